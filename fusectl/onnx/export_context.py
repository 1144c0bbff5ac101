"""What the passes of ``fusectl export`` share: one :class:`ExportContext`.

It holds the checkpoint, the plan recorded in it, the graph's tensors (initializers and
Constants, at any depth) paired with the names the checkpoint had before that plan (:class:`Pairing`, once ``PairInitializersPass``
has run), the checkpoint's parameters as initializers (one per unique parameter) and the
counts the :class:`~fusectl.onnx.export.ExportReport` gives. ``export_model`` creates it;
the passes read and extend it, nothing else does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from ..errors import PlanError
from ..io.checkpoint import Checkpoint
from ..steps import Plan
from .graph_tensors import GraphTensor

# the graph's paired initializers are renamed with this prefix, freeing their names for the
# checkpoint's parameters; the passes rebind their uses, and none may be left in use
SET_ASIDE = "fusectl_graph/"


class ExportError(PlanError):
    """The graph does not have the structure the checkpoint's plan needs."""


class IRBuilder:
    """Appends onnx-ir nodes to a graph; the same interface as the probes' GraphBuilder."""

    def __init__(self, graph: ir.Graph):
        self.graph, self.count = graph, 0

    def node(self, op: str, inputs, n_out: int = 1, *, into: ir.Graph | None = None, **attrs) -> list[ir.Value]:
        """Append an ``op`` node to the main graph, or to ``into`` (a subgraph whose nodes
        it computes for); its outputs are named ``fusectl_<op>_<n>``."""
        node = ir.node(op, inputs, attributes=attrs or None, num_outputs=n_out)
        for out in node.outputs:
            self.count += 1
            out.name = f"fusectl_{op.lower()}_{self.count}"
        (into if into is not None else self.graph).append(node)
        return list(node.outputs)

    def one(self, op: str, inputs, *, into: ir.Graph | None = None, **attrs) -> ir.Value:
        """One node of ``op`` with one output, appended to the graph (or ``into``); its output value."""
        return self.node(op, inputs, 1, into=into, **attrs)[0]

    def ints(self, values) -> ir.Value:
        """An int64 1-D constant of ``values`` (axes, sizes, pads), as an initializer."""
        return self.constant(np.asarray(list(values), np.int64))

    def constant(self, array: np.ndarray, name: str | None = None) -> ir.Value:
        """``array`` as a new initializer of the graph (named ``name``, else a fresh fusectl name)."""
        self.count += 1
        name = name or f"fusectl_const_{self.count}"
        value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
        self.graph.register_initializer(value)
        return value


@dataclass(frozen=True)
class Pairing:
    """The graph tensors ``PairInitializersPass`` paired and set aside (``SET_ASIDE``).

    ``by_name``: a name the checkpoint had before its plan → the graph tensors (initializers
    or Constant outputs, at any depth) holding that tensor, each with whether it holds it
    transposed. ``direct``: a graph tensor the exporter already made in the fused layout (an
    LSTM's packed W/R/B), by key → its value, the checkpoint tensor it holds, and whether
    transposed; ``direct_names`` those checkpoint tensors. ``aside``: every tensor set aside
    (none may be in use once the rewrite is done); ``unpaired``: the graph's own tensors,
    kept where still in use and reported (``ExportReport.kept_constants``); ``explained``: the
    checkpoint tensors (before the plan) that folds the exporter made account for.
    """

    by_name: dict[str, list[tuple[ir.Value, bool]]]
    direct: dict[str, tuple[ir.Value, str, bool]]
    direct_names: frozenset[str]
    aside: tuple[GraphTensor, ...] = ()
    unpaired: tuple[GraphTensor, ...] = ()
    explained: frozenset[str] = frozenset()


@dataclass
class ExportCounts:
    """What the report counts: steps folded, graph tensor uses rebound, MatMul/Gemm groups
    fused; the groups left unfused, the graph constants kept and the checkpoint's integer
    tensors left out, as the report lists them."""

    folded: int = 0
    rebound: int = 0
    fused_matmuls: int = 0
    not_fused: list[dict] = field(default_factory=list)
    kept_constants: list[dict] = field(default_factory=list)
    unused: list[dict] = field(default_factory=list)


@dataclass(eq=False)
class ExportContext:
    """The state the export's passes share, for one ``model`` (loaded from ``graph_path``)
    rewritten to take ``checkpoint``'s parameters."""

    checkpoint: Checkpoint
    graph_path: str
    model: ir.Model
    plan: Plan = field(init=False)
    builder: IRBuilder = field(init=False)
    params: dict[str, ir.Value] = field(init=False, default_factory=dict)  # unique name → initializer
    pairing: Pairing | None = field(init=False, default=None)  # PairInitializersPass's result
    counts: ExportCounts = field(init=False, default_factory=ExportCounts)

    def __post_init__(self) -> None:
        provenance = self.checkpoint.provenance
        self.plan = provenance.plan if provenance else Plan()
        self.builder = IRBuilder(self.model.graph)

    def param(self, name: str) -> ir.Value:
        """The initializer holding checkpoint tensor ``name`` (one per unique parameter),
        read from the checkpoint only when the model is saved."""
        table = self.checkpoint.table
        if name not in table:
            raise ExportError(f"{name!r} is not in {self.checkpoint.path}")
        unique = table.unique_name(name)
        if unique not in self.params:
            tensor = table[unique]
            spec = tensor.spec
            lazy = ir.LazyTensor(
                lambda t=tensor: ir.tensor(t.read()),
                dtype=ir.DataType(spec.dtype.onnx), shape=ir.Shape(spec.shape), name=unique,
            )
            value = ir.Value(name=unique, const_value=lazy, shape=ir.Shape(spec.shape),
                             type=ir.TensorType(ir.DataType(spec.dtype.onnx)))
            self.model.graph.register_initializer(value)
            self.params[unique] = value
        return self.params[unique]

    def is_param(self, value: ir.Value) -> bool:
        """Whether ``value`` is one of the checkpoint's parameters."""
        return value in self.params.values()

    def replace(self, old: ir.Value, new: ir.Value) -> None:
        """Every use of ``old`` reads ``new``; a graph output keeps its name."""
        if not old.is_graph_output():
            ir.convenience.replace_all_uses_with(old, new)
            return
        if new.is_initializer() or new.is_graph_input() or new.is_graph_output():
            # an output is produced by a node of its own, in the graph (or subgraph) it leaves
            new = self.builder.one("Identity", [new], into=old.graph)
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
        name, old.name = old.name, None
        new.name, new.type, new.shape = name, old.type, old.shape

    def rebind(self, old: ir.Value, new: ir.Value, transposed: bool) -> None:
        """Uses of the graph's initializer ``old`` read ``new`` (transposed where paired so)."""
        self.replace(old, self.builder.one("Transpose", [new], perm=[1, 0]) if transposed else new)
        self.counts.rebound += 1
