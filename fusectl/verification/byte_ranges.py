"""Bitwise comparison of tensors held as file ranges, streamed in chunks, and the proof it leaves.

Comparing two layout-only tables is a comparison of file bytes: no tensor is decoded or held
whole. Each equal pair of tensors proves that some bytes of the reference's files equal some
bytes of the candidate's (:class:`ByteCorrespondence`); a later check whose pairs of ranges all
fall inside proven ones (the inverse of the same plan) holds without reading anything again.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from ..errors import CheckpointError
from ..tensors import ByteRange

CHUNK = 8 << 20  # bytes compared at a time, per side


@dataclass(frozen=True)
class Segment:
    """``length`` bytes at ``left`` in one file paired with as many at ``right`` in another."""

    left: str
    left_offset: int
    right: str
    right_offset: int
    length: int


def aligned(left: Sequence[ByteRange], right: Sequence[ByteRange]) -> Iterator[Segment]:
    """Two range lists of one length cut at each other's boundaries into paired segments."""
    i = j = 0
    li = ri = 0  # bytes of left[i] / right[j] already paired
    while i < len(left) and j < len(right):
        a, b = left[i], right[j]
        n = min(a.length - li, b.length - ri)
        if n:
            yield Segment(a.path, a.offset + li, b.path, b.offset + ri, n)
        li += n
        ri += n
        if li == a.length:
            i, li = i + 1, 0
        if ri == b.length:
            j, ri = j + 1, 0


class _Reader:
    """Positional reads into one reusable buffer, files kept open for the whole comparison."""

    def __init__(self):
        self.buffer = bytearray(CHUNK)
        self.view = memoryview(self.buffer)
        self.files: dict[str, int] = {}

    def read(self, path: str, offset: int, length: int) -> memoryview:
        """``length`` bytes of ``path`` at ``offset``, in the reused buffer (valid until the next
        read); CheckpointError when the file is shorter."""
        fd = self.files.get(path)
        if fd is None:
            fd = self.files[path] = os.open(path, os.O_RDONLY)
        got = os.preadv(fd, [self.view[:length]], offset)
        if got != length:
            raise CheckpointError(f"{path}: expected {length} bytes at offset {offset}, got {got}; "
                                  "the file is truncated or changed while fusectl was reading it")
        return self.view[:length]

    def close(self) -> None:
        """Close every file it opened."""
        for fd in self.files.values():
            os.close(fd)
        self.files.clear()


class RangeComparer:
    """Compares pairs of range lists chunk by chunk; one instance per comparison run."""

    def __init__(self):
        self._left, self._right = _Reader(), _Reader()

    def equal(self, left: Sequence[ByteRange], right: Sequence[ByteRange]) -> bool:
        """Whether the bytes of ``left`` and ``right`` (range lists of one length) are equal,
        read chunk by chunk."""
        for seg in aligned(left, right):
            done = 0
            while done < seg.length:
                n = min(CHUNK, seg.length - done)
                a = self._left.read(seg.left, seg.left_offset + done, n)
                b = self._right.read(seg.right, seg.right_offset + done, n)
                if n == CHUNK:
                    same = self._left.buffer == self._right.buffer  # memcmp
                else:  # memoryview == compares item by item: numpy is ~8x faster
                    same = np.array_equal(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8))
                if not same:
                    return False
                done += n
        return True

    def close(self) -> None:
        """Close the files both readers opened."""
        self._left.close()
        self._right.close()


@dataclass
class ByteCorrespondence:
    """Byte runs proven equal: reference file bytes → candidate file bytes."""

    # (reference path, candidate path, candidate offset - reference offset) -> [start, end) runs
    # of reference offsets, kept sorted and merged
    _runs: dict[tuple[str, str, int], list[list[int]]] = field(default_factory=dict)

    def add(self, reference: Sequence[ByteRange], candidate: Sequence[ByteRange]) -> None:
        """Record that the bytes of ``reference`` equal those of ``candidate`` (call ``freeze``
        once all are added)."""
        for seg in aligned(reference, candidate):
            runs = self._runs.setdefault((seg.left, seg.right, seg.right_offset - seg.left_offset), [])
            runs.append([seg.left_offset, seg.left_offset + seg.length])

    def freeze(self) -> None:
        """Sort and merge the runs (call once every proven pair is added)."""
        for key, runs in self._runs.items():
            runs.sort()
            merged = [runs[0]]
            for start, end in runs[1:]:
                if start <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], end)
                else:
                    merged.append([start, end])
            self._runs[key] = merged

    def covers(self, reference: Sequence[ByteRange], candidate: Sequence[ByteRange]) -> bool:
        """Whether every byte of ``reference`` is proven equal to the byte ``candidate`` pairs it with."""
        for seg in aligned(reference, candidate):
            runs = self._runs.get((seg.left, seg.right, seg.right_offset - seg.left_offset))
            if not runs:
                return False
            k = bisect.bisect_right(runs, [seg.left_offset, float("inf")]) - 1
            if k < 0 or runs[k][1] < seg.left_offset + seg.length:
                return False
        return True
