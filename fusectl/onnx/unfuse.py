"""ONNX ops that recover a layout step's inputs from its outputs.

Shared by verify's probes (built with onnx.helper) and export (built with onnx-ir): ``b`` is
any builder with ``node(op, inputs, n_out, **attrs)``, ``one(op, inputs, **attrs)`` and
``ints(values)`` (an int64 constant). Requires opset 13 or newer (Split sizes and
Squeeze/Unsqueeze axes as inputs).
"""

from __future__ import annotations

import numpy as np

from ..plan import Step

LAYOUT_KINDS = {"concat", "split", "interleave", "deinterleave", "stack", "unstack", "transpose",
                "reshape", "reorder", "rope_permute"}


def unfuse_in_onnx(b, step: Step, fused: list) -> list:
    """ONNX ops that recover the step's inputs from its outputs (layout steps)."""
    op, ins, outs = step.op, step.input_specs, step.output_specs
    kind = op.kind
    if kind == "concat":
        axis = op.axis % len(ins[0].shape)
        sizes = [s.shape[axis] for s in ins]
        return b.node("Split", [fused[0], b.ints(sizes)], len(ins), axis=axis)
    if kind == "split":
        return [b.one("Concat", fused, axis=op.axis % len(ins[0].shape))]
    if kind == "interleave":
        axis = op.axis % len(ins[0].shape)
        per = [s.shape[axis] // op.groups for s in ins]
        shape = list(outs[0].shape)
        grouped = _reshape(b, fused[0], shape[:axis] + [op.groups, sum(per)] + shape[axis + 1:])
        parts = b.node("Split", [grouped, b.ints(per)], len(ins), axis=axis + 1)
        return [_reshape(b, p, list(s.shape)) for p, s in zip(parts, ins)]
    if kind == "deinterleave":
        axis = op.axis % len(ins[0].shape)
        shape = list(ins[0].shape)
        grouped = [_reshape(b, f, shape[:axis] + [op.groups, s.shape[axis] // op.groups] + shape[axis + 1:])
                   for f, s in zip(fused, outs)]
        return [_reshape(b, b.one("Concat", grouped, axis=axis + 1), shape)]
    if kind == "stack":
        axis = op.axis % len(outs[0].shape)
        parts = b.node("Split", [fused[0], b.ints([1] * len(ins))], len(ins), axis=axis)
        return [b.one("Squeeze", [p, b.ints([axis])]) for p in parts]
    if kind == "unstack":
        axis = op.axis % len(ins[0].shape)
        return [b.one("Concat", [b.one("Unsqueeze", [f, b.ints([axis])]) for f in fused], axis=axis)]
    if kind == "transpose":
        return [b.one("Transpose", [fused[0]], perm=[int(p) for p in np.argsort(op.perm)])]
    if kind == "reshape":
        return [_reshape(b, fused[0], list(ins[0].shape))]
    if kind == "reorder":
        axis = op.axis % len(ins[0].shape)
        chunks = b.node("Split", [fused[0], b.ints([ins[0].shape[axis] // op.chunks] * op.chunks)],
                        op.chunks, axis=axis)
        inverse = np.argsort(op.order)
        return [b.one("Concat", [chunks[k] for k in inverse], axis=axis)]
    if kind == "rope_permute":
        rows = ins[0].shape[0]
        cols = ins[0].shape[1] if len(ins[0].shape) == 2 else 1
        half = rows // op.heads // 2
        # undo: to "hf" made (heads, 2, half) from Meta's (heads, half, 2)
        src = [op.heads, 2, half, cols] if op.to == "hf" else [op.heads, half, 2, cols]
        grouped = _reshape(b, fused[0], src)
        swapped = b.one("Transpose", [grouped], perm=[0, 2, 1, 3])
        return [_reshape(b, swapped, list(ins[0].shape))]
    raise ValueError(kind)  # pragma: no cover - PROBED lists the kinds handled


def _reshape(b, value, shape: list[int]):
    """Reshape to ``shape`` exactly: a 0 in it is an empty axis (``allowzero``, opset 14), not
    ONNX's default "copy this axis from the input"."""
    attrs = {"allowzero": 1} if 0 in shape else {}
    return b.one("Reshape", [value, b.ints(shape)], **attrs)
