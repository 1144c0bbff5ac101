"""``verify --inputs FILE.npz`` read directly (verification/inputs_file.py): the arrays by name,
their shapes and dtypes from the headers alone, each array decompressed only when looked up,
and every refusal a VerifyError naming ``--inputs FILE`` and the array.

Through ``fusectl verify`` the same archive refusals are in test_verify_edges.py (duplicate
names, npy 4.0, negative shapes, short data, damaged members, a file replaced after loading)
and test_verify_hostile.py (folders, FIFOs, text, objects, zip bombs, huge declared shapes)."""

from __future__ import annotations

import re
import zipfile

import numpy as np
import pytest

from fusectl.errors import FusectlError, VerifyError, cli_vocabulary
from fusectl.verification.inputs_file import InputsFile, load_inputs_file
from test_verify_edges import _npy, _npy_raw, _zip


def test_no_inputs_file_is_no_arrays():
    assert load_inputs_file(None) == {}


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_every_array_reads_back_as_saved(tmp_path, save):
    arrays = {"ids": np.arange(6, dtype=np.int64).reshape(2, 3), "mask": np.array([True, False]),
              "x": np.asfortranarray(np.arange(12, dtype=np.float16).reshape(3, 4)), "scalar": np.float32(2.5),
              "empty": np.zeros((0, 3), np.float32)}
    path = tmp_path / "in.npz"
    save(path, **arrays)
    inputs = load_inputs_file(str(path))
    assert isinstance(inputs, InputsFile) and sorted(inputs) == sorted(arrays) and len(inputs) == 5
    assert inputs.declared["x"] == ((3, 4), np.dtype(np.float16))
    assert inputs.declared["scalar"] == ((), np.dtype(np.float32))
    for name, array in arrays.items():
        got = inputs[name]
        assert got.dtype == np.asarray(array).dtype and got.shape == np.shape(array)
        np.testing.assert_array_equal(got, array)


def test_an_unknown_name_is_a_key_error(tmp_path):
    path = tmp_path / "in.npz"
    np.savez(path, x=np.ones(2))
    with pytest.raises(KeyError):
        load_inputs_file(str(path))["y"]


def test_a_lone_npy_array_is_refused_saying_how_to_save_named_arrays(tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, np.ones(2))
    with cli_vocabulary(), pytest.raises(VerifyError) as info:
        load_inputs_file(str(path))
    assert str(info.value) == (f"--inputs {path}: a single .npy array, not an .npz of named arrays; save the inputs "
                               "with np.savez(FILE, NAME=array, ...), one name per model input")


def test_the_library_names_the_keyword_argument():
    with pytest.raises(VerifyError, match="^inputs /nonexistent/in.npz: no such file; pass an .npz"):
        load_inputs_file("/nonexistent/in.npz")


def test_a_file_that_is_not_a_zip_is_refused(tmp_path):
    path = tmp_path / "in.npz"
    path.write_bytes(b"not a zip at all")
    with pytest.raises(VerifyError, match=re.escape(f"{path}: not a readable .npz archive (")):
        load_inputs_file(str(path))


def test_a_member_that_is_not_an_npy_array_is_named(tmp_path):
    path = _zip(tmp_path / "in.npz", [("x.npy", _npy(np.ones(2))), ("notes.txt", b"hello")])
    with pytest.raises(VerifyError, match="member 'notes.txt' is not an .npy array"):
        load_inputs_file(str(path))


def test_python_objects_are_refused_unpickled(tmp_path):
    path = _zip(tmp_path / "in.npz", [("x.npy", _npy_raw("{'descr': '|O', 'fortran_order': False, 'shape': (1,), }",
                                                          b"\x80\x02N."))])
    with pytest.raises(VerifyError, match=r"array 'x' holds Python objects \(object\); fusectl never unpickles"):
        load_inputs_file(str(path))


def test_more_dimensions_than_the_budget_are_refused(tmp_path, monkeypatch):
    path = tmp_path / "in.npz"
    np.savez(path, x=np.zeros((1, 1, 1, 1), np.float32))
    monkeypatch.setenv("FUSECTL_MAX_DIMS", "3")
    with pytest.raises(VerifyError, match="array 'x': 4 dimensions of one tensor exceeds fusectl's limit of 3"):
        load_inputs_file(str(path))


def test_more_members_than_the_tensor_budget_are_refused(tmp_path, monkeypatch):
    path = tmp_path / "in.npz"
    np.savez(path, a=np.zeros(1), b=np.zeros(1), c=np.zeros(1))
    monkeypatch.setenv("FUSECTL_MAX_TENSORS", "2")
    with pytest.raises(VerifyError, match="3 tensors in one checkpoint exceeds fusectl's limit of 2"):
        load_inputs_file(str(path))


def test_the_zip_declaring_more_than_the_byte_budget_is_refused_first(tmp_path, monkeypatch):
    path = tmp_path / "in.npz"
    np.savez_compressed(path, a=np.zeros(100, np.float32), b=np.zeros(100, np.float32))
    monkeypatch.setenv("FUSECTL_MAX_VERIFY_INPUT_BYTES", "600")
    sizes = sum(i.file_size for i in zipfile.ZipFile(path).infolist())
    with pytest.raises(VerifyError, match=re.escape(f"{path}: {sizes} bytes of arrays in one verify --inputs file")):
        load_inputs_file(str(path))


def test_an_npy_header_declaring_more_than_the_budget_names_its_array(tmp_path, monkeypatch):
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1000,), }"
    path = _zip(tmp_path / "in.npz", [("x.npy", _npy(np.ones(2))), ("y.npy", _npy_raw(header))])
    monkeypatch.setenv("FUSECTL_MAX_VERIFY_INPUT_BYTES", "1000")
    with pytest.raises(VerifyError, match=re.escape(f"{path}: array 'y': 4000 bytes of arrays")):
        load_inputs_file(str(path))


def test_an_array_cut_short_after_loading_is_refused_when_read(tmp_path):
    path = tmp_path / "in.npz"
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }"
    _zip(path, [("x.npy", _npy_raw(header, b"\0" * 16))])
    inputs = load_inputs_file(str(path))
    _zip(path, [("x.npy", _npy_raw(header, b"\0" * 8))])  # the same header, half the data
    with pytest.raises(VerifyError, match="array 'x' holds 8 of its 16 bytes; the archive is truncated"):
        inputs["x"]


def test_every_refusal_is_a_fusectl_error(tmp_path):
    path = _zip(tmp_path / "in.npz", [("x.npy", b"\x93NUMPY garbage")])
    with pytest.raises(FusectlError, match="array 'x' is unreadable"):
        load_inputs_file(str(path))


def test_a_member_in_a_folder_is_named_by_its_whole_path_as_numpy_names_it(tmp_path):
    path = _zip(tmp_path / "in.npz", [("sub/x.npy", _npy(np.ones(3, np.int32)))])
    inputs = load_inputs_file(str(path))
    assert list(inputs) == list(np.load(path).files) == ["sub/x"]
    assert inputs["sub/x"].tolist() == [1, 1, 1]
