"""Recognising a BatchNorm the exporter already folded into a Conv (fusectl.onnx.exporter_folds),
on the dynamo graph of the convbn fixture edited by hand: a fold is recognised only with both
its folded weight and its folded bias as constants, a BatchNorm of another width is never
taken for it, and Convs that hold no checkpoint tensor are left alone."""

from __future__ import annotations

import os

import numpy as np
import onnx
import safetensors.numpy
from onnx import helper, numpy_helper

from conftest import FIXTURES, ok, write_rules

CONVBN = FIXTURES / "onnx" / "convbn"


def _dynamo() -> onnx.ModelProto:
    """The dynamo export of the convbn model: conv1.weight and conv2.weight/bias hold BatchNorm folds."""
    return onnx.load(str(CONVBN / "model_dynamo.onnx"))


def _conv1(model: onnx.ModelProto) -> onnx.NodeProto:
    (node,) = [n for n in model.graph.node if n.op_type == "Conv" and n.input[1] == "conv1.weight"]
    return node


def _export(cli, ckpt, model: onnx.ModelProto, tmp_path):
    graph = tmp_path / "graph.onnx"
    onnx.save(model, str(graph))
    out = tmp_path / "out.onnx"
    return graph, out, cli("export", ckpt, "--graph", graph, "-o", out, "--json")


def _refused_as_unexplained(result, out) -> None:
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: graph initializer 'conv1.weight' has the name of checkpoint tensor "
                                    "'conv1.weight' but holds other data (max abs difference")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output
    assert not os.path.lexists(out)


def test_a_folded_weight_without_a_bias_is_not_taken_for_a_fold(cli, tmp_path):
    model = _dynamo()
    del _conv1(model).input[2]  # the folded bias is gone: the weight alone cannot be matched
    _, out, result = _export(cli, CONVBN / "model.safetensors", model, tmp_path)
    _refused_as_unexplained(result, out)


def test_a_folded_weight_whose_bias_is_computed_is_not_taken_for_a_fold(cli, tmp_path):
    model = _dynamo()
    conv = _conv1(model)
    model.graph.node.insert(0, helper.make_node("Identity", [conv.input[2]], ["computed_bias"]))
    conv.input[2] = "computed_bias"  # no longer a constant the fold can be compared with
    _, out, result = _export(cli, CONVBN / "model.safetensors", model, tmp_path)
    _refused_as_unexplained(result, out)


def test_a_batchnorm_of_another_width_is_passed_over(cli, tmp_path):
    """``bn0`` (4 channels) sorts before bn1 and bn2 but fits neither Conv (8 output channels):
    the two folds take bn1 and bn2, and bn0, which the graph does not compute with, is what the
    export refuses to leave out; dropped from the checkpoint, the export goes through."""
    tensors = safetensors.numpy.load_file(str(CONVBN / "model.safetensors"))
    for part, value in (("weight", 2.0), ("bias", 0.5), ("running_mean", 0.1), ("running_var", 3.0)):
        tensors[f"bn0.{part}"] = np.full(4, value, np.float32)
    ckpt = tmp_path / "decoy.safetensors"
    safetensors.numpy.save_file(tensors, str(ckpt))
    graph, out, result = _export(cli, ckpt, _dynamo(), tmp_path)
    assert result.exit_code == 2 and not os.path.lexists(out)
    assert result.stderr.startswith("error: 4 tensor(s) of ") and "have no copy in the graph (by name, content or " \
        "transposed content): 'bn0.bias' float32[4], 'bn0.running_mean' float32[4], 'bn0.running_var' float32[4], " \
        "'bn0.weight' float32[4]. To fix:" in result.stderr
    rules = write_rules(tmp_path / "drop.toml", 'version = 1\n[[rule]]\nop = "drop"\ninput = "bn0.{p}"\n')
    dropped = tmp_path / "dropped.safetensors"
    ok(cli("fuse", ckpt, "-r", rules, "-o", dropped, "--quiet"))
    _, out, result = _export(cli, dropped, _dynamo(), tmp_path)
    assert ok(result).json()["folded"] == 2
    ok(cli("verify", graph, out, "--inputs", CONVBN / "io.npz"))


def test_a_conv_holding_no_checkpoint_tensor_is_left_alone(cli, tmp_path):
    """A 1x1 Conv appended with an anonymous weight: not a fold, not refused, kept as it is."""
    model = _dynamo()
    model.graph.node[-1].output[0] = "y0"
    extra = np.full((8, 8, 1, 1), 0.25, np.float32)
    model.graph.initializer.append(numpy_helper.from_array(extra, "onnx::Conv_99"))
    model.graph.node.append(helper.make_node("Conv", ["y0", "onnx::Conv_99"], ["y"], kernel_shape=[1, 1]))
    graph, out, result = _export(cli, CONVBN / "model.safetensors", model, tmp_path)
    assert ok(result).json()["folded"] == 2
    written = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer}
    np.testing.assert_array_equal(written["onnx::Conv_99"], extra)
    ok(cli("verify", graph, out, "--inputs", CONVBN / "io.npz"))
