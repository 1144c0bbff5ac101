"""What export's passes share (onnx/export_context.py): the plan a checkpoint records, its
parameters as one lazy initializer per unique tensor (a name it lacks refused naming the name
and the checkpoint), the IR builder's fresh names, and rebinding a value's uses — a graph
output keeping its name, a transposed pairing read through a Transpose."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx_ir.passes.common import RemoveUnusedNodesPass

from conftest import FIXTURES, ok, write_rules, write_safetensors
from fusectl.errors import PlanError
from fusectl.io.checkpoint import open_checkpoint
from fusectl.onnx.export_context import ExportContext, ExportError, IRBuilder
from fusectl.steps import Plan

OPSET = '<ir_version: 8, opset_import: ["" : 17]>'
TIED = FIXTURES / "tied-embeddings.safetensors"

GRAPH = f"""{OPSET}
g (float[2, 16] x) => (float[2, 16] y) <float[16, 16] w> {{
    y = MatMul(x, w)
}}"""


def graph_model(w: np.ndarray | None = None) -> ir.Model:
    w = np.eye(16, dtype=np.float32) if w is None else w
    return ir.from_onnx_text(GRAPH, initializers=[ir.tensor(w, name="w")])


def context(ckpt: Path = TIED, model: ir.Model | None = None) -> ExportContext:
    return ExportContext(open_checkpoint(str(ckpt)), "graph.onnx", model or graph_model())


def run(model: ir.Model, path: Path, **feeds):
    """Save ``model`` as export does (nodes left without uses removed) and run it."""
    RemoveUnusedNodesPass()(model)
    ir.save(model, str(path))
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_a_checkpoint_without_provenance_has_an_empty_plan():
    ctx = context()
    assert ctx.plan == Plan()
    assert ctx.params == {} and ctx.pairing is None
    assert (ctx.counts.folded, ctx.counts.rebound, ctx.counts.fused_matmuls) == (0, 0, 0)
    assert ctx.builder.graph is ctx.model.graph


def test_a_fused_checkpoint_brings_its_recorded_plan(cli, tmp_path):
    src = write_safetensors(tmp_path / "m.safetensors", {"a.weight": np.ones((2, 3), np.float32)})
    rules = write_rules(tmp_path / "r.toml", 'version = 1\n[[rule]]\nname = "t"\nop = "transpose"\n'
                                             'input = "a.weight"\noutput = "a.weight"\n')
    out = tmp_path / "fused.safetensors"
    ok(cli("fuse", src, "-r", rules, "-o", out, "--quiet"))
    plan = context(out).plan
    assert [g.rule for g in plan.groups] == ["t"]
    assert plan.steps[0].op.kind == "transpose"


def test_param_is_one_lazy_initializer_per_unique_parameter():
    ctx = context()
    head = ctx.param("head.weight")
    assert ctx.param("embed.weight") is head  # tied: one initializer
    assert head.name == ctx.checkpoint.table.unique_name("head.weight") == "embed.weight"
    assert ctx.model.graph.initializers["embed.weight"] is head
    assert head.shape == ir.Shape([64, 16]) and head.dtype == ir.DataType.FLOAT
    assert ctx.is_param(head)
    assert not ctx.is_param(ctx.model.graph.initializers["w"])
    expected = ctx.checkpoint.table["embed.weight"].read()
    np.testing.assert_array_equal(head.const_value.numpy(), expected)
    assert set(ctx.params) == {"embed.weight"}


def test_param_refuses_a_name_the_checkpoint_lacks():
    ctx = context()
    with pytest.raises(ExportError) as err:
        ctx.param("lm_head.weight")
    assert str(err.value) == f"'lm_head.weight' is not in {TIED}"
    assert isinstance(err.value, PlanError)
    assert ctx.params == {}


def test_the_builder_names_its_outputs_and_constants_freshly():
    model = graph_model()
    b = IRBuilder(model.graph)
    x = model.graph.inputs[0]
    relu, = b.node("Relu", [x])
    assert relu.name == "fusectl_relu_1"
    tr = b.one("Transpose", [relu], perm=[1, 0])
    assert tr.name == "fusectl_transpose_2"
    assert list(tr.producer().attributes["perm"].value) == [1, 0]
    halves = b.node("Split", [x], 2, axis=1, num_outputs=2)
    assert [v.name for v in halves] == ["fusectl_split_3", "fusectl_split_4"]
    axes = b.ints([0, -1])
    assert axes.name == "fusectl_const_5"
    assert axes.const_value.numpy().dtype == np.int64 and axes.const_value.numpy().tolist() == [0, -1]
    named = b.constant(np.zeros(3, np.float32), name="mine")
    assert model.graph.initializers["mine"] is named and b.count == 6


def test_the_builder_appends_into_a_subgraph_when_asked():
    model = graph_model()
    sub = ir.Graph([], [], nodes=[], name="body")
    b = IRBuilder(model.graph)
    before = len(list(model.graph))
    b.one("Identity", [model.graph.inputs[0]], into=sub)
    assert len(list(sub)) == 1 and len(list(model.graph)) == before


def test_replace_rebinds_every_use(tmp_path):
    model = graph_model()
    ctx = context(model=model)
    new = ctx.builder.constant(np.full((16, 16), 2.0, np.float32))
    ctx.replace(model.graph.initializers["w"], new)
    x = np.ones((2, 16), np.float32)
    np.testing.assert_allclose(run(model, tmp_path / "m.onnx", x=x)[0], x @ np.full((16, 16), 2.0))


RELU = f"""{OPSET}
g (float[2] x) => (float[2] y) {{
    y = Relu(x)
}}"""


def test_replacing_a_graph_output_keeps_its_name(tmp_path):
    model = ir.from_onnx_text(RELU)
    ctx = context(model=model)
    y = model.graph.outputs[0]
    new = ctx.builder.one("Neg", [model.graph.inputs[0]])  # a node of the graph: no Identity needed
    ctx.replace(y, new)
    assert model.graph.outputs[0] is new and new.name == "y" and y.name is None
    assert new.shape == ir.Shape([2]) and new.producer().op_type == "Neg"
    x = np.array([1.5, -2.0], np.float32)
    np.testing.assert_array_equal(run(model, tmp_path / "m.onnx", x=x)[0], -x)


def test_a_graph_output_replaced_by_an_initializer_is_produced_by_an_identity(tmp_path):
    model = ir.from_onnx_text(RELU)
    ctx = context(model=model)
    const = ctx.builder.constant(np.array([5.0, 6.0], np.float32))
    ctx.replace(model.graph.outputs[0], const)
    out = model.graph.outputs[0]
    assert out.name == "y" and out.producer().op_type == "Identity"
    assert const.name != "y" and const.is_initializer()
    np.testing.assert_array_equal(run(model, tmp_path / "m.onnx", x=np.zeros(2, np.float32))[0], [5.0, 6.0])


def test_rebind_reads_a_transposed_pairing_through_a_transpose(tmp_path):
    model = graph_model()
    ctx = context(model=model)
    proj = ctx.param("proj.weight")
    ctx.rebind(model.graph.initializers["w"], proj, transposed=True)
    assert ctx.counts.rebound == 1
    x = np.arange(32, dtype=np.float32).reshape(2, 16) / 7
    w = ctx.checkpoint.table["proj.weight"].read()
    np.testing.assert_allclose(run(model, tmp_path / "m.onnx", x=x)[0], x @ w.T, rtol=1e-6)


def test_rebind_without_transposing(tmp_path):
    model = graph_model()
    ctx = context(model=model)
    ctx.rebind(model.graph.initializers["w"], ctx.param("proj.weight"), transposed=False)
    assert ctx.counts.rebound == 1
    assert not [n for n in model.graph if n.op_type == "Transpose"]
    x = np.ones((2, 16), np.float32)
    w = ctx.checkpoint.table["proj.weight"].read()
    np.testing.assert_allclose(run(model, tmp_path / "m.onnx", x=x)[0], x @ w, rtol=1e-6)
