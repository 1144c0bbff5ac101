"""Bitwise comparison of tensors held as file ranges, in place, and the proof it leaves.

Comparing two layout-only tables is a comparison of file bytes: no tensor is decoded or held
whole. The bytes are compared where they lie in the page cache, window by window through
read-only mappings (``RangeComparer``), by a few threads at once (``equal_pairs``). Each equal
pair of tensors proves that some bytes of the reference's files equal some bytes of the
candidate's (:class:`ByteCorrespondence`); a later check whose pairs of ranges all fall inside
proven ones (the inverse of the same plan) holds without reading anything again.
"""

from __future__ import annotations

import bisect
import itertools
import mmap
import os
import threading
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from ..errors import CheckpointError
from ..tensors import ByteRange

CHUNK = 4 << 20  # bytes compared at a time, per side (mapped, then unmapped: resident meanwhile)


def _libc_memcmp():
    """The C library's ``memcmp`` through ctypes (which drops the GIL for the call), or None
    where there is no C library to load."""
    try:
        import ctypes

        libc = ctypes.cdll.msvcrt if os.name == "nt" else ctypes.CDLL(None)
        memcmp = libc.memcmp
    except (ImportError, OSError, AttributeError):
        return None
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return memcmp


_MEMCMP = _libc_memcmp()


def _address(view: np.ndarray) -> int:
    return view.__array_interface__["data"][0]


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


def _short(path: str, offset: int, length: int, got: int) -> CheckpointError:
    return CheckpointError(f"{path}: expected {length} bytes at offset {offset}, got {max(got, 0)}; "
                           "the file is truncated or changed while fusectl was reading it")


class Files:
    """The files of one side, opened once for the whole comparison."""

    def __init__(self):
        self.fds: dict[str, int] = {}

    def fd(self, path: str) -> int:
        """The descriptor of ``path``, opened on first use."""
        fd = self.fds.get(path)
        if fd is None:
            fd = self.fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        return fd

    def check(self, path: str, offset: int, length: int) -> int:
        """The descriptor of ``path``, after checking that the file (as it is now) holds
        ``length`` bytes at ``offset``; CheckpointError when it is shorter."""
        fd = self.fd(path)
        size = os.fstat(fd).st_size
        if offset + length > size:
            raise _short(path, offset, length, size - offset)
        return fd

    def close(self) -> None:
        """Close every file it opened."""
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


class Mapped:
    """``length`` bytes of a file at ``offset`` as a read-only mapping of the page cache (no
    copy), as a uint8 array; ``close`` unmaps it, so that the pages it touched leave the
    process's resident set. OSError or ValueError where the file cannot be mapped."""

    def __init__(self, fd: int, offset: int, length: int):
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        self._map = mmap.mmap(fd, length + offset - start, access=mmap.ACCESS_READ, offset=start)
        self.array = np.frombuffer(self._map, np.uint8, length, offset - start)

    def close(self) -> None:
        """Drop the view, then the mapping."""
        self.array = None
        self._map.close()


class _Reader:
    """Positional reads into one reusable buffer: where a file cannot be mapped."""

    def __init__(self):
        self.view = memoryview(bytearray(CHUNK))

    def read(self, fd: int, path: str, offset: int, length: int) -> np.ndarray:
        """``length`` bytes of the file at ``offset``, in the reused buffer (valid until the
        next read); CheckpointError when the file is shorter."""
        if len(self.view) < length:
            self.view = memoryview(bytearray(length))
        got = os.preadv(fd, [self.view[:length]], offset)
        if got != length:
            raise _short(path, offset, length, got)
        return np.frombuffer(self.view, np.uint8, length)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two uint8 arrays of one length hold the same bytes: memcmp in place when the C
    library is at hand (neither is copied, and the GIL is free meanwhile), else numpy."""
    if _MEMCMP is not None:
        return _MEMCMP(_address(a), _address(b), len(a)) == 0
    return bool(np.array_equal(a, b))


class RangeComparer:
    """Compares pairs of range lists window by window; one instance per comparison run.

    Each window of ``CHUNK`` bytes per side is mapped read-only and compared in place with
    ``memcmp``, so no byte is copied out of the page cache and the GIL is free while the bytes
    are compared (another thread may work meanwhile); the window is unmapped before the next,
    so the resident memory it adds stays two windows, whatever the files' size. A file that
    cannot be mapped (a pipe, a file system without mmap) is read with ``preadv`` into buffers.

    Each window is mapped only after ``fstat`` says the file holds it: a file found shorter
    raises CheckpointError naming it. A file truncated by another process in the moment between
    that check and the comparison of the window still raises SIGBUS, which ends the process
    (it never passes); a file rewritten in place while it is compared gives no more guarantee
    than with reads.
    """

    def __init__(self):
        self._files = (Files(), Files())
        self._readers: tuple[_Reader, _Reader] | None = None

    def _window_equal(self, seg: Segment, done: int, n: int) -> bool:
        ends = ((seg.left, seg.left_offset + done), (seg.right, seg.right_offset + done))
        fds = [files.check(path, offset, n) for files, (path, offset) in zip(self._files, ends)]
        views: list[Mapped] = []
        try:
            for fd, (_, offset) in zip(fds, ends):
                views.append(Mapped(fd, offset, n))
        except (OSError, ValueError):  # not mappable: read instead
            for view in views:
                view.close()
            if self._readers is None:
                self._readers = (_Reader(), _Reader())
            a, b = (reader.read(fd, path, offset, n)
                    for reader, fd, (path, offset) in zip(self._readers, fds, ends))
            return _same(a, b)
        try:
            return _same(views[0].array, views[1].array)
        finally:
            for view in views:
                view.close()

    def equal(self, left: Sequence[ByteRange], right: Sequence[ByteRange]) -> bool:
        """Whether the bytes of ``left`` and ``right`` (range lists of one length) are equal,
        compared window by window (the first window that differs ends it)."""
        for seg in aligned(left, right):
            self._files[0].check(seg.left, seg.left_offset, seg.length)  # the whole of it, named
            self._files[1].check(seg.right, seg.right_offset, seg.length)
            done = 0
            while done < seg.length:
                n = min(CHUNK, seg.length - done)
                if not self._window_equal(seg, done, n):
                    return False
                done += n
        return True

    def close(self) -> None:
        """Close the files both sides opened."""
        for files in self._files:
            files.close()


WORKERS = 2  # threads comparing pairs at once (memcmp runs without the GIL)


def equal_pairs(pairs: Sequence[tuple[Sequence[ByteRange], Sequence[ByteRange]]]) -> list[bool]:
    """For each (left, right) pair of range lists, whether their bytes are equal: the pairs are
    shared among up to ``WORKERS`` threads, each with its own :class:`RangeComparer`. The answers
    are those of comparing the pairs in turn; when pairs raise, the error of the first raises."""
    results: list[bool | None] = [None] * len(pairs)
    errors: dict[int, BaseException] = {}
    claim = itertools.count()  # next() is atomic under the GIL

    def work() -> None:
        comparer = RangeComparer()
        try:
            while not errors:
                k = next(claim)
                if k >= len(pairs):
                    return
                try:
                    results[k] = comparer.equal(*pairs[k])
                except BaseException as e:  # handed to the caller below
                    errors[k] = e
                    return
        finally:
            comparer.close()

    threads = [threading.Thread(target=work, name=f"fusectl-compare-{k}", daemon=True)
               for k in range(min(WORKERS, len(pairs)) - 1)]
    for thread in threads:
        thread.start()
    work()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[min(errors)]
    return results


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
