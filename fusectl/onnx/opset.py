"""The opset ``fusectl export`` rewrites in: graphs older than ``MIN_OPSET`` are converted first.

The nodes that un-fuse a layout step take Split sizes and Squeeze/Unsqueeze axes as inputs, which
ONNX allows from opset 13. Exporters of older models wrote opset 12 and below (ddddocr's and
DNSMOS's graphs are opset 12), so :func:`upgrade_opset` converts such a graph with
``onnx.version_converter``. Its adapters keep each op's meaning (a Split's ``split`` attribute
becomes an input, an opset-12 Softmax over a non-last axis becomes Flatten, Softmax, Reshape)
or refuse an op they cannot convert; that refusal is an ExportError saying how to get a newer
graph. The converter works on protobuf: the main graph's initializers are left out of what it
is given (as graph inputs of their type and shape) and put back afterwards, so their data is
never copied and a graph past 2 GB converts too.
"""

from __future__ import annotations

import os

import onnx_ir as ir

from ..errors import printable
from .export_context import ExportError

MIN_OPSET = 13


def default_opset(model: ir.Model) -> int:
    """The version of the default ONNX domain ``model`` imports (0 when it imports none)."""
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))


def upgrade_opset(model: ir.Model, graph_path: str) -> ir.Model:
    """``model`` itself when it is opset ``MIN_OPSET`` or newer, else a converted copy at
    ``MIN_OPSET`` (``model`` is left without its initializers, which move to the copy).
    ExportError when the graph imports no default opset or the converter refuses it."""
    import onnx

    opset = default_opset(model)
    if opset >= MIN_OPSET:
        return model
    path = printable(graph_path)
    if opset == 0:
        raise ExportError(f"{path} imports no version of the default ONNX opset; export needs opset "
                          f"{MIN_OPSET} or newer")
    graph = model.graph
    initializers = {name: value.const_value for name, value in graph.initializers.items()
                    if value.const_value is not None}
    inputs = {value.name for value in graph.inputs}
    for name, tensor in initializers.items():
        value = graph.initializers.pop(name)
        value.shape, value.dtype = value.shape or tensor.shape, value.dtype or tensor.dtype
        value.const_value = None
        if name not in inputs:
            graph.inputs.append(value)
    try:
        converted = onnx.version_converter.convert_version(ir.serde.serialize_model(model), MIN_OPSET)
        upgraded = ir.serde.deserialize_model(converted)
    except Exception as e:  # the converter raises RuntimeError and ValidationError; onnx-ir its own
        reason = printable(" ".join(str(e).split())[:300])
        raise ExportError(f"{path}: opset {opset}; onnx.version_converter could not convert it to opset "
                          f"{MIN_OPSET} ({reason}); export the graph at opset {MIN_OPSET} or newer") from e
    ir.external_data.set_base_dir(upgraded.graph, os.path.dirname(graph_path))
    by_name = {value.name: value for value in upgraded.graph.inputs}
    for name, tensor in initializers.items():
        value = by_name.get(name)
        if value is None:  # the converter left out an input nothing reads
            continue
        if name not in inputs:
            upgraded.graph.inputs.remove(value)
        value.const_value = tensor
        upgraded.graph.register_initializer(value)
    return upgraded
