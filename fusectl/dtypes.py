"""One table of tensor dtypes: safetensors name, numpy dtype (ml_dtypes for bf16/fp8), ONNX type.

ml_dtypes, which defines numpy's bf16 and fp8 types, is imported the first time one of its types
is needed (``DType.numpy`` of BF16 or F8_*): a header, a plan or an inspect of any checkpoint,
and all work on one without bf16/fp8 tensors, never pays for it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .errors import CheckpointError


@dataclass(frozen=True)
class DType:
    """A tensor element type as fusectl knows it."""

    safetensors: str
    # where the numpy type lives: "numpy.float32", or "ml_dtypes.bfloat16" for bf16 and fp8
    numpy_type: str
    onnx: int | None
    # bits per element; below 8 for safetensors' packed F4/F6 types, whose bytes fusectl
    # can copy, rename or drop but not compute on (numpy has no packed sub-byte arrays)
    bits: int

    @cached_property
    def numpy(self) -> np.dtype:
        """The numpy dtype the data is read as (uint8 for packed dtypes' raw bytes); for bf16 and
        fp8 the first use imports ml_dtypes."""
        module, name = self.numpy_type.split(".")
        return np.dtype(getattr(importlib.import_module(module), name))

    @property
    def itemsize(self) -> int:
        """Bytes per element of the numpy dtype the data is read as (1 for packed dtypes' raw bytes)."""
        return 1 if self.packed else self.bits // 8

    @property
    def packed(self) -> bool:
        """Whether elements are packed below one byte each (F4/F6): only renamed, dropped or copied."""
        return 0 < self.bits < 8

    @property
    def is_float(self) -> bool:
        """Whether it is a floating-point type (bf16 and fp8 included), as numeric ops require."""
        return self.safetensors.startswith(("BF", "F8")) or self.numpy.kind == "f"

    def __str__(self) -> str:
        return self.safetensors


class TensorProto:
    """ONNX ``TensorProto.DataType`` numbers (fixed by the ONNX spec; a test checks them against
    the onnx package). Spelled out so that reading and writing checkpoints never imports onnx."""

    FLOAT, UINT8, INT8, UINT16, INT16, INT32, INT64 = 1, 2, 3, 4, 5, 6, 7
    BOOL, FLOAT16, DOUBLE, UINT32, UINT64, COMPLEX64 = 9, 10, 11, 12, 13, 14
    BFLOAT16, FLOAT8E4M3FN, FLOAT8E4M3FNUZ, FLOAT8E5M2, FLOAT8E5M2FNUZ = 16, 17, 18, 19, 20
    FLOAT8E8M0 = 24


_ALL = [
    DType("BOOL", "numpy.bool_", TensorProto.BOOL, 8),
    DType("U8", "numpy.uint8", TensorProto.UINT8, 8),
    DType("I8", "numpy.int8", TensorProto.INT8, 8),
    DType("U16", "numpy.uint16", TensorProto.UINT16, 16),
    DType("I16", "numpy.int16", TensorProto.INT16, 16),
    DType("U32", "numpy.uint32", TensorProto.UINT32, 32),
    DType("I32", "numpy.int32", TensorProto.INT32, 32),
    DType("U64", "numpy.uint64", TensorProto.UINT64, 64),
    DType("I64", "numpy.int64", TensorProto.INT64, 64),
    DType("F16", "numpy.float16", TensorProto.FLOAT16, 16),
    DType("BF16", "ml_dtypes.bfloat16", TensorProto.BFLOAT16, 16),
    DType("F32", "numpy.float32", TensorProto.FLOAT, 32),
    DType("F64", "numpy.float64", TensorProto.DOUBLE, 64),
    DType("C64", "numpy.complex64", TensorProto.COMPLEX64, 64),
    DType("F8_E4M3", "ml_dtypes.float8_e4m3fn", TensorProto.FLOAT8E4M3FN, 8),
    DType("F8_E4M3FNUZ", "ml_dtypes.float8_e4m3fnuz", TensorProto.FLOAT8E4M3FNUZ, 8),
    DType("F8_E5M2", "ml_dtypes.float8_e5m2", TensorProto.FLOAT8E5M2, 8),
    DType("F8_E5M2FNUZ", "ml_dtypes.float8_e5m2fnuz", TensorProto.FLOAT8E5M2FNUZ, 8),
    DType("F8_E8M0", "ml_dtypes.float8_e8m0fnu", TensorProto.FLOAT8E8M0, 8),
    # packed: read as their raw bytes
    DType("F4", "numpy.uint8", None, 4),
    DType("F6_E2M3", "numpy.uint8", None, 6),
    DType("F6_E3M2", "numpy.uint8", None, 6),
]

BY_NAME: dict[str, DType] = {d.safetensors: d for d in _ALL}
# the dtypes a numpy array can hold element by element (all but the packed sub-byte ones)
ARRAY_DTYPES: dict[str, DType] = {n: d for n, d in BY_NAME.items() if not d.packed}
# numpy dtype -> DType, for numpy's own types; ml_dtypes' are looked up when an array of one is
# met (ml_dtypes is then imported already, so naming its types costs nothing)
_BY_NUMPY: dict[np.dtype, DType] = {d.numpy: d for d in reversed(_ALL)
                                    if not d.packed and d.numpy_type.startswith("numpy.")}


def from_safetensors(name: object, where: str) -> DType:
    """Look up a safetensors dtype string; ``where`` names the file and tensor for the error.

    >>> from_safetensors("BF16", "m.safetensors").numpy.name
    'bfloat16'
    >>> from_safetensors(["F32"], "m.safetensors: tensor 'w'")
    Traceback (most recent call last):
    ...
    fusectl.errors.CheckpointError: m.safetensors: tensor 'w': the dtype must be a string such as "F32", not a list; the file is corrupt
    """
    if not isinstance(name, str):
        raise CheckpointError(
            f"{where}: the dtype must be a string such as \"F32\", not {_kind(name)}; the file is corrupt"
        )
    try:
        return BY_NAME[name]
    except KeyError:
        known = ", ".join(BY_NAME)
        shown = repr(name) if len(name) <= 40 else repr(name[:40]) + "..."
        raise CheckpointError(
            f"{where}: unknown dtype {shown}; fusectl reads {known}"
        ) from None


def _kind(value: object) -> str:
    return {list: "a list", dict: "an object", bool: "a boolean", int: "a number", float: "a number",
            type(None): "null"}.get(type(value), type(value).__name__)


def from_numpy(dtype: np.dtype, where: str) -> DType:
    """Look up the DType of a numpy (or ml_dtypes) dtype.

    >>> from_numpy(np.float32, "m.npz").safetensors
    'F32'
    """
    dtype = np.dtype(dtype)
    if dtype not in _BY_NUMPY and dtype.type.__module__ == "ml_dtypes":
        _BY_NUMPY.update((d.numpy, d) for d in _ALL if d.numpy_type.startswith("ml_dtypes."))
    try:
        return _BY_NUMPY[dtype]
    except KeyError:
        raise CheckpointError(f"{where}: unsupported numpy dtype {dtype}") from None
