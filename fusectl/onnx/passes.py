"""The rewrite passes of ``fusectl export``: onnx-ir in-place passes over one model.

Each pass takes the :class:`~fusectl.onnx.export_context.ExportContext` it shares with the
others; ``fusectl.onnx.export.export_passes`` lists them in the order they run. A pass's
``requires`` checks that it runs on the context's model and after the passes it needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PreconditionError

from ..errors import quote
from ..steps import Plan, Step, StepGroup
from ..executor import recover_inputs
from .accounting import account_for_checkpoint, refuse_unpaired_checkpoint_tensors
from .export_context import SET_ASIDE, ExportContext, ExportError, Pairing
from .exporter_folds import BatchNormFold, recognise_batchnorm_folds, same_within_tolerance
from .graph_tensors import MAIN_GRAPH, GraphTensor, graph_tensors, in_use, tensor_views
from .namemap import NameMap, map_names


class ExportPass(InPlacePass):
    """A pass of the export: it rewrites the model of ``ctx`` and only that one."""

    def __init__(self, ctx: ExportContext):
        self.ctx = ctx

    def requires(self, model: ir.Model) -> None:
        """PreconditionError unless ``model`` is the model of this pass's ExportContext."""
        if model is not self.ctx.model:
            raise PreconditionError(f"{type(self).__name__} runs on the model its ExportContext holds")


class PairedExportPass(ExportPass):
    """A pass that works on the initializers ``PairInitializersPass`` paired."""

    def requires(self, model: ir.Model) -> None:
        """As ``ExportPass.requires``, and PreconditionError unless PairInitializersPass has run."""
        super().requires(model)
        if self.ctx.pairing is None:
            raise PreconditionError(f"{type(self).__name__} runs after PairInitializersPass")

    @property
    def pairing(self) -> Pairing:
        """The pairing PairInitializersPass left in the context."""
        return self.ctx.pairing


# -- 1. pairing --------------------------------------------------------------------------------


class PairInitializersPass(ExportPass):
    """Pair the graph's tensors — initializers and Constant nodes, in the main graph and in
    If/Loop/Scan bodies (``graph_tensors``) — with the names the checkpoint had before its
    plan, and set the paired ones aside (renamed ``fusectl_graph/NAME``; an initializer that is
    also a graph input stops being one) for the passes after this one.

    The names are recovered by inverting the plan's exact layout steps (numeric, one-way
    steps leave names without data: name matching only). An initializer named like a
    checkpoint tensor but holding other data is explained as a Conv + BatchNorm fold the
    exporter made (the Conv then takes the fold of the checkpoint's own tensors), or refused.
    Initializers the exporter already made in the fused layout (an LSTM's packed W/R/B) pair
    with the checkpoint's own tensors (``Pairing.direct``). Every checkpoint tensor must pair
    (``accounting.refuse_unpaired_checkpoint_tensors``): one that does not is refused, naming
    the graph's own tensors that could be stale copies of it. A graph tensor pairing with
    nothing is kept as the graph's own.
    """

    def requires(self, model: ir.Model) -> None:
        """As ``ExportPass.requires``, and PreconditionError when the graph is paired already."""
        super().requires(model)
        if self.ctx.pairing is not None:
            raise PreconditionError("the graph's initializers are paired already")

    def call(self, model: ir.Model) -> PassResult:
        """Pair and set aside (see the class); modified when anything was set aside or folded."""
        ctx, graph = self.ctx, model.graph
        tensors = graph_tensors(model)
        by_key = {t.key: t for t in tensors}
        readers, specs = tensor_views(tensors)
        original = recover_inputs(ctx.checkpoint.table, ctx.plan)
        mapping = map_names(original, readers, specs)
        _refuse_differing_constants(mapping, by_key)
        folds = recognise_batchnorm_folds(graph, original, mapping)
        explained_ckpt = set().union(*(f.checkpoint_names() for f in folds))
        explained_graph = set().union(*(f.graph_initializers() for f in folds))
        by_name: dict[str, list[tuple[ir.Value, bool]]] = {}
        for p in mapping.pairs:
            if p.data == "differs":
                continue
            by_name.setdefault(p.structural, []).append((by_key[p.initializer].value, p.how == "transposed"))
        # initializers the exporter already made in the fused layout: paired with the
        # checkpoint's own tensors
        rest = [n for n in mapping.unmatched_graph if n not in explained_graph]
        direct = map_names(ctx.checkpoint.table, {n: readers[n] for n in rest}, {n: specs[n] for n in rest})
        refuse_unpaired_checkpoint_tensors(ctx, original, set(by_name), explained_ckpt,
                                           {p.structural for p in direct.pairs},
                                           [by_key[k] for k in direct.unmatched_graph])
        # the graph's paired tensors move aside, freeing their names for the checkpoint's
        aside = sorted({p.initializer for p in mapping.pairs} | {p.initializer for p in direct.pairs})
        for key in aside:
            _set_aside(by_key[key])
        for fold in folds:
            _use_checkpoint_fold(ctx, fold)
        set_aside = set(aside) | explained_graph
        ctx.pairing = Pairing(
            by_name,
            {p.initializer: (by_key[p.initializer].value, p.structural, p.how == "transposed") for p in direct.pairs},
            frozenset(p.structural for p in direct.pairs),
            aside=tuple(by_key[k] for k in aside),
            unpaired=tuple(t for t in tensors if t.key not in set_aside),
            explained=frozenset(explained_ckpt),
        )
        return PassResult(model, bool(aside or folds))


def _set_aside(tensor: GraphTensor) -> None:
    """Rename a paired graph tensor ``fusectl_graph/NAME``. A paired initializer that is also
    a graph input (``keep_initializers_as_inputs=True``) stops being one: the checkpoint's
    parameter that replaces it is an initializer only, so onnxruntime treats it as a constant
    (it cannot fold or pre-pack an initializer a caller may override)."""
    value, graph = tensor.value, tensor.graph
    name = value.name
    if tensor.kind == "initializer":
        graph.initializers.pop(name)
        value.name = f"{SET_ASIDE}{name}"
        graph.register_initializer(value)
        if value in graph.inputs:
            graph.inputs.remove(value)
    else:
        value.name = f"{SET_ASIDE}{name}"


def _use_checkpoint_fold(ctx: ExportContext, fold: BatchNormFold) -> None:
    """The Conv the exporter folded takes the fold of the checkpoint's own tensors."""
    weight = ctx.builder.constant(fold.folded_weight, f"fusectl_fold/{fold.weight}")
    bias = ctx.builder.constant(fold.folded_bias, f"fusectl_fold/{fold.bias or fold.weight + '_bias'}")
    fold.node.replace_input_with(1, weight)
    fold.node.replace_input_with(2, bias)
    ctx.counts.folded += 1


def _refuse_differing_constants(mapping: NameMap, by_key: dict[str, GraphTensor]) -> None:
    """A Constant or subgraph initializer named like a checkpoint tensor but holding other data
    is a stale weight (only the main graph's Conv initializers can hold an exporter's fold)."""
    for p in mapping.differing():
        tensor = by_key[p.initializer]
        if tensor.kind != "initializer" or tensor.where != MAIN_GRAPH:
            raise ExportError(f"graph {tensor.describe()} has the name of checkpoint tensor {quote(p.structural)} "
                              "but holds other data; was the graph exported from the model this checkpoint "
                              "was fused from?")


# -- 2. numeric steps --------------------------------------------------------------------------


class FoldReparametrizationsPass(PairedExportPass):
    """Find the plan's numeric steps in the graph and fold them there.

    Each step's op folds itself (``op.fold_in_graph``) through a :class:`GraphFold`: a
    weight_norm or spectral_norm subgraph over initializers is replaced by the folded weight;
    Conv/Gemm/ConvTranspose + BatchNormalization becomes one layer on the folded weight and
    bias. A step the exporter folded already (the graph holds the checkpoint's result)
    counts as folded and is left as it is. Exact steps are left to
    ``RebindInitializersPass``; renames are followed.
    """

    def call(self, model: ir.Model) -> PassResult:
        """Fold the plan's numeric steps (see the class); modified when a fold was made."""
        ctx, pairing = self.ctx, self.pairing
        before = ctx.counts.folded
        current = {n: list(vs) for n, vs in pairing.by_name.items()}
        for group, consumed in zip(ctx.plan.groups, _consumed_later(ctx.plan)):
            fold = GraphFold(ctx, group)
            for step in group.steps:
                if step.op.renames:
                    if step.inputs[0] in current:
                        current[step.outputs[0]] = current.pop(step.inputs[0])
                    continue
                if step.op.exact:
                    continue
                for name in step.outputs:
                    if name in consumed or name not in ctx.checkpoint.table:
                        raise ExportError(f"{group.describe()}: {name!r} is transformed again later; "
                                          "export supports numeric folds only on final tensors")
                if all(o in pairing.direct_names for o in step.outputs):
                    # the exporter folded it already and the graph holds the checkpoint's result
                    ctx.counts.folded += 1
                    continue
                values = [found[0][0] if found else None for found in map(current.get, step.inputs)]
                if not step.op.graph_foldable:
                    fold.require_all(step, values)
                    raise ExportError(f"{group.describe()}: export does not handle {step.op.kind}")
                step.op.fold_in_graph(fold, step, values)
                ctx.counts.folded += 1
        return PassResult(model, ctx.counts.folded > before)


def _consumed_later(plan: Plan) -> list[set[str]]:
    """For each group of ``plan``, the tensors the groups after it read."""
    out, later = [], set()
    for group in reversed(plan.groups):
        out.append(set(later))
        later |= {n for s in group.steps for n in s.inputs}
    return out[::-1]


class GraphFold:
    """The graph rewrites an op's ``fold_in_graph`` calls back, for the steps of one ``group``.

    ``values`` are the graph initializers of the step's inputs, None where the graph has none.
    """

    def __init__(self, ctx: ExportContext, group: StepGroup):
        self.ctx, self.group = ctx, group

    def require_all(self, step: Step, values) -> None:
        """ExportError naming the step's inputs the graph has no initializer for."""
        missing = [n for n, v in zip(step.inputs, values) if v is None]
        if missing:
            raise ExportError(f"{self.group.describe()}: the graph has no initializer for {missing}; "
                              "export the unfolded model with constant folding off")

    def replace_subgraph(self, step: Step, values) -> None:
        """Replace the subgraph computing the step's output from its initializers (with
        constants) by the checkpoint's folded tensor."""
        self.require_all(step, values)
        graph = self.ctx.model.graph
        cone_values = set(values)
        cone_nodes = []
        changed = True
        while changed:
            changed = False
            for node in list(graph):
                if node in cone_nodes or not node.inputs:
                    continue
                ins = [v for v in node.inputs if v is not None]
                if any(v in cone_values for v in ins) and all(
                    v in cone_values or v.is_initializer() or _is_constant_output(v) for v in ins
                ):
                    cone_nodes.append(node)
                    cone_values.update(node.outputs)
                    changed = True
        frontier = [v for n in cone_nodes for v in n.outputs
                    if any(use.node not in cone_nodes for use in v.uses()) or v in graph.outputs]
        if len(frontier) != 1:
            raise ExportError(f"{self.group.describe()}: expected one subgraph computing {step.outputs[0]!r} from "
                              f"{list(step.inputs)}, found {len(frontier)} result(s)")
        self.ctx.replace(frontier[0], self.ctx.param(step.outputs[0]))

    def fold_batchnorm(self, step: Step, values) -> None:
        """Conv/Gemm/ConvTranspose on the step's weight + BatchNormalization becomes one layer
        on the checkpoint's folded weight and bias. A graph with the weight but without the
        BatchNorm's initializers may hold the fold already: see ``_rebind_folded_layer``."""
        if values[0] is not None and not all(v is not None for v in values[2:]):
            self._rebind_folded_layer(step, values[0])
            return
        self.require_all(step, values)
        weight = values[0]
        layers = [u.node for u in weight.uses() if u.node.op_type in ("Conv", "Gemm", "ConvTranspose") and u.idx == 1]
        done = 0
        for layer in layers:
            out = layer.outputs[0]
            users = [u.node for u in out.uses()]
            if len(users) != 1 or users[0].op_type != "BatchNormalization":
                continue
            bn = users[0]
            inputs = [layer.inputs[0], self.ctx.param(step.outputs[0]), self.ctx.param(step.outputs[1])]
            attrs = {k: a.value for k, a in layer.attributes.items()}
            fused = self.ctx.builder.one(layer.op_type, inputs, **attrs)
            self.ctx.replace(bn.outputs[0], fused)
            done += 1
        if not done:
            raise ExportError(f"{self.group.describe()}: no Conv/Gemm/ConvTranspose on {step.inputs[0]!r} "
                              "followed by BatchNormalization in the graph")

    def _rebind_folded_layer(self, step: Step, weight: ir.Value) -> None:
        """The graph's Conv already holds the fold (the dynamo exporter folds BatchNorm into
        the Conv and keeps the Conv's names): it takes the checkpoint's folded weight and bias
        when they equal the graph's within the dtype's tolerance, else ExportError."""
        layers = [u.node for u in weight.uses() if u.node.op_type == "Conv" and u.idx == 1]
        folded_weight, folded_bias = (self.ctx.checkpoint.table[n] for n in step.outputs)
        for layer in layers:
            bias = layer.inputs[2] if len(layer.inputs) > 2 else None
            if bias is None or not (same_within_tolerance(weight, folded_weight)
                                    and same_within_tolerance(bias, folded_bias)):
                raise ExportError(
                    f"{self.group.describe()}: the graph has no BatchNormalization for {step.inputs[2:]} "
                    f"and its Conv on {weight.name.split('/', 1)[-1]!r} does not hold the checkpoint's "
                    f"folded {list(step.outputs)}; export the unfolded model with its optimizations off"
                )
            layer.replace_input_with(1, self.ctx.param(step.outputs[0]))
            layer.replace_input_with(2, self.ctx.param(step.outputs[1]))
        if not layers:
            raise ExportError(f"{self.group.describe()}: the graph has no initializer for {list(step.inputs[2:])} "
                              "and no Conv on the weight; export the unfolded model with constant folding off")


def _is_constant_output(value: ir.Value) -> bool:
    producer = value.producer()
    return producer is not None and producer.op_type == "Constant"


# -- 3. everything else from the checkpoint ------------------------------------------------------


class RebindInitializersPass(PairedExportPass):
    """Rebuild every set-aside initializer the graph still uses from the checkpoint's unique
    parameters: the same tensor, its transpose, or ONNX nodes that un-fuse a layout step
    (``op.onnx_unfuse``: Split, Reshape, ...), through renames. Tied parameters are one
    initializer. Run after the folds' dead subgraphs are removed: their initializers have
    no uses left and are not rebuilt."""

    def call(self, model: ir.Model) -> PassResult:
        """Rebuild the set-aside initializers in use (see the class); modified when one was."""
        ctx, pairing = self.ctx, self.pairing
        before = ctx.counts.rebound
        available = self._recoverable()
        for name, graph_values in pairing.by_name.items():
            for old, transposed in graph_values:
                if not old.uses():
                    continue
                if name not in available:
                    raise ExportError(f"the graph uses {name!r} (initializer {old.name.split('/', 1)[-1]!r}), "
                                      f"which {ctx.checkpoint.path} cannot provide")
                ctx.rebind(old, available[name](), transposed)
        for old, name, transposed in pairing.direct.values():
            if old.uses():  # a fold may have replaced its uses already
                ctx.rebind(old, ctx.param(name), transposed)
        return PassResult(model, ctx.counts.rebound > before)

    def _recoverable(self) -> dict:
        """Name before the plan → how to build it from the checkpoint (called only for the
        names the graph still uses, so only those nodes are added)."""
        ctx = self.ctx
        available = {name: (lambda n=name: ctx.param(n)) for name in ctx.checkpoint.table.names()}
        for group in reversed(ctx.plan.groups):
            for step in reversed(group.steps):
                if step.op.renames and step.outputs[0] in available:
                    available[step.inputs[0]] = available[step.outputs[0]]
                elif step.op.onnx_unfusable and all(o in available for o in step.outputs):
                    outs = [available[o] for o in step.outputs]
                    built: list = []

                    def make(step=step, outs=outs, built=built):
                        if not built:
                            built.extend(step.op.onnx_unfuse(ctx.builder, step.input_specs, step.output_specs,
                                                             [f() for f in outs]))
                        return built

                    for k, name in enumerate(step.inputs):
                        available[name] = (lambda k=k, make=make: make()[k])
        return available


# -- 4. one MatMul or Gemm for the parts of a fused weight ----------------------------------------


@dataclass(frozen=True, eq=False)
class _Projection:
    """A MatMul or Gemm multiplying by part ``part`` of a split fused weight; ``oriented``:
    whether it multiplies by the part as the fused layout's projection ([out, in] parts used
    transposed, [in, out] parts as they are)."""

    node: ir.Node
    part: int
    oriented: bool

    @property
    def label(self) -> str:
        """How messages name the node: its name, else its first output's."""
        return self.node.name or self.node.outputs[0].name


class FuseSharedMatMulPass(PairedExportPass):
    """MatMul and Gemm consumers of the parts of one fused weight that share their input become
    one MatMul or Gemm on the fused weight followed by a Split of its output.

    The parts come from the Split that un-fuses a weight concatenated on axis 0 ([out, in]:
    Linear's layout, read through a Transpose by MatMul, by Gemm with transB=1 or through a
    Transpose with transB=0) or on axis 1 ([in, out]: Conv1D's, read as they are). A group
    fuses when, on one input and in one graph (a subgraph's consumers are fused inside it),
    every part has exactly one consumer and they are all MatMul — when each is followed by an
    Add of the parts of one fused bias, one Add of that bias comes before the Split — or all
    Gemm with equal alpha, beta and transA whose biases C are the parts of one fused bias,
    1-D tensors joined by a Concat, or absent. Parts and biases are followed through Identity
    copies, so a layer used N times (ALBERT) fuses in each of its N uses. Any other group is left
    as it is and reported in ``ExportCounts.not_fused`` with the reason.
    """

    def call(self, model: ir.Model) -> PassResult:
        """Fuse the groups that qualify (see the class); modified when one was fused."""
        ctx = self.ctx
        before = ctx.counts.fused_matmuls
        for split in [n for n in model.graph if n.op_type == "Split"]:
            source = split.inputs[0]
            if not ctx.is_param(source) or len(source.shape or ()) != 2:
                continue
            if len(split.inputs) < 2 or split.inputs[1] is None or split.inputs[1].const_value is None:
                continue
            axis = split.attributes["axis"].as_int() % 2 if "axis" in split.attributes else 0
            groups: dict[tuple[int, int], list[_Projection]] = {}
            for projection in _projections(split, axis):
                node = projection.node
                groups.setdefault((id(node.graph), id(node.inputs[0])), []).append(projection)
            for members in groups.values():
                why = self._fuse(split, axis, members)
                if why is not None:
                    ctx.counts.not_fused.append({"weight": source.name, "consumers": sorted(m.label for m in members),
                                                 "why": why})
        return PassResult(model, ctx.counts.fused_matmuls > before)

    def _fuse(self, split: ir.Node, axis: int, members: list[_Projection]) -> str | None:
        """Fuse one group of consumers on one input; the reason it cannot be, else None."""
        ctx, b = self.ctx, self.ctx.builder
        kinds = sorted({m.node.op_type for m in members})
        if len(kinds) > 1:
            return "the consumers on this input mix MatMul and Gemm"
        read = sorted(m.part for m in members)
        if read != list(range(len(split.outputs))):
            return (f"the consumers on this input read parts {read} of {len(split.outputs)}; "
                    "fusing needs each part read once")
        if not all(m.oriented for m in members):
            return "a consumer multiplies by its part in the fused layout's other orientation"
        members = sorted(members, key=lambda m: m.part)
        nodes = [m.node for m in members]
        x, source, graph = nodes[0].inputs[0], split.inputs[0], nodes[0].graph
        sizes = split.inputs[1].const_value.numpy().tolist()
        outs = [n.outputs[0] for n in nodes]
        if kinds == ["MatMul"]:
            weight = b.one("Transpose", [source], into=graph, perm=[1, 0]) if axis == 0 else source
            y = b.one("MatMul", [x, weight], into=graph)
            bias = self._shared_bias(outs)
            if bias is not None:
                bias_source, adds = bias
                y = b.one("Add", [y, bias_source], into=graph)
                outs = [a.outputs[0] for a in adds]
        else:
            attrs = {_gemm_attributes(n) for n in nodes}
            if len(attrs) != 1:
                return f"their Gemm attributes (alpha, beta, transA) differ: {sorted(attrs)}"
            alpha, beta, trans_a = attrs.pop()
            biases = [n.inputs[2] if len(n.inputs) > 2 else None for n in nodes]
            inputs = [x, source]
            if any(c is not None for c in biases):
                joined = self._joined_bias(biases, sizes, graph)
                if joined is None:
                    return ("their biases C do not join into one (each must be a part of one fused bias, "
                            "or a 1-D tensor as long as its part's output)")
                inputs.append(joined)
            y = b.one("Gemm", inputs, into=graph, alpha=alpha, beta=beta, transA=trans_a,
                      transB=1 if axis == 0 else 0)
        parts = b.node("Split", [y, b.ints(sizes)], len(sizes), into=graph, axis=-1)
        for old, new in zip(outs, parts):
            ctx.replace(old, new)
        ctx.counts.fused_matmuls += 1
        return None

    def _joined_bias(self, biases: list, sizes: list[int], graph: ir.Graph) -> ir.Value | None:
        """One bias for a fused Gemm: the fused parameter the biases are split from, in order,
        or a Concat of 1-D biases as long as their parts; None when they do not join."""
        if any(c is None for c in biases):
            return None
        sources = [_before_identities(c) for c in biases]
        producer = sources[0].producer()
        if (producer is not None and producer.op_type == "Split" and list(producer.outputs) == sources
                and self.ctx.is_param(producer.inputs[0])):
            return producer.inputs[0]
        shapes = [tuple(c.const_value.shape) if c.const_value is not None else
                  (tuple(c.shape) if c.shape is not None else None) for c in biases]
        if shapes != [(n,) for n in sizes]:
            return None
        return self.ctx.builder.one("Concat", biases, into=graph, axis=0)

    def _shared_bias(self, outs):
        """(the fused bias, the Adds) when each of ``outs`` is added to a part of one split
        parameter, in order; else None."""
        adds, biases = [], []
        for out in outs:
            uses = out.uses()
            if len(uses) != 1 or uses[0].node.op_type != "Add":
                return None
            add = uses[0].node
            adds.append(add)
            biases.append(_before_identities(add.inputs[1 - uses[0].idx]))
        producers = {id(b.producer()) for b in biases if b.producer() is not None}
        if len(producers) != 1:
            return None
        split = biases[0].producer()
        if split.op_type != "Split" or list(split.outputs) != biases or not self.ctx.is_param(split.inputs[0]):
            return None
        return split.inputs[0], adds


def _projections(split: ir.Node, axis: int) -> list[_Projection]:
    """Every MatMul or Gemm multiplying by an output of ``split`` (on ``axis`` of a 2-D
    weight) as its right-hand side, directly or through one 2-D Transpose, past Identity copies."""
    # [out, in] parts (axis 0) are multiplied by transposed, [in, out] parts as they are
    flips_wanted = 1 if axis == 0 else 0
    found = []
    for k, part in enumerate(split.outputs):
        for use in _uses_past_identities(part):
            reads = [(use.node, use.idx, 0)]
            if use.node.op_type == "Transpose" and _is_2d_transpose(use.node):
                reads = [(u.node, u.idx, 1) for u in _uses_past_identities(use.node.outputs[0])]
            for node, idx, flips in reads:
                if idx != 1 or node.op_type not in ("MatMul", "Gemm"):
                    continue
                if node.op_type == "Gemm" and "transB" in node.attributes:
                    flips += node.attributes["transB"].as_int()
                found.append(_Projection(node, k, flips % 2 == flips_wanted))
    return found


def _is_identity(node: ir.Node | None) -> bool:
    return node is not None and node.op_type == "Identity" and node.domain in ("", "ai.onnx")


def _uses_past_identities(value: ir.Value) -> list:
    """The uses of ``value``, an Identity node's standing for the Identity's own: a weight that
    several layers share reaches all but one of them through Identity copies (TorchScript keeps
    one of equal initializers and copies it for each other use: ALBERT's one layer used N
    times)."""
    found = []
    for use in value.uses():
        if _is_identity(use.node):
            found.extend(_uses_past_identities(use.node.outputs[0]))
        else:
            found.append(use)
    return found


def _before_identities(value: ir.Value) -> ir.Value:
    """``value``, or what the chain of Identity nodes producing it copies."""
    while _is_identity(value.producer()) and value.producer().inputs[0] is not None:
        value = value.producer().inputs[0]
    return value


def _is_2d_transpose(node: ir.Node) -> bool:
    perm = node.attributes.get("perm")
    return perm is None or list(perm.as_ints()) == [1, 0]


def _gemm_attributes(node: ir.Node) -> tuple[float, float, int]:
    """A Gemm's (alpha, beta, transA), with ONNX's defaults."""
    a = node.attributes
    return (a["alpha"].as_float() if "alpha" in a else 1.0, a["beta"].as_float() if "beta" in a else 1.0,
            a["transA"].as_int() if "transA" in a else 0)


# -- 5. nothing of the graph's own weights is left -------------------------------------------------


class RefuseLeftoverGraphWeightsPass(PairedExportPass):
    """ExportError when the graph still uses a tensor set aside in pairing (run after unused
    nodes and initializers are removed): fusectl could not take it from the checkpoint, and
    saving it would export the graph's own weight; or when the graph computes with none of the
    checkpoint's tensors. Set-aside subgraph initializers left without uses are removed. The
    graph's own tensors still in use are recorded as kept (``ExportCounts.kept_constants``)."""

    def call(self, model: ir.Model) -> PassResult:
        """Refuse leftovers, remove unused ones (see the class); modified when one was removed."""
        ctx, pairing = self.ctx, self.pairing
        leftovers = sorted((t for t in pairing.aside if in_use(t.value)), key=lambda t: t.key)
        if leftovers:
            detail = "; ".join(t.describe() for t in leftovers[:5])
            raise ExportError(f"the graph still uses {[t.key for t in leftovers[:5]]} that fusectl could not take "
                              f"from {ctx.checkpoint.path} ({detail}); saving them would export the graph's own "
                              "weights. Was the graph exported from the unfused model of this checkpoint?")
        removed = 0
        for tensor in pairing.aside:
            initializers = tensor.graph.initializers
            if tensor.kind == "initializer" and initializers.get(tensor.value.name) is tensor.value:
                del initializers[tensor.value.name]
                removed += 1
        if not ctx.params and not ctx.counts.folded and len(ctx.checkpoint.table.names()):
            raise ExportError(f"{ctx.graph_path} computes with none of the tensors of {ctx.checkpoint.path}: no graph "
                              "tensor (initializer or Constant) pairs with one by name, content or transposed "
                              "content. Export the graph from the model this checkpoint was fused from")
        kept = sorted((t for t in pairing.unpaired if in_use(t.value)), key=lambda t: t.key)
        ctx.counts.kept_constants = [{**t.to_json(), "why": _why_kept(t)} for t in kept]
        return PassResult(model, bool(removed))


# why a graph tensor that pairs with no checkpoint tensor is kept (``kept_constants``' "why")
KEPT_INTEGER = "integer"  # integer or bool: a shape, an axis, indices, a mask
KEPT_SCALAR = "scalar"  # one element: an epsilon, a scale
KEPT_GRAPH_OWN = "graph-own"  # float, and no unpaired checkpoint tensor has its shape: a rotary table


def _why_kept(tensor: GraphTensor) -> str:
    if tensor.dtype.startswith(("int", "uint", "bool")):
        return KEPT_INTEGER
    if tensor.size <= 1:
        return KEPT_SCALAR
    return KEPT_GRAPH_OWN


# -- 6. nothing of the checkpoint is left out -------------------------------------------------------


class AccountForCheckpointPass(PairedExportPass):
    """ExportError unless every unique parameter of the checkpoint that holds weights is an
    initializer the rewritten graph computes with, or went into a fold the exporter made
    (``accounting.account_for_checkpoint``; run last). The integer and bool tensors the graph
    does not read are recorded (``ExportCounts.unused``)."""

    def call(self, model: ir.Model) -> PassResult:
        """Account for the checkpoint (see the class); the model is not modified."""
        self.ctx.counts.unused = account_for_checkpoint(self.ctx, self.pairing)
        return PassResult(model, False)
