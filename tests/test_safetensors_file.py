"""The safetensors reader (io/formats/safetensors_file.py): every broken header, offset, dtype, shape or
truncation is refused naming the file (and the tensor), and nothing is written."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from conftest import BF16, LLAMA, refuse_case


def test_truncated_file(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    model = src / "model.safetensors"
    data = model.read_bytes()
    model.write_bytes(data[: len(data) - 1000])
    refuse_case(cli, area, src, "-r", "llama-qkv", needles=["model.safetensors", "truncated"])


def test_header_length_past_end(cli, area):
    path = area / "in" / "m.safetensors"
    path.write_bytes(struct.pack("<Q", 10**6) + b'{"a":1}')
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.safetensors"])


def test_absurd_header_length(cli, area):
    path = area / "in" / "m.safetensors"
    path.write_bytes(struct.pack("<Q", 2**63) + b"x" * 64)
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.safetensors"])


def test_non_json_header(cli, area):
    path = area / "in" / "m.safetensors"
    header = b"this is not json at all!"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.safetensors", "JSON"])


def test_non_utf8_header(cli, area):
    path = area / "in" / "m.safetensors"
    header = b"\xff\xfe\xfd\xfc\xfb\xfa\xf9\xf8"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.safetensors"])


def test_header_not_an_object(cli, area):
    path = area / "in" / "m.safetensors"
    header = b"[1, 2, 3]"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.safetensors"])


def _raw_file(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_offsets_outside_the_file(cli, area):
    path = _raw_file(area / "in" / "m.safetensors",
                     {"w.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]},
                      "x.weight": {"dtype": "F32", "shape": [4], "data_offsets": [64, 80]}},
                     b"\0" * 64)
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.safetensors", "x.weight"])


def test_offsets_not_matching_shape(cli, area):
    path = _raw_file(area / "in" / "m.safetensors",
                     {"w.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 32]}},
                     b"\0" * 64)
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.safetensors", "w.weight"])


def test_overlapping_tensors(cli, area):
    path = _raw_file(area / "in" / "m.safetensors",
                     {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                      "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}},
                     b"\0" * 24)
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.safetensors"])


def test_unknown_dtype(cli, area):
    path = _raw_file(area / "in" / "m.safetensors",
                     {"w.weight": {"dtype": "Q4_K", "shape": [4], "data_offsets": [0, 16]}},
                     b"\0" * 16)
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.safetensors", "w.weight", "Q4_K"])


def test_bad_shape_entry(cli, area):
    path = _raw_file(area / "in" / "m.safetensors",
                     {"w.weight": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}},
                     b"\0" * 16)
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["w.weight"])


def test_empty_file(cli, area):
    path = area / "in" / "m.safetensors"
    path.write_bytes(b"")
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.safetensors"])


def test_corrupt_shard(cli, area, copy_fixture):
    src = copy_fixture(BF16)
    shard = src / "model-00002-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:20] = b"#corrupt!###"  # break the JSON header
    shard.write_bytes(bytes(data))
    refuse_case(cli, area, src, "-r", "llama-qkv", needles=["model-00002-of-00003.safetensors"])


def test_truncated_shard(cli, area, copy_fixture):
    src = copy_fixture(BF16)
    shard = src / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    refuse_case(cli, area, src, "-r", "llama-qkv", needles=["model-00003-of-00003.safetensors"])


def test_duplicate_names_in_a_safetensors_header_are_refused(cli, area):
    header = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}'
    header += b" " * (-len(header) % 8)
    path = area / "in" / "dup.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x01\x02")
    result = cli("inspect", path)
    assert result.exit_code == 2 and "'a' twice" in result.stderr
