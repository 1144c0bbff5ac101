"""Stream a planned table to disk: read, compute, write, free — one step's tensors at a time."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from .errors import ComputeError, OutputError, quote
from .io.checkpoint import Companion
from .io.output import atomic_output, open_writer, output_kind, plan_shards
from .io.provenance import METADATA_KEY, Provenance
from .plan import Computation, ComputedTensor, Plan
from .progress import Progress
from .table import ParamTable
from .tensors import ByteRange, LazyTensor, TensorSpec, read_ranges


class Materializer:
    """Evaluates lazy tensors, keeping each computation's outputs only until their last use.

    A computed tensor that is a plain byte copy of its inputs (a part of a split, a stack, a
    rename) is read from those bytes and never computes its computation: counting it as a use
    of that computation would keep the computation's other outputs cached to the end.
    """

    def __init__(self, roots: Sequence[LazyTensor]):
        self._uses: Counter[int] = Counter()
        self._cache: dict[int, list[np.ndarray]] = {}
        seen: set[int] = set()
        stack: list[Computation] = []

        def use(t: LazyTensor) -> None:
            if isinstance(t, ComputedTensor) and t.byte_ranges() is None:
                self._uses[id(t.computation)] += 1
                stack.append(t.computation)

        for t in roots:
            use(t)
        while stack:
            computation = stack.pop()
            if id(computation) in seen:
                continue
            seen.add(id(computation))
            for t in computation.inputs:
                use(t)

    def array(self, tensor: LazyTensor) -> np.ndarray:
        if not isinstance(tensor, ComputedTensor):
            return tensor.read()
        ranges = tensor.byte_ranges()
        if ranges is not None:
            return read_ranges(ranges, tensor.spec)
        computation = tensor.computation
        key = id(computation)
        if key not in self._cache:
            self._cache[key] = self._compute(computation)
        out = self._cache[key][tensor.index]
        self._uses[key] -= 1
        if self._uses[key] == 0:
            del self._cache[key]
        return out

    def cached(self) -> int:
        """How many computations' outputs are held (0 once every use has been read)."""
        return len(self._cache)

    def _compute(self, computation: Computation) -> list[np.ndarray]:
        arrays = [self.array(t) for t in computation.inputs]
        try:
            with np.errstate(all="ignore"):  # overflow is found below and reported as an error
                outputs = computation.op.apply(arrays)
        except ComputeError as e:
            raise ComputeError(f"{computation.label}: {e}") from None
        for array, spec in zip(outputs, computation.output_specs, strict=True):
            if not isinstance(array, np.ndarray) or array.dtype != spec.dtype.numpy or array.shape != spec.shape:
                raise ComputeError(
                    f"{computation.label}: produced {array.dtype}{list(array.shape)}, planned {spec}"
                )
        if not computation.op.exact:
            _check_finite(computation, arrays, outputs)
        return outputs


def _check_finite(computation: Computation, inputs, outputs) -> None:
    """A numeric step never writes NaN or infinity: from finite inputs that means the result
    overflowed the stored dtype (gamma 3e38 over a zero variance), else the inputs hold them."""
    bad = sum(int(np.count_nonzero(~np.isfinite(a))) for a in outputs if a.dtype.kind in "fcV" and a.size)
    if not bad:
        return
    broken = [f"{quote(name)} ({int(np.count_nonzero(~np.isfinite(a)))} non-finite)"
              for name, a in zip(computation.input_names, inputs)
              if a.dtype.kind in "fcV" and a.size and not np.all(np.isfinite(a))]
    if broken:
        raise ComputeError(f"{computation.label}: the inputs hold NaN or infinity: {', '.join(broken)}; "
                           "the checkpoint is damaged — fix or re-download it")
    raise ComputeError(
        f"{computation.label}: the result has {bad} NaN or infinite value(s) although every input is "
        f"finite: it overflows {computation.output_specs[0].dtype}. The inputs are out of range for this "
        "fold (a huge scale over a near-zero norm or variance); check them"
    )


@dataclass(frozen=True)
class WriteReport:
    path: str
    tensors: int
    unique_bytes: int  # bytes of unique parameters
    copied_bytes: int  # bytes copied as file ranges, never decoded
    written_bytes: int  # bytes of every tensor written (adopted ties stored twice count twice)


def output_metadata(table: ParamTable, plan: Plan, passthrough: Mapping[str, str]):
    """Per-file metadata (aliases in the save_model convention) and the provenance entry."""
    unique = table.unique_names()
    written = {name for name, _ in table.written()}
    aliases = {alias: unique[alias] for group in table.ties() for alias in group if alias not in written}
    provenance = Provenance(plan, aliases).dumps()

    def shard_metadata(entries: Sequence[tuple[str, TensorSpec]]) -> dict[str, str]:
        names = {n for n, _ in entries}
        meta = {k: v for k, v in passthrough.items()}
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
) -> WriteReport:
    """Write every unique parameter of ``table`` to ``out`` (atomically), computing lazily;
    tied members the input stored itself are written too (``ParamTable.written``).

    Tensors are written in the order their bytes come from the input, so reads are sequential.
    A folder output is cut into shards of ``max_shard_size``; when that is None, a sharded
    input's shards are mirrored (each tensor goes with the input shard its bytes come from),
    else one 5 GB cap applies.
    """
    unique = table.written()
    sources = {name: _source(tensor) for name, tensor in unique}
    unique.sort(key=lambda item: _source_key(sources[item[0]]))
    kind = output_kind(out)
    if max_shard_size is not None and kind != "folder":
        raise OutputError(f"{out}: --max-shard-size applies to folder outputs; drop it or write a folder")
    shards = _cut_shards(unique, sources, kind, max_shard_size)
    entry_shards = [[(name, tensor.spec) for name, tensor in shard] for shard in shards]
    shard_metadata, index_metadata = output_metadata(table, plan, passthrough)
    materializer = Materializer([t for _, t in unique])
    bar = Progress("writing", sum(t.spec.nbytes for _, t in unique), progress)
    copied = 0
    with atomic_output(out, force=force, inputs=inputs, on_note=on_note) as temp:
        writer = open_writer(kind, temp, entry_shards, shard_metadata, index_metadata,
                             companions if kind == "folder" else ())
        try:
            for name, tensor in (item for shard in shards for item in shard):
                ranges = tensor.byte_ranges()
                if ranges is not None:
                    writer.write(name, ranges)
                    copied += tensor.spec.nbytes
                else:
                    writer.write(name, materializer.array(tensor))
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


def _source(tensor: LazyTensor) -> ByteRange | None:
    """Where a tensor's first bytes come from: its own file range or its first input's."""
    ranges = tensor.byte_ranges()
    if ranges:
        return ranges[0]
    if isinstance(tensor, ComputedTensor):
        for t in tensor.computation.inputs:
            found = _source(t)
            if found is not None:
                return found
    return None


def _source_key(src: ByteRange | None) -> tuple:
    return (0, src.path, src.offset) if src else (1, "", 0)


def _cut_shards(unique, sources: Mapping[str, ByteRange | None], kind: str, max_shard_size: int | None):
    if kind != "folder":
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



