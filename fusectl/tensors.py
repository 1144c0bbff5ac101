"""Lazy tensors: dtype and shape known from headers, bytes read only when a step needs them."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .dtypes import DType
from .errors import CheckpointError, InternalError


@dataclass(frozen=True)
class TensorSpec:
    """What a plan knows about a tensor before reading it."""

    dtype: DType
    shape: tuple[int, ...]

    # cached: a header's tensors share their specs, and tables ask for sizes again and again
    @cached_property
    def numel(self) -> int:
        """The number of elements (1 for a 0-d tensor)."""
        return math.prod(self.shape)

    @cached_property
    def nbytes(self) -> int:
        """The bytes the tensor takes on disk (packed dtypes: bits × elements / 8)."""
        return self.numel * self.dtype.bits // 8

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@dataclass(frozen=True, slots=True)
class ByteRange:
    """``length`` bytes of ``path`` starting at ``offset``."""

    path: str
    offset: int
    length: int


class LazyTensor:
    """The tensor protocol: a spec known from headers, data produced on demand.

    Every kind implements it: a file range (:class:`FileTensor`), a compressed npz member, an
    output of a planned step (``fusectl.executor.StepOutput``), a name known only from a plan.
    """

    __slots__ = ()  # subclasses may keep theirs in slots: a header can hold 10^6 tensors
    spec: TensorSpec

    def read(self) -> np.ndarray:
        """The tensor's data as a fresh array of ``spec`` (uint8 bytes for packed dtypes)."""
        raise NotImplementedError

    def byte_ranges(self) -> tuple[ByteRange, ...] | None:
        """The tensor's bytes as file ranges, when they can be copied without decoding."""
        return None

    def has_data(self) -> bool:
        """Whether the bytes can be produced (False for a name known only from a plan)."""
        return True


def read_ranges(ranges: tuple[ByteRange, ...], spec: TensorSpec) -> np.ndarray:
    """Read file ranges into one fresh array of ``spec`` (positional reads, no mapping kept)."""
    buffer = bytearray(spec.nbytes)
    view = memoryview(buffer)
    pos = 0
    for r in ranges:
        with open(r.path, "rb") as f:
            got = os.preadv(f.fileno(), [view[pos : pos + r.length]], r.offset)
        if got != r.length:
            raise CheckpointError(
                f"{r.path}: expected {r.length} bytes at offset {r.offset}, got {got}; "
                "the file is truncated or changed while fusectl was reading it"
            )
        pos += r.length
    if spec.dtype.packed:  # raw bytes: several elements share a byte
        return np.frombuffer(buffer, dtype=np.uint8)
    return np.frombuffer(buffer, dtype=spec.dtype.numpy).reshape(spec.shape)


@dataclass(frozen=True, eq=False, slots=True)
class FileTensor(LazyTensor):
    """A tensor stored as raw little-endian bytes in a file (safetensors, uncompressed npy)."""

    spec: TensorSpec
    location: ByteRange

    def byte_ranges(self) -> tuple[ByteRange, ...]:
        """Its one file range."""
        return (self.location,)

    def read(self) -> np.ndarray:
        """Read its range into a fresh array."""
        return read_ranges((self.location,), self.spec)


@dataclass(frozen=True, eq=False, slots=True)
class RangesTensor(LazyTensor):
    """A tensor whose bytes are several file ranges laid end to end, in C order: a parameter
    that each rank of a distributed checkpoint holds a piece of, in a file of its own. Nothing
    is read until asked; a writer copies it range by range."""

    spec: TensorSpec
    ranges: tuple[ByteRange, ...]

    def __post_init__(self):
        if sum(r.length for r in self.ranges) != self.spec.nbytes:
            raise InternalError(f"ranges of {sum(r.length for r in self.ranges)} bytes for a {self.spec} tensor "
                                f"of {self.spec.nbytes}")

    def byte_ranges(self) -> tuple[ByteRange, ...]:
        """Its ranges, in order."""
        return self.ranges

    def read(self) -> np.ndarray:
        """Read its ranges into one fresh array."""
        return read_ranges(self.ranges, self.spec)


@dataclass(frozen=True, eq=False)
class ArrayTensor(LazyTensor):
    """A tensor computed in memory (verify's ΔW of a LoRA module): its array is its data."""

    spec: TensorSpec
    array: np.ndarray

    def read(self) -> np.ndarray:
        """A copy of the array, so that what a caller does to it never reaches the tensor."""
        return self.array.copy()
