"""``fusectl export``: rewrite an exporter's graph of the unfused model to take the fused
checkpoint's parameters, as onnx-ir passes over a lazily loaded model.

``export_passes`` lists the rewrite (the passes are in ``fusectl.onnx.passes``, the state they
share in one ``ExportContext``):

1. ``PairInitializersPass``: the graph's tensors — initializers and Constant nodes, in the main
   graph and in If/Loop/Scan bodies (``graph_tensors``) — are paired (``namemap``) with the
   names the checkpoint had before its recorded plan and set aside (a paired initializer that
   is also a graph input stops being one); Conv + BatchNorm folds the exporter made take the
   fold of the checkpoint's tensors; a checkpoint tensor no graph tensor holds is refused,
   naming the graph's own tensors that could be stale copies of it.
2. ``FoldReparametrizationsPass``: each numeric step folds itself in the graph
   (``op.fold_in_graph``) — a weight_norm or spectral_norm subgraph over initializers becomes
   the folded weight; Conv/Gemm/ConvTranspose + BatchNormalization becomes one layer.
3. ``TopologicalSortPass``, ``RemoveUnusedNodesPass`` (onnx-ir's): the folded subgraphs go,
   so their initializers are not rebuilt.
4. ``RebindInitializersPass``: every set-aside tensor still in use is rebuilt from the
   checkpoint's unique parameters: the same tensor, its transpose, or ONNX nodes that un-fuse
   a layout step (``op.onnx_unfuse``). Tied parameters are one initializer.
5. ``FuseSharedMatMulPass``: MatMul or Gemm consumers of the parts of one fused weight that
   share their input become one MatMul (+ one bias Add) or one Gemm followed by a Split;
   groups that cannot be fused are reported (``ExportReport.not_fused``).
6. ``TopologicalSortPass``, ``RemoveUnusedNodesPass``: new nodes were appended after their
   users; unused nodes and initializers go.
7. ``RefuseLeftoverGraphWeightsPass``: no set-aside tensor of the graph may be left in use, and
   the graph must compute with the checkpoint; the graph's own tensors still in use are
   reported (``ExportReport.kept_constants``).
8. ``AccountForCheckpointPass``: every float parameter of the checkpoint is an initializer the
   graph computes with (``fusectl.onnx.accounting``; pairing already refused the checkpoint
   tensors no graph tensor holds); the integer ones it does not read are reported
   (``ExportReport.unused``).

A graph below opset 13 is converted first (``fusectl.onnx.opset``).

The checkpoint's provenance (the plan that fused it, :mod:`fusectl.io.provenance`) is recorded in
the model's ``metadata_props`` under ``fusectl``, so that ``verify --localize`` can name the rule
that made the weights of a node that diverges.

The model is then saved (tensors streamed from the checkpoint) and checked with
``onnx.checker`` by path. Past ``EXTERNAL_DATA_THRESHOLD`` its tensors go to ``OUT.data``
beside it: the model and its data are one group for ``fusectl.io.atomic.atomic_output``, which
renames both into place or neither, and leaves an old pair whole.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

import onnx_ir as ir
from onnx_ir.passes import InvariantError, PassError, PassResult, Sequential
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from ..errors import OutputError, printable, speaking_cli
from ..io.atomic import atomic_output, temporary_name
from ..io.checkpoint import Checkpoint
from ..io.provenance import METADATA_KEY
from .export_context import ExportContext, ExportError, IRBuilder
from .graph import load_model
from .opset import MIN_OPSET, default_opset, upgrade_opset
from .passes import (AccountForCheckpointPass, FoldReparametrizationsPass, FuseSharedMatMulPass,
                     PairInitializersPass, RebindInitializersPass, RefuseLeftoverGraphWeightsPass)

__all__ = ["EXTERNAL_DATA_THRESHOLD", "ExportError", "ExportReport", "IRBuilder", "check_onnx_output", "export_model",
           "export_passes", "run_passes"]

EXTERNAL_DATA_THRESHOLD = 2 * 10**9  # protobuf cannot hold a model past 2 GB


@dataclass
class ExportReport:
    """What ``export_model`` wrote: the output, its initializer count, how many MatMul/Gemm
    groups were fused, numeric steps folded and graph tensor uses rebound; the groups of
    MatMul/Gemm consumers of a fused weight left unfused, and the graph's own tensors kept.

    ``not_fused``: ``[{"weight", "consumers", "why"}]``, the fused parameter, the nodes
    reading its parts on one input, and why they stay apart. ``kept_constants``: ``[{"name",
    "where", "kind", "dtype", "shape", "why"}]``, every initializer or Constant the output
    computes with that is not the checkpoint's, sorted by name: ``why`` is ``integer``
    (integer or bool: shapes, axes, indices), ``scalar`` (one element) or ``graph-own`` (any
    other float tensor: a rotary table, a mask). ``unused``: ``[{"name", "dtype", "shape",
    "why": "integer"}]``, the checkpoint's integer tensors the graph does not read (a float one
    is an error). ``converted_from_opset``: the graph's opset when it was below 13 and
    converted first, else None.
    """

    output: str
    initializers: int
    fused_matmuls: int
    folded: int
    rebound: int
    external_data: bool
    not_fused: list[dict] = field(default_factory=list)
    kept_constants: list[dict] = field(default_factory=list)
    unused: list[dict] = field(default_factory=list)
    converted_from_opset: int | None = None

    def to_json(self) -> dict:
        """The documented ``export --json`` object."""
        return {"output": self.output, "initializers": self.initializers, "fused_matmuls": self.fused_matmuls,
                "folded": self.folded, "rebound": self.rebound, "external_data": self.external_data,
                "converted_from_opset": self.converted_from_opset,
                "not_fused": self.not_fused, "kept_constants": self.kept_constants, "unused": self.unused}

    def to_text(self) -> str:
        """What ``export`` prints: the output and its counts, each group left unfused and why,
        and how many of the graph's own tensors were kept (the first graph-own ones named)."""
        def names(items) -> str:
            return ", ".join(printable(n) for n in items)

        lines = [f"wrote {self.output}: {self.initializers} initializers; {self.fused_matmuls} fused MatMul/Gemm "
                 f"group(s), {self.folded} folded step(s), {self.rebound} graph tensor use(s) rebound"
                 + ("; external data" if self.external_data else "")]
        if self.converted_from_opset is not None:
            lines.append(f"converted the graph from opset {self.converted_from_opset} to {MIN_OPSET} with "
                         "onnx.version_converter first")
        for group in self.not_fused:
            lines.append(f"not fused: {names(group['consumers'])} on parts of {printable(group['weight'])}: "
                         f"{printable(group['why'])}")
        kept = self.kept_constants
        if kept:
            whys = sorted({k["why"] for k in kept})
            own = [k["name"] for k in kept if k["why"] == "graph-own"]
            lines.append(f"kept {len(kept)} graph tensor(s) of its own: "
                         + ", ".join(f"{sum(k['why'] == why for k in kept)} {why}" for why in whys)
                         + (f" ({names(own[:5])}{', …' if len(own) > 5 else ''})" if own else ""))
        if self.unused:
            left = [u["name"] for u in self.unused]
            lines.append(f"left out {len(left)} integer tensor(s) of the checkpoint that the graph does not read "
                         f"({names(left[:5])}{', …' if len(left) > 5 else ''})")
        return "\n".join(lines)


def export_passes(ctx: ExportContext) -> Sequential:
    """The rewrite of ``ctx.model``, in the order it runs."""
    return Sequential(
        PairInitializersPass(ctx),
        FoldReparametrizationsPass(ctx),
        TopologicalSortPass(),
        RemoveUnusedNodesPass(),
        RebindInitializersPass(ctx),
        FuseSharedMatMulPass(ctx),
        TopologicalSortPass(),
        RemoveUnusedNodesPass(),
        RefuseLeftoverGraphWeightsPass(ctx),
        AccountForCheckpointPass(ctx),
    )


def export_model(checkpoint: Checkpoint, graph_path: str, out: str, *, force: bool = False,
                 on_note=None) -> ExportReport:
    """Rewrite ``graph_path`` (exported from the unfused model) to consume ``checkpoint``;
    OutputError unless ``out`` names an ``.onnx`` file."""
    check_onnx_output(out)
    model = load_model(graph_path)
    opset = default_opset(model)
    model = upgrade_opset(model, graph_path)
    ctx = ExportContext(checkpoint, graph_path, model)
    run_passes(export_passes(ctx), model)
    if checkpoint.provenance is not None:
        model.metadata_props[METADATA_KEY] = checkpoint.provenance.dumps()
    total = sum(t.spec.nbytes for _, t in checkpoint.table.unique())
    external = total > EXTERNAL_DATA_THRESHOLD
    _save(model, out, external=external, force=force, on_note=on_note,
          inputs=[graph_path, *checkpoint.input_paths()])
    counts = ctx.counts
    return ExportReport(out, len(model.graph.initializers), counts.fused_matmuls, counts.folded, counts.rebound,
                        external, counts.not_fused, counts.kept_constants, counts.unused,
                        converted_from_opset=opset if opset < MIN_OPSET else None)


def check_onnx_output(out: str) -> None:
    """OutputError unless ``out`` ends in ``.onnx``: export writes one ONNX model, and a name
    without the suffix (``-o o4``) would be a file no tool takes for one."""
    if out.endswith(".onnx") and os.path.basename(out) != ".onnx":
        return
    suffix = os.path.splitext(out.rstrip(os.sep))[1]
    what = f"not {printable(suffix)}" if suffix else "a name without the .onnx suffix"
    command = "fusectl export" if speaking_cli() else "fusectl.export"
    raise OutputError(f"{printable(out)}: {command} writes an ONNX model, {what}; choose OUT.onnx")


def run_passes(passes: Sequential, model: ir.Model) -> PassResult:
    """Run ``passes`` on ``model``; an error raised in a pass comes out as itself (an
    ExportError, a CheckpointError reading a tensor), not wrapped in onnx-ir's PassError."""
    try:
        return passes(model)
    except (PassError, InvariantError) as e:
        error = e
        while isinstance(error, (PassError, InvariantError)) and error.__cause__ is not None:
            error = error.__cause__
    raise error


# -- saving -------------------------------------------------------------------------------------


def _save(model: ir.Model, out: str, *, external: bool, force: bool, on_note, inputs) -> None:
    """Save ``model`` at ``out`` atomically and check it; with ``external``, its tensors in
    ``OUT.data``, which ``atomic_output`` replaces together with the model as one group."""
    if not external:
        with atomic_output(out, force=force, inputs=inputs, on_note=on_note) as temp:
            ir.save(model, temp)
            _check(temp)
        return
    # the model names its data file relatively: both are saved side by side in a folder of their
    # own, checked there, then moved to the temporary names that atomic_output renames into place
    target = os.path.realpath(out)
    data_path = target + ".data"
    with atomic_output(out, force=force, inputs=inputs, on_note=on_note, extra=[data_path]) as temp:
        stage = temp + ".d"
        try:
            os.makedirs(stage)
            staged = os.path.join(stage, os.path.basename(target))
            ir.save(model, staged, external_data=os.path.basename(data_path))
            _check(staged)
            os.replace(staged + ".data", temporary_name(data_path))
            os.replace(staged, temp)
        finally:
            shutil.rmtree(stage, ignore_errors=True)


def _check(path: str) -> None:
    import onnx

    try:
        onnx.checker.check_model(path)  # by path, so models past 2 GB are checked too
    except onnx.checker.ValidationError as e:
        raise ExportError(f"the rewritten graph fails onnx.checker: {e}") from e
