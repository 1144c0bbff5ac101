"""Megatron-LM torch_dist checkpoints written without torch or Megatron: what
``dist_checkpointing.save`` leaves, which megatron-core loads at any TP, PP and EP.

The input is a model in megatron-core's TP=1 PP=1 names: what :mod:`.megatron` reads of a legacy
save, what :mod:`.megatron_dist` reads of a torch_dist one, or what ``llama-to-megatron-gpt``
makes of a Hugging Face Llama. :func:`write_megatron_dist` writes the save folder that
:mod:`.megatron_dist` documents, its tensors global (TP-invariant), under the keys the reader
maps back (:func:`.megatron_dist.stacked_slot`, the inverse of the reader's
:func:`.megatron_dist.layer_name`: one mapping, both ways):

- ``latest_checkpointed_iteration.txt`` and ``iter_NNNNNNN/`` (``release/`` for a model whose
  iteration is not known, as :mod:`.megatron_writer` names one), holding ``metadata.json``
  (``sharded_backend`` torch_dist), ``common.pt`` (``args`` — an ``argparse.Namespace`` whose
  ``ckpt_format`` is torch_dist, its parallelism the ``tp`` and ``pp`` given —,
  ``checkpoint_version`` 3.0, ``iteration``, ``num_floating_point_operations_so_far``) and a DCP
  folder of one rank's file (``.metadata``, ``__0_0.distcp``: :func:`.dcp_writer.write_items`);
- every layer's tensors stacked into one per key, ``[num_layers, …]``, each layer one DCP chunk
  (one item of the file, copied from the layer's file ranges where it has them): the norms under
  Transformer Engine's names (``self_attention.linear_qkv.layer_norm_weight``), SwiGLU
  ``linear_fc1`` as the TP=1 model holds it (``[gate_all; up_all]``), SequentialMLP experts
  stacked over layers and experts ``[layers, experts, …]``, one chunk per layer and expert;
  the embedding, final norm and output layer as they are (a tied model has no
  ``output_layer.weight``: megatron-core saves its head as a replica of the embedding);
- each linear module's extra state per layer (and expert), ``…_extra_state/shard_L_N``
  (``shard_L.E_N.M`` for experts): a value, ``[None]``, as megatron-core's local spec saves it,
  since its load asks for every one.

No ``rng_state`` is written (it belongs to the ranks of a training run): Megatron-LM resumes
from the save with ``--no-load-rng``. No optimizer state is written: megatron-core keeps a
torch_dist optimizer as sharded tensors of its own (``optimizer.state.exp_avg.…``) that
fusectl does not write yet, so the API refuses a training input whose optimizer is not dropped
on purpose. Every element is accounted for (:class:`~fusectl.rules.parallel.Ledger`): each input
tensor lands in exactly one slot of one stacked (or plain) tensor and every slot has one source,
checked before a byte is written. fusectl's record (its provenance) is kept in ``common.pt``'s
archive, which ``torch.load`` does not read; the input's config.json is copied beside
``latest_checkpointed_iteration.txt``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from typing import Mapping

from ...errors import PlanError, printable, quote
from ...rules.parallel import Ledger
from ...tensors import LazyTensor, TensorSpec
from ..sniff import MEGATRON_DIST_COMMON, MEGATRON_DIST_METADATA
from .chunks import Reshaped
from .dcp_writer import Chunked, write_items
from .megatron_dist import BACKEND, stacked_slot
from .megatron_writer import (CHECKPOINT_VERSION, GptSizes, check_divides, iteration_name, megatron_args,
                              module_order, sizes_of, write_tracker)
from .torch_writer import write_torch_file

# dist_checkpointing's metadata.json, as megatron-core 0.16 writes it
METADATA = {"sharded_backend": BACKEND, "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}
EXTRA_STATE = [None]  # a local-spec linear module's extra state, as megatron-core saves it
_LINEAR = re.compile(r"(decoder\.layers\..*(?:linear_proj|linear_qkv|linear_fc1|linear_fc2))\.weight")
_EMBEDDING = "embedding.word_embeddings.weight"


def dist_items(tensors: Mapping[str, LazyTensor], sizes: GptSizes, where: str) -> list[tuple[str, object]]:
    """The DCP items of the model ``tensors`` (megatron-core's TP=1 names), in order: each key
    where its first tensor stands in ``tensors``; a stacked key a :class:`~.dcp_writer.Chunked`
    tensor of one block per layer (and expert), followed by its module's extra state per slot.

    :raises PlanError: naming the key: a layer's tensor of another shape or dtype than the
        others of its key, a slot with no tensor or a tensor past the layers or experts (the
        ledger's proof fails), before anything is written.
    """
    ledger = Ledger()
    slots: dict[str, dict[tuple[int, ...] | None, tuple[str, LazyTensor]]] = {}
    for name, tensor in tensors.items():
        found = stacked_slot(name)
        key, index = found if found is not None else (name, None)
        slots.setdefault(key, {})[index] = (name, tensor)
        ledger.source(name, tensor.spec.shape, None)
    items: list[tuple[str, object]] = []
    for key, held in slots.items():
        if None in held:
            name, tensor = held[None]
            ledger.output(key, tensor.spec.shape, None)
            ledger.take(name, 0, key, 0, 1)
            items.append((key, tensor))
            continue
        first_name, first = next(iter(held.values()))
        counts = (sizes.num_layers, sizes.experts)[:len(next(iter(held)))]
        ledger.output(key, (math.prod(counts), *first.spec.shape), 0)
        blocks = []
        for index, (name, tensor) in held.items():
            if tensor.spec != first.spec:
                raise PlanError(f"{where}: {quote(name)} is {tensor.spec} but {quote(first_name)} is {first.spec}; "
                                f"torch_dist stacks them into one tensor {quote(key)}, so every layer's must agree")
            if all(i < n for i, n in zip(index, counts)):  # else never taken: the ledger names it
                flat = index[0] * counts[1] + index[1] if len(index) == 2 else index[0]
                ledger.take(name, 0, key, flat, 1)
                block = TensorSpec(tensor.spec.dtype, (1,) * len(index) + tensor.spec.shape)
                blocks.append(((*index, *(0,) * len(tensor.spec.shape)), Reshaped(block, tensor)))
        blocks.sort(key=lambda block: block[0])
        items.append((key, Chunked(TensorSpec(first.spec.dtype, (*counts, *first.spec.shape)), tuple(blocks))))
        module = _LINEAR.fullmatch(key)
        if module is not None:
            shape = ".".join(map(str, counts))
            items += [(f"{module.group(1)}._extra_state/shard_{'.'.join(map(str, index))}_{shape}", EXTRA_STATE)
                      for index in itertools.product(*map(range, counts))]
    ledger.check(PlanError)
    return items


def write_megatron_dist(folder: str, tensors: Mapping[str, LazyTensor], *, tp: int, pp: int, ep: int = 1,
                        config: Mapping[str, object] | None, tied: bool, iteration: int | None = None,
                        where: str = "", metadata: Mapping[str, str] | None = None,
                        config_text: bytes | None = None) -> tuple[int, int, int]:
    """Write ``tensors`` (megatron-core's TP=1 names) as a Megatron-LM torch_dist save folder
    ``folder`` (made if missing; module docstring).

    :param folder: the save folder (a temporary one the caller renames into place).
    :param tensors: name → tensor of the whole model, in any order (a tied head left out); written
        in megatron-core's module order.
    :param tp: the tensor-parallel size ``args`` records (the tensors are global: megatron-core
        loads them at any).
    :param pp: the pipeline-parallel size ``args`` records.
    :param ep: the expert-parallel size ``args`` records (an MoE model's experts divide over it;
        1 for a dense model).
    :param config: head counts and the rest of ``args`` (Megatron's args or a Hugging Face config).
    :param tied: the output layer shares the embedding (no ``output_layer.weight`` is stored).
    :param iteration: the iteration the save is named by (None: ``release``).
    :param where: the input, as messages name it.
    :param metadata: fusectl's record (its provenance), kept in ``common.pt``'s archive.
    :param config_text: a config.json written beside ``latest_checkpointed_iteration.txt``.
    :returns: (files of tensors written, bytes of tensors written, of which copied as file ranges).
    :raises PlanError: sizes that do not divide over ``tp``, ``pp`` and ``ep``, a model that is not
        megatron-core's GPT, a layer's tensor that does not stack with the others', before
        anything is written.

    >>> import tempfile
    >>> from fusectl.io.formats.megatron_dist import read_megatron_dist
    >>> model = read_megatron_dist("fixtures/megatron/gpt-tp2-torch_dist").tensors
    >>> out = tempfile.mkdtemp()
    >>> write_megatron_dist(out, model, tp=2, pp=1, config={"num_attention_heads": 4, "num_query_groups": 2},
    ...                     tied=False, iteration=10)[0]
    1
    """
    where = where or printable(folder)
    sizes = sizes_of(tensors, config, tied, where)
    check_divides(sizes, tp, pp, where, ep)
    items = dist_items({n: tensors[n] for n in module_order(list(tensors))}, sizes, where)
    args = megatron_args(sizes, tp, pp, iteration or 0, config, tensors[_EMBEDDING].spec.dtype.safetensors,
                         ep, ckpt_format=BACKEND)
    name = iteration_name(iteration)
    inside = os.path.join(folder, name)
    write_items(inside, items, None, name, where)
    common = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration or 0,
              "num_floating_point_operations_so_far": 0.0}
    write_torch_file(os.path.join(inside, MEGATRON_DIST_COMMON), common, metadata=metadata)
    with open(os.path.join(inside, MEGATRON_DIST_METADATA), "w", encoding="ascii") as f:
        json.dump(METADATA, f)
    write_tracker(folder, iteration, config_text)
    return 1, sum(t.spec.nbytes for t in tensors.values()), \
        sum(t.spec.nbytes for t in tensors.values() if t.byte_ranges() is not None)
