"""The formats fusectl reads and writes, one row each: how a file is recognised, which file of a
folder is read, the reader (every one returns :class:`~fusectl.io.contents.Contents`) and the
writer. ``open_checkpoint`` and the output side (``write.write_table``) know formats only
through these rows.

A file is recognised by its suffix where the suffix decides (``.safetensors``, ``.npz``,
``.onnx``, MXNet's ``.params`` and ``.nd``, the index files); any other file is an MXNet NDArray
file when it starts with the list magic, else a PyTorch file when its content is one, under any
name (:mod:`fusectl.io.sniff`). A folder is read through the file of the first row, in
``folder_rank`` order, that it holds exactly one of. An output path is written by the row whose
file output ends it, else as a folder.

Adding a format: a reader module (``read(path, key=None, check_link=None) -> Contents``, and a
writer if it is written) and one row below.

>>> format_of("model.safetensors").name, format_of("checkpoint.pth.tar").name
('safetensors', 'pytorch')
>>> output_kind("out.npz"), output_kind("model.pt"), output_kind("model.params"), output_kind("out/")
('npz', 'pytorch', 'mxnet', 'folder')
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Callable

from ..errors import CheckpointError, OutputError
from .contents import Contents, Reader
from .output import FolderWriter, Output, single_file
from .formats.safetensors_file import INDEX_SUFFIX, SafetensorsWriter, read_safetensors, read_safetensors_index
from .sniff import (MXNET_SUFFIXES, deepspeed_kind, is_dcp_folder, is_dcp_safetensors_folder, is_megatron_dist,
                    is_megatron_legacy, is_mxnet, is_pytorch)


@dataclass(frozen=True)
class Format:
    """One format: ``name`` (what ``Checkpoint.format`` says), ``suffixes`` (file names that end
    so are this format; for a format ``told_by`` content, only the names a folder is searched
    for), ``read`` (its reader), ``told_by`` (whether a file holds this format, for a format
    recognised by content under any name), ``sniffed`` (whether a file holds this format, for a
    format its suffixes decide that is also recognised by content under other names; tried
    before ``told_by``), ``folder_rank`` (where it comes when a folder is
    read: lower first; None: never picked in a folder), ``listed_as`` (how a folder holding no
    weights lists it), ``takes_key`` (``key`` selects a state dict) and ``output`` (how it is
    written; None: it is not), ``folder`` (for a format whose checkpoint is a folder of its
    own, what torch.distributed.checkpoint and DeepSpeed write: whether a folder is one; its
    reader is given the folder)."""

    name: str
    suffixes: tuple[str, ...]
    read: Reader
    told_by: Callable[[str], bool] | None = None
    sniffed: Callable[[str], bool] | None = None
    folder_rank: int | None = None
    listed_as: str | None = None
    takes_key: bool = False
    output: Output | None = None
    # a format whose checkpoint is a folder of its own (what many ranks wrote): whether a folder is one
    folder: Callable[[str], bool] | None = None


def _lazy(module: str, function: str) -> Reader:
    """A reader that imports ``fusectl.io.formats.<module>`` when first called: a run pays only for the
    readers of the formats it reads (ONNX's imports onnx-ir; npz's, zipfile)."""

    def read(path: str, key: str | None = None, check_link: Callable[[str], None] | None = None) -> Contents:
        reader = getattr(importlib.import_module(f"{__package__}.formats.{module}"), function)
        return reader(path, key=key, check_link=check_link)

    read.__qualname__ = read.__name__ = function
    return read


def _lazy_writer(module: str, cls: str) -> Callable:
    """A file writer (``writer(path, entries, metadata)``) imported when first opened, as
    :func:`_lazy` imports a reader: PyTorch's writer loads PyTorch's reader (its dtype table)."""

    def open_writer(path, entries, metadata, **order):
        return getattr(importlib.import_module(f"{__package__}.formats.{module}"), cls)(path, entries, metadata, **order)

    open_writer.__qualname__ = open_writer.__name__ = cls
    return open_writer


TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
TORCH_INDEX_SUFFIX = ".bin.index.json"  # pytorch_model.bin.index.json

# in the order a folder holding no weights lists them
FORMATS: tuple[Format, ...] = (
    Format("safetensors", (".safetensors",), read_safetensors, folder_rank=1, listed_as=".safetensors",
           output=Output(single_file(SafetensorsWriter))),
    Format("safetensors-sharded", (INDEX_SUFFIX,), read_safetensors_index, folder_rank=0, listed_as=INDEX_SUFFIX,
           output=Output(FolderWriter, folder=True)),
    Format("npz", (".npz",), _lazy("npz_file", "read_npz"), folder_rank=2, listed_as=".npz",
           output=Output(single_file(_lazy_writer("npz_file", "NpzWriter")), indexed=False)),
    Format("pytorch", TORCH_SUFFIXES, _lazy("torch_file", "read_pytorch"), told_by=is_pytorch, folder_rank=4,
           listed_as=f"PyTorch ({', '.join(TORCH_SUFFIXES)}, *{TORCH_INDEX_SUFFIX})", takes_key=True,
           output=Output(single_file(_lazy_writer("torch_writer", "TorchWriter")))),
    Format("pytorch-sharded", (TORCH_INDEX_SUFFIX,), _lazy("torch_file", "read_pytorch_index"), folder_rank=3),
    Format("onnx", (".onnx",), _lazy("onnx_file", "read_onnx")),
    # never picked in a folder: an export's folder holds PREFIX-symbol.json and one params file per epoch
    Format("mxnet", MXNET_SUFFIXES, _lazy("mxnet_params", "read_mxnet"), sniffed=is_mxnet,
           output=Output(single_file(_lazy_writer("mxnet_params", "MXNetWriter")), indexed=False)),
    # folders many ranks wrote: read as the one checkpoint they hold together
    Format("deepspeed-zero", (), _lazy("deepspeed_zero", "read_zero"),
           folder=lambda path: deepspeed_kind(path) == "zero"),
    Format("deepspeed-universal", (), _lazy("deepspeed_universal", "read_universal"),
           folder=lambda path: deepspeed_kind(path) == "universal"),
    # Megatron-LM's torch_dist (a DCP folder with metadata.json and common.pt): before dcp and megatron-legacy,
    # which its iteration folder and its save folder would also match
    Format("megatron-torch_dist", (), _lazy("megatron_dist", "read_megatron_dist"), folder=is_megatron_dist),
    # torch.distributed.checkpoint: a folder holding .metadata; one of its .distcp files is refused (name the folder)
    Format("dcp", (".distcp",), _lazy("dcp", "read_dcp"), takes_key=True, folder=is_dcp_folder),
    # torch.distributed.checkpoint saved as sharded safetensors (no index): a folder of shard-R-model-N-of-M files
    Format("dcp-safetensors", (), _lazy("dcp_safetensors", "read_dcp_safetensors"), folder=is_dcp_safetensors_folder),
    # Megatron-LM's legacy save folder (or one iter_NNNNNNN folder): mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt
    Format("megatron-legacy", (), _lazy("megatron", "read_megatron"), folder=is_megatron_legacy),
)

# files of formats fusectl does not read that hold weights all the same
_OTHER_WEIGHT_SUFFIXES = (".onnx_data", ".msgpack", ".h5")
# files that hold weights; everything else in a Hugging Face folder travels with the output
WEIGHT_SUFFIXES = (*(s for f in FORMATS for s in f.suffixes), *_OTHER_WEIGHT_SUFFIXES)
# file names a user may mean as a single-file output that fusectl does not write (with the
# suffixes of formats it reads but does not write as files): never silently turn them into a folder
_OTHER_UNWRITTEN_SUFFIXES = (".pkl", ".h5", ".msgpack", ".gguf", ".safetensor", ".zip", ".tar")


def format_named(name: str) -> Format:
    """The row whose ``name`` is ``name`` (``"npz"``); KeyError for one fusectl does not know."""
    for fmt in FORMATS:
        if fmt.name == name:
            return fmt
    raise KeyError(name)


def folder_format(path: str) -> Format | None:
    """The format whose checkpoint the folder ``path`` is as a whole (a DCP folder, a DeepSpeed
    checkpoint); None for any other folder (a Hugging Face folder: its weight file is read)."""
    return next((f for f in FORMATS if f.folder is not None and f.folder(path)), None)


def format_by_suffix(path: str) -> Format | None:
    """The format a file's suffix decides: every format's but those told by content (PyTorch's,
    whose files are told by what they hold, under any name: ``.pth.tar``, ``.model``, none)."""
    return next((f for f in FORMATS if f.told_by is None and path.endswith(f.suffixes)), None)


def format_of(path: str) -> Format:
    """The format of the file at ``path``: the one its suffix decides, else the one its content
    shows (a ``sniffed`` format first); the last format told by content when none is shown (its
    reader says what the file is instead).

    >>> format_of("resnet-0000.params").name
    'mxnet'
    """
    decided = format_by_suffix(path)
    if decided is not None:
        return decided
    sniffed = next((f for f in FORMATS if f.sniffed is not None and f.sniffed(path)), None)
    if sniffed is not None:
        return sniffed
    by_content = [f for f in FORMATS if f.told_by is not None]
    return next((f for f in by_content[:-1] if f.told_by(path)), by_content[-1])


def takes_key(path: str) -> bool:
    """Whether ``path`` names a file of a format whose reader takes ``key`` (a PyTorch file, whose
    state dict ``--key`` selects): a file with that format's suffix (.pt, .pth, .bin, .ckpt), or
    any other file whose suffix names no other format and whose content is one
    (``checkpoint.pth.tar``); never a file a ``sniffed`` format's content claims."""
    if not os.path.isfile(path) or format_by_suffix(path) is not None:
        return False
    if any(f.sniffed is not None and f.sniffed(path) for f in FORMATS):  # an MXNet file named weights.pt
        return False
    return any(f.takes_key and (path.endswith(f.suffixes) or f.told_by(path)) for f in FORMATS if f.told_by)


def pick_in_folder(folder: str, exclude: Callable[[str], bool] | None = None) -> tuple[str, Format]:
    """The weights file of a Hugging Face folder and its format: by ``folder_rank`` (safetensors
    first: an index, else one file; else one .npz; else PyTorch's: ``pytorch_model.bin.index.json``,
    else one .bin/.pt/.pth/.ckpt file). A rank with two or more files asks which to read. A name
    ``exclude`` says is not a weight file is never picked (a Trainer's ``optimizer.pt``)."""
    names = sorted(n for n in os.listdir(folder) if exclude is None or not exclude(n))
    ranked = sorted((f for f in FORMATS if f.folder_rank is not None), key=lambda f: f.folder_rank)
    for fmt in ranked:
        found = [n for n in names if n.endswith(fmt.suffixes)]
        if len(found) == 1:
            return os.path.join(folder, found[0]), fmt
        if found:
            raise CheckpointError(f"{folder}: holds {', '.join(found)}; name the one to read instead of the folder")
    listed = ", ".join(f.listed_as for f in FORMATS if f.listed_as)
    raise CheckpointError(f"{folder}: holds no {listed} file")


def output_format(path: str) -> Format:
    """The format an output path is written in: the one whose file output's suffix ends it, else a
    folder (the format with the folder output); OutputError for a suffix of a file fusectl does
    not write, which would otherwise silently become a folder."""
    files = [f for f in FORMATS if f.output is not None and not f.output.folder]
    for fmt in files:
        if path.endswith(fmt.suffixes):
            return fmt
    # a suffix of a format read but not written, or of a file format in other letters (.PT)
    claimed = {"." + s.rsplit(".", 1)[1] for f in FORMATS for s in f.suffixes}
    suffix = os.path.splitext(path.rstrip(os.sep))[1]
    if suffix.lower() in claimed or suffix.lower() in _OTHER_UNWRITTEN_SUFFIXES:
        shown = ", ".join(s for f in files for s in f.suffixes)
        choices = ", ".join(f"OUT{f.suffixes[0]}" for f in files)
        raise OutputError(f"{path}: fusectl writes {shown} or a folder, not {suffix}; "
                          f"choose {choices} or a folder name")
    return next(f for f in FORMATS if f.output is not None and f.output.folder)


def output_kind(path: str) -> str:
    """``"folder"`` for a folder output, else the name of the file format written
    (``"safetensors"``, ``"npz"``, ``"pytorch"``), from the output path's suffix (:func:`output_format`)."""
    fmt = output_format(path)
    return "folder" if fmt.output.folder else fmt.name
