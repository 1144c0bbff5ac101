"""Hostile rules files: budgets checked before the work they guard, and clear errors."""

from __future__ import annotations


import numpy as np
import psutil
import pytest

from conftest import FIXTURES, leftovers, ok, snapshot, time_limit, write_rules, write_safetensors


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "in" / "m.safetensors"
    path.parent.mkdir()
    write_safetensors(path, {"w": np.arange(64, dtype=np.float32).reshape(8, 8), "b": np.zeros(0, np.float32)})
    return path


def refused_to_write(cli, ckpt, rules, tmp_path, *needles):
    """fuse is refused as plan was: the same message, no output, nothing left, input unchanged."""
    out = tmp_path / "refused-out.safetensors"
    before = snapshot(ckpt.parent)
    refused(cli("fuse", ckpt, "-r", rules, "-o", out), *needles)
    assert not out.exists() and leftovers(tmp_path) == [] and snapshot(ckpt.parent) == before


def refused(result, *needles):
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error:") and "internal error" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr
    return result


@pytest.mark.parametrize("tensor", ["w", "b"])  # b is empty: every chunk count divides 0
def test_reorder_with_a_billion_chunks_is_refused_at_once(cli, ckpt, tmp_path, tensor):
    rules = write_rules(tmp_path / "r.toml", f"""
version = 1
[[rule]]
op = "reorder"
input = "{tensor}"
output = "{tensor}2"
chunks = 1000000000
order = [0]
""")
    rss = psutil.Process().memory_info().rss
    with time_limit(60):  # a hang guard: a billion chunks planned one by one would run for minutes
        refused(cli("plan", ckpt, "-r", rules), "1000000000", "FUSECTL_MAX_CHUNKS")
        refused_to_write(cli, ckpt, rules, tmp_path, "FUSECTL_MAX_CHUNKS")
    assert psutil.Process().memory_info().rss - rss < 100 << 20


def test_reshape_to_more_dimensions_than_numpy_has_is_refused_when_planning(cli, ckpt, tmp_path):
    rules = write_rules(tmp_path / "r.toml", "version = 1\n[[rule]]\nop = \"reshape\"\ninput = \"w\"\n"
                                             f"output = \"w2\"\nshape = {[1] * 100 + [64]}\n")
    refused(cli("plan", ckpt, "-r", rules), "reshape of 'w'", "101")
    out = tmp_path / "out.safetensors"
    refused(cli("fuse", ckpt, "-r", rules, "-o", out))
    assert not out.exists() and leftovers(tmp_path) == []


def test_reshape_sizes_that_overflow_int64_are_refused(cli, ckpt, tmp_path):
    rules = write_rules(tmp_path / "r.toml", "version = 1\n[[rule]]\nop = \"reshape\"\ninput = \"w\"\n"
                                             "output = \"w2\"\nshape = [4294967296, 4294967296, 4]\n")
    refused(cli("plan", ckpt, "-r", rules), "cannot reshape")
    refused_to_write(cli, ckpt, rules, tmp_path, "cannot reshape")


def test_unfuse_r_of_a_rename_that_drops_a_placeholder_says_why(cli, tmp_path):
    path = tmp_path / "in" / "m.safetensors"
    path.parent.mkdir()
    write_safetensors(path, {"a.x.w": np.ones(2, np.float32)})
    rules = write_rules(tmp_path / "r.toml", 'version = 1\n[[rule]]\nop = "rename"\ninput = "a.{k}.w"\noutput = "b.w"\n')
    fused = tmp_path / "fused.safetensors"
    ok(cli("fuse", path, "-r", rules, "-o", fused))
    back = tmp_path / "back.safetensors"
    refused(cli("unfuse", fused, "-r", rules, "-o", back), "drops {k}", "unfuse with the provenance")
    assert not back.exists()
    ok(cli("unfuse", fused, "-o", back))  # the provenance knows the name


def test_a_refuse_message_cannot_print_control_characters(cli, ckpt, tmp_path):
    rules = write_rules(tmp_path / "r.toml", 'version = 1\n[[rule]]\nop = "refuse"\ninput = "w"\n'
                                             'message = "\\u001b[2J\\u0007wiped"\n')
    before = snapshot(ckpt.parent)
    result = refused(cli("plan", ckpt, "-r", rules), "\\x1b[2J\\x07wiped")
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr
    assert snapshot(ckpt.parent) == before
    refused_to_write(cli, ckpt, rules, tmp_path, "\\x1b[2J\\x07wiped")


def test_a_rules_file_with_no_rules_is_refused_instead_of_writing_a_copy(cli, ckpt, tmp_path):
    rules = write_rules(tmp_path / "empty.toml", "version = 1\n")
    out = tmp_path / "out.safetensors"
    refused(cli("fuse", ckpt, "-r", rules, "-o", out), "empty.toml", "no [[rule]]")
    assert not out.exists()


@pytest.mark.parametrize("name", ["__metadata__", "__fusectl_metadata__"])
def test_an_output_named_like_the_metadata_is_refused(cli, ckpt, tmp_path, name):
    rules = write_rules(tmp_path / "r.toml", f'version = 1\n[[rule]]\nop = "rename"\ninput = "w"\noutput = "{name}"\n')
    for out in (tmp_path / "out.safetensors", tmp_path / "out.npz"):
        refused(cli("fuse", ckpt, "-r", rules, "-o", out), name, "reserves")
        assert not out.exists()


def test_an_output_name_past_the_name_budget_is_refused(cli, ckpt, tmp_path):
    rules = write_rules(tmp_path / "r.toml", f'version = 1\n[[rule]]\nop = "rename"\ninput = "w"\noutput = "{"n" * 70000}"\n')
    out = tmp_path / "out.npz"
    refused(cli("fuse", ckpt, "-r", rules, "-o", out), "FUSECTL_MAX_NAME_BYTES")
    assert not out.exists()


def _bn_checkpoint(path, gamma, var):
    c = 4
    write_safetensors(path, {
        "conv.weight": np.ones((c, 2, 3, 3), np.float32), "conv.bias": np.zeros(c, np.float32),
        "bn.weight": np.full(c, gamma, np.float32), "bn.bias": np.zeros(c, np.float32),
        "bn.running_mean": np.zeros(c, np.float32), "bn.running_var": np.full(c, var, np.float32),
    })


BN_RULES = """
version = 1
[[rule]]
op = "bn_fold"
weight = "conv.weight"
bias = "conv.bias"
gamma = "bn.weight"
beta = "bn.bias"
mean = "bn.running_mean"
var = "bn.running_var"
output_weight = "conv.weight"
output_bias = "conv.bias"
"""


def test_a_fold_that_overflows_float32_is_refused_not_written(cli, tmp_path):
    """gamma 3e38 over a zero variance: 3e38 / sqrt(1e-5) is past float32's range (the report
    saw 54 NaN and 18 inf written with exit 0)."""
    path = tmp_path / "in" / "bn.safetensors"
    path.parent.mkdir()
    _bn_checkpoint(path, 3e38, 0.0)
    out = tmp_path / "out.safetensors"
    before = snapshot(path.parent)
    result = refused(cli("fuse", path, "-r", write_rules(tmp_path / "r.toml", BN_RULES), "-o", out),
                     "although every input is finite", "overflows F32", "conv.weight")
    assert not out.exists() and leftovers(tmp_path) == [] and snapshot(path.parent) == before
    assert result.exit_code == 2


def test_weight_norm_with_a_huge_g_over_a_tiny_v_is_refused(cli, tmp_path):
    path = tmp_path / "in" / "wn.safetensors"
    path.parent.mkdir()
    write_safetensors(path, {"l.weight_g": np.full((3, 1), 3e38, np.float32),
                             "l.weight_v": np.full((3, 4), 1e-18, np.float32)})
    out = tmp_path / "out.safetensors"
    refused(cli("fuse", path, "-r", "weight-norm-fold", "-o", out), "overflows F32", "l.weight")
    assert not out.exists()


def test_a_fold_over_inputs_that_hold_nan_names_them(cli, tmp_path):
    path = tmp_path / "in" / "bn.safetensors"
    path.parent.mkdir()
    _bn_checkpoint(path, float("nan"), 1.0)
    out = tmp_path / "out.safetensors"
    refused(cli("fuse", path, "-r", write_rules(tmp_path / "r.toml", BN_RULES), "-o", out),
            "'bn.weight' (4 non-finite)", "damaged")
    assert not out.exists()


@pytest.mark.parametrize("line, needle", [
    ('op = ["drop"]\ninput = "w"', "op must be a string"),
    ('op = "reorder"\ninput = "w"\noutput = "x"\norder = [0]\nchunks = ' + "9" * 5000, "integer is too long"),
    ('op = "transpose"\ninput = "w"\noutput = "x"\nperm = [1, 99999999999999999999]', "64 bits"),
    ('op = "bn_fold"\nweight = "w"\ngamma = "g"\nbeta = "b"\nmean = "m"\nvar = "v"\noutput_weight = "w"\n'
     'output_bias = "b2"\neps = inf', "expected a finite number"),
    ("a = " + "[" * 100_000 + "]" * 100_000, "nested too deep for Python's TOML reader; rules files nest at most 32"),
])
def test_malformed_values_in_a_rules_file_are_rule_errors(cli, ckpt, tmp_path, line, needle):
    rules = write_rules(tmp_path / "bad.toml", f"version = 1\n[[rule]]\n{line}\n")
    refused(cli("plan", ckpt, "-r", rules), "bad.toml", needle)
    refused_to_write(cli, ckpt, rules, tmp_path, "bad.toml", needle)


def test_a_sequential_conv_transpose_before_a_batchnorm_is_not_folded_as_a_conv(cli, tmp_path):
    """ConvTranspose2d(8, 4) + BatchNorm2d(4) in an nn.Sequential: read as a Conv its weight
    [8, 4, 3, 3] has 8 output channels, which the BatchNorm's 4 do not fit; the error says so
    and how to fold it instead of a misleading channel count."""
    path = tmp_path / "in" / "dec.safetensors"
    path.parent.mkdir()
    write_safetensors(path, {"dec.0.weight": np.ones((8, 4, 3, 3), np.float32), "dec.0.bias": np.zeros(4, np.float32),
                             **{f"dec.1.{p}": np.ones(4, np.float32) for p in ("weight", "bias", "running_mean", "running_var")}})
    refused(cli("plan", path, "-r", "conv-bn-fold"), "'dec.0.weight' has 8 output channels as a conv weight",
            'layer = "conv_transpose"')
    refused_to_write(cli, path, "conv-bn-fold", tmp_path, 'layer = "conv_transpose"')


DOTTED = ".".join(["a"] * 5000)


@pytest.mark.parametrize("text", [
    f"[config]\nset = {{ {DOTTED} = 1 }}",
    f"[config.set]\n{DOTTED} = 1",
    f"[config.set.{DOTTED}]\nb = 1",
    f"[vars.{DOTTED}]\nb = 1",
    f'[[rule]]\nop = "drop"\ninput = "w"\n[rule.{DOTTED}]\nb = 1',
    "[config]\nset = { a = " + "[" * 40 + "]" * 40 + " }",  # past the budget, short of tomllib's recursion
], ids=["dotted-key", "dotted-key-in-table", "table-header", "vars-header", "rule-subtable", "arrays"])
def test_a_rules_file_nested_past_the_budget_is_refused_naming_it(cli, ckpt, tmp_path, text):
    # dotted keys and table headers nest without recursion in the TOML reader; json.dumps of
    # the [config] value then recursed: exit 70 (RecursionError)
    rules = write_rules(tmp_path / "deep.toml", f"version = 1\n{text}\n")
    refused(cli("plan", ckpt, "-r", rules), "deep.toml", "levels of nesting in a rules file", "FUSECTL_MAX_RULES_DEPTH")
    refused_to_write(cli, ckpt, rules, tmp_path, "deep.toml", "FUSECTL_MAX_RULES_DEPTH")


def _nested(depth: int) -> str:
    """An inline table nested ``depth`` levels: {x = {x = ... {x = 1}}}."""
    return "{ x = " * depth + "1" + " }" * depth


def test_a_config_value_as_deep_as_the_budget_allows_round_trips_through_the_provenance(cli, tmp_path):
    # the rules file nests 32 levels (document, [config], set, 29 of value); its provenance nests
    # the value 6 levels down, within the 64 levels fusectl reads JSON to: unfuse reads it back
    rules = write_rules(tmp_path / "r.toml", f"version = 1\n[config]\nset = {{ deep = {_nested(29)} }}\n")
    out, back = tmp_path / "fused", tmp_path / "back"
    ok(cli("fuse", FIXTURES / "tiny-llama-gqa", "-r", rules, "-o", out))
    ok(cli("unfuse", out, "-o", back))
    assert (back / "config.json").read_bytes() == (FIXTURES / "tiny-llama-gqa" / "config.json").read_bytes()
    deeper = write_rules(tmp_path / "deeper.toml", f"version = 1\n[config]\nset = {{ deep = {_nested(30)} }}\n")
    refused(cli("plan", FIXTURES / "tiny-llama-gqa", "-r", deeper), "33 levels of nesting", "limit of 32")


@pytest.mark.parametrize("eps", ["-1e-5", "-0.5"])
def test_a_negative_eps_in_a_rules_file_is_refused_naming_the_rule(cli, tmp_path, eps):
    path = tmp_path / "in" / "bn.safetensors"
    path.parent.mkdir()
    _bn_checkpoint(path, 1.0, 1.0)
    rules = write_rules(tmp_path / "r.toml", BN_RULES + f"eps = {eps}\n")
    refused(cli("plan", path, "-r", rules), "rule '#1 bn_fold'", f"eps = {float(eps)!r}", "finite number ≥ 0")
    refused_to_write(cli, path, rules, tmp_path, f"eps = {float(eps)!r}")


def test_an_eps_that_zeroes_the_layer_is_refused_not_written(cli, tmp_path):
    """eps = 1e300 is finite, but float32 holds it as infinity: every scale is 0 and the folded
    conv a constant (exit 0 before)."""
    path = tmp_path / "in" / "bn.safetensors"
    path.parent.mkdir()
    _bn_checkpoint(path, 1.0, 1.0)
    rules = write_rules(tmp_path / "r.toml", BN_RULES + "eps = 1e300\n")
    refused_to_write(cli, path, rules, tmp_path, "4 output channel(s) (first: 0) become all zeros",
                     "underflows float32", "eps = 1e+300")
