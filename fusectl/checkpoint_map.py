"""Pair the names of two checkpoints of one model (``fusectl map CKPT OTHER``): Gluon 2.0's
structural names (``save_parameters``: ``0.weight``, ``bn.gamma``) against the prefixed unique
names of an ``export`` (``arg:model_fc1_weight``, ``aux:…_running_mean``), a DataParallel
checkpoint against the bare model, any two files that hold the same parameters under other names.

Pairs are found by name where the names agree — after MXNet's ``arg:``/``aux:`` prefix and one
common leading prefix on either side (``module.``, ``model.``) — then by content: a tensor of one
side pairs with the one tensor of the other whose dtype, shape and bytes are equal. Where several
tensors hold the same bytes (a fresh BatchNorm's ones and zeros), a name's role — its last word,
``gamma``, ``running_var``, ``bias`` — pairs them only where each role leaves exactly one tensor
per side; anything else is **ambiguous**, reported, and never paired. Tied names (one tensor)
pair together: a tensor the other side stores once for two names pairs with both, and a tied
tensor pairs with the equal copies the other side stores, one per name (a Gluon
``save_parameters`` without ``deduplicate`` against its export).
Content is hashed (dtype, shape, bytes) once per tensor, and only tensors whose spec the other
side has are read.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from .errors import printable
from .table import ParamTable
from .tensors import LazyTensor

MXNET_PREFIXES = ("arg:", "aux:")
_ROLE = re.compile(r"[^._:]+$")


def digest(array: np.ndarray) -> tuple:
    """(dtype, shape, blake2b of the bytes) of ``array``: equal for equal tensors, once per tensor."""
    array = np.ascontiguousarray(array)
    return (str(array.dtype), array.shape,
            hashlib.blake2b(array.reshape(-1).view(np.uint8).data, digest_size=16).digest())


def common_prefix(structural: list[str], graph: list[str]) -> tuple[str, str]:
    """The (graph prefix, checkpoint prefix) under which the most names coincide: a prefix on
    one side (an exporter's wrapper, ``model.``), or one leading segment swapped for another
    (``module.`` of a DataParallel checkpoint against a wrapper's ``m.``).

    >>> common_prefix(["module.conv.weight", "module.conv.bias"], ["m.conv.weight", "m.conv.bias", "x"])
    ('m.', 'module.')
    """
    counts: Counter[tuple[str, str]] = Counter()
    struct_set, graph_set = set(structural), set(graph)
    for names, others, side in ((graph, struct_set, 0), (structural, graph_set, 1)):
        for name in names:
            parts = name.split(".")
            for k in range(len(parts)):
                if ".".join(parts[k:]) in others:
                    prefix = ".".join(parts[:k]) + ("." if k else "")
                    counts[(prefix, "") if side == 0 else ("", prefix)] += 1
                    break
    graph_rest: dict[str, set[str]] = {}
    for name in graph:
        head, _, rest = name.partition(".")
        if rest.count(".") >= 1:  # at least two segments must coincide
            graph_rest.setdefault(rest, set()).add(head + ".")
    for name in structural:
        head, _, rest = name.partition(".")
        for graph_head in graph_rest.get(rest, ()):
            if graph_head != head + ".":
                counts[(graph_head, head + ".")] += 1
    if not counts:
        return "", ""
    return counts.most_common(1)[0][0]


def role(name: str) -> str:
    """A parameter's own name, the last word of its name: ``bn.running_var`` and
    ``aux:net_batchnorm0_running_var`` → ``var``; ``0.weight`` → ``weight``.

    >>> role("bn.gamma"), role("arg:convbn_batchnorm0_gamma"), role("aux:x_running_mean")
    ('gamma', 'gamma', 'mean')
    """
    found = _ROLE.search(name)
    return found.group(0) if found else name


def _bare(name: str) -> str:
    return name[4:] if name.startswith(MXNET_PREFIXES) else name


@dataclass(frozen=True)
class CheckpointPair:
    """A name of the first checkpoint paired with one of the other: ``how`` (``name``,
    ``content``, or ``role``: equal content shared by several tensors, told apart by the names'
    last word) and whether their ``data`` are ``equal`` (or, paired by name, ``differs``)."""

    checkpoint: str
    other: str
    how: str
    data: str = "equal"


@dataclass(frozen=True)
class Ambiguous:
    """Tensors of both sides holding one content (``dtype``, ``shape``) that nothing tells apart:
    ``checkpoint`` and ``other`` list their names; none of them is paired."""

    checkpoint: tuple[str, ...]
    other: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]


@dataclass
class CheckpointMap:
    """What :func:`map_checkpoints` found: the pairs, the ambiguous groups, the names of either
    side paired with nothing, and the leading prefixes stripped to pair by name."""

    pairs: list[CheckpointPair] = field(default_factory=list)
    ambiguous: list[Ambiguous] = field(default_factory=list)
    unmatched_checkpoint: list[str] = field(default_factory=list)
    unmatched_other: list[str] = field(default_factory=list)
    checkpoint_prefix: str = ""
    other_prefix: str = ""

    def differing(self) -> list[CheckpointPair]:
        """Pairs by name whose data differ."""
        return [p for p in self.pairs if p.data == "differs"]

    def to_json(self) -> dict:
        """The mapping as ``fusectl map CKPT OTHER --json`` prints it."""
        return {
            "pairs": [{"checkpoint": p.checkpoint, "other": p.other, "how": p.how, "data": p.data} for p in self.pairs],
            "ambiguous": [{"checkpoint": list(a.checkpoint), "other": list(a.other), "dtype": a.dtype,
                           "shape": list(a.shape)} for a in self.ambiguous],
            "unmatched_checkpoint": self.unmatched_checkpoint,
            "unmatched_other": self.unmatched_other,
            "checkpoint_prefix": self.checkpoint_prefix,
            "other_prefix": self.other_prefix,
        }

    def to_text(self, checkpoint: str, other: str, names: tuple[int, int]) -> str:
        """``map``'s text: one aligned line per pair, then what is ambiguous and unmatched, then a
        summary (``names``: how many names each side has)."""
        width = max((len(printable(p.checkpoint)) for p in self.pairs), default=0)
        other_width = max((len(printable(p.other)) for p in self.pairs), default=0)
        lines = [f"{printable(p.checkpoint):<{width}}  {printable(p.other):<{other_width}}  ({p.how}"
                 f"{'' if p.data == 'equal' else ', data ' + p.data})" for p in self.pairs]
        for a in self.ambiguous:
            lines.append(f"ambiguous: {', '.join(map(printable, a.checkpoint))} in {checkpoint} and "
                         f"{', '.join(map(printable, a.other))} in {other} hold the same bytes ({a.dtype} "
                         f"{list(a.shape)}); not paired")
        lines += [f"unmatched in {checkpoint}: {printable(n)}" for n in self.unmatched_checkpoint]
        lines += [f"unmatched in {other}: {printable(n)}" for n in self.unmatched_other]
        paired = len({p.checkpoint for p in self.pairs}), len({p.other for p in self.pairs})
        lines.append(f"{paired[0]} of {names[0]} names of {checkpoint} paired with {paired[1]} of {names[1]} "
                     f"of {other}; {len(self.ambiguous)} ambiguous group(s)")
        return "\n".join(lines)


def _same_bytes(a: LazyTensor, b: LazyTensor) -> str:
    if not a.has_data() or not b.has_data() or a.spec.dtype.packed or b.spec.dtype.packed:
        return "unknown"
    mine = np.ascontiguousarray(a.read()).reshape(-1).view(np.uint8)
    theirs = np.ascontiguousarray(b.read()).reshape(-1).view(np.uint8)
    return "equal" if np.array_equal(mine, theirs) else "differs"


def map_checkpoints(first: ParamTable, other: ParamTable) -> CheckpointMap:
    """Pair ``first``'s names with ``other``'s: by name, then by unique content (see the module)."""
    result = CheckpointMap()
    groups = first.groups(), other.groups()
    matched: tuple[set[int], set[int]] = (set(), set())

    def add(a: LazyTensor, b: LazyTensor, how: str, data: str = "equal") -> None:
        result.pairs.extend(CheckpointPair(x, y, how, data) for x in groups[0][id(a)] for y in groups[1][id(b)])
        matched[0].add(id(a))
        matched[1].add(id(b))

    bare = [{_bare(n): n for n in first.names()}, {_bare(n): n for n in other.names()}]
    prefix_other, prefix_first = common_prefix(list(bare[0]), list(bare[1]))
    result.checkpoint_prefix, result.other_prefix = prefix_first, prefix_other
    for key, name in bare[0].items():
        if not key.startswith(prefix_first):
            continue
        theirs = bare[1].get(prefix_other + key[len(prefix_first):])
        if theirs is None:
            continue
        a, b = first[name], other[theirs]
        if id(a) in matched[0] or id(b) in matched[1] or a.spec != b.spec:
            continue
        add(a, b, "name", _same_bytes(a, b))

    left = [[t for _, t in table.unique() if id(t) not in matched[k] and t.has_data() and not t.spec.dtype.packed]
            for k, table in enumerate((first, other))]
    specs = [{t.spec for t in side} for side in left]
    by_digest: dict[tuple, tuple[list[LazyTensor], list[LazyTensor]]] = {}
    for k, side in enumerate(left):
        for tensor in side:
            if tensor.spec in specs[1 - k]:  # a tensor no spec of the other side fits is never read
                by_digest.setdefault(digest(tensor.read()), ([], []))[k].append(tensor)
    for key, (mine, theirs) in by_digest.items():
        if not mine or not theirs:
            continue
        if len(mine) == 1 and len(theirs) == 1:
            add(mine[0], theirs[0], "content")
            continue
        # one side ties the names that the other stores as equal copies (save_parameters without
        # deduplicate against an export): one parameter, every copy pairs with it
        if len(mine) == 1 and len(groups[0][id(mine[0])]) >= len(theirs):
            for tensor in theirs:
                add(mine[0], tensor, "content")
            continue
        if len(theirs) == 1 and len(groups[1][id(theirs[0])]) >= len(mine):
            for tensor in mine:
                add(tensor, theirs[0], "content")
            continue
        _pair_by_role(mine, theirs, groups, add, result, key)
    result.pairs.sort(key=lambda p: (p.checkpoint, p.other))
    paired = {p.checkpoint for p in result.pairs}, {p.other for p in result.pairs}
    result.unmatched_checkpoint = [n for n in first.names() if n not in paired[0]
                                   and not any(n in a.checkpoint for a in result.ambiguous)]
    result.unmatched_other = [n for n in other.names() if n not in paired[1]
                              and not any(n in a.other for a in result.ambiguous)]
    return result


def _pair_by_role(mine, theirs, groups, add, result: CheckpointMap, key: tuple) -> None:
    """Equal content held by several tensors: pair within each role (the names' last word) that
    leaves one tensor per side; what is left of the content is one ambiguous group."""
    def roles(tensors, side):
        found: dict[str, list[LazyTensor]] = {}
        for tensor in tensors:
            for r in {role(n) for n in groups[side][id(tensor)]}:
                found.setdefault(r, []).append(tensor)
        return found

    by_role = roles(mine, 0), roles(theirs, 1)
    paired: set[int] = set()
    for r, ours in by_role[0].items():
        other = by_role[1].get(r, [])
        if len(ours) == 1 and len(other) == 1 and id(ours[0]) not in paired and id(other[0]) not in paired:
            add(ours[0], other[0], "role")
            paired.update((id(ours[0]), id(other[0])))
    rest = [t for t in mine if id(t) not in paired], [t for t in theirs if id(t) not in paired]
    if rest[0] and rest[1]:
        result.ambiguous.append(Ambiguous(tuple(n for t in rest[0] for n in groups[0][id(t)]),
                                          tuple(n for t in rest[1] for n in groups[1][id(t)]), key[0], key[1]))
