"""Opening a checkpoint (io/checkpoint.py): a path that is no checkpoint, a missing path, and a
sharded index that names a missing shard, is no JSON or points a tensor at the wrong shard are
refused naming the file; nothing is written."""

from __future__ import annotations

import json
import os

from conftest import BF16, refuse_case


def test_not_a_checkpoint_format(cli, area):
    path = area / "in" / "weights.txt"
    path.write_text("hello")
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["weights.txt"])


def test_missing_input(cli, area):
    refuse_case(cli, area, area / "in" / "nope", "-r", "llama-qkv", needles=["nope"])


def test_index_names_missing_shard(cli, area, copy_fixture):
    src = copy_fixture(BF16)
    os.remove(src / "model-00002-of-00003.safetensors")
    refuse_case(cli, area, src, "-r", "llama-qkv", needles=["model-00002-of-00003.safetensors"])


def test_index_not_json(cli, area, copy_fixture):
    src = copy_fixture(BF16)
    (src / "model.safetensors.index.json").write_text("{ not json")
    refuse_case(cli, area, src, "-r", "llama-qkv", needles=["model.safetensors.index.json"])


def test_index_points_tensor_to_wrong_shard(cli, area, copy_fixture):
    src = copy_fixture(BF16)
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name, shard = next((n, s) for n, s in index["weight_map"].items() if s.startswith("model-00001"))
    index["weight_map"][name] = "model-00003-of-00003.safetensors"
    index_path.write_text(json.dumps(index))
    refuse_case(cli, area, src, "-r", "llama-qkv", needles=[name])
