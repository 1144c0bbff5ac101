"""fusectl: re-lay out model checkpoints with declarative rules and prove they compute the same.

The command line's jobs as functions (``fusectl.cli`` is an edge over them); each returns a
report that knows its documented JSON (``.to_json()``) and its text (``.to_text()``)::

    import fusectl
    report = fusectl.fuse("model/", ["llama-qkv", "llama-gate-up"], "fused/")
    assert fusectl.verify("model/", "fused/").passed
    print(fusectl.inspect("fused/").to_text())
"""

import importlib

from .version import __version__

# each public name and the module that defines it, imported on first use: ``import fusectl``
# (and ``fusectl --version``) then costs nothing but this file
_HOME = {
    "Checkpoint": "io.checkpoint", "open_checkpoint": "io.checkpoint", "FusectlError": "errors",
    **{name: "api" for name in ("FuseReport", "InspectReport", "Planned", "convert", "export", "fuse",
                                "inspect", "map_names", "plan", "unfuse", "verify")},
}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'fusectl' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    globals()[name] = value  # once: later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})


__all__ = [
    "Checkpoint",
    "FuseReport",
    "FusectlError",
    "InspectReport",
    "Planned",
    "__version__",
    "convert",
    "export",
    "fuse",
    "inspect",
    "map_names",
    "open_checkpoint",
    "plan",
    "unfuse",
    "verify",
]
