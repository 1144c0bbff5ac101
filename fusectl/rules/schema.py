"""Rules files (TOML) → typed, validated rules. Every unknown key is an error."""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass
from typing import Mapping

from ..config_edit import ConfigEdit
from ..errors import RuleError
from ..limits import check_limit, limit, nesting_depth
from ..ops import OPS, Op
from .patterns import Pattern
from .variables import ConfigLookupError, Variables, checked_integer, evaluate

_TOP_KEYS = {"version", "description", "vars", "ties", "rule", "quantization", "config"}
_RULE_KEYS = {"name", "op", "optional", "over"}
# op fields derived from the rule's own shape, never written by a user
_DERIVED = {"parts", "has_bias", "facts"}


@dataclass(frozen=True)
class Rule:
    """One rule bound to its variables: patterns plus a concrete op."""

    name: str
    source: str
    op: Op
    inputs: tuple[Pattern | None, ...]  # None: an optional input the rule leaves out
    outputs: tuple[Pattern, ...]
    over: str | None = None
    optional: bool = False

    def describe(self) -> str:
        """How messages name the rule: ``rule 'attn-qkv' (rules.toml)``."""
        return f"rule {self.name!r} ({self.source})"


@dataclass(frozen=True)
class RuleSet:
    """A loaded rules file: its rules in order and its declared ties."""

    source: str
    rules: tuple[Rule, ...]
    ties: tuple[tuple[str, ...], ...] = ()
    description: str = ""
    block_size: tuple[int, int] | None = None  # [quantization] block_size
    config: ConfigEdit | None = None  # [config]: set / remove keys of the output config.json

    def changes_nothing(self) -> str | None:
        """Why binding this rules file would change nothing (the sections it lacks), or None."""
        if self.rules or self.ties or self.config or self.block_size:
            return None
        return "has no [[rule]], [ties], [config] or [quantization]"


def load_rules(
    text: str, source: str, config: Mapping[str, object] | None = None
) -> RuleSet:
    """Parse and validate a rules file; ``source`` names it in messages.

    >>> rs = load_rules('version = 1\\n[[rule]]\\nop = "rename"\\ninput = "a.{x}"\\noutput = "b.{x}"', "r.toml")
    >>> rs.rules[0].describe()
    "rule '#1 rename' (r.toml)"
    """
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RuleError(f"{source}: not valid TOML: {e}") from e
    except ValueError as e:  # an integer literal past Python's 4,300-digit conversion limit
        raise RuleError(f"{source}: an integer is too long to read ({e}); sizes and counts fit in 64 bits") from e
    except RecursionError as e:  # tomllib recurses once per nested array or inline table: no budget helps
        raise RuleError(f"{source}: arrays or inline tables nested too deep for Python's TOML reader; rules files "
                        f"nest at most {limit('rules-depth')} levels") from e
    # dotted keys and table headers nest without recursion in tomllib, not in what reads them
    check_limit("rules-depth", nesting_depth(doc), source, RuleError)
    _no_unknown_keys(doc, _TOP_KEYS, source)
    if type(doc.get("version")) is not int or doc["version"] != 1:
        raise RuleError(f"{source}: 'version = 1' is required (got {doc.get('version')!r})")
    raw_vars = doc.get("vars", {})
    if not isinstance(raw_vars, dict):
        raise RuleError(f"{source}: [vars] must be a table")
    variables = _LazyVariables(raw_vars, config, source)
    ties = _load_ties(doc.get("ties", {}), source)
    raw_rules = doc.get("rule", [])
    if not isinstance(raw_rules, list):
        raise RuleError(f"{source}: rules are written as [[rule]] tables")
    rules = tuple(_load_rule(raw, k + 1, source, variables) for k, raw in enumerate(raw_rules))
    description = doc.get("description", "")
    if not isinstance(description, str):
        raise RuleError(f"{source}: description must be a string")
    return RuleSet(source, rules, ties, description, _load_quantization(doc.get("quantization", {}), source),
                   _load_config_edit(doc.get("config"), source))


def _load_quantization(raw: object, source: str) -> tuple[int, int] | None:
    where = f"{source} [quantization]"
    if not isinstance(raw, dict):
        raise RuleError(f"{where}: must be a table with block_size = [rows, columns]")
    _no_unknown_keys(raw, {"block_size"}, where)
    block = raw.get("block_size")
    if block is None:
        return None
    if (not isinstance(block, list) or len(block) != 2
            or not all(type(v) is int and 0 < v < 2**31 for v in block)):
        raise RuleError(f"{where}: block_size must be two positive integers [rows, columns], not {block!r}")
    return (block[0], block[1])


def _load_config_edit(raw: object, source: str) -> ConfigEdit | None:
    where = f"{source} [config]"
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RuleError(f"{where}: must be a table with set and/or remove")
    _no_unknown_keys(raw, {"set", "remove"}, where)
    sets, removes = raw.get("set", {}), raw.get("remove", [])
    if not isinstance(sets, dict):
        raise RuleError(f"{where}: set must be a table of keys and values")
    if not isinstance(removes, list) or not all(isinstance(p, str) and p and "" not in p.split(".") for p in removes):
        raise RuleError(f"{where}: remove must be a list of keys (dotted for nested ones: \"a.b\")")
    try:
        encoded = tuple((key, json.dumps(value, allow_nan=False)) for key, value in sets.items())
    except (TypeError, ValueError):
        raise RuleError(f"{where}: set values must be JSON values (no dates, times or NaN)") from None
    if not encoded and not removes:
        raise RuleError(f"{where}: neither set nor remove: it would change nothing")
    return ConfigEdit(encoded, tuple(removes))


class _LazyVariables:
    """Resolves ``[vars]`` on first use, so a file whose rules need no config loads without one."""

    def __init__(self, raw: dict, config, source: str):
        self._raw, self._config, self._source = raw, config, source
        self._variables: Variables | None = None

    def value(self, expression: object, where: str) -> int:
        """The integer ``expression`` (a number, a var, an expression over vars) gives;
        ConfigLookupError when a var it uses needs a config key the config lacks."""
        if type(expression) is int:
            return checked_integer(expression, where)
        if not isinstance(expression, str):
            raise RuleError(f"{where}: {expression!r} must be an integer or a var name")
        if self._variables is None:
            self._variables = Variables(self._raw, self._config, self._source)
        variables = self._variables

        def lookup(name: str) -> int:
            if name not in variables:
                raise RuleError(f"{where}: {name!r} is not defined in [vars]")
            return variables.value(name)

        return evaluate(expression, lookup, where)


class NeedsConfig:
    """The op of a rule whose parameters need config keys the model's config lacks.

    Binding a rule asks its op's class attributes first (``gathers_over``, ``named_inputs``,
    ``guard`` …: which inputs find bindings, whether the rule must match); this answers those
    as the op's class does, so that a rule whose patterns match nothing says so, with the
    nearest names. Anything a binding needs of the op itself (``for_present``, ``infer``,
    ``inverse`` …) raises the ConfigLookupError, naming the rule, the var and the key.
    """

    def __init__(self, op_cls: type[Op], error: ConfigLookupError):
        self._op_cls, self._error = op_cls, str(error)

    def __getattr__(self, name: str):
        if name in _class_vars(self._op_cls):
            return getattr(self._op_cls, name)
        if name.startswith("__"):  # copy, pickle and friends probe for optional hooks
            raise AttributeError(name)
        raise ConfigLookupError(self._error)

    def __repr__(self) -> str:
        return f"NeedsConfig({self._op_cls.kind}: {self._error})"


def _class_vars(op_cls: type) -> set[str]:
    """The names an op class declares as ``ClassVar`` (on itself or a base)."""
    return {name for klass in op_cls.__mro__ for name, annotation in vars(klass).get("__annotations__", {}).items()
            if str(annotation).startswith(("ClassVar", "typing.ClassVar"))}


def _no_unknown_keys(table: Mapping, allowed: set[str], where: str) -> None:
    for key in table:
        if key not in allowed:
            raise RuleError(
                f"{where}: unknown key {key!r}; allowed keys are {', '.join(sorted(allowed))}"
            )


def _load_ties(raw: object, source: str) -> tuple[tuple[str, ...], ...]:
    if not isinstance(raw, dict):
        raise RuleError(f"{source}: [ties] must be a table with 'groups'")
    _no_unknown_keys(raw, {"groups"}, f"{source} [ties]")
    groups = raw.get("groups", [])
    if not isinstance(groups, list) or not all(
        isinstance(g, list) and len(g) >= 2 and all(isinstance(n, str) for n in g) for g in groups
    ):
        raise RuleError(f"{source} [ties]: groups must be a list of lists of two or more names")
    return tuple(tuple(g) for g in groups)


def _patterns(raw: object, key: str, where: str) -> tuple[Pattern, ...]:
    items = raw if isinstance(raw, list) else [raw]
    if not items or not all(isinstance(p, str) for p in items):
        raise RuleError(f"{where}: {key!r} must be a name pattern or a list of them")
    try:
        return tuple(Pattern.parse(p) for p in items)
    except RuleError as e:
        raise RuleError(f"{where}: {key!r}: {e}") from None


def _load_rule(raw: object, index: int, source: str, variables: _LazyVariables) -> Rule:
    where = f"{source}: rule #{index}"
    if not isinstance(raw, dict):
        raise RuleError(f"{where}: a [[rule]] must be a table")
    kind = raw.get("op")
    if "op" in raw and not isinstance(kind, str):
        raise RuleError(f"{where}: op must be a string naming one of {', '.join(sorted(OPS))}, not {kind!r}")
    name = raw.get("name", f"#{index} {kind}")
    if not isinstance(name, str):
        raise RuleError(f"{where}: name must be a string")
    where = f"rule {name!r} ({source})"
    if "op" not in raw:
        raise RuleError(f"{where}: missing 'op'; use one of {', '.join(sorted(OPS))}")
    if kind not in OPS:
        raise RuleError(f"{where}: op {kind!r} is not one of {', '.join(sorted(OPS))}")
    op_cls = OPS[kind]

    params = {f.name: f for f in dataclasses.fields(op_cls) if f.name not in _DERIVED}
    if op_cls.named_inputs:
        io_keys = set(op_cls.named_inputs) | set(op_cls.named_outputs)
    else:
        io_keys = {op_cls.inputs_field} | ({op_cls.outputs_field} if op_cls.outputs_field else set())
    if op_cls.inputs_field == "inputs" and not op_cls.named_inputs:
        io_keys.add("input")
    if "inputs" in io_keys or not op_cls.gathers_over:
        allowed = _RULE_KEYS | io_keys | set(params)
    else:
        allowed = (_RULE_KEYS - {"over"}) | io_keys | set(params)
    _no_unknown_keys(raw, allowed, where)
    over = raw.get("over")
    if op_cls.named_inputs:
        inputs, outputs = _named_io(raw, op_cls, where)
    else:
        inputs, outputs = _listed_io(raw, op_cls, over, where)
    optional = raw.get("optional", False)
    if not isinstance(optional, bool):
        raise RuleError(f"{where}: optional must be true or false")

    _check_placeholders(inputs, outputs, over, op_cls, where)
    op = _make_op(op_cls, raw, params, len(outputs), variables, where)
    return Rule(name, source, op, inputs, outputs, over, optional)


def _single(raw: dict, key: str, where: str) -> Pattern:
    if key not in raw:
        raise RuleError(f"{where}: missing {key!r}")
    patterns = _patterns(raw[key], key, where)
    if len(patterns) != 1 or isinstance(raw[key], list):
        raise RuleError(f"{where}: {key!r} must be one pattern")
    return patterns[0]


def _named_io(raw: dict, op_cls, where: str):
    """Inputs and outputs named by role (g, v, weight, ...); absent optional inputs are None."""
    inputs = tuple(
        None if (k in op_cls.optional_inputs and key not in raw) else _single(raw, key, where)
        for k, key in enumerate(op_cls.named_inputs)
    )
    outputs = tuple(_single(raw, key, where) for key in op_cls.named_outputs)
    return inputs, outputs


def _listed_io(raw: dict, op_cls, over, where: str):
    """Inputs as ``input`` / ``inputs`` (or ``input`` + ``over``), outputs as ``output(s)``."""
    if op_cls.inputs_field == "inputs":
        if ("inputs" in raw) == ("input" in raw):
            raise RuleError(f"{where}: give either 'inputs' (a list) or 'input' with 'over'")
        if "input" in raw and over is None:
            raise RuleError(f"{where}: 'input' gathers bindings only with 'over = \"placeholder\"'")
        if "inputs" in raw and over is not None:
            raise RuleError(f"{where}: 'over' goes with a single 'input' pattern, not 'inputs'")
        if "inputs" in raw and not isinstance(raw["inputs"], list):
            raise RuleError(f"{where}: 'inputs' must be a list")
        inputs = _patterns(raw.get("inputs", raw.get("input")), op_cls.inputs_field, where)
    else:
        inputs = (_single(raw, op_cls.inputs_field, where),)
    outputs: tuple[Pattern, ...] = ()
    if op_cls.outputs_field == "output":
        outputs = (_single(raw, "output", where),)
    elif op_cls.outputs_field == "outputs":
        if "outputs" not in raw:
            raise RuleError(f"{where}: missing 'outputs'")
        if not isinstance(raw["outputs"], list):
            raise RuleError(f"{where}: 'outputs' must be a list")
        outputs = _patterns(raw["outputs"], "outputs", where)
    return inputs, outputs


def _check_placeholders(inputs, outputs, over, op_cls, where) -> None:
    inputs = [p for p in inputs if p is not None]
    _check_offsets([*inputs, *outputs], where)
    bound = set().union(*(p.names for p in inputs))
    for p in inputs[1:]:
        if p.names != inputs[0].names:
            raise RuleError(
                f"{where}: inputs {inputs[0].text!r} and {p.text!r} use different placeholders; "
                "every input of a rule must use the same ones"
            )
    if over is not None:
        if not isinstance(over, str):
            raise RuleError(f"{where}: over must be a placeholder name")
        if not op_cls.gathers_over:
            if over in bound:
                raise RuleError(f"{where}: over = {over!r} must be a placeholder of the output, not the input")
            if not outputs or over not in outputs[0].names:
                raise RuleError(f"{where}: the output must contain {{{over}}} (over = {over!r})")
            bound = bound | {over}
        elif over not in bound:
            raise RuleError(f"{where}: over = {over!r} is not a placeholder of the input")
        else:
            bound = bound - {over}
    elif not op_cls.gathers_over:
        raise RuleError(f"{where}: {op_cls.kind} needs over = \"placeholder\" naming the output's index")
    for p in outputs:
        unbound = p.names - bound
        if unbound:
            raise RuleError(
                f"{where}: output {p.text!r} uses {{{sorted(unbound)[0]}}}, which no input binds"
            )


def _check_offsets(patterns, where) -> None:
    """``{n+1}`` shifts a whole number: no pattern of the rule may bind n as text or segments.

    n may also be written ``{n:int}`` (in the same pattern or another one) or only shifted:
    ``{p*}.{n+1}.num_batches_tracked`` drops the counters of every BatchNorm at index 1 or more.
    """
    plain = {}
    for pattern in patterns:
        for p in pattern.placeholders:
            if not p.offset:
                plain.setdefault(p.name, (p, pattern))
    for pattern in patterns:
        for p in pattern.placeholders:
            other = plain.get(p.name)
            if p.offset and other is not None and other[0].kind != "int":
                raise RuleError(
                    f"{where}: {pattern.text!r} writes {p.written}, which shifts a whole number, but "
                    f"{other[1].text!r} binds {p.name!r} with {other[0].written}; write {{{p.name}:int}} "
                    "there (offsets apply only to whole numbers)"
                )


def _make_op(op_cls, raw, params, n_outputs, variables: _LazyVariables, where) -> Op | NeedsConfig:
    values = {}
    needs_config = None
    for key, field in params.items():
        if key not in raw:
            continue
        try:
            values[key] = _convert(raw[key], field.type, variables, f"{where}: {key}")
        except ConfigLookupError as e:  # the other parameters are still checked now
            needs_config = needs_config or e
    if needs_config is not None:
        # which config.json keys a model has matters only for a rule that binds to it
        return NeedsConfig(op_cls, ConfigLookupError(f"{where}: {needs_config}"))
    if "parts" in {f.name for f in dataclasses.fields(op_cls)}:
        values["parts"] = n_outputs
    if values.get("sizes") is not None and op_cls.outputs_field == "outputs":
        if len(values["sizes"]) != n_outputs:
            raise RuleError(f"{where}: sizes has {len(values['sizes'])} entries for {n_outputs} outputs")
    return op_cls(**values)


def _convert(value, annotation: str, variables: _LazyVariables, where: str):
    text = str(annotation)
    if text.startswith("tuple"):
        if not isinstance(value, list):
            raise RuleError(f"{where}: expected a list, got {value!r}")
        return tuple(variables.value(v, where) for v in value)
    if text == "int":
        return variables.value(value, where)
    if text == "str":
        if not isinstance(value, str):
            raise RuleError(f"{where}: expected a string, got {value!r}")
        return value
    if text == "float":
        if type(value) not in (int, float) or not math.isfinite(value):
            raise RuleError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if text == "bool | str | None":  # bn_fold's fix_gamma: true, false, or read from the MXNet symbol
        if type(value) is not bool and value != "symbol":
            raise RuleError(f"{where}: expected true, false or \"symbol\", got {value!r}")
        return value
    if text == "int | str":  # an integer, or a keyword such as "auto" / "none"
        if type(value) is not int and not isinstance(value, str):
            raise RuleError(f"{where}: expected an integer or a string, got {value!r}")
        return value
    raise RuleError(f"{where}: cannot read {value!r}")  # pragma: no cover - new field type
