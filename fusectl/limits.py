"""Budgets on sizes that come from untrusted files, each checked before the work it guards.

A checkpoint, rules file or provenance downloaded from elsewhere decides how much fusectl
reads, allocates and computes. Each size below has a budget far above any real model's and far
below what would exhaust a machine; a file past one is refused with an error that names the
limit and the environment variable that raises it.

>>> check_limit("tensors", 10, "model.safetensors")
>>> limit("tensors") >= 100_000
True
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

from .errors import CheckpointError, FusectlError


@dataclass(frozen=True)
class Limit:
    """One budget: ``key`` (as ``check_limit`` names it), its ``default`` and ``what`` it counts.

    >>> LIMITS["tensors"].variable
    'FUSECTL_MAX_TENSORS'
    """

    key: str
    default: int
    what: str  # what is counted, for messages
    # what the library fusectl computes with can hold, whatever the budget: () -> (the most,
    # the rest of the refusal: who says so and what to do)
    ceiling: Callable[[], tuple[int, str]] | None = None

    @property
    def variable(self) -> str:
        """The environment variable that raises this budget: ``FUSECTL_MAX_`` + the key in capitals, ``-`` as ``_``."""
        return "FUSECTL_MAX_" + self.key.upper().replace("-", "_")


@functools.cache
def _numpy_dims() -> tuple[int, str]:
    """The most dimensions the installed numpy gives an array: 32 before numpy 2.0, 64 since."""
    import numpy as np

    try:
        np.empty((0,) * 64)
    except ValueError:
        return 32, f"numpy {np.__version__} holds at most 32 (numpy 2 holds 64: upgrade numpy)"
    return 64, f"numpy {np.__version__} holds at most 64; fusectl cannot read the tensor"


LIMITS: dict[str, Limit] = {
    limit.key: limit
    for limit in (
        Limit("header-bytes", 100_000_000, "bytes of safetensors header"),
        Limit("tensors", 1_000_000, "tensors in one checkpoint"),
        Limit("json-depth", 64, "levels of JSON nesting"),
        Limit("json-bytes", 64_000_000, "bytes of a JSON file (config, index)"),
        # a [config] value nests 3 levels down in a rules file and 6 in the provenance that
        # records it: 32 keeps the provenance within json-depth, so an output reads back
        Limit("rules-depth", 32, "levels of nesting in a rules file (tables, dotted keys, arrays)"),
        Limit("name-bytes", 4096, "bytes in one tensor name"),
        Limit("dims", 64, "dimensions of one tensor", _numpy_dims),
        Limit("integer-digits", 30, "digits in one integer"),
        Limit("expression-chars", 1000, "characters in one [vars] expression"),
        Limit("chunks", 1_000_000, "chunks or groups one step cuts a tensor into"),
        Limit("decompressed-bytes", 4_000_000_000, "bytes decompressed from one archive member"),
        Limit("verify-input-bytes", 2 * 2**30, "bytes of arrays in one verify --inputs file, decompressed"),
        Limit("pickle-bytes", 1_000_000_000, "bytes of pickle in one PyTorch checkpoint"),
        Limit("pickle-opcodes", 50_000_000, "pickle opcodes in one PyTorch checkpoint"),
        Limit("pickle-items", 2_000_000, "items in one pickled list, dict, tuple or set"),
        Limit("pickle-depth", 64, "levels of nesting in a PyTorch checkpoint's pickle"),
        Limit("pickle-memory", 300_000_000, "bytes of objects that unpickling a PyTorch checkpoint would "
              "build (estimated before unpickling)"),
        Limit("pickle-hash-keys", 10_000, "dict keys or set members in a PyTorch checkpoint's pickle that are "
              "not strings or small integers (numbers and tuples, whose hashes a file can make collide)"),
        Limit("expanded-bytes", 4_000_000_000, "bytes of one tensor that repeats its stored elements (an expanded view)"),
        Limit("order-search", 10_000_000, "steps of work proving from shapes which parameter each optimizer state "
              "belongs to (positions, matchings and search states, each paid for before it is made)"),
    )
}


def limit(key: str) -> int:
    """The budget for ``key``: its default, or the value of its environment variable, but never
    more than the library that computes on it can hold (``Limit.ceiling``).

    >>> limit("dims") <= 64  # numpy's most
    True
    """
    spec = LIMITS[key]
    budget = _configured(spec)
    if spec.ceiling is not None:
        return min(budget, spec.ceiling()[0])
    return budget


def _configured(spec: Limit) -> int:
    """The default of ``spec``, or the value of its environment variable."""
    raw = os.environ.get(spec.variable)
    if raw is None:
        return spec.default
    try:
        value = int(raw)
    except ValueError:
        raise FusectlError(f"{spec.variable}={raw!r} is not a whole number; unset it or give a number") from None
    if value < 1:
        raise FusectlError(f"{spec.variable}={raw!r} must be at least 1")
    return value


def nesting_depth(value: object) -> int:
    """How deeply dicts and lists nest in ``value`` (a parsed document), counted without
    recursion, so that a file's nesting is known before anything recursive walks it.

    >>> nesting_depth({"a": [1, {"b": {}}], "c": 2}), nesting_depth(7)
    (4, 0)
    """
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def check_limit(key: str, value: int, where: str, error: type[FusectlError] = CheckpointError) -> None:
    """Raise ``error`` naming ``where`` when ``value`` exceeds the budget for ``key``: naming the
    variable that raises it, or, past what the library can hold (``Limit.ceiling``), the library."""
    budget = limit(key)
    if value > budget:
        spec = LIMITS[key]
        if spec.ceiling is not None and value > spec.ceiling()[0]:  # no budget would let it through
            raise error(f"{where}: {value} {spec.what}, but {spec.ceiling()[1]}")
        raise error(
            f"{where}: {value} {spec.what} exceeds fusectl's limit of {budget}; if the file is "
            f"genuine, raise it with {spec.variable}={value}"
        )
