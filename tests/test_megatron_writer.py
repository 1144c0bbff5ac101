"""``--to megatron --tp N --pp M``: Megatron-LM legacy rank files written without torch
(fusectl/io/formats/megatron_writer.py), compared with the rank files megatron-core itself wrote.

fixtures/megatron/*-legacy were saved by the real megatron-core 0.16.1 (fixtures/generate_megatron.py);
reference/NAME-full.safetensors are the TP=1 parameters megatron-core gathered. Every comparison
reads both sides with fusectl's torch reader and compares bytes: a written rank's model holds the
same names in the same order, None for the same ``_extra_state`` entries, and each tensor bitwise
equal to megatron's own rank file's.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from conftest import (FIXTURES, assert_megatron_logits, megatron_forward_of, megatron_rank, ok, parse_safetensors,
                      refused)

from fusectl.dtypes import from_numpy
from fusectl.errors import PlanError
from fusectl.io.formats.megatron import RECORDS, read_megatron
from fusectl.io.formats.megatron_writer import piece, rank_models, sizes_of, write_megatron
from fusectl.io.formats.torch_file import read_torch_tree
from fusectl.tensors import ArrayTensor, TensorSpec

MEGATRON = FIXTURES / "megatron"
CONFIG = MEGATRON / "hf-config" / "llama" / "config.json"


def rank_files(folder) -> dict[str, dict]:
    """rank folder name → its model_optim_rng.pt tree, for the one iteration folder of a save."""
    latest = (folder / "latest_checkpointed_iteration.txt").read_text().strip()
    iteration = folder / ("release" if latest == "release" else f"iter_{int(latest):07d}")
    return {name: read_torch_tree(str(iteration / name / "model_optim_rng.pt"), records=RECORDS)[0]
            for name in sorted(os.listdir(iteration))}


def assert_same_ranks(written, original) -> None:
    """Same rank folders, each model with the same names in order and bitwise equal tensors."""
    mine, theirs = rank_files(written), rank_files(original)
    assert list(mine) == list(theirs)
    for rank, tree in theirs.items():
        model = mine[rank]["model"]
        assert list(model) == list(tree["model"]), rank
        for name, value in tree["model"].items():
            if value is None:
                assert model[name] is None, (rank, name)
            else:
                assert model[name].spec == value.spec, (rank, name)
                assert model[name].read().tobytes() == value.read().tobytes(), (rank, name)


@pytest.mark.parametrize("variant, tp, pp", [("gpt-tp2-legacy", 2, 1), ("gpt-tp2-pp2-legacy", 2, 2),
                                             ("tied-tp2-legacy", 2, 1)])
def test_megatron_checkpoint_rewritten_at_its_parallelism_equals_megatrons_rank_files(cli, tmp_path, variant, tp, pp):
    out = tmp_path / "out"
    ok(cli("convert", MEGATRON / variant, "--to", "megatron", "--tp", str(tp), "--pp", str(pp), "--drop-optimizer",
           "-o", out))
    assert_same_ranks(out, MEGATRON / variant)
    tree = rank_files(out)[f"mp_rank_00{'_000' if pp > 1 else ''}"]
    assert tree["checkpoint_version"] == 3.0 and tree["iteration"] == 10
    args = tree["args"]
    assert args.name == "argparse.Namespace"
    assert (args.field("tensor_model_parallel_size"), args.field("pipeline_model_parallel_size")) == (tp, pp)
    assert (args.field("num_attention_heads"), args.field("num_query_groups"), args.field("kv_channels")) == (4, 2, 4)
    assert args.field("untie_embeddings_and_output_weights") is ("tied" not in variant)
    assert "optimizer" not in tree  # no optimizer state is written (dropped on purpose)


def test_tp_and_pp_round_trips_are_bitwise(cli, tmp_path):
    """TP=2 → TP=1 → TP=2 and TP=2×PP=2 → TP=1×PP=1 → TP=2×PP=2 give megatron's own rank files back."""
    for variant, tp, pp in (("gpt-tp2-legacy", 2, 1), ("gpt-tp2-pp2-legacy", 2, 2)):
        one, back = tmp_path / f"{variant}-1", tmp_path / f"{variant}-back"
        ok(cli("convert", MEGATRON / variant, "--to", "megatron", "--drop-optimizer", "-o", one))
        assert list(rank_files(one)) == ["mp_rank_00"]
        ok(cli("convert", one, "--to", "megatron", "--tp", str(tp), "--pp", str(pp), "-o", back))
        assert_same_ranks(back, MEGATRON / variant)


def test_pp_changes_round_trip_bitwise(cli, tmp_path):
    """PP=2 → PP=1 (at TP=2) → PP=2."""
    flat, back = tmp_path / "pp1", tmp_path / "pp2"
    ok(cli("convert", MEGATRON / "gpt-tp2-pp2-legacy", "--to", "megatron", "--tp", "2", "--drop-optimizer",
           "-o", flat))
    assert list(rank_files(flat)) == ["mp_rank_00", "mp_rank_01"]
    ok(cli("convert", flat, "--to", "megatron", "--tp", "2", "--pp", "2", "-o", back))
    assert_same_ranks(back, MEGATRON / "gpt-tp2-pp2-legacy")


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_written_checkpoint_reads_back_as_megatrons_full_parameters(cli, tmp_path, tp, pp):
    out = tmp_path / "out"
    ok(cli("convert", MEGATRON / "reference" / "gpt-tp2-full.safetensors", "--config", CONFIG, "--to", "megatron",
           "--tp", str(tp), "--pp", str(pp), "-o", out))
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "release"
    full, _ = parse_safetensors(MEGATRON / "reference" / "gpt-tp2-full.safetensors")
    back = read_megatron(str(out))
    assert (back.distributed["tp"], back.distributed["pp"]) == (tp, pp)
    assert sorted(back.tensors) == sorted(full)
    for name, (dtype, shape, raw) in full.items():
        assert back.tensors[name].spec.dtype.safetensors == dtype and list(back.tensors[name].spec.shape) == shape
        assert back.tensors[name].read().tobytes() == raw, name


def test_hugging_face_llama_to_megatron_in_one_fuse(cli, tmp_path):
    """A Llama (megatron-gpt-to-llama of the reference) through llama-to-megatron-gpt straight to
    rank files: megatron's own TP=2 files, bitwise."""
    hf, out = tmp_path / "hf", tmp_path / "out"
    ok(cli("fuse", MEGATRON / "reference" / "gpt-tp2-full.safetensors", "-r", "megatron-gpt-to-llama", "--config",
           CONFIG, "-o", hf))
    (hf / "config.json").write_text(CONFIG.read_text())
    result = ok(cli("fuse", hf, "-r", "llama-to-megatron-gpt", "--to", "megatron", "--tp", "2", "-o", out, "--json"))
    report = json.loads(result.stdout)
    assert report["tensors"] == 15 and report["optimizer"] is None and report["steps"] > 0
    assert_same_ranks(out, MEGATRON / "gpt-tp2-legacy")


def test_unfuse_of_a_llama_fusectl_made_writes_megatron_ranks(cli, tmp_path):
    """A Llama fused from megatron's parameters, unfused from its provenance straight to TP=2 rank
    files: megatron's own, bitwise."""
    hf, out = tmp_path / "hf", tmp_path / "out"
    ok(cli("fuse", MEGATRON / "reference" / "gpt-tp2-full.safetensors", "-r", "megatron-gpt-to-llama", "--config",
           CONFIG, "-o", hf))
    ok(cli("unfuse", hf, "--config", CONFIG, "--to", "megatron", "--tp", "2", "-o", out))
    assert_same_ranks(out, MEGATRON / "gpt-tp2-legacy")



def test_torch_dist_save_to_legacy_ranks_equals_megatrons_legacy_save(cli, tmp_path):
    """The same trained model saved as torch_dist, written as legacy TP=2 ranks: megatron's own
    legacy files of it, bitwise (the head counts from --config: torch_dist's args are not read here)."""
    out = tmp_path / "out"
    ok(cli("convert", MEGATRON / "gpt-tp2-torch_dist", "--config", CONFIG, "--to", "megatron", "--tp", "2",
           "-o", out))
    assert_same_ranks(out, MEGATRON / "gpt-tp2-legacy")

def test_tied_head_is_stored_on_the_last_stage_only_at_pp_above_one(cli, tmp_path):
    out = tmp_path / "out"
    ok(cli("convert", MEGATRON / "tied-tp2-legacy", "--to", "megatron", "--tp", "2", "--pp", "2", "--drop-optimizer",
           "-o", out))
    files = rank_files(out)
    assert "output_layer.weight" not in files["mp_rank_00_000"]["model"]
    head = files["mp_rank_01_001"]["model"]["output_layer.weight"]
    embedding = files["mp_rank_01_000"]["model"]["embedding.word_embeddings.weight"]
    assert head.read().tobytes() == embedding.read().tobytes()
    back = read_megatron(str(out))  # the last stage's head, checked equal to the embedding, is no second tensor
    assert "output_layer.weight" not in back.tensors and back.distributed["tied_head_copy"] == "output_layer.weight"
    again = tmp_path / "again"  # its args say tied: back at PP=1 the head is not stored
    ok(cli("convert", out, "--to", "megatron", "--tp", "2", "-o", again))
    assert_same_ranks(again, MEGATRON / "tied-tp2-legacy")


def test_a_release_save_is_rewritten_as_a_release(cli, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    ok(cli("convert", MEGATRON / "reference" / "gpt-tp2-full.safetensors", "--config", CONFIG, "--to", "megatron",
           "-o", first))
    ok(cli("convert", first, "--to", "megatron", "--tp", "2", "-o", second))
    assert (second / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert rank_files(second)["mp_rank_00"]["iteration"] == 0


# ------------------------------------------------------------------------------- refusals


def test_tp_that_does_not_divide_the_heads_is_refused(cli, tmp_path):
    out = tmp_path / "out"
    refused(cli("convert", MEGATRON / "gpt-tp2-legacy", "--to", "megatron", "--tp", "3", "--drop-optimizer",
                "-o", out), "4 attention heads", "--tp 3", unwritten=[out])
    refused(cli("convert", MEGATRON / "gpt-tp2-legacy", "--to", "megatron", "--tp", "4", "--drop-optimizer",
                "-o", out), "2 query groups", "--tp 4", unwritten=[out])
    refused(cli("convert", MEGATRON / "gpt-tp2-legacy", "--to", "megatron", "--pp", "3", "--drop-optimizer",
                "-o", out), "2 layers", "--pp 3", unwritten=[out])


def test_file_output_shard_size_and_tp_without_to_are_refused(cli, tmp_path):
    src = MEGATRON / "gpt-tp2-legacy"
    file = tmp_path / "model.safetensors"
    refused(cli("convert", src, "--to", "megatron", "--drop-optimizer", "-o", file), "writes a folder",
            unwritten=[file])
    out = tmp_path / "out"
    refused(cli("convert", src, "--tp", "2", "--drop-optimizer", "-o", out), "--tp", "--to megatron",
            unwritten=[out])
    refused(cli("fuse", src, "-r", "megatron-gpt-to-llama", "--pp", "2", "--drop-optimizer", "-o", out), "--pp",
            unwritten=[out])
    refused(cli("convert", src, "--to", "megatron", "--drop-optimizer", "--max-shard-size", "1MB", "-o", out),
            "--max-shard-size", unwritten=[out])
    assert cli("convert", src, "--to", "megatron", "--tp", "0", "-o", out).exit_code == 2


def test_an_optimizer_is_never_dropped_silently(cli, tmp_path):
    """An optimizer the reader cannot map (the distributed optimizer's distrib_optim.pt) is refused
    naming it unless dropped on purpose (test_megatron_optimizer.py: the optimizer written)."""
    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(MEGATRON / "gpt-tp2-legacy", src)
    (src / "iter_0000010" / "mp_rank_00" / "distrib_optim.pt").write_bytes(b"")
    refused(cli("convert", src, "--to", "megatron", "--tp", "2", "-o", out),
            "distrib_optim.pt", "--drop-optimizer", unwritten=[out])
    result = ok(cli("convert", src, "--to", "megatron", "--drop-optimizer", "-o", out, "--json"))
    assert json.loads(result.stdout)["optimizer"]["state"] == "dropped"


def test_a_model_without_head_counts_or_not_megatrons_is_refused(cli, tmp_path):
    out = tmp_path / "out"
    refused(cli("convert", MEGATRON / "reference" / "gpt-tp2-full.safetensors", "--to", "megatron", "-o", out),
            "attention heads", "--config", unwritten=[out])
    refused(cli("convert", FIXTURES / "tiny-llama-gqa", "--to", "megatron", "-o", out),
            "megatron-core's GPT", "llama-to-megatron-gpt", unwritten=[out])
    config = json.loads(CONFIG.read_text())
    config["num_key_value_heads"] = 4
    wrong = tmp_path / "config.json"
    wrong.write_text(json.dumps(config))
    refused(cli("convert", MEGATRON / "reference" / "gpt-tp2-full.safetensors", "--config", wrong, "--to", "megatron",
                "-o", out), "4 query groups", "linear_qkv", unwritten=[out])
    config["num_key_value_heads"] = "two"
    wrong.write_text(json.dumps(config))
    refused(cli("convert", MEGATRON / "reference" / "gpt-tp2-full.safetensors", "--config", wrong, "--to", "megatron",
                "-o", out), "num_key_value_heads", unwritten=[out])


# ------------------------------------------------------------------------------- the pieces


def tensor(array: np.ndarray) -> ArrayTensor:
    return ArrayTensor(TensorSpec(from_numpy(array.dtype, "test"), array.shape), array)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_pieces_of_computed_tensors_follow_megatrons_rules(tp):
    """Pieces of a tensor without file ranges (a planned step's output) are cut when read, as the
    fixture script states megatron's layout: column rows, [gate_r; up_r], row columns, whole."""
    whole = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    gate, up = np.split(whole, 2)
    expected = {"column": np.split(whole, tp), "row": np.split(whole, tp, axis=1), "replicated": [whole] * tp,
                "column-swiglu": [np.concatenate(p) for p in zip(np.split(gate, tp), np.split(up, tp))]}
    for kind, pieces in expected.items():
        for r in range(tp):
            got = piece(kind, tensor(whole), r, tp)
            assert got.spec.shape == pieces[r].shape
            assert np.array_equal(got.read(), pieces[r]), (kind, r)


def test_sizes_from_megatron_args_and_hugging_face_config():
    model = read_megatron(str(MEGATRON / "gpt-tp2-legacy")).tensors
    hf = sizes_of(model, json.loads(CONFIG.read_text()), False, "m")
    megatron = sizes_of(model, {"num_attention_heads": 4, "num_query_groups": 2, "kv_channels": 4}, False, "m")
    assert hf == megatron
    assert (hf.heads, hf.groups, hf.head_dim, hf.ffn, hf.num_layers, hf.swiglu) == (4, 2, 4, 32, 2, True)
    with pytest.raises(PlanError, match="4 query groups"):  # megatron's args without GQA: groups = heads
        sizes_of(model, {"num_attention_heads": 4, "group_query_attention": False, "num_query_groups": 2,
                         "kv_channels": 4}, False, "m")
    with pytest.raises(PlanError, match="decoder.layers.0"):
        sizes_of({k: v for k, v in model.items() if not k.startswith("decoder.layers.0.")}, {}, False, "m")
    with pytest.raises(PlanError, match=r"holds layers \[\]"):
        sizes_of({"embedding.word_embeddings.weight": model["embedding.word_embeddings.weight"]},
                 {"num_attention_heads": 4}, False, "m")


def test_rank_models_hold_extra_state_beside_each_linear_module():
    model = read_megatron(str(MEGATRON / "gpt-tp2-legacy")).tensors
    sizes = sizes_of(model, json.loads(CONFIG.read_text()), False, "m")
    ranks = rank_models(model, sizes, 1, 2)
    assert [rank.folder for rank in ranks] == ["mp_rank_00_000", "mp_rank_00_001"]
    first, last = ranks.values()
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "output_layer._extra_state" in last and last["output_layer._extra_state"] is None
    assert [n for n in last if n.startswith("decoder.layers.")] == \
        [n.replace("layers.1.", "layers.0.") for n in first if n.startswith("decoder.layers.")]


def test_write_megatron_refuses_before_writing(tmp_path):
    model = read_megatron(str(MEGATRON / "gpt-tp2-legacy")).tensors
    with pytest.raises(PlanError, match="positive integer"):
        write_megatron(str(tmp_path / "x"), model, tp=0, pp=1, config=json.loads(CONFIG.read_text()), tied=False)
    assert not (tmp_path / "x").exists()



def test_pieces_of_stored_rows_read_from_their_file_ranges():
    model = read_megatron(str(MEGATRON / "gpt-tp2-legacy")).tensors
    qkv = model["decoder.layers.0.self_attention.linear_qkv.weight"]
    part = piece("column", qkv, 1, 2)
    assert part.byte_ranges() is not None
    assert np.array_equal(part.read(), qkv.read()[16:])


def test_a_model_missing_a_layer_tensor_is_refused_naming_it():
    model = dict(read_megatron(str(MEGATRON / "gpt-tp2-legacy")).tensors)
    del model["decoder.layers.0.mlp.linear_fc2.weight"]
    with pytest.raises(PlanError, match="linear_fc2.weight"):
        sizes_of(model, json.loads(CONFIG.read_text()), False, "m")


def test_saved_args_of_a_folder_without_ranks_is_refused(tmp_path):
    from fusectl.errors import CheckpointError
    from fusectl.io.formats.megatron import saved_args
    assert saved_args(str(MEGATRON / "gpt-tp2-legacy"))["num_query_groups"] == 2
    with pytest.raises(CheckpointError, match="mp_rank"):
        saved_args(str(tmp_path))

# ------------------------------------------------------------------------------- megatron-core itself

MEGATRON_CORE_VARIANTS = {"gpt-tp2": "llama", "gpt-tp2-pp2": "llama", "tied-tp2": "tied"}


def load_and_forward(rank: int, world: int, name: str, folder: str, port: int) -> None:
    """One rank: megatron-core's GPTModel at the variant's parallelism, ``load_state_dict(strict=True)``
    of the rank file fusectl wrote (read by ``torch.load(weights_only=True)``), its logits saved."""
    g = megatron_rank(rank, world, port)
    from megatron.core import parallel_state

    spec = g.VARIANTS[name]
    parallel_state.initialize_model_parallel(spec["tp"], spec["pp"])
    model = g.build_model(spec, spec["tp"], spec["pp"], 1)
    tp_rank, pp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    rank_name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if spec["pp"] > 1 else "")
    megatron_forward_of(g, model, os.path.join(folder, "release", rank_name, "model_optim_rng.pt"), folder,
                        tp_rank == 0)


@pytest.mark.parametrize("variant", sorted(MEGATRON_CORE_VARIANTS))
def test_megatron_core_loads_the_written_ranks_and_computes_its_own_logits(cli, tmp_path, variant):
    """megatron's full parameters written at the variant's TP × PP with fusectl: megatron-core loads
    every rank strictly and its forward gives the logits it computed before saving (within 1e-5)."""
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")

    spec = {"gpt-tp2": (2, 1), "gpt-tp2-pp2": (2, 2), "tied-tp2": (2, 1)}[variant]
    out = tmp_path / "out"
    config = MEGATRON / "hf-config" / MEGATRON_CORE_VARIANTS[variant] / "config.json"
    ok(cli("convert", MEGATRON / "reference" / f"{variant}-full.safetensors", "--config", config, "--to", "megatron",
           "--tp", str(spec[0]), "--pp", str(spec[1]), "-o", out))
    assert_megatron_logits(__file__, variant, out, spec[0] * spec[1])


if __name__ == "__main__":  # the ranks of the test above, spawned by torch.multiprocessing
    import sys

    import torch.multiprocessing as mp

    port = 29600 + os.getpid() % 1000
    mp.spawn(load_and_forward, args=(int(sys.argv[3]), sys.argv[1], sys.argv[2], port), nprocs=int(sys.argv[3]))
