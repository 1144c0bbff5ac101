"""Hostile ONNX tensors through every command that reads a model (issue 18, items 4 and 7).

Each model is a tiny MatMul graph (``y = x @ w``) built with onnx.helper whose weight ``w`` is
made wrong one way: external data at a location with a NUL byte, offsets and lengths that are
negative, not numbers, too long or past the file's end, a key ONNX does not define; an
initializer whose dims are negative, too many or too large, or whose values do not fill them.
``inspect``, ``convert``, ``verify`` (two models), ``map`` and ``export --graph`` must each
refuse it with one ``error:`` line naming the model and the tensor (exit 2, never 70), and
write nothing. The same graph with a sound ``w`` passes every command (the refusals are the
tensor's, not the graph's).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import ok, refused, write_safetensors

W = np.arange(4, dtype=np.float32).reshape(2, 2)


def _save(folder: Path, weight: TensorProto, nodes=()) -> Path:
    """``folder/m.onnx``: y = x @ w (x, w float32 [2, 2]), with ``weight`` as w."""
    folder.mkdir(parents=True, exist_ok=True)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), *nodes], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "m.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def _external(folder: Path, **entries: str) -> Path:
    """w's 16 bytes in ``folder/data.bin``, pointed at by exactly these ``external_data`` entries."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "data.bin").write_bytes(W.tobytes())
    weight = numpy_helper.from_array(W, "w")
    weight.ClearField("raw_data")
    weight.data_location = TensorProto.EXTERNAL
    for key, value in entries.items():
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    return _save(folder, weight)


def _embedded(folder: Path, dims, raw: bytes | None = None, **values) -> Path:
    """w with these dims and exactly this raw_data or typed ``values`` (float_data=[...], …)."""
    weight = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=dims)
    if raw is not None:
        weight.raw_data = raw
    for field, items in values.items():
        getattr(weight, field).extend(items)
    return _save(folder, weight)


def _external_dims(folder: Path, dims) -> Path:
    """w in data.bin (offset 0, length 16) but with these dims."""
    path = _external(folder, location="data.bin", offset="0", length="16")
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    del model.graph.initializer[0].dims[:]
    model.graph.initializer[0].dims.extend(dims)
    path.write_bytes(model.SerializeToString())
    return path


def _constant_with_negative_dims(folder: Path) -> Path:
    """A sound w, and an unnamed Constant tensor of dims [-1] beside the MatMul."""
    value = TensorProto(data_type=TensorProto.FLOAT, dims=[-1])
    const = helper.make_node("Constant", [], ["c"], name="bad_const", value=value)
    return _save(folder, numpy_helper.from_array(W, "w"), [const])


HOSTILE = {
    # item 7: external data locations, offsets and lengths
    "nul-in-location": (lambda d: _external(d, location="data\0.bin", offset="0", length="16"),
                        ["'data\\x00.bin'", "NUL byte"]),
    "negative-offset": (lambda d: _external(d, location="data.bin", offset="-4", length="16"),
                        ["offset '-4'", "not whole numbers"]),
    "negative-length": (lambda d: _external(d, location="data.bin", offset="0", length="-16"),
                        ["length '-16'", "not whole numbers"]),
    "word-offset": (lambda d: _external(d, location="data.bin", offset="eight"),
                    ["offset 'eight'", "not whole numbers"]),
    "float-length": (lambda d: _external(d, location="data.bin", length="1e3"), ["length '1e3'", "not whole numbers"]),
    # int() reads these; ONNX (and onnxruntime's stoll) offsets are plain ASCII digits
    "spaced-offset": (lambda d: _external(d, location="data.bin", offset=" 0"), ["offset ' 0'", "not whole numbers"]),
    "arabic-digits": (lambda d: _external(d, location="data.bin", offset="\u0660"), ["not whole numbers"]),
    "huge-offset": (lambda d: _external(d, location="data.bin", offset="9" * 40, length="16"),
                    ["offset '999", "not whole numbers from 0 to 2**63-1"]),
    "huge-length": (lambda d: _external(d, location="data.bin", offset="0", length="9" * 40),
                    ["length '999", "not whole numbers from 0 to 2**63-1"]),
    "int64-overflow": (lambda d: _external(d, location="data.bin", offset=str(2**63)),
                       ["not whole numbers from 0 to 2**63-1"]),
    "offset-past-end": (lambda d: _external(d, location="data.bin", offset="8", length="16"),
                        ["at bytes 8..24, past the file's end (16 bytes)"]),
    "no-length-past-end": (lambda d: _external(d, location="data.bin", offset="4"),
                           ["at bytes 4..20, past the file's end (16 bytes)"]),
    "length-past-end": (lambda d: _external(d, location="data.bin", offset="0", length="32"),
                        ["with length 32, but shape [2, 2] of FLOAT needs 16 bytes"]),
    "length-short": (lambda d: _external(d, location="data.bin", offset="0", length="8"),
                     ["with length 8, but shape [2, 2] of FLOAT needs 16 bytes"]),
    "unknown-key": (lambda d: _external(d, location="data.bin", offset="0", length="16", size="16"),
                    ["the key 'size'", "checksum, length, location, offset"]),
    # item 4: dims and the data that must fill them
    "negative-dims": (lambda d: _embedded(d, [-4, -4], raw=b""), ["shape [-4, -4] has a negative dimension"]),
    "negative-dims-external": (lambda d: _external_dims(d, [-2, -2]), ["shape [-2, -2] has a negative dimension"]),
    "huge-dims": (lambda d: _embedded(d, [2**62, 2**62], raw=b""), ["too large to be stored"]),
    "huge-dims-beside-zero": (lambda d: _embedded(d, [0, 2**62, 2**62], raw=b""), ["too large to be stored"]),
    "too-many-dims": (lambda d: _embedded(d, [1] * 100, raw=W.tobytes()[:4]), ["100 dimensions of one tensor, but numpy"]),
    "short-raw-data": (lambda d: _embedded(d, [4, 4], raw=W.tobytes()),
                       ["holds 16 bytes of data, but shape [4, 4] of FLOAT needs 64"]),
    "short-float-data": (lambda d: _embedded(d, [4, 4], float_data=[0.0] * 4),
                         ["holds 4 values in float_data, but shape [4, 4] of FLOAT needs 16"]),
    "no-data": (lambda d: _embedded(d, [2, 2]), ["holds 0 values in float_data, but shape [2, 2] of FLOAT needs 4"]),
    "wrong-field": (lambda d: _embedded(d, [2, 2], int32_data=[0] * 4), ["keeps its values in int32_data",
                                                                         "FLOAT"]),
}


def _commands(model: Path, tmp_path: Path):
    """(name, args, outputs it must not write) for every command that reads ``model``."""
    ckpt = write_safetensors(tmp_path / "w.safetensors", {"w": W})
    return [
        ("inspect", ["inspect", model], []),
        ("convert", ["convert", model, "-o", tmp_path / "out.safetensors"], [tmp_path / "out.safetensors"]),
        ("verify", ["verify", model, model, "--report", tmp_path / "r.json"], [tmp_path / "r.json"]),
        ("map", ["map", ckpt, model, "--json"], []),
        ("export", ["export", ckpt, "--graph", model, "-o", tmp_path / "out.onnx"], [tmp_path / "out.onnx"]),
    ]


COMMANDS = ["inspect", "convert", "verify", "map", "export"]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_tensor_is_refused_by_every_command(cli, tmp_path, case, command):
    make, needles = HOSTILE[case]
    model = make(tmp_path / "in")
    (args, unwritten), = [(a, u) for name, a, u in _commands(model, tmp_path) if name == command]
    result = cli(*args)
    refused(result, f"error: {model}: tensor 'w'", *needles, unwritten=unwritten)
    assert result.stdout == ""


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unnamed_constant_with_negative_dims_is_refused_naming_its_node(cli, tmp_path, command):
    model = _constant_with_negative_dims(tmp_path / "in")
    (args, unwritten), = [(a, u) for name, a, u in _commands(model, tmp_path) if name == command]
    refused(cli(*args), f"{model}: the tensor of attribute 'value' of node 'bad_const'", "negative dimension",
            unwritten=unwritten)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("sound", ["external", "external-no-length", "embedded"])
def test_the_same_graph_with_a_sound_weight_passes_every_command(cli, tmp_path, command, sound):
    folder = tmp_path / "in"
    model = {"external": lambda: _external(folder, location="data.bin", offset="0", length="16"),
             "external-no-length": lambda: _external(folder, location="data.bin"),
             "embedded": lambda: _embedded(folder, [2, 2], raw=W.tobytes())}[sound]()
    (args, outputs), = [(a, u) for name, a, u in _commands(model, tmp_path) if name == command]
    ok(cli(*args))
    for path in outputs:
        assert path.exists(), path


def test_convert_copies_a_sound_external_weight_bitwise(cli, tmp_path):
    import safetensors.numpy

    model = _external(tmp_path / "in", location="data.bin", offset="0")
    ok(cli("convert", model, "-o", tmp_path / "out.safetensors"))
    back = safetensors.numpy.load_file(str(tmp_path / "out.safetensors"))
    assert back["w"].tobytes() == W.tobytes() and back["w"].shape == (2, 2)


# by name: each onnx release adds types (FLOAT4E2M1 in 1.18, INT2/UINT2 and FLOAT6 later), and the
# suite runs on the declared floor of onnx too
_PACKED = {getattr(TensorProto, name) for name in ("UINT4", "INT4", "FLOAT4E2M1", "INT2", "UINT2")
           if hasattr(TensorProto, name)}
_UNWRITABLE = {getattr(TensorProto, name) for name in ("UNDEFINED", "FLOAT6E2M3", "FLOAT6E3M2")
               if hasattr(TensorProto, name)}


@pytest.mark.parametrize("raw", [False, True], ids=["typed-fields", "raw-data"])
@pytest.mark.parametrize("dtype", [d for d in TensorProto.DataType.values()
                                   if d not in _UNWRITABLE],
                         ids=TensorProto.DataType.Name)
def test_every_dtype_as_onnx_writes_it_passes_the_checks(dtype, raw):
    """No false refusal: a [3, 3] tensor of each dtype, as onnx.helper (typed fields, 2- and
    4-bit values packed) and numpy_helper (raw_data) write it, is accepted and onnx-ir reads it."""
    import onnx_ir as ir

    from fusectl.io.formats.onnx_protos import check_tensor_protos

    if dtype == TensorProto.STRING:
        if raw:
            pytest.skip("strings have no raw_data form")
        tensor = helper.make_tensor("w", dtype, [3, 3], [b"a"] * 9)
    else:
        values = np.ones(9, helper.tensor_dtype_to_np_dtype(dtype)).reshape(3, 3)
        if raw:
            tensor = numpy_helper.from_array(values, "w")
        else:
            tensor = helper.make_tensor("w", dtype, [3, 3], [1] * 9 if dtype in _PACKED else values.ravel())
    model = helper.make_model(helper.make_graph([], "g", [], [], [tensor]))
    assert check_tensor_protos("m.onnx", model) == []
    assert ir.serde.deserialize_model(model).graph.initializers["w"].const_value.numpy().shape == (3, 3)
