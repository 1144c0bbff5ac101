"""Model-mode verify that never passes on nothing, with per-output tolerances, several seeded runs
and saved failing inputs (verification/runs.py, issue 31).

Every graph is made here: an output that is NaN everywhere on both sides (Sqrt of a negative
number), an empty one (a Slice to nothing), a candidate off by a constant (for ``--tol``) and a
candidate that differs only where its scalar input is negative (Relu against Identity), so
that which seeds fail is known from numpy's generator alone."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from conftest import run_cli
from fusectl import api
from fusectl.errors import VerifyError
from fusectl.verification.compare import compare
from fusectl.verification.inputs_file import load_inputs_file, npz_bytes
from fusectl.verification.model_check import verify_models
from fusectl.verification.report import Check
from fusectl.verification.runs import MAX_RUNS, OutputChecks, RunTally, compared_nothing

F = TensorProto.FLOAT


def _save(path: Path, nodes, inputs, outputs, initializers=()) -> str:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return str(path)


def _nan_graph(tmp_path: Path) -> str:
    """y = sqrt(-1 - |x|): NaN everywhere; z = x."""
    minus_one = helper.make_tensor("minus_one", F, [], [-1.0])
    return _save(tmp_path / "nan.onnx",
                 [helper.make_node("Abs", ["x"], ["a"]), helper.make_node("Sub", ["minus_one", "a"], ["n"]),
                  helper.make_node("Sqrt", ["n"], ["y"]), helper.make_node("Identity", ["x"], ["z"])],
                 [helper.make_tensor_value_info("x", F, [2, 3])],
                 [helper.make_tensor_value_info("y", F, [2, 3]), helper.make_tensor_value_info("z", F, [2, 3])],
                 [minus_one])


def _offset_graph(tmp_path: Path, name: str, offset: float) -> str:
    """y = x + offset, z = x - offset (float32[4, 5])."""
    c = helper.make_tensor("c", F, [], [offset])
    return _save(tmp_path / name,
                 [helper.make_node("Add", ["x", "c"], ["y"]), helper.make_node("Sub", ["x", "c"], ["z"])],
                 [helper.make_tensor_value_info("x", F, [4, 5])],
                 [helper.make_tensor_value_info("y", F, [4, 5]), helper.make_tensor_value_info("z", F, [4, 5])], [c])


def _sign_pair(tmp_path: Path) -> tuple[str, str]:
    """Identity against Relu of a float32[1] input: they differ exactly when the input is negative."""
    io = ([helper.make_tensor_value_info("x", F, [1])], [helper.make_tensor_value_info("y", F, [1])])
    return (_save(tmp_path / "identity.onnx", [helper.make_node("Identity", ["x"], ["y"])], *io),
            _save(tmp_path / "relu.onnx", [helper.make_node("Relu", ["x"], ["y"])], *io))


def _negative(seed: int) -> bool:
    """Whether verify's random input for ``seed`` is negative (make_inputs draws N(0,1) so)."""
    return bool(np.random.default_rng(seed).standard_normal((1,)).astype(np.float32)[0] < 0)


# -- never pass on nothing ---------------------------------------------------------------------

def test_two_all_nan_outputs_are_not_a_pass(tmp_path):
    model = _nan_graph(tmp_path)
    report = tmp_path / "r.json"
    result = run_cli("verify", model, model, "--report", report)
    assert result.exit_code == 1, result.stderr
    fail = next(line for line in result.stdout.splitlines() if line.startswith("  FAIL output y"))
    assert "compared no finite element" in fail and "--inputs FILE.npz" in fail
    assert "NaN/+inf/-inf reference 6/0/0, candidate 6/0/0" in fail
    assert "  PASS output z" in result.stdout and result.stdout.rstrip().endswith("1 passed, 1 failed")
    doc = json.loads(report.read_text())
    y = next(c for c in doc["checks"] if c["name"] == "y")
    assert not y["passed"] and doc["failed"] == ["y"]
    assert y["comparison"]["compared"] == 0
    assert y["comparison"]["nonfinite"] == {"reference": {"nan": 6, "+inf": 0, "-inf": 0},
                                            "candidate": {"nan": 6, "+inf": 0, "-inf": 0}}
    assert math.isinf(y["comparison"]["min_atol"])  # no tolerance would pass it
    z = next(c for c in doc["checks"] if c["name"] == "z")
    assert z["comparison"]["compared"] == 6 and z["comparison"]["nonfinite"]["reference"]["nan"] == 0


def test_an_empty_output_compares_nothing_and_fails(tmp_path):
    starts, ends, axes = (helper.make_tensor(n, TensorProto.INT64, [1], [v]) for n, v in
                          (("starts", 0), ("ends", 0), ("axes", 1)))
    model = _save(tmp_path / "empty.onnx", [helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["y"])],
                  [helper.make_tensor_value_info("x", F, [2, 3])], [helper.make_tensor_value_info("y", F, [2, 0])],
                  [starts, ends, axes])
    report = verify_models(model, model, provider="cpu")
    assert not report.passed and "it has no elements" in report.checks[0].detail
    assert 'inputs="FILE.npz"' in report.checks[0].detail  # the API's spelling


def test_nan_matches_only_nan_and_an_infinity_only_itself_at_the_same_place():
    ref = np.array([np.nan, np.inf, -np.inf, 1.0], np.float32)
    same = compare("y", ref, ref.copy())
    assert same.passed and same.compared == 1
    assert same.nonfinite["reference"] == {"nan": 1, "+inf": 1, "-inf": 1} == same.nonfinite["candidate"]
    for i, other in ((0, 1.0), (1, -np.inf), (2, np.nan), (3, np.inf)):
        cand = ref.copy()
        cand[i] = other
        result = compare("y", ref, cand)
        assert not result.passed and result.first_mismatch == [i] and math.isinf(result.min_atol), (i, other)
    moved = compare("y", ref, np.array([np.inf, np.nan, -np.inf, 1.0], np.float32))
    assert moved.mismatches == 2 and moved.nonfinite["candidate"] == {"nan": 1, "+inf": 1, "-inf": 1}


def test_nonfinite_counts_of_complex_and_integer_and_string_arrays():
    ref = np.array([complex(np.inf, 0), complex(1, -np.inf), complex(np.nan, 0), 1 + 1j], np.complex64)
    result = compare("c", ref, ref.copy())
    assert result.nonfinite["reference"] == {"nan": 1, "+inf": 1, "-inf": 1} and result.compared == 1
    ints = compare("i", np.arange(5), np.arange(5))
    assert ints.compared == 5 and not any(ints.nonfinite["reference"].values())
    strings = compare("s", np.array(["a", "b"]), np.array(["a", "b"]))
    assert strings.passed and strings.compared == 2


def test_a_check_without_comparison_or_that_failed_is_left_as_it_is():
    failed = Check("output", "y", False, detail="the reference gives a sequence")
    assert compared_nothing(failed) is failed
    ok = Check("output", "y", True, compare("y", np.ones(2), np.ones(2)))
    assert compared_nothing(ok) is ok


# -- per-output tolerances ---------------------------------------------------------------------

def test_tol_sets_one_outputs_tolerances_and_the_report_gives_the_minimum_that_passes(tmp_path):
    ref, cand = _offset_graph(tmp_path, "a.onnx", 0.0), _offset_graph(tmp_path, "b.onnx", 1e-3)
    report = tmp_path / "r.json"
    plain = run_cli("verify", ref, cand, "--report", report)
    assert plain.exit_code == 1
    checks = {c["name"]: c["comparison"] for c in json.loads(report.read_text())["checks"]}
    assert checks["y"]["min_atol"] == pytest.approx(1e-3, rel=1e-3)
    only_y = run_cli("verify", ref, cand, "--tol", "y=2e-3", "--report", report)
    assert only_y.exit_code == 1  # z keeps the global tolerances
    doc = json.loads(report.read_text())
    assert doc["failed"] == ["z"]
    y = next(c["comparison"] for c in doc["checks"] if c["name"] == "y")
    assert y["atol"] == 2e-3 and y["rtol"] == 1e-5  # RTOL left out: the dtype's default
    both = run_cli("verify", ref, cand, "--tol", "y=2e-3", "--tol", "z=0,1", "--rtol", "1e-6")
    assert both.exit_code == 0, both.stdout + both.stderr
    assert "atol 0.002 rtol 1e-06" in both.stdout and "atol 0 rtol 1" in both.stdout


@pytest.mark.parametrize("args, message", [
    (["--tol", "nope=1e-3"], "--tol nope: neither graph has an output named 'nope'; their outputs are y, z"),
    (["--tol", "y=nan"], "--tol y 'nan': a tolerance must be a finite number >= 0"),
    (["--tol", "y=1e-3,-1"], "--tol y '-1': a tolerance must be a finite number >= 0"),
    (["--tol", "1e-3"], "write OUTPUT=ATOL or OUTPUT=ATOL,RTOL"),
    (["--tol", "y=1e-3", "--tol", "y=1e-2"], "--tol y is given twice with different tolerances"),
    (["--runs", "0"], "--runs"),
    (["--runs", str(MAX_RUNS + 1)], f"give a whole number from 1 to {MAX_RUNS}"),
])
def test_bad_tol_and_runs_exit_2(tmp_path, args, message):
    model = _offset_graph(tmp_path, "a.onnx", 0.0)
    result = run_cli("verify", model, model, *args, "--save-inputs", tmp_path / "s.npz")
    assert result.exit_code == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "s.npz").exists()


def test_the_api_spells_the_knobs_as_the_dataclass_names_them(tmp_path):
    model = _offset_graph(tmp_path, "a.onnx", 0.0)
    with pytest.raises(VerifyError, match=r"OutputChecks.tolerances q: neither graph"):
        api.verify(model, model, provider="cpu", output_checks=OutputChecks(tolerances={"q": (1.0, None)}))
    for runs in (0, True, 1.5):
        with pytest.raises(VerifyError, match="OutputChecks.runs"):
            OutputChecks(runs=runs)
    with pytest.raises(VerifyError, match="OutputChecks.tolerances y"):
        OutputChecks(tolerances={"y": (math.inf, None)})


@pytest.mark.parametrize("checks, knob", [
    (OutputChecks(runs=2), "OutputChecks.runs"), (OutputChecks(tolerances={"w": (1.0, None)}), "OutputChecks.tolerances"),
    (OutputChecks(save_inputs="x.npz"), "OutputChecks.save_inputs"),
])
def test_output_checks_do_not_apply_to_checkpoints(checks, knob):
    with pytest.raises(VerifyError, match=f"{knob} applies to two .onnx models"):
        api.verify("fixtures/tiny-llama-gqa", "fixtures/tiny-llama-gqa", output_checks=checks)


# -- several seeded runs -----------------------------------------------------------------------

def test_runs_gives_the_pass_rate_the_worst_run_and_each_outputs_worst(tmp_path):
    ref, cand = _sign_pair(tmp_path)
    report = tmp_path / "r.json"
    result = run_cli("verify", ref, cand, "--runs", "8", "--seed", "3", "--report", report)
    seeds = range(3, 11)
    failing = [s for s in seeds if _negative(s)]
    assert failing and len(failing) < 8  # the generator gives both signs over these seeds
    assert result.exit_code == 1
    runs = json.loads(report.read_text())["runs"]
    assert runs["count"] == 8 and runs["passed"] == 8 - len(failing)
    assert runs["pass_rate"] == pytest.approx((8 - len(failing)) / 8) and runs["seeds"] == [3, 10]
    assert runs["first_failing"] == {"index": failing[0] - 3, "seed": failing[0]}
    # every failing run fails one check of one mismatch: the worst is the earliest of them
    assert runs["worst"] == {"index": failing[0] - 3, "seed": failing[0], "failed": ["y"]}
    worst_abs = max(abs(float(np.random.default_rng(s).standard_normal((1,)).astype(np.float32)[0])) for s in failing)
    assert runs["outputs"]["y"]["failed_runs"] == len(failing)
    assert runs["outputs"]["y"]["max_abs"] == pytest.approx(worst_abs) == runs["outputs"]["y"]["min_atol"]
    assert f"runs: {8 - len(failing)} of 8 passed" in result.stdout
    assert f"checks below are of the worst run, seed {failing[0]} (1 failed)" in result.stdout
    assert f"runs failed by y: {len(failing)} of 8" in result.stdout


def test_one_run_reports_one_run_and_every_passing_run_passes(tmp_path):
    model = _offset_graph(tmp_path, "a.onnx", 0.0)
    one = verify_models(model, model, provider="cpu")
    assert one.to_json()["runs"]["count"] == 1 and "runs:" not in one.to_text()
    many = verify_models(model, model, provider="cpu", output_checks=OutputChecks(runs=5, save_inputs="unused.npz"))
    runs = many.to_json()["runs"]
    assert many.passed and runs["passed"] == 5 and runs["pass_rate"] == 1.0 and runs["first_failing"] is None
    assert runs["worst"] == {"index": 0, "seed": 0, "failed": []} and many.failing_inputs is None
    assert "runs: 5 of 5 passed (100%), seeds 0-4" in many.to_text()


def test_the_worst_run_is_the_one_with_the_most_failures():
    tally = RunTally(first_seed=0)
    y_bad = compare("y", np.zeros(3), np.array([0, 1, 0.0]))
    y_worse = compare("y", np.zeros(3), np.array([1, 1, 0.0]))
    ok = compare("y", np.zeros(3), np.zeros(3))
    feeds = {"x": np.zeros(1)}
    tally.add(0, [Check("output", "y", True, ok)], feeds)
    tally.add(1, [Check("output", "y", False, y_bad)], {"x": np.ones(1)})
    tally.add(2, [Check("output", "y", False, y_worse)], {"x": np.full(1, 2.0)})
    tally.add(3, [Check("output", "y", False, y_bad), Check("output", "w", False, detail="missing")], feeds)
    tally.add(4, [Check("output", "y", False, y_worse)], feeds)
    doc = tally.to_json()
    assert doc["worst"] == {"index": 3, "seed": 3, "failed": ["y", "w"]}
    assert doc["first_failing"] == {"index": 1, "seed": 1} and tally.failing_inputs["x"][0] == 1.0
    assert doc["outputs"]["w"] == {"failed_runs": 1, "max_abs": 0.0, "min_atol": 0.0, "min_rtol": 0.0}
    assert doc["outputs"]["y"]["failed_runs"] == 4 and doc["outputs"]["y"]["max_abs"] == 1.0


def test_runs_refused_when_every_input_is_given(tmp_path):
    ref, cand = _sign_pair(tmp_path)
    inputs = tmp_path / "in.npz"
    np.savez(inputs, x=np.ones(1, np.float32))
    result = run_cli("verify", ref, cand, "--inputs", inputs, "--runs", "2")
    assert result.exit_code == 2 and "--inputs gives every input, so each run would be the same" in result.stderr


# -- saved failing inputs ----------------------------------------------------------------------

def test_save_inputs_then_inputs_reproduces_the_failure(tmp_path):
    ref, cand = _sign_pair(tmp_path)
    saved, report = tmp_path / "failing.npz", tmp_path / "r.json"
    result = run_cli("verify", ref, cand, "--runs", "8", "--save-inputs", saved, "--report", report)
    assert result.exit_code == 1
    first = json.loads(report.read_text())["runs"]["first_failing"]["seed"]
    arrays = dict(load_inputs_file(str(saved)))
    expected = np.random.default_rng(first).standard_normal((1,)).astype(np.float32)
    assert list(arrays) == ["x"] and np.array_equal(arrays["x"], expected) and arrays["x"][0] < 0
    again = run_cli("verify", ref, cand, "--inputs", saved, "--report", report)
    assert again.exit_code == 1
    doc = json.loads(report.read_text())
    assert doc["failed"] == ["y"] and doc["inputs"][0]["source"] == "file"
    assert doc["checks"][0]["comparison"]["max_abs"] == pytest.approx(abs(float(expected[0])))


def test_save_inputs_writes_nothing_when_every_run_passes_and_never_over_an_input(tmp_path):
    model = _offset_graph(tmp_path, "a.onnx", 0.0)
    saved = tmp_path / "s.npz"
    result = run_cli("verify", model, model, "--runs", "3", "--save-inputs", saved)
    assert result.exit_code == 0 and not saved.exists()
    assert f"note: every run passed, so --save-inputs {saved} was not written" in result.stderr
    over = run_cli("verify", model, model, "--save-inputs", model)
    assert over.exit_code == 2 and "--save-inputs" in over.stderr and "would overwrite the input" in over.stderr
    same = run_cli("verify", model, model, "--save-inputs", saved, "--report", saved)
    assert same.exit_code == 2 and "both name" in same.stderr


def test_npz_bytes_round_trips_through_the_inputs_reader(tmp_path):
    arrays = {"ids": np.arange(6, dtype=np.int64).reshape(2, 3), "mask": np.array([True, False])}
    path = tmp_path / "i.npz"
    path.write_bytes(npz_bytes(arrays))
    back = load_inputs_file(str(path))
    assert {k: back[k].tolist() for k in back} == {k: v.tolist() for k, v in arrays.items()}
