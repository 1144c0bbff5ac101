"""Output layouts: a Hugging Face folder with shards, and the openers every writer is reached by.

A format's row (:data:`fusectl.io.registry.FORMATS`) names its :class:`Output`; the files are
written at the temporary path that ``atomic.atomic_output`` renames into place.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Protocol, Sequence

from ..tensors import ByteRange, TensorSpec
from .formats.safetensors_file import INDEX_SUFFIX, SafetensorsWriter

if TYPE_CHECKING:
    import numpy as np

    from .checkpoint import Companion

Entries = Sequence[tuple[str, TensorSpec]]


class TensorWriter(Protocol):
    """What every output writes through: tensors in the declared order, then close (or abort)."""

    def write(self, name: str, data: "np.ndarray | tuple[ByteRange, ...]") -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


class OpenWriter(Protocol):
    """Opens an output at ``path``: ``shards`` are the entries cut into files (one for a
    single-file output) in the order their bytes are laid, ``shard_metadata(entries)`` gives each
    file's metadata, ``index_metadata`` goes to every file (or to a sharded folder's index),
    ``companions`` are copied into a folder, whose files are named after ``stem``; ``order``
    (an :attr:`Output.indexed` format's) is the order of the keys a loader sees, where it is
    not the bytes' (``fusectl.key_order``)."""

    def __call__(self, path: str, shards: Sequence[Entries], shard_metadata: Callable[[Entries], dict[str, str]],
                 index_metadata: Mapping[str, str], companions: "Sequence[Companion]" = (),
                 stem: str = "model", order: Sequence[str] | None = None) -> TensorWriter: ...


@dataclass(frozen=True)
class Output:
    """How a format is written: ``open`` makes its writer; ``folder``: a folder output (cut into
    shards, companions copied), which is what an output path no file output claims becomes;
    ``indexed``: the format lists its keys apart from their bytes (a safetensors header, a zip's
    central directory), so the bytes may be laid in the order they are read and the keys listed
    in the output's key order; else the bytes are written in the key order."""

    open: OpenWriter
    folder: bool = False
    indexed: bool = True


def single_file(writer: Callable[..., TensorWriter]) -> OpenWriter:
    """The opener of a one-file output that ``writer(path, entries, metadata)`` writes (with
    ``order=`` where the key order is not the entries')."""

    def open_file(path, shards, shard_metadata, index_metadata, companions=(), stem="model", order=None):
        (entries,) = shards
        metadata = {**shard_metadata(entries), **index_metadata}
        return writer(path, entries, metadata) if order is None else writer(path, entries, metadata, order=order)

    return open_file


class FolderWriter:
    """A Hugging Face folder: ``model.safetensors``, or shards plus ``model.safetensors.index.json``."""

    def __init__(self, folder: str, shards: Sequence[Entries], shard_metadata: Callable[[Entries], dict[str, str]],
                 index_metadata: Mapping[str, str], companions: "Sequence[Companion]" = (), stem: str = "model",
                 order: Sequence[str] | None = None):
        os.makedirs(folder)
        for companion in companions:
            target = os.path.join(folder, companion.relative)
            if companion.is_dir:
                os.makedirs(target, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if companion.write is not None:
                companion.write(target)
            elif companion.content is not None:
                with open(target, "wb") as f:
                    f.write(companion.content)
            else:
                shutil.copy2(companion.source, target)
        self._folder, self._stem = folder, stem
        self._total = sum(s.nbytes for shard in shards for _, s in shard)
        if len(shards) == 1:
            files = [f"{stem}.safetensors"]
            metadata = {**shard_metadata(shards[0]), **index_metadata}
            self._metas = [metadata]
            self._index = None
        else:
            files = [f"{stem}-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
            self._metas = [shard_metadata(s) for s in shards]
            weight_map = {n: f for f, shard in zip(files, shards) for n, _ in shard}
            listed = [n for n in order or () if n in weight_map]
            self._index = {
                "metadata": {"total_size": self._total, **index_metadata},
                "weight_map": {**{n: weight_map[n] for n in listed}, **weight_map},
            }
        self._files = files
        self._order = order
        self._shards = shards
        self._where = {n: k for k, shard in enumerate(shards) for n, _ in shard}
        self._writer: SafetensorsWriter | None = None
        self._current = -1

    def write(self, name: str, data) -> None:
        k = self._where[name]
        if k != self._current:
            if self._writer:
                self._writer.close()
            self._current = k
            self._writer = SafetensorsWriter(
                os.path.join(self._folder, self._files[k]), self._shards[k], self._metas[k], self._order
            )
        self._writer.write(name, data)

    def close(self) -> None:
        if self._writer:
            self._writer.close()
        for k in range(self._current + 1, len(self._shards)):  # empty shards cannot occur
            SafetensorsWriter(os.path.join(self._folder, self._files[k]), self._shards[k], self._metas[k],
                              self._order).close()
        if self._index is not None:
            with open(os.path.join(self._folder, self._stem + INDEX_SUFFIX), "w") as f:
                json.dump(self._index, f, indent=2)
                f.write("\n")

    def abort(self) -> None:
        if self._writer:
            self._writer.abort()


def plan_shards(entries: Sequence[tuple[str, TensorSpec]], max_size: int) -> list[list[tuple[str, TensorSpec]]]:
    """Cut the ordered entries into shards of at most ``max_size`` bytes (a bigger tensor alone)."""
    shards: list[list[tuple[str, TensorSpec]]] = [[]]
    size = 0
    for name, spec in entries:
        if shards[-1] and size + spec.nbytes > max_size:
            shards.append([])
            size = 0
        shards[-1].append((name, spec))
        size += spec.nbytes
    return shards
