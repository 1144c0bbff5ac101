"""A plan is computed from headers alone (SPEC §1), for every kind of checkpoint: plain ones,
quantized ones (scales follow their weights) and LoRA adapters (A and B follow the base view).

Every tensor of the opened checkpoint is swapped for one whose ``read()`` fails, and the file
readers fail too: ``fusectl.plan`` must not touch tensor data. And ``adapter_config.json`` is
read and parsed once per opened checkpoint, however many steps ask about the adapter.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

import fusectl
import fusectl.io.checkpoint
import fusectl.tensors
from conftest import FIXTURES, ok
from fusectl.io.checkpoint import open_checkpoint
from fusectl.tensors import LazyTensor, TensorSpec

LORA = FIXTURES / "lora"
LLAMA_CONFIG = str(LORA / "llama-base" / "config.json")
PHI3_CONFIG = str(LORA / "phi3-base" / "config.json")


@dataclass(frozen=True, eq=False)
class Unreadable(LazyTensor):
    """A tensor that knows its spec and fails when anything reads it."""

    spec: TensorSpec
    name: str

    def read(self):
        raise AssertionError(f"the plan read the data of {self.name!r}")

    def byte_ranges(self):
        raise AssertionError(f"the plan asked for the bytes of {self.name!r}")


def unreadable(path, config=None):
    """``path`` opened, each tensor replaced by an Unreadable one (tied names stay tied)."""
    checkpoint = open_checkpoint(str(path), config)
    table = checkpoint.table
    swapped = {}
    for name in table.names():
        tensor = table[name]
        table.entries[name] = swapped.setdefault(id(tensor), Unreadable(tensor.spec, name))
    return checkpoint


@pytest.fixture
def no_file_reads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the plan read tensor data")

    monkeypatch.setattr(fusectl.tensors, "read_ranges", refuse)
    monkeypatch.setattr(fusectl.tensors.FileTensor, "read", refuse)
    monkeypatch.setattr(os, "preadv", refuse)
    monkeypatch.setattr(os, "pread", refuse)


@pytest.mark.parametrize("fixture,rules,config", [
    ("tiny-llama-gqa", ["llama-qkv", "llama-gate-up"], None),
    ("fp8-llama", ["llama-qkv", "llama-gate-up"], None),
    ("fp8-llama", ["llama-qkv", "fp8-dequant"], None),  # a later rule binds the moved scales
    ("fp8-llama-channel", ["llama-qkv", "llama-gate-up"], None),
    ("fp8-moe", ["fp8-dequant"], None),
    ("lora/llama-lora", ["llama-qkv", "llama-gate-up"], LLAMA_CONFIG),
    ("lora/phi3-lora", ["phi3-unfuse"], PHI3_CONFIG),
])
def test_a_plan_reads_no_tensor_data(fixture, rules, config, no_file_reads):
    planned = fusectl.plan(unreadable(FIXTURES / fixture, config), rules)
    assert planned.plan.steps
    if "lora" in fixture:
        assert planned.lora_base is not None and planned.lora_base.steps


def test_fusing_split_lora_parts_again_reads_no_data_and_shares_their_a(tmp_path, request):
    """The parts of a split adapter share one A: the provenance says one replicate step made
    them, so the fuse merges them to rank r without reading the As (it used to compare them)."""
    split = tmp_path / "split"
    fusectl.fuse(LORA / "phi3-lora", ["phi3-unfuse"], split, config=PHI3_CONFIG)
    checkpoint = unreadable(split, PHI3_CONFIG)
    request.getfixturevalue("no_file_reads")
    planned = fusectl.plan(checkpoint, ["llama-qkv"])
    kinds = {s.op.kind for s in planned.plan.steps}
    assert "merge_equal" in kinds and "block_diagonal" not in kinds


def test_a_split_adapter_without_its_provenance_fuses_block_diagonal(tmp_path):
    """Without the provenance nothing in the headers says the As are one: the exact general
    form (block-diagonal B, rank 3r) is planned, whatever the data holds."""
    import json

    from conftest import array_of, load_checkpoint_raw, write_safetensors

    split = tmp_path / "split"
    fusectl.fuse(LORA / "phi3-lora", ["phi3-unfuse"], split, config=PHI3_CONFIG)
    arrays = {n: array_of(e) for n, e in load_checkpoint_raw(split).items()}
    write_safetensors(split / "adapter_model.safetensors", arrays)  # no metadata: no provenance
    planned = fusectl.plan(unreadable(split, PHI3_CONFIG), ["llama-qkv"])
    kinds = {s.op.kind for s in planned.plan.steps}
    assert "block_diagonal" in kinds and "merge_equal" not in kinds
    rank = json.loads((split / "adapter_config.json").read_text())["r"]
    qkv = next(s for s in planned.plan.steps if s.op.kind == "concat" and "lora_A" in s.outputs[0])
    assert qkv.output_specs[0].shape[0] == 3 * rank


def test_a_lying_provenance_fails_the_merge_instead_of_writing_a_wrong_adapter(tmp_path):
    """The provenance says one replicate made the As, but one A was changed since: the merge
    compares them when it runs and stops."""
    from conftest import array_of, load_checkpoint_raw, metadata_of, write_safetensors

    split = tmp_path / "split"
    fusectl.fuse(LORA / "phi3-lora", ["phi3-unfuse"], split, config=PHI3_CONFIG)
    arrays = {n: array_of(e) for n, e in load_checkpoint_raw(split).items()}
    name = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"
    arrays[name] = arrays[name] + 1
    write_safetensors(split / "adapter_model.safetensors", arrays, metadata_of(split))
    with pytest.raises(fusectl.errors.FusectlError, match="for LoRA factors the provenance records as one replicated tensor, the file was edited"):
        fusectl.fuse(split, ["llama-qkv"], tmp_path / "again", config=PHI3_CONFIG)
    assert not (tmp_path / "again").exists()


@pytest.fixture
def adapter_reads(monkeypatch):
    """How many times adapter_config.json is read from disk and parsed."""
    counts = {"read": 0, "parsed": 0}
    read, parse = fusectl.io.checkpoint.read_config_text, fusectl.io.checkpoint.load_json

    def counting_read(path):
        if os.path.basename(path) == "adapter_config.json":
            counts["read"] += 1
        return read(path)

    def counting_parse(text, where, what):
        if os.path.basename(str(where)) == "adapter_config.json":
            counts["parsed"] += 1
        return parse(text, where, what)

    monkeypatch.setattr(fusectl.io.checkpoint, "read_config_text", counting_read)
    monkeypatch.setattr(fusectl.io.checkpoint, "load_json", counting_parse)
    return counts


def test_adapter_config_is_read_and_parsed_once_per_fuse(tmp_path, adapter_reads):
    fusectl.fuse(LORA / "llama-lora", ["llama-qkv", "llama-gate-up"], tmp_path / "fused", config=LLAMA_CONFIG)
    assert adapter_reads == {"read": 1, "parsed": 1}


def test_adapter_config_is_read_and_parsed_once_per_checkpoint_in_verify_with_rules(tmp_path, adapter_reads, cli):
    out = tmp_path / "fused"
    ok(cli("fuse", LORA / "llama-lora", "--config", LLAMA_CONFIG, "-r", "llama-qkv", "-o", out))
    adapter_reads.update(read=0, parsed=0)
    report = fusectl.verify(LORA / "llama-lora", out, rules=["llama-qkv"], config=LLAMA_CONFIG)
    assert report.passed
    assert adapter_reads == {"read": 2, "parsed": 2}  # the reference's and the candidate's
