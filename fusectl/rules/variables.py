"""``[vars]``: integers, ``config:`` lookups and integer expressions over config keys and vars.

>>> resolve_variables({"heads": "config:n", "dim": "config:h // heads"}, {"n": 4, "h": 32}, "r.toml")
{'heads': 4, 'dim': 8}
"""

from __future__ import annotations

import ast
import operator
from typing import Callable, Mapping

from ..errors import RuleError

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}


def evaluate(expression: str, lookup: Callable[[str], int], where: str) -> int:
    """Evaluate an integer expression: + - * // %, parentheses, names resolved by ``lookup``."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise RuleError(f"{where}: {expression!r} is not an integer expression") from None

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name):
            return lookup(node.id)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
                raise RuleError(f"{where}: {expression!r} divides by zero")
            return _BINARY[type(node.op)](left, right)
        raise RuleError(
            f"{where}: {expression!r} may use only integers, names, + - * // % and parentheses"
        )

    return walk(tree)


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
            raise RuleError(f"{where}: config key {key!r} (for var {var!r}) is {value!r}, not an integer")
        return value

    def resolve(name: str) -> int:
        if name in values:
            return values[name]
        if name in active:
            raise RuleError(f"{where}: vars {' -> '.join(active + [name])} refer to each other in a cycle")
        active.append(name)
        spec = raw[name]
        if type(spec) is int:
            value = spec
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
