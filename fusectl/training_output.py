"""A training dict written whole: the model, the optimizer with its state moved, the rest kept.

A PyTorch output of a training dict (``Checkpoint.training``: any dict around the state dict
read, a top-level state dict with other entries too) is the whole container, every entry of it
as read, only the model's tensors changed (:func:`write_container`; exit 0 never drops one).
When ``fuse`` reads a training dict whose optimizer state it can map and writes a PyTorch
file, it plans the state tensors with their parameters (``<name>::<key>`` entries of the table,
``followers.optimizer``) and :func:`write_training` assembles what ``torch.save`` would have
written for the fused model's training:

- the model state dict: the dict as read (an ``OrderedDict`` stays one), its model tensors
  replaced by the fused table's (tied names one tensor, so one storage) in the input's key
  order, each fused tensor where its first part was (``fusectl.key_order``; in the given
  parameter order when there is one), its other entries where they were (:func:`model_dict`);
- the optimizer, in the form it was read in (``io.optimizer_state.written_optimizer``):
  ``param_groups`` with their hyperparameters as read, ``params`` renumbered 0..n-1 over the
  groups in the output parameter order (by default the input optimizer's, a fused parameter where
  its first part was; or, keyed by name, an unchanged parameter's name as
  read and a fused one's name), ``state`` keyed alike with each parameter's moved state tensors
  and its numbers (kept once for a fused parameter);
- every other entry of the training dict as read; fusectl's provenance in its metadata record,
  with the parameter of each new optimizer id (``optimizer_state.order_record``), so the output
  maps without being told its order.

A plan that moves no parameter (``convert``; rules that touch no tensor the optimizer could hold
state for: :func:`moves_state`) writes the optimizer as it was read, never mapping its ids.

The output parameter order is, by default, the input's — the state dict's for the model, the
optimizer's own ids' for its groups —: a fused parameter takes the position of its first part. A model that declares its parameters in another order (Phi-3
declares ``o_proj`` before ``qkv_proj``) is given it as a JSON list
(``[n for n, _ in new_model.named_parameters()]``; ``param_order_out``): each group's
parameters are sorted by it.

``unfuse`` of such a file from its provenance writes it the same way, with the inverse plan
lifted to the state (``api.unfuse``): each part takes its fused parameter's place (or, where
the parts were not adjacent, the place the provenance recorded), so a fuse in the default order
unfuses to the original training dict, bitwise and in order.
"""

from __future__ import annotations

import collections
import math
import os
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

import numpy as np

from .errors import CheckpointError, InternalError, PlanError, option, printable, quote
from .followers.optimizer import SCALAR_KEYS, STATE_SEP, refuse_separator
from .io.atomic import atomic_output
from .io.checkpoint import Checkpoint
from .io.registry import output_kind
from .io.key_path import KeyPath, key_text, node_at
from .io.optimizer_state import RECORD_KEYS, order_record, read_order, training_tree, without_optimizer, \
    written_optimizer
from .key_order import KeyOrder, output_order, sort_keys, ties_of
from .io.formats.trainer_folder import TrainerOptimizer
from .steps import Plan
from .table import ParamTable
from .twins import MovedTwin
from .tensors import LazyTensor, TensorSpec
from .write import WriteReport, output_metadata


def _write_dcp(folder: str, root, model_path: KeyPath, optimizer_path: KeyPath, metadata: Mapping[str, str],
               out: str) -> None:
    from .io.formats.dcp_writer import write_dcp
    write_dcp(folder, root, model_path, optimizer_path, metadata, checkpoint_id=os.path.basename(os.path.normpath(out)),
              where=printable(out))


def _write_universal(folder: str, root, model_path: KeyPath, optimizer_path: KeyPath, metadata: Mapping[str, str],
                     out: str) -> None:
    from .io.formats.deepspeed_universal import write_universal
    write_universal(folder, root, model_path, optimizer_path, metadata, where=printable(out))


# the folders a training checkpoint is written as with ``--to`` (``to=``): a DCP folder that
# ``dcp.load`` reads on any number of ranks, a DeepSpeed universal checkpoint
TARGETS: dict[str, Callable[..., None]] = {"dcp": _write_dcp, "ds-universal": _write_universal}


def writes_training(checkpoint: Checkpoint, out) -> bool:
    """Whether ``out`` is ``checkpoint``'s container written whole: a training dict (the dict
    around the state dict read, with or without an optimizer) written as a PyTorch file, or a
    Hugging Face Trainer folder (``io.trainer_folder``) written as a folder (``trainer_output``).
    Every entry of it is written then, only the model's tensors (and the optimizer's state with
    them) changed."""
    training = checkpoint.training
    if training is None:
        return False
    kind = "folder" if isinstance(training, TrainerOptimizer) else "pytorch"
    return output_kind(os.fspath(out)) == kind


def left_out(checkpoint: Checkpoint, shown: int = 8) -> list[str]:
    """The entries of ``checkpoint``'s training dict beside its model's tensors (the top-level
    keys other than the one holding the model; for a state dict at the top, its entries that are
    not tensors), as text, the first ``shown`` of them: what an output holding only the model's
    tensors leaves out."""
    path = checkpoint.training.model_path
    if path:
        try:
            tree = checkpoint.training.tree()
        except CheckpointError:  # an entry the model-only output never reads is broken: not this note's to say
            return []
        names = [key_text((k,)) for k in tree if k != path[0]]
    else:
        names = list(checkpoint.ignored)
    return [quote(n) for n in names[:shown]] + ([f"{len(names) - shown} more"] if len(names) > shown else [])


def write_training(checkpoint: Checkpoint, table: ParamTable, plan: Plan, out: str, *, order: KeyOrder,
                   param_order_out: str | None = None, restore: bool = False, force: bool = False,
                   on_note: Callable[[str], None] | None = None, twins: Sequence[MovedTwin] = (),
                   to: str | None = None) -> WriteReport:
    """Write the training dict of ``checkpoint`` with ``table`` (what ``plan`` made of its
    training table) as its model and optimizer state, ``twins`` (``fusectl.twins``: the
    model's copies after its plan) at their keys, in ``order`` (``key_order.keys_for``; a given
    ``param_order_out`` orders the model's tensors too), ``order.recorded`` as its provenance,
    and the parameter of each optimizer id in fusectl's record (``optimizer_state.order_record``:
    read back, the output maps without being told its order) with the optimizer's order before
    fusectl's first step (``Checkpoint.original_order``). ``restore``: an unfuse, whose optimizer
    takes that recorded order back (parts fused from places apart return to them, as each id's
    state must stand where ``model.parameters()`` puts its parameter). A plan that moves no parameter
    (:func:`moves_state`) is written by :func:`write_container` instead: the optimizer as read.

    :raises PlanError: a parameter of a param group that ``param_order_out`` does not list, a
        name it lists that the fused model does not hold, a fused parameter whose parts have
        different numbers of state or sit in two groups; CheckpointError: a per-parameter number
        that is not finite, a tensor whose name holds the state separator. Nothing is written then.
    """
    training = checkpoint.training
    given = read_order(os.fspath(param_order_out)) if param_order_out is not None else None
    original = checkpoint.recorded_original_order() if restore and given is None else None
    moved = moved_optimizer(checkpoint, table, plan, order=given, order_source=param_order_out, preferred=order.names,
                            restored=original)
    order = replace(order, names=list(moved.model))
    model = model_dict(node_at(training.tree(), training.model_path), moved.model, plan,
                       set(checkpoint.table.entries))
    root = training_tree(training.tree(), training.model_path, model, training.optimizer_path, moved.optimizer,
                         twin_entries(checkpoint, twins))
    return _write_tree(checkpoint, table, root, order, out, force, on_note,
                       order_record(moved.names, checkpoint.original_order()), to=to)


def moves_state(checkpoint: Checkpoint, plan: Plan) -> bool:
    """Whether ``plan`` (the model's steps) touches a tensor of ``checkpoint`` that its optimizer
    could hold state for (``Checkpoint.possible_parameters``, proven or not): when it does not,
    the optimizer is written as it was read and its mapping is never needed."""
    possible = checkpoint.possible_parameters()
    table = checkpoint.table
    return any(table.unique_name(n) in possible for step in plan.steps for n in step.inputs if n in table)


def _check_whole(checkpoint: Checkpoint, table: ParamTable, root) -> None:
    """Every tensor of ``table`` is in the tree ``root`` to write — each model tensor, and each
    parameter's state (an untied member's copy as its source; a tied group keeps the one state
    of its unique name, its other members' entries are that state): a tensor left out would
    vanish from an output that exits 0. InternalError otherwise, a bug of fusectl's."""
    written = {id(t.source) if isinstance(t, _Copy) else id(t) for t in tree_tensors(root)}

    def needed(name: str) -> bool:
        parameter, sep, _ = name.partition(STATE_SEP)
        return not sep or table.unique_name(parameter) == parameter

    lost = next((n for n, t in table.entries.items() if id(t) not in written and needed(n)), None)
    if lost is not None:
        raise InternalError(f"{checkpoint.path}: the tensor {lost!r} of the plan's result is not in the training "
                            "dict to write; nothing was written")


def write_container(checkpoint: Checkpoint, table: ParamTable, plan: Plan, out: str, *, order: KeyOrder,
                    drop_optimizer: bool = False, force: bool = False,
                    on_note: Callable[[str], None] | None = None, twins: Sequence[MovedTwin] = (),
                    to: str | None = None) -> WriteReport:
    """Write the training dict of ``checkpoint`` whole with ``table`` (what ``plan`` made of its
    model) as its model, in ``order``, ``twins`` at their keys (as :func:`write_training`),
    every other entry as it is: a dict without an optimizer (a Lightning checkpoint saved
    without one keeps ``hparams``, ``epoch``, ``loops``; ``{model, step}`` its ``step``), or,
    with ``drop_optimizer`` (``--drop-optimizer``), one whose optimizer is left out: the entry
    at its key, or Lightning's ``optimizer_states`` with ``lr_schedulers``, as Lightning's
    ``save_weights_only`` leaves them out. An optimizer kept is one no step moves
    (:func:`moves_state`; ``convert``): written as it was read, ids and fusectl's record included,
    its mapping never needed."""
    training = checkpoint.training
    kept = training.optimizer_path is not None and not drop_optimizer
    names = [n for n in order.names if n in table.entries]
    model = model_dict(node_at(training.tree(), training.model_path), {n: table.entries[n] for n in names}, plan,
                       set(checkpoint.table.entries))
    root = training_tree(training.tree(), training.model_path, model, None, None, twin_entries(checkpoint, twins))
    if drop_optimizer and training.optimizer_path is not None:
        root = without_optimizer(root, training.optimizer_path)
    record = {k: v for k, v in checkpoint.metadata.items() if k in RECORD_KEYS} if kept else None
    return _write_tree(checkpoint, table, root, order, out, force, on_note, record, model_alone=True, to=to)


def model_dict(node: Mapping, tensors: Mapping[str, LazyTensor], plan: Plan, inputs: set[str],
               prefix: str = "") -> dict:
    """The state dict ``node`` as read (a dict of the tree) with its model tensors replaced by
    ``tensors`` (output name → tensor, in the output's order, ``fusectl.key_order``): each entry
    of ``node`` that is a tensor of the input's model (``inputs``, names after ``prefix``)
    gives its place to what ``plan`` made of it, in that order; every other entry (a number, a
    nested dict, a tensor the model does not hold) stays as and where it was. An unchanged name
    keeps its key object (an integer key stays one); a dict its type."""
    positions, keys, fixed = {}, {}, []
    for place, (key, value) in enumerate(node.items()):
        name = str(key)[len(prefix):] if type(key) in (str, int) and str(key).startswith(prefix) else None
        if isinstance(value, LazyTensor) and name in inputs:
            positions[name], keys[name] = place, key
        else:
            fixed.append(((place,), key, value))
    names = list(tensors)
    placed = sort_keys(positions, plan, names)
    last: tuple = (-1,)
    for k, name in enumerate(names):  # a name without a place (an alias the node did not list) after the one before
        last = placed.setdefault(name, (*last, float("inf"), k))
    items = sorted([(placed[n], True, n, None) for n in names] + [(p, False, k, v) for p, k, v in fixed],
                   key=lambda item: item[0])
    tensor_places = [i for i, item in enumerate(items) if item[1]]
    for place, name in zip(tensor_places, names):  # the output's order among the places the tensors hold
        items[place] = (None, True, name, None)
    out = type(node)()
    for _, is_tensor, key, value in items:
        if is_tensor:
            key, value = keys.get(key, prefix + key), tensors[key]
        if key in out:
            raise PlanError(f"{quote(str(key))}: the state dict would hold it twice (a tensor the plan made and an "
                            "entry that is not one of the model's tensors); rename the rule's output")
        out[key] = value
    return out


def twin_entries(checkpoint: Checkpoint, twins: Sequence[MovedTwin]) -> list[tuple[KeyPath, dict]]:
    """Each moved twin as (its key path, the dict to write there): the dict as read with the
    twin's tensors what the model's plan made of them (:func:`model_dict`; in the twin's own
    order, a fused tensor where its first part was) under its prefix; its other entries (an
    ``AveragedModel``'s ``n_averaged``) where they stood."""
    out = []
    for moved in twins:
        twin = moved.twin
        table = moved.table
        names = output_order(list(twin.tensors), moved.plan, list(table.entries), ties=ties_of(table.groups().values()))
        node = node_at(checkpoint.training.tree(), twin.path)
        out.append((twin.path, model_dict(node, {n: table.entries[n] for n in names}, moved.plan, set(twin.tensors),
                                          twin.prefix)))
    return out


@dataclass(frozen=True)
class MovedOptimizer:
    """The output side of a training checkpoint: ``model`` its state dict (name → tensor, in the
    output order), ``optimizer`` the optimizer's new ``state_dict()`` tree, ``names`` the
    parameter of each of its new ids (in id order)."""

    model: collections.OrderedDict
    optimizer: dict
    names: list[str]


def moved_optimizer(checkpoint: Checkpoint, table: ParamTable, plan: Plan, *, order: list[str] | None = None,
                    order_source=None, positions: list[str] | None = None,
                    preferred: Sequence[str] | None = None, restored: Sequence[str] | None = None) -> MovedOptimizer:
    """The model and optimizer state ``table`` holds after ``plan`` (the state tensors moved with
    their parameters), the optimizer's ids renumbered 0..n-1 over its groups in the output order:
    ``order`` where given (each group sorted by it; ``order_source`` names it in messages; the
    model's tensors take it too), else each parameter where its first part stands in
    ``positions`` (default: the input optimizer's own order, its ids' — what
    ``Optimizer.load_state_dict`` pairs with the model's parameters). The model state dict takes
    the input's key order (``fusectl.key_order``), reordered by ``preferred`` (the output's key
    order) among the places its names hold, each fused tensor where its first part was.
    ``restored`` (an unfuse: the optimizer's order before fusectl's first step) orders the
    optimizer's parameters among the places they hold, the model's key order untouched.

    :raises PlanError: see :func:`write_training`.
    """
    training = checkpoint.training
    state, mapping = checkpoint.optimizer_mapped
    model_names = [n for n in table.entries if STATE_SEP not in n]
    ties = ties_of(table.groups().values())
    model_order = output_order(checkpoint.input_order(), plan, model_names, ties=ties,
                               preferred=order if order is not None else preferred)
    model = collections.OrderedDict((n, table.entries[n]) for n in model_order)
    if positions is None:
        positions = [mapping.names[p] for p in state.ids() if p in mapping.names]
    inputs = list(positions)  # the optimizer's ids in its own order, then every other name
    listed = set(inputs)
    inputs += [n for n in checkpoint.table.entries if n not in listed]
    optimizer_order = output_order(inputs, plan, model_names, ties=ties,
                                   preferred=order if order is not None else restored)
    origins, position = _origins(inputs, plan), {n: i for i, n in enumerate(inputs)}

    # each output parameter of the optimizer: the unique name, its group, its input ids
    group_of = {name: state.group_of(pid) for pid, name in mapping.names.items()}
    id_of = {name: pid for pid, name in mapping.names.items()}
    members: dict[str, list] = {}
    for name in optimizer_order:
        unique = table.unique_name(name)
        if unique != name or unique in members:
            continue
        made = sorted(origins.get(name, {name}), key=lambda p: position.get(p, len(position)))
        parts = [p for p in dict.fromkeys(checkpoint.table.unique_name(p) for p in made if p in checkpoint.table)
                 if p in id_of]
        if parts:
            members[unique] = parts
    groups: list[list[str]] = [[] for _ in state.groups]
    for name, parts in members.items():
        found = {group_of[p] for p in parts}
        if len(found) > 1:
            raise PlanError(f"{printable(checkpoint.path)}: {quote(name)} is made of parameters of two optimizer "
                            f"param groups ({quote(parts[0])} and another); the optimizer cannot hold it (pass "
                            f"{option('drop_optimizer')} to write the model without its optimizer state)")
        groups[found.pop()].append(name)
    if order is not None:
        groups = _ordered(groups, order, model_names, order_source)

    seen: set[int] = set()

    def state_of(name: str) -> dict:
        entry = _state_of(name, members[name], state, id_of, table, checkpoint.path)
        for key, value in entry.items():  # untied members: each its own copy of the one state
            if isinstance(value, LazyTensor):
                entry[key] = _Copy(value.spec, value) if id(value) in seen else value
                seen.add(id(value))
        return entry

    written_groups = [[(name, id_of[members[name][0]], members[name] == [name], state_of(name)) for name in group]
                      for group in groups]
    optimizer = training.tree() if isinstance(training, TrainerOptimizer) else \
        node_at(training.tree(), training.optimizer_path)
    new_optimizer = written_optimizer(state, optimizer, written_groups)  # in the form it was read in
    return MovedOptimizer(model, new_optimizer, [n for group in groups for n in group])


def _write_tree(checkpoint: Checkpoint, table: ParamTable, root, order: KeyOrder, out: str, force: bool,
                on_note, record: Mapping[str, str] | None = None, model_alone: bool = False,
                to: str | None = None) -> WriteReport:
    """Write the training tree ``root`` whose model is ``table``'s, ``order.recorded`` as its
    provenance (with ``order.record``), ``record`` (``optimizer_state.order_record``) beside it:
    a PyTorch file, or, with ``to`` (:data:`TARGETS`), the folder of a format a distributed
    trainer resumes from (a DCP folder, a DeepSpeed universal checkpoint); ``to`` may also be
    such a writer itself, called as ``TARGETS``' are (``api``'s Megatron rank files).
    Where the input has an optimizer, a tensor of the model whose name holds the state separator
    is refused, in the input or, where ``table`` holds the model alone (the optimizer written as
    read, or left out), in ``table``: it would read as an optimizer state, its steps left out of
    the provenance. Every tensor of ``table`` must be in ``root`` (:func:`_check_whole`)."""
    if checkpoint.training.optimizer_path is not None:
        refuse_separator(checkpoint.table.entries, printable(checkpoint.path), CheckpointError)
        if model_alone:
            refuse_separator(table.entries, printable(out), remedy="give the rule's output another name")
    _check_whole(checkpoint, table, root)
    model_table = model_only(table)
    shard_metadata, index_metadata = output_metadata(model_table, order.recorded, checkpoint.metadata,
                                                     order=order.record)
    metadata = {**shard_metadata([(n, t.spec) for n, t in model_table.written()]), **index_metadata,
                **(record or {})}
    written = {id(t): t for t in tree_tensors(root)}
    with atomic_output(out, force=force, inputs=checkpoint.input_paths(), on_note=on_note) as temp:
        if to is None:
            from .io.formats.torch_writer import write_torch_file  # PyTorch's writer loads its reader: only when needed
            write_torch_file(temp, root, metadata=metadata)
        else:
            training = checkpoint.training
            writer = TARGETS[to] if isinstance(to, str) else to  # a writer of its own (api's --to megatron)
            writer(temp, root, training.model_path, training.optimizer_path, metadata, out)
    nbytes = sum(t.spec.nbytes for t in written.values())
    copied = sum(t.spec.nbytes for t in written.values() if t.byte_ranges() is not None)
    return WriteReport(out, len(model_table.written()), sum(t.spec.nbytes for _, t in model_table.unique()),
                       copied, nbytes)


def model_only(table: ParamTable) -> ParamTable:
    """A copy of ``table`` without the optimizer's state tensors: the model written."""
    model_table = table.copy()
    model_table.remove([n for n in table.entries if STATE_SEP in n])
    return model_table


def model_ties(table: ParamTable) -> list[list[str]]:
    """The tie groups of ``table``'s model tensors (a tied parameter's state is tied alike)."""
    return [g for g in table.ties() if not any(STATE_SEP in n for n in g)]


def model_steps(plan: Plan) -> Plan:
    """``plan`` without the optimizer state's steps and ties: what the provenance records (the
    state follows its parameters by rule; a replay or an inverse acts on the model's tensors)."""
    def model(names) -> bool:
        return not any(STATE_SEP in n for n in names)

    return Plan(tuple(replace(g, steps=tuple(s for s in g.steps if model((*s.inputs, *s.outputs))),
                              untied=tuple(m for m in g.untied if model(m)),
                              untied_stored=tuple(m for m, u in zip(g.untied_stored, g.untied) if model(u)))
                      for g in plan.groups))


def _origins(inputs, plan: Plan) -> dict[str, set]:
    """Each model tensor name → the input names it is made from, through the plan's steps."""
    origins = {n: {n} for n in inputs if STATE_SEP not in n}
    for group in plan.groups:
        for step in group.steps:
            if any(STATE_SEP in n for n in step.outputs):
                continue
            made = set().union(*(origins.get(n, {n}) for n in step.inputs))
            for n in step.outputs:
                origins[n] = made
    return origins


def _ordered(groups: list[list[str]], order: list[str], model_names: list[str], where) -> list[list[str]]:
    """Each group sorted by ``order`` (PlanError: a parameter it does not list, or a name the fused
    model does not hold)."""
    at = dict((n, i) for i, n in enumerate(order))
    known = set(model_names)
    stray = next((n for n in order if n not in known), None)
    if stray is not None:
        raise PlanError(f"{printable(os.fspath(where))}: {quote(stray)} is not a tensor of the fused model; "
                        f"{option('param_order_out')} lists [n for n, _ in new_model.named_parameters()]")
    for group in groups:
        missing = next((n for n in group if n not in at), None)
        if missing is not None:
            raise PlanError(f"{printable(os.fspath(where))}: the optimizer's parameter {quote(missing)} is not "
                            f"listed; {option('param_order_out')} must list every parameter of the fused model "
                            "([n for n, _ in new_model.named_parameters()])")
    return [sorted(group, key=at.__getitem__) for group in groups]


def _state_of(name: str, parts: list[str], state, id_of: Mapping, table: ParamTable, path: str) -> dict:
    """The optimizer state of output parameter ``name``: its moved tensors from ``table``, its
    numbers from its parts' states (equal across them, kept once), each per-parameter number
    finite (:func:`_check_finite`)."""
    first = state.states.get(id_of[parts[0]], {})
    entry = {}
    for key, value in first.items():
        moved = table.entries.get(f"{name}{STATE_SEP}{key}")
        if moved is not None:
            entry[key] = moved
            _check_finite(key, moved, name, path)
            continue
        if isinstance(value, LazyTensor):
            raise PlanError(f"{printable(path)}: the state {quote(key)} of {quote(name)} was not moved with it; "
                            "fusectl cannot write this optimizer")
        values = [state.states.get(id_of[p], {}).get(key) for p in parts]
        for v in values:
            _check_finite(key, v, name, path)
        if len(set(values)) != 1:  # finite, so equal values are one
            raise PlanError(f"{printable(path)}: the parts of {quote(name)} hold different {quote(key)} states "
                            f"({', '.join(map(repr, sorted(set(values), key=repr)))}); one fused parameter keeps one")
        entry[key] = value
    for p in parts[1:]:
        if set(state.states.get(id_of[p], {})) != set(first):
            raise PlanError(f"{printable(path)}: the parts of {quote(name)} hold different state keys "
                            f"({quote(parts[0])} and {quote(p)}); one fused parameter keeps one state")
    return entry


def _check_finite(key: str, value, name: str, path: str) -> None:
    """A per-parameter number (``step``, NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``) is
    finite, whether the optimizer keeps it as a Python number or as a tensor (its value read:
    one number). torch resumes from a NaN ``step`` without a word, and Adam's bias correction
    ``1 - beta ** step`` then turns every update, so every parameter, into NaN: a CheckpointError."""
    if key not in SCALAR_KEYS:
        return
    if isinstance(value, LazyTensor):
        finite = bool(np.isfinite(np.asarray(value.read(), dtype=np.float64)).all())
    else:
        finite = type(value) not in (float, int) or math.isfinite(value)
    if not finite:
        shown = value.read().tolist() if isinstance(value, LazyTensor) else value
        raise CheckpointError(f"{printable(path)}: the optimizer state {quote(key)} of {quote(name)} is {shown!r}, "
                              "not a finite number; resumed from it, torch's bias correction (1 - beta ** step) "
                              "would turn every update into NaN, so the file is corrupt. Pass "
                              f"{option('drop_optimizer')} to write the model without its optimizer state")


@dataclass(frozen=True, eq=False)
class _Copy(LazyTensor):
    """Another tensor with ``source``'s data: written as its own storage (an untied member's
    state, which torch's optimizer must not update in place with another parameter's)."""

    spec: TensorSpec
    source: LazyTensor

    def read(self):
        """The source's data."""
        return self.source.read()

    def byte_ranges(self):
        """The source's file ranges (copied without decoding)."""
        return self.source.byte_ranges()


def tree_tensors(tree):
    """Every tensor of a training tree (dicts, lists, tuples), depth first; one met twice twice."""
    if isinstance(tree, LazyTensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from tree_tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from tree_tensors(v)
