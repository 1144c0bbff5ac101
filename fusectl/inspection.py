"""``inspect``: what a checkpoint holds, from its headers (and, asked to, its data's hashes).

:func:`inspect_checkpoint` makes an :class:`InspectReport`, whose :meth:`~InspectReport.to_json`
is the object ``fusectl inspect --json`` prints (SPEC §2) and :meth:`~InspectReport.to_text`
the text ``fusectl inspect`` prints. ``fusectl.inspect`` opens a path and calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .errors import CheckpointError, option, option_name, printable
from .followers.optimizer import recognise
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
    ``adapter`` the scales and LoRA modules found (None when there are none); ``optimizer``
    a training dict's optimizer state (:func:`optimizer_report`; None when there is none);
    ``twins`` the copies of the model beside it (:func:`twins_report`); ``distributed`` how
    many ranks wrote it (``world_size``, a ZeRO ``stage``; None for a checkpoint one process wrote).
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
    optimizer: dict | None = None
    twins: list[dict] = field(default_factory=list)
    distributed: dict | None = None
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
            "optimizer": self.optimizer,
            "twins": self.twins,
            "distributed": self.distributed,
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
        if self.distributed is not None:
            lines.extend(_distributed_lines(self.distributed))
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
        if self.optimizer:
            lines.extend(_optimizer_text(self.optimizer))
        for t in self.twins:
            prefix = f", names under {printable(t['prefix'])}" if t["prefix"] else ""
            others = f", other entries kept: {', '.join(map(printable, t['other_entries']))}" if t["other_entries"] else ""
            lines.append(f"copy of the model: {printable(t['where'])}: {t['tensors']} of its tensors "
                         f"({', '.join(t['dtypes'])}){prefix}{others}; it takes the model's plan")
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
        optimizer=optimizer_report(c),
        twins=twins_report(c),
        distributed=c.distributed,
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


def twins_report(c: Checkpoint) -> list[dict]:
    """The copies of the model a training dict holds beside it (an EMA, an averaged model), as
    ``inspect --json`` shows them: ``where`` the dotted key, ``tensors`` how many of the model's
    tensors it holds (by name), ``prefix`` what its names put before the model's, ``dtypes``
    its tensors' dtypes, ``other_entries`` its keys that are not the model's tensors (kept)."""
    return [{"where": t.where, "tensors": len(t.tensors), "prefix": t.prefix,
             "dtypes": sorted({v.spec.dtype.safetensors for v in t.tensors.values()}),
             "other_entries": [str(k) for k in t.rest]} for t in c.twins]


def optimizer_report(c: Checkpoint) -> dict | None:
    """A training dict's optimizer state as ``inspect --json`` shows it (None when there is
    none): where it is, the optimizer as recognised (``kind``; ``exact``: whether layout rules
    move it exactly, else ``refused_because``), ``order_from`` (how each state was mapped to its
    parameter), its groups with their hyperparameters, the ``step`` and each parameter's id,
    group and state keys. A state that cannot be read or mapped is shown with ``problem``."""
    try:
        state = c.optimizer
    except CheckpointError as e:
        where = c.training.optimizer_key if c.training is not None else None
        return {"where": where, "problem": str(e)}
    if state is None:
        return None
    follower = c.followers.of("optimizer")
    try:
        if follower is not None:
            return {**follower.report(), "problem": None}
        c.optimizer_mapped
        problem = "not mapped"
    except CheckpointError as e:
        problem = str(e)
    kind, why = recognise(set(state.keys()), [g.hyper for g in state.groups])
    return {"where": state.where, "kind": kind, "exact": why is None, "refused_because": why, "order_from": None,
            "groups": [{"params": len(g.params), "hyperparameters": g.hyper} for g in state.groups],
            "step": None, "parameters": None, "problem": problem}


def _optimizer_text(o: dict) -> list[str]:
    if o.get("kind") is None:
        return [f"optimizer: {printable(str(o['where']))}: {printable(o['problem'])}"]
    how = "moves exactly" if o["exact"] else f"refused ({o['refused_because']})"
    lines = [f"optimizer: {printable(o['where'])}: {o['kind']}, {len(o['groups'])} group(s), {how}"]
    for n, g in enumerate(o["groups"]):
        hyper = ", ".join(f"{k}={v}" for k, v in g["hyperparameters"].items())
        lines.append(f"  group {n}: {g['params']} parameter(s); {printable(hyper)}")
    if o["parameters"] is not None:
        keys = sorted({k for p in o["parameters"].values() for k in p["state"]})
        if o["step"] is not None:
            step = f"; step {o['step']}"
        else:  # a step kept as a tensor is data, which inspect does not read
            step = "; step held as tensors" if "step" in keys else ""
        lines.append(f"  state: {', '.join(keys)} of {len(o['parameters'])} parameter(s){step}; "
                     f"order from {printable(o['order_from'])}")
    if o["problem"]:
        lines.append(f"  not mapped to its parameters: {printable(o['problem'])}")
    return lines


def _distributed_lines(distributed: dict) -> list[str]:
    """How ``inspect`` says who wrote a checkpoint of many ranks: the sizes on one line, the
    parallel kinds counted, the accounting of every element.

    >>> lines = _distributed_lines({"tp": 2, "parallel": {"a": "row", "b": "row", "c": "column"},
    ...     "accounted": {"source_tensors": 4, "source_elements": 96, "source_copies": 1, "output_tensors": 2,
    ...                   "output_elements": 96, "output_copies": 0}})
    >>> lines[:2]
    ['written by tp 2', 'parallel kinds: row 2, column 1']
    >>> lines[2][:72]
    'every element accounted for: 4 rank tensor(s), 96 element(s), each taken'
    """
    plain = {k: v for k, v in distributed.items() if k not in ("parallel", "accounted")}
    lines = ["written by " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in plain.items())]
    kinds = distributed.get("parallel")
    if isinstance(kinds, dict):
        counts: dict[str, int] = {}
        for kind in kinds.values():
            counts[kind] = counts.get(kind, 0) + 1
        lines.append("parallel kinds: " + ", ".join(f"{k} {n}" for k, n in counts.items()))
    a = distributed.get("accounted")
    if isinstance(a, dict):
        lines.append(f"every element accounted for: {a['source_tensors']} rank tensor(s), {a['source_elements']} "
                     f"element(s), each taken once ({a['source_copies']} copy(ies) — of replicated tensors, of a "
                     f"tied head — compared with the one kept), make {a['output_tensors']} tensor(s) of "
                     f"{a['output_elements']} element(s)")
    return lines

