"""``verify A.onnx B.onnx --localize``: the first node, in the candidate's topological order,
whose output differs from the reference's beyond tolerance.

**Pairs.** An intermediate tensor of the candidate (the output of a node that does not compute
from initializers and Constants alone: weights are not compared, they are what the node reads)
is paired with the reference's

- *by name*: the reference has a value of the same name, produced by a node of the same op
  type; or a node of the same name and op type, whose output at the same index it is;
- *through the plan*: a fused MatMul or Gemm (``fusectl export``) computes the parts' outputs
  side by side and a Split hands each part's consumers its slice. Each slice pairs with the
  reference's value that the consumer of the same name reads in its place, the fused output with
  those values concatenated on the Split's axis, and so on up through a bias Add (the output of
  the fused MatMul before the fused bias with the parts' MatMul outputs before theirs).

**Segments.** Both graphs run with a few paired values exposed as extra outputs at a time: a
segment is a sub-model cut (``onnx_ir.convenience.extract``, sharing the loaded tensors) from the
graph's inputs to the segment's values, so nodes past them do not run. The reference's segment
runs, its session is let go, then the candidate's; the pairs are compared (:func:`~fusectl.
verification.compare.compare`, the verify's tolerances) in the candidate's topological order, and
the first that differs ends the search. The first segment holds ``FIRST_SEGMENT`` pair; each
next one as many as the last one's bytes say fit in ``SEGMENT_BYTES`` (both graphs' values
together), and at most ``GROWTH`` times as many as the last, so memory stays that of one session
plus one segment, never every intermediate at once (Polygraphy's ``mark all`` runs out of memory
on big models: NVIDIA/TensorRT #4443). Each segment runs the graphs from their inputs again: the
search costs time (an early segment runs few nodes), not memory.

**Rules.** ``fusectl export`` records the fused checkpoint's provenance in the candidate's
``metadata_props`` (key ``fusectl``): the rule whose step wrote an initializer the first
diverging node reads is named. A candidate without one names no rule.

>>> Localization().to_json()["paired_by"]
{'name': 0, 'plan': 0}
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from ..errors import CheckpointError, VerifyError, printable
from ..io.provenance import METADATA_KEY, Provenance
from .compare import Comparison, compare
from .runner import run, session

__all__ = ["FIRST_SEGMENT", "GROWTH", "Localization", "Pair", "SEGMENT_BYTES", "localize_models", "pair_values"]

# the first segment's pairs, before any value's bytes are known
FIRST_SEGMENT = 1
# both graphs' exposed values held at once, a segment at a time (one value larger than this is
# one segment of its own: the session computing it holds it anyway)
SEGMENT_BYTES = 16 * 2**20
# a segment holds at most GROWTH times the pairs of the one before: the bytes of values not yet
# computed are not known, so a run of small values does not make room for a burst of large ones
GROWTH = 4
MAX_SEGMENT = 1024

BY_NAME, BY_PLAN = "name", "plan"


@dataclass(frozen=True)
class Pair:
    """A candidate value and what it equals in the reference.

    ``reference``: one value's name, or (with ``axis``) the names of the values the candidate's
    concatenates on that axis. ``node``/``op_type``: the candidate node that produces ``output``;
    ``weights``: the float initializers it reads (directly or through nodes that compute from
    initializers and Constants only: a Transpose of a weight). ``by``: ``"name"`` or ``"plan"``.

    >>> Pair("mm", "MatMul", "y", ("a", "b"), -1, "plan").reference_text
    'concat(a, b, axis=-1)'
    """

    node: str
    op_type: str
    output: str
    reference: tuple[str, ...]
    axis: int | None
    by: str
    weights: tuple[str, ...] = ()

    @property
    def reference_text(self) -> str:
        """The reference side as the report names it: a value's name, or ``concat(a, b, axis=-1)``."""
        if self.axis is None:
            return self.reference[0]
        return f"concat({', '.join(self.reference)}, axis={self.axis})"


@dataclass
class Localization:
    """What ``--localize`` found: the report's ``localization`` object.

    ``first``: the first diverging node (``node``, ``op_type``, ``output``, ``reference_value``,
    ``candidate_value``, ``weights``, ``rule``, ``comparison``), None when no paired value
    differs; ``compared``: the pairs compared; ``paired_by``: the pairs found by name and through
    the plan; ``segments``: the segments run; ``note``: what else the reader should know.
    """

    first: dict | None = None
    compared: int = 0
    paired_by: dict[str, int] = field(default_factory=lambda: {BY_NAME: 0, BY_PLAN: 0})
    segments: int = 0
    note: str = ""

    def to_json(self) -> dict:
        """The documented ``localization`` object of verify's JSON report."""
        return {"first": self.first, "compared": self.compared, "paired_by": dict(self.paired_by),
                "segments": self.segments, "note": self.note}

    def text_lines(self) -> list[str]:
        """What verify prints under its checks."""
        pairs = (f"{self.compared} paired value(s) compared ({self.paired_by[BY_NAME]} paired by name, "
                 f"{self.paired_by[BY_PLAN]} through the plan) in {self.segments} segment(s)")
        lines = []
        if self.first is None:
            lines.append(f"  localize: no paired intermediate differs; {pairs}")
        else:
            first, m = self.first, Comparison(**self.first["comparison"])
            rule = f", rule {printable(first['rule'])}" if first["rule"] else ""
            weights = ", ".join(map(printable, first["weights"])) or "none"
            lines.append(f"  localize: first divergence at node {printable(first['node'])} "
                         f"({printable(first['op_type'])}) output {printable(first['output'])} against reference "
                         f"{printable(first['reference_value'])}: {m.dtype}{m.shape}, max abs {m.max_abs:.3g}, "
                         f"max rel {m.max_rel:.3g}, {m.mismatches} element(s) differ, first at {m.first_mismatch}")
            lines.append(f"  localize: weights {weights}{rule}; {pairs}")
        if self.note:
            lines.append(f"  localize: {printable(self.note)}")
        return lines


# -- pairing -----------------------------------------------------------------------------------


def _label(node) -> str:
    """How the report names a node: its name, else its first output's."""
    return node.name or (node.outputs[0].name if node.outputs and node.outputs[0].name else node.op_type)


def _has_subgraph(node) -> bool:
    import onnx_ir as ir

    return any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values())


def _constant_values(graph) -> set:
    """The values of ``graph`` computed from initializers and Constants alone (weights and their
    Transposes, shapes, axes): what a node reads, not what localization compares."""
    constant = set(graph.initializers.values())
    for node in graph:
        computed = (node.op_type == "Constant"
                    or (node.inputs and all(v is None or v in constant for v in node.inputs)
                        and not _has_subgraph(node) and not node.op_type.startswith("Random")))
        if computed:
            constant.update(node.outputs)
    return constant


def _weights(node, constant: set) -> tuple[str, ...]:
    """The float initializers ``node`` reads, directly or through constant-only nodes."""
    found, seen = set(), set()
    stack = [v for v in node.inputs if v is not None and v in constant]
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        if value.is_initializer():
            if value.dtype is not None and value.dtype.is_floating_point():
                found.add(value.name)
        elif value.producer() is not None:
            stack.extend(v for v in value.producer().inputs if v is not None)
    return tuple(sorted(found))


class _Side:
    """One graph's main-graph values and nodes by name, and which values are constant."""

    def __init__(self, graph):
        self.graph = graph
        self.constant = _constant_values(graph)
        self.nodes = {node.name: node for node in graph if node.name}
        self.values = {v.name: v for node in graph for v in node.outputs if v.name}

    def activation(self, name: str | None):
        """The value ``name`` when a node computes it from the graph's inputs, else None."""
        value = self.values.get(name) if name else None
        return value if value is not None and value not in self.constant else None

    def same_node(self, node):
        """The node of ``node``'s name and op type, else None."""
        other = self.nodes.get(node.name) if node.name else None
        return other if other is not None and other.op_type == node.op_type else None


def _counterpart(value, reference: _Side):
    """The reference value that the consumers of ``value`` read in its place: each consumer with
    a node of its name and op type in the reference reads one value at that input, and they agree."""
    found = set()
    for use in value.uses():
        if use.node.graph is not value.graph:
            continue  # a subgraph's reader has no name of the main graph to pair by
        other = reference.same_node(use.node)
        if other is not None and use.idx < len(other.inputs) and other.inputs[use.idx] is not None:
            found.add(other.inputs[use.idx])
    if len(found) != 1:
        return None
    (value,) = found
    return value if value not in reference.constant else None


def _one_live_input(node, constant: set):
    """The one input of an Add that is not constant (the other being its bias), else None."""
    if node is None or node.op_type != "Add":
        return None
    live = [v for v in node.inputs if v is not None and v not in constant]
    return live[0] if len(live) == 1 else None


def _plan_pairs(reference: _Side, candidate: _Side) -> dict:
    """Candidate value → (reference values, axis) for the Splits of a fused MatMul or Gemm (see
    the module's docstring): each slice, the Split's input, and up through bias Adds."""
    found: dict = {}
    for split in candidate.graph:
        if split.op_type != "Split" or not split.inputs or split.inputs[0] in candidate.constant:
            continue
        parts = [_counterpart(out, reference) for out in split.outputs]
        if not parts or any(p is None for p in parts) or len(set(parts)) != len(parts):
            continue
        axis = split.attributes["axis"].as_int() if "axis" in split.attributes else 0
        for out, part in zip(split.outputs, parts):
            found.setdefault(out, ((part.name,), None))
        fused = split.inputs[0]
        while fused is not None and fused not in found:
            found[fused] = (tuple(p.name for p in parts), axis)
            fused = _one_live_input(fused.producer(), candidate.constant)
            parts = [_one_live_input(p.producer(), reference.constant) for p in parts]
            if fused is None or any(p is None for p in parts):
                break
    return found


def pair_values(reference, candidate) -> tuple[list[Pair], int]:
    """The candidate's intermediate values paired with the reference's (see the module's
    docstring), in the candidate's topological order; and how many of its values found no pair.

    ``reference``, ``candidate``: onnx-ir main graphs.
    """
    ref, cand = _Side(reference), _Side(candidate)
    planned = _plan_pairs(ref, cand)
    pairs, unpaired = [], 0
    for node in candidate:
        if all(v is None or v in cand.constant for v in node.outputs):
            continue
        same = ref.same_node(node)
        weights = _weights(node, cand.constant)
        for index, value in enumerate(node.outputs):
            if not value.name:
                continue
            other = ref.activation(value.name)
            if other is not None and other.producer().op_type != node.op_type:
                other = None
            if other is None and same is not None and index < len(same.outputs):
                other = ref.activation(same.outputs[index].name)
            if other is not None:
                pairs.append(Pair(_label(node), node.op_type, value.name, (other.name,), None, BY_NAME, weights))
            elif value in planned:
                names, axis = planned[value]
                pairs.append(Pair(_label(node), node.op_type, value.name, names, axis, BY_PLAN, weights))
            else:
                unpaired += 1
    return pairs, unpaired


# -- running segments ----------------------------------------------------------------------------


class _Segments:
    """Sub-models of one graph, from its inputs to chosen values, run on onnxruntime."""

    def __init__(self, model, folder: str, provider: str, what: str, initializers: Mapping[str, object]):
        self.model, self.folder, self.provider, self.what = model, folder, provider, what
        self.initializers = initializers

    def run(self, names: list[str], feeds: Mapping[str, np.ndarray]) -> dict:
        """The values ``names`` for ``feeds``, computed by the nodes they need and no others."""
        import onnx_ir as ir

        graph = self.model.graph
        cut = ir.convenience.extract(graph, inputs=list(graph.inputs), outputs=names)
        proto = ir.serde.serialize_model(ir.Model(cut, ir_version=self.model.ir_version,
                                                  functions=list(self.model.functions.values())))
        shared = {name: v for name, v in self.initializers.items() if name in cut.initializers}
        data = proto.SerializeToString()
        del proto, cut
        sess = session(data, self.provider, self.what, shared, external_folder=self.folder)
        del data
        # only the inputs the segment reads: onnxruntime refuses a name its graph lacks (an io.npz holds outputs)
        wanted = {i.name for i in sess.get_inputs()}
        return run(sess, {name: value for name, value in feeds.items() if name in wanted}, self.what)


def _rules(model) -> tuple[dict[str, str], str]:
    """Initializer name → the rule whose step wrote it, from the provenance ``fusectl export``
    recorded in ``model``; and a note when there is none to read."""
    text = model.metadata_props.get(METADATA_KEY)
    if text is None:
        return {}, "the candidate records no fusectl provenance, so no rule is named"
    try:
        provenance = Provenance.loads(text, "the candidate's metadata")
    except CheckpointError as e:
        return {}, f"no rule is named: {e}"
    rules = {}
    for group in provenance.plan.groups:
        for step in group.steps:
            rules.update(dict.fromkeys(step.outputs, group.rule))
    for alias, unique in provenance.aliases.items():
        if alias in rules:
            rules.setdefault(unique, rules[alias])
    return rules, ""


def _reference_array(pair: Pair, values: Mapping, like: np.ndarray) -> np.ndarray | None:
    """The reference side of ``pair`` shaped as ``like``, else None (not tensors, or parts that
    do not concatenate to its shape)."""
    parts = [values[name] for name in pair.reference]
    if not all(isinstance(p, np.ndarray) for p in parts):
        return None
    if pair.axis is None:
        return parts[0]
    try:
        joined = np.concatenate(parts, axis=pair.axis)
    except ValueError:  # other ranks, other sizes off the axis, or no such axis
        return None
    return joined if joined.shape == like.shape else None


def _load(path: str, upcast: bool):
    """``path`` as onnx-ir loads it (bf16 upcast to float32 when ``upcast``)."""
    from ..onnx.graph import load_model

    if not upcast:
        return load_model(path)
    import onnx
    import onnx_ir as ir

    from .upcast import upcast_bfloat16

    return ir.serde.deserialize_model(onnx.ModelProto.FromString(upcast_bfloat16(path)))


def localize_models(reference: str, candidate: str, feeds: Mapping[str, np.ndarray], *, provider: str,
                    atol: float | None = None, rtol: float | None = None,
                    initializers: Mapping[str, object] | None = None, upcast: bool = False,
                    note: str = "") -> Localization:
    """Where ``candidate`` first computes other values than ``reference`` on ``feeds``.

    Runs both graphs a segment at a time (see the module's docstring) on ``provider`` (a
    resolved onnxruntime provider) and compares paired values with ``atol``/``rtol`` (None: by
    dtype). ``initializers``: OrtValues both graphs share (verify's shared initializers), handed
    to each segment's session that reads them; ``upcast``: run bf16 models as float32, as verify
    does on CPU; ``note`` starts the result's note (which inputs were used). A segment onnxruntime
    cannot run ends the search, said in the note; so does a graph onnx-ir cannot read (onnxruntime
    may run what onnx-ir cannot represent).

    >>> result = localize_models("fixtures/onnx/lstm/model.onnx", "fixtures/onnx/lstm/model.onnx",
    ...                          dict(np.load("fixtures/onnx/lstm/io.npz")), provider="CPUExecutionProvider")
    >>> result.first is None and result.compared > 0
    True
    """
    try:
        ref_model, cand_model = _load(reference, upcast), _load(candidate, upcast)
    except CheckpointError as e:  # onnxruntime runs graphs onnx-ir cannot represent (maps)
        return Localization(note="; ".join([*([note] if note else []), f"not localized: {e}"]))
    pairs, unpaired = pair_values(ref_model.graph, cand_model.graph)
    rules, rules_note = _rules(cand_model)
    result = Localization(paired_by={BY_NAME: sum(p.by == BY_NAME for p in pairs),
                                     BY_PLAN: sum(p.by == BY_PLAN for p in pairs)})
    notes = [note] if note else []
    if unpaired:
        notes.append(f"{unpaired} value(s) of the candidate have no pair in the reference")
    runners = [_Segments(model, os.path.dirname(os.path.abspath(path)), provider, path, initializers or {})
               for model, path in ((ref_model, reference), (cand_model, candidate))]
    skipped, start, size = 0, 0, FIRST_SEGMENT
    while start < len(pairs) and result.first is None:
        segment = pairs[start:start + size]
        result.segments += 1
        try:
            ref_out = runners[0].run(list(dict.fromkeys(n for p in segment for n in p.reference)), feeds)
            cand_out = runners[1].run([p.output for p in segment], feeds)
        except VerifyError as e:
            notes.append(f"stopped at segment {result.segments}: {e}")
            break
        for pair in segment:
            candidate_value = cand_out[pair.output]
            reference_value = (_reference_array(pair, ref_out, candidate_value)
                               if isinstance(candidate_value, np.ndarray) else None)
            if reference_value is None or reference_value.dtype != candidate_value.dtype:
                skipped += 1
                continue
            result.compared += 1
            comparison = compare(pair.output, reference_value, candidate_value, atol, rtol)
            if not comparison.passed:
                named = sorted({rules[w] for w in pair.weights if w in rules})
                result.first = {"node": pair.node, "op_type": pair.op_type, "output": pair.output,
                                "reference_value": pair.reference_text, "candidate_value": pair.output,
                                "weights": list(pair.weights), "rule": ", ".join(named) or None,
                                "comparison": comparison.to_json()}
                break
        held = sum(a.nbytes for out in (ref_out, cand_out) for a in out.values() if isinstance(a, np.ndarray))
        del ref_out, cand_out
        start += len(segment)
        fit = int(SEGMENT_BYTES * len(segment) / max(held, 1))
        size = max(1, min(MAX_SEGMENT, GROWTH * len(segment), fit))
    if skipped:
        notes.append(f"{skipped} pair(s) not compared (not tensors, or other shapes or dtypes)")
    if result.first is not None and rules_note:
        notes.append(rules_note)
    result.note = "; ".join(notes)
    return result
