"""Probes: each step kind, once per distinct shape, run as a small onnxruntime computation.

The reference side is the *layer* computed from the unfused parameters; the candidate side is
the same layer computed from the fused parameters, with the un-fusing expressed in ONNX ops
(Split, Reshape, Transpose, Gather, ...) or, for numeric folds, the reparametrization computed
by ONNX (ReduceSumSquare, BatchNormalization, ...). A wrong fuse changes the layer's output
even when every tensor has the right name and shape.

The "layer" for a parameter T is a linear readout: ``x @ T.reshape(T.shape[0], -1).T`` for
T with 2 or more dimensions, ``x * T`` for a vector or scalar; x is seeded N(0, 1).
Parameters enter the graphs as float32 (exact for fp16/bf16/fp8); non-float tensors are not
probed (their layout is checked bitwise tensor by tensor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from ..execute import Materializer
from ..ops.reparam import SpectralNormFold, weight_norm_dim
from ..onnx.unfuse import unfuse_in_onnx
from ..plan import Plan, Planner, Step
from ..table import ParamTable
from .compare import compare, default_tolerance
from .report import Check
from .runner import resolve_provider, run, session

OPSET = 18
PROBED = {"concat", "split", "interleave", "deinterleave", "stack", "unstack", "transpose",
          "reshape", "reorder", "rope_permute", "weight_norm_fold", "weight_norm_unfold",
          "spectral_norm_fold", "bn_fold"}


@dataclass
class GraphBuilder:
    """A tiny helper over onnx.helper: named values, nodes, float32 initializers."""

    nodes: list = field(default_factory=list)
    initializers: list = field(default_factory=list)
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    count: int = 0

    def fresh(self, stem: str) -> str:
        self.count += 1
        return f"{stem}_{self.count}"

    def const(self, array: np.ndarray, stem: str = "c") -> str:
        name = self.fresh(stem)
        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def ints(self, values: Sequence[int]) -> str:
        return self.const(np.asarray(list(values), np.int64), "shape")

    def node(self, op: str, inputs: Sequence[str], n_out: int = 1, **attrs) -> list[str]:
        outs = [self.fresh(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, list(inputs), outs, **attrs))
        return outs

    def one(self, op: str, inputs: Sequence[str], **attrs) -> str:
        return self.node(op, inputs, 1, **attrs)[0]

    def input(self, name: str, shape: Sequence[int]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape)))
        return name

    def output(self, value: str, name: str) -> None:
        self.nodes.append(helper.make_node("Identity", [value], [name]))
        self.outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))

    def model(self) -> bytes:
        graph = helper.make_graph(self.nodes, "probe", self.inputs, self.outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = 8
        return model.SerializeToString()


def _f32(array: np.ndarray) -> np.ndarray:
    return np.asarray(array).astype(np.float32)


def readout(b: GraphBuilder, value: str, shape: Sequence[int], x: str) -> str:
    """The probe layer on a parameter value of ``shape`` (x: [2, features])."""
    if len(shape) >= 2:
        # the width spelled out, not -1: ONNX cannot infer -1 beside a zero (an empty tensor)
        flat = b.one("Reshape", [value, b.ints([shape[0], readout_width(shape)])], allowzero=1)
        return b.one("MatMul", [x, b.one("Transpose", [flat], perm=[1, 0])])
    return b.one("Mul", [x, value])


def readout_width(shape: Sequence[int]) -> int:
    if len(shape) >= 2:
        return int(np.prod(shape[1:]))
    return shape[0] if shape else 1


def weight_norm_in_onnx(b: GraphBuilder, g: str, v: str, v_shape, dim: int | None) -> str:
    axes = [a for a in range(len(v_shape)) if a != dim] if dim is not None else list(range(len(v_shape)))
    norm = b.one("Sqrt", [b.one("ReduceSumSquare", [v, b.ints(axes)], keepdims=1 if dim is not None else 0)])
    return b.one("Mul", [v, b.one("Div", [g, norm])])


@dataclass(frozen=True)
class Probe:
    label: str
    reference: bytes
    candidate: bytes
    feeds: dict
    tolerance: tuple[float, float]


def build_probe(step: Step, before: list[np.ndarray], after: list[np.ndarray], seed: int) -> Probe | None:
    kind = step.op.kind
    if kind not in PROBED or not all(s.dtype.is_float for s in step.input_specs + step.output_specs):
        return None
    rng = np.random.default_rng(seed)
    ref, cand = GraphBuilder(), GraphBuilder()
    feeds: dict[str, np.ndarray] = {}
    label = f"{kind} {', '.join(str(s) for s in step.input_specs)} -> {', '.join(str(s) for s in step.output_specs)}"
    numeric = not step.op.exact
    dtype = step.output_specs[0].dtype if numeric else None
    tolerance = default_tolerance(dtype.numpy) if dtype else default_tolerance(np.float32)

    def x_for(shape, k):
        name = f"x{k}"
        feeds[name] = rng.standard_normal((2, readout_width(shape))).astype(np.float32)
        for b in (ref, cand):
            b.input(name, [2, readout_width(shape)])
        return name

    if kind == "bn_fold":
        return _bn_probe(step, before, after, label, tolerance, rng)
    if kind in ("weight_norm_fold", "spectral_norm_fold"):
        w_shape = step.output_specs[0].shape
        x = x_for(w_shape, 0)
        if kind == "weight_norm_fold":
            g, v = (ref.const(_f32(a), "p") for a in before)
            dim = weight_norm_dim(step.input_specs[0].shape, w_shape, "g", "v")
            w = weight_norm_in_onnx(ref, g, v, w_shape, dim)
        else:
            w, u, v = (ref.const(_f32(a), "p") for a in before)
            dims = step.op.candidate_dims(w_shape, step.input_specs[1].shape, step.input_specs[2].shape, ("w", "u", "v"))
            dim = dims[0] if len(dims) == 1 else SpectralNormFold._consistent(*(_f32(a) for a in before), dims)[0]
            perm = [dim] + [a for a in range(len(w_shape)) if a != dim]
            m = ref.one("Reshape", [ref.one("Transpose", [w], perm=perm), ref.ints([w_shape[dim], -1])])
            sigma = ref.one("ReduceSum", [ref.one("Mul", [u, ref.one("MatMul", [m, v])])], keepdims=0)
            w = ref.one("Div", [w, sigma])
        ref.output(readout(ref, w, w_shape, x), "y0")
        cand.output(readout(cand, cand.const(_f32(after[0]), "p"), w_shape, x), "y0")
    elif kind == "weight_norm_unfold":
        w_shape = step.input_specs[0].shape
        x = x_for(w_shape, 0)
        ref.output(readout(ref, ref.const(_f32(before[0]), "p"), w_shape, x), "y0")
        g, v = (cand.const(_f32(a), "p") for a in after)
        dim = weight_norm_dim(step.output_specs[0].shape, w_shape, "g", "v")
        cand.output(readout(cand, weight_norm_in_onnx(cand, g, v, w_shape, dim), w_shape, x), "y0")
    else:
        fused = [cand.const(_f32(a), "p") for a in after]
        recovered = unfuse_in_onnx(cand, step, fused)
        for k, (array, spec) in enumerate(zip(before, step.input_specs)):
            x = x_for(spec.shape, k)
            ref.output(readout(ref, ref.const(_f32(array), "p"), spec.shape, x), f"y{k}")
            cand.output(readout(cand, recovered[k], spec.shape, x), f"y{k}")
    return Probe(label, ref.model(), cand.model(), feeds, tolerance)


def _bn_probe(step: Step, before, after, label, tolerance, rng) -> Probe:
    op = step.op
    arrays = [_f32(a) for a in before]
    if not op.has_bias:
        arrays.insert(1, None)
    w, bias, gamma, beta, mean, var = arrays
    ref, cand = GraphBuilder(), GraphBuilder()
    spatial = len(w.shape) - 2
    if op.layer == "linear":
        x_shape = [2, w.shape[1]]
        layer, attrs = "Gemm", {"transB": 1}
    elif op.layer == "conv":
        x_shape = [1, w.shape[1]] + [k + 2 for k in w.shape[2:]]
        layer, attrs = "Conv", {}
    else:
        x_shape = [1, w.shape[0]] + [3] * spatial
        layer, attrs = "ConvTranspose", {"group": op.groups}
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32)}
    for b in (ref, cand):
        b.input("x", x_shape)
    ins = ["x", ref.const(w)] + ([ref.const(bias)] if bias is not None else [])
    y = ref.one(layer, ins, **attrs)
    y = ref.one("BatchNormalization", [y] + [ref.const(a) for a in (gamma, beta, mean, var)], epsilon=op.eps)
    ref.output(y, "y")
    w2, b2 = (_f32(a) for a in after)
    cand.output(cand.one(layer, ["x", cand.const(w2), cand.const(b2)], **attrs), "y")
    return Probe(label, ref.model(), cand.model(), feeds, tolerance)


def run_probes(plan: Plan, reference: ParamTable, candidate: ParamTable, provider: str,
               seed: int, atol: float | None, rtol: float | None) -> tuple[list[Check], str]:
    """One probe per distinct (op, specs); returns the checks and the provider used."""
    chosen = resolve_provider(provider)
    planner = Planner(reference.copy(), untie=True)
    final_names = set(candidate.names())
    # names a later group consumes are intermediate: the candidate does not hold them
    consumed_after: list[set[str]] = []
    later: set[str] = set()
    for group in reversed(plan.groups):
        consumed_after.append(set(later))
        later |= {n for s in group.steps for n in s.inputs}
    consumed_after.reverse()
    seen: set = set()
    checks: list[Check] = []
    for group, consumed_later in zip(plan.groups, consumed_after):
        before = planner.table.copy()
        planner.apply_group(group)
        after = planner.table
        for step in group.steps:
            key = (step.op, step.input_specs, step.output_specs)
            if key in seen or step.op.kind not in PROBED:
                continue
            seen.add(key)
            # fused side from the candidate where it holds the step's outputs as written
            source = candidate if all(n in final_names and n not in consumed_later for n in step.outputs) else after
            ins = [before[n] for n in step.inputs]
            outs = [source[n] for n in step.outputs]
            m_in, m_out = Materializer(ins), Materializer(outs)
            probe = build_probe(step, [m_in.array(t) for t in ins], [m_out.array(t) for t in outs], seed)
            if probe is None:
                continue
            checks.append(_run_probe(probe, group.describe(), chosen, atol, rtol))
    return checks, chosen


def _run_probe(probe: Probe, where: str, provider: str, atol, rtol) -> Check:
    ref = run(session(probe.reference, provider, f"probe {probe.label} (reference)"), probe.feeds, "probe")
    cand = run(session(probe.candidate, provider, f"probe {probe.label} (candidate)"), probe.feeds, "probe")
    p_atol, p_rtol = probe.tolerance
    worst = None
    for name in sorted(ref):
        result = compare(f"{probe.label} {name}", ref[name], cand[name],
                         p_atol if atol is None else atol, p_rtol if rtol is None else rtol)
        if worst is None or (not result.passed and worst.passed) or result.max_abs > worst.max_abs:
            worst = result
    return Check("probe", f"{where}: {probe.label}", worst.passed, worst)

