"""torch.distributed.checkpoint (DCP) folders (fusectl/io/formats/dcp.py), read without torch.

The fixtures were written by torch 2.13.0's FSDP2 (``fully_shard``, 2 ranks, gloo, CPU) with
``dcp.save({"model", "optim"})`` from ``get_state_dict``; ``reference/dcp.pt`` and
``reference/dcp-tied.pt`` are what torch's own ``dcp_to_torch_save`` wrote from them
(fixtures/generate_distributed.py). Every test here runs without torch.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES, ok, refused, run_cli, snapshot
from fusectl.errors import CheckpointError
from fusectl import dtypes
from fusectl.io.formats.chunks import Blocks
from fusectl.io.formats.dcp import METADATA_FILE, RECORDS, read_dcp
from fusectl.io.formats.safetensors_file import read_safetensors
from fusectl.io.formats.torch_file import Record, read_pickle, read_torch_tree
from fusectl.io.formats.torch_writer import pickle_tree, write_torch_file
from fusectl.tensors import ArrayTensor, LazyTensor, RangesTensor, TensorSpec

DIST = FIXTURES / "distributed"
F32 = dtypes.BY_NAME["F32"]


def _same_tree(ours: object, theirs: object, where: str = "the tree") -> None:
    """The two trees are equal: the same types, keys in the same order, values, and every tensor
    the same dtype, shape and bytes."""
    if isinstance(theirs, LazyTensor):
        assert isinstance(ours, LazyTensor) and ours.spec == theirs.spec, where
        assert ours.read().tobytes() == theirs.read().tobytes(), where
        return
    assert type(ours) is type(theirs), (where, type(ours), type(theirs))
    if isinstance(theirs, dict):
        assert list(ours) == list(theirs), where
        for k in theirs:
            _same_tree(ours[k], theirs[k], f"{where}[{k!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), where
        for k, (a, b) in enumerate(zip(ours, theirs)):
            _same_tree(a, b, f"{where}[{k}]")
    else:
        assert ours == theirs, where


@pytest.mark.parametrize("name", ["dcp", "dcp-tied"])
def test_convert_to_pt_writes_what_dcp_to_torch_save_writes_bitwise(tmp_path, name):
    out = tmp_path / "out.pt"
    ok(run_cli("convert", DIST / name, "-o", out))
    ours, _ = read_torch_tree(str(out))
    theirs, _ = read_torch_tree(str(DIST / "reference" / f"{name}.pt"))
    _same_tree(ours, theirs)


def test_a_tensor_cut_along_rows_is_the_byte_ranges_of_each_ranks_file():
    contents = read_dcp(str(DIST / "dcp"))
    q = contents.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q.opened, RangesTensor) and q.spec.shape == (16, 16)
    assert [os.path.basename(r.path) for r in q.byte_ranges()] == ["__0_0.distcp", "__1_0.distcp"]
    assert [r.length for r in q.byte_ranges()] == [8 * 16 * 4, 8 * 16 * 4]
    assert contents.distributed == {"world_size": 2}
    assert [os.path.basename(f) for f in contents.files] == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_inspect_json_says_the_format_the_ranks_the_global_shapes_and_the_optimizer():
    report = ok(run_cli("inspect", "--json", DIST / "dcp")).json()
    assert report["format"] == "dcp" and report["distributed"] == {"world_size": 2}
    shapes = {p["name"]: p["shape"] for p in report["parameters"]}
    assert len(shapes) == 21 and shapes["model.embed_tokens.weight"] == [64, 16]
    assert shapes["model.layers.0.mlp.down_proj.weight"] == [16, 32]
    optimizer = report["optimizer"]
    assert optimizer["kind"] == "Adam/AdamW" and optimizer["exact"]
    assert [g["params"] for g in optimizer["groups"]] == [16, 5]


def test_convert_to_a_folder_writes_the_models_tensors_as_safetensors(tmp_path):
    out = tmp_path / "hf"
    ok(run_cli("convert", DIST / "dcp", "-o", out))
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    written = read_safetensors(str(out / "model.safetensors"))
    theirs, _ = read_torch_tree(str(DIST / "reference" / "dcp.pt"))
    assert sorted(written.tensors) == sorted(theirs["model"])
    for name, tensor in theirs["model"].items():
        assert written.tensors[name].read().tobytes() == tensor.read().tobytes(), name


def test_fuse_moves_the_optimizer_state_and_unfuse_gives_back_the_input_bitwise(tmp_path):
    fused, back = tmp_path / "fused.pt", tmp_path / "back.pt"
    result = ok(run_cli("fuse", DIST / "dcp", "-r", "llama-qkv", "-r", "llama-gate-up", "-o", fused))
    assert "moved with its parameters" in result.stdout
    tree, _ = read_torch_tree(str(fused))
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert tree["model"][qkv].spec.shape == (32, 16) and tree["optim"]["state"][qkv]["exp_avg"].spec.shape == (32, 16)
    assert "model.layers.0.self_attn.q_proj.weight" not in tree["optim"]["state"]
    ok(run_cli("unfuse", fused, "-o", back))
    ours, _ = read_torch_tree(str(back))
    theirs, _ = read_torch_tree(str(DIST / "reference" / "dcp.pt"))
    _same_tree(ours, theirs)


def test_a_model_saved_at_the_top_level_reads_as_its_state_dict(tmp_path):
    """``dcp.save(model.state_dict())``: the tensors at the top level; no training dict."""
    folder = _copy(tmp_path, "dcp")
    _edit(folder, lambda meta: _drop(meta, lambda fqn: not fqn.startswith("model.")))
    _edit(folder, lambda meta: meta["planner_data"].clear())
    contents = read_dcp(str(folder))
    assert contents.training is None and contents.state_dict_key is None
    assert "model.model.embed_tokens.weight" in contents.tensors and len(contents.tensors) == 21
    out = tmp_path / "model.pt"  # a file output of a model many ranks wrote: not cut into shards
    ok(run_cli("convert", folder, "-o", out))
    tree, _ = read_torch_tree(str(out))
    theirs, _ = read_torch_tree(str(DIST / "reference" / "dcp.pt"))
    _same_tree(tree["model.model.embed_tokens.weight"], theirs["model"]["model.embed_tokens.weight"])


def test_a_cut_along_columns_is_assembled_block_by_block(tmp_path):
    """A tensor whose chunks are column blocks (tensor parallelism's ``Shard(1)``) reads whole,
    each block in its place: q_proj rewritten as two [16, 8] blocks in a rank file of their own,
    each item a torch.save archive as DCP writes it."""
    folder = _copy(tmp_path, "dcp")
    fqn = "model.model.layers.0.self_attn.q_proj.weight"
    theirs, _ = read_torch_tree(str(DIST / "reference" / "dcp.pt"))
    whole = theirs["model"]["model.layers.0.self_attn.q_proj.weight"].read()
    items = []
    for k, column in enumerate((0, 8)):
        part = tmp_path / f"part{k}.pt"
        write_torch_file(str(part), ArrayTensor(TensorSpec(F32, (16, 8)), np.ascontiguousarray(whole[:, column:column + 8])))
        items.append(part.read_bytes())
    (folder / "__0_1.distcp").write_bytes(b"".join(items))

    def columns(meta):
        for chunk, column in zip(_chunks(meta, fqn), (0, 8)):
            chunk.state.update(offsets=(0, column), sizes=(16, 8))
        indices = sorted((i for i in meta["storage_data"] if i.state["fqn"] == fqn), key=lambda i: i.state["offset"])
        for k, (index, column) in enumerate(zip(indices, (0, 8))):
            index.state["offset"] = (0, column)
            meta["storage_data"][index].state.update(relative_path="__0_1.distcp", offset=len(items[0]) * k,
                                                     length=len(items[k]))

    _edit(folder, columns)
    q = read_dcp(str(folder)).tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.byte_ranges() is None and q.spec.shape == (16, 16)
    assert q.read().tobytes() == whole.tobytes()


def test_blocks_of_any_cut_are_placed_where_their_offsets_say():
    f32 = F32
    whole = np.arange(24, dtype=np.float32).reshape(4, 6)
    pieces = tuple(((r, c), ArrayTensor(TensorSpec(f32, (2, 3)), whole[r:r + 2, c:c + 3].copy()))
                   for r in (0, 2) for c in (0, 3))
    assert np.array_equal(Blocks(TensorSpec(f32, (4, 6)), pieces).read(), whole)


# ------------------------------------------------------------------------------- hostile folders


def _copy(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / "in" / name
    shutil.copytree(DIST / name, folder)
    return folder


def _edit(folder: Path, edit, index: str = ".metadata") -> None:
    """Read the folder's ``index`` with fusectl's reader, ``edit`` its fields, pickle it back."""
    path = folder / index
    meta = read_pickle(path.read_bytes(), str(path), RECORDS)
    edit(meta.state)
    path.write_bytes(pickle_tree(meta, str(path)))


def _drop(meta: dict, gone) -> None:
    for fqn in [k for k in meta["state_dict_metadata"] if gone(k)]:
        del meta["state_dict_metadata"][fqn]
        meta["planner_data"].pop(fqn, None)
    for index in [i for i in meta["storage_data"] if gone(i.state["fqn"])]:
        del meta["storage_data"][index]


def _chunks(meta: dict, fqn: str = "model.model.layers.0.self_attn.q_proj.weight") -> list[Record]:
    return meta["state_dict_metadata"][fqn].state["chunks"]


def _refused(tmp_path: Path, folder: Path, *needles: str) -> str:
    before = snapshot(tmp_path / "in")
    out = tmp_path / "out.pt"
    result = run_cli("convert", folder, "-o", out)
    refused(result, *needles, unwritten=[out])
    assert snapshot(tmp_path / "in") == before
    return result.stderr


def test_a_metadata_whose_pickle_would_run_code_runs_nothing(tmp_path):
    folder = _copy(tmp_path, "dcp")
    marker = tmp_path / "ran"
    payload = (b"\x80\x02cos\nsystem\nX" + len(f"touch {marker}").to_bytes(4, "little") + f"touch {marker}".encode()
               + b"\x85R.")
    (folder / ".metadata").write_bytes(payload)
    _refused(tmp_path, folder, ".metadata", "os.system")
    assert not marker.exists()


def test_a_class_outside_the_allow_list_in_the_metadata_is_refused(tmp_path):
    folder = _copy(tmp_path, "dcp")
    data = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(data.replace(b"_StorageInfo", b"_StorageInfX", 1))
    _refused(tmp_path, folder, ".metadata", "_StorageInfX")


@pytest.mark.parametrize("edit, needles", [
    (lambda m: _chunks(m).pop(), ("q_proj.weight", "pieces are missing")),
    (lambda m: _chunks(m).append(_chunks(m)[0]), ("q_proj.weight", "pieces overlap")),
    (lambda m: _chunks(m)[1].state.update(offsets=(4, 0), sizes=(8, 16))
     or _chunks(m)[0].state.update(sizes=(8, 16)), ("q_proj.weight",)),
    (lambda m: _chunks(m)[1].state.update(offsets=(9, 0)), ("q_proj.weight", "past the tensor's bounds")),
    (lambda m: _chunks(m)[1].state.update(offsets=(7, 0)) or _chunks(m)[0].state.update(sizes=(9, 16)),
     ("q_proj.weight", "overlap")),
    (lambda m: m["state_dict_metadata"]["model.model.norm.weight"].state.update(size=(17,)),
     ("model.model.norm.weight",)),
    (lambda m: m["planner_data"].update({"model.model.norm.weight": ("model", 10**9)}),
     ("model.model.norm.weight", "list positions")),
    (lambda m: m["planner_data"].update({"model.model.norm.weight": ("optim", "state")}),
     ("runs through 'state'", "another key")),
    (lambda m: m["planner_data"].update({"model.model.norm.weight": ("model", "model.embed_tokens.weight", "x")}),
     ("model.model.norm.weight", "something else")),
    (lambda m: m.update(state_dict_metadata=[]), ("state_dict_metadata",)),
    (lambda m: m.update(storage_data=None), ("storage_data",)),
    (lambda m: m.update(planner_data=[1]), ("planner_data",)),
])
def test_a_layout_that_is_not_dcps_is_refused_naming_the_tensor(tmp_path, edit, needles):
    folder = _copy(tmp_path, "dcp")
    _edit(folder, edit)
    _refused(tmp_path, folder, ".metadata", *needles)


def _storage(meta: dict, fqn: str = "model.model.layers.0.self_attn.q_proj.weight") -> dict:
    return next(info.state for index, info in meta["storage_data"].items()
                if index.state["fqn"] == fqn and index.state.get("offset") == (8, 0))


@pytest.mark.parametrize("edit, needles", [
    (lambda m: _storage(m).update(relative_path="../elsewhere.distcp"), ("follows no path out",)),
    (lambda m: _storage(m).update(relative_path="__2_0.distcp"), ("__2_0.distcp", "missing")),
    (lambda m: _storage(m).update(offset=-1), ("q_proj.weight", "offset")),
    (lambda m: _storage(m).update(offset=10**9), ("__1_0.distcp", "past the end")),
    (lambda m: _storage(m).update(offset=_storage(m)["offset"] + 1), ("__1_0.distcp", "not a torch.save archive")),
    (lambda m: _storage(m).update(transform_descriptors=["zstd"]), ("transformed",)),
    (lambda m: [m["storage_data"].pop(i) for i in list(m["storage_data"])
                if i.state["fqn"] == "model.model.norm.weight"], ("model.model.norm.weight", "no storage entry")),
])
def test_storage_that_is_not_where_the_metadata_says_is_refused(tmp_path, edit, needles):
    folder = _copy(tmp_path, "dcp")
    _edit(folder, edit)
    _refused(tmp_path, folder, *needles)


def test_an_item_that_is_another_chunk_than_the_metadata_says_is_refused(tmp_path):
    """Two chunk entries swapped with another tensor's: the items are read and found other."""
    folder = _copy(tmp_path, "dcp")

    def swap(meta):
        a = _storage(meta)
        b = next(info.state for index, info in meta["storage_data"].items()
            if index.state["fqn"] == "model.model.embed_tokens.weight" and index.state["offset"] == (32, 0))
        a["offset"], b["offset"] = b["offset"], a["offset"]
        a["length"], b["length"] = b["length"], a["length"]

    _edit(folder, swap)
    _refused(tmp_path, folder, "__1_0.distcp", "F32[8, 16]", "F32[32, 16]", "embed_tokens.weight")


def test_an_optimizer_item_is_checked_when_an_output_holds_it(tmp_path):
    """The optimizer's items are opened when an output reads them, not when the folder is read
    (a safetensors output of the model leaves two thirds of an Adam checkpoint's items alone):
    two moments' chunks swapped, the model's folder is written and right, the training .pt is
    refused naming the rank file, nothing written."""
    folder = _copy(tmp_path, "dcp")
    moment = "optim.state.model.layers.0.self_attn.q_proj.weight."

    def swap(meta):
        infos = {(index.state["fqn"], index.state.get("offset")): info.state
                 for index, info in meta["storage_data"].items()}
        a = infos[moment + "exp_avg", (8, 0)]
        b = infos["optim.state.model.layers.0.mlp.up_proj.weight.exp_avg", (16, 0)]
        for field in ("offset", "length"):
            a[field], b[field] = b[field], a[field]

    _edit(folder, swap)
    out = tmp_path / "model"
    ok(run_cli("convert", folder, "-o", out))
    theirs, _ = read_torch_tree(str(DIST / "reference" / "dcp.pt"))
    written = read_safetensors(str(out / "model.safetensors")).tensors
    _same_tree(dict(written), {k: theirs["model"][k] for k in written})
    _refused(tmp_path, folder, "__1_0.distcp", "F32[8, 16]", "F32[16, 16]", moment + "exp_avg")


def test_a_truncated_rank_file_is_refused_naming_it(tmp_path):
    folder = _copy(tmp_path, "dcp")
    data = (folder / "__1_0.distcp").read_bytes()
    (folder / "__1_0.distcp").write_bytes(data[: len(data) // 2])
    _refused(tmp_path, folder, "__1_0.distcp")


def test_a_missing_rank_file_is_refused_naming_it(tmp_path):
    folder = _copy(tmp_path, "dcp")
    (folder / "__1_0.distcp").unlink()
    _refused(tmp_path, folder, "__1_0.distcp", "missing")


def test_one_rank_file_named_alone_is_refused_asking_for_the_folder(tmp_path):
    result = run_cli("inspect", DIST / "dcp" / "__0_0.distcp")
    refused(result, "__0_0.distcp", "name the folder")


def test_fusectls_metadata_in_the_folder_is_its_provenance_and_a_bad_one_is_refused(tmp_path):
    folder = _copy(tmp_path, "dcp")
    (folder / METADATA_FILE).write_text('{"fusectl": "{}", "format": "pt"}')
    contents = read_dcp(str(folder))
    assert contents.metadata == {"fusectl": "{}", "format": "pt"} and contents.provenance_text == "{}"
    assert os.path.basename(contents.files[-1]) == METADATA_FILE
    (folder / METADATA_FILE).write_text('{"fusectl": 3}')
    _refused(tmp_path, folder, METADATA_FILE, "object of texts")


def test_a_tensor_of_a_dtype_fusectl_does_not_read_is_refused_naming_it(tmp_path):
    folder = _copy(tmp_path, "dcp")

    def complex128(meta):
        properties = meta["state_dict_metadata"]["model.model.norm.weight"].state["properties"]
        properties.state = ("torch.complex128?",) + properties.state[1:]

    _edit(folder, complex128)
    _refused(tmp_path, folder, "model.model.norm.weight", "dtype")


def test_several_dicts_of_tensors_ask_for_the_key_and_the_key_chooses(tmp_path):
    folder = _copy(tmp_path, "dcp")

    def rename(meta):
        for fqn, path in meta["planner_data"].items():
            if path[0] == "model":
                meta["planner_data"][fqn] = ("student" if "layers.1" in fqn else "teacher", *path[1:])

    _edit(folder, rename)
    _refused(tmp_path, folder, "several dicts of tensors", "'student'", "'teacher'", "--key")
    assert len(read_dcp(str(folder), key="teacher").tensors) == 12
    assert len(ok(run_cli("inspect", "--json", "--key", "student", folder)).json()["parameters"]) == 9
    with pytest.raises(CheckpointError, match="no dict 'pupil'"):
        read_dcp(str(folder), key="pupil")


def test_verify_replays_the_rules_and_the_optimizer_on_a_dcp_folder(tmp_path):
    fused = tmp_path / "fused.pt"
    ok(run_cli("fuse", DIST / "dcp", "-r", "llama-qkv", "-r", "llama-gate-up", "-o", fused))
    report = ok(run_cli("verify", DIST / "dcp", fused)).stdout
    assert "PASS optimizer param group 0" in report and "result: PASS" in report
    tampered = tmp_path / "tampered.pt"
    tree, metadata = read_torch_tree(str(fused))
    qkv = tree["optim"]["state"]["model.layers.1.self_attn.qkv_proj.weight"]
    changed = qkv["exp_avg"].read().copy()
    changed[3, 4] += 1.0
    qkv["exp_avg"] = ArrayTensor(qkv["exp_avg"].spec, changed)
    write_torch_file(str(tampered), tree, metadata=metadata)
    result = run_cli("verify", DIST / "dcp", tampered)
    assert result.exit_code == 1 and "FAIL" in result.stdout and "qkv_proj.weight" in result.stdout


# ------------------------------------------- ranks that saved without talking: __R.metadata each

def test_each_ranks_own_index_is_read_together_equal_to_what_torch_gathered(tmp_path):
    """``dcp.save(..., use_collectives=False)``: no .metadata, each rank's __R.metadata names only
    its own chunks (a Replicate tensor in both). Read together they give every tensor whole,
    equal to torch's ``full_tensor()`` of each (reference/dcp-variants.pt). torch 2.13's own
    ``dcp_to_torch_save`` reads rank 0's index alone here and leaves the rest of each tensor
    uninitialised (tried by hand)."""
    out = tmp_path / "out.pt"
    ok(run_cli("convert", DIST / "dcp-local", "-o", out))
    ours, _ = read_torch_tree(str(out))
    theirs, _ = read_torch_tree(str(DIST / "reference" / "dcp-variants.pt"))
    assert ours["step"] == 3
    _same_tree({"model": ours["model"], "tp": ours["tp"]}, theirs)
    contents = read_dcp(str(DIST / "dcp-local"))
    assert contents.distributed == {"world_size": 2}
    assert [os.path.basename(f) for f in contents.files][:2] == ["__0.metadata", "__1.metadata"]
    q = contents.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert [os.path.basename(r.path) for r in q.byte_ranges()] == ["__0_0.distcp", "__1_0.distcp"]


def test_a_ranks_missing_index_is_refused_naming_it(tmp_path):
    folder = _copy(tmp_path, "dcp-local")
    (folder / "__0.metadata").unlink()
    assert "__0.metadata" in _refused(tmp_path, folder, "copy the whole folder")


def test_a_rank_file_without_its_index_is_refused_naming_the_rank(tmp_path):
    folder = _copy(tmp_path, "dcp-local")
    (folder / "__1.metadata").unlink()
    _refused(tmp_path, folder, "__1.metadata", "rank 1")


@pytest.mark.parametrize("edit, needles", [
    (lambda m: m["state_dict_metadata"]["tp.col"].state.update(size=(6, 12)), ["'tp.col'", "another rank"]),
    (lambda m: m["planner_data"].update({"tp.col": ("tp", "other")}), ["'tp.col'", "key path"]),
    (lambda m: m["state_dict_metadata"].update(
        {"step": m["state_dict_metadata"]["tp.rep"]}), ["'step'", "another rank"]),
    (lambda m: _chunks(m, "tp.col")[0].state.update(offsets=(0, 3)), ["'tp.col'", "overlap"]),
])
def test_ranks_whose_indexes_disagree_are_refused_naming_the_tensor(tmp_path, edit, needles):
    folder = _copy(tmp_path, "dcp-local")
    _edit(folder, edit, "__1.metadata")
    _refused(tmp_path, folder, *needles)


def test_a_metadata_holding_the_ranks_save_plans_reads_as_records():
    """megatron-core's torch_dist save keeps every rank's SavePlan in ``all_local_plans``
    (fixtures/megatron, written by megatron-core 0.16.1): read as inert records, its layout the
    same as any other .metadata's."""
    path = FIXTURES / "megatron" / "gpt-tp2-torch_dist" / "iter_0000010" / ".metadata"
    meta = read_pickle(path.read_bytes(), str(path), RECORDS)
    plans = meta.state["all_local_plans"]
    assert len(plans) == 2 and all(p.name == "torch.distributed.checkpoint.planner.SavePlan" for p in plans)
    items = plans[0].state["items"]
    assert {i.name for i in items} == {"torch.distributed.checkpoint.planner.WriteItem"}
    qkv = meta.state["state_dict_metadata"]["decoder.layers.self_attention.linear_qkv.weight"]
    assert tuple(qkv.state["size"]) == (2, 32, 16)
