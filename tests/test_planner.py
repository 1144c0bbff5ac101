"""Binding rules to a parameter table (SPEC §1, §3): the plan is computed from headers
alone, rules apply in order, and every misfit names the tensor and the rule."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import save_file

import fusectl.tensors
from conftest import LLAMA, llama_tensors, refuse_case, write_rules, write_safetensors
from fusectl.errors import FusectlError, PlanError
from fusectl.executor import Evaluation, run_plan
from fusectl.io.checkpoint import open_checkpoint
from fusectl.planner import make_plan
from fusectl.rules.inverse import invert_rule, invert_ruleset
from fusectl.rules.schema import load_rules


SRC = "rules/test.toml"


def open_table(tmp_path, tensors: dict[str, np.ndarray], name="model.safetensors"):
    path = tmp_path / name
    save_file({k: np.array(v, order="C") for k, v in tensors.items()}, str(path))
    return open_checkpoint(str(path)).table


def rules(body: str, config=None, source=SRC):
    return load_rules("version = 1\n" + body, source, config)


def values(table, names=None) -> dict[str, np.ndarray]:
    names = table.names() if names is None else names
    m = Evaluation([table[n] for n in names])
    return {n: np.array(m.array(table[n])) for n in names}


def rows(n: int, cols: int = 2, start: float = 0) -> np.ndarray:
    return (np.arange(n * cols, dtype=np.float32) + start).reshape(n, cols)


# --- order ------------------------------------------------------------------------------


def test_rules_apply_in_order_and_see_earlier_outputs(tmp_path):
    table = open_table(tmp_path, {
        "l.0.query.w": rows(2, start=0),
        "l.0.k.w": rows(1, start=100),
        "l.1.query.w": rows(2, start=200),
        "l.1.k.w": rows(1, start=300),
    })
    rs = rules('''
[[rule]]
name = "rename-q"
op = "rename"
input = "l.{i}.query.w"
output = "l.{i}.q.w"

[[rule]]
name = "fuse-qk"
op = "concat"
inputs = ["l.{i}.q.w", "l.{i}.k.w"]
output = "l.{i}.qk.w"
''')
    plan, out = make_plan(table, [rs])
    assert [g.rule for g in plan.groups] == ["rename-q", "fuse-qk"]
    assert out.names() == ["l.0.qk.w", "l.1.qk.w"]
    # the second rule consumed what the first produced
    assert [s.inputs for s in plan.groups[1].steps] == [("l.0.q.w", "l.0.k.w"), ("l.1.q.w", "l.1.k.w")]
    got = values(out)
    assert got["l.1.qk.w"].tolist() == [[200, 201], [202, 203], [300, 301]]
    # the input table is untouched
    assert table.names() == ["l.0.k.w", "l.0.query.w", "l.1.k.w", "l.1.query.w"]


def test_rule_order_matters(tmp_path):
    table = open_table(tmp_path, {"a.w": rows(1), "k.w": rows(1)})
    rs = rules('''
[[rule]]
name = "fuse"
op = "concat"
inputs = ["q.w", "k.w"]
output = "qk.w"

[[rule]]
name = "rename"
op = "rename"
input = "a.w"
output = "q.w"
''')
    # 'fuse' runs first, before any q.w exists: k.w is found but q.w is not
    with pytest.raises(PlanError) as e:
        make_plan(table, [rs])
    assert "'fuse'" in str(e.value)


def test_earlier_rule_removes_names_later_rules_see(tmp_path):
    table = open_table(tmp_path, {"a.w": rows(1)})
    rs = rules('''
[[rule]]
name = "first"
op = "rename"
input = "a.w"
output = "b.w"

[[rule]]
name = "second"
op = "rename"
input = "a.w"
output = "c.w"
''')
    with pytest.raises(PlanError) as e:
        make_plan(table, [rs])
    assert "'second'" in str(e.value) and "a.w" in str(e.value)


def test_several_rulesets_apply_in_order(tmp_path):
    table = open_table(tmp_path, {"a": rows(2)})
    one = rules('[[rule]]\nname = "r1"\nop = "rename"\ninput = "a"\noutput = "b"\n', source="one.toml")
    two = rules('[[rule]]\nname = "r2"\nop = "transpose"\ninput = "b"\noutput = "c"\n', source="two.toml")
    plan, out = make_plan(table, [one, two])
    assert [(g.rule, g.source) for g in plan.groups] == [("r1", "one.toml"), ("r2", "two.toml")]
    assert values(out)["c"].tolist() == [[0, 2], [1, 3]]


# --- missing and unmatched --------------------------------------------------------------


def test_missing_input_names_the_tensor_and_the_rule(tmp_path):
    table = open_table(tmp_path, {
        "model.layers.0.self_attn.q_proj.weight": rows(2),
        "model.layers.0.self_attn.k_proj.weight": rows(2),
        "model.layers.0.self_attn.v_proj.weight": rows(2),
        "model.layers.1.self_attn.q_proj.weight": rows(2),
        "model.layers.1.self_attn.k_proj.weight": rows(2),
    })
    rs = rules('''
[[rule]]
name = "attn-qkv"
op = "concat"
inputs = ["model.layers.{i}.self_attn.q_proj.weight",
          "model.layers.{i}.self_attn.k_proj.weight",
          "model.layers.{i}.self_attn.v_proj.weight"]
output = "model.layers.{i}.self_attn.qkv_proj.weight"
''')
    with pytest.raises(PlanError) as e:
        make_plan(table, [rs])
    msg = str(e.value)
    assert "model.layers.1.self_attn.v_proj.weight" in msg
    assert "attn-qkv" in msg and SRC in msg


def test_missing_first_input_is_found_from_a_later_pattern(tmp_path):
    table = open_table(tmp_path, {"l.0.q": rows(1), "l.0.k": rows(1), "l.1.k": rows(1)})
    rs = rules('[[rule]]\nname = "qk"\nop = "concat"\ninputs = ["l.{i}.q", "l.{i}.k"]\noutput = "l.{i}.qk"\n')
    with pytest.raises(PlanError) as e:
        make_plan(table, [rs])
    assert "l.1.q" in str(e.value) and "'qk'" in str(e.value)


def test_rule_matching_nothing_is_an_error(tmp_path):
    table = open_table(tmp_path, {"encoder.w": rows(1)})
    rs = rules('[[rule]]\nname = "bn"\nop = "drop"\ninput = "{p*}.num_batches_tracked"\n')
    with pytest.raises(PlanError) as e:
        make_plan(table, [rs])
    msg = str(e.value)
    assert "'bn'" in msg and SRC in msg and "{p*}.num_batches_tracked" in msg


def test_optional_rule_matching_nothing_is_skipped(tmp_path):
    table = open_table(tmp_path, {"encoder.w": rows(1)})
    rs = rules('[[rule]]\nname = "bn"\nop = "drop"\ninput = "{p*}.num_batches_tracked"\noptional = true\n'
               '[[rule]]\nname = "mv"\nop = "rename"\ninput = "encoder.w"\noutput = "enc.w"\n')
    plan, out = make_plan(table, [rs])
    assert [g.rule for g in plan.groups] == ["mv"]
    assert out.names() == ["enc.w"]


def test_rules_file_where_no_rule_matches_is_an_error(tmp_path):
    # every rule optional, none matching: the file does not fit this model at all
    table = open_table(tmp_path, {"encoder.w": rows(1)})
    rs = rules('[[rule]]\nname = "bn"\nop = "drop"\ninput = "{p*}.num_batches_tracked"\noptional = true\n')
    with pytest.raises(PlanError) as e:
        make_plan(table, [rs])
    assert SRC in str(e.value)


def test_optional_rule_that_matches_still_applies(tmp_path):
    table = open_table(tmp_path, {"bn.num_batches_tracked": np.zeros((), np.int64), "bn.w": rows(1)})
    rs = rules('[[rule]]\nname = "bn"\nop = "drop"\ninput = "{p*}.num_batches_tracked"\noptional = true\n')
    plan, out = make_plan(table, [rs])
    assert len(plan.steps) == 1
    assert out.names() == ["bn.w"]


def test_vanishing_dot_binds_top_level_names(tmp_path):
    table = open_table(tmp_path, {"weight_ih_l0": rows(4), "enc.rnn.weight_ih_l0": rows(4)})
    rs = rules('[[rule]]\nname = "lstm"\nop = "reorder"\ninput = "{p*}.weight_ih_l{k:int}"\n'
               'output = "{p*}.W_l{k:int}"\nchunks = 4\norder = [0, 3, 1, 2]\n')
    _, out = make_plan(table, [rs])
    assert out.names() == ["W_l0", "enc.rnn.W_l0"]
    assert values(out)["W_l0"][:, 0].tolist() == [0, 6, 2, 4]


# --- over ----------------------------------------------------------------------------


def test_concat_over_int_placeholder_sorts_numerically(tmp_path):
    experts = {e: np.full((1, 2), e, np.float32) for e in (10, 2, 0, 1)}
    table = open_table(tmp_path, {f"moe.experts.{e}.w": a for e, a in experts.items()})
    rs = rules('[[rule]]\nname = "gather"\nop = "concat"\ninput = "moe.experts.{e:int}.w"\n'
               'output = "moe.w"\nover = "e"\n')
    plan, out = make_plan(table, [rs])
    (step,) = plan.steps
    assert step.inputs == ("moe.experts.0.w", "moe.experts.1.w", "moe.experts.2.w", "moe.experts.10.w")
    assert values(out)["moe.w"][:, 0].tolist() == [0, 1, 2, 10]


def test_concat_over_gathers_per_binding_of_the_other_placeholders(tmp_path):
    table = open_table(tmp_path, {
        f"l.{i}.e.{e}.w": np.full((1, 1), 10 * i + e, np.float32) for i in (0, 1) for e in (0, 1, 2)
    })
    rs = rules('[[rule]]\nname = "g"\nop = "concat"\ninput = "l.{i}.e.{e:int}.w"\noutput = "l.{i}.w"\nover = "e"\n')
    plan, out = make_plan(table, [rs])
    assert len(plan.steps) == 2
    got = values(out)
    assert got["l.0.w"][:, 0].tolist() == [0, 1, 2]
    assert got["l.1.w"][:, 0].tolist() == [10, 11, 12]


def test_stack_over_sorts_numerically(tmp_path):
    table = open_table(tmp_path, {f"x.{e}.w": np.full((2,), e, np.float32) for e in range(12)})
    rs = rules('[[rule]]\nname = "s"\nop = "stack"\ninput = "x.{e:int}.w"\noutput = "x.w"\nover = "e"\n')
    plan, out = make_plan(table, [rs])
    assert plan.steps[0].output_specs[0].shape == (12, 2)
    assert values(out)["x.w"][:, 0].tolist() == list(range(12))


@pytest.mark.parametrize("indices", [(0, 1, 3), (1, 2), (0, 2)])
def test_stack_over_indices_not_0_to_n_is_an_error(tmp_path, indices):
    table = open_table(tmp_path, {f"moe.{e}.w": rows(2) for e in indices})
    rs = rules('[[rule]]\nname = "experts"\nop = "stack"\ninput = "moe.{e:int}.w"\noutput = "moe.w"\nover = "e"\n')
    with pytest.raises(PlanError) as e:
        make_plan(table, [rs])
    assert "'experts'" in str(e.value)


def test_unstack_names_outputs_by_index(tmp_path):
    w = np.arange(12, dtype=np.float32).reshape(3, 2, 2)
    table = open_table(tmp_path, {"m.experts.w": w})
    rs = rules('[[rule]]\nname = "u"\nop = "unstack"\ninput = "{p*}.experts.w"\n'
               'output = "{p*}.experts.{e}.w"\nover = "e"\n')
    _, out = make_plan(table, [rs])
    assert out.names() == ["m.experts.0.w", "m.experts.1.w", "m.experts.2.w"]
    assert values(out)["m.experts.2.w"].tolist() == [[8, 9], [10, 11]]


def test_unstack_of_a_scalar_is_a_plan_error(tmp_path):
    table = open_table(tmp_path, {"m.experts.w": np.zeros((), np.float32)})
    rs = rules('[[rule]]\nname = "u"\nop = "unstack"\ninput = "{p*}.experts.w"\n'
               'output = "{p*}.experts.{e}.w"\nover = "e"\n')
    with pytest.raises(PlanError) as e:
        make_plan(table, [rs])
    assert "m.experts.w" in str(e.value) and "'u'" in str(e.value)


# --- collisions ----------------------------------------------------------------------


def test_output_colliding_with_an_existing_name_is_an_error(tmp_path):
    table = open_table(tmp_path, {"a.w": rows(1), "b.w": rows(1)})
    rs = rules('[[rule]]\nname = "mv"\nop = "rename"\ninput = "a.w"\noutput = "b.w"\n')
    with pytest.raises(PlanError) as e:
        make_plan(table, [rs])
    assert "b.w" in str(e.value) and "'mv'" in str(e.value)


def test_two_bindings_making_one_output_is_an_error(tmp_path):
    table = open_table(tmp_path, {"a.1.x": rows(1), "a.1.y": rows(1)})
    rs = rules('[[rule]]\nname = "squash"\nop = "rename"\ninput = "a.{i}.{j}"\noutput = "b.{i}"\n')
    with pytest.raises(PlanError) as e:
        make_plan(table, [rs])
    assert "b.1" in str(e.value) and "'squash'" in str(e.value)


def test_split_outputs_colliding_with_each_other(tmp_path):
    table = open_table(tmp_path, {"w": rows(4)})
    rs = rules('[[rule]]\nname = "sp"\nop = "split"\ninput = "w"\noutputs = ["p", "p"]\n')
    with pytest.raises(PlanError) as e:
        make_plan(table, [rs])
    assert "'sp'" in str(e.value) and "'p'" in str(e.value)


def test_in_place_transform_keeps_the_name(tmp_path):
    # llama-rope writes the same names it reads
    q = rows(8)
    table = open_table(tmp_path, {"q_proj.weight": q})
    rs = rules('[[rule]]\nname = "rope"\nop = "rope_permute"\ninput = "q_proj.weight"\n'
               'output = "q_proj.weight"\nheads = 2\n')
    _, out = make_plan(table, [rs])
    assert out.names() == ["q_proj.weight"]
    assert values(out)["q_proj.weight"][:, 0].tolist() == [0, 4, 2, 6, 8, 12, 10, 14]


# --- plan-time checks ---------------------------------------------------------------


def test_shape_mismatch_names_tensor_and_rule(tmp_path):
    table = open_table(tmp_path, {"l.0.q": rows(2, cols=3), "l.0.k": rows(2, cols=4)})
    rs = rules('[[rule]]\nname = "qk"\nop = "concat"\ninputs = ["l.{i}.q", "l.{i}.k"]\noutput = "l.{i}.qk"\n')
    with pytest.raises(PlanError) as e:
        make_plan(table, [rs])
    assert "l.0.k" in str(e.value) and "'qk'" in str(e.value)


def test_dtype_mismatch_names_tensor_and_rule(tmp_path):
    table = open_table(tmp_path, {"l.0.q": rows(2), "l.0.k": rows(2).astype(np.float16)})
    rs = rules('[[rule]]\nname = "qk"\nop = "concat"\ninputs = ["l.{i}.q", "l.{i}.k"]\noutput = "l.{i}.qk"\n')
    with pytest.raises(PlanError) as e:
        make_plan(table, [rs])
    assert "l.0.k" in str(e.value) and "'qk'" in str(e.value)


def test_split_sizes_from_config_vars(tmp_path):
    table = open_table(tmp_path, {"l.0.qkv": rows(8)})
    rs = rules('''
[vars]
heads = "config:num_attention_heads"
kv = "config:num_key_value_heads"
hd = "config:hidden_size // heads"
[[rule]]
name = "unfuse"
op = "split"
input = "l.{i}.qkv"
outputs = ["l.{i}.q", "l.{i}.k", "l.{i}.v"]
sizes = ["heads * hd", "kv * hd", "kv * hd"]
''', config={"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 4})
    plan, out = make_plan(table, [rs])
    assert [s.shape for s in plan.steps[0].output_specs] == [(4, 2), (2, 2), (2, 2)]
    assert values(out)["l.0.v"][:, 0].tolist() == [12, 14]


def test_split_sizes_not_fitting_names_tensor_and_rule(tmp_path):
    table = open_table(tmp_path, {"l.0.qkv": rows(8)})
    rs = rules('[[rule]]\nname = "unfuse"\nop = "split"\ninput = "l.{i}.qkv"\n'
               'outputs = ["l.{i}.q", "l.{i}.k"]\nsizes = [4, 2]\n')
    with pytest.raises(PlanError) as e:
        make_plan(table, [rs])
    assert "l.0.qkv" in str(e.value) and "'unfuse'" in str(e.value)


def test_name_binding_two_ways_names_the_rule(tmp_path):
    table = open_table(tmp_path, {"wx111": rows(1)})
    rs = rules('[[rule]]\nname = "odd"\nop = "rename"\ninput = "w{a}1{b:int}"\noutput = "v.{a}.{b}"\n')
    with pytest.raises(FusectlError) as e:
        make_plan(table, [rs])
    assert "'odd'" in str(e.value) and "wx111" in str(e.value)


def test_steps_record_specs(tmp_path):
    table = open_table(tmp_path, {"a": rows(3, cols=2), "b": rows(1, cols=2)})
    rs = rules('[[rule]]\nname = "c"\nop = "concat"\ninputs = ["a", "b"]\noutput = "ab"\n')
    plan, out = make_plan(table, [rs])
    (step,) = plan.steps
    assert step.inputs == ("a", "b") and step.outputs == ("ab",)
    assert [s.shape for s in step.input_specs] == [(3, 2), (1, 2)]
    assert [(str(s.dtype), s.shape) for s in step.output_specs] == [("F32", (4, 2))]
    assert out.spec("ab") == step.output_specs[0]


# --- inverse ----------------------------------------------------------------------------


def test_inverse_of_drop_names_the_rule(tmp_path):
    table = open_table(tmp_path, {"bn.num_batches_tracked": np.zeros((), np.int64), "w": rows(1)})
    rs = rules('''
[[rule]]
name = "keep-w"
op = "rename"
input = "w"
output = "v"

[[rule]]
name = "drop-counter"
op = "drop"
input = "{p*}.num_batches_tracked"
''')
    plan, _ = make_plan(table, [rs])
    with pytest.raises(PlanError) as e:
        plan.inverse()
    msg = str(e.value)
    assert "drop-counter" in msg and SRC in msg


def test_inverse_plan_restores_names_and_bytes(tmp_path):
    q, k, v = rows(4, 3, 0), rows(2, 3, 100), rows(2, 3, 200)
    w = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    tensors = {
        "l.0.q": q, "l.0.k": k, "l.0.v": v,
        "l.1.q": q + 1, "l.1.k": k + 1, "l.1.v": v + 1,
        "gate": w, "e.0": rows(2), "e.1": rows(2, start=7),
    }
    table = open_table(tmp_path, tensors)
    rs = rules('''
[[rule]]
name = "il"
op = "interleave"
inputs = ["l.{i}.q", "l.{i}.k", "l.{i}.v"]
output = "l.{i}.qkv"
groups = 2

[[rule]]
name = "t"
op = "transpose"
input = "gate"
output = "gate_t"
perm = [2, 0, 1]

[[rule]]
name = "st"
op = "stack"
input = "e.{n:int}"
output = "e"
over = "n"
axis = 1

[[rule]]
name = "flat"
op = "reshape"
input = "e"
output = "e_flat"
shape = [-1]
''')
    plan, fused = make_plan(table, [rs])
    assert fused.names() == ["e_flat", "gate_t", "l.0.qkv", "l.1.qkv"]
    inverse = plan.inverse()
    assert [g.rule for g in inverse.groups] == ["flat", "st", "t", "il"]
    back = run_plan(fused, inverse, "unfuse")
    assert back.names() == sorted(tensors)
    got = values(back)
    for name, array in tensors.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape
        assert got[name].tobytes() == array.tobytes(), name


def test_inverted_rules_restore_the_checkpoint(tmp_path):
    """``unfuse -r``: the rules inverted one by one, in reverse order."""
    tensors = {f"x.{e}.w": np.full((2, 2), e, np.float32) for e in range(11)}
    tensors.update({"l.0.q": rows(4), "l.0.k": rows(2, start=50), "w": rows(3, cols=4)})
    table = open_table(tmp_path, tensors)
    rs = rules('''
[[rule]]
name = "s"
op = "stack"
input = "x.{e:int}.w"
output = "x.w"
over = "e"

[[rule]]
name = "c"
op = "concat"
inputs = ["l.{i}.q", "l.{i}.k"]
output = "l.{i}.qk"
sizes = [4, 2]

[[rule]]
name = "r"
op = "reorder"
input = "w"
output = "w2"
chunks = 3
order = [2, 0, 1]
''')
    _, fused = make_plan(table, [rs])
    assert fused.names() == ["l.0.qk", "w2", "x.w"]
    inverse = invert_ruleset(rs)
    assert [r.name for r in inverse.rules] == ["r (inverse)", "c (inverse)", "s (inverse)"]
    _, back = make_plan(fused, [inverse])
    assert back.names() == sorted(tensors)
    got = values(back)
    for name, array in tensors.items():
        assert got[name].tobytes() == array.tobytes() and got[name].shape == array.shape, name


@pytest.mark.parametrize(
    "body",
    [
        'op = "drop"\ninput = "a"',
        'op = "concat"\ninputs = ["a", "b"]\noutput = "c"',  # sizes not stated
        'op = "concat"\ninput = "a.{e}"\noutput = "c"\nover = "e"',
        'op = "reshape"\ninput = "a"\noutput = "c"\nshape = [-1]',
    ],
)
def test_rules_that_cannot_be_inverted_name_the_rule(body):
    (rule,) = rules(f'[[rule]]\nname = "one-way"\n{body}\n').rules
    with pytest.raises(PlanError) as e:
        invert_rule(rule)
    assert "one-way" in str(e.value) and SRC in str(e.value)


def test_planned_byte_ranges_hold_the_computed_bytes(tmp_path):
    """Where a planned tensor is a plain copy of file bytes (zero-copy writing), those bytes
    are the ones the computation makes."""
    tensors = {f"e.{n}": rows(2, 3, 10 * n) for n in range(3)}
    tensors.update({"q": rows(2), "k": rows(3, start=40), "big": rows(6, 2, 90)})
    table = open_table(tmp_path, tensors)
    rs = rules('''
[[rule]]
name = "st"
op = "stack"
input = "e.{n:int}"
output = "e"
over = "n"

[[rule]]
name = "flat"
op = "reshape"
input = "e"
output = "e_flat"
shape = [-1]

[[rule]]
name = "qk"
op = "concat"
inputs = ["q", "k"]
output = "qk"

[[rule]]
name = "parts"
op = "split"
input = "big"
outputs = ["big.a", "big.b"]
sizes = [4, 2]

[[rule]]
name = "again"
op = "rename"
input = "big.b"
output = "tail"
''')
    _, out = make_plan(table, [rs])
    got = values(out)
    checked = 0
    for name in out.names():
        ranges = out[name].byte_ranges()
        if ranges is None:
            continue
        data = b""
        for r in ranges:
            with open(r.path, "rb") as f:
                f.seek(r.offset)
                data += f.read(r.length)
        assert data == got[name].tobytes(), name
        checked += 1
    assert checked == 4  # e_flat, qk, big.a, tail
    assert got["tail"].tolist() == [[98, 99], [100, 101]]


def test_replaying_a_plan_on_a_different_shape_names_tensor_and_rule(tmp_path):
    plan, _ = make_plan(open_table(tmp_path, {"a": rows(2)}, "one.safetensors"),
                        [rules('[[rule]]\nname = "t"\nop = "transpose"\ninput = "a"\noutput = "b"\n')])
    other = open_table(tmp_path, {"a": rows(3)}, "two.safetensors")
    with pytest.raises(PlanError) as e:
        run_plan(other, plan, "verify")
    assert "'a'" in str(e.value) and "'t'" in str(e.value)
    missing = open_table(tmp_path, {"z": rows(2)}, "three.safetensors")
    with pytest.raises(PlanError) as e:
        run_plan(missing, plan, "verify")
    assert "'a'" in str(e.value) and "'t'" in str(e.value)


# --- headers only -------------------------------------------------------------------


FUSING_RULES = '''
[[rule]]
name = "qkv"
op = "concat"
inputs = ["l.{i}.q", "l.{i}.k", "l.{i}.v"]
output = "l.{i}.qkv"

[[rule]]
name = "t"
op = "transpose"
input = "l.{i}.qkv"
output = "l.{i}.qkv_t"
'''


def fusing_table(tmp_path):
    return open_table(tmp_path, {
        f"l.{i}.{m}": rows(2, 3, 10 * i) for i in range(2) for m in "qkv"
    })


def test_plan_is_made_without_reading_tensor_data(tmp_path, monkeypatch):
    table = fusing_table(tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("make_plan read tensor data")

    monkeypatch.setattr(fusectl.tensors, "read_ranges", refuse)
    monkeypatch.setattr(fusectl.tensors.FileTensor, "read", refuse)
    monkeypatch.setattr(os, "preadv", refuse)
    monkeypatch.setattr(os, "pread", refuse)
    plan, out = make_plan(table, [rules(FUSING_RULES)])
    assert len(plan.steps) == 4
    assert out.spec("l.1.qkv_t").shape == (3, 6)


def test_plan_is_made_after_the_file_is_gone(tmp_path):
    table = fusing_table(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    plan, out = make_plan(table, [rules(FUSING_RULES)])
    assert [g.rule for g in plan.groups] == ["qkv", "t"]
    assert out.names() == ["l.0.qkv_t", "l.1.qkv_t"]


def test_an_output_name_with_an_empty_segment_is_refused(tmp_path):
    table = open_table(tmp_path, {"weight": rows(1)})
    rs = rules('[[rule]]\nname = "r"\nop = "rename"\ninput = "{p*}.weight"\noutput = "{p}.w"\n')
    with pytest.raises(PlanError) as e:
        make_plan(table, [rs])
    assert "'.w'" in str(e.value) and "'r'" in str(e.value)


# --- bad input through the CLI: refused in full (conftest.assert_refused) ----------------


def test_missing_tensor_in_binding(cli, area, copy_fixture):
    tensors = llama_tensors(copy_fixture)
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    ckpt_dir = area / "in" / "partial"
    ckpt_dir.mkdir()
    shutil.copy2(area / "in" / "llama-src" / "config.json", ckpt_dir / "config.json")
    write_safetensors(ckpt_dir / "model.safetensors", tensors, {"format": "pt"})
    refuse_case(cli, area, ckpt_dir, "-r", "llama-qkv",
                needles=["attn-qkv", "model.layers.1.self_attn.v_proj.weight"])


def test_rule_matching_nothing(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    refuse_case(cli, area, src, "-r", "mixtral-experts", needles=["stack-experts"])


def test_output_name_collision(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    rules = write_rules(area / "in" / "clash.toml", """
version = 1
[[rule]]
name = "clash"
op = "rename"
input = "lm_head.weight"
output = "model.embed_tokens.weight"
""")
    refuse_case(cli, area, src, "-r", rules, needles=["clash", "model.embed_tokens.weight"])
