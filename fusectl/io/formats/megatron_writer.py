"""Megatron-LM legacy checkpoints written at a chosen TP, PP and EP, without torch or Megatron.

The input is a model in megatron-core's TP=1 PP=1 names: what :mod:`.megatron`'s reader gives
for any legacy save, or what the preset ``llama-to-megatron-gpt`` (``mixtral-to-megatron-moe``)
makes of a Hugging Face Llama (Mixtral).
:func:`write_megatron` splits it by the inverse of the reader's rules and writes what Megatron-LM's
``save_checkpoint`` (``--ckpt-format torch``) writes:

- ``latest_checkpointed_iteration.txt`` (the iteration number) and
  ``iter_NNNNNNN/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` per rank (``_PPP`` only at PP > 1,
  ``_EEE`` only at EP > 1: Megatron-LM's ``get_checkpoint_name``), each a
  ``torch.save`` dict with ``args`` (an ``argparse.Namespace``), ``checkpoint_version`` 3.0,
  ``iteration`` and ``model``: that rank's state dict, an ``OrderedDict`` in megatron-core's
  module order, each linear module's ``_extra_state`` None beside its weight (the local spec's
  value; Transformer Engine's layers accept None too);
- TP rank r holds: of a column-parallel tensor (``linear_qkv``, ``word_embeddings``,
  ``output_layer``) rows ``r·n/TP …`` (a query group whole on one rank, so the number of query
  groups must divide by TP); of a SwiGLU ``linear_fc1`` ``[gate_r; up_r]``; of a row-parallel
  weight (``linear_proj``, ``linear_fc2``) columns ``r·n/TP …``; a replicated tensor (norms,
  row-parallel biases) whole;
- PP stage p holds layers ``p·L/PP …``, numbered from 0 (where a name's layer index is, and what
  only the first or last stage holds: the layout file's ``[pipeline]``, as the reader reads it);
  the embedding only on stage 0; the final norm and the output layer only on the last (a tied
  head is stored there too at PP > 1, as megatron-core keeps its copy of the embedding on the
  last stage; at PP = 1 it is not stored).

Row pieces are file ranges of the input where it has them (nothing read but what is copied);
column pieces of a row-parallel weight are computed when their rank's file is written, one tensor
at a time. The sizes the split needs come from the tensors and a config: Megatron's own ``args``
(``num_attention_heads``, ``num_query_groups``, ``kv_channels``) or a Hugging Face config.json
(``num_attention_heads``, ``num_key_value_heads``, ``head_dim``).

An MoE model (every layer's MLP a ``router`` and experts ``mlp.experts.local_experts.N``, the
SequentialMLP's names) is written at TP × PP × EP: EP rank e holds experts ``e·E/EP …``
renumbered from 0 (the layout file's ``[experts]``), each expert's linears split over TP as the
dense ones are (megatron-core's expert tensor parallelism equal to TP); the
dense part (attention, norms, router, embedding, head) whole on every EP rank, as megatron-core
keeps it data-parallel there. Experts that do not divide over EP, an ``ep`` above 1 for a dense
model, layers without the same experts are PlanErrors before anything is written.

A training checkpoint's optimizer (the legacy, non-distributed one: torch's Adam
``state_dict()``) of the whole model — what the Megatron reader gives, or a TP=1 training dict a
fuse or convert wrote — is written into each rank file as ``optimizer``, as megatron-core's own
save holds it: the rank's parameters in megatron-core's param groups (the whole optimizer's
groups in their order: decayed weights, then 1-D ones without weight decay; at EP > 1 each
group's experts in an ``is_expert_parallel`` group right after it, at EP = 1 in their dense twin;
a group no parameter of the rank is in left out), each with its hyperparameters, ids 0..n-1 through the groups in the
rank's state-dict order; each parameter's ``exp_avg``/``exp_avg_sq`` split exactly like the
parameter (:func:`piece`), its ``step`` as it is; a tied head's last-stage copy (PP > 1) gets
the embedding's state, as megatron-core trains it with the embedding's gradient. An optimizer
that does not map so (:func:`whole_optimizer`) is a PlanError naming why, before anything is
written. The input's ``opt_param_scheduler`` is kept in every rank file; no ``rng_state`` is
written (each rank's RNG belongs to the input's parallelism). fusectl's record (its provenance)
is kept in each rank file's archive, which ``torch.load`` does not read; the input's config.json
is copied beside ``latest_checkpointed_iteration.txt``, where Megatron-LM does not look.
"""

from __future__ import annotations

import collections
import json
import os
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ...errors import PlanError, option, option_name, printable, quote
from ...rules.parallel import Ledger
from ...tensors import LazyTensor, TensorSpec
from ..sniff import MEGATRON_LATEST
from .chunks import assemble, cut
from .megatron import EXPERTS, LAYERS, LAYOUT, RANK_FILE, RECORDS, parallel_kind, rank_folder
from .torch_writer import write_torch_file

CHECKPOINT_VERSION = 3.0
_HOW = "a config.json (Hugging Face) with num_attention_heads and num_key_value_heads"
# megatron-core's module order within a layer (local and Transformer Engine specs)
_MODULES = (".input_layernorm.", ".self_attention.linear_proj.", ".self_attention.linear_qkv.",
            ".pre_mlp_layernorm.", ".mlp.router.", ".mlp.linear_fc1.", ".mlp.linear_fc2.", ".mlp.experts.")
_EXPERT_MODULES = (".linear_fc1.", ".linear_fc2.")
_TOP_FIRST = ("embedding.word_embeddings.", "embedding.position_embeddings.")
_TOP_LAST = ("decoder.final_layernorm.", "output_layer.")
_LINEAR = re.compile(r"(.*(?:linear_proj|linear_qkv|linear_fc1|linear_fc2)|output_layer)\.[a-z_]+")
_EMBEDDING = "embedding.word_embeddings.weight"
_OUTPUT = "output_layer.weight"


@dataclass(frozen=True)
class GptSizes:
    """The sizes of a megatron-core GPT that its split and its ``args`` need."""

    num_layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    swiglu: bool
    tied: bool
    bias: bool
    experts: int = 0  # experts per MoE layer (every layer's); 0: a dense model


def sizes_of(tensors: Mapping[str, LazyTensor], config: Mapping[str, object] | None, tied: bool,
             where: str) -> GptSizes:
    """The sizes of the model ``tensors`` (megatron-core's TP=1 names), its head counts from
    ``config`` (Megatron's args or a Hugging Face config.json).

    :param tensors: name → tensor of the whole model.
    :param config: the config's values (None: none given).
    :param tied: whether the output layer shares the embedding.
    :param where: the input, as messages name it.
    :raises PlanError: a config without head counts, tensors that disagree with it, MoE layers
        that do not all hold the same experts, a name megatron-core's GPT does not have.
    """
    for name in tensors:
        if parallel_kind(name, True, 2) is None or LAYERS.index(name) is None and LAYOUT.stage(name, 2) is None:
            raise PlanError(f"{where}: {quote(name)} is not a tensor of megatron-core's GPT (TP=1 names), so "
                            "fusectl cannot tell how Megatron splits it or which stage holds it; convert a Hugging "
                            "Face Llama with the llama-to-megatron-gpt preset (a Mixtral with "
                            "mixtral-to-megatron-moe) first")
    layers = {i for i in map(LAYERS.index, tensors) if i is not None}
    if not layers or layers != set(range(len(layers))):
        raise PlanError(f"{where}: holds layers {sorted(layers)[:8]}; a megatron-core GPT has decoder.layers.0 … "
                        "without gaps")
    qkv, proj = _need(tensors, "decoder.layers.0.self_attention.linear_qkv.weight", where), \
        _need(tensors, "decoder.layers.0.self_attention.linear_proj.weight", where)
    experts = _experts(tensors, len(layers), where)
    mlp = "decoder.layers.0.mlp." + ("experts.local_experts.0." if experts else "")
    fc1, fc2 = _need(tensors, mlp + "linear_fc1.weight", where), _need(tensors, mlp + "linear_fc2.weight", where)
    embedding = _need(tensors, _EMBEDDING, where)
    hidden = embedding.spec.shape[1] if len(embedding.spec.shape) == 2 else 0
    cfg = dict(config or {})
    heads = _int(cfg, "num_attention_heads", where)
    if heads is None:
        raise PlanError(f"{where}: no config says how many attention heads the model has; give "
                        f"{option_name('config')} {_HOW}")
    megatron = "num_query_groups" in cfg or "kv_channels" in cfg
    groups = _int(cfg, "num_query_groups" if megatron else "num_key_value_heads", where)
    if groups is None or (megatron and cfg.get("group_query_attention") is False):
        groups = heads
    head_dim = _int(cfg, "kv_channels" if megatron else "head_dim", where) or (hidden // heads if heads else 0)
    rows = (heads + 2 * groups) * head_dim
    if qkv.spec.shape[:1] != (rows,) or proj.spec.shape != (hidden, heads * head_dim) or heads % groups:
        raise PlanError(f"{where}: the config's {heads} heads in {groups} query groups of {head_dim} make a "
                        f"linear_qkv of {rows} rows and a linear_proj [{hidden}, {heads * head_dim}], but the model "
                        f"holds {qkv.spec} and {proj.spec}; give the model's own config")
    swiglu = fc1.spec.shape[:1] == (2 * fc2.spec.shape[-1],)
    ffn = fc2.spec.shape[-1]
    return GptSizes(len(layers), hidden, ffn, heads, groups, head_dim, embedding.spec.shape[0], swiglu, tied,
                    any(n.endswith(".bias") and "layernorm" not in n for n in tensors), experts)


def _experts(tensors: Mapping[str, LazyTensor], layers: int, where: str) -> int:
    """How many experts each MoE layer holds (0: none): every layer the same experts 0 … n-1,
    each with its router, or none.

    :raises PlanError: naming the first layer that differs."""
    found: list[set[int]] = [set() for _ in range(layers)]
    for name in tensors:
        expert, layer = EXPERTS.index(name), LAYERS.index(name)
        if expert is not None and layer is not None:
            found[layer].add(expert)
    count = len(found[0])
    for layer, indices in enumerate(found):
        router = f"decoder.layers.{layer}.mlp.router.weight"
        if indices != set(range(count)) or (count > 0) != (router in tensors):
            raise PlanError(f"{where}: layer {layer} holds experts {sorted(indices)[:8]}"
                            f"{' and a router' if router in tensors else ''}, layer 0 experts 0 … {count - 1}; "
                            "fusectl writes a Megatron MoE whose every layer holds the same experts, with a router "
                            "(args.num_experts), or a dense model")
    return count


def _need(tensors: Mapping[str, LazyTensor], name: str, where: str) -> LazyTensor:
    if name not in tensors:
        raise PlanError(f"{where}: holds no {quote(name)}, which every megatron-core GPT has; convert a Hugging "
                        "Face Llama with the llama-to-megatron-gpt preset first")
    return tensors[name]


def _int(config: Mapping[str, object], key: str, where: str) -> int | None:
    value = config.get(key)
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise PlanError(f"{where}: the config's {key} is {value!r}, not a positive integer; give "
                        f"{option_name('config')} {_HOW}")
    return value


def check_divides(sizes: GptSizes, tp: int, pp: int, where: str, ep: int = 1) -> None:
    """The model splits over ``tp`` tensor-, ``pp`` pipeline- and ``ep`` expert-parallel ranks.

    :raises PlanError: naming the size that does not divide, an ``ep`` above 1 for a dense model."""
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep)):
        if type(value) is not int or value < 1:
            raise PlanError(f"{option_name(name)} {value!r}: a positive integer")
    if ep > 1 and not sizes.experts:
        raise PlanError(f"{where}: holds no MoE experts (decoder.layers.L.mlp.experts.local_experts.N), so "
                        f"{option_name('ep')} {ep} has nothing to split; leave {option_name('ep')} out")
    for what, n, over in (("attention heads", sizes.heads, tp), ("query groups", sizes.groups, tp),
                          ("ffn rows", sizes.ffn, tp), ("vocabulary rows", sizes.vocab, tp),
                          ("layers", sizes.num_layers, pp), ("experts", sizes.experts, ep)):
        if n % over:
            flag = option_name({"layers": "pp", "experts": "ep"}.get(what, "tp"))
            raise PlanError(f"{where}: its {n} {what} do not divide over {flag} {over}; Megatron gives every rank an "
                            f"equal part — choose a {flag} that divides {n}")


# ------------------------------------------------------------------------------- the pieces


def piece(kind: str, tensor: LazyTensor, rank: int, tp: int) -> LazyTensor:
    """TP rank ``rank``'s piece of ``tensor`` of ``kind`` (:func:`.megatron.parallel_kind`): the
    layout's split inverted, the reader's join undone (rows as file ranges of the input where it
    has them; other cuts made when the rank's file is written, one tensor at a time).

    >>> from fusectl.tensors import ArrayTensor
    >>> from fusectl.dtypes import from_numpy
    >>> w = np.arange(8, dtype=np.float32).reshape(4, 2)
    >>> t = ArrayTensor(TensorSpec(from_numpy(w.dtype, "w"), (4, 2)), w)
    >>> piece("column-swiglu", t, 1, 2).read().ravel().tolist()
    [2.0, 3.0, 6.0, 7.0]
    """
    split, shape = LAYOUT.kind(kind), tensor.spec.shape
    if split.replicated or tp == 1:
        return tensor
    axis = split.axis
    local = tuple(n // tp if i == axis else n for i, n in enumerate(shape))
    pieces = []
    for start, at, count in split.runs(shape[axis], tp)[rank]:
        pieces.append((tuple(start if i == axis else 0 for i in range(len(shape))), cut(tensor, axis, at, count)))
    return assemble(TensorSpec(tensor.spec.dtype, local), pieces)


def _module_rank(name: str) -> tuple[int, int, int]:
    """Where a layer's entry ``name`` sits in megatron-core's module order: its module, then an
    expert's index and its linear."""
    rank = next((i for i, m in enumerate(_MODULES) if m in name), len(_MODULES))
    expert = EXPERTS.index(name)
    if expert is None:
        return rank, 0, 0
    return rank, expert, next((i for i, m in enumerate(_EXPERT_MODULES) if m in name), len(_EXPERT_MODULES))


def module_order(names: Sequence[str]) -> list[str]:
    """``names`` in megatron-core's state-dict order (the input's order within a module).

    >>> module_order(["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight",
    ...               "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"])[0]
    'decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight'
    """
    def key(item: tuple[int, str]) -> tuple:
        i, name = item
        layer = LAYERS.index(name)
        if layer is not None:
            return (1, layer, *_module_rank(name), i)
        first = next((j for j, p in enumerate(_TOP_FIRST) if name.startswith(p)), None)
        if first is not None:
            return (0, first, 0, 0, 0, i)
        last = next((j for j, p in enumerate(_TOP_LAST) if name.startswith(p)), len(_TOP_LAST))
        return (2, last, 0, 0, 0, i)
    return [n for _, n in sorted(enumerate(names), key=key)]


@dataclass(frozen=True)
class Rank:
    """One rank of the written save: its TP rank, PP stage and EP rank of ``tp`` × ``pp`` × ``ep``."""

    t: int
    p: int
    e: int
    tp: int
    pp: int
    ep: int

    @property
    def folder(self) -> str:
        """Megatron-LM's name of its folder (``mp_rank_TT[_PPP][_EEE]``)."""
        return rank_folder(self.t, self.p, self.e, self.pp, self.ep)

    def at(self, t: int | None = None, p: int | None = None, e: int | None = None) -> "Rank":
        """The rank of the same save at another TP rank, stage or EP rank."""
        return Rank(self.t if t is None else t, self.p if p is None else p, self.e if e is None else e,
                    self.tp, self.pp, self.ep)


def local_name(name: str, rank: Rank, sizes: GptSizes) -> str | None:
    """The name ``rank`` holds the whole model's tensor ``name`` by, or None where it holds none of
    it: a layer numbered from 0 in its stage, an expert from 0 on its EP rank; a name outside the
    layers on the stage the layout's ``[pipeline]`` says (the embedding on the first, the final
    norm and the head on the last).

    >>> sizes = GptSizes(2, 16, 32, 4, 2, 4, 64, True, False, False, 4)
    >>> local_name("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight", Rank(0, 1, 1, 1, 2, 2), sizes)
    'decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight'
    """
    if LAYERS.index(name) is None:
        return name if LAYOUT.stage(name, rank.pp) == rank.p else None
    local = LAYERS.on_rank(name, rank.p, sizes.num_layers // rank.pp)
    if local is None or EXPERTS.index(local) is None:
        return local
    return EXPERTS.on_rank(local, rank.e, sizes.experts // rank.ep)


def rank_models(tensors: Mapping[str, LazyTensor], sizes: GptSizes, tp: int, pp: int, ep: int = 1
                ) -> dict[Rank, collections.OrderedDict]:
    """Each rank → its ``model`` state dict (tensors, and None for each linear module's
    ``_extra_state``), in megatron-core's order; ranks stage by stage, EP rank by EP rank."""
    names = module_order(list(tensors))
    if sizes.tied and _OUTPUT not in tensors:
        # at PP > 1 the last stage keeps its copy of the shared embedding; at PP = 1 only the
        # output layer's extra state is stored
        names.append(_OUTPUT)
    ledger = Ledger()
    for name, tensor in tensors.items():
        split = LAYOUT.kind(parallel_kind(name, sizes.swiglu, tp))
        ledger.source(name, tensor.spec.shape, None if split.replicated or tp == 1 else split.axis)
    out = {}
    for p in range(pp):
        for e in range(ep):
            for t in range(tp):
                rank = Rank(t, p, e, tp, pp, ep)
                out[rank] = _rank_model(tensors, names, sizes, rank, ledger)
    ledger.check(PlanError)
    return out


def _rank_model(tensors: Mapping[str, LazyTensor], names: Sequence[str], sizes: GptSizes, rank: Rank,
                ledger: Ledger) -> collections.OrderedDict:
    """``rank``'s model (:func:`rank_models`), its pieces recorded in ``ledger``."""
    model: collections.OrderedDict = collections.OrderedDict()
    extra = None
    for name in names:
        local = local_name(name, rank, sizes)
        if local is None:
            continue
        module = _LINEAR.fullmatch(local)
        module = module.group(1) if module else None
        if extra is not None and module != extra:
            model[f"{extra}._extra_state"] = None
        extra = module
        if sizes.tied and name == _OUTPUT and rank.pp == 1:
            if name in tensors and rank.t == 0 and rank.e == 0:  # the input's head is the embedding (tied)
                ledger.copy(name, _EMBEDDING)
            continue  # the head reads the embedding; its module keeps only its extra state
        source = name if name in tensors else _EMBEDDING
        kind = parallel_kind(source, sizes.swiglu, rank.tp)
        model[local] = piece(kind, tensors[source], rank.t, rank.tp)
        _record(ledger, source, kind, tensors[source].spec.shape, rank, local, name != source)
    if extra is not None:
        model[f"{extra}._extra_state"] = None
    return model


def _record(ledger: Ledger, name: str, kind: str, shape: tuple[int, ...], rank: Rank, local: str,
            tied_copy: bool) -> None:
    """Record in ``ledger`` that ``rank`` holds ``name``'s piece as ``local``: its slices of the
    whole; a replicated tensor's whole once (on its first TP rank; a copy on every other), the
    dense part once (on EP rank 0; a copy on every other), a tied head a copy of its stage 0
    embedding piece."""
    split, expert = LAYOUT.kind(kind), EXPERTS.index(local) is not None
    key = f"{rank.folder}: {local}"
    if tied_copy:
        ledger.output(key, shape, None)
        ledger.copy(key, f"{rank.at(p=0, e=0).folder}: {name}")
        return
    if not expert and rank.e > 0:  # the dense part: EP rank 0's, again
        ledger.output(key, shape, None)
        ledger.copy(key, f"{rank.at(t=0 if split.replicated else None, e=0).folder}: {local}")
        return
    if split.replicated or rank.tp == 1:
        ledger.output(key, shape, None)
        first = f"{rank.at(t=0).folder}: {local}"
        if key == first:
            ledger.take(name, 0, key, 0, 1)
        else:
            ledger.copy(key, first)
        return
    axis = split.axis
    ledger.output(key, tuple(n // rank.tp if i == axis else n for i, n in enumerate(shape)), axis)
    for start, at, count in split.runs(shape[axis], rank.tp)[rank.t]:
        ledger.take(name, at, key, start, count)


# ------------------------------------------------------------------------------- the optimizer

_NAMES_KEY = "fusectl.param_names"  # optimizer_state.NAMES_KEY: the parameter of each id, in id order


@dataclass(frozen=True)
class WholeOptimizer:
    """The whole (TP=1 PP=1) model's optimizer, parsed for splitting: its param groups'
    hyperparameters (``params`` and ``param_names`` left out) and, per parameter name, its
    group's index and its state (``{}``: none, as torch keeps for a parameter never stepped)."""

    hyper: tuple[dict, ...]
    group_of: dict[str, int]
    state_of: dict[str, dict]


def whole_optimizer(optimizer: object, tensors: Mapping[str, LazyTensor], record: Mapping[str, str] | None,
                    where: str, copies: Mapping[str, str] | None = None) -> WholeOptimizer:
    """The optimizer ``state_dict()`` of the whole model ``tensors`` parsed for splitting: each
    id's parameter from its group's ``param_names`` (what fusectl's Megatron reader gives), else
    from fusectl's ``record`` (the parameter of each id, in id order).

    :param optimizer: torch's ``{"state": {id: {...}}, "param_groups": [...]}``.
    :param tensors: the whole model (megatron-core's TP=1 names; a tied head left out).
    :param record: the training dict's fusectl record (None: none).
    :param where: the input, as messages name it.
    :param copies: name → the tensor of ``tensors`` it is a copy of (a tied head's copy on the last
        PP stage, which megatron-core trains with the embedding's gradient): its state, where the
        optimizer has one, must be the kept one's, bitwise; it is written as that one's.
    :raises PlanError: an optimizer that is not torch's state_dict, ids no name is known for, a
        parameter in no group or in two, a group naming a tensor the model does not hold, a
        state tensor whose shape is not its parameter's, a moment some parameters lack, a
        copy's state that is not its tensor's.
    """
    copies = dict(copies or {})
    state, groups = (optimizer.get("state"), optimizer.get("param_groups")) if isinstance(optimizer, dict) else \
        (None, None)
    if not isinstance(state, dict) or not isinstance(groups, list) or \
            not all(isinstance(g, dict) and type(g.get("params")) is list for g in groups):
        raise PlanError(f"{where}: its optimizer is not torch's state_dict (state, param_groups with params), so "
                        f"fusectl cannot split it over Megatron's ranks; {_drop()}")
    ids = [i for g in groups for i in g["params"]]
    if len(set(ids)) != len(ids) or not all(type(i) is int for i in ids):
        raise PlanError(f"{where}: its optimizer's param groups list an id twice or one that is not an integer; "
                        f"fusectl cannot tell whose state each id is; {_drop()}")
    if all(type(g.get("param_names")) is list and len(g["param_names"]) == len(g["params"]) for g in groups):
        name_of = dict(zip(ids, (n for g in groups for n in g["param_names"])))
    else:
        names = _recorded_names(record)
        if names is None or sorted(ids) != list(range(len(names))):
            raise PlanError(f"{where}: its optimizer's param groups do not name their parameters (param_names) and "
                            f"fusectl's record of them is missing or lists {len(names or [])} for {len(ids)} ids; "
                            f"fusectl cannot tell whose state each id is; {_drop()}")
        name_of = {i: names[i] for i in ids}
    group_of: dict[str, int] = {}
    copied = {i: name_of.pop(i) for i in list(name_of) if name_of[i] in copies}
    for index, group in enumerate(groups):
        for i in group["params"]:
            if i in copied:
                continue
            name = name_of[i]
            if name not in tensors:
                raise PlanError(f"{where}: optimizer param group {index} holds {quote(str(name))}, which the model "
                                f"to write does not hold; fusectl cannot map that group to Megatron's; {_drop()}")
            if group_of.setdefault(name, index) != index:
                raise PlanError(f"{where}: {quote(name)} is in two optimizer param groups; {_drop()}")
    missing = next((n for n in tensors if n not in group_of), None)
    if missing is not None:
        raise PlanError(f"{where}: {quote(missing)} is in none of the optimizer's param groups, so megatron-core's "
                        f"optimizer on its rank would have no group to put it in; {_drop()}")
    state_of: dict[str, dict] = {}
    moments: set[str] | None = None
    for i, name in name_of.items():
        entry = state.get(i, {})
        if not isinstance(entry, dict):
            raise PlanError(f"{where}: the optimizer state of {quote(name)} (id {i}) is not a dict; {_drop()}")
        shaped = set()
        for key, value in entry.items():
            if isinstance(value, LazyTensor) and value.spec.shape:
                if value.spec.shape != tensors[name].spec.shape:
                    raise PlanError(f"{where}: the optimizer's {quote(str(key))} of {quote(name)} is {value.spec}, "
                                    f"but the parameter is {tensors[name].spec}; fusectl splits a moment exactly "
                                    f"like its parameter and cannot split this one; {_drop()}")
                shaped.add(key)
        if entry:
            if moments is not None and shaped != moments:
                lacking = sorted(moments ^ shaped)[0]
                raise PlanError(f"{where}: the optimizer state of {quote(name)} lacks or adds {quote(str(lacking))} "
                                f"beside the other parameters' moments; a missing moment is never written as one; "
                                f"{_drop()}")
            moments = shaped
        state_of[name] = entry
    for i, name in copied.items():
        kept = copies[name]
        index = next(n for n, g in enumerate(groups) if i in g["params"])
        if index != group_of[kept] or not _same_state(state.get(i, {}), state_of[kept]):
            raise PlanError(f"{where}: the optimizer state of {quote(name)}, a copy of {quote(kept)}, is not that "
                            f"tensor's (another group, or other moments), so the copy is not trained as it is; "
                            f"fusectl writes one state for both and cannot choose; {_drop()}")
    hyper = tuple({k: v for k, v in g.items() if k not in ("params", "param_names")} for g in groups)
    return WholeOptimizer(hyper, group_of, state_of)


def _same_state(a: object, b: Mapping) -> bool:
    """Two optimizer states with the same entries, numbers equal and tensors bitwise."""
    if not isinstance(a, dict) or list(a) != list(b):
        return False
    for key, value in a.items():
        other = b[key]
        if isinstance(value, LazyTensor) or isinstance(other, LazyTensor):
            if not (isinstance(value, LazyTensor) and isinstance(other, LazyTensor) and value.spec == other.spec
                    and value.read().tobytes() == other.read().tobytes()):
                return False
        elif type(value) is not type(other) or value != other:
            return False
    return True


def _drop() -> str:
    return f"pass {option('drop_optimizer')} to write the model without its optimizer state"


def _recorded_names(record: Mapping[str, str] | None) -> list[str] | None:
    """The parameter of each id fusectl recorded for a training dict it wrote, or None."""
    text = (record or {}).get(_NAMES_KEY)
    try:
        names = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return names if isinstance(names, list) and all(type(n) is str for n in names) else None


def whole_name(local: str, rank: Rank, sizes: GptSizes) -> str:
    """The whole model's name of the tensor ``rank``'s ``local`` entry holds (:func:`local_name`
    undone by the same layout tables): its layer number plus the layers of the stages before, an
    expert's index plus the experts of the EP ranks before; a tied head (the last stage's copy
    at PP > 1) the embedding.

    >>> sizes = GptSizes(4, 16, 32, 4, 2, 4, 64, True, False, False, 4)
    >>> whole_name("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", Rank(0, 1, 1, 1, 2, 2), sizes)
    'decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight'
    """
    if LAYERS.index(local) is None:
        return _EMBEDDING if sizes.tied and local == _OUTPUT else local
    name = LAYERS.renumbered(local, rank.p * (sizes.num_layers // rank.pp))
    if EXPERTS.index(name) is None:
        return name
    return EXPERTS.renumbered(name, rank.e * (sizes.experts // rank.ep))


_EXPERT_PARALLEL = "is_expert_parallel"


def _rank_groups(whole: WholeOptimizer, ep: int) -> tuple[list[dict], dict[tuple[int, bool], int]]:
    """megatron-core's param groups at ``ep`` of the whole optimizer's (``_get_param_groups``: one
    group per set of hyperparameters and ``is_expert_parallel``, experts' weights expert-parallel
    only at EP > 1): (their hyperparameters in order, (whole group, an expert's) → its index).

    A whole group of expert-parallel parameters (read at EP > 1) joins, at EP = 1, the group
    whose hyperparameters are its own but for that flag; a group's experts at EP > 1 form a group
    of their own right after it, flagged."""
    hyper = whole.hyper
    plain = [{k: v for k, v in h.items() if k != _EXPERT_PARALLEL} for h in hyper]
    targets: list[dict] = []
    index: dict[tuple[int, bool], int] = {}
    for g, h in enumerate(hyper):
        base = g
        if h.get(_EXPERT_PARALLEL) is True:  # its dense twin, where the whole optimizer has one
            base = next((b for b in range(len(hyper)) if plain[b] == plain[g] and
                         hyper[b].get(_EXPERT_PARALLEL) is not True), g)
        for expert in (False, True):
            flagged = expert and ep > 1
            if _EXPERT_PARALLEL in hyper[base] or flagged:
                target = {_EXPERT_PARALLEL: flagged, **plain[base]} if _EXPERT_PARALLEL not in hyper[base] else \
                    {k: (flagged if k == _EXPERT_PARALLEL else v) for k, v in hyper[base].items()}
            else:
                target = dict(hyper[base])
            if target not in targets:
                targets.append(target)
            index[(g, expert)] = targets.index(target)
    return targets, index


def rank_optimizer(whole: WholeOptimizer, model: Mapping[str, LazyTensor | None], rank: Rank,
                   sizes: GptSizes) -> dict:
    """``rank``'s optimizer ``state_dict()``, the rank holding ``model`` (:func:`rank_models`):
    megatron-core's param groups of its parameters (:func:`_rank_groups`: the whole optimizer's
    in their order, experts' re-grouped for the EP written, empty ones left out, each with its
    hyperparameters), ids 0..n-1 through them in the model's order, each parameter's state split
    like the parameter (:func:`piece`), its numbers (``step``) as they are."""
    hyper, index = _rank_groups(whole, rank.ep)
    members: list[list[str]] = [[] for _ in hyper]
    for local, value in model.items():
        if value is not None:
            name = whole_name(local, rank, sizes)
            members[index[(whole.group_of[name], EXPERTS.index(name) is not None)]].append(name)
    state, groups, pid = {}, [], 0
    for h, names in zip(hyper, members):
        if not names:
            continue
        ids = list(range(pid, pid + len(names)))
        for i, name in zip(ids, names):
            entry = whole.state_of[name]
            if entry:
                kind = parallel_kind(name, sizes.swiglu, rank.tp)
                state[i] = {k: piece(kind, v, rank.t, rank.tp) if isinstance(v, LazyTensor) and v.spec.shape else v
                            for k, v in entry.items()}
        groups.append({**h, "params": ids})
        pid += len(names)
    return {"state": state, "param_groups": groups}


# ------------------------------------------------------------------------------- the files


def megatron_args(sizes: GptSizes, tp: int, pp: int, iteration: int, config: Mapping[str, object] | None,
                  dtype: str, ep: int = 1, ckpt_format: str = "torch") -> object:
    """The ``argparse.Namespace`` record Megatron-LM pickles into each rank file (``common.pt``
    for ``ckpt_format`` torch_dist): the given
    config's plain values where it is Megatron's own ``args``, then the sizes and parallelism
    (an MoE's ``num_experts``, ``moe_ffn_hidden_size``, ``expert_model_parallel_size``; its
    ``moe_router_topk`` from Megatron's args or a Hugging Face config's ``num_experts_per_tok``;
    the smallest world that holds the ranks: ``tp·pp·ep``, the dense part data-parallel over EP)."""
    base: dict[str, object] = {}
    if config and ("num_query_groups" in config or "tensor_model_parallel_size" in config):
        base = {k: v for k, v in config.items() if v is None or type(v) in (int, float, bool, str)}
    else:
        cfg = dict(config or {})
        topk = cfg.get("num_experts_per_tok")
        if sizes.experts and type(topk) is int:
            base["moe_router_topk"] = topk
        rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000))
        eps = cfg.get("rms_norm_eps", 1e-5)
        positions = cfg.get("max_position_embeddings")
        base |= {"max_position_embeddings": positions if type(positions) is int else None,
                "seq_length": positions if type(positions) is int else None,
                "position_embedding_type": "rope", "rotary_base": theta if type(theta) in (int, float) else 10000,
                "rotary_percent": 1.0, "normalization": "RMSNorm", "norm_epsilon": eps if type(eps) is float else 1e-5}
    base.update(
        num_layers=sizes.num_layers, hidden_size=sizes.hidden, ffn_hidden_size=sizes.ffn,
        num_attention_heads=sizes.heads, group_query_attention=sizes.groups != sizes.heads,
        num_query_groups=sizes.groups, kv_channels=sizes.head_dim, swiglu=sizes.swiglu,
        add_bias_linear=sizes.bias, untie_embeddings_and_output_weights=not sizes.tied,
        padded_vocab_size=sizes.vocab, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, num_experts=sizes.experts or None, fp16=dtype == "F16", bf16=dtype == "BF16",
        ckpt_format=ckpt_format, use_distributed_optimizer=False, iteration=iteration, world_size=tp * pp * ep,
        data_parallel_size=ep)
    if sizes.experts:
        base.update(moe_ffn_hidden_size=sizes.ffn, moe_grouped_gemm=False)
        base.setdefault("moe_router_topk", 2)
    else:
        for key in ("moe_ffn_hidden_size", "moe_router_topk", "moe_grouped_gemm"):
            base.pop(key, None)
    base.setdefault("make_vocab_size_divisible_by", 1)
    base.setdefault("transformer_impl", "local")
    record = RECORDS.classes["argparse.Namespace"]()
    record.state = base
    return record


def write_megatron(folder: str, tensors: Mapping[str, LazyTensor], *, tp: int, pp: int, ep: int = 1,
                   config: Mapping[str, object] | None, tied: bool, iteration: int | None = None,
                   where: str = "", optimizer: WholeOptimizer | None = None, scheduler: object = None,
                   metadata: Mapping[str, str] | None = None, config_text: bytes | None = None
                   ) -> tuple[int, int, int]:
    """Write ``tensors`` (megatron-core's TP=1 names) as a Megatron-LM legacy save folder
    ``folder`` (made if missing) at ``tp`` × ``pp`` × ``ep`` (module docstring).

    :param folder: the save folder (a temporary one the caller renames into place).
    :param tensors: name → tensor of the whole model, in any order.
    :param tp: tensor-parallel size.
    :param pp: pipeline-parallel size.
    :param ep: expert-parallel size (an MoE model's experts divide over it; 1 for a dense model).
    :param config: head counts and the rest of ``args`` (Megatron's args or a Hugging Face config).
    :param tied: the output layer shares the embedding (``output_layer.weight`` not stored at PP=1).
    :param iteration: the iteration the save is named by (None: ``release``, as Megatron names a
        converted model, whose loader refuses iteration 0).
    :param where: the input, as messages name it.
    :param optimizer: the whole model's optimizer (:func:`whole_optimizer`), written split per
        rank as ``optimizer`` (:func:`rank_optimizer`); None: none written.
    :param scheduler: ``opt_param_scheduler`` written in every rank file as it is (None: none).
    :param metadata: fusectl's record (its provenance), kept in every rank file's archive
        (``torch_writer``), which ``torch.load`` does not read.
    :param config_text: a config.json written beside ``latest_checkpointed_iteration.txt``,
        where Megatron-LM does not look.
    :returns: (rank files written, bytes of tensors written in them, of which copied as file ranges).
    :raises PlanError: sizes that do not divide (experts over ``ep`` too), ``ep`` above 1 for a
        dense model, a model that is not megatron-core's GPT, before anything is written.
    """
    where = where or printable(folder)
    sizes = sizes_of(tensors, config, tied, where)
    check_divides(sizes, tp, pp, where, ep)
    dtype = tensors[_EMBEDDING].spec.dtype.safetensors
    models = rank_models(tensors, sizes, tp, pp, ep)
    args = megatron_args(sizes, tp, pp, iteration or 0, config, dtype, ep)
    iteration_folder = os.path.join(folder, iteration_name(iteration))
    written = copied = 0
    for rank, model in models.items():
        tree = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration or 0, "model": model}
        if optimizer is not None:
            tree["optimizer"] = rank_optimizer(optimizer, model, rank, sizes)
            if scheduler is not None:
                tree["opt_param_scheduler"] = scheduler
        held = [v for v in model.values() if v is not None] + \
            [v for e in tree.get("optimizer", {"state": {}})["state"].values() for v in e.values()
             if isinstance(v, LazyTensor)]
        written += sum(v.spec.nbytes for v in held)
        copied += sum(v.spec.nbytes for v in held if v.byte_ranges() is not None)
        path = os.path.join(iteration_folder, rank.folder)
        os.makedirs(path, exist_ok=True)
        write_torch_file(os.path.join(path, RANK_FILE), tree, metadata=metadata)
    write_tracker(folder, iteration, config_text)
    return len(models), written, copied


def iteration_name(iteration: int | None) -> str:
    """The iteration folder Megatron-LM saves ``iteration`` in (None: ``release``)."""
    return "release" if iteration is None else f"iter_{iteration:07d}"


def write_tracker(folder: str, iteration: int | None, config_text: bytes | None) -> None:
    """``latest_checkpointed_iteration.txt`` (the iteration, or ``release``) in the save folder,
    and ``config_text`` beside it as config.json, where Megatron-LM does not look."""
    with open(os.path.join(folder, MEGATRON_LATEST), "w", encoding="ascii") as f:
        f.write("release" if iteration is None else str(iteration))
    if config_text is not None:
        with open(os.path.join(folder, "config.json"), "wb") as f:
            f.write(config_text)

