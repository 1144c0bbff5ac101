"""Where a step moves the slabs of its inputs: the proof that blocks move whole.

An op applied to arrays of ids (slab k of input j holds its global id) says, for each output,
which slabs it holds and in what order — without any op knowing about scales or adapters.
A follower then checks that the weight's blocks (a block scale's rows, a LoRA part's rows) map
to whole blocks of the output.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..ops import Op


def moved_ids(op: Op, lengths: Sequence[int], axis: int, ndim: int) -> list[np.ndarray]:
    """Where ``op`` moves the slabs of its inputs (of ``lengths`` along ``axis``): for each
    output, the ids of the slabs it holds, numbered across the inputs in order.

    >>> from fusectl.ops.layout import Concat, Split
    >>> [a.reshape(-1).tolist() for a in moved_ids(Concat(axis=0), [2, 1], 0, 2)]
    [[0, 1, 2]]
    >>> [a.reshape(-1).tolist() for a in moved_ids(Split(axis=0, sizes=(1, 2), parts=2), [3], 0, 2)]
    [[0], [1, 2]]
    """
    return op.apply([_ids(ndim, axis, n, start) for n, start in zip(lengths, np.cumsum([0, *lengths]))])


def _ids(ndim: int, axis: int, length: int, start: int) -> np.ndarray:
    """Ids ``start .. start+length-1`` laid along ``axis`` of an ``ndim``-dimensional array."""
    shape = [1] * ndim
    shape[axis] = length
    return (np.arange(length, dtype=np.int64) + int(start)).reshape(shape)
