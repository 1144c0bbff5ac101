"""Stream a planned table to disk: read, compute, write, free — one step's tensors at a time."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from .errors import ComputeError
from .io.output import atomic_output, open_writer, output_kind
from .io.provenance import METADATA_KEY, Provenance
from .plan import Computation, ComputedTensor, Plan
from .progress import Progress
from .table import ParamTable
from .tensors import LazyTensor, TensorSpec


class Materializer:
    """Evaluates lazy tensors, keeping each computation's outputs only until their last use."""

    def __init__(self, roots: Sequence[LazyTensor]):
        self._uses: Counter[int] = Counter()
        self._cache: dict[int, list[np.ndarray]] = {}
        seen: set[int] = set()
        stack = [t.computation for t in roots if isinstance(t, ComputedTensor)]
        for t in roots:
            if isinstance(t, ComputedTensor):
                self._uses[id(t.computation)] += 1
        while stack:
            computation = stack.pop()
            if id(computation) in seen:
                continue
            seen.add(id(computation))
            for t in computation.inputs:
                if isinstance(t, ComputedTensor):
                    self._uses[id(t.computation)] += 1
                    stack.append(t.computation)

    def array(self, tensor: LazyTensor) -> np.ndarray:
        if not isinstance(tensor, ComputedTensor):
            return tensor.read()
        computation = tensor.computation
        key = id(computation)
        if key not in self._cache:
            self._cache[key] = self._compute(computation)
        out = self._cache[key][tensor.index]
        self._uses[key] -= 1
        if self._uses[key] == 0:
            del self._cache[key]
        return out

    def _compute(self, computation: Computation) -> list[np.ndarray]:
        arrays = [self.array(t) for t in computation.inputs]
        try:
            outputs = computation.op.apply(arrays)
        except ComputeError as e:
            raise ComputeError(f"{computation.label}: {e}") from None
        for array, spec in zip(outputs, computation.output_specs, strict=True):
            if array.dtype != spec.dtype.numpy or array.shape != spec.shape:
                raise ComputeError(
                    f"{computation.label}: produced {array.dtype}{list(array.shape)}, planned {spec}"
                )
        return outputs


@dataclass(frozen=True)
class WriteReport:
    path: str
    tensors: int
    unique_bytes: int
    copied_bytes: int  # bytes moved by kernel range copies, never decoded


def output_metadata(table: ParamTable, plan: Plan, passthrough: Mapping[str, str]):
    """Per-file metadata (aliases in the save_model convention) and the provenance entry."""
    aliases = {
        alias: table.unique_name(alias)
        for group in table.ties() for alias in group if alias != table.unique_name(alias)
    }
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
    companions: Sequence[str] = (),
    max_shard_size: int = 5 * 10**9,
    force: bool = False,
    progress: bool | None = None,
) -> WriteReport:
    """Write every unique parameter of ``table`` to ``out`` (atomically), computing lazily."""
    unique = table.unique()
    entries = [(name, tensor.spec) for name, tensor in unique]
    shard_metadata, index_metadata = output_metadata(table, plan, passthrough)
    kind = output_kind(out)
    materializer = Materializer([t for _, t in unique])
    bar = Progress("writing", sum(s.nbytes for _, s in entries), progress)
    copied = 0
    with atomic_output(out, force=force, inputs=inputs) as temp:
        writer = open_writer(kind, temp, entries, shard_metadata, index_metadata,
                             max_shard_size, companions if kind == "folder" else ())
        try:
            for name, tensor in unique:
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
    return WriteReport(out, len(entries), sum(s.nbytes for _, s in entries), copied)


