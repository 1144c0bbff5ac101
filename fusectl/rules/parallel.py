"""Parallel layouts: how a model's tensors are split over tensor-parallel ranks, declared in TOML.

A layout file (the shipped one is ``fusectl/rules/layouts/megatron-core.toml``) lists
``[[parallel]]`` tables; the first whose ``names`` match a tensor, and whose ``when`` flag (if
any) the save sets, says how that tensor is split::

    [[parallel]]
    kind  = "column-swiglu"     # how inspect names the split
    names = ["{p*}.linear_fc1.weight", "{p*}.linear_fc1.bias"]
    axis  = 0                   # the axis cut; without one, the tensor is whole on every rank
    parts = 2                   # the axis is 2 equal parts ([gate; up]), each cut over the ranks
    when  = "swiglu"            # only where the save's args set swiglu

Rank ``r`` of ``n`` holds, of an axis of global length ``L`` made of ``k`` parts, the slices
``[j·L/k + r·L/(k·n), +L/(k·n))`` for ``j = 0 … k-1``, laid end to end in that order. A
column-parallel linear is ``axis = 0``, a row-parallel one ``axis = 1``, Megatron's SwiGLU
``linear_fc1`` (``[gate_r; up_r]`` on each rank) ``axis = 0, parts = 2``. A reader joins the
ranks' pieces by the layout and a writer, inverting it, cuts them, so one file describes the
model at any TP (:meth:`Split.runs` gives both directions the same pieces).

Pipeline stages and expert-parallel ranks hold consecutive blocks of layers and experts, each
numbering its own from 0; the ``[pipeline]`` and ``[experts]`` tables name where that index is
(one ``{x:int}`` placeholder, a :class:`Numbering`), and which names outside the layers only the
first or the last stage holds::

    [pipeline]
    layers = "decoder.layers.{i:int}.{rest*}"    # stage p's layer i is layer p·L/PP + i
    first  = ["embedding.{rest*}"]               # on the first stage only
    last   = ["decoder.final_layernorm.{rest*}", "output_layer.{rest*}"]   # on the last only

    [experts]
    names = "{p*}.experts.local_experts.{i:int}.{module}.{tensor}"  # EP rank e's i: e·E/EP + i

A reader renumbers each rank's names to the whole model's by the same tables a writer uses to
renumber them back.

:class:`Ledger` is the proof a conversion keeps of those pieces: every element of every source
tensor taken exactly once (or the tensor is a copy of a replicated one, checked equal to the copy
taken) and every element of every output tensor given exactly once. A layout that maps a tensor
two ways, a reader that forgets a rank's tensor, a writer that leaves a hole: each fails the
check, naming the tensor.
"""

from __future__ import annotations

import functools
import math
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from typing import Mapping, Sequence

from ..errors import RuleError, quote
from .patterns import Pattern

_KEYS = {"version", "description", "parallel", "pipeline", "experts"}
_SPLIT_KEYS = {"kind", "names", "axis", "parts", "when"}
_PIPELINE_KEYS = {"layers", "first", "last"}
_EXPERTS_KEYS = {"names"}


@dataclass(frozen=True)
class Split:
    """How a tensor is split over tensor-parallel ranks: ``axis`` None keeps it whole on every
    rank (replicated); else the axis is ``parts`` equal parts, each cut in equal slices."""

    kind: str
    axis: int | None = None
    parts: int = 1

    @property
    def replicated(self) -> bool:
        """Whole on every rank."""
        return self.axis is None

    def divides(self, length: int, tp: int) -> bool:
        """Whether a global axis of ``length`` splits so over ``tp`` ranks."""
        return self.replicated or length % (self.parts * tp) == 0

    def runs(self, length: int, tp: int) -> list[list[tuple[int, int, int]]]:
        """Per rank, its slices of a global axis of ``length``: (start on the rank, start in the
        whole, count), in the rank's order (module docstring); a replicated split gives every rank
        the whole axis.

        >>> Split("column-swiglu", 0, 2).runs(8, 2)
        [[(0, 0, 2), (2, 4, 2)], [(0, 2, 2), (2, 6, 2)]]
        """
        if self.replicated or tp == 1:
            return [[(0, 0, length)] for _ in range(tp)]
        if not self.divides(length, tp):
            raise ValueError(f"{length} does not split in {self.parts} parts over {tp} ranks")
        part, n = length // self.parts, length // (self.parts * tp)
        return [[(j * n, j * part + r * n, n) for j in range(self.parts)] for r in range(tp)]


@dataclass(frozen=True)
class Numbering:
    """Names whose index ranks hold in consecutive blocks, each rank numbering its block from 0
    (a pipeline stage's layers, an expert-parallel rank's experts): ``pattern``'s one
    ``{x:int}`` placeholder is the index.

    >>> layers = Numbering(Pattern.parse("decoder.layers.{i:int}.{rest*}"))
    >>> layers.index("decoder.layers.3.mlp.linear_fc1.weight"), layers.index("output_layer.weight")
    (3, None)
    >>> layers.on_rank("decoder.layers.3.mlp.linear_fc1.weight", 1, 2)
    'decoder.layers.1.mlp.linear_fc1.weight'
    """

    pattern: Pattern

    @property
    def _key(self) -> str:
        return next(p.name for p in self.pattern.placeholders if p.kind == "int")

    def index(self, name: str) -> int | None:
        """The index in ``name``, or None where the pattern does not match it."""
        binding = self.pattern.match(name)
        return None if binding is None else int(binding[self._key])

    def renumbered(self, name: str, delta: int) -> str:
        """``name`` with its index moved by ``delta`` (a rank's local name to the whole model's:
        the indices of the ranks before it).

        :raises ValueError: a name the pattern does not match, an index that would go below 0."""
        binding = self.pattern.match(name)
        if binding is None or int(binding[self._key]) + delta < 0:
            raise ValueError(f"{name!r} has no index {self.pattern.text!r} can move by {delta}")
        return self.pattern.format({**binding, self._key: str(int(binding[self._key]) + delta)})

    def on_rank(self, name: str, rank: int, per_rank: int) -> str | None:
        """The name rank ``rank`` (each holding ``per_rank`` consecutive indices) holds the whole
        model's ``name`` by, numbered from 0 there; None where another rank holds it."""
        index = self.index(name)
        if index is None or not rank * per_rank <= index < (rank + 1) * per_rank:
            return None
        return self.renumbered(name, -rank * per_rank)


@dataclass(frozen=True)
class Layout:
    """A loaded layout file: its splits, first match wins; where the layers' and the experts'
    index is (None: the file has no ``[pipeline]`` / ``[experts]`` table), and which names
    outside the layers the first stage alone holds, or the last."""

    source: str
    description: str
    splits: tuple[tuple[tuple[Pattern, ...], str | None, Split], ...]
    layers: Numbering | None = None
    first: tuple[Pattern, ...] = ()
    last: tuple[Pattern, ...] = ()
    experts: Numbering | None = None

    def stage(self, name: str, stages: int) -> int | None:
        """The stage of ``stages`` that holds ``name``, a name outside the layers: 0 for a
        ``first`` name, the last for a ``last`` one; None for a name the layout places on none."""
        if any(p.match(name) is not None for p in self.first):
            return 0
        if any(p.match(name) is not None for p in self.last):
            return stages - 1
        return None

    def split_of(self, name: str, flags: Mapping[str, object]) -> Split | None:
        """The split of tensor ``name`` in a save whose flags (its args) are ``flags``: the first
        table whose names match and whose ``when`` flag is true there; None if none matches."""
        for patterns, when, split in self.splits:
            if (when is None or flags.get(when) is True) and any(p.match(name) is not None for p in patterns):
                return split
        return None

    def kind(self, kind: str) -> Split:
        """The split named ``kind`` (``"replicated"`` is always there).

        :raises KeyError: a kind the layout does not declare."""
        if kind == "replicated":
            return Split("replicated")
        return next(s for _, _, s in self.splits if s.kind == kind)


def load_layout(text: str, source: str) -> Layout:
    """Parse and validate a layout file; ``source`` names it in messages.

    >>> layout = load_layout('version = 1\\n[[parallel]]\\nkind = "row"\\nnames = ["{p*}.proj.weight"]\\naxis = 1',
    ...                      "l.toml")
    >>> layout.split_of("h.0.proj.weight", {})
    Split(kind='row', axis=1, parts=1)

    :raises RuleError: not TOML, an unknown key, a bad pattern, axis or parts, one kind
        declared as two different splits.
    """
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RuleError(f"{source}: not valid TOML: {e}") from e
    _known(doc, _KEYS, source)
    if type(doc.get("version")) is not int or doc["version"] != 1:
        raise RuleError(f"{source}: 'version = 1' is required (got {doc.get('version')!r})")
    tables = doc.get("parallel")
    if not isinstance(tables, list) or not tables:
        raise RuleError(f"{source}: a layout lists its splits as [[parallel]] tables; it has none")
    splits, kinds = [], {}
    for k, table in enumerate(tables, 1):
        where = f"{source} [[parallel]] #{k}"
        if not isinstance(table, dict):
            raise RuleError(f"{where}: must be a table")
        _known(table, _SPLIT_KEYS, where)
        kind, names, when = table.get("kind"), table.get("names"), table.get("when")
        if not isinstance(kind, str) or not kind or kind == "replicated" and "axis" in table:
            raise RuleError(f"{where}: kind must be a name (\"replicated\" only for a split without an axis)")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise RuleError(f"{where}: names must be a list of name patterns")
        if when is not None and not isinstance(when, str):
            raise RuleError(f"{where}: when must name a flag of the save (such as \"swiglu\")")
        axis, parts = table.get("axis"), table.get("parts", 1)
        if axis is not None and (type(axis) is not int or not 0 <= axis < 8):
            raise RuleError(f"{where}: axis must be an integer 0 … 7, not {axis!r}")
        if type(parts) is not int or not 1 <= parts <= 64 or parts > 1 and axis is None:
            raise RuleError(f"{where}: parts must be an integer 1 … 64, and needs an axis")
        split = Split(kind, axis, parts)
        if kinds.setdefault(kind, split) != split:
            raise RuleError(f"{where}: kind {quote(kind)} is declared before as another split; give each split "
                            "its own kind")
        try:
            patterns = tuple(Pattern.parse(n) for n in names)
        except RuleError as e:
            raise RuleError(f"{where}: {e}") from None
        splits.append((patterns, when, split))
    description = doc.get("description", "")
    if not isinstance(description, str):
        raise RuleError(f"{source}: description must be a string")
    pipeline, experts = doc.get("pipeline", {}), doc.get("experts")
    if not isinstance(pipeline, dict) or experts is not None and not isinstance(experts, dict):
        raise RuleError(f"{source}: [pipeline] and [experts] must be tables")
    _known(pipeline, _PIPELINE_KEYS, f"{source} [pipeline]")
    layers = _numbering(pipeline["layers"], f"{source} [pipeline] layers") if "layers" in pipeline else None
    first, last = (_patterns(pipeline.get(k, []), f"{source} [pipeline] {k}") for k in ("first", "last"))
    if experts is not None:
        _known(experts, _EXPERTS_KEYS, f"{source} [experts]")
        experts = _numbering(experts.get("names"), f"{source} [experts] names")
    return Layout(source, description, tuple(splits), layers, first, last, experts)


def _patterns(texts: object, where: str) -> tuple[Pattern, ...]:
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise RuleError(f"{where}: must be a list of name patterns")
    try:
        return tuple(Pattern.parse(t) for t in texts)
    except RuleError as e:
        raise RuleError(f"{where}: {e}") from None


def _numbering(text: object, where: str) -> Numbering:
    if not isinstance(text, str):
        raise RuleError(f"{where}: must be a name pattern")
    pattern = _patterns([text], where)[0]
    if sum(p.kind == "int" for p in pattern.placeholders) != 1:
        raise RuleError(f"{where}: {quote(text)} must hold one {{x:int}} placeholder, the index ranks number "
                        "from 0")
    return Numbering(pattern)


@functools.cache
def shipped_layout(name: str) -> Layout:
    """The layout file ``name`` shipped in ``fusectl/rules/layouts/``.

    >>> shipped_layout("megatron-core").split_of("decoder.layers.0.mlp.linear_fc2.weight", {}).kind
    'row'
    """
    text = (resources.files(__package__) / "layouts" / f"{name}.toml").read_text()
    return load_layout(text, f"layouts/{name}.toml")


def _known(table: Mapping, allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise RuleError(f"{where}: unknown key {unknown[0]!r}; allowed keys are {', '.join(sorted(allowed))}")


# ------------------------------------------------------------------------------- the proof


@dataclass
class _Account:
    """One tensor's axis: its length, its slices so far, its elements per unit of the axis."""

    length: int
    unit: int
    axis: int | None
    slices: list[tuple[int, int, str]] = field(default_factory=list)  # (start, count, the other side)


class Ledger:
    """The pieces of one conversion: which slices of which source tensors make which output
    tensors. Sources and outputs are named by the caller (``"file: name"`` for a rank's tensor);
    :meth:`check` proves every element of each is used exactly once."""

    def __init__(self) -> None:
        self._sources: dict[str, _Account] = {}
        self._outputs: dict[str, _Account] = {}
        self._copies: dict[str, str] = {}

    def source(self, key: str, shape: Sequence[int], axis: int | None) -> None:
        """A source tensor of ``shape``, to be taken in slices along ``axis`` (None: whole)."""
        self._sources[key] = _account(shape, axis)

    def output(self, key: str, shape: Sequence[int], axis: int | None) -> None:
        """An output tensor of ``shape``, given in slices along ``axis`` (None: whole)."""
        self._outputs[key] = _account(shape, axis)

    def take(self, source: str, start: int, output: str, at: int, count: int) -> None:
        """``count`` units of ``source`` from ``start`` become those of ``output`` from ``at``."""
        self._sources[source].slices.append((start, count, output))
        self._outputs[output].slices.append((at, count, source))

    def copy(self, key: str, of: str) -> None:
        """The source or output ``key`` is a copy of ``of`` (a replicated tensor on another rank):
        a source checked equal to it by the caller, an output written from the same data."""
        self._copies[key] = of

    def check_output(self, key: str, error: type[Exception]) -> None:
        """Prove at once that the output ``key`` is given exactly once (before it is assembled).

        :raises error: as :meth:`check`."""
        _tiles(key, self._outputs[key], "output", error)

    def check(self, error: type[Exception]) -> dict[str, int]:
        """Prove the pieces: every source tensor taken exactly once, element by element, or a
        copy of one that was; every output tensor given exactly once.

        :param error: the exception to raise (the reader's CheckpointError, the writer's PlanError).
        :returns: the counts ``inspect`` shows: source tensors and their elements, each taken
            once; source copies checked equal to one taken; output tensors and their elements,
            each written once; output copies of one written.
        :raises error: the first tensor with an element used twice or never, naming it.

        >>> ledger = Ledger()
        >>> ledger.source("a", (2, 3), 0); ledger.output("w", (4, 3), 0); ledger.take("a", 0, "w", 0, 2)
        >>> ledger.check(ValueError)
        Traceback (most recent call last):
        ValueError: 'w': rows 2 … 3 of its 4 have no source; the plan leaves them unwritten
        """
        for kind, accounts in (("source", self._sources), ("output", self._outputs)):
            for key, account in accounts.items():
                if key in self._copies:
                    if account.slices or self._copies[key] not in accounts or self._copies[key] in self._copies:
                        raise error(f"{quote(key)}: a copy of {quote(self._copies[key])}, which is not one "
                                    f"{kind} the plan {'takes' if kind == 'source' else 'writes'} once")
                    continue
                _tiles(key, account, kind, error)
        return {"source_tensors": sum(k not in self._copies for k in self._sources),
                "source_elements": sum(a.length * a.unit for k, a in self._sources.items() if k not in self._copies),
                "source_copies": sum(k in self._copies for k in self._sources),
                "output_tensors": sum(k not in self._copies for k in self._outputs),
                "output_elements": sum(a.length * a.unit for k, a in self._outputs.items() if k not in self._copies),
                "output_copies": sum(k in self._copies for k in self._outputs)}


def _account(shape: Sequence[int], axis: int | None) -> _Account:
    if axis is None:
        return _Account(1, math.prod(shape), None)
    return _Account(shape[axis], math.prod(shape) // shape[axis] if shape[axis] else 0, axis)


def _tiles(key: str, account: _Account, kind: str, error: type[Exception]) -> None:
    """The slices of ``account`` cover its axis once: no gap, no overlap."""
    units = {None: "part", 0: "rows", 1: "columns"}.get(account.axis, f"indices on axis {account.axis}")
    what = "are never read: the plan would drop them" if kind == "source" else \
        "have no source; the plan leaves them unwritten"
    at = 0
    for start, count, other in sorted(account.slices):
        if start < at:
            raise error(f"{quote(key)}: {units} {start} … {at - 1} are used twice (again by {quote(other)}); "
                        f"the plan {'reads' if kind == 'source' else 'writes'} them twice")
        if start > at:
            raise error(f"{quote(key)}: {units} {at} … {start - 1} of its {account.length} {what}")
        at = start + count
    if at != account.length:
        raise error(f"{quote(key)}: {units} {at} … {account.length - 1} of its {account.length} {what}"
                    if at < account.length else f"{quote(key)}: the plan uses {at} {units} of its {account.length}")
