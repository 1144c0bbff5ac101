"""The refuse guard (ops/guard.py): a matched tensor stops the plan with a PlanError naming it and
giving the rule's message (control characters in either escaped); it has no outputs, and through
a rules file it is a guard — a rule that need not match, left out when inverting."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ok, refused, write_rules, write_safetensors

from fusectl.dtypes import BY_NAME
from fusectl.errors import PlanError
from fusectl.ops import OPS
from fusectl.ops.guard import Refuse
from fusectl.rules.schema import load_rules
from fusectl.tensors import TensorSpec

SPEC = TensorSpec(BY_NAME["F32"], (4, 2))


def test_a_match_is_refused_naming_the_tensor_and_giving_the_message():
    with pytest.raises(PlanError) as err:
        Refuse(message="this LSTM has proj_size; use lstm-to-mxnet-fused").infer([SPEC], ["lstm.weight_hr_l0"])
    assert str(err.value) == "'lstm.weight_hr_l0': this LSTM has proj_size; use lstm-to-mxnet-fused"


def test_the_default_message():
    with pytest.raises(PlanError, match=r"^'w': this tensor is not supported by these rules$"):
        Refuse().infer([SPEC], ["w"])


def test_control_characters_in_the_name_and_the_message_are_escaped():
    with pytest.raises(PlanError) as err:
        Refuse(message="bad\x1b[31m red").infer([SPEC], ["evil\x07'name"])
    message = str(err.value)
    assert message == "'evil\\x07\\'name': bad\\x1b[31m red"
    assert "\x1b" not in message and "\x07" not in message


def test_a_guard_has_no_outputs_and_no_inverse():
    op = Refuse()
    assert op.output_count([SPEC]) == 0
    assert op.guard and Refuse.outputs_field is None
    assert op.inverse([SPEC]) is None
    assert OPS["refuse"] is Refuse
    assert Refuse.from_params(Refuse(message="m").params()) == Refuse(message="m")


def test_a_rules_file_loads_a_refuse_rule_with_its_message():
    ruleset = load_rules('version = 1\n[[rule]]\nop = "refuse"\ninput = "{p*}.weight_hr_l{k}"\n'
                         'message = "proj_size is not supported"\noptional = true\n', "guards.toml")
    rule = ruleset.rules[0]
    assert rule.op == Refuse(message="proj_size is not supported")
    assert rule.optional and rule.outputs == ()


GUARDS = """
version = 1
[[rule]]
name     = "no-proj"
op       = "refuse"
input    = "{p*}.weight_hr_l{k}"
message  = "this LSTM has proj_size; fusectl cannot lay it out for ONNX"
optional = true
"""


def test_fuse_stops_at_a_guarded_tensor_and_writes_nothing(cli, tmp_path):
    src = write_safetensors(tmp_path / "lstm.safetensors",
                            {"lstm.weight_hr_l0": np.zeros((2, 3), np.float32),
                             "lstm.weight_ih_l0": np.zeros((8, 3), np.float32)})
    rules = write_rules(tmp_path / "guards.toml", GUARDS)
    out = tmp_path / "out.safetensors"
    refused(cli("fuse", src, "-r", rules, "-o", out),
            "'lstm.weight_hr_l0': this LSTM has proj_size; fusectl cannot lay it out for ONNX",
            unwritten=[out])


def test_a_guard_that_matches_nothing_lets_the_plan_through(cli, tmp_path):
    src = write_safetensors(tmp_path / "lstm.safetensors", {"lstm.weight_ih_l0": np.zeros((8, 3), np.float32)})
    rules = write_rules(tmp_path / "guards.toml", GUARDS)
    result = ok(cli("plan", src, "-r", rules, "--json"))
    plan = result.json()
    assert plan["groups"] == []
    assert [p["name"] for p in plan["result"]["parameters"]] == ["lstm.weight_ih_l0"]
