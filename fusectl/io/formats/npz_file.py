"""``.npz`` archives: lazy members (zero-copy ranges when stored uncompressed), the npy header
parser (also what ``verify --inputs`` reads arrays with), and a streaming writer.

numpy's format has no bf16/fp8 types (ml_dtypes arrays save as raw ``|V2``), so fusectl writes
those as unsigned integers of the same width and records the real dtypes in a
``__fusectl_dtypes__.npy`` member; reading restores them.
"""

from __future__ import annotations

import json
import struct
import zipfile
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Callable

import numpy as np

from ... import dtypes
from ...errors import CheckpointError, OutputError, printable, quote
from ...limits import check_limit, limit
from ..contents import Contents
from ..provenance import METADATA_KEY
from ..untrusted import load_json, open_input
from ...tensors import ByteRange, FileTensor, LazyTensor, TensorSpec, read_ranges

SUFFIX = ".npz"
NPY_MAGIC = b"\x93NUMPY"
DTYPES_MEMBER = "__fusectl_dtypes__"
METADATA_MEMBER = "__fusectl_metadata__"
_RESERVED = (DTYPES_MEMBER, METADATA_MEMBER)
# what zipfile, zlib and numpy's npy header reader raise for a damaged archive or member
UNREADABLE = (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error, RuntimeError, NotImplementedError,
              struct.error, SyntaxError, RecursionError, MemoryError)
_NPY_VERSIONS = ((1, 0), (2, 0), (3, 0))


def read_npy_header(f: BinaryIO) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, Fortran order, dtype, header bytes) of the npy stream ``f``, from its header alone;
    one of :data:`UNREADABLE` for a damaged header or an npy version numpy does not write.

    >>> import io
    >>> buffer = io.BytesIO()
    >>> np.save(buffer, np.zeros((2, 3), np.float32)); _ = buffer.seek(0)
    >>> read_npy_header(buffer)[:3]
    ((2, 3), False, dtype('float32'))
    """
    version = np.lib.format.read_magic(f)
    if version not in _NPY_VERSIONS:
        raise ValueError(f"npy format version {version[0]}.{version[1]} is not one numpy writes")
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read(f)
    return tuple(shape), bool(fortran), dtype, f.tell()


def member_name(info: zipfile.ZipInfo) -> str | None:
    """The array name of an npz member (its file name without ``.npy``); None for a member that
    is not an ``.npy`` array."""
    return info.filename[: -len(".npy")] if info.filename.endswith(".npy") else None


@dataclass(frozen=True, eq=False)
class NpzMemberTensor(LazyTensor):
    """A compressed (or Fortran-ordered) npz member: decoded on read."""

    spec: TensorSpec
    path: str
    member: str

    def read(self) -> np.ndarray:
        with zipfile.ZipFile(self.path) as zf, zf.open(self.member) as f:
            array = np.lib.format.read_array(f, allow_pickle=False)
        return np.ascontiguousarray(array).view(self.spec.dtype.numpy).reshape(self.spec.shape)


def read_npz(path: str, key: str | None = None, check_link: Callable[[str], None] | None = None) -> Contents:
    """The :class:`Contents` of an npz archive (a regular file only): its tensors (lazy) and
    fusectl metadata (which holds the provenance entry), with member count, name length,
    dimensions and decompressed sizes within fusectl's budgets."""
    raw = open_input(path)
    try:
        zf = zipfile.ZipFile(raw)
    except (OSError, zipfile.BadZipFile, ValueError, EOFError) as e:
        raw.close()
        raise CheckpointError(f"{path}: not a readable .npz archive ({e})") from e
    tensors: dict[str, LazyTensor] = {}
    extras: dict[str, bytes] = {}
    with zf, raw:
        members = zf.infolist()
        check_limit("tensors", len(members), path)
        name_chars = limit("name-bytes") // 4
        for info in members:
            name = member_name(info)
            if name is None:
                raise CheckpointError(f"{path}: member {quote(info.filename[:200])} is not a .npy array")
            where = f"{path}: array {quote(name[:200])}"
            if len(name) > name_chars:
                check_limit("name-bytes", len(name.encode("utf-8", "surrogateescape")), where)
            if info.compress_type != zipfile.ZIP_STORED:
                check_limit("decompressed-bytes", info.file_size, where)
            try:
                with zf.open(info) as f:
                    shape, fortran, dtype, header_end = read_npy_header(f)
                    if name in _RESERVED:
                        check_limit("json-bytes", info.file_size, where)
                        extras[name] = f.read()
                        continue
            except UNREADABLE as e:
                raise CheckpointError(f"{where}: unreadable ({printable(str(e)[:200])})") from e
            if dtype.hasobject:
                raise CheckpointError(f"{where}: holds Python objects (pickle); fusectl never unpickles npz data")
            check_limit("dims", len(shape), where)
            if not all(type(d) is int and d >= 0 for d in shape):
                raise CheckpointError(f"{where}: shape {shape!r} is not a tuple of whole numbers")
            spec = TensorSpec(dtypes.from_numpy(dtype, where), tuple(shape))
            if name in tensors:
                raise CheckpointError(f"{where}: the archive holds two members of this name")
            if info.file_size != header_end + spec.nbytes:
                raise CheckpointError(
                    f"{where}: the member holds {info.file_size - header_end} data bytes, but "
                    f"{spec} needs {spec.nbytes}; the archive is truncated or corrupt"
                )
            if info.compress_type == zipfile.ZIP_STORED and not fortran:
                raw.seek(info.header_offset)
                local = raw.read(30)
                if local[:4] != b"PK\x03\x04":
                    raise CheckpointError(f"{where}: corrupt zip entry")
                name_len, extra_len = struct.unpack("<HH", local[26:30])
                start = info.header_offset + 30 + name_len + extra_len + header_end
                tensors[name] = FileTensor(spec, ByteRange(path, start, spec.nbytes))
            else:
                tensors[name] = NpzMemberTensor(spec, path, info.filename)
    metadata = string_map(extras, METADATA_MEMBER, path)
    for name, dtype_name in string_map(extras, DTYPES_MEMBER, path).items():
        if name not in tensors:
            raise CheckpointError(f"{path}: {DTYPES_MEMBER} names {quote(name)}, which the archive lacks")
        tensor = tensors[name]
        spec = TensorSpec(dtypes.from_safetensors(dtype_name, f"{path}: {quote(name)}"), tensor.spec.shape)
        if spec.nbytes != tensor.spec.nbytes:
            raise CheckpointError(
                f"{path}: {DTYPES_MEMBER} makes {quote(name)} {spec}, which does not fit its "
                f"{tensor.spec.nbytes} stored bytes"
            )
        tensors[name] = (
            FileTensor(spec, tensor.location) if isinstance(tensor, FileTensor)
            else NpzMemberTensor(spec, tensor.path, tensor.member)
        )
    return Contents(tensors, [path], metadata, metadata.get(METADATA_KEY))


def string_map(extras: dict[str, bytes], member: str, path: str) -> dict[str, str]:
    """A fusectl JSON member of an npz: an object of strings, or a CheckpointError."""
    if member not in extras:
        return {}
    value = load_json(extras[member], path, f"member {member}")
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise CheckpointError(f"{path}: member {member} must map strings to strings")
    try:
        for text in (*value, *value.values()):
            text.encode()
    except UnicodeEncodeError:
        raise CheckpointError(f"{path}: member {member} holds a lone UTF-16 surrogate, which is not text; "
                              "the file is corrupt") from None
    return value


# a zip member's name length is a 16-bit field
_ZIP_NAME_BYTES = 0xFFFF
_STORAGE_TYPE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class NpzWriter:
    """Writes an uncompressed npz member by member (extension dtypes stored as raw uints)."""

    def __init__(self, path: str, entries, metadata):
        reserved = [n for n, _ in entries if n in _RESERVED]
        if reserved:
            raise OutputError(f"{path}: tensor {quote(reserved[0])} has a name fusectl reserves in npz "
                              "files; rename it or write .safetensors")
        for name, _ in entries:
            if len(name.encode("utf-8", "surrogatepass")) + len(".npy") > _ZIP_NAME_BYTES:
                raise OutputError(
                    f"{path}: tensor {quote(name[:80])}... ({len(name)} characters) has a name longer than a "
                    f"zip archive can store ({_ZIP_NAME_BYTES} bytes); rename it or write .safetensors"
                )
        self.path = path
        self._specs = dict(entries)
        self._zip = zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True)
        self._real_dtypes = {
            n: s.dtype.safetensors for n, s in entries if not _native(s)
        }
        self._put(METADATA_MEMBER, np.frombuffer(json.dumps(dict(metadata)).encode(), np.uint8))
        if self._real_dtypes:
            self._put(DTYPES_MEMBER, np.frombuffer(json.dumps(self._real_dtypes).encode(), np.uint8))

    def _put(self, name: str, array: np.ndarray) -> None:
        with self._zip.open(name + ".npy", "w", force_zip64=True) as f:
            np.lib.format.write_array(f, array, allow_pickle=False)

    def write(self, name: str, data) -> None:
        spec = self._specs[name]
        if not isinstance(data, np.ndarray):
            data = read_ranges(data, spec)
        if name in self._real_dtypes:
            data = np.ascontiguousarray(data).reshape(spec.shape).view(_STORAGE_TYPE[spec.dtype.itemsize])
        self._put(name, data)

    def close(self) -> None:
        self._zip.close()

    def abort(self) -> None:
        self._zip.close()


def _native(spec: TensorSpec) -> bool:
    return spec.dtype.numpy.type.__module__ == "numpy"
