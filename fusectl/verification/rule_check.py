"""Each recorded group of a candidate's provenance re-derived from the rule it names (``verify``'s
check 5): a provenance whose steps its rules do not give fails, however consistent its steps and
data are with each other.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ..errors import FusectlError, RuleError, option, printable, quote
from ..executor import apply_group
from ..io.checkpoint import Checkpoint
from ..planner import bind_rule
from ..mxnet_facts import with_checkpoint_facts
from ..rules.origin import load_origin
from ..rules.presets import preset_names, preset_text
from ..rules.schema import load_rules
from ..steps import Plan, RuleOrigin, Step, StepGroup
from ..table import ParamTable
from .report import Check


def rule_checks(reference: Checkpoint, plan: Plan, adapter: bool = False) -> list[Check]:
    """One check per recorded group with steps: bound again from the rule its provenance records,
    on the reference as the groups before it left it, the rule must give exactly the recorded
    steps (op, parameters, names, specs).

    A group recorded with its rule's origin (the rules text and the config values its vars read)
    is re-derived from that text. A group that names a shipped preset is also re-derived from
    the preset as shipped (with the reference's config.json for the vars) whenever the recorded
    text is not the preset's, so a provenance cannot borrow a preset's name for other rules.
    A group that records no origin and names no shipped preset fails: the rule that made it is
    nowhere to be read, and a provenance could drop its origin to escape the check (``-r RULES``
    checks against the rules instead). A LoRA adapter's groups are lifted from its base view
    and are noted as not re-derived.
    """
    table = reference.table.copy()
    checks = []
    for group in plan.groups:
        if group.steps:
            checks.append(Check("rules", group.describe(), *_rederive(group, table, reference, adapter)))
        apply_group(table, group, untie=True)
    return checks


def _rederive(group: StepGroup, table: ParamTable, reference: Checkpoint, adapter: bool) -> tuple[bool, None, str]:
    """(passed, None, detail) for one recorded group."""
    if adapter:
        return True, None, "not re-derived: an adapter's steps are lifted from its base view"
    try:
        found = _recorded_rules(group, reference)
    except FusectlError as e:
        return False, None, f"the recorded rules do not load: {e}"
    if isinstance(found, str):
        return False, None, f"not re-derived: {found}"
    for rule, origin, riders, what in found:
        passed, _, detail = _rederive_from(group, table, reference, rule, origin, riders)
        if not passed:
            return False, None, f"{what}: {detail}"
    return True, None, f"{len(group.steps)} step(s) re-derived from {' and '.join(w for *_, w in found)}"


def _rederive_from(group: StepGroup, table: ParamTable, reference: Checkpoint, rule, origin: RuleOrigin,
                   riders) -> tuple[bool, None, str]:
    """(passed, None, detail): whether ``rule`` bound on ``table`` gives the group's steps."""
    disagreeing = _config_disagreement(origin, reference)
    if disagreeing:
        return False, None, disagreeing
    try:
        steps = bind_rule(rule, table, riders)
    except FusectlError as e:
        return False, None, f"the recorded rule does not bind to the reference: {e}"
    for k, (got, want) in enumerate(zip(steps, group.steps)):
        if _step_record(got) != _step_record(want):
            return False, None, (f"step {k}: the provenance records {_describe(want)}, but the rule "
                                 f"{quote(rule.name)} gives {_describe(got)}")
    if len(steps) != len(group.steps):
        return False, None, (f"the rule gives {len(steps)} step(s), the provenance records "
                             f"{len(group.steps)}")
    return True, None, f"{len(steps)} step(s) re-derived from the recorded rule"


def _recorded_rules(group: StepGroup, reference: Checkpoint):
    """[(rule, origin, riders, what)] to re-derive a group from: the rules text it records and,
    when it names a shipped preset whose text that is not, the preset as shipped; or why there
    is nothing to re-derive it from."""
    found = []
    origin = group.origin
    if origin is not None:
        ruleset = with_checkpoint_facts(load_origin(origin, group.source), reference)
        if origin.rule >= len(ruleset.rules) or ruleset.rules[origin.rule].name != group.rule:
            raise RuleError(f"{group.source} has no rule {quote(group.rule)} at index {origin.rule}")
        found.append((ruleset.rules[origin.rule], origin, reference.followers.riders(origin=origin),
                      "the recorded rule"))
    preset = group.source[len("preset "):] if group.source.startswith("preset ") else None
    if preset is not None and preset in preset_names() and (origin is None or origin.text != preset_text(preset)):
        shipped = _shipped_rule(group, preset, reference)
        if isinstance(shipped, str):
            return shipped
        found.append(shipped)
    if not found:
        return ("the provenance records no rules text and names no shipped preset, so nothing says which "
                "rule made these steps (a provenance written before fusectl recorded rules texts, or one "
                f"edited since); pass {option('rules')} with the rules it was fused with, or re-fuse with this fusectl")
    return found


def _shipped_rule(group: StepGroup, preset: str, reference: Checkpoint):
    """(rule, origin, riders, what) of the shipped preset a group names, or why it cannot be read."""
    try:
        ruleset = with_checkpoint_facts(load_rules(preset_text(preset), group.source, reference.config), reference)
    except RuleError as e:
        return f"the provenance names preset {preset}, which does not load here ({e})"
    index = next((k for k, r in enumerate(ruleset.rules) if r.name == group.rule), None)
    if index is None:
        return f"the provenance names preset {preset}, which has no rule {quote(group.rule)}"
    riders = reference.followers.riders([ruleset])
    return ruleset.rules[index], RuleOrigin(preset_text(preset), index), riders, f"preset {preset} as shipped"


def _config_disagreement(origin: RuleOrigin, reference: Checkpoint) -> str:
    """Why the recorded config values are not the reference's (empty when they agree)."""
    config = reference.config if isinstance(reference.config, Mapping) else {}
    for key, value in origin.config:
        if key in config and config[key] != value:
            return (f"the rule was bound with config {quote(key)} = {value}, but the reference's config.json "
                    f"says {str(config[key])[:40]}")
    return ""


def _step_record(step: Step) -> tuple:
    return (step.op.kind, step.op.params(), step.inputs, step.outputs, step.input_specs, step.output_specs)


def _describe(step: Step) -> str:
    return f"{step.op.kind} {_names(step.inputs)} -> {_names(step.outputs)} {printable(str(step.op.params()))}"


def _names(names: Sequence[str]) -> str:
    return "[" + ", ".join(quote(n) for n in names) + "]"
