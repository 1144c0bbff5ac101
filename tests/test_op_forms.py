"""Every op owns its forms: what an op declares (ClassVars) matches what its methods do.

One example step per registered op kind (a new op without an example fails here first), then,
for each: the ONNX un-fuse recovers the inputs bitwise on onnxruntime, the probe's two graphs
run and agree (and disagree on a wrong fused tensor), the graph fold reaches the export's
rewriter, and the tie / rename / guard flags fit what ``apply`` and ``infer`` do. Last, no
module outside ``fusectl/ops/`` switches on op-kind strings.
"""

from __future__ import annotations

import ast
import glob
from pathlib import Path

import numpy as np
import onnxruntime
import pytest

from fusectl.dtypes import BY_NAME
from fusectl.errors import PlanError
from fusectl.ops import OPS, Op
from fusectl.ops.guard import Refuse
from fusectl.ops.dequantize import Dequantize
from fusectl.ops.layout import (
    BlockDiagonal, BlockDiagonalSplit, Concat, Deinterleave, Drop, Interleave, MergeEqual, Replicate, Rename, Reorder, Reshape, RopePermute, Split, Stack,
    Transpose, Unstack,
)
from fusectl.ops.reparam import BnFold, SpectralNormFold, WeightNormFold, WeightNormUnfold
from fusectl.steps import Step
from fusectl.tensors import ByteRange, TensorSpec
from fusectl.verification.probes import GraphBuilder, _run_probe, build_probe
from fusectl.verification.runner import CPU

ROOT = Path(__file__).resolve().parent.parent


def _data(seed: int, *shapes) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _spectral_example() -> list[np.ndarray]:
    (w, v) = _data(1, (4, 3, 2), (6,))
    mv = w.reshape(4, -1) @ v
    return [w, (mv / np.linalg.norm(mv)).astype(np.float32), v]  # σ = ‖M v‖ > 0


def _bn_example() -> list[np.ndarray]:
    w, b, gamma, beta, mean, var = _data(2, (4, 3, 3, 3), (4,), (4,), (4,), (4,), (4,))
    return [w, b, gamma, beta, mean, np.abs(var) + 0.5]


# one example per op kind: the op and its inputs' data (float32, every element distinct)
EXAMPLES: dict[str, tuple[Op, list[np.ndarray]]] = {
    "rename": (Rename(), _data(3, (3, 4))),
    "drop": (Drop(), _data(4, (3, 4))),
    "concat": (Concat(axis=1), _data(5, (2, 3), (2, 5))),
    "split": (Split(axis=0, sizes=(1, 3), parts=2), _data(6, (4, 3))),
    "interleave": (Interleave(axis=0, groups=2), _data(7, (4, 3), (2, 3))),
    "deinterleave": (Deinterleave(axis=0, groups=2, sizes=(4, 2), parts=2), _data(8, (6, 3))),
    "stack": (Stack(axis=1), _data(9, (2, 3), (2, 3), (2, 3))),
    "unstack": (Unstack(axis=1), _data(10, (2, 3, 4))),
    "transpose": (Transpose(perm=(2, 0, 1)), _data(11, (2, 3, 4))),
    "reshape": (Reshape(shape=(2, 3, 4)), _data(12, (4, 6))),
    "reorder": (Reorder(axis=0, chunks=3, order=(2, 0, 1)), _data(13, (6, 2))),
    "rope_permute": (RopePermute(heads=2, to="hf"), _data(14, (12, 3))),
    "weight_norm_fold": (WeightNormFold(), _data(15, (4, 1, 1), (4, 3, 2))),
    "weight_norm_unfold": (WeightNormUnfold(dim=0), _data(16, (4, 6))),
    "spectral_norm_fold": (SpectralNormFold(dim=0), _spectral_example()),
    "bn_fold": (BnFold(layer="conv"), _bn_example()),
    "refuse": (Refuse(message="not this one"), _data(17, (2,))),
    "merge_equal": (MergeEqual(), _data(18, (2, 1)) * 3),
    "replicate": (Replicate(parts=3), _data(19, (2, 1))),
    "dequantize": (Dequantize(block=(2, 2)), _data(20, (4, 5), (2, 3))),
    "block_diagonal": (BlockDiagonal(), _data(21, (3, 2), (2, 4))),
    "block_diagonal_split": (BlockDiagonalSplit(rows=(3, 2), cols=(2, 4), parts=2),
                             [BlockDiagonal().apply(_data(22, (3, 2), (2, 4)))[0]]),
}
KINDS = sorted(OPS)
F32 = BY_NAME["F32"]


def _specs(arrays) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(F32, a.shape) for a in arrays)


def example_step(kind: str) -> tuple[Step, list[np.ndarray], list[np.ndarray]]:
    """The example's planned step, its inputs' data and its outputs' data."""
    op, arrays = EXAMPLES[kind]
    specs = _specs(arrays)
    names = tuple(f"in{k}" for k in range(len(arrays)))
    out_specs = tuple(op.infer(specs, names))
    outputs = [np.ascontiguousarray(a) for a in op.apply(arrays)]
    assert [(a.dtype, a.shape) for a in outputs] == [(s.dtype.numpy, s.shape) for s in out_specs]
    step = Step(op, names, tuple(f"out{k}" for k in range(len(outputs))), specs, out_specs)
    return step, arrays, outputs


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_op_is_registered_and_has_an_example():
    ops = [c for c in _subclasses(Op) if c.__module__.startswith("fusectl.ops.")]
    assert {c.kind for c in ops} == set(OPS) == set(EXAMPLES)
    for cls in ops:
        assert OPS[cls.kind] is cls
        assert type(EXAMPLES[cls.kind][0]) is cls
        assert not hasattr(cls, "summary"), f"{cls.kind}: summary is dead, nothing reads it"


@pytest.mark.parametrize("kind", KINDS)
def test_onnx_unfuse_recovers_the_inputs_bitwise_where_declared(kind):
    op, arrays = EXAMPLES[kind]
    if op.guard:
        assert not op.onnx_unfusable
        return
    step, inputs, outputs = example_step(kind)
    b = GraphBuilder()
    if not op.onnx_unfusable:
        with pytest.raises(NotImplementedError, match=kind):
            op.onnx_unfuse(b, step.input_specs, step.output_specs, ["f"] * len(outputs))
        return
    inverse = step.inverse()
    assert inverse is not None, f"{kind} un-fuses in ONNX but has no inverse"
    assert all(a.tobytes() == w.tobytes() for a, w in zip(inverse.op.apply(outputs), inputs))
    recovered = op.onnx_unfuse(b, step.input_specs, step.output_specs, [b.const(a, "p") for a in outputs])
    assert len(recovered) == len(inputs)
    for k, value in enumerate(recovered):
        b.output(value, f"y{k}")
    sess = onnxruntime.InferenceSession(b.model(), providers=["CPUExecutionProvider"])
    got = sess.run([f"y{k}" for k in range(len(inputs))], {})
    for g, w in zip(got, inputs):
        assert g.shape == w.shape and g.tobytes() == w.tobytes(), kind


@pytest.mark.parametrize("kind", KINDS)
def test_probed_ops_build_probes_that_onnxruntime_runs(kind):
    op, arrays = EXAMPLES[kind]
    if op.guard:
        assert not op.probed
        return
    step, inputs, outputs = example_step(kind)
    probe = build_probe(step, inputs, outputs, seed=0)
    if not op.probed:
        assert probe is None
        with pytest.raises(NotImplementedError, match=kind):
            op.probe(None, inputs, outputs, step.input_specs, step.output_specs)
        return
    assert probe is not None and probe.feeds
    assert _run_probe(probe, "r", CPU, None, None).passed
    # the probe can fail: a fused tensor off by one everywhere changes the layer's output
    wrong = [outputs[0] + np.float32(1.0)] + outputs[1:]
    assert not _run_probe(build_probe(step, inputs, wrong, seed=0), "r", CPU, None, None).passed


class RecordingRewriter:
    def __init__(self):
        self.calls = []

    def replace_subgraph(self, step, values):
        self.calls.append(("replace_subgraph", step, values))

    def fold_batchnorm(self, step, values):
        self.calls.append(("fold_batchnorm", step, values))


@pytest.mark.parametrize("kind", KINDS)
def test_graph_folds_reach_the_rewriter_where_declared(kind):
    op, arrays = EXAMPLES[kind]
    step = Step(op, (), (), _specs(arrays), ())
    rewriter, values = RecordingRewriter(), ["v0", "v1"]
    if not op.graph_foldable:
        with pytest.raises(NotImplementedError, match=kind):
            op.fold_in_graph(rewriter, step, values)
        return
    assert not op.exact, f"{kind}: an exact op moves bytes; the export rebinds it instead of folding"
    op.fold_in_graph(rewriter, step, values)
    assert [(s, v) for _, s, v in rewriter.calls] == [(step, values)]
    expected = "fold_batchnorm" if isinstance(op, BnFold) else "replace_subgraph"
    assert rewriter.calls[0][0] == expected


@pytest.mark.parametrize("kind", KINDS)
def test_tie_rename_and_guard_flags_fit_what_the_op_does(kind):
    op, arrays = EXAMPLES[kind]
    specs = _specs(arrays)
    names = tuple(f"in{k}" for k in range(len(arrays)))
    if op.guard:
        with pytest.raises(PlanError, match="not this one"):
            op.infer(specs, names)
        assert op.output_count(specs) == 0 and op.outputs_field is None
        assert not (op.renames or op.keeps_ties or op.moves_packed or op.graph_foldable)
        return
    outputs = op.apply(arrays)
    if op.renames:
        # the outputs are the inputs: same array, same bytes, bitwise
        assert op.keeps_ties and op.moves_packed and op.exact
        assert len(outputs) == len(arrays) and all(o is a for o, a in zip(outputs, arrays))
        ranges = (ByteRange("f", 8, specs[0].nbytes),)
        assert op.byte_ranges((ranges,), specs, 0) == ranges
        assert op.inverse(specs).renames
    if op.keeps_ties or op.moves_packed:
        # a tie survives, and packed data moves, only where no element is computed
        assert op.exact and (op.renames or op.output_count(specs) == 0 == len(outputs))
    if not op.gathers_over:
        assert op.inputs_field == "input" and op.outputs_field == "output" and not op.named_inputs
    if op.indexed_over:
        assert op.inputs_field == "inputs" and op.gathers_over


@pytest.mark.parametrize("kind", KINDS)
def test_rule_inverse_problems_are_said_only_by_invertible_ops(kind):
    op, arrays = EXAMPLES[kind]
    problems = [op.rule_inverse_problem(over) for over in (None, "e")]
    if any(problems):
        assert op.inverse(_specs(arrays)) is not None
        assert all(p is None or kind in p for p in problems)


# ------------------------------------------------------------------ no kind switches outside ops/

# the package files that must not switch on op-kind strings: all of it but ops/ itself
KIND_SWITCH_FREE = ("fusectl/**/*.py",)


def _strings(node) -> list[str]:
    """String constants of a literal (and of a tuple / list / set literal, or set(...) of one)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _strings(e)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("set", "frozenset"):
        return [s for a in node.args for s in _strings(a)]
    return []


def _is_op_kind(node) -> bool:
    """``op.kind``, ``step.op.kind``, ``op_cls.kind``: an op's kind read to switch on it."""
    return (isinstance(node, ast.Attribute) and node.attr == "kind"
            and ast.unparse(node.value).split(".")[-1] in ("op", "op_cls", "cls"))


def kind_switches(source: str) -> list[tuple[int, str]]:
    """Where ``source`` switches on op-kind strings: comparisons with a kind name or with an
    op's ``kind``, literals naming two kinds or more (a set of kinds), ``case "kind":``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(s in OPS for side in sides for s in _strings(side)) or any(map(_is_op_kind, sides)):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            elts = node.keys if isinstance(node, ast.Dict) else node.elts
            if sum(s in OPS for e in elts if e is not None for s in _strings(e)) >= 2:
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.MatchValue) and any(s in OPS for s in _strings(node.value)):
            found.append((node.lineno, ast.unparse(node.value)))
    return found


def test_the_kind_switch_finder_finds_them():
    switches = [
        'if step.op.kind == "concat": pass',
        'if kind in ("stack", "unstack") and over is None: pass',
        'ok = r.op.kind != refuse_kind',
        'ok = step.op.kind not in PROBED',
        'PROBED = {"concat", "split"}',
        'FORMS = {"bn_fold": 1, "weight_norm_fold": 2}',
        'match kind:\n    case "reshape": pass',
    ]
    for source in switches:
        assert kind_switches(source), source
    for source in ('if part.kind == "multi": pass', 'if kind not in OPS: pass', 'b.one("Reshape", [x])',
                   'raise PlanError(f"cannot {op.kind} it")', 'x = "concat"'):
        assert not kind_switches(source), source


def test_no_op_kind_switches_outside_ops():
    files = sorted({Path(p) for pattern in KIND_SWITCH_FREE for p in glob.glob(str(ROOT / pattern), recursive=True)})
    files = [f for f in files if "ops" not in f.relative_to(ROOT / "fusectl").parts[:1]]
    assert files
    found = [f"{f.relative_to(ROOT)}:{line}: {text}" for f in files for line, text in kind_switches(f.read_text())]
    assert not found, "ask the op (a ClassVar or method in fusectl/ops/) instead:\n" + "\n".join(found)
