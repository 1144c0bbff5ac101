"""Lazy tensors (tensors.py): a spec's sizes, reading file ranges into one array, a truncated
file named with what to do, and the protocol's defaults."""

from __future__ import annotations

import numpy as np
import pytest

from fusectl.dtypes import BY_NAME
from fusectl.errors import CheckpointError, InternalError
from fusectl.tensors import ArrayTensor, ByteRange, FileTensor, LazyTensor, RangesTensor, TensorSpec, read_ranges


def test_spec_sizes_and_text():
    spec = TensorSpec(BY_NAME["BF16"], (3, 4))
    assert spec.numel == 12 and spec.nbytes == 24
    assert str(spec) == f"{BY_NAME['BF16']}[3, 4]"
    assert TensorSpec(BY_NAME["F32"], ()).numel == 1  # a scalar holds one element


def test_a_file_tensor_reads_its_range(tmp_path):
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    path = tmp_path / "raw.bin"
    path.write_bytes(b"HEADER" + data.tobytes() + b"TAIL")
    tensor = FileTensor(TensorSpec(BY_NAME["F32"], (2, 3)), ByteRange(str(path), 6, data.nbytes))
    assert tensor.byte_ranges() == (ByteRange(str(path), 6, 24),)
    np.testing.assert_array_equal(tensor.read(), data)
    assert tensor.has_data()


def test_ranges_from_two_files_make_one_array(tmp_path):
    a, b = np.arange(4, dtype=np.int16), np.arange(4, 8, dtype=np.int16)
    (tmp_path / "a").write_bytes(a.tobytes())
    (tmp_path / "b").write_bytes(b"xx" + b.tobytes())
    got = read_ranges((ByteRange(str(tmp_path / "a"), 0, 8), ByteRange(str(tmp_path / "b"), 2, 8)),
                      TensorSpec(BY_NAME["I16"], (2, 4)))
    np.testing.assert_array_equal(got, np.arange(8, dtype=np.int16).reshape(2, 4))


def test_a_ranges_tensor_is_its_ranges_end_to_end(tmp_path):
    # a parameter whose pieces two ranks' files hold (io/formats/deepspeed_zero)
    a, b = np.arange(4, dtype=np.int16), np.arange(4, 8, dtype=np.int16)
    (tmp_path / "a").write_bytes(a.tobytes())
    (tmp_path / "b").write_bytes(b"xx" + b.tobytes())
    ranges = (ByteRange(str(tmp_path / "a"), 0, 8), ByteRange(str(tmp_path / "b"), 2, 8))
    tensor = RangesTensor(TensorSpec(BY_NAME["I16"], (2, 4)), ranges)
    assert tensor.byte_ranges() == ranges
    np.testing.assert_array_equal(tensor.read(), np.arange(8, dtype=np.int16).reshape(2, 4))
    with pytest.raises(InternalError, match="ranges of 16 bytes"):  # a reader's bug, never a file's
        RangesTensor(TensorSpec(BY_NAME["I16"], (3, 4)), ranges)


def test_a_truncated_file_names_the_file_and_what_happened(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"\0" * 10)
    tensor = FileTensor(TensorSpec(BY_NAME["F32"], (4,)), ByteRange(str(path), 0, 16))
    with pytest.raises(CheckpointError) as e:
        tensor.read()
    assert str(path) in str(e.value) and "expected 16 bytes at offset 0, got 10" in str(e.value)
    assert "truncated" in str(e.value)


def test_an_array_tensor_hands_out_copies():
    array = np.ones((2, 2), np.float32)
    tensor = ArrayTensor(TensorSpec(BY_NAME["F32"], (2, 2)), array)
    got = tensor.read()
    got[0, 0] = 5
    assert array[0, 0] == 1 and tensor.byte_ranges() is None


def test_the_protocol_has_no_data_of_its_own():
    class Named(LazyTensor):
        spec = TensorSpec(BY_NAME["F32"], (1,))

    with pytest.raises(NotImplementedError):
        Named().read()
    assert Named().byte_ranges() is None and Named().has_data()
