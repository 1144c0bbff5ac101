"""Graphs below opset 13 are converted before export (fusectl/onnx/opset.py): a small opset-12
graph built with onnx.helper whose ops changed at 13 (Softmax over a non-last axis, Split,
Squeeze/Unsqueeze, ReduceSum with attributes), TorchScript's opset-12 ALBERT against PyTorch's
output, external data, and graphs the converter refuses."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from conftest import FIXTURES, ok, refused, snapshot, write_rules, write_safetensors

ALBERT = FIXTURES / "onnx-export" / "albert"
rng = np.random.default_rng(12)

QKV = """version = 1
[[rule]]
op     = "concat"
inputs = ["a.q.weight", "a.k.weight", "a.v.weight"]
output = "a.qkv.weight"
"""


def run(path, **feeds) -> list[np.ndarray]:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def opset12_graph(path, weights: dict[str, np.ndarray], **save) -> None:
    """Three projections of x (TorchScript's transposed initializers), then ops whose form
    changed at opset 13: Softmax over axis 1 of a rank-3 tensor (opset 12 flattens from the
    axis on), Split with a ``split`` attribute, Squeeze/Unsqueeze and ReduceSum with ``axes``."""
    nodes = [helper.make_node("MatMul", ["x", f"onnx::MatMul_{n}"], [n]) for n in "qkv"]
    nodes += [
        helper.make_node("Mul", ["q", "k"], ["qk"]),
        helper.make_node("Softmax", ["qk"], ["p"], axis=1),
        helper.make_node("Mul", ["p", "v"], ["pv"]),
        helper.make_node("Split", ["pv"], ["s0", "s1"], axis=2, split=[1, 3]),
        helper.make_node("Squeeze", ["s0"], ["s0q"], axes=[2]),
        helper.make_node("Unsqueeze", ["s0q"], ["s0u"], axes=[2]),
        helper.make_node("ReduceSum", ["s1"], ["r"], axes=[2], keepdims=1),
        helper.make_node("Concat", ["s0u", "r"], ["y"], axis=2),
    ]
    inits = [numpy_helper.from_array(weights[f"a.{n}.weight"].T.copy(), f"onnx::MatMul_{n}") for n in "qkv"]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 2])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    model.ir_version = 7
    onnx.checker.check_model(model)
    onnx.save(model, str(path), **save)


def fused_qkv(cli, tmp_path):
    weights = {f"a.{n}.weight": rng.standard_normal((4, 4)).astype(np.float32) for n in "qkv"}
    ckpt = write_safetensors(tmp_path / "m.safetensors", weights)
    fused = tmp_path / "fused.safetensors"
    ok(cli("fuse", ckpt, "-r", write_rules(tmp_path / "r.toml", QKV), "-o", fused, "--quiet"))
    return weights, fused


def test_an_opset_12_graph_is_converted_fused_and_computes_what_it_did(cli, tmp_path):
    weights, fused = fused_qkv(cli, tmp_path)
    (tmp_path / "g").mkdir()
    graph = tmp_path / "g" / "old.onnx"
    opset12_graph(graph, weights)
    before = snapshot(tmp_path / "g")
    out = tmp_path / "out.onnx"
    report = ok(cli("export", fused, "--graph", graph, "-o", out, "--json")).json()
    assert report["converted_from_opset"] == 12 and report["fused_matmuls"] == 1 and report["unused"] == []
    assert snapshot(tmp_path / "g") == before  # the graph is converted in memory, never on disk
    model = onnx.load(str(out))
    assert {o.version for o in model.opset_import if o.domain in ("", "ai.onnx")} == {13}
    assert [i.name for i in model.graph.initializer if i.name.startswith("a.")] == ["a.qkv.weight"]
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    np.testing.assert_allclose(run(out, x=x)[0], run(graph, x=x)[0], rtol=1e-6, atol=1e-6)
    text = ok(cli("export", fused, "--graph", graph, "-o", out, "--force")).stdout
    assert "converted the graph from opset 12 to 13 with onnx.version_converter first" in text


def test_a_graph_at_opset_13_or_newer_is_not_converted(cli, tmp_path):
    out = tmp_path / "out.onnx"
    report = ok(cli("export", ALBERT, "--graph", ALBERT / "model.onnx", "-o", out, "--json")).json()
    assert report["converted_from_opset"] is None
    assert "converted" not in ok(cli("export", ALBERT, "--graph", ALBERT / "model.onnx", "-o", out, "--force")).stdout


def test_the_opset_12_torchscript_albert_exports_fused_and_computes_what_pytorch_did(cli, tmp_path):
    fused = tmp_path / "fused"
    ok(cli("fuse", ALBERT, "-r", ALBERT / "qkv.toml", "-o", fused, "--quiet"))
    out = tmp_path / "out.onnx"
    report = ok(cli("export", fused, "--graph", ALBERT / "model_opset12.onnx", "-o", out, "--json")).json()
    assert report["converted_from_opset"] == 12 and report["fused_matmuls"] == 3 and report["not_fused"] == []
    io = np.load(ALBERT / "io.npz")
    got = run(out, input_ids=io["input_ids"], attention_mask=io["attention_mask"])[0]
    np.testing.assert_allclose(got, io["last_hidden_state"], rtol=1e-5, atol=1e-5)
    ok(cli("verify", ALBERT / "model_opset12.onnx", out, "--inputs", ALBERT / "io.npz"))


def test_an_opset_12_graph_with_external_data_keeps_its_weights(cli, tmp_path):
    """The converter gets the graph without its initializers; they are put back afterwards, read
    from OLD.onnx.data beside the graph."""
    weights, fused = fused_qkv(cli, tmp_path)
    (tmp_path / "g").mkdir()
    graph = tmp_path / "g" / "old.onnx"
    opset12_graph(graph, weights, save_as_external_data=True, all_tensors_to_one_file=True,
                  location="old.onnx.data", size_threshold=0)
    assert (tmp_path / "g" / "old.onnx.data").stat().st_size == 3 * 4 * 4 * 4
    out = tmp_path / "out.onnx"
    assert ok(cli("export", fused, "--graph", graph, "-o", out, "--json")).json()["converted_from_opset"] == 12
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    np.testing.assert_allclose(run(out, x=x)[0], run(graph, x=x)[0], rtol=1e-6, atol=1e-6)


def old_graph(path, op: str, opset_imports) -> None:
    graph = helper.make_graph([helper.make_node(op, ["x", "onnx::MatMul_1"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                              [numpy_helper.from_array(np.ones((4, 3), np.float32), "onnx::MatMul_1")])
    model = helper.make_model(graph, opset_imports=opset_imports)
    model.ir_version = 7
    onnx.save(model, str(path))


def test_a_graph_the_converter_refuses_is_an_error_saying_what_to_do(cli, tmp_path):
    ckpt = write_safetensors(tmp_path / "m.safetensors", {"lin.weight": np.ones((3, 4), np.float32)})
    graph = tmp_path / "old.onnx"
    old_graph(graph, "NoSuchOp", [helper.make_opsetid("", 12)])
    out = tmp_path / "out.onnx"
    refused(cli("export", ckpt, "--graph", graph, "-o", out),
            f"{graph}: opset 12; onnx.version_converter could not convert it to opset 13 (",
            "export the graph at opset 13 or newer", unwritten=[out])


def test_a_graph_without_the_default_opset_is_refused(cli, tmp_path):
    ckpt = write_safetensors(tmp_path / "m.safetensors", {"lin.weight": np.ones((3, 4), np.float32)})
    graph = tmp_path / "custom.onnx"
    old_graph(graph, "MatMul", [helper.make_opsetid("com.example", 1)])
    out = tmp_path / "out.onnx"
    refused(cli("export", ckpt, "--graph", graph, "-o", out),
            f"{graph} imports no version of the default ONNX opset; export needs opset 13 or newer", unwritten=[out])
