"""Megatron-LM legacy checkpoints (``--ckpt-format torch``), read as one checkpoint without torch.

Megatron-LM's ``save_checkpoint`` writes a save folder whose ``latest_checkpointed_iteration.txt``
names the iteration (``10``, or ``release``), and under ``iter_0000010/`` (``release/``) one
``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` per model-parallel rank: TT the tensor-parallel
rank (two digits), ``_PPP`` the pipeline stage (only when PP > 1), ``_EEE`` the expert-parallel
rank (only when EP > 1). Each is a ``torch.save`` dict: ``args`` (an ``argparse.Namespace``),
``iteration``, ``model`` (that rank's state dict), ``optimizer`` (the non-distributed
optimizer's ``state_dict()``: torch's Adam state), RNG states and the LR scheduler's. The
distributed optimizer keeps its state in ``distrib_optim.pt`` beside it instead.

:func:`read_megatron` gives the model as megatron-core's TP=1 PP=1 EP=1 model names and holds
it (what ``dist_checkpointing.load`` into such a model gives, bitwise), by the layout rules of
megatron-core 0.16.1 (``fixtures/generate_megatron.py`` states and checks them):

- column-parallel (``linear_qkv``, ``word_embeddings``, ``output_layer``): the TP ranks' pieces
  joined on axis 0 (the qkv rows are interleaved per query group, a group whole on one rank, so
  the join keeps megatron's own interleave);
- ``linear_fc1`` with SwiGLU (``args.swiglu``): each rank holds ``[gate_r; up_r]``; joined as
  ``[gate_0; …; gate_n; up_0; …; up_n]`` (without SwiGLU a plain column-parallel join);
- row-parallel (``linear_proj``, ``linear_fc2``): joined on axis 1; their biases whole;
- replicated (norms, the MoE router, row-parallel biases, position embeddings): whole on
  every TP rank; the first rank's is kept;
- pipeline stages number their layers from 0: stage p's ``decoder.layers.i`` is global layer
  ``i`` plus the layers of the stages before it (each stage's count from its files, which must
  add up to ``args.num_layers``; where the index is: the layout's ``[pipeline]``);
- expert-parallel rank e's ``experts.local_experts.i`` is expert ``e * (num_experts / EP) + i``
  (the layout's ``[experts]``); the dense part is the same on every EP rank (the first one's is
  kept);
- ``_extra_state`` entries (None without Transformer Engine) are left out, named in
  ``ignored``.
- tied embeddings (``args.untie_embeddings_and_output_weights`` false) at PP > 1: the last
  stage has no embedding, so megatron-core keeps a copy of it there as ``output_layer.weight``
  (its gradient all-reduced with the embedding's); the copy is checked bitwise against the
  embedding, TP rank by TP rank, and left out with its optimizer state (``distributed``
  names it ``tied_head_copy``): the TP=1 model has one tensor, its head reads the embedding.

Every copy a rule keeps only one of (a replicated tensor on each TP rank, the dense part on
each EP rank) is checked to have the kept one's shape and dtype, and bitwise equal where it is
small (up to :data:`_COMPARED_BYTES`: norms, routers, biases); TP pieces must all have one
shape. Axis-0 joins are file ranges laid end to end (consolidating copies ranges, it never
holds the model); axis-1 joins are assembled one tensor at a time when written.

The optimizer: torch's Adam state per rank, its ids running through megatron-core's param
groups in order (the decayed weights, the expert-parallel ones at EP > 1, then the 1-D ones
without weight decay), in the model's state-dict order within each. Its moments are joined
exactly like their parameters into one ``optimizer.state_dict()`` of the TP=1 model (ids again
in group order), beside the model in the training tree ``{"model", "optimizer"}``. An optimizer
fusectl cannot map so (a mixed-precision optimizer's ``fp32_from_fp16_params``, other param
groups, ``distrib_optim.pt``) leaves the model readable (``inspect`` shows the problem; a
``.safetensors`` file or a folder of the model is written) and a PyTorch training-dict output is
refused naming why, with ``--drop-optimizer`` too: fusectl never writes it without the optimizer.

Every file is read through ``torch_file``'s scanned, allow-listed unpickler; Megatron's classes
(:data:`RECORDS`) are inert records: nothing is imported or run. The folder is checked before
anything is written: ``args`` against the rank files present (a missing or stale rank file),
ranks that disagree on names or shapes, layers that do not add up — each a CheckpointError
naming the file.
"""

from __future__ import annotations

import collections
import os
import re
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ...errors import CheckpointError, printable, quote
from ...tensors import LazyTensor, TensorSpec
from ..contents import Contents
from ..optimizer_state import Training
from ..provenance import METADATA_KEY
from ..sniff import MEGATRON_LATEST, MEGATRON_RANK_FOLDER
from ..untrusted import open_input
from ...rules.parallel import Ledger, shipped_layout
from .chunks import assemble, cut, rows
from .torch_file import Record, Records, described, read_torch_tree

# the classes beyond the allow-list a model_optim_rng.pt pickles, read as inert records: the
# ``args`` Namespace, megatron-core's enums in it, and numpy's RNG state (an ndarray rebuilt by
# ``_reconstruct``; numpy 1 names it ``numpy.core``)
RECORDS = Records((
    "argparse.Namespace",
    *(f"megatron.core.transformer.enums.{n}" for n in (
        "AttnBackend", "AttnMaskType", "AttnType", "LayerType", "ModelType", "CudaGraphScope")),
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.dtype",
))

RANK_FILE = "model_optim_rng.pt"
DISTRIB_OPTIM = "distrib_optim.pt"
_ITERATION_BYTES = 32
_COMPARED_BYTES = 1 << 20  # copies up to this size are compared bitwise, larger ones by shape and dtype
_GROUPED_EXPERT = re.compile(r".*\.experts\.linear_fc[12]\.(weight|bias)[0-9]+")
_NEVER = "Megatron-LM never writes one; the file is corrupt"
_EMBEDDING, _OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"
_HOW = "give the folder Megatron-LM's save_checkpoint wrote (or its iter_NNNNNNN folder) as it left it"

# how megatron-core's layers hold each tensor at TP > 1, and where the index of a layer and of an
# expert is that pipeline stages and expert-parallel ranks number from 0: the layout file, shared
# with the writer
LAYOUT = shipped_layout("megatron-core")
LAYERS, EXPERTS = LAYOUT.layers, LAYOUT.experts


def parallel_kind(name: str, swiglu: bool, tp: int) -> str | None:
    """How megatron-core splits the tensor ``name`` over tensor-parallel ranks: the kind of its
    split in :data:`LAYOUT` (``"column"``, ``"column-swiglu"``, ``"row"``, ``"replicated"``); at
    TP=1 any other name is ``"replicated"`` (whole), at TP > 1 None.

    >>> parallel_kind("decoder.layers.0.mlp.linear_fc1.weight", True, 2)
    'column-swiglu'
    """
    split = LAYOUT.split_of(name, {"swiglu": swiglu})
    if split is None:
        return "replicated" if tp == 1 else None
    return split.kind


# ------------------------------------------------------------------------------- the folder


def iteration_folder(path: str, check_link: Callable[[str], None]) -> tuple[str, str | None]:
    """(the iteration folder of the checkpoint at ``path``, the latest file that named it or
    None): ``path`` itself when it holds no ``latest_checkpointed_iteration.txt``.

    :raises CheckpointError: a latest file that holds anything but an iteration number or
        ``release``, or names a folder that is not there.
    """
    marker = os.path.join(path, MEGATRON_LATEST)
    if not os.path.lexists(marker):
        return path, None
    check_link(marker)
    with open_input(marker) as f:
        raw = f.read(_ITERATION_BYTES + 1)
    text = raw.decode("utf-8", "replace").strip()
    if text == "release":
        name = "release"
    elif text.isdigit() and len(raw) <= _ITERATION_BYTES and text.isascii():
        name = f"iter_{int(text):07d}"
    else:
        shown = f"{len(raw)}+ bytes" if len(raw) > _ITERATION_BYTES else quote(text)
        raise CheckpointError(f"{printable(marker)}: holds {shown}, not an iteration number or 'release' "
                              f"(Megatron-LM writes one such as '10'); {_HOW}")
    folder = os.path.join(path, name)
    check_link(folder)
    if not os.path.isdir(folder):
        raise CheckpointError(f"{printable(marker)}: names iteration {quote(text)}, but {printable(folder)} is not "
                              "there; the checkpoint is incomplete — give an iteration folder that is")
    return folder, marker


def rank_folder(tp_rank: int, pp_rank: int, ep_rank: int, pp: int, ep: int) -> str:
    """Megatron-LM's name of a rank's folder (``get_checkpoint_name``).

    >>> rank_folder(1, 0, 1, 1, 2)
    'mp_rank_01_001'
    """
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + (f"_{ep_rank:03d}" if ep > 1 else "")


@dataclass(frozen=True)
class Parallelism:
    """What ``args`` says of the save: the TP, PP and EP sizes, the layer and expert counts,
    SwiGLU, tied embeddings (``untie_embeddings_and_output_weights`` false)."""

    tp: int
    pp: int
    ep: int
    num_layers: int
    num_experts: int | None
    swiglu: bool
    tied: bool

    @classmethod
    def of(cls, tree: dict, path: str) -> "Parallelism":
        """The parallelism a rank file's ``args`` records.

        :raises CheckpointError: no ``args`` Namespace, a size that is not a positive integer,
            experts that do not divide over the EP ranks, experts split over another TP size."""
        args = tree.get("args")
        if not isinstance(args, Record) or args.name != "argparse.Namespace" or type(args.state) is not dict:
            raise _corrupt(path, "args", args, "the argparse.Namespace Megatron-LM saves")

        def size(key: str, default: int | None = None) -> int:
            value = args.field(key, default)
            if type(value) is not int or value < 1:
                raise _corrupt(path, f"args.{key}", value, "a positive integer")
            return value

        tp, pp = size("tensor_model_parallel_size"), size("pipeline_model_parallel_size")
        ep = size("expert_model_parallel_size", 1)
        experts = args.field("num_experts")
        if experts is not None:
            experts = size("num_experts")
            if experts % ep:
                raise CheckpointError(f"{printable(path)}: args.num_experts {experts} does not divide over "
                                      f"expert_model_parallel_size {ep}; the file is corrupt")
        etp = args.field("expert_tensor_parallel_size")
        if experts is not None and etp not in (None, tp):
            raise CheckpointError(f"{printable(path)}: experts split over {etp!r} tensor-parallel ranks "
                                  f"(expert_tensor_parallel_size) while the dense layers use {tp}; fusectl reads "
                                  "Megatron checkpoints whose experts follow the dense layers' TP only")
        if args.field("virtual_pipeline_model_parallel_size") not in (None, 1):
            raise CheckpointError(f"{printable(path)}: saved with a virtual pipeline (args.virtual_pipeline_model_"
                                  "parallel_size), whose model0, model1 … chunks fusectl does not read yet")
        return cls(tp, pp, ep, size("num_layers"), experts, args.field("swiglu") is True,
                   args.field("untie_embeddings_and_output_weights") is False)

    def ranks(self) -> list[tuple[int, int, int]]:
        """Every (tp, pp, ep) rank, stage by stage."""
        return [(t, p, e) for p in range(self.pp) for e in range(self.ep) for t in range(self.tp)]


def _rank_files(folder: str, check_link: Callable[[str], None]) -> tuple[Parallelism, dict, dict]:
    """(the parallelism, (tp, pp, ep) → the rank's file, (tp, pp, ep) → its tree)."""
    names = sorted(n for n in _listing(folder) if MEGATRON_RANK_FOLDER.fullmatch(n))
    if not names:
        torch_dist = os.path.lexists(os.path.join(folder, "metadata.json"))
        raise CheckpointError(f"{printable(folder)}: holds no mp_rank_TT[_PPP][_EEE] folders" + (
            ": a torch_dist checkpoint (metadata.json), which this reader of the legacy format does not read"
            if torch_dist else f"; {_HOW}"))
    first = os.path.join(folder, names[0], RANK_FILE)
    trees = {}
    tree = _read(first, check_link)
    par = Parallelism.of(tree, first)
    expected = {rank_folder(t, p, e, par.pp, par.ep): (t, p, e) for t, p, e in par.ranks()}
    for name in names:
        if name not in expected:
            raise CheckpointError(f"{printable(os.path.join(folder, name))}: not a rank of this save, whose args "
                                  f"say TP={par.tp} PP={par.pp} EP={par.ep} ({printable(first)}); the folder "
                                  "mixes two saves — remove the stale folder")
    files = {}
    for name, rank in expected.items():
        file = os.path.join(folder, name, RANK_FILE)
        if not os.path.lexists(file):
            raise CheckpointError(f"{printable(file)}: missing; {printable(first)} says TP={par.tp} PP={par.pp} "
                                  f"EP={par.ep}, and every rank's file is needed")
    for name, rank in expected.items():
        file = os.path.join(folder, name, RANK_FILE)
        if os.path.lexists(os.path.join(folder, name, DISTRIB_OPTIM)):
            files.setdefault("distrib_optim", os.path.join(folder, name, DISTRIB_OPTIM))
        files[rank] = file
        trees[rank] = tree if file == first else _read(file, check_link)
        other = Parallelism.of(trees[rank], file)
        if other != par:
            raise CheckpointError(f"{printable(file)}: its args say {_said(other)}, {printable(first)}'s "
                                  f"{_said(par)}; the folder mixes two saves")
    return par, files, trees


def _said(par: Parallelism) -> str:
    return f"TP={par.tp} PP={par.pp} EP={par.ep}, {par.num_layers} layers"


def _listing(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError as e:
        raise CheckpointError(f"{printable(path)}: cannot list it ({e.strerror})") from e


def _read(path: str, check_link: Callable[[str], None]) -> dict:
    check_link(path)
    tree, _ = read_torch_tree(path, records=RECORDS)
    if not isinstance(tree, dict):
        raise CheckpointError(f"{printable(path)}: holds {described(tree)}, not the dict Megatron-LM saves; {_HOW}")
    if "model" not in tree and "model0" in tree:
        raise CheckpointError(f"{printable(path)}: holds model0, model1 … (a virtual pipeline), which fusectl "
                              "does not read yet")
    model = tree.get("model")
    if not isinstance(model, dict) or not all(type(k) is str for k in model):
        raise _corrupt(path, "model", model, "a state dict")
    return tree


# ------------------------------------------------------------------------------- the model


@dataclass
class _Global:
    """A tensor of the TP=1 model: its kind and, per TP rank, (file, local name, tensor) of each
    copy (one per EP rank for the dense part; the first is kept)."""

    kind: str
    copies: dict[int, list[tuple[str, str, LazyTensor]]]


def _local_layers(names: Sequence[str], path: str) -> int:
    """How many layers a stage's file holds (its indices must run 0..n-1)."""
    found = {i for i in map(LAYERS.index, names) if i is not None}
    if found != set(range(len(found))):
        raise CheckpointError(f"{printable(path)}: holds layers {sorted(found)}; a pipeline stage numbers its "
                              "layers from 0 without gaps — the file is corrupt")
    return len(found)


def _global_name(local: str, offset: int, ep_rank: int, per_rank: int, path: str) -> str:
    """The whole model's name of a rank's ``local`` entry: its layer moved by the layers of the
    stages before (``offset``), its expert by the experts of the EP ranks before (the layout's
    ``[pipeline]`` and ``[experts]``)."""
    if LAYERS.index(local) is None:
        return local
    name = LAYERS.renumbered(local, offset)
    index = EXPERTS.index(name)
    if index is not None and per_rank:
        if index >= per_rank:
            raise CheckpointError(f"{printable(path)}: holds {quote(local)}, but each of the expert-parallel ranks "
                                  f"holds {per_rank} experts; the file is corrupt")
        name = EXPERTS.renumbered(name, ep_rank * per_rank)
    return name


def _model(par: Parallelism, files: dict, trees: dict) -> tuple[dict[str, _Global], list[str], list[str], dict]:
    """(global name → _Global, the global order, the ``_extra_state`` names left out, (rank,
    local name) → global name)."""
    per_rank = par.num_experts // par.ep if par.num_experts else 0
    tensors: dict[str, _Global] = {}
    order: list[str] = []
    extra: list[str] = []
    names: dict = {}
    offset = 0
    for p in range(par.pp):
        first = files[(0, p, 0)]
        reference = list(trees[(0, p, 0)]["model"])
        count = _local_layers(reference, first)
        segments = []
        for e in range(par.ep):
            seen = []
            for t in range(par.tp):
                path, model = files[(t, p, e)], trees[(t, p, e)]["model"]
                local = list(model)
                if t > 0 and local != list(trees[(0, p, e)]["model"]):
                    raise _disagree(path, files[(0, p, e)], local, list(trees[(0, p, e)]["model"]))
                if e > 0 and [n for n in local if EXPERTS.index(n) is None] != \
                        [n for n in reference if EXPERTS.index(n) is None]:
                    raise _disagree(path, first, local, reference)
                for key in local:
                    if par.ep > 1 and _GROUPED_EXPERT.fullmatch(key):
                        raise CheckpointError(f"{printable(path)}: holds {quote(key)}, grouped experts "
                                              "(TEGroupedMLP) at EP > 1, which fusectl does not read yet")
                    name = _global_name(key, offset, e, per_rank, path)
                    value = model[key]
                    if key.endswith("_extra_state"):
                        if value is not None and not isinstance(value, (bytes, Record)):
                            raise _corrupt(path, f"model.{key}", value, "None (Transformer Engine's extra state)")
                        if name not in extra:
                            extra.append(name)
                        continue
                    if not isinstance(value, LazyTensor):
                        raise _corrupt(path, f"model.{key}", value, "a tensor")
                    kind = parallel_kind(name, par.swiglu, par.tp)
                    if kind is None:
                        raise CheckpointError(f"{printable(path)}: {quote(key)} is a tensor fusectl does not know "
                                              f"how Megatron splits over {par.tp} tensor-parallel ranks; fusectl "
                                              "reads megatron-core's GPT layers (local and Transformer Engine specs)")
                    entry = tensors.setdefault(name, _Global(kind, {}))
                    entry.copies.setdefault(t, []).append((path, key, value))
                    names[((t, p, e), key)] = name
                    if t == 0:
                        seen.append((key, name))
            segments.append(seen)
        order.extend(_merge_experts(segments))
        offset += count
    if offset != par.num_layers:
        raise CheckpointError(f"{printable(files[(0, 0, 0)])}: args say {par.num_layers} layers, but the pipeline "
                              f"stages' files hold {offset}; the files are of two saves or some are missing")
    return tensors, order, extra, names


def _merge_experts(segments: list[list[tuple[str, str]]]) -> list[str]:
    """One stage's names in the TP=1 model's order from each EP rank's (local name, whole
    model's name) pairs: EP rank 0's, each run of its experts followed by the other EP ranks'
    runs at the same place (their local names are EP rank 0's)."""
    reference = [local for local, _ in segments[0]]
    position = {local: k for k, local in enumerate(reference)}
    run: list[int] = []  # where the run of experts each of EP rank 0's names is in begins
    for k, local in enumerate(reference):
        continues = k > 0 and EXPERTS.index(local) is not None and EXPERTS.index(reference[k - 1]) is not None
        run.append(run[k - 1] if continues else k)
    keys: dict[str, tuple[int, int, int]] = {}
    for e, segment in enumerate(segments):
        for i, (local, name) in enumerate(segment):
            k = position.get(local)
            # anything else (never in megatron's layout) keeps its place at the end
            keys.setdefault(name, (run[k], e, k) if k is not None else (len(reference), e, i))
    return sorted(keys, key=keys.__getitem__)


def _disagree(path: str, first: str, names: Sequence[str], expected: Sequence[str]) -> CheckpointError:
    extra = [n for n in names if n not in expected] or [n for n in expected if n not in names]
    shown = quote(extra[0]) if extra else "the same names in another order"
    return CheckpointError(f"{printable(path)}: its model holds other tensors than {printable(first)}'s ({shown}); "
                           "the ranks disagree — the folder mixes two saves")


def join(kind: str, name: str, parts: Sequence[tuple[str, str, LazyTensor]], ledger: Ledger) -> LazyTensor:
    """The whole tensor ``name`` of ``kind`` (:func:`parallel_kind`) from each TP rank's piece
    ``(file, local name, tensor)``, in rank order, by the split :data:`LAYOUT` declares; each
    piece's slices recorded in ``ledger``.

    :raises CheckpointError: pieces that differ in shape or dtype, or that the split cannot cut
        (too few dimensions, an axis that is not whole parts), naming the file.
    """
    path0, _, t0 = parts[0]
    for path, _, t in parts[1:]:
        if t.spec.shape != t0.spec.shape or t.spec.dtype != t0.spec.dtype:
            raise CheckpointError(f"{printable(path)}: {quote(name)} is {t.spec}, but {printable(path0)} holds "
                                  f"{t0.spec}; the tensor-parallel ranks disagree on its shape — the folder mixes "
                                  "two saves")
    shape, tp, split = t0.spec.shape, len(parts), LAYOUT.kind(kind)
    axis = None if split.replicated or tp == 1 else split.axis
    if axis is not None and (axis >= len(shape) or shape[axis] % split.parts):
        raise CheckpointError(f"{printable(path0)}: {quote(name)} is {t0.spec}; a {kind} tensor's axis {axis} holds "
                              f"{split.parts} equal part(s) on each rank ({LAYOUT.source}) — the file is corrupt")
    whole = shape if axis is None else tuple(n * tp if i == axis else n for i, n in enumerate(shape))
    ledger.output(name, whole, axis)
    if axis is None:
        ledger.source(_key(path0, parts[0][1]), shape, None)
        ledger.take(_key(path0, parts[0][1]), 0, name, 0, 1)
        return t0
    pieces = []
    for (path, key, t), runs in zip(parts, split.runs(whole[axis], tp)):
        ledger.source(_key(path, key), shape, axis)
        for start, at, count in runs:
            ledger.take(_key(path, key), start, name, at, count)
            pieces.append((tuple(at if i == axis else 0 for i in range(len(shape))), cut(t, axis, start, count)))
    ledger.check_output(name, CheckpointError)
    return assemble(TensorSpec(t0.spec.dtype, whole), pieces)


def _key(path: str, name: str) -> str:
    """How the ledger names a rank's tensor."""
    return f"{printable(path)}: {name}"


def _copies(name: str, entry: _Global, ledger: Ledger) -> list[tuple[str, str, LazyTensor]]:
    """The piece of ``name`` kept of each TP rank (the first EP rank's), in rank order; every
    other copy (a replicated tensor on the other TP ranks, the dense part on the other EP ranks)
    checked equal to the one kept and recorded in ``ledger`` as its copy."""
    ranks = [entry.copies[t] for t in sorted(entry.copies)]
    groups = [[c for copies in ranks for c in copies]] if entry.kind == "replicated" else ranks
    for copies in groups:
        _check_copies(name, copies)
        for path, key, tensor in copies[1:]:
            ledger.source(_key(path, key), tensor.spec.shape, None)
            ledger.copy(_key(path, key), _key(copies[0][0], copies[0][1]))
    return [copies[0] for copies in ranks]


def _check_copies(name: str, copies: Sequence[tuple[str, str, LazyTensor]]) -> None:
    """Copies of one piece (a replicated tensor on each TP rank, the dense part on each EP rank)
    agree with the first: shape and dtype always, bitwise when small."""
    path0, _, t0 = copies[0]
    small = t0.spec.nbytes <= _COMPARED_BYTES
    data = t0.read() if small and len(copies) > 1 else None
    for path, _, t in copies[1:]:
        if t.spec.shape != t0.spec.shape or t.spec.dtype != t0.spec.dtype:
            raise CheckpointError(f"{printable(path)}: {quote(name)} is {t.spec}, but {printable(path0)} holds "
                                  f"{t0.spec}; the ranks disagree on its shape — the folder mixes two saves")
        if data is not None and t.read().tobytes() != data.tobytes():
            raise CheckpointError(f"{printable(path)}: {quote(name)} differs from {printable(path0)}'s, although "
                                  "Megatron keeps it whole and equal on every rank; the folder mixes two saves")


def _tied_head(par: Parallelism, tensors: dict[str, _Global], order: list[str]) -> str | None:
    """Take a tied model's head copy out of the model: at PP > 1 the last stage has no
    embedding, so megatron-core gives it ``output_layer.weight``, a copy of the embedding kept
    equal by all-reducing their gradients; the TP=1 model has one tensor, the embedding (its
    head reads it). Each TP rank's copy is checked bitwise against the embedding's piece of the
    same rank, :data:`_COMPARED_BYTES` at a time; its optimizer state goes with it (the
    embedding's is kept). Returns the name taken out, or None (untied, PP=1, no copy stored).

    :raises CheckpointError: a copy that differs from the embedding, naming the two files and
        the first row that differs; a tied save whose stages hold no embedding.
    """
    if not par.tied or par.pp == 1 or _OUTPUT not in tensors:
        return None
    if _EMBEDDING not in tensors:
        path = tensors[_OUTPUT].copies[0][0][0]
        raise CheckpointError(f"{printable(path)}: holds {quote(_OUTPUT)}, the head of a model its args say is tied "
                              f"(untie_embeddings_and_output_weights false), but no stage holds {quote(_EMBEDDING)}; "
                              "the folder mixes two saves")
    for t, copies in sorted(tensors[_OUTPUT].copies.items()):
        path, _, copy = copies[0]
        first, _, embedding = tensors[_EMBEDDING].copies[t][0]
        if copy.spec != embedding.spec:
            raise CheckpointError(f"{printable(path)}: the tied head copy {quote(_OUTPUT)} is {copy.spec}, but "
                                  f"{printable(first)}'s {quote(_EMBEDDING)} is {embedding.spec}; the folder mixes "
                                  "two saves")
        height = copy.spec.shape[0] if copy.spec.shape else 0
        step = max(1, _COMPARED_BYTES // max(1, copy.spec.nbytes // max(1, height)))
        for start in range(0, height, step):
            count = min(step, copy.spec.shape[0] - start)
            mine = rows(copy, start, count, printable(path), _NEVER).read()
            theirs = rows(embedding, start, count, printable(first), _NEVER).read()
            if mine.tobytes() != theirs.tobytes():
                differs = next(i for i in range(count) if mine[i].tobytes() != theirs[i].tobytes())
                raise CheckpointError(
                    f"{printable(path)}: {quote(_OUTPUT)}, the last stage's copy of the tied embedding, differs from "
                    f"{quote(_EMBEDDING)} in {printable(first)} (row {start + differs} of TP rank {t}'s piece), "
                    "although megatron-core keeps the two equal; the checkpoint is of two saves or was edited — "
                    "save it untied (untie_embeddings_and_output_weights) if the head is its own tensor")
    del tensors[_OUTPUT]
    order.remove(_OUTPUT)
    return _OUTPUT


# ------------------------------------------------------------------------------- the optimizer

_DECAY, _EXPERT_GROUP, _NO_DECAY = "decay", "expert", "no-decay"


class _Unmapped(Exception):
    """An optimizer state fusectl cannot map to the parameters: the model still reads."""


def _classes(model: Mapping[str, object], ep: int) -> dict[str, list[str]]:
    """megatron-core's param groups of one rank's model (``_get_param_groups``), by class."""
    out = {_DECAY: [], _EXPERT_GROUP: [], _NO_DECAY: []}
    for key, value in model.items():
        if not isinstance(value, LazyTensor):
            continue
        if ep > 1 and EXPERTS.index(key) is not None:
            out[_EXPERT_GROUP].append(key)
        elif len(value.spec.shape) == 1 or key.endswith(".bias"):
            out[_NO_DECAY].append(key)
        else:
            out[_DECAY].append(key)
    return {k: v for k, v in out.items() if v}


def _rank_state(tree: dict, path: str, ep: int) -> tuple[dict[str, dict], dict[str, dict]]:
    """(local name → its optimizer state, class → its param group's hyperparameters) of a rank.

    :raises _Unmapped: an optimizer that is not torch's state_dict in megatron-core's groups."""
    node = tree.get("optimizer")
    if isinstance(node, dict) and "fp32_from_fp16_params" in node:
        raise _Unmapped(f"{printable(path)}: a mixed-precision optimizer (fp32_from_fp16_params), whose master "
                        "weights fusectl does not map yet")
    if not isinstance(node, dict) or not isinstance(node.get("state"), dict) or \
            not isinstance(node.get("param_groups"), list):
        raise _Unmapped(f"{printable(path)}: 'optimizer' is {described(node)}, not an optimizer's state_dict "
                        "(state, param_groups)")
    model = tree["model"]
    classes = _classes(model, ep)
    groups = node["param_groups"]
    if len(groups) != len(classes) or not all(isinstance(g, dict) and type(g.get("params")) is list for g in groups):
        raise _Unmapped(f"{printable(path)}: {len(groups)} optimizer param groups, not megatron-core's default "
                        f"{len(classes)} ({', '.join(classes)}); fusectl cannot tell whose state each id is")
    ids = [i for g in groups for i in g["params"]]
    if ids != list(range(len(ids))):
        raise _Unmapped(f"{printable(path)}: the optimizer's ids run {ids[:8]}…, not 0, 1, … through the groups; "
                        "fusectl cannot tell whose state each id is")
    states, hyper, pid = {}, {}, 0
    for (kind, keys), group in zip(classes.items(), groups):
        if len(group["params"]) != len(keys) or bool(group.get("is_expert_parallel")) != (kind == _EXPERT_GROUP):
            raise _Unmapped(f"{printable(path)}: optimizer param group {list(classes).index(kind)} holds "
                            f"{len(group['params'])} parameters, but megatron-core's {kind} group of this model "
                            f"holds {len(keys)}; fusectl cannot tell whose state each id is")
        hyper[kind] = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        for key in keys:
            state = node["state"].get(pid, {})
            if not isinstance(state, dict):
                raise _Unmapped(f"{printable(path)}: the optimizer state of id {pid} is {described(state)}")
            for k, v in state.items():
                if isinstance(v, LazyTensor) and v.spec.shape and v.spec.shape != model[key].spec.shape:
                    raise _Unmapped(f"{printable(path)}: the optimizer's {quote(k)} of id {pid} is {v.spec}, but "
                                    f"its parameter {quote(key)} is {model[key].spec}; fusectl cannot tell whose "
                                    "state each id is")
            states[key] = state
            pid += 1
    return states, hyper


def _optimizer(par: Parallelism, files: dict, trees: dict, tensors: dict[str, _Global], order: list[str],
               extra_optim: str | None, ledger: Ledger) -> dict:
    """The TP=1 model's ``optimizer.state_dict()``, moments joined like their parameters (their
    pieces recorded in ``ledger``; the moments of a copy the model does not keep are not read).

    :raises _Unmapped: naming what fusectl cannot map."""
    if extra_optim is not None:
        raise _Unmapped(f"{printable(extra_optim)}: the distributed optimizer's state, which fusectl does not "
                        "read yet")
    per_rank, hyper = {}, {}
    for rank, tree in trees.items():
        per_rank[rank], groups = _rank_state(tree, files[rank], par.ep)
        for kind, h in groups.items():
            if hyper.setdefault(kind, (files[rank], h))[1] != h:
                raise _Unmapped(f"{printable(files[rank])}: the optimizer's {kind} group has other hyperparameters "
                                f"than {printable(hyper[kind][0])}'s; fusectl cannot merge them into one group")
    by_file = {files[r]: r for r in files}
    state = {}
    members: dict[str, list[str]] = {k: [] for k in (_DECAY, _EXPERT_GROUP, _NO_DECAY) if k in hyper}
    for name in order:
        entry = tensors[name]
        first = [copies[0] for _, copies in sorted(entry.copies.items())]
        rank_states = [per_rank[by_file[path]][key] for path, key, _ in first]
        keys = list(rank_states[0])
        if any(list(s) != keys for s in rank_states[1:]):
            raise _Unmapped(f"{printable(first[1][0])}: the optimizer state of {quote(name)} holds other entries "
                            f"than {printable(first[0][0])}'s")
        moments = {}
        for k in keys:
            value = rank_states[0][k]
            if isinstance(value, LazyTensor) and value.spec.shape:
                pieces = [(path, f"{key} ({k})", s[k]) for (path, key, _), s in zip(first, rank_states)]
                moments[k] = join(entry.kind, f"{name} ({k})", pieces, ledger)
            else:
                moments[k] = value
        path, key, tensor = first[0]
        shape = tensor.spec.shape
        kind = _EXPERT_GROUP if par.ep > 1 and EXPERTS.index(name) is not None else \
            _NO_DECAY if len(shape) == 1 or name.endswith(".bias") else _DECAY
        members[kind].append(name)
        if moments:
            state[name] = moments
    out_state, groups, pid = {}, [], 0
    for kind, names in members.items():
        ids = list(range(pid, pid + len(names)))
        for i, name in zip(ids, names):
            if name in state:
                out_state[i] = state[name]
        groups.append({**hyper[kind][1], "params": ids, "param_names": list(names)})
        pid += len(names)
    return {"state": out_state, "param_groups": groups}


# ------------------------------------------------------------------------------- the reader


def read_megatron(path: str, key: str | None = None, check_link: Callable[[str], None] | None = None) -> Contents:
    """The :class:`~fusectl.io.contents.Contents` of a Megatron-LM legacy checkpoint: its save
    folder (``latest_checkpointed_iteration.txt`` names the iteration) or an iteration folder.

    :param path: the folder.
    :param key: unused (the registry row takes no key).
    :param check_link: called with each file before it is read (the input's link boundary).
    :returns: the TP=1 PP=1 EP=1 model (module docstring) as ``tensors`` in megatron-core's
        order, the ``_extra_state`` names in ``ignored``, ``training`` the model and the
        optimizer's state dict, ``distributed`` tp, pp, ep, world_size, num_layers, iteration
        and each tensor's parallel kind.
    :raises CheckpointError: naming the file and what is wrong with it (module docstring).

    >>> read_megatron("fixtures/megatron/gpt-tp2-legacy").distributed["tp"]  # doctest: +SKIP
    2
    """
    check = check_link or _no_check
    folder, latest = iteration_folder(path, check)
    par, files, trees = _rank_files(folder, check)
    distrib_optim = files.pop("distrib_optim", None)
    tensors, order, extra, _ = _model(par, files, trees)
    head_copies = tensors[_OUTPUT].copies if _OUTPUT in tensors else {}
    head = _tied_head(par, tensors, order)
    model: collections.OrderedDict[str, LazyTensor] = collections.OrderedDict()
    ledger = Ledger()
    for name in order:
        entry = tensors[name]
        if sorted(entry.copies) != list(range(par.tp)):
            raise CheckpointError(f"{printable(files[(0, 0, 0)])}: {quote(name)} is held by TP ranks "
                                  f"{sorted(entry.copies)} of {par.tp}; the ranks disagree — the folder mixes two "
                                  "saves")
        kept = _copies(name, entry, ledger)
        model[name] = join(entry.kind, name, kept, ledger)
    problem = None
    optimizer_path: tuple[str, ...] | None = ("optimizer",)
    tree: dict = {"model": model}
    if distrib_optim is None and all(t.get("optimizer") is None for t in trees.values()):
        optimizer_path = None  # saved without one (--no-save-optim)
    else:
        try:
            tree["optimizer"] = _optimizer(par, files, trees, tensors, order, distrib_optim, ledger)
        except _Unmapped as e:
            problem = f"{e}; the model reads without it"
    iteration = trees[(0, 0, 0)].get("iteration")
    distributed = {"tp": par.tp, "pp": par.pp, "ep": par.ep, "world_size": len(files), "num_layers": par.num_layers,
                   "iteration": iteration if type(iteration) is int else None,
                   "parallel": {n: tensors[n].kind for n in order}}
    if head is not None:
        distributed["tied_head_copy"] = head
        for t, copies in sorted(head_copies.items()):  # checked bitwise against the embedding's piece
            for path, key, tensor in copies:
                ledger.source(_key(path, key), tensor.spec.shape, None)
                ledger.copy(_key(path, key), _key(*tensors[_EMBEDDING].copies[t][0][:2]))
    distributed["accounted"] = ledger.check(CheckpointError)
    read = [*([latest] if latest else []), *(files[r] for r in par.ranks())]
    training = _Training(path, ("model",), optimizer_path, lambda: _whole(tree, problem), problem)
    # fusectl's record (its provenance) in the rank files of a save fusectl wrote (megatron_writer)
    record = read_torch_tree(files[(0, 0, 0)], records=RECORDS)[1]
    return Contents(dict(model), read, record, record.get(METADATA_KEY), ignored=extra, training=training,
                    order=list(model), distributed=distributed)


class _Training(Training):
    """A Megatron checkpoint's training state: its tree holds no copies of the model (twins)."""

    def twins(self, model_names: set[str]) -> list:
        """None: the tree holds the model and the optimizer only."""
        return []


def _whole(tree: dict, problem: str | None) -> dict:
    """The training tree, which a PyTorch output writes whole; never one without the optimizer
    fusectl could not map (a model-only output does not ask for it)."""
    if problem is not None:
        raise CheckpointError(f"{problem}, so fusectl writes no training dict of it; write the model to a "
                              ".safetensors file or a folder instead")
    return tree


def saved_args(path: str, check_link: Callable[[str], None] | None = None) -> dict[str, object]:
    """The fields of the ``args`` Namespace of the first rank file of the checkpoint at ``path``
    (the reader checks that every rank's agree): the sizes a writer of the model needs.

    :raises CheckpointError: as :func:`read_megatron` for a folder without rank files or args."""
    check = check_link or _no_check
    folder, _ = iteration_folder(path, check)
    names = sorted(n for n in _listing(folder) if MEGATRON_RANK_FOLDER.fullmatch(n))
    if not names:
        raise CheckpointError(f"{printable(folder)}: holds no mp_rank_TT[_PPP][_EEE] folders; {_HOW}")
    first = os.path.join(folder, names[0], RANK_FILE)
    tree = _read(first, check)
    Parallelism.of(tree, first)
    return dict(tree["args"].state)


def _no_check(path: str) -> None:
    return None


def _corrupt(path: str, what: str, value: object, expected: str) -> CheckpointError:
    return CheckpointError(f"{printable(path)}: {quote(what)} is {described(value)}, not {expected}; the file is corrupt "
                           "or not Megatron-LM's")

