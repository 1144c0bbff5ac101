"""The dtype table agrees with the onnx and safetensors packages it stands in for."""

import ml_dtypes
import numpy as np
import onnx
import pytest

from fusectl import dtypes
from fusectl.errors import CheckpointError


@pytest.mark.parametrize("name", sorted(n for n in dir(dtypes.TensorProto) if n.isupper()))
def test_onnx_type_numbers_match_the_onnx_package(name):
    assert getattr(dtypes.TensorProto, name) == getattr(onnx.TensorProto, name)


@pytest.mark.parametrize("dtype", [d for d in dtypes.BY_NAME.values() if d.onnx is not None])
def test_onnx_types_have_the_same_width(dtype):
    np_type = onnx.helper.tensor_dtype_to_np_dtype(dtype.onnx)
    assert np_type.itemsize == dtype.itemsize


def test_packed_dtypes_are_not_array_dtypes():
    assert {"F4", "F6_E2M3", "F6_E3M2"} <= set(dtypes.BY_NAME)
    assert not {"F4", "F6_E2M3", "F6_E3M2"} & set(dtypes.ARRAY_DTYPES)
    assert dtypes.BY_NAME["F4"].bits == 4 and dtypes.BY_NAME["BF16"].bits == 16


# what each dtype is read as, spelled from the packages themselves (dtypes.py names them by string
# so that ml_dtypes is imported only when one of its types is needed)
NUMPY_OF = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
            "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64, "F16": np.float16,
            "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F64": np.float64, "C64": np.complex64,
            "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E4M3FNUZ": ml_dtypes.float8_e4m3fnuz,
            "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
            "F8_E8M0": ml_dtypes.float8_e8m0fnu, "F4": np.uint8, "F6_E2M3": np.uint8, "F6_E3M2": np.uint8}


def test_every_dtype_reads_as_its_numpy_or_ml_dtypes_type():
    assert set(NUMPY_OF) == set(dtypes.BY_NAME)
    for name, dtype in dtypes.BY_NAME.items():
        assert dtype.numpy == np.dtype(NUMPY_OF[name]), name
        assert dtype.itemsize == dtype.numpy.itemsize, name
        assert dtype.is_float == (dtype.numpy.kind == "f" or dtype.numpy.type.__module__ == "ml_dtypes"), name


@pytest.mark.parametrize("dtype", list(dtypes.ARRAY_DTYPES.values()), ids=str)
def test_from_numpy_finds_every_array_dtype(dtype):
    assert dtypes.from_numpy(np.empty(1, dtype.numpy).dtype, "x") is dtype


def test_from_numpy_refuses_what_it_does_not_read():
    with pytest.raises(CheckpointError, match="m.npz: unsupported numpy dtype <U3"):
        dtypes.from_numpy(np.dtype("<U3"), "m.npz")
    with pytest.raises(CheckpointError, match="unsupported numpy dtype int4"):
        dtypes.from_numpy(ml_dtypes.int4, "m.npz")
