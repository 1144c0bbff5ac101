"""torch.distributed.checkpoint (DCP) folders, read without torch.

``dcp.save(state_dict, checkpoint_id=DIR)`` — what FSDP (``SHARDED_STATE_DICT``, ``fully_shard``),
torchtitan and accelerate write — leaves a folder that holds

- ``.metadata``: a pickle of ``torch.distributed.checkpoint.metadata.Metadata``:
  ``state_dict_metadata`` (per flattened key, a ``TensorStorageMetadata`` — the tensor's global
  ``size``, its ``properties`` (dtype first) and ``chunks``, each the ``offsets`` and ``sizes``
  of the block one rank wrote — or a ``BytesStorageMetadata`` for any other value),
  ``planner_data`` (per flattened key, the key path in the nested dict that was saved:
  ``("optim", "param_groups", 0, "lr")``) and ``storage_data`` (per chunk, a ``MetadataIndex``
  of its key and offsets → a ``filesystem._StorageInfo``: the file, byte offset and length);
- ``__R_N.distcp``: what rank R wrote, each item a complete ``torch.save`` archive at its
  offset (a tensor chunk, or a value).

:func:`read_dcp` gives what torch's ``dcp_to_torch_save`` writes: the nested dict rebuilt from
``planner_data`` in ``state_dict_metadata``'s order, each tensor whole at its global size. A
tensor cut along its first dimension only (FSDP's ``Shard(0)``) is the file ranges of its
chunks one after another (:class:`~fusectl.tensors.RangesTensor`: consolidating copies file
ranges, it never holds the model); any other cut is assembled block by block when read, one
tensor at a time. The model's state dict is the tree's ``model`` entry (or the one dict of
tensors beside the optimizer, or the top level when it holds the tensors), the optimizer the
entry training code names so (``optim``: ``get_state_dict``'s form, keyed by parameter name).

Every pickle is read through ``torch_file``'s scanned, allow-listed unpickler, DCP's classes as
inert records (:data:`RECORDS`): nothing of torch is imported, nothing in ``.metadata`` runs
(torch 2.13 loads it with an unrestricted ``pickle.load``). The layout is checked as data
before anything is written — chunks past their tensor, overlapping or leaving holes, a chunk
with no storage entry, a file named outside the folder or missing, an item that is not the
chunk it is said to be, a key path that contradicts another — each a CheckpointError naming
the file.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from ...errors import CheckpointError, printable, quote
from ...limits import check_limit, limit
from ...tensors import LazyTensor, TensorSpec
from ..contents import Contents
from ..key_path import KeyPath, key_text
from ..optimizer_state import Training, find_optimizer
from ..provenance import METADATA_KEY
from ..sniff import DCP_METADATA, DCP_RANK_METADATA
from ..untrusted import open_input, read_json_file
from .chunks import assemble, check_tiling
from .torch_file import Record, Records, dtype_of, global_name, read_pickle, read_torch_tree

_META = "torch.distributed.checkpoint.metadata."
# the classes a DCP ``.metadata`` holds, read as inert records (never imported)
RECORDS = Records((
    *(_META + n for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                          "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.serialization._get_layout",
    "pathlib.PosixPath", "pathlib._local.PosixPath",  # StorageMeta's checkpoint_id
    # Megatron's torch_dist keeps every rank's save plan in Metadata.all_local_plans
    *("torch.distributed.checkpoint.planner." + n for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")),
))

METADATA_FILE = "fusectl_metadata.json"  # fusectl's record (its provenance) in a DCP folder it wrote
_RANK_FILE = re.compile(r"__([0-9]{1,6})_([0-9]{1,6})\.distcp")
_HOW = "the folder is not what torch.distributed.checkpoint writes, or it is corrupt"


def read_dcp(path: str, key: str | None = None, check_link: Callable[[str], None] | None = None) -> Contents:
    """The :class:`~fusectl.io.contents.Contents` of the DCP folder ``path``.

    :param path: the folder (one of its ``.distcp`` files is refused: name the folder).
    :param key: the top-level entry that holds the model's state dict (None: ``model``, else the
        one dict of tensors beside the optimizer, else the top level).
    :param check_link: called with each file before it is read (the input's link boundary).
    :returns: the model's tensors, each at its global size; the whole tree as ``training``
        (``dcp_to_torch_save``'s, every entry kept); ``distributed`` ``{"world_size": the ranks
        whose files the folder holds}``; fusectl's record from ``fusectl_metadata.json``.
    :raises CheckpointError: naming the file: a ``.metadata`` that is not DCP's or holds a class
        outside the allow-list, chunks that do not tile their tensor, a missing or truncated
        ``.distcp`` file, an item that is not what the metadata says, contradicting key paths.
    """
    folder = DcpFolder(path, check_link)
    values = {fqn: folder.tensor(fqn) if folder.is_tensor(fqn) else folder.value(fqn) for fqn in folder.entries}
    where = folder.where
    tree = _unflatten(values, folder.layout.planner, where)
    record = _record(path, folder.check)
    model_path, optimizer_path, problem = _model_path(tree, key, where)
    model = _node(tree, model_path)
    tensors = {str(k): v for k, v in model.items() if isinstance(v, LazyTensor)}
    for tensor in tensors.values():  # the model's items checked now; the rest when an output reads them
        tensor.opened
    ignored = [str(k) for k, v in model.items() if not isinstance(v, LazyTensor)]
    whole = model_path or ignored or optimizer_path is not None
    training = Training(path, model_path, optimizer_path, lambda: tree, problem) if whole else None
    read = folder.read_files()
    if record is not None:
        read.append(os.path.join(path, METADATA_FILE))
    record = record or {}
    return Contents(tensors, read, record, record.get(METADATA_KEY), state_dict_key=key_text(model_path) or None,
                    ignored=ignored, training=training, distributed={"world_size": len(folder.ranks())})


class DcpFolder:
    """A DCP folder whose index is read and checked, its items opened only when asked:
    ``entries`` (flattened key → its TensorStorageMetadata or BytesStorageMetadata record, in
    the index's order), :meth:`tensor` and :meth:`value` of each, :meth:`read_files` (the files
    opened so far). A reader of a format built on DCP (Megatron's torch_dist) reads the tensors
    it needs and never opens a value it does not.

    :param path: the folder (one of its ``.distcp`` files is refused: name the folder).
    :param check_link: called with each file before it is read (the input's link boundary).
    :raises CheckpointError: naming the file: a ``.metadata`` that is not DCP's or holds a class
        outside the allow-list, a rank's items without its index, more entries than the limit.
    """

    def __init__(self, path: str, check_link: Callable[[str], None] | None = None):
        self.path, self.check = path, check_link or (lambda p: None)
        if not os.path.isdir(path):
            raise CheckpointError(f"{printable(path)}: one file of a torch.distributed.checkpoint folder; name the "
                                  f"folder that holds it and its {DCP_METADATA}")
        self.indexes = _indexes(path)
        for index in self.indexes:
            self.check(index)
        self.layout = _Layout.read(self.indexes)
        self.where = self.layout.where
        if self.layout.ranks:
            written = {int(m.group(1)) for n in _listing(path) if (m := _RANK_FILE.fullmatch(n))}
            unindexed = sorted(written - self.layout.ranks)
            if unindexed:
                raise CheckpointError(f"{printable(path)}: holds the items of rank {unindexed[0]} "
                                      f"(__{unindexed[0]}_*.distcp) but not its index __{unindexed[0]}.metadata; "
                                      "copy the whole folder")
        check_limit("tensors", len(self.layout.entries), self.where)
        self.entries: dict[str, Record] = self.layout.entries
        self.files: dict[str, str] = {}

    def file_of(self, info: dict) -> str:
        """The path of the file an item's storage ``info`` names, checked to be there.

        :raises CheckpointError: the file is missing."""
        name = info["relative_path"]
        if name not in self.files:
            full = os.path.join(self.path, name)
            self.check(full)
            if not os.path.lexists(full):
                raise CheckpointError(f"{printable(full)}: missing; {self.where} keeps items there (a rank's file: "
                                      "copy the whole folder)")
            self.files[name] = full
        return self.files[name]

    def is_tensor(self, fqn: str) -> bool:
        """Whether the entry ``fqn`` is a tensor (else a value: a BytesStorageMetadata item)."""
        return self.entries[fqn].name != _META + "BytesStorageMetadata"

    def tensor(self, fqn: str) -> LazyTensor:
        """The tensor ``fqn`` at its global size, its chunks checked to tile it and their files
        to be there; its items opened and checked when it is first read (``opened``).

        :raises CheckpointError: chunks past the tensor, overlapping or leaving holes, a chunk
            without a storage entry, a missing file, a dtype fusectl does not read."""
        return _tensor(fqn, self.entries[fqn], self.layout, self.file_of, self.where)

    def value(self, fqn: str, records: Records | None = None) -> object:
        """The value ``fqn`` (a ``torch.save`` item), read through the scanned unpickler.

        :param records: classes read as inert records beyond torch_file's allow-list.
        :raises CheckpointError: the item holds a class outside the allow-list, or is corrupt."""
        info = self.layout.location(fqn, None)
        value, _ = read_torch_tree(self.file_of(info), span=(info["offset"], info["length"]), records=records)
        return value

    def value_file(self, fqn: str) -> str:
        """The file that holds the value ``fqn``, checked to be there, without reading it.

        :raises CheckpointError: no storage entry names it, or its file is missing."""
        return self.file_of(self.layout.location(fqn, None))

    def ranks(self) -> set[int]:
        """The ranks whose ``__R_N.distcp`` files the folder holds or its index names."""
        return {int(m.group(1)) for n in [*self.files, *_listing(self.path)] if (m := _RANK_FILE.fullmatch(n))}

    def read_files(self) -> list[str]:
        """The index files, then every item file opened so far, by name."""
        return [*self.indexes, *(self.files[n] for n in sorted(self.files))]


class _Layout:
    """What the folder's index says: ``entries`` (flattened key → its TensorStorageMetadata or
    BytesStorageMetadata record, in the file's order), ``planner`` (flattened key → key path),
    the storage of each chunk (:meth:`location`) and, where each rank wrote an index of its
    own, the ``ranks`` that did (else empty)."""

    def __init__(self, where: str, entries: dict, planner: dict, storage: dict, ranks: frozenset[int] = frozenset()):
        self.where, self.entries, self.planner, self._storage, self.ranks = where, entries, planner, storage, ranks

    @classmethod
    def read(cls, paths: list[str]) -> "_Layout":
        """The layout of one ``.metadata``, or of the ranks' ``__R.metadata`` files together: each
        tensor's chunks from every rank (a block two ranks both saved — a replicated tensor — read
        from the first), the ranks agreeing on every key's size, dtype and key path."""
        first = cls._parse(paths[0])
        ranks = frozenset(int(m.group(1)) for p in paths if (m := DCP_RANK_METADATA.fullmatch(os.path.basename(p))))
        if len(paths) == 1:
            return cls(first.where, first.entries, first.planner, first._storage, ranks)
        where = f"{printable(os.path.dirname(paths[0]) or '.')}/__R.metadata"
        entries, planner, storage = dict(first.entries), dict(first.planner), dict(first._storage)
        for path in paths[1:]:
            rank = cls._parse(path)
            for fqn, entry in rank.entries.items():
                known = entries.get(fqn)
                if known is None:
                    entries[fqn] = entry
                else:
                    entries[fqn] = _merged(fqn, known, entry, rank.where)
                if planner.setdefault(fqn, rank.planner.get(fqn, (fqn,))) != rank.planner.get(fqn, (fqn,)):
                    raise CheckpointError(f"{rank.where}: saves {quote(fqn)} at the key path "
                                          f"{_shown(rank.planner.get(fqn))}, another rank at {_shown(planner[fqn])}; "
                                          "the ranks' files are of different checkpoints")
            for key, info in rank._storage.items():
                storage.setdefault(key, info)
        return cls(where, entries, planner, storage, ranks)

    @classmethod
    def _parse(cls, path: str) -> "_Layout":
        where = printable(path)
        with open_input(path) as f:
            check_limit("pickle-bytes", os.fstat(f.fileno()).st_size, where)
            data = f.read()
        root = _state(read_pickle(data, where, RECORDS), "Metadata", where, "the file")
        entries = root.get("state_dict_metadata")
        if type(entries) is not dict or any(type(k) is not str for k in entries):
            raise CheckpointError(f"{where}: its state_dict_metadata is not a dict of keys; {_HOW}")
        kinds = (_META + "TensorStorageMetadata", _META + "BytesStorageMetadata")
        for fqn, entry in entries.items():
            if not isinstance(entry, Record) or entry.name not in kinds:
                raise CheckpointError(f"{where}: the entry of {quote(fqn)} is {_shown(entry)}, not a tensor's or a "
                                      f"value's storage metadata; {_HOW}")
        planner = root.get("planner_data") or {}
        if type(planner) is not dict:
            raise CheckpointError(f"{where}: its planner_data is not a dict of key paths; {_HOW}")
        storage: dict[tuple, dict] = {}
        raw = root.get("storage_data")
        if type(raw) is not dict:
            raise CheckpointError(f"{where}: its storage_data is not a dict; {_HOW}")
        for index, info in raw.items():
            index = _state(index, "MetadataIndex", where, "a storage_data key")
            fqn, offset = index.get("fqn"), index.get("offset")
            if type(fqn) is not str or not (offset is None or _ints(offset)):
                raise CheckpointError(f"{where}: a storage_data key names {_shown(fqn)} at {_shown(offset)}; {_HOW}")
            info = _state(info, "_StorageInfo", where, f"the storage of {quote(fqn)}",
                          module="torch.distributed.checkpoint.filesystem.")
            storage_key = (fqn, tuple(offset) if offset is not None else None)
            if storage_key in storage:
                raise CheckpointError(f"{where}: the chunk of {quote(fqn)} at {list(offset or ())} has two storage "
                                      f"entries; {_HOW}")
            storage[storage_key] = _checked_info(info, fqn, where)
        return cls(where, entries, planner, storage)

    def location(self, fqn: str, offsets: tuple[int, ...] | None) -> dict:
        """The storage of ``fqn``'s chunk at ``offsets`` (None: a value's): the file, offset, length."""
        found = self._storage.get((fqn, offsets))
        if found is None:
            at = "" if offsets is None else f"'s chunk at {list(offsets)}"
            raise CheckpointError(f"{self.where}: {quote(fqn)}{at} has no storage entry (no file holds it); {_HOW}")
        return found


def _indexes(folder: str) -> list[str]:
    """The folder's index: its ``.metadata``, else every rank's ``__R.metadata`` (what ranks that
    saved without talking to each other write), ranks 0 to N-1 all there."""
    whole = os.path.join(folder, DCP_METADATA)
    if os.path.lexists(whole):
        return [whole]
    ranks = sorted(int(m.group(1)) for n in _listing(folder) if (m := DCP_RANK_METADATA.fullmatch(n)))
    missing = sorted(set(range(ranks[-1] + 1)) - set(ranks)) if ranks else [0]
    if missing:
        raise CheckpointError(f"{printable(folder)}: holds the index of rank(s) {', '.join(map(str, ranks))} but not "
                              f"__{missing[0]}.metadata; copy the whole folder (each rank wrote its own index)")
    return [os.path.join(folder, f"__{r}{DCP_METADATA}") for r in ranks]


def _merged(fqn: str, known: Record, entry: Record, where: str) -> Record:
    """``known`` (an earlier rank's entry for ``fqn``) with the chunks of ``entry`` it lacks."""
    if entry.name != known.name:
        raise CheckpointError(f"{where}: saves {quote(fqn)} as {_shown(entry)}, another rank as {_shown(known)}; the "
                              "ranks' files are of different checkpoints")
    if entry.name != _META + "TensorStorageMetadata":
        return known
    mine, theirs = entry.state, known.state
    if type(mine) is not dict or type(theirs) is not dict or type(mine.get("chunks")) is not list or \
            type(theirs.get("chunks")) is not list:
        raise CheckpointError(f"{where}: the tensor {quote(fqn)} has no list of chunks; {_HOW}")
    if mine.get("size") != theirs.get("size") or \
            _dtype(fqn, mine.get("properties"), where) != _dtype(fqn, theirs.get("properties"), where):
        raise CheckpointError(f"{where}: the tensor {quote(fqn)} is {_shown(mine.get('size'))} there, "
                              f"{_shown(theirs.get('size'))} on another rank (or of another dtype); the ranks' files "
                              "are of different checkpoints")
    seen = {_block(c) for c in theirs["chunks"]}
    merged = type(known)()
    merged.__setstate__({**theirs, "chunks": [*theirs["chunks"], *(c for c in mine["chunks"] if _block(c) not in seen)]})
    return merged


def _block(chunk: object) -> object:
    """A chunk's (offsets, sizes), to tell two ranks' copies of one block (a chunk that is not
    DCP's is checked with the tensor's others)."""
    state = chunk.state if isinstance(chunk, Record) and type(chunk.state) is dict else {}
    offsets, sizes = state.get("offsets"), state.get("sizes")
    return (tuple(offsets), tuple(sizes)) if _ints(offsets) and _ints(sizes) else id(chunk)


def _state(value: object, cls: str, where: str, what: str, module: str = _META) -> dict:
    """The fields of ``value``, a record of DCP's class ``cls``; CheckpointError otherwise."""
    if not isinstance(value, Record) or value.name != module + cls or type(value.state) is not dict:
        raise CheckpointError(f"{where}: {what} is {_shown(value)}, not DCP's {cls}; {_HOW}")
    return value.state


def _shown(value: object) -> str:
    return quote(value.name) if isinstance(value, Record) else quote(repr(value)[:80])


def _ints(value: object) -> bool:
    """Whether ``value`` is a tuple or list of non-negative ints (a torch.Size reads as a tuple)."""
    return type(value) in (tuple, list) and all(type(v) is int and v >= 0 for v in value)


def _checked_info(info: dict, fqn: str, where: str) -> dict:
    name, offset, length = info.get("relative_path"), info.get("offset"), info.get("length")
    if type(name) is not str or not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise CheckpointError(f"{where}: the storage of {quote(fqn)} names the file {_shown(name)}; a DCP item lies in "
                              "a file of the folder itself — fusectl follows no path out of it")
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        raise CheckpointError(f"{where}: the storage of {quote(fqn)} is at offset {_shown(offset)}, length "
                              f"{_shown(length)}; {_HOW}")
    if info.get("transform_descriptors"):
        raise CheckpointError(f"{where}: the storage of {quote(fqn)} is transformed "
                              f"({_shown(info['transform_descriptors'])}); fusectl reads plain DCP items only")
    return {"relative_path": name, "offset": offset, "length": length}


def _tensor(fqn: str, entry: Record, layout: _Layout, file_of: Callable[[dict], str], where: str) -> LazyTensor:
    """The tensor ``fqn`` at its global size from its chunks, each checked against its item."""
    state = entry.state if type(entry.state) is dict else {}
    size, chunks = state.get("size"), state.get("chunks")
    if not _ints(size) or len(size) > limit("dims") or type(chunks) is not list:
        raise CheckpointError(f"{where}: the tensor {quote(fqn)} has size {_shown(size)} and chunks "
                              f"{_shown(chunks)}; {_HOW}")
    spec = TensorSpec(_dtype(fqn, state.get("properties"), where), tuple(size))
    check_limit("chunks", len(chunks), f"{where}: {quote(fqn)}")
    blocks = []
    for chunk in chunks:
        fields = _state(chunk, "ChunkStorageMetadata", where, f"a chunk of {quote(fqn)}")
        offsets, sizes = fields.get("offsets"), fields.get("sizes")
        if not _ints(offsets) or not _ints(sizes) or len(offsets) != len(size) or len(sizes) != len(size) or \
                any(o + s > d for o, s, d in zip(offsets, sizes, size)):
            raise CheckpointError(f"{where}: a chunk of {quote(fqn)} {list(spec.shape)} is at offsets "
                                  f"{_shown(offsets)} with sizes {_shown(sizes)}: past the tensor's bounds; {_HOW}")
        blocks.append((tuple(offsets), tuple(sizes)))
    check_tiling(fqn, spec, blocks, where, _HOW)
    located = [(offsets, sizes, layout.location(fqn, offsets)) for offsets, sizes in blocks]
    for *_, info in located:
        file_of(info)  # a missing rank file is refused now, whichever tensor needs it
    return _Deferred(spec, functools.partial(_opened, fqn, spec, located, file_of, where))


def _opened(fqn: str, spec: TensorSpec, located: list, file_of: Callable[[dict], str], where: str) -> LazyTensor:
    """The tensor ``fqn`` from its chunks' items, each opened and checked to be the chunk it is
    said to be."""
    pieces = []
    for offsets, sizes, info in located:
        file = file_of(info)
        item, _ = read_torch_tree(file, span=(info["offset"], info["length"]))
        expected = TensorSpec(spec.dtype, sizes)
        if not isinstance(item, LazyTensor) or item.spec != expected:
            got = item.spec if isinstance(item, LazyTensor) else "no tensor"
            raise CheckpointError(f"{printable(file)}: the item at offset {info['offset']} holds {got}, but {where} "
                                  f"says it is the chunk of {quote(fqn)} at {list(offsets)}, {expected}; the files "
                                  "are of two checkpoints, or one is corrupt")
        pieces.append((offsets, item))
    return assemble(spec, pieces)


@dataclass(frozen=True, eq=False)
class _Deferred(LazyTensor):
    """A tensor whose chunks' items are opened and checked when it is first read or copied, not
    when the folder is read: the model's tensors are opened at once (:func:`read_dcp`), the
    optimizer's moments only by an output that holds them — a safetensors output of the model,
    two thirds fewer items to open for an Adam checkpoint. Its spec is the metadata's, checked
    (the chunks tile it) when the folder is read."""

    spec: TensorSpec
    open: Callable[[], LazyTensor]

    @functools.cached_property
    def opened(self) -> LazyTensor:
        """The tensor assembled from its items (RangesTensor or chunks.Blocks)."""
        return self.open()

    def read(self) -> np.ndarray:
        """Read the assembled tensor."""
        return self.opened.read()

    def byte_ranges(self):
        """The assembled tensor's file ranges (None for blocks of any other cut)."""
        return self.opened.byte_ranges()


def _dtype(fqn: str, properties: object, where: str):
    """The dtype of a TensorProperties record (its pickled state: a tuple, dtype first; older
    torch: a dict)."""
    state = properties.state if isinstance(properties, Record) else None
    marker = state[0] if type(state) is tuple and state else state.get("dtype") if type(state) is dict else None
    dtype = dtype_of(marker)
    if dtype is None:
        shown = quote(global_name(marker) or repr(marker)[:80])
        raise CheckpointError(f"{where}: the tensor {quote(fqn)} has the dtype {shown}, which fusectl does not read; "
                              "convert it to a dtype fusectl reads before saving")
    return dtype


def _unflatten(values: Mapping[str, object], planner: Mapping, where: str) -> dict:
    """The nested dict ``dcp_to_torch_save`` rebuilds: each value set at its key path (torch's
    ``set_element``: a missing container made as the next key asks, a dict for a name, a list
    for a position), in ``values``' order; a key without a path at the top level."""
    root: dict = {}
    bound = len(values)  # a list position past the number of entries cannot be a real one
    for fqn, value in values.items():
        path = planner.get(fqn, (fqn,))
        if type(path) not in (tuple, list) or not path or \
                any(type(k) is not str and (type(k) is not int or not 0 <= k < bound) for k in path):
            raise CheckpointError(f"{where}: the key path of {quote(fqn)} is {_shown(path)}, not keys and list "
                                  f"positions under {bound}; {_HOW}")
        node: object = root
        for k, following in zip(path, path[1:]):
            made = {} if type(following) is str else []
            node = _step(node, k, made, fqn, where)
        _place(node, path[-1], value, fqn, where)
    return root


def _step(node: object, key, made: object, fqn: str, where: str) -> object:
    if type(node) is dict and type(key) is str:
        child = node.setdefault(key, made)
    elif type(node) is list and type(key) is int:
        node.extend([None] * (key + 1 - len(node)))
        if node[key] is None:
            node[key] = made
        child = node[key]
    else:
        child = None
    if type(child) is not type(made):
        shown = quote(key) if type(key) is str else str(key)
        raise CheckpointError(f"{where}: the key path of {quote(fqn)} runs through {shown}, which another key "
                              f"holds as something else; {_HOW}")
    return child


def _place(node: object, key, value: object, fqn: str, where: str) -> None:
    taken = node.get(key) if type(node) is dict and type(key) is str else \
        (node[key] if key < len(node) else None) if type(node) is list and type(key) is int else False
    if taken is not None:
        raise CheckpointError(f"{where}: {quote(fqn)} is saved at a key path another key holds; {_HOW}")
    if type(node) is list:
        node.extend([None] * (key + 1 - len(node)))
    node[key] = value


def _model_path(tree: dict, key: str | None, where: str) -> tuple[KeyPath, KeyPath | None, str | None]:
    """(where the model's state dict is, where the optimizer is, a problem finding it)."""
    optimizer_path, problem = find_optimizer(tree, ())
    if problem:
        problem = f"{where}: {problem}"
    if key is not None:
        if not isinstance(tree.get(key), dict):
            raise CheckpointError(f"{where}: the checkpoint has no dict {quote(key)}; its entries are "
                                  f"{', '.join(quote(str(k)) for k in list(tree)[:20])}")
        return (key,), optimizer_path, problem
    if any(isinstance(v, LazyTensor) for v in tree.values()):
        return (), optimizer_path, problem
    found = [k for k, v in tree.items() if (k,) != optimizer_path and isinstance(v, dict)
             and any(isinstance(t, LazyTensor) for t in v.values())]
    if "model" in found or len(found) == 1:
        return ("model" if "model" in found else found[0],), optimizer_path, problem
    if not found:
        raise CheckpointError(f"{where}: holds no dict of tensors beside the optimizer; fusectl reads a model's "
                              "state dict, as dcp.save({'model': model.state_dict(), ...}) writes")
    raise CheckpointError(f"{where}: holds several dicts of tensors: {', '.join(quote(str(k)) for k in found[:20])}; "
                          "pass --key with the one that holds the model")


def _node(tree: dict, path: KeyPath) -> dict:
    return tree if not path else tree[path[0]]


def _record(folder: str, check: Callable[[str], None]) -> dict[str, str] | None:
    """fusectl's record in a DCP folder it wrote (``fusectl_metadata.json``: names → texts); None
    where there is none."""
    path = os.path.join(folder, METADATA_FILE)
    if not os.path.lexists(path):
        return None
    check(path)
    raw = read_json_file(path, "fusectl's metadata")
    if type(raw) is not dict or any(type(k) is not str or type(v) is not str for k, v in raw.items()):
        raise CheckpointError(f"{printable(path)}: not an object of texts, as fusectl writes its metadata; remove the "
                              "file or restore it")
    return raw


def _listing(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError as e:
        raise CheckpointError(f"{printable(path)}: cannot be listed ({e.strerror})") from e
