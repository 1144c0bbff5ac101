"""What every format's reader returns: :class:`Contents`, read from headers alone.

A reader (one per row of :data:`fusectl.io.registry.FORMATS`) is called as
``read(path, key=None, check_link=None)`` and answers a :class:`Contents`; ``open_checkpoint``
builds a checkpoint from it without knowing which format it came from.

>>> Contents({}, ["m.safetensors"]).provenance_text is None
True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence

from ..tensors import LazyTensor


@dataclass(frozen=True)
class Contents:
    """The tensors a checkpoint file (or index) stores, lazily, and what came with them.

    ``tensors``: stored name → lazy tensor (no tensor byte read yet). ``files``: every file
    read, in order (an index's shards, an ONNX model's external data files). ``metadata``: the
    file's string metadata (safetensors ``__metadata__``, fusectl's npz member); the provenance
    entry is left in it, as ``provenance_text`` (what the entry holds, unchecked: the checkpoint
    refuses one that is not a string), or None where the format keeps none. ``aliases``: a
    name → the stored name it shares storage with (PyTorch views of one storage).
    ``state_dict_key``: the dotted key of the state dict read inside a PyTorch file (None: the
    top level); ``ignored``: the entries of it that are not tensors. ``training``: for a
    state dict inside a training dict, the rest of it (``optimizer_state.Training``: the
    optimizer beside the model, the whole tree for writing it back); None otherwise.
    ``config``: values for rules' ``config:`` vars that the checkpoint's own files supply (an
    MXNet export's RNN operator in its ``-symbol.json``), used where there is no config.json;
    None: none. ``order``: every name of ``tensors`` and ``aliases`` in the order the file lists
    them (a state dict's, its tied names in their places), where that is not ``tensors``' order
    followed by ``aliases``'; None: it is. ``variant``: the format's name where one reader reads
    several (``"deepspeed-zero2"``); None: the registry row's. ``distributed``: for a checkpoint
    many ranks wrote, how (``world_size``, and what the format adds: its ZeRO stage); None
    otherwise.
    """

    tensors: Mapping[str, LazyTensor]
    files: list[str]
    metadata: Mapping[str, str] = field(default_factory=dict)
    provenance_text: object = None
    aliases: Mapping[str, str] = field(default_factory=dict)
    state_dict_key: str | None = None
    ignored: list[str] = field(default_factory=list)
    training: object = None
    config: Mapping[str, object] | None = None
    order: Sequence[str] | None = None
    variant: str | None = None
    distributed: Mapping[str, object] | None = None

    @property
    def optimizer(self):
        """The optimizer state beside the state dict (``optimizer_state.OptimizerState``; None:
        none), parsed now (CheckpointError for a malformed one)."""
        return self.training.optimizer() if self.training is not None else None


class Reader(Protocol):
    """A format's reader: the :class:`Contents` of the checkpoint at ``path``.

    ``key`` selects a state dict (only a format whose row ``takes_key`` is given one);
    ``check_link(path)`` raises for a file the checkpoint names (an index's shard) that lies
    outside the input's link boundary (None: no boundary)."""

    def __call__(self, path: str, key: str | None = None,
                 check_link: Callable[[str], None] | None = None) -> Contents: ...
