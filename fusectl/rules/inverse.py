"""Invert a rules file rule by rule (``fusectl unfuse -r``): reversed order, inverse ops."""

from __future__ import annotations

from dataclasses import replace

from ..errors import PlanError
from .schema import Rule, RuleSet


def invert_rule(rule: Rule) -> Rule:
    """The rule that undoes ``rule``; PlanError naming it when rules alone cannot say how."""
    try:
        op = rule.op.inverse(None)
    except PlanError as e:
        raise PlanError(f"{rule.describe()}: {e}") from None
    if op is None:
        raise PlanError(f"{rule.describe()} is one-way ({rule.op.kind}); it cannot be undone")
    problem = rule.op.rule_inverse_problem(rule.over)
    if problem is not None:
        raise PlanError(f"{rule.describe()}: {problem}")
    # what the inverse must bind: every placeholder of the inputs but the gathered one
    bound = set().union(*(p.names for p in rule.outputs)) | ({rule.over} if rule.over else set())
    for pattern in rule.inputs:
        dropped = sorted(pattern.names - bound) if pattern is not None else []
        if dropped:
            raise PlanError(
                f"{rule.describe()}: its output {rule.outputs[0].text!r} drops {{{dropped[0]}}}, so the "
                "rule alone cannot say which name to go back to; unfuse with the provenance instead of -r"
            )
    # every invertible op maps the forward rule's outputs back to its inputs
    return replace(rule, name=f"{rule.name} (inverse)", op=op,
                   inputs=rule.outputs, outputs=rule.inputs)


def invert_ruleset(ruleset: RuleSet) -> RuleSet:
    """The rules that undo ``ruleset``, last first; guards (``refuse``) change nothing and are left out."""
    rules = [r for r in reversed(ruleset.rules) if not r.op.guard]
    try:
        config = ruleset.config.inverse() if ruleset.config is not None else None
    except PlanError as e:
        raise PlanError(f"{ruleset.source} [config]: {e}") from None
    return replace(ruleset, rules=tuple(invert_rule(r) for r in rules), config=config)
