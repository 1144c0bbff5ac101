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

from conftest import metadata_of, write_rules, write_safetensors
from fusectl.cli import main
from fusectl.io.formats.safetensors_file import read_header
from fusectl.verification.compare import compare
from fusectl.verification.probes import build_probe, _run_probe
from fusectl.verification.runner import CPU

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
    # the provider named: auto takes CUDA where onnxruntime has it
    result = run("verify", src, fused, "--provider", "cpu", "--report", report, "--junit", junit)
    assert result.exit_code == 0, result.output
    doc = json.loads(report.read_text())
    assert doc["passed"] and doc["mode"] == "checkpoint" and doc["provider"] == CPU
    kinds = {c["kind"] for c in doc["checks"]}
    assert kinds == {"tensor", "inverse", "probe", "rules"}
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
    from fusectl.steps import Step
    from fusectl.tensors import TensorSpec

    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((8, 4)).astype(np.float32) for _ in range(3))
    op = Interleave(axis=0, groups=2)
    specs = tuple(TensorSpec(BY_NAME["F32"], (8, 4)) for _ in range(3))
    step = Step(op, ("q", "k", "v"), ("qkv",), specs, (TensorSpec(BY_NAME["F32"], (24, 4)),))
    good = _run_probe(build_probe(step, [q, k, v], op.apply([q, k, v]), 0), "r", CPU, None, None)
    bad = _run_probe(build_probe(step, [q, k, v], [np.concatenate([q, k, v])], 0), "r", CPU, None, None)
    assert good.passed and not bad.passed


def test_a_step_that_moves_rows_is_probed_on_a_window_of_columns_and_still_catches_a_wrong_layout(tmp_path):
    """A wide concat is probed on its first PROBE_COLUMNS columns (a slice, not the whole tensor
    upcast); rows in the wrong place change every column, so the window still sees them."""
    from fusectl.verification.probes import PROBE_COLUMNS

    rng = np.random.default_rng(3)
    src = tmp_path / "m.safetensors"
    parts = {f"l.{x}": rng.standard_normal((4, 3 * PROBE_COLUMNS)).astype(np.float32) for x in "ab"}
    write_safetensors(src, parts)
    rules = write_rules(tmp_path / "r.toml", 'version = 1\n[[rule]]\nname = "cat"\nop = "concat"\n'
                                             'inputs = ["l.a", "l.b"]\noutput = "l.ab"\n')
    out = fuse(src, tmp_path / "out.safetensors", rules)
    report = tmp_path / "r.json"
    assert run("verify", src, out, "--report", report).exit_code == 0
    (probe,) = [c for c in json.loads(report.read_text())["checks"] if c["kind"] == "probe"]
    assert probe["detail"] == f"columns 0..{PROBE_COLUMNS - 1} of {3 * PROBE_COLUMNS}: the step moves whole rows"
    # the fused tensor with two rows swapped: caught by the tensor check and by the probe
    swapped = np.concatenate([parts["l.a"], parts["l.b"]])[[1, 0, 2, 3, 4, 5, 6, 7]]
    write_safetensors(tmp_path / "bad.safetensors", {"l.ab": swapped},
                      metadata=metadata_of(out))
    assert run("verify", src, tmp_path / "bad.safetensors", "--report", report).exit_code == 1
    failed = {c["kind"] for c in json.loads(report.read_text())["checks"] if not c["passed"]}
    assert failed == {"tensor", "inverse", "probe"}


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


# ------------------------------------------------------------------ model mode: input shapes


def _masked_model(path: Path, ids=("batch", "sequence"), mask=("batch", "sequence")):
    """A BERT-like signature whose output multiplies the two inputs, so their shapes must agree."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["input_ids", "attention_mask"], ["y"])], "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, list(ids)),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, list(mask))],
        [helper.make_tensor_value_info("y", TensorProto.INT64, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _shapes(report: Path) -> dict:
    doc = json.loads(report.read_text())
    return {i["name"]: i["shape"] for i in doc["inputs"]}


def test_dynamic_dims_default_to_2_for_a_leading_axis_and_16_elsewhere(tmp_path):
    a = _masked_model(tmp_path / "a.onnx")
    report = tmp_path / "r.json"
    result = run("verify", a, a, "--report", report)
    assert result.exit_code == 0, result.output
    assert _shapes(report) == {"input_ids": [2, 16], "attention_mask": [2, 16]}
    doc = json.loads(report.read_text())
    assert doc["dims"] == {"batch": 2, "sequence": 16}
    assert doc["checks"][0]["comparison"]["shape"] == [2, 16]
    assert "  inputs: input_ids int64[2, 16], attention_mask int64[2, 16]; dims batch=2, sequence=16" in result.output


def test_default_rule_per_axis():
    from fusectl.verification.runner import resolve_shapes
    shapes, dims = resolve_shapes({"pos": ("sequence",), "ids": ("batch", "sequence"), "lengths": ("batch",),
                                   "u": (None, None, 3)})
    # 'sequence' leads in pos but not in ids: 16; 'batch' leads everywhere: 2; unnamed by position
    assert shapes == {"pos": (16,), "ids": (2, 16), "lengths": (2,), "u": (2, 16, 3)}
    assert dims == {"sequence": 16, "batch": 2}


def test_input_shape_gives_its_named_dims_to_the_other_inputs(tmp_path):
    a = _masked_model(tmp_path / "a.onnx")
    report = tmp_path / "r.json"
    result = run("verify", a, a, "--input", "input_ids=3x8", "--report", report)
    assert result.exit_code == 0, result.output
    assert _shapes(report) == {"input_ids": [3, 8], "attention_mask": [3, 8]}
    assert json.loads(report.read_text())["dims"] == {"batch": 3, "sequence": 8}
    # an input shape that agrees with an explicit --dim is fine
    result = run("verify", a, a, "--input", "input_ids=3x8", "--dim", "sequence=8", "--report", report)
    assert result.exit_code == 0, result.output


def test_dim_option_sizes_every_input_that_uses_it(tmp_path):
    a = _masked_model(tmp_path / "a.onnx")
    report = tmp_path / "r.json"
    result = run("verify", a, a, "--dim", "batch=3", "--dim", "sequence=5", "--report", report)
    assert result.exit_code == 0, result.output
    assert _shapes(report) == {"input_ids": [3, 5], "attention_mask": [3, 5]}
    assert "dims batch=3, sequence=5" in result.output


def test_unknown_dim_is_exit_2_naming_the_graphs_dims(tmp_path):
    a = _masked_model(tmp_path / "a.onnx")
    report = tmp_path / "r.json"
    result = run("verify", a, a, "--dim", "seq=8", "--report", report)
    assert result.exit_code == 2
    assert result.output.startswith("error: --dim seq:")
    assert "its named dimensions are batch, sequence" in result.output
    assert not report.exists()


@pytest.mark.parametrize("args,message", [
    (["--input", "input_ids=2x8", "--dim", "batch=3"],
     "--input input_ids=2x8 sets dimension 'batch' to 2, but --dim batch=3 sets it to 3"),
    (["--input", "input_ids=2x8", "--input", "attention_mask=2x9"],
     "--input attention_mask=2x9 sets dimension 'sequence' to 9, but --input input_ids=2x8 sets it to 8"),
    (["--dim", "batch=2", "--dim", "batch=3"], "--dim batch is given twice with different sizes"),
    (["--input", "input_ids=2x8", "--input", "input_ids=2x9"], "--input input_ids is given twice"),
])
def test_conflicting_sizes_are_exit_2(tmp_path, args, message):
    a = _masked_model(tmp_path / "a.onnx")
    report = tmp_path / "r.json"
    result = run("verify", a, a, *args, "--report", report)
    assert result.exit_code == 2
    assert result.output.startswith(f"error: {message}")
    assert not report.exists()


@pytest.mark.parametrize("option,value", [
    ("--input", "input_ids=-1x8"), ("--input", "input_ids=0x8"), ("--input", "input_ids=2x"),
    ("--input", "input_ids=2by8"), ("--input", "input_ids=1_0x8"), ("--input", f"input_ids={2**31}x8"),
    ("--dim", "batch=abc"), ("--dim", "batch=-1"), ("--dim", "batch=0"), ("--dim", "batch="),
    ("--dim", f"batch={2**31}"),
])
def test_bad_sizes_are_usage_errors_naming_the_option(tmp_path, option, value):
    a = _masked_model(tmp_path / "a.onnx")
    report = tmp_path / "r.json"
    result = run("verify", a, a, option, value, "--report", report)
    assert result.exit_code == 2
    assert result.output.startswith(f"error: {option} {value!r}: ")
    assert "is not a size" in result.output and "from 1 to 2147483647" in result.output
    assert not report.exists()


@pytest.mark.parametrize("option,value", [("--input", "input_ids"), ("--input", "=2x8"), ("--dim", "=2"),
                                          ("--dim", "batch")])
def test_option_without_name_or_equals_is_a_usage_error(tmp_path, option, value):
    a = _masked_model(tmp_path / "a.onnx")
    result = run("verify", a, a, option, value)
    assert result.exit_code == 2
    assert result.output.startswith(f"error: {option} {value!r}: no NAME=; write NAME=")


def test_largest_size_parses_but_a_huge_random_input_is_refused(tmp_path):
    a = _masked_model(tmp_path / "a.onnx")
    result = run("verify", a, a, "--dim", f"batch={2**31 - 1}")
    assert result.exit_code == 2
    assert result.output.startswith("error: input input_ids of shape [2147483647, 16] would hold")


def test_input_shape_must_fit_the_graphs_rank_and_fixed_axes(tmp_path):
    a = _linear_model(tmp_path / "a.onnx", np.eye(4, 3, dtype=np.float32), dynamic=True)
    result = run("verify", a, a, "--input", "x=5x3")
    assert result.exit_code == 2 and "axis 1 of x is fixed at 4" in result.output
    result = run("verify", a, a, "--input", "x=5x4x1")
    assert result.exit_code == 2 and "input x has 2 dimensions, not 3" in result.output
    result = run("verify", a, a, "--input", "z=5x4")
    assert result.exit_code == 2 and "has no input named 'z'; its inputs are x" in result.output


def test_empty_input_shape_still_means_a_scalar(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "s"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"]),
         helper.make_tensor_value_info("s", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    a = tmp_path / "a.onnx"
    onnx.save(model, str(a))
    report = tmp_path / "r.json"
    result = run("verify", a, a, "--input", "s=", "--report", report)
    assert result.exit_code == 0, result.output
    assert _shapes(report) == {"x": [2], "s": []}
    result = run("verify", a, a, "--input", "x=")
    assert result.exit_code == 2 and "input x has 1 dimension, not 0" in result.output


def test_a_fixed_axis_of_the_other_model_sizes_the_named_dim(tmp_path):
    a = _masked_model(tmp_path / "a.onnx")
    b = _masked_model(tmp_path / "b.onnx", ids=("batch", 128), mask=("batch", 128))
    report = tmp_path / "r.json"
    result = run("verify", a, b, "--report", report)
    assert result.exit_code == 0, result.output
    assert _shapes(report) == {"input_ids": [2, 128], "attention_mask": [2, 128]}
    assert json.loads(report.read_text())["dims"] == {"batch": 2, "sequence": 128}


def test_arrays_from_the_inputs_file_size_the_random_ones(tmp_path):
    a = _masked_model(tmp_path / "a.onnx")
    inputs = tmp_path / "in.npz"
    np.savez(inputs, input_ids=np.ones((3, 5), np.int64))
    report = tmp_path / "r.json"
    result = run("verify", a, a, "--inputs", inputs, "--report", report)
    assert result.exit_code == 0, result.output
    assert _shapes(report) == {"input_ids": [3, 5], "attention_mask": [3, 5]}
    assert "input_ids int64[3, 5] from file, attention_mask int64[3, 5]" in result.output
    result = run("verify", a, a, "--inputs", inputs, "--dim", "batch=2")
    assert result.exit_code == 2
    assert "--inputs array input_ids sets dimension 'batch' to 3, but --dim batch=2 sets it to 2" in result.output


@pytest.mark.parametrize("graph_first", [True, False])
def test_a_graph_against_a_checkpoint_is_exit_2_suggesting_export(tmp_path, graph_first):
    a = _masked_model(tmp_path / "a.onnx")
    ckpt = FIXTURES / "tiny-llama-gqa"
    result = run("verify", *((a, ckpt) if graph_first else (ckpt, a)))
    assert result.exit_code == 2
    assert result.output.startswith(f"error: {a} is an ONNX graph but {ckpt} is a checkpoint")
    assert "compares a graph with a graph (two .onnx files) or a checkpoint with a checkpoint" in result.output
    assert f"fusectl export {ckpt} --graph {a} -o OUT.onnx" in result.output
    assert "unsupported checkpoint format" not in result.output


@pytest.mark.parametrize("option,value", [("--input", "x=2x4"), ("--dim", "batch=2"), ("--inputs", "in.npz")])
def test_model_input_options_with_checkpoints_are_exit_2(tmp_path, option, value):
    src = FIXTURES / "tied-embeddings.safetensors"
    result = run("verify", src, src, option, value)
    assert result.exit_code == 2
    assert result.output.startswith(f"error: {option} applies to two .onnx models")


def test_verify_probes_an_empty_tensor(tmp_path):
    """A reshape of an empty F32[0, 4] to [4, 0]: the probe's readout spells its width out, as
    ONNX cannot infer -1 beside a zero."""
    from safetensors.numpy import save_file

    save_file({"w": np.zeros((0, 4), np.float32), "x": np.ones((3, 4), np.float32)}, str(tmp_path / "m.safetensors"))
    (tmp_path / "r.toml").write_text('version = 1\n[[rule]]\nop = "reshape"\ninput = "w"\noutput = "r"\nshape = [4, 0]\n')
    fused = tmp_path / "f.safetensors"
    result = run("fuse", tmp_path / "m.safetensors", "-r", tmp_path / "r.toml", "-o", fused)
    assert result.exit_code == 0, result.output
    result = run("verify", tmp_path / "m.safetensors", fused)
    assert result.exit_code == 0, result.output
    assert "PASS probe" in result.output
