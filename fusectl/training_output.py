"""A fused training dict written whole: the model, the optimizer with its state moved, the rest kept.

When ``fuse`` reads a training dict whose optimizer state it can map (``Checkpoint.training``
with an optimizer) and writes a PyTorch file, it plans the state tensors with their parameters
(``<name>::<key>`` entries of the table, ``followers.optimizer``) and this module assembles
what ``torch.save`` would have written for the fused model's training:

- the model state dict: the fused table's tensors as a ``collections.OrderedDict`` (tied names
  one tensor, so one storage), each fused tensor where its first part was (in the given
  parameter order when there is one);
- the optimizer, in the form it was read in (``io.optimizer_state.written_optimizer``):
  ``param_groups`` with their hyperparameters as read, ``params`` renumbered 0..n-1 over the
  groups in the output parameter order (or, keyed by name, an unchanged parameter's name as
  read and a fused one's name), ``state`` keyed alike with each parameter's moved state tensors
  and its numbers (kept once for a fused parameter);
- every other entry of the training dict as read; fusectl's provenance in its metadata record.

The output parameter order is, by default, the state dict's: a fused parameter takes the
position of its first part. A model that declares its parameters in another order (Phi-3
declares ``o_proj`` before ``qkv_proj``) is given it as a JSON list
(``[n for n, _ in new_model.named_parameters()]``; ``param_order_out``): each group's
parameters are sorted by it.

``unfuse`` of such a file from its provenance writes it the same way, with the inverse plan
lifted to the state (``api.unfuse``): each part takes its fused parameter's place, so a fuse
in the default order unfuses to the original training dict, bitwise and in order.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

from .errors import PlanError, option, printable, quote
from .followers.optimizer import STATE_SEP
from .io.atomic import atomic_output
from .io.checkpoint import Checkpoint
from .io.formats import output_kind
from .io.key_path import KeyPath, node_at, without
from .io.optimizer_state import LIGHTNING_KEY, read_order, training_tree, written_optimizer
from .io.trainer_folder import TrainerOptimizer
from .steps import Plan
from .table import ParamTable
from .twins import MovedTwin
from .tensors import LazyTensor, TensorSpec
from .write import WriteReport, output_metadata


def writes_training(checkpoint: Checkpoint, out) -> bool:
    """Whether ``fuse`` writes ``checkpoint``'s whole training checkpoint to ``out``: a training
    dict with an optimizer beside its model, written as a PyTorch file, or a Hugging Face
    Trainer folder (``io.trainer_folder``) written as a folder (``trainer_output``)."""
    training = checkpoint.training
    if training is None or training.optimizer_key is None:
        return False
    kind = "folder" if isinstance(training, TrainerOptimizer) else "pytorch"
    return output_kind(os.fspath(out)) == kind


def write_training(checkpoint: Checkpoint, table: ParamTable, plan: Plan, recorded: Plan, out: str, *,
                   param_order_out: str | None = None, force: bool = False,
                   on_note: Callable[[str], None] | None = None, twins: Sequence[MovedTwin] = ()) -> WriteReport:
    """Write the training dict of ``checkpoint`` with ``table`` (what ``plan`` made of its
    training table) as its model and optimizer state, ``twins`` (``fusectl.twins``: the
    model's copies after its plan) at their keys, ``recorded`` as its provenance.

    :raises PlanError: a parameter of a param group that ``param_order_out`` does not list, a
        name it lists that the fused model does not hold, a fused parameter whose parts have
        different numbers of state or sit in two groups. Nothing is written then.
    """
    training = checkpoint.training
    order = read_order(os.fspath(param_order_out)) if param_order_out is not None else None
    moved = moved_optimizer(checkpoint, table, plan, order=order, order_source=param_order_out)
    root = training_tree(training.tree(), training.model_path, moved.model, training.optimizer_path, moved.optimizer,
                         twin_entries(checkpoint, twins))
    return _write_tree(checkpoint, table, root, recorded, out, force, on_note)


def twin_entries(checkpoint: Checkpoint, twins: Sequence[MovedTwin]) -> list[tuple[KeyPath, dict]]:
    """Each moved twin as (its key, the dict to write there): its tensors in the order the
    model's are written (the twin's own order, a fused tensor where its first part was) under
    its prefix, where its first tensor of the model stood; its other entries (an
    ``AveragedModel``'s ``n_averaged``) where they stood."""
    out = []
    for moved in twins:
        twin = moved.twin
        names, _, _ = _model_order(checkpoint, list(moved.table.entries), moved.plan, [],
                                   positions=list(twin.tensors))
        entries, placed = collections.OrderedDict(), False
        for key in twin.order:
            if key in twin.rest:
                entries[key] = twin.rest[key]
            elif not placed:
                entries.update((twin.prefix + n, moved.table.entries[n]) for n in names)
                placed = True
        out.append((twin.path, entries))
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
                    order_source=None, positions: list[str] | None = None) -> MovedOptimizer:
    """The model and optimizer state ``table`` holds after ``plan`` (the state tensors moved with
    their parameters), the optimizer's ids renumbered 0..n-1 over its groups in the output order:
    ``order`` where given (each group sorted by it; ``order_source`` names it in messages), else
    each parameter where its first part stands in ``positions`` (default: the checkpoint's state
    dict order).

    :raises PlanError: see :func:`write_training`.
    """
    training = checkpoint.training
    state, mapping = checkpoint.optimizer_mapped
    model_names = [n for n in table.entries if STATE_SEP not in n]
    model_order, origins, position = _model_order(checkpoint, model_names, plan, order or [], positions)
    model = collections.OrderedDict((n, table.entries[n]) for n in model_order)

    # each output parameter of the optimizer: the unique name, its group, its input ids
    group_of = {name: state.group_of(pid) for pid, name in mapping.names.items()}
    id_of = {name: pid for pid, name in mapping.names.items()}
    members: dict[str, list] = {}
    for name in model_order:
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


def write_without_optimizer(checkpoint: Checkpoint, table: ParamTable, plan: Plan, recorded: Plan, out: str, *,
                            force: bool = False, on_note: Callable[[str], None] | None = None,
                            twins: Sequence[MovedTwin] = ()) -> WriteReport:
    """Write the training dict of ``checkpoint`` with ``table`` (what ``plan`` made of its model)
    as its model, ``twins`` at their keys (as :func:`write_training`), and its optimizer left
    out (``--drop-optimizer``): the entry at its optimizer
    key, or Lightning's ``optimizer_states`` with ``lr_schedulers``, as Lightning's
    ``save_weights_only`` leaves them out; every other entry kept. The model in the state dict's
    order, each fused tensor where its first part was."""
    training = checkpoint.training
    model_order, _, _ = _model_order(checkpoint, list(table.entries), plan, [])
    model = collections.OrderedDict((n, table.entries[n]) for n in model_order)
    root = training_tree(training.tree(), training.model_path, model, None, None, twin_entries(checkpoint, twins))
    path = training.optimizer_path
    if len(path) >= 2 and path[-2] == LIGHTNING_KEY and type(path[-1]) is int:
        root = without(root, path[:-2], {LIGHTNING_KEY, "lr_schedulers"})
    else:
        root = without(root, path[:-1], {path[-1]})
    return _write_tree(checkpoint, table, root, recorded, out, force, on_note)


def _model_order(checkpoint: Checkpoint, model_names: list[str], plan: Plan, order: list[str],
                 positions: list[str] | None = None):
    """(the output's model tensors in order, each model tensor's input names, each input name's
    position): ``order`` first (a given parameter order orders the state dict as well), then
    ``positions`` (default: the state dict's order), a fused tensor where its first part was."""
    inputs = list(positions) if positions is not None else list(checkpoint.table.entries)
    listed = set(inputs)
    inputs += [n for n in checkpoint.table.entries if n not in listed]
    origins = _origins(inputs, plan)
    position = {n: i for i, n in enumerate(inputs)}

    def first_part(name: str) -> int:
        return min((position[p] for p in origins.get(name, {name}) if p in position), default=len(position))

    rank = {n: i for i, n in enumerate(order)}
    made_at = {n: i for i, n in enumerate(model_names)}
    return sorted(model_names, key=lambda n: (rank.get(n, len(rank)), first_part(n), made_at[n])), origins, position


def _write_tree(checkpoint: Checkpoint, table: ParamTable, root, recorded: Plan, out: str, force: bool,
                on_note) -> WriteReport:
    """Write the training tree ``root`` whose model is ``table``'s, ``recorded`` as its provenance."""
    model_table = model_only(table)
    shard_metadata, index_metadata = output_metadata(model_table, recorded, checkpoint.metadata)
    metadata = {**shard_metadata([(n, t.spec) for n, t in model_table.written()]), **index_metadata}
    written = {id(t): t for t in tree_tensors(root)}
    from .io.torch_writer import write_torch_file  # PyTorch's writer loads its reader: only when needed
    with atomic_output(out, force=force, inputs=checkpoint.input_paths(), on_note=on_note) as temp:
        write_torch_file(temp, root, metadata=metadata)
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
    numbers from its parts' states (equal across them, kept once)."""
    first = state.states.get(id_of[parts[0]], {})
    entry = {}
    for key, value in first.items():
        moved = table.entries.get(f"{name}{STATE_SEP}{key}")
        if moved is not None:
            entry[key] = moved
            continue
        if isinstance(value, LazyTensor):
            raise PlanError(f"{printable(path)}: the state {quote(key)} of {quote(name)} was not moved with it; "
                            "fusectl cannot write this optimizer")
        values = {state.states.get(id_of[p], {}).get(key) for p in parts}
        if len(values) != 1:
            raise PlanError(f"{printable(path)}: the parts of {quote(name)} hold different {quote(key)} states "
                            f"({', '.join(map(repr, sorted(values, key=repr)))}); one fused parameter keeps one")
        entry[key] = value
    for p in parts[1:]:
        if set(state.states.get(id_of[p], {})) != set(first):
            raise PlanError(f"{printable(path)}: the parts of {quote(name)} hold different state keys "
                            f"({quote(parts[0])} and {quote(p)}); one fused parameter keeps one state")
    return entry


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
