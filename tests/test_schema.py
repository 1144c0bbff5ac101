"""Rules files (SPEC §3): TOML → RuleSet; every mistake is a RuleError that names the file,
the rule and the offending key."""

from __future__ import annotations

import pytest

from conftest import LLAMA, refuse_case, write_rules
from fusectl.errors import RuleError
from fusectl.ops.layout import Concat, Interleave, Rename, RopePermute, Split, Stack, Unstack
from fusectl.rules.schema import RuleSet, load_rules


SRC = "rules/attn.toml"


def load(text: str, config=None) -> RuleSet:
    return load_rules(text, SRC, config)


def error(text: str, config=None) -> str:
    with pytest.raises(RuleError) as e:
        load_rules(text, SRC, config)
    return str(e.value)


def rule(body: str, name: str = "attn-qkv") -> str:
    return f'version = 1\n[[rule]]\nname = "{name}"\n{body}\n'


# --- what loads ---------------------------------------------------------------------


def test_spec_example_loads():
    text = """
version = 1
description = "fuse q, k, v"

[vars]
heads    = "config:num_attention_heads"
kv_heads = "config:num_key_value_heads"
head_dim = "config:hidden_size // heads"
q_rows   = "heads * head_dim"
kv_rows  = "kv_heads * head_dim"

[ties]
groups = [["lm_head.weight", "model.embed_tokens.weight"]]

[[rule]]
name   = "attn-qkv"
op     = "concat"
inputs = ["model.layers.{i}.self_attn.q_proj.weight",
          "model.layers.{i}.self_attn.k_proj.weight",
          "model.layers.{i}.self_attn.v_proj.weight"]
output = "model.layers.{i}.self_attn.qkv_proj.weight"
axis   = 0
sizes  = ["q_rows", "kv_rows", "kv_rows"]

[[rule]]
op = "drop"
input = "{p*}.num_batches_tracked"
optional = true
"""
    rs = load(text, {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32})
    assert rs.source == SRC
    assert rs.description == "fuse q, k, v"
    assert rs.ties == (("lm_head.weight", "model.embed_tokens.weight"),)
    assert len(rs.rules) == 2
    qkv, drop = rs.rules
    assert qkv.name == "attn-qkv"
    assert qkv.op == Concat(axis=0, sizes=(32, 16, 16))
    assert [p.text for p in qkv.inputs] == [
        "model.layers.{i}.self_attn.q_proj.weight",
        "model.layers.{i}.self_attn.k_proj.weight",
        "model.layers.{i}.self_attn.v_proj.weight",
    ]
    assert [p.text for p in qkv.outputs] == ["model.layers.{i}.self_attn.qkv_proj.weight"]
    assert qkv.optional is False and qkv.over is None
    assert drop.op.kind == "drop" and drop.optional is True and drop.outputs == ()
    # an unnamed rule still gets a name that says which one it is
    assert "2" in drop.name
    assert SRC in drop.describe()


def test_rules_keep_file_order():
    text = "version = 1\n" + "".join(
        f'[[rule]]\nname = "r{k}"\nop = "rename"\ninput = "a{k}"\noutput = "b{k}"\n' for k in (3, 1, 2)
    )
    assert [r.name for r in load(text).rules] == ["r3", "r1", "r2"]


def test_empty_file_with_version_loads():
    rs = load("version = 1\n")
    assert rs.rules == () and rs.ties == ()


def test_vars_are_only_resolved_when_a_rule_needs_them():
    # a file whose rules need no config loads without one
    text = (
        'version = 1\n[vars]\nheads = "config:num_attention_heads"\n'
        '[[rule]]\nop = "rename"\ninput = "a"\noutput = "b"\n'
    )
    assert load(text, config=None).rules[0].op == Rename()
    # ... and the same var is an error naming the missing config once a rule that uses it
    # binds (tests/test_rule_var_order.py): loading alone does not need it
    op = load(text + '[[rule]]\nname = "rp"\nop = "rope_permute"\ninput = "q"\noutput = "q2"\nheads = "heads"\n').rules[1].op
    with pytest.raises(RuleError) as e:
        op.for_present([None])
    assert "num_attention_heads" in str(e.value) and SRC in str(e.value)


def test_op_parameters_from_vars_and_expressions():
    text = """
version = 1
[vars]
heads = "config:num_attention_heads"
kv = 2
[[rule]]
name = "q"
op = "rope_permute"
input = "q"
output = "q2"
heads = "heads"
to = "meta"
[[rule]]
name = "k"
op = "rope_permute"
input = "k"
output = "k2"
heads = "kv * 1"
[[rule]]
name = "il"
op = "interleave"
inputs = ["a.{x}", "b.{x}"]
output = "c.{x}"
groups = "heads // kv"
axis = -1
"""
    q, k, il = load(text, {"num_attention_heads": 8}).rules
    assert q.op == RopePermute(heads=8, to="meta")
    assert k.op == RopePermute(heads=2, to="hf")
    assert il.op == Interleave(axis=-1, groups=4)


def test_split_parts_come_from_outputs():
    (r,) = load(rule('op = "split"\ninput = "w"\noutputs = ["a", "b", "c"]\naxis = 1')).rules
    assert r.op == Split(axis=1, sizes=None, parts=3)
    assert [p.text for p in r.outputs] == ["a", "b", "c"]


def test_over_loads_for_concat_stack_unstack():
    (c,) = load(rule('op = "concat"\ninput = "e.{e:int}.w"\noutput = "w"\nover = "e"')).rules
    assert c.over == "e" and c.op == Concat()
    (s,) = load(rule('op = "stack"\ninput = "{p*}.experts.{e}.w"\noutput = "{p*}.experts.w"\nover = "e"')).rules
    assert s.over == "e" and s.op == Stack()
    (u,) = load(rule('op = "unstack"\ninput = "{p*}.experts.w"\noutput = "{p*}.experts.{e}.w"\nover = "e"')).rules
    assert u.over == "e" and u.op == Unstack()


# --- top level ----------------------------------------------------------------------


def test_unknown_top_level_key():
    msg = error('version = 1\nrulez = 3\n')
    assert SRC in msg and "'rulez'" in msg


def test_missing_version():
    msg = error('[[rule]]\nname = "r"\nop = "rename"\ninput = "a"\noutput = "b"\n')
    assert SRC in msg and "version" in msg


@pytest.mark.parametrize("version", ["2", '"1"', "0", "true"])
def test_wrong_version(version):
    msg = error(f"version = {version}\n")
    assert SRC in msg and "version" in msg


def test_invalid_toml_names_the_file():
    msg = error("version = 1\n[[rule]\n")
    assert SRC in msg


def test_rule_written_as_a_single_table():
    msg = error('version = 1\n[rule]\nname = "r"\nop = "rename"\ninput = "a"\noutput = "b"\n')
    assert SRC in msg and "[[rule]]" in msg


def test_unknown_key_in_ties():
    msg = error('version = 1\n[ties]\ngroups = [["a", "b"]]\nstrict = true\n')
    assert SRC in msg and "'strict'" in msg


@pytest.mark.parametrize("groups", ['[["a"]]', '["a", "b"]', "[[1, 2]]", '"a"'])
def test_malformed_tie_groups(groups):
    msg = error(f"version = 1\n[ties]\ngroups = {groups}\n")
    assert SRC in msg


def test_vars_must_be_a_table():
    assert SRC in error('version = 1\nvars = 3\n')


def test_bad_var_used_by_a_rule_names_the_file():
    op = load(
        'version = 1\n[vars]\nq = "config:missing_key"\n'
        '[[rule]]\nname = "r"\nop = "split"\ninput = "w"\noutputs = ["a", "b"]\nsizes = ["q", "q"]\n',
        {"hidden_size": 4},
    ).rules[0].op
    with pytest.raises(RuleError) as e:  # raised once the rule binds (tests/test_rule_var_order.py)
        op.infer([], [])
    assert SRC in str(e.value) and "missing_key" in str(e.value)


# --- rule keys ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, key",
    [
        ('op = "rename"\ninput = "a.{x}"\noutput = "b.{x}"\naxes = 1', "axes"),
        ('op = "concat"\ninputs = ["a", "b"]\noutput = "c"\ndim = 0', "dim"),
        ('op = "split"\ninput = "a"\noutputs = ["b", "c"]\nparts = 2', "parts"),  # derived, not user-set
        ('op = "drop"\ninput = "a"\noutput = "b"', "output"),
        ('op = "transpose"\ninput = "a"\noutput = "b"\npermutation = [1, 0]', "permutation"),
        ('op = "rope_permute"\ninput = "a"\noutput = "b"\nkv_heads = 2', "kv_heads"),
        ('op = "rename"\ninput = "a"\noutput = "b"\nOptional = true', "Optional"),
    ],
)
def test_unknown_rule_key_names_file_rule_and_key(body, key):
    msg = error(rule(body, name="attn-qkv"))
    assert SRC in msg
    assert "attn-qkv" in msg
    assert f"'{key}'" in msg


def test_unknown_rule_key_in_unnamed_rule_names_its_position():
    msg = error('version = 1\n[[rule]]\nop = "rename"\ninput = "a"\noutput = "b"\n'
                '[[rule]]\nop = "rename"\ninput = "c"\noutput = "d"\nbogus = 1\n')
    assert SRC in msg and "'bogus'" in msg and "#2" in msg


def test_unknown_op_names_file_rule_and_op():
    msg = error(rule('op = "fuse_qkv"\ninput = "a"\noutput = "b"', name="attn-qkv"))
    assert SRC in msg
    assert "attn-qkv" in msg
    assert "fuse_qkv" in msg


def test_missing_op_names_file_and_rule():
    msg = error(rule('input = "a"\noutput = "b"', name="attn-qkv"))
    assert SRC in msg and "attn-qkv" in msg and "op" in msg


def test_missing_output():
    msg = error(rule('op = "rename"\ninput = "a"'))
    assert "attn-qkv" in msg and "'output'" in msg


def test_missing_input():
    msg = error(rule('op = "rename"\noutput = "a"'))
    assert "attn-qkv" in msg and "'input'" in msg


def test_output_using_an_unbound_placeholder():
    msg = error(rule('op = "rename"\ninput = "a.{x}"\noutput = "b.{y}"'))
    assert SRC in msg and "attn-qkv" in msg and "{y}" in msg and "b.{y}" in msg


def test_outputs_list_with_an_unbound_placeholder():
    msg = error(rule('op = "split"\ninput = "w.{i}"\noutputs = ["a.{i}", "b.{j}"]'))
    assert "attn-qkv" in msg and "{j}" in msg


def test_inputs_with_different_placeholders():
    msg = error(rule('op = "concat"\ninputs = ["q.{i}", "k.{j}"]\noutput = "qk.{i}"'))
    assert SRC in msg and "attn-qkv" in msg and "q.{i}" in msg and "k.{j}" in msg


def test_inputs_with_a_subset_of_placeholders():
    msg = error(rule('op = "concat"\ninputs = ["q.{i}.{m}", "k.{i}"]\noutput = "qk.{i}.{m}"'))
    assert "attn-qkv" in msg and "k.{i}" in msg


def test_ambiguous_pattern_names_the_rule():
    msg = error(rule('op = "rename"\ninput = "{a}_{b}"\noutput = "x.{a}.{b}"'))
    assert SRC in msg and "attn-qkv" in msg and "{a}_{b}" in msg


# --- index offsets ({n+1}) -------------------------------------------------------------

BN_SEQUENTIAL = """op = "bn_fold"
weight = "{p*}.{n:int}.weight"
bias = "{p*}.{n:int}.bias"
gamma = "{p*}.{n+1}.weight"
beta = "{p*}.{n+1}.bias"
mean = "{p*}.{n+1}.running_mean"
var = "{p*}.{n+1}.running_var"
output_weight = "{p*}.{n:int}.weight"
output_bias = "{p*}.{n:int}.bias"
layer = "auto"
"""


def test_offset_in_another_pattern_counts_as_the_same_placeholder():
    (r,) = load(rule(BN_SEQUENTIAL, "seq-bn")).rules
    assert [p.text for p in r.inputs][2] == "{p*}.{n+1}.weight"
    assert all(p.names == {"p", "n"} for p in r.inputs)


def test_offset_alone_and_in_outputs_load():
    load(rule('op = "drop"\ninput = "{p*}.{n+1}.num_batches_tracked"'))
    load(rule('op = "rename"\ninput = "l.{i+1}.w"\noutput = "l.{i:int}.w"'))
    load(rule('op = "rename"\ninput = "l.{i:int}.w"\noutput = "l.{i-1}.w"'))


@pytest.mark.parametrize(
    "body, expect",
    [
        # n is text in one pattern, shifted in another: refused, naming both patterns
        (BN_SEQUENTIAL.replace("{p*}.{n:int}.weight", "{p*}.{n}.weight", 1)
         .replace('"{p*}.{n:int}.bias"\ngamma', '"{p*}.{n}.bias"\ngamma'),
         "'{p*}.{n+1}.weight' writes {n+1}, which shifts a whole number, but '{p*}.{n}.weight' binds "
         "'n' with {n}; write {n:int} there"),
        ('op = "rename"\ninput = "l.{i}.w"\noutput = "l.{i+1}.w"', "'l.{i}.w' binds 'i' with {i}"),
        ('op = "rename"\ninput = "{i*}.w"\noutput = "x.{i-1}.w"', "binds 'i' with {i*}"),
        ('op = "rename"\ninput = "{p*+1}.w"\noutput = "x.w"', "stands for segments"),
        ('op = "rename"\ninput = "l.{i+0}.w"\noutput = "x.{i:int}"', "write {i:int}"),
        ('op = "concat"\ninputs = ["q.{i:int}", "k.{j+1}"]\noutput = "qk.{i:int}"', "use different placeholders"),
        ('op = "rename"\ninput = "l.{i:int}.w"\noutput = "l.{j+1}.w"', "{j}, which no input binds"),
    ],
)
def test_offset_errors_at_load_name_file_rule_and_pattern(body, expect):
    msg = error(rule(body))
    assert SRC in msg and "attn-qkv" in msg and expect in msg


# --- over ---------------------------------------------------------------------------


def test_over_on_an_op_without_gathering():
    msg = error(rule('op = "rename"\ninput = "a.{x}"\noutput = "b.{x}"\nover = "x"'))
    assert "attn-qkv" in msg and "'over'" in msg


def test_over_with_an_inputs_list():
    msg = error(rule('op = "concat"\ninputs = ["a.{x}", "b.{x}"]\noutput = "c"\nover = "x"'))
    assert "attn-qkv" in msg and "over" in msg


def test_over_naming_no_placeholder_of_the_input():
    msg = error(rule('op = "concat"\ninput = "a.{x}"\noutput = "c"\nover = "y"'))
    assert "attn-qkv" in msg and "'y'" in msg


def test_single_input_without_over():
    msg = error(rule('op = "stack"\ninput = "a.{x}"\noutput = "c"'))
    assert "attn-qkv" in msg and "over" in msg


def test_output_still_using_the_gathered_placeholder():
    msg = error(rule('op = "concat"\ninput = "a.{x}"\noutput = "c.{x}"\nover = "x"'))
    assert "attn-qkv" in msg and "{x}" in msg


def test_unstack_needs_over():
    msg = error(rule('op = "unstack"\ninput = "w"\noutput = "w.{e}"'))
    assert "attn-qkv" in msg and "over" in msg


def test_unstack_over_must_be_in_the_output():
    msg = error(rule('op = "unstack"\ninput = "w"\noutput = "w.x"\nover = "e"'))
    assert "attn-qkv" in msg and "{e}" in msg


def test_unstack_over_must_not_be_bound_by_the_input():
    msg = error(rule('op = "unstack"\ninput = "w.{e}"\noutput = "v.{e}"\nover = "e"'))
    assert "attn-qkv" in msg and "'e'" in msg


def test_both_input_and_inputs():
    msg = error(rule('op = "concat"\ninput = "a.{x}"\ninputs = ["a.{x}", "b.{x}"]\noutput = "c"\nover = "x"'))
    assert "attn-qkv" in msg


# --- values -------------------------------------------------------------------------


def test_sizes_count_must_match_outputs():
    msg = error(rule('op = "split"\ninput = "w"\noutputs = ["q", "k"]\nsizes = [8, 4, 4]'))
    assert SRC in msg and "attn-qkv" in msg and "sizes" in msg


def test_deinterleave_sizes_count_must_match_outputs():
    msg = error(rule('op = "deinterleave"\ninput = "w"\noutputs = ["q", "k", "v"]\ngroups = 2\nsizes = [8, 4]'))
    assert "attn-qkv" in msg and "sizes" in msg


def test_sizes_naming_an_undefined_var():
    msg = error(rule('op = "split"\ninput = "w"\noutputs = ["q", "k"]\nsizes = ["q_rows", 4]'))
    assert "attn-qkv" in msg and "sizes" in msg and "q_rows" in msg


@pytest.mark.parametrize(
    "body, key",
    [
        ('op = "concat"\ninputs = ["a", "b"]\noutput = "c"\naxis = 1.5', "axis"),
        ('op = "concat"\ninputs = ["a", "b"]\noutput = "c"\naxis = true', "axis"),
        ('op = "split"\ninput = "a"\noutputs = ["b", "c"]\nsizes = 3', "sizes"),
        ('op = "transpose"\ninput = "a"\noutput = "b"\nperm = "1, 0"', "perm"),
        ('op = "rope_permute"\ninput = "a"\noutput = "b"\nheads = 4\nto = 1', "to"),
        ('op = "rename"\ninput = "a"\noutput = "b"\noptional = "yes"', "optional"),
    ],
)
def test_badly_typed_values_name_rule_and_key(body, key):
    msg = error(rule(body))
    assert "attn-qkv" in msg
    assert f": {key}" in msg or f"'{key}'" in msg


def test_output_must_be_one_pattern_for_single_output_ops():
    msg = error(rule('op = "rename"\ninput = "a"\noutput = ["b", "c"]'))
    assert "attn-qkv" in msg and "output" in msg


def test_outputs_must_be_a_list():
    msg = error(rule('op = "split"\ninput = "a"\noutputs = "b"'))
    assert "attn-qkv" in msg and "outputs" in msg


def test_input_must_be_one_pattern():
    msg = error(rule('op = "rename"\ninput = ["a", "b"]\noutput = "c"'))
    assert "attn-qkv" in msg and "input" in msg


def test_pattern_must_be_a_string():
    msg = error(rule('op = "rename"\ninput = 3\noutput = "c"'))
    assert "attn-qkv" in msg and "input" in msg


def test_rule_name_must_be_a_string():
    msg = error('version = 1\n[[rule]]\nname = 7\nop = "rename"\ninput = "a"\noutput = "b"\n')
    assert SRC in msg and "name" in msg


def test_deeply_nested_toml_is_a_rule_error_not_a_crash():
    msg = error("version = 1\na = " + "[" * 100_000 + "]" * 100_000 + "\n")
    assert SRC in msg and "nested too deep for Python's TOML reader" in msg


# --- bad input through the CLI: refused in full (conftest.assert_refused) ----------------


def test_rules_file_not_toml(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    rules = write_rules(area / "in" / "bad.toml", "version = 1\n[[rule]\nop = 'rename'\n")
    refuse_case(cli, area, src, "-r", rules, needles=["bad.toml", "TOML"])


def test_unknown_rule_key(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    rules = write_rules(area / "in" / "typo.toml", """
version = 1
[[rule]]
name = "attn-qkv"
op = "concat"
inputs = ["model.layers.{i:int}.self_attn.q_proj.weight", "model.layers.{i:int}.self_attn.k_proj.weight"]
output = "model.layers.{i:int}.self_attn.qk_proj.weight"
axes = 0
""")
    refuse_case(cli, area, src, "-r", rules, needles=["typo.toml", "attn-qkv", "axes"])


def test_unknown_top_level_key_refuses_the_fuse(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    rules = write_rules(area / "in" / "top.toml", """
version = 1
variables = { a = 1 }
[[rule]]
op = "drop"
input = "lm_head.weight"
""")
    refuse_case(cli, area, src, "-r", rules, needles=["top.toml", "variables"])


def test_unknown_ties_key(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    rules = write_rules(area / "in" / "ties.toml", """
version = 1
[ties]
group = [["a", "b"]]
""")
    refuse_case(cli, area, src, "-r", rules, needles=["ties.toml", "group"])


def test_unknown_op(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    rules = write_rules(area / "in" / "op.toml", """
version = 1
[[rule]]
name = "mystery"
op = "fuse_everything"
input = "lm_head.weight"
output = "x"
""")
    refuse_case(cli, area, src, "-r", rules, needles=["op.toml", "mystery", "fuse_everything"])


def test_missing_version_refuses_the_fuse(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    rules = write_rules(area / "in" / "nov.toml", """
[[rule]]
op = "drop"
input = "lm_head.weight"
""")
    refuse_case(cli, area, src, "-r", rules, needles=["nov.toml", "version"])
