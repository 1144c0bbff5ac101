"""A tensor whole at its global size from the blocks that ranks wrote of it.

A checkpoint written by many ranks keeps each tensor as blocks: each a rank's piece, at its
offsets in the whole. torch.distributed.checkpoint's ``.distcp`` items and its sharded
safetensors files cut tensors so. :func:`check_tiling` proves that the blocks cover the tensor
exactly once; :func:`assemble` gives the tensor: the file ranges of its blocks one after another
where they are whole rows in order (a cut along the first dimension alone: consolidating copies
file ranges, it never holds the model), else :class:`Blocks`, assembled when read, one tensor at
a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...errors import CheckpointError, quote
from ...tensors import ByteRange, LazyTensor, RangesTensor, TensorSpec

Piece = tuple[tuple[int, ...], LazyTensor]  # a block: its offsets in the whole and its data


def check_tiling(name: str, spec: TensorSpec, blocks: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
                 where: str, how: str) -> None:
    """Blocks within the tensor's bounds tile it exactly when their volumes add up to it and no
    two overlap.

    :param name: the tensor's name, for the error.
    :param spec: the whole tensor.
    :param blocks: (offsets, sizes) of each block, each within ``spec``'s shape.
    :param where: the file whose layout is checked, first in the error.
    :param how: what the error says to do.
    :raises CheckpointError: pieces missing or overlapping, naming two that overlap.
    """
    volume = sum(math.prod(s) for _, s in blocks)
    if volume != spec.numel:
        raise CheckpointError(f"{where}: the chunks of {quote(name)} {list(spec.shape)} hold {volume} elements, the "
                              f"tensor {spec.numel}: {'pieces are missing' if volume < spec.numel else 'pieces overlap'}"
                              f"; {how}")
    full = [(o, s) for o, s in blocks if math.prod(s)]
    if len(full) < 2 or not spec.shape:
        return
    lo = np.array([o for o, _ in full], dtype=np.int64)
    hi = lo + np.array([s for _, s in full], dtype=np.int64)
    step = max(1, 2**22 // (len(full) * len(spec.shape)))  # rows of the pairwise test at a time
    for start in range(0, len(full), step):
        block = slice(start, start + step)
        meets = np.all((lo[block, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[block, None, :]), axis=2)
        rows, cols = np.nonzero(meets)
        clash = [(start + r, c) for r, c in zip(rows, cols) if start + r < c]
        if clash:
            a, b = clash[0]
            raise CheckpointError(f"{where}: the chunks of {quote(name)} at {list(full[a][0])} and {list(full[b][0])} "
                                  f"overlap (and leave a hole elsewhere); {how}")


def assemble(spec: TensorSpec, pieces: Sequence[Piece]) -> LazyTensor:
    """The tensor ``spec`` from ``pieces`` that tile it (:func:`check_tiling`), each of the
    block's shape and ``spec``'s dtype."""
    ranges = [item.byte_ranges() for _, item in pieces]
    whole_rows = all(o[1:] == (0,) * (len(o) - 1) and item.spec.shape[1:] == spec.shape[1:] for o, item in pieces)
    if whole_rows and all(r is not None for r in ranges):  # Shard(0): the blocks' bytes one after another
        ordered = sorted(zip(pieces, ranges), key=lambda p: p[0][0])
        return RangesTensor(spec, tuple(r for _, rs in ordered for r in rs))
    return Blocks(spec, tuple(pieces))


@dataclass(frozen=True, eq=False, slots=True)
class Blocks(LazyTensor):
    """A tensor whose blocks are not whole rows in file ranges (any cut but along the first
    dimension alone, or blocks not stored as plain bytes): assembled when read."""

    spec: TensorSpec
    pieces: tuple[Piece, ...]

    def read(self) -> np.ndarray:
        """Read each block into its place in one fresh array."""
        out = np.empty(self.spec.shape, dtype=self.spec.dtype.numpy)
        for offsets, item in self.pieces:
            out[tuple(slice(o, o + s) for o, s in zip(offsets, item.spec.shape))] = item.read()
        return out


def rows(tensor: LazyTensor, start: int, count: int, where: str, how: str) -> RangesTensor:
    """Rows ``start`` … ``start + count`` of ``tensor`` as file ranges (a layer of a stacked
    tensor, a rank's half of a SwiGLU weight).

    :param where: the file, first in the error; :param how: what the error says to do.
    :raises CheckpointError: a tensor not stored as plain little-endian bytes (strided or
        big-endian), which has no rows as file ranges.
    """
    ranges = tensor.byte_ranges()
    if ranges is None:
        raise CheckpointError(f"{where}: a {tensor.spec} tensor is not stored as plain little-endian bytes (it is "
                              f"strided or big-endian); {how}")
    row = tensor.spec.nbytes // tensor.spec.shape[0]
    lo, hi, at, out = start * row, (start + count) * row, 0, []
    for r in ranges:
        a, b = max(lo, at), min(hi, at + r.length)
        if a < b:
            out.append(ByteRange(r.path, r.offset + a - at, b - a))
        at += r.length
    return RangesTensor(TensorSpec(tensor.spec.dtype, (count, *tensor.spec.shape[1:])), tuple(out))


def cut(tensor: LazyTensor, axis: int, start: int, count: int) -> LazyTensor:
    """Indices ``start`` … ``start + count`` of ``tensor`` along ``axis``: file ranges for rows
    of a tensor stored as plain bytes (:func:`rows`), else a :class:`Slice` cut when read.

    >>> from fusectl.tensors import ArrayTensor
    >>> from fusectl.dtypes import from_numpy
    >>> w = np.arange(6, dtype=np.float32).reshape(2, 3)
    >>> cut(ArrayTensor(TensorSpec(from_numpy(w.dtype, "w"), (2, 3)), w), 1, 1, 2).read().tolist()
    [[1.0, 2.0], [4.0, 5.0]]
    """
    if start == 0 and count == tensor.spec.shape[axis]:
        return tensor
    if axis == 0 and tensor.byte_ranges() is not None:
        return rows(tensor, start, count, "", "")
    shape = tuple(count if i == axis else n for i, n in enumerate(tensor.spec.shape))
    return Slice(TensorSpec(tensor.spec.dtype, shape), tensor, axis, start)


@dataclass(frozen=True, eq=False, slots=True)
class Slice(LazyTensor):
    """Indices ``start`` … of ``source`` along ``axis`` (``spec`` gives the count): cut when read."""

    spec: TensorSpec
    source: LazyTensor
    axis: int
    start: int

    def read(self) -> np.ndarray:
        """The slice, as a fresh C-ordered array."""
        index = [slice(None)] * len(self.spec.shape)
        index[self.axis] = slice(self.start, self.start + self.spec.shape[self.axis])
        return np.ascontiguousarray(self.source.read()[tuple(index)])



@dataclass(frozen=True, eq=False, slots=True)
class Reshaped(LazyTensor):
    """``source``'s elements, in their C order, in the shape ``spec`` gives: a layer's tensor as
    its block ``[1, …]`` of a stacked tensor. Its file ranges are the source's."""

    spec: TensorSpec
    source: LazyTensor

    def read(self) -> np.ndarray:
        """The source's array in this shape."""
        return self.source.read().reshape(self.spec.shape)

    def byte_ranges(self) -> tuple[ByteRange, ...] | None:
        """The source's file ranges (None where it has none)."""
        return self.source.byte_ranges()
