"""PyTorch checkpoints (``torch.save``, zip and legacy formats) read lazily, without torch.

A ``torch.save`` file is a pickle whose tensors point into storage records: the members
``<archive>/data/<key>`` of a zip archive (the default since PyTorch 1.6), or, in the legacy
format, raw storages that follow the pickles in the same file. fusectl reads the pickle
through an allow-list and keeps each tensor as a lazy description (storage, offset, shape,
strides, dtype); no tensor byte is read until a step needs it.

Unpickling runs code chosen by the file, so this module never lets it:

1. Every pickle is first *scanned* (opcode by opcode, nothing constructed): a global outside
   the allow-list below, or an opcode that builds arbitrary objects (``INST``, ``OBJ``,
   ``NEWOBJ`` — except of a class a format's reader allows as a record, :class:`Records` —,
   extension codes, out-of-band buffers), refuses the file before anything else happens. ``STACK_GLOBAL`` names are followed through the memo. The scan also bounds the work
   the pickle asks for (``pickle-bytes``, ``pickle-opcodes``, ``pickle-items``, ``pickle-depth``,
   ``pickle-hash-keys``, ``integer-digits``, ``pickle-memory``): a pickle that builds a huge list
   is refused in about the time it takes to read it; so is a tuple nested so deep that hashing it
   would overflow CPython's C stack (a crash, not an exception), a dict whose keys a file made
   collide (each insertion would scan all earlier keys: hours for a few megabytes), and a pickle
   that calls an allowed global again and again on one memoized object (each call copies it:
   gigabytes from a few megabytes) — every object and every call's result is counted, sized from
   what the call is given (``_BUILDS``), before anything is built.
2. Only then is it loaded by a :class:`pickle.Unpickler` whose ``find_class`` returns
   fusectl's own stand-ins for the allowed globals (the tensor rebuild functions return lazy
   descriptions, storage classes and dtypes are inert markers) and whose ``persistent_load``
   turns storage references into lazy storage descriptions. Each tensor is then checked
   against its storage (bounds, record size, ``expanded-bytes`` for a view that repeats its
   elements) when the state dict is chosen, before a table is built from it.

Pickle protocols 0 to 5 are scanned alike (a legacy file in protocol 0 or 1 starts with the magic
number as a text ``LONG``, not ``PROTO``). A protocol 0 file is refused all the same: its storage
references are text, which torch.load cannot read either. In a big-endian file (``byteorder``
"big") each storage is swapped by its own element size, as torch.load swaps it; a tensor whose
element size differs from its storage's (a uint16 tensor on an ``UntypedStorage``, which torch.load
leaves unswapped) is refused, since torch.load's values are then not what the writer saved.

The allow-list, exactly: ``collections.OrderedDict``; ``torch._utils._rebuild_tensor``,
``_rebuild_tensor_v2``, ``_rebuild_tensor_v3``, ``_rebuild_parameter``,
``_rebuild_parameter_with_state``; ``torch._tensor._rebuild_from_type_v2`` with ``torch.Tensor``
(a plain tensor that carries Python attributes); the typed storage classes
(``torch.FloatStorage``, ``torch.BFloat16Storage``, …) and ``torch.storage.UntypedStorage``;
the ``torch`` dtypes (``torch.float8_e4m3fn``, ``torch.uint16``, …, which ``_rebuild_tensor_v3``
names); ``torch.Size``; and the builtins a pickle of plain data uses: ``set``, ``frozenset`` and
``complex`` (as ``builtins.*`` and, in protocol 2, ``__builtin__.*``) and ``_codecs.encode`` (how
protocol 2 writes ``bytes``; latin-1 only).

>>> sorted(ALLOWED_GLOBALS)[:3]
['__builtin__.complex', '__builtin__.frozenset', '__builtin__.set']
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import io
import os
import pickle
import struct
import zipfile
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Callable

import numpy as np

from ... import dtypes
from ...dtypes import DType
from ...errors import CheckpointError, option_name, printable, quote
from ...limits import check_limit, limit
from ...tensors import ByteRange, FileTensor, LazyTensor, TensorSpec
from ..contents import Contents
from ..key_path import KeyPath, key_repr, key_text, resolve
from .npz_file import string_map
from ..optimizer_state import Training, find_optimizer, is_optimizer_dict, is_twin_of
from ..pickle_scan import Builds, NeedMore, call_bytes, scan
from .sharded import read_index
from ..sniff import check_pytorch
from ..provenance import METADATA_KEY
from ..untrusted import collector_paused, open_input

# the first pickle of a legacy file, and the version after it (torch/serialization.py)
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001
# every pickle protocol: 0 and 1 (torch.save(..., pickle_protocol=1)) write the magic number as a
# text LONG; the scan reads their opcodes as it reads their binary spellings
_LEGACY_MAGIC_PICKLES = {pickle.dumps(_LEGACY_MAGIC, protocol=p) for p in range(pickle.HIGHEST_PROTOCOL + 1)}
_LEGACY_PROTOCOL_PICKLES = {pickle.dumps(_LEGACY_PROTOCOL, protocol=p) for p in range(pickle.HIGHEST_PROTOCOL + 1)}
_LEGACY_TEXT_HEAD = pickle.dumps(_LEGACY_MAGIC, protocol=1)[:4]  # b"L119"
_DIM_MAX = 2**63 - 1
_SHOWN_CANDIDATES = 20


@dataclass(frozen=True)
class TorchContents:
    """What :func:`read_torch` found in a PyTorch file."""

    tensors: dict[str, LazyTensor]  # stored names → lazy tensors (one per unique storage view)
    aliases: dict[str, str]  # name → the kept name it shares storage with (same offset, shape, strides, dtype)
    key: str | None  # dotted key of the state dict chosen inside the file's object (None: the top level)
    ignored: list[str]  # names of entries of the chosen state dict that are not tensors
    candidates: dict[KeyPath, int]  # key path (() = top level) → tensor count, of every dict of tensors considered
    training: Training | None = None  # the container around the state dict (None: a top-level state dict alone)
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)  # fusectl's record (METADATA_RECORD)
    # every name of tensors and aliases in the state dict's order (None: tensors', then aliases')
    order: list[str] | None = None


def read_pytorch(path: str, key: str | None = None, check_link: Callable[[str], None] | None = None) -> Contents:
    """The :class:`Contents` of a PyTorch file, once its content shows what ``torch.save`` writes
    (:func:`~fusectl.io.sniff.check_pytorch` says what it is otherwise): the state dict
    :func:`read_torch` chooses (``key``), its storage aliases and the entries it ignored."""
    check_pytorch(path)
    found = read_torch(path, key)
    return Contents(found.tensors, [path], found.metadata, found.metadata.get(METADATA_KEY), aliases=found.aliases,
                    state_dict_key=found.key, ignored=found.ignored, training=found.training, order=found.order)


def read_pytorch_index(path: str, key: str | None = None,
                       check_link: Callable[[str], None] | None = None) -> Contents:
    """The :class:`Contents` of a sharded PyTorch checkpoint, from its index
    (``pytorch_model.bin.index.json``); each shard's top-level state dict is read. fusectl
    writes no sharded PyTorch checkpoints, so the index's metadata holds no provenance of fusectl's."""
    return dataclasses.replace(read_index(path, read_pytorch, check_link), provenance_text=None)


def read_torch(path: str, key: str | None = None) -> TorchContents:
    """The state dict of a ``torch.save`` file (zip or legacy format), as lazy tensors.

    ``key`` is the dotted path of the state dict inside a training dict (``"model_state_dict"``,
    ``"state.model"``; ``""`` is the top level). Without it: a top-level dict that holds a tensor
    of at least one dimension is the state dict. Otherwise the candidates are the dicts reachable
    through dicts (not lists) that hold tensors, leaving out optimizer state (a dict with
    ``state`` and ``param_groups``, and what it holds, or a key containing ``optim``); when exactly
    one of them holds a tensor of at least one dimension (or, failing that, exactly one holds
    tensors: a lone ``step`` scalar does not make a training dict a state dict) it is the state
    dict; otherwise a CheckpointError lists the candidates and asks for ``key``. Entries of the
    state dict that are not tensors (a number, a nested dict) are listed in ``ignored``.

    Names that view one storage with the same offset, shape, strides and dtype are one tensor:
    the first in the dict's order is kept, the others are ``aliases``. A C-contiguous view of an
    uncompressed little-endian storage is a :class:`FileTensor` (its bytes are one file range);
    any other view is read from its storage and laid out on demand.
    """
    return _contents(path, _open_archive(path), key)


def read_torch_tree(path: str, span: tuple[int, int] | None = None,
                    records: Records | None = None) -> tuple[object, dict[str, str]]:
    """The whole object of a ``torch.save`` file (zip or legacy format), read through the same
    scan and allow-list as :func:`read_torch`: dicts, lists, tuples, numbers and each tensor a
    lazy tensor checked against its storage; with fusectl's record (``METADATA_RECORD``; empty
    when there is none). For files that are not a state dict, such as a Hugging Face Trainer's
    ``optimizer.pt`` (an optimizer's ``state_dict()``).

    ``span`` (offset, length): the zip archive ``torch.save`` wrote at that range of a larger
    file (one item of a DCP ``.distcp`` file), its tensors file ranges of the whole file.
    ``records``: the classes beyond the allow-list whose objects the format's files hold
    (:class:`Records`), each read as a :class:`Record`."""
    archive = _open_archive(path, span, records)
    return _lazy_tree(path, archive, archive.root), dict(archive.metadata)


def read_pickle(data: bytes, where: str, records: Records) -> object:
    """The object of a bare pickle that is not a ``torch.save`` file (DCP's ``.metadata``): the
    same scan and allow-list, ``records``' classes read as :class:`Record`; no tensor storage."""
    scan(data, 0, where, complete=True, allowed=records.scanned)
    return _Loader(io.BytesIO(data), where, records=records, storages=False).run()


def _open_archive(path: str, span: tuple[int, int] | None = None, records: Records | None = None) -> "_Archive":
    with open_input(path) as f:
        size = os.fstat(f.fileno()).st_size
        if span is not None:
            offset, length = span
            if offset < 0 or length < 0 or offset + length > size:
                raise CheckpointError(f"{printable(path)}: an item of {length} bytes at offset {offset} runs past "
                                      f"the end of the file ({size} bytes); the file is truncated")
            f = _Window(f, offset, length)
            size = length
        head = f.read(4)
        if head == b"PK\x03\x04":
            return _read_zip(path, f, size, records)
        if span is None and (head[:1] == b"\x80" or head == _LEGACY_TEXT_HEAD):
            return _read_legacy(path, f, size)
        if span is not None:
            raise CheckpointError(f"{printable(path)}: the item at offset {span[0]} is not a torch.save archive "
                                  f"(it starts with {head!r}); the file is corrupt or the metadata names the "
                                  "wrong place")
        shown = "is empty" if size == 0 else f"starts with {head!r}"
        raise CheckpointError(
            f"{printable(path)}: not a PyTorch checkpoint (the file {shown}; torch.save writes a zip "
            "archive or, in the legacy format, a pickle); re-save it with torch.save or name another file"
        )


# ------------------------------------------------------------------------------- lazy tensors


@dataclass(frozen=True, eq=False, slots=True)
class _FileSource:
    """Storage bytes that lie as they are at ``offset`` of a file."""

    path: str
    offset: int

    def read(self, start: int, length: int) -> bytes:
        buffer = bytearray(length)
        try:
            with open(self.path, "rb") as f:
                got = os.preadv(f.fileno(), [buffer], self.offset + start)
        except OSError as e:
            raise CheckpointError(f"{printable(self.path)}: cannot read it ({e.strerror})") from e
        if got != length:
            raise CheckpointError(
                f"{printable(self.path)}: expected {length} bytes at offset {self.offset + start}, got {got}; "
                "the file is truncated or changed while fusectl was reading it"
            )
        return bytes(buffer)


@dataclass(frozen=True, eq=False, slots=True)
class _MemberSource:
    """Storage bytes in a compressed zip member: decompressed on read."""

    path: str
    member: str

    def read(self, start: int, length: int) -> bytes:
        where = f"{printable(self.path)}: member {quote(self.member)}"
        try:
            with open_input(self.path) as raw, zipfile.ZipFile(raw) as zf, zf.open(self.member) as f:
                f.seek(start)
                data = f.read(length)
        except (OSError, EOFError, ValueError, KeyError, NotImplementedError, RuntimeError, zipfile.BadZipFile,
                zlib.error) as e:
            raise CheckpointError(f"{where}: cannot be decompressed ({printable(str(e))[:200]}); "
                                  "the archive is corrupt or changed while fusectl was reading it") from e
        if len(data) != length:
            raise CheckpointError(f"{where}: ended after {start + len(data)} bytes, {start + length} needed; "
                                  "the archive is corrupt")
        return data


@dataclass(frozen=True, eq=False, slots=True)
class TorchViewTensor(LazyTensor):
    """A tensor that is not one plain file range: a strided view (a transposed or expanded
    tensor saved as it is), a storage in a compressed zip member, big-endian bytes, or a view
    with PyTorch's conjugate / negative bit. ``read`` reads the storage bytes the view covers
    and lays them out in C order."""

    spec: TensorSpec
    source: _FileSource | _MemberSource
    offset: int  # in elements
    strides: tuple[int, ...]  # in elements
    byteswap: bool = False
    conj: bool = False
    neg: bool = False

    def read(self) -> np.ndarray:
        dtype, shape = self.spec.dtype, self.spec.shape
        if self.spec.numel == 0:
            return np.empty(shape, dtype.numpy)
        itemsize = dtype.itemsize
        span = 1 + sum((n - 1) * s for n, s in zip(shape, self.strides))
        flat = np.frombuffer(self.source.read(self.offset * itemsize, span * itemsize), dtype.numpy)
        if self.byteswap and itemsize > 1:
            flat = _swapped(flat)
        view = np.lib.stride_tricks.as_strided(flat, shape, tuple(s * itemsize for s in self.strides),
                                               writeable=False)
        out = np.array(view, order="C")
        if self.conj:
            np.conjugate(out, out=out)
        if self.neg:
            np.negative(out, out=out)
        return out


def _swapped(flat: np.ndarray) -> np.ndarray:
    # a complex number is two floats, each stored in the file's byte order
    width = flat.dtype.itemsize // (2 if flat.dtype.kind == "c" else 1)
    unsigned = np.dtype(f"<u{width}")
    return flat.view(unsigned).byteswap().view(flat.dtype)


# ------------------------------------------------------------------------------- the archive


@dataclass(eq=False)
class _Storage:
    """One storage the pickle references: its bytes are the record ``key``."""

    key: str
    dtype: DType  # of the typed storage (U8 for an untyped one)
    nbytes: int
    source: _FileSource | _MemberSource | None = None
    problem: str | None = None  # why its record cannot be read (reported for tensors that use it)

    def __setstate__(self, state):
        raise _Malformed("BUILD on a storage")


@dataclass
class _Archive:
    """A file's unpickled object and the storages its tensors view."""

    root: object
    storages: dict[str, _Storage]
    byteswap: bool  # the storages are big-endian
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)  # fusectl's record (METADATA_RECORD)


def _read_zip(path: str, f: BinaryIO, size: int, records: Records | None = None) -> _Archive:
    where = printable(path)
    try:
        zf = zipfile.ZipFile(f)
    except (OSError, EOFError, ValueError, zipfile.BadZipFile, NotImplementedError, struct.error) as e:
        raise CheckpointError(f"{where}: a zip archive that cannot be read ({printable(str(e))[:200]}); the "
                              "file is truncated or corrupt — re-download or re-save it") from e
    with zf:
        infos = zf.infolist()
        members: dict[str, zipfile.ZipInfo] = {}
        duplicated = set()
        for info in infos:
            if info.filename in members:
                duplicated.add(info.filename)
            members[info.filename] = info
        prefix = infos[0].filename.split("/", 1)[0] if infos and "/" in infos[0].filename else None
        pickle_name = f"{prefix}/data.pkl"
        if prefix is None or pickle_name not in members:
            raise CheckpointError(
                f"{where}: a zip archive without a data.pkl record in its first folder, so not a torch.save "
                "checkpoint (a TorchScript archive, an .npz or another zip?); re-save the state dict with torch.save"
            )
        for name in duplicated:
            if name == pickle_name or name.startswith(f"{prefix}/data/") or name == f"{prefix}/byteorder":
                raise CheckpointError(f"{where}: the archive holds two records {quote(name)}; it is corrupt")

        def record(name: str, budget_key: str | None) -> bytes:
            info = members[name]
            if budget_key:
                check_limit(budget_key, info.file_size, f"{where}: record {quote(name)}")
            elif info.file_size > 16:
                raise CheckpointError(f"{where}: record {quote(name)} holds {info.file_size} bytes, not a byte "
                                      "order; the file is corrupt")
            try:
                with zf.open(info) as m:
                    data = m.read(info.file_size + 1)
            except (OSError, EOFError, ValueError, NotImplementedError, RuntimeError, zipfile.BadZipFile,
                    zlib.error) as e:
                raise CheckpointError(f"{where}: record {quote(name)} cannot be read ({printable(str(e))[:200]}); "
                                      "the archive is corrupt") from e
            if len(data) != info.file_size:
                raise CheckpointError(f"{where}: record {quote(name)} holds {len(data)} bytes, the archive "
                                      f"says {info.file_size}; it is corrupt")
            return data

        byteswap = False
        if f"{prefix}/byteorder" in members:
            order = record(f"{prefix}/byteorder", None)
            if order not in (b"little", b"big"):
                raise CheckpointError(f"{where}: the byteorder record says {order[:20]!r}, not 'little' or "
                                      "'big'; the file is corrupt")
            byteswap = order == b"big"
        data = record(pickle_name, "pickle-bytes")
        pickle_where = f"{where} ({printable(pickle_name)})"
        scan(data, 0, pickle_where, complete=True, allowed=records.scanned if records else _SCANNED)
        loader = _Loader(io.BytesIO(data), pickle_where, records=records)
        root = loader.run()
        for storage in loader.storages.values():
            _locate_member(path, f, size, members, f"{prefix}/data/{storage.key}", storage)
            if storage.source is not None and isinstance(f, _Window):  # a range of the whole file
                storage.source = _FileSource(path, f.start + storage.source.offset)
        metadata = {}
        if f"{prefix}/{METADATA_RECORD}" in members:  # written by fusectl's torch_writer
            name = f"{prefix}/{METADATA_RECORD}"
            metadata = string_map({name: record(name, "json-bytes")}, name, where)
    return _Archive(root, loader.storages, byteswap, metadata)


def _locate_member(path: str, f: BinaryIO, size: int, members: dict, name: str, storage: _Storage) -> None:
    """Where a storage record's bytes lie: a file range when it is stored uncompressed (as
    torch.save stores them), else the member, decompressed when read."""
    info = members.get(name)
    if info is None:
        storage.problem = f"its storage record {quote(name)} is missing from the archive"
        return
    if info.flag_bits & 0x1:
        storage.problem = f"its storage record {quote(name)} is encrypted"
        return
    start = None
    if info.compress_type == zipfile.ZIP_STORED:
        f.seek(info.header_offset)
        local = f.read(30)
        if len(local) == 30 and local[:4] == b"PK\x03\x04":
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            encoded = info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437", "replace")
            if f.read(name_len) == encoded and info.compress_size == info.file_size:
                start = info.header_offset + 30 + name_len + extra_len
        if start is None:
            storage.problem = f"its storage record {quote(name)} has a corrupt zip header"
            return
        if start + info.file_size > size:
            storage.problem = (f"its storage record {quote(name)} ({info.file_size} bytes from offset {start}) "
                               f"runs past the end of the file ({size} bytes); the file is truncated or corrupt")
            return
    if info.file_size != storage.nbytes:
        storage.problem = (f"its storage record {quote(name)} holds {info.file_size} bytes, but the pickle "
                           f"declares a storage of {storage.nbytes}; the file is corrupt")
        return
    if start is not None:
        storage.source = _FileSource(path, start)
    elif isinstance(f, _Window):
        storage.problem = f"its storage record {quote(name)} is compressed, which torch.save never writes"
    elif info.compress_type in (zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA):
        check_limit("decompressed-bytes", info.file_size, f"{printable(path)}: record {quote(name)}")
        storage.source = _MemberSource(path, name)
    else:
        storage.problem = f"its storage record {quote(name)} uses zip compression method {info.compress_type}"


def _read_legacy(path: str, f: BinaryIO, size: int) -> _Archive:
    """The legacy format: pickles of the magic number, the protocol version, system info, the
    object and the storage keys, then each storage as an int64 element count and its bytes."""
    where = printable(path)
    budget = limit("pickle-bytes")
    buffer = b""
    bounds = []
    pos = memory = 0
    # every pickle is scanned before any is unpickled; the first two are compared as bytes
    for i in range(5):
        while True:
            try:
                end, memory = scan(buffer, pos, where, complete=len(buffer) >= size, allowed=_SCANNED, memory=memory)
                break
            except NeedMore:
                if len(buffer) >= budget:
                    check_limit("pickle-bytes", len(buffer) + 1, f"{where}: the pickles")
                f.seek(0)
                buffer = f.read(min(size, budget, max(1 << 23, 4 * len(buffer))))
        if i == 0:
            if buffer[pos:end] not in _LEGACY_MAGIC_PICKLES:
                raise CheckpointError(f"{where}: not a PyTorch checkpoint (a pickle, but not what torch.save writes: "
                                      "no magic number); fusectl reads only state dicts saved with torch.save")
        if i == 1 and buffer[pos:end] not in _LEGACY_PROTOCOL_PICKLES:
            raise CheckpointError(f"{where}: a legacy torch.save file whose format is not version "
                                  f"{_LEGACY_PROTOCOL}; re-save it with a current PyTorch")
        bounds.append((pos, end))
        pos = end
    (info_start, info_end), (root_start, root_end), (keys_start, keys_end) = bounds[2:]
    _Loader(io.BytesIO(buffer[info_start:info_end]), where, plain=True).run()  # system info: nothing needed
    loader = _Loader(io.BytesIO(buffer[root_start:root_end]), where)
    root = loader.run()
    storages = loader.storages
    keys = _Loader(io.BytesIO(buffer[keys_start:keys_end]), where, plain=True).run()
    if type(keys) is not list or not all(type(k) is str for k in keys):
        raise CheckpointError(f"{where}: the list of storage keys is not a list of strings; the file is corrupt")
    if len(set(keys)) != len(keys) or set(keys) != set(storages):
        raise CheckpointError(f"{where}: the list of storage keys does not match the storages the pickle "
                              "references; the file is corrupt")
    # legacy storages are always written little-endian, whatever the machine
    for key in keys:
        storage = storages[key]
        f.seek(pos)
        header = f.read(8)
        if len(header) < 8:
            _past_end(storages, keys, key, size)
            break
        (count,) = struct.unpack("<q", header)
        if count < 0 or count * storage.dtype.itemsize != storage.nbytes:
            raise CheckpointError(
                f"{where}: storage {quote(key)} at offset {pos} holds {count} elements of "
                f"{storage.dtype.itemsize} bytes, the pickle declares {storage.nbytes} bytes; the file is corrupt"
            )
        if pos + 8 + storage.nbytes > size:
            _past_end(storages, keys, key, size)
            break
        storage.source = _FileSource(path, pos + 8)
        pos += 8 + storage.nbytes
    return _Archive(root, storages, False)


def _past_end(storages: dict[str, _Storage], keys: list[str], first: str, size: int) -> None:
    for key in keys[keys.index(first):]:
        storages[key].problem = (f"its storage {quote(key)} lies past the end of the file ({size} bytes); "
                                 "the file is truncated")


class _Window:
    """The file-like range ``[start, start + length)`` of an open file: a zip archive that
    ``torch.save`` wrote inside a larger file, read as a file of its own."""

    def __init__(self, f: BinaryIO, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = max(0, offset if whence == 0 else self.pos + offset if whence == 1 else self.length + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n is None or n < 0 else min(n, max(0, self.length - self.pos))
        self.f.seek(self.start + self.pos)
        data = self.f.read(n)
        self.pos += len(data)
        return data

    def fileno(self) -> int:
        return self.f.fileno()


class Record:
    """An object of a class a format allows beyond the allow-list (``Records``): never an object
    of that class, only its class's dotted ``name``, the ``args`` it was made with (an enum's
    value, a path's parts) and its ``state`` (what BUILD gave it: a dataclass's fields)."""

    __slots__ = ("args", "state")
    name = ""

    def __new__(cls, *args):
        record = object.__new__(cls)
        record.args, record.state = args, None
        return record

    def __setstate__(self, state):
        if type(state) not in (dict, tuple) or self.state is not None:
            raise _Malformed(f"BUILD on {self.name} with a state that is not one dict or tuple")
        self.state = state

    def field(self, key: str, default: object = None) -> object:
        """A field of a dataclass's state (``default`` where it has none)."""
        return self.state.get(key, default) if type(self.state) is dict else default

    def __repr__(self) -> str:
        return f"{self.name}{self.args if self.args else ''}"


@dataclass(frozen=True)
class Records:
    """The classes a format's pickles hold beyond the allow-list (DCP's metadata classes,
    DeepSpeed's loss scaler), each read as a :class:`Record` of its own subclass, made by NEWOBJ
    with no arguments and given a state by BUILD, or called with arguments. Nothing of the real
    class is imported or run."""

    names: tuple[str, ...]

    @functools.cached_property
    def classes(self) -> dict[str, type]:
        return {n: type(n.rsplit(".", 1)[-1], (Record,), {"__slots__": (), "name": n}) for n in self.names}

    @functools.cached_property
    def scanned(self) -> dict[str, Builds]:
        return {**_SCANNED, **{n: Builds.RECORD for n in self.names}}


# ------------------------------------------------------------------------------- the load (after the scan: io/pickle_scan.py)


class _Malformed(Exception):
    """Raised while unpickling; reported as a corrupt file."""




class _View:
    """A tensor as the pickle describes it (checked when it is named: see _tensor)."""

    __slots__ = ("storage", "offset", "size", "stride", "dtype", "metadata")

    def __init__(self, storage, offset, size, stride, dtype, metadata=None):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride
        self.dtype = dtype  # a dtype marker (_rebuild_tensor_v3), or None: the storage's
        self.metadata = metadata

    def __setstate__(self, state):
        raise _Malformed("BUILD on a tensor")


class _Inert:
    """An allowed global that is never called: a storage class, a dtype, ``torch.Tensor``."""

    __slots__ = ("name", "dtype")

    def __init__(self, name: str, dtype: DType | None = None):
        self.name, self.dtype = name, dtype

    def __setstate__(self, state):
        raise _Malformed(f"BUILD on {self.name}")


class _Call:
    """An allowed global that the pickle calls (REDUCE): fusectl's stand-in for it."""

    __slots__ = ("name", "fn")

    def __init__(self, name: str, fn):
        self.name, self.fn = name, fn

    def __call__(self, *args):
        try:
            return self.fn(*args)
        except TypeError as e:  # wrong number of arguments
            raise _Malformed(f"{self.name} called with {len(args)} arguments") from e

    def __setstate__(self, state):
        raise _Malformed(f"BUILD on {self.name}")


class _OrderedDict(dict):
    """collections.OrderedDict (a plain dict keeps order too)."""

    __slots__ = ()

    def __setstate__(self, state):
        # Module.state_dict() carries a per-module version table as an attribute (_metadata):
        # nothing in it describes a tensor
        if type(state) is not dict:
            raise _Malformed("an OrderedDict with a state that is not a dict")


def _rebuild_tensor(storage, storage_offset, size, stride):
    return _View(storage, storage_offset, size, stride, None)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                       metadata=None):
    return _View(storage, storage_offset, size, stride, None, metadata)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
    if not isinstance(dtype, _Inert) or dtype.name not in _DTYPE_GLOBALS:
        raise _Malformed("_rebuild_tensor_v3 without a dtype")
    return _View(storage, storage_offset, size, stride, dtype, metadata)


def _rebuild_parameter(data, requires_grad, backward_hooks, state=None):
    if not isinstance(data, _View):
        raise _Malformed("a Parameter whose data is not a tensor")
    return data


def _rebuild_from_type_v2(func, new_type, args, state):
    if not isinstance(func, _Call) or func.fn not in (_rebuild_tensor_v2, _rebuild_tensor_v3, _rebuild_tensor):
        raise _Malformed("_rebuild_from_type_v2 without a tensor rebuild function")
    if not isinstance(new_type, _Inert) or new_type.name != "torch.Tensor":
        raise _Malformed("a tensor subclass")
    if type(args) is not tuple:
        raise _Malformed("_rebuild_from_type_v2 without an argument tuple")
    return func(*args)  # the state (the tensor's Python attributes) describes no data


def _complex(real=0.0, imag=0.0):
    if not all(type(x) in (int, float) for x in (real, imag)):
        raise _Malformed("a complex number of something other than numbers")
    return complex(real, imag)


_STORAGE_CLASSES = {
    "DoubleStorage": "F64", "FloatStorage": "F32", "HalfStorage": "F16", "BFloat16Storage": "BF16",
    "LongStorage": "I64", "IntStorage": "I32", "ShortStorage": "I16", "CharStorage": "I8",
    "ByteStorage": "U8", "BoolStorage": "BOOL", "ComplexFloatStorage": "C64",
}
_DTYPE_NAMES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "complex64": "C64", "uint16": "U16",
    "uint32": "U32", "uint64": "U64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0",
}
# the tables fusectl's writer (torch_writer) writes from: one table for reading and writing
STORAGE_CLASSES, DTYPE_NAMES = _STORAGE_CLASSES, _DTYPE_NAMES
# the record fusectl's writer adds to a torch.save zip: its metadata, fusectl's provenance among it
METADATA_RECORD = "fusectl_metadata.json"
# dtypes PyTorch has and fusectl does not: a tensor of one is refused by name, not as a strange global
_UNSUPPORTED_DTYPES = ("complex128", "complex32", "float4_e2m1fn_x2")
_DTYPE_GLOBALS = {f"torch.{n}" for n in (*_DTYPE_NAMES, *_UNSUPPORTED_DTYPES)}


def _globals() -> dict[str, object]:
    table: dict[str, object] = {
        "collections.OrderedDict": None,  # _Loader.find_class gives a stand-in (_BOUND)
        "torch.Tensor": _Inert("torch.Tensor"),
        "torch.storage.UntypedStorage": _Inert("torch.storage.UntypedStorage", dtypes.BY_NAME["U8"]),
        "torch.UntypedStorage": _Inert("torch.UntypedStorage", dtypes.BY_NAME["U8"]),
        "torch.ComplexDoubleStorage": _Inert("torch.ComplexDoubleStorage"),
    }
    for name, fn in [("torch._utils._rebuild_tensor", _rebuild_tensor),
                     ("torch._utils._rebuild_tensor_v2", _rebuild_tensor_v2),
                     ("torch._utils._rebuild_tensor_v3", _rebuild_tensor_v3),
                     ("torch._utils._rebuild_parameter", _rebuild_parameter),
                     ("torch._utils._rebuild_parameter_with_state", _rebuild_parameter),
                     ("torch._tensor._rebuild_from_type_v2", _rebuild_from_type_v2)]:
        table[name] = _Call(name, fn)
    table["torch.Size"] = table["_codecs.encode"] = None  # _Loader.find_class gives a stand-in
    # protocol 2 spells builtins the Python 2 way (pickle's fix_imports)
    for module in ("builtins", "__builtin__"):
        table[f"{module}.complex"] = _Call(f"{module}.complex", _complex)
        table[f"{module}.set"] = table[f"{module}.frozenset"] = None  # _Loader.find_class gives a stand-in
    for cls, dtype_name in _STORAGE_CLASSES.items():
        table[f"torch.{cls}"] = _Inert(f"torch.{cls}", dtypes.BY_NAME[dtype_name])
    for name in _DTYPE_GLOBALS:
        table[name] = _Inert(name, dtypes.BY_NAME.get(_DTYPE_NAMES.get(name[len("torch."):], "")))
    return table


_GLOBALS = _globals()
ALLOWED_GLOBALS = frozenset(_GLOBALS)


def dtype_of(value: object) -> DType | None:
    """The dtype a ``torch.<dtype>`` global read from a pickle stands for (DCP's
    TensorProperties hold one); None for any other value or a dtype fusectl does not read."""
    return value.dtype if isinstance(value, _Inert) and value.name in _DTYPE_GLOBALS else None


def dtype_global(dtype: DType) -> object:
    """``torch.<dtype>`` as the reader gives it, for a tree the writer pickles (a DCP
    ``.metadata``'s TensorProperties)."""
    name = next(n for n, d in _DTYPE_NAMES.items() if d == dtype.safetensors)
    return _GLOBALS[f"torch.{name}"]


def described(value: object) -> str:
    """How a value read from a pickle is named in an error: ``a tensor F32[4, 4]``, ``a
    deepspeed.runtime.zero.config.ZeroStageEnum``, ``3``, ``a dict``."""
    if isinstance(value, LazyTensor):
        return f"a tensor {value.spec}"
    if isinstance(value, Record):
        return f"a {value.name}"
    if type(value) in (int, float, bool) or value is None:
        return repr(value)
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def global_name(value: object) -> str | None:
    """The dotted name of an allowed global the reader gave as a marker (a dtype, a storage
    class), for the writer to pickle it as that global; None for any other value."""
    return value.name if isinstance(value, _Inert) else None
# allowed globals that copy what they are given (the others build an object of a fixed size)
_BUILDS = {"torch.Size": Builds.TUPLE, "builtins.set": Builds.SET, "__builtin__.set": Builds.SET,
           "builtins.frozenset": Builds.FROZENSET, "__builtin__.frozenset": Builds.FROZENSET,
           "collections.OrderedDict": Builds.DICT, "_codecs.encode": Builds.BYTES}
_SCANNED = {name: _BUILDS.get(name, Builds.OBJECT) for name in _GLOBALS}  # what the scan needs to know
# allowed globals bound to the loader, which counts what they hash and what they copy
_BOUND = {"builtins.set": "_set", "__builtin__.set": "_set", "builtins.frozenset": "_frozenset",
          "__builtin__.frozenset": "_frozenset", "collections.OrderedDict": "_ordered_dict",
          "torch.Size": "_size", "_codecs.encode": "_encode"}

# what the C unpickler may raise on a malformed (already scanned) pickle
_LOAD_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError,
                OverflowError, MemoryError, RecursionError, UnicodeError, struct.error, _Malformed)


class _Loader(pickle.Unpickler):
    """Unpickles a scanned pickle with fusectl's stand-ins for the allowed globals (and
    ``records``' classes); ``storages`` False: a pickle that may reference no storage."""

    def __init__(self, file: BinaryIO, where: str, plain: bool = False, records: Records | None = None,
                 storages: bool = True):
        super().__init__(file, encoding="utf-8")
        self.where = where
        self.key_budget = limit("name-bytes")
        self.keys_budget = limit("pickle-hash-keys")
        self.odd_keys = 0
        self.memory_budget = limit("pickle-memory")
        self.copied = 0  # bytes the calls of _BOUND globals built
        self.plain = plain  # the small pickles of a legacy file's head: no global, no storage
        self.records = records.classes if records is not None else {}
        self.has_storages = storages
        self.storages: dict[str, _Storage] = {}

    def run(self):
        try:
            with collector_paused():
                return self.load()
        except _LOAD_ERRORS as e:
            raise CheckpointError(f"{self.where}: corrupt pickle ({_reason(e)}); the file is corrupt") from e

    def find_class(self, module: str, name: str):
        full = f"{module}.{name}"
        if not self.plain and full in self.records:
            return self.records[full]
        if self.plain or full not in _GLOBALS:  # the scan refused it already: a second lock
            raise CheckpointError(f"{self.where}: the pickle calls {quote(full[:200])}, which fusectl refuses")
        if full in _BOUND:  # these hash or copy what they are given: counted
            return _Call(full, getattr(self, _BOUND[full]))
        return _GLOBALS[full]

    def _copies(self, name: str, n: int) -> None:
        # the scan counted every call already (pickle-memory): a second lock, on what calls copy
        self.copied += call_bytes(_BUILDS[name], n)
        if self.copied > self.memory_budget:
            check_limit("pickle-memory", self.copied, f"{self.where} (a call of {quote(name)})")

    def _count_keys(self, keys) -> None:
        weights: dict[int, int] = {}
        for k in keys:
            if not (type(k) in (str, bytes, bool, type(None)) or type(k) is int and -(2**61) < k < 2**61
                    or type(k) in (_View, _Storage, _Inert, _Call)):  # these hash by identity
                self.odd_keys += _weight(k, weights)
        if self.odd_keys > self.keys_budget:
            check_limit("pickle-hash-keys", self.odd_keys, self.where)

    def _set(self, items=()):
        return set(self._members(items, "builtins.set"))

    def _frozenset(self, items=()):
        return frozenset(self._members(items, "builtins.frozenset"))

    def _members(self, items, name: str):
        if type(items) not in (list, tuple, set, frozenset):
            raise _Malformed("a set of something other than a list")
        self._copies(name, len(items))
        self._count_keys(items)
        return items

    def _size(self, sizes):
        if type(sizes) not in (tuple, list):
            raise _Malformed("torch.Size of something other than whole numbers")
        self._copies("torch.Size", len(sizes))
        if not all(type(n) is int for n in sizes):
            raise _Malformed("torch.Size of something other than whole numbers")
        return tuple(sizes)

    def _encode(self, text, encoding="utf-8"):
        # protocol 2 pickles bytes as _codecs.encode(str, 'latin1'); no other codec is needed
        if type(text) is not str or encoding not in ("latin1", "latin-1"):
            raise _Malformed("_codecs.encode other than of a string to latin1")
        self._copies("_codecs.encode", len(text))
        return text.encode("latin1")

    def _ordered_dict(self, items=()):
        if type(items) not in (list, tuple) and not isinstance(items, dict):
            raise _Malformed("an OrderedDict of something other than pairs")
        self._copies("collections.OrderedDict", len(items))
        if type(items) in (list, tuple):
            if not all(type(p) in (tuple, list) and len(p) == 2 for p in items):
                raise _Malformed("an OrderedDict of something other than pairs")
            self._count_keys(p[0] for p in items)
        return _OrderedDict(items)

    def persistent_load(self, pid):
        if type(pid) is str and pid.startswith("('storage', ") and not self.plain:  # protocol 0: str(the tuple)
            raise CheckpointError(
                f"{self.where}: a torch.save file written with pickle protocol 0, which stores each storage "
                "reference as text instead of a tuple; torch.load cannot read such a file either (\"saved_id "
                "must be a tuple\"), so fusectl does not guess at it. Load it with the PyTorch that wrote it and "
                "save it again with torch.save's default protocol")
        if self.plain or not self.has_storages or type(pid) is not tuple or len(pid) not in (5, 6) or \
                pid[0] != "storage":
            raise _Malformed("a persistent id that is not a storage")
        storage_type, key, location, numel = pid[1:5]
        if len(pid) == 6 and pid[5] is not None:
            raise _Malformed("a storage view (written by PyTorch before 1.0; re-save the file)")
        if not isinstance(storage_type, _Inert) or not storage_type.name.endswith("Storage"):
            raise _Malformed("a storage whose type is not a storage class")
        if type(key) is not str or type(numel) is not int or numel < 0 or type(location) is not str:
            raise _Malformed("a storage reference that is not (type, key, location, size)")
        if storage_type.dtype is None:
            raise CheckpointError(f"{self.where}: storage {quote(key[:200])} is a {storage_type.name}, a dtype "
                                  f"fusectl does not read (it reads {', '.join(dtypes.ARRAY_DTYPES)})")
        nbytes = numel * storage_type.dtype.itemsize
        storage = self.storages.get(key)
        if storage is None:
            if len(key) > self.key_budget:
                check_limit("name-bytes", len(key), f"{self.where}: a storage key")
            storage = self.storages[key] = _Storage(key, storage_type.dtype, nbytes)
        elif storage.dtype != storage_type.dtype or storage.nbytes != nbytes:
            raise CheckpointError(f"{self.where}: storage {quote(key[:200])} is referenced as two different "
                                  "storages (types or sizes); torch.save never writes that — the file is corrupt")
        return storage


def _weight(value: object, weights: dict[int, int]) -> int:
    """What hashing ``value`` costs: its items, counted as often as they occur (the scan bounds
    the nesting, so the recursion is shallow; ``weights`` keeps it linear in distinct tuples)."""
    if type(value) not in (tuple, frozenset):
        return 1
    known = weights.get(id(value))
    if known is None:
        known = weights[id(value)] = 1 + sum(_weight(v, weights) for v in value)
    return known


def _reason(e: BaseException) -> str:
    return printable(f"{type(e).__name__}: {e}"[:200])


def _short(value: object, nested: bool = False) -> str:
    """A value read from a pickle, shown in a message (briefly: it may be huge, and a tuple may
    hold itself many times over, so only one level is shown)."""
    if type(value) in (tuple, list):
        if nested:
            return "(...)" if type(value) is tuple else "[...]"
        shown = ", ".join(_short(v, True) for v in value[:6]) + (", ..." if len(value) > 6 else "")
        return f"({shown}{',' if len(value) == 1 else ''})" if type(value) is tuple else f"[{shown}]"
    if type(value) in (int, str, float, bool, type(None)):
        text = repr(value) if type(value) is not int or value.bit_length() < 100 else f"<{value.bit_length()}-bit int>"
        return printable(text if len(text) <= 40 else text[:40] + "...")
    return type(value).__name__


# ------------------------------------------------------------------------------- the state dict


def _contents(path: str, archive: _Archive, key: str | None) -> TorchContents:
    where = printable(path)
    found = _find_dicts(archive.root, where)
    candidates = found.candidates
    if key is None:
        if found.weighty.get(()):
            pool = [()]  # a state dict at the top level; dicts of tensors inside it are ignored entries
        else:
            pool = [k for k in candidates if found.weighty[k]] or list(candidates)
            pool = [k for k in pool if not is_twin_of(k, pool)]  # a model's EMA beside it: the model
        if not pool:
            skipped = "; optimizer state does not count" if found.optimizer_tensors else ""
            raise CheckpointError(f"{where}: holds no dict of tensors (the file holds {_describe(archive.root)}"
                                  f"{skipped}); fusectl reads a state dict, as torch.save(model.state_dict(), ...) "
                                  "writes")
        if len(pool) > 1:
            raise CheckpointError(f"{where}: holds several dicts of tensors: {_listed(pool, candidates)}; pass {option_name('key')} "
                                  "with the dotted key of the state dict to read")
        chosen = pool[0]
    else:  # the user's dotted text, matched against the real keys (a text two of them print as is refused)
        chosen = resolve(key, [p for p, d in found.dicts.items() if any(isinstance(v, _View) for v in d.values())],
                         where)
        if chosen is None:
            what = "is not a dict of tensors" if any(key_text(p) == key for p in found.dicts) else "does not exist"
            raise CheckpointError(f"{where}: key {quote(key[:200])} {what}; the dicts of tensors are: "
                                  f"{_listed(list(candidates), candidates) or 'none'}")
    state = found.dicts[chosen]
    tensors, aliases, ignored = _state_dict(path, archive, state)
    # a tied name where the state dict holds it (a model's lm_head.weight last, not beside its embedding)
    order = [str(k) for k, v in state.items() if type(k) in (str, int) and isinstance(v, _View)] if aliases else None
    # a top-level state dict that holds other entries is its own container: written whole, they stay
    training = _training(path, archive, found, chosen) if chosen or ignored else None
    return TorchContents(tensors, aliases, key_text(chosen) or None, ignored, candidates, training,
                         archive.metadata, order)


def _training(path: str, archive: _Archive, found: "_Dicts", key: KeyPath) -> Training:
    """The training dict around the state dict at ``key`` (a top-level state dict with other
    entries: the file itself): the optimizer beside it, and the whole tree, converted when asked
    for."""
    prefix = key[:-1]
    parent = found.dicts.get(prefix) if key else None
    optimizer_key, problem = find_optimizer(parent, prefix) if parent is not None else (None, None)
    where = printable(path)
    return Training(path, key, optimizer_key, lambda: _lazy_tree(path, archive, archive.root),
                    f"{where}: {problem}" if problem else None)


def _lazy_tree(path: str, archive: _Archive, root: object) -> object:
    """``root`` with each tensor a lazy tensor (checked against its storage), each
    ``OrderedDict`` a ``collections.OrderedDict`` and each other dict a plain dict (so that a
    container written back keeps its types); other values as unpickled. A value reached twice is
    converted once."""
    specs: dict = {}
    dims = limit("dims")
    memo: dict[int, object] = {}

    def convert(value: object, dotted: str) -> object:
        known = memo.get(id(value))
        if known is not None:
            return known
        if isinstance(value, _View):
            out = _tensor(path, dotted, value, archive, specs, dims)[0]
        elif isinstance(value, dict):
            out = collections.OrderedDict() if isinstance(value, _OrderedDict) else {}
            memo[id(value)] = out
            for k, v in value.items():
                out[k] = convert(v, f"{dotted}.{k}" if dotted else str(k))
        elif type(value) in (list, tuple):
            items: list = []
            if type(value) is list:  # a list may hold itself: it is known before its items
                memo[id(value)] = items
            items.extend(convert(v, f"{dotted}.{n}" if dotted else str(n)) for n, v in enumerate(value))
            out = items if type(value) is list else tuple(items)
        else:
            return value
        memo[id(value)] = out
        return out

    return convert(root, "")


def _listed(keys: list[KeyPath], candidates: dict[KeyPath, int]) -> str:
    texts = [key_text(k) for k in candidates]
    alike = {t for t in texts if texts.count(t) > 1} if len(set(texts)) < len(texts) else set()

    def shown_key(k: KeyPath) -> str:  # keys that print alike are shown as the keys they are
        return key_repr(k) + " (prints alike another)" if key_text(k) in alike else _key_text(k)
    shown = ", ".join(f"{shown_key(k)} ({candidates[k]} tensors)" for k in keys[:_SHOWN_CANDIDATES])
    return shown + (f" and {len(keys) - _SHOWN_CANDIDATES} more" if len(keys) > _SHOWN_CANDIDATES else "")


def _describe(value: object) -> str:
    if isinstance(value, _View):
        return "a single tensor, with no name"
    return {list: "a list", tuple: "a tuple"}.get(type(value)) or ("a dict" if isinstance(value, dict) else
                                                                 f"a {type(value).__name__}")


def _key_text(key: KeyPath) -> str:
    return quote(key_text(key)) if key else "the top level"


@dataclass
class _Dicts:
    dicts: dict[KeyPath, dict]  # every dict reachable through dicts, by key path (() for the top level)
    candidates: dict[KeyPath, int]  # those that hold tensors (optimizer state left out) → tensor count
    weighty: dict[KeyPath, bool]  # candidate → whether it holds a tensor of one dimension or more
    optimizer_tensors: bool  # whether optimizer state (left out) holds tensors


def _find_dicts(root: object, where: str) -> _Dicts:
    """The dicts of ``root``, walked depth first in the file's order, each once (a dict reached
    again, or a cycle, is not walked again)."""
    found = _Dicts({}, {}, {}, False)
    if not isinstance(root, dict):
        return found
    depth_budget = limit("pickle-depth")
    seen: set[int] = set()
    todo = [((), root, 0, False)]
    while todo:
        at, d, depth, optimizer = todo.pop()
        found.dicts.setdefault(at, d)
        if id(d) in seen:
            continue
        seen.add(id(d))
        if depth > depth_budget:
            check_limit("pickle-depth", depth, f"{where}: dicts nested under {quote(key_text(at)[:200])}")
        optimizer = optimizer or is_optimizer_dict(d)
        views = [v for v in d.values() if isinstance(v, _View)]
        if views and optimizer:
            found.optimizer_tensors = True
        elif views:
            found.candidates[at] = len(views)
            found.weighty[at] = any(type(v.size) in (tuple, list) and len(v.size) > 0 for v in views)
        children = []
        for k, v in d.items():
            if isinstance(v, dict) and type(k) in (str, int):
                children.append(((*at, k), v, depth + 1, optimizer or "optim" in str(k).lower()))
        todo.extend(reversed(children))
    return found


def _state_dict(path: str, archive: _Archive, d: dict) -> tuple[dict[str, LazyTensor], dict[str, str], list[str]]:
    where = printable(path)
    tensors: dict[str, LazyTensor] = {}
    aliases: dict[str, str] = {}
    ignored: list[str] = []
    kept: dict[tuple, str] = {}
    specs: dict[tuple, TensorSpec] = {}
    name_bytes = limit("name-bytes")
    dims = limit("dims")
    count = sum(isinstance(v, _View) for v in d.values())
    check_limit("tensors", count, where)
    for k, value in d.items():
        if type(k) is str:
            name = k
        elif type(k) is int:
            name = str(k)
        else:
            ignored.append(_short(k))
            continue
        if not isinstance(value, _View):
            ignored.append(name)
            continue
        if len(name) > name_bytes // 4:
            check_limit("name-bytes", len(name.encode("utf-8", "surrogatepass")), f"{where}: tensor {quote(name[:80])}...")
        try:
            name.encode()
        except UnicodeEncodeError:
            raise CheckpointError(f"{where}: tensor name {quote(name[:80])} holds a lone UTF-16 surrogate, which "
                                  "is not text; the file is corrupt") from None
        if name in tensors or name in aliases:
            raise CheckpointError(f"{where}: two entries are named {quote(name)} (a number and a string?)")
        tensor, identity = _tensor(path, name, value, archive, specs, dims)
        first = kept.setdefault(identity, name)
        if first != name:
            aliases[name] = first
        else:
            tensors[name] = tensor
    return tensors, aliases, ignored


def _tensor(path: str, name: str, view: _View, archive: _Archive, specs: dict, dims: int) -> tuple[LazyTensor, tuple]:
    """The lazy tensor of one named view, checked against its storage (a large state dict has
    10^5 of these: the common case is kept short)."""

    def bad(message: str) -> CheckpointError:
        return CheckpointError(f"{printable(path)}: tensor {quote(name)}: {message}")

    storage = view.storage
    if storage.__class__ is not _Storage:
        raise bad("its storage is not a storage reference; the file is corrupt")
    dtype = storage.dtype if view.dtype is None else view.dtype.dtype
    if dtype is None:
        raise bad(f"dtype {view.dtype.name} is not one fusectl reads (it reads {', '.join(dtypes.ARRAY_DTYPES)})")
    offset, size, stride = view.offset, view.size, view.stride
    if type(size) not in (tuple, list) or type(stride) not in (tuple, list) or len(size) != len(stride):
        raise bad("its shape and strides are not two tuples of one length; the file is corrupt")
    if len(size) > dims:
        check_limit("dims", len(size), f"{printable(path)}: tensor {quote(name)}")
    if not _whole((offset,)):
        raise bad(f"storage offset {_short(offset)} is not a whole number; the file is corrupt")
    for values, what in ((size, "shape"), (stride, "strides")):
        if not _whole(values):
            raise bad(f"{what} {_short(values)} is not a tuple of whole numbers; the file is corrupt")
    size, stride = tuple(size), tuple(stride)
    conj = neg = False
    if view.metadata is not None:
        metadata = view.metadata
        if type(metadata) is not dict or not set(metadata) <= {"conj", "neg"} or \
                not all(type(v) is bool for v in metadata.values()):
            raise bad("tensor metadata other than PyTorch's conj/neg bits; the file is corrupt or newer than fusectl")
        conj, neg = metadata.get("conj", False), metadata.get("neg", False)
        if conj and dtype.numpy.kind != "c" or neg and dtype.numpy.kind in "bu":
            raise bad(f"a {'conjugate' if conj else 'negative'} view of a {dtype} tensor, which PyTorch cannot "
                      "make; the file is corrupt")
    spec = specs.get((dtype, size))
    if spec is None:
        spec = specs[(dtype, size)] = TensorSpec(dtype, size)
    identity = (id(storage), offset, size, stride, dtype.safetensors, conj, neg)
    if not spec.numel:  # no elements, no bytes (PyTorch checks no bounds either)
        return FileTensor(spec, ByteRange(path, 0, 0)), identity
    span, step, contiguous = 1, 1, True
    for n, s in zip(reversed(size), reversed(stride)):
        span += (n - 1) * s
        if n != 1 and s != step:
            contiguous = False
        step *= n
    itemsize = dtype.itemsize
    if (offset + span) * itemsize > storage.nbytes:
        raise bad(f"{spec} at offset {offset} with strides {list(stride)} reaches byte {(offset + span) * itemsize} "
                  f"of its storage {quote(storage.key)}, which holds {storage.nbytes}; the file is corrupt")
    if spec.numel > span:  # an expanded view (a stride of 0) repeats elements: reading it makes more bytes
        check_limit("expanded-bytes", spec.nbytes, f"{printable(path)}: tensor {quote(name)}")
    source = storage.source
    if source is None:
        raise bad(storage.problem or "its storage has no data in the file")
    if archive.byteswap and storage.dtype.itemsize != itemsize:
        # torch.load swaps a big-endian storage by its own element size: an untyped storage
        # (uint16/32/64 tensors) not at all. Reading what the writer meant would differ from
        # torch.load, reading what torch.load returns would be wrong for a big-endian writer.
        width = storage.dtype.itemsize
        how = "leaves its bytes as they are" if width == 1 else f"reverses its bytes in groups of {width}"
        raise bad(f"a {dtype} tensor on a storage of {width}-byte elements in a big-endian file; torch.load {how} "
                  f"(by the storage's element size, not the tensor's {itemsize} bytes), so the values it returns "
                  "are not the ones a big-endian machine saved, and fusectl refuses rather than guess. Load the "
                  "file with torch on the machine that wrote it and save the state dict with safetensors "
                  "(always little-endian)")
    if contiguous and source.__class__ is _FileSource and not (archive.byteswap and itemsize > 1) \
            and not conj and not neg:
        return FileTensor(spec, ByteRange(source.path, source.offset + offset * itemsize, spec.nbytes)), identity
    return TorchViewTensor(spec, source, offset, stride, archive.byteswap, conj, neg), identity


def _whole(values) -> bool:
    for n in values:
        if type(n) is not int or n < 0 or n > _DIM_MAX:
            return False
    return True
