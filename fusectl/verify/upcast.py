"""Run bf16 models on onnxruntime's CPU provider, which has no bf16 kernels: upcast the
whole graph to float32 (initializers, value types, Cast targets, Constant values)."""

from __future__ import annotations

import numpy as np


def _float32(tensor) -> np.ndarray:
    return np.asarray(tensor.numpy()).astype(np.float32)


def has_bfloat16(path: str) -> bool:
    import onnx_ir as ir

    from ..onnx.graph import load_model

    model = load_model(path)
    bf16 = ir.DataType.BFLOAT16
    values = list(model.graph.inputs) + list(model.graph.outputs) + list(model.graph.initializers.values())
    values += [v for node in model.graph.all_nodes() for v in node.outputs]
    return any(v.dtype == bf16 for v in values)


def upcast_bfloat16(path: str) -> bytes:
    """The model at ``path`` with every bfloat16 tensor and type made float32, serialized."""
    import onnx_ir as ir

    from ..onnx.graph import load_model

    model = load_model(path)
    bf16, f32 = ir.DataType.BFLOAT16, ir.DataType.FLOAT
    for value in list(model.graph.initializers.values()):
        if value.const_value is not None and value.const_value.dtype == bf16:
            value.const_value = ir.tensor(_float32(value.const_value), name=value.name)
    values = list(model.graph.inputs) + list(model.graph.initializers.values())
    for node in model.graph.all_nodes():
        values += list(node.outputs)
        if node.op_type == "Cast" and node.attributes["to"].value == bf16:
            node.attributes["to"] = ir.AttrInt64("to", f32)
        if node.op_type == "Constant" and "value" in node.attributes:
            tensor = node.attributes["value"].value
            if tensor.dtype == bf16:
                node.attributes["value"] = ir.AttrTensor("value", ir.tensor(_float32(tensor)))
    for value in values + list(model.graph.outputs):
        if value.dtype == bf16:
            value.dtype = f32
    return ir.serde.serialize_model(model).SerializeToString()
