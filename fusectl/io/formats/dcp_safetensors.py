"""torch.distributed.checkpoint saved as sharded safetensors, read without torch.

``dcp.save(state_dict, storage_writer=HuggingFaceStorageWriter(DIR, save_distributed=True))`` —
what torchtitan's Hugging Face saves write before (or without) consolidating — leaves one
safetensors file per rank and output file, ``shard-RRRRR-model-NNNNN-of-MMMMM.safetensors``
(ranks numbered from 1), each an ordinary safetensors file holding that rank's block of each
tensor, with the block's place in the whole in its ``__metadata__``: ``DCP_SHARDING_INFO``, a
JSON object {name: {"saved_offsets": [...]}}. There is no index: a tensor's global shape is
where its blocks end, as torch's own reader and consolidation take it.

:func:`read_dcp_safetensors` gives each tensor whole at that shape (:mod:`.chunks`: rows cut
along the first dimension are file ranges; other cuts assembled when read). Checked as data:
every file's header (:func:`~.safetensors_file.read_header`), its sharding entry naming exactly
the tensors the file holds, ranks numbered 1 to N with every one of a rank's files there, one
dtype per tensor, blocks that tile their tensor. What the format cannot tell — a last rank
whose every file is gone, for tensors that rank alone held the end of — no reader can; the
consolidated files torch writes beside (``enable_consolidation``) carry the whole shapes.
"""

from __future__ import annotations

import os
from typing import Callable

from ...errors import CheckpointError, printable, quote
from ...limits import limit
from ...tensors import LazyTensor, TensorSpec
from ..contents import Contents
from ..sniff import DCP_SHARD_FILE, DCP_SHARDING_INFO
from ..untrusted import load_json
from .chunks import Piece, assemble, check_tiling
from .safetensors_file import SUFFIX, read_header

_HOW = "the folder is not what torch.distributed.checkpoint's HuggingFaceStorageWriter writes, or it is corrupt"


def read_dcp_safetensors(path: str, key: str | None = None,
                         check_link: Callable[[str], None] | None = None) -> Contents:
    """The :class:`~fusectl.io.contents.Contents` of the folder ``path`` of DCP's sharded
    safetensors files.

    :param path: the folder (one of its files alone is refused: it is one rank's blocks).
    :param key: unused (the files hold one flat state dict).
    :param check_link: called with each file before it is read (the input's link boundary).
    :returns: every tensor whole, in the order the files first name them; ``distributed``
        ``{"world_size": the ranks}``.
    :raises CheckpointError: naming the file: a rank or a rank's file missing, another
        safetensors file beside the shards, a sharding entry missing or not naming the file's
        tensors, a tensor of two dtypes, blocks that do not tile their tensor.
    """
    check = check_link or (lambda p: None)
    if not os.path.isdir(path):
        raise CheckpointError(f"{printable(path)}: one rank's blocks of a torch.distributed.checkpoint saved as "
                              "sharded safetensors; name the folder that holds every rank's shard-*.safetensors")
    files = _files(path)
    blocks: dict[str, list[Piece]] = {}
    for file in files:
        check(file)
        tensors, metadata = read_header(file)
        for name, (offsets, tensor) in _sharding(file, tensors, metadata).items():
            blocks.setdefault(name, []).append((offsets, tensor))
    where = printable(path)
    tensors: dict[str, LazyTensor] = {}
    for name, pieces in blocks.items():
        dtypes = {t.spec.dtype for _, t in pieces}
        if len(dtypes) > 1:
            raise CheckpointError(f"{where}: the blocks of {quote(name)} are of dtypes "
                                  f"{', '.join(sorted(d.safetensors for d in dtypes))}; {_HOW}")
        ends = [[o + s for o, s in zip(offsets, t.spec.shape)] for offsets, t in pieces]
        spec = TensorSpec(next(iter(dtypes)), tuple(max(dim) for dim in zip(*ends)) if ends[0] else ())
        check_tiling(name, spec, [(o, t.spec.shape) for o, t in pieces], where, _HOW)
        tensors[name] = assemble(spec, pieces)
    ranks = {DCP_SHARD_FILE.fullmatch(os.path.basename(f)).group(1) for f in files}
    return Contents(tensors, files, distributed={"world_size": len(ranks)})


def _files(folder: str) -> list[str]:
    """The folder's shard files, rank by rank, each rank's files all there."""
    try:
        names = sorted(os.listdir(folder))
    except OSError as e:
        raise CheckpointError(f"{printable(folder)}: cannot be listed ({e.strerror})") from e
    others = [n for n in names if n.endswith(SUFFIX) and not DCP_SHARD_FILE.fullmatch(n)]
    if others:
        raise CheckpointError(f"{printable(folder)}: holds {quote(others[0])} beside DCP's shard-*.safetensors files; "
                              "move one kind out, or name the file to read")
    found: dict[int, dict[int, int]] = {}
    for name in names:
        if m := DCP_SHARD_FILE.fullmatch(name):
            rank, index, count = (int(g) for g in m.groups())
            found.setdefault(rank, {})[index] = count
    missing_rank = next((r for r in range(1, max(found) + 1) if r not in found), None)
    if missing_rank is not None:
        raise CheckpointError(f"{printable(folder)}: holds no shard-{missing_rank:05d}-*.safetensors, the files of "
                              f"rank {missing_rank} of {max(found)}; copy the whole folder")
    for rank, indexes in found.items():
        count = max(indexes.values())
        absent = [i for i in range(1, count + 1) if i not in indexes]
        if absent or set(indexes.values()) != {count}:
            i = absent[0] if absent else max(indexes)
            raise CheckpointError(f"{printable(folder)}: rank {rank}'s file {i} of {count} "
                                  f"(shard-{rank:05d}-model-{i:05d}-of-{count:05d}.safetensors) is missing or "
                                  "numbered otherwise; copy the whole folder")
    return [os.path.join(folder, f"shard-{r:05d}-model-{i:05d}-of-{found[r][i]:05d}{SUFFIX}")
            for r in sorted(found) for i in sorted(found[r])]


def _sharding(file: str, tensors: dict, metadata: dict[str, str]) -> dict[str, tuple[tuple[int, ...], LazyTensor]]:
    """Each tensor of ``file`` with its block's offsets in the whole, from ``DCP_SHARDING_INFO``."""
    where = printable(file)
    text = metadata.get(DCP_SHARDING_INFO)
    if text is None:
        raise CheckpointError(f"{where}: has no {DCP_SHARDING_INFO} in its __metadata__, so where its blocks lie is "
                              f"unknown; {_HOW}")
    info = load_json(text, where, f"its {DCP_SHARDING_INFO}")
    if type(info) is not dict:
        raise CheckpointError(f"{where}: its {DCP_SHARDING_INFO} is not a JSON object; {_HOW}")
    extra = sorted(set(info) - set(tensors)) or sorted(set(tensors) - set(info))
    if extra:
        raise CheckpointError(f"{where}: its {DCP_SHARDING_INFO} and its tensors differ on {quote(extra[0])}; {_HOW}")
    out = {}
    dims = limit("dims")
    for name, tensor in tensors.items():
        entry = info[name]
        offsets = entry.get("saved_offsets") if type(entry) is dict else None
        shape = tensor.spec.shape
        if type(offsets) is not list or len(offsets) != len(shape) or len(offsets) > dims or \
                any(type(o) is not int or not 0 <= o < 2**62 for o in offsets):
            raise CheckpointError(f"{where}: the block of {quote(name)} {list(shape)} is at saved_offsets "
                                  f"{quote(repr(offsets)[:80])}, not one offset per dimension; {_HOW}")
        out[name] = (tuple(offsets), tensor)
    return out
