"""``fusectl export``: rewrite an exporter's graph of the unfused model to take the fused
checkpoint's parameters, as onnx-ir passes over a lazily loaded model.

1. The graph's initializers are paired (``namemap``) with the names the checkpoint had before
   its recorded plan; those names are recovered from the fused checkpoint by inverting the
   exact layout steps (numeric, one-way steps leave names without data: name matching only).
2. ``FoldReparametrizationsPass``: numeric steps are found in the graph — a weight_norm or
   spectral_norm subgraph over initializers is replaced by the folded weight; Conv/Gemm/
   ConvTranspose + BatchNormalization becomes one layer on the folded weight and bias.
3. ``RebindInitializersPass``: every other initializer the graph uses is rebuilt from the
   checkpoint's unique parameters: the same tensor, its transpose, or ONNX ops that un-fuse a
   layout step (Split, Reshape, ...). Tied parameters are one initializer.
4. ``FuseSharedMatMulPass``: MatMul/Gemm consumers of the parts of one fused weight that share
   their input become one MatMul (+ one bias Add) followed by a Split.
5. Unused nodes and initializers go; the model is sorted, saved (external data past 2 GB,
   tensors streamed from the checkpoint) and checked with ``onnx.checker`` by path.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from ..execute import Materializer
from ..io.checkpoint import Checkpoint
from ..io.output import atomic_output, temporary_name
from ..plan import Plan, Planner, StepGroup
from ..table import ParamTable
from ..tensors import LazyTensor, TensorSpec
from .graph import initializer_views, load_model
from .exporter_folds import BatchNormFold, recognise_batchnorm_folds, same_within_tolerance
from .namemap import NameMap, map_names
from .unfuse import LAYOUT_KINDS, unfuse_in_onnx

EXTERNAL_DATA_THRESHOLD = 2 * 10**9  # protobuf cannot hold a model past 2 GB


class ExportError(PlanError):
    """The graph does not have the structure the checkpoint's plan needs."""


@dataclass(frozen=True, eq=False)
class OpaqueTensor(LazyTensor):
    """A tensor that existed before a one-way or numeric step: its name and spec, no data."""

    spec: TensorSpec
    name: str

    def has_data(self) -> bool:
        return False

    def read(self):
        raise ExportError(f"{self.name!r} is not recoverable from the fused checkpoint")


def original_table(table: ParamTable, plan: Plan) -> ParamTable:
    """The names (and, through exact layout steps, the data) before ``plan`` ran."""
    planner = Planner(table.copy(), untie=True)
    for group in reversed(plan.groups):
        if all(s.op.exact and s.inverse() is not None for s in group.steps):
            planner.apply_group(Plan((group,)).inverse().groups[0])
            continue
        for step in reversed(group.steps):
            for name in step.outputs:
                planner.table.entries.pop(name, None)
            for name, spec in zip(step.inputs, step.input_specs):
                planner.table.entries[name] = OpaqueTensor(spec, name)
    return planner.table


class IRBuilder:
    """Appends onnx-ir nodes to a graph; the same interface as the probes' GraphBuilder."""

    def __init__(self, graph):
        import onnx_ir as ir

        self.ir, self.graph, self.count = ir, graph, 0

    def node(self, op: str, inputs, n_out: int = 1, **attrs):
        node = self.ir.node(op, inputs, attributes=attrs or None, num_outputs=n_out)
        for k, out in enumerate(node.outputs):
            self.count += 1
            out.name = f"fusectl_{op.lower()}_{self.count}"
        self.graph.append(node)
        return list(node.outputs)

    def one(self, op: str, inputs, **attrs):
        return self.node(op, inputs, 1, **attrs)[0]

    def ints(self, values):
        return self.constant(np.asarray(list(values), np.int64))

    def constant(self, array: np.ndarray, name: str | None = None):
        self.count += 1
        name = name or f"fusectl_const_{self.count}"
        value = self.ir.Value(name=name, const_value=self.ir.tensor(array, name=name))
        self.graph.register_initializer(value)
        return value


@dataclass
class ExportReport:
    output: str
    initializers: int
    fused_matmuls: int
    folded: int
    rebound: int
    external_data: bool


class Exporter:
    def __init__(self, checkpoint: Checkpoint, graph_path: str):
        import onnx_ir as ir

        self.ir = ir
        self.ckpt = checkpoint
        self.graph_path = graph_path
        self.model = load_model(graph_path)
        self.graph = self.model.graph
        opset = self.model.opset_imports.get("", 0)
        if opset < 13:
            raise ExportError(f"{graph_path}: opset {opset}; export needs opset 13 or newer")
        self.plan = checkpoint.provenance.plan if checkpoint.provenance else Plan()
        self.b = IRBuilder(self.graph)
        self.params: dict[str, object] = {}  # unique name -> initializer value
        self.folded = 0
        self.rebound = 0
        self.fused_matmuls = 0

    # -- checkpoint parameters as initializers ------------------------------------------
    def param(self, name: str):
        """The initializer holding checkpoint tensor ``name`` (one per unique parameter)."""
        table = self.ckpt.table
        if name not in table:
            raise ExportError(f"{name!r} is not in {self.ckpt.path}")
        unique = table.unique_name(name)
        if unique not in self.params:
            tensor = table[unique]
            spec = tensor.spec
            lazy = self.ir.LazyTensor(
                lambda t=tensor: self.ir.tensor(Materializer([t]).array(t)),
                dtype=self.ir.DataType(spec.dtype.onnx), shape=self.ir.Shape(spec.shape), name=unique,
            )
            value = self.ir.Value(name=unique, const_value=lazy, shape=self.ir.Shape(spec.shape),
                                  type=self.ir.TensorType(self.ir.DataType(spec.dtype.onnx)))
            self.graph.register_initializer(value)
            self.params[unique] = value
        return self.params[unique]

    # -- 1. pairing ------------------------------------------------------------------------
    def pair(self) -> NameMap:
        readers, specs = initializer_views(self.model)
        original = original_table(self.ckpt.table, self.plan)
        mapping = map_names(original, readers, specs)
        # initializers named like checkpoint tensors but holding folded values: explained as
        # the exporter's own Conv+BatchNorm folds, or refused
        folds = recognise_batchnorm_folds(self.graph, original, mapping)
        explained_ckpt = set().union(*(f.checkpoint_names() for f in folds))
        explained_graph = set().union(*(f.graph_initializers() for f in folds))
        self.graph_value: dict[str, list[tuple[object, bool]]] = {}
        for p in mapping.pairs:
            if p.data == "differs":
                continue
            value = self.graph.initializers[p.initializer]
            self.graph_value.setdefault(p.structural, []).append((value, p.how == "transposed"))
        # the graph's paired initializers move aside, freeing their names for the checkpoint's
        # initializers the exporter already made in the fused layout (an LSTM's packed W/R/B):
        # paired with the checkpoint's own tensors
        rest = [n for n in mapping.unmatched_graph if n not in explained_graph]
        direct = map_names(self.ckpt.table, {n: readers[n] for n in rest}, {n: specs[n] for n in rest})
        self.direct = {p.initializer: (p.structural, p.how == "transposed") for p in direct.pairs}
        self.direct_structurals = {p.structural for p in direct.pairs}
        self._refuse_stale_weights(original, mapping, direct, specs, explained_ckpt)
        for name in {p.initializer for p in mapping.pairs} | set(self.direct):
            value = self.graph.initializers.pop(name)
            value.name = f"fusectl_graph/{name}"
            self.graph.register_initializer(value)
        for fold in folds:
            self._use_checkpoint_fold(fold)
        return mapping

    def _use_checkpoint_fold(self, fold: BatchNormFold) -> None:
        """The Conv the exporter folded takes the fold of the checkpoint's own tensors."""
        weight = self.b.constant(fold.folded_weight, f"fusectl_fold/{fold.weight}")
        bias = self.b.constant(fold.folded_bias, f"fusectl_fold/{fold.bias or fold.weight + '_bias'}")
        fold.node.replace_input_with(1, weight)
        fold.node.replace_input_with(2, bias)
        self.folded += 1

    def _refuse_stale_weights(self, original: ParamTable, mapping: NameMap, direct: NameMap, specs,
                              explained: set[str]) -> None:
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
                    f"{self.ckpt.path}, though {name!r} has its shape: their data differ. Was "
                    f"{self.graph_path} exported from the model this checkpoint was fused from?"
                )

    # -- 2. numeric steps -------------------------------------------------------------------
    def fold_reparametrizations(self) -> None:
        current = {n: list(vs) for n, vs in self.graph_value.items()}
        later = self._consumed_later()
        for group, consumed in zip(self.plan.groups, later):
            for step in group.steps:
                kind = step.op.kind
                if kind == "rename":
                    if step.inputs[0] in current:
                        current[step.outputs[0]] = current.pop(step.inputs[0])
                    continue
                if step.op.exact:
                    continue
                for name in step.outputs:
                    if name in consumed or name not in self.ckpt.table:
                        raise ExportError(f"{group.describe()}: {name!r} is transformed again later; "
                                          "export supports numeric folds only on final tensors")
                ins = [current.get(n) for n in step.inputs]
                if all(o in self.direct_structurals for o in step.outputs):
                    # the exporter folded it already and the graph holds the checkpoint's result
                    self.folded += 1
                    continue
                if kind == "bn_fold" and ins[0] and not all(ins[2:]):
                    # no BatchNorm in the graph: the exporter may have folded it already
                    self._rebind_folded_layer(group, step, ins[0][0][0])
                    self.folded += 1
                    continue
                if any(not v for v in ins):
                    missing = [n for n, v in zip(step.inputs, ins) if not v]
                    raise ExportError(f"{group.describe()}: the graph has no initializer for {missing}; "
                                      "export the unfolded model with constant folding off")
                if kind == "bn_fold":
                    self._fold_batchnorm(group, step, [v[0][0] for v in ins])
                elif kind in ("weight_norm_fold", "spectral_norm_fold"):
                    self._replace_subgraph(group, step, [v[0][0] for v in ins])
                else:
                    raise ExportError(f"{group.describe()}: export does not handle {kind}")
                self.folded += 1

    def _consumed_later(self) -> list[set[str]]:
        out, later = [], set()
        for group in reversed(self.plan.groups):
            out.append(set(later))
            later |= {n for s in group.steps for n in s.inputs}
        return out[::-1]

    def _replace_subgraph(self, group: StepGroup, step, values) -> None:
        """Replace the subgraph computing the weight from the step's initializers."""
        cone_values = set(values)
        cone_nodes = []
        changed = True
        while changed:
            changed = False
            for node in list(self.graph):
                if node in cone_nodes or not node.inputs:
                    continue
                ins = [v for v in node.inputs if v is not None]
                if any(v in cone_values for v in ins) and all(
                    v in cone_values or v.is_initializer() or (v.producer() is not None and v.producer().op_type == "Constant")
                    for v in ins
                ):
                    cone_nodes.append(node)
                    cone_values.update(node.outputs)
                    changed = True
        frontier = [v for n in cone_nodes for v in n.outputs
                    if any(use.node not in cone_nodes for use in v.uses()) or v in self.graph.outputs]
        if len(frontier) != 1:
            raise ExportError(f"{group.describe()}: expected one subgraph computing {step.outputs[0]!r} from "
                              f"{list(step.inputs)}, found {len(frontier)} result(s)")
        self._replace(frontier[0], self.param(step.outputs[0]))

    def _fold_batchnorm(self, group: StepGroup, step, values) -> None:
        weight = values[0]
        layers = [u.node for u in weight.uses() if u.node.op_type in ("Conv", "Gemm", "ConvTranspose") and u.idx == 1]
        done = 0
        for layer in layers:
            out = layer.outputs[0]
            users = [u.node for u in out.uses()]
            if len(users) != 1 or users[0].op_type != "BatchNormalization":
                continue
            bn = users[0]
            inputs = [layer.inputs[0], self.param(step.outputs[0]), self.param(step.outputs[1])]
            attrs = {k: a.value for k, a in layer.attributes.items()}
            fused = self.b.one(layer.op_type, inputs, **attrs)
            self._replace(bn.outputs[0], fused)
            done += 1
        if not done:
            raise ExportError(f"{group.describe()}: no Conv/Gemm/ConvTranspose on {step.inputs[0]!r} "
                              "followed by BatchNormalization in the graph")

    def _rebind_folded_layer(self, group: StepGroup, step, weight) -> None:
        """The graph's Conv already holds the fold (the dynamo exporter folds BatchNorm into
        the Conv and keeps the Conv's names): it takes the checkpoint's folded weight and bias
        when they equal the graph's within the dtype's tolerance, else ExportError."""
        layers = [u.node for u in weight.uses() if u.node.op_type == "Conv" and u.idx == 1]
        folded_weight, folded_bias = (self.ckpt.table[n] for n in step.outputs)
        for layer in layers:
            bias = layer.inputs[2] if len(layer.inputs) > 2 else None
            if bias is None or not (same_within_tolerance(weight, folded_weight)
                                    and same_within_tolerance(bias, folded_bias)):
                raise ExportError(
                    f"{group.describe()}: the graph has no BatchNormalization for {step.inputs[2:]} "
                    f"and its Conv on {weight.name.split('/', 1)[-1]!r} does not hold the checkpoint's "
                    f"folded {list(step.outputs)}; export the unfolded model with its optimizations off"
                )
            layer.replace_input_with(1, self.param(step.outputs[0]))
            layer.replace_input_with(2, self.param(step.outputs[1]))
        if not layers:
            raise ExportError(f"{group.describe()}: the graph has no initializer for {list(step.inputs[2:])} "
                              "and no Conv on the weight; export the unfolded model with constant folding off")

    def _replace(self, old, new) -> None:
        """Every use of ``old`` reads ``new``; a graph output keeps its name."""
        if not old.is_graph_output():
            self.ir.convenience.replace_all_uses_with(old, new)
            return
        if new.is_initializer() or new.is_graph_input() or new.is_graph_output():
            new = self.b.one("Identity", [new])  # an output is produced by a node of its own
        self.ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
        name, old.name = old.name, None
        new.name, new.type, new.shape = name, old.type, old.shape

    # -- 3. everything else from the checkpoint --------------------------------------------
    def rebind(self) -> None:
        # name -> how to build it from the checkpoint (built only if the graph still uses it)
        available = {name: (lambda n=name: self.param(n)) for name in self.ckpt.table.names()}
        for group in reversed(self.plan.groups):
            for step in reversed(group.steps):
                if step.op.kind == "rename" and step.outputs[0] in available:
                    available[step.inputs[0]] = available[step.outputs[0]]
                elif step.op.kind in LAYOUT_KINDS and all(o in available for o in step.outputs):
                    outs = [available[o] for o in step.outputs]
                    built: list = []

                    def make(step=step, outs=outs, built=built):
                        if not built:
                            built.extend(unfuse_in_onnx(self.b, step, [f() for f in outs]))
                        return built

                    for k, name in enumerate(step.inputs):
                        available[name] = (lambda k=k, make=make: make()[k])
        for name, graph_values in self.graph_value.items():
            for old, transposed in graph_values:
                if not old.uses():
                    continue
                if name not in available:
                    raise ExportError(f"the graph uses {name!r} (initializer {old.name.split('/', 1)[-1]!r}), "
                                      f"which {self.ckpt.path} cannot provide")
                self._rebind(old, available[name](), transposed)
        for initializer, (name, transposed) in self.direct.items():
            old = self.graph.initializers.get(f"fusectl_graph/{initializer}")
            if old is not None and old.uses():  # a fold may have replaced its uses already
                self._rebind(old, self.param(name), transposed)

    def _rebind(self, old, new, transposed: bool) -> None:
        """Uses of the graph's initializer ``old`` read ``new`` (transposed where paired so)."""
        self._replace(old, self.b.one("Transpose", [new], perm=[1, 0]) if transposed else new)
        self.rebound += 1

    # -- 4. one MatMul for the parts of a fused weight ---------------------------------------
    def fuse_shared_matmuls(self) -> None:
        for split in [n for n in self.graph if n.op_type == "Split"]:
            source = split.inputs[0]
            if source not in self.params.values() or split.attributes.get("axis") is None:
                continue
            if split.attributes["axis"].value != 0 or len(source.shape or ()) != 2:
                continue
            matmuls, ok = [], True
            for part in split.outputs:
                uses = part.uses()
                if len(uses) != 1 or uses[0].node.op_type != "Transpose":
                    ok = False
                    break
                transpose = uses[0].node
                consumers = [u.node for u in transpose.outputs[0].uses()]
                if len(consumers) != 1 or consumers[0].op_type != "MatMul" or consumers[0].inputs[1] is not transpose.outputs[0]:
                    ok = False
                    break
                matmuls.append(consumers[0])
            if not ok or len({id(m.inputs[0]) for m in matmuls}) != 1:
                continue
            x = matmuls[0].inputs[0]
            sizes = split.inputs[1].const_value.numpy().tolist()
            y = self.b.one("MatMul", [x, self.b.one("Transpose", [source], perm=[1, 0])])
            outs = [m.outputs[0] for m in matmuls]
            bias = self._shared_bias(outs, sizes)
            if bias is not None:
                bias_source, adds = bias
                y = self.b.one("Add", [y, bias_source])
                outs = [a.outputs[0] for a in adds]
            parts = self.b.node("Split", [y, self.b.ints(sizes)], len(sizes), axis=-1)
            for old, new in zip(outs, parts):
                self._replace(old, new)
            self.fused_matmuls += 1

    def _shared_bias(self, outs, sizes):
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
        if split.op_type != "Split" or list(split.outputs) != biases or split.inputs[0] not in self.params.values():
            return None
        return split.inputs[0], adds

    # -- 5. clean up and save ---------------------------------------------------------------
    def remove_unused(self) -> None:
        """Sort (new nodes were appended after their users), then drop dead nodes."""
        from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

        TopologicalSortPass()(self.model)
        RemoveUnusedNodesPass()(self.model)

    def finish(self, out: str, force: bool, on_note=None) -> ExportReport:
        self.remove_unused()
        leftovers = [v.name.split("/", 1)[1] for v in self.graph.initializers.values()
                     if v.name.startswith("fusectl_graph/")]
        if leftovers:
            raise ExportError(f"the graph still uses {leftovers[:5]} that fusectl could not take from "
                              f"{self.ckpt.path}")
        total = sum(t.spec.nbytes for _, t in self.ckpt.table.unique())
        external = total > EXTERNAL_DATA_THRESHOLD
        data_name = os.path.basename(out) + ".data"
        data_path = os.path.join(os.path.dirname(os.path.abspath(out)), data_name)
        with atomic_output(out, force=force, inputs=[self.graph_path, *self.ckpt.input_paths()],
                           on_note=on_note, extra=[data_path] if external else []) as temp:
            if not external:
                self.ir.save(self.model, temp)
                _check(temp)
            else:
                # the model names its data file relatively: stage both side by side, check, then
                # hand both to atomic_output, which renames them into place together
                stage = temp + ".d"
                os.makedirs(stage)
                try:
                    target = os.path.join(stage, os.path.basename(out))
                    self.ir.save(self.model, target, external_data=data_name)
                    _check(target)
                    os.replace(os.path.join(stage, data_name), temporary_name(data_path))
                    os.replace(target, temp)
                finally:
                    shutil.rmtree(stage, ignore_errors=True)
        return ExportReport(out, len(self.graph.initializers), self.fused_matmuls, self.folded,
                            self.rebound, external)


def _check(path: str) -> None:
    import onnx

    try:
        onnx.checker.check_model(path)  # by path, so models past 2 GB are checked too
    except onnx.checker.ValidationError as e:
        raise ExportError(f"the rewritten graph fails onnx.checker: {e}") from e


def export_model(checkpoint: Checkpoint, graph_path: str, out: str, *, force: bool = False,
                 on_note=None) -> ExportReport:
    """Rewrite ``graph_path`` (exported from the unfused model) to consume ``checkpoint``."""
    exporter = Exporter(checkpoint, graph_path)
    exporter.pair()
    exporter.fold_reparametrizations()
    exporter.remove_unused()
    exporter.rebind()
    exporter.fuse_shared_matmuls()
    return exporter.finish(out, force, on_note)
