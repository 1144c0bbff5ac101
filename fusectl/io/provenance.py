"""Provenance: the executed plan and the tie aliases, stored in an output's metadata."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .. import __version__, dtypes
from ..errors import CheckpointError
from ..plan import Plan, Step, StepGroup, op_from_record
from ..tensors import TensorSpec

METADATA_KEY = "fusectl"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Provenance:
    """What fusectl recorded: the plan that made the file and which names alias which."""

    plan: Plan = field(default_factory=Plan)
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> unique (stored) name

    def to_json(self) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "fusectl_version": __version__,
            "plan": plan_to_json(self.plan),
            "aliases": dict(sorted(self.aliases.items())),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def loads(cls, text: str, where: str) -> "Provenance":
        try:
            doc = json.loads(text)
            if doc.get("format_version") != FORMAT_VERSION:
                raise CheckpointError(
                    f"{where}: provenance format {doc.get('format_version')!r} is not "
                    f"{FORMAT_VERSION}; use the fusectl version that wrote it"
                )
            aliases = doc.get("aliases", {})
            if not isinstance(aliases, dict):
                raise ValueError("aliases must be an object")
            return cls(plan_from_json(doc["plan"]), {str(k): str(v) for k, v in aliases.items()})
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{where}: fusectl provenance is unreadable ({e}); the metadata was edited or corrupted") from e


def _spec_json(spec: TensorSpec) -> list:
    return [spec.dtype.safetensors, list(spec.shape)]


def _spec(raw: list) -> TensorSpec:
    return TensorSpec(dtypes.BY_NAME[raw[0]], tuple(int(d) for d in raw[1]))


def plan_to_json(plan: Plan) -> list[dict]:
    """A plan as JSON-ready data (also what ``fusectl plan --json`` prints under "groups")."""
    return [
        {
            "rule": g.rule,
            "source": g.source,
            "op": g.kind,
            "untied": [list(u) for u in g.untied],
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


def plan_from_json(raw: list[dict]) -> Plan:
    groups = []
    for g in raw:
        steps = tuple(
            Step(
                op_from_record(s["op"], s["params"]),
                tuple(s["inputs"]),
                tuple(s["outputs"]),
                tuple(_spec(x) for x in s["input_specs"]),
                tuple(_spec(x) for x in s["output_specs"]),
            )
            for s in g["steps"]
        )
        groups.append(StepGroup(g["rule"], g["source"], steps, tuple(tuple(u) for u in g.get("untied", []))))
    return Plan(tuple(groups))
