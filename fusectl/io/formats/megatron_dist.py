"""Megatron-LM torch_dist checkpoints (``ckpt_format="torch_dist"``), read as one checkpoint without torch.

megatron-core's ``dist_checkpointing.save`` writes, in the iteration folder
(``iter_0000010/``, named by the save folder's ``latest_checkpointed_iteration.txt`` as for the
legacy format, :mod:`.megatron`):

- ``metadata.json``: ``{"sharded_backend": "torch_dist", "sharded_backend_version": 1,
  "common_backend": "torch", ...}`` — the backend that wrote the tensors;
- ``common.pt``: a ``torch.save`` of everything not sharded: ``args`` (an
  ``argparse.Namespace``: the TP, PP and EP sizes, ``num_layers`` …), ``iteration`` …;
- a torch.distributed.checkpoint folder (``.metadata``, ``__R_I.distcp``: :mod:`.dcp`) whose
  tensors are global: ``embedding.word_embeddings.weight``, ``output_layer.weight``,
  ``decoder.final_layernorm.weight`` as they are, and every layer's tensors stacked into one
  per name with a leading ``[num_layers]`` axis (``decoder.layers.self_attention.linear_qkv.weight``
  [2, 32, 16]); ``linear_fc1`` stored TP-invariant as ``[gate_all; up_all]`` (the TP=1 layout
  already); the two norms under Transformer Engine's names even from the local spec
  (``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``);
  byte items (DCP values): each linear's ``_extra_state/shard_L_N`` per layer and the RNG state
  ``rng_state/shard_P.T_PP.TP`` per rank (numpy's MT19937 state among them);
- MoE (SequentialMLP, ``experts.local_experts.N`` in the model): the router stacked like any
  layer tensor (``decoder.layers.mlp.router.weight`` [layers, experts, hidden]) and each expert
  tensor stacked over layers AND experts, the experts numbered globally whatever the EP rank
  that wrote them: ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` [layers, experts,
  2·ffn, hidden] (``[gate; up]``, written as two chunks) and ``…linear_fc2.weight``;
- a tied model at PP > 1: the last stage's copy of the embedding (its head) is saved as a replica
  of ``embedding.word_embeddings.weight``, so the files hold one tensor, as the TP=1 model does.

:func:`read_megatron_dist` gives megatron-core's TP=1 model, the names and tensors
``dist_checkpointing.load`` into a TP=1 GPTModel of the local spec gives (bitwise): each stacked
tensor unstacked into ``decoder.layers.L.…`` — a layer of a row-major stacked tensor is a
contiguous byte range of each chunk that holds it, so a layer is file ranges (or blocks of
them where the ranks cut it along another axis), never the stacked tensor read whole —, the
Transformer Engine norm names given the local spec's (``input_layernorm``,
``pre_mlp_layernorm``), each stacked expert tensor unstacked twice into
``decoder.layers.L.mlp.experts.local_experts.E.…``, in megatron-core's module order (each
layer's tensors in the index's order, its experts expert by expert where the first expert tensor
stands, the layers where the first stacked tensor stands). Every other tensor keeps its name.
The byte items are not model tensors: they are listed in ``ignored`` and never opened (their
storage and file are checked to be there) — so the RNG state's numpy arrays are never
unpickled, and no allow-list grows for them.

``common.pt`` is read through ``torch_file``'s scanned, allow-listed unpickler with the legacy
reader's Megatron records (the ``args`` Namespace, megatron-core's enums): nothing is imported or
run. Checked before anything is written, each a CheckpointError naming the file: a
``metadata.json`` naming another backend (``zarr``) or none, a missing ``common.pt`` or one
without Megatron's ``args``, a stacked tensor whose first dimension is not ``args.num_layers``,
stacked experts whose second is not ``args.num_experts``, experts stacked under another name
(TEGroupedMLP's ``experts.linear_fc1.weight``, not reachable on CPU to check its layout), which
fusectl does not unstack; and everything :class:`~.dcp.DcpFolder` checks of the DCP part (an
expert's chunk missing: its pieces do not tile the tensor).
"""

from __future__ import annotations

import os
import re
from typing import Callable

from ...errors import CheckpointError, printable, quote
from ...tensors import LazyTensor, RangesTensor, TensorSpec
from ..contents import Contents
from ..provenance import METADATA_KEY
from ..sniff import MEGATRON_DIST_COMMON as COMMON, MEGATRON_DIST_METADATA as METADATA_JSON
from ..untrusted import read_json_file
from .chunks import Blocks, assemble, rows
from .dcp import DcpFolder
from .megatron import RECORDS, Parallelism, iteration_folder
from .torch_file import read_torch_tree

BACKEND = "torch_dist"
_STACKED = re.compile(r"decoder\.layers\.([^0-9].*)")  # a stacked tensor: no layer number after the prefix
# SequentialMLP's experts, stacked over layers and experts: [num_layers, num_experts, …]
_EXPERTS = re.compile(r"decoder\.layers\.(.*\.experts\.)experts\.(.*)")
# Transformer Engine's names of the fused norms → the local spec's (megatron-core's TP=1 model)
_TE_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
_LOCAL_NORMS = {local: te for te, local in _TE_NORMS.items()}
_LAYER = re.compile(r"decoder\.layers\.([0-9]+)\.(.*)")  # a tensor of megatron-core's TP=1 model's layer
_LOCAL_EXPERT = re.compile(r"(.*\.experts\.)local_experts\.([0-9]+)\.(.*)")
_HOW = "give the folder Megatron-LM's dist_checkpointing.save wrote (or its iter_NNNNNNN folder) as it left it"


def layer_name(key: str, layer: int, expert: int | None = None) -> str:
    """The TP=1 model's name of layer ``layer``'s slice (and expert ``expert``'s, for stacked
    experts) of the stacked tensor ``key``: the inverse of :func:`stacked_slot`.

    >>> layer_name("decoder.layers.self_attention.linear_qkv.layer_norm_weight", 1)
    'decoder.layers.1.input_layernorm.weight'
    >>> layer_name("decoder.layers.mlp.experts.experts.linear_fc2.weight", 0, 3)
    'decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight'
    """
    if expert is not None:
        place, rest = _EXPERTS.fullmatch(key).groups()
        return f"decoder.layers.{layer}.{place}local_experts.{expert}.{rest}"
    rest = _STACKED.fullmatch(key).group(1)
    return f"decoder.layers.{layer}.{_TE_NORMS.get(rest, rest)}"


def stacked_slot(name: str) -> tuple[str, tuple[int, ...]] | None:
    """Where dist_checkpointing stores the TP=1 model's tensor ``name``: (the stacked key, its
    index there: the layer, or the layer and the expert); None for a tensor stored as it is
    (the embedding, the final norm, the output layer). The inverse of :func:`layer_name`.

    >>> stacked_slot("decoder.layers.1.input_layernorm.weight")
    ('decoder.layers.self_attention.linear_qkv.layer_norm_weight', (1,))
    >>> stacked_slot("decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight")
    ('decoder.layers.mlp.experts.experts.linear_fc2.weight', (0, 3))
    """
    m = _LAYER.fullmatch(name)
    if m is None:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    expert = _LOCAL_EXPERT.fullmatch(rest)
    if expert is not None:
        place, number, tail = expert.groups()
        return f"decoder.layers.{place}experts.{tail}", (layer, int(number))
    return f"decoder.layers.{_LOCAL_NORMS.get(rest, rest)}", (layer,)


def read_megatron_dist(path: str, key: str | None = None,
                       check_link: Callable[[str], None] | None = None) -> Contents:
    """The :class:`~fusectl.io.contents.Contents` of a Megatron-LM torch_dist checkpoint: its
    save folder (``latest_checkpointed_iteration.txt`` names the iteration) or an iteration folder.

    :param path: the folder.
    :param key: unused (the registry row takes no key).
    :param check_link: called with each file before it is read (the input's link boundary).
    :returns: megatron-core's TP=1 model (module docstring) as ``tensors`` in its module order,
        the byte items in ``ignored``, fusectl's record where fusectl wrote the save (kept in
        ``common.pt``'s archive, which ``torch.load`` does not read), ``distributed`` tp, pp,
        ep, num_layers, iteration (from ``common.pt``'s args) and world_size (the ranks whose
        files the folder holds).
    :raises CheckpointError: naming the file and what is wrong with it (module docstring).

    >>> read_megatron_dist("fixtures/megatron/gpt-tp2-torch_dist").distributed["num_layers"]  # doctest: +SKIP
    2
    """
    check = check_link or _no_check
    folder, latest = iteration_folder(path, check)
    meta = os.path.join(folder, METADATA_JSON)
    _check_backend(meta, check)
    common_path, common, record = _common(folder, check)
    par = Parallelism.of(common, common_path)
    dcp = DcpFolder(folder, check)
    stacked = [fqn for fqn in dcp.entries if dcp.is_tensor(fqn) and _STACKED.fullmatch(fqn)]
    tensors: dict[str, LazyTensor] = {}
    ignored: list[str] = []
    for fqn in dcp.entries:
        if not dcp.is_tensor(fqn):
            dcp.value_file(fqn)  # listed, never opened
            ignored.append(fqn)
        elif fqn not in stacked:
            tensors[fqn] = dcp.tensor(fqn).opened
        elif fqn == stacked[0]:
            tensors.update(_unstacked(dcp, stacked, par, common_path, folder))
    iteration = common.get("iteration")
    distributed = {"tp": par.tp, "pp": par.pp, "ep": par.ep, "num_layers": par.num_layers,
                   "iteration": iteration if type(iteration) is int else None, "world_size": len(dcp.ranks())}
    read = [*([latest] if latest else []), meta, common_path, *dcp.read_files()]
    return Contents(tensors, read, record, record.get(METADATA_KEY), ignored=ignored, distributed=distributed)


def saved_args(path: str, check_link: Callable[[str], None] | None = None) -> dict[str, object]:
    """The fields of the ``args`` Namespace in the save's ``common.pt``: the sizes a writer of
    the model needs (head counts, query groups, ``num_experts`` …).

    :raises CheckpointError: as :func:`read_megatron_dist` for a folder without ``common.pt`` or args."""
    check = check_link or _no_check
    folder, _ = iteration_folder(path, check)
    common_path, common, _ = _common(folder, check)
    Parallelism.of(common, common_path)
    return dict(common["args"].state)


def _common(folder: str, check: Callable[[str], None]) -> tuple[str, dict, dict[str, str]]:
    """(the path of ``common.pt``, its dict, fusectl's record in its archive: the provenance of a
    save fusectl wrote, :mod:`.megatron_dist_writer`)."""
    path = os.path.join(folder, COMMON)
    check(path)
    if not os.path.lexists(path):
        raise CheckpointError(f"{printable(path)}: missing; a torch_dist checkpoint keeps Megatron's args there; {_HOW}")
    common, record = read_torch_tree(path, records=RECORDS)
    if not isinstance(common, dict):
        raise CheckpointError(f"{printable(path)}: holds no dict, not the common state Megatron-LM saves; {_HOW}")
    return path, common, record


def _check_backend(meta: str, check: Callable[[str], None]) -> None:
    """Refuse a ``metadata.json`` that does not say torch_dist wrote the tensors."""
    check(meta)
    if not os.path.lexists(meta):
        raise CheckpointError(f"{printable(meta)}: missing; dist_checkpointing.save writes it beside the tensors; "
                              f"{_HOW}")
    raw = read_json_file(meta, "dist_checkpointing's metadata")
    backend = raw.get("sharded_backend") if type(raw) is dict else None
    if backend != BACKEND:
        shown = quote(backend) if type(backend) is str else "no backend"
        raise CheckpointError(f"{printable(meta)}: names {shown} as sharded_backend; fusectl reads Megatron's "
                              f"{BACKEND!r} checkpoints only — convert it with Megatron's dist_checkpointing to "
                              f"{BACKEND!r} first")


def _unstacked(dcp: DcpFolder, stacked: list[str], par: Parallelism, common: str, folder: str) -> dict[str, LazyTensor]:
    """Every layer's tensors, layer by layer, each layer's in the index's order; the experts of a
    layer (stacked over layers and experts) expert by expert where the first of them stands."""
    whole = {}
    for fqn in stacked:
        tensor = dcp.tensor(fqn).opened
        shape = tensor.spec.shape
        if not shape or shape[0] != par.num_layers:
            raise CheckpointError(f"{dcp.where}: the stacked tensor {quote(fqn)} is {tensor.spec}, its first dimension "
                                  f"not the {par.num_layers} layers {printable(common)}'s args.num_layers says; the "
                                  "files are of two saves")
        if ".experts." in fqn:
            _check_experts(dcp, fqn, tensor, par, common)
        whole[fqn] = tensor
    experts = [fqn for fqn in whole if _EXPERTS.fullmatch(fqn)]
    out = {}
    for layer in range(par.num_layers):
        for fqn, tensor in whole.items():
            if fqn in experts[1:]:
                continue
            if fqn in experts:
                for expert in range(par.num_experts or 0):
                    for each in experts:
                        out[layer_name(each, layer, expert)] = _slab(_slab(whole[each], layer, folder), expert, folder)
                continue
            out[layer_name(fqn, layer)] = _slab(tensor, layer, folder)
    return out


def _check_experts(dcp: DcpFolder, fqn: str, tensor: LazyTensor, par: Parallelism, common: str) -> None:
    """Refuse a stacked expert tensor that is not SequentialMLP's ``[layers, experts, …]``.

    :raises CheckpointError: naming the key: grouped experts (``experts.linear_fc1.weight``
        of TEGroupedMLP), or a second dimension that is not ``args.num_experts``."""
    if not _EXPERTS.fullmatch(fqn):
        raise CheckpointError(f"{dcp.where}: holds {quote(fqn)}, MoE experts fusectl does not know how "
                              "dist_checkpointing stacked (it reads SequentialMLP's "
                              "'decoder.layers.mlp.experts.experts.linear_fc1.weight' [layers, experts, …]); save "
                              "the checkpoint with Megatron-LM's legacy format (ckpt_format 'torch') instead")
    shape = tensor.spec.shape
    if par.num_experts is None or len(shape) < 2 or shape[1] != par.num_experts:
        said = f"the {par.num_experts} experts" if par.num_experts else "no experts:"
        raise CheckpointError(f"{dcp.where}: the stacked experts {quote(fqn)} are {tensor.spec}, its second "
                              f"dimension not {said} {printable(common)}'s args.num_experts says; the files are of "
                              "two saves")


def _slab(tensor: LazyTensor, index: int, folder: str) -> LazyTensor:
    """``tensor[index]`` (along the first axis), streamed: the file ranges of that slice, or
    the blocks that hold it, each cut to it."""
    spec = TensorSpec(tensor.spec.dtype, tensor.spec.shape[1:])
    if isinstance(tensor, Blocks):
        pieces = [(offsets[1:], _slab(item, index - offsets[0], folder)) for offsets, item in tensor.pieces
                  if offsets[0] <= index < offsets[0] + item.spec.shape[0]]
        return assemble(spec, pieces)
    never = "torch.distributed.checkpoint never writes one; the file is corrupt"
    return RangesTensor(spec, rows(tensor, index, 1, printable(folder), never).ranges)


def _no_check(path: str) -> None:
    return None
