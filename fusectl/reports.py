"""How reports read: the documented JSON objects and the text the command line prints.

Shared by the report objects of :mod:`fusectl.api` and :mod:`fusectl.inspection`, so that a
table reads the same in ``inspect --json`` and under ``"result"`` in ``plan --json``, and a
size the same in every line of text.
"""

from __future__ import annotations

from typing import Iterable

from .errors import option, printable
from .io.provenance import plan_to_json
from .followers.scales import scale_names
from .steps import Plan
from .table import ParamTable


def human(nbytes: int) -> str:
    """A byte count in decimal units, as the text reports print it.

    >>> human(999), human(1500), human(2_400_000_000)
    ('999 B', '1.50 KB', '2.40 GB')
    """
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} B"


def names_text(names: Iterable[str]) -> str:
    """Names read from a file, escaped and joined with commas.

    >>> names_text(["a", "b" + chr(7)])
    'a, b\\\\x07'
    """
    return ", ".join(printable(n) for n in names)


def parameters_json(table: ParamTable) -> list[dict]:
    """Every name of ``table`` with the unique parameter it is, its dtype, shape and size."""
    unique = table.unique_names()
    return [
        {
            "name": name,
            "unique": unique[name],
            "dtype": table.spec(name).dtype.safetensors,
            "shape": list(table.spec(name).shape),
            "nbytes": table.spec(name).nbytes,
        }
        for name in table.names()
    ]


def table_json(table: ParamTable) -> dict:
    """A table as ``inspect --json`` and ``plan --json`` (``"result"``) show it: ``parameters``,
    ``ties``, ``unique_count``, ``total_bytes`` (of the unique parameters)."""
    unique = table.unique()
    return {
        "parameters": parameters_json(table),
        "ties": table.ties(),
        "unique_count": len(unique),
        "total_bytes": sum(t.spec.nbytes for _, t in unique),
    }


def plan_json(plan: Plan, result: ParamTable) -> dict:
    """``plan --json``: the rule groups (as the provenance records them) and the table they make."""
    return {"groups": plan_to_json(plan), "result": table_json(result)}


def plan_text(plan: Plan, result: ParamTable) -> str:
    """``plan``'s text: each rule group with its steps (a quantized weight's scales beside it),
    the ties it breaks, then the table the plan makes."""
    steps = plan.steps
    lines = [f"plan: {len(plan.groups)} rule group(s), {len(steps)} step(s) (computed from headers)"]
    for group in plan.groups:
        notes = [n for n, on in (("one-way", any(s.inverse() is None for s in group.steps)),
                                  ("numeric", any(not s.op.exact for s in group.steps))) if on]
        note = f" ({', '.join(notes)})" if notes else ""
        lines.append(f"{group.describe()}: {group.kind} x{len(group.steps)}{note}")
        if group.config is not None:
            lines.append(f"  {group.config.describe()}")
        weights: set[str] = set()
        for step in group.steps:
            ins = ", ".join(f"{printable(n)} {s}" for n, s in zip(step.inputs, step.input_specs))
            outs = ", ".join(f"{printable(n)} {s}" for n, s in zip(step.outputs, step.output_specs))
            # a quantized weight's scales move right after it, shown beside it
            is_scale = all(n in scale_names(weights) for n in step.inputs)
            if not is_scale:
                weights = set(step.inputs)
            lines.append(f"  {'  scale: ' if is_scale else ''}{ins} -> {outs or '(dropped)'}")
        for members in group.untied:
            lines.append(f"  untied ({option('untie')}): {names_text(members)}")
    unique = result.unique()
    lines.append(f"result: {len(result.entries)} names, {len(unique)} unique parameters, "
                 f"{human(sum(t.spec.nbytes for _, t in unique))}")
    for group in result.ties():
        lines.append(f"tied: {names_text(group)}")
    return "\n".join(lines)


def name_map_text(name_map, checkpoint: str, graph: str, names: int) -> str:
    """``map``'s text for a :class:`~fusectl.onnx.namemap.NameMap` of ``checkpoint`` (with
    ``names`` structural names) on ``graph``: one line per pair (how it was paired, and a
    note when its data differs or was not checked), the unmatched names, then a count."""
    pairs = name_map.pairs
    width = max((len(printable(p.structural)) for p in pairs), default=0)
    notes = {"differs": "  (data differs: the graph holds something else under this name)",
             "unknown": "  (data not checked: the checkpoint knows only the name)"}
    lines = [f"{printable(p.structural):<{width}}  {p.how:<10}  {printable(p.initializer)}{notes.get(p.data, '')}"
             for p in pairs]
    lines += [f"unmatched in {checkpoint}: {printable(name)}" for name in name_map.unmatched_checkpoint]
    lines += [f"unmatched in {graph}: {printable(name)}" for name in name_map.unmatched_graph]
    lines.append(f"{len({p.structural for p in pairs})} of {names} names paired; "
                 f"{len(name_map.unmatched_graph)} graph initializer(s) unmatched")
    differing = name_map.differing()
    if differing:
        lines.append(f"{len(differing)} pair(s) by name hold different data: "
                     f"{names_text(p.structural for p in differing)}")
    return "\n".join(lines)
