"""``torch.save`` files written without torch: what ``torch.load(path, weights_only=True)`` reads.

A tree of plain data and tensors (:func:`write_torch_file`), or a state dict written by
``fuse``/``convert`` through the format registry (:class:`TorchWriter`), becomes the zip archive
torch.save (2.x) writes, record for record:

- ``<name>/data.pkl``: the tree, pickled with protocol 2 exactly as Python's pickler does for
  torch.save (same opcodes, same memo); each tensor is ``torch._utils._rebuild_tensor_v2`` on a
  typed storage (``torch.FloatStorage``, …), or, for a dtype without one (fp8, uint16/32/64),
  ``_rebuild_tensor_v3`` on an ``UntypedStorage`` with the dtype named — as torch.save does;
- ``.format_version`` ("1"), ``.storage_alignment`` ("64"), ``byteorder`` ("little": every
  storage is written little-endian), ``data/<key>`` (one storage per tensor object: keys
  "0", "1", … in the order the pickle first meets them, records in that order — a state dict
  written through :class:`TorchWriter` lays them in the order its tensors' bytes come instead,
  the central directory naming each), ``version``
  ("3"), ``.data/serialization_id``;
- fusectl's own record, ``<name>/fusectl_metadata.json`` (a JSON object of strings: the
  metadata a safetensors output keeps in its header, fusectl's provenance included), only
  when there is metadata to keep; torch.load ignores records it does not know, and fusectl's
  reader (:mod:`fusectl.io.formats.torch_file`) reads it back, so ``unfuse`` of a ``.pt`` output works.

Every record is stored (ZIP_STORED) with its data aligned to 64 bytes (a ``FB`` extra field of
``Z`` padding, as PyTorch's miniz writer pads it) and followed by a data descriptor, so each
storage streams from its source's byte ranges (or its computed array) through one reused
buffer, its CRC taken on the way; nothing holds the whole checkpoint in memory. Archives past
4 GiB carry zip64 fields as miniz writes them. A file written here equals what torch.save
writes for the same object byte for byte (its records in the pickle's order), except the
serialization id, which fusectl derives from the pickle (torch's is random), so that the same
input gives the same file. Sets, frozensets, complex numbers and bytes, which the reader's
allow-list reads back, are pickled as Python's pickler reduces them.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import struct
import zlib
from typing import Callable, Mapping, Sequence

import numpy as np

from ...background import Background
from ...errors import CheckpointError, InternalError, OutputError, quote
from ...tensors import ByteRange, LazyTensor, TensorSpec
from ...ties import aliases_from_metadata
from ..streaming import COPY_BUFFER, Writeback, copy_ranges, read_chunks, write_all
from .torch_file import DTYPE_NAMES, METADATA_RECORD, STORAGE_CLASSES, Record, global_name

ALIGNMENT = 64
_ARCHIVE_VERSION = b"3\n"

# safetensors dtype name -> the storage class torch.save names (dtypes torch had before 2.1), or
# the torch dtype it names after an UntypedStorage; from the reader's tables, inverted
_TYPED = {dtype: cls for cls, dtype in STORAGE_CLASSES.items()}
_UNTYPED = {dtype: name for name, dtype in DTYPE_NAMES.items() if dtype not in _TYPED}

Progress = Callable[[int], None]


def write_torch_file(path: str, root: object, *, on_progress: Progress | None = None,
                     metadata: Mapping[str, str] | None = None) -> None:
    """Write ``root`` to ``path`` as ``torch.save(root, path)`` would, and flush it to disk.

    ``root`` is a tree of dicts (str or int keys, in their order; a ``collections.OrderedDict``
    is written as one, as ``model.state_dict()`` is, any other dict as a dict), lists, tuples,
    ints, floats, bools, None, strs, tensors (:class:`~fusectl.tensors.LazyTensor`) and the
    records the reader gives for a format's own classes (``torch_file.Record``). A tensor
    object met twice is one tensor (``torch.load`` gives one object, one storage). Each
    storage's bytes come from its tensor's ``byte_ranges()`` when it has them, else from
    ``read()``; ``on_progress(n)`` is called with each storage's byte count once it is written.
    ``metadata`` (strings) is kept in fusectl's record. Anything torch cannot hold (a packed
    sub-byte dtype, an object of another type, a key neither str nor int) is an OutputError
    naming where it is in the tree, before the file is created. Write it under a temporary name
    (``atomic.atomic_output``) for an atomic replacement.
    """
    pickler = _Pickler(path)
    pickled = pickler.dump(root)
    archive = _Archive(path, _archive_name(path))
    try:
        _fill(archive, pickled, pickler.storages, metadata or {}, on_progress)
        os.fsync(archive.fd)
    except BaseException:
        archive.abort()
        os.unlink(path)  # no half-written file left behind
        raise
    archive.close()


def append_torch_archive(fd: int, writeback: Writeback, root: object, where: str) -> int:
    """Append ``root`` to the open file ``fd`` at its position as one complete ``torch.save``
    archive, as torch.save writes one to a stream (records under ``archive/``): an item of a
    torch.distributed.checkpoint ``.distcp`` file, which torch reads back with ``torch.load`` of
    the file's bytes from the item's offset. The same tree as :func:`write_torch_file` takes;
    ``writeback`` is the file's own (told of every byte). Returns the archive's length in bytes.

    :raises OutputError: naming ``where``: a value torch cannot hold, before anything is appended.
    """
    pickler = _Pickler(where)
    pickled = pickler.dump(root)
    archive = _Archive(where, "archive", sink=(fd, writeback))
    _fill(archive, pickled, pickler.storages, {}, None)
    return archive.length


def _fill(archive: "_Archive", pickled: bytes, storages: list, metadata: Mapping[str, str],
          on_progress: Progress | None) -> None:
    """Every record of an archive: the pickle, each storage from its tensor's file ranges (or its
    array), the closing records and the central directory."""
    archive.start(pickled)
    for tensor in storages:
        ranges = tensor.byte_ranges()
        archive.storage(tensor.spec, ranges if ranges is not None else tensor.read())
        if on_progress is not None:
            on_progress(tensor.spec.nbytes)
    archive.finish(metadata)


def pickle_tree(root: object, where: str) -> bytes:
    """``root`` as a bare protocol-2 pickle, as ``pickle.dump`` writes it, for a file that is not
    a torch.save archive (DCP's ``.metadata``): the same tree as :func:`write_torch_file` takes,
    records and dtype globals included, but no tensors. OutputError naming ``where`` for
    anything else."""
    pickler = _Pickler(where)
    pickled = pickler.dump(root)
    if pickler.storages:
        raise OutputError(f"{where}: holds a tensor, which a bare pickle cannot hold")
    return pickled


class TorchWriter:
    """The ``pytorch`` row's output (:data:`fusectl.io.registry.FORMATS`): a state dict — a
    ``collections.OrderedDict`` of name → tensor, as ``torch.save(model.state_dict())`` writes
    it — its keys in ``order`` (the output's key order, ``fusectl.key_order``; by default the
    entries'), the records of the tensors' bytes in the order the entries are written (the
    zip's central directory finds each by name). An alias in ``metadata`` (the save_model
    convention: ``{alias: kept}``) is a second tensor on its kept tensor's storage, as a state
    dict holds a tied parameter twice: where ``order`` lists it, else right after its kept
    tensor. The metadata goes to fusectl's record."""

    def __init__(self, path: str, entries: Sequence[tuple[str, TensorSpec]], metadata: Mapping[str, str],
                 order: Sequence[str] | None = None):
        self.path = path
        aliases = aliases_from_metadata(metadata, [n for n, _ in entries])
        slots = {name: _Slot(spec) for name, spec in entries}
        keys = [n for n in order or () if n in slots or n in aliases]
        listed = set(keys)
        keys += [n for n in slots if n not in listed]
        listed = set(keys)
        followers: dict[str, list[str]] = {}
        for alias, kept in aliases.items():
            if alias not in listed:
                followers.setdefault(kept, []).append(alias)
        state = collections.OrderedDict()
        for name in keys:
            if name in slots:
                state[name] = slots[name]
                state.update((alias, _Alias(slots[name])) for alias in followers.get(name, ()))
            else:
                state[name] = _Alias(slots[aliases[name]])
        pickler = _Pickler(path)
        pickled = pickler.dump(state)
        self._keys = pickler.keys  # each slot's storage key, in the pickle's order, as torch.save numbers them
        self._pending = collections.deque((n, slots[n]) for n, _ in entries)
        self._metadata = dict(metadata)
        self._archive = _Archive(path, _archive_name(path))
        self._archive.start(pickled)

    def write(self, name: str, data: np.ndarray | tuple[ByteRange, ...]) -> None:
        expected, slot = self._pending.popleft()
        if name != expected:
            raise InternalError(f"{self.path}: the writer expected {expected!r} next, got {name!r}")
        self._archive.storage(slot.spec, data, name, key=self._keys[id(slot)])

    def close(self) -> None:
        if self._pending:
            raise InternalError(f"{self.path}: {len(self._pending)} tensor(s) were never written")
        self._archive.finish(self._metadata)
        self._archive.close()

    def abort(self) -> None:
        self._archive.abort()


class _Slot:
    """A tensor of a state dict, known by its spec: :meth:`TorchWriter.write` is given its bytes."""

    __slots__ = ("spec",)

    def __init__(self, spec: TensorSpec):
        self.spec = spec


class _Alias:
    """Another tensor object on ``tensor``'s storage (a tied name of a state dict)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: _Slot):
        self.tensor = tensor


def _archive_name(path: str) -> str:
    """The archive's folder name, as torch.save names it: the file name up to its first dot
    (a temporary name's leading dot skipped), else ``archive``."""
    return os.path.basename(path).lstrip(".").split(".", 1)[0] or "archive"


# ------------------------------------------------------------------------------- the pickle

_MARK, _STOP, _TUPLE, _EMPTY_TUPLE, _REDUCE, _BINPERSID = b"(", b".", b"t", b")", b"R", b"Q"
_EMPTY_DICT, _EMPTY_LIST, _SETITEM, _SETITEMS, _APPEND, _APPENDS = b"}", b"]", b"s", b"u", b"a", b"e"
_NONE, _NEWTRUE, _NEWFALSE, _POP, _POP_MARK = b"N", b"\x88", b"\x89", b"0", b"1"
_NEWOBJ, _BUILD = b"\x81", b"b"
_TUPLE_N = {1: b"\x85", 2: b"\x86", 3: b"\x87"}
_BATCH = 1000  # pickle's batch of APPENDS / SETITEMS


class _Pickler:
    """Protocol 2 as CPython's pickler writes it for torch.save: objects of the tree memoized by
    identity, globals once each; ``storages`` lists each storage's tensor in key order."""

    def __init__(self, path: str):
        self.path = path
        self.out = bytearray(b"\x80\x02")
        self.memo: dict[int, int] = {}  # id of an object of the tree -> memo index
        self.named: dict[object, int] = {}  # a global, or a constant torch.save reuses -> memo index
        self.count = 0
        self.keys: dict[int, str] = {}  # id of a storage's tensor -> its key
        self.storages: list[LazyTensor | _Slot] = []

    def dump(self, root: object) -> bytes:
        try:
            self.save(root, "the object")
        except RecursionError:
            raise OutputError(f"{self.path}: the object is nested too deeply to be pickled") from None
        self.out += _STOP
        return bytes(self.out)

    # memo
    def put(self) -> int:
        index = self.count
        self.count += 1
        self.out += b"q" + bytes([index]) if index < 256 else b"r" + struct.pack("<I", index)
        return index

    def get(self, index: int) -> bytes:
        return b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)

    def memoize(self, obj: object) -> None:
        self.memo[id(obj)] = self.put()

    def once(self, key: object, emit: Callable[[], None]) -> None:
        """A global or a reused constant: written the first time, fetched from the memo after."""
        index = self.named.get(key)
        if index is not None:
            self.out += self.get(index)
            return
        emit()
        self.named[key] = self.put()

    def global_(self, module: str, name: str) -> None:
        self.once(("global", module, name), lambda: self.out.extend(b"c%s\n%s\n" % (module.encode(), name.encode())))

    def text(self, value: str) -> None:
        data = value.encode("utf-8", "surrogatepass")
        self.out += b"X" + struct.pack("<I", len(data)) + data

    def constant(self, value: str) -> None:
        self.once(("text", value), lambda: self.text(value))

    def integer(self, n: int) -> None:
        if 0 <= n <= 0xFF:
            self.out += b"K" + bytes([n])
        elif 0 <= n <= 0xFFFF:
            self.out += b"M" + struct.pack("<H", n)
        elif -(2**31) <= n < 2**31:
            self.out += b"J" + struct.pack("<i", n)
        else:
            data = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
            if data[-1:] == b"\xff" and len(data) > 1 and data[-2] & 0x80:  # as pickle's encode_long
                data = data[:-1]
            self.out += (b"\x8a" + bytes([len(data)]) if len(data) < 256 else b"\x8b" + struct.pack("<i", len(data)))
            self.out += data

    # the tree
    def save(self, obj: object, where: str) -> None:
        kind = type(obj)
        if obj is None:
            self.out += _NONE
        elif kind is bool:
            self.out += _NEWTRUE if obj else _NEWFALSE
        elif kind is int:
            self.integer(obj)
        elif kind is float:
            self.out += b"G" + struct.pack(">d", obj)
        elif id(obj) in self.memo:
            self.out += self.get(self.memo[id(obj)])
        elif kind is str:
            self.text(obj)
            self.memoize(obj)
        elif kind in (set, frozenset, complex, bytes):
            self.reduced(obj, where)
        elif kind is tuple:
            self.tuple_(obj, where)
        elif kind is list:
            self.out += _EMPTY_LIST
            self.memoize(obj)
            self.items(obj, where)
        elif isinstance(obj, dict):
            self.dict_(obj, where)
        elif isinstance(obj, (LazyTensor, _Slot, _Alias)):
            self.tensor(obj, where)
        elif isinstance(obj, Record):
            self.record(obj, where)
        elif global_name(obj) is not None:  # a dtype global read from a pickle (DCP's TensorProperties)
            self.global_(*global_name(obj).rsplit(".", 1))
        else:
            raise OutputError(f"{self.path}: {where} is a {kind.__name__}, which fusectl does not write to a PyTorch "
                              "file (it writes dicts, lists, tuples, sets, strings, bytes, numbers, booleans, None "
                              "and tensors)")

    def reduced(self, obj: set | frozenset | complex | bytes, where: str) -> None:
        """A set, frozenset, complex number or bytes, as protocol 2 reduces it (what the reader's
        allow-list reads back): ``set(list)``, ``complex(real, imag)``, ``_codecs.encode(text,
        'latin1')``."""
        if type(obj) is bytes:
            self.global_("_codecs", "encode")
            self.text(obj.decode("latin1"))
            self.put()
            self.constant("latin1")
        elif type(obj) is complex:
            self.global_("__builtin__", "complex")
            self.out += b"G" + struct.pack(">d", obj.real) + b"G" + struct.pack(">d", obj.imag)
        else:
            self.global_("__builtin__", type(obj).__name__)
            self.out += _EMPTY_LIST
            self.put()
            self.items(list(obj), where)
        self.out += _TUPLE_N[1 if type(obj) in (set, frozenset) else 2]
        self.put()
        self.out += _REDUCE
        self.memoize(obj)

    def record(self, obj: Record, where: str) -> None:
        """An object of a class a format's files hold beyond the allow-list, as the reader gave it
        (:class:`~fusectl.io.formats.torch_file.Record`: DeepSpeed's loss scaler, its ZeRO stage
        enum), pickled as protocol 2 pickles the object itself: its class called with its
        arguments (an enum's value), or made by NEWOBJ with none; then its state by BUILD."""
        module, _, name = obj.name.rpartition(".")
        self.global_(module, name)
        if obj.args:
            self.tuple_(obj.args, f"{where}'s arguments")
            self.out += _REDUCE
        else:
            self.out += _EMPTY_TUPLE + _NEWOBJ
        self.memoize(obj)
        if obj.state is not None:
            self.save(obj.state, f"{where}'s state")
            self.out += _BUILD

    def tuple_(self, obj: tuple, where: str) -> None:
        if not obj:
            self.out += _EMPTY_TUPLE
            return
        small = len(obj) <= 3
        if not small:
            self.out += _MARK
        for k, item in enumerate(obj):
            self.save(item, f"{where}[{k}]")
        if id(obj) in self.memo:  # the tuple was reached through itself (a list inside it holds it)
            self.out += (_POP * len(obj) if small else _POP_MARK) + self.get(self.memo[id(obj)])
            return
        self.out += _TUPLE_N[len(obj)] if small else _TUPLE
        self.memoize(obj)

    def items(self, values: list, where: str) -> None:
        """A list's items, batched as CPython's pickler batches an exact list."""
        if len(values) == 1:
            self.save(values[0], f"{where}[0]")
            self.out += _APPEND
            return
        for start in range(0, len(values), _BATCH):
            self.out += _MARK
            for k in range(start, min(start + _BATCH, len(values))):
                self.save(values[k], f"{where}[{k}]")
            self.out += _APPENDS

    def dict_(self, obj: dict, where: str) -> None:
        """A dict's items, batched as CPython's pickler batches an exact dict (one item: SETITEM;
        else batches of 1000, with an empty batch after a whole number of them) or, for an
        OrderedDict, the items of its ``__reduce__`` (a batch of one: SETITEM)."""
        ordered = isinstance(obj, collections.OrderedDict)
        if ordered:
            self.global_("collections", "OrderedDict")
            self.out += _EMPTY_TUPLE + _REDUCE
        else:
            self.out += _EMPTY_DICT
        self.memoize(obj)
        pairs = list(obj.items())
        if not pairs:
            return
        if len(pairs) == 1:
            batches = [pairs]
        elif ordered:
            batches = [pairs[k:k + _BATCH] for k in range(0, len(pairs), _BATCH)]
        else:
            batches = [pairs[k:k + _BATCH] for k in range(0, len(pairs) + 1, _BATCH)]
        for batch in batches:
            single = len(batch) == 1 and (ordered or len(pairs) == 1)
            if not single:
                self.out += _MARK
            for key, value in batch:
                if type(key) not in (str, int) and not isinstance(key, Record):  # DCP's storage_data: records
                    raise OutputError(f"{self.path}: {where} has a key {quote(repr(key)[:80])} of type "
                                      f"{type(key).__name__}; fusectl writes dicts keyed by strings or integers")
                self.save(key, where)
                self.save(value, f"{where}[{key!r}]")
            self.out += _SETITEM if single else _SETITEMS

    def tensor(self, node: LazyTensor | _Slot | _Alias, where: str) -> None:
        tensor = node.tensor if isinstance(node, _Alias) else node
        spec = tensor.spec
        name = spec.dtype.safetensors
        if name not in _TYPED and name not in _UNTYPED:
            raise OutputError(f"{self.path}: {where} is a {spec} tensor; PyTorch has no {name} dtype, so a PyTorch "
                              "file cannot hold it — write .safetensors instead")
        self.global_("torch._utils", "_rebuild_tensor_v2" if name in _TYPED else "_rebuild_tensor_v3")
        self.out += _MARK + _MARK
        self.constant("storage")
        if name in _TYPED:
            self.global_("torch", _TYPED[name])
            numel = spec.numel
        else:
            self.global_("torch.storage", "UntypedStorage")
            numel = spec.nbytes
        key = self.keys.get(id(tensor))
        if key is None:
            key = self.keys[id(tensor)] = str(len(self.storages))
            self.storages.append(tensor)
            self.text(key)
            self.named[("key", key)] = self.put()
        else:
            self.out += self.get(self.named[("key", key)])
        self.constant("cpu")
        self.integer(numel)
        self.out += _TUPLE
        self.put()
        self.out += _BINPERSID
        self.integer(0)  # storage offset
        for values in (spec.shape, _contiguous_strides(spec.shape)):
            self.shape(values)
        self.out += _NEWFALSE  # requires_grad
        self.global_("collections", "OrderedDict")  # backward hooks: an empty OrderedDict
        self.out += _EMPTY_TUPLE + _REDUCE
        self.put()
        if name not in _TYPED:
            self.global_("torch", _UNTYPED[name])
        self.out += _TUPLE
        self.put()
        self.out += _REDUCE
        self.memoize(node)

    def shape(self, values: tuple[int, ...]) -> None:
        if not values:
            self.out += _EMPTY_TUPLE
            return
        if len(values) > 3:
            self.out += _MARK
        for n in values:
            self.integer(n)
        self.out += _TUPLE_N.get(len(values), _TUPLE)
        self.put()


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """PyTorch's strides of a contiguous tensor (a dimension of 0 counts as 1)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


# ------------------------------------------------------------------------------- the zip archive

_U32 = 0xFFFFFFFF
_ZIP64_AT = _U32  # a size or offset this large goes in a zip64 field (as miniz decides)
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_DESCRIPTOR_ID = 0x08074B50
_UTF8, _DESCRIBED = 0x0800, 0x0008  # UTF-8 names; sizes in a data descriptor (not for an empty record, as miniz)


def _zip64_fields(size: int, offset: int) -> list[int]:
    """A record's zip64 fields: its sizes when they do not fit 32 bits, its offset when that does not."""
    return ([size] * 2 if size >= _ZIP64_AT else []) + ([offset] if offset >= _ZIP64_AT else [])


def _zip64_extra(fields: list[int]) -> bytes:
    return struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""


def _flags(size: int) -> int:
    return _UTF8 | _DESCRIBED if size else _UTF8


def crc_of_ranges(ranges: Sequence[ByteRange], buffer: memoryview) -> int:
    """The CRC-32 (zlib's, a zip record's) of the bytes of ``ranges`` in order, read through
    ``buffer``; CheckpointError when a file ends before its range does."""
    crc = 0
    for chunk in read_chunks(ranges, buffer):
        crc = zlib.crc32(chunk, crc)
    return crc


def _stamps(ranges: Sequence[ByteRange]) -> dict[str, tuple[int, int]]:
    """Each source file's (size, modification time in ns): unchanged while a record is copied
    and its CRC read, or the two reads may disagree."""
    found = {}
    for r in ranges:
        if r.path not in found:
            st = os.stat(r.path)
            found[r.path] = (st.st_size, st.st_mtime_ns)
    return found


class _Archive:
    """The records of a torch.save zip, written in order straight to the file (unbuffered)."""

    def __init__(self, path: str, name: str, sink: tuple[int, Writeback] | None = None):
        """A new file at ``path``, or (``sink``: an open file and its writeback) one more archive
        appended to a file of several (DCP's ``.distcp``), its offsets from its own start."""
        self.path, self.prefix = path, name
        self._file = None
        if sink is not None:
            self.fd, self._writeback = sink
        else:
            try:
                self._file = open(path, "wb", buffering=0)
            except OSError as e:
                raise OutputError(f"{path}: cannot be written ({e.strerror})") from e
            self.fd = self._file.fileno()
            self._writeback = Writeback(self.fd)  # to disk while the rest is written
        self._pos = 0
        self._entries: list[tuple[bytes, int, int, int]] = []  # name, header offset, size, crc
        self._buffer: memoryview | None = None
        self._keys = 0
        self._pickle = b""

    def start(self, pickled: bytes) -> None:
        self._pickle = pickled
        self.record("data.pkl", pickled)
        self.record(".format_version", b"1")
        self.record(".storage_alignment", str(ALIGNMENT).encode())
        self.record("byteorder", b"little")

    def storage(self, spec: TensorSpec, data: np.ndarray | tuple[ByteRange, ...], name: str | None = None,
                key: str | None = None) -> None:
        """The next storage record: ``data/<key>`` (by default the next number, when records come
        in the pickle's order)."""
        if key is None:
            key = str(self._keys)
            self._keys += 1
        if isinstance(data, np.ndarray):
            if data.dtype.byteorder == ">" and data.dtype.newbyteorder("=") == spec.dtype.numpy:
                data = data.astype(spec.dtype.numpy)  # the same numbers, little-endian: byteorder says so
            if data.dtype != spec.dtype.numpy or data.shape != spec.shape:
                raise InternalError(f"{self.path}: {name or key!r} arrived as {data.dtype}{list(data.shape)}, "
                                    f"the pickle says {spec}")
            self.record(f"data/{key}", np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)
            return
        if sum(r.length for r in data) != spec.nbytes:
            raise InternalError(f"{self.path}: {name or key!r} would get {sum(r.length for r in data)} bytes "
                                f"for {spec}; the plan and the data disagree")
        if self._buffer is None:
            self._buffer = memoryview(bytearray(COPY_BUFFER))
        size = spec.nbytes
        begin = self._begin(f"data/{key}", size)
        # the record's CRC-32 is read off the source on a second thread (zlib and preadv release
        # the GIL) while the kernel copies the bytes (copy_file_range): two reads of the page
        # cache instead of every byte through Python
        before = _stamps(data)
        crc = Background(lambda: crc_of_ranges(data, self._buffer), name="fusectl-crc")
        copy_ranges(data, self.fd, None, None, self._writeback)
        self._end(begin, size, crc.result)
        after = _stamps(data)
        if after != before:  # the two reads may have seen different bytes
            changed = next(p for p in before if after.get(p) != before[p])
            raise CheckpointError(f"{changed}: changed while fusectl was reading it; nothing is written, "
                                  "run again once nothing writes the input")

    def record(self, name: str, data) -> None:
        view = memoryview(data).cast("B")
        begin = self._begin(name, len(view))
        write_all(self.fd, view, self._writeback)
        self._end(begin, len(view), lambda: zlib.crc32(view))

    def _begin(self, name: str, size: int) -> tuple[bytes, int, bool]:
        encoded = f"{self.prefix}/{name}".encode()
        offset = self._pos
        zip64 = _zip64_fields(size, offset)
        extra = _zip64_extra(zip64)
        start = offset + _LOCAL.size + len(encoded) + len(extra) + 4
        padding = -start % ALIGNMENT
        extra += b"FB" + struct.pack("<H", padding) + b"Z" * padding
        header = _LOCAL.pack(0x04034B50, 0, _flags(size), 0, 0, 0, 0, 0, 0, len(encoded), len(extra))
        self._write(header + encoded + extra)
        self._pos += size
        return encoded, offset, bool(zip64)

    def _end(self, begin: tuple[bytes, int, bool], size: int, crc: Callable[[], int]) -> None:
        encoded, offset, zip64 = begin
        value = crc() & _U32
        if size:
            sizes = struct.pack("<QQ", size, size) if zip64 else struct.pack("<II", size, size)
            self._write(struct.pack("<II", _DESCRIPTOR_ID, value) + sizes)
        self._entries.append((encoded, offset, size, value))

    def _write(self, data: bytes) -> None:
        write_all(self.fd, data, self._writeback)
        self._pos += len(data)

    def finish(self, metadata: Mapping[str, str]) -> None:
        self.record("version", _ARCHIVE_VERSION)
        # torch.save writes 40 random digits; these come from the pickle, so a file is reproducible
        digest = int.from_bytes(hashlib.sha256(self._pickle).digest(), "big") % 10**40
        self.record(".data/serialization_id", f"{digest:040d}".encode())
        if metadata:
            self.record(METADATA_RECORD, json.dumps(dict(metadata), separators=(",", ":")).encode())
        self._central_directory()

    def _central_directory(self) -> None:
        start = self._pos
        parts = []
        for encoded, offset, size, crc in self._entries:
            extra = _zip64_extra(_zip64_fields(size, offset))
            shown_size, shown_offset = (_U32 if n >= _ZIP64_AT else n for n in (size, offset))
            parts.append(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 0, _flags(size), 0, 0, 0, crc, shown_size,
                                     shown_size, len(encoded), len(extra), 0, 0, 0, 0, shown_offset)
                         + encoded + extra)
        self._write(b"".join(parts))
        size, count, end = self._pos - start, len(self._entries), self._pos
        self._write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x2D, 0, 0, count, count, size, start))
        self._write(struct.pack("<IIQI", 0x07064B50, 0, end, 1))
        self._write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                                *(_U32 if n >= _ZIP64_AT else n for n in (size, start)), 0))

    @property
    def length(self) -> int:
        """The bytes written so far."""
        return self._pos

    def close(self) -> None:
        self._writeback.finish()
        self._file.close()

    def abort(self) -> None:
        self._writeback.stop()
        self._file.close()

