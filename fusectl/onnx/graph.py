"""Load an ONNX model through onnx-ir (lazy: external data is memory-mapped, not read)."""

from __future__ import annotations

import os
import stat

import numpy as np

from ..errors import CheckpointError, printable, quote
from ..io.untrusted import check_regular_file, is_generated


def load_model(path: str):
    """The onnx-ir model at ``path``; CheckpointError for a missing or unreadable file, or one
    whose external data lies outside its folder."""
    import onnx_ir as ir

    check_model_file(path)
    try:
        model = ir.load(path)  # lazy: external data is only mapped when a tensor is read
    except Exception as e:  # protobuf and onnx raise a variety of types for corrupt files
        cause = e
        while cause.__cause__ is not None:  # onnx-ir wraps the reason ("Map types are not supported")
            cause = cause.__cause__
        reason = " ".join(str(cause).split())[:300]
        raise CheckpointError(f"{printable(path)}: not a readable ONNX model ({printable(reason)})") from e
    # checked on the loaded model, before any tensor is read: parsing the file a second time
    # with onnx (as external_data_files does for onnxruntime) would cost a model's size again
    folder = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    for graph in (model.graph, *model.graph.subgraphs()):
        for value in graph.initializers.values():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor):
                _check_location(path, folder, value.name, str(tensor.location),
                                str(tensor.offset or 0), None if tensor.length is None else str(tensor.length))
    return model


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


def _graph_tensors(graph):
    """Every TensorProto a graph holds: initializers, sparse ones, and node attributes, recursively."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        yield from _node_tensors(node)


def _node_tensors(node):
    for attr in node.attribute:
        if attr.HasField("t"):
            yield attr.t
        yield from attr.tensors
        if attr.HasField("sparse_tensor"):
            yield attr.sparse_tensor.values
            yield attr.sparse_tensor.indices
        for sparse in attr.sparse_tensors:
            yield sparse.values
            yield sparse.indices
        if attr.HasField("g"):
            yield from _graph_tensors(attr.g)
        for graph in attr.graphs:
            yield from _graph_tensors(graph)


def external_data_files(path: str) -> list[str]:
    """The external data files of the ONNX model at ``path``, checked before anything loads them.

    Each location must be a relative path that stays inside the model's folder (links
    resolved), name an existing regular file, and hold the tensor's offset and length; anything
    else is a CheckpointError naming the model, the tensor and the location. A model without
    external data gives [].
    """
    import onnx
    from onnx import TensorProto

    check_model_file(path)
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as e:  # protobuf and onnx raise a variety of types for corrupt files
        raise CheckpointError(f"{printable(path)}: not a readable ONNX model ({printable(str(e))})") from e
    folder = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    tensors = list(_graph_tensors(model.graph))
    for function in model.functions:
        for node in function.node:
            tensors.extend(_node_tensors(node))
    files: dict[str, None] = {}  # an ordered set
    for tensor in tensors:
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        entries = {entry.key: entry.value for entry in tensor.external_data}
        target = _check_location(path, folder, tensor.name, entries.get("location", ""),
                                 entries.get("offset", "0"), entries.get("length"))
        files[target] = None
    return list(files)


def _check_location(path: str, folder: str, name: str, location: str, offset_text: str,
                    length_text: str | None) -> str:
    """The resolved file of one external tensor; CheckpointError unless it is a regular file
    inside the model's ``folder`` that holds ``offset`` + ``length`` bytes."""
    where = f"{printable(path)}: tensor {quote(name)} keeps its data in {quote(location)}"
    if not location:
        raise CheckpointError(f"{printable(path)}: tensor {quote(name)} is marked external but names "
                              "no location; re-export the model")
    if os.path.isabs(location) or os.path.splitdrive(location)[0]:
        raise CheckpointError(f"{where}, an absolute path; external data must lie in the model's folder "
                              f"{printable(folder)}: move it there and give a relative location")
    target = os.path.realpath(os.path.join(folder, location))
    if not target.startswith(folder + os.sep):
        raise CheckpointError(f"{where}, outside the model's folder {printable(folder)}; external data must "
                              "lie in that folder (links resolved): move it there and fix the location")
    try:
        info = os.stat(target)
    except OSError:
        raise CheckpointError(f"{where}, which does not exist; put the file beside the model") from None
    if not stat.S_ISREG(info.st_mode) or is_generated(target):
        raise CheckpointError(f"{where}, which is not a regular file; external data must be a plain file")
    try:
        offset = int(offset_text)
        length = int(length_text) if length_text is not None else info.st_size - offset
    except ValueError:
        raise CheckpointError(f"{where} with offset {quote(offset_text)} and length {quote(length_text or '')}, "
                              "not whole numbers; re-export the model") from None
    if offset < 0 or length < 0 or offset + length > info.st_size:
        raise CheckpointError(f"{where} at bytes {offset}..{offset + length}, past the file's end "
                              f"({info.st_size} bytes); the file is truncated or not this model's")
    return target
