"""io/formats/deepspeed_universal: DeepSpeed universal checkpoints read and written without torch.

The universal checkpoints of the fixtures are DeepSpeed's own (``ds_to_universal.py`` of the
ZeRO 2 and 3 checkpoints beside them: ``fixtures/generate_distributed.py``,
``fixtures/generate_deepspeed_padded.py``): read, they are the ZeRO checkpoint they came from,
bitwise. Written by fusectl from a ZeRO checkpoint's training state, one reads back as it was
written, unfuses to the original, and — where DeepSpeed is installed — resumes on one rank with
the uninterrupted run's losses, fused or not. Hostile folders and trees are refused.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES, ok, refused, run_cli, snapshot
from fusectl.errors import CheckpointError, OutputError
from fusectl.io.formats.deepspeed_universal import read_universal, write_universal
from fusectl.io.formats.deepspeed_zero import RECORDS, read_zero
from fusectl.io.formats.torch_file import read_torch_tree
from fusectl.io.provenance import METADATA_KEY

DIST = FIXTURES / "distributed"
PADDED = FIXTURES / "deepspeed-padded"
TAG = "global_step3"
SAVED = 3
PAIRS = [(DIST, "zero2"), (DIST, "zero3"), (PADDED, "zero2"), (PADDED, "zero3")]
IDS = ["distributed/zero2", "distributed/zero3", "padded/zero2", "padded/zero3"]
MODEL, OPTIMIZER = ("model",), ("optimizer",)


def _bytes(tensor) -> bytes:
    return tensor.read().tobytes()


def _same_training(a, b) -> None:
    """Two Contents hold the same state dict (order, ties, bytes) and optimizer, bitwise."""
    assert list(a.order) == list(b.order) and dict(a.aliases) == dict(b.aliases)
    for name, tensor in b.tensors.items():
        assert a.tensors[name].spec == tensor.spec and _bytes(a.tensors[name]) == _bytes(tensor), name
    ta, tb = a.training.tree()["optimizer"], b.training.tree()["optimizer"]
    assert ta["param_groups"] == tb["param_groups"]
    assert sorted(ta["state"]) == sorted(tb["state"])
    for pid, entry in tb["state"].items():
        assert list(ta["state"][pid]) == list(entry)
        for key, value in entry.items():
            assert ta["state"][pid][key].spec == value.spec and _bytes(ta["state"][pid][key]) == _bytes(value)


@pytest.mark.parametrize("root,name", PAIRS, ids=IDS)
def test_deepspeeds_universal_checkpoint_is_the_zero_checkpoint_it_came_from(root, name):
    universal = read_universal(str(root / f"{name}-universal"))
    _same_training(universal, read_zero(str(root / name)))
    assert universal.variant == "deepspeed-universal"
    assert universal.distributed == {"world_size": 2, "tag": TAG, "stage": int(name[4])}
    tag = read_universal(str(root / f"{name}-universal" / TAG))  # its tag folder alike
    assert list(tag.order) == list(universal.order)


def test_inspect_json_says_deepspeed_universal():
    report = ok(run_cli("inspect", "--json", DIST / "zero2-universal")).json()
    assert report["format"] == "deepspeed-universal"
    assert report["distributed"] == {"world_size": 2, "tag": TAG, "stage": 2}
    assert report["optimizer"]["kind"] == "Adam/AdamW" and len(report["parameters"]) == 21


@pytest.mark.parametrize("root,name", [(DIST, "zero2"), (DIST, "zero3-tied"), (PADDED, "zero3")],
                         ids=["distributed/zero2", "distributed/zero3-tied", "padded/zero3"])
def test_a_written_universal_checkpoint_reads_back_as_it_was_written(tmp_path, root, name):
    source = read_zero(str(root / name))
    out = tmp_path / "universal"
    write_universal(str(out), source.training.tree(), MODEL, OPTIMIZER, {})
    assert (out / "latest_universal").read_text() == TAG
    listing = sorted(os.listdir(out / TAG))
    assert listing == ["mp_rank_00_model_states.pt", "zero", "zero_pp_rank_0_mp_rank_00_model_states.pt"]
    back = read_universal(str(out))
    _same_training(back, source)
    zero = out / TAG / "zero"
    assert sorted(os.listdir(zero)) == sorted(["optimizer_state.pt", *source.order])  # a folder per tensor
    optimizer, _ = read_torch_tree(str(zero / "optimizer_state.pt"))
    assert optimizer["ds_version"] and [set(g) - {"params"} for g in optimizer["param_groups"]] == \
        [set(g) - {"params", "param_names"} for g in source.training.tree()["optimizer"]["param_groups"]]
    weight, _ = read_torch_tree(str(zero / "model.norm.weight" / "fp32.pt")) if root == DIST else \
        read_torch_tree(str(zero / "a.bias" / "fp32.pt"))
    assert list(weight) == ["cat_dim", "param"]  # as ds_to_universal writes it


def _fused_universal(tmp_path: Path) -> tuple[Path, dict]:
    """zero2/ fused with llama-qkv + llama-gate-up (to .pt), its training tree written as a
    universal checkpoint with fusectl's record; (the folder, the record)."""
    fused = tmp_path / "fused.pt"
    ok(run_cli("fuse", DIST / "zero2", "-r", "llama-qkv", "-r", "llama-gate-up", "-o", fused))
    tree, record = read_torch_tree(str(fused))
    out = tmp_path / "universal"
    write_universal(str(out), tree, MODEL, OPTIMIZER, record)
    return out, record


def test_a_fused_universal_checkpoint_unfuses_to_the_original_training_state(tmp_path):
    out, record = _fused_universal(tmp_path)
    written = read_universal(str(out))
    assert written.provenance_text == record[METADATA_KEY]  # fusectl's record, kept in the model states
    assert "model.layers.0.self_attn.qkv_proj.weight" in written.tensors
    restored = tmp_path / "restored.pt"
    ok(run_cli("unfuse", out, "-o", restored))
    back, _ = read_torch_tree(str(restored))
    source = read_zero(str(DIST / "zero2")).training.tree()
    assert list(back["model"]) == list(source["model"])
    assert all(_bytes(back["model"][n]) == _bytes(t) for n, t in source["model"].items())
    assert back["optimizer"]["param_groups"] == source["optimizer"]["param_groups"]
    for pid, entry in source["optimizer"]["state"].items():
        assert {k: _bytes(v) for k, v in back["optimizer"]["state"][pid].items()} == \
            {k: _bytes(v) for k, v in entry.items()}


# ------------------------------------------------------------------------------- resumed by DeepSpeed


def _resume(folder: Path, stage: int = 2) -> dict:
    """fixtures/distributed_train.py's resume of a universal checkpoint on one rank, a ZeRO-``stage``
    engine (its ZeRO-3 load with DeepSpeed 0.19.8's two load bugs undone)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("deepspeed")
    shutil.copy(DIST / "zero2" / "config.json", folder / "config.json")
    done = subprocess.run([sys.executable, str(FIXTURES / "distributed_train.py"), "resume-ds-universal", str(folder),
                           "--ranks", "1", "--stage", str(stage)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _uninterrupted() -> list[float]:
    [losses] = json.loads((DIST / "reference" / "losses.json").read_text())["deepspeed-zero2"].values()
    return losses[SAVED:]


def test_deepspeed_resumes_a_written_universal_checkpoint_on_one_rank(tmp_path):
    out = tmp_path / "universal"
    write_universal(str(out), read_zero(str(DIST / "zero2")).training.tree(), MODEL, OPTIMIZER, {})
    got = _resume(out)
    assert got["arch"] == "llama" and got["ranks"] == 1
    assert max(abs(a - b) for a, b in zip(got["losses"], _uninterrupted(), strict=True)) <= 1e-5


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_resumes_a_fused_universal_checkpoint_in_the_fused_layout(tmp_path, stage):
    out, _ = _fused_universal(tmp_path)
    got = _resume(out, stage)  # Phi3ForCausalLM: its universal loader pairs state by name, in any order
    assert got["arch"] == "phi3"
    assert max(abs(a - b) for a, b in zip(got["losses"], _uninterrupted(), strict=True)) <= 1e-5


# ------------------------------------------------------------------------------- hostile


@pytest.fixture
def spoiled(tmp_path):
    """A copy of zero2-universal to spoil, and the check that converting it is refused."""

    class Spoiled:
        folder = tmp_path / "in" / "zero2-universal"
        zero = folder / TAG / "zero"

        def refused(self, *needles: str) -> None:
            before = snapshot(tmp_path / "in")
            out = tmp_path / "out.pt"
            refused(run_cli("convert", self.folder, "-o", out), *needles, unwritten=[out])
            assert snapshot(tmp_path / "in") == before

    shutil.copytree(DIST / "zero2-universal", Spoiled.folder)
    return Spoiled()


@pytest.mark.parametrize("text", ["../zero2-universal/global_step3", "/tmp", "..", "missing"])
def test_a_latest_universal_that_names_anything_but_a_folder_beside_it_is_refused(spoiled, text):
    (spoiled.folder / "latest_universal").write_text(text)
    spoiled.refused(str(spoiled.folder / "latest_universal"))


def test_a_parameter_without_its_weight_is_refused_naming_the_file(spoiled):
    path = spoiled.zero / "model.norm.weight" / "fp32.pt"
    path.unlink()
    spoiled.refused(str(path), "missing")


def test_a_moment_of_another_size_is_refused_naming_the_file(spoiled):
    shutil.copy(spoiled.zero / "model.norm.weight" / "exp_avg.pt",
                spoiled.zero / "model.layers.0.self_attn.q_proj.weight" / "exp_avg.pt")
    spoiled.refused(str(spoiled.zero / "model.layers.0.self_attn.q_proj.weight" / "exp_avg.pt"), "[16, 16]")


def test_a_missing_optimizer_state_is_refused_naming_it(spoiled):
    (spoiled.zero / "optimizer_state.pt").unlink()
    spoiled.refused(str(spoiled.zero / "optimizer_state.pt"))


def test_a_parameter_named_as_a_path_is_refused(spoiled):
    from fusectl.io.formats.torch_writer import write_torch_file
    path = spoiled.folder / TAG / "mp_rank_00_model_states.pt"
    tree, _ = read_torch_tree(str(path), records=RECORDS)
    shapes = tree["param_shapes"][1]
    tree["param_shapes"][1] = type(shapes)(("../../x" if n == "model.norm.weight" else n, s) for n, s in shapes.items())
    write_torch_file(str(path) + ".new", tree)
    os.replace(str(path) + ".new", path)
    spoiled.refused("'../../x'", "folder")


@pytest.mark.parametrize("edit,needle", [
    (lambda tree: tree["model"].update({"a/b": next(iter(tree["model"].values()))}), "'a/b'"),
    (lambda tree: tree["optimizer"]["param_groups"][1]["param_names"].__setitem__(0, "model.nothing"),
     "'model.nothing'"),
    (lambda tree: tree["optimizer"]["state"][0].update(exp_avg=tree["optimizer"]["state"][1]["exp_avg"]),
     "shaped like its parameter"),
    (lambda tree: [g.pop("param_names") for g in tree["optimizer"]["param_groups"]], "param_names"),
    (lambda tree: tree["model"].update({"x": 1}), "'x'"),
])
def test_what_a_universal_checkpoint_cannot_hold_is_refused_before_anything_is_written(tmp_path, edit, needle):
    tree = read_zero(str(DIST / "zero2")).training.tree()
    tree = {"model": dict(tree["model"]), "optimizer": json_copy(tree["optimizer"])}
    edit(tree)
    out = tmp_path / "universal"
    with pytest.raises((OutputError, CheckpointError)) as refusal:
        write_universal(str(out), tree, MODEL, OPTIMIZER, {})
    assert needle in str(refusal.value)
    assert not out.exists()


def json_copy(node):
    """A copy of a tree's dicts and lists (its tensors shared)."""
    if isinstance(node, dict):
        return {k: json_copy(v) for k, v in node.items()}
    if isinstance(node, list):
        return [json_copy(v) for v in node]
    return node


def test_a_universal_folder_without_its_model_states_is_refused(spoiled):
    (spoiled.folder / TAG / "mp_rank_00_model_states.pt").unlink()
    spoiled.refused("mp_rank_00_model_states.pt", "missing")
