"""An ONNX model's initializers as a checkpoint: ``fusectl inspect model.onnx``, ``convert``.

Initializers in external data are byte ranges of their data file (copied without decoding);
those inside the model are read from the model onnx-ir loaded. Names are the graph's
initializer names (``fusectl map`` pairs them with a checkpoint's structural names).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dtypes import ARRAY_DTYPES, DType
from ..errors import CheckpointError, printable, quote
from ..limits import check_limit
from ..tensors import ByteRange, FileTensor, LazyTensor, TensorSpec
from .graph import load_model

_BY_ONNX: dict[int, DType] = {d.onnx: d for d in ARRAY_DTYPES.values() if d.onnx is not None}


@dataclass(frozen=True, eq=False)
class InitializerTensor(LazyTensor):
    """An initializer stored inside the model file (already in memory once the model is loaded)."""

    spec: TensorSpec
    tensor: object  # the onnx-ir tensor

    def read(self) -> np.ndarray:
        array = np.asarray(self.tensor.numpy())
        return np.ascontiguousarray(array).view(self.spec.dtype.numpy).reshape(self.spec.shape).copy()


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
            # exactly the spec's bytes at the offset (tensor_protos.check_location)
            location = tensor.path
            tensors[name] = FileTensor(spec, ByteRange(str(location), int(tensor.offset or 0), spec.nbytes))
            if str(location) not in files:
                files.append(str(location))
        else:
            tensors[name] = InitializerTensor(spec, tensor)
    return tensors, files
