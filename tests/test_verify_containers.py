"""``verify`` of a training checkpoint compares every entry beside the model (issue 28.4).

A fused ``.pt`` whose ``epoch`` and ``lr_scheduler`` differ from the reference's, and a fused
Trainer folder with another ``scheduler.pt`` and ``trainer_state.json``, both passed (exit 0),
though ``fuse`` promises to keep them unchanged. Now each entry of a training dict that is not a
model tensor, the optimizer's state or a copy of the model is compared value for value (kind
``entry``), each file a Trainer folder carries unchanged byte for byte (kind ``file``), and a
difference fails (exit 1) naming the entry or file.
"""

from __future__ import annotations

import collections
import json
import shutil

import numpy as np
import pytest

from conftest import FIXTURES, ok, run_cli
from fusectl import dtypes
from fusectl.io.formats.torch_file import read_torch_tree
from fusectl.io.checkpoint import open_checkpoint
from fusectl.io.formats.torch_writer import write_torch_file
from fusectl.steps import Plan
from fusectl.tensors import ArrayTensor, TensorSpec
from fusectl.verification.container_check import container_checks
from test_trainer_folder import llama_order

TRAINING = FIXTURES / "training"
RULES = ["-r", "llama-qkv", "-r", "llama-gate-up"]
F32 = dtypes.BY_NAME["F32"]


def tensor(array) -> ArrayTensor:
    array = np.asarray(array, np.float32)
    return ArrayTensor(TensorSpec(F32, array.shape), array)


def edited(src, dst, edit) -> None:
    """``dst``: the training dict of ``src`` (fusectl's record kept) with ``edit(tree)`` applied."""
    tree, record = read_torch_tree(str(src))
    tree = dict(tree)
    edit(tree)
    write_torch_file(str(dst), tree, metadata=record)


def failed(result) -> dict[str, str]:
    """The failed checks of a :func:`verify` run's report: name → detail."""
    return {c["name"]: c["detail"] for c in result.report["checks"] if not c["passed"]}


@pytest.fixture
def fused(tmp_path):
    out = tmp_path / "fused.pt"
    ok(run_cli("fuse", TRAINING / "llama-adamw.pt", *RULES, "-o", out))
    return out


def verify(reference, candidate, *extra):
    """``verify REFERENCE CANDIDATE``, its JSON report (written beside the candidate) as ``.report``."""
    report = candidate.parent / f"{candidate.name}.report.json"
    result = run_cli("verify", reference, candidate, "--report", report, *extra)
    result.report = json.loads(report.read_text())
    return result


def test_a_fused_training_dict_with_its_entries_unchanged_passes(fused):
    result = ok(verify(TRAINING / "llama-adamw.pt", fused))
    assert "PASS entry beside the model" in result.stdout


def test_another_epoch_and_an_added_scheduler_fail_named(tmp_path, fused):
    candidate = tmp_path / "edited.pt"
    edited(fused, candidate, lambda t: t.update(epoch=9, lr_scheduler={"last_epoch": 3}))
    result = verify(TRAINING / "llama-adamw.pt", candidate)
    assert result.exit_code == 1, result.output
    assert failed(result) == {"epoch": "1 in the reference, 9 in the candidate", "lr_scheduler": "not in the reference"}


def test_a_nested_value_a_tensor_and_a_missing_entry_are_each_named(tmp_path):
    reference, fused, candidate = tmp_path / "ref.pt", tmp_path / "fused.pt", tmp_path / "edited.pt"
    rng = np.random.default_rng(0)
    model = collections.OrderedDict([("w", tensor(rng.standard_normal((4, 2)))), ("version", 2)])
    write_torch_file(str(reference), {"model": model, "scheduler": {"last_epoch": 3, "base_lrs": [0.1]},
                                      "rng": tensor(np.array(5.0)), "step": 10})
    rules = tmp_path / "rename.toml"
    rules.write_text('version = 1\n[[rule]]\nop = "rename"\ninput = "w"\noutput = "weight"\n')
    ok(run_cli("fuse", reference, "-r", rules, "-o", fused))
    ok(verify(reference, fused))

    def edit(tree):
        tree["scheduler"] = {"last_epoch": 3, "base_lrs": [0.2]}
        tree["rng"] = tensor(np.array(6.0))
        del tree["step"]
        tree["model"] = collections.OrderedDict(tree["model"], version=3)
    edited(fused, candidate, edit)
    result = verify(reference, candidate)
    assert result.exit_code == 1
    assert failed(result) == {"scheduler.base_lrs.0": "0.1 in the reference, 0.2 in the candidate",
                              "rng": "a F32[] tensor with other bytes", "step": "missing from the candidate",
                              "model.version": "2 in the reference, 3 in the candidate"}


def test_entries_in_another_order_fail(tmp_path, fused):
    candidate = tmp_path / "reordered.pt"
    tree = read_torch_tree(str(fused))[0]
    reordered = dict(reversed(list(tree.items())))
    write_torch_file(str(candidate), reordered, metadata=read_torch_tree(str(fused))[1])
    result = verify(TRAINING / "llama-adamw.pt", candidate)
    assert result.exit_code == 1 and failed(result) == {"(the top level)": "the same keys in another order"}


def test_a_dropped_optimizer_and_a_model_only_output_are_no_missing_entries(tmp_path):
    dropped = tmp_path / "dropped.ckpt"
    ok(run_cli("fuse", TRAINING / "lightning.ckpt", "-r", "llama-qkv", "--drop-optimizer", "-o", dropped))
    ok(verify(TRAINING / "lightning.ckpt", dropped))  # optimizer_states and lr_schedulers left out on purpose
    model = tmp_path / "model.safetensors"
    ok(run_cli("fuse", TRAINING / "llama-adamw.pt", *RULES, "-o", model))
    result = ok(verify(TRAINING / "llama-adamw.pt", model))
    assert "not compared: the candidate holds the model only" in result.stdout


@pytest.fixture
def trainer(tmp_path):
    """(the Llama order file, the Trainer folder fused with it)."""
    order = tmp_path / "llama.json"
    order.write_text(json.dumps(llama_order()))
    out = tmp_path / "fused"
    ok(run_cli("fuse", TRAINING / "trainer" / "checkpoint-2", *RULES, "--param-order", order, "-o", out))
    return order, out


def test_a_fused_trainer_folder_with_its_files_unchanged_passes(trainer):
    order, out = trainer
    result = ok(verify(TRAINING / "trainer" / "checkpoint-2", out, "--param-order", order))
    files = {c["name"] for c in result.report["checks"] if c["kind"] == "file" and c["passed"]}
    assert {"scheduler.pt", "trainer_state.json", "rng_state.pth", "training_args.bin"} <= files


def test_another_scheduler_and_trainer_state_fail_named(trainer):
    order, out = trainer
    state = json.loads((out / "trainer_state.json").read_text())
    state["global_step"] += 1
    (out / "trainer_state.json").write_text(json.dumps(state, indent=2))
    data = bytearray((out / "scheduler.pt").read_bytes())
    data[-30] ^= 1  # same size, other bytes
    (out / "scheduler.pt").write_bytes(bytes(data))
    (out / "rng_state.pth").unlink()
    shutil.copy(out / "generation_config.json", out / "extra.json")
    result = verify(TRAINING / "trainer" / "checkpoint-2", out, "--param-order", order)
    assert result.exit_code == 1
    found = failed(result)
    assert found["scheduler.pt"] == "other bytes" and found["rng_state.pth"] == "missing from the candidate"
    assert "in the candidate" in found["trainer_state.json"] and found["extra.json"] == "not in the reference"
    assert set(found) == {"scheduler.pt", "trainer_state.json", "rng_state.pth", "extra.json"}


def test_an_entry_of_another_kind_shape_or_length_is_named_with_both_sides(tmp_path, fused):
    candidate = tmp_path / "edited.pt"
    reference = tmp_path / "ref.pt"

    def extras(tree):
        # tensors in lists: a dict of tensors beside the model would be another state dict to choose
        tree["extra"] = {"rng": [tensor(np.zeros(3))], "seed": [tensor(np.zeros(2))], "history": [1, 2],
                         "best": 0.5, "note": ["x"], "metric": float("nan")}
    edited(TRAINING / "llama-adamw.pt", reference, extras)
    edited(fused, candidate, extras)
    ok(verify(reference, candidate))  # an unset metric (NaN) is the same NaN on both sides

    def other(tree):
        tree["extra"] = {"rng": [tensor(np.zeros(4))], "seed": [7], "history": [1, 2, 3], "best": "0.5",
                         "note": [tensor(np.zeros(1))], "metric": float("nan")}
    changed = tmp_path / "changed.pt"
    edited(candidate, changed, other)
    result = verify(reference, changed)
    assert result.exit_code == 1
    assert failed(result) == {"extra.rng.0": "F32[3] in the reference, F32[4] in the candidate",
                              "extra.seed.0": "a F32[2] tensor in the reference, an int in the candidate",
                              "extra.history": "2 items in the reference, 3 in the candidate",
                              "extra.best": "a float in the reference, a str in the candidate",
                              "extra.note.0": "a str in the reference, a F32[1] tensor in the candidate"}


def test_more_differences_than_are_named_are_counted(tmp_path, fused):
    candidate = tmp_path / "edited.pt"
    edited(fused, candidate, lambda t: t.update({f"added{i:02}": i for i in range(25)}))
    result = verify(TRAINING / "llama-adamw.pt", candidate)
    assert result.exit_code == 1
    found = failed(result)
    assert len(found) == 21
    assert found.pop("more") == "at least 5 more entries differ (the comparison stops once more than 20 are found)"
    assert found == {f"added{i:02}": "not in the reference" for i in range(20)}


def test_a_strided_tensor_entry_is_compared_by_its_values(tmp_path):
    # torch.save of a transposed tensor keeps its strides: its bytes are no one file range
    torch = pytest.importorskip("torch")
    reference, fused, candidate = tmp_path / "ref.pt", tmp_path / "fused.pt", tmp_path / "edited.pt"
    torch.save({"model": {"w": torch.ones(4, 2)}, "rng": [torch.arange(6.0).reshape(2, 3).T]},
               reference)
    rules = tmp_path / "rename.toml"
    rules.write_text('version = 1\n[[rule]]\nop = "rename"\ninput = "w"\noutput = "weight"\n')
    ok(run_cli("fuse", reference, "-r", rules, "-o", fused))
    ok(verify(reference, fused))
    edited(fused, candidate, lambda t: t.update(rng=[tensor(np.arange(6.0).reshape(2, 3).T[::-1])]))
    result = verify(reference, candidate)
    assert result.exit_code == 1 and failed(result) == {"rng.0": "a F32[3, 2] tensor with other bytes"}


def test_a_trainer_folder_against_a_model_only_file_on_either_side(tmp_path, trainer):
    order, out = trainer
    unfused, fused = tmp_path / "unfused.safetensors", tmp_path / "fused.safetensors"
    ok(run_cli("convert", TRAINING / "trainer" / "checkpoint-2" / "model.safetensors", "-o", unfused))
    ok(run_cli("convert", out / "model.safetensors", "-o", fused))
    result = ok(verify(TRAINING / "trainer" / "checkpoint-2", fused, *RULES, "--param-order", order))
    assert "not compared: the candidate holds the model only, without the Trainer's files" in result.stdout
    result = verify(unfused, out, "--param-order", order)
    assert result.exit_code == 1
    assert failed(result)["beside the model"] == "the candidate holds the Trainer's files, the reference does not"


def test_a_trainer_folder_against_a_training_dict_fails_on_either_side():
    """Both hold training state, in two forms: nothing beside the model can be held to unchanged,
    so the entries fail (they passed as "not compared", as if one side held the model only)."""
    folder = open_checkpoint(str(TRAINING / "trainer" / "checkpoint-2"))
    training_dict = open_checkpoint(str(TRAINING / "llama-adamw.pt"))
    for reference, candidate, kinds in [(folder, training_dict, ("a Trainer folder", "a training dict")),
                                        (training_dict, folder, ("a training dict", "a Trainer folder"))]:
        [check] = container_checks(reference, candidate, Plan())
        assert not check.passed
        assert check.detail.startswith(f"the reference is {kinds[0]}, the candidate {kinds[1]}")


def test_a_folder_in_a_trainer_folder_is_compared_as_a_folder(tmp_path):
    order = tmp_path / "llama.json"
    order.write_text(json.dumps(llama_order()))
    reference, out = tmp_path / "checkpoint-2", tmp_path / "fused"
    shutil.copytree(TRAINING / "trainer" / "checkpoint-2", reference)
    (reference / "runs").mkdir()  # empty: a folder is all there is to compare
    ok(run_cli("fuse", reference, *RULES, "--param-order", order, "-o", out))
    result = ok(verify(reference, out, "--param-order", order))
    assert any(c["name"] == "runs" and c["passed"] and c["detail"] == "a folder" for c in result.report["checks"])
    (out / "runs").rmdir()
    (out / "runs").write_text("not a folder\n")
    result = verify(reference, out, "--param-order", order)
    assert result.exit_code == 1 and failed(result) == {"runs": "a folder on one side only"}


def test_a_config_json_the_rules_edit_is_not_compared_as_a_file(tmp_path):
    order = tmp_path / "llama.json"
    order.write_text(json.dumps(llama_order()))
    rules = tmp_path / "edit.toml"
    rules.write_text('version = 1\n[config]\nset = { fused_by = "fusectl" }\n')
    out = tmp_path / "fused"
    ok(run_cli("fuse", TRAINING / "trainer" / "checkpoint-2", *RULES, "-r", rules, "--param-order", order,
               "-o", out))
    assert json.loads((out / "config.json").read_text())["fused_by"] == "fusectl"
    result = ok(verify(TRAINING / "trainer" / "checkpoint-2", out, "--param-order", order))
    assert "config.json" not in {c["name"] for c in result.report["checks"] if c["kind"] == "file"}
