"""Tie discovery: provenance, safetensors ``save_model`` metadata, ``[ties]``, content hashes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np

from .errors import TieError
from .table import ParamTable
from .tensors import LazyTensor


def aliases_from_metadata(metadata: Mapping[str, str], stored: Iterable[str]) -> dict[str, str]:
    """``save_model`` records each removed shared tensor as ``{removed_name: kept_name}``."""
    stored = set(stored)
    return {k: v for k, v in metadata.items() if k not in stored and v in stored}


# transformers' tie conventions (the ``_tied_weights_keys`` of its model classes, 5.x): an
# output head (or its bias) that is the input embedding (or a shared bias) when the config's
# ``tie_word_embeddings`` is not false. save_pretrained stores only the right-hand name.
HEAD_TIES: tuple[tuple[str, str], ...] = (
    ("lm_head.weight", "model.embed_tokens.weight"),  # Llama, Mistral, Qwen, Gemma, Phi, ...
    ("lm_head.weight", "transformer.wte.weight"),  # GPT-2, GPT-J, GPT-Neo, CodeGen
    ("lm_head.weight", "transformer.word_embeddings.weight"),  # Bloom, Falcon
    ("lm_head.weight", "transformer.w.weight"),  # CTRL
    ("lm_head.weight", "gpt_neox.embed_in.weight"),
    ("embed_out.weight", "gpt_neox.embed_in.weight"),
    ("lm_head.weight", "model.decoder.embed_tokens.weight"),  # OPT, Marian
    ("lm_head.weight", "model.shared.weight"),  # BART, mBART, Pegasus, M2M100
    ("lm_head.weight", "shared.weight"),  # T5
    ("proj_out.weight", "model.decoder.embed_tokens.weight"),  # Whisper
    ("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"),
    ("cls.predictions.decoder.bias", "cls.predictions.bias"),
    ("cls.predictions.decoder.weight", "deberta.embeddings.word_embeddings.weight"),
    ("lm_head.decoder.weight", "roberta.embeddings.word_embeddings.weight"),
    ("lm_head.decoder.bias", "lm_head.bias"),
    ("vocab_projector.weight", "distilbert.embeddings.word_embeddings.weight"),
    ("generator_lm_head.weight", "electra.embeddings.word_embeddings.weight"),
    ("predictions.decoder.weight", "albert.embeddings.word_embeddings.weight"),
    ("predictions.decoder.bias", "predictions.bias"),
    ("decoder.weight", "model.embeddings.tok_embeddings.weight"),  # ModernBERT
    ("lm_loss.weight", "transformer.word_embedding.weight"),  # XLNet
    # Megatron-LM's GPTModel read with the config.json of the Hugging Face model it becomes
    # (megatron-gpt-to-llama): a shared head is not stored, the embedding is
    ("output_layer.weight", "embedding.word_embeddings.weight"),
)
# embeddings that T5- and BART-style models always share, whatever tie_word_embeddings says
SHARED_EMBEDDING_TIES: tuple[tuple[str, str], ...] = (
    ("encoder.embed_tokens.weight", "shared.weight"),
    ("decoder.embed_tokens.weight", "shared.weight"),
    ("model.encoder.embed_tokens.weight", "model.shared.weight"),
    ("model.decoder.embed_tokens.weight", "model.shared.weight"),
)
# model classes that have an output head (``BertModel`` has none, ``BertForMaskedLM`` has)
_HEAD_CLASS_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration",
                        "ForPreTraining", "MTModel", "WithLMHead")


def aliases_from_config(config: Mapping | None, stored: Iterable[str]) -> dict[str, str]:
    """Ties a transformers ``config.json`` declares, for names the checkpoint does not store:
    ``{alias: stored_name}``.

    A head is added only when ``architectures`` names a class that has one and
    ``tie_word_embeddings`` is not false: a head that is not stored can only be the embedding
    there, since transformers would otherwise report it missing.

    >>> config = {"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True}
    >>> aliases_from_config(config, ["model.embed_tokens.weight", "model.norm.weight"])
    {'lm_head.weight': 'model.embed_tokens.weight'}
    >>> aliases_from_config({"architectures": ["BertModel"]}, ["bert.embeddings.word_embeddings.weight"])
    {}
    """
    if not isinstance(config, Mapping):
        return {}
    stored = set(stored)
    architectures = config.get("architectures")
    has_head = isinstance(architectures, list) and any(
        isinstance(a, str) and a.endswith(_HEAD_CLASS_SUFFIXES) for a in architectures
    )
    pairs = list(SHARED_EMBEDDING_TIES)
    if has_head and config.get("tie_word_embeddings", True) is not False:
        pairs += HEAD_TIES
    return {alias: kept for alias, kept in pairs if kept in stored and alias not in stored}


def merge_aliases(sources: Iterable[tuple[str, Mapping[str, str]]]) -> dict[str, str]:
    """Merge alias maps from several sources; two sources that disagree are an error."""
    merged: dict[str, str] = {}
    origin: dict[str, str] = {}
    for where, aliases in sources:
        for alias, kept in aliases.items():
            if alias in merged and merged[alias] != kept:
                raise TieError(
                    f"{alias!r} is tied to {merged[alias]!r} by {origin[alias]} but to "
                    f"{kept!r} by {where}; fix the metadata of one of them"
                )
            merged[alias], origin[alias] = kept, where
    return merged


def apply_aliases(table: ParamTable, aliases: Mapping[str, str], where: str) -> None:
    """Add each alias as a structural name of its kept tensor."""
    for alias, kept in sorted(aliases.items()):
        if kept not in table:
            raise TieError(f"{where}: {alias!r} is recorded as an alias of {kept!r}, which is not stored")
        if alias in table and table[alias] is not table[kept]:
            raise TieError(f"{where}: {alias!r} is stored and also recorded as an alias of {kept!r}")
        table.tie([alias], keep=kept)


def declare_ties(table: ParamTable, groups: Iterable[Iterable[str]], where: str) -> None:
    """``[ties]`` groups: absent members become aliases; present ones must be bitwise equal."""
    for group in groups:
        members = sorted(set(group))
        present = [m for m in members if m in table]
        if not present:
            raise TieError(f"{where}: tie group {members} names no tensor of the checkpoint")
        keep = next((m for m in present if m in table.stored), present[0])
        for other in present:
            if table[other] is table[keep]:
                continue
            if table.spec(other) != table.spec(keep) or not _equal(table[other], table[keep]):
                raise TieError(
                    f"{where}: tie group {members}: {other!r} and {keep!r} differ "
                    f"({table.spec(other)} vs {table.spec(keep)}); they cannot be one parameter"
                )
        table.tie(members, keep=keep)


@dataclass(frozen=True)
class DetectedTies:
    """Suspected ties, and how many equal groups were not suspected for being constant."""

    groups: list[list[str]]
    constant_groups: int


def detect_ties(table: ParamTable) -> DetectedTies:
    """Groups of unique parameters with equal dtype, shape and bytes (reads every tensor).

    A tensor whose elements are all one value (a fresh norm weight of ones, a zero bias) equals
    every other such tensor by chance, not because the model shares it: such groups are
    counted, never suspected.
    """
    import hashlib  # here, not at start-up: OpenSSL is slow to load

    by_content: dict[tuple, list[str]] = {}
    constant: set[tuple] = set()
    for name, tensor in table.unique():
        data = _bytes(tensor)
        key = (tensor.spec, hashlib.blake2b(data, digest_size=16).hexdigest())
        by_content.setdefault(key, []).append(name)
        if _constant(data, tensor.spec.nbytes // max(tensor.spec.numel, 1)):
            constant.add(key)
    groups = [sorted(g) for key, g in by_content.items() if len(g) > 1 and key not in constant]
    skipped = sum(1 for key, g in by_content.items() if len(g) > 1 and key in constant)
    return DetectedTies(sorted(groups), skipped)


def _constant(data: memoryview, itemsize: int) -> bool:
    """Whether every element has the same bytes (packed sub-byte dtypes: every byte)."""
    flat = np.frombuffer(data, dtype=np.uint8)
    if itemsize < 1 or flat.size % itemsize:
        itemsize = 1
    elements = flat.reshape(-1, itemsize)
    return bool(np.all(elements == elements[:1]))


def _bytes(tensor: LazyTensor) -> memoryview:
    return np.ascontiguousarray(tensor.read()).reshape(-1).view(np.uint8).data


def _equal(a: LazyTensor, b: LazyTensor) -> bool:
    return _bytes(a) == _bytes(b)
