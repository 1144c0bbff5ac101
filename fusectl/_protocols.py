"""The interfaces that let layers talk without importing each other (onnx-ir's habit).

Each class is a :class:`typing.Protocol`: it says what a caller may ask, and any object that
answers is accepted — no base class to inherit, no import of the concrete type. This module
sits at the bottom of the layers, so the types it names are themselves protocols here
(:class:`StepLike`, :class:`TableLike`) or left as ``Any`` where only the layer above knows
them (an ``Op``, a ``RuleOrigin``).

Followers
---------
A *follower* is a kind of tensor that rides on a base weight and is moved by the base's planned
steps: a quantized weight's scales (``fusectl.followers.scales``), a LoRA adapter's A and B
(``fusectl.followers.lora``). The planner binds rules to base weights only; a follower is told
each step (:meth:`Follower.lift`) and answers with the steps its own tensors take, or refuses.
The op says what the step does through :class:`Lift` (``Op.lift``), so no follower switches on
op kinds and no op knows a follower. A :class:`Rider` sits in the table beside its weights and
the planner asks all of them at once (:class:`Riders`); a :class:`View` stands in for a base
its checkpoint does not hold. A checkpoint's followers are a :class:`FollowerSet`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, NoReturn, Protocol, Sequence, runtime_checkable

from .tensors import TensorSpec


class StepLike(Protocol):
    """One planned step (``fusectl.steps.Step``): an op, named inputs → named outputs, specs known."""

    op: Any
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    input_specs: tuple[TensorSpec, ...]
    output_specs: tuple[TensorSpec, ...]


class TableLike(Protocol):
    """What followers read of a parameter table (``fusectl.table.ParamTable``): names and specs."""

    def __contains__(self, name: str) -> bool: ...

    def __getitem__(self, name: str) -> Any: ...

    def names(self) -> list[str]: ...

    def spec(self, name: str) -> TensorSpec: ...


class Lift(Protocol):
    """What an op says its step does to the tensors that follow the weights it consumes.

    ``Op.lift(lift)`` calls exactly one of the methods below; the follower turns it into steps
    on its own tensors (a scale grid, a LoRA factor) or refuses. ``ndim`` is the number of
    dimensions of the step's (first) input weight, so an op can normalize its axis.
    """

    ndim: int

    def rename(self) -> None:
        """The outputs are the inputs under new names (rename; a row move inside blocks)."""

    def drop(self) -> None:
        """The inputs are dropped (drop; a dequantize drops the scales it consumed)."""

    def along(self, axis: int, make: Callable[[list[int], list[int]], Any]) -> None:
        """The step moves whole slabs of its inputs along ``axis`` (concat, split, interleave,
        deinterleave, reorder, rope_permute); ``make(in_lengths, out_lengths)`` is the same op
        for tensors of those lengths along that axis."""

    def stack(self, axis: int) -> None:
        """The inputs are stacked along a new ``axis`` of the output."""

    def unstack(self, axis: int) -> None:
        """The input is cut along ``axis`` into one output per index."""

    def transpose(self, perm: Sequence[int]) -> None:
        """The input's axes are permuted by ``perm``."""

    def reshape(self) -> None:
        """The input's elements keep their order under a new shape."""

    def refuse(self, why: str) -> NoReturn:
        """The step cannot carry the follower exactly: a PlanError naming the rule, the weight,
        the follower tensor and ``why`` (with what to do)."""


class Follower(Protocol):
    """One kind of tensor that rides on base weights, as found in one checkpoint.

    ``kind`` names it in reports (``"scales"``, ``"lora"``)."""

    kind: str

    def claims(self, weight: str, table: TableLike) -> list[str]:
        """The follower tensors ``table`` holds beside base weight ``weight`` (its scales; for
        a LoRA adapter, the module's A and B)."""

    def lift(self, step: StepLike, group: Sequence[StepLike], table: TableLike, describe: str) -> list[StepLike]:
        """The steps this follower's tensors take for one base ``step`` of a rule's ``group``
        (bound to ``table`` as the rules before left it; ``describe`` names the rule). Lifts
        are exact or refused: a PlanError naming the rule, the weight and the follower tensor.
        A follower tensor that a step of ``group`` consumes itself is not moved again."""

    def report(self) -> dict | None:
        """What ``inspect --json`` shows of this follower (None: nothing to show)."""


class Rider(Follower, Protocol):
    """A follower that sits in the table the rules bind, beside its weights (scales; next,
    optimizer moments). Configured once per plan, then asked what ``Riders`` asks."""

    def for_plan(self, rulesets: Sequence[Any] = (), origin: Any = None) -> "Rider":
        """This follower for a plan of ``rulesets`` (their settings, a rules file's
        ``[quantization]``, override the checkpoint's), or for binding again a group recorded
        with ``origin``."""

    def claimed(self, names: Iterable[str]) -> set[str]:
        """Every name a tensor of this follower beside one of ``names`` would have."""

    def complete(self, op: Any) -> Any:
        """``op`` with what this follower knows filled in (a dequantize's block size)."""

    def recorded(self, origin: Any) -> Any:
        """``origin`` with what binding the rule again needs of this follower (the block size)."""


class Riders(Protocol):
    """What the planner asks of the riders in the table it binds (``make_plan``, ``bind_rule``):
    every rider of one plan at once (``FollowerSet.riders``)."""

    def claimed(self, names: Iterable[str]) -> set[str]:
        """Of every name a rider tensor of ``names`` could have, a set: a binding made only of
        such names is not a binding of its own (the rider moves with its weight)."""

    def complete(self, op: Any) -> Any:
        """``op`` with what the riders know filled in."""

    def recorded(self, origin: Any) -> Any:
        """``origin`` (a ``RuleOrigin``) with what binding the rule again needs recorded."""

    def lift(self, steps: Sequence[StepLike], table: TableLike, describe: str) -> list[StepLike]:
        """One rule's bound ``steps``, each followed by the steps of the riders on its inputs
        (joined before the group is applied: a later rule binds the moved ones)."""


class View(Follower, Protocol):
    """A follower whose base is not in its checkpoint (a LoRA adapter): rules bind to a view
    of the base, and the follower's steps replace the base steps."""

    stem: str  # the weight file's stem when written (``adapter_model``)

    def base_view(self, table: TableLike) -> Any:
        """A name-and-shape-only table of the base weights (a ``ParamTable``)."""

    def lift_plan(self, base: Any, table: Any, untie: bool) -> tuple[Any, Any]:
        """(plan on the follower's tensors, the table it makes) for the ``base`` plan bound to
        the view; ``table`` is the follower checkpoint's (copied, not changed)."""

    def config_files(self) -> Mapping[str, tuple[str, str]]:
        """The config files the view's plan edits: relative name → (path, text as read)."""


@runtime_checkable
class FollowerSet(Protocol):
    """The followers detected in one checkpoint (``Checkpoint.followers``)."""

    followers: tuple[Follower, ...]
    view: View | None

    def riders(self, rulesets: Sequence[Any] = (), origin: Any = None) -> Riders:
        """Every rider configured for a plan of ``rulesets``, or for binding again a group
        recorded with ``origin`` (``Rider.for_plan``)."""

    def of(self, kind: str) -> Follower | None:
        """The follower of ``kind`` (None when the checkpoint has none)."""

    def report(self, kind: str) -> dict | None:
        """The report of the follower of ``kind`` (None when there is none)."""
