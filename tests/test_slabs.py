"""Where a step moves the slabs of its inputs (followers/slabs.py): ``moved_ids`` numbers slab k
of input j across the inputs in order, lays the ids along the op's axis, and lets the op itself
say where each id lands. The follower contract built on it is in test_followers.py."""

from __future__ import annotations

import numpy as np
import pytest

from fusectl.followers.slabs import moved_ids
from fusectl.ops.layout import Concat, Deinterleave, Interleave, Reorder, Split, Transpose


def _flat(arrays) -> list[list[int]]:
    return [a.reshape(-1).tolist() for a in arrays]


def test_ids_are_int64_laid_along_the_axis_with_ones_elsewhere():
    (ids,) = moved_ids(Concat(axis=1), [2, 3], axis=1, ndim=3)
    assert ids.dtype == np.int64
    assert ids.shape == (1, 5, 1)
    assert ids.reshape(-1).tolist() == [0, 1, 2, 3, 4]


def test_concat_numbers_the_inputs_one_after_another():
    assert _flat(moved_ids(Concat(axis=0), [1, 3, 2], 0, 2)) == [[0, 1, 2, 3, 4, 5]]


def test_split_gives_each_output_its_own_slabs():
    assert _flat(moved_ids(Split(axis=0, sizes=(2, 1, 3), parts=3), [6], 0, 2)) == [[0, 1], [2], [3, 4, 5]]


def test_interleave_with_unequal_inputs_takes_a_chunk_of_each_in_turn():
    # q of 4 slabs, k and v of 2, two groups: [q0 q1 k0 v0 | q2 q3 k1 v1]
    (ids,) = moved_ids(Interleave(axis=0, groups=2), [4, 2, 2], 0, 2)
    assert ids.reshape(-1).tolist() == [0, 1, 4, 6, 2, 3, 5, 7]


def test_deinterleave_gathers_each_part_from_every_group():
    outs = moved_ids(Deinterleave(axis=0, groups=2, sizes=(4, 2, 2), parts=3), [8], 0, 2)
    assert _flat(outs) == [[0, 1, 4, 5], [2, 6], [3, 7]]


def test_reorder_permutes_chunks_on_a_later_axis():
    (ids,) = moved_ids(Reorder(axis=1, chunks=4, order=(0, 3, 1, 2)), [8], axis=1, ndim=2)
    assert ids.shape == (1, 8)
    assert ids.reshape(-1).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]


def test_a_transpose_moves_the_ids_onto_the_other_axis():
    (ids,) = moved_ids(Transpose(perm=(1, 0)), [3], axis=0, ndim=2)
    assert ids.shape == (1, 3)  # the slabs of axis 0 now lie along axis 1
    assert ids.reshape(-1).tolist() == [0, 1, 2]


def test_an_empty_input_takes_no_id():
    assert _flat(moved_ids(Concat(axis=0), [2, 0, 1], 0, 1)) == [[0, 1, 2]]


@pytest.mark.parametrize("lengths", [[3], [1, 1, 1, 1]])
def test_every_id_lands_exactly_once(lengths):
    op = Concat(axis=0) if len(lengths) > 1 else Split(axis=0, sizes=(1, 2), parts=2)
    found = sorted(i for a in moved_ids(op, lengths, 0, 2) for i in a.reshape(-1).tolist())
    assert found == list(range(sum(lengths)))
