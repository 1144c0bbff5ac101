"""Quantized weights and their scales: how a scale's grid lines up with its weight, and the
``dequantize`` op (fp8 weight × scale → bf16 / fp16 / fp32).

A scale lines up with its weight's leading axes (missing trailing axes broadcast). Along each
weight axis it is either *grid g* (``ceil(length / g)`` entries, each covering g consecutive
slabs; g = 1 is one entry per slab) or *broadcast* (one entry for the whole axis):

- a block scale (DeepSeek-V3, Qwen3-FP8, transformers ``fp8``): ``weight_scale_inv`` of shape
  ``[ceil(out/128), ceil(in/128)]`` is grid 128 along both axes;
- a per-channel scale ``[out, 1]`` or ``[out]`` is grid 1 along the rows, broadcast along the
  columns;
- a per-tensor scale (one element) broadcasts along every axis.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Sequence

import numpy as np

from ..dtypes import BY_NAME
from ..errors import PlanError
from ..tensors import TensorSpec
from .base import Op

# one entry per weight axis: a grid step (1 = per slab), or None = broadcast over the axis
Grid = tuple["int | None", ...]

OUTPUT_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def scale_grid(weight: Sequence[int], scale: Sequence[int], block: Sequence[int] | None) -> Grid | None:
    """How a scale of shape ``scale`` lines up with a weight of shape ``weight``; None when it
    fits no grid. ``block`` (the checkpoint's block size, rows × columns) applies to the
    weight's last two axes.

    >>> scale_grid((256, 384), (2, 3), (128, 128))
    (128, 128)
    >>> scale_grid((320, 256), (320, 1), None)
    (1, None)
    >>> scale_grid((4, 96, 64), (), None)
    (None, None, None)
    >>> scale_grid((128, 256), (1, 2), (128, 128))  # one block row, not a broadcast
    (128, 128)
    """
    if len(scale) > len(weight):
        return None
    grid: list[int | None] = []
    for axis, length in enumerate(weight):
        if axis >= len(scale):
            grid.append(None)
            continue
        entries = scale[axis]
        # a scale with the weight's rank is a block grid where it fits one (a 128-row weight
        # has one block row: one entry is that block, not a broadcast)
        step = _block_step(block, axis, len(weight)) if len(scale) == len(weight) else None
        if step and entries == -(-length // step) and step > 1:
            grid.append(step)
        elif entries == length:
            grid.append(1)
        elif entries == 1:
            grid.append(None)
        else:
            return None
    return tuple(grid)


def _block_step(block: Sequence[int] | None, axis: int, ndim: int) -> int | None:
    if not block or axis < ndim - 2:
        return None
    return block[axis - (ndim - 2)]


def expand_scale(scale: np.ndarray, weight_shape: Sequence[int], grid: Grid) -> np.ndarray:
    """The scale broadcast to one entry per weight element (ragged last blocks cropped)."""
    s = scale.reshape(scale.shape + (1,) * (len(weight_shape) - scale.ndim))
    for axis, step in enumerate(grid):
        if step is not None and step > 1:
            s = np.repeat(s, step, axis=axis)
            s = np.take(s, np.arange(weight_shape[axis]), axis=axis)
    return s


@dataclasses.dataclass(frozen=True)
class Dequantize(Op):
    """w · s in float32 (the scale block-broadcast), rounded to nearest even in ``dtype``.

    Rule keys: ``op = "dequantize"``, ``weight``, ``scale`` (a per-tensor, per-channel or block
    scale: ``weight_scale_inv``, ``weight_scale``), ``output``, ``dtype`` (default
    ``"bfloat16"``; ``"float16"`` or ``"float32"``), ``block`` (rows × columns a block scale
    covers; left empty it is the checkpoint's, ``quantization_config.weight_block_size`` or
    ``[quantization] block_size``). Only ``scale`` finds a rule's bindings. The output has the
    weight's shape in ``dtype``; the weight's other scales (``input_scale``) are dropped with it.
    Refuses another ``dtype``, a weight that is neither floating point nor int8, a scale that is
    not floating point, a ``block`` that is not two positive integers, and a scale whose shape
    fits no grid of the weight. Inverse: none (one-way: fusectl never requantizes).

    >>> w, s = np.array([[1.0, 2.0]], dtype=np.float32), np.array([[3.0]], dtype=np.float32)
    >>> Dequantize(dtype="float32").apply([w, s])[0].tolist()
    [[3.0, 6.0]]

    Rule::

        [[rule]]
        op     = "dequantize"
        weight = "{m*}.weight"
        scale  = "{m*}.weight_scale_inv"
        output = "{m*}.weight"
    """

    kind: ClassVar[str] = "dequantize"
    exact: ClassVar[bool] = False
    named_inputs: ClassVar[tuple[str, ...]] = ("weight", "scale")
    named_outputs: ClassVar[tuple[str, ...]] = ("output",)
    binding_inputs: ClassVar[tuple[str, ...]] = ("scale",)
    block: tuple[int, ...] = ()
    dtype: str = "bfloat16"

    def with_block_size(self, block: tuple[int, int] | None) -> "Dequantize":
        if self.block or not block:
            return self
        return dataclasses.replace(self, block=tuple(block))

    def _grid(self, weight: TensorSpec, scale: TensorSpec, names: Sequence[str]) -> Grid:
        grid = scale_grid(weight.shape, scale.shape, self.block)
        if grid is None:
            hint = ("" if self.block else "; if it is a block scale, set the block size "
                    "(quantization_config.weight_block_size in config.json, or [quantization] block_size)")
            raise PlanError(f"{names[1]!r} has shape {list(scale.shape)}, which is neither a per-tensor, "
                            f"per-channel nor a block scale of {names[0]!r} {list(weight.shape)}"
                            f"{f' with blocks {list(self.block)}' if self.block else ''}{hint}")
        return grid

    def infer(self, specs, names):
        weight, scale = specs
        if self.dtype not in OUTPUT_DTYPES:
            raise PlanError(f"dequantize: dtype = {self.dtype!r}; use one of {', '.join(OUTPUT_DTYPES)}")
        if not (weight.dtype.is_float or weight.dtype.safetensors == "I8") or not scale.dtype.is_float:
            raise PlanError(f"{names[0]!r} is {weight.dtype} and {names[1]!r} is {scale.dtype}; dequantize "
                            "needs a float8 (or int8) weight and a floating-point scale")
        if self.block and (len(self.block) != 2 or any(b <= 0 for b in self.block)):
            raise PlanError(f"dequantize: block = {list(self.block)}; give two positive integers (rows, columns)")
        self._grid(weight, scale, names)
        return [TensorSpec(BY_NAME[OUTPUT_DTYPES[self.dtype]], weight.shape)]

    def apply(self, arrays):
        weight, scale = arrays
        grid = scale_grid(weight.shape, scale.shape, self.block)
        values = weight.astype(np.float32) * expand_scale(scale.astype(np.float32), weight.shape, grid)
        return [values.astype(BY_NAME[OUTPUT_DTYPES[self.dtype]].numpy)]

    def lift(self, lift):
        lift.drop()  # the weight is plain now: its other scales (input_scale) go too


QUANTIZATION_OPS: tuple[type[Op], ...] = (Dequantize,)
