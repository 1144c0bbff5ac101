"""Element-wise comparison (verification/compare.py): Polygraphy's rule (fail only past atol AND
rtol·|ref|), NaN and infinity as values, exact comparison of integers and non-numbers, the
smallest tolerances that would pass, statistics, and tolerances that would rubber-stamp refused."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from fusectl.errors import VerifyError
from fusectl.verification.compare import Comparison, check_tolerance, compare


@pytest.mark.parametrize("value, number", [("1e-3", 1e-3), (0, 0.0), ("0", 0.0), (2, 2.0)])
def test_check_tolerance_accepts_finite_numbers_from_zero(value, number):
    assert check_tolerance("--atol", value) == number


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1e-5", "abc", None, [1], "1e\x1b"])
def test_check_tolerance_refuses_what_would_pass_anything_naming_the_option(value):
    with pytest.raises(VerifyError) as err:
        check_tolerance("--rtol", value)
    message = str(err.value)
    assert message.startswith("--rtol ") and "a tolerance must be a finite number >= 0, for example 1e-5" in message
    assert "\x1b" not in message


def test_equal_arrays_pass_with_zero_statistics():
    a = np.linspace(-1, 1, 10, dtype=np.float32)
    c = compare("y", a, a.copy())
    assert isinstance(c, Comparison)
    assert c.passed and c.mismatches == 0 and c.first_mismatch is None and c.note == ""
    assert (c.max_abs, c.mean_abs, c.p99_abs, c.max_rel, c.min_atol, c.min_rtol) == (0, 0, 0, 0, 0, 0)
    assert (c.name, c.dtype, c.shape, c.atol, c.rtol) == ("y", "float32", [10], 1e-5, 1e-5)


def test_an_element_fails_only_past_both_tolerances():
    ref = np.array([100.0, 1.0, 2.0], np.float64)
    cand = np.array([100.5, 1.5, 2.001], np.float64)
    # 0.5 at 100: within rtol 1e-2 (1.0); 0.5 at 1: past both; 0.001 at 2: within atol
    c = compare("y", ref, cand, atol=0.01, rtol=0.01)
    assert not c.passed and c.mismatches == 1 and c.first_mismatch == [1]
    assert c.max_abs == 0.5 and c.max_rel == 0.5
    assert c.mean_abs == pytest.approx((0.5 + 0.5 + 0.001) / 3)
    assert c.mean_rel == pytest.approx((0.005 + 0.5 + 0.0005) / 3)
    assert c.p99_abs == 0.5  # an element, never an interpolation
    # the smallest atol passing at rtol 0.01 is 0.5; the smallest rtol at atol 0.01 is 0.5
    assert c.min_atol == 0.5 and c.min_rtol == 0.5
    assert compare("y", ref, cand, atol=c.min_atol, rtol=0.01).passed
    assert compare("y", ref, cand, atol=0.01, rtol=c.min_rtol).passed


def test_a_difference_against_zero_has_infinite_relative_error():
    c = compare("y", np.zeros(2), np.array([0.0, 1.0]), atol=0.1, rtol=0.1)
    assert c.max_rel == math.inf and c.mismatches == 1 and c.min_atol == 1.0 and c.min_rtol == math.inf


def test_the_first_mismatch_is_an_index_of_each_axis():
    ref = np.zeros((2, 3), np.float32)
    cand = ref.copy()
    cand[1, 2], cand[1, 0] = 1, 1
    c = compare("y", ref, cand)
    assert c.first_mismatch == [1, 0] and c.mismatches == 2 and c.shape == [2, 3]


def test_defaults_come_from_the_reference_dtype():
    assert compare("h", np.ones(2, np.float16), np.ones(2, np.float16)).atol == 1e-3
    bf16 = np.ones(2, ml_dtypes.bfloat16)
    c = compare("b", bf16, bf16)
    assert (c.atol, c.rtol, c.passed) == (1e-2, 1e-2, True)
    assert compare("i", np.arange(3), np.arange(3)).atol == 0.0


def test_an_invalid_tolerance_argument_is_refused():
    with pytest.raises(VerifyError, match="^atol 'nan'"):
        compare("y", np.ones(1), np.ones(1), atol=math.nan)
    with pytest.raises(VerifyError, match="^rtol '-1'"):
        compare("y", np.ones(1), np.ones(1), rtol=-1)


@pytest.mark.parametrize("cand", [np.ones(3, np.float32), np.ones((2, 2), np.float64)])
def test_a_candidate_of_another_dtype_or_shape_fails_every_element(cand):
    c = compare("y", np.ones((2, 2), np.float32), cand)
    assert not c.passed and c.mismatches == 4
    assert c.max_abs == c.min_atol == c.min_rtol == math.inf and c.first_mismatch is None
    assert c.note == f"candidate is {cand.dtype}{list(cand.shape)}"


def test_nan_passes_only_against_nan():
    both = compare("y", np.array([np.nan, 1.0]), np.array([np.nan, 1.0]))
    assert both.passed and both.note == "stats cover the 1 element(s) finite on both sides"
    one = compare("y", np.array([np.nan, 1.0, 2.0]), np.array([1.0, np.nan, 2.0]), atol=1e9, rtol=1e9)
    assert not one.passed and one.mismatches == 2 and one.first_mismatch == [0]
    assert one.min_atol == one.min_rtol == math.inf
    assert one.note == ("2 element(s) NaN on one side only; stats cover the 1 element(s) finite on both sides")


def test_infinity_equals_only_the_same_infinity():
    ref = np.array([np.inf, -np.inf, np.inf, 3.0])
    c = compare("y", ref, np.array([np.inf, np.inf, 5.0, 3.0]), atol=1e9, rtol=1e9)
    assert not c.passed and c.mismatches == 2 and c.first_mismatch == [1]
    assert c.note.startswith("2 element(s) differ in infinity (first at [1]: reference -inf, candidate inf)")
    assert c.max_abs == 0.0  # the stats cover only the finite pair
    assert compare("y", np.array([np.inf, -np.inf]), np.array([np.inf, -np.inf])).passed


def test_zero_tolerances_compare_integers_exactly_beyond_float64():
    big = np.array([2**53, 2**60], np.int64)
    off = big + np.array([1, 1], np.int64)  # equal once rounded through float64
    c = compare("ids", big, off, atol=0, rtol=0)
    assert not c.passed and c.mismatches == 2
    assert compare("ids", big, big.copy()).passed
    # with a tolerance, the comparison goes through float64
    assert compare("ids", big, off, atol=2.0, rtol=0).passed


def test_complex_values_compare_by_modulus_of_the_difference():
    ref = np.array([1 + 1j, 2 - 1j], np.complex64)
    cand = np.array([1 + 1j, 2 + 1j], np.complex64)
    c = compare("z", ref, cand, atol=0.1, rtol=0.1)
    assert not c.passed and c.mismatches == 1 and c.max_abs == 2.0
    assert compare("z", ref, ref.copy()).passed


def test_booleans_and_fp8_are_numbers():
    assert not compare("m", np.array([True, False]), np.array([True, True])).passed
    fp8 = np.array([1.0, 2.0], np.float32).astype(ml_dtypes.float8_e4m3fn)
    c = compare("w", fp8, fp8.copy())
    assert c.passed and c.atol == 0.1 and c.note == ""


def test_strings_compare_exactly():
    ref = np.array(["a", "b", "c"])
    c = compare("s", ref, np.array(["a", "x", "c"]))
    assert not c.passed and c.mismatches == 1 and c.first_mismatch == [1]
    assert c.min_atol == c.min_rtol == math.inf and c.note == "<U1 compared exactly"
    same = compare("s", ref, ref.copy())
    assert same.passed and same.min_atol == 0.0 and same.first_mismatch is None


def test_objects_and_raw_bytes_compare_exactly():
    objects = np.array([1, "a", None], dtype=object)
    assert compare("o", objects, objects.copy()).passed
    assert compare("o", objects, np.array([1, "b", None], dtype=object)).mismatches == 1
    raw = np.frombuffer(b"abcd", dtype="V2")
    c = compare("v", raw, np.frombuffer(b"abce", dtype="V2"))
    assert c.mismatches == 1 and c.note == "|V2 compared exactly"


def test_empty_arrays_pass():
    c = compare("e", np.zeros((0, 3), np.float32), np.zeros((0, 3), np.float32))
    assert c.passed and c.max_abs == 0.0 and c.shape == [0, 3]


def test_to_json_lists_every_field_by_name():
    c = compare("y", np.array([1.0]), np.array([2.0]), atol=0.5, rtol=0)
    record = c.to_json()
    assert record["name"] == "y" and record["passed"] is False and record["first_mismatch"] == [0]
    assert set(record) == set(Comparison.__dataclass_fields__)


def _errors(ref, cand):
    """The absolute and relative errors of the elements finite on both sides, as numpy computes them."""
    ref, cand = ref.astype(np.float64), cand.astype(np.float64)
    finite = np.isfinite(ref) & np.isfinite(cand)
    diff = np.abs(ref[finite] - cand[finite])
    magnitude = np.abs(ref[finite])
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(magnitude > 0, diff / np.where(magnitude > 0, magnitude, 1), np.where(diff > 0, np.inf, 0.0))
    return diff, rel


@pytest.mark.parametrize("chunk, keep", [(7, 5), (64, 3), (1000, 40), (1 << 16, 1 << 18)])
@pytest.mark.parametrize("seed", range(6))
def test_statistics_over_chunks_are_numpys_over_the_whole_array(monkeypatch, chunk, keep, seed):
    # tiny chunks and a tiny keep make every path run: many chunks, the p99 narrowed by
    # histograms over several passes, ties, infinite relative errors, NaN and inf skipped
    import fusectl.verification.compare as module
    monkeypatch.setattr(module, "CHUNK", chunk)
    monkeypatch.setattr(module, "_KEEP", keep)
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal(2000).astype(np.float32)
    cand = ref.copy()
    cand[rng.choice(2000, 1500, replace=False)] += rng.choice([0.0, 1e-6, 1e-3, 0.5, 0.5, 2.0], 1500).astype(np.float32)
    ref[:30] = 0.0  # relative error inf where the candidate differs
    ref[30], cand[31], ref[32], cand[32] = np.nan, np.nan, np.inf, np.inf
    if seed % 2:
        ref, cand = ref.reshape(40, 50).T, cand.reshape(40, 50).T  # not contiguous: chunks are copies
    c = compare("y", ref, cand, atol=1e-4, rtol=1e-4)
    diff, rel = _errors(ref, cand)
    assert (c.p99_abs, c.p99_rel) == (np.percentile(diff, 99, method="higher"), np.percentile(rel, 99, method="higher"))
    assert (c.max_abs, c.max_rel) == (diff.max(), rel.max())
    assert c.mean_abs == pytest.approx(diff.mean(), rel=1e-12) and c.mean_rel == rel.mean()
    r, k = ref.astype(np.float64), cand.astype(np.float64)  # SPEC's rule on the whole arrays at once
    with np.errstate(invalid="ignore"):
        finite = np.isfinite(r) & np.isfinite(k)
        d = np.where(finite, np.abs(r - k), 0)
        failed = ((finite & (d > 1e-4) & (d > 1e-4 * np.abs(r))) | (np.isnan(r) ^ np.isnan(k))
                  | (~finite & ~np.isnan(r) & ~np.isnan(k) & (r != k)))
    assert c.mismatches == int(np.count_nonzero(failed))
    assert c.first_mismatch == [int(i) for i in np.unravel_index(int(np.argmax(failed)), ref.shape)]
    bounds = [10.0 ** e for e in c.histogram["edges_log10"]]  # |a−b| by decade, counted on the whole array
    decades = ([int(np.count_nonzero((diff > 0) & (diff < bounds[0])))]
               + [int(np.count_nonzero((diff >= low) & (diff < high))) for low, high in zip(bounds, bounds[1:])]
               + [int(np.count_nonzero(diff >= bounds[-1]))])
    assert c.histogram["counts"] == decades and c.histogram["zero"] == int(np.count_nonzero(diff == 0))
    assert c.histogram["zero"] + sum(c.histogram["counts"]) == c.compared == diff.size


def test_the_histogram_bins_by_decade_from_below_the_first_edge_to_past_the_last():
    ref = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 1e308, np.nan, 0.0])
    cand = np.array([1.0, 1.0 + 1e-13, 1.0 + 1e-5, 1.5, 5e3, -1e308, np.nan, 0.0])
    c = compare("y", ref, cand)
    histogram = c.histogram
    assert histogram["edges_log10"] == list(range(-12, 4)) and len(histogram["counts"]) == 17
    at = {e: histogram["counts"][i + 1] for i, e in enumerate(histogram["edges_log10"][:-1])}  # [1e(e), 1e(e+1))
    assert histogram["counts"][0] == 1  # 1e-13 (as float64 rounds it): below 1e-12
    assert at[-5] == 1  # (1 + 1e-5) - 1 is 1.0000000000065512e-05 in float64
    assert at[-1] == 1  # 0.5
    assert histogram["counts"][-1] == 2  # 4999, and inf: 1e308 - -1e308 overflows float64
    assert histogram["zero"] == 2 and histogram["zero"] + sum(histogram["counts"]) == c.compared == 7


def test_exact_and_mismatched_comparisons_have_no_histogram():
    assert compare("s", np.array(["a"]), np.array(["b"])).histogram is None
    assert compare("y", np.zeros(3, np.float32), np.zeros(4, np.float32)).histogram is None
    nothing = compare("y", np.full(3, np.nan), np.full(3, np.nan)).histogram
    assert nothing["zero"] == 0 and sum(nothing["counts"]) == 0


@pytest.mark.parametrize("elements", [1 << 21, 1 << 23])  # 8 MB and 32 MB of float32
def test_comparing_a_large_output_allocates_bounded_memory(elements):
    # it cost ~19 bytes per output byte (1.28 GB for one float32 [4096, 4096] output); now a
    # chunk's temporaries and the p99's kept values, the same for every size
    import tracemalloc
    rng = np.random.default_rng(0)
    ref = np.ones(elements, np.float32)
    cand = ref + rng.uniform(-1e-6, 1e-6, elements).astype(np.float32)
    tracemalloc.start()
    try:
        c = compare("logits", ref, cand)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert c.passed and c.p99_abs == np.percentile(np.abs(ref.astype(np.float64) - cand), 99, method="higher")
    assert peak < 24 << 20, f"{peak / 2**20:.1f} MiB for a {ref.nbytes / 2**20:.0f} MiB output"
