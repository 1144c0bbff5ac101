"""The order of an output's keys: the input's own, each tensor a step made where its first input was.

A loader meets a checkpoint's keys in an order — a state dict's in its pickle, a safetensors
header's, an index's — and code walks them in it (``for name, t in state_dict.items()``, an
optimizer that numbers its parameters by position). fusectl writes every output in the input's
order:

- a name the plan leaves alone keeps its place;
- a tensor a step makes takes the place of the step's first input (``qkv_proj`` where
  ``q_proj`` was), several outputs in the step's order (``q``, ``k``, ``v`` where ``qkv``
  was), through any number of steps;
- a tied name the input did not list (an alias of the save_model convention) follows its
  tensor's first name; a name with no place at all comes last, in the table's order;
- a preferred order (a given parameter order; the order before fusectl's first step, when a
  fused file is unfused) then reorders the names it lists among the places they hold.

Unfusing a fuse gives the input's order back wherever a fused tensor's parts were adjacent; where
they were not, the provenance records the original order (:func:`recorded_order`), and the
unfuse takes it as its preferred order.

The writer may still lay the bytes in another order where the format indexes them apart (a
safetensors header, a zip's central directory): reads stay sequential, and the keys a loader
sees are in this order.

>>> from fusectl.steps import Plan
>>> output_order(["a", "b", "c"], Plan(), ["c", "a", "b", "d"])
['a', 'b', 'c', 'd']
>>> reordered(["x", "a", "y", "b"], ["b", "a"])
['x', 'b', 'y', 'a']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .errors import PlanError
from .io.checkpoint import Checkpoint
from .steps import Plan
from .table import ParamTable

_AFTER = float("inf")  # a tied alias's place: right after its tensor's first name and what was made there


def sort_keys(positions: Mapping[str, int], plan: Plan, names: Sequence[str],
              ties: Mapping[str, Sequence[str]] | None = None) -> dict[str, tuple]:
    """Each of ``names`` that has a place → its sort key: ``(position,)`` for a name of the
    input at ``positions``, the key of a step's first placed input extended by the output's
    index for a name a step made, and a tied name's (``ties``: a name → every name of its
    tensor) right after the first of its tensor's names that has one."""
    keys = {n: (p,) for n, p in positions.items()}
    for step in plan.steps:
        placed = [keys[n] for n in step.inputs if n in keys]
        if placed:
            first = min(placed)
            for k, name in enumerate(step.outputs):
                keys[name] = (*first, k)
    out = {n: keys[n] for n in names if n in keys}
    for name in names:
        if name not in out and ties is not None:
            members = [keys[m] for m in ties.get(name, ()) if m in keys]
            if members:
                out[name] = (*min(members), _AFTER)
    return out


def output_order(input_order: Sequence[str], plan: Plan, names: Iterable[str], *,
                 ties: Mapping[str, Sequence[str]] | None = None,
                 preferred: Sequence[str] | None = None) -> list[str]:
    """``names`` (what the output holds) in the order of the module doc: ``input_order`` the
    input's names in its order, ``plan`` what made ``names`` from them, ``ties`` as
    :func:`sort_keys`'s, ``preferred`` an order to take among the places its names hold."""
    names = list(names)
    keys = sort_keys({n: i for i, n in enumerate(input_order)}, plan, names, ties)
    unplaced = {n: i for i, n in enumerate(names)}
    ordered = sorted(names, key=lambda n: (0, keys[n], 0) if n in keys else (1, (), unplaced[n]))
    return reordered(ordered, preferred) if preferred else ordered


def reordered(sequence: Sequence, preferred: Sequence) -> list:
    """``sequence`` with the items ``preferred`` lists put in ``preferred``'s order, in the places
    those items hold; every other item where it is."""
    rank = {n: i for i, n in enumerate(preferred)}
    places = [i for i, n in enumerate(sequence) if n in rank]
    out = list(sequence)
    for place, name in zip(places, sorted((sequence[i] for i in places), key=rank.__getitem__)):
        out[place] = name
    return out


def ties_of(groups: Iterable[Sequence[str]]) -> dict[str, Sequence[str]]:
    """Each name of a tie group → the group (``ParamTable.groups().values()``)."""
    return {n: g for g in groups if len(g) > 1 for n in g}


def recorded_order(original: Sequence[str] | None, written: Sequence[str], plan: Plan) -> list[str] | None:
    """What a provenance records for an unfuse to restore ``original`` (the order before the
    recorded plan's first step): None when unfusing ``written`` (the output's names in order,
    which ``plan``, the whole recorded plan, made) gives that order anyway, or when the plan
    cannot be undone; else ``original``."""
    if original is None or not plan.groups:
        return None
    try:
        inverse = plan.inverse()
    except PlanError:
        return None  # a one-way step: nothing unfuses it
    restored = output_order(written, inverse, list(original))
    return None if restored == list(original) else list(original)


def original_order(input_order: Sequence[str], recorded: Sequence[str] | None, history: Plan) -> list[str] | None:
    """The order before fusectl's first step of a checkpoint whose keys are ``input_order``:
    its provenance's ``recorded`` order, else (``history``, the recorded plan, undone) the order
    an unfuse would give; ``input_order`` itself when nothing is recorded; None when the history
    cannot be undone."""
    if recorded is not None:
        return list(recorded)
    if not history.groups:
        return list(input_order)
    try:
        inverse = history.inverse()
    except PlanError:
        return None
    return output_order(input_order, inverse, names_after(input_order, inverse))


def names_after(names: Sequence[str], plan: Plan) -> list[str]:
    """The names a table of ``names`` holds after ``plan`` (each group's inputs replaced by its
    outputs, as the executor does), in no particular order."""
    out = dict.fromkeys(names)
    for group in plan.groups:
        for step in group.steps:
            for name in step.inputs:
                out.pop(name, None)
        out.update(dict.fromkeys(n for step in group.steps for n in step.outputs))
    return list(out)


@dataclass(frozen=True)
class KeyOrder:
    """An output's key order (``names``: every name of its table, in order), the order before
    fusectl's first step (``original``; None: unknown) and the plan its provenance records
    (``recorded``): what the provenance keeps of the original order is :attr:`record`."""

    names: list[str]
    original: list[str] | None = None
    recorded: Plan = Plan()

    @property
    def record(self) -> list[str] | None:
        """The original order where an unfuse needs it (:func:`recorded_order`), else None."""
        return recorded_order(self.original, self.names, self.recorded)


def keys_for(checkpoint: Checkpoint, table: ParamTable, made: Plan, recorded: Plan) -> KeyOrder:
    """The key order of an output of ``checkpoint`` holding ``table``, which ``made`` made from
    the checkpoint's table, with ``recorded`` (its history and new steps) as its provenance:
    the module doc's order, the order the checkpoint's provenance recorded taken among the places
    its names hold."""
    provenance = checkpoint.provenance
    kept = list(provenance.order) if provenance is not None and provenance.order is not None else None
    inputs = checkpoint.input_order()
    names = output_order(inputs, made, list(table.entries), ties=ties_of(table.groups().values()), preferred=kept)
    original = original_order(inputs, kept, provenance.plan if provenance is not None else Plan())
    return KeyOrder(names, original, recorded)
