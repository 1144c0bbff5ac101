"""Bind rules to a parameter table: the :class:`~fusectl.steps.Plan` they make, from headers alone.

Each rule binds against the table as the rules before it left it; the executor applies each
group as it is bound (``executor.apply_group``), so the table the planner ends with is the one
``run_plan`` makes from the finished plan.

Rules bind to base weights only. What rides on them (``fusectl.followers``) is asked through
``_protocols``: the riders' names are no bindings of their own, and each rule's group gets the
riders' steps before it is applied (``Riders``); a view follower's base is bound instead of its
table and its lifted steps are the plan (``View``). :func:`bind_and_lift` is the one place
that does both, for every caller.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, replace
from typing import Protocol, Sequence

from ._protocols import FollowerSet, Riders
from .errors import PlanError, RuleError, quote
from .executor import apply_group
from .limits import check_limit
from .steps import Plan, RuleOrigin, Step, StepGroup
from .rules.schema import Rule, RuleSet
from .table import ParamTable
from .tensors import TensorSpec


class BindingProof(Protocol):
    """Decides which bindings of a rule may become steps (``unfuse -r``: only those the
    inverted rule can prove its forward rule produced; see ``fusectl.rules.inverse``)."""

    def admits(self, rule: Rule, step: Step) -> bool:
        """True to keep the step, False to leave its tensors alone; PlanError to refuse."""

    def nothing_admitted(self, rule: Rule) -> PlanError:
        """The error for a rule that bound tensors of which none was admitted."""


@dataclass(frozen=True)
class Bound:
    """Rules bound to a checkpoint and lifted to its followers: the plan, the table running it
    makes, and for a view follower the plan on its base view the steps were lifted from."""

    plan: Plan
    table: ParamTable
    base: Plan | None = None


def bind_and_lift(table: ParamTable, followers: FollowerSet, rulesets: Sequence[RuleSet], untie: bool = False, *,
                  origins: Sequence[RuleOrigin] | None = None, proof: BindingProof | None = None) -> Bound:
    """Bind ``rulesets`` to ``table`` (a checkpoint's, with its ``followers``), from headers alone.

    The rules bind to the base weights and every rider follower's steps join each group; where
    a view follower stands in for the base (it holds no base weights), they bind to its base view and the
    view lifts the base plan to its own tensors. ``origins`` (one per ruleset) are recorded on
    the groups bound to the table itself; ``proof`` filters the bindings (``unfuse -r``)."""
    riders = followers.riders(rulesets)
    view = followers.view
    if view is None:
        plan, result = make_plan(table, rulesets, untie, riders, origins=origins, proof=proof)
        return Bound(plan, result)
    base, _ = make_plan(view.base_view(table), rulesets, True, riders, proof=proof)
    plan, result = view.lift_plan(base, table, untie)
    return Bound(plan, result, base)


def lift_recorded(table: ParamTable, plan: Plan, riders: Riders, untie: bool = True) -> Plan:
    """A plan made without the ``riders`` (a provenance, its inverse: the model's steps) with
    each group's steps lifted to them, each on ``table`` as the groups before left it: what an
    optimizer's state takes when ``unfuse`` replays a recorded plan, or ``verify`` checks it."""
    current = table.copy()
    groups = []
    for group in plan.groups:
        steps = riders.lift(group.steps, current, group.describe())
        groups.append(apply_group(current, replace(group, steps=tuple(steps)), untie))
    return Plan(tuple(groups))


def make_plan(table: ParamTable, rulesets: Sequence[RuleSet], untie: bool = False, riders: Riders | None = None, *,
              origins: Sequence[RuleOrigin] | None = None,
              proof: BindingProof | None = None) -> tuple[Plan, ParamTable]:
    """Bind ``rulesets`` in order to a copy of ``table``: the plan and the table it makes.

    ``riders`` (``followers.Followers.riders``) are the followers in the table: their tensors
    move with the weights the rules bind. ``origins`` (one per ruleset: its text and the config
    values its vars read) are recorded on each group with the rule's index, so the provenance
    says how to bind it again. ``proof`` filters the bindings (``unfuse -r``)."""
    current = table.copy()
    groups: list[StepGroup] = []
    for k, ruleset in enumerate(rulesets):
        origin = origins[k] if origins is not None else None
        empty = ruleset.changes_nothing()
        if empty:
            raise PlanError(f"{ruleset.source}: {empty}; it would change nothing. Add rules, or leave it out")
        applied = 0
        for index, rule in enumerate(ruleset.rules):
            steps = bind_rule(rule, current, riders, proof)
            if steps:
                recorded = replace(origin, rule=index) if origin is not None else None
                if recorded is not None and riders is not None:
                    recorded = riders.recorded(recorded)
                groups.append(apply_group(current, StepGroup(rule.name, rule.source, tuple(steps),
                                                             origin=recorded), untie))
                applied += 1
        # optional rules may each match nothing, but a file of which no rule matches does not
        # fit this model at all (a fold preset on a model without the reparametrization)
        if ruleset.rules and not applied and not all(r.op.guard for r in ruleset.rules):
            raise PlanError(f"{ruleset.source}: no rule matched any tensor of the checkpoint; "
                            "check that these rules fit this model")
        if ruleset.config is not None:
            groups.append(StepGroup("[config]", ruleset.source, (), config=ruleset.config))
    return Plan(tuple(groups)), current


def bind_rule(rule: Rule, table: ParamTable, riders: Riders | None = None,
              proof: BindingProof | None = None) -> list[Step]:
    """Concrete steps for one rule against the current table (headers only), each followed by
    the steps of the ``riders`` on the weights it consumes. With ``proof``, only the bindings
    it admits become steps."""
    names = table.names()
    steps: list[Step] = []
    left_alone = 0
    bindings = list(_bindings(rule, names, table))
    # a binding made only of rider tensors (a pattern matching a weight and what rides on it
    # alike) is not one of its own: they move with their weight
    claimed = riders.claimed(n for inputs, _ in bindings for n in inputs if n is not None) if riders else set()
    for inputs, binding in bindings:
        if claimed and all(n in claimed for n in inputs if n is not None):
            continue
        # specs, not just presence: an op may resolve a parameter from them (bn_fold's layer)
        op = rule.op.for_present([table.spec(n) if n is not None else None for n in inputs])
        try:
            op = op.for_names(inputs)
        except PlanError as e:
            raise PlanError(f"{rule.describe()}: {e}") from e
        if riders is not None:
            op = riders.complete(op)
        inputs = [n for n in inputs if n is not None]
        specs = tuple(table.spec(n) for n in inputs)
        for name, spec in zip(inputs, specs):
            if spec.dtype.packed and not op.moves_packed:
                raise PlanError(
                    f"{rule.describe()}: {name!r} is {spec.dtype}, packed below one byte per "
                    f"element; fusectl can rename, drop or copy it, not {op.kind} it"
                )
        try:
            out_specs = tuple(op.infer(specs, inputs))
            outputs = _outputs(rule, binding, specs)
        except PlanError as e:
            raise PlanError(f"{rule.describe()}: {e}") from e
        step = Step(op, tuple(inputs), tuple(outputs), specs, out_specs)
        if proof is not None and not proof.admits(rule, step):
            left_alone += 1
            continue
        steps.append(step)
    if not steps and left_alone and not rule.optional:
        raise proof.nothing_admitted(rule)
    if not steps and not rule.optional:
        raise PlanError(
            f"{rule.describe()} matches nothing: no tensor fits {_first(rule).text!r}"
            f"{_closest_hint(rule.inputs[0].text, names)}. Fix the pattern or set optional = true"
        )
    return riders.lift(steps, table, rule.describe()) if riders is not None else steps


def _bindings(rule: Rule, names: Sequence[str], table: ParamTable):
    over = rule.over if rule.op.gathers_over else None
    if over is not None:
        pattern = rule.inputs[0]
        gathered: dict[tuple, list[tuple[str, str]]] = {}
        for name in names:
            b = _match(rule, pattern, name)
            if b is not None:
                key = tuple((k, v) for k, v in b.items() if k != over)
                gathered.setdefault(key, []).append((b[over], name))
        for key, items in sorted(gathered.items()):
            numeric = all(v.isdigit() for v, _ in items)
            items.sort(key=lambda item: (int(item[0]), item[0]) if numeric else (0, item[0]))
            if rule.op.indexed_over:
                indices = [int(v) if v.isdigit() else None for v, _ in items]
                if indices != list(range(len(items))):
                    raise PlanError(
                        f"{rule.describe()}: stacking over {{{over}}} needs indices 0..{len(items) - 1}, "
                        f"found {[v for v, _ in items]} for {pattern.format({**dict(key), over: '*'})!r}"
                    )
            yield [n for _, n in items], dict(key)
        return
    # the inputs that find bindings: the op's binding_inputs (a BatchNorm's running
    # statistics), else every input; the others must then exist for each binding found
    roles = rule.op.named_inputs
    finders = [k for k, p in enumerate(rule.inputs) if p is not None and (
        not rule.op.binding_inputs or (k < len(roles) and roles[k] in rule.op.binding_inputs))]
    bindings: dict[tuple, dict[str, str]] = {}
    for k in finders:
        for name in names:
            b = _match(rule, rule.inputs[k], name)
            if b is not None:
                bindings.setdefault(tuple(sorted(b.items())), b)
    for _, binding in sorted(bindings.items()):
        try:
            inputs = [p.format(binding) if p is not None else None for p in rule.inputs]
        except (PlanError, RuleError) as e:  # {n-1} with n = 0
            raise PlanError(f"{rule.describe()}: {e}") from e
        for k, name in enumerate(inputs):
            if name is None or name in table:
                continue
            if k in rule.op.optional_inputs:
                inputs[k] = None
                continue
            present = next(inputs[j] for j in [*finders, *range(len(inputs))]
                           if inputs[j] is not None and inputs[j] in table)
            raise PlanError(
                f"{rule.describe()}: {name!r} not found (the rule found {present!r})"
                f"{_closest_hint(name, names)}; check the pattern"
            )
        yield inputs, binding


def _first(rule: Rule):
    return next(p for p in rule.inputs if p is not None)


def _match(rule: Rule, pattern, name: str):
    try:
        return pattern.match(name)
    except RuleError as e:
        raise RuleError(f"{rule.describe()}: {e}") from e


def _outputs(rule: Rule, binding: dict[str, str], specs: Sequence[TensorSpec]) -> list[str]:
    if not rule.op.gathers_over:  # over names the outputs (unstack)
        count = rule.op.output_count(specs)
        names = [rule.outputs[0].format({**binding, rule.over: str(k)}) for k in range(count)]
    else:
        names = [p.format(binding) for p in rule.outputs]
    for name in names:
        if not name or "" in name.split("."):
            raise PlanError(f"output pattern makes the name {name!r}, which has an empty segment; "
                            "use {x*} for parts that may be empty")
        if name in RESERVED_NAMES:
            raise PlanError(f"output pattern makes the name {name!r}, which safetensors reserves for "
                            "its metadata; choose another output name")
        check_limit("name-bytes", len(name.encode("utf-8", "surrogatepass")), f"output name {quote(name[:80])}…",
                    PlanError)
    return names


# names a safetensors header keeps for itself (and fusectl for its npz metadata member)
RESERVED_NAMES = frozenset({"__metadata__", "__fusectl_metadata__"})


def _closest_hint(name: str, names: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    if close:
        return f"; the checkpoint has {close[0]!r}"
    # nothing close (rules written for another model): the nearest of the checkpoint's name
    # forms, layer numbers aside, so the message shows what this model holds
    digits = str.maketrans("123456789", "0" * 9)
    forms: dict[str, str] = {}
    for n in names:
        forms.setdefault(n.translate(digits), n)
    nearest = difflib.get_close_matches(name, list(forms)[:2000], n=3, cutoff=0)
    return f"; nothing is close, its nearest names are {', '.join(repr(forms[f]) for f in nearest)}" if nearest else ""


