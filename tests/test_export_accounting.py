"""Every checkpoint tensor reaches the exported graph, or the export is refused
(fusectl/onnx/accounting.py): on BeatNet's LSTM in miniature as TorchScript exports it
(fixtures/onnx-export/lstm-tuned/), fine-tuned and not, against PyTorch's outputs; and on tiny
graphs built with onnx.helper for a tensor the graph does not use, an integer one, one only dead
code reads."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import FIXTURES, leftovers, ok, refused, snapshot, write_rules, write_safetensors
from fusectl.dtypes import from_safetensors
from fusectl.onnx.accounting import could_hold, plan_origins
from fusectl.onnx.export import ExportReport
from fusectl.onnx.graph_tensors import GraphTensor
from fusectl.tensors import TensorSpec

LSTM = FIXTURES / "onnx-export" / "lstm-tuned"
rng = np.random.default_rng(28)


def run(path, io) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": io["x"]})[0]


def fused_lstm(cli, tmp_path, stem: str):
    out = tmp_path / f"{stem}-fused.safetensors"
    ok(cli("fuse", LSTM / f"{stem}.pt", "-r", "lstm-to-onnx", "-o", out, "--quiet"))
    return out


# ------------------------------------------------------------------- BeatNet's LSTM (issue 28)


def test_a_fine_tuned_lstm_onto_the_untuned_graph_is_refused_naming_both(cli, tmp_path):
    """The fused tuned LSTM has W/R/B of the shapes the graph's onnx::LSTM_* have but other data:
    exporting kept the graph's own W/R/B (exit 0, 0.038 from PyTorch's tuned output)."""
    ckpt = fused_lstm(cli, tmp_path, "tuned")
    out = tmp_path / "out.onnx"
    before = snapshot(tmp_path)
    refused(cli("export", ckpt, "--graph", LSTM / "model.onnx", "-o", out),
            "6 tensor(s) of ", "have no copy in the graph (by name, content or transposed content): "
            "'lstm.B_l0' float32[1, 32] (made from 'lstm.bias_hh_l0', 'lstm.bias_ih_l0'), ",
            "'lstm.W_l1' float32[1, 16, 4] (made from 'lstm.weight_ih_l1')",
            "the graph would keep 6 float tensor(s) of its own whose size fits them",
            "initializer 'onnx::LSTM_", "the W of LSTM '/lstm/LSTM'", "the B of LSTM '/lstm/LSTM_1'",
            f"export {LSTM / 'model.onnx'} from the model {ckpt} comes from", unwritten=[out])
    assert snapshot(tmp_path) == before and not leftovers(tmp_path)


def test_a_fine_tuned_lstm_in_pytorch_layout_is_refused_saying_which_preset_packs_it(cli, tmp_path):
    out = tmp_path / "out.onnx"
    refused(cli("export", LSTM / "tuned.pt", "--graph", LSTM / "model.onnx", "-o", out),
            "8 tensor(s) of ", "'lstm.weight_hh_l0' float32[16, 4]", "initializer 'onnx::LSTM_",
            "the R of LSTM '/lstm/LSTM'", "fuse the checkpoint into that layout first (-r lstm-to-onnx)",
            unwritten=[out])


def test_the_untuned_lstm_in_pytorch_layout_is_refused_too(cli, tmp_path):
    """Its data equal the graph's, but the graph holds them packed: nothing pairs, and the
    output would hold none of the checkpoint's LSTM tensors."""
    out = tmp_path / "out.onnx"
    refused(cli("export", LSTM / "model.pt", "--graph", LSTM / "model.onnx", "-o", out),
            "'lstm.weight_ih_l0' float32[16, 5]", "(-r lstm-to-onnx)", unwritten=[out])


@pytest.mark.parametrize("stem", ["model", "tuned"])
def test_an_lstm_fused_onto_the_graph_of_its_own_model_computes_what_pytorch_did(cli, tmp_path, stem):
    ckpt = fused_lstm(cli, tmp_path, stem)
    out = tmp_path / "out.onnx"
    report = ok(cli("export", ckpt, "--graph", LSTM / f"{stem}.onnx", "-o", out, "--json")).json()
    assert report["unused"] == [] and not [k for k in report["kept_constants"] if k["name"].startswith("onnx::LSTM")]
    names = {i.name for i in onnx.load(str(out)).graph.initializer}
    assert {f"lstm.{k}_l{n}" for k in "WRB" for n in (0, 1)} <= names
    io = np.load(LSTM / ("io.npz" if stem == "model" else "tuned.io.npz"))
    np.testing.assert_allclose(run(out, io), io["y"], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------- tensors the graph does not use


def linear_graph(path, weight: np.ndarray, dead: np.ndarray | None = None):
    """``y = x @ W.T`` as TorchScript writes a Linear without bias (an anonymous transposed
    initializer); with ``dead``, an initializer ``d`` that only an unused Mul reads."""
    nodes = [helper.make_node("MatMul", ["x", "onnx::MatMul_1"], ["y"])]
    inits = [numpy_helper.from_array(weight.T.copy(), "onnx::MatMul_1")]
    if dead is not None:
        nodes.append(helper.make_node("Mul", ["x", "d"], ["unused"]))
        inits.append(numpy_helper.from_array(dead, "d"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], inits)
    # IR 8: the oldest onnxruntime fusectl supports (1.18) loads up to IR 10, and onnx writes its newest
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def test_a_float_tensor_the_graph_does_not_compute_with_is_refused_until_dropped(cli, tmp_path):
    weight = rng.standard_normal((3, 4)).astype(np.float32)
    ckpt = write_safetensors(tmp_path / "m.safetensors", {
        "lin.weight": weight, "head.weight": rng.standard_normal((5, 3)).astype(np.float32)})
    graph = linear_graph(tmp_path / "g.onnx", weight)
    out = tmp_path / "out.onnx"
    refused(cli("export", ckpt, "--graph", graph, "-o", out),
            "1 tensor(s) of ", "have no copy in the graph (by name, content or transposed content): "
            "'head.weight' float32[5, 3]. To fix:", 'leave it out of the checkpoint with a rule of op "drop"',
            unwritten=[out])
    rules = write_rules(tmp_path / "drop.toml", 'version = 1\n[[rule]]\nop = "drop"\ninput = "head.weight"\n')
    dropped = tmp_path / "dropped.safetensors"
    ok(cli("fuse", ckpt, "-r", rules, "-o", dropped, "--quiet"))
    assert ok(cli("export", dropped, "--graph", graph, "-o", out, "--json")).json()["unused"] == []
    x = rng.standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_allclose(run(out, {"x": x}), x @ weight.T, rtol=1e-6)


def test_integer_tensors_the_graph_does_not_read_are_listed_as_unused(cli, tmp_path):
    weight = rng.standard_normal((3, 4)).astype(np.float32)
    ckpt = write_safetensors(tmp_path / "m.safetensors", {
        "lin.weight": weight, "bn.num_batches_tracked": np.array(7, np.int64)})
    out = tmp_path / "out.onnx"
    result = ok(cli("export", ckpt, "--graph", linear_graph(tmp_path / "g.onnx", weight), "-o", out))
    assert "left out 1 integer tensor(s) of the checkpoint that the graph does not read (bn.num_batches_tracked)" \
        in result.stdout
    report = ok(cli("export", ckpt, "--graph", tmp_path / "g.onnx", "-o", out, "--json", "--force")).json()
    assert report["unused"] == [{"name": "bn.num_batches_tracked", "dtype": "int64", "shape": [], "why": "integer"}]


def test_a_tensor_only_dead_code_reads_is_refused_once_the_rewrite_is_done(cli, tmp_path):
    """``d`` pairs by name, but only a node whose output nothing uses reads it: the rewrite
    removes that node, and the output would not hold the checkpoint's ``d``."""
    weight = rng.standard_normal((3, 4)).astype(np.float32)
    dead = rng.standard_normal((2, 4)).astype(np.float32)
    ckpt = write_safetensors(tmp_path / "m.safetensors", {"lin.weight": weight, "d": dead})
    out = tmp_path / "out.onnx"
    refused(cli("export", ckpt, "--graph", linear_graph(tmp_path / "g.onnx", weight, dead), "-o", out),
            "1 tensor(s) of ", "would be left out of the rewritten graph: 'd' float32[2, 4]. To fix:", unwritten=[out])


# ------------------------------------------------------------------------------------- units


def graph_tensor(key: str, dtype: str, shape: tuple[int, ...]) -> GraphTensor:
    return GraphTensor(key, None, None, "initializer", "main graph", dtype, shape, lambda: None)


def test_could_hold_is_every_float_tensor_whose_size_is_a_sum_of_the_left_out_sizes():
    f32 = from_safetensors("F32", "test")
    specs = [TensorSpec(f32, (4,)), TensorSpec(f32, (2, 3))]
    tensors = [graph_tensor(k, d, s) for k, d, s in (
        ("a", "float32", (1, 4)), ("b", "float16", (3, 2)), ("c", "float32", (10,)), ("d", "float32", (5,)),
        ("e", "int64", (4,)), ("f", "float32", (2, 2, 3)), ("g", "float32", ()))]
    assert [t.key for t in could_hold(specs, tensors)] == ["a", "b", "c"]
    assert could_hold(specs, [t for t in tensors if t.key == "e"]) == []


def test_plan_origins_follow_renames_and_joins(cli, tmp_path):
    from fusectl.io.checkpoint import open_checkpoint

    ckpt = write_safetensors(tmp_path / "m.safetensors", {
        f"a.{n}.weight": np.ones((2, 2), np.float32) * k for k, n in enumerate("qkv")})
    rules = write_rules(tmp_path / "r.toml", """version = 1
[[rule]]
op = "concat"
inputs = ["a.q.weight", "a.k.weight", "a.v.weight"]
output = "a.qkv"
[[rule]]
op = "rename"
input = "a.qkv"
output = "a.qkv.weight"
""")
    ok(cli("fuse", ckpt, "-r", rules, "-o", tmp_path / "f.safetensors", "--quiet"))
    origins = plan_origins(open_checkpoint(str(tmp_path / "f.safetensors")).provenance.plan)
    assert origins["a.qkv.weight"] == {"a.q.weight", "a.k.weight", "a.v.weight"}


def test_the_report_lists_unused_integer_tensors_in_text_and_json():
    unused = [{"name": f"bn{k}.num_batches_tracked", "dtype": "int64", "shape": [], "why": "integer"} for k in range(7)]
    report = ExportReport("o.onnx", 3, 0, 0, 3, False, unused=unused)
    assert json.loads(json.dumps(report.to_json()))["unused"] == unused
    assert report.to_text().endswith("left out 7 integer tensor(s) of the checkpoint that the graph does not read "
                                     "(bn0.num_batches_tracked, bn1.num_batches_tracked, bn2.num_batches_tracked, "
                                     "bn3.num_batches_tracked, bn4.num_batches_tracked, …)")
