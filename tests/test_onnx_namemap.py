"""``fusectl map`` pairing by closeness (an exporter's own folds, equal up to rounding): each
checkpoint tensor pairs with at most one initializer and each initializer with at most one
tensor, as is before transposed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from conftest import ok, write_safetensors

F = TensorProto.FLOAT
NUDGE = 1 + 3e-7  # inside float32's default tolerance (1e-5), but not the same bits


def _graph(path: Path, initializers: dict[str, np.ndarray]) -> Path:
    """x -> Identity -> y, holding ``initializers`` (anonymous, as an exporter's folds are)."""
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", F, [1])],
                              [helper.make_tensor_value_info("y", F, [1])],
                              [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


def _pairs(doc) -> list[tuple[str, str, str, str]]:
    return [(p["structural"], p["initializer"], p["how"], p["data"]) for p in doc["pairs"]]


def test_a_square_tensor_close_to_two_initializers_pairs_once_as_is(cli, tmp_path):
    w = np.random.default_rng(0).uniform(1, 2, (3, 3)).astype(np.float32)
    ckpt = write_safetensors(tmp_path / "w.safetensors", {"w": w})
    graph = _graph(tmp_path / "g.onnx", {"onnx::A": w * NUDGE, "onnx::B": w.T * NUDGE})
    for a, b in ((w * NUDGE, w), (w.T * NUDGE, w.T)):  # the premise: close, not bitwise equal
        assert not np.array_equal(a, b) and np.allclose(a, b, atol=1e-5, rtol=1e-5)
    doc = ok(cli("map", ckpt, graph, "--json")).json()
    assert _pairs(doc) == [("w", "onnx::A", "content", "close")]
    assert doc["unmatched_graph"] == ["onnx::B"]


def test_the_transposed_initializer_pairs_when_no_as_is_one_is_close(cli, tmp_path):
    w = np.random.default_rng(1).uniform(1, 2, (3, 3)).astype(np.float32)
    ckpt = write_safetensors(tmp_path / "w.safetensors", {"w": w})
    graph = _graph(tmp_path / "g.onnx", {"onnx::B": w.T * NUDGE})
    assert _pairs(ok(cli("map", ckpt, graph, "--json")).json()) == [("w", "onnx::B", "transposed", "close")]


def test_two_tensors_close_to_one_initializer_share_it_with_no_one(cli, tmp_path):
    base = np.linspace(1, 2, 4, dtype=np.float32)
    ckpt = write_safetensors(tmp_path / "w.safetensors", {"a": base, "b": base * np.float32(1 + 2e-7)})
    graph = _graph(tmp_path / "g.onnx", {"onnx::X": base * NUDGE})
    doc = ok(cli("map", ckpt, graph, "--json")).json()
    pairs = _pairs(doc)
    assert len(pairs) == 1 and pairs[0][1:] == ("onnx::X", "content", "close"), pairs
    assert doc["unmatched_checkpoint"] == sorted({"a", "b"} - {pairs[0][0]})
    assert doc["unmatched_graph"] == []
