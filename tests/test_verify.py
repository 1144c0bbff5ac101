"""verify: checkpoint mode (replay, inverse, ties, probes) and model mode (two .onnx)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from fusectl.cli import main
from fusectl.io.safetensors_file import read_header
from fusectl.verify.compare import compare
from fusectl.verify.probes import build_probe, _run_probe
from fusectl.verify.runner import CPU

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def fuse(src, out, *rules):
    result = run("fuse", src, *[x for r in rules for x in ("-r", r)], "-o", out, "--quiet")
    assert result.exit_code == 0, result.output
    return out


def perturb(path: Path, tensor: str, index: int, delta: float = 0.01):
    """Add ``delta`` to one float32 element of a tensor inside a safetensors file."""
    location = read_header(str(path))[0][tensor].location
    with open(path, "r+b") as f:
        f.seek(location.offset + 4 * index)
        value = np.frombuffer(f.read(4), np.float32)[0]
        f.seek(location.offset + 4 * index)
        f.write(np.float32(value + delta).tobytes())


# ------------------------------------------------------------------ comparison rule


def test_element_fails_only_when_both_tolerances_are_exceeded():
    ref = np.array([1.0, 100.0, 0.0], np.float32)
    cand = np.array([1.0 + 2e-5, 100.0 + 5e-4, 2e-5], np.float32)
    result = compare("y", ref, cand, atol=1e-5, rtol=1e-5)
    # 1+2e-5: abs 2e-5 > atol and rel 2e-5 > rtol -> fails; 100+5e-4: rel 5e-6 -> passes;
    # 0 -> 2e-5: abs > atol and rel = inf -> fails
    assert result.mismatches == 2 and result.first_mismatch == [0]
    assert result.min_atol == pytest.approx(2e-5, rel=1e-2)


def test_nan_fails_unless_nan_on_both_sides():
    ref = np.array([np.nan, 1.0], np.float32)
    assert compare("y", ref, ref.copy()).passed
    assert not compare("y", ref, np.array([0.0, 1.0], np.float32)).passed
    assert not compare("y", np.array([1.0], np.float32), np.array([np.nan], np.float32)).passed


def test_default_tolerances_follow_the_dtype():
    ref = np.ones(4, np.float16)
    assert compare("y", ref, (ref + np.float16(5e-4)).astype(np.float16)).passed  # fp16: 1e-3
    assert not compare("y", ref.astype(np.float32), ref.astype(np.float32) + 5e-4).passed


# ------------------------------------------------------------------ checkpoint mode


def test_checkpoint_mode_passes_and_writes_reports(tmp_path):
    src = FIXTURES / "tiny-llama-gqa"
    fused = fuse(src, tmp_path / "fused", "llama-qkv", "llama-gate-up")
    report, junit = tmp_path / "r.json", tmp_path / "j.xml"
    result = run("verify", src, fused, "--report", report, "--junit", junit)
    assert result.exit_code == 0, result.output
    doc = json.loads(report.read_text())
    assert doc["passed"] and doc["mode"] == "checkpoint" and doc["provider"] == CPU
    kinds = {c["kind"] for c in doc["checks"]}
    assert kinds == {"tensor", "inverse", "probe"}
    probes = [c for c in doc["checks"] if c["kind"] == "probe"]
    assert len(probes) == 2  # concat q/k/v and gate/up, once per distinct shape
    suite = ET.parse(junit).getroot()
    assert suite.get("failures") == "0" and int(suite.get("tests")) == len(doc["checks"])


def test_one_perturbed_element_makes_checkpoint_verify_fail(tmp_path):
    src = FIXTURES / "tiny-llama-gqa"
    fused = fuse(src, tmp_path / "fused", "llama-qkv")
    perturb(fused / "model.safetensors", "model.layers.0.self_attn.qkv_proj.weight", 40 * 32 + 3)
    report = tmp_path / "r.json"
    result = run("verify", src, fused, "--report", report)
    assert result.exit_code == 1, result.output
    doc = json.loads(report.read_text())
    assert "model.layers.0.self_attn.qkv_proj.weight" in doc["failed"]
    # the probe of layer 0's concat also sees it: its fused side reads the candidate's bytes
    assert any(c["kind"] == "probe" and not c["passed"] for c in doc["checks"])
    assert "FAIL tensor model.layers.0.self_attn.qkv_proj.weight" in result.output


def test_ties_of_the_reference_must_survive(tmp_path):
    src = FIXTURES / "tied-embeddings.safetensors"
    rules = tmp_path / "r.toml"
    rules.write_text('version = 1\n[[rule]]\nop = "rename"\ninput = "head.weight"\noutput = "lm_head.weight"\n')
    out = fuse(src, tmp_path / "out.safetensors", rules)
    assert run("verify", src, out).exit_code == 0
    # a candidate that stores the two members separately passes tensor checks but not ties
    from safetensors.numpy import load_file, save_file
    arrays = load_file(str(out))
    arrays["lm_head.weight"] = arrays["embed.weight"].copy()
    loose = tmp_path / "loose.safetensors"
    save_file(arrays, str(loose))
    result = run("verify", src, loose, "-r", rules)
    assert result.exit_code == 1, result.output
    assert "FAIL ties embed.weight, lm_head.weight" in result.output


@pytest.mark.parametrize("stem,preset", [
    ("weight_norm_legacy", "weight-norm-fold"),
    ("spectral_norm_parametrizations", "spectral-norm-fold"),
    ("conv_bn", "conv-bn-fold"),
])
def test_numeric_folds_verify_within_tolerance(tmp_path, stem, preset):
    src = FIXTURES / "reparam" / f"{stem}.safetensors"
    out = fuse(src, tmp_path / "out.safetensors", preset)
    report = tmp_path / "r.json"
    result = run("verify", src, out, "--report", report)
    assert result.exit_code == 0, result.output
    probes = [c for c in json.loads(report.read_text())["checks"] if c["kind"] == "probe"]
    assert probes and all(c["passed"] for c in probes)


def test_a_wrong_bn_fold_is_caught_by_the_probe(tmp_path):
    src = FIXTURES / "reparam" / "conv_bn.safetensors"
    out = fuse(src, tmp_path / "out.safetensors", "conv-bn-fold")
    perturb(out, "stem.conv1.bias", 1, delta=0.05)
    report = tmp_path / "r.json"
    assert run("verify", src, out, "--report", report).exit_code == 1
    failed = [c for c in json.loads(report.read_text())["checks"] if not c["passed"]]
    assert {c["kind"] for c in failed} == {"tensor", "probe"}
    assert any("stem.conv1.bias" == c["name"] for c in failed)


def test_probe_catches_a_wrong_layout_the_names_cannot_show():
    # an interleave whose fused tensor was concatenated instead: same names, same shape
    from fusectl.dtypes import BY_NAME
    from fusectl.ops.layout import Interleave
    from fusectl.plan import Step
    from fusectl.tensors import TensorSpec

    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((8, 4)).astype(np.float32) for _ in range(3))
    op = Interleave(axis=0, groups=2)
    specs = tuple(TensorSpec(BY_NAME["F32"], (8, 4)) for _ in range(3))
    step = Step(op, ("q", "k", "v"), ("qkv",), specs, (TensorSpec(BY_NAME["F32"], (24, 4)),))
    good = _run_probe(build_probe(step, [q, k, v], op.apply([q, k, v]), 0), "r", CPU, None, None)
    bad = _run_probe(build_probe(step, [q, k, v], [np.concatenate([q, k, v])], 0), "r", CPU, None, None)
    assert good.passed and not bad.passed


def test_no_provenance_and_no_rules_is_exit_2(tmp_path):
    src = FIXTURES / "tied-embeddings.safetensors"
    result = run("verify", src, src)
    assert result.exit_code == 2 and "no fusectl provenance" in result.output


# ------------------------------------------------------------------ model mode


def _linear_model(path: Path, w: np.ndarray, dynamic=False):
    batch = "batch" if dynamic else 2
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, w.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, w.shape[1]])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_model_mode_passes_on_equal_models_and_fails_on_one_element(tmp_path):
    w = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    a = _linear_model(tmp_path / "a.onnx", w, dynamic=True)
    b = _linear_model(tmp_path / "b.onnx", w.copy(), dynamic=True)
    report = tmp_path / "r.json"
    result = run("verify", a, b, "--input", "x=5x4", "--report", report)
    assert result.exit_code == 0, result.output
    doc = json.loads(report.read_text())
    assert doc["inputs"] == [{"name": "x", "dtype": "float32", "shape": [5, 4], "source": "random"}]
    w2 = w.copy()
    w2[2, 1] += 0.01
    c = _linear_model(tmp_path / "c.onnx", w2, dynamic=True)
    result = run("verify", a, c, "--report", report)
    assert result.exit_code == 1
    doc = json.loads(report.read_text())
    assert doc["failed"] == ["y"]
    y = next(ch for ch in doc["checks"] if ch["name"] == "y")["comparison"]
    assert y["min_atol"] > 1e-5 and y["first_mismatch"][1] == 1


def test_model_mode_uses_inputs_from_npz(tmp_path):
    w = np.eye(4, 3, dtype=np.float32)
    a = _linear_model(tmp_path / "a.onnx", w)
    inputs = tmp_path / "in.npz"
    np.savez(inputs, x=np.arange(8, dtype=np.float32).reshape(2, 4))
    report = tmp_path / "r.json"
    assert run("verify", a, a, "--inputs", inputs, "--report", report).exit_code == 0
    assert json.loads(report.read_text())["inputs"][0]["source"] == "file"
    bad = tmp_path / "bad.npz"
    np.savez(bad, z=np.zeros(2, np.float32))
    result = run("verify", a, a, "--inputs", bad)
    assert result.exit_code == 2 and "'z'" in result.output


@pytest.mark.skipif("CUDAExecutionProvider" in onnxruntime.get_available_providers(),
                    reason="this machine has CUDA")
def test_cuda_without_cuda_is_exit_2(tmp_path):
    a = _linear_model(tmp_path / "a.onnx", np.eye(2, dtype=np.float32))
    result = run("verify", a, a, "--provider", "cuda")
    assert result.exit_code == 2
    assert result.output.startswith("error: --provider cuda") and "CUDA" in result.output


def test_bad_input_shape_option_is_exit_2(tmp_path):
    a = _linear_model(tmp_path / "a.onnx", np.eye(2, dtype=np.float32))
    result = run("verify", a, a, "--input", "x=2by2")
    assert result.exit_code == 2 and "NAME=D0xD1" in result.output


def _bf16_model(path: Path, w: np.ndarray):
    import ml_dtypes
    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16),
         helper.make_node("MatMul", ["xb", "w"], ["yb"]),
         helper.make_node("Cast", ["yb"], ["y"], to=TensorProto.FLOAT)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, w.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, w.shape[1]])],
        [helper.make_tensor("w", TensorProto.BFLOAT16, w.shape,
                            w.astype(ml_dtypes.bfloat16).astype(np.float32).reshape(-1).tolist())],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.mark.skipif("CUDAExecutionProvider" in onnxruntime.get_available_providers(),
                    reason="with CUDA, bf16 runs natively")
def test_bf16_models_run_upcast_to_float32_on_cpu_and_say_so(tmp_path):
    w = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    a = _bf16_model(tmp_path / "a.onnx", w)
    report = tmp_path / "r.json"
    result = run("verify", a, a, "--report", report)
    assert result.exit_code == 0, result.output
    assert json.loads(report.read_text())["precision"] == "fp32-upcast"
    assert "bf16 upcast to float32" in result.output
    w2 = w.copy()
    w2[0, 0] += 1.0
    b = _bf16_model(tmp_path / "b.onnx", w2)
    assert run("verify", a, b).exit_code == 1


def test_verify_replays_only_what_the_reference_lacks(tmp_path):
    src = FIXTURES / "tiny-llama-gqa"
    once = fuse(src, tmp_path / "once", "llama-qkv")
    twice = fuse(once, tmp_path / "twice", "llama-gate-up")
    result = run("verify", once, twice)
    assert result.exit_code == 0, result.output
    assert "mlp-gate-up" in result.output and "attn-qkv" not in result.output
    assert run("verify", src, twice).exit_code == 0
