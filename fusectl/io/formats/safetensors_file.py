"""safetensors: header parsing (lazy, validated), the readers of a file and of a sharded index
(:class:`~fusectl.io.contents.Contents`), and a streaming writer.

The ``safetensors`` package loads whole tensors and cannot write a file tensor by tensor,
so fusectl reads the (tiny, documented) header itself to keep each tensor's byte offsets,
and writes the header first, then streams each tensor: bytes that pass through unchanged
are copied range by range without being decoded.
"""

from __future__ import annotations

import collections
import json
import os
import struct
from typing import BinaryIO, Callable, Mapping, Sequence

import numpy as np

from ... import dtypes
from ...errors import CheckpointError, InternalError, quote
from ...limits import check_limit, limit
from ..contents import Contents
from ..provenance import METADATA_KEY
from ..sniff import DCP_SHARD_FILE, DCP_SHARDING_INFO
from .sharded import read_index
from ..streaming import Writeback, copy_ranges, write_all
from ..untrusted import collector_paused, load_json, open_input
from ...tensors import ByteRange, FileTensor, TensorSpec

ALIGNMENT = 8
SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"  # model.safetensors.index.json, beside its shards
# the largest numbers safetensors (Rust usize) reads, and the largest dimension numpy can hold
_USIZE_MAX = 2**64 - 1
_DIM_MAX = 2**63 - 1


def read_safetensors(path: str, key: str | None = None,
                     check_link: Callable[[str], None] | None = None) -> Contents:
    """The :class:`Contents` of one safetensors file: its tensors (lazy byte ranges) and
    ``__metadata__``, which holds fusectl's provenance entry (:func:`read_header` says what is
    validated)."""
    tensors, metadata = read_header(path)
    if DCP_SHARDING_INFO in metadata and _dcp_block(path, metadata[DCP_SHARDING_INFO]):
        raise CheckpointError(f"{path}: one rank's blocks of a torch.distributed.checkpoint saved as sharded "
                              f"safetensors ({DCP_SHARDING_INFO} places them in larger tensors); name the folder that "
                              "holds every rank's shard-*.safetensors")
    return Contents(tensors, [path], metadata, metadata.get(METADATA_KEY))


def _dcp_block(path: str, sharding: str) -> bool:
    """Whether a file with DCP's sharding entry holds blocks of larger tensors: a rank's file by
    its name, or any block not at the origin (torch's rank-0 save of whole tensors has all 0)."""
    if DCP_SHARD_FILE.fullmatch(os.path.basename(path)):
        return True
    info = load_json(sharding, path, DCP_SHARDING_INFO)
    offsets = [e.get("saved_offsets") for e in info.values() if type(e) is dict] if type(info) is dict else [None]
    return any(type(o) is not list or any(o) for o in offsets)


def read_safetensors_index(path: str, key: str | None = None,
                           check_link: Callable[[str], None] | None = None) -> Contents:
    """The :class:`Contents` of a sharded safetensors checkpoint, from its index
    (``model.safetensors.index.json``), whose ``metadata`` holds fusectl's provenance entry."""
    return read_index(path, read_safetensors, check_link)


def read_header(path: str) -> tuple[dict[str, FileTensor], dict[str, str]]:
    """The tensors (lazy) and ``__metadata__`` of one safetensors file, validated.

    At least as strict as the safetensors library (a file it rejects is rejected here too):
    the header is UTF-8 JSON text that begins with ``{`` and is padded with spaces only;
    every entry has exactly ``dtype``, ``shape`` (whole numbers) and ``data_offsets``
    ``[begin, end]`` whose span is what dtype and shape need; and the entries, sorted by
    offset, tile the data section from 0 to the file's last byte, with no gap, overlap
    or trailing byte. Counts and sizes are checked against fusectl's budgets (limits.py).
    """
    try:
        with open_input(path) as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if size < 8 or len(prefix) < 8:
                raise CheckpointError(
                    f"{path}: {size} bytes is too short for a safetensors file; "
                    "it is empty or truncated — re-download or re-save it"
                )
            (length,) = struct.unpack("<Q", prefix)
            if length > size - 8:
                raise CheckpointError(
                    f"{path}: header length {length} runs past the end of the file "
                    f"({size} bytes); the file is truncated or not safetensors"
                )
            check_limit("header-bytes", length, path)
            raw = f.read(length)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror}") from e
    if len(raw) != length:
        raise CheckpointError(f"{path}: the file shrank while its header was read; was it being written?")
    with collector_paused():
        return _parse_header(path, raw, size - 8 - length, 8 + length)


def _parse_header(path: str, raw: bytes, data_size: int, data_start: int):
    body = raw.rstrip(b" ")
    if not body.startswith(b"{") or not body.endswith(b"}"):
        raise CheckpointError(
            f"{path}: the header is not a JSON object padded with spaces (it starts with "
            f"{raw[:12]!r}, ends with {raw[-12:]!r}); the file is corrupt or not safetensors"
        )
    entries = _Entries(path, data_start, data_size)
    try:
        header = load_json(body, path, "the header", object_pairs_hook=entries.from_pairs)
    except _DuplicateKey as e:
        raise CheckpointError(f"{path}: the header names {quote(str(e))} twice; the file is corrupt") from None
    if type(header) is not dict:
        raise CheckpointError(f"{path}: the header is not a JSON object; the file is corrupt")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    elif type(metadata) is not dict or not all(type(k) is str and type(v) is str for k, v in metadata.items()):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings; the file is corrupt")
    check_limit("tensors", len(header), path)
    if b"\\u" in raw:  # only a \u escape can make a lone surrogate, which is not UTF-8
        _check_encodable(path, header, metadata)
    # the parser's hook made the usual entries FileTensors; the rest are checked by name here
    for name, entry in header.items():
        if type(entry) is not FileTensor:
            header[name] = entries.named(name, entry)
    if header and max(map(len, header)) > limit("name-bytes") // 4:  # shorter fits in any UTF-8
        for name in header:
            check_limit("name-bytes", len(name.encode()), _where(path, name, 80))
    _check_tiling(path, header, data_start, data_size)
    return header, metadata


class _Entries:
    """Turns header entries into FileTensors, checking each one as the safetensors library
    does, and within fusectl's ``dims`` budget.

    ``from_pairs`` is the JSON parser's hook for every object: an entry spelled in the usual
    order becomes a FileTensor as soon as it is parsed (its lists are freed at once, and no
    dict is built for it); anything else becomes a dict, with a key given twice refused (the
    library refuses a repeated field). ``named`` then checks what is left, with the tensor's
    name for the error.
    """

    def __init__(self, path: str, data_start: int, data_size: int):
        self.path, self.data_start, self.data_size = path, data_start, data_size
        self.dims = limit("dims")
        self.specs: dict[tuple, tuple[TensorSpec, int]] = {}  # tensors of one shape share a spec

    def from_pairs(self, pairs: list[tuple[str, object]]):
        if len(pairs) == 3:
            (k0, dtype_name), (k1, shape), (k2, offsets) = pairs
            if k0 == "dtype" and k1 == "shape" and k2 == "data_offsets":
                tensor = self.tensor(dtype_name, shape, offsets)
                if tensor is not None:
                    return tensor
        out = dict(pairs)
        if len(out) != len(pairs):
            seen = set()
            for key, _ in pairs:
                if key in seen:
                    raise _DuplicateKey(key)
                seen.add(key)
        return out

    def named(self, name: str, entry: object) -> FileTensor:
        """The entry of tensor ``name`` as a FileTensor, or the CheckpointError that says what is wrong."""
        if type(entry) is not dict or len(entry) != 3 or not all(k in entry for k in _ENTRY_KEYS):
            raise CheckpointError(f"{_where(self.path, name)}: entry must have exactly dtype, shape and data_offsets")
        return self.tensor(*(entry[k] for k in _ENTRY_KEYS), name=name)

    def tensor(self, dtype_name: object, shape: object, offsets: object, name: str | None = None):
        """A FileTensor for a valid entry; for an invalid one, None when ``name`` is None (the
        parser's hook: the entry is reported later, by name), else a CheckpointError."""
        if type(shape) is not list or len(shape) > self.dims:
            if name is not None and type(shape) is list:
                check_limit("dims", len(shape), _where(self.path, name))
            return self._refuse(name, lambda: f"shape {_short(shape)} is not a list of whole numbers")
        for d in shape:
            if type(d) is not int or not 0 <= d <= _DIM_MAX:
                return self._refuse(name, lambda: f"shape {_short(shape)} is not a list of whole numbers "
                                                  "from 0 to 2**63-1")
        if type(offsets) is not list or len(offsets) != 2:
            return self._refuse(name, lambda: f"data_offsets {_short(offsets)} must be [begin, end]")
        begin, end = offsets
        if type(begin) is not int or type(end) is not int or not 0 <= begin <= end:
            return self._refuse(name, lambda: f"data_offsets {_short(offsets)} must be [begin, end]")
        key = (dtype_name, tuple(shape)) if type(dtype_name) is str else None
        known = self.specs.get(key)
        if known is None:
            if name is None:  # a new spec: let the named pass say what is wrong with it
                try:
                    known = self._spec(dtype_name, shape, "")
                except CheckpointError:
                    return None
            else:
                known = self._spec(dtype_name, shape, _where(self.path, name))
            self.specs[key] = known
        spec, nbytes = known
        if end > self.data_size:
            return self._refuse(name, lambda: f"data_offsets [{begin}, {end}] lie outside the file's "
                                              f"{self.data_size} data bytes; the file is truncated or corrupt")
        if end - begin != nbytes:
            return self._refuse(name, lambda: f"{spec} needs {nbytes} bytes but data_offsets span {end - begin}")
        return FileTensor(spec, ByteRange(self.path, self.data_start + begin, nbytes))

    def _refuse(self, name: str | None, message) -> None:
        if name is not None:
            raise CheckpointError(f"{_where(self.path, name)}: {message()}")
        return None

    @staticmethod
    def _spec(dtype_name: object, shape: list[int], where: str) -> tuple[TensorSpec, int]:
        """The spec of an entry, refused where the safetensors library refuses it: a size
        past 2**64 bits at any step of the product, or a whole that is not a number of bytes."""
        dtype = dtypes.from_safetensors(dtype_name, where)
        size = dtype.bits
        for d in shape:
            size *= d
            if size > _USIZE_MAX:
                raise CheckpointError(f"{where}: shape {_short(shape)} of {dtype} is too large to be stored; "
                                      "the file is corrupt")
        if size % 8:
            raise CheckpointError(f"{where}: {dtype}{shape} is {size} bits, not a whole number of bytes; "
                                  "the file is corrupt")
        spec = TensorSpec(dtype, tuple(shape))
        return spec, spec.nbytes


def _check_tiling(path: str, tensors: dict[str, FileTensor], data_start: int, data_size: int) -> None:
    """The tensors' byte spans, sorted by (begin, end), must follow one another from the data
    section's first byte to its last, as the safetensors library requires."""
    end = 0
    if tensors:
        count = len(tensors)
        begin_at = np.fromiter((t.location.offset for t in tensors.values()), np.int64, count) - data_start
        end_at = begin_at + np.fromiter((t.location.length for t in tensors.values()), np.int64, count)
        order = np.lexsort((end_at, begin_at))
        begin_at, end_at = begin_at[order], end_at[order]
        names = None
        if begin_at[0] != 0:
            names = list(tensors)
            raise CheckpointError(
                f"{_where(path, names[order[0]])}: the first tensor's data begins at byte {int(begin_at[0])}, "
                "not 0; the header does not describe the data section — the file is corrupt"
            )
        broken = np.flatnonzero(begin_at[1:] != end_at[:-1])
        if broken.size:
            names = list(tensors)
            k = int(broken[0])
            a, b = names[order[k]], names[order[k + 1]]
            how = "overlap" if begin_at[k + 1] < end_at[k] else "leave a gap between them"
            raise CheckpointError(
                f"{path}: tensors {quote(a)} (bytes {int(begin_at[k])}..{int(end_at[k])}) and {quote(b)} "
                f"(bytes {int(begin_at[k + 1])}..{int(end_at[k + 1])}) {how}; the file is corrupt"
            )
        end = int(end_at[-1])
    if end != data_size:
        raise CheckpointError(
            f"{path}: the tensors' data ends at byte {end} but {data_size} bytes follow the header; "
            "the header length or the offsets are wrong, or bytes were cut or appended — the file is corrupt"
        )


def _check_encodable(path: str, header: dict, metadata: dict) -> None:
    for text in (*header, *metadata, *metadata.values()):
        try:
            text.encode()
        except UnicodeEncodeError:
            raise CheckpointError(f"{path}: the header holds {quote(text[:80])}, with a lone UTF-16 "
                                  "surrogate that is not text; the file is corrupt") from None


def _where(path: str, name: str, longest: int = 200) -> str:
    shown = quote(name) if len(name) <= longest else quote(name[:longest]) + f"... ({len(name)} characters)"
    return f"{path}: tensor {shown}"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."


class _DuplicateKey(Exception):
    pass


_ENTRY_KEYS = ("dtype", "shape", "data_offsets")


def header_bytes(entries: Sequence[tuple[str, TensorSpec]], metadata: Mapping[str, str],
                 order: Sequence[str] | None = None) -> bytes:
    """The 8-byte length plus JSON header for tensors laid out back to back in this order; the
    header lists them in ``order`` (the output's key order, ``key_order``; names it does not
    hold ignored, entries it does not list after the others), by default in the layout's."""
    laid: dict[str, object] = {}
    offset = 0
    for name, spec in entries:
        laid[name] = {
            "dtype": spec.dtype.safetensors,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    for name in order or ():
        if name in laid:
            header[name] = laid[name]
    for name, entry in laid.items():
        header.setdefault(name, entry)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % ALIGNMENT)
    return struct.pack("<Q", len(raw)) + raw


class SafetensorsWriter:
    """Writes one safetensors file: header first (its keys in ``order``, by default the
    entries'), then tensors in the declared order."""

    def __init__(self, path: str, entries: Sequence[tuple[str, TensorSpec]], metadata: Mapping[str, str],
                 order: Sequence[str] | None = None):
        self.path = path
        self._pending = collections.deque(entries)
        # unbuffered: array writes and range copies go straight to the file, in order
        self._file: BinaryIO = open(path, "wb", buffering=0)
        self._writeback = Writeback(self._file.fileno())  # to disk while the rest is written
        write_all(self._file.fileno(), header_bytes(entries, metadata, order), self._writeback)
        # consecutive file ranges are merged into one copy (fewer, larger reads)
        self._ranges: list[ByteRange] = []

    def write(self, name: str, data: np.ndarray | tuple[ByteRange, ...]) -> None:
        expected, spec = self._pending.popleft()
        if name != expected:
            raise InternalError(f"{self.path}: the writer expected {expected!r} next, got {name!r}")
        if isinstance(data, np.ndarray):
            if data.dtype != spec.dtype.numpy or data.shape != spec.shape:
                raise InternalError(f"{self.path}: {name!r} arrived as {data.dtype}{list(data.shape)}, "
                                    f"the header says {spec}")
            self._flush()
            write_all(self._file.fileno(), np.ascontiguousarray(data).reshape(-1).view(np.uint8).data,
                      self._writeback)
            return
        if sum(r.length for r in data) != spec.nbytes:
            raise CheckpointError(f"{self.path}: {name!r} would get {sum(r.length for r in data)} "
                                  f"bytes for {spec}; the plan and the data disagree")
        for r in data:
            last = self._ranges[-1] if self._ranges else None
            if last and last.path == r.path and last.offset + last.length == r.offset:
                self._ranges[-1] = ByteRange(r.path, last.offset, last.length + r.length)
            else:
                self._ranges.append(r)

    def _flush(self) -> None:
        copy_ranges(self._ranges, self._file.fileno(), None, writeback=self._writeback)
        self._ranges = []

    def close(self) -> None:
        if self._pending:
            raise InternalError(f"{self.path}: {len(self._pending)} tensor(s) were never written")
        self._flush()
        self._writeback.finish()
        self._file.close()

    def abort(self) -> None:
        self._writeback.stop()
        self._file.close()
