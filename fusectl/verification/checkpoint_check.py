"""``verify REFERENCE CANDIDATE`` on checkpoints: replay the plan on the reference and compare.

1. every tensor of the replayed reference against the candidate (bitwise where every step
   that made it is exact, with the dtype's tolerance where a numeric step took part);
2. where every step is invertible, the inverse of the candidate against the reference;
3. every tie of the (replayed) reference is a tie of the candidate;
4. each step kind once per distinct shape as a small onnxruntime computation: the layer on
   the unfused parameters vs the layer on the fused ones (``probes``);
5. with the candidate's provenance as the plan, each recorded group re-derived from the rule
   it names (``rule_check``): a provenance whose steps its rules do not give fails, however
   consistent its steps and data are with each other;
6. a training checkpoint's optimizer state: the plan's steps lifted to the reference's state,
   each state tensor compared as in 1 (kind ``state``), the parameters, param groups and
   numbers checked (``optimizer_check``); its copies of the model (``twin_check``); every other
   entry of a training dict, and every file a Trainer folder carries unchanged, equal
   (``container_check``, kinds ``entry`` and ``file``).

1 and 2 (the byte comparisons, which read the most and mostly wait on memory with the GIL
released) run on a thread while 3 to 6 run: the report is the same as when they run in turn,
and an error of 1 or 2 is the one raised when both fail.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..background import Background
from ..errors import PlanError, VerifyError, option
from ..executor import Evaluation, is_exact, run_plan
from ..io.checkpoint import Checkpoint
from ..steps import Plan
from ..table import ParamTable
from .byte_ranges import ByteCorrespondence, equal_pairs
from .compare import check_tolerance, compare
from .report import Check, VerifyReport
from .runner import check_seed


def _bitwise_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        np.ascontiguousarray(a).reshape(-1).view(np.uint8), np.ascontiguousarray(b).reshape(-1).view(np.uint8))


def compare_tables(kind: str, expected: ParamTable, actual: ParamTable, atol: float | None,
                   rtol: float | None, *, proven: ByteCorrespondence | None = None,
                   record: ByteCorrespondence | None = None) -> list[Check]:
    """Tensor by tensor: names, dtypes and shapes, then data (bitwise where every step that made
    both sides moves bytes, else within tolerance).

    Pairs held as file ranges on both sides are compared as bytes in place (``equal_pairs``;
    equal pairs are added to ``record``); a pair whose bytes ``proven`` already covers is not
    read at all. The
    rest are computed (each task freed after its last use) and compared as arrays.
    """
    missing = []
    for name in sorted(set(expected.names()) ^ set(actual.names())):
        side = "candidate" if name in expected else "reference after the plan"
        missing.append(Check(kind, name, False, detail=f"missing from the {side}"))
    common = [n for n in expected.names() if n in actual]
    checks: list[Check] = []
    computed = []
    to_compare = []  # (name, (expected ranges, actual ranges)) not proven already
    for name in common:
        if expected.spec(name) != actual.spec(name):
            checks.append(Check(kind, name, False,
                                detail=f"expected {expected.spec(name)}, found {actual.spec(name)}"))
            continue
        want, got = expected[name], actual[name]
        ranges = (want.byte_ranges(), got.byte_ranges()) if is_exact(want) and is_exact(got) else (None, None)
        if None in ranges:
            computed.append(name)
        elif proven is not None and proven.covers(*ranges):
            checks.append(Check(kind, name, True, detail="bitwise"))
        else:
            to_compare.append((name, ranges))
    for (name, ranges), same in zip(to_compare, equal_pairs([r for _, r in to_compare])):
        if same:
            if record is not None:
                record.add(*ranges)
            checks.append(Check(kind, name, True, detail="bitwise"))
        else:
            computed.append(name)  # differs: computed below, for the report's figures
    want_eval = Evaluation([expected[n] for n in computed])
    got_eval = Evaluation([actual[n] for n in computed])
    for name in computed:
        a, b = want_eval.array(expected[name]), got_eval.array(actual[name])
        if is_exact(expected[name]) and is_exact(actual[name]):
            same = _bitwise_equal(a, b)
            checks.append(Check(kind, name, same, None if same else compare(name, a, b, 0.0, 0.0),
                                detail="bitwise"))
        else:
            result = compare(name, a, b, atol, rtol)
            checks.append(Check(kind, name, result.passed, result, detail="numeric step: tolerance"))
    order = {n: k for k, n in enumerate(common)}
    return missing + sorted(checks, key=lambda c: order[c.name])


def tie_checks(expected: ParamTable, actual: ParamTable) -> list[Check]:
    checks = []
    for group in expected.ties():
        present = [m for m in group if m in actual]
        tied = len(present) == len(group) and len({id(actual[m]) for m in present}) == 1
        checks.append(Check("ties", ", ".join(group), tied,
                            detail="" if tied else "tied in the reference, not in the candidate"))
    return checks


def _tensors_and_inverse(reference: ParamTable, expected: ParamTable, candidate: ParamTable, candidate_path: str,
                         plan: Plan, atol, rtol) -> list[Check]:
    """Steps 1 and 2 of the module doc: the replayed reference against the candidate, then the
    inverse of the candidate against the reference (reading only bytes not proven already)."""
    proven = ByteCorrespondence()
    checks = compare_tables("tensor", expected, candidate, atol, rtol, record=proven)
    proven.freeze()
    if any(s.inverse() is None for s in plan.steps):
        checks.append(Check("inverse", "unfuse", True, detail="skipped: the plan has a one-way step"))
    elif not all(s.op.exact for s in plan.steps):
        checks.append(Check("inverse", "unfuse", True, detail=(
            "skipped: a numeric step's inverse gives an equivalent parametrization, not the input")))
    else:
        # the inverse maps candidate bytes back: where it maps them onto the reference bytes the
        # tensor comparison proved equal, nothing is read again
        back = run_plan(candidate, plan.inverse(), f"{candidate_path} (inverse)", untie=True)
        checks += compare_tables("inverse", reference, back, atol, rtol, proven=proven)
    return checks


def verify_checkpoints(
    reference: Checkpoint,
    candidate: Checkpoint,
    plan: Plan,
    *,
    provider: str = "auto",
    atol: float | None = None,
    rtol: float | None = None,
    seed: int = 0,
    lora_base: Plan | None = None,
    recorded: bool = False,
) -> VerifyReport:
    """Check that ``candidate`` is ``plan`` applied to ``reference`` (see the module doc);
    ``recorded``: the plan is the candidate's provenance, whose groups are re-derived from
    their rules."""
    atol = None if atol is None else check_tolerance("atol", atol)
    rtol = None if rtol is None else check_tolerance("rtol", rtol)
    seed = check_seed(seed)
    try:
        expected = run_plan(reference.table, plan, f"{reference.path} (plan replay)", untie=True)
    except PlanError as e:
        raise VerifyError(f"the candidate's plan does not apply to {reference.path}: {e}") from e
    report = VerifyReport("checkpoint", reference.path, candidate.path, seed=seed)
    # the byte comparisons (GIL free: file pages compared in place) run beside the rest, which
    # imports onnxruntime and runs the probes; the report keeps the order of a sequential run
    # the tables are read here, not on the thread (a cached property computed on one thread only)
    reference_table, candidate_table = reference.table, candidate.table
    compared = Background(lambda: _tensors_and_inverse(reference_table, expected, candidate_table,
                                                        str(candidate.path), plan, atol, rtol),
                          name="fusectl-compare")
    try:
        # what runs beside the comparison is imported once it has started (the rule language,
        # the probes, onnxruntime): the comparison starts that much sooner
        from .adapter_probes import adapter_probes
        from .container_check import container_checks  # a training checkpoint's other entries
        from .optimizer_check import optimizer_replay
        from .probes import run_probes
        from .rule_check import rule_checks
        from .twin_check import twin_checks  # a training dict's copies of the model (an EMA)

        later = tie_checks(expected, candidate.table)
        replay = optimizer_replay(reference, candidate, plan)
        if replay is not None:
            if replay.tables is not None:
                later += compare_tables("state", *replay.tables, atol, rtol)
            later += replay.checks
        later += twin_checks(reference, candidate, plan, atol, rtol)
        later += container_checks(reference, candidate, plan)
        if recorded:
            later += rule_checks(reference, plan, adapter=lora_base is not None)
        probe_checks, chosen = run_probes(plan, reference.table, candidate.table, provider, seed, atol, rtol,
                                          reference.followers.of("scales").scheme)
        later += probe_checks
        if lora_base is not None:
            later += adapter_probes(lora_base, reference, candidate, chosen, seed, atol, rtol)
    except KeyboardInterrupt:
        raise  # not kept waiting for the comparison (its thread is a daemon)
    except BaseException:
        compared.result()  # its error first, as when it ran first; else this one
        raise
    report.checks += compared.result() + later
    report.provider = chosen
    if replay is not None:
        report.optimizer = replay.summary(report.checks)
    return report


def lora_base_for(candidate: Checkpoint, rulesets: Sequence, reference: Checkpoint) -> Plan | None:
    """For view followers (LoRA adapters), the base plan their steps were lifted from (for the
    ΔW probes); None for other checkpoints."""
    if reference.followers.view is None or candidate.followers.view is None:
        return None
    if rulesets:
        from ..planner import bind_and_lift

        return bind_and_lift(reference.table, reference.followers, rulesets, untie=True).base
    base = candidate.provenance.lora_base if candidate.provenance else None
    done = reference.provenance.lora_base if reference.provenance else None
    if base is not None and done is not None and base.groups[:len(done.groups)] == done.groups:
        return Plan(base.groups[len(done.groups):])
    return base


def plan_for(candidate: Checkpoint, rulesets: Sequence, reference: Checkpoint) -> Plan:
    """The plan to check: the candidate's provenance, or the rules given with -r."""
    if rulesets:
        from ..planner import bind_and_lift

        return bind_and_lift(reference.table, reference.followers, rulesets, untie=True).plan
    if candidate.provenance is None or not candidate.provenance.plan.groups:
        raise VerifyError(f"{candidate.path}: no fusectl provenance; pass {option('rules')} to say how it was made")
    plan = candidate.provenance.plan
    # a reference that was itself fused records the start of the candidate's history
    done = reference.provenance.plan.groups if reference.provenance else ()
    if done and plan.groups[:len(done)] == done:
        return Plan(plan.groups[len(done):])
    return plan
