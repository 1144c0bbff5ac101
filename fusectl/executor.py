"""Run a plan: the steps of a :class:`~fusectl.steps.Plan` become frozen tasks over a table.

``run_plan(table, plan)`` is the one place a plan is applied. Each step turns into a
:class:`Task` (an op over the tensors it reads) whose outputs are :class:`StepOutput` tensors
in the resulting table; nothing is read until someone asks for data. Tasks are frozen and
hashable: two steps applying the same op to the same tensors (the members of a tie) are one
task, so they compute once and their outputs are tied in turn.

An :class:`Evaluation` computes what a set of tensors needs, keeping each task's outputs only
until their last real use: an output that is a plain byte copy of its inputs (a part of a
split, a stack) is read from those bytes and never asks for the task's arrays, so it is not
counted as a use.

``fuse`` and ``unfuse`` write the table ``run_plan`` returns, ``verify`` replays with it and
walks it group by group for the probes (``walk``), and ``export`` recovers the names a fused
checkpoint had before its plan (``recover_inputs``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Iterator, Sequence

import numpy as np

from .errors import ComputeError, PlanError, TieError, option, quote
from .ops import Op
from .steps import Plan, Step, StepGroup
from .table import ParamTable
from .tensors import ByteRange, LazyTensor, TensorSpec, read_ranges


@dataclass(frozen=True)
class Task:
    """One op over input tensors; its outputs are computed together. Equal tasks (same op,
    same input tensors) are one task."""

    op: Op
    inputs: tuple[LazyTensor, ...]
    output_specs: tuple[TensorSpec, ...] = field(compare=False)
    label: str = field(compare=False, default="")
    input_names: tuple[str, ...] = field(compare=False, default=())

    def __post_init__(self) -> None:
        # chains of steps hash their inputs recursively: hash once
        object.__setattr__(self, "_hash", hash((self.op, self.inputs)))

    def __hash__(self) -> int:
        return self._hash

    def exact(self) -> bool:
        """Whether this task and every task it reads from move bytes only."""
        return self.op.exact and all(map(is_exact, self.inputs))


@dataclass(frozen=True)
class StepOutput(LazyTensor):
    """Output ``index`` of a task."""

    spec: TensorSpec = field(compare=False)
    task: Task
    index: int

    def read(self) -> np.ndarray:
        """Compute this output (and what it needs) now; the tensor protocol's ``read``."""
        return Evaluation([self]).array(self)

    def has_data(self) -> bool:
        """Whether every input of its task can produce its bytes (False past an ``OpaqueTensor``)."""
        return all(t.has_data() for t in self.task.inputs)

    def exact(self) -> bool:
        """Whether every step behind this output moves bytes only (then it compares bitwise)."""
        return self.task.exact()

    def byte_ranges(self) -> tuple[ByteRange, ...] | None:
        """This output as file ranges of its inputs, when the op says it is a plain byte copy
        of them (``Op.byte_ranges``); None when it must be computed."""
        ranges = [t.byte_ranges() for t in self.task.inputs]
        if any(r is None for r in ranges):
            return None
        specs = [t.spec for t in self.task.inputs]
        return self.task.op.byte_ranges(ranges, specs, self.index)

    def source(self) -> ByteRange | None:
        """Where this tensor's first bytes come from: its own range or its first input's."""
        ranges = self.byte_ranges()
        if ranges:
            return ranges[0]
        return next((s for s in map(source_of, self.task.inputs) if s is not None), None)


def source_of(tensor: LazyTensor) -> ByteRange | None:
    """The file range a tensor's bytes start at (None for a tensor computed from nothing on disk)."""
    if isinstance(tensor, StepOutput):
        return tensor.source()
    ranges = tensor.byte_ranges()
    return ranges[0] if ranges else None


def is_exact(tensor: LazyTensor) -> bool:
    """Whether every step that produced ``tensor`` moves bytes only (a stored tensor: True)."""
    return tensor.exact() if isinstance(tensor, StepOutput) else True


class Evaluation:
    """Computes the tensors ``roots`` need, freeing each task's outputs after their last use."""

    def __init__(self, roots: Sequence[LazyTensor]):
        self._uses: Counter[Task] = Counter()
        self._cache: dict[Task, list[np.ndarray]] = {}
        seen: set[Task] = set()
        stack: list[Task] = []

        def use(t: LazyTensor) -> None:
            if isinstance(t, StepOutput) and t.byte_ranges() is None:
                self._uses[t.task] += 1
                stack.append(t.task)

        for t in roots:
            use(t)
        while stack:
            task = stack.pop()
            if task in seen:
                continue
            seen.add(task)
            for t in task.inputs:
                use(t)

    def array(self, tensor: LazyTensor) -> np.ndarray:
        """The data of ``tensor``: read from its file ranges when it has them, else computed
        (each task once, its outputs freed after their last use among the roots)."""
        if not isinstance(tensor, StepOutput):
            return tensor.read()
        ranges = tensor.byte_ranges()
        if ranges is not None:
            return read_ranges(ranges, tensor.spec)
        task = tensor.task
        if task not in self._cache:
            self._cache[task] = self._compute(task)
        out = self._cache[task][tensor.index]
        self._uses[task] -= 1
        if self._uses[task] <= 0:
            del self._cache[task]
        return out

    def cached(self) -> int:
        """How many tasks' outputs are held (0 once every use has been read)."""
        return len(self._cache)

    def _compute(self, task: Task) -> list[np.ndarray]:
        arrays = [self.array(t) for t in task.inputs]
        try:
            with np.errstate(all="ignore"):  # overflow is found below and reported as an error
                outputs = task.op.apply(arrays)
        except ComputeError as e:
            raise ComputeError(f"{task.label}: {e}") from e
        for array, spec in zip(outputs, task.output_specs, strict=True):
            if not isinstance(array, np.ndarray) or array.dtype != spec.dtype.numpy or array.shape != spec.shape:
                raise ComputeError(f"{task.label}: produced {array.dtype}{list(array.shape)}, planned {spec}")
        if not task.op.exact:
            _check_finite(task, arrays, outputs)
        return outputs


def _check_finite(task: Task, inputs, outputs) -> None:
    """A numeric step never writes NaN or infinity: from finite inputs that means the result
    overflowed the stored dtype (gamma 3e38 over a zero variance), else the inputs hold them."""
    bad = sum(int(np.count_nonzero(~np.isfinite(a))) for a in outputs if a.dtype.kind in "fcV" and a.size)
    if not bad:
        return
    broken = [f"{quote(name)} ({int(np.count_nonzero(~np.isfinite(a)))} non-finite)"
              for name, a in zip(task.input_names, inputs)
              if a.dtype.kind in "fcV" and a.size and not np.all(np.isfinite(a))]
    if broken:
        raise ComputeError(f"{task.label}: the inputs hold NaN or infinity: {', '.join(broken)}; "
                           "the checkpoint is damaged — fix or re-download it")
    raise ComputeError(
        f"{task.label}: the result has {bad} NaN or infinite value(s) although every input is "
        f"finite: it overflows {task.output_specs[0].dtype}. The inputs are out of range for this "
        "fold (a huge scale over a near-zero norm or variance); check them"
    )


@dataclass(frozen=True, eq=False)
class OpaqueTensor(LazyTensor):
    """A tensor that existed before a one-way or numeric step: its name and spec, no data."""

    spec: TensorSpec
    name: str

    def has_data(self) -> bool:
        """Always False: only the name and spec are known."""
        return False

    def read(self) -> np.ndarray:
        """PlanError naming the tensor: its data was consumed by a one-way or numeric step."""
        raise PlanError(f"{self.name!r} is not recoverable from the fused checkpoint")


# --- applying steps to a table --------------------------------------------------------------

def apply_group(table: ParamTable, group: StepGroup, untie: bool) -> StepGroup:
    """Apply one rule's steps to ``table`` (in place): its inputs are replaced by the steps'
    outputs. Returns the group with the tie groups it broke recorded (``untie``; without it,
    breaking a tie is a TieError naming rule and group)."""
    consumed = {n for step in group.steps for n in step.inputs}
    produced: set[str] = set()
    for step in group.steps:
        for name in step.outputs:
            if name in produced or (name in table and name not in consumed):
                raise PlanError(f"{group.describe()}: output {name!r} already exists; "
                                "rename or drop it first, or change the output pattern")
            produced.add(name)
    untied = _judge_ties(table, group, untie)
    untied_stored = tuple(tuple(m for m in members if m in table.stored) for members in untied)

    new_entries: dict[str, LazyTensor] = {}
    # equal tasks (one op over the same tensors: tied members treated alike) are one task,
    # whose outputs are the same tensors, so they are tied in turn
    made: dict[Task, tuple[LazyTensor, ...]] = {}
    for step in group.steps:
        sources = tuple(table[n] for n in step.inputs)
        if step.op.renames:
            outputs: tuple[LazyTensor, ...] = sources
        else:
            task = Task(step.op, sources, step.output_specs, f"{group.describe()}: {_roles(step)}", step.inputs)
            outputs = made.setdefault(task, tuple(StepOutput(spec, task, k)
                                                  for k, spec in enumerate(step.output_specs)))
        new_entries.update(zip(step.outputs, outputs))
    # a step's outputs are stored when an input was: an output of a stored tensor must be
    # written even where it is tied, so that no loader loses a tensor the input had
    stored_outputs = {o for step in group.steps if any(n in table.stored for n in step.inputs)
                      for o in step.outputs}
    table.remove(consumed)
    table.stored |= stored_outputs
    table.add(new_entries)
    _retie(table, group, new_entries)
    return replace(group, untied=untied, untied_stored=untied_stored)


def _retie(table: ParamTable, group: StepGroup, new_entries) -> None:
    """An inverse ties again what its forward group untied (exact steps give equal copies)."""
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


def _step_key(table: ParamTable, step: Step) -> tuple:
    return (step.op, tuple(id(table[n]) for n in step.inputs))


def _judge_ties(table: ParamTable, group: StepGroup, untie: bool) -> tuple[tuple[str, ...], ...]:
    """Tie groups this rule breaks: allowed only with untie (returned so the plan records
    them), else a TieError naming rule and group.

    A group stays tied when the rule renames or drops its members, or when every member
    is consumed by a step applying the same op to the same tensors (a transpose of each
    member; a concat of parts that are tied pairwise).
    """
    if group.steps and group.steps[0].op.keeps_ties:
        return ()
    consumer = {n: step for step in group.steps for n in step.inputs}
    untied = []
    for members in table.ties():
        hit = [m for m in members if m in consumer]
        if not hit:
            continue
        if len(hit) == len(members) and len({_step_key(table, consumer[m]) for m in members}) == 1:
            continue
        if not untie:
            rest = [m for m in members if m not in hit]
            how = (f"uses {', '.join(repr(m) for m in hit)} but not {', '.join(repr(m) for m in rest)}"
                   if rest else "treats its members differently (one is combined with other tensors)")
            raise TieError(f"{group.describe()} {how} of the tied group {members}; this would break the "
                           f"tie. Pass {option('untie')} to write the members as separate copies")
        untied.append(tuple(members))
    return tuple(untied)


def _roles(step: Step) -> str:
    """The step's inputs, with their roles for ops that name them (``var=bn1.running_var``)."""
    roles = step.op.input_roles()
    if len(roles) != len(step.inputs):
        return ", ".join(step.inputs)
    return ", ".join(f"{r}={n}" for r, n in zip(roles, step.inputs))


def check_group(table: ParamTable, group: StepGroup, what: str) -> None:
    """A recorded group applies to ``table``: its inputs exist with the recorded specs, and its
    op produces the recorded outputs (re-derived, not trusted: an edited record is refused)."""
    for step in group.steps:
        for name, spec in zip(step.inputs, step.input_specs):
            if name not in table:
                raise PlanError(f"{what}: {group.describe()} needs {name!r}, which the checkpoint lacks")
            if table.spec(name) != spec:
                raise PlanError(f"{what}: {group.describe()} expects {name!r} as {spec}, "
                                f"but the checkpoint has {table.spec(name)}")
        try:
            derived = tuple(step.op.infer(step.input_specs, step.inputs))
        except PlanError as e:
            raise PlanError(f"{what}: {group.describe()}: {e}") from e
        if derived != step.output_specs or len(derived) != len(step.outputs):
            raise PlanError(
                f"{what}: {group.describe()} records outputs {[str(x) for x in step.output_specs]} "
                f"that its op does not produce; the provenance was edited or corrupted"
            )


def walk(table: ParamTable, plan: Plan, what: str, untie: bool = True
         ) -> Iterator[tuple[StepGroup, ParamTable, ParamTable]]:
    """Apply ``plan`` to a copy of ``table`` group by group: (group, table before, table after)."""
    current = table.copy()
    for group in plan.groups:
        check_group(current, group, what)
        before = current.copy()
        apply_group(current, group, untie)
        yield group, before, current


def run_plan(table: ParamTable, plan: Plan, what: str, untie: bool = False) -> ParamTable:
    """``plan`` applied to a copy of ``table``: the resulting table, each tensor a task (or a
    stored tensor the plan did not touch). ``what`` names the run in errors."""
    result = table.copy()
    for group in plan.groups:
        check_group(result, group, what)
        apply_group(result, group, untie)
    return result


def recover_inputs(table: ParamTable, plan: Plan) -> ParamTable:
    """The names ``table`` had before ``plan`` ran: through exact, invertible groups with their
    data (the inverse run), through the others as :class:`OpaqueTensor` (name and spec only)."""
    current = table.copy()
    for group in reversed(plan.groups):
        if all(s.op.exact and s.inverse() is not None for s in group.steps):
            apply_group(current, Plan((group,)).inverse().groups[0], untie=True)
            continue
        for step in reversed(group.steps):
            current.remove(n for n in step.outputs if n in current)
            current.add({n: OpaqueTensor(spec, n) for n, spec in zip(step.inputs, step.input_specs)})
    return current
