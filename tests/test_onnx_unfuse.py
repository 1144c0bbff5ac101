"""``Op.onnx_unfuse``: the ONNX ops that undo a planned layout step, run on onnxruntime (CPU).

Each case binds a one-rule file to a small safetensors checkpoint, takes the planned step,
computes the fused tensors with the step's own op (``op.apply``) and feeds them to the
op's un-fuse subgraph, built with both of its callers' builders: the probes'
GraphBuilder (fused data as initializers) and export's IRBuilder (fused data as graph
inputs). The result must be the step's inputs, bitwise, with their dtype and shape.
Random data makes every element distinct, so a wrong axis, order or permutation fails.
"""

from __future__ import annotations

import tomllib

import numpy as np
import onnx_ir as ir
import onnxruntime
import pytest
from safetensors.numpy import save_file

from fusectl.io.checkpoint import open_checkpoint
from fusectl.onnx.export import IRBuilder
from fusectl.ops import OPS
from fusectl.steps import Step
from fusectl.rules.schema import load_rules
from fusectl.verification.probes import OPSET, GraphBuilder

from fusectl.planner import make_plan

DTYPES = [np.float32, np.float16, np.int64]
UNFUSABLE = {kind for kind, op in OPS.items() if op.onnx_unfusable}


def unfuse(b, step: Step, fused: list) -> list:
    return step.op.onnx_unfuse(b, step.input_specs, step.output_specs, fused)


def rule(op: str, body: str) -> str:
    return f'[[rule]]\nname = "r"\nop = "{op}"\n{body}\n'


# (id, rule, {tensor name: shape}); one rule, one binding, so one planned step
CASES = [
    ("concat-axis0", rule("concat", 'inputs = ["a", "b", "c"]\noutput = "f"\naxis = 0'),
     {"a": (2, 3), "b": (3, 3), "c": (1, 3)}),
    ("concat-axis1", rule("concat", 'inputs = ["a", "b"]\noutput = "f"\naxis = 1'),
     {"a": (2, 3, 2), "b": (2, 5, 2)}),
    ("concat-axis-1", rule("concat", 'inputs = ["a", "b"]\noutput = "f"\naxis = -1'),
     {"a": (3, 2), "b": (3, 4)}),
    ("split-axis0-sizes", rule("split", 'input = "f"\noutputs = ["a", "b", "c"]\naxis = 0\nsizes = [1, 3, 2]'),
     {"f": (6, 3)}),
    ("split-axis1-parts", rule("split", 'input = "f"\noutputs = ["a", "b", "c"]\naxis = 1'),
     {"f": (2, 6, 2)}),
    ("split-axis-1", rule("split", 'input = "f"\noutputs = ["a", "b"]\naxis = -1\nsizes = [3, 1]'),
     {"f": (2, 4)}),
    ("interleave-groups1", rule("interleave", 'inputs = ["a", "b"]\noutput = "f"\naxis = 0\ngroups = 1'),
     {"a": (2, 3), "b": (4, 3)}),
    ("interleave-groups2-axis0", rule("interleave", 'inputs = ["a", "b", "c"]\noutput = "f"\naxis = 0\ngroups = 2'),
     {"a": (4, 3), "b": (2, 3), "c": (6, 3)}),
    ("interleave-groups3-axis1", rule("interleave", 'inputs = ["a", "b"]\noutput = "f"\naxis = 1\ngroups = 3'),
     {"a": (2, 6, 2), "b": (2, 3, 2)}),
    ("interleave-groups2-axis-1", rule("interleave", 'inputs = ["a", "b"]\noutput = "f"\naxis = -1\ngroups = 2'),
     {"a": (3, 4), "b": (3, 2)}),
    ("deinterleave-groups2-axis0", rule("deinterleave", 'input = "f"\noutputs = ["a", "b"]\naxis = 0\ngroups = 2\nsizes = [4, 2]'),
     {"f": (6, 3)}),
    ("deinterleave-groups2-axis1", rule("deinterleave", 'input = "f"\noutputs = ["a", "b", "c"]\naxis = 1\ngroups = 2\nsizes = [2, 4, 2]'),
     {"f": (3, 8)}),
    ("deinterleave-groups3-parts", rule("deinterleave", 'input = "f"\noutputs = ["a", "b"]\naxis = 1\ngroups = 3'),
     {"f": (2, 12, 2)}),
    ("stack-axis0", rule("stack", 'input = "x.{e:int}.w"\noutput = "x.w"\nover = "e"\naxis = 0'),
     {"x.0.w": (2, 3), "x.1.w": (2, 3), "x.2.w": (2, 3)}),
    ("stack-axis1", rule("stack", 'input = "x.{e:int}.w"\noutput = "x.w"\nover = "e"\naxis = 1'),
     {"x.0.w": (2, 3), "x.1.w": (2, 3), "x.2.w": (2, 3), "x.3.w": (2, 3)}),
    ("stack-axis-1", rule("stack", 'input = "x.{e:int}.w"\noutput = "x.w"\nover = "e"\naxis = -1'),
     {"x.0.w": (2, 3), "x.1.w": (2, 3)}),
    ("unstack-axis0", rule("unstack", 'input = "x.w"\noutput = "x.{e}.w"\nover = "e"\naxis = 0'),
     {"x.w": (3, 2, 4)}),
    ("unstack-axis2", rule("unstack", 'input = "x.w"\noutput = "x.{e}.w"\nover = "e"\naxis = 2'),
     {"x.w": (2, 3, 4)}),
    ("unstack-axis-2", rule("unstack", 'input = "x.w"\noutput = "x.{e}.w"\nover = "e"\naxis = -2'),
     {"x.w": (2, 5, 3)}),
    ("transpose-2d", rule("transpose", 'input = "w"\noutput = "t"\nperm = [1, 0]'), {"w": (3, 5)}),
    # (2, 0, 1) is not its own inverse: using perm instead of its argsort fails
    ("transpose-3d", rule("transpose", 'input = "w"\noutput = "t"\nperm = [2, 0, 1]'), {"w": (2, 3, 4)}),
    ("reshape-split-dims", rule("reshape", 'input = "w"\noutput = "r"\nshape = [2, 3, 4]'), {"w": (4, 6)}),
    ("reshape-flatten", rule("reshape", 'input = "w"\noutput = "r"\nshape = [-1]'), {"w": (3, 2, 2)}),
    # (2, 0, 1) and (1, 3, 0, 2) are not their own inverses
    ("reorder-axis0", rule("reorder", 'input = "w"\noutput = "r"\naxis = 0\nchunks = 3\norder = [2, 0, 1]'),
     {"w": (6, 2)}),
    ("reorder-axis1", rule("reorder", 'input = "w"\noutput = "r"\naxis = 1\nchunks = 4\norder = [1, 3, 0, 2]'),
     {"w": (2, 8, 3)}),
    ("reorder-axis-1", rule("reorder", 'input = "w"\noutput = "r"\naxis = -1\nchunks = 3\norder = [1, 2, 0]'),
     {"w": (2, 6)}),
    ("rope-to-hf", rule("rope_permute", 'input = "q"\noutput = "p"\nheads = 2\nto = "hf"'), {"q": (12, 3)}),
    ("rope-to-meta", rule("rope_permute", 'input = "q"\noutput = "p"\nheads = 2\nto = "meta"'), {"q": (12, 3)}),
    ("rope-to-hf-bias", rule("rope_permute", 'input = "q"\noutput = "p"\nheads = 3\nto = "hf"'), {"q": (12,)}),
    ("rope-to-meta-bias", rule("rope_permute", 'input = "q"\noutput = "p"\nheads = 1\nto = "meta"'), {"q": (8,)}),
    # per-tensor scales of fused parts: equal ones merge (a name for a shape: a copy of that tensor)
    ("merge-equal", rule("merge_equal", 'inputs = ["a", "b", "c"]\noutput = "f"'), {"a": (1,), "b": "a", "c": "a"}),
    ("merge-equal-per-channel", rule("merge_equal", 'inputs = ["a", "b"]\noutput = "f"'), {"a": (3, 1), "b": "a"}),
    ("replicate", rule("replicate", 'input = "s"\noutputs = ["a", "b", "c"]'), {"s": (2, 1)}),
    ("block-diagonal", rule("block_diagonal", 'inputs = ["a", "b", "c"]\noutput = "f"'),
     {"a": (3, 2), "b": (1, 4), "c": (2, 1)}),
    # a block-diagonal input (zeros off the diagonal), as block_diagonal made it
    ("block-diagonal-split", rule("block_diagonal_split", 'input = "f"\noutputs = ["a", "b"]\nrows = [3, 1]\ncols = [2, 4]'),
     {"f": ("block_diagonal", (3, 2), (1, 4))}),
]


def random_array(rng, shape, dtype) -> np.ndarray:
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-(2**62), 2**62, size=shape, dtype=dtype)
    return rng.standard_normal(shape).astype(dtype)


def planned_step(tmp_path, rules_text: str, tensors: dict[str, np.ndarray]) -> Step:
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    ruleset = load_rules("version = 1\n" + rules_text, "rules/test.toml", None)
    plan, _ = make_plan(open_checkpoint(str(path)).table, [ruleset])
    (step,) = plan.steps
    return step


def unfuse_with_graph_builder(step: Step, fused: list[np.ndarray]) -> list[np.ndarray]:
    """As the probes build it: the fused tensors as initializers."""
    b = GraphBuilder()
    recovered = unfuse(b, step, [b.const(a, "p") for a in fused])
    for k, (value, spec) in enumerate(zip(recovered, step.input_specs)):
        b.output(value, f"y{k}", spec)  # declared as the step's own dtype and shape
    return run_model(b.model(), {})


def unfuse_with_ir_builder(step: Step, fused: list[np.ndarray]) -> list[np.ndarray]:
    """As export builds it: onnx-ir nodes appended to a graph, the fused tensors as inputs."""
    inputs = [ir.Value(name=f"f{k}", type=ir.TensorType(ir.DataType.from_numpy(a.dtype)), shape=ir.Shape(a.shape))
              for k, a in enumerate(fused)]
    graph = ir.Graph(inputs, [], nodes=[], opset_imports={"": OPSET}, name="unfuse")
    b = IRBuilder(graph)
    recovered = unfuse(b, step, list(inputs))
    for k, value in enumerate(recovered):
        value.name = f"y{k}"
        graph.outputs.append(value)
    model = ir.Model(graph, ir_version=8)
    return run_model(ir.to_proto(model).SerializeToString(), {f"f{k}": a for k, a in enumerate(fused)})


def run_model(model: bytes, feeds: dict) -> list[np.ndarray]:
    sess = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    names = sorted((o.name for o in sess.get_outputs()), key=lambda n: int(n[1:]))
    return sess.run(names, feeds)


BUILDERS = {"probes": unfuse_with_graph_builder, "export": unfuse_with_ir_builder}


def assert_bitwise(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, (k, g.dtype, g.shape, w.dtype, w.shape)
        assert g.tobytes() == w.tobytes(), f"input {k} differs"


@pytest.mark.parametrize("builder", sorted(BUILDERS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_unfusing_the_fused_tensors_in_onnx_gives_back_the_inputs_bitwise(tmp_path, case, dtype, builder):
    _, rules_text, shapes = case
    rng = np.random.default_rng(sorted(c[0] for c in CASES).index(case[0]))
    tensors = {name: random_array(rng, shape, dtype) for name, shape in shapes.items()
               if not isinstance(shape, str) and not isinstance(shape[0], str)}
    tensors.update({name: OPS[shape[0]]().apply([random_array(rng, s, dtype) for s in shape[1:]])[0]
                    for name, shape in shapes.items() if not isinstance(shape, str) and isinstance(shape[0], str)})
    tensors.update({name: tensors[shape].copy() for name, shape in shapes.items() if isinstance(shape, str)})
    step = planned_step(tmp_path, rules_text, tensors)
    inputs = [tensors[n] for n in step.inputs]
    fused = [np.ascontiguousarray(a) for a in step.op.apply(inputs)]
    # the fused tensors are what the plan says they are, and actually moved something
    assert [(a.dtype, a.shape) for a in fused] == [(s.dtype.numpy, s.shape) for s in step.output_specs]
    assert_bitwise(BUILDERS[builder](step, fused), inputs)


def test_the_cases_cover_every_unfusable_op_and_branch():
    ops = [tomllib.loads(c[1])["rule"][0] for c in CASES]
    assert {op["op"] for op in ops} == UNFUSABLE
    for kind in ("concat", "split", "interleave", "deinterleave", "stack", "unstack", "reorder"):
        assert {op.get("axis", 0) != 0 for op in ops if op["op"] == kind} == {False, True}, kind
    assert any(op["groups"] > 1 for op in ops if op["op"] == "interleave")
    assert {op["to"] for op in ops if op["op"] == "rope_permute"} == {"hf", "meta"}


# Empty tensors: ONNX Reshape reads a 0 in the target shape as "copy this input dimension"
# unless allowzero = 1, so the ops' un-fuse Reshapes fail (or mis-shape) on them,
# and `fusectl verify` exits 2 on a correct fuse. Strict: these start passing when fixed.
EMPTY_CASES = [
    ("reshape-empty", rule("reshape", 'input = "w"\noutput = "r"\nshape = [4, 0]'), {"w": (0, 4)}),
    ("interleave-empty-rows", rule("interleave", 'inputs = ["a", "b"]\noutput = "f"\ngroups = 2'),
     {"a": (4, 0), "b": (2, 0)}),
    ("rope-empty-cols", rule("rope_permute", 'input = "q"\noutput = "p"\nheads = 1\nto = "hf"'), {"q": (4, 0)}),
]


@pytest.mark.parametrize("builder", sorted(BUILDERS))
@pytest.mark.parametrize("case", EMPTY_CASES, ids=[c[0] for c in EMPTY_CASES])
def test_empty_tensors_unfuse_in_onnx(tmp_path, case, builder):
    _, rules_text, shapes = case
    tensors = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
    step = planned_step(tmp_path, rules_text, tensors)
    inputs = [tensors[n] for n in step.inputs]
    assert_bitwise(BUILDERS[builder](step, step.op.apply(inputs)), inputs)


def test_a_wrong_fused_layout_is_not_given_back_as_the_inputs(tmp_path):
    # the check itself can fail: a plain concat of q, k, v is not their interleave
    tensors = {n: random_array(np.random.default_rng(k), (4, 3), np.float32) for k, n in enumerate("abc")}
    step = planned_step(tmp_path, rule("interleave", 'inputs = ["a", "b", "c"]\noutput = "f"\ngroups = 2'), tensors)
    inputs = [tensors[n] for n in step.inputs]
    for builder in BUILDERS.values():
        with pytest.raises(AssertionError, match="differs"):
            assert_bitwise(builder(step, [np.concatenate(inputs)]), inputs)


def test_rename_has_no_onnx_unfuse_the_callers_must_rebind_it_by_name(tmp_path):
    step = planned_step(tmp_path, rule("rename", 'input = "a"\noutput = "b"'), {"a": np.zeros((2,), np.float32)})
    assert not step.op.onnx_unfusable and step.op.renames
    with pytest.raises(NotImplementedError, match="rename"):
        unfuse(GraphBuilder(), step, ["b"])
