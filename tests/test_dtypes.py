"""The dtype table agrees with the onnx and safetensors packages it stands in for."""

import onnx
import pytest

from fusectl import dtypes


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
