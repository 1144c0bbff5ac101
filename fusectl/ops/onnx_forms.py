"""What ops need to write themselves as ONNX nodes (``Op.onnx_unfuse``, ``Op.probe``).

Ops build graphs through a duck-typed builder ``b``, so they import neither onnx nor onnx-ir:
verify's probes pass one over onnx.helper, export one over onnx-ir. A builder has
``node(op, inputs, n_out, **attrs)`` (a list of ``n_out`` values), ``one(op, inputs, **attrs)``
(one value) and ``ints(values)`` (an int64 constant). The nodes need opset 14 or newer
(Split sizes and Squeeze/Unsqueeze axes as inputs, Reshape's ``allowzero``).
"""

from __future__ import annotations

from typing import Sequence


def reshape(b, value, shape: Sequence[int]):
    """Reshape to ``shape`` exactly: a 0 in it is an empty axis (``allowzero``, opset 14), not
    ONNX's default "copy this axis from the input"."""
    shape = list(shape)
    attrs = {"allowzero": 1} if 0 in shape else {}
    return b.one("Reshape", [value, b.ints(shape)], **attrs)
