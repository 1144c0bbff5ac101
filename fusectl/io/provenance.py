"""Provenance: the executed plan and the tie aliases, stored in an output's metadata."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from dataclasses import dataclass, field

from .. import dtypes
from ..version import __version__
from ..config_edit import ConfigEdit
from ..errors import CheckpointError, FusectlError, PlanError, quote
from ..limits import check_limit, limit
from .untrusted import MalformedJSON, load_json
from ..ops import Op
from ..steps import Plan, RuleOrigin, Step, StepGroup, op_from_record
from ..tensors import TensorSpec

METADATA_KEY = "fusectl"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Provenance:
    """What fusectl recorded: the plan that made the file and which names alias which."""

    plan: Plan = field(default_factory=Plan)
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> unique (stored) name
    # a LoRA adapter's: the plan on its base view (m.weight names) the steps were lifted from
    lora_base: Plan | None = None
    # the keys before the plan's first step, in their order, where unfusing would not give that
    # order back by itself (``fusectl.key_order``); None: unfusing gives it
    order: tuple[str, ...] | None = None

    def to_json(self) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "fusectl_version": __version__,
            "plan": plan_to_json(self.plan),
            "aliases": dict(sorted(self.aliases.items())),
            **({"lora_base": plan_to_json(self.lora_base)} if self.lora_base is not None else {}),
            **({"order": list(self.order)} if self.order is not None else {}),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def loads(cls, text: str, where: str) -> "Provenance":
        """Read a provenance back, checking every field's type and every step against its op.

        The text comes from a file's metadata, which anyone may edit: a record that does
        not parse, has a field of the wrong type, names an unknown op, or whose op does not
        produce the recorded outputs from the recorded inputs is a CheckpointError naming
        ``where``, never an exception from deep inside a later command.
        """
        try:
            doc = load_json(text, where, "fusectl provenance")
        except MalformedJSON as e:
            raise _unreadable(where, e.detail) from e
        if not isinstance(doc, dict):
            raise _unreadable(where, "it is not a JSON object")
        version = doc.get("format_version")
        if type(version) is not int or version != FORMAT_VERSION:
            raise CheckpointError(
                f"{where}: provenance format {_short(version)} is not "
                f"{FORMAT_VERSION}; use the fusectl version that wrote it"
            )
        try:
            _only_keys(doc, {"format_version", "fusectl_version", "plan", "aliases", "lora_base", "order"},
                       "the record")
            if not isinstance(doc.get("fusectl_version", ""), str):
                raise _Invalid("fusectl_version must be a string")
            aliases = doc.get("aliases", {})
            if not isinstance(aliases, dict):
                raise _Invalid("aliases must be an object")
            for alias, unique in aliases.items():
                _name(alias, "an alias")
                _name(unique, f"the target of alias {quote(alias)}")
            lora_base = _plan(doc["lora_base"]) if "lora_base" in doc else None
            order = _order(doc["order"]) if "order" in doc else None
            return cls(_plan(doc.get("plan", _MISSING)), dict(aliases), lora_base, order)
        except _Invalid as e:
            raise _unreadable(where, str(e)) from e


class _Invalid(Exception):
    """What is wrong with a provenance record (the message is the detail of the error)."""


_MISSING = object()


def _unreadable(where: str, detail: str) -> CheckpointError:
    return CheckpointError(
        f"{where}: fusectl provenance is unreadable ({detail}); the metadata was edited or corrupted"
    )


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."


def _only_keys(record: dict, allowed: set[str], what: str) -> None:
    unknown = sorted(k for k in record if k not in allowed)
    if unknown:
        raise _Invalid(f"{what} has the unknown key {quote(unknown[0][:80])}")


def _list(value: object, what: str) -> list:
    if not isinstance(value, list):
        raise _Invalid(f"{what} must be a list, not {_short(value)}")
    return value


def _name(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise _Invalid(f"{what} must be a non-empty tensor name, not {_short(value)}")
    try:
        size = len(value.encode())
    except UnicodeEncodeError:
        raise _Invalid(f"{what} {quote(value[:80])} holds a lone UTF-16 surrogate, which is not text") from None
    _within("name-bytes", size, f"{what} {quote(value[:80])}")
    return value


def _order(raw: object) -> tuple[str, ...]:
    items = _list(raw, "order")
    _within("tensors", len(items), "the recorded order")
    names = tuple(_name(n, "a name of the recorded order") for n in items)
    if len(set(names)) != len(names):
        raise _Invalid("order names a tensor twice")
    return names


def _within(key: str, value: int, what: str) -> None:
    try:
        check_limit(key, value, what)
    except FusectlError as e:
        raise _Invalid(str(e)) from None


def _plan(raw: object) -> Plan:
    groups = []
    texts: dict[str, str] = {}  # rules texts by SHA-256, as the groups introduce them
    for g, group in enumerate(_list(raw, "plan")):
        what = f"rule group {g}"
        if not isinstance(group, dict):
            raise _Invalid(f"{what} must be an object, not {_short(group)}")
        _only_keys(group, {"rule", "source", "op", "untied", "untied_stored", "steps", "config", "origin"}, what)
        for key in ("rule", "source"):
            if not isinstance(group.get(key), str):
                raise _Invalid(f"{what}: {key} must be a string, not {_short(group.get(key))}")
        if not isinstance(group.get("op", ""), str):
            raise _Invalid(f"{what}: op must be a string")
        untied = tuple(
            tuple(_name(m, f"{what}: a member of untied group {k}") for m in _list(members, f"{what}: untied group {k}"))
            for k, members in enumerate(_list(group.get("untied", []), f"{what}: untied"))
        )
        untied_stored = tuple(
            tuple(_name(m, f"{what}: a member of untied_stored group {k}")
                  for m in _list(members, f"{what}: untied_stored group {k}"))
            for k, members in enumerate(_list(group.get("untied_stored", []), f"{what}: untied_stored"))
        )
        if untied_stored and (len(untied_stored) != len(untied)
                              or any(not set(s) <= set(u) for s, u in zip(untied_stored, untied))):
            raise _Invalid(f"{what}: untied_stored must name members of each untied group")
        steps = tuple(_step(step, f"{what}, step {k}") for k, step in enumerate(_list(group.get("steps"), f"{what}: steps")))
        config = None
        if "config" in group:
            try:
                config = ConfigEdit.from_json(group["config"], f"{what}: config")
            except PlanError as e:
                raise _Invalid(str(e)) from None
        origin = _origin(group["origin"], f"{what}: origin", texts) if "origin" in group else None
        groups.append(StepGroup(group["rule"], group["source"], steps, untied, untied_stored, config=config,
                                origin=origin))
    return Plan(tuple(groups))


def _origin(raw: object, what: str, texts: dict[str, str]) -> RuleOrigin:
    """A recorded rule origin; its text is written by the first group that uses it, later
    groups name it by SHA-256 only."""
    if not isinstance(raw, dict):
        raise _Invalid(f"{what} must be an object, not {_short(raw)}")
    _only_keys(raw, {"rules_sha256", "text", "rule", "config", "block"}, what)
    sha, rule = raw.get("rules_sha256"), raw.get("rule")
    if not isinstance(sha, str) or type(rule) is not int or rule < 0:
        raise _Invalid(f"{what}: rules_sha256 must be a string and rule a whole number")
    if "text" in raw:
        text = raw["text"]
        if not isinstance(text, str):
            raise _Invalid(f"{what}: text must be a string")
        import hashlib  # here, not at start-up: OpenSSL is slow to load

        try:
            actual = hashlib.sha256(text.encode("utf-8")).hexdigest()
        except UnicodeEncodeError:
            raise _Invalid(f"{what}: text holds a lone UTF-16 surrogate, which is not text") from None
        if actual != sha:
            raise _Invalid(f"{what}: the rules text does not have the recorded SHA-256 {quote(sha[:80])}")
        texts[sha] = text
    if sha not in texts:
        raise _Invalid(f"{what}: rules_sha256 {quote(sha[:80])} names no text an earlier group recorded")
    config = raw.get("config", {})
    if not isinstance(config, dict) or not all(type(v) is int for v in config.values()):
        raise _Invalid(f"{what}: config must map config keys to the integers the rules' vars read")
    block = raw.get("block")
    if block is not None and not (isinstance(block, list) and len(block) == 2
                                  and all(type(v) is int and v > 0 for v in block)):
        raise _Invalid(f"{what}: block must be null or two positive integers")
    return RuleOrigin(texts[sha], rule, tuple(sorted(config.items())), tuple(block) if block else None)


def _origin_json(origin: RuleOrigin, written: set[str]) -> dict:
    sha = origin.sha256
    record = {"rules_sha256": sha, "rule": origin.rule, "config": dict(origin.config),
              "block": list(origin.block) if origin.block else None}
    if sha not in written:  # the text once per plan; later groups name it
        written.add(sha)
        record["text"] = origin.text
    return record


def _step(raw: object, what: str) -> Step:
    if not isinstance(raw, dict):
        raise _Invalid(f"{what} must be an object, not {_short(raw)}")
    _only_keys(raw, {"op", "params", "exact", "one_way", "inputs", "outputs", "input_specs", "output_specs"}, what)
    from ..ops import OPS

    kind, params = raw.get("op"), raw.get("params")
    if not isinstance(kind, str) or kind not in OPS:
        raise _Invalid(f"{what}: op {_short(kind)} is not an op this fusectl knows")
    if not isinstance(params, dict):
        raise _Invalid(f"{what}: params must be an object, not {_short(params)}")
    _check_params(OPS[kind], params, f"{what} ({kind})")
    for key in ("exact", "one_way"):
        if not isinstance(raw.get(key, False), bool):
            raise _Invalid(f"{what}: {key} must be true or false")
    inputs = tuple(_name(n, f"{what}: an input") for n in _list(raw.get("inputs"), f"{what}: inputs"))
    outputs = tuple(_name(n, f"{what}: an output") for n in _list(raw.get("outputs"), f"{what}: outputs"))
    input_specs = tuple(_spec_of(x, f"{what}: input_specs") for x in _list(raw.get("input_specs"), f"{what}: input_specs"))
    output_specs = tuple(_spec_of(x, f"{what}: output_specs") for x in _list(raw.get("output_specs"), f"{what}: output_specs"))
    if len(inputs) != len(input_specs) or len(outputs) != len(output_specs):
        raise _Invalid(f"{what}: {len(inputs)} inputs with {len(input_specs)} input_specs, "
                       f"{len(outputs)} outputs with {len(output_specs)} output_specs")
    try:
        step = Step(op_from_record(kind, params), inputs, outputs, input_specs, output_specs)
        # the op re-derives the outputs: an edited record cannot make it write what it would not
        derived = tuple(step.op.infer(input_specs, inputs))
        if derived != output_specs:
            raise _Invalid(f"{what}: {kind} makes {[str(x) for x in derived]} from its inputs, "
                           f"not the recorded {[str(x) for x in output_specs]}")
        inverse = step.inverse()  # what inspect reports and unfuse runs must be computable
        if inverse is not None:
            inverse.op.infer(inverse.input_specs, inverse.inputs)
    except FusectlError as e:
        raise _Invalid(f"{what}: {e}") from None
    except (TypeError, ValueError, ArithmeticError, IndexError, KeyError, AttributeError) as e:
        raise _Invalid(f"{what}: {kind} cannot be rebuilt from these params ({type(e).__name__}: {e})") from e
    return step


def _spec_of(raw: object, what: str) -> TensorSpec:
    """A recorded spec: ``[dtype name, [dims...]]``."""
    if (not isinstance(raw, list) or len(raw) != 2 or not isinstance(raw[0], str)
            or not isinstance(raw[1], list) or not all(type(d) is int and d >= 0 for d in raw[1])):
        raise _Invalid(f"{what}: {_short(raw)} is not [dtype, [dims...]] with whole-number dims")
    if raw[0] not in dtypes.BY_NAME:
        raise _Invalid(f"{what}: unknown dtype {_short(raw[0])}")
    if len(raw[1]) > limit("dims"):
        _within("dims", len(raw[1]), what)
    return TensorSpec(dtypes.BY_NAME[raw[0]], tuple(raw[1]))


def _check_params(op: type[Op], params: dict, what: str) -> None:
    """Each param must be a field of ``op`` and of its annotated type (JSON lists for tuples)."""
    hints = _param_types(op)
    for key, value in params.items():
        if key not in hints:
            raise _Invalid(f"{what}: unknown param {quote(str(key)[:80])}")
        if not _fits(value, hints[key]):
            raise _Invalid(f"{what}: param {key} = {_short(value)} is not of type {_type_name(hints[key])}")


@functools.cache
def _param_types(op: type[Op]) -> dict[str, object]:
    try:
        hints = typing.get_type_hints(op)
    except (NameError, TypeError):  # an annotation this check cannot resolve: any value passes here
        hints = {}
    return {f.name: hints.get(f.name, object) for f in dataclasses.fields(op)}


def _fits(value: object, hint: object) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        return type(value) is bool
    if hint is int:
        return type(value) is int
    if hint is float:
        return type(value) in (int, float) and math.isfinite(value)
    if hint is str:
        return type(value) is str
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin is typing.Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if origin in (tuple, list):
        if type(value) is not list:
            return False
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):
            return not args or all(_fits(v, args[0]) for v in value)
        return len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args))
    return True  # a type this check does not know: the op's own checks judge the value


def _type_name(hint: object) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _spec_json(spec: TensorSpec) -> list:
    return [spec.dtype.safetensors, list(spec.shape)]


def plan_to_json(plan: Plan) -> list[dict]:
    """A plan as JSON-ready data (also what ``fusectl plan --json`` prints under "groups"). A
    group's ``origin`` (the rule as bound: its file's text, the rule's index, the config values
    its vars read) carries the text the first time the plan uses it."""
    written: set[str] = set()
    return [
        {
            "rule": g.rule,
            "source": g.source,
            "op": g.kind,
            "untied": [list(u) for u in g.untied],
            "untied_stored": [list(u) for u in g.untied_stored],
            **({"config": g.config.to_json()} if g.config is not None else {}),
            **({"origin": _origin_json(g.origin, written)} if g.origin is not None else {}),
            "steps": [
                {
                    "op": s.op.kind,
                    "params": s.op.params(),
                    "exact": s.op.exact,
                    "one_way": s.inverse() is None,
                    "inputs": list(s.inputs),
                    "outputs": list(s.outputs),
                    "input_specs": [_spec_json(x) for x in s.input_specs],
                    "output_specs": [_spec_json(x) for x in s.output_specs],
                }
                for s in g.steps
            ],
        }
        for g in plan.groups
    ]


def plan_from_json(raw: list, where: str = "the plan") -> Plan:
    """A plan from its JSON form (``plan_to_json``), every field and step checked;
    CheckpointError naming ``where`` when the record is not one fusectl could have written."""
    try:
        return _plan(raw)
    except _Invalid as e:
        raise _unreadable(where, str(e)) from e
