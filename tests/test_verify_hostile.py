"""``verify`` on hostile input: exit 2 with one ``error:`` line, no report written, inputs
untouched; a real difference (infinities included) is exit 1.

Models are built inline with onnx.helper; anything that could block (a FIFO) or print from
onnxruntime's C++ side (its own log lines) runs in a subprocess with a timeout.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import ok, snapshot, write_safetensors, refused
from fusectl.errors import VerifyError
from fusectl.verification.compare import compare
from fusectl.verification.model_check import verify_models
from fusectl.verification.runner import one_line

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
F = TensorProto.FLOAT


def _save(path: Path, nodes, inputs, outputs, initializers=(), opsets=(("", 17),)) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


def _add_model(path: Path, w: np.ndarray) -> Path:
    """y = x + w, x of w's shape (float32)."""
    return _save(path, [helper.make_node("Add", ["x", "w"], ["y"])],
                 [helper.make_tensor_value_info("x", F, list(w.shape))],
                 [helper.make_tensor_value_info("y", F, list(w.shape))],
                 [numpy_helper.from_array(np.asarray(w, np.float32), "w")])


def _const_model(path: Path, value: np.ndarray, elem_type: int) -> Path:
    """A graph with no inputs whose output y is the constant ``value``."""
    tensor = helper.make_tensor("v", elem_type, list(value.shape),
                                [s.encode() for s in value.ravel()] if elem_type == TensorProto.STRING
                                else value.ravel().tolist())
    return _save(path, [helper.make_node("Constant", [], ["y"], value=tensor)], [],
                 [helper.make_tensor_value_info("y", elem_type, list(value.shape))])


def _no_nan(doc) -> None:
    json.dumps(doc, allow_nan=True)
    for check in doc["checks"]:
        for key, value in (check["comparison"] or {}).items():
            assert not (isinstance(value, float) and math.isnan(value)), (key, value)


# ------------------------------------------------------------------ 1. infinities are values


@pytest.mark.parametrize("ref,cand,passes", [
    (np.inf, np.inf, True), (-np.inf, -np.inf, True),
    (np.inf, 1.0, False), (np.inf, -np.inf, False), (1.0, np.inf, False), (-np.inf, 6e4, False),
    (np.inf, np.nan, False), (np.nan, np.nan, True),
])
def test_infinities_compare_as_values(ref, cand, passes):
    for dtype in (np.float32, np.float64, np.float16):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            result = compare("y", np.array([ref, 2.0], dtype), np.array([cand, 2.0], dtype), atol=1.0, rtol=1.0)
        assert result.passed is passes, (ref, cand, dtype)


def test_stats_with_infinities_stay_finite_and_say_how_many_differ():
    ref = np.array([np.inf, 1.0, -np.inf, 2.0, np.nan, np.inf], np.float32)
    cand = np.array([1.0, 1.0, np.inf, 2.5, np.nan, np.inf], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "invalid value" RuntimeWarning leaks
        result = compare("y", ref, cand)
    assert result.mismatches == 3 and result.first_mismatch == [0]
    assert result.max_abs == pytest.approx(0.5) and result.p99_abs == pytest.approx(0.5)
    assert result.mean_abs == pytest.approx(0.25)  # over the two elements finite on both sides
    assert all(not math.isnan(v) for v in (result.max_rel, result.mean_rel, result.p99_rel))
    assert "2 element(s) differ in infinity" in result.note
    assert result.min_atol == math.inf  # no tolerance makes inf equal 1


def test_verify_fails_when_the_reference_is_inf_and_the_candidate_is_not(cli, tmp_path):
    ref = _add_model(tmp_path / "ref.onnx", np.array([np.inf, 1.0, np.inf, 0.0]))
    report = tmp_path / "r.json"
    for w in ([1.0, 1.0, -np.inf, 0.0], [np.inf, 1.0, -np.inf, 0.0], [1.0, 1.0, 1.0, 0.0]):
        cand = _add_model(tmp_path / "cand.onnx", np.array(w))
        result = cli("verify", ref, cand, "--report", report)
        assert result.exit_code == 1, result.output
        assert "differ in infinity" in result.stdout
        doc = json.loads(report.read_text())
        _no_nan(doc)
        assert doc["failed"] == ["y"]
    ok(cli("verify", ref, _add_model(tmp_path / "same.onnx", np.array([np.inf, 1.0, np.inf, 0.0]))))


# ------------------------------------------------------------------ 2. tolerances


@pytest.mark.parametrize("option", ["--atol", "--rtol"])
@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "-1", "-0.5", "abc", ""])
def test_tolerances_must_be_finite_and_not_negative(cli, tmp_path, option, value):
    model = _add_model(tmp_path / "m.onnx", np.ones(2))
    report = tmp_path / "r.json"
    result = cli("verify", model, model, option, value, "--report", report)
    refused(result, f"error: {option}", "finite", unwritten=[report])


def test_a_zero_tolerance_is_accepted(cli, tmp_path):
    model = _add_model(tmp_path / "m.onnx", np.ones(2))
    ok(cli("verify", model, model, "--atol", "0", "--rtol", "0"))


def test_the_library_refuses_a_nan_tolerance(tmp_path):
    model = str(_add_model(tmp_path / "m.onnx", np.ones(2)))
    with pytest.raises(VerifyError, match="atol"):
        verify_models(model, model, atol=float("nan"))
    with pytest.raises(VerifyError, match="rtol"):
        compare("y", np.ones(2), np.ones(2), rtol=float("inf"))


# ------------------------------------------------------------------ 3. reports never overwrite inputs


def _external_model(folder: Path, w: np.ndarray) -> Path:
    """An Add model whose initializer lives in ``w.bin`` beside it."""
    folder.mkdir(exist_ok=True)
    path = _add_model(folder / "ext.onnx", w)
    model = onnx.load(str(path))
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location="w.bin", size_threshold=0)
    assert (folder / "w.bin").exists()
    return path


@pytest.mark.parametrize("option", ["--report", "--junit"])
@pytest.mark.parametrize("target", ["reference", "candidate", "inputs", "external", "hardlink", "symlink"])
def test_a_report_naming_an_input_is_refused_before_running(cli, tmp_path, option, target):
    ref = _external_model(tmp_path / "in", np.ones(4))
    cand = _add_model(tmp_path / "in" / "cand.onnx", np.ones(4))
    inputs = tmp_path / "in" / "io.npz"
    np.savez(inputs, x=np.zeros(4, np.float32))
    if target == "hardlink":
        dest = tmp_path / "link.json"
        os.link(inputs, dest)
    elif target == "symlink":
        dest = tmp_path / "link.json"
        dest.symlink_to(tmp_path / "in" / "w.bin")
    else:
        dest = {"reference": ref, "candidate": cand, "inputs": inputs, "external": tmp_path / "in" / "w.bin"}[target]
    before = snapshot(tmp_path / "in")
    result = cli("verify", ref, cand, "--inputs", inputs, option, dest)
    refused(result, option, "input")
    assert snapshot(tmp_path / "in") == before
    assert result.stdout == ""  # refused before running: no report text either


@pytest.mark.parametrize("dest", ["model.safetensors", "config.json", "verify.json"])
def test_a_report_inside_a_checkpoint_folder_is_refused(cli, tmp_path, dest):
    src = tmp_path / "in" / "llama"
    shutil.copytree(FIXTURES / "tiny-llama-gqa", src)
    rules = tmp_path / "in" / "qkv.toml"
    rules.write_text(cli("rules", "show", "llama-qkv").stdout)
    fused = tmp_path / "fused"
    ok(cli("fuse", src, "-r", rules, "-o", fused, "--quiet"))
    before = snapshot(tmp_path / "in")
    refused(cli("verify", src, fused, "--junit", src / dest), "--junit", "inside the input folder")
    refused(cli("verify", src, fused, "-r", rules, "--report", rules), "--report", "qkv.toml")
    assert snapshot(tmp_path / "in") == before


def test_report_and_junit_naming_one_file_are_refused(cli, tmp_path):
    model = _add_model(tmp_path / "m.onnx", np.ones(2))
    (tmp_path / "sub").mkdir()
    report = tmp_path / "r.xml"
    result = cli("verify", model, model, "--report", report, "--junit", tmp_path / "sub" / ".." / "r.xml")
    refused(result, "--report", "--junit", unwritten=[report])


def test_a_report_in_a_missing_folder_is_refused_before_running(cli, tmp_path):
    model = _add_model(tmp_path / "m.onnx", np.ones(2))
    report = tmp_path / "r.json"
    result = cli("verify", model, model, "--report", report, "--junit", tmp_path / "nowhere" / "j.xml")
    refused(result, "--junit", "nowhere", unwritten=[report])
    refused(cli("verify", model, model, "--report", tmp_path), "--report", "folder")


# ------------------------------------------------------------------ 4. onnxruntime's own output


def _runtime_failure_model(path: Path) -> Path:
    """MatMul of x (2 x n) by a 4 x 3 weight: any n but 4 fails inside onnxruntime."""
    return _save(path, [helper.make_node("MatMul", ["x", "w"], ["y"])],
                 [helper.make_tensor_value_info("x", F, [2, "n"])],
                 [helper.make_tensor_value_info("y", F, [2, 3])],
                 [numpy_helper.from_array(np.ones((4, 3), np.float32), "w")])


def _fusectl(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "fusectl", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=Path(__file__).resolve().parent.parent)


def test_onnxruntime_log_lines_stay_off_stderr(tmp_path):
    model = _runtime_failure_model(tmp_path / "m.onnx")
    done = _fusectl("verify", model, model, "--input", "x=2x5", "--provider", "cpu")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error:") and done.stderr.count("\n") == 1, done.stderr
    assert "\x1b" not in done.stderr and "m.onnx" in done.stderr


def test_onnxruntime_messages_fold_into_one_line():
    text = one_line(RuntimeError("\x1b[1;31m[ONNXRuntimeError] first\x1b[m\n\n  second line\r\nthird\t" + "x" * 2000))
    assert text.startswith("[ONNXRuntimeError] first; second line; third")
    assert "\n" not in text and "\x1b" not in text and "\r" not in text
    assert len(text) <= 500 and text.endswith("...")


# ------------------------------------------------------------------ 5. inputs files and options


def _inputs_case(tmp_path: Path, kind: str) -> Path:
    good = tmp_path / "good.npz"
    np.savez(good, x=np.zeros(2, np.float32))
    path = tmp_path / f"{kind}.npz"
    if kind == "truncated":
        path.write_bytes(good.read_bytes()[:100])
    elif kind == "npy":
        path = tmp_path / "x.npy"
        np.save(path, np.zeros(2, np.float32))
    elif kind == "directory":
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "text":
        path.write_text("x = [1, 2]\n")
    elif kind == "objects":
        np.savez(path, x=np.array([{"a": 1}, None], dtype=object))
    elif kind == "not-npy-member":
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr("x.txt", "1 2")
    elif kind == "corrupt-member":
        data = bytearray(good.read_bytes())
        start = data.index(b"\x93NUMPY")
        data[start + 10:start + 60] = b"!" * 50  # the npy header's dict
        path.write_bytes(bytes(data))
    elif kind == "missing":
        pass
    return path


@pytest.mark.parametrize("kind,needle", [
    ("truncated", "not a readable .npz"), ("npy", "np.savez"), ("directory", "not a regular file"),
    ("empty", "not a readable .npz"), ("text", "not a readable .npz"), ("objects", "Python objects"),
    ("not-npy-member", "x.txt"), ("corrupt-member", "'x'"), ("missing", "no such file"),
])
def test_an_unreadable_inputs_file_is_exit_2(cli, tmp_path, kind, needle):
    model = _add_model(tmp_path / "m.onnx", np.ones(2))
    inputs = _inputs_case(tmp_path, kind)
    report = tmp_path / "r.json"
    refused(cli("verify", model, model, "--inputs", inputs, "--report", report),
            "--inputs", inputs.name, needle, unwritten=[report])


def test_a_fifo_as_inputs_is_refused_without_blocking(tmp_path):
    model = _add_model(tmp_path / "m.onnx", np.ones(2))
    fifo = tmp_path / "in.npz"
    os.mkfifo(fifo)
    done = _fusectl("verify", model, model, "--inputs", fifo, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("error: --inputs"), done.stderr
    assert "not a regular file" in done.stderr


@pytest.mark.parametrize("kind", ["onnx-fifo", "onnx-directory"])
def test_a_model_that_is_not_a_file_is_refused_without_blocking(tmp_path, kind):
    model = _add_model(tmp_path / "m.onnx", np.ones(2))
    other = tmp_path / "other.onnx"
    os.mkfifo(other) if kind == "onnx-fifo" else other.mkdir()
    done = _fusectl("verify", model, other, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("error:"), done.stderr
    assert "other.onnx" in done.stderr and "not a regular file" in done.stderr


def _count_decompressed(monkeypatch) -> list[int]:
    """Bytes read from zip members, as zipfile decompresses them (one entry per read)."""
    reads: list[int] = []
    real_read = zipfile.ZipExtFile.read

    def read(self, n=-1):
        data = real_read(self, n)
        reads.append(len(data))
        return data

    monkeypatch.setattr(zipfile.ZipExtFile, "read", read)
    return reads


def test_inputs_past_the_size_budget_are_refused_before_decompressing(cli, tmp_path, monkeypatch):
    n = 1 << 20  # 4 MiB of float32 zeros, deflated to a few KiB
    model = _add_model(tmp_path / "m.onnx", np.zeros(n))
    bomb = tmp_path / "bomb.npz"
    np.savez_compressed(bomb, x=np.zeros(n, np.float32))
    assert bomb.stat().st_size < 100_000
    monkeypatch.setenv("FUSECTL_MAX_VERIFY_INPUT_BYTES", str(1 << 20))
    reads = _count_decompressed(monkeypatch)
    report = tmp_path / "r.json"
    refused(cli("verify", model, model, "--inputs", bomb, "--report", report),
            "bomb.npz", "FUSECTL_MAX_VERIFY_INPUT_BYTES", unwritten=[report])
    assert sum(reads) < 4096, "array data was decompressed before its size was checked"
    monkeypatch.delenv("FUSECTL_MAX_VERIFY_INPUT_BYTES")
    ok(cli("verify", model, model, "--inputs", bomb))  # within the default budget


@pytest.mark.parametrize("array,needle", [
    (np.zeros((1 << 20, 2), np.float32), "1 dimension, not 2"),  # wrong rank
    (np.zeros(1 << 21, np.float32), "fixed at 4"),  # wrong size on a fixed axis
    (np.zeros(4, np.float64), "save it as float32"),  # wrong element type
])
def test_arrays_that_do_not_fit_the_model_are_refused_before_decompressing(cli, tmp_path, monkeypatch, array, needle):
    model = _add_model(tmp_path / "m.onnx", np.zeros(4))
    inputs = tmp_path / "in.npz"
    np.savez_compressed(inputs, x=array, y=np.zeros(1 << 21, np.float32))
    reads = _count_decompressed(monkeypatch)
    refused(cli("verify", model, model, "--inputs", inputs), "--inputs array x", needle)
    assert sum(reads) < 4096


def test_expected_outputs_in_the_inputs_file_are_not_decompressed(cli, tmp_path, monkeypatch):
    model = _add_model(tmp_path / "m.onnx", np.zeros(4))
    inputs = tmp_path / "in.npz"
    np.savez_compressed(inputs, x=np.ones(4, np.float32), y=np.zeros(1 << 22, np.float32))
    reads = _count_decompressed(monkeypatch)
    ok(cli("verify", model, model, "--inputs", inputs))
    assert sum(reads) < 4096


def test_an_npy_header_declaring_a_huge_array_is_refused_before_allocating(cli, tmp_path):
    model = _add_model(tmp_path / "m.onnx", np.ones(2))
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 64), }"
    member = b"\x93NUMPY\x01\x00" + len(header.ljust(118) + "\n").to_bytes(2, "little") + \
        (header.ljust(118) + "\n").encode() + b"\0" * 64
    lie = tmp_path / "lie.npz"
    with zipfile.ZipFile(lie, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("x.npy", member)
    refused(cli("verify", model, model, "--inputs", lie), "lie.npz", "FUSECTL_MAX_VERIFY_INPUT_BYTES")


@pytest.mark.parametrize("mode", ["model", "checkpoint"])
@pytest.mark.parametrize("seed", ["-1", "-99999999999999999999", "1.5", "x"])
def test_a_negative_or_non_integer_seed_is_a_usage_error(cli, tmp_path, mode, seed):
    if mode == "model":
        a = b = _add_model(tmp_path / "m.onnx", np.ones(2))
    else:
        a = FIXTURES / "tiny-llama-gqa"
        b = tmp_path / "fused"
        ok(cli("fuse", a, "-r", "llama-qkv", "-o", b, "--quiet"))
    report = tmp_path / "r.json"
    refused(cli("verify", a, b, "--seed", seed, "--report", report), "error: --seed", unwritten=[report])


def test_a_large_seed_is_accepted(cli, tmp_path):
    model = _add_model(tmp_path / "m.onnx", np.ones(2))
    ok(cli("verify", model, model, "--seed", str(2**70)))


@pytest.mark.parametrize("value", ["x=-1x8", "x=0x8", "x=2x-8"])
def test_a_negative_input_size_is_a_usage_error(cli, tmp_path, value):
    model = _add_model(tmp_path / "m.onnx", np.ones(2))
    report = tmp_path / "r.json"
    refused(cli("verify", model, model, "--input", value, "--report", report), "error: --input", unwritten=[report])


def _relocate(model: Path, location: str) -> None:
    """Point every external tensor of ``model`` at ``location``."""
    proto = onnx.load(str(model), load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    model.write_bytes(proto.SerializeToString())


@pytest.mark.parametrize("case", ["parent", "absolute", "missing", "symlink-out", "fifo", "past-end"])
def test_external_data_outside_the_model_folder_is_refused(cli, tmp_path, case):
    model = _external_model(tmp_path / "in", np.ones(4))
    outside = tmp_path / "outside.bin"
    shutil.copy(tmp_path / "in" / "w.bin", outside)
    location = {"parent": "../outside.bin", "absolute": str(outside), "missing": "gone.bin",
                "symlink-out": "link.bin", "fifo": "pipe.bin", "past-end": "short.bin"}[case]
    if case == "symlink-out":
        (tmp_path / "in" / "link.bin").symlink_to(outside)
    elif case == "fifo":
        os.mkfifo(tmp_path / "in" / "pipe.bin")
    elif case == "past-end":
        (tmp_path / "in" / "short.bin").write_bytes(b"\0" * 4)
    _relocate(model, location)
    other = _add_model(tmp_path / "other.onnx", np.ones(4))
    report = tmp_path / "r.json"
    if case == "fifo":  # onnxruntime would block reading it
        done = _fusectl("verify", other, model, timeout=60)
        assert done.returncode == 2 and done.stderr.startswith("error:") and "pipe.bin" in done.stderr, done.stderr
        return
    refused(cli("verify", other, model, "--report", report), "ext.onnx", location, unwritten=[report])


def test_external_data_beside_the_model_still_verifies(cli, tmp_path):
    model = _external_model(tmp_path / "in", np.arange(4))
    ok(cli("verify", model, _add_model(tmp_path / "plain.onnx", np.arange(4))))


# ------------------------------------------------------------------ 6. models verify cannot run


def _map_output_model(path: Path) -> Path:
    return _save(path, [helper.make_node("ZipMap", ["x"], ["m"], domain="ai.onnx.ml", classlabels_int64s=[0, 1])],
                 [helper.make_tensor_value_info("x", F, [1, 2])],
                 [helper.make_value_info("m", helper.make_sequence_type_proto(
                     helper.make_map_type_proto(TensorProto.INT64, helper.make_tensor_type_proto(F, []))))],
                 opsets=(("", 17), ("ai.onnx.ml", 3)))


@pytest.mark.parametrize("case,needle", [
    ("garbage", "not a readable ONNX model"), ("empty", "other.onnx"), ("no-outputs", "no outputs"),
    ("sequence-input", "seq(tensor(float))"), ("map-output", "map(int64,tensor(float))"),
])
def test_a_model_verify_cannot_run_is_exit_2(cli, tmp_path, case, needle):
    model = _add_model(tmp_path / "m.onnx", np.ones(2))
    other = tmp_path / "other.onnx"
    if case == "garbage":
        other.write_bytes(b"this is not onnx" * 10)
    elif case == "empty":
        other.write_bytes(b"")
    elif case == "no-outputs":
        _save(other, [helper.make_node("Identity", ["x"], ["y"])], [helper.make_tensor_value_info("x", F, [2])], [])
    elif case == "sequence-input":
        _save(other, [helper.make_node("SequenceAt", ["s", "i"], ["y"])],
              [helper.make_tensor_sequence_value_info("s", F, None),
               helper.make_tensor_value_info("i", TensorProto.INT64, [])],
              [helper.make_tensor_value_info("y", F, None)])
        model = other
    elif case == "map-output":
        model = other = _map_output_model(other)
    report = tmp_path / "r.json"
    refused(cli("verify", model, other, "--report", report), "other.onnx", needle, unwritten=[report])


def test_mismatched_output_names_are_a_difference(cli, tmp_path):
    def identity(path, out):
        return _save(path, [helper.make_node("Identity", ["x"], [out])], [helper.make_tensor_value_info("x", F, [2])],
                     [helper.make_tensor_value_info(out, F, [2])])
    result = cli("verify", identity(tmp_path / "y.onnx", "y"), identity(tmp_path / "z.onnx", "z"))
    assert result.exit_code == 1, result.output
    assert "z.onnx has no output 'y'" in result.stdout and "y.onnx has no output 'z'" in result.stdout


def test_string_outputs_compare_exactly(cli, tmp_path):
    ref = _const_model(tmp_path / "ref.onnx", np.array(["a", "b"]), TensorProto.STRING)
    ok(cli("verify", ref, _const_model(tmp_path / "same.onnx", np.array(["a", "b"]), TensorProto.STRING)))
    result = cli("verify", ref, _const_model(tmp_path / "c.onnx", np.array(["a", "c"]), TensorProto.STRING))
    assert result.exit_code == 1 and "1 element(s) differ" in result.stdout, result.output


def test_integer_outputs_compare_exactly_beyond_float64_precision(cli, tmp_path):
    big = 2**53
    ref = _const_model(tmp_path / "ref.onnx", np.array([big, 1], np.int64), TensorProto.INT64)
    cand = _const_model(tmp_path / "cand.onnx", np.array([big + 1, 1], np.int64), TensorProto.INT64)
    result = cli("verify", ref, cand)
    assert result.exit_code == 1, result.output


def _ragged_sequence_model(path: Path, w: np.ndarray) -> Path:
    """x + w split into a sequence of a 1- and a 3-element tensor."""
    return _save(path, [helper.make_node("Add", ["x", "w"], ["t"]),
                        helper.make_node("SplitToSequence", ["t", "lengths"], ["s"])],
                 [helper.make_tensor_value_info("x", F, [4])],
                 [helper.make_tensor_sequence_value_info("s", F, None)],
                 [numpy_helper.from_array(np.asarray(w, np.float32), "w"),
                  numpy_helper.from_array(np.array([1, 3], np.int64), "lengths")])


def test_sequence_outputs_compare_element_by_element(cli, tmp_path):
    ref = _ragged_sequence_model(tmp_path / "ref.onnx", np.zeros(4))
    ok(cli("verify", ref, _ragged_sequence_model(tmp_path / "same.onnx", np.zeros(4))))
    report = tmp_path / "r.json"
    result = cli("verify", ref, _ragged_sequence_model(tmp_path / "c.onnx", [0, 0, 1, 0]), "--report", report)
    assert result.exit_code == 1, result.output
    assert json.loads(report.read_text())["failed"] == ["s[1]"]


def test_an_input_of_unknown_rank_takes_any_array(cli, tmp_path):
    """onnxruntime reports an unknown rank as [], like a scalar's: the array is not refused for it."""
    model = _save(tmp_path / "m.onnx", [helper.make_node("Identity", ["x"], ["y"])],
                  [helper.make_tensor_value_info("x", F, None)], [helper.make_tensor_value_info("y", F, None)])
    inputs = tmp_path / "in.npz"
    np.savez(inputs, x=np.ones((2, 3), np.float32))
    ok(cli("verify", model, model, "--inputs", inputs))


def test_the_library_takes_arrays_in_memory(tmp_path):
    model = str(_add_model(tmp_path / "m.onnx", np.array([np.inf, 0, 0, 0])))
    report = verify_models(model, model, inputs={"x": np.ones(4, np.float32)})
    assert report.passed and report.inputs[0]["source"] == "file"


@pytest.mark.parametrize("command", ["map", "export"])
def test_map_and_export_refuse_external_data_outside_the_model_folder(cli, tmp_path, command):
    model = _external_model(tmp_path / "in", np.ones(4))
    outside = tmp_path / "outside.bin"
    shutil.copy(tmp_path / "in" / "w.bin", outside)
    _relocate(model, "../outside.bin")
    ckpt = tmp_path / "w.safetensors"
    write_safetensors(ckpt, {"w": np.ones(4, np.float32)})
    out = tmp_path / "out.onnx"
    args = ["map", ckpt, model] if command == "map" else ["export", ckpt, "--graph", model, "-o", out]
    result = cli(*args)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error:") and "ext.onnx" in result.stderr and "outside" in result.stderr
    assert not out.exists()
