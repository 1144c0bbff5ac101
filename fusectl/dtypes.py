"""One table of tensor dtypes: safetensors name, numpy dtype (ml_dtypes for bf16/fp8), ONNX type."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .errors import CheckpointError


@dataclass(frozen=True)
class DType:
    """A tensor element type as fusectl knows it."""

    safetensors: str
    numpy: np.dtype
    onnx: int | None
    # bits per element; below 8 for safetensors' packed F4/F6 types, whose bytes fusectl
    # can copy, rename or drop but not compute on (numpy has no packed sub-byte arrays)
    bits: int = 0

    @property
    def itemsize(self) -> int:
        """Bytes per element of the numpy dtype the data is read as (1 for packed dtypes' raw bytes)."""
        return self.numpy.itemsize

    @property
    def packed(self) -> bool:
        """Whether elements are packed below one byte each (F4/F6): only renamed, dropped or copied."""
        return 0 < self.bits < 8

    @property
    def is_float(self) -> bool:
        """Whether it is a floating-point type (bf16 and fp8 included), as numeric ops require."""
        return self.numpy.kind == "f" or self.safetensors.startswith(("BF", "F8"))

    def __str__(self) -> str:
        return self.safetensors


class TensorProto:
    """ONNX ``TensorProto.DataType`` numbers (fixed by the ONNX spec; a test checks them against
    the onnx package). Spelled out so that reading and writing checkpoints never imports onnx."""

    FLOAT, UINT8, INT8, UINT16, INT16, INT32, INT64 = 1, 2, 3, 4, 5, 6, 7
    BOOL, FLOAT16, DOUBLE, UINT32, UINT64, COMPLEX64 = 9, 10, 11, 12, 13, 14
    BFLOAT16, FLOAT8E4M3FN, FLOAT8E4M3FNUZ, FLOAT8E5M2, FLOAT8E5M2FNUZ = 16, 17, 18, 19, 20
    FLOAT8E8M0 = 24


def _d(name: str, np_type, onnx_type: int | None, bits: int = 0) -> DType:
    return DType(name, np.dtype(np_type), onnx_type, bits or np.dtype(np_type).itemsize * 8)


_ALL = [
    _d("BOOL", np.bool_, TensorProto.BOOL),
    _d("U8", np.uint8, TensorProto.UINT8),
    _d("I8", np.int8, TensorProto.INT8),
    _d("U16", np.uint16, TensorProto.UINT16),
    _d("I16", np.int16, TensorProto.INT16),
    _d("U32", np.uint32, TensorProto.UINT32),
    _d("I32", np.int32, TensorProto.INT32),
    _d("U64", np.uint64, TensorProto.UINT64),
    _d("I64", np.int64, TensorProto.INT64),
    _d("F16", np.float16, TensorProto.FLOAT16),
    _d("BF16", ml_dtypes.bfloat16, TensorProto.BFLOAT16),
    _d("F32", np.float32, TensorProto.FLOAT),
    _d("F64", np.float64, TensorProto.DOUBLE),
    _d("C64", np.complex64, TensorProto.COMPLEX64),
    _d("F8_E4M3", ml_dtypes.float8_e4m3fn, TensorProto.FLOAT8E4M3FN),
    _d("F8_E4M3FNUZ", ml_dtypes.float8_e4m3fnuz, TensorProto.FLOAT8E4M3FNUZ),
    _d("F8_E5M2", ml_dtypes.float8_e5m2, TensorProto.FLOAT8E5M2),
    _d("F8_E5M2FNUZ", ml_dtypes.float8_e5m2fnuz, TensorProto.FLOAT8E5M2FNUZ),
    _d("F8_E8M0", ml_dtypes.float8_e8m0fnu, TensorProto.FLOAT8E8M0),
    _d("F4", np.uint8, None, bits=4),
    _d("F6_E2M3", np.uint8, None, bits=6),
    _d("F6_E3M2", np.uint8, None, bits=6),
]

BY_NAME: dict[str, DType] = {d.safetensors: d for d in _ALL}
# the dtypes a numpy array can hold element by element (all but the packed sub-byte ones)
ARRAY_DTYPES: dict[str, DType] = {n: d for n, d in BY_NAME.items() if not d.packed}
_BY_NUMPY: dict[np.dtype, DType] = {d.numpy: d for d in reversed(_ALL) if not d.packed}


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
    """Look up the DType of a numpy (or ml_dtypes) dtype."""
    try:
        return _BY_NUMPY[np.dtype(dtype)]
    except KeyError:
        raise CheckpointError(f"{where}: unsupported numpy dtype {np.dtype(dtype)}") from None
