"""ONNX model files: loading one through onnx-ir, every tensor checked first, and its
initializers as a checkpoint (``fusectl inspect model.onnx``, ``convert``).

onnx and onnx-ir are imported only when a model is opened (start-up time matters). Initializers
in external data are byte ranges of their data file (copied without decoding); those inside the
model are read from the model onnx-ir loaded. Names are the graph's initializer names
(``fusectl map`` pairs them with a checkpoint's structural names).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ...dtypes import ARRAY_DTYPES, DType
from ...errors import CheckpointError, printable, quote
from ...limits import check_limit
from ...tensors import ByteRange, FileTensor, LazyTensor, TensorSpec
from ..contents import Contents
from .onnx_protos import check_tensor_protos
from ..untrusted import check_regular_file

SUFFIX = ".onnx"
_BY_ONNX: dict[int, DType] = {d.onnx: d for d in ARRAY_DTYPES.values() if d.onnx is not None}


def load_model(path: str):
    """The onnx-ir model at ``path``; CheckpointError for a missing or unreadable file, or one
    with a tensor :func:`~fusectl.io.formats.onnx_protos.check_tensor_protos` refuses (bad dims or
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


def check_model_file(path: str) -> None:
    """CheckpointError unless ``path`` is a regular file outside /proc: a FIFO or a device would
    block or never end when read, a folder is not a model."""
    check_regular_file(path, hint="give the path of an .onnx file")


def external_data_files(path: str) -> list[str]:
    """The external data files of the ONNX model at ``path``, checked before anything loads them.

    Each location must be a relative path that stays inside the model's folder (links
    resolved), name an existing regular file, and hold the tensor's bytes at its offset; every
    tensor's dims and embedded data are checked too
    (:func:`~fusectl.io.formats.onnx_protos.check_tensor_protos`). Anything else is a
    CheckpointError naming the model and the tensor. A model without external data gives [].
    """
    return _checked_proto(path)[1]


@dataclass(frozen=True, eq=False)
class InitializerTensor(LazyTensor):
    """An initializer stored inside the model file (already in memory once the model is loaded)."""

    spec: TensorSpec
    tensor: object  # the onnx-ir tensor

    def read(self) -> np.ndarray:
        array = np.asarray(self.tensor.numpy())
        return np.ascontiguousarray(array).view(self.spec.dtype.numpy).reshape(self.spec.shape).copy()


def read_onnx(path: str, key: str | None = None, check_link: Callable[[str], None] | None = None) -> Contents:
    """The :class:`Contents` of an ONNX model: its main graph's initializers (lazy), read from
    the model file and the external data files they name (``files``). A model keeps no
    metadata or provenance of fusectl's."""
    tensors, data_files = read_initializers(path)
    return Contents(tensors, [path, *data_files])


def read_initializers(path: str) -> tuple[dict[str, LazyTensor], list[str]]:
    """The main graph's initializers of the model at ``path`` (lazy), and the external data
    files they read from."""
    import onnx_ir as ir

    model = load_model(path)
    initializers = model.graph.initializers
    check_limit("tensors", len(initializers), path)
    tensors: dict[str, LazyTensor] = {}
    files: list[str] = []
    for name, value in initializers.items():
        tensor = value.const_value
        where = f"{printable(path)}: initializer {quote(name)}"
        if tensor is None:
            continue  # an initializer without a value is a graph input's default: no weight
        dtype = _BY_ONNX.get(int(tensor.dtype))
        if dtype is None:
            raise CheckpointError(f"{where} is {tensor.dtype.name}, which a checkpoint cannot hold; "
                                  "fusectl reads numeric initializers")
        shape = tuple(int(d) for d in tensor.shape)
        spec = TensorSpec(dtype, shape)
        if isinstance(tensor, ir.ExternalTensor):
            # load_model checked that the location lies inside the model's folder and holds
            # exactly the spec's bytes at the offset (onnx_protos.check_location)
            location = tensor.path
            tensors[name] = FileTensor(spec, ByteRange(str(location), int(tensor.offset or 0), spec.nbytes))
            if str(location) not in files:
                files.append(str(location))
        else:
            tensors[name] = InitializerTensor(spec, tensor)
    return tensors, files
