"""Plans (steps.py): a step's inverse swaps inputs and outputs, a plan inverts group by group in
reverse (retying what exact steps untied, inverting [config] edits), a one-way step is refused
naming the rule and the tensors, and recorded ops are rebuilt or refused by kind."""

from __future__ import annotations

import hashlib

import pytest

from fusectl.config_edit import ConfigEdit
from fusectl.dtypes import BY_NAME
from fusectl.errors import PlanError
from fusectl.ops.dequantize import Dequantize
from fusectl.ops.layout import Concat, Rename, Split, Transpose
from fusectl.ops.reparam import WeightNormFold
from fusectl.steps import Plan, RuleOrigin, Step, StepGroup, op_from_record
from fusectl.tensors import TensorSpec

F32 = BY_NAME["F32"]


def spec(*shape, dtype=F32):
    return TensorSpec(dtype, shape)


def concat_step():
    return Step(Concat(axis=0), ("q", "k"), ("qk",), (spec(2, 4), spec(3, 4)), (spec(5, 4),))


def test_a_step_inverse_swaps_names_and_specs():
    inverse = concat_step().inverse()
    assert inverse.op == Split(axis=0, sizes=(2, 3), parts=2)
    assert inverse.inputs == ("qk",) and inverse.outputs == ("q", "k")
    assert inverse.input_specs == (spec(5, 4),)
    assert inverse.output_specs == (spec(2, 4), spec(3, 4))


def test_a_one_way_step_has_no_inverse():
    step = Step(Dequantize(), ("w", "s"), ("w",), (spec(2, 2, dtype=BY_NAME["F8_E4M3"]), spec(1, 1)),
                (spec(2, 2, dtype=BY_NAME["BF16"]),))
    assert step.inverse() is None


def test_group_kind_and_description():
    step = concat_step()
    assert StepGroup("attn-qkv", "rules.toml", (step,)).kind == "concat"
    assert StepGroup("cfg", "preset fp8-dequant", (), config=ConfigEdit(removes=("a",))).kind == "config"
    assert StepGroup("empty", "rules.toml", ()).kind == "none"
    assert StepGroup("attn-qkv", "rules.toml", (step,)).describe() == "rule 'attn-qkv' (rules.toml)"


def test_plan_steps_are_in_group_order_and_plans_add():
    a, b = concat_step(), Step(Rename(), ("x",), ("y",), (spec(2),), (spec(2),))
    first = Plan((StepGroup("one", "r", (a,)),))
    second = Plan((StepGroup("two", "r", (b,)),))
    both = first + second
    assert both.steps == [a, b]
    assert [g.rule for g in both.groups] == ["one", "two"]
    assert Plan().steps == [] and Plan().inverse() == Plan()


def test_the_inverse_runs_groups_and_steps_in_reverse():
    rename = Step(Rename(), ("a",), ("b",), (spec(2, 4),), (spec(2, 4),))
    transpose = Step(Transpose(perm=(1, 0)), ("b",), ("b",), (spec(2, 4),), (spec(4, 2),))
    plan = Plan((StepGroup("first", "r.toml", (concat_step(),)),
                 StepGroup("second", "r.toml", (rename, transpose))))
    inverse = plan.inverse()
    assert [g.rule for g in inverse.groups] == ["second", "first"]
    undo_second = inverse.groups[0].steps
    assert [s.op.kind for s in undo_second] == ["transpose", "rename"]
    assert undo_second[0].input_specs == (spec(4, 2),) and undo_second[1].outputs == ("a",)
    assert inverse.groups[1].steps[0].op.kind == "split"
    # inverting twice gives the same steps back
    assert plan.inverse().inverse().steps == plan.steps


def test_exact_groups_retie_what_they_untied():
    group = StepGroup("t", "r.toml", (Step(Transpose(), ("a",), ("a",), (spec(2, 3),), (spec(3, 2),)),),
                      untied=(("a", "b"),), untied_stored=(("a",),))
    undone = Plan((group,)).inverse().groups[0]
    assert undone.retie == (("a", "b"),) and undone.retie_stored == (("a",),)
    assert undone.untied == ()


def test_numeric_groups_do_not_retie():
    fold = Step(WeightNormFold(dim=0), ("g", "v"), ("w",), (spec(4, 1), spec(4, 3)), (spec(4, 3),))
    group = StepGroup("wn", "r.toml", (fold,), untied=(("v", "v2"),), untied_stored=(("v",),))
    undone = Plan((group,)).inverse().groups[0]
    assert undone.steps[0].op.kind == "weight_norm_unfold"
    assert undone.retie == () and undone.retie_stored == ()


def test_config_edits_are_listed_and_inverted():
    edit = ConfigEdit(removes=("quantization_config",), before='{"quantization_config": {}}')
    plan = Plan((StepGroup("a", "r", (concat_step(),)), StepGroup("cfg", "r", (), config=edit)))
    assert plan.config_edits() == [edit]
    inverse = plan.inverse()
    assert inverse.groups[0].config == ConfigEdit(restore='{"quantization_config": {}}')
    assert inverse.config_edits() == [inverse.groups[0].config]


def test_an_unbound_config_edit_cannot_be_inverted():
    plan = Plan((StepGroup("cfg", "r", (), config=ConfigEdit(removes=("a",))),))
    with pytest.raises(PlanError, match="cannot be undone from the rules file alone"):
        plan.inverse()


def test_a_one_way_step_is_refused_naming_the_rule_and_its_inputs():
    deq = Step(Dequantize(), ("m.weight", "m.weight_scale_inv"), ("m.weight",),
               (spec(2, 2, dtype=BY_NAME["F8_E4M3"]), spec(1, 1)), (spec(2, 2, dtype=BY_NAME["BF16"]),))
    plan = Plan((StepGroup("fp8", "preset fp8-dequant", (deq,)),))
    with pytest.raises(PlanError) as err:
        plan.inverse()
    assert str(err.value) == ("rule 'fp8' (preset fp8-dequant) is one-way: its dequantize step on "
                              "'m.weight', 'm.weight_scale_inv' cannot be undone")


def test_rule_origin_names_its_text_by_sha256():
    origin = RuleOrigin("version = 1\n", 2, (("hidden_size", 8),), (128, 128))
    assert origin.sha256 == hashlib.sha256(b"version = 1\n").hexdigest()
    assert RuleOrigin("é", 0).sha256 == hashlib.sha256("é".encode("utf-8")).hexdigest()


def test_op_from_record_rebuilds_an_op_from_its_params():
    op = Concat(axis=1, sizes=(2, 3))
    assert op_from_record("concat", op.params()) == op
    assert op_from_record("transpose", {"perm": [1, 0]}) == Transpose(perm=(1, 0))


def test_op_from_record_refuses_an_unknown_kind():
    with pytest.raises(PlanError) as err:
        op_from_record("warp", {})
    assert str(err.value) == "recorded op 'warp' is not known to this fusectl version"
