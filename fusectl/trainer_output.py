"""A fused Hugging Face Trainer folder written whole: the model, optimizer.pt moved, the rest copied.

``fuse`` (and ``unfuse`` from the provenance) of a Trainer ``checkpoint-N/`` folder
(``io.trainer_folder``) to a folder writes what the Trainer resumes from:

- the model as any folder output writes it (``write.write_table``: ``model.safetensors`` or
  its shards, with fusectl's provenance; ``config.json`` as the rules' ``[config]`` edits make
  it), without the optimizer's state tensors;
- ``optimizer.pt`` rewritten by the torch.save writer (``io.torch_writer``): the state moved
  with each parameter and the ids renumbered in the output order (``training_output.
  moved_optimizer``, shared with training dicts), with fusectl's record naming the parameter
  of each id and the order before fusectl's first step (``optimizer_state.order_record``);
- every other file (``scheduler.pt``, ``rng_state*.pth``, ``trainer_state.json``,
  ``training_args.bin``, ``generation_config.json``, tokenizer files, …) copied byte for byte.

All of it is one atomic output: on any error nothing is written.

The output order of the optimizer's parameters (what ``Optimizer.load_state_dict`` pairs by
position with the new model's ``named_parameters()``, in the Trainer's decay / no-decay groups):
``param_order_out``'s list where given; else, with ``param_order_from_model``, the order the
output ``config.json``'s class declares (transformers on the meta device, ``io.model_order``);
for an unfuse, the original order fusectl recorded; else the input's order, each fused parameter
where its first part was (an unfused part where its fused parameter was).
"""

from __future__ import annotations

import json
import os
from typing import Callable, Sequence

from .errors import CheckpointError, PlanError, option, printable
from .io.checkpoint import Checkpoint, Companion, read_config_text
from .io.optimizer_state import order_record, read_order
from .key_order import KeyOrder
from .steps import Plan
from .table import ParamTable
from .training_output import model_only, moved_optimizer, tree_tensors
from .write import WriteReport, write_table


def write_trainer_folder(checkpoint: Checkpoint, table: ParamTable, plan: Plan, recorded: Plan, out: str, *,
                         companions: Sequence[Companion], param_order_out: str | None = None,
                         param_order_from_model: bool = False, restore: bool = False,
                         max_shard_size: int | None = None, force: bool = False, progress: bool | None = None,
                         on_note: Callable[[str], None] | None = None, keys: KeyOrder | None = None) -> WriteReport:
    """Write the Trainer folder ``checkpoint`` to the folder ``out`` with ``table`` (what ``plan``
    made of its training table: model and optimizer state), ``recorded`` as the model's
    provenance, ``companions`` (the folder's other files, an edited config.json among them)
    copied. ``restore``: an unfuse, whose parameters take the recorded original order. ``keys``:
    the model's key order (``key_order.keys_for``).

    :raises PlanError: as :func:`~fusectl.training_output.write_training`; CheckpointError when the
        order from the model's code cannot be had. Nothing is written then.
    """
    training = checkpoint.training
    model_table = model_only(table)
    order, source = _output_order(checkpoint, model_table, companions, param_order_out, param_order_from_model,
                                  restore)
    given, _ = checkpoint.given_order
    state, mapping = checkpoint.optimizer_mapped
    positions = given if given is not None else [mapping.names[p] for p in state.ids() if p in mapping.names]
    if order is None and on_note is not None and _architecture(companions) != (checkpoint.config or {}).get("architectures"):
        on_note(f"{out}: the optimizer's parameters are numbered in {checkpoint.path}'s order (a fused one where "
                "its first part was); if the new model's code declares its parameters in another order (Phi-3 "
                f"declares o_proj before qkv_proj), give {option('param_order_out')} or "
                f"{option('param_order_from_model')}")
    moved = moved_optimizer(checkpoint, table, plan, order=order, order_source=source, positions=positions)
    record = order_record(moved.names, checkpoint.original_order())
    relative = training.optimizer_key

    def write_optimizer(target: str) -> None:
        from .io.formats.torch_writer import write_torch_file  # PyTorch's writer loads its reader: only when needed
        write_torch_file(target, moved.optimizer, metadata=record)

    files = [c for c in companions if c.relative != relative]
    files.append(Companion(training.file, relative, write=write_optimizer))
    report = write_table(model_table, recorded, out, inputs=checkpoint.input_paths(),
                         passthrough=checkpoint.metadata, companions=files, max_shard_size=max_shard_size, force=force, progress=progress,
                         on_note=on_note, order=keys)
    state_bytes = sum(t.spec.nbytes for t in {id(t): t for t in tree_tensors(moved.optimizer)}.values())
    return WriteReport(report.path, report.tensors, report.unique_bytes, report.copied_bytes,
                       report.written_bytes + state_bytes)


def _output_order(checkpoint: Checkpoint, model_table: ParamTable, companions: Sequence[Companion], param_order_out,
                  from_model: bool, restore: bool) -> tuple[list[str] | None, str | None]:
    """(the output parameter order, what names it in messages), or (None, None) for the default;
    ``model_table``: the output's parameters (what the output config's model is built within)."""
    if param_order_out is not None:
        return read_order(os.fspath(param_order_out)), os.fspath(param_order_out)
    original = checkpoint.recorded_original_order() if restore else None
    if original is not None:  # else, the record lost, each part where its fused parameter was
        return original, f"the original order recorded in {checkpoint.training.file}"
    if from_model:
        from .io.model_order import order_from_model
        config = _output_config(companions)
        if config is None:
            raise CheckpointError(f"{printable(checkpoint.path)}: no config.json to build the new model from for "
                                  f"{option('param_order_from_model')}; give {option('param_order_out')}")
        held = [t.spec.shape for t in model_table.entries.values()]
        return order_from_model(config, "the output's config.json", held), "the output config.json's model code"
    return None, None


def _output_config(companions: Sequence[Companion]) -> dict | None:
    """The output's config.json as written (an edited one's new text), parsed; None without one."""
    found = next((c for c in companions if c.relative == "config.json" and not c.is_dir), None)
    if found is None:
        return None
    if found.content is not None:
        text = found.content.decode("utf-8")
    else:
        text = read_config_text(found.source)
    try:
        config = json.loads(text)
    except ValueError as e:
        raise PlanError(f"{printable(found.source)}: the output config.json is not JSON ({e})") from None
    return config if isinstance(config, dict) else None


def _architecture(companions: Sequence[Companion]):
    """The output config.json's ``architectures`` (None when unknown)."""
    try:
        config = _output_config(companions)
    except (PlanError, CheckpointError):
        return None
    return config.get("architectures") if config else None
