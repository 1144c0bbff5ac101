"""A training dict's copies of the model (an EMA, an averaged model) take the model's plan (issue 20).

fixtures/training/twins/ (fixtures/generate_training_twins.py): timm's ``CheckpointSaver`` with a
``ModelEmaV3`` (``state_dict_ema``; once with a bfloat16 model and its EMA in float32) and a
training dict holding a ``torch.optim.swa_utils.AveragedModel``'s state dict (``ema``: the
model's names under ``module.``, ``n_averaged``). ``fuse`` to ``.pth`` moves each copy exactly as
a safetensors fuse of that copy alone (bitwise, in its dtype, its prefix and other entries
kept); ``unfuse`` gives back every tensor of the training dict bitwise; a copy the plan does not
bind to as it binds to the model is exit 2 naming it, nothing written; ``--drop-optimizer`` with
conv-bn-fold folds the copy too; ``inspect --json`` lists the copies (``twins``); ``verify``
replays the plan on them and fails on a copy left unfused. With torch and timm (skipped
without; run by hand with ``/work/venv-gen/bin/python -m pytest``), the fused file loads through
timm's own ``resume_checkpoint`` and ``load_checkpoint(use_ema=True)`` into the fused model and
its EMA, and training goes on with the unfused run's losses and EMA.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest

import fusectl
from conftest import FIXTURES, ok, run_cli, snapshot
from fusectl.io.formats.torch_file import read_torch_tree
from fusectl.io.formats.torch_writer import write_torch_file
from fusectl.tensors import LazyTensor

TWINS = FIXTURES / "training" / "twins"
CONFIG = ["--config", TWINS / "config.json"]
ATTN = "model.layers.0.self_attn."


def _tensors(path, key):
    """name → numpy array of the state dict at ``key`` of a torch file, read by fusectl."""
    tree, _ = read_torch_tree(str(path))
    return {k: v.read() for k, v in tree[key].items() if isinstance(v, LazyTensor)}, list(tree[key])


def _alone(tmp_path, source, key, rules, name):
    """A safetensors fuse of the state dict at ``key`` alone (the reference for its twin)."""
    plain = tmp_path / f"{name}-plain.safetensors"
    ok(run_cli("convert", source, "--key", key, "-o", plain))
    fused = tmp_path / f"{name}-alone.safetensors"
    ok(run_cli("fuse", plain, *rules, *CONFIG, "-o", fused))
    checkpoint = fusectl.open_checkpoint(str(fused))
    return {n: t.read() for n, t in checkpoint.table.entries.items()}


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _tree_equal(a, b, where=""):
    """Two trees read by fusectl: equal dict orders and values, every tensor bitwise."""
    if isinstance(a, LazyTensor):
        assert isinstance(b, LazyTensor) and _same(a.read(), b.read()), where
    elif isinstance(a, dict):
        assert list(map(str, a)) == list(map(str, b)), where
        for (k, v), w in zip(a.items(), b.values()):
            _tree_equal(v, w, f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for n, (v, w) in enumerate(zip(a, b)):
            _tree_equal(v, w, f"{where}.{n}")
    else:
        assert a == b, where


@pytest.mark.parametrize("name, key", [("timm.pth.tar", "state_dict_ema"), ("timm-bf16.pth.tar", "state_dict_ema"),
                                       ("averaged.pt", "ema")])
def test_fuse_moves_the_copy_as_a_fuse_of_it_alone(tmp_path, name, key):
    out = tmp_path / "fused.pth"
    report = json.loads(ok(run_cli("fuse", TWINS / name, "-r", "llama-qkv", "-o", out, "--json")).stdout)
    assert report["twins"] == [key] and report["optimizer"]["state"] == "moved"
    got, order = _tensors(out, key)
    want = _alone(tmp_path, TWINS / name, key, ["-r", "llama-qkv"], "twin")
    assert set(got) == set(want)
    assert all(_same(got[n], want[n]) for n in want)
    original, original_order = _tensors(TWINS / name, key)
    prefix = "module." if key == "ema" else ""
    qkv = got[prefix + ATTN + "qkv_proj.weight"]
    assert qkv.dtype == original[prefix + ATTN + "q_proj.weight"].dtype  # the EMA's own dtype (float32)
    # the copy's entries in the model's output order, its other entries (n_averaged) where they were
    model_order = _tensors(out, "model" if key == "ema" else "state_dict")[1]
    assert [n for n in order if n != "n_averaged"] == [prefix + n for n in model_order]
    assert (order[0] == "n_averaged") == (original_order[0] == "n_averaged") == (key == "ema")


def test_unfuse_gives_the_training_dict_back_bitwise(tmp_path):
    fused, back = tmp_path / "fused.pth", tmp_path / "back.pth"
    ok(run_cli("fuse", TWINS / "timm.pth.tar", "-r", "llama-qkv", "-o", fused))
    ok(run_cli("unfuse", fused, "-o", back))
    _tree_equal(read_torch_tree(str(TWINS / "timm.pth.tar"))[0], read_torch_tree(str(back))[0])


def test_a_copy_that_does_not_bind_like_the_model_is_refused(tmp_path):
    tree, metadata = read_torch_tree(str(TWINS / "timm.pth.tar"))
    del tree["state_dict_ema"][ATTN + "k_proj.weight"]
    bad = tmp_path / "bad.pth"
    write_torch_file(str(bad), tree, metadata=metadata)
    before = snapshot(tmp_path)
    result = run_cli("fuse", bad, "-r", "llama-qkv", *CONFIG, "-o", tmp_path / "out.pth")
    assert result.exit_code == 2
    assert "'state_dict_ema'" in result.stderr and ATTN + "k_proj.weight" in result.stderr
    assert "Traceback" not in result.stderr
    assert snapshot(tmp_path) == before
    # the model alone is still written where asked for
    ok(run_cli("fuse", bad, "-r", "llama-qkv", *CONFIG, "-o", tmp_path / "model.safetensors"))


def test_drop_optimizer_and_a_fold_fold_the_copy_too(tmp_path):
    refused = run_cli("fuse", TWINS / "timm.pth.tar", "-r", "conv-bn-fold", "-o", tmp_path / "refused.pth")
    assert refused.exit_code == 2 and "--drop-optimizer" in refused.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written, nothing left beside it
    out = tmp_path / "folded.pth"
    report = json.loads(ok(run_cli("fuse", TWINS / "timm.pth.tar", "-r", "conv-bn-fold", "--drop-optimizer",
                                   "-o", out, "--json")).stdout)
    assert report["twins"] == ["state_dict_ema"] and report["optimizer"]["state"] == "dropped"
    got, _ = _tensors(out, "state_dict_ema")
    want = _alone(tmp_path, TWINS / "timm.pth.tar", "state_dict_ema", ["-r", "conv-bn-fold"], "folded")
    assert set(got) == set(want) and "stem.conv1.bias" in got and not any(".bn1." in n for n in got)
    assert all(_same(got[n], want[n]) for n in want)
    model, _ = _tensors(out, "state_dict")
    assert not np.array_equal(model["stem.conv1.bias"], got["stem.conv1.bias"])  # the EMA's own statistics


def test_inspect_lists_the_copies():
    report = json.loads(ok(run_cli("inspect", TWINS / "averaged.pt", "--json")).stdout)
    assert report["state_dict_key"] == "model"
    assert report["twins"] == [{"where": "ema", "tensors": 12, "prefix": "module.", "dtypes": ["F32", "I64"],
                                "other_entries": ["n_averaged"]}]
    bf16 = json.loads(ok(run_cli("inspect", TWINS / "timm-bf16.pth.tar", "--json")).stdout)
    assert bf16["twins"][0]["where"] == "state_dict_ema" and bf16["twins"][0]["dtypes"] == ["F32", "I64"]
    assert {p["dtype"] for p in bf16["parameters"]} == {"BF16", "I64"}
    plain = json.loads(ok(run_cli("inspect", FIXTURES / "training" / "llama-adamw.pt", "--json")).stdout)
    assert plain["twins"] == []


def test_verify_replays_the_plan_on_the_copy(tmp_path):
    fused = tmp_path / "fused.pth"
    ok(run_cli("fuse", TWINS / "timm.pth.tar", "-r", "llama-qkv", "-o", fused))
    report = tmp_path / "report.json"
    ok(run_cli("verify", TWINS / "timm.pth.tar", fused, "--report", report))
    twin = [c for c in json.loads(report.read_text())["checks"] if c["kind"] == "twin"]
    assert [c["name"] for c in twin] == ["state_dict_ema"] and twin[0]["passed"]
    # the copy left as it was (what fusectl wrote before it moved copies): verify fails, naming it
    tree, metadata = read_torch_tree(str(fused))
    tree["state_dict_ema"] = read_torch_tree(str(TWINS / "timm.pth.tar"))[0]["state_dict_ema"]
    stale = tmp_path / "stale.pth"
    write_torch_file(str(stale), tree, metadata=metadata)
    result = run_cli("verify", TWINS / "timm.pth.tar", stale)
    assert result.exit_code != 0 and "FAIL twin state_dict_ema" in result.stdout


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.mark.skipif(not (_has("torch") and _has("timm")), reason="needs torch and timm")
def test_the_fused_file_resumes_in_timm_with_its_ema(tmp_path):
    import torch

    sys.path.insert(0, str(FIXTURES))
    import generate_training_twins as g

    try:
        timm = g.import_timm()
    except ImportError as e:  # timm needs torchvision, which a CPU torch may lack
        pytest.skip(f"timm does not import here: {e}")
    from timm.models import load_checkpoint, resume_checkpoint

    g.setup()
    fused = tmp_path / "fused.pth"
    ok(run_cli("fuse", TWINS / "timm.pth.tar", "-r", "llama-qkv", "-o", fused))
    runs = {}
    for path, is_fused in ((TWINS / "timm.pth.tar", False), (fused, True)):
        model = g.Tiny(fused=is_fused)
        optimizer = g.optimizer_for(model)
        epoch = resume_checkpoint(model, str(path), optimizer, log_info=False)
        ema = timm.utils.ModelEmaV3(model, decay=0.9)
        load_checkpoint(ema.module, str(path), use_ema=True)
        losses = []
        for step, batch in enumerate(g.batches(g.STEPS + 3)[g.STEPS:]):
            losses.append(g.train_step(model, optimizer, batch))
            ema.update(model, step=g.STEPS + step)
        runs[is_fused] = (epoch, losses, ema.module.state_dict())
    assert runs[False][0] == runs[True][0] == 1
    assert np.allclose(runs[False][1], runs[True][1], rtol=0, atol=1e-5), runs
    unfused, fused_ema = runs[False][2], runs[True][2]
    want = torch.cat([unfused[ATTN + p] for p in ("q_proj.weight", "k_proj.weight", "v_proj.weight")])
    assert torch.allclose(fused_ema[ATTN + "qkv_proj.weight"], want, rtol=0, atol=1e-5)
    assert torch.allclose(fused_ema["stem.bn1.running_var"], unfused["stem.bn1.running_var"], rtol=0, atol=1e-5)
