"""What an export leaves out of the checkpoint: nothing, or it is refused.

Pairing (``namemap``) finds the graph tensor that holds a checkpoint tensor by name, content or
transposed content. A checkpoint tensor it cannot pair is where an export goes silently wrong:
the graph of an untuned model holds an LSTM's packed W/R/B, a fine-tuned checkpoint's LSTM pairs
with none of them, and the graph would go on computing with its own, stale weights. So an
export accounts for every checkpoint tensor twice:

1. when the graph is paired (:func:`refuse_unpaired_checkpoint_tensors`, from
   ``PairInitializersPass``): every tensor of the checkpoint as it was before its plan (one
   with data, not an integer) pairs with a graph tensor, is explained by a fold the exporter
   made, or went into a checkpoint tensor that pairs with a graph tensor in the fused layout
   (an LSTM's packed W/R/B);
2. after the rewrite (:func:`account_for_checkpoint`, from ``AccountForCheckpointPass``):
   every unique parameter of the
   checkpoint that is not an integer is an initializer the graph computes with, or went into
   a fold of the exporter's. Integer and bool tensors the graph does not read
   (``num_batches_tracked``, ``position_ids``) are listed in the report (``unused``).

A refusal names the checkpoint tensors left out and the graph's own float tensors that could
hold them in another layout: those whose element count is that of one of them or of several
together (a reshape, a transpose, the gates of an LSTM reordered, a concatenation or a stack),
which the export would keep. It says what to do: export the graph from the model the
checkpoint comes from, fuse the checkpoint into the layout the graph holds, or leave a tensor
the graph does not compute with out of the checkpoint with a ``drop`` rule.
"""

from __future__ import annotations

import re

from ..errors import option, printable, quote
from ..steps import Plan
from ..table import ParamTable
from ..tensors import TensorSpec
from .export_context import ExportContext, ExportError, Pairing
from .graph_tensors import GraphTensor, in_use

# the ONNX recurrent ops whose inputs 1, 2, 3 are the packed W, R, B, with the preset that
# packs PyTorch's per-gate tensors into them
_RECURRENT = {"LSTM": "lstm-to-onnx", "GRU": "gru-to-onnx", "RNN": None}
_TORCH_RNN_NAME = re.compile(r"(^|\.)(weight|bias)_(ih|hh)_l\d+(_reverse)?$")
# names of tensors an exporter folds (TorchScript's do_constant_folding, dynamo always) into
# anonymous ones, with the preset that makes the same fold in the checkpoint
_FOLDED_BY_EXPORTERS = (
    (re.compile(r"(^|\.)(weight_g|parametrizations\.weight\.original0)$"), "weight-norm-fold"),
    (re.compile(r"(^|\.)(weight_orig|parametrizations\.weight\.original)$"), "spectral-norm-fold"),
    (re.compile(r"(^|\.)running_mean$"), "conv-bn-fold"),
)
_NAMED = 8  # names listed in a message before "…"


def holds_weights(spec: TensorSpec) -> bool:
    """Whether a tensor of ``spec`` is a weight: floating point (bf16, fp8 and packed fp4/fp6
    included), not an integer or bool (shapes, indices, counters)."""
    return spec.dtype.is_float or spec.dtype.packed


def plan_origins(plan: Plan) -> dict[str, frozenset[str]]:
    """For each name ``plan`` produces, the names before the plan that went into it (a rename
    keeps them, a concat joins its inputs'); a name the plan leaves alone is its own origin."""
    origins: dict[str, frozenset[str]] = {}
    for step in plan.steps:
        joined = frozenset().union(*(origins.get(n, frozenset((n,))) for n in step.inputs))
        origins.update((n, joined) for n in step.outputs)
    return origins


def refuse_unpaired_checkpoint_tensors(ctx: ExportContext, original: ParamTable, paired: set[str],
                                       explained: set[str], direct: set[str], unpaired: list[GraphTensor]) -> None:
    """ExportError unless each tensor of ``original`` (the checkpoint before its plan) with data
    that holds weights is ``paired`` with a graph tensor, ``explained`` by an exporter's fold, or
    an origin of a checkpoint tensor paired ``direct`` in the fused layout. The error names the
    checkpoint's tensors made from those (each with the parts it was made of, where the plan
    joined them) and the ``unpaired`` graph tensors that could hold them."""
    origins = plan_origins(ctx.plan)
    covered = set(paired) | set(explained)
    for name in direct:
        covered |= origins.get(name, frozenset((name,)))
    before = original.unique_names()
    missing: dict[str, TensorSpec] = {}
    for members in original.groups().values():
        tensor = original[members[0]]
        if tensor.has_data() and holds_weights(tensor.spec) and not covered.intersection(members):
            missing.update((m, tensor.spec) for m in members)
    if not missing:
        return
    table = ctx.checkpoint.table
    after = table.unique_names()
    left = []
    for members in table.groups().values():
        parts = sorted({before[n] for m in members for n in origins.get(m, frozenset((m,))) if n in missing})
        if parts:
            left.append((after[members[0]], table[members[0]].spec, [] if parts == [after[members[0]]] else parts))
    sizes = [spec for name, spec in missing.items() if before[name] == name] + [spec for _, spec, _ in left]
    if covered:
        head = (f"{len(left)} tensor(s) of {printable(ctx.checkpoint.path)} have no copy in the graph (by name, "
                f"content or transposed content)")
    else:
        head = (f"{printable(ctx.graph_path)} computes with none of the tensors of {printable(ctx.checkpoint.path)}: "
                f"none of its {len(left)} tensor(s) has a copy in the graph (by name, content or transposed content)")
    raise ExportError(_left_out(ctx, head, left, sizes, unpaired))


def account_for_checkpoint(ctx: ExportContext, pairing: Pairing) -> list[dict]:
    """The checkpoint's unique parameters of integer or bool dtype that the rewritten graph does
    not read (``[{"name", "dtype", "shape", "why": "integer"}]``); ExportError naming those that
    hold weights and are neither an initializer the graph computes with nor part of a fold the
    exporter made, with the graph's own tensors kept that could hold them. Run once unused nodes
    and initializers are removed."""
    placed = {name for name, value in ctx.params.items() if in_use(value)}
    origins = plan_origins(ctx.plan)
    left, unused = [], []
    for unique, tensor in ctx.checkpoint.table.unique():
        if unique in placed or origins.get(unique, frozenset((unique,))) & pairing.explained:
            continue
        if holds_weights(tensor.spec):
            left.append((unique, tensor.spec, []))
        else:
            unused.append({"name": unique, "dtype": str(tensor.spec.dtype.numpy),
                           "shape": list(tensor.spec.shape), "why": "integer"})
    if left:
        kept = [t for t in pairing.unpaired if in_use(t.value)]
        head = f"{len(left)} tensor(s) of {printable(ctx.checkpoint.path)} would be left out of the rewritten graph"
        raise ExportError(_left_out(ctx, head, left, [spec for _, spec, _ in left], kept))
    return unused


# -- the refusal ---------------------------------------------------------------------------------


def _left_out(ctx: ExportContext, head: str, left: list[tuple[str, TensorSpec, list[str]]],
              sizes: list[TensorSpec], graph_tensors: list[GraphTensor]) -> str:
    """The message for checkpoint tensors ``left`` out of the export (name, spec, the parts
    before the plan that are missing from it): ``head``, the names, the graph's own float
    tensors whose size fits ``sizes`` (``could_hold``), and what to do."""
    def named(name: str, spec: TensorSpec, parts: list[str]) -> str:
        made = f" (made from {', '.join(quote(p) for p in parts[:4])}{', …' if len(parts) > 4 else ''})" if parts else ""
        return f"{quote(name)} {spec.dtype.numpy}{list(spec.shape)}{made}"

    left = sorted(left)
    more = f", … ({len(left)} in all)" if len(left) > _NAMED else ""
    message = f"{head}: {', '.join(named(*entry) for entry in left[:_NAMED])}{more}"
    suspects = could_hold(sizes, graph_tensors)
    if suspects:
        described = "; ".join(_describe(t) for t in suspects[:_NAMED])
        message += (f"; the graph would keep {len(suspects)} float tensor(s) of its own whose size fits them, "
                    f"equal to no checkpoint tensor: {described}{', …' if len(suspects) > _NAMED else ''}. "
                    "Those hold the graph's own weights (or folds the exporter made of them): the export would compute with them silently")
    ckpt, graph = printable(ctx.checkpoint.path), printable(ctx.graph_path)
    advice = [f"export {graph} from the model {ckpt} comes from (its weights then pair by name or content)"]
    presets = _layout_presets([n for name, _, parts in left for n in [name, *parts]], suspects)
    if presets:
        advice.append("if the graph was exported from this very model, it holds them in another layout: fuse "
                      f"the checkpoint into that layout first ({' or '.join(option('rules', p) for p in presets)}) "
                      "and export that")
    advice.append("if the graph does not compute with a tensor (a head it leaves out), leave it out of the "
                  "checkpoint with a rule of op \"drop\" when fusing")
    return message + ". To fix: " + "; or ".join(advice)


def could_hold(specs: list[TensorSpec], graph_tensors: list[GraphTensor]) -> list[GraphTensor]:
    """The float tensors of ``graph_tensors`` whose element count is the sum of the element
    counts of some of ``specs`` (one of them, or several packed or concatenated), by key."""
    candidates = [t for t in graph_tensors if not t.dtype.startswith(("int", "uint", "bool"))]
    if not candidates:
        return []
    # no sum of some of the sizes passes their total: the bitset need not be wider than either
    limit = min(max(t.size for t in candidates), sum(spec.numel for spec in specs))
    mask = (1 << (limit + 1)) - 1
    counts: dict[int, int] = {}
    for spec in specs:
        counts[spec.numel] = counts.get(spec.numel, 0) + 1
    reachable = 1  # bit k set: some of the sizes add up to k
    for size, count in counts.items():
        # ``count`` equal sizes as chunks of 1, 2, 4, … of them: every multiple up to count,
        # in log(count) shifts (a model repeats few shapes many times)
        chunk = 1
        while count and 0 < size * min(chunk, count) <= limit:  # a longer shift only reaches past the limit
            take = min(chunk, count)
            reachable = (reachable | (reachable << size * take)) & mask
            count, chunk = count - take, chunk * 2
    return sorted((t for t in candidates if t.size and reachable >> t.size & 1), key=lambda t: t.key)


def _layout_presets(names: list[str], suspects: list[GraphTensor]) -> list[str]:
    """The presets that would put checkpoint tensors ``names`` into the layout the graph holds
    them in: an RNN's packed W/R/B (when a ``suspect`` is one), or a fold an exporter made."""
    found = {p for t in suspects for op, _ in _recurrent_uses(t) if (p := _RECURRENT[op])}
    if not any(_TORCH_RNN_NAME.search(n) for n in names):
        found = set()
    found |= {preset for pattern, preset in _FOLDED_BY_EXPORTERS if any(pattern.search(n) for n in names)}
    return sorted(found)


def _recurrent_uses(tensor: GraphTensor) -> list[tuple[str, str]]:
    """(op, role) for each LSTM/GRU/RNN reading ``tensor`` as its W, R or B."""
    return [(use.node.op_type, f"{'WRB'[use.idx - 1]} of {use.node.op_type} {quote(use.node.name or '')}")
            for use in tensor.value.uses() if use.node.op_type in _RECURRENT and use.idx in (1, 2, 3)]


def _describe(tensor: GraphTensor) -> str:
    roles = [role for _, role in _recurrent_uses(tensor)]
    return tensor.describe() + (f", the {', '.join(roles)}" if roles else "")
