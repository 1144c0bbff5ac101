"""Invert a rules file rule by rule (``fusectl unfuse -r``): reversed order, inverse ops, and
only the bindings the inverse can prove its forward rule made.

An inverted rule's pattern is the forward rule's output pattern, which may also match tensors
the forward rule left alone: the prefix strip ``model.{r*}`` → ``{r*}`` outputs ``layers.0.x``,
but ``lm_head.weight``, which it never touched, fits ``{r*}`` just as well. Names alone cannot
tell the two apart, so :class:`InverseProof` admits a binding only when it is proven:

* **by the provenance**, when the checkpoint's recorded plan has groups of the forward rule
  (same rule name, and the same rules text or, for provenances that predate recorded texts,
  the same source): a group lists every binding the rule made, so the inverse runs exactly the
  recorded steps whose outputs are still the tensors of that name (same op, parameters, names
  and specs) and leaves every other tensor alone. A binding that overlaps a recorded step but
  is not it is refused.
  A provenance that records no step of the forward rule (an ``unfuse`` wrote an empty plan,
  or the file was fused with other rules) proves that the rule made nothing there: every
  binding is left alone, and a rule none of whose bindings is admitted is an error.
* Without a provenance nothing is proven: not even an in-place step (``llama-rope``, a
  transpose), whose input and output names are the same, so a never-fused tensor looks exactly
  like one the rule rewrote. Every binding is refused, naming the tensor.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from ..errors import PlanError, option_name, quote, speaking_cli
from ..steps import Plan, RuleOrigin, Step
from .schema import Rule, RuleSet

def _use_provenance() -> str:
    """How to unfuse from the provenance instead, in the caller's words."""
    how = "`fusectl unfuse CKPT -o OUT`" if speaking_cli() else "`fusectl.unfuse(ckpt, out)`"
    return (f"unfuse a checkpoint fusectl fused without {option_name('rules')} ({how} inverts its recorded "
            "provenance, which says which tensors each rule made)")


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
                f"rule alone cannot say which name to go back to; unfuse with the provenance instead of "
                f"{option_name('rules')}"
            )
    # every invertible op maps the forward rule's outputs back to its inputs
    return replace(rule, name=f"{rule.name} (inverse)", op=op,
                   inputs=rule.outputs, outputs=rule.inputs)


def _undone(ruleset: RuleSet) -> list[tuple[int, Rule]]:
    """The rules an inverse undoes, last first, with their index in the file; guards
    (``refuse``) change nothing and are left out."""
    return [(k, r) for k, r in reversed(list(enumerate(ruleset.rules))) if not r.op.guard]


def invert_ruleset(ruleset: RuleSet) -> RuleSet:
    """The rules that undo ``ruleset``, last first; guards (``refuse``) change nothing and are left out."""
    try:
        config = ruleset.config.inverse() if ruleset.config is not None else None
    except PlanError as e:
        raise PlanError(f"{ruleset.source} [config]: {e}") from None
    return replace(ruleset, rules=tuple(invert_rule(r) for _, r in _undone(ruleset)), config=config)


def invert_with_proof(rulesets: Sequence[RuleSet], origins: Sequence[RuleOrigin], history: Plan | None,
                      where: str) -> tuple[list[RuleSet], "InverseProof"]:
    """``unfuse -r``: the inverted rulesets (last file first) and the proof that admits their
    bindings. ``origins`` are the files' texts as loaded (one per ruleset); ``history`` is the
    checkpoint's recorded plan (None without provenance); ``where`` names the checkpoint."""
    inverted, forward = [], {}
    for ruleset, origin in zip(reversed(rulesets), reversed(origins)):
        inverse = invert_ruleset(ruleset)
        for rule, (index, fwd) in zip(inverse.rules, _undone(ruleset)):
            forward[id(rule)] = (fwd, replace(origin, rule=index))
        inverted.append(inverse)
    return inverted, InverseProof(inverted, forward, history, where)


class InverseProof:
    """Admits an inverted rule's binding only when it can show the forward rule produced the
    tensors it consumes (the module doc says how); the planner asks it for every binding."""

    def __init__(self, inverted: Sequence[RuleSet], forward: dict[int, tuple[Rule, RuleOrigin]],
                 history: Plan | None, where: str):
        self._inverted = inverted  # keeps the rules whose ids key ``forward`` alive
        self._forward = forward
        self._recorded = history is not None
        self._history = history if history is not None else Plan()
        self._writers = _Writers(self._history)
        self._where = where
        self.left_alone: list[str] = []  # tensors the provenance says the rules did not make

    def admits(self, rule: Rule, step: Step) -> bool:
        """Whether the inverse ``step`` of ``rule`` undoes something the forward rule made, by
        the recorded provenance; PlanError when there is none to tell (names alone cannot)."""
        forward, origin = self._forward[id(rule)]
        if not self._recorded:
            raise PlanError(
                f"{rule.describe()}: {quote(step.inputs[0])} may be a tensor the forward rule left alone, "
                f"and {self._where} has no fusectl provenance to tell (names cannot: a tensor "
                f"{forward.describe()} never touched has the name of one it made), so undoing it into "
                f"{_names(step.outputs)} would be a guess; {_use_provenance()}, or "
                f"write the conversion as forward rules for {'`fusectl fuse`' if speaking_cli() else '`fusectl.fuse`'}")
        return self._by_provenance(rule, forward, step, self._recorded_groups(forward, origin))

    def nothing_admitted(self, rule: Rule) -> PlanError:
        """The PlanError for an inverse rule whose every match the provenance says its forward
        rule did not make (returned for the planner to raise)."""
        forward, _ = self._forward[id(rule)]
        return PlanError(
            f"{rule.describe()}: every tensor it matches is one the provenance of {self._where} says "
            f"{forward.describe()} did not make, so there is nothing of it to undo; check the rules, or "
            f"{_use_provenance()}")

    def _recorded_groups(self, forward: Rule, origin: RuleOrigin) -> set[int]:
        def made_by(group) -> bool:
            if group.rule != forward.name or not group.steps:
                return False
            if group.origin is not None:
                return group.origin.sha256 == origin.sha256 and group.origin.rule == origin.rule
            return group.source == forward.source
        return {g for g, group in enumerate(self._history.groups) if made_by(group)}

    def _by_provenance(self, rule: Rule, forward: Rule, step: Step, groups: set[int]) -> bool:
        writers = {self._writers.of(n) for n in step.inputs}
        mine = {w for w in writers if w is not None and w[0] in groups}
        if not mine:
            self.left_alone.extend(step.inputs)
            return False
        key = min(mine)
        recorded = self._history.groups[key[0]].steps[key[1]]
        if writers == {key} and _undoes(forward, recorded, step):
            self._writers.undo(key, recorded)
            return True
        raise PlanError(
            f"{rule.describe()}: would make {_names(step.outputs)} from {_names(step.inputs)}, but the "
            f"provenance of {self._where} records {forward.describe()} making {_names(recorded.outputs)} "
            f"from {_names(recorded.inputs)} ({recorded.op.kind}); the rules do not fit what was recorded. "
            f"U{_use_provenance()[1:]}")


def _undoes(forward: Rule, recorded: Step, step: Step) -> bool:
    """Whether ``step`` (an inverted binding) is exactly the inverse of ``recorded``: the same
    op as the forward rule gives for those inputs, the same names and the same specs."""
    op = forward.op.for_present(list(recorded.input_specs))
    return (type(recorded.op) is type(op) and recorded.op.params() == op.params()
            and recorded.outputs == step.inputs and recorded.inputs == step.outputs
            and recorded.output_specs == step.input_specs and recorded.input_specs == step.output_specs)


def _names(names) -> str:
    return ", ".join(quote(n) for n in names)


class _Writers:
    """Which recorded step wrote each name now in the checkpoint, replayed from the plan, so
    that undoing a step brings back the writers of the names it consumed."""

    def __init__(self, plan: Plan):
        self._now: dict[str, tuple[int, int]] = {}
        self._before: dict[tuple[int, int], dict[str, tuple[int, int] | None]] = {}
        for g, group in enumerate(plan.groups):
            for k, step in enumerate(group.steps):
                touched = {*step.inputs, *step.outputs}
                self._before[(g, k)] = {n: self._now.get(n) for n in touched}
                for name in step.inputs:
                    self._now.pop(name, None)
                for name in step.outputs:
                    self._now[name] = (g, k)

    def of(self, name: str) -> tuple[int, int] | None:
        """The (group, step) that wrote ``name`` last; None when it predates the plan."""
        return self._now.get(name)

    def undo(self, key: tuple[int, int], step: Step) -> None:
        """Forget that step ``key`` wrote its outputs: each name it touched goes back to its writer before it."""
        for name in step.outputs:
            self._now.pop(name, None)
        for name, writer in self._before[key].items():
            if writer is None:
                self._now.pop(name, None)
            else:
                self._now[name] = writer
