"""Probes: each probed step (``op.probed``), once per distinct shape, run as a small
onnxruntime computation.

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

import struct
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from ..dtypes import BY_NAME, TensorProto, from_numpy
from ..executor import Evaluation, walk
from ..ops.dequantize import expand_scale, scale_grid
from ..followers.scales import QuantScheme, scale_step_of
from ..steps import Plan, Step
from ..table import ParamTable
from ..tensors import TensorSpec, read_ranges
from ..tolerance import default_tolerance
from .byte_ranges import Files, Mapped
from .compare import compare
from .report import Check
from .runner import resolve_provider, run, session

OPSET = 18


# ONNX's protobuf (onnx.proto), the fields a probe uses: the graphs are written here as bytes,
# so that a probe needs neither the onnx package nor what it imports (ml_dtypes), only
# onnxruntime. The bytes are those onnx.helper gives (fields in number order; a test compares).
_ATTR_FLOAT, _ATTR_INT, _ATTR_INTS = 1, 2, 7  # AttributeProto.AttributeType


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # an int64 below zero: its two's complement, ten bytes
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _int(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


def _bytes(field: int, value: bytes | str) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    return _varint(field << 3 | 2) + _varint(len(data)) + data


def _attribute(name: str, value) -> bytes:
    """An AttributeProto the way onnx.helper.make_attribute makes it (int, float, list of ints)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return _bytes(1, name) + _int(3, int(value)) + _int(20, _ATTR_INT)
    if isinstance(value, (float, np.floating)):
        return _bytes(1, name) + _varint(2 << 3 | 5) + struct.pack("<f", value) + _int(20, _ATTR_FLOAT)
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, np.integer)) for v in value):
        return _bytes(1, name) + b"".join(_int(8, int(v)) for v in value) + _int(20, _ATTR_INTS)
    raise TypeError(f"probe attribute {name}: {value!r} is not an int, a float or a list of ints")


def _tensor(array: np.ndarray, name: str) -> bytes:
    """A TensorProto with raw data, as onnx.numpy_helper.from_array makes it."""
    kind = from_numpy(array.dtype, f"probe constant {name}").onnx
    if kind is None:
        raise TypeError(f"probe constant {name}: dtype {array.dtype} has no ONNX type")
    data = (array.byteswap() if array.dtype.byteorder == ">" else array).tobytes()  # little-endian
    return b"".join(_int(1, d) for d in array.shape) + _int(2, kind) + _bytes(8, name) + _bytes(9, data)


def _value_info(name: str, elem_type: int, shape: Sequence[int] | None) -> bytes:
    """A ValueInfoProto of a tensor, as onnx.helper.make_tensor_value_info makes it."""
    tensor = _int(1, elem_type)
    if shape is not None:
        tensor += _bytes(2, b"".join(_bytes(1, _int(1, d)) for d in shape))
    return _bytes(1, name) + _bytes(2, _bytes(1, tensor))


@dataclass
class GraphBuilder:
    """A tiny graph builder: named values, nodes, float32 initializers; ``model`` serializes."""

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
        self.initializers.append(_tensor(np.asarray(array), name))
        return name

    def ints(self, values: Sequence[int]) -> str:
        return self.const(np.asarray(list(values), np.int64), "shape")

    def node(self, op: str, inputs: Sequence[str], n_out: int = 1, **attrs) -> list[str]:
        outs = [self.fresh(op.lower()) for _ in range(n_out)]
        self._node(op, inputs, outs, attrs)
        return outs

    def _node(self, op: str, inputs: Sequence[str], outputs: Sequence[str], attrs: dict) -> None:
        # a NodeProto as onnx.helper.make_node makes it: attributes sorted by name
        self.nodes.append(b"".join(_bytes(1, v) for v in inputs) + b"".join(_bytes(2, v) for v in outputs)
                          + _bytes(4, op) + b"".join(_bytes(5, _attribute(k, v))
                                                     for k, v in sorted(attrs.items()) if v is not None))

    def one(self, op: str, inputs: Sequence[str], **attrs) -> str:
        return self.node(op, inputs, 1, **attrs)[0]

    def input(self, name: str, shape: Sequence[int]) -> str:
        self.inputs.append(_value_info(name, TensorProto.FLOAT, list(shape)))
        return name

    def output(self, value: str, name: str, spec: TensorSpec | None = None) -> None:
        """``value`` as the graph output ``name``: float32 of any shape, or of ``spec``."""
        self._node("Identity", [value], [name], {})
        self.outputs.append(_value_info(name, TensorProto.FLOAT, None) if spec is None
                            else _value_info(name, spec.dtype.onnx, list(spec.shape)))

    def model(self) -> bytes:
        """The ModelProto's bytes (IR version 8, opset ``OPSET``)."""
        graph = (b"".join(_bytes(1, n) for n in self.nodes) + _bytes(2, "probe")
                 + b"".join(_bytes(5, t) for t in self.initializers)
                 + b"".join(_bytes(11, v) for v in self.inputs) + b"".join(_bytes(12, v) for v in self.outputs))
        return _int(1, 8) + _bytes(7, graph) + _bytes(8, _bytes(1, "") + _int(2, OPSET))


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


@dataclass(frozen=True)
class Probe:
    label: str
    reference: bytes
    candidate: bytes
    feeds: dict
    tolerance: tuple[float, float]


@dataclass
class ProbeGraphs:
    """The two graphs of one probe, as an op's ``probe`` fills them: the reference computes
    from the unfused tensors, the candidate from the fused ones, on the same random inputs."""

    rng: np.random.Generator
    ref: GraphBuilder = field(default_factory=GraphBuilder)
    cand: GraphBuilder = field(default_factory=GraphBuilder)
    feeds: dict = field(default_factory=dict)

    def param(self, b: GraphBuilder, array: np.ndarray) -> str:
        """A parameter as a float32 initializer of ``b`` (exact for fp16, bf16 and fp8)."""
        return b.const(_f32(array), "p")

    def input(self, name: str, shape: Sequence[int]) -> str:
        """A seeded N(0, 1) input of both graphs."""
        self.feeds[name] = self.rng.standard_normal(list(shape)).astype(np.float32)
        for b in (self.ref, self.cand):
            b.input(name, shape)
        return name

    def output(self, name: str, ref_value: str, cand_value: str) -> None:
        """Outputs the two graphs must agree on."""
        self.ref.output(ref_value, name)
        self.cand.output(cand_value, name)

    def readouts(self, k: int, ref_value: str, cand_value: str, shape: Sequence[int]) -> None:
        """The probe layer (``readout``) on a parameter of ``shape``, as each graph has it."""
        x = self.input(f"x{k}", [2, readout_width(shape)])
        self.output(f"y{k}", readout(self.ref, ref_value, shape, x), readout(self.cand, cand_value, shape, x))


def build_probe(step: Step, before: list[np.ndarray], after: list[np.ndarray], seed: int,
                specs: tuple[Sequence[TensorSpec], Sequence[TensorSpec]] | None = None) -> Probe | None:
    """The probe of ``step`` (None when its op is not probed or a tensor is not float):
    ``before`` are its inputs' data, ``after`` its outputs'; ``specs`` (inputs', outputs') when
    they are a window of the step's tensors (``column_window``)."""
    op = step.op
    if not op.probed or not all(s.dtype.is_float for s in step.input_specs + step.output_specs):
        return None
    graphs = ProbeGraphs(np.random.default_rng(seed))
    label = f"{op.kind} {', '.join(str(s) for s in step.input_specs)} -> {', '.join(str(s) for s in step.output_specs)}"
    dtype = step.output_specs[0].dtype if not op.exact else None
    tolerance = default_tolerance(dtype.numpy) if dtype else default_tolerance(np.float32)
    op.probe(graphs, before, after, *(specs or (step.input_specs, step.output_specs)))
    return Probe(label, graphs.ref.model(), graphs.cand.model(), graphs.feeds, tolerance)


PROBE_COLUMNS = 64  # columns of each tensor a step that moves whole rows is probed on


def column_window(step: Step) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]] | None:
    """The specs of the first ``PROBE_COLUMNS`` columns of the step's tensors (each seen as
    rows x columns), when the step only moves whole rows and its tensors are wider: it commutes
    with taking those columns, so the probe needs a slice of each tensor, not all of it."""
    if not step.op.moves_rows(step.input_specs) or readout_width(step.input_specs[0].shape) <= PROBE_COLUMNS:
        return None

    def window(specs):
        return tuple(TensorSpec(s.dtype, (s.shape[0], PROBE_COLUMNS)) for s in specs)

    return window(step.input_specs), window(step.output_specs)


def _columns(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array.reshape(array.shape[0], -1)[:, :PROBE_COLUMNS])


def run_probes(plan: Plan, reference: ParamTable, candidate: ParamTable, provider: str,
               seed: int, atol: float | None, rtol: float | None,
               scheme: QuantScheme = QuantScheme()) -> tuple[list[Check], str]:
    """One probe per distinct (op, specs); returns the checks and the provider used.

    A step of quantized weights whose scales move beside it (``followers.scales``) is probed once
    more on the dequantized tensors: w · s of each part against w · s of the fused weight,
    un-fused in ONNX, so a scale moved apart from its rows changes the layer's output."""
    chosen = resolve_provider(provider)
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
    for (group, before, after), consumed_later in zip(walk(reference, plan, "probes"), consumed_after):
        for step in group.steps:
            key = (step.op, step.input_specs, step.output_specs)
            if key in seen or not step.op.probed:
                continue
            seen.add(key)
            # fused side from the candidate where it holds the step's outputs as written
            source = candidate if all(n in final_names and n not in consumed_later for n in step.outputs) else after
            ins = [before[n] for n in step.inputs]
            outs = [source[n] for n in step.outputs]
            window = column_window(step)
            # each tensor is cut to the window as it is read: one whole tensor held at a time
            m_in, m_out = Evaluation(ins), Evaluation(outs)
            probe = build_probe(step, [_probe_data(m_in, t, window is not None) for t in ins],
                                [_probe_data(m_out, t, window is not None) for t in outs], seed, window)
            if probe is None:
                continue
            check = _run_probe(probe, group.describe(), chosen, atol, rtol)
            if window:
                check = replace(check, detail=f"columns 0..{PROBE_COLUMNS - 1} of "
                                              f"{readout_width(step.input_specs[0].shape)}: the step moves whole rows")
            checks.append(check)
            scaled = scale_step_of(step, group.steps)
            if scaled is not None:
                s_ins = [before[n] for n in scaled.inputs]
                s_outs = [source[n] for n in scaled.outputs]
                dequantized = build_probe(
                    step, [_dequantized(m_in.array(w), s.read(), scheme, window) for w, s in zip(ins, s_ins)],
                    [_dequantized(m_out.array(w), s.read(), scheme, window) for w, s in zip(outs, s_outs)],
                    seed, window)
                if dequantized is not None:
                    checks.append(_run_probe(replace(dequantized, label=f"dequantized {dequantized.label} "
                                                     f"with {scaled.op.kind} of its scales"),
                                             group.describe(), chosen, atol, rtol))
    return checks, chosen


_BF16, _U16 = BY_NAME["BF16"], BY_NAME["U16"]


def _probe_data(evaluation: Evaluation, tensor, windowed: bool) -> np.ndarray:
    """The data of ``tensor``, cut to the probe's column window when ``windowed``. A bf16 tensor
    held as file ranges is read as its bits and widened to float32 here, which is exact (bf16 is
    the top half of a float32) and what the graph's initializer holds anyway: the probe then
    needs no ml_dtypes. Cut from one file range (bf16, or a dtype numpy has itself), only the
    window is copied out of the page cache."""
    dtype = tensor.spec.dtype
    bf16 = dtype == _BF16
    own = dtype.numpy_type.startswith("numpy.") and not dtype.packed  # no ml_dtypes type needed
    ranges = tensor.byte_ranges() if bf16 or (windowed and own) else None
    if ranges is None:
        array = evaluation.array(tensor)
        return _columns(array) if windowed else array
    spec = TensorSpec(_U16, tensor.spec.shape) if bf16 else tensor.spec
    data = _mapped_columns(ranges, spec) if windowed else None
    if data is None:
        data = read_ranges(ranges, spec)
        data = _columns(data) if windowed else data
    return (data.astype(np.uint32) << 16).view(np.float32) if bf16 else data


def _mapped_columns(ranges, spec: TensorSpec) -> np.ndarray | None:
    """The probe's columns of a tensor held as one file range, copied from a read-only mapping
    of it (the rows in between are never copied); None for several ranges, an empty tensor or a
    file that cannot be mapped; CheckpointError naming a file shorter than the range."""
    if len(ranges) != 1 or not ranges[0].length:  # (a mapping of length 0 would be the whole file)
        return None
    r = ranges[0]
    files = Files()
    try:
        mapped = Mapped(files.check(r.path, r.offset, r.length), r.offset, r.length)
    except (OSError, ValueError):
        return None
    finally:
        files.close()
    try:  # np.array copies even where the columns are all of it: nothing may keep the mapping
        return np.array(_columns(mapped.array.view(spec.dtype.numpy).reshape(spec.shape)))
    finally:
        mapped.close()


def _dequantized(weight: np.ndarray, scale: np.ndarray, scheme: QuantScheme, window) -> np.ndarray:
    """w · s in float32 (the scale broadcast over its blocks), computed only on the probe's
    column window when there is one (the weight is a matrix then: the step moves rows)."""
    grid = scale_grid(weight.shape, scale.shape, scheme.block)
    if window:
        weight = _columns(weight)
        step = grid[-1]
        if step is not None and scale.ndim == weight.ndim:
            scale = scale[..., : -(-PROBE_COLUMNS // step)]
    return weight.astype(np.float32) * expand_scale(scale.astype(np.float32), weight.shape, grid)


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

