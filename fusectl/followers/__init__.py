"""Followers: tensors that ride on a base weight and follow its planned steps (``_protocols``).

A checkpoint's followers are detected once, when it is first planned or inspected
(``Checkpoint.followers``), by the registry :data:`KINDS`: one row per kind of follower, each a
``detect`` function of what the checkpoint holds (:class:`Source`: its table, config.json, its
``adapter_config.json`` as read, its recorded plan).

- *Riders* sit in the checkpoint's own table beside their weights (``scales``: a quantized
  weight's scales). The planner joins their steps to each rule's group before it is applied,
  so a later rule binds the moved ones (``-r llama-qkv -r fp8-dequant``).
- ``optimizer``: a training checkpoint's optimizer state rides on its parameters (a rider
  whose tensors ``Checkpoint.training_table`` puts beside them).
- A *view* replaces the base (``lora``: an adapter holds A and B, not the base weights): rules
  bind to its base view, and its lifted steps are the plan.

Adding a follower is one module (a class answering ``_protocols.Rider`` or ``_protocols.View``,
whose ``lift`` hands each step's op a ``_protocols.Lift``) and one row in :data:`KINDS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from ..errors import InternalError
from ..steps import Plan, Step
from ..table import ParamTable
from .lora import LoraAdapter
from .optimizer import OptimizerFollower
from .scales import Scales


@dataclass(frozen=True)
class Source:
    """What detecting followers may look at, read once by ``io.checkpoint`` (which followers
    never import): the table, config.json as parsed, ``adapter_config.json`` as (path, text,
    parsed object) or None, the checkpoint's recorded plan, and a training dict's optimizer
    state with its parameter mapping (``io.optimizer_state``: (OptimizerState, ParamMap or a
    function that proves it when first called)) or None."""

    table: ParamTable
    config: Mapping | None = None
    adapter_config: tuple[str, str, dict] | None = None
    history: Plan | None = None
    optimizer: tuple | None = None


@dataclass(frozen=True)
class Kind:
    """One row of the registry: a follower kind's name and how it is found in a checkpoint."""

    name: str
    detect: Callable[[Source], object | None]
    rides: bool  # True: a rider in the table; False: a view that replaces the base


KINDS: tuple[Kind, ...] = (
    Kind("scales", lambda source: Scales.detect(source.table, source.config), rides=True),
    Kind("optimizer", lambda source: OptimizerFollower.detect(source.optimizer), rides=True),
    Kind("lora", lambda source: LoraAdapter.detect(source.table, source.adapter_config, source.history),
         rides=False),
)


class Followers:
    """The followers detected in one checkpoint (``_protocols.FollowerSet``)."""

    def __init__(self, found: Sequence[tuple[Kind, object]]):
        self._found = tuple(found)
        self.followers = tuple(f for _, f in self._found)
        views = [f for kind, f in self._found if not kind.rides]
        if len(views) > 1:  # two views would each replace the base: no plan could serve both
            raise InternalError(f"followers {[v.kind for v in views]} are all views of one checkpoint; "
                                "KINDS must not detect two views at once")
        self.view = views[0] if views else None

    def riders(self, rulesets: Sequence = (), origin=None) -> "Riders":
        return Riders([f.for_plan(rulesets, origin) for kind, f in self._found if kind.rides])

    def of(self, kind: str):
        """The follower of ``kind`` (None when the checkpoint has none)."""
        return next((f for k, f in self._found if k.name == kind), None)

    def report(self, kind: str) -> dict | None:
        found = self.of(kind)
        return found.report() if found is not None else None


def detect(source: Source) -> Followers:
    """Every follower :data:`KINDS` finds in ``source``."""
    found = []
    for kind in KINDS:
        follower = kind.detect(source)
        if follower is not None:
            found.append((kind, follower))
    return Followers(found)


class Riders:
    """The rider followers of one plan, as the planner asks them (``_protocols.Riders``)."""

    def __init__(self, riders: Sequence = ()):
        self._riders = tuple(riders)

    def claimed(self, names: Iterable[str]) -> set[str]:
        names = list(names)
        return set().union(*(r.claimed(names) for r in self._riders))

    def complete(self, op):
        for rider in self._riders:
            op = rider.complete(op)
        return op

    def recorded(self, origin):
        for rider in self._riders:
            origin = rider.recorded(origin)
        return origin

    def lift(self, steps: Sequence[Step], table: ParamTable, describe: str) -> list[Step]:
        lifted: list[Step] = []
        for step in steps:
            lifted.append(step)
            for rider in self._riders:
                lifted.extend(rider.lift(step, steps, table, describe))
        return lifted


__all__ = ["KINDS", "Followers", "Kind", "LoraAdapter", "OptimizerFollower", "Riders", "Scales", "Source", "detect"]
