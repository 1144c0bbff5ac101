"""What the command line does, as functions: plan, fuse, unfuse, export and verify.

Each takes paths (or an opened :class:`~fusectl.io.checkpoint.Checkpoint`) and rules, raises a
:class:`~fusectl.errors.FusectlError` for bad input, and returns a report; nothing here prints.
``fusectl.cli`` parses options and calls these.

>>> import os, tempfile, fusectl
>>> out = os.path.join(tempfile.mkdtemp(), "fused")
>>> report = fusectl.fuse("fixtures/tiny-llama-gqa", ["llama-qkv", "llama-gate-up"], out)
>>> report.tensors, report.steps
(15, 4)
>>> fusectl.verify("fixtures/tiny-llama-gqa", out).passed
True
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

from .errors import PlanError, quote
from .executor import run_plan
from .adapters import ADAPTER_CONFIG, LoraConfig, make_adapter_plan
from .config_edit import resolve_edits
from .io.checkpoint import Checkpoint, Companion, adapter_config, open_checkpoint, read_config_text
from .io.formats import output_kind
from .steps import Plan, RuleOrigin
from .planner import make_plan
from .rules.inverse import InverseProof, invert_with_proof
from .rules.origin import load_recorded_rules
from .rules.schema import RuleSet
from .table import ParamTable
from .ties import declare_ties, detect_ties
from .write import write_table

@dataclass(frozen=True)
class Planned:
    """A checkpoint with rules bound to it: the table they start from (the checkpoint's, with
    declared ties), the plan, and the table running the plan makes."""

    checkpoint: Checkpoint
    start: ParamTable
    plan: Plan
    table: ParamTable
    lora_base: Plan | None = None  # a LoRA adapter's: the plan on its base view it was lifted from


@dataclass(frozen=True)
class FuseReport:
    """What ``fuse`` / ``unfuse`` wrote."""

    output: str
    tensors: int
    unique_bytes: int
    written_bytes: int
    copied_bytes: int  # copied as file ranges, never decoded
    steps: int  # steps in the recorded plan
    ties: list[list[str]]


def _checkpoint(ckpt, config: str | None, follow_symlinks: bool) -> Checkpoint:
    if isinstance(ckpt, Checkpoint):
        return ckpt
    return open_checkpoint(os.fspath(ckpt), config, allow_outside_links=follow_symlinks)


def load_rulesets(checkpoint: Checkpoint, rules: Sequence[str]) -> list[RuleSet]:
    """Each rules file path (or preset name) loaded against the checkpoint's config."""
    return [ruleset for ruleset, _ in _load_with_origins(checkpoint, rules)]


def _load_with_origins(checkpoint: Checkpoint, rules: Sequence[str]) -> list[tuple[RuleSet, RuleOrigin]]:
    """Each rules file loaded, with the text and config values its provenance records."""
    return [load_recorded_rules(os.fspath(r), checkpoint.config) for r in rules]


def _prepared_table(checkpoint: Checkpoint, rulesets: Sequence[RuleSet], detect: bool,
                    write_ties_once: bool) -> ParamTable:
    table = checkpoint.table.copy()
    for ruleset in rulesets:
        declare_ties(table, ruleset.ties, f"{ruleset.source} [ties]")
    if detect:
        declare_ties(table, detect_ties(table).groups, "--detect-ties")
    if write_ties_once:
        table.store_once()
    return table


def plan(ckpt, rules: Sequence[str], *, config: str | None = None, untie: bool = False,
         detect_ties: bool = False, write_ties_once: bool = False, follow_symlinks: bool = False) -> Planned:
    """Bind ``rules`` (files or preset names, in order) to a checkpoint, from headers alone.

    >>> planned = plan("fixtures/tiny-llama-gqa", ["llama-qkv"])
    >>> [g.rule for g in planned.plan.groups]
    ['attn-qkv']
    """
    if not rules:
        raise PlanError("give at least one rules file or preset name")
    checkpoint = _checkpoint(ckpt, config, follow_symlinks)
    loaded = _load_with_origins(checkpoint, rules)
    rulesets = [ruleset for ruleset, _ in loaded]
    table = _prepared_table(checkpoint, rulesets, detect_ties, write_ties_once)
    return _bind(checkpoint, table, rulesets, untie, origins=[origin for _, origin in loaded])


def _bind(checkpoint: Checkpoint, table: ParamTable, rulesets: Sequence[RuleSet], untie: bool, *,
          origins: Sequence[RuleOrigin] | None = None, proof: InverseProof | None = None) -> Planned:
    """Rules bound to a checkpoint's table; to a LoRA adapter's, through its base view.
    ``origins`` are recorded on the groups; ``proof`` admits the bindings of inverted rules."""
    adapter = adapter_config(checkpoint)
    if adapter is None:
        steps, result = make_plan(table, rulesets, untie, checkpoint.config, origins=origins, proof=proof)
        return Planned(checkpoint, table, steps, result)
    where, text, raw = adapter
    lifted = make_adapter_plan(table, LoraConfig.parse(raw, where), text, rulesets, untie, checkpoint.config,
                               proof=proof)
    return Planned(checkpoint, table, lifted.plan, lifted.table, lifted.base)



def _write(checkpoint: Checkpoint, table: ParamTable, history: Plan, new: Plan, out, *, max_shard_size, force,
           progress, on_note, lora_base: Plan | None = None) -> FuseReport:
    """Write ``table``, recording ``history + new`` as its provenance; ``new``'s [config] edits
    change the output's config.json (adapter_config.json). A LoRA adapter is written as
    ``adapter_model.safetensors`` with the base plan its steps were lifted from."""
    out = os.fspath(out)
    new, companions = _edit_config(checkpoint, new, out, on_note)
    recorded = history + new
    adapter = adapter_config(checkpoint) is not None
    if adapter and lora_base is not None and checkpoint.provenance and checkpoint.provenance.lora_base:
        lora_base = checkpoint.provenance.lora_base + lora_base
    report = write_table(table, recorded, out, inputs=checkpoint.input_paths(), passthrough=checkpoint.metadata,
                         companions=companions, max_shard_size=max_shard_size, force=force,
                         progress=progress, on_note=on_note, stem="adapter_model" if adapter else "model",
                         lora_base=lora_base)
    return FuseReport(out, report.tensors, report.unique_bytes, report.written_bytes, report.copied_bytes,
                      len(recorded.steps), table.ties())


def _edit_config(checkpoint: Checkpoint, plan: Plan, out: str, on_note) -> tuple[Plan, list[Companion]]:
    """The plan with each [config] edit's replaced text recorded, and the companions to write
    (the edited config.json in place of the input's)."""
    companions = list(checkpoint.companions)
    adapter = adapter_config(checkpoint)
    sources = {"config.json": checkpoint.config_path, ADAPTER_CONFIG: adapter[0] if adapter else None}
    for file, where in sources.items():
        edits = [g.config for g in plan.groups if g.config is not None and g.config.file == file]
        if not edits:
            continue
        if where is None:  # nothing to edit: the edits are not recorded either
            if on_note is not None:
                on_note(f"{checkpoint.path} has no {file}: the rules' [config] edits are left out "
                        "(give one with --config to edit it)")
            plan = Plan(tuple(g for g in plan.groups if g.config is None or g.config.file != file))
            continue
        resolved, final = resolve_edits(edits, read_config_text(where), where)
        it = iter(resolved)
        plan = Plan(tuple(replace(g, config=next(it)) if g.config is not None and g.config.file == file else g
                          for g in plan.groups))
        if output_kind(out) != "folder":
            if on_note is not None:
                on_note(f"{out} is one file: the edits ({'; '.join(e.describe() for e in resolved)}) "
                        f"are recorded but no {file} is written; write a folder to get it")
            continue
        companions = [c for c in companions if c.relative != file]
        try:
            content = final.encode("utf-8")
        except UnicodeEncodeError:
            raise PlanError(f"{where}: the {file} to write holds a lone surrogate escape; it is not text a "
                            "loader reads. Fix the file (or the provenance that recorded it)") from None
        companions.append(Companion(where, file, content=content))
    return plan, companions


def fuse(ckpt, rules: Sequence[str], out, *, max_shard_size: int | None = None, force: bool = False,
         untie: bool = False, detect_ties: bool = False, write_ties_once: bool = False,
         config: str | None = None, follow_symlinks: bool = False, progress: bool | None = False,
         on_note: Callable[[str], None] | None = None) -> FuseReport:
    """Apply ``rules`` to a checkpoint and write ``out`` (``.safetensors``, ``.npz`` or a folder)
    atomically, with the plan recorded as provenance (appended to the input's own)."""
    planned = plan(ckpt, rules, config=config, untie=untie, detect_ties=detect_ties,
                   write_ties_once=write_ties_once, follow_symlinks=follow_symlinks)
    checkpoint = planned.checkpoint
    history = checkpoint.provenance.plan if checkpoint.provenance else Plan()
    result = run_plan(planned.start, planned.plan, str(checkpoint.path), untie)
    return _write(checkpoint, result, history, planned.plan, out, max_shard_size=max_shard_size,
                  force=force, progress=progress, on_note=on_note, lora_base=planned.lora_base)


def unfuse(ckpt, out, rules: Sequence[str] = (), *, max_shard_size: int | None = None, force: bool = False,
           untie: bool = False, write_ties_once: bool = False, config: str | None = None,
           follow_symlinks: bool = False, progress: bool | None = False,
           on_note: Callable[[str], None] | None = None) -> FuseReport:
    """Undo a fuse: invert the checkpoint's recorded provenance, or ``rules`` in reverse order.

    With ``rules``, only tensors the rules provably made are changed (``fusectl.rules.inverse``):
    those the provenance records the rule making; the others are left alone, and without a
    provenance every binding is a PlanError naming the tensor."""
    checkpoint = _checkpoint(ckpt, config, follow_symlinks)
    if rules:
        loaded = _load_with_origins(checkpoint, rules)
        history = _bound_history(checkpoint)
        rulesets, proof = invert_with_proof([r for r, _ in loaded], [o for _, o in loaded], history,
                                            str(checkpoint.path))
        start = _prepared_table(checkpoint, rulesets, False, write_ties_once)
        planned = _bind(checkpoint, start, rulesets, untie, proof=proof)
        table = run_plan(start, planned.plan, str(checkpoint.path), untie)
        history, new = (checkpoint.provenance.plan if checkpoint.provenance else Plan()), planned.plan
        lora_base = planned.lora_base
        if proof.left_alone and on_note is not None:
            on_note(f"left {len(proof.left_alone)} tensor(s) alone that the provenance says the rules did not "
                    f"make (first: {quote(proof.left_alone[0])})")
    else:
        if checkpoint.provenance is None or not checkpoint.provenance.plan.groups:
            raise PlanError(f"{checkpoint.path}: no fusectl provenance to undo; pass -r RULES to invert rules instead")
        start = checkpoint.table.copy()
        if write_ties_once:
            start.store_once()
        inverse = checkpoint.provenance.plan.inverse()
        table = run_plan(start, inverse, f"{checkpoint.path} (provenance)", untie)
        history, new = Plan(), Plan(tuple(g for g in inverse.groups if g.config is not None))
        lora_base = None
    return _write(checkpoint, table, history, new, out, max_shard_size=max_shard_size, force=force,
                  progress=progress, on_note=on_note, lora_base=lora_base)


def _bound_history(checkpoint: Checkpoint) -> Plan | None:
    """The recorded plan on the names rules bind to: an adapter's base view (its provenance's
    ``lora_base``), else the checkpoint's own; None when nothing is recorded."""
    provenance = checkpoint.provenance
    if provenance is None:
        return None
    if adapter_config(checkpoint) is not None:
        return provenance.lora_base
    return provenance.plan


def convert(ckpt, out, *, max_shard_size: int | None = None, force: bool = False,
            write_ties_once: bool = False, config: str | None = None, follow_symlinks: bool = False,
            progress: bool | None = False, on_note: Callable[[str], None] | None = None) -> FuseReport:
    """Write a checkpoint in another format (``.safetensors``, ``.npz`` or a folder) with no rules:
    the same tensors, ties written once with their aliases recorded, and the input's provenance
    (if any) carried over. To read a training dict, open it with its key first:
    ``convert(open_checkpoint("ckpt.pth", key="model_state_dict"), "model.safetensors")``.

    >>> import os, tempfile
    >>> out = os.path.join(tempfile.mkdtemp(), "model.npz")
    >>> convert("fixtures/tied-embeddings.safetensors", out).ties
    [['embed.weight', 'head.weight']]
    """
    checkpoint = _checkpoint(ckpt, config, follow_symlinks)
    table = checkpoint.table.copy()
    if write_ties_once:
        table.store_once()
    history = checkpoint.provenance.plan if checkpoint.provenance else Plan()
    return _write(checkpoint, table, history, Plan(), out, max_shard_size=max_shard_size, force=force,
                  progress=progress, on_note=on_note)


def map_names(ckpt, graph, *, config: str | None = None, follow_symlinks: bool = False):
    """Pair a checkpoint's structural names with the initializers of ``graph`` (an exporter's
    ``.onnx``) and its Constant nodes, also inside If/Loop/Scan bodies: by name, then by equal
    content, then by equal transposed content; a
    :class:`~fusectl.onnx.namemap.NameMap`.

    >>> pairs = map_names("fixtures/onnx/bert/model.safetensors", "fixtures/onnx/bert/model.onnx")
    >>> len(pairs.pairs) > 0 and not pairs.differing()
    True
    """
    from .onnx.graph import load_model
    from .onnx.namemap import map_graph

    checkpoint = _checkpoint(ckpt, config, follow_symlinks)
    return map_graph(checkpoint.table, load_model(os.fspath(graph)))


def export(ckpt, graph, out, *, force: bool = False, config: str | None = None, follow_symlinks: bool = False,
           on_note: Callable[[str], None] | None = None):
    """Rewrite ``graph`` (exported from the unfused model) to take the checkpoint's parameters;
    an :class:`~fusectl.onnx.export.ExportReport` (``.to_json()`` is ``export --json``: what was
    fused, what was not and why, and the graph's own tensors it kept). OutputError unless
    ``out`` ends in ``.onnx``; ExportError when a weight the graph holds (an initializer or a
    Constant, at any depth) cannot be taken from the checkpoint."""
    from .onnx.export import check_onnx_output, export_model

    check_onnx_output(os.fspath(out))  # before the checkpoint is opened: nothing to read for a bad name
    return export_model(_checkpoint(ckpt, config, follow_symlinks), os.fspath(graph), os.fspath(out),
                        force=force, on_note=on_note)


def verify(reference, candidate, *, rules: Sequence[str] = (), provider: str = "auto",
           rtol: float | None = None, atol: float | None = None,
           shapes: Mapping[str, tuple[int, ...]] | None = None, dims: Mapping[str, int] | None = None,
           inputs: Mapping | None = None, seed: int = 0, config: str | None = None,
           follow_symlinks: bool = False):
    """Prove ``candidate`` computes what ``reference`` computes: two ``.onnx`` models run on
    onnxruntime, or two checkpoints compared through the candidate's provenance (or ``rules``).
    A :class:`~fusectl.verification.report.VerifyReport`; ``.passed`` says whether it did."""
    from .verification.checkpoint_check import lora_base_for, plan_for, verify_checkpoints
    from .verification.model_check import verify_models

    def is_graph(path) -> bool:
        return not isinstance(path, Checkpoint) and os.fspath(path).endswith(".onnx")

    if is_graph(reference) and is_graph(candidate):
        return verify_models(os.fspath(reference), os.fspath(candidate), provider=provider, atol=atol, rtol=rtol,
                             inputs=inputs or {}, shapes=shapes or {}, dims=dims or {}, seed=seed)
    ref = _checkpoint(reference, config, follow_symlinks)
    cand = _checkpoint(candidate, config, follow_symlinks)
    rulesets = load_rulesets(ref, rules)
    return verify_checkpoints(ref, cand, plan_for(cand, rulesets, ref), provider=provider, atol=atol, rtol=rtol,
                              seed=seed, lora_base=lora_base_for(cand, rulesets, ref), recorded=not rulesets)
