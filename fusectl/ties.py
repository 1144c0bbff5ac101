"""Tie discovery: provenance, safetensors ``save_model`` metadata, ``[ties]``, content hashes."""

from __future__ import annotations

import hashlib
from typing import Iterable, Mapping

import numpy as np

from .errors import TieError
from .table import ParamTable
from .tensors import LazyTensor


def aliases_from_metadata(metadata: Mapping[str, str], stored: Iterable[str]) -> dict[str, str]:
    """``save_model`` records each removed shared tensor as ``{removed_name: kept_name}``."""
    stored = set(stored)
    return {k: v for k, v in metadata.items() if k not in stored and v in stored}


def merge_aliases(sources: Iterable[tuple[str, Mapping[str, str]]]) -> dict[str, str]:
    """Merge alias maps from several sources; two sources that disagree are an error."""
    merged: dict[str, str] = {}
    origin: dict[str, str] = {}
    for where, aliases in sources:
        for alias, kept in aliases.items():
            if alias in merged and merged[alias] != kept:
                raise TieError(
                    f"{alias!r} is tied to {merged[alias]!r} by {origin[alias]} but to "
                    f"{kept!r} by {where}; fix the metadata of one of them"
                )
            merged[alias], origin[alias] = kept, where
    return merged


def apply_aliases(table: ParamTable, aliases: Mapping[str, str], where: str) -> None:
    """Add each alias as a structural name of its kept tensor."""
    for alias, kept in sorted(aliases.items()):
        if kept not in table:
            raise TieError(f"{where}: {alias!r} is recorded as an alias of {kept!r}, which is not stored")
        if alias in table and table[alias] is not table[kept]:
            raise TieError(f"{where}: {alias!r} is stored and also recorded as an alias of {kept!r}")
        table.tie([alias], keep=kept)


def declare_ties(table: ParamTable, groups: Iterable[Iterable[str]], where: str) -> None:
    """``[ties]`` groups: absent members become aliases; present ones must be bitwise equal."""
    for group in groups:
        members = sorted(set(group))
        present = [m for m in members if m in table]
        if not present:
            raise TieError(f"{where}: tie group {members} names no tensor of the checkpoint")
        keep = next((m for m in present if m in table.stored), present[0])
        for other in present:
            if table[other] is table[keep]:
                continue
            if table.spec(other) != table.spec(keep) or not _equal(table[other], table[keep]):
                raise TieError(
                    f"{where}: tie group {members}: {other!r} and {keep!r} differ "
                    f"({table.spec(other)} vs {table.spec(keep)}); they cannot be one parameter"
                )
        table.tie(members, keep=keep)


def detect_ties(table: ParamTable) -> list[list[str]]:
    """Groups of unique parameters with equal dtype, shape and bytes (reads every tensor)."""
    by_content: dict[tuple, list[str]] = {}
    for name, tensor in table.unique():
        digest = hashlib.blake2b(_bytes(tensor), digest_size=16).hexdigest()
        by_content.setdefault((tensor.spec, digest), []).append(name)
    return sorted(sorted(g) for g in by_content.values() if len(g) > 1)


def _bytes(tensor: LazyTensor) -> memoryview:
    return np.ascontiguousarray(tensor.read()).reshape(-1).view(np.uint8).data


def _equal(a: LazyTensor, b: LazyTensor) -> bool:
    return _bytes(a) == _bytes(b)
