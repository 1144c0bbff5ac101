"""``inspect``: what a checkpoint holds, from its headers (and, asked to, its data's hashes).

:func:`inspect_checkpoint` makes an :class:`InspectReport`, whose :meth:`~InspectReport.to_json`
is the object ``fusectl inspect --json`` prints (SPEC §2) and :meth:`~InspectReport.to_text`
the text ``fusectl inspect`` prints. ``fusectl.inspect`` opens a path and calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .errors import option, option_name, printable
from .io.checkpoint import Checkpoint
from .reports import human, names_text, table_json
from .ties import detect_ties as find_equal_tensors


@dataclass(frozen=True)
class InspectReport:
    """What ``inspect`` found in a checkpoint.

    ``path`` is the checkpoint as the caller named it; ``summary`` the table as
    :func:`fusectl.reports.table_json` shows it (``parameters``, ``ties``, ``unique_count``,
    ``total_bytes``); ``provenance`` fusectl's recorded provenance as JSON (None when the
    file has none) and ``provenance_groups``/``provenance_steps`` its size; ``config`` the
    config.json read; ``state_dict_key`` the state dict read inside a PyTorch training dict;
    ``ignored`` what a PyTorch file held that is not a tensor; ``quantization`` and
    ``adapter`` the scales and LoRA modules found (None when there are none).
    ``suspected_ties`` and ``constant_groups_skipped`` are None unless ties were detected.
    """

    path: str
    format: str
    files: list[str]
    summary: dict
    provenance: dict | None
    provenance_groups: int
    provenance_steps: int
    config: str | None
    state_dict_key: str | None
    ignored: list[str]
    quantization: dict | None
    adapter: dict | None
    suspected_ties: list[list[str]] | None = None
    constant_groups_skipped: int | None = None

    def to_json(self) -> dict:
        """The documented ``inspect --json`` object, keys in their stable order; with ties
        detected, ``suspected_ties`` and ``constant_groups_skipped`` last."""
        report = {
            "format": self.format,
            "files": self.files,
            **self.summary,
            "provenance": self.provenance,
            "config": self.config,
            "state_dict_key": self.state_dict_key,
            "ignored": self.ignored,
            "quantization": self.quantization,
            "adapter": self.adapter,
        }
        if self.suspected_ties is not None:
            report["suspected_ties"] = self.suspected_ties
            report["constant_groups_skipped"] = self.constant_groups_skipped
        return report

    def to_text(self) -> str:
        """``inspect``'s text: a summary line, one line per name (``-> unique`` for a tie), the
        ties, and what was found beside the tensors (adapter, scales, provenance)."""
        summary = self.summary
        lines = [f"{self.path}: {self.format}, {len(self.files)} file(s), {summary['unique_count']} unique "
                 f"parameters, {human(summary['total_bytes'])}"]
        if self.state_dict_key is not None:
            lines.append(f"state dict: {printable(self.state_dict_key)} (pass {option_name('key')} to choose another)")
        if self.ignored:
            lines.append(f"ignored (not tensors): {names_text(self.ignored)}")
        width = max((len(printable(p["name"])) for p in summary["parameters"]), default=0)
        for p in summary["parameters"]:
            tie = f"  -> {printable(p['unique'])}" if p["unique"] != p["name"] else ""
            lines.append(f"  {printable(p['name']):<{width}}  {p['dtype']:<6} {str(p['shape']):<16}{tie}")
        for group in summary["ties"]:
            lines.append(f"tied: {names_text(group)}")
        for group in self.suspected_ties or []:
            lines.append(f"suspected tie (equal content): {names_text(group)}; adopt with "
                         f"{option('detect_ties')} on fuse/plan or [ties] in a rules file")
        if self.constant_groups_skipped:
            lines.append(f"not suspected: {self.constant_groups_skipped} group(s) of equal tensors whose "
                         "elements are all one value (all-ones norms, zero biases), which are equal by chance")
        if self.adapter:
            modules = self.adapter["modules"].values()
            ranks = sorted({m["rank"] for m in modules})
            scalings = sorted({m["scaling"] for m in modules})
            lines.append(f"LoRA adapter: {len(self.adapter['modules'])} module(s), rank "
                         f"{', '.join(map(str, ranks))}, scaling {', '.join(f'{s:g}' for s in scalings)}")
        if self.quantization:
            weights = self.quantization["weights"]
            kinds = sorted({s["kind"] for scales in weights.values() for s in scales})
            lines.append(f"quantized: {len(weights)} weight(s) with scales ({', '.join(kinds)}); "
                         f"block size {_block_text(self.quantization)}")
        if self.provenance is not None:
            lines.append(f"provenance: {self.provenance_groups} rule group(s), "
                         f"{self.provenance_steps} step(s) recorded by fusectl")
        return "\n".join(lines)


def inspect_checkpoint(c: Checkpoint, path: str | None = None, *, detect_ties: bool = False) -> InspectReport:
    """The :class:`InspectReport` of an opened checkpoint (named ``path`` in its text, by
    default its own path); ``detect_ties`` hashes every tensor to report equal ones as
    suspected ties (the only part that reads tensor data)."""
    provenance = c.provenance
    report = InspectReport(
        path=str(c.path) if path is None else path,
        format=c.format,
        files=c.files,
        summary=table_json(c.table),
        provenance=provenance.to_json() if provenance else None,
        provenance_groups=len(provenance.plan.groups) if provenance else 0,
        provenance_steps=len(provenance.plan.steps) if provenance else 0,
        config=c.config_path,
        state_dict_key=c.state_dict_key,
        ignored=c.ignored,
        quantization=c.followers.report("scales"),
        adapter=c.followers.report("lora"),
    )
    if not detect_ties:
        return report
    known = {tuple(g) for g in c.table.ties()}
    detected = find_equal_tensors(c.table)
    return replace(report, suspected_ties=[g for g in detected.groups if tuple(g) not in known],
                   constant_groups_skipped=detected.constant_groups)



def _block_text(quantized: dict) -> str:
    if not quantized["block_size"]:
        return "not set (no block scales, or set quantization_config.weight_block_size)"
    return f"{quantized['block_size'][0]}x{quantized['block_size'][1]} ({quantized['block_size_source']})"
