"""The op registry: every op kind a rule may name."""

from .base import Op
from .layout import LAYOUT_OPS

OPS: dict[str, type[Op]] = {op.kind: op for op in LAYOUT_OPS}

__all__ = ["OPS", "Op"]
