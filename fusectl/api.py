"""What the command line does, as functions: plan, fuse, unfuse, convert, inspect, map, export, verify.

Each takes a path (or an opened :class:`~fusectl.io.checkpoint.Checkpoint`) and rules, raises a
:class:`~fusectl.errors.FusectlError` for bad input, and returns a report that knows its
documented JSON (``.to_json()``) and its text (``.to_text()``); nothing here prints. Errors
name options as keyword arguments (``untie=True``); ``fusectl.cli`` parses flags, calls these
inside :func:`fusectl.errors.cli_vocabulary` (so the same errors name flags) and echoes the
reports.

>>> import os, tempfile, fusectl
>>> out = os.path.join(tempfile.mkdtemp(), "fused")
>>> report = fusectl.fuse("fixtures/tiny-llama-gqa", ["llama-qkv", "llama-gate-up"], out)
>>> report.tensors, report.steps
(15, 4)
>>> fusectl.verify("fixtures/tiny-llama-gqa", out).passed
True
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from .errors import CheckpointError, PlanError, TieError, VerifyError, option, option_name, printable, quote, \
    speaking_cli
from .executor import run_plan
from .config_edit import resolve_edits
from .inspection import InspectReport, inspect_checkpoint
from .io.checkpoint import Checkpoint, Companion, open_checkpoint, read_config_text, takes_key
from .io.registry import output_kind
from .key_order import keys_for
from .steps import Plan, RuleOrigin
from .followers.optimizer import STATE_SEP
from .reports import human, name_map_text, plan_json, plan_text
from .table import ParamTable
from .ties import declare_ties, detect_ties
from .io.formats.trainer_folder import TrainerOptimizer, is_training_state
from .trainer_output import write_trainer_folder
from .training_output import TARGETS, left_out, model_steps, model_ties, moves_state, write_container, \
    write_training, writes_training
from .twins import MovedTwin, move_twins
from .verification.runs import OutputChecks
from .write import DEFAULT_SHARD_SIZE, write_table

if TYPE_CHECKING:  # imported where a rule is loaded or bound: the rule language and its op
    # registry are most of what a command that binds no rule (inspect) would otherwise load
    from .rules.inverse import InverseProof
    from .rules.schema import RuleSet

__all__ = ["FuseReport", "InspectReport", "OutputChecks", "Planned", "check_seed", "check_tolerance", "convert", "export",
           "fuse", "inspect", "map_names", "name_map_text", "open_input", "plan", "preset_text", "presets", "unfuse", "verify"]


@dataclass(frozen=True)
class Planned:
    """A checkpoint with rules bound to it: the table they start from (the checkpoint's, with
    declared ties), the plan, and the table running the plan makes."""

    checkpoint: Checkpoint
    start: ParamTable
    plan: Plan
    table: ParamTable
    lora_base: Plan | None = None  # a LoRA adapter's: the plan on its base view it was lifted from
    # a training checkpoint's plan that moves no parameter: made without its optimizer state,
    # which is kept as read (``training_output.moves_state``)
    state_copied: bool = False

    def to_json(self) -> dict:
        """The documented ``plan --json`` object: ``groups`` (each rule group as the provenance
        records it) and ``result`` (the table the plan makes, as ``inspect --json`` shows one)."""
        return plan_json(self.plan, self.table)

    def to_text(self) -> str:
        """``plan``'s text: each rule group and its steps, then the resulting table."""
        return plan_text(self.plan, self.table)


@dataclass(frozen=True)
class FuseReport:
    """What ``fuse``, ``unfuse`` or ``convert`` wrote."""

    output: str
    tensors: int
    unique_bytes: int
    written_bytes: int
    copied_bytes: int  # copied as file ranges, never decoded
    steps: int  # steps in the recorded plan
    ties: list[list[str]]
    seconds: float = 0.0  # from the call to the output in place, rounded to milliseconds
    # a training checkpoint's optimizer state: what became of it (``_optimizer_fate``); None: none
    optimizer: dict | None = None
    # the copies of the model written beside it, moved with it (``fusectl.twins``): their keys
    twins: tuple[str, ...] = ()

    def to_json(self) -> dict:
        """The documented ``--json`` object of fuse, unfuse and convert (README: "Training
        checkpoints" documents ``optimizer``)."""
        return {
            "output": self.output,
            "tensors": self.tensors,
            "unique_bytes": self.unique_bytes,
            "written_bytes": self.written_bytes,
            "copied_bytes": self.copied_bytes,
            "steps": self.steps,
            "ties": self.ties,
            "seconds": self.seconds,
            "optimizer": self.optimizer,
            "twins": list(self.twins),
        }

    def to_text(self) -> str:
        """The line fuse, unfuse and convert print: what was written, how much, how fast; for a
        training checkpoint, what became of its optimizer state."""
        line = (f"wrote {self.output}: {self.tensors} tensors, {human(self.written_bytes)} "
                f"({human(self.copied_bytes)} copied without decoding) in {self.seconds:.2f}s")
        twins = [f"copy of the model ({printable(w)}): moved with it" for w in self.twins]
        return "\n".join([line, *_optimizer_lines(self.optimizer), *twins])


def _optimizer_lines(fate: dict | None) -> list[str]:
    """What ``fuse``/``unfuse``/``convert`` print about a training checkpoint's optimizer state."""
    if fate is None:
        return []
    said = {"moved": "moved with its parameters",
            "dropped": f"dropped ({option_name('drop_optimizer')}): the output holds the model without it",
            "copied": "copied as it is (no step moves it)",
            "not written": "not written: the output format holds the model only"}
    lines = [f"optimizer state ({printable(fate['where'])}): {said[fate['state']]}"]
    for members in fate["untied"]:
        lines.append(f"untied {', '.join(map(quote, members))}: each has its own copy of the one optimizer state "
                     "and its own gradient (tied, their gradients were summed), so training goes on along "
                     "another trajectory than the tied model's")
    return lines


def _timed(report: FuseReport, started: float) -> FuseReport:
    return replace(report, seconds=round(time.monotonic() - started, 3))


def open_input(path, *, config: str | None = None, follow_symlinks: bool = False,
               key: str | None = None) -> Checkpoint:
    """Open the checkpoint at ``path`` as every function here does (a Checkpoint is returned as
    it is): ``config`` a config.json other than the one beside it, ``follow_symlinks`` to follow
    links out of its folder, ``key`` the state dict inside a PyTorch training dict. Raises
    CheckpointError for a missing, corrupt or unknown file.

    >>> open_input("fixtures/tied-embeddings.safetensors").format
    'safetensors'
    """
    return _checkpoint(path, config, follow_symlinks, key)


def _checkpoint(ckpt, config: str | None, follow_symlinks: bool, key: str | None = None,
                param_order: str | None = None, param_order_from_model: bool = False) -> Checkpoint:
    if isinstance(ckpt, Checkpoint):
        return ckpt
    return open_checkpoint(os.fspath(ckpt), config, allow_outside_links=follow_symlinks, key=key,
                           param_order=os.fspath(param_order) if param_order is not None else None,
                           param_order_from_model=param_order_from_model)


def load_rulesets(checkpoint: Checkpoint, rules: Sequence[str]) -> list[RuleSet]:
    """Each rules file path (or preset name) loaded against the checkpoint's config."""
    return [ruleset for ruleset, _ in _load_with_origins(checkpoint, rules)]


def _load_with_origins(checkpoint: Checkpoint, rules: Sequence[str]) -> list[tuple[RuleSet, RuleOrigin]]:
    """Each rules file loaded, with the text and config values its provenance records; its
    ``bn_fold`` rules given what an MXNet checkpoint's symbol says (``mxnet_facts``)."""
    from .mxnet_facts import with_checkpoint_facts
    from .rules.origin import load_recorded_rules

    loaded = [load_recorded_rules(os.fspath(r), checkpoint.config) for r in rules]
    return [(with_checkpoint_facts(ruleset, checkpoint), origin) for ruleset, origin in loaded]


def _prepared_table(checkpoint: Checkpoint, rulesets: Sequence[RuleSet], detect: bool,
                    write_ties_once: bool, training: bool = False) -> ParamTable:
    # training: with a training dict's optimizer state beside its parameters (a plan shows
    # their steps; an output format that can hold them is the torch writer's)
    table = _training_table(checkpoint) if training else checkpoint.table.copy()
    for ruleset in rulesets:
        declare_ties(table, ruleset.ties, f"{ruleset.source} [ties]")
    if detect:
        declare_ties(table, detect_ties(table).groups, option_name("detect_ties"))
    if write_ties_once:
        table.store_once()
    return table


def _training_table(checkpoint: Checkpoint) -> ParamTable:
    """The checkpoint's table with its optimizer state (``Checkpoint.training_table``); an
    optimizer that cannot be read or mapped is a CheckpointError that also says how to write
    the model without it."""
    _or_drop(lambda: checkpoint.optimizer_mapped)
    return checkpoint.training_table()


def _or_drop(call: Callable[[], object]):
    """``call()``, a CheckpointError from it (an optimizer that cannot be read or mapped) also
    saying how to write the model without the optimizer."""
    try:
        return call()
    except CheckpointError as e:
        raise type(e)(f"{e}; or pass {option('drop_optimizer')} to write the model without its optimizer "
                      "state") from None


def _has_optimizer(checkpoint: Checkpoint) -> bool:
    """Whether the checkpoint is a training dict with an optimizer beside its model (read or not)."""
    return checkpoint.training is not None and checkpoint.training.optimizer_key is not None


def _check_drop(checkpoint: Checkpoint, drop_optimizer: bool) -> None:
    """``drop_optimizer`` applies to a checkpoint with an optimizer (PlanError otherwise)."""
    if drop_optimizer and not _has_optimizer(checkpoint):
        raise PlanError(f"{printable(str(checkpoint.path))} holds no optimizer state, so "
                        f"{option_name('drop_optimizer')} has nothing to drop; leave it out")


CKPT_FORMATS = ("torch", "torch_dist")  # Megatron-LM's --ckpt-format: legacy rank files, dist_checkpointing


def _check_megatron(checkpoint: Checkpoint, out, to: str | None, parallel: tuple[int | None, ...],
                    drop_optimizer: bool, max_shard_size: int | None, ckpt_format: str | None = None) -> None:
    """``tp``/``pp``/``ep`` (``parallel``) and ``ckpt_format`` go with ``to="megatron"`` only, which
    writes a folder: PlanError for a file output, a ``ckpt_format`` Megatron-LM does not have, a
    Hugging Face Trainer folder's optimizer (not megatron-core's param groups) or any optimizer
    with ``ckpt_format="torch_dist"`` (whose sharded optimizer state fusectl does not write) not
    dropped on purpose, a shard size; CheckpointError for an optimizer the reader could not map,
    not dropped on purpose."""
    given = [name for name, value in zip(("tp", "pp", "ep", "ckpt_format"), (*parallel, ckpt_format))
             if value is not None]
    if to != "megatron":
        if given:
            what = "the format" if given[0] == "ckpt_format" else "the parallelism"
            raise PlanError(f"{option_name(given[0])} sets {what} of a Megatron-LM checkpoint written with "
                            f"{option_name('to')} megatron; add that, or leave {option_name(given[0])} out")
        return
    flag = f"{option_name('to')} megatron"
    if ckpt_format not in (None, *CKPT_FORMATS):
        raise PlanError(f"{option_name('ckpt_format')} {quote(str(ckpt_format))}: Megatron-LM saves "
                        f"{' or '.join(CKPT_FORMATS)}")
    if output_kind(os.fspath(out)) != "folder":
        raise PlanError(f"{os.fspath(out)}: {flag} writes a folder; give {option_name('out')} a folder (a path "
                        "without a file suffix)")
    if ckpt_format == "torch_dist" and _has_optimizer(checkpoint) and not drop_optimizer:
        raise PlanError(f"{printable(str(checkpoint.path))} holds optimizer state, which {flag} "
                        f"{option_name('ckpt_format')} torch_dist does not write (megatron-core keeps it as sharded "
                        f"tensors of its own); pass {option('drop_optimizer')} to write the model without it, or "
                        f"leave {option_name('ckpt_format')} out to write Megatron-LM's legacy rank files with each "
                        "rank's Adam state")
    if isinstance(checkpoint.training, TrainerOptimizer) and _has_optimizer(checkpoint) and not drop_optimizer:
        raise PlanError(f"{printable(str(checkpoint.path))} is a Hugging Face Trainer folder, whose optimizer.pt "
                        f"{flag} cannot split over megatron-core's param groups; pass {option('drop_optimizer')} "
                        "to write the model without it")
    if _has_optimizer(checkpoint) and not drop_optimizer:
        _or_drop(checkpoint.training.tree)  # an optimizer the reader could not map: never dropped silently
    if max_shard_size is not None:
        raise PlanError(f"{flag} writes one file per rank; {option_name('max_shard_size')} does not apply, leave it "
                        "out")


_HEAD, _EMBEDDING = "output_layer.weight", "embedding.word_embeddings.weight"


def _megatron_facts(checkpoint: Checkpoint, table: ParamTable) -> tuple[dict | None, int | None, bool]:
    """(the config giving the head counts: the checkpoint's, else a Megatron input's own ``args``;
    the iteration to name the save by, None for a release; whether the head is tied)."""
    config = checkpoint.config
    iteration = None
    if checkpoint.format in ("megatron-legacy", "megatron-torch_dist"):
        if config is None:
            from .io.formats import megatron, megatron_dist
            reader = megatron if checkpoint.format == "megatron-legacy" else megatron_dist
            config = reader.saved_args(str(checkpoint.path))
        iteration = (checkpoint.distributed or {}).get("iteration") or None  # 0: a release, never loaded as 0
    # a tied save at PP > 1 stores the head's copy on the last stage: its args say it is tied
    tied = _HEAD not in table or (_EMBEDDING in table and table[_HEAD] is table[_EMBEDDING]) or \
        (config or {}).get("untie_embeddings_and_output_weights") is False
    return config, iteration, tied


def _config_text(checkpoint: Checkpoint) -> bytes | None:
    """The input's config.json as it is, copied beside a Megatron save (None: it has none)."""
    if checkpoint.config_path is None:
        return None
    with open(checkpoint.config_path, "rb") as f:
        return f.read()


def _write_megatron(checkpoint: Checkpoint, table: ParamTable, out: str, parallel: tuple[int | None, ...],
                    force: bool, on_note: Callable[[str], None] | None, recorded: Plan,
                    ckpt_format: str | None = None) -> FuseReport:
    """Write ``table`` (megatron-core's TP=1 names) alone as a Megatron-LM save folder ``out``
    at ``parallel`` (tp, pp, ep; 1 where not given): legacy rank files (``io.formats.megatron_writer``)
    or, with ``ckpt_format="torch_dist"``, dist_checkpointing's global tensors
    (``io.formats.megatron_dist_writer``); ``recorded`` its provenance, the input's config.json
    beside it. The head counts come from the checkpoint's config, else (a Megatron input) its
    own ``args``. A training checkpoint whose optimizer is kept goes through ``_write`` instead
    (:func:`_megatron_target`)."""
    from .io.atomic import atomic_output
    from .io.formats.megatron_dist_writer import write_megatron_dist
    from .io.formats.megatron_writer import write_megatron
    from .write import output_metadata
    tp, pp, ep = (value if value is not None else 1 for value in parallel)
    config, iteration, tied = _megatron_facts(checkpoint, table)
    tensors = {n: table[n] for n in table.entries if not (tied and n == _HEAD)}
    _, provenance = output_metadata(table, recorded, checkpoint.metadata)
    writer = write_megatron_dist if ckpt_format == "torch_dist" else write_megatron
    with atomic_output(out, force=force, inputs=checkpoint.input_paths(), on_note=on_note) as temp:
        _, written, copied = writer(temp, tensors, tp=tp, pp=pp, ep=ep, config=config, tied=tied,
                                    iteration=iteration, where=printable(str(checkpoint.path)),
                                    metadata=provenance, config_text=_config_text(checkpoint))
    unique = sum(t.spec.nbytes for t in {id(t): t for t in tensors.values()}.values())
    fate = None
    if _has_optimizer(checkpoint):
        fate = {"where": checkpoint.training.optimizer_key, "state": "dropped", "untied": [],
                "trajectory_changes": False}
    return FuseReport(os.fspath(out), len(tensors), unique, written, copied, len(recorded.steps), model_ties(table),
                      optimizer=fate)


def _megatron_target(checkpoint: Checkpoint, table: ParamTable, parallel: tuple[int | None, ...],
                     on_note: Callable[[str], None] | None) -> Callable[..., None]:
    """The writer ``training_output`` calls (as it calls ``TARGETS``' ones) with the whole
    (TP=1) training tree of a checkpoint whose optimizer is kept: its model and optimizer split
    over ``parallel`` (tp, pp, ep) Megatron-LM rank files (``megatron_writer.whole_optimizer``: a
    PlanError for an optimizer it cannot map), the input's ``opt_param_scheduler`` in each (a
    note where it has none), fusectl's record in each rank file, the config.json beside."""
    from .io.formats.megatron_writer import whole_optimizer, write_megatron
    from .io.key_path import node_at
    from .io.optimizer_state import RECORD_KEYS
    from .tensors import LazyTensor
    tp, pp, ep = (value if value is not None else 1 for value in parallel)
    config, iteration, tied = _megatron_facts(checkpoint, table)
    where = printable(str(checkpoint.path))

    def write(folder: str, root, model_path, optimizer_path, metadata: Mapping[str, str], out: str) -> None:
        model = node_at(root, model_path)
        tensors = {n: t for n, t in model.items() if isinstance(t, LazyTensor) and not (tied and n == _HEAD)}
        whole = whole_optimizer(node_at(root, optimizer_path), tensors, metadata, where,
                                copies={_HEAD: _EMBEDDING} if tied else None)
        scheduler = _megatron_scheduler(checkpoint, root)
        found = iteration if iteration is not None else \
            (root.get("iteration") if isinstance(root, dict) and type(root.get("iteration")) is int else None)
        write_megatron(folder, tensors, tp=tp, pp=pp, ep=ep, config=config, tied=tied, iteration=found or None,
                       where=where, optimizer=whole, scheduler=scheduler,
                       metadata={k: v for k, v in metadata.items() if k not in RECORD_KEYS},
                       config_text=_config_text(checkpoint))
        if on_note is None:
            return
        if scheduler is None:
            on_note(f"{where}: holds no opt_param_scheduler, so {printable(out)} has none; Megatron-LM's "
                    "load_checkpoint reads one beside the optimizer and stops without it (add the scheduler's "
                    "state_dict() to each rank file, or resume with `pretrain_gpt.py --no-load-optim`)")
        if not found:
            on_note(f"{where}: its iteration is not known, so {printable(out)} is a release save, whose optimizer "
                    "Megatron-LM does not load (it fine-tunes a release); rename release/ to iter_NNNNNNN/ and "
                    "write NNNNNNN in latest_checkpointed_iteration.txt to resume")
        on_note(f"{printable(out)}: holds no rng_state (the input's ranks' RNG states are of its own "
                "parallelism); resume with `pretrain_gpt.py --no-load-rng`")

    return write


def _megatron_scheduler(checkpoint: Checkpoint, root) -> object:
    """The input's ``opt_param_scheduler`` (the same on every rank): a Megatron save's first rank
    file's, else the training dict's entry; None where it has none."""
    if isinstance(root, dict) and "opt_param_scheduler" in root:
        return root["opt_param_scheduler"]
    if checkpoint.format != "megatron-legacy":
        return None
    from .io.formats.megatron import RANK_FILE, RECORDS
    from .io.formats.torch_file import read_torch_tree
    first = next(f for f in checkpoint.files if os.path.basename(f) == RANK_FILE)
    tree, _ = read_torch_tree(first, records=RECORDS)
    return tree.get("opt_param_scheduler") if isinstance(tree, dict) else None


def _whole(checkpoint: Checkpoint, out, to: str | None, drop_optimizer: bool, max_shard_size: int | None) -> bool:
    """Whether ``out`` is ``checkpoint``'s training state written whole, optimizer included
    (``training_output.writes_training``, or ``to``: a folder of that format). PlanError for a
    ``to`` that cannot be: an unknown format, an output that is not a folder, a checkpoint
    without an optimizer (or a Trainer folder), with ``drop_optimizer`` or ``max_shard_size``."""
    if to == "megatron":  # the optimizer split with the model over the rank files (_check_megatron)
        return _has_optimizer(checkpoint) and not drop_optimizer
    if to is None:
        return writes_training(checkpoint, out) and _has_optimizer(checkpoint) and not drop_optimizer
    flag = f"{option_name('to')} {to}"
    if to not in TARGETS:
        raise PlanError(f"{option_name('to')} {quote(to)}: fusectl writes {' or '.join([*TARGETS, 'megatron'])}")
    if output_kind(os.fspath(out)) != "folder":
        raise PlanError(f"{os.fspath(out)}: {flag} writes a folder; give {option_name('out')} a folder (a path "
                        "without a file suffix)")
    if not _has_optimizer(checkpoint) or isinstance(checkpoint.training, TrainerOptimizer):
        what = "is a Hugging Face Trainer folder" if _has_optimizer(checkpoint) else "holds no optimizer state"
        raise PlanError(f"{printable(str(checkpoint.path))} {what}; {flag} writes a training checkpoint (a model and "
                        "its optimizer, as a DeepSpeed or torch.distributed.checkpoint folder, a training .pt holds "
                        f"them); leave {option_name('to')} out to write the model")
    for name, given in (("drop_optimizer", drop_optimizer), ("max_shard_size", max_shard_size is not None)):
        if given:
            raise PlanError(f"{flag} writes the whole training state, unsharded; {option_name(name)} does not "
                            "apply, leave it out")
    return True


def _untied_training(checkpoint: Checkpoint, plan: Plan, untie_training: bool) -> list[list[str]]:
    """The tie groups of trained parameters ``plan`` breaks, in a plan carrying the optimizer's
    state (the state of a tied parameter is tied alike, ``Checkpoint.training_table``). Without
    ``untie_training`` any is a TieError: the optimizer trains a tied group as one parameter, the
    sum of its members' gradients, and untied each member trains on its own gradient."""
    mapped = checkpoint.optimizer_mapped
    trained = set(mapped[1].names.values()) if mapped is not None else set()
    found = []
    for group in plan.groups:
        for members in group.untied:
            if not any(STATE_SEP in m for m in members) and not any(
                    m in checkpoint.table and checkpoint.table.unique_name(m) in trained for m in members):
                continue
            model = [m for m in members if STATE_SEP not in m]
            if model and model not in found:
                found.append(model)
            if not untie_training:
                raise TieError(
                    f"{group.describe()} breaks the tie of {', '.join(map(quote, model or members))} in a training "
                    "checkpoint: its optimizer trains them as one parameter, on the sum of their gradients; "
                    "untied, each member gets its own gradient and a copy of the one optimizer state, so "
                    f"training goes on along another trajectory. Pass {option('untie_training')} to do it "
                    f"anyway, or {option('drop_optimizer')} to write the model without its optimizer state")
    return found


def plan(ckpt, rules: Sequence[str], *, config: str | None = None, untie: bool = False,
         detect_ties: bool = False, write_ties_once: bool = False, follow_symlinks: bool = False,
         key: str | None = None, param_order: str | None = None, param_order_from_model: bool = False,
         drop_optimizer: bool = False, untie_training: bool = False) -> Planned:
    """Bind ``rules`` to a checkpoint, from headers alone (no tensor data is read).

    :param ckpt: the checkpoint: a path (a file or a folder, any format fusectl reads) or an
        opened :class:`~fusectl.io.checkpoint.Checkpoint` (then ``config``,
        ``follow_symlinks`` and ``key`` are the ones it was opened with).
    :param rules: rules files or preset names, applied in order (at least one).
    :param config: a config.json for the rules' ``config:`` variables (default: the one beside
        the checkpoint).
    :param untie: allow rules that break a tie (the other members become copies).
    :param detect_ties: adopt tensors with equal, non-constant content as ties (reads their data).
    :param write_ties_once: store a tie adopted over two stored tensors once, the others as aliases.
    :param follow_symlinks: follow links in an input folder that lead outside it.
    :param key: the state dict inside a PyTorch training dict (dotted for nesting).
    :param param_order: for a training dict whose optimizer state the shapes do not map to its
        parameters, a JSON file listing them in the order the optimizer was given them
        (``[n for n, _ in model.named_parameters()]``). A training dict's optimizer state is
        planned with its parameters: each state tensor (``<name>::<key>``) takes its
        parameter's steps. A Hugging Face Trainer folder's ``optimizer.pt`` is such a state.
    :param param_order_from_model: take that order from the model's code instead of a file:
        the transformers class ``config.json`` names, built on the meta device (needs torch and
        transformers; never a model's own code).
    :param drop_optimizer: plan a training checkpoint's model without its optimizer state (as
        :func:`fuse` writes it with ``drop_optimizer``): folds and rules its optimizer cannot
        follow are planned.
    :param untie_training: allow rules that break a tie of trained parameters in a training
        checkpoint (implies ``untie``): each member gets a copy of the one optimizer state and
        trains on its own gradient, another trajectory than the tied model's.
    :returns: a :class:`Planned`: the plan and the table it makes (``.to_json()`` is
        ``plan --json``, ``.to_text()`` what ``plan`` prints).
    :raises PlanError: no rules, or rules that do not fit the checkpoint (TieError: a tie
        would break without ``untie``, a tie of trained parameters without ``untie_training``);
        a rule a training checkpoint's optimizer state cannot follow (without
        ``drop_optimizer``); RuleError for a bad rules file or an unknown preset;
        CheckpointError for an unreadable checkpoint.

    >>> planned = plan("fixtures/tiny-llama-gqa", ["llama-qkv"])
    >>> [g.rule for g in planned.plan.groups]
    ['attn-qkv']
    >>> planned.to_json()["result"]["unique_count"]
    17
    """
    checkpoint = _checkpoint(ckpt, config, follow_symlinks, key, param_order, param_order_from_model)
    _check_drop(checkpoint, drop_optimizer)
    return _plan(checkpoint, rules, untie or untie_training, detect_ties, write_ties_once, training=not drop_optimizer,
                 untie_training=untie_training, may_copy=_has_optimizer(checkpoint))


def _plan(checkpoint: Checkpoint, rules: Sequence[str], untie: bool, detect_ties: bool, write_ties_once: bool,
          training: bool, untie_training: bool = False, may_copy: bool = False) -> Planned:
    """``plan`` on an opened checkpoint; ``training``: with a training dict's optimizer state
    (an output that holds the model only leaves it out), whose trained ties break only with
    ``untie_training``. ``may_copy``: a plan that moves no parameter is made without the state
    (``Planned.state_copied``), so its mapping is never needed."""
    if not rules:
        raise PlanError("give at least one rules file or preset name")
    loaded = _load_with_origins(checkpoint, rules)
    rulesets = [ruleset for ruleset, _ in loaded]
    origins = [origin for _, origin in loaded]
    if training and may_copy:
        table = _prepared_table(checkpoint, rulesets, detect_ties, write_ties_once)
        planned = _bind(checkpoint, table, rulesets, untie, origins=origins)
        if not _or_drop(lambda: moves_state(checkpoint, planned.plan)):
            return replace(planned, state_copied=True)
    table = _prepared_table(checkpoint, rulesets, detect_ties, write_ties_once, training=training)
    planned = _bind(checkpoint, table, rulesets, untie, origins=origins)
    if training:
        _untied_training(checkpoint, planned.plan, untie_training)
    return planned


def _bind(checkpoint: Checkpoint, table: ParamTable, rulesets: Sequence[RuleSet], untie: bool, *,
          origins: Sequence[RuleOrigin] | None = None, proof: InverseProof | None = None) -> Planned:
    """Rules bound to a checkpoint's table and lifted to its followers (``planner.bind_and_lift``).
    ``origins`` are recorded on the groups; ``proof`` admits the bindings of inverted rules."""
    from .planner import bind_and_lift

    bound = bind_and_lift(table, checkpoint.followers, rulesets, untie, origins=origins, proof=proof)
    return Planned(checkpoint, table, bound.plan, bound.table, bound.base)


def _write(checkpoint: Checkpoint, table: ParamTable, history: Plan, new: Plan, out, *, max_shard_size, force,
           progress, on_note, lora_base: Plan | None = None, whole_training: bool = False,
           param_order_out: str | None = None, moved: Plan | None = None,
           param_order_from_model: bool = False, dropped: bool = False,
           untied: Sequence[Sequence[str]] = (), twins: Sequence[MovedTwin] = (),
           state_copied: bool = False, to: str | None = None) -> FuseReport:
    """Write ``table``, recording ``history + new`` as its provenance; ``new``'s [config] edits
    change the output's config.json (adapter_config.json). A LoRA adapter is written as
    ``adapter_model.safetensors`` with the base plan its steps were lifted from.
    ``whole_training``: ``table`` holds the optimizer state too, and the whole training dict is
    written (``training_output``; ``param_order_out`` its parameter order; ``moved`` the plan that
    made ``table`` when it is not ``new``, as for an unfuse, which records no steps). A Hugging
    Face Trainer folder written whole is a folder (``trainer_output``): the model, its
    optimizer.pt rewritten, its other files copied. A training dict without an optimizer written
    to a PyTorch file is written whole too (``training_output.write_container``), as is one whose
    optimizer is ``dropped``: left out on purpose (no note; the training dict without it);
    every output's keys are in the input's order (``key_order``). ``untied``: tie groups of trained parameters
    the plan broke (``untie_training``); both go into the report's ``optimizer``. ``twins``: the
    model's copies after the plan (``fusectl.twins``), written at their keys of a training dict.
    ``state_copied``: a training dict written whole whose plan moves no parameter
    (``training_output.moves_state``): ``table`` is the model's, the optimizer is written as read.
    ``to``: the training dict written whole as a folder of that format (``training_output.TARGETS``)."""
    out = os.fspath(out)
    training = checkpoint.training
    trainer = isinstance(training, TrainerOptimizer)
    # no step moves the state: a Trainer folder's optimizer file is copied as it is
    unchanged = trainer and not new.groups and not dropped and output_kind(out) == "folder"
    fate = None
    if _has_optimizer(checkpoint):
        state = "copied" if state_copied or unchanged else "moved" if whole_training else \
            "dropped" if dropped else "not written"
        fate = {"where": training.optimizer_key, "state": state, "untied": [list(g) for g in untied],
                "trajectory_changes": bool(untied)}
    made = new if moved is None else moved
    if whole_training and trainer:
        edited, companions = _edit_config(checkpoint, model_steps(new), out, on_note)
        recorded = history + edited
        report = write_trainer_folder(checkpoint, table, made, recorded, out,
                                      companions=companions, param_order_out=param_order_out,
                                      param_order_from_model=param_order_from_model, restore=moved is not None,
                                      max_shard_size=max_shard_size, force=force, progress=progress,
                                      on_note=on_note, keys=keys_for(checkpoint, table, made, recorded))
        return FuseReport(out, report.tensors, report.unique_bytes, report.written_bytes, report.copied_bytes,
                          len(recorded.steps), model_ties(table), optimizer=fate)
    # a training dict's tree (a Trainer folder without its optimizer is a model folder)
    as_training = whole_training or (not trainer and writes_training(checkpoint, out))
    if as_training and max_shard_size is not None:
        raise PlanError(f"{out}: {option_name('max_shard_size')} applies to folder outputs; drop it or write a folder")
    if as_training:
        edited, _ = _edit_config(checkpoint, model_steps(new), out, on_note)
        recorded = history + edited
        order = keys_for(checkpoint, table, made, recorded)
        if whole_training and not state_copied:
            report = write_training(checkpoint, table, made, out, order=order, param_order_out=param_order_out,
                                    restore=moved is not None, force=force, on_note=on_note, twins=twins, to=to)
        else:  # no optimizer, one no step moves (written as read), or one dropped: the training dict whole
            report = write_container(checkpoint, table, made, out, order=order, drop_optimizer=dropped, force=force,
                                     on_note=on_note, twins=twins, to=to)
        return FuseReport(out, report.tensors, report.unique_bytes, report.written_bytes, report.copied_bytes,
                          len(recorded.steps), model_ties(table), optimizer=fate,
                          twins=tuple(t.twin.where for t in twins))
    if fate is not None and not dropped and not unchanged and on_note is not None:
        on_note(f"{checkpoint.path}: its optimizer state ({training.optimizer_key}) is not written: {out} holds "
                "the model's tensors only (a PyTorch file, .pt, holds the whole training dict; "
                f"{option('drop_optimizer')} leaves the state out on purpose)")
    elif training is not None and not trainer and on_note is not None:
        names = left_out(checkpoint)
        listed = f" ({', '.join(names)})" if names else ""
        on_note(f"{checkpoint.path}: its entries beside the model's tensors{listed} are not written: {out} holds "
                "the model's tensors only (a PyTorch file, .pt, holds the whole training dict)")
    new, companions = _edit_config(checkpoint, new, out, on_note)
    if trainer and dropped:  # the model folder: without optimizer.pt, a Trainer resuming from the
        # scheduler and trainer state it left would go on with a fresh optimizer, silently
        companions = [c for c in companions if not is_training_state(c.relative)]
    if unchanged:  # no step moves the state: a Trainer folder's optimizer file is copied as it is
        companions.append(Companion(training.file, training.optimizer_key))
    recorded = history + new
    view = checkpoint.followers.view
    if view is not None and lora_base is not None and checkpoint.provenance and checkpoint.provenance.lora_base:
        lora_base = checkpoint.provenance.lora_base + lora_base
    if max_shard_size is None and checkpoint.distributed is not None and output_kind(out) == "folder":
        # rank files are no shards to mirror
        max_shard_size = DEFAULT_SHARD_SIZE
    report = write_table(table, recorded, out, inputs=checkpoint.input_paths(), passthrough=checkpoint.metadata,
                         companions=companions, max_shard_size=max_shard_size, force=force,
                         progress=progress, on_note=on_note, stem=view.stem if view is not None else "model",
                         lora_base=lora_base, order=keys_for(checkpoint, table, made, recorded))
    return FuseReport(out, report.tensors, report.unique_bytes, report.written_bytes, report.copied_bytes,
                      len(recorded.steps), table.ties(), optimizer=fate)


def _edit_config(checkpoint: Checkpoint, plan: Plan, out: str, on_note) -> tuple[Plan, list[Companion]]:
    """The plan with each [config] edit's replaced text recorded, and the companions to write
    (the edited config.json in place of the input's)."""
    companions = list(checkpoint.companions)
    view = checkpoint.followers.view
    # the view's config files (adapter_config.json), as read when the checkpoint was opened
    texts = dict(view.config_files()) if view is not None else {}
    sources = {"config.json": checkpoint.config_path, **{file: where for file, (where, _) in texts.items()}}
    for group in plan.groups:  # an edit of a file the checkpoint does not have (a provenance's)
        if group.config is not None:
            sources.setdefault(group.config.file, None)
    for file, where in sources.items():
        edits = [g.config for g in plan.groups if g.config is not None and g.config.file == file]
        if not edits:
            continue
        if where is None:  # nothing to edit: the edits are not recorded either
            if on_note is not None:
                on_note(f"{checkpoint.path} has no {file}: the rules' [config] edits are left out "
                        f"(give one with {option('config')} to edit it)")
            plan = Plan(tuple(g for g in plan.groups if g.config is None or g.config.file != file))
            continue
        text = texts[file][1] if file in texts else read_config_text(where)
        resolved, final = resolve_edits(edits, text, where)
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
         config: str | None = None, follow_symlinks: bool = False, key: str | None = None,
         progress: bool | None = False, on_note: Callable[[str], None] | None = None,
         param_order: str | None = None, param_order_out: str | None = None,
         param_order_from_model: bool = False, drop_optimizer: bool = False,
         untie_training: bool = False, to: str | None = None, tp: int | None = None,
         pp: int | None = None, ep: int | None = None, ckpt_format: str | None = None) -> FuseReport:
    """Apply ``rules`` to a checkpoint and write ``out`` atomically, with the plan recorded as
    provenance (appended to the input's own).

    A training dict with an optimizer written to a PyTorch file (``.pt``, ``.pth``, ``.bin``,
    ``.ckpt``) is written whole: the fused model, the optimizer with its state moved (each
    state tensor takes its parameter's steps) and its ids renumbered in the output parameter
    order, every other entry kept (``fusectl.training_output``); one without an optimizer is
    written whole too, only its model's tensors changed. Other outputs hold the model only, in
    the input's key order (``fusectl.key_order``). A Hugging Face Trainer folder
    (``checkpoint-N/``) written to a folder is written whole the same way: the fused model,
    ``optimizer.pt`` with its state moved, every other file copied byte for byte
    (``fusectl.trainer_output``). With ``drop_optimizer`` no output holds the optimizer state — a PyTorch file is the
    training dict without it (Lightning's: without ``optimizer_states`` and ``lr_schedulers``,
    as ``save_weights_only`` writes), every other entry kept — and the rules the optimizer
    cannot follow (numeric folds, a non-elementwise optimizer) apply.

    :param ckpt: the checkpoint: a path or an opened :class:`~fusectl.io.checkpoint.Checkpoint`.
    :param rules: rules files or preset names, applied in order (at least one).
    :param out: the output: ``FILE.safetensors``, ``FILE.npz`` or a folder (Hugging Face layout).
    :param untie: allow rules that break a tie (the other members become copies).
    :param detect_ties: adopt tensors with equal, non-constant content as ties.
    :param max_shard_size: cut a folder output into shards of at most this many bytes
        (default: keep a sharded input's shards, else 5 GB); only for folder outputs.
    :param force: replace an existing output.
    :param write_ties_once: store a tie adopted over two stored tensors once, the others as aliases.
    :param config: a config.json other than the one beside the checkpoint.
    :param follow_symlinks: follow links in an input folder that lead outside it.
    :param key: the state dict inside a PyTorch training dict (dotted for nesting).
    :param progress: progress on stderr: None when stderr is a terminal, True always, False never.
    :param on_note: called with each note that is not an error (edits left out, leftovers cleaned).
    :param param_order: as :func:`plan`'s: the input optimizer's parameter order, where shapes
        do not prove it.
    :param param_order_out: for a training dict written whole, a JSON list of the fused model's
        parameters in its order (``[n for n, _ in new_model.named_parameters()]``): each param
        group's parameters are numbered in it (default: the state dict's order, a fused
        parameter where its first part was; for a Trainer folder, the input optimizer's order).
    :param param_order_from_model: take the input optimizer's order from the model's code
        (as :func:`plan`'s), and a Trainer folder's output order from the output
        ``config.json``'s model class (both need torch and transformers).
    :param drop_optimizer: write a training checkpoint's model without its optimizer state, on
        purpose (the report's ``optimizer.state`` says ``"dropped"``).
    :param untie_training: as :func:`plan`'s: break ties of trained parameters, each member
        getting its own copy of the one state (the report's ``optimizer.untied`` lists them).
    :param to: ``"dcp"`` or ``"ds-universal"``: write the training checkpoint whole (as a
        ``.pt`` output is written) as a folder ``out`` of that format: a torch.distributed.checkpoint
        folder that ``dcp.load`` reads on any number of ranks, or a DeepSpeed universal
        checkpoint (PlanError for an input without an optimizer, or an output that is not a folder);
        or ``"megatron"``: the model (megatron-core's TP=1 names, as ``llama-to-megatron-gpt``
        makes them) as a Megatron-LM legacy save folder at ``tp`` × ``pp`` × ``ep``
        (``io.formats.megatron_writer``), with a training input's optimizer split over the
        ranks like its parameters (PlanError for one it cannot map, unless ``drop_optimizer``),
        the input's scheduler, fusectl's provenance in the rank files, its config.json beside.
    :param tp: with ``to="megatron"``: the tensor-parallel size (default 1).
    :param pp: with ``to="megatron"``: the pipeline-parallel size (default 1).
    :param ep: with ``to="megatron"``: the expert-parallel size of an MoE model (default 1); its
        experts must divide over it.
    :param ckpt_format: with ``to="megatron"``: Megatron-LM's ``--ckpt-format``: ``"torch"``
        (default: legacy rank files) or ``"torch_dist"``: dist_checkpointing's global tensors
        (``io.formats.megatron_dist_writer``), which megatron-core loads at any TP and PP; the
        model only (PlanError for a training input whose optimizer is not dropped).
    :returns: a :class:`FuseReport` (``.to_json()`` is ``fuse --json``).
    :raises PlanError: as :func:`plan` does (a fold of a training dict written whole: its
        optimizer state cannot follow, without ``drop_optimizer``); a parameter ``param_order_out``
        does not list; ComputeError when a step's data is invalid for its
        op; OutputError when ``out`` exists (without ``force``) or would overwrite an input.

    >>> import os, tempfile
    >>> out = os.path.join(tempfile.mkdtemp(), "fused.safetensors")
    >>> report = fuse("fixtures/tiny-llama-gqa", ["llama-qkv"], out)
    >>> report.steps, report.output == out
    (2, True)
    """
    started = time.monotonic()
    checkpoint = _checkpoint(ckpt, config, follow_symlinks, key, param_order, param_order_from_model)
    _check_drop(checkpoint, drop_optimizer)
    _check_megatron(checkpoint, out, to, (tp, pp, ep), drop_optimizer, max_shard_size, ckpt_format)
    whole = _whole(checkpoint, out, to, drop_optimizer, max_shard_size)
    if param_order_out is not None and not whole:
        raise PlanError(f"{option_name('param_order_out')} orders the optimizer of a training checkpoint written "
                        "whole (a PyTorch output of a training dict with an optimizer, a folder output of a Trainer "
                        f"folder); {os.fspath(out)} is not one, so leave it out")
    untie = untie or untie_training
    planned = _plan(checkpoint, rules, untie, detect_ties, write_ties_once, training=whole,
                    untie_training=untie_training, may_copy=_may_copy_state(checkpoint, param_order_out))
    copied = planned.state_copied
    untied = _untied_training(checkpoint, planned.plan, untie_training) if whole and not copied else []
    history = checkpoint.provenance.plan if checkpoint.provenance else Plan()
    result = run_plan(planned.start, planned.plan, str(checkpoint.path), untie)
    if to == "megatron" and not whole:
        return _timed(_write_megatron(checkpoint, result, out, (tp, pp, ep), force, on_note, history + planned.plan,
                                      ckpt_format), started)
    twins = _moved_twins(checkpoint, planned.start, planned.plan, out, to)
    return _timed(_write(checkpoint, result, history, planned.plan, out, max_shard_size=max_shard_size,
                         force=force, progress=progress, on_note=on_note, lora_base=planned.lora_base,
                         whole_training=whole, param_order_out=param_order_out,
                         param_order_from_model=param_order_from_model, dropped=drop_optimizer,
                         untied=untied, twins=twins, state_copied=copied,
                         to=_megatron_target(checkpoint, result, (tp, pp, ep), on_note) if to == "megatron" else to),
                  started)


def _may_copy_state(checkpoint: Checkpoint, param_order_out) -> bool:
    """Whether a training dict written whole may keep its optimizer as read when no step moves a
    parameter: not when ``param_order_out`` renumbers it, nor for a Trainer folder (whose
    ``optimizer.pt`` fusectl rewrites with its record)."""
    return param_order_out is None and not isinstance(checkpoint.training, TrainerOptimizer)


def _moved_twins(checkpoint: Checkpoint, start: ParamTable, plan: Plan, out, to: str | None = None) -> list[MovedTwin]:
    """The model's copies in a training dict (an EMA) after the model's steps of ``plan``, which
    started from ``start``, when ``out`` is the training dict written whole (with or without
    its optimizer state; ``to``: as a folder of that format); none otherwise (an output of the
    model alone)."""
    if isinstance(checkpoint.training, TrainerOptimizer) or not (to or writes_training(checkpoint, out)):
        return []
    return move_twins(checkpoint, start, model_steps(plan))


def unfuse(ckpt, out, rules: Sequence[str] = (), *, max_shard_size: int | None = None, force: bool = False,
           untie: bool = False, write_ties_once: bool = False, config: str | None = None,
           follow_symlinks: bool = False, key: str | None = None, progress: bool | None = False,
           on_note: Callable[[str], None] | None = None, drop_optimizer: bool = False,
           untie_training: bool = False, param_order: str | None = None, to: str | None = None,
           tp: int | None = None, pp: int | None = None, ep: int | None = None,
           ckpt_format: str | None = None) -> FuseReport:
    """Undo a fuse: invert the checkpoint's recorded provenance, or ``rules`` in reverse order.

    With ``rules``, only tensors the rules provably made are changed (``fusectl.rules.inverse``):
    those the provenance records the rule making; the others are left alone (``on_note`` hears
    how many), and without a provenance every binding is a PlanError naming the tensor.

    A fused training dict (one with an optimizer) unfused to a PyTorch file, from its provenance
    or with ``rules``, is written whole, as :func:`fuse` writes it: each inverse step lifted to
    the optimizer's state, the parameters in the unfused table's order (a fused parameter's parts
    where it was: the original order after a fuse in the default order), every other entry kept. A fused
    Hugging Face Trainer folder unfused to a folder is written whole as well, its optimizer's
    parameters in the original order fusectl recorded in its ``optimizer.pt``. A fused training
    dict fusectl wrote records the parameter of each optimizer id, so it is mapped without being
    told the order; ``param_order`` gives the order where that record was lost.

    :param ckpt: the fused checkpoint: a path or an opened :class:`~fusectl.io.checkpoint.Checkpoint`.
    :param out: the output: ``FILE.safetensors``, ``FILE.npz`` or a folder.
    :param rules: rules files or preset names to invert (default: the recorded provenance).
    :param untie: allow inverted rules that break a tie.
    :param max_shard_size: cut a folder output into shards of at most this many bytes
        (default: keep a sharded input's shards, else 5 GB); only for folder outputs.
    :param force: replace an existing output.
    :param write_ties_once: store a tie adopted over two stored tensors once, the others as aliases.
    :param config: a config.json other than the one beside the checkpoint.
    :param follow_symlinks: follow links in an input folder that lead outside it.
    :param key: the state dict inside a PyTorch training dict (dotted for nesting).
    :param progress: progress on stderr: None when stderr is a terminal, True always, False never.
    :param on_note: called with each note that is not an error (edits left out, leftovers cleaned).
    :param drop_optimizer: as :func:`fuse`'s: write the model without its optimizer state.
    :param untie_training: as :func:`plan`'s: inverted rules may break ties of trained parameters.
    :param param_order: as :func:`plan`'s: the fused optimizer's parameter order (the fused
        model's ``named_parameters()``), for a file without fusectl's record whose shapes do not
        prove it.
    :param to: as :func:`fuse`'s: the training checkpoint written whole as a DCP folder
        (``"dcp"``) or a DeepSpeed universal checkpoint (``"ds-universal"``); ``"megatron"``: the
        model (its optimizer split with it, as :func:`fuse`'s) as a Megatron-LM legacy save.
    :param tp: as :func:`fuse`'s.
    :param pp: as :func:`fuse`'s.
    :param ep: as :func:`fuse`'s.
    :param ckpt_format: as :func:`fuse`'s.
    :returns: a :class:`FuseReport` (``.to_json()`` is ``unfuse --json``).
    :raises PlanError: no provenance to undo and no ``rules``, or rules that did not make the
        tensors; OutputError as :func:`fuse`.

    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> _ = fuse("fixtures/tiny-llama-gqa", ["llama-qkv"], os.path.join(folder, "fused"))
    >>> unfuse(os.path.join(folder, "fused"), os.path.join(folder, "restored")).tensors
    21
    """
    from .planner import lift_recorded
    from .rules.inverse import invert_with_proof

    started = time.monotonic()
    checkpoint = _checkpoint(ckpt, config, follow_symlinks, key, param_order)
    _check_drop(checkpoint, drop_optimizer)
    _check_megatron(checkpoint, out, to, (tp, pp, ep), drop_optimizer, max_shard_size, ckpt_format)
    whole = _whole(checkpoint, out, to, drop_optimizer, max_shard_size)
    untie = untie or untie_training
    copied = False
    if rules:
        loaded = _load_with_origins(checkpoint, rules)
        history = _bound_history(checkpoint)

        def bound(training: bool):  # a proof admits each binding once: a new one per binding
            rulesets, proof = invert_with_proof([r for r, _ in loaded], [o for _, o in loaded], history,
                                                str(checkpoint.path))
            start = _prepared_table(checkpoint, rulesets, False, write_ties_once, training=training)
            return start, _bind(checkpoint, start, rulesets, untie, proof=proof), proof

        if whole and _may_copy_state(checkpoint, None):
            start, planned, proof = bound(False)
            copied = not _or_drop(lambda: moves_state(checkpoint, planned.plan))
        if not copied:
            start, planned, proof = bound(whole)
        untied = _untied_training(checkpoint, planned.plan, untie_training) if whole and not copied else []
        table = run_plan(start, planned.plan, str(checkpoint.path), untie)
        twins = _moved_twins(checkpoint, start, planned.plan, out, to)
        history, new = (checkpoint.provenance.plan if checkpoint.provenance else Plan()), planned.plan
        lora_base = planned.lora_base
        if proof.left_alone and on_note is not None:
            on_note(f"left {len(proof.left_alone)} tensor(s) alone that the provenance says the rules did not "
                    f"make (first: {quote(proof.left_alone[0])})")
        moved = None
    else:
        if checkpoint.provenance is None or not checkpoint.provenance.plan.groups:
            raise PlanError(f"{checkpoint.path}: no fusectl provenance to undo; pass {option('rules')} to invert "
                            "rules instead")
        inverse = checkpoint.provenance.plan.inverse()
        copied = whole and _may_copy_state(checkpoint, None) and \
            not _or_drop(lambda: moves_state(checkpoint, inverse))
        start = _training_table(checkpoint) if whole and not copied else checkpoint.table.copy()
        if write_ties_once:
            start.store_once()
        if whole and not copied:  # the optimizer state takes each inverse step with its parameter
            inverse = lift_recorded(start, inverse, checkpoint.followers.riders(), untie)
        untied = _untied_training(checkpoint, inverse, untie_training) if whole and not copied else []
        table = run_plan(start, inverse, f"{checkpoint.path} (provenance)", untie)
        twins = _moved_twins(checkpoint, start, inverse, out, to)
        history, new = Plan(), Plan(tuple(g for g in inverse.groups if g.config is not None))
        lora_base, moved = None, inverse
    if to == "megatron" and not whole:
        return _timed(_write_megatron(checkpoint, table, out, (tp, pp, ep), force, on_note, history + new, ckpt_format),
                      started)
    return _timed(_write(checkpoint, table, history, new, out, max_shard_size=max_shard_size, force=force,
                         progress=progress, on_note=on_note, lora_base=lora_base, whole_training=whole,
                         moved=moved, dropped=drop_optimizer, untied=untied, twins=twins, state_copied=copied,
                         to=_megatron_target(checkpoint, table, (tp, pp, ep), on_note) if to == "megatron" else to),
                  started)


def _bound_history(checkpoint: Checkpoint) -> Plan | None:
    """The recorded plan on the names rules bind to: an adapter's base view (its provenance's
    ``lora_base``), else the checkpoint's own; None when nothing is recorded."""
    provenance = checkpoint.provenance
    if provenance is None:
        return None
    if checkpoint.followers.view is not None:
        return provenance.lora_base
    return provenance.plan


def convert(ckpt, out, *, max_shard_size: int | None = None, force: bool = False,
            write_ties_once: bool = False, config: str | None = None, follow_symlinks: bool = False,
            key: str | None = None, progress: bool | None = False,
            on_note: Callable[[str], None] | None = None, param_order: str | None = None,
            drop_optimizer: bool = False, to: str | None = None, tp: int | None = None,
            pp: int | None = None, ep: int | None = None, ckpt_format: str | None = None) -> FuseReport:
    """Write a checkpoint in another format with no rules: the same tensors, ties written once
    with their aliases recorded, and the input's provenance (if any) carried over.

    A training dict written to a PyTorch file is written whole, as :func:`fuse` writes it: its
    optimizer as it was read (no step moves a parameter, so its ids need not be mapped to them);
    with ``drop_optimizer``, the dict without its optimizer. Other outputs hold the model only.
    Keys keep the input's order.

    :param ckpt: the checkpoint: a path (any format fusectl reads: PyTorch files and
        ``pytorch_model*.bin`` folders, read without torch; an ONNX model's initializers;
        safetensors; npz) or an opened :class:`~fusectl.io.checkpoint.Checkpoint`.
    :param out: the output: ``FILE.safetensors``, ``FILE.npz`` or a folder.
    :param max_shard_size: cut a folder output into shards of at most this many bytes
        (default: keep a sharded input's shards, else 5 GB); only for folder outputs.
    :param force: replace an existing output.
    :param write_ties_once: store a tie adopted over two stored tensors once, the others as aliases.
    :param config: a config.json other than the one beside the checkpoint.
    :param follow_symlinks: follow links in an input folder that lead outside it.
    :param key: the state dict inside a PyTorch training dict (dotted for nesting).
    :param progress: progress on stderr: None when stderr is a terminal, True always, False never.
    :param on_note: called with each note that is not an error (edits left out, leftovers cleaned).
    :param param_order: as :func:`plan`'s: the optimizer's parameter order, where shapes do not
        prove it (only read where the mapping is needed: never for the state written as read).
    :param drop_optimizer: as :func:`fuse`'s: write the model without its optimizer state.
    :param to: as :func:`fuse`'s: the training checkpoint written whole as a DCP folder
        (``"dcp"``) or a DeepSpeed universal checkpoint (``"ds-universal"``), its optimizer as read;
        or ``"megatron"``: the model (its optimizer split with it, as :func:`fuse`'s) as a
        Megatron-LM legacy save at ``tp`` × ``pp``.
    :param tp: with ``to="megatron"``: the tensor-parallel size (default 1).
    :param pp: with ``to="megatron"``: the pipeline-parallel size (default 1).
    :param ep: with ``to="megatron"``: the expert-parallel size of an MoE model (default 1); its
        experts must divide over it.
    :param ckpt_format: with ``to="megatron"``: Megatron-LM's ``--ckpt-format``: ``"torch"``
        (default: legacy rank files) or ``"torch_dist"``: dist_checkpointing's global tensors
        (``io.formats.megatron_dist_writer``), which megatron-core loads at any TP and PP; the
        model only (PlanError for a training input whose optimizer is not dropped).
    :returns: a :class:`FuseReport` (``.to_json()`` is ``convert --json``).
    :raises CheckpointError: an unreadable input (a PyTorch file with several state dicts and
        no ``key``); OutputError as :func:`fuse`.

    >>> import os, tempfile
    >>> out = os.path.join(tempfile.mkdtemp(), "model.npz")
    >>> convert("fixtures/tied-embeddings.safetensors", out).ties
    [['embed.weight', 'head.weight']]
    >>> out = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> convert("fixtures/torch/training.pt", out, key="model_state_dict").tensors > 0
    True
    """
    started = time.monotonic()
    checkpoint = _checkpoint(ckpt, config, follow_symlinks, key, param_order)
    _check_drop(checkpoint, drop_optimizer)
    _check_megatron(checkpoint, out, to, (tp, pp, ep), drop_optimizer, max_shard_size, ckpt_format)
    # a Trainer folder's optimizer.pt: no step moves it, so a folder output copies it as it is
    whole = _whole(checkpoint, out, to, drop_optimizer, max_shard_size) and \
        not isinstance(checkpoint.training, TrainerOptimizer)
    history = checkpoint.provenance.plan if checkpoint.provenance else Plan()
    if to == "megatron" and not whole:
        return _timed(_write_megatron(checkpoint, checkpoint.table.copy(), out, (tp, pp, ep), force, on_note, history,
                                      ckpt_format), started)
    table = checkpoint.table.copy()  # no step: the optimizer is written as read
    if write_ties_once:
        table.store_once()
    return _timed(_write(checkpoint, table, history, Plan(), out, max_shard_size=max_shard_size, force=force,
                         progress=progress, on_note=on_note, whole_training=whole, dropped=drop_optimizer,
                         state_copied=whole,
                         to=_megatron_target(checkpoint, table, (tp, pp, ep), on_note) if to == "megatron" else to),
                  started)


def inspect(ckpt, *, config: str | None = None, detect_ties: bool = False, follow_symlinks: bool = False,
            key: str | None = None, param_order: str | None = None,
            param_order_from_model: bool = False) -> InspectReport:
    """What a checkpoint holds: its parameters, ties, provenance, scales and adapter, from its
    headers.

    :param ckpt: the checkpoint: a path or an opened :class:`~fusectl.io.checkpoint.Checkpoint`.
    :param config: a config.json other than the one beside the checkpoint (it decides, for
        example, a quantized checkpoint's block size).
    :param detect_ties: hash every tensor and report equal ones as suspected ties (reads all data).
    :param follow_symlinks: follow links in an input folder that lead outside it.
    :param key: the state dict inside a PyTorch training dict (dotted for nesting).
    :param param_order: a JSON file listing the parameters in the order a training dict's
        optimizer was given them, where the shapes do not prove it.
    :param param_order_from_model: take that order from the model's code (as :func:`plan`'s).
    :returns: an :class:`~fusectl.inspection.InspectReport`: ``.to_json()`` is the object
        ``inspect --json`` prints, ``.to_text()`` what ``inspect`` prints (its hints, such as
        how to choose another state dict, in the words of the caller rendering it: ``key`` here,
        ``--key`` from the command line).
    :raises CheckpointError: a missing, corrupt or unknown file, or a ``key`` that names no
        state dict (or given for a file that is not PyTorch's).

    >>> report = inspect("fixtures/tied-embeddings.safetensors")
    >>> report.to_json()["ties"]
    [['embed.weight', 'head.weight']]
    >>> print(report.to_text().splitlines()[0])
    fixtures/tied-embeddings.safetensors: safetensors, 1 file(s), 3 unique parameters, 5.18 KB
    """
    checkpoint = _checkpoint(ckpt, config, follow_symlinks, key, param_order, param_order_from_model)
    label = str(checkpoint.path) if isinstance(ckpt, Checkpoint) else os.fspath(ckpt)
    return inspect_checkpoint(checkpoint, label, detect_ties=detect_ties)


def map_names(ckpt, other, *, config: str | None = None, follow_symlinks: bool = False, key: str | None = None):
    """Pair a checkpoint's structural names with the initializers of an ONNX graph, or with the
    names of another checkpoint of the same model.

    A graph (``other`` ending in ``.onnx``): its initializers and Constant nodes, also inside
    If/Loop/Scan bodies, by name (allowing one common prefix), then by equal content, then by
    equal transposed content (exporters fold Linear weights into anonymous transposed
    initializers). Another checkpoint (any format fusectl reads: a Gluon ``save_parameters``
    file against its ``export``): by name where the names agree (after MXNet's ``arg:``/``aux:``
    and one common prefix), then by content where it is unique on both sides; tensors of equal
    content that nothing tells apart are reported as ambiguous, never paired
    (:mod:`fusectl.checkpoint_map`).

    :param ckpt: the checkpoint: a path or an opened :class:`~fusectl.io.checkpoint.Checkpoint`.
    :param other: the path of an exporter's ``.onnx``, or of another checkpoint (or an opened one).
    :param config: a config.json other than the one beside the checkpoint.
    :param follow_symlinks: follow links in an input folder that lead outside it (both inputs).
    :param key: the state dict inside a PyTorch training dict (dotted for nesting; ``ckpt`` only).
    :returns: a :class:`~fusectl.onnx.namemap.NameMap` for a graph, a
        :class:`~fusectl.checkpoint_map.CheckpointMap` for a checkpoint (``.to_json()`` is
        ``map --json``).
    :raises CheckpointError: an unreadable checkpoint or graph.

    >>> pairs = map_names("fixtures/onnx/bert/model.safetensors", "fixtures/onnx/bert/model.onnx")
    >>> len(pairs.pairs) > 0 and not pairs.differing()
    True
    >>> gluon = map_names("fixtures/mxnet/prefixed/prefixed.params", "fixtures/mxnet/prefixed/prefixed-0000.params")
    >>> [(p.checkpoint, p.other) for p in gluon.pairs][:2]
    [('0.bias', 'arg:model_fc1_bias'), ('0.weight', 'arg:model_fc1_weight')]
    """
    checkpoint = _checkpoint(ckpt, config, follow_symlinks, key)
    if isinstance(other, Checkpoint) or not os.fspath(other).endswith(".onnx"):
        from .checkpoint_map import map_checkpoints

        return map_checkpoints(checkpoint.table, _checkpoint(other, None, follow_symlinks).table)
    from .onnx.graph import load_model
    from .onnx.namemap import map_graph

    return map_graph(checkpoint.table, load_model(os.fspath(other)))


def export(ckpt, graph, out, *, force: bool = False, config: str | None = None, follow_symlinks: bool = False,
           key: str | None = None, on_note: Callable[[str], None] | None = None):
    """Rewrite ``graph`` (exported from the unfused model) to take the checkpoint's parameters
    as its initializers: fused MatMul/Gemm consumers of a fused weight, folded
    reparametrizations, tied parameters stored once.

    :param ckpt: the (fused) checkpoint: a path or an opened :class:`~fusectl.io.checkpoint.Checkpoint`.
    :param graph: the path of the ONNX graph exported from the model with the unfused layout.
    :param out: the output; must end in ``.onnx``.
    :param force: replace an existing output.
    :param config: a config.json other than the one beside the checkpoint.
    :param follow_symlinks: follow links in an input folder that lead outside it.
    :param key: the state dict inside a PyTorch training dict (dotted for nesting).
    :param on_note: called with each note that is not an error.
    :returns: an :class:`~fusectl.onnx.export.ExportReport` (``.to_json()`` is ``export
        --json``: what was fused, what was not and why, and the graph's own tensors it kept;
        ``.to_text()`` what ``export`` prints).
    :raises OutputError: ``out`` does not end in ``.onnx`` (checked before anything is read),
        exists without ``force``, or would overwrite an input; ExportError when a weight the
        graph holds (an initializer or a Constant, at any depth) cannot be taken from the
        checkpoint, when a float tensor of the checkpoint would not be in the output, or when
        a graph below opset 13 cannot be converted.

    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> _ = fuse("fixtures/onnx/bert", ["bert-qkv"], os.path.join(folder, "fused"))
    >>> report = export(os.path.join(folder, "fused"), "fixtures/onnx/bert/model.onnx",
    ...                 os.path.join(folder, "fused.onnx"))
    >>> report.fused_matmuls > 0
    True
    """
    from .onnx.export import check_onnx_output, export_model

    check_onnx_output(os.fspath(out))  # before the checkpoint is opened: nothing to read for a bad name
    return export_model(_checkpoint(ckpt, config, follow_symlinks, key), os.fspath(graph), os.fspath(out),
                        force=force, on_note=on_note)


def verify(reference, candidate, *, rules: Sequence[str] = (), provider: str = "auto",
           rtol: float | None = None, atol: float | None = None,
           shapes: Mapping[str, tuple[int, ...]] | None = None, dims: Mapping[str, int] | None = None,
           inputs: Mapping | str | os.PathLike | None = None, seed: int = 0, config: str | None = None,
           follow_symlinks: bool = False, key: str | None = None, report: str | None = None,
           junit: str | None = None, on_note: Callable[[str], None] | None = None, param_order: str | None = None,
           param_order_out: str | None = None, output_checks: OutputChecks | None = None,
           html: str | None = None):
    """Prove ``candidate`` computes what ``reference`` computes.

    Two ``.onnx`` models: both run on onnxruntime with the same inputs and every output is
    compared. Two checkpoints: the candidate's provenance (or ``rules``) is replayed on the
    reference and compared tensor by tensor, the inverse is checked, ties are checked, and
    each step kind runs once per shape as a small onnxruntime computation. A training
    checkpoint's optimizer state is replayed too: each state tensor against the plan's steps
    on the reference's, the parameters, param groups and numbers (``.optimizer`` of the
    report; a candidate that dropped it passes with ``"status": "dropped"``). A graph and a
    checkpoint are refused (export the checkpoint to a graph first).

    :param reference: the original: a ``.onnx`` path, a checkpoint path or an opened
        :class:`~fusectl.io.checkpoint.Checkpoint`.
    :param candidate: what should compute the same, of the same kind as ``reference``.
    :param rules: with checkpoints, the rules that made the candidate (default: its provenance).
    :param provider: ``"auto"``, ``"cpu"`` or ``"cuda"`` (which must really run on CUDA).
    :param rtol: relative tolerance, finite and >= 0 (default by dtype: fp32 1e-5, fp16 1e-3, bf16 1e-2).
    :param atol: absolute tolerance, finite and >= 0 (default by dtype).
    :param shapes: models only: whole shapes of model inputs by name (their named dimensions
        apply to the other inputs too).
    :param dims: models only: sizes of named dynamic dimensions (dim_param).
    :param inputs: models only: model inputs, as named arrays or the path of an ``.npz``
        (default: seeded random).
    :param seed: seed of the random inputs (>= 0).
    :param config: checkpoints only: a config.json other than the one beside each checkpoint.
    :param follow_symlinks: follow links in an input folder that lead outside it.
    :param key: checkpoints only: the state dict inside a PyTorch training dict (given to
        whichever of the two is a PyTorch file).
    :param report: write the JSON report here (never over an input).
    :param junit: write JUnit XML here, for CI (never over an input).
    :param html: write the report as one self-contained HTML page here: the checks, failing
        first, their statistics and error histograms (never over an input).
    :param on_note: called with each note that is not an error.
    :param param_order: checkpoints only: the reference's optimizer parameter order, where the
        shapes do not prove it (as :func:`plan`'s).
    :param param_order_out: checkpoints only: the candidate's (the fused model's
        ``named_parameters()`` order, as :func:`fuse` takes it).
    :param output_checks: models only: an :class:`~fusectl.verification.runs.OutputChecks` of
        per-output tolerances, the number of seeded runs (the report's ``runs`` gives the pass
        rate and the worst run) and an ``.npz`` to save the first failing run's inputs to (then
        ``inputs=`` that file reproduces the failure; nothing is written when every run passes),
        and whether to localize the first diverging node (by default when an output fails: the
        report's ``localization``).
    :returns: a :class:`~fusectl.verification.report.VerifyReport`; ``.passed`` says whether
        the candidate computes the same, ``.to_json()`` is the ``--report`` object and
        ``.to_text()`` what ``verify`` prints.
    :raises VerifyError: a graph with a checkpoint, options that do not apply to the inputs
        given, a checkpoint candidate without provenance or ``rules``, an unavailable
        provider, inputs that do not fit the models; OutputError for a report destination
        that is an input, lies inside an input folder, or is given twice.

    >>> verify("fixtures/onnx/bert/model.onnx", "fixtures/onnx/bert/model.onnx", provider="cpu").passed
    True
    >>> verify("fixtures/onnx/bert/model.onnx", "fixtures/onnx/bert/model.safetensors")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    fusectl.errors.VerifyError: fixtures/onnx/bert/model.onnx is an ONNX graph but fixtures/onnx/bert/model.safetensors is a checkpoint; ...
    """
    from .verification.checkpoint_check import lora_base_for, plan_for, verify_checkpoints
    from .verification.inputs_file import load_inputs_file, npz_bytes
    from .verification.report import check_report_destinations
    from .verification.runs import knob

    def is_graph(path) -> bool:
        return not isinstance(path, Checkpoint) and os.fspath(path).endswith(".onnx")

    checks = output_checks or OutputChecks()
    save_option = knob("--save-inputs", "save_inputs")
    destinations = {option_name("report"): report, option_name("junit"): junit, option_name("html"): html,
                    save_option: checks.save_inputs}
    # rules files and the config are inputs too; a preset name is not a path
    named = [p for p in (*map(os.fspath, rules), config) if p and os.path.exists(p)]
    graphs = [is_graph(reference), is_graph(candidate)]
    if any(graphs) and key is not None:
        raise VerifyError(f"{option_name('key')} selects a state dict inside a PyTorch checkpoint; it does not "
                          "apply to .onnx models")
    order = "param_order" if param_order is not None else "param_order_out" if param_order_out is not None else None
    if any(graphs) and order is not None:
        raise VerifyError(f"{option_name(order)} orders a training checkpoint's optimizer; it does not apply to "
                          ".onnx models")
    if all(graphs):
        # imported here: checkpoints never need what graphs do (onnx, onnx-ir, ml_dtypes)
        from .verification.model_check import model_input_paths, verify_models

        reference, candidate = os.fspath(reference), os.fspath(candidate)
        inputs_path = os.fspath(inputs) if isinstance(inputs, (str, os.PathLike)) else None
        sources = [*model_input_paths(reference), *model_input_paths(candidate), *named,
                   *([inputs_path] if inputs_path else [])]
        check_report_destinations(destinations, sources)
        arrays = load_inputs_file(inputs_path) if inputs_path is not None else inputs or {}
        result = verify_models(reference, candidate, provider=provider, atol=atol, rtol=rtol,
                               inputs=arrays, shapes=shapes or {}, dims=dims or {}, seed=seed,
                               output_checks=checks)
    elif any(graphs):
        graph, ckpt = (reference, candidate) if graphs[0] else (candidate, reference)
        raise VerifyError(_graph_with_checkpoint(_label(graph), _label(ckpt)))
    else:
        used = [option_name(name) for name, value in (("shapes", shapes), ("dims", dims), ("inputs", inputs))
                if value]
        used += [knob(flag, name) for flag, name, value in (
            ("--tol", "tolerances", checks.tolerances), ("--runs", "runs", checks.runs != 1),
            ("--save-inputs", "save_inputs", checks.save_inputs),
            ("--localize", "localize", checks.localize is not None)) if value]
        if used:
            raise VerifyError(f"{used[0]} applies to two .onnx models; with checkpoints, verify "
                              "makes its own inputs")
        ref = _checkpoint(reference, config, follow_symlinks, _key_for(reference, key), param_order)
        cand = _checkpoint(candidate, config, follow_symlinks, _key_for(candidate, key), param_order_out)
        if key is not None and not {ref.format, cand.format} & {"pytorch"}:
            raise VerifyError(f"{option_name('key')} selects a state dict inside a PyTorch file; neither "
                              f"{printable(_label(reference))} nor {printable(_label(candidate))} is one, "
                              "so leave it out")
        sources = [*ref.input_paths(), *cand.input_paths(), *named]
        check_report_destinations(destinations, sources)
        rulesets = load_rulesets(ref, rules)
        result = verify_checkpoints(ref, cand, plan_for(cand, rulesets, ref), provider=provider, atol=atol,
                                    rtol=rtol, seed=seed, lora_base=lora_base_for(cand, rulesets, ref),
                                    recorded=not rulesets)
    failing = getattr(result, "failing_inputs", None)
    saved = [(checks.save_inputs, lambda: npz_bytes(failing))] if checks.save_inputs and failing is not None else []
    result.write(json_path=report, junit_path=junit, html_path=html, inputs=sources, on_note=on_note, extra=saved)
    if checks.save_inputs and not saved and on_note is not None:
        on_note(f"every run passed, so {save_option} {checks.save_inputs} was not written")
    return result


def _label(ckpt) -> str:
    """A verify input as messages name it: the path given (an opened checkpoint's own)."""
    return str(ckpt.path) if isinstance(ckpt, Checkpoint) else os.fspath(ckpt)


def _key_for(ckpt, key: str | None) -> str | None:
    """``key`` for a PyTorch file, None for the others (verify reads two inputs, which may differ)."""
    if key is None or isinstance(ckpt, Checkpoint) or not takes_key(os.fspath(ckpt)):
        return None
    return key


def _graph_with_checkpoint(graph: str, ckpt: str) -> str:
    """Why a graph and a checkpoint are not compared, and how to make the graph to compare."""
    if speaking_cli():
        make = f"`fusectl export {printable(ckpt)} --graph {printable(graph)} -o OUT.onnx`"
    else:
        make = (f"fusectl.export({printable(json.dumps(ckpt))}, {printable(json.dumps(graph))}, "
                '"OUT.onnx")')
    return (f"{printable(graph)} is an ONNX graph but {printable(ckpt)} is a checkpoint; verify compares a "
            "graph with a graph (two .onnx files) or a checkpoint with a checkpoint. Make a graph from the "
            f"checkpoint with {make}, then verify the two .onnx files")


def presets() -> dict[str, str]:
    """The presets shipped with fusectl, by name, each with its one-line description.

    :returns: ``{name: description}`` in name order.

    >>> presets()["llama-qkv"].startswith("Llama")
    True
    """
    from .rules.presets import preset_description, preset_names

    return {name: preset_description(name) for name in preset_names()}


def preset_text(name: str) -> str:
    """The rules file (TOML) of the preset ``name``, as shipped.

    :raises RuleError: no preset has that name (the message lists them).

    >>> preset_text("llama-qkv").splitlines()[0]
    'version = 1'
    """
    from .rules import presets

    return presets.preset_text(name)


def check_tolerance(name: str, value) -> float:
    """``value`` as a tolerance named ``name`` in the message: a finite number >= 0, else
    VerifyError (NaN or an infinity would pass anything).

    >>> check_tolerance("atol", "1e-4")
    0.0001
    """
    from .verification.compare import check_tolerance as checked

    return checked(name, value)


def check_seed(seed: int) -> int:
    """``seed`` if it seeds random inputs: a whole number >= 0, else VerifyError.

    >>> check_seed(7)
    7
    """
    from .verification.runner import check_seed as checked

    return checked(seed)
