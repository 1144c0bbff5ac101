"""``verify`` of a training checkpoint: the plan replayed on the reference's optimizer state.

The candidate's plan (its provenance, or ``-r RULES``) records the model's steps; each is lifted
to the reference's optimizer state as ``fuse`` lifts it (``followers.optimizer``: a state tensor
takes its parameter's step, a number is kept once) and run on the reference's
``training_table``. What that makes is what the candidate must hold:

- every state tensor ``<parameter>::<key>`` equal to the candidate's (``checkpoint_check``
  compares them as it compares the model's, kind ``state``: a moment that did not follow its
  weight fails, named);
- the same parameters in the optimizer, each in the param group the plan puts it in, and the
  groups' hyperparameters equal (kind ``optimizer``, one check per group);
- each per-parameter number that is not a tensor (an old checkpoint's ``step``) equal.

A candidate without optimizer state whose reference has one passes with the state reported
``"dropped"`` (``fuse --drop-optimizer``, or an output that holds the model only), never
silently; a candidate with optimizer state its reference lacks, or whose state cannot be mapped
to its parameters, fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import CheckpointError, PlanError, VerifyError, option, printable
from ..executor import run_plan
from ..followers import Riders
from ..followers.optimizer import STATE_SEP, OptimizerFollower
from ..io.checkpoint import Checkpoint
from ..planner import lift_recorded
from ..steps import Plan
from ..table import ParamTable
from ..tensors import LazyTensor
from .report import Check


@dataclass
class OptimizerReplay:
    """What verify checks of the optimizer state: the two state tables to compare tensor by
    tensor (None when there is nothing to compare), the other checks, and the report's
    ``optimizer`` object (:meth:`summary`)."""

    reference: str | None  # where the optimizer sits in each (optimizer_state_dict), None: none
    candidate: str | None
    status: str  # "checked", "dropped", "not in the reference", "not mapped", "not replayed"
    tables: tuple[ParamTable, ParamTable] | None = None
    checks: list[Check] = field(default_factory=list)
    parameters: int = 0
    groups: int = 0

    def summary(self, checks: list[Check]) -> dict:
        """The ``optimizer`` object of the verify report (README: "Training checkpoints");
        ``checks`` are the report's, of which those of kinds ``state`` and ``optimizer`` count."""
        mine = [c for c in checks if c.kind in ("state", "optimizer")]
        return {"reference": self.reference, "candidate": self.candidate, "status": self.status,
                "state_tensors": sum(c.kind == "state" for c in mine), "parameters": self.parameters,
                "groups": self.groups, "passed": all(c.passed for c in mine)}


def _where(checkpoint: Checkpoint) -> str | None:
    training = checkpoint.training
    return training.optimizer_key if training is not None else None


def _state_only(table: ParamTable) -> ParamTable:
    state = table.copy()
    state.remove([n for n in table.entries if STATE_SEP not in n])
    return state


def optimizer_replay(reference: Checkpoint, candidate: Checkpoint, plan: Plan) -> OptimizerReplay | None:
    """The optimizer checks of ``candidate`` against ``plan`` on ``reference`` (see the module
    doc); None when neither holds optimizer state. VerifyError when the reference's state cannot
    be mapped to its parameters (its message says how to give the order)."""
    ref_where, cand_where = _where(reference), _where(candidate)
    if ref_where is None and cand_where is None:
        return None
    if cand_where is None:
        return OptimizerReplay(ref_where, None, "dropped", checks=[Check(
            "optimizer", ref_where, True, detail="dropped: the candidate holds no optimizer state, so the "
            "reference's is not checked")])
    if ref_where is None:
        return OptimizerReplay(None, cand_where, "not in the reference", checks=[Check(
            "optimizer", cand_where, False, detail="the candidate holds optimizer state but the reference has none; "
            "no plan makes it")])
    try:
        start = reference.training_table()
    except CheckpointError as e:
        raise VerifyError(f"cannot check the optimizer state: {e}") from e
    try:
        got = candidate.training_table()
    except CheckpointError as e:
        return OptimizerReplay(ref_where, cand_where, "not mapped", checks=[Check(
            "optimizer", cand_where, False, detail=f"the candidate's optimizer state is not mapped to its "
            f"parameters: {e} (the candidate's order: {option('param_order_out')})")])
    follower = OptimizerFollower(*reference.optimizer_mapped)
    try:
        lifted = lift_recorded(start, plan, Riders([follower]))
        expected = run_plan(start, lifted, f"{reference.path} (plan replay, optimizer state)", untie=True)
    except PlanError as e:
        return OptimizerReplay(ref_where, cand_where, "not replayed", checks=[Check(
            "optimizer", cand_where, False, detail=f"the plan's steps cannot carry the reference's optimizer "
            f"state, yet the candidate holds one: {e}")])
    state, mapping = candidate.optimizer_mapped
    replay = OptimizerReplay(ref_where, cand_where, "checked", (_state_only(expected), _state_only(got)),
                             parameters=len(mapping.names), groups=len(state.groups))
    replay.checks = _group_checks(reference, expected, follower, candidate) + _number_checks(reference, follower,
                                                                                           candidate)
    return replay


def _expected_group(reference: Checkpoint, follower: OptimizerFollower, name: str) -> int | None:
    """The param group the plan puts parameter ``name`` in (an untied member: its tie's)."""
    if name in follower.group_of:
        return follower.group_of[name]
    if name in reference.table:
        return follower.group_of.get(reference.table.unique_name(name))
    return None


def _group_checks(reference: Checkpoint, expected: ParamTable, follower: OptimizerFollower,
                  candidate: Checkpoint) -> list[Check]:
    """The optimizer's parameters are the plan's, each in its group; the groups' hyperparameters
    are the reference's."""
    state, mapping = candidate.optimizer_mapped
    trained = {expected.unique_name(n.split(STATE_SEP)[0]) for n in expected.entries if STATE_SEP in n}
    trained |= {n for n in expected.entries if STATE_SEP not in n and expected.unique_name(n) == n
                and _expected_group(reference, follower, n) is not None}
    held = set(mapping.names.values())
    checks = []
    extra, missing = sorted(held - trained), sorted(trained - held)
    if extra or missing:
        detail = (f"the candidate's optimizer holds {printable(extra[0])!r}, which the plan trains nowhere"
                  if extra else f"the plan trains {printable(missing[0])!r}, which the candidate's optimizer "
                  "does not hold")
        checks.append(Check("optimizer", "parameters", False, detail=f"{detail} ({len(extra)} extra, "
                                                                       f"{len(missing)} missing)"))
    else:
        checks.append(Check("optimizer", "parameters", True, detail=f"{len(held)} parameter(s), as the plan makes "
                                                                     "them"))
    ref_groups = follower.state.groups
    if len(state.groups) != len(ref_groups):
        checks.append(Check("optimizer", "param groups", False, detail=f"{len(state.groups)} param group(s), the "
                                                                         f"reference has {len(ref_groups)}"))
        return checks
    for k, (got, want) in enumerate(zip(state.groups, ref_groups)):
        names = [mapping.names[p] for p in got.params if p in mapping.names]
        astray = next((n for n in names if n in trained and _expected_group(reference, follower, n) != k), None)
        if got.hyper != want.hyper:
            key = next((h for h in {**want.hyper, **got.hyper} if got.hyper.get(h) != want.hyper.get(h)), None)
            checks.append(Check("optimizer", f"param group {k}", False, detail=(
                f"hyperparameter {printable(str(key))!r} is {got.hyper.get(key)!r}, the reference's "
                f"{want.hyper.get(key)!r}")))
        elif astray is not None:
            checks.append(Check("optimizer", f"param group {k}", False, detail=(
                f"holds {printable(astray)!r}, which the plan puts in param group "
                f"{_expected_group(reference, follower, astray)}")))
        else:
            checks.append(Check("optimizer", f"param group {k}", True, detail=(
                f"{len(names)} parameter(s), hyperparameters equal")))
    return checks


def _number_checks(reference: Checkpoint, follower: OptimizerFollower, candidate: Checkpoint) -> list[Check]:
    """Each per-parameter number that is not a tensor equals what the plan keeps of it."""
    state, mapping = candidate.optimizer_mapped
    checks, equal = [], 0
    for pid, name in mapping.names.items():
        got = {k: v for k, v in state.states.get(pid, {}).items() if not isinstance(v, LazyTensor)}
        want = follower.numbers.get(name)
        if want is None and name in reference.table:
            want = follower.numbers.get(reference.table.unique_name(name))
        want = want or {}
        for key in sorted(set(got) | set(want)):
            if repr(got.get(key)) != repr(want.get(key)):
                checks.append(Check("optimizer", f"{name}{STATE_SEP}{key}", False, detail=(
                    f"{got.get(key)!r}, the plan keeps {want.get(key)!r}")))
            else:
                equal += 1
    if equal and not checks:
        checks.append(Check("optimizer", "numbers", True, detail=f"{equal} per-parameter number(s) equal"))
    return checks
