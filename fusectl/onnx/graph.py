"""Load an ONNX model through onnx-ir (lazy: external data is memory-mapped, not read)."""

from __future__ import annotations

import os

import numpy as np

from ..errors import CheckpointError, printable
from ..io.untrusted import check_regular_file
from .tensor_protos import check_tensor_protos


def load_model(path: str):
    """The onnx-ir model at ``path``; CheckpointError for a missing or unreadable file, or one
    with a tensor :func:`~fusectl.onnx.tensor_protos.check_tensor_protos` refuses (bad dims or
    data, external data outside its folder)."""
    import onnx_ir as ir

    proto, _ = _checked_proto(path)
    # what ir.load does, on the proto already checked: parsing the file a second time would
    # cost a model's size again; external data stays lazy (mapped when a tensor is read)
    try:
        model = ir.serde.deserialize_model(proto)
    except Exception as e:  # onnx-ir raises a variety of types for what it cannot represent
        raise CheckpointError(f"{printable(path)}: not a readable ONNX model ({_reason(e)})") from e
    ir.external_data.set_base_dir(model.graph, os.path.dirname(path))
    return model


def _checked_proto(path: str):
    """The ModelProto at ``path`` (external data not loaded) and its external data files, every
    tensor checked."""
    import onnx

    check_model_file(path)
    try:
        proto = onnx.load(path, load_external_data=False)
    except Exception as e:  # protobuf and onnx raise a variety of types for corrupt files
        raise CheckpointError(f"{printable(path)}: not a readable ONNX model ({_reason(e)})") from e
    return proto, check_tensor_protos(path, proto)


def _reason(error: BaseException) -> str:
    """The innermost reason of an error, on one line (onnx-ir wraps it in SerdeErrors)."""
    cause = error
    while cause.__cause__ is not None:
        cause = cause.__cause__
    return printable(" ".join(str(cause).split())[:300])


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


def check_model_file(path: str) -> None:
    """CheckpointError unless ``path`` is a regular file outside /proc: a FIFO or a device would
    block or never end when read, a folder is not a model."""
    check_regular_file(path, hint="give the path of an .onnx file")


def external_data_files(path: str) -> list[str]:
    """The external data files of the ONNX model at ``path``, checked before anything loads them.

    Each location must be a relative path that stays inside the model's folder (links
    resolved), name an existing regular file, and hold the tensor's bytes at its offset; every
    tensor's dims and embedded data are checked too
    (:func:`~fusectl.onnx.tensor_protos.check_tensor_protos`). Anything else is a
    CheckpointError naming the model and the tensor. A model without external data gives [].
    """
    return _checked_proto(path)[1]
