"""Layout ops: they move bytes, so they are exact for every dtype and invert bitwise."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Sequence

import numpy as np

from ..errors import ComputeError, PlanError, option, option_name, quote
from ..limits import check_limit
from ..tensors import ByteRange, TensorSpec
from .base import Op, RowMover, leading_ones, normalize_axis, same_dtype
from . import onnx_forms


def slice_ranges(ranges: Sequence[ByteRange], start: int, length: int) -> tuple[ByteRange, ...]:
    """Bytes ``start .. start+length`` of the concatenation of ``ranges``."""
    out: list[ByteRange] = []
    pos = 0
    for r in ranges:
        lo, hi = max(start, pos), min(start + length, pos + r.length)
        if lo < hi:
            out.append(ByteRange(r.path, r.offset + lo - pos, hi - lo))
        pos += r.length
    return tuple(out)


def _declared_sizes(op: Op) -> tuple[int, ...]:
    if op.sizes is None:
        raise PlanError(f"{op.kind} without sizes cannot be undone from the rule alone; add "
                        f"sizes = [...] to the rule or unfuse with the provenance instead of {option_name('rules')}")
    return op.sizes


def _non_negative(sizes: Sequence[int], name: str) -> None:
    if any(s < 0 for s in sizes):
        raise PlanError(f"{name!r}: sizes {list(sizes)} must not be negative")


def _equal_sizes(total: int, parts: int, name: str, what: str) -> tuple[int, ...]:
    check_limit("chunks", parts, f"{quote(name)}: {what}", PlanError)
    if parts <= 0 or total % parts:
        raise PlanError(f"{name!r}: length {total} along the {what} does not split into {parts} equal parts")
    return (total // parts,) * parts


def _explicit_list_problem(op: Op, over: str | None) -> str | None:
    """A stack or unstack rule names its index by ``over``; over an explicit list it cannot be
    inverted from the rule (the inverse would have to name each tensor)."""
    if over is not None:
        return None
    return (f"a {op.kind} over an explicit list cannot be undone from the rule alone; "
            "use over = \"placeholder\" or unfuse with the provenance")


@dataclasses.dataclass(frozen=True)
class Rename(Op):
    """A new name for a tensor, same data.

    Rule keys: ``op = "rename"``, ``input``, ``output``. The output IS the input (same bytes, any
    dtype, packed ones included), so a tie group renamed member by member stays tied. Refuses
    nothing. Inverse: ``rename`` back (output to input).

    >>> Rename().apply([np.arange(3)])[0].tolist()
    [0, 1, 2]
    >>> Rename().inverse(None)
    Rename()

    Rule::

        [[rule]]
        op     = "rename"
        input  = "{p*}.mlp.gate.weight"
        output = "{p*}.block_sparse_moe.gate.weight"
    """

    kind: ClassVar[str] = "rename"
    renames: ClassVar[bool] = True
    keeps_ties: ClassVar[bool] = True
    moves_packed: ClassVar[bool] = True

    def infer(self, specs, names):
        return [specs[0]]

    def apply(self, arrays):
        return [arrays[0]]

    def inverse(self, specs):
        return Rename()

    def lift(self, lift):
        lift.rename()

    def byte_ranges(self, ranges, specs, index):
        return ranges[0]


@dataclasses.dataclass(frozen=True)
class Drop(Op):
    """Removes a tensor from the output (e.g. a BatchNorm's ``num_batches_tracked``).

    Rule keys: ``op = "drop"``, ``input``; no output key. Takes any dtype, packed ones included,
    and never breaks a tie. Inverse: none (one-way:
    ``unfuse`` fails naming the rule).

    >>> Drop().apply([np.ones(2)])
    []
    >>> Drop().inverse(None) is None
    True

    Rule::

        [[rule]]
        op       = "drop"
        input    = "{p*}.bn{n:int}.num_batches_tracked"
        optional = true
    """

    kind: ClassVar[str] = "drop"
    keeps_ties: ClassVar[bool] = True
    moves_packed: ClassVar[bool] = True
    outputs_field: ClassVar[str | None] = None

    def infer(self, specs, names):
        return []

    def output_count(self, specs):
        return 0

    def lift(self, lift):
        lift.drop()

    def apply(self, arrays):
        return []


@dataclasses.dataclass(frozen=True)
class Concat(RowMover, Op):
    """Joins tensors along ``axis``, in the order the rule lists them.

    Rule keys: ``op = "concat"``, ``inputs`` (a list of patterns) or ``input`` with
    ``over = "k"`` (every binding of ``{k}`` gathered, in numeric order when they are numbers), ``output``,
    ``axis`` (default 0), ``sizes`` (optional: each input's length along ``axis``, ints or var
    names, checked at plan time). The output holds input 0, then input 1, … along ``axis``.
    Refuses inputs of different dtypes, inputs that differ on any other axis, an axis out of range,
    and ``sizes`` that do not match the inputs. Inverse: ``split`` with each input's recorded
    length; undoing the rule alone (``unfuse -r``) needs ``sizes`` and is refused for ``over``.

    >>> Concat(axis=0).apply([np.ones((1, 2)), np.zeros((1, 2))])[0].tolist()
    [[1.0, 1.0], [0.0, 0.0]]
    >>> Concat(axis=0, sizes=(1, 2)).inverse(None)
    Split(axis=0, sizes=(1, 2), parts=2)

    Rule::

        [[rule]]
        op     = "concat"
        inputs = ["{p*}.q_proj.weight", "{p*}.k_proj.weight", "{p*}.v_proj.weight"]
        output = "{p*}.qkv_proj.weight"
        axis   = 0
    """

    kind: ClassVar[str] = "concat"
    onnx_unfusable: ClassVar[bool] = True
    probed: ClassVar[bool] = True
    inputs_field: ClassVar[str] = "inputs"
    axis: int = 0
    sizes: tuple[int, ...] | None = None

    def infer(self, specs, names):
        same_dtype(specs, names)
        ndim = len(specs[0].shape)
        axis = normalize_axis(self.axis, ndim, names[0])
        for spec, name in zip(specs, names):
            if len(spec.shape) != ndim or any(
                a != b for k, (a, b) in enumerate(zip(spec.shape, specs[0].shape)) if k != axis
            ):
                raise PlanError(
                    f"{name!r} has shape {list(spec.shape)} but {names[0]!r} has "
                    f"{list(specs[0].shape)}; they must agree on every axis but {axis}"
                )
        if self.sizes is not None:
            _non_negative(self.sizes, names[0])
            if len(self.sizes) != len(specs):
                raise PlanError(f"sizes {list(self.sizes)} name {len(self.sizes)} parts but there are {len(specs)} inputs")
            for size, spec, name in zip(self.sizes, specs, names):
                if spec.shape[axis] != size:
                    raise PlanError(
                        f"{name!r} has length {spec.shape[axis]} along axis {axis}, "
                        f"but the rule's sizes say {size}"
                    )
        shape = list(specs[0].shape)
        shape[axis] = sum(s.shape[axis] for s in specs)
        return [TensorSpec(specs[0].dtype, tuple(shape))]

    def apply(self, arrays):
        return [np.concatenate(arrays, axis=self.axis)]

    def inverse(self, specs):
        if specs is None:
            return Split(axis=self.axis, sizes=_declared_sizes(self), parts=len(self.sizes))
        axis = self.op_axis(len(specs[0].shape))
        return Split(axis=self.axis, sizes=tuple(s.shape[axis] for s in specs), parts=len(specs))

    def rule_inverse_problem(self, over):
        if over is None:
            return None
        return (f"a concat over {{{over}}} cannot be undone from the rule alone; "
                f"unfuse with the provenance instead of {option_name('rules')}")

    def onnx_unfuse(self, b, input_specs, output_specs, fused):
        axis = self.op_axis(len(input_specs[0].shape))
        sizes = [s.shape[axis] for s in input_specs]
        return b.node("Split", [fused[0], b.ints(sizes)], len(input_specs), axis=axis)

    def lift(self, lift):
        axis = self.op_axis(lift.ndim)  # the scale may have fewer axes: a normalized axis
        lift.along(axis, lambda in_lengths, out_lengths: Concat(axis=axis))

    def byte_ranges(self, ranges, specs, index):
        if not leading_ones(specs[0].shape, self.op_axis(len(specs[0].shape))):
            return None
        return tuple(r for rs in ranges for r in rs)


@dataclasses.dataclass(frozen=True)
class Split(RowMover, Op):
    """Cuts a tensor along ``axis`` into consecutive parts, one per output.

    Rule keys: ``op = "split"``, ``input``, ``outputs`` (a list of patterns), ``axis`` (default 0),
    ``sizes`` (optional: one length per output, ints or var names; omitted = equal parts). The
    number of parts is the number of outputs (``parts`` is never written). Output k holds the k-th
    run of ``sizes[k]`` slabs along ``axis``. Refuses sizes that do not add up to the input's
    length, negative sizes, a length that does not divide into equal parts, and (at load) a
    ``sizes`` whose count differs from the outputs'. Inverse: ``concat`` along the same axis.

    >>> [p.tolist() for p in Split(axis=0, sizes=(1, 2), parts=2).apply([np.arange(3)])]
    [[0], [1, 2]]
    >>> [p.tolist() for p in Split(axis=0, parts=2).apply([np.arange(4)])]
    [[0, 1], [2, 3]]

    Rule::

        [[rule]]
        op      = "split"
        input   = "{p*}.mlp.gate_up_proj.weight"
        outputs = ["{p*}.mlp.gate_proj.weight", "{p*}.mlp.up_proj.weight"]
        axis    = 0
    """

    kind: ClassVar[str] = "split"
    onnx_unfusable: ClassVar[bool] = True
    probed: ClassVar[bool] = True
    outputs_field: ClassVar[str] = "outputs"
    axis: int = 0
    sizes: tuple[int, ...] | None = None
    parts: int = 0

    def _sizes(self, spec: TensorSpec, name: str) -> tuple[int, ...]:
        axis = normalize_axis(self.axis, len(spec.shape), name)
        if self.sizes is None:
            return _equal_sizes(spec.shape[axis], self.parts, name, f"axis {axis}")
        _non_negative(self.sizes, name)
        if sum(self.sizes) != spec.shape[axis]:
            raise PlanError(
                f"{name!r} has length {spec.shape[axis]} along axis {axis}, "
                f"but sizes {list(self.sizes)} add up to {sum(self.sizes)}"
            )
        return self.sizes

    def output_count(self, specs):
        return self.parts

    def infer(self, specs, names):
        axis = normalize_axis(self.axis, len(specs[0].shape), names[0])
        out = []
        for size in self._sizes(specs[0], names[0]):
            shape = list(specs[0].shape)
            shape[axis] = size
            out.append(TensorSpec(specs[0].dtype, tuple(shape)))
        return out

    def apply(self, arrays):
        bounds = np.cumsum(self.sizes or (arrays[0].shape[self.axis] // self.parts,) * self.parts)[:-1]
        return list(np.split(arrays[0], bounds, axis=self.axis))

    def inverse(self, specs):
        return Concat(axis=self.axis)

    def onnx_unfuse(self, b, input_specs, output_specs, fused):
        return [b.one("Concat", fused, axis=self.op_axis(len(input_specs[0].shape)))]

    def lift(self, lift):
        axis = self.op_axis(lift.ndim)
        lift.along(axis, lambda in_lengths, out_lengths: Split(axis=axis, sizes=tuple(out_lengths), parts=self.parts))

    def byte_ranges(self, ranges, specs, index):
        spec = specs[0]
        axis = self.op_axis(len(spec.shape))
        if not leading_ones(spec.shape, axis):
            return None
        sizes = self._sizes(spec, "")
        row = spec.nbytes // spec.shape[axis] if spec.shape[axis] else 0
        return slice_ranges(ranges[0], sum(sizes[:index]) * row, sizes[index] * row)


@dataclasses.dataclass(frozen=True)
class Interleave(RowMover, Op):
    """Joins tensors group by group: the per-head ``[q, k, v]`` of MXNet, GPT-NeoX and Bloom.

    Rule keys: ``op = "interleave"``, ``inputs`` (a list) or ``input`` with ``over``, ``output``,
    ``axis`` (default 0), ``groups`` (default 1; e.g. ``groups = "heads"``, or ``"kv_heads"``
    for per-KV-group ``[q…, k, v]``), ``sizes`` (optional, as ``concat``'s). Each input is cut
    into ``groups`` equal chunks along ``axis``; the output is chunk 0 of every input, then chunk
    1 of every input, … Refuses what ``concat`` refuses, and an input whose length along ``axis``
    does not divide into ``groups``. Inverse: ``deinterleave`` with the same groups and the inputs'
    recorded lengths (from the rule alone it needs ``sizes``).

    >>> Interleave(axis=0, groups=2).apply([np.array([0, 1]), np.array([10, 11])])[0].tolist()
    [0, 10, 1, 11]

    Rule::

        [[rule]]
        op     = "interleave"
        inputs = ["{p*}.query.weight", "{p*}.key.weight", "{p*}.value.weight"]
        output = "{p*}.qkv.weight"
        groups = 4
    """

    kind: ClassVar[str] = "interleave"
    onnx_unfusable: ClassVar[bool] = True
    probed: ClassVar[bool] = True
    inputs_field: ClassVar[str] = "inputs"
    axis: int = 0
    groups: int = 1
    sizes: tuple[int, ...] | None = None

    def infer(self, specs, names):
        (out,) = Concat(axis=self.axis, sizes=self.sizes).infer(specs, names)
        axis = self.op_axis(len(out.shape))
        for spec, name in zip(specs, names):
            _equal_sizes(spec.shape[axis], self.groups, name, f"axis {axis} ({self.groups} groups)")
        return [out]

    def apply(self, arrays):
        axis = self.op_axis(arrays[0].ndim)
        chunks = [np.split(a, self.groups, axis=axis) for a in arrays]
        return [np.concatenate([c[g] for g in range(self.groups) for c in chunks], axis=axis)]

    def inverse(self, specs):
        if specs is None:
            return Deinterleave(axis=self.axis, groups=self.groups,
                                sizes=_declared_sizes(self), parts=len(self.sizes))
        axis = self.op_axis(len(specs[0].shape))
        return Deinterleave(axis=self.axis, groups=self.groups,
                            sizes=tuple(s.shape[axis] for s in specs), parts=len(specs))

    def lift(self, lift):
        axis = self.op_axis(lift.ndim)
        lift.along(axis, lambda in_lengths, out_lengths: Interleave(axis=axis, groups=self.groups))

    def onnx_unfuse(self, b, input_specs, output_specs, fused):
        axis = self.op_axis(len(input_specs[0].shape))
        per = [s.shape[axis] // self.groups for s in input_specs]
        shape = list(output_specs[0].shape)
        grouped = onnx_forms.reshape(b, fused[0], shape[:axis] + [self.groups, sum(per)] + shape[axis + 1:])
        parts = b.node("Split", [grouped, b.ints(per)], len(input_specs), axis=axis + 1)
        return [onnx_forms.reshape(b, p, s.shape) for p, s in zip(parts, input_specs)]


@dataclasses.dataclass(frozen=True)
class Deinterleave(RowMover, Op):
    """Splits a per-group interleaved tensor back into its parts: exact inverse of ``interleave``.

    Rule keys: ``op = "deinterleave"``, ``input``, ``outputs`` (a list), ``axis`` (default 0),
    ``groups`` (default 1), ``sizes`` (optional: each output's total length, ints or var names;
    omitted = equal parts, one per output). The input is cut into ``groups`` equal chunks along
    ``axis``, each chunk into the parts (``sizes[k] / groups`` slabs each); output k gathers part k
    of every chunk. Refuses what ``split`` refuses, and a part whose length does not divide into
    ``groups``. Inverse: ``interleave`` with the same ``groups``.

    >>> [p.tolist() for p in Deinterleave(axis=0, groups=2, parts=2).apply([np.array([0, 10, 1, 11])])]
    [[0, 1], [10, 11]]

    Rule::

        [[rule]]
        op      = "deinterleave"
        input   = "{p*}.attention.query_key_value.weight"
        outputs = ["{p*}.attention.query.weight", "{p*}.attention.key.weight", "{p*}.attention.value.weight"]
        groups  = "heads"
    """

    kind: ClassVar[str] = "deinterleave"
    onnx_unfusable: ClassVar[bool] = True
    probed: ClassVar[bool] = True
    outputs_field: ClassVar[str] = "outputs"
    axis: int = 0
    groups: int = 1
    sizes: tuple[int, ...] | None = None
    parts: int = 0

    def output_count(self, specs):
        return self.parts

    def infer(self, specs, names):
        outs = Split(axis=self.axis, sizes=self.sizes, parts=self.parts).infer(specs, names)
        axis = self.op_axis(len(specs[0].shape))
        for k, out in enumerate(outs):
            _equal_sizes(out.shape[axis], self.groups, names[0], f"axis {axis} (part {k}, {self.groups} groups)")
        return outs

    def apply(self, arrays):
        a = arrays[0]
        axis = self.op_axis(a.ndim)
        sizes = self.sizes or (a.shape[axis] // self.parts,) * self.parts
        per_group = [s // self.groups for s in sizes]
        grouped = a.reshape(a.shape[:axis] + (self.groups, sum(per_group)) + a.shape[axis + 1 :])
        pieces = np.split(grouped, np.cumsum(per_group)[:-1], axis=axis + 1)
        return [
            p.reshape(a.shape[:axis] + (size,) + a.shape[axis + 1 :])
            for p, size in zip(pieces, sizes)
        ]

    def inverse(self, specs):
        return Interleave(axis=self.axis, groups=self.groups)

    def lift(self, lift):
        axis = self.op_axis(lift.ndim)
        lift.along(axis, lambda in_lengths, out_lengths: Deinterleave(
            axis=axis, groups=self.groups, sizes=tuple(out_lengths), parts=self.parts))

    def onnx_unfuse(self, b, input_specs, output_specs, fused):
        axis = self.op_axis(len(input_specs[0].shape))
        shape = list(input_specs[0].shape)
        grouped = [onnx_forms.reshape(b, f, shape[:axis] + [self.groups, s.shape[axis] // self.groups] + shape[axis + 1:])
                   for f, s in zip(fused, output_specs)]
        return [onnx_forms.reshape(b, b.one("Concat", grouped, axis=axis + 1), shape)]


@dataclasses.dataclass(frozen=True)
class Stack(Op):
    """Stacks tensors of one shape along a new axis (per-expert weights into one tensor).

    Rule keys: ``op = "stack"``, ``inputs`` (a list) or ``input`` with ``over = "e"`` (the
    bindings of ``{e}`` must be exactly 0..n-1: they become positions along the new axis),
    ``output``, ``axis`` (default 0: where the new axis goes in the output). Output index k along
    ``axis`` holds input k. Refuses inputs of different dtypes or shapes, an axis out of range,
    and ``over`` indices with gaps. Inverse: ``unstack`` along the same axis (from the rule alone
    only with ``over``, which names the outputs).

    >>> Stack(axis=0).apply([np.array([1, 2]), np.array([3, 4])])[0].tolist()
    [[1, 2], [3, 4]]

    Rule::

        [[rule]]
        op     = "stack"
        input  = "{p*}.experts.{e:int}.w1.weight"
        over   = "e"
        output = "{p*}.experts.w1"
    """

    kind: ClassVar[str] = "stack"
    indexed_over: ClassVar[bool] = True
    onnx_unfusable: ClassVar[bool] = True
    probed: ClassVar[bool] = True
    inputs_field: ClassVar[str] = "inputs"
    axis: int = 0

    def infer(self, specs, names):
        same_dtype(specs, names)
        for spec, name in zip(specs, names):
            if spec.shape != specs[0].shape:
                raise PlanError(
                    f"{name!r} has shape {list(spec.shape)} but {names[0]!r} has "
                    f"{list(specs[0].shape)}; stacked tensors must have one shape"
                )
        ndim = len(specs[0].shape) + 1
        axis = normalize_axis(self.axis, ndim, names[0])
        shape = list(specs[0].shape)
        shape.insert(axis, len(specs))
        return [TensorSpec(specs[0].dtype, tuple(shape))]

    def apply(self, arrays):
        return [np.stack(arrays, axis=self.axis)]

    def inverse(self, specs):
        return Unstack(axis=self.axis)

    def rule_inverse_problem(self, over):
        return _explicit_list_problem(self, over)

    def lift(self, lift):
        lift.stack(normalize_axis(self.axis, lift.ndim + 1, "the stacked weight"))

    def onnx_unfuse(self, b, input_specs, output_specs, fused):
        axis = self.op_axis(len(output_specs[0].shape))
        parts = b.node("Split", [fused[0], b.ints([1] * len(input_specs))], len(input_specs), axis=axis)
        return [b.one("Squeeze", [p, b.ints([axis])]) for p in parts]

    def byte_ranges(self, ranges, specs, index):
        axis = self.op_axis(len(specs[0].shape) + 1)
        if not leading_ones(specs[0].shape, axis):
            return None
        return tuple(r for rs in ranges for r in rs)


@dataclasses.dataclass(frozen=True)
class Unstack(Op):
    """Cuts a tensor along ``axis`` into its slices, dropping that axis: inverse of ``stack``.

    Rule keys: ``op = "unstack"``, ``input``, ``output`` (a pattern holding ``{e}``), ``over = "e"``
    (required: the output's index placeholder, which the input must not have), ``axis`` (default
    0). Output ``{e} = k`` holds slice k along ``axis``, for k = 0..length-1. Refuses an axis out of
    range, and (at load) a rule without ``over`` or whose output lacks ``{e}``. Inverse: ``stack``
    along the same axis.

    >>> [p.tolist() for p in Unstack(axis=0).apply([np.array([[1, 2], [3, 4]])])]
    [[1, 2], [3, 4]]

    Rule::

        [[rule]]
        op     = "unstack"
        input  = "{p*}.mlp.experts.down_proj"
        over   = "e"
        output = "{p*}.block_sparse_moe.experts.{e}.w2.weight"
    """

    kind: ClassVar[str] = "unstack"
    gathers_over: ClassVar[bool] = False
    onnx_unfusable: ClassVar[bool] = True
    probed: ClassVar[bool] = True
    axis: int = 0

    def output_count(self, specs):
        return specs[0].shape[normalize_axis(self.axis, len(specs[0].shape), "input")]

    def infer(self, specs, names):
        axis = normalize_axis(self.axis, len(specs[0].shape), names[0])
        shape = specs[0].shape[:axis] + specs[0].shape[axis + 1 :]
        return [TensorSpec(specs[0].dtype, shape)] * specs[0].shape[axis]

    def apply(self, arrays):
        axis = self.op_axis(arrays[0].ndim)
        return [np.take(arrays[0], k, axis=axis) for k in range(arrays[0].shape[axis])]

    def inverse(self, specs):
        return Stack(axis=self.axis)

    def rule_inverse_problem(self, over):
        return _explicit_list_problem(self, over)

    def lift(self, lift):
        lift.unstack(self.op_axis(lift.ndim))

    def onnx_unfuse(self, b, input_specs, output_specs, fused):
        axis = self.op_axis(len(input_specs[0].shape))
        return [b.one("Concat", [b.one("Unsqueeze", [f, b.ints([axis])]) for f in fused], axis=axis)]

    def byte_ranges(self, ranges, specs, index):
        spec = specs[0]
        axis = self.op_axis(len(spec.shape))
        if not leading_ones(spec.shape, axis):
            return None
        row = spec.nbytes // spec.shape[axis]
        return slice_ranges(ranges[0], index * row, row)


@dataclasses.dataclass(frozen=True)
class Transpose(Op):
    """Permutes a tensor's axes: output axis k is input axis ``perm[k]`` (as ``numpy.transpose``).

    Rule keys: ``op = "transpose"``, ``input``, ``output``, ``perm`` (default ``[1, 0]``). The
    output holds the same elements, laid out contiguously in the new axis order. Refuses a
    ``perm`` that is not a permutation of the input's axes. Inverse: ``transpose`` with the inverse
    permutation.

    >>> Transpose(perm=(1, 0)).apply([np.array([[1, 2, 3]])])[0].tolist()
    [[1], [2], [3]]
    >>> Transpose(perm=(1, 2, 0)).inverse(None)
    Transpose(perm=(2, 0, 1))

    Rule::

        [[rule]]
        op     = "transpose"
        input  = "{p*}.weight"
        output = "{p*}.weight_t"
        perm   = [1, 0]
    """

    kind: ClassVar[str] = "transpose"
    onnx_unfusable: ClassVar[bool] = True
    probed: ClassVar[bool] = True
    perm: tuple[int, ...] = (1, 0)

    def infer(self, specs, names):
        spec = specs[0]
        if sorted(self.perm) != list(range(len(spec.shape))):
            raise PlanError(
                f"{names[0]!r} has {len(spec.shape)} dimensions; perm {list(self.perm)} "
                "must be a permutation of them"
            )
        return [TensorSpec(spec.dtype, tuple(spec.shape[p] for p in self.perm))]

    def apply(self, arrays):
        return [np.transpose(arrays[0], self.perm).copy(order="C")]

    def inverse(self, specs):
        return Transpose(perm=tuple(int(p) for p in np.argsort(self.perm)))

    def lift(self, lift):
        lift.transpose(self.perm)

    def onnx_unfuse(self, b, input_specs, output_specs, fused):
        return [b.one("Transpose", [fused[0]], perm=[int(p) for p in np.argsort(self.perm)])]


@dataclasses.dataclass(frozen=True)
class Reshape(Op):
    """Same bytes, new shape (flat parameter vectors, a ``[D, 8H]`` bias from ``[D, 2, 4H]``).

    Rule keys: ``op = "reshape"``, ``input``, ``output``, ``shape`` (a list; one entry may be -1,
    the length that makes the element count fit). Refuses a shape whose element count differs
    from the input's, more than one -1, any other negative entry, and a shape with more axes
    than the limit allows. Inverse: ``reshape`` to the input's recorded shape; it cannot be undone
    from the rule alone (``unfuse -r``), which does not hold that shape.

    >>> Reshape(shape=(2, -1)).apply([np.arange(4)])[0].tolist()
    [[0, 1], [2, 3]]

    Rule::

        [[rule]]
        op     = "reshape"
        input  = "{p*}.bias"
        output = "{p*}.bias_2d"
        shape  = [1, -1]
    """

    kind: ClassVar[str] = "reshape"
    onnx_unfusable: ClassVar[bool] = True
    probed: ClassVar[bool] = True
    shape: tuple[int, ...] = ()

    def infer(self, specs, names):
        spec = specs[0]
        shape = list(self.shape)
        check_limit("dims", len(shape), f"reshape of {quote(names[0])}: shape", PlanError)
        if shape.count(-1) > 1 or any(d < -1 for d in shape):
            raise PlanError(f"reshape of {names[0]!r}: shape {shape} may hold one -1 and no other negative")
        known = math.prod(d for d in shape if d != -1)  # Python integers: no int64 overflow
        if -1 in shape:
            if known == 0 or spec.numel % known:
                raise PlanError(f"{names[0]!r} has {spec.numel} elements; cannot reshape to {shape}")
            shape[shape.index(-1)] = spec.numel // known
        elif known != spec.numel:
            raise PlanError(f"{names[0]!r} has {spec.numel} elements ({list(spec.shape)}); cannot reshape to {shape}")
        return [TensorSpec(spec.dtype, tuple(shape))]

    def apply(self, arrays):
        return [arrays[0].reshape(self.shape)]

    def inverse(self, specs):
        if specs is None:
            raise PlanError("reshape cannot be undone from the rule alone (the original shape is "
                            f"not in it); unfuse with the provenance instead of {option_name('rules')}")
        return Reshape(shape=specs[0].shape)

    def lift(self, lift):
        lift.reshape()

    def onnx_unfuse(self, b, input_specs, output_specs, fused):
        return [onnx_forms.reshape(b, fused[0], input_specs[0].shape)]

    def byte_ranges(self, ranges, specs, index):
        return ranges[0]


@dataclasses.dataclass(frozen=True)
class Reorder(RowMover, Op):
    """Cuts a tensor into ``chunks`` equal chunks along ``axis`` and emits them in ``order``.

    Rule keys: ``op = "reorder"``, ``input``, ``output``, ``axis`` (default 0), ``chunks``,
    ``order`` (a permutation of 0..chunks-1): output chunk k is input chunk ``order[k]``
    (LSTM gates ifgo → iofc: ``order = [0, 3, 1, 2]``; GRU rzn → zrn: ``[1, 0, 2]``). Refuses a
    length along ``axis`` that does not divide into ``chunks``, and an ``order`` that is not a
    permutation of 0..chunks-1. Inverse: ``reorder`` with the inverse order.

    >>> Reorder(axis=0, chunks=3, order=(2, 0, 1)).apply([np.arange(3)])[0].tolist()
    [2, 0, 1]
    >>> Reorder(axis=0, chunks=4, order=(0, 3, 1, 2)).inverse(None).order
    (0, 2, 3, 1)

    Rule::

        [[rule]]
        op     = "reorder"
        input  = "{p*}.weight_ih_l{k:int}"
        output = "{p*}.W_l{k:int}"
        chunks = 4
        order  = [0, 3, 1, 2]
    """

    kind: ClassVar[str] = "reorder"
    onnx_unfusable: ClassVar[bool] = True
    probed: ClassVar[bool] = True
    axis: int = 0
    chunks: int = 1
    order: tuple[int, ...] = ()

    def infer(self, specs, names):
        spec = specs[0]
        axis = normalize_axis(self.axis, len(spec.shape), names[0])
        _equal_sizes(spec.shape[axis], self.chunks, names[0], f"axis {axis}")
        if len(self.order) != self.chunks or sorted(self.order) != list(range(self.chunks)):
            raise PlanError(f"order {list(self.order)} must be a permutation of 0..{self.chunks - 1}")
        _equal_sizes(spec.shape[axis], self.chunks, names[0], f"axis {axis}")
        return [spec]

    def apply(self, arrays):
        parts = np.split(arrays[0], self.chunks, axis=self.axis)
        return [np.concatenate([parts[k] for k in self.order], axis=self.axis)]

    def inverse(self, specs):
        return Reorder(axis=self.axis, chunks=self.chunks,
                       order=tuple(int(k) for k in np.argsort(self.order)))

    def lift(self, lift):
        axis = self.op_axis(lift.ndim)
        lift.along(axis, lambda in_lengths, out_lengths: dataclasses.replace(self, axis=axis))

    def onnx_unfuse(self, b, input_specs, output_specs, fused):
        axis = self.op_axis(len(input_specs[0].shape))
        chunk = input_specs[0].shape[axis] // self.chunks
        chunks = b.node("Split", [fused[0], b.ints([chunk] * self.chunks)], self.chunks, axis=axis)
        return [b.one("Concat", [chunks[k] for k in np.argsort(self.order)], axis=axis)]

    def byte_ranges(self, ranges, specs, index):
        spec = specs[0]
        axis = self.op_axis(len(spec.shape))
        if not leading_ones(spec.shape, axis):
            return None
        chunk = spec.nbytes // self.chunks
        return tuple(r for k in self.order for r in slice_ranges(ranges[0], k * chunk, chunk))


@dataclasses.dataclass(frozen=True)
class RopePermute(Op):
    """Meta ↔ Hugging Face rotary layout of q/k projection rows.

    Meta interleaves the two halves of each head's rotary pairs; HF keeps them in two blocks:
    to "hf" is ``w.reshape(heads, rows/heads/2, 2, cols).transpose(0, 2, 1, 3)``, back to the
    input's shape; to "meta" is its inverse.

    Rule keys: ``op = "rope_permute"``, ``input``, ``output``, ``heads`` (``heads`` for q,
    ``kv_heads`` for k), ``to = "hf"`` (default) or ``"meta"``. Takes a matrix or a bias (1-D).
    Refuses another ``to``, a tensor of another rank, and rows that are not a multiple of
    2 × heads. Inverse: ``rope_permute`` with the other ``to``.

    >>> RopePermute(heads=1, to="hf").apply([np.arange(4)])[0].tolist()
    [0, 2, 1, 3]
    >>> RopePermute(heads=1, to="hf").inverse(None)
    RopePermute(heads=1, to='meta')

    Rule::

        [[rule]]
        op     = "rope_permute"
        input  = "{p*}.self_attn.k_proj.weight"
        output = "{p*}.self_attn.k_proj.weight"
        heads  = "kv_heads"
    """

    kind: ClassVar[str] = "rope_permute"
    onnx_unfusable: ClassVar[bool] = True
    probed: ClassVar[bool] = True
    heads: int = 1
    to: str = "hf"

    def moves_rows(self, input_specs):
        return len(input_specs[0].shape) == 2

    def infer(self, specs, names):
        spec = specs[0]
        if self.to not in ("hf", "meta"):
            raise PlanError(f"rope_permute: to = {self.to!r}; use \"hf\" or \"meta\"")
        if len(spec.shape) not in (1, 2):
            raise PlanError(f"{names[0]!r} has shape {list(spec.shape)}; rope_permute needs a matrix or a bias")
        if self.heads <= 0 or spec.shape[0] % (2 * self.heads):
            raise PlanError(
                f"{names[0]!r} has {spec.shape[0]} rows, not a multiple of 2 × heads "
                f"(heads = {self.heads}); use heads for q and kv_heads for k"
            )
        return [spec]

    def apply(self, arrays):
        w = arrays[0]
        rows = w.shape[0]
        cols = w.shape[1] if w.ndim == 2 else 1
        half = rows // self.heads // 2
        src = (self.heads, half, 2, cols) if self.to == "hf" else (self.heads, 2, half, cols)
        return [np.ascontiguousarray(w.reshape(src).transpose(0, 2, 1, 3)).reshape(w.shape)]

    def inverse(self, specs):
        return RopePermute(heads=self.heads, to="meta" if self.to == "hf" else "hf")

    def lift(self, lift):
        lift.along(0, lambda in_lengths, out_lengths: self)

    def onnx_unfuse(self, b, input_specs, output_specs, fused):
        shape = input_specs[0].shape
        rows, cols = shape[0], shape[1] if len(shape) == 2 else 1
        half = rows // self.heads // 2
        # undo: to "hf" made (heads, 2, half) from Meta's (heads, half, 2)
        src = [self.heads, 2, half, cols] if self.to == "hf" else [self.heads, half, 2, cols]
        swapped = b.one("Transpose", [onnx_forms.reshape(b, fused[0], src)], perm=[0, 2, 1, 3])
        return [onnx_forms.reshape(b, swapped, shape)]


@dataclasses.dataclass(frozen=True)
class MergeEqual(Op):
    """One tensor from several that hold the same bytes.

    The per-tensor scales of fused parts may become the fused weight's scale only when they are
    equal (else nothing exact exists; fusectl never requantizes).

    Rule keys: ``op = "merge_equal"``, ``inputs`` (a list) or ``input`` with ``over``, ``output``.
    The output is input 1. Refuses, at plan time, inputs of different dtypes or shapes; when the
    step runs, inputs whose bytes differ (a ComputeError showing the first values). Inverse:
    ``replicate`` into as many copies, from the recorded step only (the rule alone does not say
    how many).

    >>> MergeEqual().apply([np.array([0.5]), np.array([0.5])])[0].tolist()
    [0.5]

    Rule::

        [[rule]]
        op     = "merge_equal"
        inputs = ["{p*}.q_proj.input_scale", "{p*}.k_proj.input_scale"]
        output = "{p*}.qk_proj.input_scale"
    """

    kind: ClassVar[str] = "merge_equal"
    onnx_unfusable: ClassVar[bool] = True
    probed: ClassVar[bool] = True
    inputs_field: ClassVar[str] = "inputs"

    def infer(self, specs, names):
        same_dtype(specs, names)
        for spec, name in zip(specs, names):
            if spec.shape != specs[0].shape:
                raise PlanError(f"{name!r} has shape {list(spec.shape)} but {names[0]!r} has "
                                f"{list(specs[0].shape)}; merged tensors must have one shape")
        return [specs[0]]

    def apply(self, arrays):
        first = arrays[0]
        for k, other in enumerate(arrays[1:], 1):
            if first.tobytes() != other.tobytes():
                raise ComputeError(
                    f"input {k + 1} holds {_few(other)} but input 1 holds {_few(first)}: one tensor can "
                    "stand for both only when they are equal (fusectl does not requantize scales or "
                    f"re-factor adapters): for scales, dequantize first ({option('rules', 'fp8-dequant')}); "
                    "for LoRA factors the provenance records as one replicated tensor, the file was edited "
                    "since it was written")
        return [first]

    def inverse(self, specs):
        return Replicate(parts=len(specs) if specs is not None else 0)

    def rule_inverse_problem(self, over):
        return ("a merge_equal cannot be undone from the rule alone (the number of copies is not "
                f"in it); unfuse with the provenance instead of {option_name('rules')}")

    def onnx_unfuse(self, b, input_specs, output_specs, fused):
        return [b.one("Identity", [fused[0]]) for _ in input_specs]


@dataclasses.dataclass(frozen=True)
class Replicate(Op):
    """Copies of one tensor under several names: a per-tensor scale given to every part of a
    split weight.

    Rule keys: ``op = "replicate"``, ``input``, ``outputs`` (a list; the number of copies is the
    number of outputs). Every output holds the input's bytes. Refuses nothing but a copy count
    past the limit. Inverse: ``merge_equal``, which checks the copies are still equal.

    >>> [c.tolist() for c in Replicate(parts=2).apply([np.array([0.5])])]
    [[0.5], [0.5]]
    >>> Replicate(parts=2).inverse(None)
    MergeEqual()

    Rule::

        [[rule]]
        op      = "replicate"
        input   = "{p*}.gate_up_proj.weight_scale"
        outputs = ["{p*}.gate_proj.weight_scale", "{p*}.up_proj.weight_scale"]
    """

    kind: ClassVar[str] = "replicate"
    onnx_unfusable: ClassVar[bool] = True
    probed: ClassVar[bool] = True
    outputs_field: ClassVar[str] = "outputs"
    parts: int = 0

    def output_count(self, specs):
        return self.parts

    def infer(self, specs, names):
        check_limit("chunks", self.parts, f"replicate of {quote(names[0])}", PlanError)
        return [specs[0]] * self.parts

    def apply(self, arrays):
        return [arrays[0]] * self.parts

    def inverse(self, specs):
        return MergeEqual()

    def byte_ranges(self, ranges, specs, index):
        return ranges[0]

    def onnx_unfuse(self, b, input_specs, output_specs, fused):
        return [b.one("Identity", [fused[0]])]


@dataclasses.dataclass(frozen=True)
class BlockDiagonal(Op):
    """Matrices placed along a diagonal, zeros elsewhere.

    The LoRA B of a fused module whose parts had their own A: ``[B1 0; 0 B2]``, with A the
    parts' As stacked.

    Rule keys: ``op = "block_diagonal"``, ``inputs`` (a list) or ``input`` with ``over``,
    ``output``. The output is ``[sum of rows, sum of columns]``: input k at rows and columns after
    those of inputs 0..k-1, zeros off the blocks. Refuses inputs that are not matrices and inputs of
    different dtypes. Inverse: ``block_diagonal_split`` with the inputs' recorded shapes; none from
    the rule alone, which does not hold them.

    >>> BlockDiagonal().apply([np.array([[1]]), np.array([[2, 3]])])[0].tolist()
    [[1, 0, 0], [0, 2, 3]]

    Rule::

        [[rule]]
        op     = "block_diagonal"
        inputs = ["{p*}.q_proj.lora_B.weight", "{p*}.v_proj.lora_B.weight"]
        output = "{p*}.qv_proj.lora_B.weight"
    """

    kind: ClassVar[str] = "block_diagonal"
    onnx_unfusable: ClassVar[bool] = True
    probed: ClassVar[bool] = True
    inputs_field: ClassVar[str] = "inputs"

    def infer(self, specs, names):
        same_dtype(specs, names)
        for spec, name in zip(specs, names):
            if len(spec.shape) != 2:
                raise PlanError(f"{name!r} has shape {list(spec.shape)}; block_diagonal takes matrices")
        rows = sum(s.shape[0] for s in specs)
        cols = sum(s.shape[1] for s in specs)
        return [TensorSpec(specs[0].dtype, (rows, cols))]

    def apply(self, arrays):
        rows, cols = sum(a.shape[0] for a in arrays), sum(a.shape[1] for a in arrays)
        out = np.zeros((rows, cols), dtype=arrays[0].dtype)
        r = c = 0
        for a in arrays:
            out[r:r + a.shape[0], c:c + a.shape[1]] = a
            r, c = r + a.shape[0], c + a.shape[1]
        return [out]

    def inverse(self, specs):
        if specs is None:
            return None
        return BlockDiagonalSplit(rows=tuple(s.shape[0] for s in specs), cols=tuple(s.shape[1] for s in specs),
                                  parts=len(specs))

    def onnx_unfuse(self, b, input_specs, output_specs, fused):
        rows = b.node("Split", [fused[0], b.ints([s.shape[0] for s in input_specs])], len(input_specs), axis=0)
        cols = [s.shape[1] for s in input_specs]
        starts = np.cumsum([0, *cols])
        return [b.one("Slice", [r, b.ints([int(starts[k])]), b.ints([int(starts[k + 1])]), b.ints([1])])
                for k, r in enumerate(rows)]


@dataclasses.dataclass(frozen=True)
class BlockDiagonalSplit(Op):
    """The blocks along a matrix's diagonal (``rows[k]`` × ``cols[k]`` each); inverse of
    ``block_diagonal``.

    Rule keys: ``op = "block_diagonal_split"``, ``input``, ``outputs`` (a list), ``rows`` and
    ``cols`` (one length per output). Output k holds the block at rows and columns after those of
    blocks 0..k-1; what lies off the diagonal is not kept. Refuses ``rows`` / ``cols`` whose counts
    differ from the outputs', negative lengths, and an input whose shape is not
    ``[sum(rows), sum(cols)]``. Inverse: ``block_diagonal`` (zeros off the blocks).

    >>> a = np.array([[1, 0, 0], [0, 2, 3]])
    >>> [b.tolist() for b in BlockDiagonalSplit(rows=(1, 1), cols=(1, 2), parts=2).apply([a])]
    [[[1]], [[2, 3]]]

    Rule::

        [[rule]]
        op      = "block_diagonal_split"
        input   = "{p*}.qv_proj.lora_B.weight"
        outputs = ["{p*}.q_proj.lora_B.weight", "{p*}.v_proj.lora_B.weight"]
        rows    = [64, 64]
        cols    = [8, 8]
    """

    kind: ClassVar[str] = "block_diagonal_split"
    onnx_unfusable: ClassVar[bool] = True
    probed: ClassVar[bool] = True
    outputs_field: ClassVar[str] = "outputs"
    rows: tuple[int, ...] = ()
    cols: tuple[int, ...] = ()
    parts: int = 0

    def output_count(self, specs):
        return self.parts

    def infer(self, specs, names):
        spec = specs[0]
        if len(self.rows) != self.parts or len(self.cols) != self.parts:
            raise PlanError(f"block_diagonal_split of {names[0]!r}: rows {list(self.rows)} and cols "
                            f"{list(self.cols)} must name {self.parts} blocks")
        _non_negative(self.rows + self.cols, names[0])
        if len(spec.shape) != 2 or (sum(self.rows), sum(self.cols)) != spec.shape:
            raise PlanError(f"{names[0]!r} has shape {list(spec.shape)}; blocks of rows {list(self.rows)} and "
                            f"cols {list(self.cols)} need [{sum(self.rows)}, {sum(self.cols)}]")
        return [TensorSpec(spec.dtype, (r, c)) for r, c in zip(self.rows, self.cols)]

    def apply(self, arrays):
        a = arrays[0]
        r0, c0 = np.cumsum([0, *self.rows]), np.cumsum([0, *self.cols])
        return [np.ascontiguousarray(a[r0[k]:r0[k + 1], c0[k]:c0[k + 1]]) for k in range(self.parts)]

    def inverse(self, specs):
        return BlockDiagonal()

    def onnx_unfuse(self, b, input_specs, output_specs, fused):
        cols = sum(self.cols)
        padded = []
        start = 0
        for f, spec in zip(fused, output_specs):
            pads = [0, start, 0, cols - start - spec.shape[1]]
            padded.append(b.one("Pad", [f, b.ints(pads)]))
            start += spec.shape[1]
        return [b.one("Concat", padded, axis=0)]


def _few(array: np.ndarray) -> str:
    flat = array.reshape(-1)
    shown = ", ".join(str(v) for v in flat[:3].tolist())
    return f"[{shown}{', …' if flat.size > 3 else ''}]"


LAYOUT_OPS: tuple[type[Op], ...] = (
    Rename, Drop, Concat, Split, Interleave, Deinterleave, Stack, Unstack,
    Transpose, Reshape, Reorder, RopePermute, MergeEqual, Replicate, BlockDiagonal, BlockDiagonalSplit,
)
