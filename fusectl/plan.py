"""Bind rules to a parameter table → a Plan of frozen steps, computed from headers alone.

The plan is data: ``fusectl plan`` prints it, ``fuse`` executes it and stores it as
provenance, ``unfuse`` executes ``plan.inverse()``.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, replace
from typing import Sequence

from .errors import PlanError, RuleError, TieError, quote
from .limits import check_limit
from .ops import OPS, Op
from .rules.schema import Rule, RuleSet
from .table import ParamTable
from .tensors import ByteRange, LazyTensor, TensorSpec


@dataclass(frozen=True)
class Step:
    """One concrete application of an op: named inputs → named outputs, specs known."""

    op: Op
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    input_specs: tuple[TensorSpec, ...]
    output_specs: tuple[TensorSpec, ...]

    def inverse(self) -> "Step | None":
        op = self.op.inverse(self.input_specs)
        if op is None:
            return None
        return Step(op, self.outputs, self.inputs, self.output_specs, self.input_specs)


@dataclass(frozen=True)
class StepGroup:
    """The steps one rule produced; ties are judged per group."""

    rule: str
    source: str
    steps: tuple[Step, ...]
    untied: tuple[tuple[str, ...], ...] = ()  # tie groups this rule broke (--untie)
    # for each untied group, its members the input stored (an alias became a copy)
    untied_stored: tuple[tuple[str, ...], ...] = ()
    retie: tuple[tuple[str, ...], ...] = ()  # groups an inverse ties again (exact steps only)
    retie_stored: tuple[tuple[str, ...], ...] = ()  # ... and which of their members stay stored

    @property
    def kind(self) -> str:
        return self.steps[0].op.kind if self.steps else "none"

    def describe(self) -> str:
        return f"rule {self.rule!r} ({self.source})"


@dataclass(frozen=True)
class Plan:
    """An ordered list of step groups."""

    groups: tuple[StepGroup, ...] = ()

    @property
    def steps(self) -> list[Step]:
        return [s for g in self.groups for s in g.steps]

    def inverse(self) -> "Plan":
        """The plan that undoes this one; PlanError naming the first one-way step."""
        groups = []
        for group in reversed(self.groups):
            steps = []
            for step in reversed(group.steps):
                inverse = step.inverse()
                if inverse is None:
                    raise PlanError(
                        f"{group.describe()} is one-way: its {step.op.kind} step on "
                        f"{', '.join(repr(n) for n in step.inputs)} cannot be undone"
                    )
                steps.append(inverse)
            # undoing exact steps makes the untied copies bitwise equal again: tie them back
            exact = all(s.op.exact for s in group.steps)
            groups.append(StepGroup(group.rule, group.source, tuple(steps),
                                    retie=group.untied if exact else (),
                                    retie_stored=group.untied_stored if exact else ()))
        return Plan(tuple(groups))

    def __add__(self, other: "Plan") -> "Plan":
        return Plan(self.groups + other.groups)


@dataclass(frozen=True, eq=False)
class Computation:
    """One op over input tensors; its outputs are computed together."""

    op: Op
    inputs: tuple[LazyTensor, ...]
    output_specs: tuple[TensorSpec, ...]
    label: str
    input_names: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False)
class ComputedTensor(LazyTensor):
    """Output ``index`` of a computation."""

    spec: TensorSpec
    computation: Computation
    index: int

    def has_data(self) -> bool:
        return all(t.has_data() for t in self.computation.inputs)

    def byte_ranges(self) -> tuple[ByteRange, ...] | None:
        ranges = [t.byte_ranges() for t in self.computation.inputs]
        if any(r is None for r in ranges):
            return None
        specs = [t.spec for t in self.computation.inputs]
        return self.computation.op.byte_ranges(ranges, specs, self.index)


@dataclass
class Planner:
    """Applies step groups to a table, judging ties; ``table`` is the state after each group."""

    table: ParamTable
    untie: bool = False
    groups: list[StepGroup] = field(default_factory=list)

    def apply_rules(self, ruleset: RuleSet) -> None:
        if not ruleset.rules and not ruleset.ties:
            raise PlanError(f"{ruleset.source}: has no [[rule]] and no [ties]; it would change nothing. "
                            "Add rules, or leave it out")
        applied = 0
        for rule in ruleset.rules:
            steps = bind_rule(rule, self.table)
            if steps:
                self.apply_group(StepGroup(rule.name, rule.source, tuple(steps)))
                applied += 1
        # optional rules may each match nothing, but a file of which no rule matches does not
        # fit this model at all (a fold preset on a model without the reparametrization)
        if ruleset.rules and not applied and any(r.op.kind != "refuse" for r in ruleset.rules):
            raise PlanError(
                f"{ruleset.source}: no rule matched any tensor of the checkpoint; "
                "check that these rules fit this model"
            )

    def apply_plan(self, plan: Plan, what: str) -> None:
        for group in plan.groups:
            for step in group.steps:
                for name, spec in zip(step.inputs, step.input_specs):
                    if name not in self.table:
                        raise PlanError(
                            f"{what}: {group.describe()} needs {name!r}, which the checkpoint lacks"
                        )
                    if self.table.spec(name) != spec:
                        raise PlanError(
                            f"{what}: {group.describe()} expects {name!r} as {spec}, "
                            f"but the checkpoint has {self.table.spec(name)}"
                        )
                # recorded output specs are re-derived, not trusted: an edited record is refused
                try:
                    derived = tuple(step.op.infer(step.input_specs, step.inputs))
                except PlanError as e:
                    raise PlanError(f"{what}: {group.describe()}: {e}") from None
                if derived != step.output_specs or len(derived) != len(step.outputs):
                    raise PlanError(
                        f"{what}: {group.describe()} records outputs {[str(x) for x in step.output_specs]} "
                        f"that its op does not produce; the provenance was edited or corrupted"
                    )
            self.apply_group(group)

    def plan(self) -> Plan:
        return Plan(tuple(self.groups))

    def apply_group(self, group: StepGroup) -> None:
        table = self.table
        consumed = {n for step in group.steps for n in step.inputs}
        produced: set[str] = set()
        for step in group.steps:
            for name in step.outputs:
                if name in produced or (name in table and name not in consumed):
                    raise PlanError(
                        f"{group.describe()}: output {name!r} already exists; "
                        "rename or drop it first, or change the output pattern"
                    )
                produced.add(name)
        untied = self._judge_ties(group, consumed)
        untied_stored = tuple(tuple(m for m in members if m in table.stored) for members in untied)

        new_entries: dict[str, LazyTensor] = {}
        # steps applying one op to the same tensors (tied members treated alike) compute once,
        # so their outputs are tied in turn
        done: dict[tuple, tuple[LazyTensor, ...]] = {}
        for step in group.steps:
            sources = tuple(table[n] for n in step.inputs)
            key = self._step_key(step)
            if step.op.kind == "rename":
                outputs: tuple[LazyTensor, ...] = sources
            elif key in done:
                outputs = done[key]
            else:
                label = f"{group.describe()}: {_roles(step)}"
                computation = Computation(step.op, sources, step.output_specs, label, step.inputs)
                outputs = tuple(
                    ComputedTensor(spec, computation, k) for k, spec in enumerate(step.output_specs)
                )
                done[key] = outputs
            new_entries.update(zip(step.outputs, outputs))
        # a step's outputs are stored when an input was: an output of a stored tensor must be
        # written even where it is tied, so that no loader loses a tensor the input had
        stored_outputs = {o for step in group.steps if any(n in table.stored for n in step.inputs)
                          for o in step.outputs}
        for name in consumed:
            del table.entries[name]
        table.stored -= consumed
        table.stored |= stored_outputs
        table.entries.update(new_entries)
        for k, members in enumerate(group.retie):
            present = [m for m in members if m in table]
            untouched = [m for m in present if m not in new_entries]
            if len(present) > 1:
                table.tie(present, keep=(untouched or present)[0])
                # a member that was an alias before the tie was broken is one again; what the
                # input stored stays stored (a provenance without the record keeps one)
                copies = sorted(m for m in present if m in table.stored)
                stored_before = set(group.retie_stored[k]) if k < len(group.retie_stored) else set(copies[:1])
                table.stored -= set(copies) - (stored_before or set(copies[:1]))
        self.groups.append(replace(group, untied=untied, untied_stored=untied_stored))

    def _step_key(self, step: Step) -> tuple:
        return (step.op, tuple(id(self.table[n]) for n in step.inputs))

    def _judge_ties(self, group: StepGroup, consumed: set[str]) -> tuple[tuple[str, ...], ...]:
        """Tie groups this rule breaks: allowed only with untie (returned so the plan records
        them), else a TieError naming rule and group.

        A group stays tied when the rule renames or drops its members, or when every member
        is consumed by a step applying the same op to the same tensors (a transpose of each
        member; a concat of parts that are tied pairwise).
        """
        if group.kind in ("rename", "drop"):
            return ()
        consumer = {n: step for step in group.steps for n in step.inputs}
        untied = []
        for members in self.table.ties():
            hit = [m for m in members if m in consumer]
            if not hit:
                continue
            alike = len(hit) == len(members) and len({self._step_key(consumer[m]) for m in members}) == 1
            if alike:
                continue
            if not self.untie:
                rest = [m for m in members if m not in hit]
                how = (f"uses {', '.join(repr(m) for m in hit)} but not {', '.join(repr(m) for m in rest)}"
                       if rest else "treats its members differently (one is combined with other tensors)")
                raise TieError(
                    f"{group.describe()} {how} of the tied group {members}; this would break the "
                    "tie. Pass --untie to write the members as separate copies"
                )
            untied.append(tuple(members))
        return tuple(untied)


def bind_rule(rule: Rule, table: ParamTable) -> list[Step]:
    """Concrete steps for one rule against the current table (headers only)."""
    names = table.names()
    steps: list[Step] = []
    for inputs, binding in _bindings(rule, names, table):
        # specs, not just presence: an op may resolve a parameter from them (bn_fold's layer)
        op = rule.op.for_present([table.spec(n) if n is not None else None for n in inputs])
        inputs = [n for n in inputs if n is not None]
        specs = tuple(table.spec(n) for n in inputs)
        for name, spec in zip(inputs, specs):
            if spec.dtype.packed and op.kind not in ("rename", "drop"):
                raise PlanError(
                    f"{rule.describe()}: {name!r} is {spec.dtype}, packed below one byte per "
                    f"element; fusectl can rename, drop or copy it, not {op.kind} it"
                )
        try:
            out_specs = tuple(op.infer(specs, inputs))
            outputs = _outputs(rule, binding, specs)
        except PlanError as e:
            raise PlanError(f"{rule.describe()}: {e}") from None
        steps.append(Step(op, tuple(inputs), tuple(outputs), specs, out_specs))
    if not steps and not rule.optional:
        raise PlanError(
            f"{rule.describe()} matches nothing: no tensor fits {_first(rule).text!r}"
            f"{_closest_hint(rule.inputs[0].text, names)}. Fix the pattern or set optional = true"
        )
    return steps


def _bindings(rule: Rule, names: Sequence[str], table: ParamTable):
    over = rule.over if rule.op.kind != "unstack" else None
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
            if rule.op.kind == "stack":
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
            raise PlanError(f"{rule.describe()}: {e}") from None
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


def _roles(step: Step) -> str:
    """The step's inputs, with their roles for ops that name them (``var=bn1.running_var``)."""
    roles = step.op.input_roles()
    if len(roles) != len(step.inputs):
        return ", ".join(step.inputs)
    return ", ".join(f"{r}={n}" for r, n in zip(roles, step.inputs))


def _first(rule: Rule):
    return next(p for p in rule.inputs if p is not None)


def _match(rule: Rule, pattern, name: str):
    try:
        return pattern.match(name)
    except RuleError as e:
        raise RuleError(f"{rule.describe()}: {e}") from None


def _outputs(rule: Rule, binding: dict[str, str], specs: Sequence[TensorSpec]) -> list[str]:
    if rule.op.kind == "unstack":
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
    return f"; the checkpoint has {close[0]!r}" if close else ""


def make_plan(table: ParamTable, rulesets: Sequence[RuleSet], untie: bool = False) -> tuple[Plan, ParamTable]:
    """Bind ``rulesets`` in order to a copy of ``table``: the plan and the resulting table."""
    planner = Planner(table.copy(), untie)
    for ruleset in rulesets:
        planner.apply_rules(ruleset)
    return planner.plan(), planner.table


def replay_plan(table: ParamTable, plan: Plan, what: str, untie: bool = False) -> ParamTable:
    """Apply an existing plan's steps to a copy of ``table``; the resulting table."""
    planner = Planner(table.copy(), untie)
    planner.apply_plan(plan, what)
    return planner.table


def op_from_record(kind: str, params: dict) -> Op:
    """Rebuild an op from its recorded kind and parameters (plans read back from JSON)."""
    if kind not in OPS:
        raise PlanError(f"recorded op {kind!r} is not known to this fusectl version")
    return OPS[kind].from_params(params)
