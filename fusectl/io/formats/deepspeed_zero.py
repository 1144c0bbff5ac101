"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3), read without torch or DeepSpeed.

``engine.save_checkpoint(DIR)`` writes a save folder whose ``latest`` file names the tag folder
(``global_step3/``) that holds, for a data-parallel world of N ranks:

- the model states: ``mp_rank_00_model_states.pt`` (ZeRO 1/2), or one
  ``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank (ZeRO 3): ``param_shapes`` (per flat
  group, name → shape, in the order the group holds them), ``buffer_names`` beside the
  ``module`` state dict that holds the buffers, ``frozen_param_shapes`` with
  ``frozen_param_fragments``, and ``shared_params`` (a tied name → the name kept);
- the optimizer states, ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` per rank: the fp32
  master weights and the base optimizer's state (Adam's moments), partitioned over the ranks.
  ZeRO 1/2 flatten each param group and cut it into one contiguous slice per rank
  (``single_partition_of_fp32_groups``, the last rank's padding cut off; the moments in
  ``base_optimizer_state`` keep it), the parameters one after another in ``param_shapes``
  order (``param_alignment_paddings`` between them where recorded). ZeRO 3 cuts each parameter
  on its own into ``ceil(numel / N)`` elements per rank, one after another in each rank's
  ``fp32_flat_groups`` (one per sub-group; the last rank's piece padded), the moments in
  ``optimizer_state_dict`` laid out alike.

In mixed precision (a ``bf16`` or ``fp16`` section in the DeepSpeed config) the model states'
``module`` holds the 16-bit weights (ZeRO 3: empty placeholders) and the optimizer states the
fp32 master weights, laid out as above; with bf16 every optimizer file is named ``bf16_…``.
bf16 with ZeRO 1 and fp32 gradient accumulation (``data_types.grad_accum_dtype``) is DeepSpeed's
``BF16_Optimizer``, whose files hold no ``zero_stage``: ZeRO 1's layout, each flat group aligned
to ``2 × N`` elements and cut into N equal partitions, the last rank's padding kept (its moments
alike). DeepSpeed's ``zero_to_fp32`` refuses those files ("not a zero checkpoint");
``ds_to_universal`` reads them.

:func:`read_zero` gives the fp32 master weights as DeepSpeed's ``zero_to_fp32``
(``get_fp32_state_dict_from_zero_checkpoint``) gives them, never the 16-bit copies — the buffers (floating ones as
float32), the frozen parameters, the trained ones in ``param_shapes`` order, then the tied
names — each trained parameter a :class:`~fusectl.tensors.RangesTensor` of the ranges of every
rank's file that hold it: consolidating copies file ranges, it never holds the model. Beside
the weights it gives the training state as one process would save it,
``{"model": state dict, "optimizer": optimizer.state_dict()}``: per parameter id its ``step``
and moments (assembled like the weights, shaped like the parameter) and ``param_groups`` with
DeepSpeed's hyperparameters, the ids and their ``param_names``.

Every file is read through ``torch_file``'s scanned, allow-listed unpickler; DeepSpeed's own
classes (:data:`RECORDS`) are read as inert records: nothing of DeepSpeed is imported or run.
The folder is checked as data before anything is written: a ``latest`` that names anything but
a folder beside it, a rank file missing, world sizes or shapes that disagree between ranks,
partitions whose sizes do not add up to the shapes (with their padding), a tensor past the end
of its file, an optimizer state that is not ZeRO's — each a CheckpointError naming the file.

The pieces a universal checkpoint shares with these (the save folder's tag, the model states,
the training state built from them) live here too: ``deepspeed_universal`` imports them.
"""

from __future__ import annotations

import collections
import math
import os
import re
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from ... import dtypes
from ...dtypes import DType
from ...errors import CheckpointError, InternalError, printable, quote
from ...limits import check_limit, limit
from ...tensors import ByteRange, LazyTensor, RangesTensor, TensorSpec
from ..contents import Contents
from ..optimizer_state import Training
from ..provenance import METADATA_KEY
from ..sniff import DEEPSPEED_LATEST
from ..untrusted import open_input
from .torch_file import Record, Records, described, read_torch_tree

# DeepSpeed's classes its checkpoint files hold, read as inert records (never imported): the
# loss scaler of the optimizer states (its state a dict of numbers), the ZeRO stage (an enum:
# its value), the fragment addresses of ``param_slice_mappings`` (a dataclass of two ints), and
# ``argparse.Namespace``, which Megatron-DeepSpeed keeps as ``args`` beside the model states
RECORDS = Records((
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "argparse.Namespace",
))

MODEL_STATES = "mp_rank_00_model_states.pt"  # ZeRO 1/2's (and a universal checkpoint's)
_MODEL_STATES = re.compile(r"mp_rank_([0-9]{1,6})_model_states\.pt")
_RANK_MODEL_STATES = re.compile(r"zero_pp_rank_([0-9]{1,6})_mp_rank_([0-9]{1,6})_model_states\.pt")
_OPTIM_STATES = re.compile(r"(bf16_)?zero_pp_rank_([0-9]{1,6})_mp_rank_([0-9]{1,6})_optim_states\.pt")
_EXPERT_STATES = re.compile(r"(expp_rank_[0-9]+|layer_[0-9]+_expert_[0-9]+|expert_[0-9]+)_mp_rank_.*\.pt")
_TAG_BYTES = 255  # a tag is a folder's name
_STAGES = {1: "optimizer_states", 2: "gradients", 3: "weights"}  # ZeroStageEnum's members
# what BF16_Optimizer.state_dict() always holds (beside ds_version, param_slice_mappings and,
# where recorded, universal_checkpoint_info); ZeRO's optimizers hold a loss_scaler, it none
_BF16_OPTIMIZER = frozenset({"clip_grad", "base_optimizer_state", "single_partition_of_fp32_groups",
                             "group_paddings", "partition_count"})
_F32 = dtypes.BY_NAME["F32"]
_HOW = "give the folder engine.save_checkpoint wrote (or its tag folder, global_stepN) as DeepSpeed left it"


# ------------------------------------------------------------------------------- the folder


def tag_folder(path: str, latest: str, check_link: Callable[[str], None]) -> tuple[str, str | None]:
    """(the tag folder of the DeepSpeed checkpoint at ``path``, the file that named it or None):
    ``path`` itself when it holds a model states file, else the folder its ``latest`` file
    (``latest_universal`` for a universal checkpoint) names. That file is untrusted: it must
    hold the plain name of a folder beside it (``global_step3``), never a path.

    :raises CheckpointError: no model states and no ``latest``; a ``latest`` that holds a path,
        ``..``, no name, or the name of nothing that is a folder.
    """
    names = listing(path)
    if any(_MODEL_STATES.fullmatch(n) or _RANK_MODEL_STATES.fullmatch(n) for n in names):
        return path, None
    marker = os.path.join(path, latest)
    if latest not in names:
        raise CheckpointError(f"{printable(path)}: holds no DeepSpeed model states file ({MODEL_STATES}) and no "
                              f"{quote(latest)} file naming its tag folder; {_HOW}")
    check_link(marker)
    with open_input(marker) as f:
        raw = f.read(_TAG_BYTES + 1)
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = ""
    if len(raw) > _TAG_BYTES or not tag or tag in (".", "..") or not tag.isprintable() or \
            any(c in tag for c in "/\\"):
        shown = f"{len(raw)}+ bytes" if len(raw) > _TAG_BYTES else quote(raw.decode("utf-8", "replace"))
        raise CheckpointError(f"{printable(marker)}: holds {shown}, not the name of a tag folder beside it (DeepSpeed "
                              "writes one such as 'global_step3'); fusectl follows no path out of the folder — "
                              "give the tag folder itself")
    folder = os.path.join(path, tag)
    check_link(folder)
    if not os.path.isdir(folder):
        raise CheckpointError(f"{printable(marker)}: names {quote(tag)}, which is not a folder in {printable(path)}; "
                              "the checkpoint is incomplete — give the tag folder itself")
    return folder, marker


def listing(path: str) -> list[str]:
    """The names in the folder ``path``, sorted; CheckpointError naming it when it cannot be listed."""
    try:
        return sorted(os.listdir(path))
    except OSError as e:
        raise CheckpointError(f"{printable(path)}: cannot list it ({e.strerror})") from e


def read_tree(path: str, check_link: Callable[[str], None], *, with_record: bool = False):
    """The object of a DeepSpeed ``.pt`` file (``check_link`` first), its classes :data:`RECORDS`;
    CheckpointError for one that is not a dict. ``with_record``: (it, fusectl's record)."""
    check_link(path)
    tree, record = read_torch_tree(path, records=RECORDS)
    if not isinstance(tree, dict):
        raise CheckpointError(f"{printable(path)}: holds {described(tree)}, not the dict DeepSpeed saves; {_HOW}")
    return (tree, record) if with_record else tree


@dataclass(frozen=True)
class _RankFiles:
    """The files of a tag folder: ``model`` the model states (one for ZeRO 1/2, one per rank for
    ZeRO 3, by rank), ``optim`` each rank's optimizer states, by rank."""

    model: dict[int, str]
    shared_model: str | None
    optim: dict[int, str]


def _rank_files(folder: str) -> _RankFiles:
    model, optim, shared = {}, {}, None
    for name in listing(folder):
        path = os.path.join(folder, name)
        if _EXPERT_STATES.fullmatch(name):
            raise CheckpointError(f"{printable(path)}: an expert-parallel (MoE) file; fusectl reads data-parallel "
                                  "ZeRO checkpoints, not DeepSpeed's expert files")
        found = _OPTIM_STATES.fullmatch(name) or _RANK_MODEL_STATES.fullmatch(name)
        single = _MODEL_STATES.fullmatch(name)
        mp = int(found.groups()[-1]) if found else int(single.group(1)) if single else 0
        if mp != 0:
            raise CheckpointError(f"{printable(path)}: the file of model-parallel rank {mp}; fusectl reads "
                                  "data-parallel ZeRO checkpoints (mp_rank_00 only), not tensor- or pipeline-parallel "
                                  "ones")
        if single:
            shared = path
        elif found is not None:
            rank = int(found.group(2) if found.re is _OPTIM_STATES else found.group(1))
            files = optim if found.re is _OPTIM_STATES else model
            if rank in files:
                raise CheckpointError(f"{printable(folder)}: two files for rank {rank}, "
                                      f"{quote(os.path.basename(files[rank]))} and {quote(name)}; remove the one an "
                                      "older save left")
            files[rank] = path
    return _RankFiles(model, shared, optim)


# ------------------------------------------------------------------------------- the model states


@dataclass(frozen=True)
class ModelStates:
    """What a model states file says of the model: ``groups`` per flat group its parameters
    (name, shape) in the group's order; ``buffers`` (name, tensor) in the state dict's order;
    ``frozen`` (name, shape) of the parameters no optimizer trains, ``fragments`` their tensors
    in this file; ``shared`` (tied name, the name kept); ``world_size`` (``dp_world_size``,
    None where absent), the file's whole ``tree`` and fusectl's ``record`` in it (a universal
    checkpoint fusectl wrote keeps its provenance there; empty otherwise)."""

    path: str
    groups: list[list[tuple[str, tuple[int, ...]]]]
    buffers: list[tuple[str, LazyTensor]]
    frozen: list[tuple[str, tuple[int, ...]]]
    fragments: Mapping[str, object]
    shared: list[tuple[str, str]]
    world_size: int | None
    tree: dict
    record: Mapping[str, str]

    @classmethod
    def read(cls, path: str, check_link: Callable[[str], None]) -> "ModelStates":
        """The model states file at ``path``, checked as data.

        :raises CheckpointError: an entry missing or of another kind than DeepSpeed writes,
            naming the file and the entry."""
        tree, record = read_tree(path, check_link, with_record=True)
        groups = []
        for g, group in enumerate(_list(_entry(tree, "param_shapes", path), path, "param_shapes")):
            groups.append(_shapes(group, path, f"param_shapes[{g}]"))
        frozen = _shapes(tree.get("frozen_param_shapes") or {}, path, "frozen_param_shapes")
        fragments = tree.get("frozen_param_fragments") or {}
        if not isinstance(fragments, dict):
            raise _corrupt(path, "frozen_param_fragments", fragments, "a dict of name → tensor")
        module = _entry(tree, "module", path)
        if not isinstance(module, dict):
            raise _corrupt(path, "module", module, "a state dict")
        names = _list(tree.get("buffer_names") or [], path, "buffer_names")
        if not all(type(n) is str for n in names):
            raise _corrupt(path, "buffer_names", names, "a list of names")
        wanted = set(names)
        buffers = [(k, v) for k, v in module.items() if k in wanted]
        for k, v in buffers:
            if not isinstance(v, LazyTensor):
                raise _corrupt(path, f"module.{k}", v, "a tensor (a buffer_names entry)")
        shared = tree.get("shared_params") or {}
        if not isinstance(shared, dict) or not all(type(k) is str and type(v) is str for k, v in shared.items()):
            raise _corrupt(path, "shared_params", shared, "a dict of tied name → the name kept")
        world = tree.get("dp_world_size")
        return cls(path, groups, buffers, frozen, fragments, list(shared.items()),
                   world if type(world) is int else None, tree, record)

    def names(self) -> list[str]:
        """The trained parameters' names, group after group."""
        return [n for group in self.groups for n, _ in group]


def _shapes(node: object, path: str, what: str) -> list[tuple[str, tuple[int, ...]]]:
    if not isinstance(node, dict):
        raise _corrupt(path, what, node, "a dict of parameter name → shape")
    dims = limit("dims")
    out = []
    for name, shape in node.items():
        if type(name) is not str or type(shape) not in (tuple, list) or len(shape) > dims or \
                not all(type(n) is int and n >= 0 for n in shape):
            raise _corrupt(path, f"{what}.{name}", shape, "a shape (a tuple of sizes) under a parameter's name")
        out.append((name, tuple(shape)))
    return out


# ------------------------------------------------------------------------------- ZeRO checkpoints


def read_zero(path: str, key: str | None = None, check_link: Callable[[str], None] | None = None) -> Contents:
    """The :class:`~fusectl.io.contents.Contents` of a DeepSpeed ZeRO checkpoint folder: its save
    folder (``latest`` names the tag folder) or a tag folder (``global_stepN/``).

    :param path: the folder.
    :param key: unused (the registry row takes no key).
    :param check_link: called with each file before it is read (the input's link boundary).
    :returns: the fp32 master weights (module docstring) as ``tensors``, ``aliases`` its tied
        names, ``order`` zero_to_fp32's, ``training`` the model and the optimizer's state dict,
        ``variant`` ``"deepspeed-zero1"`` … ``"deepspeed-zero3"``, ``distributed`` the world
        size, stage and tag.
    :raises CheckpointError: naming the file and what is wrong with it (module docstring).

    >>> read_zero("fixtures/distributed/zero2").variant  # doctest: +SKIP
    'deepspeed-zero2'
    """
    check = check_link or _no_check
    folder, latest = tag_folder(path, DEEPSPEED_LATEST[0], check)
    files = _rank_files(folder)
    if not files.optim:
        raise CheckpointError(f"{printable(folder)}: no ZeRO optimizer states files (zero_pp_rank_R_mp_rank_00_"
                              "optim_states.pt): not a ZeRO checkpoint (stage 0 keeps its optimizer in the model "
                              f"states, which fusectl does not read), or its files were removed; {_HOW}")
    first = files.optim[min(files.optim)]
    optim = {first: _optimizer_states(read_tree(first, check), first)}
    stage, world = optim[first].stage, optim[first].world
    prefix = "bf16_" if os.path.basename(first).startswith("bf16_") else ""
    for rank in range(world):
        if rank not in files.optim:
            missing = os.path.join(folder, f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
            raise CheckpointError(f"{printable(missing)}: missing; {printable(first)} was written by {world} ranks, "
                                  "and every rank's file is needed")
    for rank in sorted(files.optim):
        file = files.optim[rank]
        if rank >= world:
            raise CheckpointError(f"{printable(file)}: the file of rank {rank}, but {printable(first)} says {world} "
                                  "ranks wrote the checkpoint; the folder mixes two saves — remove the stale files")
        if file not in optim:
            optim[file] = _optimizer_states(read_tree(file, check), file)
        if (optim[file].stage, optim[file].world) != (stage, world):
            raise CheckpointError(f"{printable(file)}: ZeRO stage {optim[file].stage} on {optim[file].world} ranks, "
                                  f"but {printable(first)} says stage {stage} on {world}; the folder mixes two saves")
    ranks = [optim[files.optim[r]] for r in range(world)]
    model_files = _model_files(folder, files, stage, world)
    states = [ModelStates.read(f, check) for f in model_files]
    if states[0].world_size not in (None, world):
        raise CheckpointError(f"{printable(states[0].path)}: dp_world_size {states[0].world_size}, but {world} ranks "
                              "wrote the optimizer states; the folder mixes two saves")
    for other in states[1:]:
        if other.groups != states[0].groups or other.frozen != states[0].frozen:
            raise CheckpointError(f"{printable(other.path)}: its param_shapes (or frozen_param_shapes) differ from "
                                  f"{printable(states[0].path)}'s; the ranks disagree on the model's shapes — the "
                                  "folder mixes two saves")
    layout = _Stage3 if stage == 3 else _Stage12
    weights, moments = layout(states[0], ranks).assemble()
    frozen = frozen_stage3(states, world) if stage == 3 else frozen_parameters(states[0])
    groups = ranks[0].param_groups
    names = group_names(groups, states[0].groups, ranks[0].path)
    read = [*([latest] if latest else []), *model_files, *(files.optim[r] for r in range(world))]
    distributed = {"world_size": world, "stage": stage, "tag": os.path.basename(os.path.normpath(folder))}
    version = states[0].tree.get("ds_version")
    if type(version) is str:
        distributed["ds_version"] = version
    if ranks[0].bf16_optimizer:
        distributed["optimizer"] = "BF16_Optimizer"
    return training_contents(path, read, states[0], weights, frozen, groups, names, moments,
                             f"deepspeed-zero{stage}", distributed)


def _no_check(path: str) -> None:
    return None


def _model_files(folder: str, files: _RankFiles, stage: int, world: int) -> list[str]:
    """The model states files stage ``stage`` writes: the one, or each rank's (ZeRO 3)."""
    if stage != 3:
        if files.shared_model is None:
            raise CheckpointError(f"{printable(os.path.join(folder, MODEL_STATES))}: missing; a ZeRO-{stage} "
                                  f"checkpoint keeps its parameters' shapes there; {_HOW}")
        return [files.shared_model]
    for rank in range(world):
        if rank not in files.model:
            name = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
            raise CheckpointError(f"{printable(os.path.join(folder, name))}: missing; a ZeRO-3 checkpoint of {world} "
                                  "ranks has one model states file per rank, and every one is needed")
    extra = sorted(set(files.model) - set(range(world)))
    if extra:
        raise CheckpointError(f"{printable(files.model[extra[0]])}: the model states of rank {extra[0]}, but {world} "
                              "ranks wrote the optimizer states; the folder mixes two saves")
    return [files.model[r] for r in range(world)]


@dataclass(frozen=True)
class _OptimizerStates:
    """One rank's optimizer states file: its ZeRO ``stage``, the ``world`` size it was
    partitioned over, the ``flats`` (fp32 master partitions, one per flat group), the
    ``param_groups`` of the base optimizer, its ``states`` per flat group (state key → value)
    and ``paddings`` (ZeRO 1/2: per flat group the padding this rank's moments hold past its
    weights' partition; per group the alignment padding after each parameter);
    ``bf16_optimizer`` whether DeepSpeed's ``BF16_Optimizer`` wrote it (ZeRO 1's layout)."""

    path: str
    tree: dict
    stage: int
    world: int
    flats: list[_Flat]
    param_groups: list[dict]
    states: dict[int, dict]
    group_paddings: list[int]
    alignment: list[list[int]] | None
    bf16_optimizer: bool = False


def _optimizer_states(tree: dict, path: str) -> _OptimizerStates:
    node = _entry(tree, "optimizer_state_dict", path)
    if not isinstance(node, dict):
        raise _corrupt(path, "optimizer_state_dict", node, "a dict")
    where = "optimizer_state_dict."
    bf16_optimizer = "zero_stage" not in node and os.path.basename(path).startswith("bf16_") and \
        _BF16_OPTIMIZER <= set(node) and "loss_scaler" not in node
    if "zero_stage" not in node and not bf16_optimizer:
        raise CheckpointError(f"{printable(path)}: its optimizer state has no zero_stage and is not DeepSpeed's "
                              f"BF16_Optimizer's (a bf16_ file holding {', '.join(sorted(_BF16_OPTIMIZER))} and no "
                              "loss_scaler): not a ZeRO checkpoint fusectl knows (DeepSpeed's fp16 or bf16 optimizer "
                              "without ZeRO keeps its master weights in a layout fusectl does not read); save with "
                              "ZeRO stage 1-3")
    stage = 1 if bf16_optimizer else stage_of(node["zero_stage"], path)
    count = _entry(node, "partition_count", path, where)
    counts = count if type(count) is list else [count]
    if not counts or not all(type(c) is int and c >= 1 for c in counts) or len(set(counts)) != 1:
        raise _corrupt(path, where + "partition_count", count,
                       "one world size (the same for every param group: fusectl does not read expert-parallel groups)")
    world = counts[0]
    flats_key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    flats = [_flat(v, path, f"{where}{flats_key}[{k}]")
             for k, v in enumerate(_list(_entry(node, flats_key, path, where), path, where + flats_key))]
    base_key = "optimizer_state_dict" if stage == 3 else "base_optimizer_state"
    base = _entry(node, base_key, path, where)
    if type(base) is list:  # ZeRO 1/2's elastic form
        raise CheckpointError(f"{printable(path)}: {where}{base_key} is a list (DeepSpeed's elastic checkpoint), which "
                              "keeps no param groups, so the optimizer's hyperparameters are not in the file; save "
                              "with zero_optimization.elastic_checkpoint false (the default)")
    if not isinstance(base, dict) or not isinstance(base.get("state"), dict) or \
            not isinstance(base.get("param_groups"), list):
        raise _corrupt(path, where + base_key, base, "an optimizer's state_dict (state, param_groups)")
    groups = param_groups(base["param_groups"], path, f"{where}{base_key}.param_groups")
    states = {}
    for sid, entry in base["state"].items():
        if type(sid) is not int or not 0 <= sid < len(flats) or not isinstance(entry, dict) or \
                not all(type(k) is str for k in entry):
            raise _corrupt(path, f"{where}{base_key}.state[{sid!r}]", entry,
                           f"the state of one of the {len(flats)} flat groups")
        states[sid] = entry
    paddings = node.get("group_paddings") or [0] * len(flats)
    if type(paddings) is not list or len(paddings) != len(flats) or \
            not all(type(p) is int and p >= 0 for p in paddings):
        raise _corrupt(path, where + "group_paddings", paddings, f"{len(flats)} paddings")
    alignment = node.get("param_alignment_paddings")
    if alignment is not None and (type(alignment) is not list or not all(
            type(a) is list and all(type(p) is int and p >= 0 for p in a) for a in alignment)):
        raise _corrupt(path, where + "param_alignment_paddings", alignment, "a list of paddings per group")
    return _OptimizerStates(path, node, stage, world, flats, groups, states, paddings, alignment, bf16_optimizer)


def param_groups(node: object, path: str, what: str) -> list[dict]:
    """The base optimizer's ``param_groups`` as saved: dicts of hyperparameters whose
    ``params`` list flat groups by their ids. CheckpointError naming ``what`` otherwise."""
    groups = _list(node, path, what)
    for g, group in enumerate(groups):
        if not isinstance(group, dict) or not all(type(k) is str for k in group) or \
                type(group.get("params")) is not list or not all(type(i) is int for i in group["params"]):
            raise _corrupt(path, f"{what}[{g}]", group, "a param group with its ids")
    return groups


def stage_of(value: object, path: str) -> int:
    if isinstance(value, Record) and value.name.endswith(".ZeroStageEnum") and len(value.args) == 1:
        value = value.args[0]
    if type(value) is not int or value not in _STAGES:
        raise CheckpointError(f"{printable(path)}: zero_stage {described(value)}, not a ZeRO stage 1, 2 or 3 "
                              "(ZeroStageEnum); the file is corrupt or of a DeepSpeed fusectl does not know")
    return value


# ------------------------------------------------------------------------------- the partitions


@dataclass(frozen=True)
class _Flat:
    """A flat tensor of one rank's file: ``numel`` elements of ``dtype`` at one file range."""

    range: ByteRange
    numel: int
    dtype: DType


def _flat(value: object, path: str, what: str) -> _Flat:
    if not isinstance(value, LazyTensor) or len(value.spec.shape) != 1:
        raise _corrupt(path, what, value, "a flat (one-dimensional) tensor")
    ranges = value.byte_ranges()
    if ranges is None or len(ranges) != 1:
        raise CheckpointError(f"{printable(path)}: {quote(what)} is not stored as plain little-endian bytes (it is "
                              "compressed, strided or big-endian), which DeepSpeed never writes; the file is corrupt")
    return _Flat(ranges[0], value.spec.numel, value.spec.dtype)


def _cut(parts: Sequence[_Flat], start: int, count: int) -> list[ByteRange]:
    """The file ranges of elements [start, start + count) of ``parts`` laid end to end."""
    out = []
    for part in parts:
        if count <= 0:
            break
        if start >= part.numel:
            start -= part.numel
            continue
        n = min(count, part.numel - start)
        size = part.dtype.itemsize
        out.append(ByteRange(part.range.path, part.range.offset + start * size, n * size))
        count, start = count - n, 0
    if count > 0:
        raise InternalError(f"{count} elements past the partitions: a bound fusectl checks first")
    return out


# A parameter's place: per piece, (rank, element offset in that rank's flat tensor, count)
_Place = list[tuple[int, int, int]]


class _Layout:
    """Where each trained parameter lies in the ranks' flat tensors of its flat group, and the
    tensors assembled from them: the fp32 weights, each moment of the base optimizer."""

    def __init__(self, states: ModelStates, ranks: Sequence[_OptimizerStates]):
        self.states, self.ranks, self.world = states, ranks, len(ranks)
        first = ranks[0]
        if len(states.groups) != len(first.flats):
            raise CheckpointError(f"{printable(first.path)}: {len(first.flats)} flat groups, but "
                                  f"{printable(states.path)} gives the shapes of {len(states.groups)}; the files are "
                                  "of two saves")
        for rank in ranks[1:]:
            if len(rank.flats) != len(first.flats):
                raise CheckpointError(f"{printable(rank.path)}: {len(rank.flats)} flat groups, {printable(first.path)} "
                                      f"{len(first.flats)}; the ranks disagree — the folder mixes two saves")
        self.places: dict[str, tuple[int, _Place]] = {}

    def place(self, group: int) -> None:
        raise NotImplementedError

    def moment_sizes(self, group: int, rank: int) -> tuple[int, ...]:
        """The element counts a moment of flat group ``group`` may have on ``rank``."""
        raise NotImplementedError

    def assemble(self) -> tuple[dict[str, LazyTensor], dict[str, dict]]:
        """(name → fp32 weight, name → its optimizer state), every parameter of ``param_shapes``."""
        check_limit("tensors", len(self.states.names()), printable(self.states.path))
        for g in range(len(self.states.groups)):
            dtype = self.ranks[0].flats[g].dtype
            for rank in self.ranks:
                if rank.flats[g].dtype != dtype:
                    raise CheckpointError(f"{printable(rank.path)}: flat group {g} is {rank.flats[g].dtype}, "
                                          f"{printable(self.ranks[0].path)}'s {dtype}; the ranks disagree")
            self.place(g)
        shapes = {n: s for group in self.states.groups for n, s in group}
        weights = {}
        for name, (g, place) in self.places.items():
            weights[name] = self._gather([r.flats[g] for r in self.ranks], place, shapes[name])
        moments = {name: {} for name in self.places}
        for g in range(len(self.states.groups)):
            self._moments(g, shapes, moments)
        return weights, moments

    def _gather(self, parts: Sequence[_Flat], place: _Place, shape: tuple[int, ...]) -> RangesTensor:
        ranges = [r for rank, start, count in place for r in _cut([parts[rank]], start, count)]
        return RangesTensor(TensorSpec(parts[0].dtype, shape), tuple(ranges))

    def _moments(self, g: int, shapes: Mapping[str, tuple], out: dict[str, dict]) -> None:
        entries = [rank.states.get(g, {}) for rank in self.ranks]
        keys = list(entries[0])
        for rank, entry in zip(self.ranks, entries):
            if list(entry) != keys:
                raise CheckpointError(f"{printable(rank.path)}: the optimizer state of flat group {g} holds "
                                      f"{sorted(entry)}, {printable(self.ranks[0].path)}'s {sorted(keys)}; the ranks "
                                      "disagree — the folder mixes two saves")
        names = [n for n, (group, _) in self.places.items() if group == g]
        for key in keys:
            value = entries[0][key]
            what = f"the optimizer state {quote(key)} of flat group {g}"
            if isinstance(value, LazyTensor) and len(value.spec.shape) == 1:
                parts = []
                for r, (rank, entry) in enumerate(zip(self.ranks, entries)):
                    part = _flat(entry[key], rank.path, f"state[{g}].{key}")
                    if part.numel not in self.moment_sizes(g, r) or part.dtype != value.spec.dtype:
                        raise CheckpointError(f"{printable(rank.path)}: {what} is {part.dtype}[{part.numel}], but the "
                                              f"weights' partition of that rank holds {rank.flats[g].numel} elements "
                                              f"of {value.spec.dtype}; the moments do not follow the weights' "
                                              "layout, so fusectl cannot tell whose state each element is")
                    parts.append(part)
                for name in names:
                    out[name][key] = self._gather(parts, self.places[name][1], shapes[name])
            elif isinstance(value, LazyTensor) and not value.spec.shape:
                ranges = value.byte_ranges()
                if ranges is None:
                    raise CheckpointError(f"{printable(self.ranks[0].path)}: {what} is not stored as plain bytes; "
                                          "the file is corrupt")
                for name in names:  # each parameter its own tensor: torch's optimizer steps it in place
                    out[name][key] = RangesTensor(value.spec, tuple(ranges))
            elif type(value) in (int, float, bool):
                for name in names:
                    out[name][key] = value
            else:
                raise CheckpointError(f"{printable(self.ranks[0].path)}: {what} is {described(value)}, neither a "
                                      "partition of the moments, one number nor a 0-d tensor; fusectl moves "
                                      "elementwise optimizer state (Adam's, SGD's momentum) only")


class _Stage12(_Layout):
    """ZeRO 1/2: flat group g cut into one contiguous slice per rank; its parameters one after
    another in that concatenation, each followed by its alignment padding."""

    def place(self, g: int) -> None:
        ranks, world = self.ranks, self.world
        sizes = [r.flats[g].numel for r in ranks]
        for r, (rank, n) in enumerate(zip(ranks, sizes)):
            if n > sizes[0] or n < sizes[0] and r < world - 1:  # only the last slice is shorter (its padding cut off)
                raise CheckpointError(f"{printable(rank.path)}: its partition of flat group {g} holds {n} elements, "
                                      f"{printable(ranks[0].path)}'s {sizes[0]}; ZeRO cuts a group in equal slices "
                                      "(the last one's padding left out), so the ranks disagree — a file is "
                                      "truncated, of another save, or edited")
        total = sum(sizes)
        alignment = ranks[0].alignment
        paddings = alignment[g] if alignment is not None and g < len(alignment) else None
        group = self.states.groups[g]
        if paddings is not None and len(paddings) != len(group):
            raise CheckpointError(f"{printable(ranks[0].path)}: {len(paddings)} alignment paddings for flat group {g}, "
                                  f"whose {len(group)} parameters {printable(self.states.path)} lists; the files are "
                                  "of two saves")
        starts = [sum(sizes[:r]) for r in range(world)]
        offset = 0
        for k, (name, shape) in enumerate(group):
            numel = math.prod(shape)
            if offset + numel > total:
                raise self._short(g, total, offset + numel)
            place = []
            for r in range(world):
                lo, hi = max(offset, starts[r]), min(offset + numel, starts[r] + sizes[r])
                if lo < hi:
                    place.append((r, lo - starts[r], hi - lo))
            self._add(name, g, place)
            offset += numel + (paddings[k] if paddings is not None else 0)
        align = 2 * world  # DeepSpeed pads a group to a multiple of it (zero_to_fp32 checks so)
        if -(-offset // align) != -(-total // align):
            raise self._short(g, total, offset)

    def _short(self, g: int, total: int, needed: int) -> CheckpointError:
        files = printable(self.ranks[0].path) + ("" if self.world == 1 else f" … {printable(self.ranks[-1].path)}")
        return CheckpointError(f"{files}: the partitions of flat group {g} hold {total} "
                               f"elements on {self.world} ranks, but the shapes {printable(self.states.path)} gives "
                               f"(with their padding) need {needed}; they do not add up — a rank file is truncated, "
                               "of another save, or edited")

    def moment_sizes(self, g: int, r: int) -> tuple[int, ...]:
        rank = self.ranks[r]
        return rank.flats[g].numel, rank.flats[g].numel + rank.group_paddings[g]

    def _add(self, name: str, g: int, place: _Place) -> None:
        _add(self.places, name, g, place, self.states.path)


class _Stage3(_Layout):
    """ZeRO 3: each parameter of sub-group g cut on its own into ceil(numel / world) elements
    per rank, at the same offset of every rank's flat tensor, one parameter after another."""

    def place(self, g: int) -> None:
        ranks, world = self.ranks, self.world
        size = ranks[0].flats[g].numel
        for rank in ranks[1:]:
            if rank.flats[g].numel != size:
                raise CheckpointError(f"{printable(rank.path)}: its partition of sub-group {g} holds "
                                      f"{rank.flats[g].numel} elements, {printable(ranks[0].path)}'s {size}; ZeRO-3 "
                                      "gives every rank the same share — the folder mixes two saves")
        offset = 0
        for name, shape in self.states.groups[g]:
            numel = math.prod(shape)
            share = -(-numel // world)
            if offset + share > size:
                break
            place = [(r, offset, min(share, numel - r * share)) for r in range(world) if numel > r * share]
            _add(self.places, name, g, place, self.states.path)
            offset += share
        needed = sum(-(-math.prod(s) // world) for _, s in self.states.groups[g])
        if needed != size:
            raise CheckpointError(f"{printable(ranks[0].path)}: each rank's partition of sub-group {g} holds {size} "
                                  f"elements, but the shapes {printable(self.states.path)} gives need {needed} per "
                                  "rank; they do not add up — a rank file is truncated, of another save, or edited")

    def moment_sizes(self, g: int, r: int) -> tuple[int, ...]:
        return (self.ranks[r].flats[g].numel,)


def _add(places: dict, name: str, g: int, place: _Place, path: str) -> None:
    if name in places:
        raise CheckpointError(f"{printable(path)}: param_shapes lists {quote(name)} twice; the file is corrupt")
    places[name] = (g, place)


def frozen_parameters(states: ModelStates) -> dict[str, LazyTensor]:
    """ZeRO 1/2's frozen parameters: each whole in the model states file."""
    out = {}
    for name, shape in states.frozen:
        tensor = states.fragments.get(name)
        if not isinstance(tensor, LazyTensor) or tensor.spec.numel != math.prod(shape):
            raise _corrupt(states.path, f"frozen_param_fragments.{name}", tensor, f"a tensor of shape {list(shape)}")
        out[name] = tensor
    return out


def frozen_stage3(states: Sequence[ModelStates], world: int) -> dict[str, LazyTensor]:
    """ZeRO 3's frozen parameters: each rank's model states file holds ceil(numel / world) of
    each, in rank order."""
    out = {}
    for name, shape in states[0].frozen:
        numel = math.prod(shape)
        share = -(-numel // world)
        parts = []
        for s in states:
            part = _flat(s.fragments.get(name), s.path, f"frozen_param_fragments.{name}")
            if part.numel < share:
                raise _corrupt(s.path, f"frozen_param_fragments.{name}", s.fragments.get(name),
                               f"a flat tensor of at least {share} elements")
            parts.append(part)
        place = [(r, 0, min(share, numel - r * share)) for r in range(world) if numel > r * share]
        ranges = [r for rank, start, count in place for r in _cut([parts[rank]], start, count)]
        out[name] = RangesTensor(TensorSpec(parts[0].dtype, shape), tuple(ranges))
    return out


# ------------------------------------------------------------------------------- the training state


def group_names(param_groups: Sequence[dict], shapes: Sequence[Sequence[tuple[str, tuple]]],
                path: str) -> list[list[str]]:
    """The parameters of each of the base optimizer's ``param_groups``, by name: a group's ids
    are flat groups (ZeRO 3: sub-groups), whose parameters ``shapes`` (``param_shapes``) lists.

    :raises CheckpointError: ids that are not each flat group once."""
    ids = [i for g in param_groups for i in g["params"]]
    if sorted(ids) != list(range(len(shapes))):
        raise CheckpointError(f"{printable(path)}: the optimizer's param groups list the flat groups {ids}, not each "
                              f"of the {len(shapes)} once; the file is corrupt or of another save")
    return [[n for i in g["params"] for n, _ in shapes[i]] for g in param_groups]


def training_contents(path: str, files: list[str], states: ModelStates, weights: Mapping[str, LazyTensor],
                      frozen: Mapping[str, LazyTensor], param_groups: Sequence[dict], names: Sequence[Sequence[str]],
                      moments: Mapping[str, dict], variant: str, distributed: dict) -> Contents:
    """The :class:`Contents` of a DeepSpeed checkpoint from its parts: the state dict in
    ``zero_to_fp32``'s order (buffers, floating ones as float32; ``frozen``; ``weights`` in
    ``param_shapes`` order; then the names ``shared_params`` ties, as aliases), and the training
    tree ``{"model": that state dict (a tied name the same tensor), "optimizer": {"state",
    "param_groups"}}``: ids 0..n-1 over ``param_groups`` (each a group's hyperparameters as
    DeepSpeed saved them, its ``params`` and ``param_names`` ``names``), each id's state
    ``moments[name]``.

    :raises CheckpointError: a name listed twice, a tie to a name the checkpoint does not hold."""
    model: collections.OrderedDict[str, LazyTensor] = collections.OrderedDict()
    for source in ([(n, _float32(t)) for n, t in states.buffers], frozen.items(), weights.items()):
        for name, tensor in source:
            if name in model:
                raise CheckpointError(f"{printable(states.path)}: {quote(name)} is listed twice (among buffer_names, "
                                      "frozen_param_shapes and param_shapes); the file is corrupt")
            model[name] = tensor
    aliases: dict[str, str] = {}
    for alias, kept in states.shared:
        target = aliases.get(kept, kept)
        if target not in model or alias in model and alias not in aliases:
            said = f"{quote(kept)}, which it does not hold" if target not in model else \
                f"{quote(kept)}, but {quote(alias)} is a tensor of its own too"
            raise CheckpointError(f"{printable(states.path)}: shared_params ties {quote(alias)} to {said}; the file "
                                  "is corrupt")
        aliases[alias] = target
        model[alias] = model[target]
    tensors = {n: t for n, t in model.items() if n not in aliases}
    state, groups, pid = {}, [], 0
    for group, members in zip(param_groups, names):
        ids = list(range(pid, pid + len(members)))
        for i, name in zip(ids, members):
            if moments.get(name):
                state[i] = moments[name]
        groups.append({**{k: v for k, v in group.items() if k not in ("params", "param_names")},
                       "params": ids, "param_names": list(members)})
        pid += len(members)
    tree = {"model": model, "optimizer": {"state": state, "param_groups": groups}}
    training = Training(path, ("model",), ("optimizer",), lambda: tree)
    record = dict(states.record)  # fusectl's, in a universal checkpoint it wrote: its provenance
    return Contents(tensors, files, record, record.get(METADATA_KEY), aliases=aliases, training=training,
                    order=list(model), variant=variant, distributed=distributed)


@dataclass(frozen=True, eq=False)
class _Float32(LazyTensor):
    """A floating buffer of another dtype as float32 (``zero_to_fp32`` gives ``v.float()``)."""

    spec: TensorSpec
    source: LazyTensor

    def read(self) -> np.ndarray:
        return self.source.read().astype(np.float32)


def _float32(tensor: LazyTensor) -> LazyTensor:
    dtype = tensor.spec.dtype
    if dtype == _F32 or not dtype.is_float or dtype.packed:
        return tensor
    return _Float32(TensorSpec(_F32, tensor.spec.shape), tensor)


# ------------------------------------------------------------------------------- checks


def _entry(node: Mapping, key: str, path: str, where: str = "") -> object:
    if key not in node:
        raise CheckpointError(f"{printable(path)}: no {quote(where + key)} entry; not a file DeepSpeed's "
                              f"save_checkpoint wrote, or a corrupt one — {_HOW}")
    return node[key]


def _list(value: object, path: str, what: str) -> list:
    if type(value) not in (list, tuple):
        raise _corrupt(path, what, value, "a list")
    return list(value)


def _corrupt(path: str, what: str, value: object, expected: str) -> CheckpointError:
    return CheckpointError(f"{printable(path)}: {quote(what)} is {described(value)}, not {expected}; the file is corrupt "
                           "or not DeepSpeed's")
