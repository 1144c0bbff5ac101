"""DeepSpeed universal checkpoints, read and written without torch or DeepSpeed.

DeepSpeed's ``ds_to_universal.py`` turns a ZeRO checkpoint into one that resumes on any number
of ranks (``load_universal_checkpoint``): a tag folder (``global_step3/``, named by
``latest_universal`` in the folder above it) that holds

- the model states file(s) of the ZeRO checkpoint (``mp_rank_00_model_states.pt``; ZeRO 3's
  ``zero_pp_rank_R_…``): the parameters' names and shapes per param group (``param_shapes``),
  the buffers, frozen parameters and ties (``deepspeed_zero.ModelStates``);
- ``zero/optimizer_state.pt``: the optimizer's global state, its ``param_groups``'
  hyperparameters and ``ds_version`` among it;
- ``zero/<parameter name>/``: the whole parameter's fp32 master weight and each state of the
  optimizer, one file each: ``fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt`` (``{"cat_dim": 0,
  "param": tensor}``; from ZeRO 3 the bare flat tensor) and ``step.pt`` (a 0-d tensor).

:func:`read_universal` reads it as :func:`~fusectl.io.formats.deepspeed_zero.read_zero` reads a
ZeRO checkpoint: the same state dict, order and training tree, each tensor the file range of its
own file. :func:`write_universal` writes one from a training tree (``{"model": state dict,
"optimizer": optimizer.state_dict()}`` with ``param_names``) as DeepSpeed's loader reads it:
every parameter's folder, the optimizer's param groups, and a model states file holding what
the engine's ``load_checkpoint`` reads (``global_steps``, ``dp_world_size`` …), the parameter
shapes per group, the tensors no optimizer trains and the ties.
"""

from __future__ import annotations

import collections
import json
import math
import os
from typing import Callable, Mapping

import numpy as np

from ... import dtypes
from ...errors import CheckpointError, OutputError, printable, quote
from ...limits import check_limit
from ...tensors import ArrayTensor, LazyTensor, RangesTensor, TensorSpec
from ..contents import Contents
from ..key_path import KeyPath, key_text, node_at
from ..optimizer_state import NAMES_KEY, parse_optimizer
from ..sniff import DEEPSPEED_LATEST, UNIVERSAL_FOLDER
from .deepspeed_zero import MODEL_STATES, RECORDS, ModelStates, frozen_parameters, frozen_stage3, group_names, \
    listing, param_groups, read_tree, stage_of, tag_folder, training_contents
from .torch_file import read_torch_tree

OPTIMIZER_STATE = "optimizer_state.pt"  # zero/'s file of the optimizer's global state
WEIGHT = "fp32"  # the file of a parameter's fp32 master weight (zero/<name>/fp32.pt)
STAGE3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"
# the DeepSpeed whose layout write_universal writes (its loader asserts a ds_version, and ZeRO 1
# refuses one before 0.3.17)
DS_VERSION = "0.19.8"
_NAME_MAX = 255


def read_universal(path: str, key: str | None = None, check_link: Callable[[str], None] | None = None) -> Contents:
    """The :class:`~fusectl.io.contents.Contents` of a DeepSpeed universal checkpoint: its tag
    folder (``zero/`` beside the model states file) or the folder whose ``latest_universal``
    names it.

    :param path: the folder.
    :param key: unused (the registry row takes no key).
    :param check_link: called with each file and folder before it is read (the input's link boundary).
    :returns: as ``read_zero``'s, ``variant`` ``"deepspeed-universal"``; the provenance of a
        universal checkpoint fusectl wrote.
    :raises CheckpointError: naming the file: a ``latest_universal`` that names anything but a
        folder beside it, a parameter without its folder or ``fp32.pt``, a tensor whose size is
        not its parameter's, a file that is not what DeepSpeed writes.
    """
    check = check_link or (lambda p: None)
    folder, latest = tag_folder(path, DEEPSPEED_LATEST[1], check)
    states_path = next((os.path.join(folder, n) for n in (MODEL_STATES, STAGE3_MODEL_STATES)
                        if os.path.lexists(os.path.join(folder, n))), None)
    if states_path is None:
        raise CheckpointError(f"{printable(os.path.join(folder, MODEL_STATES))}: missing; a universal checkpoint keeps "
                              "its parameters' names and shapes there (ds_to_universal copies it)")
    states = ModelStates.read(states_path, check)
    zero = os.path.join(folder, UNIVERSAL_FOLDER)
    check(zero)
    optimizer_path = os.path.join(zero, OPTIMIZER_STATE)
    optimizer = read_tree(optimizer_path, check)
    groups = param_groups(optimizer.get("param_groups"), optimizer_path, "param_groups")
    names = group_names(groups, states.groups, optimizer_path)
    check_limit("tensors", len(states.names()), printable(zero))
    files = [*([latest] if latest else []), states_path, optimizer_path]
    weights, moments = {}, {}
    for k, group in enumerate(states.groups):
        step = _group_step(optimizer, k, optimizer_path)
        for name, shape in group:
            weights[name], moments[name] = _parameter(zero, name, shape, states_path, check, files)
            if "step" not in moments[name] and step is not None:  # ZeRO 3's: no step.pt
                moments[name] = {"step": step(), **moments[name]}
    frozen = _frozen(folder, states, states_path, check, files)
    distributed: dict = {"tag": os.path.basename(os.path.normpath(folder))}
    if states.world_size is not None:
        distributed = {"world_size": states.world_size, **distributed}
    if "zero_stage" in optimizer:
        distributed["stage"] = stage_of(optimizer["zero_stage"], optimizer_path)
    return training_contents(path, files, states, weights, frozen, groups, names, moments,
                             "deepspeed-universal", distributed)


def _frozen(folder: str, states: ModelStates, states_path: str, check, files: list[str]) -> dict[str, LazyTensor]:
    """The frozen parameters: whole in the model states file, or, from ZeRO 3 (ds_to_universal
    copies each rank's model states file), a share of each in every rank's."""
    if os.path.basename(states_path) != STAGE3_MODEL_STATES or not states.frozen:
        return frozen_parameters(states)
    world = states.world_size or 1
    ranks = [states]
    for rank in range(1, world):
        ranks.append(ModelStates.read(os.path.join(folder, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"), check))
        files.append(ranks[-1].path)
    return frozen_stage3(ranks, world)


def _group_step(optimizer: dict, k: int, path: str) -> Callable[[], object] | None:
    """Where ``step.pt`` is missing (ds_to_universal of a ZeRO-3 checkpoint writes none), the step
    of flat group ``k`` in ``optimizer_state.pt``'s base optimizer state: a maker of one 0-d
    tensor per parameter (torch's optimizer steps each in place), or None."""
    base = optimizer.get("optimizer_state_dict")
    entry = base.get("state", {}).get(k) if isinstance(base, dict) and isinstance(base.get("state"), dict) else None
    value = entry.get("step") if isinstance(entry, dict) else None
    if type(value) in (int, float):
        return lambda: value
    if not isinstance(value, LazyTensor) or value.spec.shape:
        return None
    ranges = value.byte_ranges()
    if ranges is None:
        raise CheckpointError(f"{printable(path)}: the step of flat group {k} is not stored as plain bytes; the file "
                              "is corrupt")
    return lambda: RangesTensor(value.spec, tuple(ranges))


def _parameter(zero: str, name: str, shape: tuple[int, ...], states_path: str, check,
               files: list[str]) -> tuple[LazyTensor, dict]:
    """(the fp32 weight, the optimizer state) of parameter ``name`` from its folder, each tensor
    shaped like the parameter (``shape``, as ``states_path`` gives it); ``files`` gets each file read."""
    folder = os.path.join(zero, _folder_name(name, printable(zero), CheckpointError))
    check(folder)
    if not os.path.isdir(folder) or not os.path.lexists(os.path.join(folder, f"{WEIGHT}.pt")):
        raise CheckpointError(f"{printable(os.path.join(folder, WEIGHT + '.pt'))}: missing; the model states name "
                              f"{quote(name)} a trained parameter, whose weight a universal checkpoint keeps there")
    keys = [n[:-3] for n in listing(folder) if n.endswith(".pt") and n != f"{WEIGHT}.pt"]
    keys.sort(key=lambda k: k != "step")  # torch's optimizer lists the step first
    weight, state = None, {}
    for key in [WEIGHT, *keys]:
        file = os.path.join(folder, f"{key}.pt")
        check(file)
        tree, _ = read_torch_tree(file, records=RECORDS)  # a dict, or (step.pt, ZeRO 3's) a bare tensor
        files.append(file)
        tensor = tree.get("param") if isinstance(tree, dict) else tree
        if not isinstance(tensor, LazyTensor):
            raise CheckpointError(f"{printable(file)}: holds no tensor ('param'); not what ds_to_universal writes")
        if key != WEIGHT and (key == "step" or not tensor.spec.shape):  # a per-parameter number
            state[key] = tensor
            continue
        ranges = tensor.byte_ranges()
        if tensor.spec.numel != math.prod(shape) or ranges is None:
            stored = "" if ranges else " not stored as plain bytes"
            raise CheckpointError(f"{printable(file)}: a {tensor.spec} tensor{stored}, but {printable(states_path)} "
                                  f"gives {quote(name)} the shape {list(shape)}; the "
                                  "files are of two models, or one is corrupt")
        shaped = RangesTensor(TensorSpec(tensor.spec.dtype, shape), tuple(ranges))
        if key == WEIGHT:
            weight = shaped
        else:
            state[key] = shaped
    return weight, state


def _folder_name(name: str, where: str, error: type[Exception]) -> str:
    """``name`` when it can be a folder's name (a universal checkpoint keeps each parameter in a
    folder of its name): not empty, ``.`` or ``..``, without a path separator or NUL, at most
    255 bytes (a file name's most on Linux and macOS)."""
    if not name or name in (".", "..") or any(c in name for c in "/\\\0") or \
            len(name.encode("utf-8", "surrogatepass")) > _NAME_MAX:
        raise error(f"{where}: the parameter {quote(name)} cannot be a folder's name, which a universal checkpoint "
                    "keeps each parameter in; rename it")
    return name


# ------------------------------------------------------------------------------- writing


def write_universal(folder: str, root: object, model_path: KeyPath, optimizer_path: KeyPath,
                    metadata: Mapping[str, str], where: str | None = None) -> None:
    """Write the training tree ``root`` as a DeepSpeed universal checkpoint in ``folder`` (made
    if missing; ``atomic_output``'s temporary: the caller renames it into place).

    :param root: a training tree as ``read_zero`` gives it: the model's state dict at
        ``model_path`` (name → tensor, a tied name the same tensor object as the one kept) and an
        optimizer's ``state_dict()`` at ``optimizer_path`` (ids, each group's ``param_names``;
        else the names ``metadata`` records under ``fusectl.param_names``).
    :param metadata: fusectl's record (its provenance), kept in the model states file.
    :param where: the output as messages name it (default: ``folder``; the final name where
        ``folder`` is a temporary one).
    :raises OutputError: a parameter name that cannot be a folder's, a model entry that is not a
        tensor, an optimizer parameter the model does not hold or whose state is not shaped like
        it, an optimizer without parameter names; CheckpointError: a malformed optimizer.
        Nothing is written then.

    The layout: ``folder/latest_universal`` names ``global_step<step>/``, which holds ``zero/``
    (module docstring) and the model states file twice, under the name a ZeRO 1/2 engine loads
    (``mp_rank_00_model_states.pt``) and the one a ZeRO-3 engine loads
    (``zero_pp_rank_0_mp_rank_00_model_states.pt``). A ZeRO 1/2 engine on any number of ranks
    resumes the run from it; so does a ZeRO-3 engine, once the two bugs of DeepSpeed 0.19.8's
    ZeRO-3 universal load that ``fixtures/distributed_train.py`` undoes are undone (left, it
    resumes as from ``ds_to_universal``'s own output: the same losses, 1.7e-3 off the run's).
    """
    where = where or printable(folder)
    model = node_at(root, model_path)
    if not isinstance(model, dict):
        raise OutputError(f"{where}: the model at {quote(key_text(model_path))} is not a state dict")
    for name, tensor in model.items():
        if type(name) is not str or not isinstance(tensor, LazyTensor):
            raise OutputError(f"{where}: the model entry {quote(str(name))} is not a named tensor; a universal "
                              "checkpoint holds tensors only")
        _folder_name(name, where, OutputError)
    raw = node_at(root, optimizer_path)
    state = parse_optimizer(raw, key_text(optimizer_path), folder)
    groups = named_groups(state, metadata, where)
    kept: dict[int, str] = {}
    shared = {}
    for name, tensor in model.items():
        first = kept.setdefault(id(tensor), name)
        if first != name:
            shared[name] = first
    trained = [name for group in groups for name in group]
    for name in trained:
        if name not in model or name in shared:
            raise OutputError(f"{where}: the optimizer trains {quote(name)}, which the model "
                              f"{'holds only as a tie' if name in shared else 'does not hold'}; the optimizer is of "
                              "another model")
    files: dict[str, dict[str, object]] = {}  # parameter → its folder's files
    steps = []
    for pid, name in zip(state.ids(), trained):
        spec = model[name].spec
        entry = {WEIGHT: {"cat_dim": 0, "param": model[name]}}
        for key, value in state.states.get(pid, {}).items():
            if isinstance(value, LazyTensor) and value.spec.shape:
                if value.spec.shape != spec.shape:
                    raise OutputError(f"{where}: the optimizer state {quote(key)} of {quote(name)} is {value.spec}, "
                                      f"the parameter {spec}; a state must be shaped like its parameter")
                entry[key] = {"cat_dim": 0, "param": value}
            else:
                entry[key] = _scalar(value)
                if key == "step":
                    steps.append(entry[key])
        files[name] = entry
    for name, tensor in model.items():  # as ds_to_universal: every other tensor's weight too
        files.setdefault(name, {WEIGHT: {"param": tensor}})
    untrained = collections.OrderedDict((n, t) for n, t in model.items() if n not in trained and n not in shared)
    step = _global_step(steps)
    model_states = {
        "module": untrained, "buffer_names": [], "optimizer": None,
        "param_shapes": [collections.OrderedDict((n, model[n].spec.shape) for n in group) for group in groups],
        "frozen_param_shapes": collections.OrderedDict((n, t.spec.shape) for n, t in untrained.items()),
        "shared_params": shared, "frozen_param_fragments": untrained,
        "lr_scheduler": None, "data_sampler": None, "random_ltd": None, "skipped_steps": 0, "global_steps": step,
        "dp_world_size": 1, "mp_world_size": 1, "ds_version": DS_VERSION,
    }
    saved = [g.hyper for g in state.groups] if state.form == "flat" else raw["param_groups"]  # as saved
    hyper = [{**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": [n]}
             for n, g in enumerate(saved)]
    optimizer_state = {
        "param_groups": hyper, "ds_version": DS_VERSION,
        # ZeRO 3's loader takes the step from its first sub-group's state here
        "optimizer_state_dict": {"state": {n: {"step": _scalar(steps[0] if steps else 0)} for n in range(len(hyper))},
                                 "param_groups": hyper},
    }
    _write(folder, f"global_step{step}", model_states, optimizer_state, files, metadata)


def named_groups(state, metadata: Mapping[str, str], where: str, output: str = "a universal checkpoint") -> \
        list[list[str]]:
    """Each param group's parameters by name: its ``param_names``, else fusectl's record
    (``metadata``); OutputError naming ``where`` and ``output`` (the kind written, which keeps
    each parameter's state under its name) for an optimizer of ids without either."""
    if all(g.param_names is not None for g in state.groups):
        return [list(g.param_names) for g in state.groups]
    if state.form != "ids":  # keyed by name (torch.distributed.checkpoint's forms)
        return [list(g.params) for g in state.groups]
    recorded = metadata.get(NAMES_KEY)
    names = json.loads(recorded) if recorded else None
    if not isinstance(names, list) or len(names) != len(state.ids()):
        raise OutputError(f"{where}: the optimizer names no parameters (param_names), and {output} "
                          "keeps each parameter's state under its name; give the optimizer's state with its names")
    out, k = [], 0
    for g in state.groups:
        out.append(names[k:k + len(g.params)])
        k += len(g.params)
    return out


def _scalar(value: object) -> LazyTensor:
    """A per-parameter number (Adam's step) as the 0-d float32 tensor torch's optimizer keeps."""
    if isinstance(value, LazyTensor):
        return value
    return ArrayTensor(TensorSpec(dtypes.BY_NAME["F32"], ()), np.array(value, dtype=np.float32))


def _global_step(steps: list[LazyTensor]) -> int:
    """The engine's step count: the optimizer's (fp32 DeepSpeed skips no step), 0 without one."""
    if not steps:
        return 0
    value = float(np.asarray(steps[0].read()).reshape(()))
    return int(value) if math.isfinite(value) and value >= 0 and value == int(value) else 0


def _write(folder: str, tag: str, model_states: dict, optimizer_state: dict, files: Mapping[str, Mapping],
           metadata: Mapping[str, str]) -> None:
    from .torch_writer import write_torch_file  # PyTorch's writer loads its reader: only when needed
    zero = os.path.join(folder, tag, UNIVERSAL_FOLDER)
    place = zero
    try:
        os.makedirs(zero)
        for name in (MODEL_STATES, STAGE3_MODEL_STATES):  # what a ZeRO 1/2 engine loads, and a ZeRO 3 one
            write_torch_file(os.path.join(folder, tag, name), model_states, metadata=metadata)
        write_torch_file(os.path.join(zero, OPTIMIZER_STATE), optimizer_state)
        for name, entry in files.items():
            place = os.path.join(zero, name)
            os.mkdir(place)
            for key, tree in entry.items():
                write_torch_file(os.path.join(place, f"{key}.pt"), tree)
        place = os.path.join(folder, DEEPSPEED_LATEST[1])
        with open(place, "w") as f:
            f.write(tag)
    except OSError as e:
        raise OutputError(f"{printable(place)}: cannot be written ({e.strerror})") from e
