"""The parameter table: structural name → unique parameter, with tie groups."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from .errors import TieError
from .tensors import LazyTensor, TensorSpec


@dataclass
class ParamTable:
    """Structural names mapped to lazy tensors; names sharing one tensor object are tied.

    >>> from fusectl.dtypes import BY_NAME
    >>> from fusectl.tensors import FileTensor, ByteRange, TensorSpec
    >>> t = FileTensor(TensorSpec(BY_NAME["F32"], (2,)), ByteRange("f", 0, 8))
    >>> table = ParamTable({"emb.weight": t, "head.weight": t}, {"emb.weight"})
    >>> table.ties()
    [['emb.weight', 'head.weight']]
    >>> table.unique_name("head.weight")
    'emb.weight'
    """

    entries: dict[str, LazyTensor] = field(default_factory=dict)
    # names physically stored in the input: a tie group's unique name is one of them
    stored: set[str] = field(default_factory=set)
    # groups(), kept until the entries change (inspect of 10^6 names asks for it several times)
    _groups: dict[int, list[str]] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_stored(cls, stored: Mapping[str, LazyTensor]) -> "ParamTable":
        """A table of tensors all stored in the input, untied (each name its own tensor)."""
        return cls(dict(stored), set(stored))

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __getitem__(self, name: str) -> LazyTensor:
        return self.entries[name]

    def names(self) -> list[str]:
        """Every structural name, sorted."""
        return sorted(self.entries)

    def spec(self, name: str) -> TensorSpec:
        """The dtype and shape of ``name``'s tensor (KeyError when absent)."""
        return self.entries[name].spec

    def aliases_of(self, name: str) -> list[str]:
        """Every structural name tied to ``name`` (itself included), sorted."""
        tensor = self.entries[name]
        return sorted(n for n, t in self.entries.items() if t is tensor)

    def groups(self) -> dict[int, list[str]]:
        """Structural names grouped by unique tensor, keyed by the tensor's id (cached until the
        entries change: read it, don't modify it)."""
        if self._groups is None:
            out: dict[int, list[str]] = {}
            for name in sorted(self.entries):
                out.setdefault(id(self.entries[name]), []).append(name)
            self._groups = out
        return self._groups

    def ties(self) -> list[list[str]]:
        """Tie groups (two or more names), each sorted, ordered by first name."""
        return sorted(g for g in self.groups().values() if len(g) > 1)

    def unique_name(self, name: str) -> str:
        """The group's unique name: a stored member, else (and among several) the first sorted."""
        return self._chosen(self.aliases_of(name))

    def _chosen(self, members: list[str]) -> str:
        kept = [m for m in members if m in self.stored]
        return (kept or members)[0]

    def unique_names(self) -> dict[str, str]:
        """Every structural name's unique name, computed in one pass over the table."""
        out: dict[str, str] = {}
        for members in self.groups().values():
            chosen = self._chosen(members)
            out.update((m, chosen) for m in members)
        return out

    def unique(self) -> list[tuple[str, LazyTensor]]:
        """(unique name, tensor) for each unique parameter, in unique-name order."""
        return sorted(((self._chosen(g), self.entries[g[0]]) for g in self.groups().values()),
                      key=lambda item: item[0])

    def written(self) -> list[tuple[str, LazyTensor]]:
        """(name, tensor) for every name an output stores, in name order: each unique parameter
        once, plus each further tied member that the input stored itself.

        A tie adopted from equal content (``--detect-ties``, ``[ties]`` over two stored names)
        is one parameter while planning, but loaders (transformers, ``safetensors.load_model``)
        restore only the ties the model itself declares: dropping such a copy would lose it.
        """
        out = []
        for members in self.groups().values():
            chosen = self._chosen(members)
            out.extend((m, self.entries[m]) for m in members if m == chosen or m in self.stored)
        return sorted(out, key=lambda item: item[0])

    def store_once(self) -> None:
        """Each tie group keeps one stored name; outputs write its other members as aliases."""
        for members in self.groups().values():
            chosen = self._chosen(members)
            self.stored -= set(members) - {chosen}

    def remove(self, names: Iterable[str]) -> None:
        """Forget ``names`` (a step consumed them)."""
        self._groups = None
        for name in list(names):
            del self.entries[name]
            self.stored.discard(name)

    def add(self, entries: Mapping[str, LazyTensor]) -> None:
        """New names (a step's outputs, or names recovered from a plan)."""
        self._groups = None
        self.entries.update(entries)

    def tie(self, names: Iterable[str], *, keep: str) -> None:
        """Make every name in ``names`` refer to ``keep``'s tensor."""
        tensor = self.entries[keep]
        self._groups = None
        for name in names:
            old = self.entries.get(name)
            if old is not None and old is not tensor and old.spec != tensor.spec:
                raise TieError(
                    f"tie {sorted(names)}: {name!r} is {old.spec} but {keep!r} is {tensor.spec}"
                )
            self.entries[name] = tensor

    def copy(self) -> "ParamTable":
        """A table with the same entries and stored names, to edit without changing this one."""
        return ParamTable(dict(self.entries), set(self.stored))
