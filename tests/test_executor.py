"""Running a plan (``fusectl.executor``): steps become frozen tasks; equal tasks are one; each
task's outputs are freed after their last real use; one function applies a plan for fuse,
unfuse, verify and export."""

from __future__ import annotations

import importlib
import numpy as np
import pytest
from safetensors.numpy import save_file

from fusectl.errors import ComputeError, PlanError
from fusectl.executor import (Evaluation, OpaqueTensor, StepOutput, is_exact, recover_inputs, run_plan,
                              source_of, walk)
from fusectl.io.checkpoint import open_checkpoint
from fusectl.planner import make_plan
from fusectl.rules.schema import load_rules
from fusectl.tensors import LazyTensor


def table_of(tmp_path, tensors, aliases=None):
    path = tmp_path / "m.safetensors"
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path), metadata=aliases)
    return open_checkpoint(str(path)).table


def rules(body):
    return load_rules("version = 1\n" + body, "rules/test.toml", None)


SPLIT_THEN_TRANSPOSE = """
[[rule]]
name = "s"
op = "split"
input = "l{i:int}.w"
outputs = ["l{i:int}.a", "l{i:int}.b"]
[[rule]]
name = "t"
op = "transpose"
input = "l{i:int}.a"
output = "l{i:int}.at"
"""


def test_the_planned_table_is_the_one_run_plan_makes(tmp_path):
    w = np.arange(48, dtype=np.float32).reshape(6, 8)
    table = table_of(tmp_path, {"l0.w": w, "l1.w": w + 1})
    plan, planned = make_plan(table, [rules(SPLIT_THEN_TRANSPOSE)])
    ran = run_plan(table, plan, "test")
    assert ran.names() == planned.names() == ["l0.at", "l0.b", "l1.at", "l1.b"]
    for name in ran.names():
        assert ran[name] == planned[name]  # equal tasks: the same op over the same tensors
        assert hash(ran[name]) == hash(planned[name])
    np.testing.assert_array_equal(ran["l1.at"].read(), (w + 1)[:3].T)
    np.testing.assert_array_equal(ran["l0.b"].read(), w[3:])


def test_tied_members_treated_alike_are_one_task_computed_once(tmp_path, monkeypatch):
    emb = np.arange(12, dtype=np.float32).reshape(3, 4)
    table = table_of(tmp_path, {"emb": emb}, {"head": "emb"})
    assert table.ties() == [["emb", "head"]]
    plan, _ = make_plan(table, [rules('[[rule]]\nname = "t"\nop = "transpose"\ninput = "{x}"\noutput = "{x}_t"\n')])
    result = run_plan(table, plan, "test")
    assert result.ties() == [["emb_t", "head_t"]]
    assert result["emb_t"] is result["head_t"]
    calls = []
    op = plan.steps[0].op
    original = type(op).apply
    monkeypatch.setattr(type(op), "apply", lambda self, arrays: calls.append(1) or original(self, arrays))
    evaluation = Evaluation([result["emb_t"], result["head_t"]])
    np.testing.assert_array_equal(evaluation.array(result["emb_t"]), emb.T)
    np.testing.assert_array_equal(evaluation.array(result["head_t"]), emb.T)
    assert len(calls) == 1 and evaluation.cached() == 0


def test_outputs_copied_as_byte_ranges_are_not_uses_so_nothing_stays_cached(tmp_path):
    w = np.arange(64, dtype=np.float32).reshape(8, 8)
    table = table_of(tmp_path, {"l0.w": w})
    plan, _ = make_plan(table, [rules(SPLIT_THEN_TRANSPOSE)])
    result = run_plan(table, plan, "test")
    assert result["l0.b"].byte_ranges() is not None and result["l0.at"].byte_ranges() is None
    evaluation = Evaluation([result[n] for n in result.names()])
    for name in result.names():
        evaluation.array(result[name])
    assert evaluation.cached() == 0


def test_a_chain_of_tasks_reports_exactness_and_where_its_bytes_start(tmp_path):
    table = table_of(tmp_path, {"g": np.ones((2, 1), np.float32), "v": np.ones((2, 3), np.float32)})
    plan, _ = make_plan(table, [rules('[[rule]]\nname = "f"\nop = "weight_norm_fold"\ng = "g"\nv = "v"\n'
                                      'output = "w"\n[[rule]]\nname = "t"\nop = "transpose"\ninput = "w"\n'
                                      'output = "wt"\n')])
    result = run_plan(table, plan, "test")
    wt = result["wt"]
    assert isinstance(wt, StepOutput) and not is_exact(wt) and not wt.task.exact()
    assert source_of(wt) == table["g"].byte_ranges()[0]
    assert is_exact(table["g"])


def test_task_errors_name_the_rule_and_the_tensors(tmp_path):
    table = table_of(tmp_path, {"g": np.array([[np.inf]], np.float32), "v": np.ones((1, 1), np.float32)})
    plan, _ = make_plan(table, [rules('[[rule]]\nname = "f"\nop = "weight_norm_fold"\ng = "g"\nv = "v"\n'
                                      'output = "w"\n')])
    with pytest.raises(ComputeError, match=r"rule 'f'.*'g' \(1 non-finite\)"):
        run_plan(table, plan, "test")["w"].read()


def test_walk_yields_each_group_with_the_table_before_and_after(tmp_path):
    w = np.arange(16, dtype=np.float32).reshape(4, 4)
    table = table_of(tmp_path, {"l0.w": w})
    plan, _ = make_plan(table, [rules(SPLIT_THEN_TRANSPOSE)])
    seen = [(g.rule, before.names(), after.names()) for g, before, after in walk(table, plan, "test")]
    assert seen == [("s", ["l0.w"], ["l0.a", "l0.b"]), ("t", ["l0.a", "l0.b"], ["l0.at", "l0.b"])]
    assert table.names() == ["l0.w"]  # the input table is left alone


def test_recover_inputs_gives_data_through_exact_groups_and_names_through_others(tmp_path):
    w = np.arange(16, dtype=np.float32).reshape(4, 4)
    source = table_of(tmp_path, {"l0.w": w, "g": np.ones((4, 1), np.float32), "v": w})
    plan, _ = make_plan(source, [rules(SPLIT_THEN_TRANSPOSE + '[[rule]]\nname = "f"\nop = "weight_norm_fold"\n'
                                       'g = "g"\nv = "v"\noutput = "w"\n')])
    fused = run_plan(source, plan, "test")
    back = recover_inputs(fused, plan)
    assert back.names() == ["g", "l0.w", "v"]
    np.testing.assert_array_equal(back["l0.w"].read(), w)
    assert isinstance(back["g"], OpaqueTensor) and not back["g"].has_data()
    assert back.spec("v") == source.spec("v")
    with pytest.raises(PlanError, match="'v' is not recoverable"):
        back["v"].read()


def test_every_tensor_kind_implements_the_protocol():
    importlib.import_module("fusectl.io.formats.npz_file")  # defines its tensor kind

    def kinds(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from kinds(sub)

    found = {k.__name__ for k in kinds(LazyTensor)}
    assert {"FileTensor", "NpzMemberTensor", "StepOutput", "OpaqueTensor"} <= found
    for kind in kinds(LazyTensor):
        assert kind.read is not LazyTensor.read, kind
        assert "spec" in getattr(kind, "__dataclass_fields__", {}), kind
