"""Hugging Face cache folders: which snapshot a repository's cache folder stands for.

huggingface_hub caches a model repository as::

    models--ORG--NAME/
        blobs/<sha>                  the files' bytes
        refs/main                    the commit main points to: 40 hex digits, no newline
        snapshots/<commit>/<file>    links to ../../blobs/<sha>

A snapshot folder is a model folder. Named at the repository folder or at its ``snapshots``
folder, fusectl reads the snapshot ``refs/main`` names, else the only snapshot there is, else
asks which one. ``refs/main`` is untrusted like every input file: it must be a regular file of a
few bytes inside the repository that holds a commit hash (so never a path) naming a snapshot
that exists; anything else is refused, saying which snapshot folder to name instead.

>>> snapshot_repository("/hub/models--org--m/snapshots/abc/config.json")
'/hub/models--org--m'
"""

from __future__ import annotations

import os
import re
from typing import Callable

from ..errors import CheckpointError, printable, quote
from .untrusted import check_regular_file, open_input

REF = os.path.join("refs", "main")
SNAPSHOTS = "snapshots"
_COMMIT = re.compile(r"[0-9a-f]{40}")  # huggingface_hub's REGEX_COMMIT_HASH
_REF_BYTES = 64  # a commit hash, with room for a newline an editor added
_SHOWN = 5
# a path inside a snapshot: group 1 is the repository's cache folder, whose blobs/ the snapshot links to
_IN_SNAPSHOT = re.compile(r"^(.*/models--[^/]+)/snapshots/[^/]+(?:/.*)?$")


def snapshot_repository(path: str) -> str | None:
    """The repository cache folder (``…/models--ORG--NAME``) of a path inside one of its
    snapshots, from the path's text alone; None for any other path."""
    match = _IN_SNAPSHOT.match(path)
    return match.group(1) if match else None


def cache_repository(folder: str) -> str | None:
    """The repository cache folder that ``folder`` is, or whose ``snapshots`` folder it is; None
    for any other folder (a snapshot folder is read as the model folder it is).

    A repository folder holds ``snapshots/`` and is named ``models--…`` or holds ``refs/`` or
    ``blobs/`` beside it (a cache folder that was renamed).
    """
    path = os.path.normpath(os.path.abspath(folder))
    if _is_repository(path):
        return folder
    if os.path.basename(path) == SNAPSHOTS and _is_repository(os.path.dirname(path)):
        return os.path.dirname(path)
    return None


def _is_repository(path: str) -> bool:
    return os.path.isdir(os.path.join(path, SNAPSHOTS)) and (
        os.path.basename(path).startswith("models--")
        or os.path.isdir(os.path.join(path, "refs")) or os.path.isdir(os.path.join(path, "blobs")))


def pick_snapshot(repository: str, check_link: Callable[[str], None]) -> str:
    """The snapshot folder of ``repository`` to read: the one ``refs/main`` names when it
    exists, else the only one; ``check_link(path)`` refuses a path that leads outside the
    repository. CheckpointError, naming the snapshots to choose from, when neither says."""
    snapshots = os.path.join(repository, SNAPSHOTS)
    check_link(snapshots)
    try:
        names = sorted(e.name for e in os.scandir(snapshots) if e.is_dir())
    except OSError as e:
        raise CheckpointError(f"{printable(snapshots)}: cannot list it ({e.strerror})") from e
    ref = os.path.join(repository, REF)
    if os.path.lexists(ref):
        check_link(ref)
        commit = _read_commit(ref, _choices(snapshots, names))
        if commit not in names:
            raise CheckpointError(
                f"{printable(ref)}: names commit {commit}, but the cache holds no snapshot "
                f"{printable(os.path.join(snapshots, commit))} (the download did not finish, or the snapshot "
                f"was deleted); download the model again, or {_choices(snapshots, names)}"
            )
        chosen = commit
    elif len(names) == 1:
        chosen = names[0]
    elif not names:
        raise CheckpointError(f"{printable(snapshots)}: holds no snapshot folder, and {printable(ref)} does "
                              "not exist; the download did not finish — download the model again")
    else:
        raise CheckpointError(f"{printable(repository)}: {len(names)} snapshots and no {REF} to say which is "
                              f"current; {_choices(snapshots, names)}")
    snapshot = os.path.join(snapshots, chosen)
    check_link(snapshot)
    return snapshot


def _read_commit(ref: str, choices: str) -> str:
    """The commit hash held by the file ``ref`` (read within a few bytes' budget)."""
    check_regular_file(ref, hint=choices)
    with open_input(ref) as f:
        size = os.fstat(f.fileno()).st_size
        if size > _REF_BYTES:
            raise CheckpointError(f"{printable(ref)}: holds {size} bytes, not a commit hash (huggingface_hub "
                                  f"writes 40 hex digits); the cache is corrupt — {choices}")
        raw = f.read(_REF_BYTES + 1)
    text = raw.decode("ascii", "replace").strip()
    if not _COMMIT.fullmatch(text):
        raise CheckpointError(f"{printable(ref)}: holds {quote(text[:_REF_BYTES])}, not a commit hash (40 hex "
                              f"digits); the cache is corrupt or was edited — {choices}")
    return text


def _choices(snapshots: str, names: list[str]) -> str:
    """What to name instead, for messages: the snapshot folders there are."""
    if not names:
        return "the cache holds no snapshot folder to name instead"
    shown = ", ".join(printable(os.path.join(snapshots, n)) for n in names[:_SHOWN])
    more = f" (and {len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
    return f"name the snapshot folder to read: {shown}{more}"
