"""fusectl: re-lay out model checkpoints with declarative rules and prove they compute the same.

The command line's jobs as functions (``fusectl.cli`` is an edge over them)::

    import fusectl
    report = fusectl.fuse("model/", ["llama-qkv", "llama-gate-up"], "fused/")
    assert fusectl.verify("model/", "fused/").passed
"""

from .api import FuseReport, Planned, convert, export, fuse, map_names, plan, unfuse, verify  # noqa: E402

from .errors import FusectlError  # noqa: E402
from .io.checkpoint import Checkpoint, open_checkpoint  # noqa: E402
from .version import __version__  # noqa: E402

__all__ = [
    "Checkpoint",
    "FuseReport",
    "FusectlError",
    "Planned",
    "__version__",
    "convert",
    "export",
    "fuse",
    "map_names",
    "open_checkpoint",
    "plan",
    "unfuse",
    "verify",
]
