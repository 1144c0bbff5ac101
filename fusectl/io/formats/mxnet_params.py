"""MXNet NDArray files (``.params``, ``.nd``, or any name that starts with the list magic): a lazy
reader and a streaming writer, without MXNet, bitwise with ``mx.nd.load``.

The format, as MXNet 1.9.1 saves and loads it (``src/ndarray/ndarray.cc``: the list
``NDArray::Save/Load`` and the array's; ``include/mxnet/tuple.h``; ``mshadow/base.h``), every
number little-endian, nothing padded or aligned:

- the list: u64 magic ``0x112``, a reserved u64 (ignored), u64 count, the count's records, then
  the names: u64 count (0: a list without names, else one per array) and each name as a u64
  byte length and its UTF-8 bytes;
- a record of ``mx.nd.save`` (V2, u32 ``0xF993FAC9``; V3 ``0xF993FACA`` is the numpy-shape form
  ``mx.npx.save`` writes): i32 storage type (0 dense, 1 row_sparse, 2 csr), for sparse storage
  its storage shape, the shape (i32 ndim, i64 dims), the context (i32 device type, i32 id),
  i32 type flag, for sparse storage each index array's type flag and shape, then the raw C-order
  data (and the index arrays' data). A V2 shape of ndim 0, or a V3 shape with an unknown
  (-1) ndim or dimension, is a "none" array: the record ends after its shape;
- older records MXNet still reads: V1 (u32 ``0xF993FAC8``, then shape, context, type flag, data)
  and pre-V1 (the first u32 is the ndim, then u32 dims, context, type flag, data).

Type flags: 0 F32, 1 F64, 2 F16, 3 U8, 4 I32, 5 I8, 6 I64, 7 BOOL, 12 BF16; MXNet 1.9.1 refuses
the others (8-11 included), and so does fusectl. Every tensor is a byte range of the file; only
the record headers and names are read. fusectl refuses, naming the array, what it cannot hold
as a dense tensor: sparse arrays (save them dense: ``array.tostype('default')``) and none arrays
(``mx.nd.load`` refuses them too). It also refuses what ``mx.nd.load`` would read differently
from what the file says: two arrays under one name (a dict keeps the last), bytes after the
names that are not fusectl's metadata.

Names are the file's, as written: ``save_parameters``' structural names (``0.weight``,
``_unfused.0.l_cell.i2h_weight``), ``export``'s ``arg:``/``aux:`` prefixed unique names
(``arg:dense0_weight``; a rule names them with the prefix). A list without names has its
arrays named ``0``, ``1``, … in file order.

fusectl's metadata (provenance, ties) is kept after the names, where ``mx.nd.load`` and
``Block.load_parameters`` never look: 16 bytes ``FUSECTL_METADATA``, a u64 length, a JSON object
of strings.

>>> import struct
>>> struct.pack("<Q", LIST_MAGIC)[:2]
b'\\x12\\x01'
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import BinaryIO, Callable, Mapping, Sequence

import numpy as np

from ... import dtypes
from ...errors import CheckpointError, InternalError, OutputError, printable, quote
from ...limits import check_limit, limit
from ...tensors import ByteRange, FileTensor, TensorSpec
from ..contents import Contents
from ..provenance import METADATA_KEY
from ..streaming import COPY_BUFFER, copy_ranges, start_writeback, write_all
from ..sniff import MXNET_LIST_MAGIC as LIST_MAGIC
from ..untrusted import load_json, open_input

V1_MAGIC, V2_MAGIC, V3_MAGIC = 0xF993FAC8, 0xF993FAC9, 0xF993FACA
METADATA_MAGIC = b"FUSECTL_METADATA"
CPU = (1, 0)  # Context: kCPU, device 0
# mshadow's type flags that MXNet 1.9.1 loads (MSHADOW_TYPE_SWITCH_WITH_BOOL)
TYPE_FLAGS: dict[int, str] = {0: "F32", 1: "F64", 2: "F16", 3: "U8", 4: "I32", 5: "I8", 6: "I64", 7: "BOOL",
                              12: "BF16"}
_FLAG_OF = {name: flag for flag, name in TYPE_FLAGS.items()}
_OTHER_FLAGS = {8: "int16", 9: "uint16", 10: "uint32", 11: "uint64"}  # mshadow names them; MXNet refuses
STORAGE = {0: "dense", 1: "row_sparse", 2: "csr"}
_AUX_ARRAYS = {0: 0, 1: 1, 2: 2}  # index arrays: row_sparse its row ids, csr its indptr and column ids
_MIN_RECORD = 12  # the shortest record: a V2 none array (magic, storage type, ndim 0)


def symbol_beside(path: str) -> str | None:
    """The ``-symbol.json`` that ``export``/``save_checkpoint`` writes beside ``PREFIX-EPOCH.params``
    (``PREFIX-symbol.json``), when ``path`` is named so; None otherwise.

    >>> symbol_beside("model/resnet-0012.params")
    'model/resnet-symbol.json'
    >>> symbol_beside("model.params") is None
    True
    """
    found = re.fullmatch(r"(.*)-\d{4}\.params", path, re.DOTALL)
    return f"{found.group(1)}-symbol.json" if found else None


@dataclass(frozen=True)
class Record:
    """One array of an NDArray file as its record says: ``spec`` and its data's byte range
    (dense), or why it is no dense tensor (``refused``)."""

    spec: TensorSpec | None
    offset: int
    refused: str | None = None


class _Stream:
    """Reads the file in order, each read checked against the file's size."""

    def __init__(self, path: str, f: BinaryIO, size: int):
        self.path, self.f, self.size, self.at = path, f, size, 0
        self.dims = limit("dims")
        self.specs: dict[tuple, TensorSpec] = {}  # (type flag, shape) → spec of the records read so far

    def rewind(self, to: int) -> None:
        self.at = to
        self.f.seek(to)

    def take(self, n: int, what: str) -> bytes:
        if n > self.size - self.at:
            raise CheckpointError(f"{self.path}: the file ends at byte {self.size}, inside {what} (byte {self.at}, "
                                  f"{n} bytes needed); it is truncated or not an MXNet NDArray file — save it again")
        data = self.f.read(n)
        if len(data) != n:
            raise CheckpointError(f"{self.path}: the file shrank while it was read; was it being written?")
        self.at += n
        return data

    def skip(self, n: int, what: str) -> int:
        """Skip ``n`` bytes (an array's data); the offset where they start."""
        start = self.at
        if n > self.size - self.at:
            raise CheckpointError(f"{self.path}: {what} needs {n} bytes at byte {start}, past the end of the "
                                  f"file ({self.size} bytes); it is truncated or corrupt — save it again")
        self.at += n
        self.f.seek(self.at)
        return start

    def unpack(self, fmt: str, what: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt), what))


def read_mxnet(path: str, key: str | None = None, check_link: Callable[[str], None] | None = None) -> Contents:
    """The :class:`Contents` of an MXNet NDArray file: every dense array as a lazy byte range,
    under its name in the file (``0``, ``1``, … for a list without names), fusectl's metadata
    when the file holds it, and the ties that a ``-symbol.json`` beside it shows (two
    operators reading one variable; :mod:`fusectl.io.formats.mxnet_symbol`) and the sizes of its one RNN
    operator as config values (:meth:`~fusectl.io.formats.mxnet_symbol.Symbol.rnn_config`). CheckpointError naming the
    file (and the array) for anything ``mx.nd.load`` refuses or would read otherwise."""
    with open_input(path) as f:
        size = os.fstat(f.fileno()).st_size
        stream = _Stream(path, f, size)
        magic, _reserved, count = stream.unpack("QQQ", "the file header")
        if magic != LIST_MAGIC:
            raise CheckpointError(f"{path}: not an MXNet NDArray file (it starts with {struct.pack('<Q', magic)!r}, "
                                  f"not the list magic 0x112)")
        if count > (size - stream.at) // _MIN_RECORD:
            raise CheckpointError(f"{path}: the header says {count} arrays, more than the file's {size} bytes can "
                                  "hold; it is truncated or corrupt — save it again")
        check_limit("tensors", count, path)
        records = [_record(stream, k, count) for k in range(count)]
        names = _names(stream, count)
        metadata = _metadata(stream)
    tensors = {}
    for name, rec in zip(names, records):
        if rec.refused:
            raise CheckpointError(f"{path}: array {quote(name)} {rec.refused}")
        if name in tensors:
            raise CheckpointError(f"{path}: two arrays are named {quote(name)}; mx.nd.load would keep only the last "
                                  "— the file was not written by mx.nd.save from a dict; save it again")
        tensors[name] = FileTensor(rec.spec, ByteRange(path, rec.offset, rec.spec.nbytes))
    files = [path]
    aliases: dict[str, str] = {}
    config = None
    symbol_path = symbol_beside(path)
    if symbol_path is not None and os.path.lexists(symbol_path):
        from .mxnet_symbol import read_symbol  # only an export's params have one

        if check_link is not None:
            check_link(symbol_path)
        symbol = read_symbol(symbol_path)
        aliases = symbol.aliases(tensors)
        config = symbol.rnn_config({name: t.spec.shape for name, t in tensors.items()})
        files.append(symbol_path)
    return Contents(tensors, files, metadata, metadata.get(METADATA_KEY), aliases, config=config)


def _record(stream: _Stream, k: int, count: int) -> Record:
    start = stream.at
    if stream.size - start >= 12:  # the usual record (V2, dense) in two reads; anything else below
        magic, storage, ndim = struct.unpack("<Iii", stream.take(12, "a record"))
        if magic == V2_MAGIC and storage == 0 and 0 < ndim <= stream.dims and stream.size - stream.at >= 8 * ndim + 12:
            *dims, _, _, flag = struct.unpack(f"<{ndim}qiii", stream.take(8 * ndim + 12, "a record"))
            spec = stream.specs.get((flag, *dims))
            if spec is not None:
                return Record(spec, stream.skip(spec.nbytes, f"array {k} (of {count})'s data ({spec})"))
        stream.rewind(start)
    record = _any_record(stream, k, count)
    if record.spec is not None:
        stream.specs[(_FLAG_OF[record.spec.dtype.safetensors], *record.spec.shape)] = record.spec
    return record


def _any_record(stream: _Stream, k: int, count: int) -> Record:
    what = f"array {k} (of {count})"
    (magic,) = stream.unpack("I", f"{what}'s magic")
    if magic in (V2_MAGIC, V3_MAGIC):
        numpy_shape = magic == V3_MAGIC
        (storage,) = stream.unpack("i", f"{what}'s storage type")
        if storage not in STORAGE:
            raise CheckpointError(f"{stream.path}: {what} has storage type {storage}, which MXNet does not know "
                                  "(0 dense, 1 row_sparse, 2 csr); the file is corrupt")
        if numpy_shape and storage != 0:
            raise CheckpointError(f"{stream.path}: {what} is a numpy-shape record of {STORAGE[storage]} storage, "
                                  "which MXNet refuses to load; the file is corrupt")
        aux = _AUX_ARRAYS[storage]
        storage_shape = _shape(stream, f"{what}'s storage shape", numpy_shape) if aux else None
        shape = _shape(stream, f"{what}'s shape", numpy_shape)
        if shape is None or (not numpy_shape and shape == ()):
            return Record(None, stream.at, "is a none array (an NDArray with no shape and no data), which mx.nd.load "
                                           "refuses too; drop it from what is saved")
    elif magic == V1_MAGIC:
        aux = 0
        storage = 0
        shape = _shape(stream, f"{what}'s shape", numpy_shape=True)
        if shape is None:
            return Record(None, stream.at, "is a none array (an NDArray with no shape and no data), which mx.nd.load "
                                           "refuses too; drop it from what is saved")
    else:  # a record older than V1: the magic is the ndim, the dims are u32
        aux = 0
        storage = 0
        ndim = magic
        if ndim > stream.dims:
            raise CheckpointError(f"{stream.path}: {what} starts with {magic:#x}, which is no record magic of MXNet "
                                  f"(0xf993fac8, 0xf993fac9, 0xf993faca) nor a dimension count of an old record "
                                  f"(at most {stream.dims}); the file is corrupt or not an MXNet NDArray file")
        shape = stream.unpack(f"{ndim}I", f"{what}'s shape")
    stream.unpack("ii", f"{what}'s context")  # the device it was saved from: fusectl reads every one to the CPU
    dtype = _dtype(stream, what)
    if aux:
        aux_specs = []
        for j in range(aux):
            aux_dtype = _dtype(stream, f"{what}'s index array {j}")
            aux_shape = _shape(stream, f"{what}'s index array {j}'s shape", numpy_shape=False)
            aux_specs.append(TensorSpec(aux_dtype, aux_shape or ()))
        stream.skip(TensorSpec(dtype, storage_shape).nbytes, f"{what}'s values")
        for j, spec in enumerate(aux_specs):
            stream.skip(spec.nbytes, f"{what}'s index array {j}")
        return Record(None, stream.at, f"is stored {STORAGE[storage]} (sparse), which fusectl does not read; save it "
                                       "dense (array.tostype('default')) and name that file")
    spec = TensorSpec(dtype, tuple(shape))
    if math.prod(max(d, 1) for d in shape) * dtype.itemsize >= 2**63:  # numpy's limit, even with no element
        raise CheckpointError(f"{stream.path}: {what} is {spec}, too large for any array; the file is corrupt")
    return Record(spec, stream.skip(spec.nbytes, f"{what}'s data ({spec})"))


def _shape(stream: _Stream, what: str, numpy_shape: bool) -> tuple[int, ...] | None:
    """A shape (i32 ndim, i64 dims); None for one with an unknown (-1) dimension, which numpy-shape
    semantics (V3) and V1 records read as a none array."""
    (ndim,) = stream.unpack("i", f"{what}'s ndim")
    if ndim < 0:  # MXNet reads -1 as a count of 2**64 - 8 bytes: its loader fails or crashes
        raise CheckpointError(f"{stream.path}: {what} has {ndim} dimensions, which MXNet cannot load; the file "
                              "is corrupt")
    if ndim > stream.dims:
        check_limit("dims", ndim, f"{stream.path}: {what}")
    dims = stream.unpack(f"{ndim}q", f"{what}'s dims")
    if any(d < -1 or (d == -1 and not numpy_shape) for d in dims):
        raise CheckpointError(f"{stream.path}: {what} is {list(dims)}, with a negative dimension MXNet refuses; "
                              "the file is corrupt")
    return None if -1 in dims else dims


def _dtype(stream: _Stream, what: str) -> dtypes.DType:
    (flag,) = stream.unpack("i", f"{what}'s type flag")
    if flag not in TYPE_FLAGS:
        known = ", ".join(f"{f} {n}" for f, n in TYPE_FLAGS.items())
        named = f" ({_OTHER_FLAGS[flag]}, which mshadow names but MXNet 1.9.1 does not load)" if flag in _OTHER_FLAGS \
            else ""
        raise CheckpointError(f"{stream.path}: {what} has type flag {flag}{named}; MXNet loads {known} — the file "
                              "is corrupt or from another MXNet")
    return dtypes.BY_NAME[TYPE_FLAGS[flag]]


def _names(stream: _Stream, count: int) -> list[str]:
    (n,) = stream.unpack("Q", "the names' count")
    if n == 0:
        return [str(k) for k in range(count)]
    if n != count:
        raise CheckpointError(f"{stream.path}: the file holds {count} arrays but {n} names; mx.nd.load refuses it "
                              "— the file is corrupt")
    budget = limit("name-bytes")
    names = []
    for k in range(n):
        (length,) = stream.unpack("Q", f"the length of name {k}")
        if length > budget:
            check_limit("name-bytes", length, f"{stream.path}: name {k}")
        raw = stream.take(length, f"name {k}")
        try:
            names.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise CheckpointError(f"{stream.path}: name {k} ({printable(raw.decode('utf-8', 'replace')[:80])}) is "
                                  "not UTF-8, which mx.nd.load refuses too; the file is corrupt") from None
    return names


def _metadata(stream: _Stream) -> dict[str, str]:
    """fusectl's metadata after the names, or {} when the file ends there."""
    left = stream.size - stream.at
    if left == 0:
        return {}
    head = stream.f.read(min(left, len(METADATA_MAGIC) + 8))
    if len(head) < len(METADATA_MAGIC) + 8 or not head.startswith(METADATA_MAGIC):
        raise CheckpointError(f"{stream.path}: {left} bytes follow the names; mx.nd.load ignores them, fusectl "
                              "refuses them: bytes were appended to the file or it is corrupt — save it again")
    stream.at += len(head)
    (length,) = struct.unpack("<Q", head[len(METADATA_MAGIC):])
    if length != stream.size - stream.at:
        raise CheckpointError(f"{stream.path}: fusectl's metadata says {length} bytes but {stream.size - stream.at} "
                              "follow; the file is truncated or corrupt")
    check_limit("json-bytes", length, f"{stream.path}: fusectl's metadata")
    value = load_json(stream.take(length, "fusectl's metadata"), stream.path, "fusectl's metadata")
    if type(value) is not dict or not all(type(k) is str and type(v) is str for k, v in value.items()):
        raise CheckpointError(f"{stream.path}: fusectl's metadata must map strings to strings; the file is corrupt")
    return value


# ------------------------------------------------------------------------------ writing


def record_header(spec: TensorSpec, numpy_shape: bool = False) -> bytes:
    """The bytes ``mx.nd.save`` writes before a dense CPU array's data (V2; V3 with
    ``numpy_shape``, as ``mx.npx.save`` writes).

    >>> record_header(TensorSpec(dtypes.BY_NAME["F32"], (2,))).hex()
    'c9fa93f900000000010000000200000000000000010000000000000000000000'
    """
    ndim = len(spec.shape)
    return (struct.pack("<Iii", V3_MAGIC if numpy_shape else V2_MAGIC, 0, ndim)
            + struct.pack(f"<{ndim}q", *spec.shape) + struct.pack("<iii", *CPU, _FLAG_OF[spec.dtype.safetensors]))


def _name_bytes(names: Sequence[str]) -> bytes:
    if list(names) == [str(k) for k in range(len(names))]:  # a list, as read from a list without names
        names = []
    encoded = [n.encode("utf-8") for n in names]
    return struct.pack("<Q", len(encoded)) + b"".join(struct.pack("<Q", len(e)) + e for e in encoded)


class MXNetWriter:
    """Writes an NDArray file as ``mx.nd.save`` does (dense V2 records of CPU arrays, then the
    names; none when they are ``0``, ``1``, … in order: a list, as ``mx.nd.save`` writes one),
    tensor by tensor in the declared order, file ranges copied undecoded; ``metadata``
    (fusectl's provenance, ties in the save_model convention) goes after the names, where MXNet
    never reads. A file holding a 0-d tensor is written in the numpy-shape form (V3: what
    ``mx.npx.save`` writes and ``mx.npx.load`` reads), the only one in which MXNet has 0-d arrays.
    A dtype MXNet cannot hold is refused before anything is written."""

    def __init__(self, path: str, entries: Sequence[tuple[str, TensorSpec]], metadata: Mapping[str, str]):
        for name, spec in entries:
            if spec.dtype.safetensors not in _FLAG_OF:
                held = ", ".join(_FLAG_OF)
                raise OutputError(f"{path}: tensor {quote(name)} is {spec.dtype}, which MXNet's NDArray files cannot "
                                  f"hold (they hold {held}); convert it, or write .safetensors")
            for text in (name,):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    raise OutputError(f"{path}: tensor {quote(name)} has a name that is not text (a lone surrogate); "
                                      "rename it") from None
        self.path = path
        self._names = [n for n, _ in entries]
        self._pending = list(reversed(entries))
        self._numpy_shape = any(spec.shape == () for _, spec in entries)
        self._metadata = dict(metadata)
        self._file: BinaryIO = open(path, "wb", buffering=0)
        self._buffer: memoryview | None = None
        write_all(self._file.fileno(), struct.pack("<QQQ", LIST_MAGIC, 0, len(entries)))

    def write(self, name: str, data: np.ndarray | tuple[ByteRange, ...]) -> None:
        """Write the next tensor's record: its header, then its bytes (an array, or file ranges)."""
        expected, spec = self._pending.pop()
        if name != expected:
            raise InternalError(f"{self.path}: the writer expected {expected!r} next, got {name!r}")
        fd = self._file.fileno()
        write_all(fd, record_header(spec, self._numpy_shape))
        if isinstance(data, np.ndarray):
            if data.dtype != spec.dtype.numpy or data.shape != spec.shape:
                raise InternalError(f"{self.path}: {name!r} arrived as {data.dtype}{list(data.shape)}, "
                                    f"the header says {spec}")
            write_all(fd, np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)
            return
        if sum(r.length for r in data) != spec.nbytes:
            raise CheckpointError(f"{self.path}: {name!r} would get {sum(r.length for r in data)} "
                                  f"bytes for {spec}; the plan and the data disagree")
        if self._buffer is None:
            self._buffer = memoryview(bytearray(min(COPY_BUFFER, max(spec.nbytes, 1 << 16))))
        copy_ranges(data, fd, self._buffer)

    def close(self) -> None:
        """Write the names (and fusectl's metadata), and close the file."""
        if self._pending:
            raise InternalError(f"{self.path}: {len(self._pending)} tensor(s) were never written")
        fd = self._file.fileno()
        write_all(fd, _name_bytes(self._names))
        if self._metadata:
            raw = json.dumps(self._metadata, separators=(",", ":"), sort_keys=True).encode()
            write_all(fd, METADATA_MAGIC + struct.pack("<Q", len(raw)) + raw)
        start_writeback(fd)
        self._file.close()

    def abort(self) -> None:
        """Close the file unfinished (the atomic output removes it)."""
        self._file.close()
