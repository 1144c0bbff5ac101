"""The rewrite passes of ``fusectl export``: onnx-ir in-place passes over one model.

Each pass takes the :class:`~fusectl.onnx.export_context.ExportContext` it shares with the
others; ``fusectl.onnx.export.export_passes`` lists them in the order they run. A pass's
``requires`` checks that it runs on the context's model and after the passes it needs.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PreconditionError

from ..plan import Plan, Step, StepGroup
from ..table import ParamTable
from ..executor import recover_inputs
from .export_context import SET_ASIDE, ExportContext, ExportError, Pairing
from .exporter_folds import BatchNormFold, recognise_batchnorm_folds, same_within_tolerance
from .graph import initializer_views
from .namemap import NameMap, map_names


class ExportPass(InPlacePass):
    """A pass of the export: it rewrites the model of ``ctx`` and only that one."""

    def __init__(self, ctx: ExportContext):
        self.ctx = ctx

    def requires(self, model: ir.Model) -> None:
        if model is not self.ctx.model:
            raise PreconditionError(f"{type(self).__name__} runs on the model its ExportContext holds")


class PairedExportPass(ExportPass):
    """A pass that works on the initializers ``PairInitializersPass`` paired."""

    def requires(self, model: ir.Model) -> None:
        super().requires(model)
        if self.ctx.pairing is None:
            raise PreconditionError(f"{type(self).__name__} runs after PairInitializersPass")

    @property
    def pairing(self) -> Pairing:
        return self.ctx.pairing


# -- 1. pairing --------------------------------------------------------------------------------


class PairInitializersPass(ExportPass):
    """Pair the graph's initializers with the names the checkpoint had before its plan, and set
    the paired ones aside (renamed ``fusectl_graph/NAME``) for the passes after this one.

    The names are recovered by inverting the plan's exact layout steps (numeric, one-way
    steps leave names without data: name matching only). An initializer named like a
    checkpoint tensor but holding other data is explained as a Conv + BatchNorm fold the
    exporter made (the Conv then takes the fold of the checkpoint's own tensors), or refused.
    Initializers the exporter already made in the fused layout (an LSTM's packed W/R/B) pair
    with the checkpoint's own tensors (``Pairing.direct``).
    """

    def requires(self, model: ir.Model) -> None:
        super().requires(model)
        if self.ctx.pairing is not None:
            raise PreconditionError("the graph's initializers are paired already")

    def call(self, model: ir.Model) -> PassResult:
        ctx, graph = self.ctx, model.graph
        readers, specs = initializer_views(model)
        original = recover_inputs(ctx.checkpoint.table, ctx.plan)
        mapping = map_names(original, readers, specs)
        folds = recognise_batchnorm_folds(graph, original, mapping)
        explained_ckpt = set().union(*(f.checkpoint_names() for f in folds))
        explained_graph = set().union(*(f.graph_initializers() for f in folds))
        by_name: dict[str, list[tuple[ir.Value, bool]]] = {}
        for p in mapping.pairs:
            if p.data == "differs":
                continue
            value = graph.initializers[p.initializer]
            by_name.setdefault(p.structural, []).append((value, p.how == "transposed"))
        # the graph's paired initializers move aside, freeing their names for the checkpoint's
        # initializers the exporter already made in the fused layout: paired with the
        # checkpoint's own tensors
        rest = [n for n in mapping.unmatched_graph if n not in explained_graph]
        direct = map_names(ctx.checkpoint.table, {n: readers[n] for n in rest}, {n: specs[n] for n in rest})
        _refuse_stale_weights(ctx, original, mapping, direct, specs, explained_ckpt)
        aside = {p.initializer for p in mapping.pairs} | {p.initializer for p in direct.pairs}
        for name in aside:
            value = graph.initializers.pop(name)
            value.name = f"{SET_ASIDE}{name}"
            graph.register_initializer(value)
        for fold in folds:
            _use_checkpoint_fold(ctx, fold)
        ctx.pairing = Pairing(
            by_name,
            {p.initializer: (p.structural, p.how == "transposed") for p in direct.pairs},
            frozenset(p.structural for p in direct.pairs),
        )
        return PassResult(model, bool(aside or folds))


def _use_checkpoint_fold(ctx: ExportContext, fold: BatchNormFold) -> None:
    """The Conv the exporter folded takes the fold of the checkpoint's own tensors."""
    weight = ctx.builder.constant(fold.folded_weight, f"fusectl_fold/{fold.weight}")
    bias = ctx.builder.constant(fold.folded_bias, f"fusectl_fold/{fold.bias or fold.weight + '_bias'}")
    fold.node.replace_input_with(1, weight)
    fold.node.replace_input_with(2, bias)
    ctx.counts.folded += 1


def _refuse_stale_weights(ctx: ExportContext, original: ParamTable, mapping: NameMap, direct: NameMap,
                          specs, explained: set[str]) -> None:
    """An unpaired graph initializer shaped like an unpaired checkpoint tensor is a weight
    whose data differs: keeping it would export the graph's old weight silently."""
    unpaired = [n for n in mapping.unmatched_checkpoint if original[n].has_data()
                and n not in {p.structural for p in mapping.pairs} and n not in explained]
    shapes = {}
    for name in unpaired:
        spec = original.spec(name)
        shapes.setdefault((str(spec.dtype.numpy), spec.shape), name)
        shapes.setdefault((str(spec.dtype.numpy), spec.shape[::-1]), name)
    for initializer in direct.unmatched_graph:
        dtype, shape = specs[initializer]
        name = shapes.get((dtype, tuple(shape)))
        if name is not None and len(shape) >= 1 and int(np.prod(shape)) > 1:
            raise ExportError(
                f"graph initializer {initializer!r} {list(shape)} pairs with no tensor of "
                f"{ctx.checkpoint.path}, though {name!r} has its shape: their data differ. Was "
                f"{ctx.graph_path} exported from the model this checkpoint was fused from?"
            )


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
        for initializer, (name, transposed) in pairing.direct.items():
            old = model.graph.initializers.get(f"{SET_ASIDE}{initializer}")
            if old is not None and old.uses():  # a fold may have replaced its uses already
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


# -- 4. one MatMul for the parts of a fused weight -----------------------------------------------


class FuseSharedMatMulPass(PairedExportPass):
    """MatMul consumers of the parts of one fused weight (Split → Transpose → MatMul) that
    share their input become one MatMul followed by a Split; when each is followed by an Add
    of the parts of one fused bias, one Add of the fused bias comes before the Split."""

    def call(self, model: ir.Model) -> PassResult:
        ctx, b = self.ctx, self.ctx.builder
        before = ctx.counts.fused_matmuls
        for split in [n for n in model.graph if n.op_type == "Split"]:
            source = split.inputs[0]
            if not ctx.is_param(source) or split.attributes.get("axis") is None:
                continue
            if split.attributes["axis"].value != 0 or len(source.shape or ()) != 2:
                continue
            matmuls = _matmuls_on_parts(split)
            if matmuls is None or len({id(m.inputs[0]) for m in matmuls}) != 1:
                continue
            x = matmuls[0].inputs[0]
            sizes = split.inputs[1].const_value.numpy().tolist()
            y = b.one("MatMul", [x, b.one("Transpose", [source], perm=[1, 0])])
            outs = [m.outputs[0] for m in matmuls]
            bias = self._shared_bias(outs)
            if bias is not None:
                bias_source, adds = bias
                y = b.one("Add", [y, bias_source])
                outs = [a.outputs[0] for a in adds]
            parts = b.node("Split", [y, b.ints(sizes)], len(sizes), axis=-1)
            for old, new in zip(outs, parts):
                ctx.replace(old, new)
            ctx.counts.fused_matmuls += 1
        return PassResult(model, ctx.counts.fused_matmuls > before)

    def _shared_bias(self, outs):
        """(the fused bias, the Adds) when each of ``outs`` is added to a part of one split
        parameter, in order; else None."""
        adds, biases = [], []
        for out in outs:
            uses = out.uses()
            if len(uses) != 1 or uses[0].node.op_type != "Add":
                return None
            add = uses[0].node
            other = add.inputs[1 - uses[0].idx]
            adds.append(add)
            biases.append(other)
        producers = {id(b.producer()) for b in biases if b.producer() is not None}
        if len(producers) != 1:
            return None
        split = biases[0].producer()
        if split.op_type != "Split" or list(split.outputs) != biases or not self.ctx.is_param(split.inputs[0]):
            return None
        return split.inputs[0], adds


def _matmuls_on_parts(split: ir.Node) -> list[ir.Node] | None:
    """The MatMul reading each output of ``split`` through one Transpose (as its right-hand
    side, and nothing else reading it); None unless every output has one."""
    matmuls = []
    for part in split.outputs:
        uses = part.uses()
        if len(uses) != 1 or uses[0].node.op_type != "Transpose":
            return None
        transpose = uses[0].node
        consumers = [u.node for u in transpose.outputs[0].uses()]
        if (len(consumers) != 1 or consumers[0].op_type != "MatMul"
                or consumers[0].inputs[1] is not transpose.outputs[0]):
            return None
        matmuls.append(consumers[0])
    return matmuls


# -- 5. nothing of the graph's own weights is left -------------------------------------------------


class RefuseLeftoverGraphWeightsPass(PairedExportPass):
    """ExportError when the graph still uses an initializer set aside in pairing (run after
    unused nodes and initializers are removed): fusectl could not take it from the checkpoint,
    and saving it would export the graph's own weight. Changes nothing."""

    def call(self, model: ir.Model) -> PassResult:
        leftovers = [v.name.split("/", 1)[1] for v in model.graph.initializers.values()
                     if v.name.startswith(SET_ASIDE)]
        if leftovers:
            raise ExportError(f"the graph still uses {leftovers[:5]} that fusectl could not take from "
                              f"{self.ctx.checkpoint.path}")
        return PassResult(model, False)
