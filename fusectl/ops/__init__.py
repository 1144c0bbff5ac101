"""The op registry: every op kind a rule may name.

``OPS`` is built the first time it is asked for (PEP 562): it imports every op module, which a
command that binds no rule and reads no provenance (``inspect``, ``--help``) never needs.
``from fusectl.ops import OPS`` inside the function that looks an op up costs one import, once.
"""

from .base import Op


def _registry() -> dict[str, type[Op]]:
    from .dequantize import QUANTIZATION_OPS
    from .guard import Refuse
    from .layout import LAYOUT_OPS
    from .reparam import REPARAM_OPS

    return {op.kind: op for op in LAYOUT_OPS + REPARAM_OPS + QUANTIZATION_OPS + (Refuse,)}


def __getattr__(name: str):
    if name == "OPS":
        registry = globals()["OPS"] = _registry()
        return registry
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["OPS", "Op"]
