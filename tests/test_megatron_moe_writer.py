"""``--to megatron --ep E``: MoE models written as Megatron-LM legacy rank files at TP × PP × EP
(fusectl/io/formats/megatron_writer.py), compared with the rank files megatron-core itself wrote.

fixtures/megatron/moe-ep2-legacy (EP=2: ``mp_rank_00_000``, ``mp_rank_00_001``, each EP rank's two
experts numbered from 0) and moe-tp2-legacy (TP=2: every expert on both ranks, split like the dense
linears) were saved by the real megatron-core 0.16.1 after three Adam steps
(fixtures/generate_megatron.py). Both sides are read with fusectl's torch reader and compared by
bytes. With megatron-core (/work/venvs/megatron; skipped where absent) fusectl's EP=1 reshard of
moe-ep2-legacy loads strictly and reproduces the logits megatron computed before saving. A
Hugging Face Mixtral fusectl did not write goes to Megatron's ranks with the preset
mixtral-to-megatron-moe.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from conftest import FIXTURES, assert_megatron_logits, megatron_forward_of, megatron_rank, ok, refused, with_provenance

from fusectl.errors import PlanError
from fusectl.io.formats import megatron_writer
from fusectl.io.formats.megatron import read_megatron
from fusectl.io.formats.megatron_writer import rank_models, sizes_of

from test_megatron_optimizer import assert_same, assert_same_training, rank_files
from test_megatron_writer import assert_same_ranks

MEGATRON = FIXTURES / "megatron"
OWN = {"moe-ep2-legacy": ("--ep", "2"), "moe-tp2-legacy": ("--tp", "2")}


@pytest.mark.parametrize("variant", sorted(OWN))
def test_moe_checkpoint_rewritten_at_its_parallelism_equals_megatrons_rank_files(cli, tmp_path, variant):
    """model, optimizer (three param groups at EP=2: decayed, expert-parallel, not decayed) and
    scheduler of every rank: as megatron saved them."""
    out = tmp_path / "out"
    result = ok(cli("convert", MEGATRON / variant, "--to", "megatron", *OWN[variant], "-o", out, "--json"))
    assert json.loads(result.stdout)["optimizer"]["state"] == "copied"
    assert_same_training(out, MEGATRON / variant)
    args = rank_files(out)[sorted(rank_files(out))[-1]]["args"]
    ep = 2 if variant == "moe-ep2-legacy" else 1
    assert (args.field("expert_model_parallel_size"), args.field("num_experts"), args.field("moe_router_topk"),
            args.field("moe_ffn_hidden_size"), args.field("world_size")) == (ep, 4, 2, 32, 2)


def test_ep2_to_ep1_to_ep2_is_bitwise_with_the_optimizer(cli, tmp_path):
    """At EP=1 megatron-core has no expert-parallel group: the experts join the decayed group in
    the model's order (as in moe-tp2-legacy's files); back at EP=2 the group is formed again."""
    one, back = tmp_path / "one", tmp_path / "back"
    ok(cli("convert", MEGATRON / "moe-ep2-legacy", "--to", "megatron", "-o", one))
    tree = rank_files(one)["mp_rank_00"]
    groups = tree["optimizer"]["param_groups"]
    assert [(g["is_expert_parallel"], g["wd_mult"], len(g["params"])) for g in groups] == [(False, 1.0, 24),
                                                                                           (False, 0.0, 5)]
    assert tree["args"].field("expert_model_parallel_size") == 1 and tree["args"].field("num_experts") == 4
    # the layout of megatron's own EP=1 files of an MoE (moe-tp2-legacy, another model, at TP=2)
    theirs = rank_files(MEGATRON / "moe-tp2-legacy")["mp_rank_00"]
    assert list(tree["model"]) == list(theirs["model"])
    assert [len(g["params"]) for g in theirs["optimizer"]["param_groups"]] == [24, 5]
    ok(cli("convert", one, "--to", "megatron", "--ep", "2", "-o", back))
    assert_same_training(back, MEGATRON / "moe-ep2-legacy")


def test_tp2_to_ep2_and_back_is_bitwise(cli, tmp_path):
    """moe-tp2 → TP=1 × EP=2 → TP=2: megatron's own TP=2 files, optimizer included."""
    ep2, back = tmp_path / "ep2", tmp_path / "back"
    ok(cli("convert", MEGATRON / "moe-tp2-legacy", "--to", "megatron", "--ep", "2", "-o", ep2))
    assert list(rank_files(ep2)) == ["mp_rank_00_000", "mp_rank_00_001"]
    ok(cli("convert", ep2, "--to", "megatron", "--tp", "2", "-o", back))
    assert_same_training(back, MEGATRON / "moe-tp2-legacy")


@pytest.mark.parametrize("variant, tp, pp, ep", [("moe-tp2-legacy", 2, 1, 2), ("moe-tp2-legacy", 1, 1, 4),
                                                 ("moe-ep2-legacy", 2, 2, 2), ("moe-ep2-legacy", 1, 2, 1)])
def test_tp_pp_ep_changes_read_back_equal_to_the_input(cli, tmp_path, variant, tp, pp, ep):
    """Every tensor and every moment of the written save, read back, equals the input's read."""
    out = tmp_path / "out"
    ok(cli("convert", MEGATRON / variant, "--to", "megatron", "--tp", str(tp), "--pp", str(pp), "--ep", str(ep),
           "-o", out))
    folders = sorted(rank_files(out))
    assert len(folders) == tp * pp * ep
    assert folders[-1] == f"mp_rank_{tp - 1:02d}" + (f"_{pp - 1:03d}" if pp > 1 else "") + \
        (f"_{ep - 1:03d}" if ep > 1 else "")
    source, back = read_megatron(str(MEGATRON / variant)), read_megatron(str(out))
    assert (back.distributed["tp"], back.distributed["pp"], back.distributed["ep"]) == (tp, pp, ep)
    assert list(back.tensors) == list(source.tensors)
    for name, tensor in source.tensors.items():
        assert back.tensors[name].spec == tensor.spec
        assert back.tensors[name].read().tobytes() == tensor.read().tobytes(), name
    theirs, mine = (c.training.tree()["optimizer"] for c in (source, back))
    # by name: the groups differ where EP does (the expert-parallel group only at EP > 1)
    by_name = [dict(sorted((n, s["state"][i]) for g in s["param_groups"]
                           for i, n in zip(g["params"], g["param_names"]))) for s in (theirs, mine)]
    assert_same(by_name[1], by_name[0], "state")


def test_each_ep_rank_holds_its_experts_numbered_from_zero(cli, tmp_path):
    out = tmp_path / "out"
    ok(cli("convert", MEGATRON / "moe-tp2-legacy", "--to", "megatron", "--tp", "2", "--ep", "2", "--drop-optimizer",
           "-o", out))
    files = rank_files(out)
    assert list(files) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    whole = read_megatron(str(MEGATRON / "moe-tp2-legacy")).tensors
    theirs = rank_files(MEGATRON / "moe-tp2-legacy")
    for e in range(2):
        for t in range(2):
            model = files[f"mp_rank_{t:02d}_{e:03d}"]["model"]
            experts = sorted({n.split("local_experts.")[1].split(".")[0] for n in model if "local_experts." in n})
            assert experts == ["0", "1"]
            fc2 = model["decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"]
            # TP rank t's piece of global expert 2e + 1: megatron's own TP=2 file holds it
            assert fc2.read().tobytes() == \
                theirs[f"mp_rank_{t:02d}"]["model"][f"decoder.layers.1.mlp.experts.local_experts.{2 * e + 1}"
                                                     ".linear_fc2.weight"].read().tobytes()
            dense = model["decoder.layers.0.self_attention.linear_qkv.weight"]
            assert dense.read().tobytes() == files[f"mp_rank_{t:02d}_000"]["model"][
                "decoder.layers.0.self_attention.linear_qkv.weight"].read().tobytes()
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight" in whole


# ------------------------------------------------------------------------------- Hugging Face Mixtral


@pytest.mark.parametrize("variant, flags", [("moe-ep2", ("--ep", "2")), ("moe-tp2", ("--tp", "2"))])
def test_mixtral_without_provenance_goes_to_megatrons_own_rank_files(cli, tmp_path, variant, flags):
    """megatron's gathered parameters as a Mixtral (megatron-moe-to-mixtral, its provenance then
    removed: a Hub checkpoint), through mixtral-to-megatron-moe straight to rank files at the
    variant's parallelism: megatron's own files' models, bitwise; args from the Mixtral config."""
    config = MEGATRON / "hf-config" / "mixtral" / "config.json"
    fused, hub = tmp_path / "fused", tmp_path / "hub"
    ok(cli("fuse", MEGATRON / "reference" / f"{variant}-full.safetensors", "-r", "megatron-moe-to-mixtral",
           "--config", config, "-o", fused))
    hub.mkdir()
    with_provenance(fused / "model.safetensors", hub / "model.safetensors")
    (hub / "config.json").write_text(config.read_text())
    out = tmp_path / "out"
    ok(cli("fuse", hub, "-r", "mixtral-to-megatron-moe", "--to", "megatron", *flags, "-o", out))
    assert_same_ranks(out, MEGATRON / f"{variant}-legacy")
    args = rank_files(out)[sorted(rank_files(out))[0]]["args"]
    assert (args.field("num_experts"), args.field("moe_router_topk"), args.field("num_query_groups")) == (4, 2, 2)


def test_transformers5_in_memory_layout_is_refused_by_name(cli, tmp_path):
    """transformers 5's in-memory layout (mlp.gate, experts fused as gate_up_proj) is not the file
    layout the preset maps: the plan stops, naming a tensor it found, before anything is written."""
    out = tmp_path / "out"
    refused(cli("fuse", FIXTURES / "moe-hf5" / "tiny-mixtral.hf5-memory.safetensors", "-r", "mixtral-to-megatron-moe",
                "--config", FIXTURES / "moe-hf5" / "tiny-mixtral" / "config.json", "--to", "megatron", "-o", out),
            "rule 'router'", "'model.layers.1.mlp.gate.weight'", unwritten=[out])


# ------------------------------------------------------------------------------- refusals


def test_experts_that_do_not_divide_and_ep_on_a_dense_model_are_refused(cli, tmp_path):
    out = tmp_path / "out"
    refused(cli("convert", MEGATRON / "moe-ep2-legacy", "--to", "megatron", "--ep", "3", "-o", out),
            "4 experts", "--ep 3", unwritten=[out])
    refused(cli("convert", MEGATRON / "gpt-tp2-legacy", "--to", "megatron", "--ep", "2", "-o", out),
            "no MoE experts", "--ep", unwritten=[out])
    refused(cli("convert", MEGATRON / "moe-ep2-legacy", "--ep", "2", "-o", out), "--ep", "--to megatron",
            unwritten=[out])
    assert cli("convert", MEGATRON / "moe-ep2-legacy", "--to", "megatron", "--ep", "0", "-o", out).exit_code == 2
    assert not out.exists()


def test_layers_that_hold_other_experts_are_refused_naming_the_layer():
    model = dict(read_megatron(str(MEGATRON / "moe-ep2-legacy")).tensors)
    config = {"num_attention_heads": 4, "num_query_groups": 2, "kv_channels": 4}
    assert sizes_of(model, config, False, "m").experts == 4
    for suffix in ("linear_fc1.weight", "linear_fc2.weight"):
        del model[f"decoder.layers.1.mlp.experts.local_experts.3.{suffix}"]
    with pytest.raises(PlanError, match=r"layer 1 holds experts \[0, 1, 2\]"):
        sizes_of(model, config, False, "m")


def test_the_ledger_proves_every_expert_is_written(monkeypatch):
    """A writer that forgot an expert on its EP rank would drop it: the ledger names it."""
    model = read_megatron(str(MEGATRON / "moe-ep2-legacy")).tensors
    sizes = sizes_of(model, {"num_attention_heads": 4, "num_query_groups": 2, "kv_channels": 4}, False, "m")
    assert len(rank_models(model, sizes, 2, 2, 2)) == 8
    placed = megatron_writer.local_name

    def forgetful(name, rank, sizes):
        return None if "layers.1.mlp.experts.local_experts.3.linear_fc2" in name else placed(name, rank, sizes)

    monkeypatch.setattr(megatron_writer, "local_name", forgetful)
    with pytest.raises(PlanError, match=r"local_experts\.3\.linear_fc2\.weight'.*never read"):
        rank_models(model, sizes, 1, 1, 2)


# ------------------------------------------------------------------------------- megatron-core itself


def load_and_forward(rank: int, world: int, variant: str, folder: str, port: int) -> None:
    """One rank: megatron-core's GPTModel of ``variant`` at TP=1 × EP=``world``,
    ``load_state_dict(strict=True)`` of the rank file fusectl wrote, its logits saved."""
    from megatron.core import parallel_state

    g = megatron_rank(rank, world, port)
    spec, ep = g.VARIANTS[variant], world
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    model = g.build_model(spec, 1, 1, ep)
    name = "mp_rank_00" + (f"_{parallel_state.get_expert_model_parallel_rank():03d}" if ep > 1 else "")
    latest = open(os.path.join(folder, "latest_checkpointed_iteration.txt")).read().strip()
    megatron_forward_of(g, model, os.path.join(folder, f"iter_{int(latest):07d}", name, "model_optim_rng.pt"),
                        folder, rank == 0)


@pytest.mark.parametrize("variant, ep", [("moe-ep2", 1), ("moe-tp2", 2)])
def test_megatron_core_loads_the_reshard_and_computes_its_own_logits(cli, tmp_path, variant, ep):
    """moe-ep2-legacy written at EP=1 (one process), moe-tp2-legacy at TP=1 × EP=2 (two): megatron-core
    loads every rank strictly and its forward gives the logits megatron computed before saving (1e-5)."""
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")

    out = tmp_path / "out"
    ok(cli("convert", MEGATRON / f"{variant}-legacy", "--to", "megatron", "--ep", str(ep), "--drop-optimizer",
           "-o", out))
    assert_megatron_logits(__file__, variant, out, ep)


if __name__ == "__main__":  # the ranks of the test above, spawned by torch.multiprocessing
    import torch.multiprocessing as mp

    port = 29700 + os.getpid() % 1000
    mp.spawn(load_and_forward, args=(int(sys.argv[3]), sys.argv[1], sys.argv[2], port), nprocs=int(sys.argv[3]))
