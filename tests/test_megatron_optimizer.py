"""``--to megatron`` with a training checkpoint: each rank's legacy (non-distributed) optimizer
state split like its parameters (fusectl/io/formats/megatron_writer.py ``whole_optimizer``,
``rank_optimizer``), the scheduler kept, fusectl's provenance and the input's config.json carried.

fixtures/megatron/*-legacy were saved by the real megatron-core 0.16.1 after three Adam steps
(fixtures/generate_megatron.py): each rank's ``optimizer`` is torch's ``Adam.state_dict()`` over
megatron-core's param groups. Every comparison reads both sides with fusectl's torch reader and
compares values and bytes. With megatron-core (/work/venvs/megatron; skipped where absent) the
resume proof: the same three further training steps from megatron's own rank files and from
fusectl's reshard of them give the same losses, in one subprocess.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from conftest import FIXTURES, ok, parse_safetensors, refused

from fusectl.dtypes import from_numpy
from fusectl.errors import PlanError
from fusectl.io.formats.megatron import RECORDS, read_megatron
from fusectl.io.formats.megatron_writer import whole_optimizer
from fusectl.io.formats.torch_file import read_torch_tree
from fusectl.io.formats.torch_writer import write_torch_file
from fusectl.tensors import ArrayTensor, LazyTensor, TensorSpec

MEGATRON = FIXTURES / "megatron"
CONFIG = MEGATRON / "hf-config" / "llama" / "config.json"
PARALLEL = {"gpt-tp2-legacy": (2, 1), "gpt-tp2-pp2-legacy": (2, 2), "tied-tp2-legacy": (2, 1),
            "tied-tp2-pp2-legacy": (2, 2)}


def rank_files(folder) -> dict[str, dict]:
    """rank folder name → its model_optim_rng.pt tree, for the one iteration folder of a save."""
    latest = (folder / "latest_checkpointed_iteration.txt").read_text().strip()
    iteration = folder / ("release" if latest == "release" else f"iter_{int(latest):07d}")
    return {name: read_torch_tree(str(iteration / name / "model_optim_rng.pt"), records=RECORDS)[0]
            for name in sorted(os.listdir(iteration))}


def assert_same(mine, theirs, where: str) -> None:
    """Equal trees: the same keys in the same order, values of the same type, tensors bitwise."""
    if isinstance(theirs, LazyTensor):
        assert isinstance(mine, LazyTensor), where
        assert mine.spec == theirs.spec and mine.read().tobytes() == theirs.read().tobytes(), where
    elif isinstance(theirs, dict):
        assert isinstance(mine, dict) and list(mine) == list(theirs), (where, list(mine), list(theirs))
        for key in theirs:
            assert_same(mine[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, (list, tuple)):
        assert type(mine) is type(theirs) and len(mine) == len(theirs), where
        for i, (a, b) in enumerate(zip(mine, theirs)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert type(mine) is type(theirs) and mine == theirs, (where, mine, theirs)


def assert_same_training(written, original, keys=("model", "optimizer", "opt_param_scheduler")) -> None:
    """Every rank of ``written`` holds ``keys`` equal to megatron's own rank file's."""
    mine, theirs = rank_files(written), rank_files(original)
    assert list(mine) == list(theirs)
    for rank, tree in theirs.items():
        for key in keys:
            assert_same(mine[rank][key], tree[key], f"{rank}.{key}")


@pytest.mark.parametrize("variant", sorted(PARALLEL))
def test_each_ranks_optimizer_written_at_its_own_parallelism_equals_megatrons(cli, tmp_path, variant):
    """state (step, exp_avg, exp_avg_sq per id), ids, param_groups and the scheduler: as megatron saved them."""
    tp, pp = PARALLEL[variant]
    out = tmp_path / "out"
    result = ok(cli("convert", MEGATRON / variant, "--to", "megatron", "--tp", str(tp), "--pp", str(pp), "-o", out,
                    "--json"))
    assert json.loads(result.stdout)["optimizer"]["state"] == "copied"
    assert_same_training(out, MEGATRON / variant)
    assert "no rng_state" in result.stderr and "`pretrain_gpt.py --no-load-rng`" in result.stderr
    tree = rank_files(out)[f"mp_rank_01{'_001' if pp > 1 else ''}"]
    assert list(tree) == ["args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler"]


@pytest.mark.parametrize("variant", sorted(PARALLEL))
def test_tp_and_pp_round_trips_through_one_rank_are_bitwise_with_the_optimizer(cli, tmp_path, variant):
    """TP=2 (×PP=2) → TP=1 PP=1 → back: megatron's own rank files, optimizer and scheduler included;
    the TP=1 rank's optimizer is the reader's whole one (ids in megatron-core's group order)."""
    tp, pp = PARALLEL[variant]
    one, back = tmp_path / "one", tmp_path / "back"
    ok(cli("convert", MEGATRON / variant, "--to", "megatron", "-o", one))
    ranks = rank_files(one)
    assert list(ranks) == ["mp_rank_00"]
    whole = read_megatron(str(MEGATRON / variant)).training.tree()["optimizer"]
    written = ranks["mp_rank_00"]["optimizer"]
    assert [g["params"] for g in written["param_groups"]] == [g["params"] for g in whole["param_groups"]]
    assert_same(written["state"], whole["state"], "state")
    ok(cli("convert", one, "--to", "megatron", "--tp", str(tp), "--pp", str(pp), "-o", back))
    assert_same_training(back, MEGATRON / variant)


def test_pp_only_round_trip_is_bitwise_with_the_optimizer(cli, tmp_path):
    """TP=2 × PP=2 → TP=2 × PP=1 → TP=2 × PP=2."""
    flat, back = tmp_path / "flat", tmp_path / "back"
    ok(cli("convert", MEGATRON / "gpt-tp2-pp2-legacy", "--to", "megatron", "--tp", "2", "-o", flat))
    assert list(rank_files(flat)) == ["mp_rank_00", "mp_rank_01"]
    ok(cli("convert", flat, "--to", "megatron", "--tp", "2", "--pp", "2", "-o", back))
    assert_same_training(back, MEGATRON / "gpt-tp2-pp2-legacy")


def test_tied_head_copy_on_the_last_stage_takes_the_embeddings_state(cli, tmp_path):
    """tied TP=2 → TP=2 × PP=2 (the last stage's head copy gets the embedding's moments, as
    megatron-core trains it with the embedding's gradient) → TP=2: megatron's own rank files; a
    copy whose state differs from the embedding's is refused, never one of them dropped."""
    staged, back = tmp_path / "staged", tmp_path / "back"
    ok(cli("convert", MEGATRON / "tied-tp2-legacy", "--to", "megatron", "--tp", "2", "--pp", "2", "-o", staged))
    ranks = rank_files(staged)
    first, last = ranks["mp_rank_01_000"]["optimizer"], ranks["mp_rank_01_001"]["optimizer"]
    head = last["param_groups"][0]["params"][-1]  # the last decayed parameter of the last stage
    assert list(ranks["mp_rank_01_001"]["model"])[-2] == "output_layer.weight"
    assert_same(last["state"][head], first["state"][0], "head copy")  # its state is the embedding's
    ok(cli("convert", staged, "--to", "megatron", "--tp", "2", "-o", back))
    assert_same_training(back, MEGATRON / "tied-tp2-legacy")
    spec = TensorSpec(from_numpy(np.dtype("float32"), "w"), (2,))
    zero, one = (ArrayTensor(spec, np.full(2, v, np.float32)) for v in (0, 1))
    optimizer = {"state": {0: {"exp_avg": zero}, 1: {"exp_avg": one}},
                 "param_groups": [{"params": [0, 1], "param_names": ["e", "h"]}]}
    with pytest.raises(PlanError, match="a copy of 'e'"):
        whole_optimizer(optimizer, {"e": zero}, None, "in", copies={"h": "e"})
    optimizer["state"][1] = {"exp_avg": ArrayTensor(spec, np.zeros(2, np.float32))}
    assert whole_optimizer(optimizer, {"e": zero}, None, "in", copies={"h": "e"}).group_of == {"e": 0}


def test_fused_to_llama_and_back_to_megatron_moves_the_optimizer_bitwise_and_unfuses(cli, tmp_path):
    """megatron → Hugging Face Llama names (a training .pt, its optimizer moved) → --to megatron at TP=2:
    megatron's own model and optimizer; the provenance travels in the rank files, so unfuse
    undoes both fuses; the config.json given is copied beside the save."""
    llama, back, undone = tmp_path / "llama.pt", tmp_path / "back", tmp_path / "undone.pt"
    ok(cli("fuse", MEGATRON / "gpt-tp2-legacy", "-r", "megatron-gpt-to-llama", "--config", CONFIG, "-o", llama))
    result = ok(cli("fuse", llama, "-r", "llama-to-megatron-gpt", "--config", CONFIG, "--to", "megatron", "--tp", "2",
                    "-o", back, "--json"))
    assert json.loads(result.stdout)["optimizer"]["state"] == "moved"
    assert_same_training(back, MEGATRON / "gpt-tp2-legacy", keys=("model", "optimizer"))
    assert (back / "config.json").read_bytes() == CONFIG.read_bytes()
    # no scheduler and no iteration in the .pt: each said, none invented
    assert "no opt_param_scheduler" in result.stderr and "release save" in result.stderr
    assert "opt_param_scheduler" not in rank_files(back)["mp_rank_00"]
    record = read_torch_tree(str(back / "release" / "mp_rank_01" / "model_optim_rng.pt"), records=RECORDS)[1]
    assert "fusectl.param_names" not in record  # the whole optimizer's ids are not a rank's
    ok(cli("unfuse", back, "-o", undone))
    tree = read_torch_tree(str(undone))[0]
    original = read_megatron(str(MEGATRON / "gpt-tp2-legacy")).training.tree()
    assert_same(tree["model"], original["model"], "model")
    assert_same(tree["optimizer"]["state"], original["optimizer"]["state"], "optimizer.state")


def test_a_model_alone_carries_its_provenance_and_config(cli, tmp_path):
    """Hugging Face Llama (a folder with its config.json) fused to megatron --to megatron: the
    provenance in the rank files and the config.json beside; unfuse undoes the recorded fuses
    bitwise."""
    llama, meg, back = tmp_path / "llama", tmp_path / "meg", tmp_path / "back.safetensors"
    ok(cli("fuse", MEGATRON / "reference" / "gpt-tp2-full.safetensors", "-r", "megatron-gpt-to-llama", "--config",
           CONFIG, "-o", llama))
    (llama / "config.json").write_bytes(CONFIG.read_bytes())  # a Hugging Face folder has its config beside
    ok(cli("fuse", llama, "-r", "llama-to-megatron-gpt", "--to", "megatron", "--tp", "2", "--pp", "2", "-o", meg))
    assert (meg / "config.json").read_bytes() == (llama / "config.json").read_bytes()
    ok(cli("unfuse", meg, "-o", back))  # both recorded fuses undone: megatron's gathered tensors
    mine, _ = parse_safetensors(back)
    theirs, _ = parse_safetensors(MEGATRON / "reference" / "gpt-tp2-full.safetensors")
    assert sorted(mine) == sorted(theirs)
    for name, value in theirs.items():
        assert mine[name] == value, name  # dtype, shape, bytes


def test_drop_optimizer_writes_the_model_alone(cli, tmp_path):
    out = tmp_path / "out"
    result = ok(cli("convert", MEGATRON / "gpt-tp2-legacy", "--to", "megatron", "--drop-optimizer", "-o", out,
                    "--json"))
    assert json.loads(result.stdout)["optimizer"]["state"] == "dropped"
    assert list(rank_files(out)["mp_rank_00"]) == ["args", "checkpoint_version", "iteration", "model"]


def _edited_training(tmp_path, edit) -> str:
    """The reader's whole training tree of gpt-tp2-legacy written as a .pt, ``edit`` applied to it."""
    tree = read_megatron(str(MEGATRON / "gpt-tp2-legacy")).training.tree()
    tree = {"model": dict(tree["model"]), "optimizer": {"state": {k: dict(v) for k, v in tree["optimizer"]["state"].items()},
                                                        "param_groups": [dict(g) for g in tree["optimizer"]["param_groups"]]}}
    edit(tree["optimizer"])
    path = tmp_path / "edited.pt"
    write_torch_file(str(path), tree)
    return str(path)


@pytest.mark.parametrize("edit, says", [
    (lambda o: o["state"][3].pop("exp_avg_sq"), "lacks or adds 'exp_avg_sq'"),
    (lambda o: [g.pop("param_names") for g in o["param_groups"]], "do not name their parameters"),
    (lambda o: o["param_groups"][1]["param_names"].__setitem__(0, "decoder.layers.9.x.weight"), "does not hold"),
    (lambda o: o["param_groups"].pop(), "in none of the optimizer's param groups"),
    (lambda o: o["state"][0].__setitem__("exp_avg", o["state"][1]["exp_avg"]), "fusectl splits a moment exactly"),
    (lambda o: o["param_groups"][1]["params"].__setitem__(0, 0), "an id twice"),
])
def test_an_optimizer_fusectl_cannot_map_is_refused_naming_it(cli, tmp_path, edit, says):
    path = _edited_training(tmp_path, edit)
    out = tmp_path / "out"
    refused(cli("convert", path, "--config", CONFIG, "--to", "megatron", "--tp", "2", "-o", out), says,
            "--drop-optimizer")
    assert not out.exists()


def test_a_trainer_folders_optimizer_is_refused_unless_dropped(cli, tmp_path):
    """A Hugging Face Trainer folder's optimizer.pt is not megatron-core's param groups: refused, never dropped."""
    out = tmp_path / "out"
    refused(cli("convert", FIXTURES / "training" / "trainer" / "checkpoint-2", "--to", "megatron", "-o", out),
            "Trainer folder", "--drop-optimizer", unwritten=[out])


def test_whole_optimizer_refuses_what_is_not_torchs_state_dict():
    model = {"w": ArrayTensor(TensorSpec(from_numpy(np.dtype("float32"), "w"), (2, 2)), np.zeros((2, 2), np.float32))}
    for optimizer in (None, {"state": {}}, {"state": [], "param_groups": []}, {"state": {}, "param_groups": [{}]}):
        with pytest.raises(PlanError, match="not torch's state_dict"):
            whole_optimizer(optimizer, model, None, "in")
    groups = [{"params": [0], "lr": 1.0}]
    with pytest.raises(PlanError, match="record of them is missing"):
        whole_optimizer({"state": {}, "param_groups": groups}, model, {"fusectl.param_names": "not json"}, "in")
    with pytest.raises(PlanError, match="is not a dict"):
        whole_optimizer({"state": {0: 1}, "param_groups": groups}, model, {"fusectl.param_names": '["w"]'}, "in")
    with pytest.raises(PlanError, match="two optimizer param groups"):
        whole_optimizer({"state": {}, "param_groups": [{"params": [0], "param_names": ["w"]},
                                                        {"params": [1], "param_names": ["w"]}]}, model, None, "in")
    parsed = whole_optimizer({"state": {}, "param_groups": groups}, model, {"fusectl.param_names": '["w"]'}, "in")
    assert parsed.group_of == {"w": 0} and parsed.state_of == {"w": {}} and parsed.hyper == ({"lr": 1.0},)


# ------------------------------------------------------------------------------- megatron-core itself


def resume(rank: int, world: int, folder: str, tp: int, pp: int, name: str, port: int) -> None:
    """One rank: megatron-core's GPTModel at ``tp`` × ``pp`` with generate_megatron.py's Adam over
    ``_get_param_groups`` and its scheduler, each loaded from the rank file (``load_state_dict``,
    strict), then three more training steps on generate_megatron's fixed batches; the last
    stage's TP rank 0 saves the losses to ``name``."""
    import argparse

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.insert(0, str(FIXTURES))
    import generate_megatron as g
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g.patch_for_cpu()
    spec = dict(g.VARIANTS["gpt-tp2-pp2"], tp=tp, pp=pp)
    parallel_state.initialize_model_parallel(tp, pp)
    torch.manual_seed(g.SEED + 7)  # another init: everything must come from the file
    model = g.build_model(spec, tp, pp, 1)
    groups = _get_param_groups([model], OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=1e-3, weight_decay=0.01),
                               None)
    optimizer = torch.optim.Adam(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=0, lr_decay_steps=100,
        lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=100, wd_incr_style="constant")
    tp_rank, pp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    rank_name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
    latest = open(os.path.join(folder, "latest_checkpointed_iteration.txt")).read().strip()
    torch.serialization.add_safe_globals([argparse.Namespace])
    state = torch.load(os.path.join(folder, f"iter_{int(latest):07d}", rank_name, "model_optim_rng.pt"),
                       weights_only=False)
    model.load_state_dict(state["model"], strict=True)
    if "optimizer" in state:  # the control saved without one resumes with a fresh Adam
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["opt_param_scheduler"])
    group = parallel_state.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    losses = []
    for step in range(g.STEPS, 2 * g.STEPS):
        tokens, labels = g.fixed_batch(step)
        optimizer.zero_grad()
        logits, handoff = g.pipeline_forward(model, tokens, grad=True)
        if logits is not None:
            loss = F.cross_entropy(logits.reshape(-1, g.VOCAB).float(), labels.reshape(-1))
            loss.backward()
            losses.append(loss.item())
            if handoff is not None:
                dist.send(handoff.grad.contiguous(), ranks[0], group=group)
        else:
            grad = torch.empty_like(handoff)
            dist.recv(grad, ranks[1], group=group)
            handoff.backward(grad)
        optimizer.step()
        scheduler.step(1)
    if losses and tp_rank == 0:
        np.save(name, np.array(losses))
    dist.barrier()
    dist.destroy_process_group()


def test_megatron_core_resumes_fusectls_reshard_as_it_resumes_its_own_save(cli, tmp_path):
    """RESUME PROOF: megatron's TP=2 × PP=2 save and fusectl's reshard of it to TP=1 × PP=1 and to
    TP=2 × PP=1, each loaded into megatron-core's model, Adam and scheduler, train three more steps
    in one subprocess: the same losses (within 1e-5), and not the losses of a fresh optimizer."""
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    import subprocess

    runs = {"original": (MEGATRON / "gpt-tp2-pp2-legacy", 2, 2)}
    for tp, pp in ((1, 1), (2, 1)):
        out = tmp_path / f"tp{tp}-pp{pp}"
        ok(cli("convert", MEGATRON / "gpt-tp2-pp2-legacy", "--to", "megatron", "--tp", str(tp), "--pp", str(pp),
               "-o", out))
        runs[f"tp{tp}-pp{pp}"] = (out, tp, pp)
    fresh = tmp_path / "fresh"
    ok(cli("convert", MEGATRON / "gpt-tp2-pp2-legacy", "--to", "megatron", "--drop-optimizer", "-o", fresh))
    runs["fresh"] = (fresh, 1, 1)
    argv = [f"{name}={folder}:{tp}:{pp}" for name, (folder, tp, pp) in runs.items()]
    run = subprocess.run([sys.executable, __file__, str(tmp_path), *argv], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = {name: np.load(tmp_path / f"{name}.npy") for name in runs}
    fresh_losses = losses.pop("fresh")
    assert losses["original"].shape == (3,)
    for name, values in losses.items():
        assert np.abs(values - losses["original"]).max() <= 1e-5, (name, values, losses["original"])
    # the proof can fail: the first loss is the loaded model's alone, the later ones need the
    # moments, the step count and the scheduler's learning rate — a fresh Adam's differ
    assert abs(fresh_losses[0] - losses["original"][0]) <= 1e-5
    assert np.abs(fresh_losses[1:] - losses["original"][1:]).max() > 1e-4, (fresh_losses, losses["original"])


if __name__ == "__main__":  # the runs of the resume proof, one after another, spawned by torch.multiprocessing
    import torch.multiprocessing as mp

    for i, item in enumerate(sys.argv[2:]):
        name, _, rest = item.partition("=")
        folder, tp, pp = rest.rsplit(":", 2)
        port = 29700 + (os.getpid() + 17 * i) % 1000
        mp.spawn(resume, args=(int(tp) * int(pp), folder, int(tp), int(pp), os.path.join(sys.argv[1], name), port),
                 nprocs=int(tp) * int(pp))
