"""``[vars]``: integers, ``config:`` lookups and integer expressions over config keys and vars.

>>> resolve_variables({"heads": "config:n", "dim": "config:h // heads"}, {"n": 4, "h": 32}, "r.toml")
{'heads': 4, 'dim': 8}
"""

from __future__ import annotations

import ast
import operator
from typing import Callable, Mapping

from ..errors import RuleError, printable
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


def resolve_variables(
    raw: Mapping[str, object], config: Mapping[str, object] | None, where: str
) -> dict[str, int]:
    """Resolve every variable of ``[vars]``; names in expressions are vars first, then config keys."""
    values: dict[str, int] = {}
    active: list[str] = []

    def lookup_config(key: str, var: str) -> int:
        if config is None:
            raise RuleError(
                f"{where}: var {var!r} needs config key {key!r}, but there is no config.json "
                "beside the checkpoint; pass --config FILE"
            )
        if key not in config:
            raise RuleError(f"{where}: var {var!r} needs config key {key!r}, which config.json lacks")
        value = config[key]
        if type(value) is not int:
            raise RuleError(f"{where}: config key {key!r} (for var {var!r}) is {_short(repr(value))}, not an integer")
        return checked_integer(value, f"{where}: config key {key!r} (for var {var!r})")

    def resolve(name: str) -> int:
        if name in values:
            return values[name]
        if name in active:
            raise RuleError(f"{where}: vars {' -> '.join(active + [name])} refer to each other in a cycle")
        active.append(name)
        spec = raw[name]
        if type(spec) is int:
            value = checked_integer(spec, f"{where}: var {name!r}")
        elif isinstance(spec, str):
            text = spec.strip()
            from_config = text.startswith("config:")
            if from_config:
                text = text[len("config:"):].strip()
            # a var's own name inside its expression is the config key ("hidden_size =
            # 'config:hidden_size'"); any other var name refers to that var
            value = evaluate(
                text,
                lambda n: resolve(n) if n in raw and not (from_config and n == name)
                else lookup_config(n, name),
                f"{where}: var {name!r}",
            )
        else:
            raise RuleError(f"{where}: var {name!r} = {spec!r}; use an integer or a string expression")
        active.pop()
        values[name] = value
        return value

    for name in raw:
        resolve(name)
    return values
