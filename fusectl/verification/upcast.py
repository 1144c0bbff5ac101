"""Run bf16 models on onnxruntime's CPU provider, which has no bf16 kernels: upcast the
whole graph to float32 (initializers, value types, Cast targets, Constant values)."""

from __future__ import annotations

import numpy as np

from ..errors import CheckpointError, printable


def _float32(tensor) -> np.ndarray:
    return np.asarray(tensor.numpy()).astype(np.float32)


def has_bfloat16(path: str) -> bool:
    """Whether any declared type, initializer, Constant or Cast of the model at ``path`` is bfloat16.

    Read from the protobuf (external data not loaded), so that models with types onnx-ir does
    not represent (maps) still reach onnxruntime.
    """
    import onnx
    from onnx import TensorProto

    from ..onnx.graph import check_model_file

    check_model_file(path)
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as e:  # protobuf and onnx raise a variety of types for corrupt files
        raise CheckpointError(f"{printable(path)}: not a readable ONNX model ({printable(str(e))})") from e
    bf16 = TensorProto.BFLOAT16
    graphs, found = [model.graph], False
    while graphs and not found:
        graph = graphs.pop()
        values = [*graph.input, *graph.output, *graph.value_info]
        found = any(_type_has(v.type, bf16) for v in values) or any(t.data_type == bf16 for t in graph.initializer)
        for node in graph.node:
            for attr in node.attribute:
                found = found or (node.op_type == "Cast" and attr.name == "to" and attr.i == bf16)
                found = found or (attr.HasField("t") and attr.t.data_type == bf16)
                graphs += [attr.g] if attr.HasField("g") else []
                graphs += list(attr.graphs)
    return found


def _type_has(type_proto, elem_type: int) -> bool:
    which = type_proto.WhichOneof("value")
    if which == "tensor_type":
        return type_proto.tensor_type.elem_type == elem_type
    if which == "sparse_tensor_type":
        return type_proto.sparse_tensor_type.elem_type == elem_type
    if which == "sequence_type":
        return _type_has(type_proto.sequence_type.elem_type, elem_type)
    if which == "optional_type":
        return _type_has(type_proto.optional_type.elem_type, elem_type)
    if which == "map_type":
        return type_proto.map_type.key_type == elem_type or _type_has(type_proto.map_type.value_type, elem_type)
    return False


def upcast_bfloat16(path: str) -> bytes:
    """The model at ``path`` with every bfloat16 tensor and type made float32, serialized."""
    import onnx_ir as ir

    from ..onnx.graph import load_model

    model = load_model(path)
    bf16, f32 = ir.DataType.BFLOAT16, ir.DataType.FLOAT
    values = []
    for graph in model.graphs():  # the main graph and every If/Loop/Scan body
        for value in graph.initializers.values():
            if value.const_value is not None and value.const_value.dtype == bf16:
                value.const_value = ir.tensor(_float32(value.const_value), name=value.name)
        values += [*graph.inputs, *graph.initializers.values(), *graph.outputs]
        for node in graph:
            values += list(node.outputs)
            if node.op_type == "Cast" and node.attributes["to"].value == bf16:
                node.attributes["to"] = ir.AttrInt64("to", f32)
            if node.op_type == "Constant" and "value" in node.attributes:
                tensor = node.attributes["value"].value
                if tensor.dtype == bf16:
                    node.attributes["value"] = ir.AttrTensor("value", ir.tensor(_float32(tensor)))
    for value in values:
        if value.dtype == bf16:
            value.dtype = f32
    return ir.serde.serialize_model(model).SerializeToString()
