"""``verify`` of a training dict's copies of the model (an EMA): the plan replayed on each.

A twin (``fusectl.twins``) takes the model's plan; the candidate's twin at each key must be
what the plan makes of the reference's twin at that key, tensor by tensor, as the model's
tensors are compared (bitwise where every step moves bytes, within tolerance after a numeric
fold). One check of kind ``twin`` per twin names its key; each tensor that differs is a
failed check of its own (``<key>:<tensor>``). A twin on one side only fails, and so does a
reference twin the plan does not bind to as it binds to the model.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import PlanError
from ..io.checkpoint import Checkpoint
from ..steps import Plan
from ..twins import move_twin, twin_table
from .report import Check


def twin_checks(reference: Checkpoint, candidate: Checkpoint, plan: Plan, atol: float | None,
                rtol: float | None) -> list[Check]:
    """The checks of the candidate's twins against ``plan`` replayed on the reference's."""
    from .checkpoint_check import compare_tables  # it calls this module: imported when run

    mine = {t.path: t for t in candidate.twins}
    checks = []
    for twin in reference.twins:
        theirs = mine.pop(twin.path, None)
        if theirs is None:
            checks.append(Check("twin", twin.where, False, detail="missing from the candidate"))
            continue
        try:
            expected = move_twin(reference.path, twin, reference.table, plan).table
        except PlanError as e:
            checks.append(Check("twin", twin.where, False, detail=str(e)))
            continue
        found = compare_tables("twin", expected, twin_table(theirs), atol, rtol)
        failed = [replace(c, name=f"{twin.where}:{c.name}") for c in found if not c.passed]
        bitwise = sum(c.detail == "bitwise" for c in found if c.passed)
        checks.append(Check("twin", twin.where, not failed,
                            detail=f"{len(found) - len(failed)} of {len(found)} tensor(s) equal ({bitwise} bitwise)"))
        checks += failed
    checks += [Check("twin", t.where, False, detail="not in the reference") for t in mine.values()]
    return checks
