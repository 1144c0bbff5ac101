"""``[vars]`` (SPEC §3): integers, ``config:`` lookups, integer expressions over config keys
and other vars; every misuse is a RuleError that names the rules file and the var."""

from __future__ import annotations

import json
import os

import pytest

from conftest import time_limit
from conftest import LLAMA, refuse_case
from fusectl.errors import RuleError
from fusectl.rules.variables import evaluate, resolve_variables


SRC = "rules/attn.toml"

LLAMA_CONFIG = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64}


def test_plain_integers():
    assert resolve_variables({"a": 3, "b": 0, "c": -2}, None, SRC) == {"a": 3, "b": 0, "c": -2}


def test_integer_written_as_a_string():
    assert resolve_variables({"a": "12"}, None, SRC) == {"a": 12}


def test_config_lookup():
    got = resolve_variables(
        {"heads": "config:num_attention_heads", "kv": "config:num_key_value_heads"}, LLAMA_CONFIG, SRC
    )
    assert got == {"heads": 4, "kv": 2}


def test_spec_example_expressions():
    raw = {
        "heads": "config:num_attention_heads",
        "kv_heads": "config:num_key_value_heads",
        "head_dim": "config:hidden_size // heads",
        "q_rows": "heads * head_dim",
        "kv_rows": "kv_heads * head_dim",
    }
    assert resolve_variables(raw, LLAMA_CONFIG, SRC) == {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 8,
        "q_rows": 32,
        "kv_rows": 16,
    }


def test_vars_may_refer_forward():
    # order in the file does not matter: 'dim' uses 'heads' defined after it
    assert resolve_variables({"dim": "hidden_size // heads", "heads": 4}, {"hidden_size": 32}, SRC) == {
        "dim": 8,
        "heads": 4,
    }


def test_config_key_under_the_same_name_as_the_var():
    # "config:hidden_size" asks for the config key, so naming the var after it is natural
    assert resolve_variables({"hidden_size": "config:hidden_size"}, LLAMA_CONFIG, SRC) == {"hidden_size": 32}


@pytest.mark.parametrize(
    "expression, value",
    [
        ("7 // 2", 3),
        ("-7 // 2", -4),  # floor division, as Python
        ("7 % 4", 3),
        ("2 + 3 * 4", 14),
        ("(2 + 3) * 4", 20),
        ("10 - 2 - 3", 5),
        ("-(3)", -3),
        ("h // n * 3", 24),
        ("(h + n) % 5", 1),
    ],
)
def test_expressions(expression, value):
    assert resolve_variables({"x": expression}, {"h": 32, "n": 4}, SRC) == {"x": value}


def test_vars_shadow_config_keys_in_expressions():
    got = resolve_variables({"n": 2, "x": "h // n"}, {"h": 32, "n": 4}, SRC)
    assert got["x"] == 16


def test_missing_config_key_names_the_key_and_var():
    with pytest.raises(RuleError) as e:
        resolve_variables({"heads": "config:num_heads"}, LLAMA_CONFIG, SRC)
    msg = str(e.value)
    assert SRC in msg and "num_heads" in msg and "heads" in msg


def test_missing_config_key_inside_an_expression():
    with pytest.raises(RuleError) as e:
        resolve_variables({"dim": "config:hidden // 4"}, LLAMA_CONFIG, SRC)
    assert "hidden" in str(e.value) and "dim" in str(e.value)


def test_no_config_at_all():
    with pytest.raises(RuleError) as e:
        resolve_variables({"heads": "config:num_attention_heads"}, None, SRC)
    msg = str(e.value)
    assert SRC in msg and "num_attention_heads" in msg and "config" in msg


def test_no_config_is_fine_when_no_var_needs_it():
    assert resolve_variables({"a": "2 * 3"}, None, SRC) == {"a": 6}


@pytest.mark.parametrize("value", [4.0, "4", True, None, [4], {"n": 4}])
def test_non_integer_config_value(value):
    with pytest.raises(RuleError) as e:
        resolve_variables({"heads": "config:n"}, {"n": value}, SRC)
    assert "'n'" in str(e.value) and "heads" in str(e.value)


@pytest.mark.parametrize(
    "raw",
    [
        {"a": "a"},
        {"a": "b", "b": "a"},
        {"a": "b + 1", "b": "c * 2", "c": "a // 2"},
    ],
)
def test_cycles_are_errors(raw):
    with pytest.raises(RuleError) as e:
        resolve_variables(raw, {}, SRC)
    assert "cycle" in str(e.value)
    assert SRC in str(e.value)


@pytest.mark.parametrize(
    "expression",
    [
        "len(h)",  # function call
        "__import__('os').getcwd()",
        "h.real",  # attribute access
        "h[0]",  # subscript
        "2 ** 3",  # power: not in the list
        "7 / 2",  # true division gives floats
        "1.5",
        "'abc'",
        "True",
        "h if h else 1",
        "lambda: 1",
        "[1, 2]",
        "h < 3",
        "h << 1",
        "1; 2",
        "",
        "h =",
    ],
)
def test_disallowed_syntax_is_rejected(expression):
    with pytest.raises(RuleError) as e:
        resolve_variables({"x": expression}, {"h": 4}, SRC)
    assert SRC in str(e.value)


@pytest.mark.parametrize("value", [1.5, True, [1], {"a": 1}])
def test_non_integer_var_values_are_rejected(value):
    with pytest.raises(RuleError) as e:
        resolve_variables({"x": value}, None, SRC)
    assert "'x'" in str(e.value)


@pytest.mark.parametrize("expression", ["h // 0", "h % (n - 4)"])
def test_division_by_zero(expression):
    with pytest.raises(RuleError) as e:
        resolve_variables({"x": expression}, {"h": 4, "n": 4}, SRC)
    assert "zero" in str(e.value)


def test_unknown_name_in_expression_without_config():
    with pytest.raises(RuleError) as e:
        resolve_variables({"x": "undefined_name * 2"}, None, SRC)
    assert "undefined_name" in str(e.value)


def test_evaluate_uses_lookup_for_names():
    seen = []

    def lookup(name):
        seen.append(name)
        return {"a": 6, "b": 4}[name]

    assert evaluate("a * b - a // b", lookup, "here") == 23
    assert set(seen) == {"a", "b"}


def test_evaluate_names_where_in_errors():
    with pytest.raises(RuleError) as e:
        evaluate("f(1)", lambda n: 0, "rule 'r' (x.toml): sizes")
    assert "rule 'r' (x.toml): sizes" in str(e.value)


# ------------------------------------------------------------------------------ budgets


def test_vars_that_square_each_other_stop_at_64_bits_at_once():
    """22 vars each squaring the one before kept `plan` busy past 30 s; the value check stops
    the chain where it leaves int64, naming the var."""
    raw = {"s0": 2, **{f"s{k}": f"s{k - 1} * s{k - 1}" for k in range(1, 22)}}
    with time_limit(60), pytest.raises(RuleError, match=r"var 's6': the value has 65 bits"):
        resolve_variables(raw, None, SRC)


@pytest.mark.parametrize("expression", [
    " * ".join(["a"] * 3000),  # a 3,000-term product
    "-" * 100_000 + "1",  # 100,000 unary minus signs
])
def test_huge_expressions_are_refused_by_size(expression):
    with pytest.raises(RuleError, match=r"exceeds fusectl's limit of 1000.*FUSECTL_MAX_EXPRESSION_CHARS"):
        resolve_variables({"a": 2, "b": expression}, None, SRC)


def test_deeply_nested_expressions_within_the_size_are_refused():
    with pytest.raises(RuleError, match=r"nests more than 100 operators"):
        evaluate("-" * 500 + "1", {}.__getitem__, SRC)
    with pytest.raises(RuleError, match=r"is not an integer expression"):
        evaluate("(" * 300 + "1" + ")" * 300, {}.__getitem__, SRC)


def test_integers_past_64_bits_are_refused_from_every_source():
    with pytest.raises(RuleError, match=r"var 'a'.*64 bits"):
        resolve_variables({"a": 2**64}, None, SRC)
    with pytest.raises(RuleError, match=r"config key 'n'.*64 bits"):
        resolve_variables({"a": "config:n"}, {"n": 2**70}, SRC)
    with pytest.raises(RuleError, match=r"var 'a'.*64 bits"):
        resolve_variables({"a": "9223372036854775807 + 1"}, None, SRC)
    assert resolve_variables({"a": "9223372036854775807"}, None, SRC) == {"a": 2**63 - 1}


# --- bad input through the CLI: refused in full (conftest.assert_refused) ----------------


def test_sizes_that_do_not_match_config(cli, area, copy_fixture):
    """llama-qkv's GQA sizes come from config.json; a config that lies is caught at plan time."""
    src = copy_fixture(LLAMA)
    config = json.loads((src / "config.json").read_text())
    config["num_key_value_heads"] = 4
    (src / "config.json").write_text(json.dumps(config))
    refuse_case(cli, area, src, "-r", "llama-qkv", needles=["attn-qkv"])


def test_missing_config_variable(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    os.remove(src / "config.json")
    refuse_case(cli, area, src, "-r", "llama-qkv", needles=["num_attention_heads"])
