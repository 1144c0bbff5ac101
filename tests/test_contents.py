"""What every format's reader returns (io/contents.py): :class:`Contents`, built from headers
alone, with the provenance entry as the file holds it (unchecked; the checkpoint checks it),
the storage aliases, the state dict read and what it ignored. That every row of the format
registry returns one is in test_formats.py; this is what each field holds."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

from conftest import FIXTURES, ok, write_safetensors
from fusectl.errors import CheckpointError
from fusectl.io.checkpoint import open_checkpoint
from fusectl.io.contents import Contents
from fusectl.io.registry import format_of
from fusectl.io.provenance import METADATA_KEY


def _read(path, **kw) -> Contents:
    return format_of(str(path)).read(str(path), **kw)


def test_defaults_are_empty_and_not_shared():
    a, b = Contents({}, ["a"]), Contents({}, ["b"])
    assert (a.metadata, a.provenance_text, a.aliases, a.state_dict_key, a.ignored) == ({}, None, {}, None, [])
    a.ignored.append("x")
    assert b.ignored == []


def test_contents_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Contents({}, ["a"]).files = ["b"]


def test_a_plain_file_has_no_provenance_and_keeps_its_metadata(tmp_path):
    path = write_safetensors(tmp_path / "m.safetensors", {"w": np.zeros((2, 2), np.float32)}, {"format": "pt"})
    contents = _read(path)
    assert contents.files == [str(path)]
    assert dict(contents.metadata) == {"format": "pt"}
    assert contents.provenance_text is None
    assert list(contents.tensors) == ["w"] and contents.tensors["w"].spec.shape == (2, 2)


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_fusectls_output_carries_its_provenance_text_in_the_metadata(cli, tmp_path, suffix):
    out = tmp_path / f"fused{suffix}"
    ok(cli("fuse", FIXTURES / "tiny-llama-gqa", "-r", "llama-qkv", "-o", out))
    contents = _read(out)
    assert isinstance(contents.provenance_text, str)
    assert contents.metadata[METADATA_KEY] == contents.provenance_text  # left in the metadata too
    assert json.loads(contents.provenance_text)["plan"]


def test_a_sharded_folder_takes_its_provenance_from_the_index(cli, tmp_path):
    out = tmp_path / "fused"
    ok(cli("fuse", FIXTURES / "tiny-llama-gqa", "-r", "llama-qkv", "-o", out, "--max-shard-size", "20KB"))
    (index,) = out.glob("*.index.json")
    contents = _read(index)
    assert len(contents.files) > 1 and all(f.endswith(".safetensors") for f in contents.files)
    assert json.loads(index.read_text())["metadata"][METADATA_KEY] == contents.provenance_text


def test_pytorch_views_of_one_storage_are_aliases():
    contents = _read(FIXTURES / "tied-embeddings.pt")
    assert dict(contents.aliases) == {"head.weight": "embed.weight"}
    assert "head.weight" not in contents.tensors and "embed.weight" in contents.tensors


def test_a_training_dict_names_the_state_dict_read():
    assert _read(FIXTURES / "torch" / "training.pt").state_dict_key == "model_state_dict"
    assert _read(FIXTURES / "torch" / "two-models.pt", key="ema").state_dict_key == "ema"
    assert _read(FIXTURES / "tied-embeddings.pt").state_dict_key is None


def test_a_provenance_entry_that_is_not_a_string_is_refused_by_the_checkpoint(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    write_safetensors(tmp_path / "a.safetensors", {"w": np.zeros(2, np.float32)})
    index.write_text(json.dumps({"metadata": {METADATA_KEY: {"plan": []}}, "weight_map": {"w": "a.safetensors"}}))
    contents = _read(index)
    assert contents.provenance_text == {"plan": []}  # the reader passes it on unchecked
    with pytest.raises(CheckpointError, match=re.escape(f"{index}: the '{METADATA_KEY}' metadata entry must be a string")):
        open_checkpoint(str(index))
