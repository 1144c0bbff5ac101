"""torch.distributed.checkpoint (DCP) folders written without torch: what ``dcp.load`` reads.

:func:`write_dcp` writes a training tree as the folder ``dcp.save({"model": msd, "optim": osd})``
leaves when one rank saves it (torch 2.13's ``FileSystemWriter``; the layout is
:mod:`fusectl.io.formats.dcp`'s docstring):

- the tree is flattened as DCP's ``flatten_state_dict`` flattens it: dict keys (as text) and
  list positions joined with ``.`` (``optim.param_groups.0.lr``), a list that holds no tensor,
  dict or such list a value of its own, a tuple always one; each flattened key keeps its key path
  in ``planner_data``;
- ``__0_0.distcp`` holds every item, one after another, as the writer writes them: a tensor as
  the complete ``torch.save`` archive of the tensor (its bytes copied from the input's file
  ranges where it has them, :func:`~fusectl.io.formats.torch_writer.append_torch_archive`:
  never the model in memory), any other value as the ``torch.save`` archive of the value;
- ``.metadata`` is the pickle of DCP's ``Metadata`` (``state_dict_metadata``: per key a
  ``TensorStorageMetadata`` with the tensor's ``TensorProperties``, ``torch.Size`` and one chunk,
  the whole tensor, or a ``BytesStorageMetadata``; ``planner_data``; ``storage_data``: per item
  its ``MetadataIndex`` → ``_StorageInfo``; ``storage_meta``; ``version``), written through
  :func:`~fusectl.io.formats.torch_writer.pickle_tree` from records of those classes, as
  torch's unpickler rebuilds them;
- fusectl's record (its provenance), a JSON object of texts in ``fusectl_metadata.json``
  (:data:`~fusectl.io.formats.dcp.METADATA_FILE`): DCP's loader reads only the files
  ``.metadata`` names, and fusectl's reader reads it back, so ``unfuse`` works on the output.

One rank's file is enough: ``dcp.load`` reshards at load, on any number of ranks. The model goes
under ``model``, the optimizer under ``optim`` in the form ``get_state_dict`` / ``set_state_dict``
use (``state`` and each group's ``params`` keyed by parameter name): an optimizer keyed by ids
(torch's ``state_dict()``, DeepSpeed's, with ``param_names`` or fusectl's record of the names) is
converted; one keyed by name (read from a DCP folder) is written as read.

:func:`write_items` writes the two files from flattened items alone, for a format built on DCP
(Megatron's torch_dist, :mod:`.megatron_dist_writer`): a :class:`Chunked` tensor is written as
its blocks, one chunk and one item each (a stacked tensor layer by layer).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from typing import Mapping, Sequence

from ...errors import OutputError, printable, quote
from ...tensors import LazyTensor, TensorSpec
from ..key_path import KeyPath, key_text, node_at
from ..optimizer_state import parse_optimizer
from ..sniff import DCP_METADATA
from ..streaming import Writeback
from .dcp import METADATA_FILE, RECORDS
from .deepspeed_universal import named_groups
from .torch_file import Records, dtype_global
from .torch_writer import append_torch_archive, pickle_tree

RANK_FILE = "__0_0.distcp"  # rank 0's file, the only one written
VERSION = "1.0.0"  # Metadata.version, as torch 2.13 writes it
MODEL, OPTIMIZER = "model", "optim"  # the keys get_state_dict's state dicts are saved under

_META = "torch.distributed.checkpoint.metadata."
# what .metadata holds, as records the writer pickles (torch.Size too: the reader gives a tuple)
_CLASSES = Records((*RECORDS.names, "torch.Size")).classes


def write_dcp(folder: str, root: object, model_path: KeyPath, optimizer_path: KeyPath | None,
              metadata: Mapping[str, str], checkpoint_id: str | None = None, where: str | None = None) -> None:
    """Write the training tree ``root`` as a DCP folder in ``folder`` (made if missing;
    ``atomic_output``'s temporary: the caller renames it into place).

    :param root: a training tree: the model's state dict at ``model_path`` (name → tensor, a tied
        name the same tensor), an optimizer's ``state_dict()`` at ``optimizer_path`` (ids with
        each group's ``param_names``, else the names ``metadata`` records under
        ``fusectl.param_names``; or keyed by name), every other top-level entry kept.
    :param metadata: fusectl's record (its provenance), written to ``fusectl_metadata.json``.
    :param checkpoint_id: the name ``storage_meta`` records (``dcp.save``'s ``checkpoint_id``;
        default: the folder's name).
    :param where: the output as messages name it (default: ``folder``; the final name where
        ``folder`` is a temporary one).
    :raises OutputError: naming the entry: an optimizer without parameter names, one that trains
        a parameter the model does not hold, two entries that flatten to one key, a value torch
        cannot hold; CheckpointError: a malformed optimizer. Nothing is written then but what
        the caller's temporary folder holds.

    >>> import tempfile
    >>> from fusectl.io.formats.dcp import read_dcp
    >>> tree = read_dcp("fixtures/distributed/dcp").training.tree()
    >>> out = tempfile.mkdtemp()
    >>> write_dcp(out, tree, ("model",), ("optim",), {})
    >>> sorted(os.listdir(out))
    ['.metadata', '__0_0.distcp']
    """
    where = where or printable(folder)
    items = flatten(dcp_tree(root, model_path, optimizer_path, metadata, where), where)
    write_items(folder, [(fqn, value) for fqn, _, value in items], {fqn: path for fqn, path, _ in items},
                checkpoint_id, where)
    if metadata:
        place = os.path.join(folder, METADATA_FILE)
        try:
            with open(place, "w", encoding="utf-8") as f:
                json.dump(dict(metadata), f, separators=(",", ":"), ensure_ascii=False)
        except OSError as e:
            raise OutputError(f"{printable(place)}: cannot be written ({e.strerror})") from e


@dataclass(frozen=True)
class Chunked:
    """A global tensor of ``spec`` written as ``blocks`` (offsets, tensor of the block's shape)
    that tile it, each block one DCP chunk — one item of the file, copied from the block's file
    ranges where it has them, else read alone: a stacked tensor written layer by layer."""

    spec: TensorSpec
    blocks: tuple[tuple[tuple[int, ...], LazyTensor], ...]


def write_items(folder: str, items: Sequence[tuple[str, object]], planner: Mapping[str, tuple] | None,
                checkpoint_id: str | None, where: str) -> None:
    """Write ``items`` (flattened key → a tensor, a :class:`Chunked` tensor, or any other value
    torch can hold) as the DCP folder ``folder``'s ``__0_0.distcp`` and ``.metadata``, in order.

    :param planner: ``planner_data`` (key → its key path; None: none, as Megatron's save leaves it).
    :param checkpoint_id: the name ``storage_meta`` records (default: the folder's name).
    :param where: the output, as messages name it.
    :raises OutputError: naming the file that cannot be written, or the item torch cannot hold.
    """
    entries, storage = {}, {}
    place = os.path.join(folder, RANK_FILE)
    try:
        os.makedirs(folder, exist_ok=True)
        with open(place, "wb", buffering=0) as f:
            writeback = Writeback(f.fileno())
            try:
                offset = 0
                for fqn, value in items:
                    entries[fqn], pieces = _storage_metadata(fqn, value)
                    for index, piece in pieces:
                        length = append_torch_archive(f.fileno(), writeback, piece, f"{where}: {quote(fqn)}")
                        storage[index] = _record("torch.distributed.checkpoint.filesystem._StorageInfo", {
                            "relative_path": RANK_FILE, "offset": offset, "length": length,
                            "transform_descriptors": None})
                        offset += length
            finally:
                writeback.finish()
            os.fsync(f.fileno())
        place = os.path.join(folder, DCP_METADATA)
        name = checkpoint_id or os.path.basename(os.path.normpath(folder))
        with open(place, "wb") as f:
            f.write(pickle_tree(_metadata(entries, planner, storage, name), where))
            os.fsync(f.fileno())
    except OSError as e:
        raise OutputError(f"{printable(place)}: cannot be written ({e.strerror})") from e


def dcp_tree(root: object, model_path: KeyPath, optimizer_path: KeyPath | None, metadata: Mapping[str, str],
             where: str) -> dict:
    """The tree ``dcp.save`` is given: the model's state dict under ``model`` and the optimizer
    under ``optim`` (keyed by parameter name, :func:`optimizer_by_name`), each where the top-level
    entry that held it stood, every other top-level entry kept as read. A model at the top of
    ``root`` (``model_path`` ``()``) is its tensors, first; its other entries are kept beside it.
    OutputError where an entry would be lost: one beside the model or optimizer inside the
    top-level entry that holds it, or one at the key the model or optimizer takes."""
    if not isinstance(root, dict):
        raise OutputError(f"{where}: the training state is not a dict; a DCP checkpoint saves a dict")
    model = node_at(root, model_path)
    if not isinstance(model, dict):
        raise OutputError(f"{where}: the model at {quote(key_text(model_path))} is not a state dict")
    tops = {model_path[:1]: MODEL}
    optimizer = None
    if optimizer_path is not None:
        optimizer = optimizer_by_name(node_at(root, optimizer_path), optimizer_path, model, metadata, where)
        tops[optimizer_path[:1]] = OPTIMIZER
    for path in (model_path, optimizer_path or ()):
        if not _alone(root, path):
            raise OutputError(f"{where}: {quote(key_text(path))} shares the entry {quote(str(path[0]))} with other "
                              "entries, which a DCP checkpoint of the model and the optimizer would lose; write a "
                              "PyTorch file (.pt) instead")
    out: dict = {MODEL: {k: v for k, v in model.items() if isinstance(v, LazyTensor)}} if not model_path else {}
    for key, value in root.items():
        new = tops.get((key,))
        if new is not None:
            value = model if new == MODEL else optimizer
        elif not model_path and isinstance(value, LazyTensor):
            continue  # the model's, saved under 'model'
        else:
            new = key
        if new in out:
            raise OutputError(f"{where}: the entry {quote(str(new))} would be saved at the key the "
                              f"{'model' if new == MODEL else 'optimizer'} takes in a DCP checkpoint; rename it")
        out[new] = value
    return out


def _alone(root: dict, path: KeyPath) -> bool:
    """Whether every container on ``path`` below the top holds nothing but the way down it."""
    node: object = root
    for depth, key in enumerate(path):
        if depth and len(node) != 1:
            return False
        node = node[key]
    return True


def optimizer_by_name(raw: object, path: KeyPath, model: Mapping, metadata: Mapping[str, str], where: str) -> dict:
    """The optimizer ``raw`` in ``get_state_dict``'s form: ``state`` keyed by parameter name, each
    group's ``params`` the names (its hyperparameters as read, ``param_names`` left out); one
    already keyed by name as it is.

    :raises OutputError: an optimizer of ids that names no parameters, or trains one the model
        does not hold; CheckpointError: a malformed optimizer."""
    state = parse_optimizer(raw, key_text(path), where)
    if state.form != "ids":
        return raw
    groups = named_groups(state, metadata, where, "a DCP checkpoint")
    for name in (n for group in groups for n in group):
        if name not in model:
            raise OutputError(f"{where}: the optimizer trains {quote(name)}, which the model does not hold; the "
                              "optimizer is of another model")
    names = dict(zip(state.ids(), (n for group in groups for n in group)))
    by_name = {names[pid]: entry for pid, entry in raw["state"].items() if pid in names}
    param_groups = [{**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": list(group)}
                    for g, group in zip(raw["param_groups"], groups)]
    rest = {k: v for k, v in raw.items() if k not in ("state", "param_groups")}
    return {"state": by_name, "param_groups": param_groups, **rest}


def flatten(tree: dict, where: str) -> list[tuple[str, tuple, object]]:
    """``(flattened key, key path, value)`` of every item of ``tree``, as DCP's
    ``flatten_state_dict`` visits them (``traverse_state_dict``): a dict's entries by ``str``
    of their keys, a list's by position where it holds a tensor or a dict (or such a list),
    anything else one item. OutputError for two paths that join to one key."""
    out: list[tuple[str, tuple, object]] = []
    seen: set[str] = set()

    def visit(path: tuple, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                visit((*path, str(k)), v)
        elif type(value) is list and not _terminal(value):
            for k, v in enumerate(value):
                visit((*path, k), v)
        else:
            fqn = ".".join(map(str, path))
            if fqn in seen:
                raise OutputError(f"{where}: two entries of the training state flatten to the key {quote(fqn)}, "
                                  "which a DCP checkpoint holds once; rename one")
            seen.add(fqn)
            out.append((fqn, path, value))

    for key, value in tree.items():
        visit((str(key),), value)
    return out


def _terminal(values: list) -> bool:
    """Whether DCP saves the list ``values`` as one value: it holds no tensor, no dict and no list
    it would walk into."""
    return not any(isinstance(v, (dict, LazyTensor)) or type(v) is list and not _terminal(v) for v in values)


def _record(name: str, state: object = None, *args: object):
    """An object of one of DCP's classes (or ``torch.Size``) for the pickle."""
    record = _CLASSES[name](*args)
    record.state = state
    return record


def _size(shape: tuple[int, ...]):
    return _record("torch.Size", None, tuple(shape))


def _storage_metadata(fqn: str, value: object) -> tuple:
    """(the item's entry of ``state_dict_metadata``, its items: each chunk's ``MetadataIndex``
    and what is written for it): a tensor's whole size, properties and its chunks (one, the
    whole tensor at offset 0, or a :class:`Chunked` tensor's blocks); a value's bytes."""
    if not isinstance(value, (LazyTensor, Chunked)):
        index = _record(_META + "MetadataIndex", {"fqn": fqn, "offset": None, "index": None})
        return _record(_META + "BytesStorageMetadata", {}), [(index, value)]
    spec = value.spec
    blocks = value.blocks if isinstance(value, Chunked) else (((0,) * len(spec.shape), value),)
    properties = _record(_META + "TensorProperties", (
        dtype_global(spec.dtype), _record("torch.serialization._get_layout", None, "torch.strided"), False,
        _record(_META + "_MEM_FORMAT_ENCODING", None, 0), False))
    chunks = [_record(_META + "ChunkStorageMetadata", {"offsets": _size(offsets), "sizes": _size(block.spec.shape)})
              for offsets, block in blocks]
    entry = _record(_META + "TensorStorageMetadata", {"properties": properties, "size": _size(spec.shape),
                                                      "chunks": chunks})
    return entry, [(_record(_META + "MetadataIndex", {"fqn": fqn, "offset": _size(offsets), "index": 0}), block)
                   for offsets, block in blocks]


def _metadata(entries: dict, planner: dict | None, storage: dict, name: str):
    """DCP's ``Metadata``; its ``save_id`` derived from what it holds (torch's is random), so the
    same input gives the same folder."""
    keys = [(k, planner[k]) if planner is not None else k for k in entries]
    digest = hashlib.sha256(repr(keys).encode()).digest()[:16]
    storage_meta = _record(_META + "StorageMeta", {
        "checkpoint_id": _record("pathlib.PosixPath", None, name), "save_id": str(uuid.UUID(bytes=digest, version=4)),
        "load_id": None, "modules": []})
    return _record(_META + "Metadata", {"state_dict_metadata": entries, "planner_data": planner,
                                        "storage_data": storage, "storage_meta": storage_meta, "version": VERSION})
