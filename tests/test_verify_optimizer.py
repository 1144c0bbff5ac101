"""``verify`` of a training checkpoint replays the plan on its optimizer state (issue 20).

A fused training dict passes; the same file with one moment moved off its weight (perturbed,
or swapped with another parameter's of the same shape), a changed ``step``, a changed
hyperparameter, or a changed Python-number step fails with exit 1 naming what differs. A
candidate that dropped the optimizer passes with the state reported ``"dropped"``; one holding
optimizer state its reference lacks fails. Every tampered file is written with
``fusectl.io.formats.torch_writer`` from the fused file's own tree, its provenance kept.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import fusectl
from conftest import FIXTURES, ok, refused, run_cli
from test_training_flags import CONFIG, RULES, TRAINING, rewrite, tensor, without_order_record

QKV0 = "model.layers.0.self_attn.qkv_proj.weight"
QKV1 = "model.layers.1.self_attn.qkv_proj.weight"


@pytest.fixture
def fused(tmp_path):
    out = tmp_path / "fused.pt"
    ok(run_cli("fuse", TRAINING / "llama-adamw.pt", *RULES, "-o", out))
    return out


def _id(path, name) -> int:
    checkpoint = fusectl.open_checkpoint(str(path))
    _, mapping = checkpoint.optimizer_mapped
    return next(pid for pid, n in mapping.names.items() if n == name)


def _verify(reference, candidate, *extra):
    return run_cli("verify", reference, candidate, *extra)


def test_a_fused_training_dict_passes_and_the_report_counts_the_optimizer_checks(fused, tmp_path):
    report = tmp_path / "verify.json"
    result = ok(_verify(TRAINING / "llama-adamw.pt", fused, "--report", report))
    assert "PASS state: 45 tensor(s) equal (45 bitwise" in result.stdout
    assert "PASS optimizer param group 0  (10 parameter(s), hyperparameters equal)" in result.stdout
    doc = json.loads(report.read_text())
    assert doc["optimizer"] == {"reference": "optimizer_state_dict", "candidate": "optimizer_state_dict",
                                "status": "checked", "state_tensors": 45, "parameters": 15, "groups": 2,
                                "passed": True}
    names = {c["name"] for c in doc["checks"] if c["kind"] == "state"}
    assert f"{QKV0}::exp_avg" in names and f"{QKV0}::step" in names


def test_a_perturbed_moment_fails_naming_it(fused, tmp_path):
    bad = tmp_path / "bad.pt"
    pid = _id(fused, QKV0)

    def perturb(tree):
        state = tree["optimizer_state_dict"]["state"][pid]
        moment = state["exp_avg"].read()
        moment[3, 5] += 1e-3
        state["exp_avg"] = tensor(moment)

    rewrite(fused, bad, perturb)
    result = _verify(TRAINING / "llama-adamw.pt", bad, "--report", tmp_path / "r.json")
    assert result.exit_code == 1, result.output
    assert f"FAIL state {QKV0}::exp_avg" in result.stdout and "1 element(s) differ, first at [3, 5]" in result.stdout
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["failed"] == [f"{QKV0}::exp_avg"] and doc["optimizer"]["passed"] is False


def test_two_moments_of_equal_shape_swapped_fail_naming_both(fused, tmp_path):
    bad = tmp_path / "swapped.pt"
    a, b = _id(fused, QKV0), _id(fused, QKV1)

    def swap(tree):
        state = tree["optimizer_state_dict"]["state"]
        state[a]["exp_avg_sq"], state[b]["exp_avg_sq"] = state[b]["exp_avg_sq"], state[a]["exp_avg_sq"]

    rewrite(fused, bad, swap)
    result = _verify(TRAINING / "llama-adamw.pt", bad, "--report", tmp_path / "r.json")
    assert result.exit_code == 1, result.output
    assert json.loads((tmp_path / "r.json").read_text())["failed"] == [f"{QKV0}::exp_avg_sq", f"{QKV1}::exp_avg_sq"]


def test_a_changed_step_fails_naming_it(fused, tmp_path):
    bad = tmp_path / "step.pt"
    pid = _id(fused, QKV1)

    def later(tree):
        tree["optimizer_state_dict"]["state"][pid]["step"] = tensor(np.array(4.0))

    rewrite(fused, bad, later)
    result = _verify(TRAINING / "llama-adamw.pt", bad)
    assert result.exit_code == 1 and f"FAIL state {QKV1}::step" in result.stdout


def test_a_changed_hyperparameter_fails_naming_the_group_and_the_key(fused, tmp_path):
    bad = tmp_path / "lr.pt"

    def other_lr(tree):
        tree["optimizer_state_dict"]["param_groups"][1]["lr"] = 0.5

    rewrite(fused, bad, other_lr)
    result = _verify(TRAINING / "llama-adamw.pt", bad)
    assert result.exit_code == 1
    assert "FAIL optimizer param group 1  (hyperparameter 'lr' is 0.5, the reference's" in result.stdout


def test_python_number_steps_are_checked_as_numbers(tmp_path):
    # an older torch saved ``step`` as a float, not a tensor: kept once by the fuse, compared as a number
    floats = tmp_path / "floats.pt"

    def as_floats(tree):
        for entry in tree["optimizer_state_dict"]["state"].values():
            entry["step"] = float(entry["step"].read())

    rewrite(TRAINING / "llama-adamw.pt", floats, as_floats)
    fused = tmp_path / "fused.pt"
    ok(run_cli("fuse", floats, *RULES, *CONFIG, "-o", fused))
    result = ok(_verify(floats, fused))
    assert "PASS optimizer numbers  (15 per-parameter number(s) equal)" in result.stdout
    assert "PASS state: 30 tensor(s) equal" in result.stdout
    bad = tmp_path / "bad.pt"
    pid = _id(fused, QKV0)

    def later(tree):
        tree["optimizer_state_dict"]["state"][pid]["step"] = 9.0

    rewrite(fused, bad, later)
    result = _verify(floats, bad)
    assert result.exit_code == 1 and f"FAIL optimizer {QKV0}::step  (9.0, the plan keeps 3.0)" in result.stdout


def test_a_dropped_optimizer_is_reported_as_dropped_not_silently_passed(tmp_path):
    out = tmp_path / "model.pt"
    ok(run_cli("fuse", TRAINING / "llama-adamw.pt", *RULES, "--drop-optimizer", "-o", out))
    result = ok(_verify(TRAINING / "llama-adamw.pt", out, "--report", tmp_path / "r.json"))
    assert "PASS optimizer optimizer_state_dict  (dropped: the candidate holds no optimizer state" in result.stdout
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["optimizer"]["status"] == "dropped" and doc["optimizer"]["candidate"] is None


def test_optimizer_state_the_reference_lacks_fails(fused, tmp_path):
    model = tmp_path / "model.safetensors"
    ok(run_cli("convert", TRAINING / "llama-adamw.pt", "-o", model))
    result = _verify(model, fused)
    assert result.exit_code == 1
    assert "FAIL optimizer optimizer_state_dict  (the candidate holds optimizer state but the reference has none" \
        in result.stdout


def test_a_plain_checkpoint_reports_no_optimizer(tmp_path):
    out = tmp_path / "fused"
    ok(run_cli("fuse", FIXTURES / "tiny-llama-gqa", "-r", "llama-qkv", "-o", out))
    assert ok(_verify(FIXTURES / "tiny-llama-gqa", out, "--report", tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text())["optimizer"] is None


def test_a_reference_whose_order_the_shapes_cannot_prove_needs_param_order(tmp_path):
    torch_dir = FIXTURES / "torch"
    table = fusectl.open_checkpoint(str(torch_dir / "training.pt")).table
    order = tmp_path / "order.json"
    order.write_text(json.dumps([n for n in table.entries if "running_" not in n and "num_batches" not in n]))
    out = tmp_path / "fused.pt"
    ok(run_cli("fuse", torch_dir / "training.pt", "-r", "lstm-to-onnx", "--param-order", order, "-o", out))
    refused(_verify(torch_dir / "training.pt", out), "cannot check the optimizer state", "--param-order FILE")
    # the fused file records the parameter of each id: its order need not be given (issue 28)
    result = ok(_verify(torch_dir / "training.pt", out, "--param-order", order))
    assert "PASS state: 36 tensor(s) equal (36 bitwise" in result.stdout
    # one fused before fusectl kept that record needs the fused model's order too
    old = tmp_path / "old.pt"
    without_order_record(out, old)
    result = _verify(torch_dir / "training.pt", old, "--param-order", order)
    assert result.exit_code == 1 and "the candidate's optimizer state is not mapped" in result.stdout
    assert "--param-order-out FILE" in result.stdout
    fused_order = tmp_path / "fused-order.json"
    table = fusectl.open_checkpoint(str(out)).table
    fused_order.write_text(json.dumps([n for n in table.entries if "running_" not in n and "num_batches" not in n]))
    result = ok(_verify(torch_dir / "training.pt", old, "--param-order", order, "--param-order-out", fused_order))
    assert "PASS optimizer parameters" in result.stdout
    assert "PASS state: 36 tensor(s) equal (36 bitwise" in result.stdout


def test_param_groups_merged_or_a_parameter_moved_to_another_group_fail_named(fused, tmp_path):
    merged, moved = tmp_path / "merged.pt", tmp_path / "moved.pt"

    def merge(tree):
        groups = tree["optimizer_state_dict"]["param_groups"]
        groups[0]["params"] = groups[0]["params"] + groups[1]["params"]
        del groups[1]

    rewrite(fused, merged, merge)
    result = _verify(TRAINING / "llama-adamw.pt", merged)
    assert result.exit_code == 1
    assert "FAIL optimizer param groups  (1 param group(s), the reference has 2)" in result.stdout
    # the last parameter of group 0 made the first of group 1: the ids keep their order, so the
    # candidate's state still maps to its parameters, but the parameter sits in another group
    last = fusectl.open_checkpoint(str(fused)).optimizer_mapped[0].groups[0].params[-1]
    name = fusectl.open_checkpoint(str(fused)).optimizer_mapped[1].names[last]

    def move(tree):
        groups = tree["optimizer_state_dict"]["param_groups"]
        groups[0]["params"] = groups[0]["params"][:-1]
        groups[1]["params"] = [last] + groups[1]["params"]

    rewrite(fused, moved, move)
    result = _verify(TRAINING / "llama-adamw.pt", moved)
    assert result.exit_code == 1
    assert f"FAIL optimizer param group 1  (holds '{name}', which the plan puts in param group 0)" in result.stdout
