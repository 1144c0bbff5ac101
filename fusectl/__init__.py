"""fusectl: re-lay out model checkpoints with declarative rules and prove they compute the same.

The command line's jobs as functions (``fusectl.cli`` is an edge over them); each returns a
report that knows its documented JSON (``.to_json()``) and its text (``.to_text()``)::

    import fusectl
    report = fusectl.fuse("model/", ["llama-qkv", "llama-gate-up"], "fused/")
    assert fusectl.verify("model/", "fused/").passed
    print(fusectl.inspect("fused/").to_text())
"""

from .api import (FuseReport, InspectReport, Planned, convert, export, fuse, inspect, map_names,  # noqa: E402
                  plan, unfuse, verify)

from .errors import FusectlError  # noqa: E402
from .io.checkpoint import Checkpoint, open_checkpoint  # noqa: E402
from .version import __version__  # noqa: E402

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
