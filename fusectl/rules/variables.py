"""``[vars]``: integers, ``config:`` lookups and integer expressions over config keys and vars.

>>> resolve_variables({"heads": "config:n", "dim": "config:h // heads"}, {"n": 4, "h": 32}, "r.toml")
{'heads': 4, 'dim': 8}
"""

from __future__ import annotations

import ast
import operator
from typing import Callable, Mapping

from ..errors import RuleError, option, printable
from ..limits import check_limit

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}


# every value a rules file computes is a size, an axis or a count: it fits in int64, and a
# value past that (vars that square each other) is refused before it grows any further
MAX_MAGNITUDE = 2**63 - 1
MAX_NESTING = 100  # operators nested in one expression


def checked_integer(value: int, where: str) -> int:
    """``value`` if it fits in int64, else RuleError naming ``where``."""
    if not -MAX_MAGNITUDE <= value <= MAX_MAGNITUDE:
        raise RuleError(f"{where}: the value has {abs(value).bit_length()} bits; sizes, axes and "
                        f"counts must fit in 64 bits (at most {MAX_MAGNITUDE})")
    return value


def evaluate(expression: str, lookup: Callable[[str], int], where: str) -> int:
    """Evaluate an integer expression: + - * // %, parentheses, names resolved by ``lookup``.

    >>> evaluate("heads * 8 // 2", {"heads": 4}.__getitem__, "r.toml")
    16
    """
    check_limit("expression-chars", len(expression), f"{where}: expression", RuleError)
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise RuleError(f"{where}: {_short(expression)} is not an integer expression") from None

    def walk(node: ast.AST, depth: int) -> int:
        if depth > MAX_NESTING:
            raise RuleError(f"{where}: {_short(expression)} nests more than {MAX_NESTING} operators; simplify it")
        if isinstance(node, ast.Expression):
            return walk(node.body, depth + 1)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return checked_integer(node.value, where)
        if isinstance(node, ast.Name):
            return checked_integer(lookup(node.id), where)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand, depth + 1)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left, depth + 1), walk(node.right, depth + 1)
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
                raise RuleError(f"{where}: {_short(expression)} divides by zero")
            return checked_integer(_BINARY[type(node.op)](left, right), where)
        raise RuleError(
            f"{where}: {_short(expression)} may use only integers, names, + - * // % and parentheses"
        )

    return walk(tree, 0)


def _short(expression: str) -> str:
    """The expression quoted for a message, cut when long."""
    text = printable(expression)
    return repr(text if len(text) <= 80 else text[:77] + "...")


class ConfigLookupError(RuleError):
    """A var needs a config.json key that is absent or not an integer (or there is no config):
    a fault of the model the rules meet, not of the rules file. A rule that needs the var
    reports it only once it binds, so a rules file that does not fit the model says that first."""


def resolve_variables(
    raw: Mapping[str, object], config: Mapping[str, object] | None, where: str
) -> dict[str, int]:
    """Resolve every variable of ``[vars]``; names in expressions are vars first, then config keys.
    RuleError for the first var that cannot be resolved (ConfigLookupError when a config key is
    what it lacks)."""
    return Variables(raw, config, where).values()


class Variables:
    """``[vars]`` of one rules file resolved against a config, every var when this is made.

    A fault of the rules file (a bad expression, a cycle, a value past 64 bits) is a RuleError
    at once. A var whose config key is missing or not an integer (and every var computed from
    it) keeps its ConfigLookupError, raised only when something asks for the var: the rule that
    needs it, once it binds.

    >>> v = Variables({"heads": "config:n", "dim": 64}, {}, "r.toml")
    >>> v.value("dim")
    64
    >>> v.value("heads")
    Traceback (most recent call last):
    ...
    fusectl.rules.variables.ConfigLookupError: r.toml: var 'heads' needs config key 'n', which config.json lacks
    """

    def __init__(self, raw: Mapping[str, object], config: Mapping[str, object] | None, where: str):
        self._raw, self._config, self._where = raw, config, where
        self._values: dict[str, int] = {}
        self._unresolved: dict[str, ConfigLookupError] = {}
        self._active: list[str] = []
        for name in raw:
            try:
                self._resolve(name)
            except ConfigLookupError:
                pass  # kept for whoever asks for the var

    def __contains__(self, name: str) -> bool:
        return name in self._raw

    def value(self, name: str) -> int:
        """The value of var ``name`` (one of ``[vars]``); its ConfigLookupError if it has none."""
        if name in self._unresolved:
            raise ConfigLookupError(str(self._unresolved[name]))
        return self._values[name]

    def values(self) -> dict[str, int]:
        """Every var's value; the first var's ConfigLookupError if one has none."""
        for error in self._unresolved.values():
            raise ConfigLookupError(str(error))
        return dict(self._values)

    def _lookup_config(self, key: str, var: str) -> int:
        where, config = self._where, self._config
        if config is None:
            raise ConfigLookupError(
                f"{where}: var {var!r} needs config key {key!r}, but there is no config.json "
                f"beside the checkpoint; pass {option('config')}"
            )
        if key not in config:
            raise ConfigLookupError(f"{where}: var {var!r} needs config key {key!r}, which config.json lacks")
        value = config[key]
        if type(value) is not int:
            raise ConfigLookupError(f"{where}: config key {key!r} (for var {var!r}) is {_short(repr(value))}, "
                                    "not an integer")
        try:
            return checked_integer(value, f"{where}: config key {key!r} (for var {var!r})")
        except RuleError as e:
            raise ConfigLookupError(str(e)) from None

    def _resolve(self, name: str) -> int:
        if name in self._values or name in self._unresolved:
            return self.value(name)
        if name in self._active:
            raise RuleError(f"{self._where}: vars {' -> '.join(self._active + [name])} refer to each other in a cycle")
        self._active.append(name)
        try:
            value = self._evaluate(name, self._raw[name])
        except ConfigLookupError as e:
            self._unresolved[name] = e
            raise
        finally:
            self._active.pop()
        self._values[name] = value
        return value

    def _evaluate(self, name: str, spec: object) -> int:
        where = self._where
        if type(spec) is int:
            return checked_integer(spec, f"{where}: var {name!r}")
        if not isinstance(spec, str):
            raise RuleError(f"{where}: var {name!r} = {spec!r}; use an integer or a string expression")
        text = spec.strip()
        from_config = text.startswith("config:")
        if from_config:
            text = text[len("config:"):].strip()
        # a var's own name inside its expression is the config key ("hidden_size =
        # 'config:hidden_size'"); any other var name refers to that var
        return evaluate(
            text,
            lambda n: self._resolve(n) if n in self._raw and not (from_config and n == name)
            else self._lookup_config(n, name),
            f"{where}: var {name!r}",
        )
