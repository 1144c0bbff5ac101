"""Stream a table to disk: each tensor copied as file ranges or computed, written, freed.

The table is what ``executor.run_plan`` made; a format that lists its keys apart from their
bytes (``Output.indexed``: safetensors, folders, PyTorch zips) gets the tensors in the order
their bytes come from the input, so reads are sequential, and lists them in the output's key
order (``fusectl.key_order``); the others are written in the key order. Shards are cut by the
policy below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from .errors import OutputError, option_name
from .executor import Evaluation, source_of
from .io.checkpoint import Companion
from .io.atomic import atomic_output
from .io.registry import output_format
from .io.optimizer_state import RECORD_KEYS
from .io.output import plan_shards
from .io.provenance import METADATA_KEY, Provenance
from .key_order import KeyOrder
from .steps import Plan
from .progress import Progress
from .table import ParamTable
from .tensors import ByteRange, TensorSpec


@dataclass(frozen=True)
class WriteReport:
    path: str
    tensors: int
    unique_bytes: int  # bytes of unique parameters
    copied_bytes: int  # bytes copied as file ranges, never decoded
    written_bytes: int  # bytes of every tensor written (adopted ties stored twice count twice)


def output_metadata(table: ParamTable, plan: Plan, passthrough: Mapping[str, str], lora_base: Plan | None = None,
                    order: Sequence[str] | None = None):
    """Per-file metadata (aliases in the save_model convention) and the provenance entry
    (``order``: the keys' order before the plan, where an unfuse needs it: ``key_order.KeyOrder``)."""
    unique = table.unique_names()
    written = {name for name, _ in table.written()}
    aliases = {alias: unique[alias] for group in table.ties() for alias in group if alias not in written}
    provenance = Provenance(plan, aliases, lora_base, tuple(order) if order is not None else None).dumps()

    def shard_metadata(entries: Sequence[tuple[str, TensorSpec]]) -> dict[str, str]:
        names = {n for n, _ in entries}
        # fusectl's record of an optimizer it wrote describes that optimizer only: never carried over
        meta = {k: v for k, v in passthrough.items() if k not in RECORD_KEYS}
        meta.setdefault("format", "pt")
        meta.update({a: kept for a, kept in aliases.items() if kept in names})
        return meta

    return shard_metadata, {METADATA_KEY: provenance}


def write_table(
    table: ParamTable,
    plan: Plan,
    out: str,
    *,
    inputs: Sequence[str],
    passthrough: Mapping[str, str],
    companions: Sequence[Companion] = (),
    max_shard_size: int | None = None,
    force: bool = False,
    progress: bool | None = None,
    on_note: Callable[[str], None] | None = None,
    stem: str = "model",
    lora_base: Plan | None = None,
    order: KeyOrder | None = None,
) -> WriteReport:
    """Write every unique parameter of ``table`` to ``out`` (atomically), computing lazily;
    tied members the input stored itself are written too (``ParamTable.written``).

    ``order`` is the output's key order and what its provenance records of the input's
    (``key_order.keys_for``; None: the names' order). Where the format lists its keys apart
    from their bytes, tensors are written in the order their bytes come from the input, so
    reads are sequential; else in the key order. A folder output is cut into shards of
    ``max_shard_size``; when that is None, a sharded input's shards are mirrored (each tensor
    goes with the input shard its bytes come from), else one 5 GB cap applies.
    """
    unique = table.written()
    sources = {name: source_of(tensor) for name, tensor in unique}
    output = output_format(out).output
    if order is not None and not output.indexed:
        rank = {n: i for i, n in enumerate(order.names)}
        unique.sort(key=lambda item: rank.get(item[0], len(rank)))
    else:
        unique.sort(key=lambda item: _source_key(sources[item[0]]))
    if max_shard_size is not None and not output.folder:
        raise OutputError(f"{out}: {option_name('max_shard_size')} applies to folder outputs; drop it or write a folder")
    shards = _cut_shards(unique, sources, output.folder, max_shard_size)
    entry_shards = [[(name, tensor.spec) for name, tensor in shard] for shard in shards]
    shard_metadata, index_metadata = output_metadata(table, plan, passthrough, lora_base,
                                                     order.record if order is not None else None)
    evaluation = Evaluation([t for _, t in unique])
    bar = Progress("writing", sum(t.spec.nbytes for _, t in unique), progress)
    copied = 0
    with atomic_output(out, force=force, inputs=inputs, on_note=on_note) as temp:
        writer = output.open(temp, entry_shards, shard_metadata, index_metadata,
                             companions if output.folder else (), stem,
                             order=order.names if order is not None and output.indexed else None)
        try:
            for name, tensor in (item for shard in shards for item in shard):
                ranges = tensor.byte_ranges()
                if ranges is not None:
                    writer.write(name, ranges)
                    copied += tensor.spec.nbytes
                else:
                    writer.write(name, evaluation.array(tensor))
                bar.advance(tensor.spec.nbytes)
            writer.close()
        except BaseException:
            writer.abort()
            raise
        finally:
            bar.finish()
    return WriteReport(out, len(unique), sum(t.spec.nbytes for _, t in table.unique()), copied,
                       sum(t.spec.nbytes for _, t in unique))


DEFAULT_SHARD_SIZE = 5 * 10**9


def _source_key(src: ByteRange | None) -> tuple:
    return (0, src.path, src.offset) if src else (1, "", 0)


def _cut_shards(unique, sources: Mapping[str, ByteRange | None], folder: bool, max_shard_size: int | None):
    if not folder:
        return [unique]
    if max_shard_size is None:
        files = {src.path for src in sources.values() if src is not None}
        if len(files) > 1:  # a sharded input: keep its sharding
            shards: dict[str, list] = {}
            for name, tensor in unique:
                src = sources[name]
                shards.setdefault(src.path if src else "", []).append((name, tensor))
            return list(shards.values())
        max_shard_size = DEFAULT_SHARD_SIZE
    cut = plan_shards([(name, tensor.spec) for name, tensor in unique], max_shard_size)
    by_name = dict(unique)
    return [[(name, by_name[name]) for name, _ in shard] for shard in cut]
