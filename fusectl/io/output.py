"""Output layouts (single safetensors, Hugging Face folder with shards, npz) written atomically."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from typing import Callable, Iterator, Mapping, Sequence

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


@contextlib.contextmanager
def atomic_output(path: str, *, force: bool, inputs: Sequence[str],
                  on_note: Callable[[str], None] | None = None, extra: Sequence[str] = ()) -> Iterator[str]:
    """Yield a temporary path beside ``path``; rename it into place only if the body succeeds.

    ``extra`` names further outputs written with the main one (an ONNX model's external data):
    the body writes each at ``temporary_name(extra)``; they are checked, flushed, renamed into
    place just before the main output, and removed on failure like it.

    The temporary output is flushed to disk (every file, then every folder) before the rename,
    and the parent folder after it, so a crash after fusectl returns cannot leave a renamed but
    empty output. Temporaries that a killed run left for the same output (``.NAME.fusectl-tmp-PID``
    of a process that is gone) are removed first, each reported through ``on_note``.
    """
    target = os.path.realpath(path)
    for output in (path, *extra):
        _check_target(output, force, inputs, on_note or (lambda message: None))
    parent = os.path.dirname(target)
    base = os.path.basename(target)
    temp = temporary_name(path)
    extras = [(temporary_name(e), os.path.realpath(e)) for e in extra]
    for t in (temp, *(t for t, _ in extras)):
        _remove(t)
    try:
        try:
            yield temp
            for t in (temp, *(t for t, _ in extras)):
                _sync_tree(t)
        except OSError as e:
            if e.errno in _NO_SPACE:
                raise OutputError(f"{path}: {e.strerror} while writing it; nothing was written. "
                                  "Free some space (or choose another -o) and run again") from e
            raise
        for t, final in extras:
            os.replace(t, final)
        if os.path.lexists(target):
            old = os.path.join(parent, f".{base}.fusectl-old-{os.getpid()}")
            os.rename(target, old)
            os.rename(temp, target)
            _remove(old)
        else:
            os.rename(temp, target)
        _sync(parent)
    finally:
        for t in (temp, *(t for t, _ in extras)):
            _remove(t)


def temporary_name(path: str) -> str:
    """Where ``atomic_output`` has an output written: ``.NAME.fusectl-tmp-PID`` beside it."""
    target = os.path.realpath(path)
    return os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.fusectl-tmp-{os.getpid()}")


def _check_target(path: str, force: bool, inputs: Sequence[str], on_note: Callable[[str], None]) -> None:
    """An output may not overwrite or land inside an input, nor replace a file without --force;
    what a killed run left for it is cleaned first."""
    target = os.path.realpath(path)
    for source in inputs:
        source = os.path.realpath(source)
        if target == source or source.startswith(target.rstrip(os.sep) + os.sep):
            raise OutputError(f"{path}: the output would overwrite the input {source}; choose another -o")
        if os.path.isdir(source) and target.startswith(source.rstrip(os.sep) + os.sep):
            raise OutputError(f"{path}: the output would land inside the input folder {source}; "
                              "choose another -o")
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        raise OutputError(f"{path}: the folder {parent} does not exist")
    _clean_stale(parent, os.path.basename(target), target, on_note)
    if os.path.lexists(target) and not force:
        raise OutputError(f"{path}: already exists; pass --force to replace it")


_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_LEFTOVER = re.compile(r"\.(?P<base>.+)\.fusectl-(?P<kind>tmp|old)-(?P<pid>[0-9]+)(?:\.d)?")


def _clean_stale(parent: str, base: str, target: str, on_note: Callable[[str], None]) -> None:
    """Remove what a killed run left for this output: temporaries of processes that are gone.

    A ``.fusectl-old-PID`` is the previous output, moved aside just before the new one was
    renamed into place: if the run died between the two renames, it is put back.
    """
    for name in sorted(os.listdir(parent)):
        m = _LEFTOVER.fullmatch(name)
        if not m or m.group("base") != base or _alive(int(m.group("pid"))):
            continue
        leftover = os.path.join(parent, name)
        if m.group("kind") == "old" and not os.path.lexists(target):
            os.rename(leftover, target)
            on_note(f"restored {target} from {leftover}, where a killed run (pid {m.group('pid')}) had moved it")
            continue
        _remove(leftover)
        on_note(f"removed {leftover}, left by a killed run (pid {m.group('pid')})")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process, or no such pid on this platform: leave it
    return True


def _sync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(path: str) -> None:
    """fsync a file, or every file and folder under a folder (files first)."""
    if not os.path.isdir(path):
        _sync(path)
        return
    folders = []
    for root, _, files in os.walk(path):
        folders.append(root)
        for name in files:
            _sync(os.path.join(root, name))
    for folder in reversed(folders):
        _sync(folder)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


class FolderWriter:
    """A Hugging Face folder: ``model.safetensors``, or shards plus ``model.safetensors.index.json``."""

    def __init__(self, folder: str, shards: Sequence[Sequence[tuple[str, TensorSpec]]],
                 shard_metadata, index_metadata: Mapping[str, str], companions: Sequence[Companion]):
        os.makedirs(folder)
        for companion in companions:
            target = os.path.join(folder, companion.relative)
            if companion.is_dir:
                os.makedirs(target, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(companion.source, target)
        self._folder = folder
        self._total = sum(s.nbytes for shard in shards for _, s in shard)
        if len(shards) == 1:
            files = ["model.safetensors"]
            metadata = {**shard_metadata(shards[0]), **index_metadata}
            self._metas = [metadata]
            self._index = None
        else:
            files = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
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
            with open(os.path.join(self._folder, "model" + INDEX_SUFFIX), "w") as f:
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


def open_writer(kind: str, path: str, shards, shard_metadata, index_metadata, companions):
    """A writer for ``kind``; ``shard_metadata(shard_entries)`` gives each file's metadata.

    ``shards`` are the entries cut into files (one for a single-file output).
    """
    if kind == "safetensors":
        (entries,) = shards
        return SafetensorsWriter(path, entries, {**shard_metadata(entries), **index_metadata})
    if kind == "npz":
        (entries,) = shards
        return NpzWriter(path, entries, {**shard_metadata(entries), **index_metadata})
    return FolderWriter(path, shards, shard_metadata, index_metadata, companions)
