"""An MXNet ``-symbol.json`` (what ``HybridBlock.export`` and ``mx.model.save_checkpoint`` write
beside ``PREFIX-0000.params``), read as data and never executed: its nodes, their operators and
attributes, and what fusectl needs of them — BatchNorm's ``eps`` and ``fix_gamma``, the RNN
operator's mode, state size, layers, direction and projection (as config values for rules'
vars, :meth:`Symbol.rnn_config`), and the variables that two operators read (a tied
parameter, stored once).

The graph is nnvm's JSON: ``nodes`` (each ``op``, ``name``, ``attrs`` — ``attr`` or ``param`` in
older files — and ``inputs``, each ``[node, output, version]``), ``arg_nodes``, ``heads``. A
variable is a node whose op is ``"null"``. An attribute missing from a node has the operator's
default (MXNet 1.9.1's ``src/operator``: BatchNorm ``eps`` 1e-3, ``fix_gamma`` true; RNN
``bidirectional`` false, no projection).

A variable read by two operators is a tie. Its other names are the ones MXNet gives an
operator's own parameter: the operator's name without Gluon's ``_fwd`` and the input's role
(``tied_dense1_fwd`` reading its weight → ``tied_dense1_weight``), with the params file's
``arg:``/``aux:`` prefix: ``arg:tied_dense1_weight`` is then an alias of the stored
``arg:tied_embedding0_weight``.

>>> symbol = parse_symbol({"nodes": [
...     {"op": "null", "name": "data", "inputs": []},
...     {"op": "null", "name": "embed_weight", "inputs": []},
...     {"op": "Embedding", "name": "embed", "inputs": [[0, 0, 0], [1, 0, 0]]},
...     {"op": "FullyConnected", "name": "head_fwd", "attrs": {"no_bias": "True"},
...      "inputs": [[2, 0, 0], [1, 0, 0]]}]}, "m-symbol.json")
>>> symbol.aliases({"arg:embed_weight": None})
{'arg:head_weight': 'arg:embed_weight'}
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from ...errors import CheckpointError, quote
from ...limits import check_limit
from ..untrusted import read_json_file

# the inputs of the operators that hold parameters, in order (MXNet 1.9.1's ListArguments and
# ListAuxiliaryStates); a variable read by another operator is named by its position
INPUT_ROLES: dict[str, tuple[str, ...]] = {
    "FullyConnected": ("data", "weight", "bias"),
    "Convolution": ("data", "weight", "bias"),
    "Deconvolution": ("data", "weight", "bias"),
    "Embedding": ("data", "weight"),
    "BatchNorm": ("data", "gamma", "beta", "moving_mean", "moving_var"),
    "LayerNorm": ("data", "gamma", "beta"),
    "InstanceNorm": ("data", "gamma", "beta"),
    "GroupNorm": ("data", "gamma", "beta"),
    "LeakyReLU": ("data", "gamma"),
    "RNN": ("data", "parameters", "state", "state_cell", "sequence_length"),
}
_TRUE, _FALSE = ("true", "1"), ("false", "0")


@dataclass(frozen=True)
class Node:
    """One node of the graph: ``op`` (``"null"`` for a variable), ``name``, ``attrs`` (strings, as
    written) and ``inputs`` (the indices of the nodes it reads, in order)."""

    op: str
    name: str
    attrs: Mapping[str, str]
    inputs: tuple[int, ...]

    def role(self, k: int) -> str:
        """What this operator's input ``k`` is (``weight``), or ``input{k}`` for an operator
        fusectl does not know."""
        roles = INPUT_ROLES.get(self.op, ())
        return roles[k] if k < len(roles) else f"input{k}"

    @property
    def base_name(self) -> str:
        """The name the operator's own parameters start with: Gluon's ``dense0_fwd`` → ``dense0``."""
        return self.name[: -len("_fwd")] if self.name.endswith("_fwd") else self.name


@dataclass(frozen=True)
class BatchNorm:
    """A BatchNorm node's folding facts: ``eps``, ``fix_gamma`` (gamma is taken as 1, whatever the
    file holds: Gluon's ``scale=False``) and ``use_global_stats``, and the variables it reads."""

    name: str
    eps: float
    fix_gamma: bool
    use_global_stats: bool
    axis: int
    gamma: str | None
    beta: str | None
    moving_mean: str | None
    moving_var: str | None


@dataclass(frozen=True)
class RNN:
    """An RNN node's attributes: ``mode`` (``lstm``, ``gru``, ``rnn_relu``, ``rnn_tanh``),
    ``state_size``, ``num_layers``, ``bidirectional``, ``projection_size`` (None: none), and the
    variable holding its flat parameter vector, when a variable feeds it directly."""

    name: str
    mode: str
    state_size: int
    num_layers: int
    bidirectional: bool
    projection_size: int | None
    parameters: str | None


@dataclass(frozen=True)
class Symbol:
    """A parsed ``-symbol.json``: its ``nodes`` in file order."""

    path: str
    nodes: tuple[Node, ...]

    def readers(self) -> dict[int, list[tuple[Node, int]]]:
        """For each variable (by node index), the operators that read it and at which input."""
        found: dict[int, list[tuple[Node, int]]] = {}
        for node in self.nodes:
            if node.op == "null":
                continue
            for k, source in enumerate(node.inputs):
                if self.nodes[source].op == "null":
                    found.setdefault(source, []).append((node, k))
        return found

    def shared_variables(self) -> dict[str, list[tuple[Node, int]]]:
        """The variables that two or more operators read (a parameter stored once, used twice),
        by name, with their readers."""
        return {self.nodes[v].name: uses for v, uses in self.readers().items()
                if len({id(node) for node, _ in uses}) > 1}

    def aliases(self, stored: Mapping[str, object]) -> dict[str, str]:
        """``{alias: stored name}`` for each shared variable that the params file ``stored`` holds
        (as ``arg:NAME``/``aux:NAME``, or bare): every reader whose own name for the input
        (:attr:`Node.base_name` + ``_`` + its role) is not the variable's name nor stored."""
        aliases: dict[str, str] = {}
        for variable, uses in self.shared_variables().items():
            kept = next((f"{p}{variable}" for p in ("arg:", "aux:", "") if f"{p}{variable}" in stored), None)
            if kept is None:
                continue
            prefix = kept[: len(kept) - len(variable)]
            for node, k in uses:
                alias = f"{prefix}{node.base_name}_{node.role(k)}"
                if alias != kept and alias not in stored:
                    aliases.setdefault(alias, kept)
        return aliases

    def batch_norms(self) -> list[BatchNorm]:
        """Every BatchNorm node, with MXNet's defaults for attributes it does not write."""
        found = []
        for node in self.nodes:
            if node.op != "BatchNorm":
                continue
            inputs = [self._variable(node, k) for k in range(1, 5)]
            eps = self._float(node, "eps", 1e-3)
            if not (math.isfinite(eps) and eps >= 0):  # 1e999 reads as inf: a fold by it zeroes the layer
                raise self._error(node, f"eps is {quote(node.attrs['eps'])}, not a finite number ≥ 0")
            found.append(BatchNorm(node.name, eps, self._bool(node, "fix_gamma", True),
                                   self._bool(node, "use_global_stats", False), self._int(node, "axis", 1),
                                   *inputs))
        return found

    def rnns(self) -> list[RNN]:
        """Every RNN node (the fused operator of Gluon's rnn layers and of FusedRNNCell)."""
        found = []
        for node in self.nodes:
            if node.op != "RNN":
                continue
            mode = node.attrs.get("mode")
            if mode not in ("lstm", "gru", "rnn_relu", "rnn_tanh"):
                raise self._error(node, f"mode {mode!r} is not lstm, gru, rnn_relu or rnn_tanh")
            projection = node.attrs.get("projection_size", "None")
            found.append(RNN(node.name, mode, self._int(node, "state_size"), self._int(node, "num_layers"),
                             self._bool(node, "bidirectional", False),
                             None if projection == "None" else self._int(node, "projection_size"),
                             self._variable(node, 1)))
        return found

    def rnn_config(self, stored: Mapping[str, tuple[int, ...]]) -> dict[str, int] | None:
        """The sizes of the graph's one RNN operator as config values for rules' ``config:``
        vars (``mxnet-fused-*-to-torch``): ``state_size``, ``num_layers``, ``bidirectional``
        (0 or 1), ``projection_size`` (only with a projection) and ``input_size``, which the
        graph does not hold: it is what the length of the operator's parameter vector (in
        ``stored``, name → shape, as ``arg:NAME`` or bare) leaves for the first layer, when
        that vector is stored and the length fits. None when the graph has no RNN operator or
        several (whose sizes one config cannot hold), or when its attributes are not MXNet's (the
        params file still reads: only a rule's var that needs a size then asks for ``--config``).

        >>> symbol = parse_symbol({"nodes": [
        ...     {"op": "null", "name": "data", "inputs": []},
        ...     {"op": "null", "name": "lstm_parameters", "inputs": []},
        ...     {"op": "RNN", "name": "lstm_rnn", "inputs": [[0, 0, 0], [1, 0, 0]],
        ...      "attrs": {"mode": "lstm", "state_size": "4", "num_layers": "2", "bidirectional": "True"}}]},
        ...     "lstm-symbol.json")
        >>> symbol.rnn_config({"arg:lstm_parameters": (736,)})
        {'state_size': 4, 'num_layers': 2, 'bidirectional': 1, 'input_size': 3}
        """
        try:
            rnns = self.rnns()
        except CheckpointError:
            return None
        if len(rnns) != 1:
            return None
        rnn = rnns[0]
        config = {"state_size": rnn.state_size, "num_layers": rnn.num_layers, "bidirectional": int(rnn.bidirectional)}
        if rnn.projection_size is not None:
            config["projection_size"] = rnn.projection_size
        shape = next((stored[f"{p}{rnn.parameters}"] for p in ("arg:", "")
                      if rnn.parameters is not None and f"{p}{rnn.parameters}" in stored), None)
        if shape is not None and len(shape) == 1:
            size = _input_size(rnn, shape[0])
            if size is not None:
                config["input_size"] = size
        return config

    def _variable(self, node: Node, k: int) -> str | None:
        if k >= len(node.inputs):
            return None
        source = self.nodes[node.inputs[k]]
        return source.name if source.op == "null" else None

    def _error(self, node: Node, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: node {quote(node.name)} ({node.op}): {what}; the file is corrupt")

    def _int(self, node: Node, key: str, default: int | None = None) -> int:
        text = node.attrs.get(key)
        if text is None and default is not None:
            return default
        try:
            value = int(text)
        except (TypeError, ValueError):
            raise self._error(node, f"{key} is {text!r}, not a whole number") from None
        if not 0 <= value < 2**31:
            raise self._error(node, f"{key} is {value}, out of range")
        return value

    def _float(self, node: Node, key: str, default: float) -> float:
        text = node.attrs.get(key)
        if text is None:
            return default
        try:
            return float(text)
        except ValueError:
            raise self._error(node, f"{key} is {text!r}, not a number") from None

    def _bool(self, node: Node, key: str, default: bool) -> bool:
        text = node.attrs.get(key)
        if text is None:
            return default
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise self._error(node, f"{key} is {text!r}, not True or False")


# gates per RNN mode: the rows of an i2h or h2h weight are gates * state_size
GATES = {"lstm": 4, "gru": 3, "rnn_relu": 1, "rnn_tanh": 1}


def _input_size(rnn: RNN, length: int) -> int | None:
    """The first layer's input size that makes MXNet's flat vector of ``rnn`` ``length`` long
    (per layer and direction i2h, h2h[, h2r] weights, then two biases per gate row); None when
    no whole positive size does."""
    gh, h, d, layers = GATES[rnn.mode] * rnn.state_size, rnn.state_size, 1 + rnn.bidirectional, rnn.num_layers
    p = rnn.projection_size or h
    h2r = p * h if rnn.projection_size is not None else 0
    if gh == 0 or layers == 0:
        return None
    first = length - (layers - 1) * d * (gh * d * p + gh * p + h2r) - layers * d * 2 * gh
    if first <= 0 or first % d or (first // d - gh * p - h2r) % gh:
        return None
    size = (first // d - gh * p - h2r) // gh
    return size if size > 0 else None


def read_symbol(path: str) -> Symbol:
    """The :class:`Symbol` of the ``-symbol.json`` at ``path`` (JSON within fusectl's budgets);
    CheckpointError naming the file for one that is not an MXNet graph."""
    return parse_symbol(read_json_file(path, "the MXNet symbol"), path)


def parse_symbol(doc: object, path: str) -> Symbol:
    """The :class:`Symbol` of a parsed ``-symbol.json`` document ``doc`` (read from ``path``)."""
    if type(doc) is not dict or type(doc.get("nodes")) is not list:
        raise CheckpointError(f"{path}: not an MXNet symbol (a JSON object with a list of nodes)")
    raw_nodes = doc["nodes"]
    check_limit("tensors", len(raw_nodes), f"{path}: the graph's nodes")
    nodes = []
    for k, raw in enumerate(raw_nodes):
        where = f"{path}: node {k}"
        if type(raw) is not dict or type(raw.get("op")) is not str or type(raw.get("name")) is not str:
            raise CheckpointError(f"{where}: a node must be an object with an op and a name (strings)")
        attrs = raw.get("attrs", raw.get("attr", raw.get("param", {})))
        if type(attrs) is not dict or not all(type(a) is str and type(v) is str for a, v in attrs.items()):
            raise CheckpointError(f"{where} ({quote(raw['name'])}): attrs must map strings to strings")
        inputs = raw.get("inputs", [])
        if type(inputs) is not list:
            raise CheckpointError(f"{where} ({quote(raw['name'])}): inputs must be a list")
        sources = []
        for entry in inputs:
            if type(entry) is not list or not 2 <= len(entry) <= 3 or not all(type(x) is int for x in entry) \
                    or not 0 <= entry[0] < k:
                raise CheckpointError(f"{where} ({quote(raw['name'])}): input {str(entry)[:40]} is not "
                                      f"[node, output, version] of an earlier node")
            sources.append(entry[0])
        nodes.append(Node(raw["op"], raw["name"], dict(attrs), tuple(sources)))
    return Symbol(path, tuple(nodes))
