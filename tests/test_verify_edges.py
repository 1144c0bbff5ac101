"""``verify`` of two .onnx models at its edges: outputs that differ in kind, length, shape or
dtype; inputs of types verify cannot make; random bool inputs; sizes taken from the
candidate; onnxruntime failing mid-run; JUnit failure messages; and ``--inputs`` archives
that are damaged, duplicated, from a future numpy, or changed while verify runs."""

from __future__ import annotations

import io
import json
import struct
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import ok, refused
from fusectl.errors import VerifyError
from fusectl.verification.compare import compare, default_tolerance
from fusectl.verification.inputs_file import load_inputs_file
from fusectl.verification.model_check import verify_models

F = TensorProto.FLOAT


def _save(path: Path, nodes, inputs, outputs, initializers=()) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


def _vi(name: str, elem_type: int = F, shape=(4,)):
    return helper.make_tensor_value_info(name, elem_type, None if shape is None else list(shape))


def _add(path: Path, w, shape=(4,)) -> Path:
    """y = x + w."""
    return _save(path, [helper.make_node("Add", ["x", "w"], ["y"])], [_vi("x", shape=shape)], [_vi("y", shape=shape)],
                 [numpy_helper.from_array(np.asarray(w, np.float32), "w")])


def _split(path: Path, lengths, out: str = "y") -> Path:
    """``out`` = x (4 elements) cut into a sequence of tensors of ``lengths``."""
    return _save(path, [helper.make_node("SplitToSequence", ["x", "lengths"], [out])], [_vi("x")],
                 [helper.make_tensor_sequence_value_info(out, F, None)],
                 [numpy_helper.from_array(np.asarray(lengths, np.int64), "lengths")])


def differs(result, *needles: str) -> None:
    """Exit 1 (a difference, not an error), each needle in the report on stdout."""
    assert result.exit_code == 1, f"exit {result.exit_code}\n{result.output}"
    assert "result: FAIL" in result.stdout
    for needle in needles:
        assert needle in result.stdout, f"{needle!r} not in {result.stdout}"


# ------------------------------------------------------------------------- outputs that differ


def test_a_sequence_against_a_tensor_is_a_difference(cli, tmp_path):
    ref = _split(tmp_path / "seq.onnx", [2, 2])
    cand = _add(tmp_path / "tensor.onnx", np.zeros(4))
    differs(cli("verify", ref, cand), "FAIL output y", "(the reference gives a sequence, the candidate a tensor)")
    differs(cli("verify", cand, ref), "(the reference gives a tensor, the candidate a sequence)")


def test_sequences_of_different_lengths_are_a_difference(cli, tmp_path):
    result = cli("verify", _split(tmp_path / "two.onnx", [2, 2]), _split(tmp_path / "three.onnx", [1, 1, 2]))
    differs(result, "FAIL output y", "(a sequence of 2 tensor(s) in the reference, 3 in the candidate)")


def test_an_output_of_another_shape_is_a_difference_no_tolerance_passes(cli, tmp_path):
    ref = _add(tmp_path / "ref.onnx", np.zeros(4))
    cand = _save(tmp_path / "cand.onnx", [helper.make_node("Concat", ["x", "x"], ["y"], axis=0)], [_vi("x")],
                 [_vi("y", shape=(8,))])
    report = tmp_path / "r.json"
    differs(cli("verify", ref, cand, "--report", report), "candidate is float32[8]", "no finite tolerance would pass")
    (check,) = json.loads(report.read_text())["checks"]
    assert check["comparison"]["note"] == "candidate is float32[8]"
    assert check["comparison"]["mismatches"] == 4


def test_junit_failures_say_how_each_output_failed(cli, tmp_path):
    """A numeric failure gives counts and the tolerance that would pass; a missing output its reason."""
    two = _save(tmp_path / "two.onnx",
                [helper.make_node("Add", ["x", "w"], ["y"]), helper.make_node("Neg", ["x"], ["z"])],
                [_vi("x")], [_vi("y"), _vi("z")], [numpy_helper.from_array(np.zeros(4, np.float32), "w")])
    one = _add(tmp_path / "one.onnx", [0, 0, 0.5, 0])
    junit = tmp_path / "verify.xml"
    inputs = tmp_path / "in.npz"
    np.savez(inputs, x=np.ones(4, np.float32))
    differs(cli("verify", two, one, "--inputs", inputs, "--junit", junit))
    suite = ET.parse(junit).getroot()
    assert (suite.get("tests"), suite.get("failures")) == ("2", "2")
    failures = {case.get("name"): case.find("failure").get("message") for case in suite.iter("testcase")}
    assert failures["y"] == "1 element(s) differ; max abs 0.5, max rel 0.5; would pass with atol 0.5 or rtol 0.5"
    assert failures["z"] == f"{one} has no output 'z'"


# --------------------------------------------------------------------------- inputs verify makes


def test_random_bool_inputs_are_zeros_and_ones_of_type_bool(cli, tmp_path):
    model = _save(tmp_path / "not.onnx", [helper.make_node("Not", ["x"], ["y"])],
                  [_vi("x", TensorProto.BOOL, (64,))], [_vi("y", TensorProto.BOOL, (64,))])
    report = tmp_path / "r.json"
    ok(cli("verify", model, model, "--report", report))
    assert json.loads(report.read_text())["inputs"] == [
        {"name": "x", "dtype": "bool", "shape": [64], "source": "random"}]


def test_an_input_of_a_type_verify_cannot_make_asks_for_an_inputs_file(cli, tmp_path):
    model = _save(tmp_path / "s.onnx", [helper.make_node("Identity", ["x"], ["y"])],
                  [_vi("x", TensorProto.STRING, (2,))], [_vi("y", TensorProto.STRING, (2,))])
    refused(cli("verify", model, model), "s.onnx: input x has type tensor(string); pass it with --inputs FILE.npz")
    inputs = tmp_path / "in.npz"
    np.savez(inputs, x=np.array(["a", "b"], dtype=object).astype(str))
    ok(cli("verify", model, model, "--inputs", inputs))


def test_an_unsized_axis_takes_the_candidates_fixed_size(cli, tmp_path):
    ref = _add(tmp_path / "ref.onnx", np.zeros(3), shape=(None,))
    cand = _add(tmp_path / "cand.onnx", np.zeros(3), shape=(3,))
    report = tmp_path / "r.json"
    ok(cli("verify", ref, cand, "--report", report))
    assert json.loads(report.read_text())["inputs"][0]["shape"] == [3]


def test_candidate_inputs_must_be_the_references(cli, tmp_path):
    ref = _add(tmp_path / "ref.onnx", np.zeros(4))
    cand = _save(tmp_path / "cand.onnx", [helper.make_node("Add", ["x", "z"], ["y"])], [_vi("x"), _vi("z")], [_vi("y")])
    refused(cli("verify", ref, cand), "cand.onnx: its inputs ['x', 'z'] differ from", "ref.onnx's ['x']")


def test_an_input_given_as_a_shape_and_in_a_file_is_refused(cli, tmp_path):
    model = _add(tmp_path / "m.onnx", np.zeros(4), shape=("n",))
    inputs = tmp_path / "in.npz"
    np.savez(inputs, x=np.ones(4, np.float32))
    report = tmp_path / "r.json"
    refused(cli("verify", model, model, "--inputs", inputs, "--input", "x=4", "--report", report),
            "--input x: --inputs already gives this input; give it one way", unwritten=[report])


def test_onnxruntime_failing_while_running_is_exit_2(cli, tmp_path):
    """Reshaping 32 elements into rows of 5 fails only when the kernel runs."""
    model = _save(tmp_path / "m.onnx", [helper.make_node("Reshape", ["x", "shape"], ["y"])],
                  [_vi("x", shape=(2, "n"))], [_vi("y", shape=None)],
                  [numpy_helper.from_array(np.array([-1, 5], np.int64), "shape")])
    refused(cli("verify", model, model, "--dim", "n=16"), "m.onnx: onnxruntime failed to run it")


@pytest.mark.parametrize("seed", ["7", 1.5, -1])
def test_the_library_refuses_a_seed_that_is_not_a_whole_number(tmp_path, seed):
    model = str(_add(tmp_path / "m.onnx", np.zeros(4)))
    with pytest.raises(VerifyError, match=r"seed .*give a whole number >= 0"):
        verify_models(model, model, seed=seed)


# -------------------------------------------------------------------------------- --inputs files


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _npy_raw(header: str, data: bytes = b"", version: tuple[int, int] = (1, 0)) -> bytes:
    text = header.encode("latin1")
    text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"
    return b"\x93NUMPY" + bytes(version) + struct.pack("<H", len(text)) + text + data


def _zip(path: Path, members, compression=zipfile.ZIP_STORED) -> Path:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a duplicate name
        with zipfile.ZipFile(path, "w", compression) as zf:
            for name, data in members:
                zf.writestr(name, data)
    return path


X = _npy(np.ones(4, np.float32))


@pytest.mark.parametrize("members, needle", [
    ([("x.npy", X), ("x.npy", X)], "holds two arrays named 'x'; keep one"),
    ([("x.npy", _npy_raw("{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }", b"\0" * 16, (4, 0)))],
     "array 'x' is unreadable (npy format version 4.0 is not one numpy writes)"),
    ([("x.npy", _npy_raw("{'descr': '<f4', 'fortran_order': False, 'shape': (-2, -2), }"))],
     "array 'x' declares the shape [-2, -2]; the archive is corrupt"),
    ([("x.npy", _npy_raw("{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }", b"\0" * 8))],
     "array 'x' declares 16 data bytes (float32[4]) but the archive holds 8"),
], ids=["duplicate", "npy-4.0", "negative-shape", "short-data"])
def test_a_bad_inputs_archive_is_refused_before_running(cli, tmp_path, members, needle):
    model = _add(tmp_path / "m.onnx", np.zeros(4))
    inputs = _zip(tmp_path / "in.npz", members)
    report = tmp_path / "r.json"
    refused(cli("verify", model, model, "--inputs", inputs, "--report", report), "--inputs", "in.npz", needle,
            unwritten=[report])


def test_a_member_whose_zip_header_is_damaged_is_refused(cli, tmp_path):
    model = _add(tmp_path / "m.onnx", np.zeros(4))
    inputs = _zip(tmp_path / "in.npz", [("x.npy", X)])
    data = bytearray(inputs.read_bytes())
    assert data[:4] == b"PK\x03\x04"
    data[:4] = b"XX\x03\x04"  # the first (only) member's local header
    inputs.write_bytes(bytes(data))
    refused(cli("verify", model, model, "--inputs", inputs), "array 'x' is unreadable", "truncated or corrupt")


def test_compressed_data_damaged_past_the_header_is_refused_when_read(cli, tmp_path):
    """Headers decompress fine (so the archive loads); the damage shows when the array is fed."""
    model = _add(tmp_path / "m.onnx", np.zeros(4096), shape=(4096,))
    inputs = tmp_path / "in.npz"
    np.savez_compressed(inputs, x=np.random.default_rng(0).standard_normal(4096).astype(np.float32))
    data = bytearray(inputs.read_bytes())
    with zipfile.ZipFile(inputs) as zf:
        info = zf.getinfo("x.npy")
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    middle = start + info.compress_size // 2
    data[middle:middle + 64] = bytes(64)
    inputs.write_bytes(bytes(data))
    load_inputs_file(str(inputs))  # the headers still read
    refused(cli("verify", model, model, "--inputs", inputs), "array 'x' is unreadable", "truncated or corrupt")


def test_an_inputs_file_replaced_after_loading_is_noticed(tmp_path):
    path = tmp_path / "in.npz"
    np.savez(path, x=np.ones(4, np.float32))
    inputs = load_inputs_file(str(path))
    np.savez(path, x=np.ones((2, 2), np.float32))
    with pytest.raises(VerifyError, match=r"array 'x' changed while verify ran; run it again"):
        inputs["x"]


def test_a_zero_width_string_array_reads_as_empty_strings(tmp_path):
    path = _zip(tmp_path / "in.npz", [("x.npy", _npy_raw("{'descr': '|S0', 'fortran_order': False, 'shape': (3,), }"))])
    inputs = load_inputs_file(str(path))
    assert len(inputs) == 1 and list(inputs) == ["x"]
    assert inputs.declared["x"][0] == (3,) and inputs.declared["x"][1].itemsize == 0
    assert inputs["x"].tolist() == [b"", b"", b""]


def test_an_inputs_file_reads_only_the_array_looked_up(tmp_path):
    path = tmp_path / "in.npz"
    np.savez(path, x=np.arange(4, dtype=np.float32), y=np.arange(6, dtype=np.int8).reshape(2, 3))
    inputs = load_inputs_file(str(path))
    assert inputs.declared == {"x": ((4,), np.dtype(np.float32)), "y": ((2, 3), np.dtype(np.int8))}
    np.testing.assert_array_equal(inputs["y"], np.arange(6, dtype=np.int8).reshape(2, 3))


# ---------------------------------------------------------------------------------- comparison


def test_default_tolerances_by_dtype():
    assert default_tolerance(np.float32) == (1e-5, 1e-5)
    assert default_tolerance(ml_dtypes.bfloat16) == (1e-2, 1e-2)
    assert default_tolerance(ml_dtypes.float8_e4m3fn) == (1e-1, 1e-1)
    assert default_tolerance(ml_dtypes.float8_e5m2) == (1e-1, 1e-1)
    assert default_tolerance(np.int32) == (0.0, 0.0)


def test_complex_outputs_compare_by_the_distance_between_values():
    ref = np.array([1 + 1j, 2 - 2j], np.complex64)
    assert compare("z", ref, ref.copy()).passed
    moved = compare("z", ref, np.array([1 + 1j, 2 - 1j], np.complex64), atol=0.5, rtol=0)
    assert not moved.passed and moved.mismatches == 1 and moved.first_mismatch == [1]
    assert moved.max_abs == pytest.approx(1.0)
    assert compare("z", ref, np.array([1 + 1j, 2 - 1.9j], np.complex64), atol=0.5, rtol=0).passed


def test_a_dtype_mismatch_fails_naming_the_candidates_dtype():
    result = compare("y", np.zeros(3, np.float32), np.zeros(3, np.float64))
    assert not result.passed
    assert result.note == "candidate is float64[3]"
    assert result.mismatches == 3 and result.min_atol == float("inf")
