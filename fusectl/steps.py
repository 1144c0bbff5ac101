"""A plan: the frozen steps that binding rules to a checkpoint produced, computed from headers.

The plan is data: ``fusectl plan`` prints it, ``fuse`` runs it (``fusectl.executor``) and stores
it as provenance, ``unfuse`` runs ``plan.inverse()``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config_edit import ConfigEdit
from .errors import PlanError
from .ops import Op
from .tensors import TensorSpec


@dataclass(frozen=True)
class Step:
    """One concrete application of an op: named inputs → named outputs, specs known."""

    op: Op
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    input_specs: tuple[TensorSpec, ...]
    output_specs: tuple[TensorSpec, ...]

    def inverse(self) -> "Step | None":
        """The step that undoes this one (outputs back to inputs); None when its op is one-way."""
        op = self.op.inverse(self.input_specs)
        if op is None:
            return None
        return Step(op, self.outputs, self.inputs, self.output_specs, self.input_specs)


@dataclass(frozen=True)
class RuleOrigin:
    """What a step group's rule was bound with, so that ``verify`` can bind it again: the rules
    file's text (a preset's shipped text), which ``[[rule]]`` of it (0-based), the config values
    its ``[vars]`` read and the quantization block size the planner used."""

    text: str
    rule: int
    config: tuple[tuple[str, object], ...] = ()  # (config key, its JSON value), sorted by key
    block: tuple[int, int] | None = None

    @property
    def sha256(self) -> str:
        """The hex SHA-256 of the rules text (how a provenance names the text it stores once)."""
        import hashlib  # only where a rule's text is fingerprinted (OpenSSL is slow to load)

        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class StepGroup:
    """The steps one rule produced; ties are judged per group."""

    rule: str
    source: str
    steps: tuple[Step, ...]
    untied: tuple[tuple[str, ...], ...] = ()  # tie groups this rule broke (--untie)
    # for each untied group, its members the input stored (an alias became a copy)
    untied_stored: tuple[tuple[str, ...], ...] = ()
    retie: tuple[tuple[str, ...], ...] = ()  # groups an inverse ties again (exact steps only)
    retie_stored: tuple[tuple[str, ...], ...] = ()  # ... and which of their members stay stored
    config: ConfigEdit | None = None  # a rules file's [config]: the group edits config.json
    origin: RuleOrigin | None = None  # the rule as bound (None: recorded before fusectl kept it)

    @property
    def kind(self) -> str:
        """The op kind of the group's steps (``"config"`` for a ``[config]`` group, ``"none"`` when
        the group has no steps)."""
        if not self.steps:
            return "config" if self.config is not None else "none"
        return self.steps[0].op.kind

    def describe(self) -> str:
        """How messages name the group's rule: ``rule 'attn-qkv' (rules.toml)``."""
        return f"rule {self.rule!r} ({self.source})"


@dataclass(frozen=True)
class Plan:
    """An ordered list of step groups."""

    groups: tuple[StepGroup, ...] = ()

    @property
    def steps(self) -> list[Step]:
        """Every step of every group, in order."""
        return [s for g in self.groups for s in g.steps]

    def inverse(self) -> "Plan":
        """The plan that undoes this one; PlanError naming the first one-way step."""
        groups = []
        for group in reversed(self.groups):
            steps = []
            for step in reversed(group.steps):
                inverse = step.inverse()
                if inverse is None:
                    raise PlanError(
                        f"{group.describe()} is one-way: its {step.op.kind} step on "
                        f"{', '.join(repr(n) for n in step.inputs)} cannot be undone"
                    )
                steps.append(inverse)
            # undoing exact steps makes the untied copies bitwise equal again: tie them back
            exact = all(s.op.exact for s in group.steps)
            groups.append(StepGroup(group.rule, group.source, tuple(steps),
                                    retie=group.untied if exact else (),
                                    retie_stored=group.untied_stored if exact else (),
                                    config=group.config.inverse() if group.config else None))
        return Plan(tuple(groups))

    def config_edits(self) -> list[ConfigEdit]:
        """The [config] edits of the plan's groups, in order."""
        return [g.config for g in self.groups if g.config is not None]

    def __add__(self, other: "Plan") -> "Plan":
        return Plan(self.groups + other.groups)


def op_from_record(kind: str, params: dict) -> Op:
    """Rebuild an op from its recorded kind and parameters (plans read back from JSON)."""
    from .ops import OPS

    if kind not in OPS:
        raise PlanError(f"recorded op {kind!r} is not known to this fusectl version")
    return OPS[kind].from_params(params)
