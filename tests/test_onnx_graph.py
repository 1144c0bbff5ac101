"""Loading ONNX models (fusectl.onnx.graph): every external tensor is found wherever the model
keeps it — initializers, sparse initializers, node attributes, subgraphs, functions — and each
location is checked before anything reads it; models onnx-ir cannot represent are refused
with one ``error:`` line."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import write_safetensors
from fusectl.errors import CheckpointError
from fusectl.onnx.graph import external_data_files, initializer_views, load_model

F = TensorProto.FLOAT


def _move_out(tensor: TensorProto, folder: Path, location: str, offset: int = 0) -> TensorProto:
    """Store ``tensor``'s bytes in ``folder/location`` at ``offset`` and point the tensor there."""
    raw = tensor.raw_data or numpy_helper.to_array(tensor).tobytes()
    target = folder / location
    with open(target, "ab") as f:
        f.write(b"\0" * (offset - f.tell()) if offset > f.tell() else b"")
        f.write(raw)
    tensor.ClearField("raw_data")
    del tensor.float_data[:], tensor.int64_data[:]
    _point(tensor, location=location, offset=str(offset), length=str(len(raw)))
    return tensor


def _point(tensor: TensorProto, **entries: str) -> TensorProto:
    """Mark ``tensor`` external with exactly these ``external_data`` entries."""
    tensor.data_location = TensorProto.EXTERNAL
    del tensor.external_data[:]
    for key, value in entries.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def _tensor(name: str, values, dtype=np.float32) -> TensorProto:
    return numpy_helper.from_array(np.asarray(values, dtype), name)


def _sparse(name: str, values, indices, dims) -> onnx.SparseTensorProto:
    return helper.make_sparse_tensor(_tensor(name, values), _tensor(f"{name}.indices", indices, np.int64), dims)


def _save(path: Path, graph: onnx.GraphProto, functions=()) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom", 1)],
                              functions=list(functions))
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


def _identity_graph(name: str, nodes=(), initializers=(), sparse=()) -> onnx.GraphProto:
    return helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"]), *nodes], name,
        [helper.make_tensor_value_info("x", F, [2])], [helper.make_tensor_value_info("y", F, [2])],
        list(initializers), sparse_initializer=list(sparse))


# --------------------------------------------------------------------- finding external data


def test_a_model_without_external_data_has_no_files(tmp_path):
    model = _save(tmp_path / "m.onnx", _identity_graph("g", initializers=[_tensor("w", [1, 2])]))
    assert external_data_files(str(model)) == []


def test_every_place_a_tensor_can_live_is_searched(tmp_path):
    """One external file per place; each must be listed once, in any order."""
    d = tmp_path
    init = _move_out(_tensor("w", [1, 2]), d, "init.bin")
    init2 = _move_out(_tensor("w2", [3, 4]), d, "init.bin", offset=64)  # the same file again
    sparse_init = _sparse("s", [5.0], [1], [2])
    _move_out(sparse_init.values, d, "sparse_init.bin")
    const = helper.make_node("Constant", [], ["c"], value=_move_out(_tensor("c", [6, 7]), d, "attr.bin"))
    sparse_attr = _sparse("sa", [8.0], [0], [2])
    _move_out(sparse_attr.indices, d, "sparse_attr.bin")
    const_sparse = helper.make_node("Constant", [], ["cs"], sparse_value=sparse_attr)
    listed = helper.make_node("Holder", [], ["h"], domain="custom",
                              ts=[_move_out(_tensor("t0", [1]), d, "tensors.bin")],
                              sts=[_sparse("st", [9.0], [0], [1])])
    sts = next(a for a in listed.attribute if a.name == "sts")
    _move_out(sts.sparse_tensors[0].values, d, "sparse_tensors.bin")
    branch = _identity_graph("then", initializers=[_move_out(_tensor("b", [1, 1]), d, "branch.bin")])
    other = _identity_graph("else")
    if_node = helper.make_node("If", ["cond"], ["z"], then_branch=branch, else_branch=other)
    nested = _identity_graph("body", initializers=[_move_out(_tensor("n", [2, 2]), d, "graphs.bin")])
    graphs_node = helper.make_node("Looper", [], ["l"], domain="custom", bodies=[nested])
    function = helper.make_function(
        "custom", "F", ["a"], ["b"],
        [helper.make_node("Constant", [], ["k"], value=_move_out(_tensor("k", [3]), d, "function.bin")),
         helper.make_node("Add", ["a", "k"], ["b"])],
        [helper.make_opsetid("", 17)])
    graph = _identity_graph("g", nodes=[const, const_sparse, listed, if_node, graphs_node],
                            initializers=[init, init2], sparse=[sparse_init])
    model = _save(d / "m.onnx", graph, functions=[function])

    found = external_data_files(str(model))
    expected = ["init.bin", "sparse_init.bin", "attr.bin", "sparse_attr.bin", "tensors.bin", "sparse_tensors.bin",
                "branch.bin", "graphs.bin", "function.bin"]
    assert len(found) == len(set(found)), found
    assert sorted(found) == sorted(os.path.realpath(d / name) for name in expected)


def _model_with_external_constant(folder: Path, **entries: str) -> Path:
    """A model whose only external tensor is a Constant inside an If branch, pointed by ``entries``."""
    folder.mkdir(exist_ok=True)
    (folder / "data.bin").write_bytes(np.arange(2, dtype=np.float32).tobytes())
    const = helper.make_node("Constant", [], ["c"], value=_point(_tensor("deep", [0, 0]), **entries))
    branch = _identity_graph("then", nodes=[const])
    graph = _identity_graph("g", nodes=[helper.make_node("If", ["cond"], ["z"], then_branch=branch,
                                                         else_branch=_identity_graph("else"))])
    return _save(folder / "m.onnx", graph)


@pytest.mark.parametrize("entries, needle", [
    ({}, "is marked external but names no location"),
    ({"location": "sub"}, "which is not a regular file"),
    ({"location": "data.bin", "offset": "eight"}, "not whole numbers"),
    ({"location": "data.bin", "length": "1e3"}, "not whole numbers"),
    ({"location": "data.bin", "offset": "-4"}, "not whole numbers from 0 to 2**63-1"),
    ({"location": "data.bin", "offset": "4", "length": "8"}, "at bytes 4..12, past the file's end (8 bytes)"),
    ({"location": "../outside.bin"}, "outside the model's folder"),
    ({"location": "/etc/hostname"}, "an absolute path"),
    ({"location": "gone.bin"}, "which does not exist"),
])
def test_a_bad_location_in_a_subgraph_is_refused_naming_model_and_tensor(tmp_path, entries, needle):
    (tmp_path / "outside.bin").write_bytes(b"\0" * 8)
    model = _model_with_external_constant(tmp_path / "in", **entries)
    (tmp_path / "in" / "sub").mkdir()
    with pytest.raises(CheckpointError) as caught:
        external_data_files(str(model))
    message = str(caught.value)
    assert message.startswith(f"{model}: tensor 'deep'"), message
    assert needle in message, message


def test_a_good_location_in_a_subgraph_is_listed(tmp_path):
    model = _model_with_external_constant(tmp_path / "in", location="data.bin", offset="0", length="8")
    assert external_data_files(str(model)) == [os.path.realpath(tmp_path / "in" / "data.bin")]


def test_a_length_left_out_is_the_tensors_size(tmp_path):
    model = _model_with_external_constant(tmp_path / "in", location="data.bin", offset="0")
    assert external_data_files(str(model)) == [os.path.realpath(tmp_path / "in" / "data.bin")]


@pytest.mark.parametrize("content", [b"", b"\xff" * 64])
def test_a_file_that_is_not_onnx_is_refused(tmp_path, content):
    path = tmp_path / "junk.onnx"
    path.write_bytes(content)
    if not content:  # an empty protobuf parses as an empty model: nothing external in it
        assert external_data_files(str(path)) == []
        return
    with pytest.raises(CheckpointError, match=r"junk\.onnx: not a readable ONNX model"):
        external_data_files(str(path))


def test_a_folder_is_not_a_model(tmp_path):
    with pytest.raises(CheckpointError, match="is a folder, not a regular file.*give the path of an .onnx file"):
        external_data_files(str(tmp_path))


# ------------------------------------------------------------------------ loading with onnx-ir


def test_initializer_views_give_specs_without_reading_and_arrays_on_demand(tmp_path):
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([7, -8, 9], np.int64)
    init = _move_out(numpy_helper.from_array(w, "w"), tmp_path, "w.bin")
    graph = _identity_graph("g", initializers=[init, numpy_helper.from_array(b, "b")])
    readers, specs = initializer_views(load_model(str(_save(tmp_path / "m.onnx", graph))))
    assert specs == {"w": ("float32", (2, 3)), "b": ("int64", (3,))}
    np.testing.assert_array_equal(readers["w"](), w)
    np.testing.assert_array_equal(readers["b"](), b)


def test_load_model_refuses_external_data_outside_the_folder_in_a_subgraph(tmp_path):
    model = _model_with_external_constant(tmp_path / "in", location="data.bin")
    proto = onnx.load(str(model), load_external_data=False)
    branch = next(a.g for a in proto.graph.node[1].attribute if a.name == "then_branch")
    (tmp_path / "outside.bin").write_bytes(b"\0" * 8)
    branch.initializer.append(_point(_tensor("far", [0, 0]), location="../outside.bin", offset="0", length="8"))
    model.write_bytes(proto.SerializeToString())
    with pytest.raises(CheckpointError) as caught:
        load_model(str(model))
    assert "tensor 'far'" in str(caught.value) and "outside the model's folder" in str(caught.value)


def _zipmap_model(path: Path) -> Path:
    """Valid ONNX whose output is a sequence of maps, a type onnx-ir does not represent."""
    graph = helper.make_graph(
        [helper.make_node("ZipMap", ["x"], ["m"], domain="ai.onnx.ml", classlabels_int64s=[0, 1])], "g",
        [helper.make_tensor_value_info("x", F, [1, 2])],
        [helper.make_value_info("m", helper.make_sequence_type_proto(
            helper.make_map_type_proto(TensorProto.INT64, helper.make_tensor_type_proto(F, []))))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


def test_map_names_the_innermost_reason_onnx_ir_cannot_load_a_model(cli, tmp_path):
    """onnx-ir wraps the reason in several SerdeErrors; the message gives the innermost one, on one line."""
    ckpt = write_safetensors(tmp_path / "w.safetensors", {"w": np.ones(2, np.float32)})
    model = _zipmap_model(tmp_path / "zipmap.onnx")
    result = cli("map", ckpt, model)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: {model}: not a readable ONNX model (Map types are not supported")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output
    assert "SerdeError" not in result.stderr and "Error calling" not in result.stderr


def test_initializer_views_skip_an_initializer_without_data():
    """An initializer onnx-ir holds without a value (a model built in memory) has no view."""
    import onnx_ir as ir

    graph = ir.Graph([], [], nodes=[], name="g")
    graph.initializers["empty"] = ir.Value(name="empty")
    graph.register_initializer(ir.Value(name="w", const_value=ir.tensor(np.ones(2, np.float32))))
    readers, specs = initializer_views(ir.Model(graph, ir_version=8))
    assert specs == {"w": ("float32", (2,))} and list(readers) == ["w"]
