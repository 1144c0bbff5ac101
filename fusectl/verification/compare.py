"""Element-wise comparison with Polygraphy's rule: an element fails when |a−b| > atol AND
|a−b| > rtol·|ref|; NaN fails unless NaN on both sides; ±inf equals only the same infinity."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import VerifyError, printable
from ..tolerance import default_tolerance

@dataclass(frozen=True)
class Comparison:
    """How one candidate array compares to its reference."""

    name: str
    dtype: str
    shape: list[int]
    passed: bool
    atol: float
    rtol: float
    mismatches: int
    max_abs: float
    mean_abs: float
    p99_abs: float
    max_rel: float
    mean_rel: float
    p99_rel: float
    # the smallest tolerance that would have passed: atol at the given rtol, or rtol at the given atol
    min_atol: float
    min_rtol: float
    first_mismatch: list[int] | None
    note: str = ""

    def to_json(self) -> dict:
        """The comparison as reports write it: every field, by name."""
        return asdict(self)


def check_tolerance(option: str, value) -> float:
    """``value`` as a tolerance: a finite number >= 0, else VerifyError naming ``option``.

    A NaN tolerance would pass every element (each comparison with it is false) and an infinite
    one would pass anything finite: either would turn verify into a rubber stamp.

    >>> check_tolerance("--atol", "1e-3")
    0.001
    """
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number < 0:
        raise VerifyError(f"{option} {printable(str(value))!r}: a tolerance must be a finite number >= 0, "
                          "for example 1e-5")
    return number


def _numeric_kind(dtype: np.dtype) -> str | None:
    """'c' complex, 'f' any other number (ml_dtypes' bf16, fp8 and int4 included), None for
    strings, Python objects and raw bytes, which compare exactly."""
    if dtype.kind == "c":
        return "c"
    if dtype.kind in "fiub" or (dtype.kind == "V" and dtype.names is None and dtype.type.__module__ == "ml_dtypes"):
        return "f"
    return None


def _stats(values: np.ndarray) -> tuple[float, float, float]:
    """max, mean and p99 ("higher": an element, never an interpolation between inf and a number)."""
    if not values.size:
        return 0.0, 0.0, 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        return (float(np.max(values)), float(np.mean(values)),
                float(np.percentile(values, 99, method="higher")))


def _compare_exactly(name: str, reference: np.ndarray, candidate: np.ndarray,
                     atol: float, rtol: float) -> Comparison:
    """Strings and other non-numbers: equal or not, element by element."""
    failed = np.broadcast_to(np.asarray(reference != candidate, dtype=bool), reference.shape)
    mismatches = int(np.count_nonzero(failed))
    first = [int(i) for i in np.unravel_index(int(np.argmax(failed)), failed.shape)] if mismatches else None
    unreachable = math.inf if mismatches else 0.0
    return Comparison(name, str(reference.dtype), list(reference.shape), mismatches == 0, atol, rtol,
                      mismatches, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, unreachable, unreachable, first,
                      note=f"{reference.dtype} compared exactly")


def compare(name: str, reference: np.ndarray, candidate: np.ndarray,
            atol: float | None = None, rtol: float | None = None) -> Comparison:
    """Compare ``candidate`` to ``reference`` element by element (defaults by dtype).

    Infinities are values: +inf equals only +inf; against a finite number or -inf it is a
    mismatch that no tolerance passes (then ``min_atol``/``min_rtol`` are inf). The error
    statistics cover the elements finite on both sides; ``note`` says how many differ in
    infinity or in NaN. With atol = rtol = 0 the comparison is exact (integers included, with
    no rounding through float64).

    >>> compare("y", np.array([np.inf, 1.0]), np.array([1.0, 1.0])).note
    '1 element(s) differ in infinity (first at [0]: reference inf, candidate 1); stats cover the 1 element(s) finite on both sides'
    """
    default_atol, default_rtol = default_tolerance(reference.dtype)
    atol = check_tolerance("atol", default_atol if atol is None else atol)
    rtol = check_tolerance("rtol", default_rtol if rtol is None else rtol)
    dtype, shape = str(reference.dtype), list(reference.shape)
    if reference.shape != candidate.shape or reference.dtype != candidate.dtype:
        inf = float("inf")
        return Comparison(name, dtype, shape, False, atol, rtol, int(reference.size), inf, inf, inf,
                          inf, inf, inf, inf, inf, None,
                          note=f"candidate is {candidate.dtype}{list(candidate.shape)}")
    kind = _numeric_kind(reference.dtype)
    if kind is None:
        return _compare_exactly(name, reference, candidate, atol, rtol)
    wide = np.complex128 if kind == "c" else np.float64
    ref, cand = np.asarray(reference, dtype=wide), np.asarray(candidate, dtype=wide)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        ref_nan, cand_nan = np.isnan(ref), np.isnan(cand)
        finite = np.isfinite(ref) & np.isfinite(cand)
        nan_mismatch = ref_nan ^ cand_nan
        inf_mismatch = ~finite & ~ref_nan & ~cand_nan & (ref != cand)
        diff = np.zeros(ref.shape, np.float64)
        diff[finite] = np.abs(ref[finite] - cand[finite])
        magnitude = np.zeros(ref.shape, np.float64)
        magnitude[finite] = np.abs(ref[finite])
        rel = np.where(magnitude > 0, diff / np.where(magnitude > 0, magnitude, 1.0), np.where(diff > 0, np.inf, 0.0))
        if atol == 0 and rtol == 0:  # exact: int64 beyond 2**53 would round equal through float64
            beyond = finite & np.broadcast_to(np.asarray(reference != candidate, dtype=bool), ref.shape)
        else:
            beyond = finite & (diff > atol) & (diff > rtol * magnitude)
    failed = beyond | nan_mismatch | inf_mismatch
    mismatches = int(np.count_nonzero(failed))
    first = [int(i) for i in np.unravel_index(int(np.argmax(failed)), failed.shape)] if mismatches else None
    max_abs, mean_abs, p99_abs = _stats(diff[finite])
    max_rel, mean_rel, p99_rel = _stats(rel[finite])
    if nan_mismatch.any() or inf_mismatch.any():
        min_atol = min_rtol = math.inf  # no tolerance makes inf equal 1, or NaN equal anything
    else:
        needs_atol = diff[finite & (diff > rtol * magnitude)]
        needs_rtol = rel[finite & (diff > atol)]
        min_atol = float(np.max(needs_atol)) if needs_atol.size else 0.0
        min_rtol = float(np.max(needs_rtol)) if needs_rtol.size else 0.0
    notes = []
    if inf_mismatch.any():
        at = np.unravel_index(int(np.argmax(inf_mismatch)), inf_mismatch.shape)
        notes.append(f"{int(np.count_nonzero(inf_mismatch))} element(s) differ in infinity (first at "
                     f"{[int(i) for i in at]}: reference {ref[at]:g}, candidate {cand[at]:g})")
    if nan_mismatch.any():
        notes.append(f"{int(np.count_nonzero(nan_mismatch))} element(s) NaN on one side only")
    covered = int(np.count_nonzero(finite))
    if covered != ref.size:
        notes.append(f"stats cover the {covered} element(s) finite on both sides")
    return Comparison(
        name, dtype, shape, mismatches == 0, atol, rtol, mismatches,
        max_abs, mean_abs, p99_abs, max_rel, mean_rel, p99_rel, min_atol, min_rtol, first,
        note="; ".join(notes),
    )
