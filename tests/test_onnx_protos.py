"""Tensors of an untrusted ONNX model checked before anything loads them (io/formats/onnx_protos.py):
every place a model keeps a tensor is walked and labelled, and each way a tensor can lie — dims,
embedded values, external data — is refused with a CheckpointError naming the model and the
tensor; a sound model passes and lists the external files it reads."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from fusectl.errors import CheckpointError
from fusectl.io.formats.onnx_protos import check_location, check_tensor_protos, tensor_protos

W = np.arange(4, dtype=np.float32).reshape(2, 2)


def model_of(*initializers, nodes=(), sparse=(), functions=()):
    graph = helper.make_graph(list(nodes), "g", [], [], list(initializers), sparse_initializer=list(sparse))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], functions=list(functions))


def external(folder: Path, name="w", data: bytes = W.tobytes(), dims=(2, 2), dtype=TensorProto.FLOAT,
             file="data.bin", **entries):
    if data is not None:
        (folder / file).write_bytes(data)
    tensor = TensorProto(name=name, data_type=dtype, dims=list(dims), data_location=TensorProto.EXTERNAL)
    for key, value in {"location": file, **entries}.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def refusal(tmp_path, *tensors, **kw) -> str:
    with pytest.raises(CheckpointError) as err:
        check_tensor_protos(str(tmp_path / "m.onnx"), model_of(*tensors, **kw))
    return str(err.value)


# ------------------------------------------------------------------- where tensors are kept


def test_every_place_a_model_keeps_a_tensor_is_walked_and_labelled():
    sparse = helper.make_sparse_tensor(numpy_helper.from_array(np.ones(2, np.float32), "sv"),
                                       numpy_helper.from_array(np.array([0, 3], np.int64), ""), [4])
    unnamed = numpy_helper.from_array(np.ones(1, np.float32), "")
    body = helper.make_graph([helper.make_node("Constant", [], ["c"], name="inner", value=unnamed)], "body", [], [],
                             [numpy_helper.from_array(W, "sub_w")])
    nodes = [
        helper.make_node("Constant", [], ["k"], name="const", value=numpy_helper.from_array(W, "kv")),
        helper.make_node("Custom", [], ["t"], name="", domain="x",
                         many=[numpy_helper.from_array(W, "t0"), numpy_helper.from_array(W, "t1")]),
        helper.make_node("Constant", [], ["s"], name="sp", sparse_value=sparse),
        helper.make_node("If", ["cond"], ["y"], name="if", then_branch=body, else_branch=body),
    ]
    function = helper.make_function("f.domain", "F", [], ["o"],
                                    [helper.make_node("Constant", [], ["o"], name="fc", value=unnamed)],
                                    [helper.make_opsetid("", 17)])
    labels = [label for label, _ in tensor_protos(model_of(numpy_helper.from_array(W, "w"), nodes=nodes,
                                                           sparse=[sparse], functions=[function]))]
    assert labels == [
        "tensor 'w'",
        "tensor 'sv'", "the indices of sparse tensor 'sv'",
        "tensor 'kv'",
        "tensor 't0'", "tensor 't1'",
        "tensor 'sv'", "the indices of sparse tensor 'sv'",
        "tensor 'sub_w'", "the tensor of attribute 'value' of node 'inner'",  # else_branch
        "tensor 'sub_w'", "the tensor of attribute 'value' of node 'inner'",  # then_branch
        "the tensor of attribute 'value' of node 'fc'",
    ]
    unlabelled = [label for label, _ in tensor_protos(model_of(TensorProto(data_type=TensorProto.FLOAT)))]
    assert unlabelled == ["an unnamed tensor"]


def test_a_node_without_a_name_is_named_by_its_op():
    node = helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.ones(1, np.float32), ""))
    assert [label for label, _ in tensor_protos(model_of(nodes=[node]))] == \
        ["the tensor of attribute 'value' of node 'Constant'"]


def test_the_sparse_attribute_list_is_walked():
    sparse = helper.make_sparse_tensor(numpy_helper.from_array(np.ones(1, np.float32), "v"),
                                       numpy_helper.from_array(np.array([0], np.int64), "i"), [2])
    node = helper.make_node("Custom", [], ["o"], name="n", domain="x", sparse_list=[sparse, sparse])
    assert [label for label, _ in tensor_protos(model_of(nodes=[node]))] == \
        ["tensor 'v'", "the indices of sparse tensor 'v'"] * 2


def test_a_list_of_subgraphs_is_walked_body_by_body():
    bodies = [helper.make_graph([], f"b{k}", [], [], [numpy_helper.from_array(W, f"w{k}")]) for k in range(2)]
    node = helper.make_node("Custom", [], ["o"], name="n", domain="x", bodies=bodies)
    assert [label for label, _ in tensor_protos(model_of(nodes=[node]))] == ["tensor 'w0'", "tensor 'w1'"]


# ------------------------------------------------------------------- what passes


def test_a_sound_model_passes_and_lists_its_external_files_once_in_first_use_order(tmp_path):
    a = external(tmp_path, "a", file="b.bin")
    b = external(tmp_path, "b", data=W.tobytes() * 2, file="a.bin", offset="16", length="16")
    c = external(tmp_path, "c", data=None, file="b.bin")
    embedded = [numpy_helper.from_array(W, "raw"), helper.make_tensor("typed", TensorProto.FLOAT, [2], [1.0, 2.0]),
                helper.make_tensor("s", TensorProto.STRING, [2], [b"x", b"y"]),
                helper.make_tensor("z", TensorProto.COMPLEX64, [1], [1 + 2j]),
                helper.make_tensor("n4", TensorProto.INT4, [3], [1, 2, 3]),
                helper.make_tensor("i64", TensorProto.INT64, [0, 5], [])]
    files = check_tensor_protos(str(tmp_path / "m.onnx"), model_of(a, b, c, *embedded))
    assert files == [os.path.realpath(tmp_path / "b.bin"), os.path.realpath(tmp_path / "a.bin")]


def test_external_data_without_a_length_reads_to_the_files_end(tmp_path):
    assert check_tensor_protos(str(tmp_path / "m.onnx"), model_of(external(tmp_path, offset="0")))


# ------------------------------------------------------------------- dims


def test_a_negative_dimension_is_refused(tmp_path):
    message = refusal(tmp_path, TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[2, -1]))
    assert message == (f"{tmp_path / 'm.onnx'}: tensor 'w': shape [2, -1] has a negative dimension; dims must be "
                       "whole numbers (the model is corrupt: re-export it)")


def test_dims_past_the_budget_are_refused_naming_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSECTL_MAX_DIMS", "3")
    message = refusal(tmp_path, TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[1, 1, 1, 1]))
    assert "tensor 'w': 4 dimensions of one tensor exceeds fusectl's limit of 3" in message
    assert "FUSECTL_MAX_DIMS=4" in message


@pytest.mark.parametrize("raw", [False, True], ids=["typed-fields", "raw-data"])
def test_a_dtype_onnx_knows_and_onnx_ir_does_not_is_refused_naming_the_tensor(tmp_path, monkeypatch, raw):
    """onnx 1.23 added INT2, which onnx-ir 0.1 has no member for: the lookup was a KeyError
    (exit 70). Here onnx-ir is made to lack INT4, which every onnx release fusectl supports has."""
    import onnx_ir as ir

    monkeypatch.setattr(ir, "DataType", {k: v for k, v in ir.DataType.__members__.items() if k != "INT4"})
    tensor = (TensorProto(name="w", data_type=TensorProto.INT4, dims=[4], raw_data=b"\0\0") if raw
              else helper.make_tensor("w", TensorProto.INT4, [4], [1, 1, 1, 1]))
    message = refusal(tmp_path, tensor)
    assert message == (f"{tmp_path / 'm.onnx'}: tensor 'w': its dtype INT4 is one onnx-ir {ir.__version__} does "
                       "not know; upgrade onnx-ir (pip install -U onnx-ir) to read it")


def test_many_dims_are_shown_in_part(tmp_path):
    message = refusal(tmp_path, TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[1] * 9 + [-1]))
    assert "shape [1, 1, 1, 1, 1, 1, 1, 1, … (10 dims)] has a negative dimension" in message


def test_a_size_past_2_to_the_63_bytes_is_refused(tmp_path):
    message = refusal(tmp_path, TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[2**31, 2**31, 0]))
    assert "tensor 'w': shape [2147483648, 2147483648, 0] of FLOAT is too large to be stored (past 2**63 bytes)" \
        in message


def test_a_tensor_of_an_unknown_dtype_is_left_to_the_loader(tmp_path):
    odd = TensorProto(name="w", data_type=999, dims=[2])
    assert check_tensor_protos(str(tmp_path / "m.onnx"), model_of(odd)) == []


# ------------------------------------------------------------------- embedded values


def test_raw_data_of_the_wrong_size_is_refused(tmp_path):
    message = refusal(tmp_path, TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[2, 2], raw_data=b"\0" * 12))
    assert message.endswith("tensor 'w': holds 12 bytes of data, but shape [2, 2] of FLOAT needs 16; "
                            "the model is corrupt")


def test_values_in_a_field_the_dtype_does_not_use_are_refused(tmp_path):
    tensor = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[2])
    tensor.int64_data.extend([1, 2])
    message = refusal(tmp_path, tensor)
    assert "tensor 'w': keeps its values in int64_data, which ONNX does not use for FLOAT " \
           "(it uses float_data or raw_data)" in message


@pytest.mark.parametrize("dtype, dims, field, values, need", [
    (TensorProto.FLOAT, [3], "float_data", [1.0, 2.0], 3),
    (TensorProto.INT8, [2], "int32_data", [], 2),  # onnx-ir would fill it with zeros
    (TensorProto.COMPLEX64, [2], "float_data", [1.0, 2.0], 4),
    (TensorProto.UINT4, [3], "int32_data", [1, 2, 3], 2),  # two values a byte
    (TensorProto.DOUBLE, [1], "double_data", [1.0, 2.0], 1),
])
def test_values_that_do_not_fill_the_dims_are_refused(tmp_path, dtype, dims, field, values, need):
    tensor = TensorProto(name="w", data_type=dtype, dims=dims)
    getattr(tensor, field).extend(values)
    message = refusal(tmp_path, tensor)
    assert f"tensor 'w': holds {len(values)} values in {field}, but shape {dims} of " \
           f"{TensorProto.DataType.Name(dtype)} needs {need}; the model is corrupt" in message


# ------------------------------------------------------------------- external data


def test_an_undefined_external_data_key_is_refused(tmp_path):
    message = refusal(tmp_path, external(tmp_path, basepath="/etc"))
    assert "tensor 'w': its external data has the key 'basepath', which ONNX does not define " \
           "(only checksum, length, location, offset)" in message


def test_no_location_is_refused(tmp_path):
    tensor = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[2, 2], data_location=TensorProto.EXTERNAL)
    assert refusal(tmp_path, tensor) == \
        f"{tmp_path / 'm.onnx'}: tensor 'w' is marked external but names no location; re-export the model"


@pytest.mark.parametrize("location, words", [
    ("da\0ta.bin", "a name with a NUL byte, which no file can have"),
    ("/etc/passwd", "an absolute path; external data must lie in the model's folder"),
    ("../data.bin", "outside the model's folder"),
    ("missing.bin", "which does not exist; put the file beside the model"),
    ("sub", "which is not a regular file; external data must be a plain file"),
])
def test_a_location_that_is_not_a_file_in_the_models_folder_is_refused(tmp_path, location, words):
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    (tmp_path / "data.bin").write_bytes(W.tobytes())
    with pytest.raises(CheckpointError) as err:
        check_tensor_protos(str(folder / "m.onnx"), model_of(external(folder, data=None, file=location)))
    message = str(err.value)
    assert message.startswith(f"{folder / 'm.onnx'}: tensor 'w' keeps its data in ")
    assert words in message


def test_a_link_out_of_the_folder_is_refused(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "secret.bin").write_bytes(W.tobytes())
    (folder / "data.bin").symlink_to(tmp_path / "secret.bin")
    with pytest.raises(CheckpointError, match="outside the model's folder"):
        check_tensor_protos(str(folder / "m.onnx"), model_of(external(folder, data=None)))


@pytest.mark.parametrize("entries", [{"offset": "-1"}, {"offset": "x"}, {"length": "1e3"},
                                     {"offset": "9" * 20}, {"length": str(2**63)}])
def test_offsets_and_lengths_must_be_whole_numbers(tmp_path, entries):
    message = refusal(tmp_path, external(tmp_path, **entries))
    assert "not whole numbers from 0 to 2**63-1; re-export the model" in message


def test_a_long_offset_is_shortened_in_the_message(tmp_path):
    message = refusal(tmp_path, external(tmp_path, offset="1" * 60))
    assert "with offset '" + "1" * 37 + "...'" in message


def test_a_length_other_than_the_tensors_bytes_is_refused(tmp_path):
    message = refusal(tmp_path, external(tmp_path, length="12"))
    assert "keeps its data in 'data.bin' with length 12, but shape [2, 2] of FLOAT needs 16 bytes" in message


def test_bytes_past_the_files_end_are_refused(tmp_path):
    message = refusal(tmp_path, external(tmp_path, offset="8"))
    assert "at bytes 8..24, past the file's end (16 bytes); the file is truncated or not this model's" in message


def test_check_location_with_an_unknown_size_reads_the_rest_and_names_the_shape(tmp_path):
    (tmp_path / "d.bin").write_bytes(b"\0" * 10)
    folder = os.path.realpath(tmp_path)
    assert check_location("m.onnx", folder, "tensor 's'", "d.bin", "4", None, None) == os.path.join(folder, "d.bin")
    # an offset past the end is refused even when there is nothing to read
    with pytest.raises(CheckpointError, match=r"at bytes 20\.\.20, past the file's end \(10 bytes\)"):
        check_location("m.onnx", folder, "tensor 's'", "d.bin", "20", None, None)
    with pytest.raises(CheckpointError, match=r"with length 3, but its shape needs 4 bytes"):
        check_location("m.onnx", folder, "tensor 's'", "d.bin", "0", "3", 4)


def test_control_characters_in_the_models_path_are_escaped(tmp_path):
    folder = tmp_path / "a\x1bb"
    folder.mkdir()
    with pytest.raises(CheckpointError) as err:
        check_tensor_protos(str(folder / "m.onnx"), model_of(TensorProto(name="w\x07", data_type=1, dims=[-1])))
    assert "\x1b" not in str(err.value) and "\x07" not in str(err.value)
    assert "a\\x1bb" in str(err.value) and "'w\\x07'" in str(err.value)
