"""The passes of ``fusectl export`` (fusectl/onnx/passes.py): their order and preconditions, what
each stage does to a real exporter's graph, and the graphs each pass must refuse, built as
inline ONNX text (onnx-ir's ``from_onnx_text``) over tiny checkpoints fused by the CLI."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx_ir.passes import InPlacePass, PassResult, PreconditionError, Sequential
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from conftest import leftovers, ok, write_rules, write_safetensors
from fusectl.io.checkpoint import open_checkpoint
from fusectl.onnx.export import ExportError, export_model, export_passes, run_passes
from fusectl.onnx.export_context import SET_ASIDE, ExportContext
from fusectl.onnx.graph import load_model
from fusectl.onnx.passes import (AccountForCheckpointPass, FoldReparametrizationsPass, FuseSharedMatMulPass,
                                 PairInitializersPass, RebindInitializersPass, RefuseLeftoverGraphWeightsPass)

ONNX = Path(__file__).resolve().parent.parent / "fixtures" / "onnx"
OPSET = '<ir_version: 8, opset_import: ["" : 17]>'
rng = np.random.default_rng(7)


def write_graph(path: Path, text: str, tensors: dict[str, np.ndarray]) -> Path:
    """An ONNX model from its text form, with ``tensors`` as initializers of the names the text
    declares. The text names them as exporters do (``l.weight_g``, ``onnx::MatMul_0``), which
    the ONNX syntax does not allow: they are parsed under stand-in names, then renamed."""
    stand_in = {n: re.sub(r"[^A-Za-z0-9_]", "_", n) for n in tensors}
    for name in sorted(tensors, key=len, reverse=True):
        text = text.replace(name, stand_in[name])
    model = ir.from_onnx_text(f"{OPSET}\n{text}",
                              initializers=[ir.tensor(a, name=stand_in[n]) for n, a in tensors.items()])
    for name in tensors:
        value = model.graph.initializers.pop(stand_in[name])
        value.name = name
        model.graph.register_initializer(value)
    ir.save(model, str(path))
    return path


def fused(cli, tmp_path: Path, tensors: dict[str, np.ndarray], rules: str) -> Path:
    ckpt = write_safetensors(tmp_path / "model.safetensors", tensors)
    rules_path = write_rules(tmp_path / "rules.toml", "version = 1\n" + rules)
    out = tmp_path / "fused.safetensors"
    ok(cli("fuse", ckpt, "-r", rules_path, "-o", out, "--quiet"))
    return out


def refused(cli, tmp_path: Path, ckpt: Path, graph: Path) -> str:
    """Export ``ckpt`` onto ``graph``: exit 2, nothing written; the error text."""
    out = tmp_path / "out.onnx"
    result = cli("export", ckpt, "--graph", graph, "-o", out)
    assert result.exit_code == 2, result.output
    assert not out.exists() and not leftovers(tmp_path)
    assert "Traceback" not in result.output and "escaped exception" not in result.output
    return result.stderr


def run(path: Path, **feeds: np.ndarray) -> list[np.ndarray]:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def op_counts(path: Path) -> collections.Counter:
    return collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)


# ------------------------------------------------------------------------- the pass list


def context(ckpt: Path, graph: Path) -> ExportContext:
    return ExportContext(open_checkpoint(str(ckpt)), str(graph), load_model(str(graph)))


def test_the_export_is_one_list_of_passes_in_the_order_they_run(tmp_path):
    ctx = context(ONNX / "bert", ONNX / "bert" / "model.onnx")
    passes = export_passes(ctx)
    assert isinstance(passes, Sequential) and passes.in_place
    assert [type(p) for p in passes.passes] == [
        PairInitializersPass, FoldReparametrizationsPass, TopologicalSortPass, RemoveUnusedNodesPass,
        RebindInitializersPass, FuseSharedMatMulPass, TopologicalSortPass, RemoveUnusedNodesPass,
        RefuseLeftoverGraphWeightsPass, AccountForCheckpointPass,
    ]
    assert all(p.ctx is ctx for p in passes.passes if hasattr(p, "ctx"))


@pytest.mark.parametrize("late", [FoldReparametrizationsPass, RebindInitializersPass, FuseSharedMatMulPass,
                                  RefuseLeftoverGraphWeightsPass, AccountForCheckpointPass])
def test_a_pass_that_needs_the_pairing_refuses_to_run_before_it(late):
    ctx = context(ONNX / "bert", ONNX / "bert" / "model.onnx")
    with pytest.raises(PreconditionError, match="runs after PairInitializersPass"):
        late(ctx)(ctx.model)
    assert ctx.pairing is None and not any(n.startswith(SET_ASIDE) for n in ctx.model.graph.initializers)


def test_a_pass_runs_only_on_its_contexts_model_and_pairs_once():
    ctx = context(ONNX / "bert", ONNX / "bert" / "model.onnx")
    other = load_model(str(ONNX / "bert" / "model.onnx"))
    with pytest.raises(PreconditionError, match="runs on the model its ExportContext holds"):
        PairInitializersPass(ctx)(other)
    assert PairInitializersPass(ctx)(ctx.model).modified
    with pytest.raises(PreconditionError, match="paired already"):
        PairInitializersPass(ctx)(ctx.model)


def test_each_stage_on_the_torchscript_bert_with_fused_qkv(cli, tmp_path):
    ckpt = tmp_path / "fused"
    ok(cli("fuse", ONNX / "bert", "-r", "bert-qkv", "-o", ckpt, "--quiet"))
    ctx = context(ckpt, ONNX / "bert" / "model.onnx")
    model, graph = ctx.model, ctx.model.graph

    assert PairInitializersPass(ctx)(model).modified
    aside = [v for v in graph.initializers.values() if v.name.startswith(SET_ASIDE)]
    assert len(aside) == 39 and not ctx.params
    assert "encoder.layer.0.attention.self.query.weight" in ctx.pairing.by_name

    assert not FoldReparametrizationsPass(ctx)(model).modified  # concat only: nothing numeric
    Sequential(TopologicalSortPass(), RemoveUnusedNodesPass())(model)

    assert RebindInitializersPass(ctx)(model).modified
    assert ctx.counts.rebound == 39 and not any(v.uses() for v in aside)
    assert "encoder.layer.1.attention.self.qkv.weight" in ctx.params
    matmuls = sum(n.op_type == "MatMul" for n in graph)

    assert FuseSharedMatMulPass(ctx)(model).modified
    assert ctx.counts.fused_matmuls == 2

    Sequential(TopologicalSortPass(), RemoveUnusedNodesPass())(model)
    assert sum(n.op_type == "MatMul" for n in graph) == matmuls - 4  # 3 per layer became 1
    assert not RefuseLeftoverGraphWeightsPass(ctx)(model).modified
    assert not any(n.startswith(SET_ASIDE) for n in graph.initializers)
    assert (ctx.counts.folded, ctx.counts.rebound, ctx.counts.fused_matmuls) == (0, 39, 2)


# ---------------------------------------------------------------- errors come out as themselves


class _Raises(InPlacePass):
    def __init__(self, error: BaseException):
        self.error = error

    def call(self, model):
        raise self.error


class _Returns(InPlacePass):
    def call(self, model):
        return PassResult(model, False)


@pytest.mark.parametrize("error", [ExportError("the graph is wrong"), ValueError("a bug"), KeyboardInterrupt()])
def test_run_passes_raises_what_a_pass_raised_not_onnx_irs_wrapper(error):
    model = load_model(str(ONNX / "wnconv" / "model.onnx"))
    with pytest.raises(type(error)) as caught:
        run_passes(Sequential(_Returns(), _Raises(error)), model)
    assert caught.value is error


def test_export_model_raises_export_error_itself(tmp_path):
    out = tmp_path / "out.onnx"
    with pytest.raises(ExportError, match="initializer 'onnx::Conv_26' float32"):
        export_model(open_checkpoint(str(ONNX / "wnconv")), str(ONNX / "wnconv" / "model_folded.onnx"), str(out))
    assert not out.exists() and not leftovers(tmp_path)


def test_a_parameter_the_checkpoint_lacks_is_an_export_error():
    ctx = context(ONNX / "bert", ONNX / "bert" / "model.onnx")
    with pytest.raises(ExportError, match="'nope' is not in"):
        ctx.param("nope")


# ---------------------------------------------------------------------------- weight_norm folds

WEIGHT_NORM = """
[[rule]]
name   = "wn"
op     = "weight_norm_fold"
g      = "{m*}.weight_g"
v      = "{m*}.weight_v"
output = "{m*}.weight"
dim    = "auto"
"""


def weight_norm_tensors() -> dict[str, np.ndarray]:
    return {"l.weight_g": rng.standard_normal((4, 1, 1)).astype(np.float32),
            "l.weight_v": rng.standard_normal((4, 3, 3)).astype(np.float32)}


WEIGHT_NORM_GRAPH = """
wn (float[1,3,8] x) => ({out}) <float[4,1,1] l.weight_g, float[4,3,3] l.weight_v> {{
  n = ReduceL2 <axes = [1, 2], keepdims = 1> (l.weight_v)
  d = Div (l.weight_v, n)
  w = Mul (l.weight_g, d)
  {body}
}}
"""


def weight_norm_graph(path: Path, tensors, out="float[1,4,6] y", body="y = Conv (x, w)") -> Path:
    return write_graph(path, WEIGHT_NORM_GRAPH.format(out=out, body=body), tensors)


def test_a_folded_weight_that_is_a_graph_output_keeps_its_name(cli, tmp_path):
    tensors = weight_norm_tensors()
    ckpt = fused(cli, tmp_path, tensors, WEIGHT_NORM)
    graph = weight_norm_graph(tmp_path / "g.onnx", tensors, out="float[4,3,3] w", body="")
    out = tmp_path / "out.onnx"
    report = ok(cli("export", ckpt, "--graph", graph, "-o", out, "--json")).json()
    assert (report["folded"], report["rebound"]) == (1, 0)
    assert [o.name for o in onnx.load(str(out)).graph.output] == ["w"]
    assert op_counts(out) == {"Identity": 1}  # an output is produced by a node of its own
    x = np.zeros((1, 3, 8), np.float32)  # read by nothing: the graph computes its weight only
    (expected,) = run(graph, x=x)
    (got,) = run(out, x=x)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert got.tobytes() == open_checkpoint(str(ckpt)).table["l.weight"].read().tobytes()


def test_a_renamed_input_is_followed_to_its_fold_and_tensors_rebound_by_their_new_names(cli, tmp_path):
    tensors = {**weight_norm_tensors(), "l.bias": rng.standard_normal(4).astype(np.float32)}
    rules = """
[[rule]]
name   = "rename-g"
op     = "rename"
input  = "{m*}.weight_g"
output = "{m*}.g"

[[rule]]
name   = "rename-bias"
op     = "rename"
input  = "{m*}.bias"
output = "{m*}.b"

[[rule]]
name   = "wn"
op     = "weight_norm_fold"
g      = "{m*}.g"
v      = "{m*}.weight_v"
output = "{m*}.weight"
dim    = "auto"
"""
    ckpt = fused(cli, tmp_path, tensors, rules)
    graph = write_graph(tmp_path / "g.onnx", WEIGHT_NORM_GRAPH.format(
        out="float[1,4,6] y", body="y = Conv (x, w, l.bias)").replace("float[4,3,3] l.weight_v>",
                                                                       "float[4,3,3] l.weight_v, float[4] l.bias>"),
        tensors)
    out = tmp_path / "out.onnx"
    report = ok(cli("export", ckpt, "--graph", graph, "-o", out, "--json")).json()
    assert (report["folded"], report["rebound"]) == (1, 1)
    assert {i.name for i in onnx.load(str(out)).graph.initializer} == {"l.weight", "l.b"}
    x = rng.standard_normal((1, 3, 8)).astype(np.float32)
    np.testing.assert_allclose(run(out, x=x)[0], run(graph, x=x)[0], rtol=1e-5, atol=1e-6)


def test_a_fold_whose_initializers_the_graph_lacks_is_refused(cli, tmp_path):
    tensors = weight_norm_tensors()
    ckpt = fused(cli, tmp_path, tensors, WEIGHT_NORM)
    graph = write_graph(tmp_path / "g.onnx", """
g (float[1,3,8] x) => (float[1,4,6] y) <float[4,3,3] onnx::Conv_3> {
  y = Conv (x, onnx::Conv_3)
}""", {"onnx::Conv_3": rng.standard_normal((4, 3, 3)).astype(np.float32)})
    assert refused(cli, tmp_path, ckpt, graph) == (
        "error: rule 'wn' (rules.toml): the graph has no initializer for ['l.weight_g', 'l.weight_v']; "
        "export the unfolded model with constant folding off\n").replace("rules.toml", str(tmp_path / "rules.toml"))


def test_a_fold_without_one_subgraph_over_its_initializers_is_refused(cli, tmp_path):
    tensors = weight_norm_tensors()
    ckpt = fused(cli, tmp_path, tensors, WEIGHT_NORM)
    graph = write_graph(tmp_path / "g.onnx", """
g (float[4,1,1] s) => (float[4,3,3] y) <float[4,1,1] l.weight_g, float[4,3,3] l.weight_v> {
  a = Mul (s, l.weight_g)
  y = Mul (a, l.weight_v)
}""", tensors)
    assert "expected one subgraph computing 'l.weight' from ['l.weight_g', 'l.weight_v'], found 0 result(s)" \
        in refused(cli, tmp_path, ckpt, graph)


def test_an_input_of_a_fold_the_graph_also_uses_elsewhere_is_refused(cli, tmp_path):
    tensors = weight_norm_tensors()
    ckpt = fused(cli, tmp_path, tensors, WEIGHT_NORM)
    graph = weight_norm_graph(tmp_path / "g.onnx", tensors, out="float[1,4,6] y, float[4,3,8] z",
                              body="y = Conv (x, w)\n  z = Mul (x, l.weight_g)")
    assert f"the graph uses 'l.weight_g' (initializer 'l.weight_g'), which {ckpt} cannot provide" \
        in refused(cli, tmp_path, ckpt, graph)


def test_a_fold_whose_output_a_later_rule_transforms_is_refused(cli, tmp_path):
    tensors = weight_norm_tensors()
    ckpt = fused(cli, tmp_path, tensors, WEIGHT_NORM + """
[[rule]]
name   = "rename-w"
op     = "rename"
input  = "{m*}.weight"
output = "{m*}.w"
""")
    graph = weight_norm_graph(tmp_path / "g.onnx", tensors)
    assert "'l.weight' is transformed again later; export supports numeric folds only on final tensors" \
        in refused(cli, tmp_path, ckpt, graph)


def test_a_numeric_step_export_cannot_fold_is_refused(cli, tmp_path):
    weight = rng.standard_normal((4, 3, 3)).astype(np.float32)
    ckpt = fused(cli, tmp_path, {"l.weight": weight}, """
[[rule]]
name  = "unfold"
op    = "weight_norm_unfold"
input = "{m*}.weight"
g     = "{m*}.weight_g"
v     = "{m*}.weight_v"
dim   = 0
""")
    graph = write_graph(tmp_path / "g.onnx", """
g (float[1,3,8] x) => (float[1,4,6] y) <float[4,3,3] l.weight> {
  y = Conv (x, l.weight)
}""", {"l.weight": weight})
    assert "rule 'unfold'" in (error := refused(cli, tmp_path, ckpt, graph))
    assert "export does not handle weight_norm_unfold" in error


# ------------------------------------------------------------------------------ BatchNorm folds

CONV_BN = """
[[rule]]
name          = "conv-bn"
op            = "bn_fold"
weight        = "conv1.weight"
bias          = "conv1.bias"
gamma         = "bn1.weight"
beta          = "bn1.bias"
mean          = "bn1.running_mean"
var           = "bn1.running_var"
output_weight = "conv1.weight"
output_bias   = "conv1.bias"
layer         = "conv"
"""


def conv_bn_tensors() -> dict[str, np.ndarray]:
    def vector(low=-1.0):
        return rng.uniform(low, 1.0, 4).astype(np.float32)

    return {"conv1.weight": rng.standard_normal((4, 3, 3)).astype(np.float32), "conv1.bias": vector(),
            "bn1.weight": vector(), "bn1.bias": vector(), "bn1.running_mean": vector(),
            "bn1.running_var": vector(0.5)}


def test_a_batchnorm_that_does_not_follow_the_layer_is_refused(cli, tmp_path):
    tensors = conv_bn_tensors()
    ckpt = fused(cli, tmp_path, tensors, CONV_BN)
    graph = write_graph(tmp_path / "g.onnx", """
g (float[1,3,8] x) => (float[1,4,6] y) <float[4,3,3] conv1.weight, float[4] conv1.bias, float[4] bn1.weight,
                                         float[4] bn1.bias, float[4] bn1.running_mean, float[4] bn1.running_var> {
  c = Conv (x, conv1.weight, conv1.bias)
  r = Relu (c)
  y = BatchNormalization (r, bn1.weight, bn1.bias, bn1.running_mean, bn1.running_var)
}""", tensors)
    assert "rule 'conv-bn'" in (error := refused(cli, tmp_path, ckpt, graph))
    assert "no Conv/Gemm/ConvTranspose on 'conv1.weight' followed by BatchNormalization in the graph" in error


def test_a_conv_without_batchnorm_that_does_not_hold_the_fold_is_refused(cli, tmp_path):
    tensors = conv_bn_tensors()
    ckpt = fused(cli, tmp_path, tensors, CONV_BN)
    graph = write_graph(tmp_path / "g.onnx", """
g (float[1,3,8] x) => (float[1,4,6] y) <float[4,3,3] conv1.weight, float[4] conv1.bias> {
  y = Conv (x, conv1.weight, conv1.bias)
}""", {k: tensors[k] for k in ("conv1.weight", "conv1.bias")})
    error = refused(cli, tmp_path, ckpt, graph)
    assert "the graph has no BatchNormalization for ('bn1.weight', 'bn1.bias', 'bn1.running_mean', " \
           "'bn1.running_var') and its Conv on 'conv1.weight' does not hold the checkpoint's folded " \
           "['conv1.weight', 'conv1.bias']" in error


def test_a_weight_without_batchnorm_or_conv_is_refused(cli, tmp_path):
    tensors = conv_bn_tensors()
    ckpt = fused(cli, tmp_path, tensors, CONV_BN)
    graph = write_graph(tmp_path / "g.onnx", """
g (float[4,3,3] x) => (float[4,3,3] y) <float[4,3,3] conv1.weight> {
  y = Add (x, conv1.weight)
}""", {"conv1.weight": tensors["conv1.weight"]})
    assert "the graph has no initializer for ['bn1.weight', 'bn1.bias', 'bn1.running_mean', 'bn1.running_var'] " \
           "and no Conv on the weight" in refused(cli, tmp_path, ckpt, graph)


def test_a_graph_weight_still_used_after_the_rewrite_is_refused(cli, tmp_path):
    """The dynamo graph's conv1.weight holds the exporter's fold; its Conv takes the checkpoint's
    fold, but a second use of the graph's copy would keep the graph's own weight."""
    model = onnx.load(str(ONNX / "convbn" / "model_dynamo.onnx"))
    model.graph.node.append(onnx.helper.make_node("Identity", ["conv1.weight"], ["w_copy"]))
    model.graph.output.append(onnx.helper.make_tensor_value_info("w_copy", onnx.TensorProto.FLOAT, None))
    graph = tmp_path / "g.onnx"
    onnx.save(model, str(graph))
    assert "the graph still uses ['conv1.weight'] that fusectl could not take from" \
        in refused(cli, tmp_path, ONNX / "convbn", graph)


# ----------------------------------------------------------------- one MatMul per fused weight

QKV = """
[[rule]]
name   = "qkv"
op     = "concat"
inputs = ["{p}.q.{t}", "{p}.k.{t}", "{p}.v.{t}"]
output = "{p}.qkv.{t}"
axis   = 0
"""


def qkv_tensors(bias: bool) -> dict[str, np.ndarray]:
    tensors = {f"a.{n}.weight": rng.standard_normal((4, 4)).astype(np.float32) for n in "qkv"}
    if bias:
        tensors |= {f"a.{n}.bias": rng.standard_normal(4).astype(np.float32) for n in "qkv"}
    return tensors


def qkv_graph(path: Path, tensors, inputs=("x", "x", "x")) -> Path:
    """TorchScript's form: each Linear is MatMul with the weight's transpose (+ Add of the bias)."""
    declared = ", ".join(f"float[4,4] onnx::MatMul_{k}" for k in range(3))
    lines, arrays = [], {}
    for k, n in enumerate("qkv"):
        arrays[f"onnx::MatMul_{k}"] = tensors[f"a.{n}.weight"].T.copy()
        target = f"m{n}" if f"a.{n}.bias" in tensors else n
        lines.append(f"{target} = MatMul ({inputs[k]}, onnx::MatMul_{k})")
        if f"a.{n}.bias" in tensors:
            declared += f", float[4] a.{n}.bias"
            arrays[f"a.{n}.bias"] = tensors[f"a.{n}.bias"]
            lines.append(f"{n} = Add (m{n}, a.{n}.bias)")
    feeds = ", ".join(f"float[2,4] {i}" for i in sorted(set(inputs)))
    return write_graph(path, f"g ({feeds}) => (float[2,4] q, float[2,4] k, float[2,4] v) <{declared}> {{\n  "
                       + "\n  ".join(lines) + "\n}", arrays)


@pytest.mark.parametrize("bias", [True, False])
def test_the_parts_of_a_fused_weight_on_one_input_become_one_matmul(cli, tmp_path, bias):
    tensors = qkv_tensors(bias)
    ckpt = fused(cli, tmp_path, tensors, QKV)
    graph = qkv_graph(tmp_path / "g.onnx", tensors)
    out = tmp_path / "out.onnx"
    assert ok(cli("export", ckpt, "--graph", graph, "-o", out, "--json")).json()["fused_matmuls"] == 1
    counts = op_counts(out)
    assert (counts["MatMul"], counts["Split"], counts["Add"]) == (1, 1, int(bias))
    x = rng.standard_normal((2, 4)).astype(np.float32)
    for got, expected in zip(run(out, x=x), run(graph, x=x)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_the_parts_of_a_fused_weight_on_different_inputs_stay_three_matmuls(cli, tmp_path):
    tensors = qkv_tensors(bias=True)
    ckpt = fused(cli, tmp_path, tensors, QKV)
    graph = qkv_graph(tmp_path / "g.onnx", tensors, inputs=("x", "x", "z"))
    out = tmp_path / "out.onnx"
    assert ok(cli("export", ckpt, "--graph", graph, "-o", out, "--json")).json()["fused_matmuls"] == 0
    assert op_counts(out)["MatMul"] == 3
    x, z = (rng.standard_normal((2, 4)).astype(np.float32) for _ in range(2))
    for got, expected in zip(run(out, x=x, z=z), run(graph, x=x, z=z)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_biases_kept_apart_are_added_per_part_after_the_one_matmul(cli, tmp_path):
    """Only the weights were fused; the graph's own Split (of its input) is left alone."""
    tensors = qkv_tensors(bias=True)
    ckpt = fused(cli, tmp_path, tensors, QKV.replace(".{t}", ".weight"))
    graph = write_graph(tmp_path / "g.onnx", """
g (float[4,4] xx) => (float[2,4] q, float[2,4] k, float[2,4] v)
  <float[4,4] onnx::MatMul_0, float[4,4] onnx::MatMul_1, float[4,4] onnx::MatMul_2,
   float[4] a.q.bias, float[4] a.k.bias, float[4] a.v.bias> {
  x, unused = Split <axis = 0> (xx)
  mq = MatMul (x, onnx::MatMul_0)
  q = Add (mq, a.q.bias)
  mk = MatMul (x, onnx::MatMul_1)
  k = Add (mk, a.k.bias)
  mv = MatMul (x, onnx::MatMul_2)
  v = Add (mv, a.v.bias)
}""", {
        **{f"onnx::MatMul_{k}": tensors[f"a.{n}.weight"].T.copy() for k, n in enumerate("qkv")},
        **{f"a.{n}.bias": tensors[f"a.{n}.bias"] for n in "qkv"}})
    out = tmp_path / "out.onnx"
    assert ok(cli("export", ckpt, "--graph", graph, "-o", out, "--json")).json()["fused_matmuls"] == 1
    counts = op_counts(out)
    assert (counts["MatMul"], counts["Split"], counts["Add"]) == (1, 2, 3)
    xx = rng.standard_normal((4, 4)).astype(np.float32)
    for got, expected in zip(run(out, xx=xx), run(graph, xx=xx)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_gemms_reading_the_parts_without_a_transpose_fuse_into_one_gemm(cli, tmp_path):
    tensors = qkv_tensors(bias=True)
    ckpt = fused(cli, tmp_path, tensors, QKV)
    declared = ", ".join(f"float[4,4] a.{n}.weight, float[4] a.{n}.bias" for n in "qkv")
    lines = "\n  ".join(f"{n} = Gemm <transB = 1> (x, a.{n}.weight, a.{n}.bias)" for n in "qkv")
    graph = write_graph(tmp_path / "g.onnx", f"""
g (float[2,4] x) => (float[2,4] q, float[2,4] k, float[2,4] v) <{declared}> {{
  {lines}
}}""", tensors)
    out = tmp_path / "out.onnx"
    assert ok(cli("export", ckpt, "--graph", graph, "-o", out, "--json")).json()["fused_matmuls"] == 1
    assert (op_counts(out)["Gemm"], op_counts(out)["Split"]) == (1, 1)
    x = rng.standard_normal((2, 4)).astype(np.float32)
    for got, expected in zip(run(out, x=x), run(graph, x=x)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_every_use_of_a_shared_layer_fuses_past_the_exporters_identity_copies(cli, tmp_path):
    """ALBERT's one layer used three times, as TorchScript writes it: the first use reads the
    transposed weights and the biases, the others Identity copies of them. Each use becomes one
    MatMul, one bias Add and a Split (was: the first use only)."""
    tensors = qkv_tensors(bias=True)
    ckpt = fused(cli, tmp_path, tensors, QKV)
    arrays = {**{f"onnx::MatMul_{k}": tensors[f"a.{n}.weight"].T.copy() for k, n in enumerate("qkv")},
              **{f"a.{n}.bias": tensors[f"a.{n}.bias"] for n in "qkv"}}
    declared = ", ".join([f"float[4,4] onnx::MatMul_{k}" for k in range(3)] + [f"float[4] a.{n}.bias" for n in "qkv"])
    lines = []
    for use in range(3):
        h = "x" if use == 0 else f"h{use - 1}"
        for k, n in enumerate("qkv"):
            w, b = f"onnx::MatMul_{k}", f"a.{n}.bias"
            if use:
                lines += [f"w{n}{use} = Identity ({w})", f"b{n}{use} = Identity ({b})"]
                w, b = f"w{n}{use}", f"b{n}{use}"
            lines += [f"m{n}{use} = MatMul ({h}, {w})", f"{n}{use} = Add (m{n}{use}, {b})"]
        lines += [f"s{use} = Add (q{use}, k{use})", f"h{use} = Add (s{use}, v{use})"]
    graph = write_graph(tmp_path / "g.onnx", f"g (float[2,4] x) => (float[2,4] h2) <{declared}> {{\n  "
                        + "\n  ".join(lines) + "\n}", arrays)
    out = tmp_path / "out.onnx"
    report = ok(cli("export", ckpt, "--graph", graph, "-o", out, "--json")).json()
    assert report["fused_matmuls"] == 3 and report["not_fused"] == []
    counts = op_counts(out)
    assert (counts["MatMul"], counts["Split"], counts["Identity"]) == (3, 3, 0)
    assert counts["Add"] == 3 + 6  # one bias Add per use, and the two sums per use
    x = rng.standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_allclose(run(out, x=x)[0], run(graph, x=x)[0], rtol=1e-5, atol=1e-6)
