"""Where an entry sits in a pickled container (a training dict): the tuple of its real keys.

A training dict is a tree of dicts and lists whose keys are whatever the training code used:
strings that hold dots (``{"run.1": {...}}``), integers beside strings that print alike
(``{"1": ..., 1: ...}``). Joined into dotted text, two entries can read the same, and a lookup
by text finds the wrong one. So fusectl addresses an entry by its :data:`KeyPath`: the dict
keys that lead to it, as the objects they are, and list positions as integers. Dotted text
(:func:`key_text`) is only for showing a path, and for the user's ``--key``, which
:func:`resolve` matches against the real paths: a text that two paths print as is refused,
naming both, rather than guessed.

>>> tree = {"run.1": {"model": {"w": 1}}, 1: [{"a": 2}]}
>>> node_at(tree, ("run.1", "model"))
{'w': 1}
>>> key_text(("run.1", "model")), key_text((1, 0, "a"))
('run.1.model', '1.0.a')
>>> replaced(tree, (1, 0, "a"), 3)[1]
[{'a': 3}]
"""

from __future__ import annotations

from typing import Iterable

from ..errors import CheckpointError, InternalError, printable, quote

KeyPath = tuple  # the keys (dict keys as they are, list positions as int) from the root to an entry


def key_text(path: KeyPath) -> str:
    """``path`` as dotted text, as messages and ``inspect`` show it (``""`` for the root)."""
    return ".".join(str(k) for k in path)


def key_repr(path: KeyPath) -> str:
    """``path`` shown so that two paths that print alike as text differ: each key as Python
    writes it (``[1, 'model']`` and ``['1', 'model']``)."""
    return printable("[" + ", ".join(repr(k)[:80] for k in path) + "]")


def node_at(tree: object, path: KeyPath) -> object:
    """The entry of ``tree`` at ``path``."""
    _check(path)
    node = tree
    for key in path:
        node = node[key]
    return node


def replaced(tree: object, path: KeyPath, value: object) -> object:
    """``tree`` with the entry at ``path`` replaced by ``value``: each dict and list on the way
    copied (a dict keeps its type and its order), everything else shared."""
    _check(path)
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(tree, (list, tuple)):
        items = list(tree)
        items[head] = replaced(items[head], rest, value)
        return type(tree)(items)
    copy = type(tree)(tree) if isinstance(tree, dict) else dict(tree)
    copy[head] = replaced(tree[head], rest, value)
    return copy


def without(tree: object, path: KeyPath, keys: Iterable) -> object:
    """``tree`` with the entries ``keys`` (real keys) of the dict at ``path`` left out."""
    keys = set(keys)
    node = node_at(tree, path)
    kept = type(node)((k, v) for k, v in node.items() if k not in keys)
    return replaced(tree, path, kept)


def resolve(text: str, paths: Iterable[KeyPath], where: str) -> KeyPath | None:
    """The one path of ``paths`` that prints as ``text`` (the user's dotted ``--key``); None
    when none does.

    :raises CheckpointError: two paths print as ``text`` (``"1"`` and ``1``, ``"a.b"`` and
        ``a`` → ``b``), naming them: fusectl does not guess which one is meant.
    """
    found = [p for p in paths if key_text(p) == text]
    if len(found) > 1:
        shown = " and ".join(key_repr(p) for p in found[:2])
        raise CheckpointError(f"{where}: the key {quote(text[:200])} names {len(found)} entries, {shown} (keys "
                              "that print alike); re-save the file with distinct string keys to choose one")
    return found[0] if found else None


def _check(path: object) -> None:
    if type(path) is not tuple:
        raise InternalError(f"a key path must be a tuple of keys, not {type(path).__name__} {path!r:.80}")
