"""torch.distributed.checkpoint saved as sharded safetensors (fusectl/io/formats/dcp_safetensors.py).

``fixtures/distributed/dcp-safetensors`` was written by torch 2.13.0's ``HuggingFaceStorageWriter``
with ``save_distributed=True`` on 2 ranks (gloo, CPU): the tiny Llama under FSDP2 and ``tp.*``
tensors cut as tensor parallelism cuts them; ``reference/dcp-variants.pt`` holds torch's own
``full_tensor()`` of each (fixtures/generate_dcp_variants.py, which also checks that torch's
``consolidate_safetensors_files`` gives the reference). Every test here runs without torch.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from conftest import FIXTURES, ok, parse_safetensors, refused, run_cli, snapshot
from fusectl.io.formats.chunks import Blocks
from fusectl.io.formats.dcp_safetensors import read_dcp_safetensors
from fusectl.io.formats.torch_file import read_torch_tree
from fusectl.tensors import RangesTensor

DIST = FIXTURES / "distributed"
FOLDER = DIST / "dcp-safetensors"
FIRST, SECOND = "shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"


def _reference() -> dict:
    """torch's whole tensors, named as the flat state dict that was saved."""
    tree, _ = read_torch_tree(str(DIST / "reference" / "dcp-variants.pt"))
    return {**tree["model"], **{f"tp.{k}": v for k, v in tree["tp"].items()}}


def _same(ours: dict, theirs: dict) -> None:
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].spec == tensor.spec, name
        assert ours[name].read().tobytes() == tensor.read().tobytes(), name


def test_convert_gives_every_tensor_whole_equal_to_torchs_own_gathering(tmp_path):
    out = tmp_path / "out.pt"
    ok(run_cli("convert", FOLDER, "-o", out))
    ours, _ = read_torch_tree(str(out))
    _same(ours, _reference())


def test_rows_are_file_ranges_and_other_cuts_blocks_and_inspect_says_what_it_read():
    contents = read_dcp_safetensors(str(FOLDER))
    q = contents.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, RangesTensor) and [os.path.basename(r.path) for r in q.byte_ranges()] == [FIRST, SECOND]
    assert isinstance(contents.tensors["tp.col"], Blocks) and contents.tensors["tp.col"].spec.shape == (6, 10)
    assert isinstance(contents.tensors["tp.mid"], Blocks) and contents.tensors["tp.mid"].spec.shape == (3, 4, 5)
    report = ok(run_cli("inspect", "--json", FOLDER)).json()
    assert report["format"] == "dcp-safetensors" and report["distributed"] == {"world_size": 2}
    shapes = {p["name"]: (p["dtype"], p["shape"]) for p in report["parameters"]}
    assert shapes["tp.rows"] == ("BF16", [7, 5]) and shapes["model.embed_tokens.weight"] == ("F32", [64, 16])


def test_fuse_then_unfuse_gives_back_every_tensor_bitwise(tmp_path):
    fused, back = tmp_path / "fused", tmp_path / "back.pt"
    ok(run_cli("fuse", FOLDER, "-r", "llama-qkv", "-r", "llama-gate-up", "--config", DIST / "config.json",
               "-o", fused))
    names = {p["name"] for p in ok(run_cli("inspect", "--json", fused)).json()["parameters"]}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    ok(run_cli("unfuse", fused, "-o", back))
    ours, _ = read_torch_tree(str(back))
    _same(ours, _reference())


# ------------------------------------------------------------------------------------ bad input

def _copy(tmp_path: Path) -> Path:
    folder = tmp_path / "in" / "ckpt"
    shutil.copytree(FOLDER, folder)
    return folder


def _rewrite(path: Path, edit) -> None:
    """Rewrite the safetensors file ``path`` after ``edit(tensors, sharding info, metadata)``."""
    tensors, metadata = parse_safetensors(path)
    original = metadata["DCP_SHARDING_INFO"]
    info = json.loads(original)
    edit(tensors, info, metadata)
    if metadata.get("DCP_SHARDING_INFO") == original:  # the edit changed the entry's object, not its text
        metadata["DCP_SHARDING_INFO"] = json.dumps(info)
    header: dict = {"__metadata__": metadata}
    body, offset = b"", 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        body, offset = body + raw, offset + len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


def _refused(tmp_path: Path, folder: Path, *needles: str) -> None:
    before = snapshot(tmp_path / "in")
    out = tmp_path / "out.pt"
    refused(run_cli("convert", folder, "-o", out), *needles, unwritten=[out])
    assert snapshot(tmp_path / "in") == before


def test_one_ranks_file_read_alone_is_refused_asking_for_the_folder(tmp_path):
    """A rank's file is an ordinary safetensors file of blocks: read as a model it would be a
    smaller model, silently. Renamed, its offsets still tell (rank 1's are not all 0)."""
    refused(run_cli("inspect", FOLDER / FIRST), FIRST, "name the folder")
    renamed = tmp_path / "model.safetensors"
    shutil.copy(FOLDER / SECOND, renamed)
    refused(run_cli("convert", renamed, "-o", tmp_path / "out"), "model.safetensors", "DCP_SHARDING_INFO",
            unwritten=[tmp_path / "out"])


def test_a_whole_tensor_file_with_the_sharding_entry_at_the_origin_reads_as_it_is(tmp_path):
    """torch's rank-0 save of whole tensors through the same writer: every offset 0."""
    path = tmp_path / "model.safetensors"
    shutil.copy(FOLDER / FIRST, path)
    _rewrite(path, lambda tensors, info, meta: [info.pop(k) for k in list(info) if any(info[k]["saved_offsets"])]
             and [tensors.pop(k) for k in list(tensors) if k not in info])
    ok(run_cli("inspect", path))


def test_a_missing_rank_is_refused_naming_its_files(tmp_path):
    folder = _copy(tmp_path)
    (folder / FIRST).unlink()
    _refused(tmp_path, folder, "shard-00001-", "rank 1 of 2")


def test_a_ranks_missing_file_is_refused_naming_it(tmp_path):
    folder = _copy(tmp_path)
    (folder / SECOND).rename(folder / "shard-00002-model-00002-of-00002.safetensors")
    _refused(tmp_path, folder, "shard-00002-model-00001-of-00002.safetensors", "missing")


def test_another_safetensors_file_beside_the_shards_is_refused(tmp_path):
    folder = _copy(tmp_path)
    shutil.copy(FOLDER / FIRST, folder / "model.safetensors")
    _refused(tmp_path, folder, "'model.safetensors'", "beside")


def test_a_truncated_rank_file_is_refused_naming_it(tmp_path):
    folder = _copy(tmp_path)
    data = (folder / SECOND).read_bytes()
    (folder / SECOND).write_bytes(data[:-10])
    _refused(tmp_path, folder, SECOND)


@pytest.mark.parametrize("edit, needles", [
    (lambda t, i, m: m.pop("DCP_SHARDING_INFO"), ["no DCP_SHARDING_INFO"]),
    (lambda t, i, m: i.pop("tp.col"), ["'tp.col'", "differ"]),
    (lambda t, i, m: i["tp.col"].update(saved_offsets=[0]), ["'tp.col'", "one offset per dimension"]),
    (lambda t, i, m: i["tp.col"].update(saved_offsets=[0, -1]), ["'tp.col'", "one offset per dimension"]),
    (lambda t, i, m: i["tp.col"].update(saved_offsets=[0, 0]), ["'tp.col'", "pieces overlap"]),
    (lambda t, i, m: i["tp.col"].update(saved_offsets=[0, 3]), ["'tp.col'", "overlap"]),
    (lambda t, i, m: t.update({"tp.col": ("F64", [6, 5], t["tp.col"][2] * 2)}), ["'tp.col'", "dtypes F32, F64"]),
])
def test_a_rank_file_that_misplaces_its_blocks_is_refused_naming_the_tensor(tmp_path, edit, needles):
    folder = _copy(tmp_path)
    _rewrite(folder / SECOND, edit)
    _refused(tmp_path, folder, *needles)


def test_sharding_info_that_is_not_an_object_is_refused(tmp_path):
    folder = _copy(tmp_path)
    _rewrite(folder / SECOND, lambda t, i, m: m.update(DCP_SHARDING_INFO="[1, 2]"))
    _refused(tmp_path, folder, SECOND, "not a JSON object")
