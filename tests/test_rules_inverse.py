"""rules/inverse.py: which rules invert from the rule alone, asked of each rule's op."""

from __future__ import annotations

import pytest

from conftest import LLAMA, assert_refused, snapshot
from fusectl.errors import PlanError
from fusectl.ops.layout import Concat, Stack, Unstack
from fusectl.rules.inverse import invert_rule, invert_ruleset
from fusectl.rules.schema import load_rules


SRC = "rules/test.toml"


def rules(text: str):
    return load_rules("version = 1\n" + text, SRC, None)


def test_a_stack_over_an_explicit_list_is_not_inverted_from_the_rule():
    (rule,) = rules('[[rule]]\nname = "st"\nop = "stack"\ninputs = ["a", "b"]\noutput = "c"\n').rules
    with pytest.raises(PlanError) as e:
        invert_rule(rule)
    assert str(e.value) == (
        f"rule 'st' ({SRC}): a stack over an explicit list cannot be undone from the rule alone; "
        "use over = \"placeholder\" or unfuse with the provenance")


def test_a_concat_over_a_placeholder_is_not_inverted_from_the_rule():
    (rule,) = rules('[[rule]]\nname = "c"\nop = "concat"\ninput = "a.{e}"\noutput = "c"\n'
                    'over = "e"\nsizes = [2, 2]\n').rules
    with pytest.raises(PlanError) as e:
        invert_rule(rule)
    assert str(e.value) == (
        f"rule 'c' ({SRC}): a concat over {{e}} cannot be undone from the rule alone; "
        "unfuse with the provenance instead of rules")  # the API names its keyword


def test_the_ops_say_which_gatherings_their_rules_cannot_invert():
    assert Stack().rule_inverse_problem("e") is None and Unstack().rule_inverse_problem("e") is None
    # an unstack rule always has over (schema); the op still says why a list would not do
    assert "unstack over an explicit list" in Unstack().rule_inverse_problem(None)
    assert Concat(sizes=(1, 2)).rule_inverse_problem(None) is None


def test_a_stack_over_a_placeholder_and_a_concat_over_a_list_invert():
    rs = rules('[[rule]]\nname = "s"\nop = "stack"\ninput = "x.{e:int}.w"\noutput = "x.w"\nover = "e"\n'
               '[[rule]]\nname = "c"\nop = "concat"\ninputs = ["a", "b"]\noutput = "ab"\nsizes = [1, 2]\n')
    inverse = invert_ruleset(rs)
    assert [(r.name, r.op.kind) for r in inverse.rules] == [("c (inverse)", "split"), ("s (inverse)", "unstack")]


def test_guards_are_left_out_of_the_inverse():
    rs = rules('[[rule]]\nname = "no"\nop = "refuse"\ninput = "w_hr"\nmessage = "not supported"\n'
               '[[rule]]\nname = "r"\nop = "rename"\ninput = "a"\noutput = "b"\n')
    assert [r.name for r in invert_ruleset(rs).rules] == ["r (inverse)"]


# --- bad input through the CLI: refused in full (conftest.assert_refused) ----------------


def test_unfuse_rules_that_do_not_fit(cli, area, copy_fixture):
    """Inverting llama-qkv needs qkv_proj, which an unfused checkpoint lacks."""
    src = copy_fixture(LLAMA)
    out = area / "out" / "restored"
    before = snapshot(area / "in")
    result = cli("unfuse", src, "-r", "llama-qkv", "-o", out)
    assert_refused(result, out, before, area / "in", "qkv_proj")
