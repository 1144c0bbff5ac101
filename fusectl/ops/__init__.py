"""The op registry: every op kind a rule may name."""

from .base import Op
from .dequantize import QUANTIZATION_OPS
from .guard import Refuse
from .layout import LAYOUT_OPS
from .reparam import REPARAM_OPS

OPS: dict[str, type[Op]] = {op.kind: op for op in LAYOUT_OPS + REPARAM_OPS + QUANTIZATION_OPS + (Refuse,)}

__all__ = ["OPS", "Op"]
