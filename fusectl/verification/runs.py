"""Model mode's output options and its seeded runs: what ``verify A.onnx B.onnx`` keeps of each.

:class:`OutputChecks` holds the options (``--tol``, ``--runs``, ``--save-inputs``); a
:class:`RunTally` takes each run's checks and keeps the counts, the worst run's checks, each
output's worst statistics and the inputs of the first failing run, never a run's outputs, so that
memory does not grow with the number of runs. :func:`compared_nothing` fails an output check that
compared no finite element.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping

import numpy as np

from ..errors import VerifyError, option, printable, speaking_cli
from .compare import check_tolerance
from .report import Check


def knob(flag: str, field_name: str) -> str:
    """An :class:`OutputChecks` knob as the caller spells it: ``--tol`` or ``OutputChecks.tolerances``."""
    return flag if speaking_cli() else f"OutputChecks.{field_name}"


MAX_RUNS = 100_000


@dataclass(frozen=True)
class OutputChecks:
    """How model mode checks the outputs, beyond the global ``atol``/``rtol``.

    ``tolerances``: output name -> (atol, rtol or None), for that output (each tensor of a
    sequence output) instead of the global ones (an rtol of None keeps the global or dtype
    default); ``--tol OUTPUT=ATOL[,RTOL]``. ``runs``: how many seeded input sets to run (seed,
    seed+1, ...); ``--runs N``. ``save_inputs``: an ``.npz`` to write the inputs of the first
    failing run to, so that ``--inputs`` reproduces it; ``--save-inputs FILE.npz``.
    ``localize``: find the first node whose output differs (:mod:`fusectl.verification.localize`):
    True always, False never, None (the default) when an output check fails; ``--localize`` /
    ``--no-localize``.

    >>> OutputChecks(tolerances={"logits": (1e-4, None)}, runs=8).runs
    8
    """

    tolerances: Mapping[str, tuple[float, float | None]] = field(default_factory=dict)
    runs: int = 1
    save_inputs: str | None = None
    localize: bool | None = None

    def __post_init__(self) -> None:
        checked = {}
        for name, (atol, rtol) in dict(self.tolerances).items():
            where = f"{knob('--tol', 'tolerances')} {printable(str(name))}"
            checked[str(name)] = (check_tolerance(where, atol), None if rtol is None else check_tolerance(where, rtol))
        object.__setattr__(self, "tolerances", checked)
        if isinstance(self.runs, bool) or not isinstance(self.runs, int) or not 1 <= self.runs <= MAX_RUNS:
            raise VerifyError(f"{knob('--runs', 'runs')} {self.runs!r}: give a whole number from 1 to {MAX_RUNS}")
        if not (self.localize is None or isinstance(self.localize, bool)):
            raise VerifyError(f"{knob('--localize', 'localize')} {self.localize!r}: give True, False or None "
                              "(localize when an output fails)")


@dataclass
class RunTally:
    """What the runs of :func:`verify_models` leave behind: counts, the worst run's checks, each
    output's worst statistics and the first failing run's inputs. Nothing else of a run is kept,
    so memory does not grow with the number of runs."""

    first_seed: int
    count: int = 0
    passed: int = 0
    worst: tuple | None = None  # (failed checks, mismatches, -index), index, seed, checks
    first_failing: tuple[int, int] | None = None  # (index, seed)
    failing_inputs: dict[str, np.ndarray] | None = None
    outputs: dict[str, dict] = field(default_factory=dict)

    def add(self, seed: int, checks: list[Check], feeds: Mapping[str, np.ndarray]) -> None:
        """One run's checks (and the inputs it ran on, kept when it is the first to fail)."""
        index, failed = self.count, [c for c in checks if not c.passed]
        self.count += 1
        self.passed += not failed
        if failed and self.first_failing is None:
            self.first_failing, self.failing_inputs = (index, seed), dict(feeds)
        key = (len(failed), sum(c.comparison.mismatches for c in failed if c.comparison), -index)
        if self.worst is None or key > self.worst[0]:
            self.worst = (key, index, seed, checks)
        for c in checks:
            entry = self.outputs.setdefault(c.name, {"failed_runs": 0, "max_abs": 0.0, "min_atol": 0.0,
                                                     "min_rtol": 0.0})
            entry["failed_runs"] += not c.passed
            if c.comparison:
                m = c.comparison
                entry["max_abs"] = max(entry["max_abs"], m.max_abs)
                entry["min_atol"] = max(entry["min_atol"], m.min_atol)
                entry["min_rtol"] = max(entry["min_rtol"], m.min_rtol)

    def to_json(self) -> dict:
        """The ``runs`` object of the JSON report."""
        _, index, seed, checks = self.worst
        return {
            "count": self.count,
            "passed": self.passed,
            "pass_rate": self.passed / self.count,
            "seeds": [self.first_seed, self.first_seed + self.count - 1],
            "worst": {"index": index, "seed": seed, "failed": [c.name for c in checks if not c.passed]},
            "first_failing": (None if self.first_failing is None
                              else {"index": self.first_failing[0], "seed": self.first_failing[1]}),
            "outputs": {name: dict(entry) for name, entry in self.outputs.items()},
        }


def compared_nothing(check: Check) -> Check:
    """``check`` failed when its comparison covered no element finite on both sides: two outputs
    NaN (or the same infinity) everywhere match, but prove nothing."""
    m = check.comparison
    if m is None or not check.passed or m.compared:
        return check
    what = "it has no elements" if not math.prod(m.shape) else "every element is NaN or infinite on both sides"
    detail = (f"compared no finite element ({what}); verify does not pass on nothing: give inputs the "
              f"model computes finite outputs from with {option('inputs', 'FILE.npz')}")
    # no tolerance makes such a check pass: its minimum tolerances are infinite
    return Check(check.kind, check.name, False, replace(m, passed=False, min_atol=math.inf, min_rtol=math.inf),
                 detail=detail)
