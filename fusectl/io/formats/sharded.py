"""Sharded checkpoints: an index (``*.index.json``) whose ``weight_map`` names the shard file of
every tensor, each shard read by its format's reader into one :class:`Contents`.

The index is untrusted like the shards: its shard names must be plain file names beside it,
every shard link must stay inside the input's boundary, and the index must put every tensor in
the shard that holds it (a tensor stored twice, or listed where it is not, is refused).
"""

from __future__ import annotations

import os
from typing import Callable

from ...errors import CheckpointError, quote
from ...limits import check_limit
from ...tensors import LazyTensor
from ..contents import Contents, Reader
from ..provenance import METADATA_KEY
from ..untrusted import read_json_file


def read_index(index_path: str, read_shard: Reader, check_link: Callable[[str], None] | None = None) -> Contents:
    """The shards the index at ``index_path`` names, each read with ``read_shard(path)``, as one
    :class:`Contents`: their tensors, metadata and storage aliases merged; the index's own
    ``metadata`` holds the provenance entry. ``check_link(shard_path)`` is called before each
    shard is read."""
    index = read_json_file(index_path, "the index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: no 'weight_map' object mapping tensor names to shard files")
    if not weight_map:
        raise CheckpointError(f"{index_path}: 'weight_map' is empty, so the index names no tensor; "
                              "the file is truncated or corrupt")
    check_limit("tensors", len(weight_map), index_path)
    index_meta = index.get("metadata")
    if index_meta is None:
        index_meta = {}
    if not isinstance(index_meta, dict):
        raise CheckpointError(f"{index_path}: 'metadata' must be an object")
    folder = os.path.dirname(index_path)
    stored: dict[str, LazyTensor] = {}
    holder: dict[str, str] = {}  # name -> the shard file holding it
    metadata: dict[str, str] = {}
    aliases: dict[str, str] = {}
    files = []
    for shard in sorted(set(weight_map.values())):
        shard_path = os.path.join(folder, shard)
        if os.path.basename(shard) != shard or shard in ("", ".", "..") or not shard.isprintable():
            raise CheckpointError(f"{index_path}: shard {_shown(shard)} is not a file name beside the index")
        if not os.path.lexists(shard_path):
            raise CheckpointError(f"{index_path}: shard {_shown(shard)} is missing beside the index")
        if check_link is not None:
            check_link(shard_path)
        contents = read_shard(shard_path)
        files.append(shard_path)
        check_limit("tensors", len(stored) + len(contents.tensors), index_path)
        for name in (*contents.tensors, *contents.aliases):
            if name in holder:
                raise CheckpointError(f"{shard_path}: tensor {quote(name)} is also stored in another shard")
            holder[name] = shard_path
        stored.update(contents.tensors)
        aliases.update(contents.aliases)
        metadata.update(contents.metadata)
    for name, shard in weight_map.items():
        if holder.get(name) != os.path.join(folder, shard):
            raise CheckpointError(
                f"{index_path}: the index puts {_shown(name)} in {_shown(shard)}, which does not hold it"
            )
    return Contents(stored, files, metadata, index_meta.get(METADATA_KEY), aliases)


def _shown(name: str) -> str:
    """A name from an index, quoted for an error, and cut short: the index is not bounded by the
    name budget the way a shard's header is."""
    return quote(name) if len(name) <= 200 else quote(name[:200]) + f"... ({len(name)} characters)"
