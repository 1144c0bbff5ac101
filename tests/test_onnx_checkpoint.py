"""An ONNX model's initializers read as a checkpoint (``inspect model.onnx``, ``convert``), with
external data copied as byte ranges; and ``convert`` between the formats fusectl reads."""

from __future__ import annotations

import json

import numpy as np
import onnx
import safetensors.numpy
from onnx import TensorProto, helper, numpy_helper

from conftest import FIXTURES, ok, refused, write_safetensors

BERT = FIXTURES / "onnx" / "bert" / "model.onnx"


def _initializers(path) -> dict[str, np.ndarray]:
    model = onnx.load(str(path))
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def test_inspect_lists_a_models_initializers_with_onnxs_dtypes_and_shapes(cli):
    report = json.loads(ok(cli("inspect", BERT, "--json")).stdout)
    expected = _initializers(BERT)
    assert report["format"] == "onnx" and report["files"] == [str(BERT)]
    got = {p["name"]: (p["dtype"], p["shape"]) for p in report["parameters"]}
    assert got == {n: ({np.float32: "F32", np.int64: "I64"}[a.dtype.type], list(a.shape)) for n, a in expected.items()}


def test_convert_writes_the_initializers_bitwise(cli, tmp_path):
    out = tmp_path / "bert.safetensors"
    ok(cli("convert", BERT, "-o", out))
    back = safetensors.numpy.load_file(str(out))
    expected = _initializers(BERT)
    assert sorted(back) == sorted(expected)
    for name, array in expected.items():
        assert back[name].dtype == array.dtype and back[name].tobytes() == array.tobytes(), name


def _external_model(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 4)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y0"]), helper.make_node("Add", ["y0", "b"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    path = tmp_path / "m.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="m.onnx.data", size_threshold=0)
    return path, {"w": w, "b": b}


def test_external_data_is_copied_as_byte_ranges(cli, tmp_path):
    path, tensors = _external_model(tmp_path)
    report = json.loads(ok(cli("inspect", path, "--json")).stdout)
    assert report["files"] == [str(path), str(tmp_path / "m.onnx.data")]
    out = tmp_path / "m.safetensors"
    written = json.loads(ok(cli("convert", path, "-o", out, "--json")).stdout)
    assert written["copied_bytes"] == written["unique_bytes"] == (8 * 4 + 4) * 4
    back = safetensors.numpy.load_file(str(out))
    for name, array in tensors.items():
        assert back[name].tobytes() == array.tobytes()


def test_a_string_initializer_is_refused_naming_it(cli, tmp_path):
    graph = helper.make_graph([helper.make_node("Identity", ["s"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", TensorProto.STRING, [1])],
                              [helper.make_tensor("s", TensorProto.STRING, [1], [b"hi"])])
    path = tmp_path / "s.onnx"
    onnx.save_model(helper.make_model(graph), str(path))
    refused(cli("inspect", path), f"{path}: initializer 's' is STRING", "numeric initializers")


def test_convert_keeps_ties_and_provenance(cli, tmp_path):
    src = FIXTURES / "tied-embeddings.safetensors"
    npz = tmp_path / "m.npz"
    ok(cli("convert", src, "-o", npz))
    report = json.loads(ok(cli("inspect", npz, "--json")).stdout)
    assert report["ties"] == [["embed.weight", "head.weight"]]
    fused = tmp_path / "fused.safetensors"
    ok(cli("fuse", FIXTURES / "tiny-llama-gqa", "-r", "llama-qkv", "-o", fused))
    converted = tmp_path / "fused-folder"
    ok(cli("convert", fused, "-o", converted))
    assert json.loads(ok(cli("inspect", converted, "--json")).stdout)["provenance"]["plan"]
    restored = tmp_path / "restored.safetensors"
    ok(cli("unfuse", converted, "-o", restored))  # the carried provenance still undoes the fuse
    original = safetensors.numpy.load_file(str(FIXTURES / "tiny-llama-gqa" / "model.safetensors"))
    back = safetensors.numpy.load_file(str(restored))
    assert sorted(back) == sorted(original)
    assert all(back[n].tobytes() == original[n].tobytes() for n in original)


def test_key_applies_only_to_pytorch_files(cli, tmp_path):
    src = write_safetensors(tmp_path / "m.safetensors", {"w": np.ones(2, np.float32)})
    refused(cli("inspect", src, "--key", "model"), f"{src}: --key selects a state dict inside a PyTorch file")
    refused(cli("verify", BERT, BERT, "--key", "model"), "--key selects a state dict inside a PyTorch checkpoint")
    refused(cli("verify", src, src, "--key", "model"), "--key selects a state dict inside a PyTorch file")
