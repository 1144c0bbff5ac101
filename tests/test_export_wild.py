"""export onto graphs as exporters write them in the wild (fixtures/onnx-wild/, from torch's
TorchScript exporter): weights held as Constant nodes inside If branches, initializers kept as
graph inputs, Linear and Conv1D heads exported as Gemm; and the output's name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import FIXTURES, leftovers, ok, refused, write_safetensors

WILD = FIXTURES / "onnx-wild"
FROZEN, KEEP, HEADS = WILD / "frozen-if", WILD / "keep-inputs", WILD / "gemm-heads"
ROOT = Path(__file__).resolve().parent.parent


def session(path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3  # the keep-inputs graphs warn that their initializers are inputs
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def assert_computes_torch_outputs(model, io_file) -> None:
    """onnxruntime on ``model`` gives the outputs torch's eager module gave (stored by the generator)."""
    io = dict(np.load(io_file))
    sess = session(model)
    got = sess.run(None, {i.name: io[i.name] for i in sess.get_inputs()})
    for out, value in zip(sess.get_outputs(), got):
        np.testing.assert_allclose(value, io[out.name], rtol=1e-5, atol=1e-6, err_msg=out.name)


def all_nodes(graph):
    """(graph, node) for every node of ``graph`` and its subgraphs."""
    for node in graph.node:
        yield graph, node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from all_nodes(attr.g)


def float_constants(path) -> list[str]:
    model = onnx.load(str(path))
    return [n.output[0] for _, n in all_nodes(model.graph) if n.op_type == "Constant"
            and any(a.name == "value" and a.t.data_type == TensorProto.FLOAT for a in n.attribute)]


def export(cli, ckpt, graph, out, *extra):
    return cli("export", ckpt, "--graph", graph, "-o", out, *extra)


# -------------------------------------------------- item 2: weights as Constants in If branches


def test_constant_weights_inside_if_branches_are_rebound_to_the_checkpoint(cli, tmp_path):
    out = tmp_path / "out.onnx"
    report = ok(export(cli, FROZEN / "model.pt", FROZEN / "model.onnx", out, "--json")).json()
    assert float_constants(FROZEN / "model.onnx")  # the frozen export holds its weights as Constants
    assert report["rebound"] == 10 and float_constants(out) == []
    names = {i.name for i in onnx.load(str(out)).graph.initializer}
    assert names == {f"{m}.{t}" for m in ("q", "k", "v", "alt", "out") for t in ("weight", "bias")}
    # the one tensor the graph keeps is the sample rate it branches on, and the report says so
    assert report["kept_constants"] == [{"name": "/Constant_5_output_0", "where": "main graph", "kind": "Constant",
                                         "dtype": "int64", "shape": [], "why": "integer"}]
    assert_computes_torch_outputs(out, FROZEN / "io.npz")
    assert_computes_torch_outputs(out, FROZEN / "io_8k.npz")


def test_a_retrained_checkpoint_onto_a_graph_of_constant_weights_is_refused_naming_them(cli, tmp_path):
    """silero-vad's case: the checkpoint's weights differ from those the graph ships as Constants;
    exporting must not keep the shipped ones."""
    out = tmp_path / "out.onnx"
    refused(export(cli, FROZEN / "retrained.pt", FROZEN / "model.onnx", out),
            "computes with none of the tensors of", "'out.bias' float32[4], 'out.weight' float32[4, 8]",
            "the graph would keep 10 float tensor(s) of its own whose size fits them",
            "Constant '/Constant_10_output_0' float32[4] (main graph)",
            "Constant '/Constant_6_output_0' float32[8] (If '/If' then_branch)", unwritten=[out])
    assert not leftovers(tmp_path)


def test_the_refusal_lists_names_in_the_same_order_whatever_the_hash_seed(tmp_path):
    def stderr(seed: str) -> str:
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-m", "fusectl", "export", str(FROZEN / "retrained.pt"), "--graph",
                               str(FROZEN / "model.onnx"), "-o", str(tmp_path / "out.onnx")],
                              capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
        assert done.returncode == 2, done.stderr
        return done.stderr

    assert stderr("1") == stderr("2") == stderr("3")


def test_fused_qkv_heads_inside_an_if_branch_become_one_gemm_there(cli, tmp_path):
    fused = tmp_path / "fused.safetensors"
    ok(cli("fuse", FROZEN / "model.pt", "-r", FROZEN / "qkv.toml", "-o", fused, "--quiet"))
    out = tmp_path / "out.onnx"
    report = ok(export(cli, fused, FROZEN / "model.onnx", out, "--json")).json()
    assert report["fused_matmuls"] == 1 and report["not_fused"] == []
    model = onnx.load(str(out))
    branch = next(n for n in model.graph.node if n.op_type == "If").attribute
    then = next(a.g for a in branch if a.name == "then_branch")
    assert [n.op_type for n in then.node].count("Gemm") == 1 and "Split" in [n.op_type for n in then.node]
    assert {"qkv.weight", "qkv.bias"} <= {i.name for i in model.graph.initializer}
    assert float_constants(out) == []
    assert_computes_torch_outputs(out, FROZEN / "io.npz")
    assert_computes_torch_outputs(out, FROZEN / "io_8k.npz")


def test_map_pairs_constant_weights_by_content(cli):
    doc = ok(cli("map", FROZEN / "model.pt", FROZEN / "model.onnx", "--json")).json()
    pairs = {p["structural"]: (p["initializer"], p["how"]) for p in doc["pairs"]}
    assert pairs["q.bias"] == ("/Constant_6_output_0", "content")  # inside the then branch
    assert len(pairs) == 10 and doc["unmatched_checkpoint"] == [] and doc["unmatched_graph"] == []


def if_graph(path, then_weight: np.ndarray) -> Path:
    """``y = If(c) then x @ W (W an initializer of the then branch) else x``, by onnx.helper:
    no torch exporter writes subgraph initializers, other converters do."""
    then = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 3])],
                             [numpy_helper.from_array(then_weight, "W")])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2, 3])])
    graph = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                               helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    # IR 8 given: make_model writes the installed onnx's newest IR, which an older onnxruntime refuses
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def test_an_initializer_of_an_if_branch_is_rebound_or_refused(cli, tmp_path):
    weight = np.arange(9, dtype=np.float32).reshape(3, 3) / 10
    ckpt = write_safetensors(tmp_path / "lin.safetensors", {"lin.weight": weight.T.copy()})
    out = tmp_path / "out.onnx"
    ok(export(cli, ckpt, if_graph(tmp_path / "g.onnx", weight), out))
    model = onnx.load(str(out))
    then = next(a.g for a in model.graph.node[-1].attribute if a.name == "then_branch")
    assert [i.name for i in model.graph.initializer] == ["lin.weight"] and not then.initializer
    x = np.ones((2, 3), np.float32)
    np.testing.assert_allclose(session(out).run(None, {"x": x, "c": np.array(True)})[0], x @ weight, rtol=1e-6)
    stale = if_graph(tmp_path / "stale.onnx", weight + 1)
    refused(export(cli, ckpt, stale, tmp_path / "stale_out.onnx"),
            "'lin.weight' float32[3, 3]", "initializer 'W' float32[3, 3] (If '' then_branch)",
            unwritten=[tmp_path / "stale_out.onnx"])


def test_a_graph_that_computes_with_none_of_the_checkpoint_is_refused(cli, tmp_path):
    out = tmp_path / "out.onnx"
    refused(export(cli, KEEP / "lin.pt", FROZEN / "model.onnx", out),
            "computes with none of the tensors of", unwritten=[out])


def test_a_rotary_table_is_reported_as_the_graphs_own(cli, tmp_path):
    onnx_dir = FIXTURES / "onnx" / "llama"
    report = ok(export(cli, onnx_dir, onnx_dir / "model.onnx", tmp_path / "out.onnx", "--json")).json()
    kept = {k["name"]: k for k in report["kept_constants"]}
    assert kept["unsqueeze_14"]["why"] == "graph-own" and kept["unsqueeze_14"]["kind"] == "initializer"
    assert [k["name"] for k in report["kept_constants"]] == sorted(kept)


# ------------------------------------------------------ item 8: keep_initializers_as_inputs=True


@pytest.mark.parametrize("name", ["lin", "encoder"])
def test_a_graph_with_initializers_as_inputs_exports(cli, tmp_path, name):
    graph = KEEP / f"{name}.onnx"
    assert {i.name for i in onnx.load(str(graph)).graph.initializer} <= {i.name for i in onnx.load(str(graph)).graph.input}
    out = tmp_path / "out.onnx"
    report = ok(export(cli, KEEP / f"{name}.pt", graph, out, "--json")).json()
    model = onnx.load(str(out))
    # the checkpoint's parameters replace them as initializers only: onnxruntime treats them as constants
    assert [i.name for i in model.graph.input] == ["x"]
    assert report["rebound"] == len(model.graph.initializer)
    assert_computes_torch_outputs(out, KEEP / f"{name}.io.npz")
    ok(cli("verify", graph, out, "--inputs", KEEP / f"{name}.io.npz"))


# ---------------------------------------------------------------- item 12: Gemm heads fuse


@pytest.mark.parametrize("stem, trans_b", [("model", 1), ("conv1d", 0)])
def test_three_gemm_heads_on_one_input_become_one_gemm(cli, tmp_path, stem, trans_b):
    graph = HEADS / f"{stem}.onnx"
    rules = HEADS / ("heads.toml" if stem == "model" else "conv1d.toml")
    fused = tmp_path / "fused.safetensors"
    ok(cli("fuse", HEADS / f"{stem}.pt", "-r", rules, "-o", fused, "--quiet"))
    out = tmp_path / "out.onnx"
    report = ok(export(cli, fused, graph, out, "--json")).json()
    assert (report["fused_matmuls"], report["not_fused"]) == (1, [])
    gemms = [n for n in onnx.load(str(out)).graph.node if n.op_type == "Gemm"]
    assert [n.input[1:] for n in gemms] == [["trunk.weight", "trunk.bias"], ["heads.weight", "heads.bias"]]
    assert helper.get_attribute_value(next(a for a in gemms[1].attribute if a.name == "transB")) == trans_b
    assert_computes_torch_outputs(out, HEADS / ("io.npz" if stem == "model" else "conv1d.io.npz"))


def test_gemm_heads_that_cannot_fuse_are_reported(cli, tmp_path):
    model = onnx.load(str(HEADS / "model.onnx"))
    head = next(n for n in model.graph.node if n.op_type == "Gemm" and n.input[1] == "b.weight")
    next(a for a in head.attribute if a.name == "alpha").f = 2.0
    graph = tmp_path / "alpha.onnx"
    onnx.save(model, str(graph))
    fused = tmp_path / "fused.safetensors"
    ok(cli("fuse", HEADS / "model.pt", "-r", HEADS / "heads.toml", "-o", fused, "--quiet"))
    out = tmp_path / "out.onnx"
    report = ok(export(cli, fused, graph, out, "--json")).json()
    assert report["fused_matmuls"] == 0
    assert report["not_fused"] == [{"weight": "heads.weight", "consumers": ["/a/Gemm", "/b/Gemm", "/c/Gemm"],
                                    "why": "their Gemm attributes (alpha, beta, transA) differ: "
                                           "[(1.0, 1.0, 0), (2.0, 1.0, 0)]"}]
    text = ok(export(cli, fused, graph, tmp_path / "text.onnx")).stdout
    assert "not fused: /a/Gemm, /b/Gemm, /c/Gemm on parts of heads.weight: their Gemm attributes" in text
    x = np.random.default_rng(0).standard_normal((3, 6)).astype(np.float32)
    for got, want in zip(session(out).run(None, {"x": x}), session(graph).run(None, {"x": x})):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_export_help_says_what_is_fused(cli):
    text = " ".join(ok(cli("export", "--help")).stdout.split())
    assert "MatMul/Gemm consumers of a fused weight that share an input become one MatMul" not in text
    assert "Gemm consumers likewise become one Gemm and a Split when their alpha, beta and transA are equal" in text
    assert "kept_constants" in text and "not_fused" in text


# ------------------------------------------------------------ item 17: the output is an .onnx


@pytest.mark.parametrize("name, says", [("o4", "a name without the .onnx suffix"),
                                        ("fused.safetensors", "not .safetensors")])
def test_an_output_not_named_onnx_is_refused(cli, tmp_path, name, says):
    out = tmp_path / name
    refused(export(cli, KEEP / "lin.pt", KEEP / "lin.onnx", out),
            f"{out}: fusectl export writes an ONNX model, {says}; choose OUT.onnx", unwritten=[out])
    assert os.listdir(tmp_path) == []


def test_a_constant_named_like_a_checkpoint_tensor_with_other_data_is_refused(cli, tmp_path):
    weight = np.arange(9, dtype=np.float32).reshape(3, 3)
    ckpt = write_safetensors(tmp_path / "lin.safetensors", {"lin.weight": weight})
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["lin.weight"], value=numpy_helper.from_array(weight + 1)),
         helper.make_node("MatMul", ["x", "lin.weight"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    out = tmp_path / "out.onnx"
    refused(export(cli, ckpt, path, out), "graph Constant 'lin.weight' float32[3, 3] (main graph) has the name of "
            "checkpoint tensor 'lin.weight' but holds other data", unwritten=[out])
