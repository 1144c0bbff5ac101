"""Element-wise comparison with Polygraphy's rule: an element fails when |a−b| > atol AND
|a−b| > rtol·|ref|; NaN fails unless NaN on both sides; ±inf equals only the same infinity.

A comparison also counts, per side, its NaN, +inf and -inf elements (``nonfinite``) and the
elements finite on both sides that its statistics cover (``compared``): two outputs that are NaN
at the same places match, but compared nothing, which verify's model mode does not call a pass.
A numeric comparison also bins those elements' |a−b| by powers of ten (``histogram``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

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
    # elements the statistics cover: finite on both sides (every element, for exact comparisons)
    compared: int = 0
    # per side ("reference", "candidate"): its count of "nan", "+inf" and "-inf" elements
    nonfinite: dict[str, dict[str, int]] = field(default_factory=lambda: no_nonfinite())
    # |a−b| of the compared elements by decade (:class:`ErrorHistogram`); None when compared exactly
    histogram: dict | None = None

    def to_json(self) -> dict:
        """The comparison as reports write it: every field, by name."""
        return asdict(self)


_NONFINITE = ("nan", "+inf", "-inf")


def no_nonfinite() -> dict[str, dict[str, int]]:
    """Non-finite counts of two arrays that hold none (or are not numbers)."""
    return {side: dict.fromkeys(_NONFINITE, 0) for side in ("reference", "candidate")}


def _count_nonfinite(values: np.ndarray, nan: np.ndarray, counts: dict[str, int]) -> None:
    """Add the NaN, +inf and -inf elements of ``values`` (float64 or complex128, with its NaN
    mask ``nan``) to ``counts``. A complex infinity takes the sign of its infinite part (the real
    one when both are)."""
    infinite = np.isinf(values)
    if not infinite.any():
        counts["nan"] += int(np.count_nonzero(nan))
        return
    if np.iscomplexobj(values):
        part = np.where(np.isinf(values.real), values.real, values.imag)
    else:
        part = values
    positive = int(np.count_nonzero(infinite & (part > 0)))
    counts["nan"] += int(np.count_nonzero(nan))
    counts["+inf"] += positive
    counts["-inf"] += int(np.count_nonzero(infinite)) - positive


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


# elements compared at a time: one chunk's temporaries take about 100 bytes an element (6.5 MB),
# so a comparison's own memory is bounded whatever the size of the outputs it compares
CHUNK = 1 << 16
# error values a p99 keeps to select from (8 bytes each); past that it narrows by histogram
_KEEP = 1 << 18


def _chunks(*arrays: np.ndarray):
    """(start, [chunk of each array]) over the arrays' elements in C order, CHUNK at a time:
    views of C-contiguous arrays, small copies of the others."""
    flats = [a.reshape(-1) if a.flags.c_contiguous else a.flat for a in arrays]
    for start in range(0, arrays[0].size, CHUNK):
        yield start, [flat[start:start + CHUNK] for flat in flats]


def _chunk_errors(reference: np.ndarray, candidate: np.ndarray, wide: type):
    """One chunk's (ref, cand, NaN masks, finite mask, |a−b| and |ref| where finite else 0,
    relative error), in float64 (complex128 for complex)."""
    ref, cand = np.asarray(reference, dtype=wide), np.asarray(candidate, dtype=wide)
    ref_nan, cand_nan = np.isnan(ref), np.isnan(cand)
    finite = np.isfinite(ref) & np.isfinite(cand)
    diff = np.abs(np.where(finite, ref - cand, 0))
    magnitude = np.where(finite, np.abs(ref), 0.0)
    rel = np.where(magnitude > 0, diff / np.where(magnitude > 0, magnitude, 1.0), np.where(diff > 0, np.inf, 0.0))
    return ref, cand, ref_nan, cand_nan, finite, diff, magnitude, rel


class _Rank:
    """The exact k-th smallest of non-negative float64 values that arrive in chunks, in bounded
    memory, over as many passes as it needs (at most five). A non-negative float's bit pattern,
    read as an unsigned integer, orders as the float does. While the candidates fit in _KEEP
    they are kept and the rank is selected among them; past that, a histogram of their next 16
    bits finds the bin that holds the rank, and the next pass looks only at that bin's values.

    >>> rank = _Rank()
    >>> rank.feed(np.array([3.0, 1.0, 2.0]))
    >>> rank.finish(1)
    2.0
    """

    def __init__(self) -> None:
        self.prefix, self.shift = 0, 64  # candidates: values whose bits >> shift == prefix (64: all)
        self.kept: list[np.ndarray] | None = []
        self.count = 0
        self.histogram: np.ndarray | None = None
        self.low, self.high = np.uint64(2**64 - 1), np.uint64(0)  # the candidates' extremes

    def feed(self, values: np.ndarray) -> None:
        """The values of one chunk (the same chunks, in the same order, on every pass)."""
        bits = np.ascontiguousarray(values, dtype=np.float64).view(np.uint64)
        if self.shift < 64:
            bits = bits[(bits >> np.uint64(self.shift)) == np.uint64(self.prefix)]
        if not bits.size:
            return
        self.low, self.high = min(self.low, bits.min()), max(self.high, bits.max())
        self.count += bits.size
        if self.shift == 0:  # every bit is fixed: the candidates are one value (low == high)
            return
        if self.kept is not None:
            self.kept.append(bits)
            if self.count <= _KEEP:
                return
            self.histogram = np.zeros(1 << 16, np.int64)
            for kept in self.kept:
                self._count(kept)
            self.kept = None
        else:
            self._count(bits)

    def _count(self, bits: np.ndarray) -> None:
        digits = (bits >> np.uint64(self.shift - 16)) & np.uint64(0xFFFF)
        self.histogram += np.bincount(digits.astype(np.intp), minlength=1 << 16)

    def finish(self, k: int) -> float | None:
        """The k-th smallest (0-based) of this pass's candidates, or None when it takes another
        pass (then call :meth:`feed` with every chunk again and ``finish`` with :attr:`next_k`)."""
        if self.low == self.high:  # every candidate is one value (no histogram can tell them apart)
            return float(np.array(self.low, np.uint64).view(np.float64))
        if self.kept is not None:
            bits = np.concatenate(self.kept)
            return float(np.partition(bits, k)[k:k + 1].view(np.float64)[0])
        below = np.cumsum(self.histogram)
        digit = int(np.searchsorted(below, k, side="right"))
        self.next_k = k - (int(below[digit - 1]) if digit else 0)
        self.prefix, self.shift = (self.prefix << 16) | digit, self.shift - 16
        self.kept, self.count, self.histogram = [], 0, None
        self.low, self.high = np.uint64(2**64 - 1), np.uint64(0)
        return None


class ErrorHistogram:
    """|a−b| of the elements finite on both sides, counted by decade as chunks arrive: memory is
    the counts, whatever the size of the outputs.

    ``zero`` counts the equal elements; ``counts[0]`` those below ``10**EDGES[0]``, ``counts[i]``
    those in ``[10**EDGES[i-1], 10**EDGES[i])`` and ``counts[-1]`` those from ``10**EDGES[-1]``
    up (an infinite difference of two finite float64 included), so that ``zero + sum(counts)`` is
    the comparison's ``compared``. The edges are the same for every comparison, so that two
    outputs' histograms (or two runs') read side by side.

    >>> histogram = ErrorHistogram()
    >>> histogram.feed(np.array([0.0, 2e-7, 3e-7, 0.5]))
    >>> record = histogram.to_json()
    >>> record["zero"], record["counts"][record["edges_log10"].index(-6)], sum(record["counts"])
    (1, 2, 3)
    """

    EDGES = tuple(range(-12, 4))  # 1e-12 .. 1e3: from float64 rounding to a wrong weight's error
    # the smallest positive float64, then the edges: how many errors reach each is all it keeps
    _BOUNDS = (np.nextafter(0.0, 1.0), *(10.0 ** e for e in EDGES))

    def __init__(self) -> None:
        self.total = 0
        self.reaching = np.zeros(len(self._BOUNDS), np.int64)

    def feed(self, abs_errors: np.ndarray) -> None:
        """The |a−b| (float64, >= 0, inf allowed) of one chunk's elements finite on both sides."""
        # a comparison per bound: a quarter of a binary search's time (np.searchsorted) for 17
        self.total += abs_errors.size
        self.reaching += [np.count_nonzero(abs_errors >= bound) for bound in self._BOUNDS]

    def to_json(self) -> dict:
        """``{"edges_log10": [...], "counts": [...], "zero": n}``, as the JSON report writes it."""
        reaching = [int(n) for n in self.reaching]
        counts = [above - next_up for above, next_up in zip(reaching, reaching[1:])] + [reaching[-1]]
        return {"edges_log10": list(self.EDGES), "counts": counts, "zero": self.total - reaching[0]}


class _P99s:
    """The p99 of the absolute and of the relative error over the elements finite on both sides,
    exactly as ``np.percentile(..., 99, method="higher")`` gives it (an element, never an
    interpolation between inf and a number), in bounded memory: fed during the comparison's
    pass, then another pass over the chunks for each narrowing a :class:`_Rank` needs."""

    def __init__(self) -> None:
        self.ranks = (_Rank(), _Rank())

    def feed(self, abs_errors: np.ndarray, rel_errors: np.ndarray) -> None:
        for rank, values in zip(self.ranks, (abs_errors, rel_errors)):
            rank.feed(values)

    def finish(self, covered: int, reference: np.ndarray, candidate: np.ndarray, wide: type) -> tuple[float, float]:
        if not covered:
            return 0.0, 0.0
        wanted = [int(np.ceil(np.float64(0.99) * (covered - 1)))] * 2
        found = [rank.finish(k) for rank, k in zip(self.ranks, wanted)]
        while None in found:
            wanted = [k if f is not None else rank.next_k for rank, k, f in zip(self.ranks, wanted, found)]
            for _, (ref, cand) in _chunks(reference, candidate):
                *_, finite, diff, _, rel = _chunk_errors(ref, cand, wide)
                for rank, f, values in zip(self.ranks, found, (diff, rel)):
                    if f is None:
                        rank.feed(values[finite])
            found = [f if f is not None else rank.finish(k) for rank, k, f in zip(self.ranks, wanted, found)]
        return found[0], found[1]


def _compare_exactly(name: str, reference: np.ndarray, candidate: np.ndarray,
                     atol: float, rtol: float) -> Comparison:
    """Strings and other non-numbers: equal or not, element by element."""
    mismatches, first = 0, None
    for start, (ref, cand) in _chunks(reference, candidate):
        failed = np.broadcast_to(np.asarray(ref != cand, dtype=bool), ref.shape)
        if first is None and failed.any():
            first = start + int(np.argmax(failed))
        mismatches += int(np.count_nonzero(failed))
    unreachable = math.inf if mismatches else 0.0
    return Comparison(name, str(reference.dtype), list(reference.shape), mismatches == 0, atol, rtol,
                      mismatches, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, unreachable, unreachable,
                      _index(first, reference.shape), note=f"{reference.dtype} compared exactly",
                      compared=int(reference.size))


def _index(flat: int | None, shape: tuple[int, ...]) -> list[int] | None:
    """The flat position ``flat`` as an index of each axis (None stays None)."""
    return None if flat is None else [int(i) for i in np.unravel_index(flat, shape)]


def compare(name: str, reference: np.ndarray, candidate: np.ndarray,
            atol: float | None = None, rtol: float | None = None) -> Comparison:
    """Compare ``candidate`` to ``reference`` element by element (defaults by dtype).

    Infinities are values: +inf equals only +inf; against a finite number or -inf it is a
    mismatch that no tolerance passes (then ``min_atol``/``min_rtol`` are inf). The error
    statistics cover the elements finite on both sides; ``note`` says how many differ in
    infinity or in NaN. With atol = rtol = 0 the comparison is exact (integers included, with
    no rounding through float64). The arrays are compared CHUNK elements at a time: the
    comparison's own memory does not grow with them (the p99s take another pass or two).

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
    covered = mismatches = nan_mismatches = inf_mismatches = 0
    first = first_inf = None
    max_abs = sum_abs = max_rel = sum_rel = needs_atol = needs_rtol = 0.0
    p99s = _P99s()
    histogram = ErrorHistogram()
    nonfinite = no_nonfinite()
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for start, (reference_chunk, candidate_chunk) in _chunks(reference, candidate):
            ref, cand, ref_nan, cand_nan, finite, diff, magnitude, rel = _chunk_errors(
                reference_chunk, candidate_chunk, wide)
            nan_mismatch = ref_nan ^ cand_nan
            if not finite.all():
                _count_nonfinite(ref, ref_nan, nonfinite["reference"])
                _count_nonfinite(cand, cand_nan, nonfinite["candidate"])
            inf_mismatch = ~finite & ~ref_nan & ~cand_nan & (ref != cand)
            if atol == 0 and rtol == 0:  # exact: int64 beyond 2**53 would round equal through float64
                beyond = finite & np.broadcast_to(np.asarray(reference_chunk != candidate_chunk, dtype=bool),
                                                  ref.shape)
            else:
                beyond = finite & (diff > atol) & (diff > rtol * magnitude)
            failed = beyond | nan_mismatch | inf_mismatch
            count = int(np.count_nonzero(failed))
            if count and first is None:
                first = start + int(np.argmax(failed))
            mismatches += count
            nan_mismatches += int(np.count_nonzero(nan_mismatch))
            if first_inf is None and inf_mismatch.any():
                at = int(np.argmax(inf_mismatch))
                first_inf = (start + at, ref[at], cand[at])
            inf_mismatches += int(np.count_nonzero(inf_mismatch))
            n = int(np.count_nonzero(finite))
            if n:
                covered += n
                abs_errors, rel_errors = diff[finite], rel[finite]
                p99s.feed(abs_errors, rel_errors)
                histogram.feed(abs_errors)
                max_abs, sum_abs = max(max_abs, float(abs_errors.max())), sum_abs + float(abs_errors.sum())
                max_rel, sum_rel = max(max_rel, float(rel_errors.max())), sum_rel + float(rel_errors.sum())
                atol_needed = diff[finite & (diff > rtol * magnitude)]
                rtol_needed = rel[finite & (diff > atol)]
                needs_atol = max(needs_atol, float(atol_needed.max())) if atol_needed.size else needs_atol
                needs_rtol = max(needs_rtol, float(rtol_needed.max())) if rtol_needed.size else needs_rtol
        p99_abs, p99_rel = p99s.finish(covered, reference, candidate, wide)
    mean_abs, mean_rel = (sum_abs / covered, sum_rel / covered) if covered else (0.0, 0.0)
    if nan_mismatches or inf_mismatches:
        min_atol = min_rtol = math.inf  # no tolerance makes inf equal 1, or NaN equal anything
    else:
        min_atol, min_rtol = needs_atol, needs_rtol
    notes = []
    if first_inf is not None:
        at, ref_value, cand_value = first_inf
        notes.append(f"{inf_mismatches} element(s) differ in infinity (first at "
                     f"{_index(at, reference.shape)}: reference {ref_value:g}, candidate {cand_value:g})")
    if nan_mismatches:
        notes.append(f"{nan_mismatches} element(s) NaN on one side only")
    if covered != reference.size:
        notes.append(f"stats cover the {covered} element(s) finite on both sides")
    return Comparison(
        name, dtype, shape, mismatches == 0, atol, rtol, mismatches,
        max_abs, mean_abs, p99_abs, max_rel, mean_rel, p99_rel, min_atol, min_rtol, _index(first, reference.shape),
        note="; ".join(notes), compared=covered, nonfinite=nonfinite, histogram=histogram.to_json(),
    )
