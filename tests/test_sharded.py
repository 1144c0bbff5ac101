"""Sharded checkpoints (io/formats/sharded.py): ``read_index`` reads an untrusted ``*.index.json``, each
shard it names through the shard reader it is given, and merges them into one Contents. Every
refusal is a CheckpointError naming the index (or the shard) and the tensor or shard at fault.

The shard reader here is a stand-in that serves tensors from a dict, so what is tested is the
index's logic alone; the same refusals through ``fusectl inspect`` on real shards are in
test_io_edges.py (odd indexes), test_hostile_readers.py (hostile JSON, links leaving the folder)
and test_fuzz.py (mutated indexes)."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from fusectl.errors import CheckpointError
from fusectl.io.contents import Contents
from fusectl.io.formats.sharded import read_index
from fusectl.io.untrusted import MalformedJSON
from fusectl.dtypes import from_numpy
from fusectl.tensors import ArrayTensor, TensorSpec


class Shards:
    """A shard reader serving ``{file name: {tensor: array}}`` (plus aliases and metadata),
    recording what it was asked to read; each shard file is created empty beside the index."""

    def __init__(self, folder, shards, aliases=None, metadata=None):
        self.folder, self.shards = folder, shards
        self.aliases, self.metadata = aliases or {}, metadata or {}
        self.read: list[str] = []
        for name in shards:
            (folder / name).write_bytes(b"")

    def __call__(self, path, key=None, check_link=None) -> Contents:
        self.read.append(path)
        name = os.path.basename(path)
        tensors = {t: _tensor(np.asarray(a)) for t, a in self.shards[name].items()}
        return Contents(tensors, [path], self.metadata.get(name, {}), None, self.aliases.get(name, {}))


def _tensor(a: np.ndarray) -> ArrayTensor:
    return ArrayTensor(TensorSpec(from_numpy(a.dtype, "test"), a.shape), a)


def _index(folder, weight_map, **extra):
    path = folder / "model.safetensors.index.json"
    path.write_text(json.dumps({"weight_map": weight_map, **extra}))
    return str(path)


def _refused(index, shards, needle, **kw):
    with pytest.raises(CheckpointError) as info:
        read_index(index, shards, **kw)
    assert str(info.value).startswith(index) or str(info.value).startswith(str(shards.folder)), info.value
    assert needle in str(info.value), info.value
    return info.value


@pytest.fixture
def two(tmp_path):
    shards = Shards(tmp_path, {"a.safetensors": {"x": np.ones(2, np.float32)},
                               "b.safetensors": {"y": np.zeros(3, np.float32), "z": np.zeros(1, np.int64)}})
    return tmp_path, shards


# ------------------------------------------------------------------------------ what it reads


def test_the_shards_are_read_once_each_in_name_order_and_merged(two):
    folder, shards = two
    index = _index(folder, {"z": "b.safetensors", "x": "a.safetensors", "y": "b.safetensors"})
    contents = read_index(index, shards)
    paths = [str(folder / "a.safetensors"), str(folder / "b.safetensors")]
    assert shards.read == paths and contents.files == paths
    assert sorted(contents.tensors) == ["x", "y", "z"]
    assert contents.tensors["y"].spec.shape == (3,)
    assert contents.provenance_text is None and dict(contents.metadata) == {}


def test_the_provenance_comes_from_the_indexs_metadata_and_shard_metadata_merges(two):
    folder, shards = two
    shards.metadata = {"a.safetensors": {"format": "pt"}, "b.safetensors": {"origin": "b"}}
    index = _index(folder, {"x": "a.safetensors", "y": "b.safetensors", "z": "b.safetensors"},
                   metadata={"fusectl": "{...}", "total_size": 4})
    contents = read_index(index, shards)
    assert contents.provenance_text == "{...}"
    assert dict(contents.metadata) == {"format": "pt", "origin": "b"}


def test_null_metadata_reads_as_none(two):
    folder, shards = two
    index = _index(folder, {"x": "a.safetensors", "y": "b.safetensors", "z": "b.safetensors"}, metadata=None)
    assert read_index(index, shards).provenance_text is None


def test_aliases_of_each_shard_are_kept(tmp_path):
    shards = Shards(tmp_path, {"a.bin": {"embed": np.ones(2)}}, aliases={"a.bin": {"head": "embed"}})
    contents = read_index(_index(tmp_path, {"embed": "a.bin", "head": "a.bin"}), shards)
    assert dict(contents.aliases) == {"head": "embed"}


def test_check_link_is_asked_about_each_shard_before_it_is_read(two):
    folder, shards = two
    asked = []

    def check_link(path):
        asked.append((path, list(shards.read)))

    read_index(_index(folder, {"x": "a.safetensors", "y": "b.safetensors", "z": "b.safetensors"}), shards, check_link)
    a, b = str(folder / "a.safetensors"), str(folder / "b.safetensors")
    assert asked == [(a, []), (b, [a])]


def test_a_shard_check_link_refuses_is_never_read(two):
    folder, shards = two

    def check_link(path):
        raise CheckpointError(f"{path}: links outside the folder")

    with pytest.raises(CheckpointError, match=re.escape(f"{folder / 'a.safetensors'}: links outside")):
        read_index(_index(folder, {"x": "a.safetensors"}), shards, check_link)
    assert shards.read == []


# ------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("text", ['[]', '{"weight_map": []}', '{"weight_map": {"x": 1}}', '{"metadata": {}}',
                                  '{"weight_map": {"x": null}}'])
def test_no_weight_map_object_of_file_names_is_refused(tmp_path, text):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(text)
    _refused(str(index), Shards(tmp_path, {}), "no 'weight_map' object mapping tensor names to shard files")


def test_an_empty_weight_map_is_refused(tmp_path):
    _refused(_index(tmp_path, {}), Shards(tmp_path, {}), "'weight_map' is empty")


def test_metadata_that_is_not_an_object_is_refused(two):
    folder, shards = two
    _refused(_index(folder, {"x": "a.safetensors"}, metadata=["fusectl"]), shards, "'metadata' must be an object")


def test_an_index_that_is_not_json_is_refused_naming_it(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"x": "a.safetensors"')
    with pytest.raises(MalformedJSON, match=re.escape(f"{index}: the index is not valid JSON")):
        read_index(str(index), Shards(tmp_path, {}))


@pytest.mark.parametrize("shard", ["../a.safetensors", "sub/a.safetensors", "/etc/passwd", ".", "..", "",
                                   "a\x07.safetensors"])
def test_a_shard_that_is_not_a_file_name_beside_the_index_is_refused_unread(two, shard):
    folder, shards = two
    error = _refused(_index(folder, {"x": shard}), shards, "is not a file name beside the index")
    assert "\x07" not in str(error)  # names from the file are escaped
    assert shards.read == []


def test_a_missing_shard_is_refused_naming_it(two):
    folder, shards = two
    _refused(_index(folder, {"x": "a.safetensors", "w": "c.safetensors"}), shards,
             "shard 'c.safetensors' is missing beside the index")


def test_a_tensor_stored_in_two_shards_is_refused(tmp_path):
    shards = Shards(tmp_path, {"a.st": {"x": np.ones(1)}, "b.st": {"x": np.ones(1), "y": np.ones(1)}})
    error = _refused(_index(tmp_path, {"x": "a.st", "y": "b.st"}), shards, "tensor 'x' is also stored in another shard")
    assert str(error).startswith(str(tmp_path / "b.st"))


def test_an_alias_in_one_shard_and_a_tensor_in_another_is_refused(tmp_path):
    shards = Shards(tmp_path, {"a.st": {"x": np.ones(1)}, "b.st": {"y": np.ones(1)}}, aliases={"b.st": {"x": "y"}})
    _refused(_index(tmp_path, {"x": "a.st", "y": "b.st"}), shards, "tensor 'x' is also stored in another shard")


def test_an_index_naming_a_shard_that_does_not_hold_the_tensor_is_refused(two):
    folder, shards = two
    _refused(_index(folder, {"x": "b.safetensors", "y": "b.safetensors", "z": "b.safetensors"}), shards,
             "the index puts 'x' in 'b.safetensors', which does not hold it")


def test_an_index_naming_a_tensor_no_shard_holds_is_refused(two):
    folder, shards = two
    _refused(_index(folder, {"x": "a.safetensors", "ghost": "a.safetensors"}), shards,
             "the index puts 'ghost' in 'a.safetensors', which does not hold it")


def test_a_long_name_from_the_index_is_cut_short_in_the_error(two):
    folder, shards = two
    error = _refused(_index(folder, {"x": "a.safetensors", "n" * 5000: "a.safetensors"}), shards,
                     "(5000 characters)")
    assert len(str(error)) < 600


def test_more_tensors_than_the_budget_are_refused_before_a_shard_is_read(two, monkeypatch):
    folder, shards = two
    monkeypatch.setenv("FUSECTL_MAX_TENSORS", "2")
    _refused(_index(folder, {"x": "a.safetensors", "y": "b.safetensors", "z": "b.safetensors"}), shards,
             "FUSECTL_MAX_TENSORS=3")
    assert shards.read == []


def test_shards_holding_more_tensors_than_the_budget_are_refused(tmp_path, monkeypatch):
    shards = Shards(tmp_path, {"a.st": {"x": np.ones(1), "y": np.ones(1), "z": np.ones(1)}})
    monkeypatch.setenv("FUSECTL_MAX_TENSORS", "2")
    _refused(_index(tmp_path, {"x": "a.st"}), shards, "FUSECTL_MAX_TENSORS=3")
