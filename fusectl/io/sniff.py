"""What a file holds, told from its first bytes and, for a zip archive, the names in its
central directory: PyTorch's ``torch.save`` files told apart from whatever looks like them.

fusectl picks a reader by suffix where the suffix is unambiguous (``.safetensors``, ``.npz``,
``.onnx``, MXNet's ``.params`` and ``.nd``, the index files). Any other file that starts with
MXNet's NDArray list magic (u64 ``0x112``: ``mx.nd.save`` files under any name, such as the
suffix-less ones of old model zoos) is read as one (:func:`is_mxnet`). Any other file
is a PyTorch file when its content is one, whatever its name (``.pth.tar``, ``.tar``, ``.model``,
``.pkl``, ``.checkpoint``, no suffix):

- a zip archive whose first folder holds ``data.pkl`` and a ``version`` or ``byteorder`` record
  (what ``torch.save`` writes), and no TorchScript (``code/``, ``constants.pkl``) or torch.export
  (``archive_format``) records; or
- a pickle (``torch.save``'s legacy format starts with a pickle of torch's magic number; any
  other pickle is left to the PyTorch reader, which scans it and says why it refuses it).

Anything else is refused naming what it looks like and what to do. Only the first bytes and
the zip's central directory are read; its records are counted against the ``tensors`` budget
as they are listed, before anything else is built from them.

>>> describe_head(b"version https://git-lfs.github.com/spec/v1\\noid sha256:ab", 130)[0]
'a Git LFS pointer (a small text file that stands in for the real one)'
"""

from __future__ import annotations

import os
import pickle
import re
import struct
from typing import BinaryIO

from ..errors import CheckpointError, printable, quote
from ..limits import check_limit, limit
from .untrusted import open_input

MXNET_SUFFIXES = (".params", ".nd")  # mx.nd.save files, as MXNet names them
MXNET_LIST_MAGIC = 0x112  # the u64 an NDArray list file starts with
_HEAD_BYTES = 512  # tar's "ustar" mark sits at byte 257
_ZIP_LOCAL = b"PK\x03\x04"
_ZIP_END = b"PK\x05\x06"
_ZIP_END_SIZE = 22
_ZIP64_LOCATOR = b"PK\x06\x07"
_ZIP64_LOCATOR_SIZE = 20
_ZIP64_END = b"PK\x06\x06"
_ZIP64_END_SIZE = 56
_ZIP_ENTRY = b"PK\x01\x02"
_ZIP_ENTRY_SIZE = 46
_ZIP_MAX_COMMENT = 0xFFFF
# torch.save's legacy format in protocols 0 and 1 (torch/serialization.py's MAGIC_NUMBER as text);
# protocols 2 and above start with PROTO, as every binary pickle does
_LEGACY_TEXT_MAGIC = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=1)
_PICKLE_PROTOCOLS = tuple(bytes([0x80, p]) for p in range(2, pickle.HIGHEST_PROTOCOL + 1))
_TORCH_VERSION_RECORDS = frozenset({"version", ".data/version", "byteorder"})
_SHOWN_MEMBERS = 5
READS = ("fusectl reads torch.save files (under any name), .safetensors, .npz and .onnx files, MXNet .params "
         "files, folders holding them, and the folders DeepSpeed writes")

DEEPSPEED_LATEST = ("latest", "latest_universal")  # the files naming the tag folder DeepSpeed loads
_DEEPSPEED_MODEL_STATES = re.compile(r"(zero_pp_rank_[0-9]+_)?mp_rank_[0-9]+_model_states\.pt")
# the scripts DeepSpeed copies into its save folder: its own code, never part of the model's files
DEEPSPEED_SCRIPTS = frozenset({"zero_to_fp32.py", "zero_to_torch.py"})
DCP_METADATA = ".metadata"  # the index of a torch.distributed.checkpoint folder
# each rank's own index, where ranks saved without talking to each other (use_collectives=False)
DCP_RANK_METADATA = re.compile(r"__([0-9]{1,6})\.metadata")
# a rank's file of a torch.distributed.checkpoint saved as sharded safetensors (HuggingFaceStorageWriter's
# save_distributed): shard-RRRRR-model-NNNNN-of-MMMMM.safetensors, its blocks' offsets in DCP_SHARDING_INFO
DCP_SHARD_FILE = re.compile(r"shard-([0-9]{5,9})-model-([0-9]{5,9})-of-([0-9]{5,9})\.safetensors")
DCP_SHARDING_INFO = "DCP_SHARDING_INFO"
MEGATRON_LATEST = "latest_checkpointed_iteration.txt"  # Megatron-LM's save folder names its iteration there
MEGATRON_ITERATION = re.compile(r"iter_[0-9]{7,}|release")  # a save folder's iteration folders
MEGATRON_DIST_METADATA, MEGATRON_DIST_COMMON = "metadata.json", "common.pt"  # a torch_dist iteration folder's
MEGATRON_RANK_FOLDER = re.compile(r"mp_rank_([0-9]{2,6})(?:_([0-9]{3,6}))?(?:_([0-9]{3,6}))?")  # _PPP, _EEE
UNIVERSAL_FOLDER = "zero"  # ds_to_universal's folder of one folder per parameter


def check_pytorch(path: str) -> None:
    """Return when ``path`` holds what ``torch.save`` writes (a zip archive or a pickle);
    otherwise a CheckpointError naming what the file looks like and what to do instead."""
    with open_input(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(_HEAD_BYTES)
        if head.startswith((_ZIP_LOCAL, _ZIP_END)):
            problem = _zip_problem(path, zip_names(path, f, size))
        elif head.startswith((*_PICKLE_PROTOCOLS, _LEGACY_TEXT_MAGIC)):
            problem = None
        else:
            problem = "; ".join(describe_head(head, size))
    if problem:
        raise CheckpointError(f"{printable(path)}: {problem}")


def is_pytorch(path: str) -> bool:
    """Whether ``path`` is a regular file holding what ``torch.save`` writes (see check_pytorch)."""
    try:
        check_pytorch(path)
    except CheckpointError:
        return False
    return True


def is_mxnet(path: str) -> bool:
    """Whether the regular file at ``path`` starts with MXNet's NDArray list magic (u64 ``0x112``)."""
    try:
        with open_input(path) as f:
            return f.read(8) == struct.pack("<Q", MXNET_LIST_MAGIC)
    except CheckpointError:
        return False


def is_dcp_folder(path: str) -> bool:
    """Whether ``path`` is a torch.distributed.checkpoint folder: one holding a ``.metadata``, or
    ``__R.metadata`` files (only names are looked at)."""
    if not os.path.isdir(path):
        return False
    if os.path.lexists(os.path.join(path, DCP_METADATA)):
        return True
    try:
        return any(DCP_RANK_METADATA.fullmatch(n) for n in os.listdir(path))
    except OSError:
        return False


def is_dcp_safetensors_folder(path: str) -> bool:
    """Whether ``path`` is a folder of DCP's sharded safetensors files (only names are looked at)."""
    try:
        return os.path.isdir(path) and any(DCP_SHARD_FILE.fullmatch(n) for n in os.listdir(path))
    except OSError:
        return False


def is_megatron_legacy(path: str) -> bool:
    """Whether ``path`` is a Megatron-LM checkpoint folder: its save folder (holding
    ``latest_checkpointed_iteration.txt``) or an iteration folder (``iter_NNNNNNN/``, holding
    ``mp_rank_TT[_PPP][_EEE]`` folders). Only names are looked at."""
    try:
        names = os.listdir(path) if os.path.isdir(path) else []
    except OSError:
        return False
    return MEGATRON_LATEST in names or any(
        MEGATRON_RANK_FOLDER.fullmatch(n) and os.path.isdir(os.path.join(path, n)) for n in names)


def is_megatron_dist(path: str) -> bool:
    """Whether ``path`` is a Megatron-LM torch_dist checkpoint: an iteration folder holding
    dist_checkpointing's ``metadata.json`` and its ``common.pt``, or a save folder (holding
    ``latest_checkpointed_iteration.txt``) whose ``iter_NNNNNNN`` or ``release`` folder does.
    Only names are looked at (the backend ``metadata.json`` names is checked when read)."""
    try:
        names = os.listdir(path) if os.path.isdir(path) else []
        if MEGATRON_DIST_METADATA in names and MEGATRON_DIST_COMMON in names:
            return True
        return MEGATRON_LATEST in names and any(
            MEGATRON_ITERATION.fullmatch(n) and os.path.lexists(os.path.join(path, n, MEGATRON_DIST_METADATA))
            for n in names)
    except OSError:
        return False


def deepspeed_kind(path: str) -> str | None:
    """What DeepSpeed checkpoint the folder ``path`` is: ``"zero"`` for its save folder (a
    ``latest`` file naming the tag folder) or a tag folder (``global_stepN/``, holding a model
    states file); ``"universal"`` for a universal checkpoint (``ds_to_universal``'s folder:
    ``zero/`` beside the model states; or a save folder naming one in ``latest_universal``
    alone); None for any other folder. Only names are looked at."""
    if not os.path.isdir(path):
        return None
    names = set(os.listdir(path))
    states = any(_DEEPSPEED_MODEL_STATES.fullmatch(n) for n in names)
    if states and UNIVERSAL_FOLDER in names and os.path.isdir(os.path.join(path, UNIVERSAL_FOLDER)):
        return "universal"
    if states or DEEPSPEED_LATEST[0] in names:
        return "zero"
    return "universal" if DEEPSPEED_LATEST[1] in names else None


def describe_head(head: bytes, size: int) -> tuple[str, str]:
    """(what a file that is neither a zip archive nor a pickle looks like, what to do), from its
    first bytes ``head`` and its ``size``."""
    if size == 0:
        return "an empty file", "the download or copy did not finish; fetch the file again"
    if head.startswith(b"version https://git-lfs.github.com/spec/"):
        return ("a Git LFS pointer (a small text file that stands in for the real one)",
                "fetch the real file with `git lfs pull` in the clone")
    if head[257:262] == b"ustar":
        return "a tar archive", "unpack it (tar -xf) and name the checkpoint inside"
    if head.startswith(b"\x1f\x8b"):
        return "gzip-compressed data", "decompress it (gunzip) and name the result"
    if head.startswith(b"\x89HDF\r\n\x1a\n"):
        return "an HDF5 file (Keras or TensorFlow .h5 weights)", "fusectl does not read HDF5; " + READS
    if head.startswith(struct.pack("<Q", MXNET_LIST_MAGIC)):
        return ("an MXNet NDArray file (mx.nd.save's list magic)", "give it a name that ends in .params, which is "
                "how fusectl tells MXNet files by name")
    if head.startswith(b"GGUF"):
        return "a GGUF file (llama.cpp)", "fusectl does not read GGUF; " + READS
    if len(head) > 8 and head[8:9] == b"{" and 2 <= struct.unpack("<Q", head[:8])[0] <= size - 8:
        return ("a safetensors file, by its header", "give it a name that ends in .safetensors, which "
                "is how fusectl tells safetensors files")
    if head.startswith(b"\x08") and len(head) > 2 and 3 <= head[1] <= 15 and head[2] == 0x12:
        return ("an ONNX model (a protobuf that starts with an IR version)",
                "give it a name that ends in .onnx, which is how fusectl tells ONNX models")
    text = _text(head)
    if text is not None and text.lstrip().lower().startswith(("<!doctype html", "<html")):
        return ("an HTML page, not a checkpoint (a download that returned a web page instead of the file?)",
                "download the file itself (on a model hub, its 'resolve' or 'raw' link)")
    if text is not None:
        return f"a text file (it starts with {quote(text[:40])})", READS
    return f"not a format fusectl knows (the file starts with {head[:16]!r})", READS


def zip_names(path: str, f: BinaryIO, size: int) -> list[str]:
    """The member names of the zip archive open in ``f`` (``size`` bytes), from its central
    directory alone, found as Python's zipfile finds it (the end record, the zip64 end record
    just before it); the records are counted against the ``tensors`` budget as they are read."""
    where = printable(path)
    tail_start = max(0, size - _ZIP_END_SIZE - _ZIP_MAX_COMMENT)
    f.seek(tail_start)
    tail = f.read()
    at = len(tail) - _ZIP_END_SIZE
    if not (at >= 0 and tail[at:at + 4] == _ZIP_END and tail[-2:] == b"\0\0"):  # else: a comment follows
        at = tail.rfind(_ZIP_END)
    if at < 0 or len(tail) - at < _ZIP_END_SIZE:
        raise _corrupt(where, "no end-of-archive record")
    end = tail_start + at
    directory_size = struct.unpack_from("<I", tail, at + 12)[0]
    directory_end = end
    if end >= _ZIP64_LOCATOR_SIZE + _ZIP64_END_SIZE:
        f.seek(end - _ZIP64_LOCATOR_SIZE - _ZIP64_END_SIZE)
        zip64 = f.read(_ZIP64_END_SIZE + _ZIP64_LOCATOR_SIZE)
        if zip64[_ZIP64_END_SIZE:_ZIP64_END_SIZE + 4] == _ZIP64_LOCATOR and zip64[:4] == _ZIP64_END:
            directory_size = struct.unpack_from("<Q", zip64, 40)[0]
            directory_end = end - _ZIP64_LOCATOR_SIZE - _ZIP64_END_SIZE
    start = directory_end - directory_size
    if start < 0:
        raise _corrupt(where, f"a central directory of {directory_size} bytes that does not fit in the file")
    f.seek(start)
    budget = limit("tensors")
    names: list[str] = []
    read = 0
    while read < directory_size:
        entry = f.read(_ZIP_ENTRY_SIZE)
        if len(entry) < _ZIP_ENTRY_SIZE or entry[:4] != _ZIP_ENTRY:
            raise _corrupt(where, f"a broken central directory record at offset {start + read}")
        flags, = struct.unpack_from("<H", entry, 8)
        name_length, extra_length, comment_length = struct.unpack_from("<HHH", entry, 28)
        raw = f.read(name_length)
        f.seek(extra_length + comment_length, 1)
        names.append(raw.decode("utf-8" if flags & 0x800 else "cp437", "replace"))
        if len(names) > budget:
            check_limit("tensors", len(names), f"{where}: the zip archive's records (one per storage)")
        read += _ZIP_ENTRY_SIZE + name_length + extra_length + comment_length
    return names


def _zip_problem(path: str, names: list[str]) -> str | None:
    """None for a torch.save archive; else what the zip archive with members ``names`` is, and
    what to do."""
    prefix = names[0].split("/", 1)[0] if names and "/" in names[0] else None
    inside = {n[len(prefix) + 1:] for n in names if n.startswith(f"{prefix}/")} if prefix else set()
    shown = quote(path)
    if "constants.pkl" in inside or any(n.startswith("code/") for n in inside):
        return (f"a TorchScript archive (torch.jit.save: the model's code, {quote(prefix + '/code/')}, with "
                "its weights), not a torch.save state dict; fusectl reads state dicts and never loads code "
                "from a file — if you trust it, re-save its weights with torch: "
                f"torch.save(torch.jit.load({shown}).state_dict(), 'model.pt')")
    if "archive_format" in inside:
        return ("a torch.export archive (torch.export.save: a program with its weights), not a torch.save "
                "state dict; fusectl reads state dicts — if you trust it, re-save its weights with torch: "
                f"torch.save(torch.export.load({shown}).state_dict, 'model.pt')")
    if "data.pkl" in inside and inside & _TORCH_VERSION_RECORDS:
        return None
    if names and all(n.endswith(".npy") for n in names):
        return "an .npz archive (numpy.savez); give it a name that ends in .npz, which is how fusectl tells them"
    listed = ", ".join(quote(n) for n in names[:_SHOWN_MEMBERS]) + (", …" if len(names) > _SHOWN_MEMBERS else "")
    held = f"it holds {listed}" if names else "it is empty"
    return (f"a zip archive but not one torch.save writes ({held}; torch.save writes FOLDER/data.pkl and "
            f"FOLDER/version); {READS}")


def _corrupt(where: str, what: str) -> CheckpointError:
    return CheckpointError(f"{where}: a zip archive with {what}; the file is truncated or corrupt — "
                           "download or save it again")


def _text(head: bytes) -> str | None:
    """``head`` as text when it is printable UTF-8 (a character cut at the end is dropped)."""
    text = head.decode("utf-8", "ignore") if head else ""
    if not text or len(text.encode("utf-8")) < len(head) - 3:
        return None
    return text if all(c.isprintable() or c in "\t\r\n" for c in text) else None
