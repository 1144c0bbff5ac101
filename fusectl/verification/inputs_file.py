"""``verify --inputs FILE.npz``: named arrays whose sizes are checked before any is decompressed.

An .npz is a zip of .npy members. A 1 MB archive can declare gigabytes, so the zip's own
sizes and each npy header (shape × itemsize) are held to the ``verify-input-bytes`` budget
first; then names, ranks, fixed axes and dtypes are checked against the model (by
:func:`fusectl.verification.runner.make_inputs`) from the headers alone; only an array that is fed
is decompressed, into a buffer of the size its header declared. Python objects are never
unpickled. The archive is parsed by the npz reader's own header parser
(:mod:`fusectl.io.formats.npz_file`); the budgets and messages here are verify's.
"""

from __future__ import annotations

import io
import math
import zipfile
from dataclasses import dataclass
from typing import Iterator, Mapping

import numpy as np

from ..errors import VerifyError, option_name, printable, quote
from ..io.formats.npz_file import NPY_MAGIC, UNREADABLE, member_name, read_npy_header
from ..io.untrusted import check_regular_file
from ..limits import check_limit
from .runner import one_line

_CHUNK = 1 << 22


@dataclass(frozen=True)
class _Member:
    """One array as its npy header declares it."""

    name: str
    info: zipfile.ZipInfo
    shape: tuple[int, ...]
    dtype: np.dtype
    fortran: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class InputsFile(Mapping[str, np.ndarray]):
    """The arrays of an ``--inputs`` .npz by name; ``declared`` gives (shape, dtype) without
    reading data, and looking an array up decompresses that array only."""

    def __init__(self, path: str, members: Mapping[str, _Member]):
        self.path = path
        self._members = dict(members)

    @property
    def declared(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {name: (m.shape, m.dtype) for name, m in self._members.items()}

    def __iter__(self) -> Iterator[str]:
        return iter(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def __getitem__(self, name: str) -> np.ndarray:
        member = self._members[name]
        where = f"{option_name('inputs')} {printable(self.path)}: array {quote(name)}"
        try:
            with zipfile.ZipFile(self.path) as archive, archive.open(member.info.filename) as f:
                if _read_header(f, where)[:3] != (member.shape, member.fortran, member.dtype):
                    raise VerifyError(f"{where} changed while verify ran; run it again")
                data = np.empty(member.nbytes, np.uint8)
                filled = 0
                while filled < member.nbytes:
                    chunk = f.read(min(_CHUNK, member.nbytes - filled))
                    if not chunk:
                        break
                    data[filled:filled + len(chunk)] = np.frombuffer(chunk, np.uint8)
                    filled += len(chunk)
        except UNREADABLE as e:
            raise VerifyError(f"{where} is unreadable ({one_line(e)}); the archive is truncated or corrupt") from e
        if filled != member.nbytes:
            raise VerifyError(f"{where} holds {filled} of its {member.nbytes} bytes; the archive is truncated")
        if member.dtype.itemsize == 0:
            return np.empty(member.shape, member.dtype)
        return data.view(member.dtype).reshape(member.shape, order="F" if member.fortran else "C")


def load_inputs_file(path: str | None) -> Mapping[str, np.ndarray]:
    """The arrays of the ``.npz`` at ``path`` (``--inputs``), or {} for None; headers read and
    checked now, data decompressed on use (:class:`InputsFile`).

    Refused with a VerifyError naming the file: anything but a regular file (a folder, FIFO,
    device, a /proc or /sys file), a lone ``.npy`` array, a corrupt or truncated archive,
    members that are not ``.npy`` arrays, Python objects, and arrays whose declared sizes
    (the zip's and the npy headers') add up past the ``verify-input-bytes`` budget.
    """
    if path is None:
        return {}
    what = f"{option_name('inputs')} {printable(path)}"
    check_regular_file(path, error=VerifyError, what=what,
                       hint="pass an .npz of arrays named after the model's inputs")
    try:
        with open(path, "rb") as f:
            if f.read(len(NPY_MAGIC)) == NPY_MAGIC:
                raise VerifyError(f"{what}: a single .npy array, not an .npz of named arrays; save the inputs "
                                  "with np.savez(FILE, NAME=array, ...), one name per model input")
        archive = zipfile.ZipFile(path)
    except UNREADABLE as e:
        raise VerifyError(f"{what}: not a readable .npz archive ({one_line(e)}); pass an .npz of named "
                          "arrays, as np.savez writes") from e
    with archive:
        infos = archive.infolist()
        check_limit("tensors", len(infos), what, VerifyError)
        # the zip's own declaration first: nothing is decompressed yet
        check_limit("verify-input-bytes", sum(i.file_size for i in infos), what, VerifyError)
        members: dict[str, _Member] = {}
        total = 0
        for info in infos:
            member = _member(archive, info, what)
            total += member.nbytes
            check_limit("verify-input-bytes", total, f"{what}: array {quote(member.name)}", VerifyError)
            if member.name in members:
                raise VerifyError(f"{what}: holds two arrays named {quote(member.name)}; keep one")
            members[member.name] = member
    return InputsFile(path, members)


def npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """``arrays`` as an .npz (``np.savez``, uncompressed, no pickles) that :func:`load_inputs_file`
    reads back: what ``--save-inputs`` writes.

    >>> np.load(io.BytesIO(npz_bytes({"x": np.zeros(2, np.float32)}))).files
    ['x']
    """
    members = {name: np.asarray(array) for name, array in arrays.items()}
    # numpy before 2.0 has no savez(allow_pickle=...) (it would be saved as an array of that
    # name): an object array is the only one savez pickles, so none gets that far
    pickled = [name for name, array in members.items() if array.dtype.hasobject]
    if pickled:
        raise ValueError(f"npz_bytes: {pickled} hold Python objects, which an .npz would pickle")
    buffer = io.BytesIO()
    np.savez(buffer, **members)
    return buffer.getvalue()


def _read_header(f, where: str) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, fortran order, dtype, header bytes) of the npy stream ``f`` (npz_file's parser)."""
    try:
        return read_npy_header(f)
    except UNREADABLE as e:
        raise VerifyError(f"{where} is unreadable ({one_line(e)}); the archive is truncated or corrupt") from e


def _member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, what: str) -> _Member:
    """One member as its header declares it, held to the budget before any data is read."""
    name = member_name(info)
    if name is None:
        raise VerifyError(f"{what}: member {quote(info.filename)} is not an .npy array; "
                          "pass an .npz of named arrays, as np.savez writes")
    where = f"{what}: array {quote(name)}"
    try:
        with archive.open(info) as f:
            shape, fortran, dtype, header_bytes = _read_header(f, where)
    except UNREADABLE as e:  # opening a member reads its local header
        raise VerifyError(f"{where} is unreadable ({one_line(e)}); the archive is truncated or corrupt") from e
    if dtype.hasobject:
        raise VerifyError(f"{where} holds Python objects ({dtype}); fusectl never unpickles, so save numbers "
                          "or strings only")
    check_limit("dims", len(shape), where, VerifyError)
    if any(d < 0 for d in shape):
        raise VerifyError(f"{where} declares the shape {list(shape)}; the archive is corrupt")
    member = _Member(name, info, shape, dtype, fortran)
    check_limit("verify-input-bytes", member.nbytes, where, VerifyError)
    if info.file_size != header_bytes + member.nbytes:
        raise VerifyError(f"{where} declares {member.nbytes} data bytes ({dtype}{list(shape)}) but the archive "
                          f"holds {info.file_size - header_bytes}; it is truncated or corrupt")
    return member
