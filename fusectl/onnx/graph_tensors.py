"""Every tensor an ONNX graph holds as data: the weights ``export`` must take from a checkpoint.

Exporters keep weights in three places: initializers of the main graph (the usual case),
``Constant`` nodes (``torch.jit.freeze`` inlines parameters as constants, which the
TorchScript exporter writes as Constant nodes; silero-vad ships such a graph), and, inside
``If``/``Loop``/``Scan`` bodies, both again — a subgraph may hold its own initializers and
Constant nodes. :func:`graph_tensors` lists them all, depth first, each with where it lies,
so pairing, rebinding and the final check see every one of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx_ir as ir

from ..errors import quote

MAIN_GRAPH = "main graph"

# the Constant attributes that hold numbers, with the dtype they are in (a "value" tensor
# knows its own); sparse and string constants are never weights fusectl writes
_NUMERIC_ATTRIBUTES = {"value": None, "value_float": np.float32, "value_floats": np.float32,
                       "value_int": np.int64, "value_ints": np.int64}


@dataclass(frozen=True, eq=False)
class GraphTensor:
    """One tensor held by a graph: ``key`` names it uniquely in the model (its value's name,
    suffixed ``#2``, ``#3``… where a subgraph reuses a name), ``kind`` is ``"initializer"``
    or ``"Constant"``, ``where`` the graph holding it (``main graph`` or a path such as
    ``If '/If' then_branch``)."""

    key: str
    value: ir.Value
    graph: ir.Graph
    kind: str
    where: str
    dtype: str  # numpy dtype name
    shape: tuple[int, ...]
    read: Callable[[], np.ndarray]

    @property
    def size(self) -> int:
        """The number of elements (the product of the shape)."""
        return int(np.prod(self.shape, dtype=np.int64))

    def describe(self) -> str:
        """``Constant '/Constant_1_output_0' float32[8, 8] (If '/If' then_branch)``."""
        return f"{self.kind} {quote(self.key)} {self.dtype}{list(self.shape)} ({self.where})"

    def to_json(self) -> dict:
        """The tensor as reports list it: name (its key), where, kind, dtype and shape."""
        return {"name": self.key, "where": self.where, "kind": self.kind, "dtype": self.dtype,
                "shape": list(self.shape)}


def graph_tensors(model: ir.Model) -> list[GraphTensor]:
    """Every initializer and numeric Constant of ``model``'s graph and its subgraphs, the main
    graph's initializers first (they keep their names as keys)."""
    found: list[GraphTensor] = []
    taken: set[str] = set()

    def key_for(name: str) -> str:
        key, n = name, 1
        while key in taken:
            n += 1
            key = f"{name}#{n}"
        taken.add(key)
        return key

    def visit(graph: ir.Graph, where: str) -> None:
        for value in graph.initializers.values():
            tensor = value.const_value
            if tensor is None:
                continue  # a graph input's declared default without data
            found.append(GraphTensor(key_for(value.name), value, graph, "initializer", where,
                                     str(tensor.dtype.numpy()), tuple(int(d) for d in tensor.shape),
                                     lambda t=tensor: np.asarray(t.numpy())))
        for node in graph:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                held = _constant_tensor(node)
                if held is not None:
                    read, dtype, shape = held
                    found.append(GraphTensor(key_for(node.outputs[0].name or "Constant"), node.outputs[0],
                                             graph, "Constant", where, dtype, shape, read))
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.GRAPH:
                    visit(attr.as_graph(), _subgraph_where(where, node, attr.name))
                elif attr.type == ir.AttributeType.GRAPHS:
                    for k, sub in enumerate(attr.as_graphs()):
                        visit(sub, _subgraph_where(where, node, f"{attr.name}[{k}]"))

    visit(model.graph, MAIN_GRAPH)
    return found


def in_use(value: ir.Value) -> bool:
    """Whether a node (at any depth) reads ``value`` or it is an output of its graph."""
    return bool(value.uses()) or value.is_graph_output()


def tensor_views(tensors: list[GraphTensor]):
    """(readers, specs) of ``tensors`` by key, as ``namemap.map_names`` takes them."""
    return ({t.key: t.read for t in tensors}, {t.key: (t.dtype, t.shape) for t in tensors})


def _subgraph_where(outer: str, node: ir.Node, attribute: str) -> str:
    here = f"{node.op_type} {quote(node.name or '')} {attribute}"
    return here if outer == MAIN_GRAPH else f"{outer} > {here}"


def _constant_tensor(node: ir.Node):
    """(reader, dtype, shape) of a Constant's numeric value; None for a string, sparse or
    attribute-reference constant."""
    for name, dtype in _NUMERIC_ATTRIBUTES.items():
        attr = node.attributes.get(name)
        if attr is None or attr.is_ref():
            continue
        if name == "value":
            tensor = attr.as_tensor()
            if tensor.dtype == ir.DataType.STRING:
                return None
            return (lambda t=tensor: np.asarray(t.numpy()), str(tensor.dtype.numpy()),
                    tuple(int(d) for d in tensor.shape))
        array = np.asarray(attr.value, dtype)
        return (lambda a=array: a, str(array.dtype), array.shape)
    return None
