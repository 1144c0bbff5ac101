"""One table of tensor dtypes: safetensors name, numpy dtype (ml_dtypes for bf16/fp8), ONNX type."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
from onnx import TensorProto

from .errors import CheckpointError


@dataclass(frozen=True)
class DType:
    """A tensor element type as fusectl knows it."""

    safetensors: str
    numpy: np.dtype
    onnx: int | None

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize

    @property
    def is_float(self) -> bool:
        return self.numpy.kind == "f" or self.safetensors.startswith(("BF", "F8"))

    def __str__(self) -> str:
        return self.safetensors


def _d(name: str, np_type, onnx_type: int | None) -> DType:
    return DType(name, np.dtype(np_type), onnx_type)


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
    _d("C128", np.complex128, TensorProto.COMPLEX128),
    _d("F8_E4M3", ml_dtypes.float8_e4m3fn, TensorProto.FLOAT8E4M3FN),
    _d("F8_E4M3FNUZ", ml_dtypes.float8_e4m3fnuz, TensorProto.FLOAT8E4M3FNUZ),
    _d("F8_E5M2", ml_dtypes.float8_e5m2, TensorProto.FLOAT8E5M2),
    _d("F8_E5M2FNUZ", ml_dtypes.float8_e5m2fnuz, TensorProto.FLOAT8E5M2FNUZ),
    _d("F8_E8M0", ml_dtypes.float8_e8m0fnu, getattr(TensorProto, "FLOAT8E8M0", None)),
]

BY_NAME: dict[str, DType] = {d.safetensors: d for d in _ALL}
_BY_NUMPY: dict[np.dtype, DType] = {d.numpy: d for d in _ALL}


def from_safetensors(name: str, where: str) -> DType:
    """Look up a safetensors dtype string; ``where`` names the file and tensor for the error."""
    try:
        return BY_NAME[name]
    except KeyError:
        known = ", ".join(BY_NAME)
        raise CheckpointError(
            f"{where}: unknown dtype {name!r}; fusectl reads {known}"
        ) from None


def from_numpy(dtype: np.dtype, where: str) -> DType:
    """Look up the DType of a numpy (or ml_dtypes) dtype."""
    try:
        return _BY_NUMPY[np.dtype(dtype)]
    except KeyError:
        raise CheckpointError(f"{where}: unsupported numpy dtype {np.dtype(dtype)}") from None


def compute_dtype(dtype: DType) -> np.dtype:
    """The dtype numeric ops compute in: float64 for float64 inputs, float32 otherwise."""
    return np.dtype(np.float64) if dtype.numpy == np.float64 else np.dtype(np.float32)
