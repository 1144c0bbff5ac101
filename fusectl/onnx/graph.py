"""Load an ONNX model through onnx-ir (lazy: external data is memory-mapped, not read)."""

from __future__ import annotations

import os

import numpy as np

from ..errors import CheckpointError


def load_model(path: str):
    """The onnx-ir model at ``path``; CheckpointError for a missing or unreadable file."""
    import onnx_ir as ir

    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such ONNX file")
    try:
        return ir.load(path)
    except Exception as e:  # protobuf and onnx raise a variety of types for corrupt files
        raise CheckpointError(f"{path}: not a readable ONNX model ({e})") from e


def initializer_views(model):
    """(readers, specs) of the graph's initializers: name → () -> array, name → (dtype, shape)."""
    readers, specs = {}, {}
    for name, value in model.graph.initializers.items():
        tensor = value.const_value
        if tensor is None:
            continue
        readers[name] = (lambda t=tensor: np.asarray(t.numpy()))
        specs[name] = (str(tensor.dtype.numpy()), tuple(int(d) for d in tensor.shape))
    return readers, specs
