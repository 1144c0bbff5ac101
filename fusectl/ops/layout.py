"""Layout ops: they move bytes, so they are exact for every dtype and invert bitwise."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Sequence

import numpy as np

from ..errors import ComputeError, PlanError, quote
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
                        "sizes = [...] to the rule or unfuse with the provenance instead of -r")
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
                "unfuse with the provenance instead of -r")

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
                            "not in it); unfuse with the provenance instead of -r")
        return Reshape(shape=specs[0].shape)

    def lift(self, lift):
        lift.reshape()

    def onnx_unfuse(self, b, input_specs, output_specs, fused):
        return [onnx_forms.reshape(b, fused[0], input_specs[0].shape)]

    def byte_ranges(self, ranges, specs, index):
        return ranges[0]


@dataclasses.dataclass(frozen=True)
class Reorder(RowMover, Op):
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
    to "hf" is ``w.reshape(heads, rows/heads/2, 2, cols).transpose(0, 2, 1, 3)``.
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
    """One tensor from several that hold the same bytes: the per-tensor scales of fused parts,
    which may become the fused weight's scale only when they are equal (else nothing exact
    exists; fusectl never requantizes). The equality is checked when the step runs."""

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
                    "stand for both only when they are equal (fusectl does not requantize); "
                    "dequantize first (-r fp8-dequant)")
        return [first]

    def inverse(self, specs):
        return Replicate(parts=len(specs) if specs is not None else 0)

    def rule_inverse_problem(self, over):
        return ("a merge_equal cannot be undone from the rule alone (the number of copies is not "
                "in it); unfuse with the provenance instead of -r")

    def onnx_unfuse(self, b, input_specs, output_specs, fused):
        return [b.one("Identity", [fused[0]]) for _ in input_specs]


@dataclasses.dataclass(frozen=True)
class Replicate(Op):
    """Copies of one tensor under several names: a per-tensor scale given to every part of a
    split weight. Inverse of ``merge_equal``."""

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
    """Matrices placed along a diagonal, zeros elsewhere: the LoRA B of a fused module whose
    parts had their own A (``[B1 0; 0 B2]`` with A the parts' As stacked)."""

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
    ``block_diagonal``. What lies off the diagonal is not kept."""

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
