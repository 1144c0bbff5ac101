"""Folds an exporter already applied: a graph initializer that keeps a checkpoint name but
holds a folded value.

torch's dynamo exporter (onnxscript's ``FuseBatchNormIntoConv``) folds each BatchNorm into the
Conv before it and keeps the Conv's initializer names: ``conv1.weight`` then holds
``conv1.weight`` scaled by the BatchNorm, which a name match alone would take for the raw
weight. Such a pair is recognised when folding the checkpoint's own Conv and BatchNorm
tensors reproduces the graph's weight and bias within the dtype's tolerance; the export then
uses the fold of the checkpoint's tensors. A pair by name whose data differ for any other
reason is refused, naming the initializer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import PlanError
from ..ops.reparam import BnFold
from ..table import ParamTable
from ..tolerance import default_tolerance
from .namemap import NameMap, Pair

# BatchNorm epsilons tried when matching a fold: PyTorch's default, then Keras/TensorFlow's
BATCHNORM_EPSILONS = (1e-5, 1e-3)
_BATCHNORM_PARTS = ("weight", "bias", "running_mean", "running_var")


class ExporterFoldError(PlanError):
    """A graph initializer named like a checkpoint tensor holds other data, unexplained."""


@dataclass(frozen=True, eq=False)
class BatchNormFold:
    """One Conv whose weight and bias the exporter folded with a BatchNorm of the checkpoint."""

    node: object  # the onnx-ir Conv node
    weight: str  # checkpoint names
    bias: str | None
    batchnorm: str  # the BatchNorm's prefix (``bn1``)
    eps: float
    folded_weight: np.ndarray
    folded_bias: np.ndarray

    def checkpoint_names(self) -> set[str]:
        """The checkpoint tensors this fold explains: the layer's weight (and bias) and the
        BatchNorm's parameters and running statistics."""
        names = {self.weight, *(f"{self.batchnorm}.{p}" for p in _BATCHNORM_PARTS)}
        return names | ({self.bias} if self.bias else set())

    def graph_initializers(self) -> set[str]:
        """Names of the Conv's weight and bias inputs that are initializers of the graph."""
        return {v.name for v in self.node.inputs[1:3] if v is not None and v.is_initializer()}


def recognise_batchnorm_folds(graph, table: ParamTable, mapping: NameMap) -> list[BatchNormFold]:
    """Explain every pair by name whose data differ as a Conv + BatchNorm fold of checkpoint
    tensors; ExporterFoldError naming the first pair no fold explains."""
    differing = {p.initializer: p for p in mapping.differing()}
    if not differing:
        return []
    candidates = _unpaired_batchnorms(table, mapping)
    folds: list[BatchNormFold] = []
    for node in graph:
        if node.op_type != "Conv" or len(node.inputs) < 2 or node.inputs[1] is None:
            continue
        pair = differing.get(node.inputs[1].name)
        if pair is None:
            continue
        fold = _match_fold(node, pair, table, candidates)
        if fold is not None:
            candidates.remove(fold.batchnorm)
            folds.append(fold)
    explained = set().union(*(f.graph_initializers() for f in folds)) if folds else set()
    for initializer, pair in differing.items():
        if initializer not in explained:
            raise ExporterFoldError(_unexplained(pair, table, graph))
    return folds


def _unpaired_batchnorms(table: ParamTable, mapping: NameMap) -> list[str]:
    """Prefixes of the checkpoint's BatchNorms (known by running statistics) that the graph
    does not hold by name: candidates for a fold the exporter made."""
    paired = {p.structural for p in mapping.pairs if p.data != "differs"}
    found = []
    for name in table.names():
        if not name.endswith(".running_mean"):
            continue
        prefix = name[: -len(".running_mean")]
        parts = [f"{prefix}.{p}" for p in _BATCHNORM_PARTS]
        if all(p in table and table[p].has_data() and p not in paired for p in parts):
            found.append(prefix)
    return found


def _match_fold(node, pair: Pair, table: ParamTable, candidates: Sequence[str]) -> BatchNormFold | None:
    weight_name = pair.structural
    weight = _array(table, weight_name)
    graph_weight = _const(node.inputs[1])
    graph_bias = _const(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] is not None else None
    if graph_weight is None or graph_bias is None or weight.ndim < 3:
        return None
    bias_name = weight_name[: -len("weight")] + "bias" if weight_name.endswith("weight") else None
    if bias_name not in table or not table[bias_name].has_data():
        bias_name = None
    bias = _array(table, bias_name) if bias_name else None
    atol, rtol = default_tolerance(weight.dtype)
    for prefix in candidates:
        gamma, beta, mean, var = (_array(table, f"{prefix}.{p}") for p in _BATCHNORM_PARTS)
        if gamma.shape != (weight.shape[0],):
            continue
        for eps in BATCHNORM_EPSILONS:
            op = BnFold(eps=eps, layer="conv", has_bias=bias is not None)
            arrays = [weight, *([bias] if bias is not None else []), gamma, beta, mean, var]
            folded_weight, folded_bias = op.apply(arrays)
            if _close(folded_weight, graph_weight, atol, rtol) and _close(folded_bias, graph_bias, atol, rtol):
                return BatchNormFold(node, weight_name, bias_name, prefix, eps, folded_weight, folded_bias)
    return None


def same_within_tolerance(value, tensor) -> bool:
    """Whether a graph initializer ``value`` equals checkpoint ``tensor`` within the tolerance
    of its dtype (a fold computed by the exporter and one computed by fusectl may differ by
    an ulp)."""
    
    theirs = _const(value)
    if theirs is None or not tensor.has_data():
        return False
    mine = tensor.read()
    atol, rtol = default_tolerance(mine.dtype)
    return _close(mine, theirs, atol, rtol)


def _close(mine: np.ndarray, theirs: np.ndarray, atol: float, rtol: float) -> bool:
    if mine.shape != theirs.shape:
        return False
    a, b = mine.astype(np.float64), theirs.astype(np.float64)
    return bool(np.all(np.abs(a - b) <= atol + rtol * np.abs(b)))


def _array(table: ParamTable, name: str) -> np.ndarray:
    
    tensor = table[name]
    return tensor.read()


def _const(value) -> np.ndarray | None:
    if value is None or value.const_value is None:
        return None
    return np.asarray(value.const_value.numpy())


def _unexplained(pair: Pair, table: ParamTable, graph) -> str:
    mine = _array(table, pair.structural)
    theirs = _const(graph.initializers[pair.initializer])
    detail = ""
    if theirs is not None and mine.dtype.kind == "f" and mine.shape == theirs.shape:
        detail = f" (max abs difference {float(np.max(np.abs(mine.astype(np.float64) - theirs))):.3g})"
    return (
        f"graph initializer {pair.initializer!r} has the name of checkpoint tensor "
        f"{pair.structural!r} but holds other data{detail}; the exporter folded something into "
        "it that fusectl does not recognise (it recognises a BatchNorm folded into a Conv), or "
        "the graph comes from another model. Export the graph with its optimizations off "
        "(dynamo: optimize=False; TorchScript: do_constant_folding=False)"
    )
