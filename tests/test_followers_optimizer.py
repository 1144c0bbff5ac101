"""followers/optimizer.py: an optimizer's state follows its parameters' steps; the optimizers
whose update is not elementwise, unequal steps and parts in two groups are refused (exit 2,
nothing written); ``plan`` lists the state steps under their parameter."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from fusectl import api
from fusectl.dtypes import BY_NAME
from fusectl.errors import PlanError
from fusectl.followers.optimizer import OptimizerFollower, recognise
from fusectl.io.optimizer_state import ParamMap, parse_optimizer
from fusectl.ops.layout import Concat, Split
from fusectl.steps import Step
from fusectl.table import ParamTable
from fusectl.tensors import ArrayTensor, TensorSpec

from conftest import FIXTURES, run_cli

F32 = BY_NAME["F32"]
TORCH = FIXTURES / "torch"
RULE = "rule 'r' (test)"


@pytest.mark.parametrize("keys, hyper, name", [
    ({"momentum_buffer"}, {"momentum": 0.9, "dampening": 0}, "SGD"),
    ({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}, {"amsgrad": True}, "Adam/AdamW"),
    ({"step", "mu_product", "exp_avg", "exp_avg_sq"}, {"momentum_decay": 0.004}, "NAdam"),
    ({"step", "exp_avg", "exp_avg_sq"}, {"decoupled_weight_decay": False}, "RAdam"),
    ({"step", "exp_avg", "exp_inf"}, {}, "Adamax"),
    ({"step", "sum"}, {"lr_decay": 0}, "Adagrad"),
    ({"step", "square_avg", "acc_delta"}, {"rho": 0.9}, "Adadelta"),
    ({"step", "square_avg", "momentum_buffer", "grad_avg"}, {"alpha": 0.99}, "RMSprop"),
    ({"step", "prev", "step_size"}, {"etas": [0.5, 1.2]}, "Rprop"),
    ({"step", "eta", "mu", "ax"}, {"t0": 1e6}, "ASGD"),
    ({"exp_avg"}, {"betas": [0.9, 0.99]}, "Lion"),
])
def test_the_elementwise_optimizers_are_recognised_as_exact(keys, hyper, name):
    assert recognise(keys, [hyper]) == (name, None)


@pytest.mark.parametrize("keys, hyper, name, why", [
    ({"step", "exp_avg_sq_row", "exp_avg_sq_col"}, {}, "Adafactor", "factored"),
    ({"step", "exp_avg", "exp_avg_sq"}, {"trust_clip": False}, "LAMB/LARS", "trust ratio"),
    ({"momentum_buffer"}, {"ns_steps": 5}, "Muon", "orthogonalises"),
    ({"step", "GG", "Q", "exp_avg"}, {}, "Shampoo/SOAP", "preconditioners"),
    ({"step", "state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2"}, {}, "bitsandbytes 8-bit", "block-quantized"),
    ({"step", "exp_avg", "mystery"}, {}, "unknown", "'mystery'"),
])
def test_the_whole_tensor_optimizers_and_unknown_keys_are_refused_by_name(keys, hyper, name, why):
    got, reason = recognise(keys, [hyper])
    assert got == name and why in reason


def _follower(states: dict, groups: list[dict], shape=(4, 2)):
    arrays = {}
    state = {}
    names = {}
    for pid, (name, entry) in enumerate(states.items()):
        names[pid] = name
        arrays[name] = np.zeros(shape, np.float32)
        state[pid] = {}
        for key, value in entry.items():
            if isinstance(value, np.ndarray):
                arrays[f"{name}::{key}"] = value
                state[pid][key] = ArrayTensor(TensorSpec(F32, value.shape), value)
            else:
                state[pid][key] = value
    parsed = parse_optimizer({"state": state, "param_groups": groups}, "opt", "f.pt")
    table = ParamTable.from_stored({n: ArrayTensor(TensorSpec(F32, a.shape), a) for n, a in arrays.items()})
    return OptimizerFollower(parsed, ParamMap(names, "test")), table


def _concat(table, names=("a", "b")):
    specs = tuple(table.spec(n) for n in names)
    return Step(Concat(axis=0), names, ("o",), specs, tuple(Concat(axis=0).infer(specs, list(names))))


def test_parts_in_two_param_groups_are_refused():
    m = np.ones((4, 2), np.float32)
    follower, table = _follower({"a": {"momentum_buffer": m}, "b": {"momentum_buffer": m}},
                                [{"params": [0], "dampening": 0, "lr": 0.1}, {"params": [1], "dampening": 0, "lr": 0.2}])
    with pytest.raises(PlanError, match=re.escape(RULE) + ".*'a' is in param group 0 and 'b' in param group 1"):
        follower.lift(_concat(table), [], table, RULE)


def test_unequal_python_number_steps_are_refused_and_equal_ones_are_kept_once():
    m = np.ones((4, 2), np.float32)
    groups = [{"params": [0, 1], "amsgrad": False}]
    follower, table = _follower({"a": {"step": 3, "exp_avg": m}, "b": {"step": 4, "exp_avg": m}}, groups)
    with pytest.raises(PlanError, match="'step' is 3 for 'a' but 4 for 'b'"):
        follower.lift(_concat(table), [], table, RULE)
    follower, table = _follower({"a": {"step": 3, "exp_avg": m}, "b": {"step": 3, "exp_avg": m}}, groups)
    steps = follower.lift(_concat(table), [], table, RULE)
    assert [s.outputs for s in steps] == [("o::exp_avg",)] and follower.numbers["o"] == {"step": 3}


def test_step_tensors_are_merged_by_merge_equal_which_refuses_unequal_parts_when_it_runs():
    from fusectl.errors import ComputeError
    m = np.ones((4, 2), np.float32)
    groups = [{"params": [0, 1], "amsgrad": False}]
    follower, table = _follower({"a": {"step": np.array(3.0, np.float32), "exp_avg": m},
                                 "b": {"step": np.array(4.0, np.float32), "exp_avg": m}}, groups)
    steps = follower.lift(_concat(table), [], table, RULE)
    merge = next(s for s in steps if s.outputs == ("o::step",))
    assert merge.op.kind == "merge_equal"
    with pytest.raises(ComputeError):
        merge.op.apply([np.array(3.0, np.float32), np.array(4.0, np.float32)])


def test_a_split_copies_the_step_and_splits_the_moments():
    m = np.arange(8, dtype=np.float32).reshape(4, 2)
    follower, table = _follower({"a": {"step": np.array(2.0, np.float32), "exp_avg": m}},
                                [{"params": [0], "amsgrad": False}])
    split = Split(axis=0, sizes=(1, 3), parts=2)
    step = Step(split, ("a",), ("x", "y"), (table.spec("a"),), tuple(split.infer([table.spec("a")], ["a"])))
    steps = follower.lift(step, [], table, RULE)
    assert {s.op.kind for s in steps} == {"split", "replicate"}
    exp = next(s for s in steps if s.op.kind == "split")
    assert exp.op == split and exp.outputs == ("x::exp_avg", "y::exp_avg")


def test_a_refused_optimizer_names_itself_and_the_rule():
    m = np.ones((4, 2), np.float32)
    follower, table = _follower({"a": {"exp_avg_sq_row": m[:, 0].copy(), "exp_avg_sq_col": m[0].copy()},
                                 "b": {"exp_avg_sq_row": m[:, 0].copy(), "exp_avg_sq_col": m[0].copy()}},
                                [{"params": [0, 1]}])
    with pytest.raises(PlanError, match=re.escape(RULE) + ".*Adafactor is not elementwise.*factored"):
        follower.lift(_concat(table), [], table, RULE)


def test_a_parameter_without_state_beside_one_with_state_is_refused():
    m = np.ones((4, 2), np.float32)
    follower, table = _follower({"a": {"exp_avg": m}, "b": {}}, [{"params": [0, 1], "amsgrad": False}])
    with pytest.raises(PlanError, match="'a' has optimizer state 'exp_avg' but 'b' has none"):
        follower.lift(_concat(table), [], table, RULE)


# --- through plan and the command line ----------------------------------------------------------


def _order(tmp_path):
    from fusectl.io.checkpoint import open_checkpoint
    table = open_checkpoint(str(TORCH / "training.pt")).table
    path = tmp_path / "order.json"
    path.write_text(json.dumps([n for n in table.entries if "running_" not in n and "num_batches" not in n]))
    return str(path)


def test_plan_lists_the_state_steps_under_their_parameter(tmp_path):
    planned = api.plan(str(TORCH / "training.pt"), ["lstm-to-onnx"], param_order=_order(tmp_path))
    group = next(g for g in planned.plan.groups if g.rule == "B-forward")
    outputs = [s.outputs for s in group.steps]
    assert outputs == [("rnn.bias_l0.d0",), ("rnn.bias_l0.d0::exp_avg",), ("rnn.bias_l0.d0::exp_avg_sq",),
                       ("rnn.bias_l0.d0::step",)]
    assert group.steps[1].op == group.steps[0].op and group.steps[3].op.kind == "merge_equal"
    assert "rnn.W_l0::exp_avg F32[2, 16, 8]" in planned.to_text()


def test_an_order_the_shapes_cannot_prove_is_exit_2_naming_the_two_tensors(tmp_path):
    result = run_cli("plan", TORCH / "training.pt", "-r", "lstm-to-onnx")
    assert result.exit_code == 2
    assert "'cnn.1.bias' and 'cnn.1.running_mean'" in result.stderr and "--param-order FILE" in result.stderr


def test_a_fold_on_a_training_checkpoint_is_refused_with_exit_2_and_nothing_written(tmp_path):
    result = run_cli("plan", TORCH / "training.pt", "-r", "conv-bn-fold", "--param-order", _order(tmp_path))
    assert result.exit_code == 2
    assert "optimizer state (Adam/AdamW" in result.stderr and "bn_fold computes" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["order.json"]


# --- inspect --------------------------------------------------------------------------------------


def test_inspect_shows_the_optimizer_its_groups_state_keys_and_where_the_order_came_from(tmp_path):
    order = _order(tmp_path)
    report = api.inspect(str(TORCH / "model-state.pt"), param_order=order).to_json()["optimizer"]
    assert report["where"] == "optimizer_state" and report["kind"] == "SGD" and report["exact"] is True
    assert report["order_from"] == order and report["problem"] is None
    assert report["groups"][0]["params"] == 17 and report["groups"][0]["hyperparameters"]["momentum"] == 0.9
    assert report["parameters"]["cnn.0.weight"] == {"id": 0, "group": 0, "state": ["momentum_buffer"]}
    text = api.inspect(str(TORCH / "model-state.pt"), param_order=order).to_text()
    assert "optimizer: optimizer_state: SGD, 1 group(s), moves exactly" in text and f"order from {order}" in text


def test_inspect_shows_an_optimizer_it_cannot_map_with_the_problem_and_none_where_there_is_none():
    report = api.inspect(str(TORCH / "training.pt")).to_json()
    assert report["optimizer"]["kind"] == "Adam/AdamW" and report["optimizer"]["parameters"] is None
    assert "'cnn.1.bias' and 'cnn.1.running_mean'" in report["optimizer"]["problem"]
    assert api.inspect(str(FIXTURES / "tied-embeddings.safetensors")).to_json()["optimizer"] is None
    result = run_cli("inspect", TORCH / "training.pt", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["optimizer"]["where"] == "optimizer_state_dict"
