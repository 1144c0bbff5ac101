"""The README's worked example from an MXNet export to a verified ONNX model, run as written on
the files MXNet 1.9.1 wrote (fixtures/mxnet/conv-bn/, by fixtures/generate_mxnet.py): a Conv +
BatchNorm net exported with ``HybridBlock.export`` (``-0000.params`` + ``-symbol.json``) and
converted by MXNet's own ONNX exporter (``mx.onnx.export_model``); folded with ``gluon-bn-fold``,
paired with the graph by ``map``, exported onto it and verified. Every graph is anchored to
MXNet's own output: MXNet's ONNX graph and the fused one, on onnxruntime with MXNet's input,
reproduce what MXNet computed. mx2onnx drops BatchNorm's fix_gamma (the scale=False net's graph
computes with the gamma MXNet ignores): verify catches it, and catches a fold of that gamma."""

from __future__ import annotations

import shlex
import shutil

import numpy as np
import pytest

from conftest import FIXTURES, ok, refused, snapshot, write_rules, write_safetensors

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

CONV_BN = FIXTURES / "mxnet" / "conv-bn"
TOLERANCE = 1e-5  # MXNet's output is float32

# the README's commands, run in a copy of fixtures/mxnet/conv-bn/
SCALE = [
    "fusectl map bn-scale-0000.params bn-scale.onnx",
    "fusectl fuse bn-scale-0000.params -r gluon-bn-fold -o folded.params",
    "fusectl export folded.params --graph bn-scale.onnx -o folded.onnx",
    "fusectl verify bn-scale.onnx folded.onnx",
]
NO_SCALE = [
    "fusectl fuse bn-noscale-0000.params -r gluon-bn-fold -o folded.params",
    "fusectl export folded.params --graph bn-noscale-gamma1.onnx -o folded.onnx",
    "fusectl verify bn-noscale-gamma1.onnx folded.onnx",
]
MX2ONNX_GAMMA = "fusectl verify bn-noscale.onnx folded.onnx"
STORED_GAMMA_RULES = """version = 1
[[rule]]
op            = "bn_fold"
weight        = "arg:convbn_conv0_weight"
bias          = "arg:convbn_conv0_bias"
gamma         = "arg:convbn_batchnorm0_gamma"
beta          = "arg:convbn_batchnorm0_beta"
mean          = "aux:convbn_batchnorm0_running_mean"
var           = "aux:convbn_batchnorm0_running_var"
output_weight = "arg:convbn_conv0_weight"
output_bias   = "arg:convbn_conv0_bias"
fix_gamma     = false
eps           = 2e-5
"""
STORED_GAMMA = [
    "fusectl convert bn-noscale-0000.params -o noscale.safetensors",
    "fusectl fuse noscale.safetensors -r stored-gamma.toml -o wrong.safetensors",
    "fusectl export wrong.safetensors --graph bn-noscale-gamma1.onnx -o wrong.onnx",
    "fusectl verify bn-noscale-gamma1.onnx wrong.onnx",
]


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A copy of fixtures/mxnet/conv-bn as the working folder (the README's commands are relative)."""
    folder = shutil.copytree(CONV_BN, tmp_path / "conv-bn")
    monkeypatch.chdir(folder)
    return folder


def run(cli, command: str):
    """One README command line (``fusectl ...``) through the CLI."""
    words = shlex.split(command)
    assert words[0] == "fusectl"
    return cli(*words[1:])


def mxnet_gap(graph, stem: str) -> float:
    """The max abs difference between ``graph`` on onnxruntime, fed MXNet's input, and MXNet's output."""
    io = np.load(CONV_BN / f"{stem}.io.npz")
    options = ort.SessionOptions()
    options.log_severity_level = 3  # mx2onnx lists the initializers as graph inputs: ORT warns
    session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"data": io["x"]})
    return float(np.max(np.abs(y.astype(np.float64) - io["y"])))


def initializers(graph) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(graph)).graph.initializer}


def test_mxnets_onnx_graphs_against_mxnets_output():
    """MXNet's exporter reproduces MXNet for scale=True; for scale=False it keeps the stored gamma
    that MXNet's fix_gamma ignores (the gamma1 graph, gamma set to ones before exporting, is right)."""
    assert mxnet_gap(CONV_BN / "bn-scale.onnx", "bn-scale") <= TOLERANCE
    assert mxnet_gap(CONV_BN / "bn-noscale-gamma1.onnx", "bn-noscale") <= TOLERANCE
    assert mxnet_gap(CONV_BN / "bn-noscale.onnx", "bn-noscale") > 0.1
    raw, gamma1 = initializers(CONV_BN / "bn-noscale.onnx"), initializers(CONV_BN / "bn-noscale-gamma1.onnx")
    assert sorted(raw) == sorted(gamma1)
    different = [n for n in raw if not np.array_equal(raw[n], gamma1[n])]
    assert different == ["convbn_batchnorm0_gamma"]
    assert not np.allclose(raw["convbn_batchnorm0_gamma"], 1) and np.all(gamma1["convbn_batchnorm0_gamma"] == 1)
    nodes = [n.op_type for n in onnx.load(str(CONV_BN / "bn-scale.onnx")).graph.node]
    assert nodes == ["Conv", "BatchNormalization"]


def test_map_pairs_the_exports_names_with_mx2onnxs_initializers_by_name(cli, work):
    """mx2onnx names the initializer of ``arg:convbn_conv0_weight`` ``convbn_conv0_weight``."""
    text = ok(run(cli, SCALE[0])).stdout
    assert "6 of 6 names paired; 0 graph initializer(s) unmatched" in text
    mapping = ok(run(cli, SCALE[0] + " --json")).json()
    pairs = {(p["structural"], p["initializer"], p["how"], p["data"]) for p in mapping["pairs"]}
    names = ["arg:convbn_conv0_weight", "arg:convbn_conv0_bias", "arg:convbn_batchnorm0_gamma",
             "arg:convbn_batchnorm0_beta", "aux:convbn_batchnorm0_running_mean", "aux:convbn_batchnorm0_running_var"]
    assert pairs == {(n, n[4:], "name", "equal") for n in names}
    assert mapping["unmatched_checkpoint"] == mapping["unmatched_graph"] == []


@pytest.mark.parametrize("commands, graph, stem", [(SCALE[1:], "bn-scale.onnx", "bn-scale"),
                                                   (NO_SCALE, "bn-noscale-gamma1.onnx", "bn-noscale")])
def test_worked_example_from_params_to_a_verified_onnx_model(cli, work, commands, graph, stem):
    inputs = {name: digest for name, digest in snapshot(work).items()}
    results = [ok(run(cli, command)) for command in commands]
    assert results[-1].stdout.splitlines()[-1] == "result: PASS — 1 passed, 0 failed"
    assert "1 folded step(s)" in results[1].stdout
    folded = onnx.load(str(work / "folded.onnx"))
    assert [n.op_type for n in folded.graph.node] == ["Conv"]  # the BatchNorm is in the Conv
    assert sorted(initializers(work / "folded.onnx")) == ["arg:convbn_conv0_bias", "arg:convbn_conv0_weight"]
    # anchored to MXNet: the fused graph computes MXNet's output
    assert mxnet_gap(work / "folded.onnx", stem) <= TOLERANCE
    after = snapshot(work)
    assert {name: after[name] for name in inputs} == inputs  # the inputs are untouched


def test_mx2onnxs_scale_false_graph_fails_verify(cli, work):
    """The fold MXNet computes against the graph mx2onnx wrote: exit 1 (mx2onnx kept the gamma)."""
    for command in NO_SCALE[:2]:
        ok(run(cli, command))
    result = run(cli, MX2ONNX_GAMMA)
    assert result.exit_code == 1, result.output
    assert "FAIL output convbn_batchnorm0_fwd" in result.stdout


def test_folding_the_ignored_gamma_fails_verify(cli, work):
    """The negative control: the scale=False net folded with its stored gamma (fix_gamma false,
    possible only once the symbol is left behind) exports, and verify fails; it is far off MXNet."""
    write_rules(work / "stored-gamma.toml", STORED_GAMMA_RULES)
    refused(run(cli, "fusectl fuse bn-noscale-0000.params -r stored-gamma.toml -o wrong.params"),
            "has fix_gamma true", unwritten=[work / "wrong.params"])
    for command in STORED_GAMMA[:-1]:
        ok(run(cli, command))
    result = run(cli, STORED_GAMMA[-1])
    assert result.exit_code == 1, result.output
    assert result.stdout.splitlines()[-1] == "result: FAIL — 0 passed, 1 failed"
    assert mxnet_gap(work / "wrong.onnx", "bn-noscale") > 0.1
    # what mx2onnx's own graph of that net computes
    ok(run(cli, "fusectl verify bn-noscale.onnx wrong.onnx"))


def test_the_name_as_it_is_pairs_before_the_name_without_arg(cli, tmp_path):
    """A graph holding both ``arg:w`` and ``w`` pairs ``arg:w`` with ``arg:w``; ``aux:`` is stripped
    like ``arg:``."""
    from onnx import TensorProto, helper, numpy_helper

    a, b, m = (np.full((2, 2), v, np.float32) for v in (1.0, 2.0, 3.0))
    ckpt = write_safetensors(tmp_path / "m.safetensors", {"arg:w": a, "aux:m": m})
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "arg:w"], ["t"]), helper.make_node("MatMul", ["t", "w"], ["u"]),
         helper.make_node("Add", ["u", "m"], ["y"])], "g", [x], [y],
        [numpy_helper.from_array(a, "arg:w"), numpy_helper.from_array(b, "w"), numpy_helper.from_array(m, "m")])
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    mapping = ok(cli("map", str(ckpt), str(path), "--json")).json()
    assert {(p["structural"], p["initializer"], p["how"]) for p in mapping["pairs"]} == {
        ("arg:w", "arg:w", "name"), ("aux:m", "m", "name")}
    assert mapping["unmatched_graph"] == ["w"]
