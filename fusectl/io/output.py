"""Output layouts: a single safetensors file, a Hugging Face folder with shards, an npz file.

They are written at the temporary path that ``atomic.atomic_output`` renames into place."""

from __future__ import annotations

import json
import os
import shutil
from typing import Mapping, Sequence

from ..errors import OutputError
from ..tensors import TensorSpec
from .checkpoint import INDEX_SUFFIX, Companion
from .npz_file import NpzWriter
from .safetensors_file import SafetensorsWriter

# file names a user may mean as a single-file output that fusectl does not write: never
# silently turn them into a folder
_UNWRITTEN_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".onnx", ".h5", ".msgpack",
                       ".gguf", ".json", ".safetensor", ".zip", ".tar")


def output_kind(path: str) -> str:
    """``safetensors``, ``npz`` or ``folder``, from the output path's suffix."""
    if path.endswith(".safetensors"):
        return "safetensors"
    if path.endswith(".npz"):
        return "npz"
    suffix = os.path.splitext(path.rstrip(os.sep))[1].lower()
    if suffix in _UNWRITTEN_SUFFIXES:
        raise OutputError(
            f"{path}: fusectl writes .safetensors, .npz or a folder, not {suffix}; "
            "choose OUT.safetensors, OUT.npz or a folder name"
        )
    return "folder"


class FolderWriter:
    """A Hugging Face folder: ``model.safetensors``, or shards plus ``model.safetensors.index.json``."""

    def __init__(self, folder: str, shards: Sequence[Sequence[tuple[str, TensorSpec]]],
                 shard_metadata, index_metadata: Mapping[str, str], companions: Sequence[Companion],
                 stem: str = "model"):
        os.makedirs(folder)
        for companion in companions:
            target = os.path.join(folder, companion.relative)
            if companion.is_dir:
                os.makedirs(target, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if companion.content is not None:
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
            self._index = {
                "metadata": {"total_size": self._total, **index_metadata},
                "weight_map": {n: f for f, shard in zip(files, shards) for n, _ in shard},
            }
        self._files = files
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
                os.path.join(self._folder, self._files[k]), self._shards[k], self._metas[k]
            )
        self._writer.write(name, data)

    def close(self) -> None:
        if self._writer:
            self._writer.close()
        for k in range(self._current + 1, len(self._shards)):  # empty shards cannot occur
            SafetensorsWriter(os.path.join(self._folder, self._files[k]), self._shards[k], self._metas[k]).close()
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


def open_writer(kind: str, path: str, shards, shard_metadata, index_metadata, companions, stem: str = "model"):
    """A writer for ``kind``; ``shard_metadata(shard_entries)`` gives each file's metadata.

    ``shards`` are the entries cut into files (one for a single-file output); a folder's files
    are ``STEM.safetensors`` (``adapter_model`` for a LoRA adapter) or ``STEM-0000k-of-0000n``.
    """
    if kind == "safetensors":
        (entries,) = shards
        return SafetensorsWriter(path, entries, {**shard_metadata(entries), **index_metadata})
    if kind == "npz":
        (entries,) = shards
        return NpzWriter(path, entries, {**shard_metadata(entries), **index_metadata})
    return FolderWriter(path, shards, shard_metadata, index_metadata, companions, stem)
