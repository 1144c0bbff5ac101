"""Pair a checkpoint's structural names with an ONNX graph's initializers.

Exporters rename: a wrapper adds a prefix (``model.``), MXNet's exporter (mx2onnx) drops the
``arg:``/``aux:`` of an export's ``.params`` names, and the TorchScript and dynamo
exporters constant-fold each Linear weight into an anonymous transposed initializer
(``onnx::MatMul_922``, ``val_90``). So pairs are found by name (allowing one common prefix
on either side, and a checkpoint name without its ``arg:``/``aux:``), then by equal content,
then by equal transposed content. Content is
compared by hashing (dtype, shape, bytes) once per tensor, never pair by pair.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from ..checkpoint_map import MXNET_PREFIXES, common_prefix, digest as _digest
from ..table import ParamTable
from ..tensors import LazyTensor


@dataclass(frozen=True)
class Pair:
    """One checkpoint name paired with one graph initializer: ``how`` they were paired and
    whether their ``data`` agree."""

    structural: str
    initializer: str
    how: str  # "name", "content" or "transposed" (the initializer is the tensor transposed)
    # "equal": same dtype, shape and bytes; "close": within the dtype's tolerance (a fold the
    # exporter computed itself, paired by content); "differs": paired by
    # name, other data (an exporter folded something into it); "unknown": the checkpoint has
    # the name but not its data
    data: str = "equal"


@dataclass
class NameMap:
    """What ``map_names`` found: the pairs, the names of either side paired with nothing, and
    the prefixes (an exporter's wrapper prefix) stripped from each side to pair them by name."""

    pairs: list[Pair] = field(default_factory=list)
    unmatched_checkpoint: list[str] = field(default_factory=list)
    unmatched_graph: list[str] = field(default_factory=list)
    graph_prefix: str = ""
    checkpoint_prefix: str = ""

    def differing(self) -> list[Pair]:
        """Pairs by name whose data differ: the graph's initializer stands for something else."""
        return [p for p in self.pairs if p.data == "differs"]

    def to_json(self) -> dict:
        """The mapping as ``fusectl map --json`` prints it."""
        return {
            "pairs": [{"structural": p.structural, "initializer": p.initializer, "how": p.how, "data": p.data}
                      for p in self.pairs],
            "unmatched_checkpoint": self.unmatched_checkpoint,
            "unmatched_graph": self.unmatched_graph,
            "graph_prefix": self.graph_prefix,
            "checkpoint_prefix": self.checkpoint_prefix,
        }


# close pairs are looked for only among this many (initializer, tensor) candidates: they are
# the exporter's own folds, a handful; past that, what is left is refused as stale, never guessed
MAX_CLOSE_CANDIDATES = 10_000


def _pair_close(table, initializers, initializer_specs, matched_graph, matched_unique, add) -> None:
    """Pair what is left by content equal within the dtype's tolerance (data "close"), as is or
    transposed: an exporter that constant-folds a BatchNorm or weight_norm computes the fold
    fusectl recorded, up to rounding (TorchScript's ``onnx::Conv_299`` against a
    ``conv-bn-fold`` checkpoint, dynamo's transposed ``val_12`` against a folded Linear)."""
    from ..tolerance import default_tolerance

    left: dict[tuple, list[tuple[LazyTensor, bool]]] = {}
    for _, tensor in table.unique():
        if id(tensor) in matched_unique or not tensor.has_data() or tensor.spec.dtype.packed:
            continue
        if tensor.spec.dtype.numpy.kind != "f" or not tensor.spec.shape:
            continue
        dtype, shape = str(tensor.spec.dtype.numpy), tensor.spec.shape
        left.setdefault((dtype, shape), []).append((tensor, False))
        if len(shape) == 2 and shape[0] != shape[1]:
            left.setdefault((dtype, shape[::-1]), []).append((tensor, True))
        elif len(shape) == 2:
            left[(dtype, shape)].append((tensor, True))
    # each left tensor is read once per orientation and compared with the initializers of its shape, one at a
    # time: memory holds one tensor and one initializer, never the whole candidate set
    by_key: dict[tuple, list[str]] = {}
    for name in initializers:
        if name not in matched_graph:
            dtype, shape = initializer_specs[name]
            by_key.setdefault((dtype, tuple(shape)), []).append(name)
    work = [(tensor, transposed, by_key[key]) for key, entries in left.items() if key in by_key
            for tensor, transposed in entries]
    if not work or sum(len(names) for _, _, names in work) > MAX_CLOSE_CANDIDATES:
        return
    for tensor, transposed, names in sorted(work, key=lambda w: w[1]):  # as is before transposed
        if id(tensor) in matched_unique:
            continue
        mine = np.asarray(tensor.read(), np.float64)
        mine = mine.T if transposed else mine
        if not np.all(np.isfinite(mine)):
            continue
        atol, rtol = default_tolerance(tensor.spec.dtype.numpy)
        for name in names:
            if name in matched_graph:
                continue
            theirs = np.asarray(initializers[name](), np.float64)
            if np.all(np.abs(mine - theirs) <= atol + rtol * np.abs(theirs)):
                add(id(tensor), name, "transposed" if transposed else "content", "close")
                break


def _same_data(tensor: LazyTensor, initializer: Callable[[], np.ndarray]) -> str:
    if not tensor.has_data():
        return "unknown"
    if tensor.spec.dtype.packed:
        return "unknown"
    mine = np.ascontiguousarray(tensor.read()).reshape(-1).view(np.uint8)
    theirs = np.ascontiguousarray(initializer()).reshape(-1).view(np.uint8)
    return "equal" if np.array_equal(mine, theirs) else "differs"


def map_names(
    table: ParamTable,
    initializers: Mapping[str, Callable[[], np.ndarray]],
    initializer_specs: Mapping[str, tuple[str, tuple[int, ...]]],
) -> NameMap:
    """Pair ``table``'s structural names with the graph's initializers.

    ``initializers`` maps each initializer name to a function returning its data (called at
    most once, only for initializers not matched by name); ``initializer_specs`` gives each
    one's numpy dtype name and shape without reading it.
    """
    result = NameMap()
    names = table.names()
    graph_prefix, ckpt_prefix = common_prefix(names, list(initializers))
    result.graph_prefix, result.checkpoint_prefix = graph_prefix, ckpt_prefix
    matched_graph: set[str] = set()
    matched_unique: set[int] = set()

    members = table.groups()  # tensor id -> its structural names (tied ones together)

    def add(tensor_id: int, initializer: str, how: str, data: str = "equal") -> None:
        result.pairs.extend(Pair(name, initializer, how, data) for name in members[tensor_id])
        matched_graph.add(initializer)
        matched_unique.add(tensor_id)

    # a name says what an initializer was called, not what it holds: exporters reuse checkpoint
    # names for folded values (dynamo's Conv+BatchNorm fusion keeps ``conv1.weight``), so every
    # pair by name is checked against the data
    # the name as it is first; then, for what is left, an MXNet name without its arg:/aux:
    # (mx2onnx names the initializer of ``arg:convbn_conv0_weight`` ``convbn_conv0_weight``)
    for bare in (False, True):
        for name in names:
            if bare and not name.startswith(MXNET_PREFIXES):
                continue
            key = name[len("arg:"):] if bare else name
            if not key.startswith(ckpt_prefix):
                continue
            candidate = graph_prefix + key[len(ckpt_prefix):]
            # a tied name pairs with the graph's initializer of its own name even when its tensor
            # paired already under another: a graph tensor named like a checkpoint tensor is never
            # kept as the graph's own unchecked (an untied graph's head against a tied checkpoint)
            if (candidate in initializers and candidate not in matched_graph
                    and (not bare or id(table[name]) not in matched_unique)):
                dtype, shape = initializer_specs[candidate]
                tensor = table[name]
                spec = tensor.spec
                if (dtype, tuple(shape)) == (str(spec.dtype.numpy), spec.shape):
                    add(id(tensor), candidate, "name", _same_data(tensor, initializers[candidate]))

    remaining = [n for n in initializers if n not in matched_graph]
    wanted_specs = {(str(t.spec.dtype.numpy), t.spec.shape) for _, t in table.unique()}
    wanted_specs |= {(d, s[::-1]) for d, s in wanted_specs if len(s) == 2}
    graph_by_digest: dict[tuple, list[str]] = {}
    for name in remaining:
        dtype, shape = initializer_specs[name]
        if (dtype, tuple(shape)) not in wanted_specs:
            continue  # no checkpoint tensor could equal it: do not read it
        graph_by_digest.setdefault(_digest(initializers[name]()), []).append(name)

    # each checkpoint tensor that could match is read once, hashed as is and transposed
    digest_specs = {key[:2] for key in graph_by_digest}
    digests: list[tuple[LazyTensor, tuple, tuple | None]] = []
    for _, tensor in table.unique():
        if id(tensor) in matched_unique or tensor.spec.dtype.packed or not tensor.has_data():
            continue
        dtype, shape = str(tensor.spec.dtype.numpy), tensor.spec.shape
        as_is = (dtype, shape) in digest_specs
        transposed = len(shape) == 2 and (dtype, shape[::-1]) in digest_specs
        if not as_is and not transposed:
            continue
        array = tensor.read()
        digests.append((tensor, _digest(array) if as_is else None, _digest(array.T) if transposed else None))
    for how, position in (("content", 1), ("transposed", 2)):
        for entry in digests:
            tensor, key = entry[0], entry[position]
            if key is None or (how == "transposed" and id(tensor) in matched_unique):
                continue
            for initializer in graph_by_digest.get(key, []):
                if initializer not in matched_graph:
                    add(id(tensor), initializer, how)
    _pair_close(table, initializers, initializer_specs, matched_graph, matched_unique, add)
    result.pairs.sort(key=lambda p: (p.structural, p.initializer))
    paired = {p.structural for p in result.pairs}
    result.unmatched_checkpoint = [n for n in names if n not in paired]
    result.unmatched_graph = sorted(n for n in initializers if n not in matched_graph)
    return result


def map_graph(table: ParamTable, model) -> NameMap:
    """Pair ``table``'s structural names with every tensor the onnx-ir ``model`` holds:
    initializers and Constant nodes, in the main graph and in If/Loop/Scan bodies (a frozen
    TorchScript export keeps its weights as Constants). ``unmatched_graph`` lists the main
    graph's initializers only: a Constant or a subgraph's tensor is listed when it pairs (the
    integer Constants of shapes and axes, an LSTM's zero initial state, would crowd it)."""
    from .graph_tensors import MAIN_GRAPH, graph_tensors, tensor_views

    tensors = graph_tensors(model)
    result = map_names(table, *tensor_views(tensors))
    initializers = {t.key for t in tensors if t.kind == "initializer" and t.where == MAIN_GRAPH}
    result.unmatched_graph = [n for n in result.unmatched_graph if n in initializers]
    return result
