"""Element-wise comparison with Polygraphy's rule: an element fails when |a−b| > atol AND
|a−b| > rtol·|ref|; NaN fails unless NaN on both sides."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import ml_dtypes
import numpy as np

# (atol, rtol) by dtype; integer and bool outputs must match exactly
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1e-5, 1e-5),
    "float64": (1e-5, 1e-5),
    "float16": (1e-3, 1e-3),
    "bfloat16": (1e-2, 1e-2),
}
FP8_TOLERANCE = (1e-1, 1e-1)


def default_tolerance(dtype: np.dtype) -> tuple[float, float]:
    """(atol, rtol) for a dtype: fp32 1e-5, fp16 1e-3, bf16 1e-2, fp8 1e-1, integers exact."""
    dtype = np.dtype(dtype)
    if dtype.name in DEFAULT_TOLERANCES:
        return DEFAULT_TOLERANCES[dtype.name]
    if dtype.name.startswith("float8"):
        return FP8_TOLERANCE
    return (0.0, 0.0)


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
        return asdict(self)


def _as_float64(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind in "fc" or a.dtype in (np.dtype(ml_dtypes.bfloat16),) or "float8" in a.dtype.name:
        return np.asarray(a, dtype=np.float64) if a.dtype.kind != "c" else np.abs(a).astype(np.float64)
    return a.astype(np.float64)


def compare(name: str, reference: np.ndarray, candidate: np.ndarray,
            atol: float | None = None, rtol: float | None = None) -> Comparison:
    """Compare ``candidate`` to ``reference`` element by element (defaults by dtype)."""
    default_atol, default_rtol = default_tolerance(reference.dtype)
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    dtype, shape = str(reference.dtype), list(reference.shape)
    if reference.shape != candidate.shape or reference.dtype != candidate.dtype:
        inf = float("inf")
        return Comparison(name, dtype, shape, False, atol, rtol, int(reference.size), inf, inf, inf,
                          inf, inf, inf, inf, inf, None,
                          note=f"candidate is {candidate.dtype}{list(candidate.shape)}")
    ref, cand = _as_float64(reference), _as_float64(candidate)
    ref_nan, cand_nan = np.isnan(ref), np.isnan(cand)
    both_nan = ref_nan & cand_nan
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(ref - cand)
        diff[np.isnan(diff) & (ref == cand)] = 0.0  # equal infinities
        diff[both_nan] = 0.0
        diff[ref_nan ^ cand_nan] = np.inf
        magnitude = np.abs(ref)
        rel = np.where(magnitude > 0, diff / np.where(magnitude > 0, magnitude, 1), np.where(diff > 0, np.inf, 0.0))
    failed = ((diff > atol) & (diff > rtol * magnitude)) | (ref_nan ^ cand_nan)
    mismatches = int(np.count_nonzero(failed))
    first = [int(i) for i in np.unravel_index(int(np.argmax(failed)), failed.shape)] if mismatches else None
    finite_diff = diff if diff.size else np.zeros(1)
    finite_rel = rel if rel.size else np.zeros(1)
    needs_atol = diff[diff > rtol * magnitude]
    needs_rtol = rel[diff > atol]
    return Comparison(
        name, dtype, shape, mismatches == 0, atol, rtol, mismatches,
        float(np.max(finite_diff)), float(np.mean(finite_diff)), float(np.percentile(finite_diff, 99, method="higher")),
        float(np.max(finite_rel)), float(np.mean(finite_rel)), float(np.percentile(finite_rel, 99, method="higher")),
        float(np.max(needs_atol)) if needs_atol.size else 0.0,
        float(np.max(needs_rtol)) if needs_rtol.size else 0.0,
        first,
    )
