"""io/formats/dcp_writer and ``--to dcp`` / ``--to ds-universal``: training checkpoints written as
the folders distributed trainers resume from.

Without torch: the DCP folder's structure and its ``.metadata`` read back with fusectl's own
allow-listed unpickler, every item the tensor or value it is said to be, the tree flattened as
torch's ``flatten_state_dict`` flattens it, an optimizer of ids written keyed by name, refusals
(no optimizer, a file output, names that cannot be written) with nothing written, and the
round trip: a fused ``--to dcp`` output unfuses to the input's tensors bitwise. With torch:
``dcp.load`` (``fixtures/distributed_train.py resume-dcp``) reads what was written from a ZeRO-2
checkpoint and from the FSDP2 one fused with ``llama-qkv`` + ``llama-gate-up``, on 1 and 2
ranks, and the next steps give the uninterrupted run's losses (within 1e-6); with DeepSpeed, a
ZeRO-2 checkpoint written ``--to ds-universal`` resumes on 1 rank (within 1e-5).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES, ok, refused, run_cli, snapshot
from test_dcp import _same_tree  # the trees compared as test_dcp compares them: types, order, bytes
from fusectl import api, dtypes
from fusectl.errors import CheckpointError, OutputError
from fusectl.io.formats import dcp_writer
from fusectl.io.formats.dcp import METADATA_FILE, RECORDS, read_dcp
from fusectl.io.formats.dcp_writer import RANK_FILE, dcp_tree, flatten, write_dcp
from fusectl.io.formats.deepspeed_universal import read_universal
from fusectl.io.formats.deepspeed_zero import read_zero
from fusectl.io.formats.torch_file import Record, dtype_of, read_pickle, read_torch_tree
from fusectl.io.provenance import METADATA_KEY
from fusectl.tensors import ArrayTensor, LazyTensor, TensorSpec

DIST = FIXTURES / "distributed"
SAVED = 3  # steps trained before the fixtures were saved (fixtures/resume_training.py)
F32 = dtypes.BY_NAME["F32"]
META = "torch.distributed.checkpoint.metadata."


def _tensor(*shape: int, start: float = 0.0) -> ArrayTensor:
    size = int(np.prod(shape)) if shape else 1
    return ArrayTensor(TensorSpec(F32, shape), np.arange(start, start + size, dtype=np.float32).reshape(shape))


def _bytes(tensor: LazyTensor) -> bytes:
    return tensor.read().tobytes()


def _metadata(folder: Path) -> dict:
    root = read_pickle((folder / ".metadata").read_bytes(), str(folder / ".metadata"), RECORDS)
    assert isinstance(root, Record) and root.name == META + "Metadata"
    return root.state


# ------------------------------------------------------------------------------- the folder, without torch


def test_a_zero2_checkpoint_written_to_dcp_holds_every_item_where_its_metadata_says(tmp_path):
    out = tmp_path / "dcp"
    ok(run_cli("convert", DIST / "zero2", "-o", out, "--to", "dcp"))
    assert sorted(os.listdir(out)) == [".metadata", RANK_FILE, METADATA_FILE]
    meta = _metadata(out)
    entries, planner, storage = meta["state_dict_metadata"], meta["planner_data"], meta["storage_data"]
    zero = read_zero(str(DIST / "zero2"))
    tree = zero.training.tree()
    model = [f"model.{n}" for n in tree["model"]]
    assert list(entries)[:len(model)] == model
    assert planner["model.model.embed_tokens.weight"] == ("model", "model.embed_tokens.weight")
    assert planner["optim.param_groups.0.lr"] == ("optim", "param_groups", 0, "lr")
    assert meta["version"] == "1.0.0" and meta["storage_meta"].state["checkpoint_id"].args == ("dcp",)
    # every item at its offset, one after another, the whole file
    spans = sorted((info.state["offset"], info.state["length"]) for info in storage.values())
    assert spans[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
    assert spans[-1][0] + spans[-1][1] == (out / RANK_FILE).stat().st_size
    for index, info in storage.items():
        fqn = index.state["fqn"]
        item, _ = read_torch_tree(str(out / RANK_FILE), span=(info.state["offset"], info.state["length"]))
        entry = entries[fqn]
        if entry.name == META + "BytesStorageMetadata":
            assert index.state["offset"] is None and not isinstance(item, LazyTensor)
            continue
        size = tuple(entry.state["size"])
        assert dtype_of(entry.state["properties"].state[0]) == item.spec.dtype and item.spec.shape == size
        [chunk] = entry.state["chunks"]
        assert chunk.state["offsets"] == (0,) * len(size) and tuple(chunk.state["sizes"]) == size
        if fqn.startswith("model."):
            assert _bytes(item) == _bytes(tree["model"][fqn[len("model."):]]), fqn
    # the optimizer keyed by name, as get_state_dict gives it
    back = read_dcp(str(out))
    optim = back.training.tree()["optim"]
    names = list(tree["model"])
    assert [p for g in optim["param_groups"] for p in g["params"]] == \
        [n for g in tree["optimizer"]["param_groups"] for n in g["param_names"]]
    assert all("param_names" not in g for g in optim["param_groups"])
    assert optim["param_groups"][0]["betas"] == (0.9, 0.999)
    for group in tree["optimizer"]["param_groups"]:
        for pid, name in zip(group["params"], group["param_names"], strict=True):
            for key, value in tree["optimizer"]["state"][pid].items():
                assert _bytes(optim["state"][name][key]) == _bytes(value), (name, key)
    for name in names:
        assert _bytes(back.tensors[name]) == _bytes(tree["model"][name])


def test_a_dcp_folder_written_to_dcp_reads_back_as_it_was_read_every_entry_kept(tmp_path):
    out = tmp_path / "again"
    ok(run_cli("convert", DIST / "dcp", "-o", out, "--to", "dcp"))
    _same_tree(read_dcp(str(out)).training.tree(), read_dcp(str(DIST / "dcp")).training.tree())


def test_the_same_input_gives_the_same_folder_byte_for_byte(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        ok(run_cli("convert", DIST / "zero2", "-o", tmp_path / name / "ckpt", "--to", "dcp"))
    assert snapshot(tmp_path / "a") == snapshot(tmp_path / "b")


def test_a_fused_dcp_output_unfuses_to_the_inputs_tensors_bitwise(tmp_path):
    fused, restored = tmp_path / "fused", tmp_path / "restored"
    ok(run_cli("fuse", DIST / "dcp", "-r", "llama-qkv", "-r", "llama-gate-up", "-o", fused, "--to", "dcp"))
    back = read_dcp(str(fused))
    assert METADATA_KEY in back.metadata and "model.layers.0.self_attn.qkv_proj.weight" in back.tensors
    assert "model.layers.0.self_attn.qkv_proj.weight" in back.training.tree()["optim"]["state"]
    ok(run_cli("unfuse", fused, "-o", restored, "--to", "dcp"))
    _same_tree(read_dcp(str(restored)).training.tree(), read_dcp(str(DIST / "dcp")).training.tree())


def test_a_zero2_checkpoint_written_to_ds_universal_reads_back_as_the_zero_checkpoint(tmp_path):
    out = tmp_path / "universal"
    ok(run_cli("convert", DIST / "zero2", "-o", out, "--to", "ds-universal"))
    ours, theirs = read_universal(str(out)), read_zero(str(DIST / "zero2"))
    for name, tensor in theirs.tensors.items():
        assert _bytes(ours.tensors[name]) == _bytes(tensor), name


def test_the_tree_is_flattened_as_dcps_flatten_state_dict_flattens_it():
    t = _tensor(2)
    tree = {"a": {"b": t, 3: 1.5}, "l": [{"x": 1}, {"y": 2}], "plain": [1, 2, [3]], "mixed": [t, 4],
            "pair": (t, 1), "deep": [[t]]}
    got = [(fqn, path, value) for fqn, path, value in flatten(tree, "out")]
    assert [(f, p) for f, p, _ in got] == [
        ("a.b", ("a", "b")), ("a.3", ("a", "3")), ("l.0.x", ("l", 0, "x")), ("l.1.y", ("l", 1, "y")),
        ("plain", ("plain",)), ("mixed.0", ("mixed", 0)), ("mixed.1", ("mixed", 1)), ("pair", ("pair",)),
        ("deep.0.0", ("deep", 0, 0))]
    assert got[4][2] == [1, 2, [3]] and got[7][2] == (t, 1)
    with pytest.raises(OutputError, match="'a.b'.*rename one"):
        flatten({"a": {"b": 1}, "a.b": 2}, "out")


def test_a_model_at_the_top_goes_under_model_its_other_entries_beside_it(tmp_path):
    w = _tensor(2, 2)
    root = {"w": w, "epoch": 3, "optimizer": {"state": {0: {"exp_avg": _tensor(2, 2, start=1)}},
                                              "param_groups": [{"lr": 0.1, "params": [0], "param_names": ["w"]}]}}
    tree = dcp_tree(root, (), ("optimizer",), {}, "out")
    assert list(tree) == ["model", "epoch", "optim"] and tree["model"] == {"w": w}
    assert tree["optim"]["param_groups"] == [{"lr": 0.1, "params": ["w"]}]
    write_dcp(str(tmp_path / "out"), root, (), ("optimizer",), {"k": "v"})
    back = read_dcp(str(tmp_path / "out"))
    assert back.metadata == {"k": "v"} and _bytes(back.tensors["w"]) == _bytes(w)
    assert back.training.tree()["epoch"] == 3
    # the names fusectl recorded stand in for param_names
    no_names = {"state": {0: {}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    tree = dcp_tree({"model": {"w": w}, "opt": no_names}, ("model",), ("opt",), {"fusectl.param_names": '["w"]'}, "o")
    assert tree["optim"]["param_groups"][0]["params"] == ["w"]


@pytest.mark.parametrize("root,model,optimizer,needle", [
    ([1], ("model",), None, "not a dict"),
    ({"model": 3}, ("model",), None, "not a state dict"),
    ({"model": {"w": _tensor(2)}, "opt": {"state": {}, "param_groups": [{"params": [0]}]}}, ("model",), ("opt",),
     "names no parameters (param_names), and a DCP checkpoint"),
    ({"model": {"w": _tensor(2)}, "opt": {"state": {}, "param_groups": [{"params": [0], "param_names": ["v"]}]}},
     ("model",), ("opt",), "trains 'v', which the model does not hold"),
    ({"s": {"model": {"w": _tensor(2)}, "step": 1}}, ("s", "model"), None, "shares the entry 's'"),
    ({"sd": {"w": _tensor(2)}, "model": 1}, ("sd",), None, "the key the model takes"),
    ({"model": {"w": _tensor(2)}, "x": object()}, ("model",), None, "is a object"),
])
def test_a_tree_that_cannot_be_written_is_refused_naming_what(tmp_path, root, model, optimizer, needle):
    with pytest.raises(OutputError, match=None) as caught:
        write_dcp(str(tmp_path / "out"), root, model, optimizer, {})
    assert needle in str(caught.value)


def test_a_malformed_optimizer_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="param_groups"):
        write_dcp(str(tmp_path / "out"), {"model": {"w": _tensor(2)}, "opt": {"state": {}}}, ("model",), ("opt",), {})


def test_a_folder_that_cannot_be_made_is_an_output_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputError, match="cannot be written"):
        write_dcp(str(tmp_path / "file"), {"model": {"w": _tensor(2)}}, ("model",), None, {})


@pytest.mark.parametrize("args,needles", [
    (["-o", "{tmp}/out.pt", "--to", "dcp"], ["--to dcp writes a folder"]),
    (["-o", "{tmp}/out", "--to", "dcp", "--drop-optimizer"], ["--drop-optimizer does not apply"]),
    (["-o", "{tmp}/out", "--to", "ds-universal", "--max-shard-size", "1MB"], ["--max-shard-size does not apply"]),
])
def test_to_is_refused_where_it_cannot_write_a_training_folder(tmp_path, args, needles):
    args = [a.format(tmp=tmp_path) for a in args]
    before = snapshot(tmp_path)
    refused(run_cli("convert", DIST / "zero2", *args), *needles)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("command", [["convert"], ["fuse", "-r", "llama-qkv"]])
def test_to_is_refused_for_a_checkpoint_without_an_optimizer(tmp_path, command):
    cmd, *rest = command
    refused(run_cli(cmd, FIXTURES / "tiny-llama-gqa", *rest, "-o", tmp_path / "out", "--to", "dcp"),
            "holds no optimizer state", "leave --to out", unwritten=[tmp_path / "out"])
    with pytest.raises(Exception, match="fusectl writes dcp or ds-universal"):
        api.convert(DIST / "zero2", tmp_path / "out", to="zip")


def test_nothing_is_written_when_writing_fails_midway(tmp_path, monkeypatch):
    calls = []
    real = dcp_writer.append_torch_archive

    def failing(fd, writeback, value, where):
        calls.append(where)
        if len(calls) == 3:
            raise OutputError(f"{where}: failed on purpose")
        return real(fd, writeback, value, where)

    monkeypatch.setattr(dcp_writer, "append_torch_archive", failing)
    with pytest.raises(OutputError, match="failed on purpose"):
        api.convert(DIST / "zero2", tmp_path / "out", to="dcp")
    assert len(calls) == 3 and os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------- loaded by torch, resumed


def _uninterrupted(run: str) -> list[float]:
    [losses] = json.loads((DIST / "reference" / "losses.json").read_text())[run].values()
    return losses[SAVED:]


def _resume(command: str, folder: Path, ranks: int, *extra: str) -> dict:
    """``fixtures/distributed_train.py COMMAND FOLDER --ranks N``'s JSON, the fixtures' config."""
    shutil.copy(DIST / "config.json", folder / "config.json")
    done = subprocess.run([sys.executable, str(FIXTURES / "distributed_train.py"), command, str(folder),
                           "--ranks", str(ranks), *extra], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """zero2/ converted --to dcp, and dcp/ fused with llama-qkv + llama-gate-up --to dcp."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("dcp-out")
    ok(run_cli("convert", DIST / "zero2", "-o", root / "zero2", "--to", "dcp"))
    ok(run_cli("fuse", DIST / "dcp", "-r", "llama-qkv", "-r", "llama-gate-up", "-o", root / "fused", "--to", "dcp"))
    return root


def test_torch_reads_the_metadata_as_its_own(written):
    from torch.distributed.checkpoint import FileSystemReader
    import torch
    meta = FileSystemReader(str(written / "zero2")).read_metadata()
    entry = meta.state_dict_metadata["model.model.embed_tokens.weight"]
    assert type(entry.size) is torch.Size and entry.properties.dtype == torch.float32
    assert meta.planner_data["optim.param_groups.1.params"] == ("optim", "param_groups", 1, "params")


@pytest.mark.parametrize("name,arch", [("zero2", "llama"), ("fused", "phi3")])
@pytest.mark.parametrize("ranks", [1, 2])
def test_dcp_load_resumes_the_written_folder_with_the_uninterrupted_runs_losses(written, name, arch, ranks):
    got = _resume("resume-dcp", written / name, ranks)
    assert got["arch"] == arch and got["ranks"] == ranks
    assert max(abs(a - b) for a, b in zip(got["losses"], _uninterrupted("fsdp2"), strict=True)) <= 1e-6


def test_deepspeed_resumes_a_zero2_checkpoint_written_to_ds_universal(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("deepspeed")
    out = tmp_path / "universal"
    ok(run_cli("convert", DIST / "zero2", "-o", out, "--to", "ds-universal"))
    got = _resume("resume-ds-universal", out, 1, "--stage", "2")
    assert got["arch"] == "llama" and got["ranks"] == 1
    assert max(abs(a - b) for a, b in zip(got["losses"], _uninterrupted("deepspeed-zero2"), strict=True)) <= 1e-5


def test_a_trainer_folder_and_an_optimizer_without_names_are_refused_naming_the_output(tmp_path):
    out = tmp_path / "out"
    refused(run_cli("convert", FIXTURES / "training" / "trainer" / "checkpoint-2", "-o", out, "--to", "dcp"),
            "is a Hugging Face Trainer folder", unwritten=[out])
    # a torch optimizer of bare ids, written as read: no name to key its state by
    result = run_cli("convert", FIXTURES / "training" / "llama-adamw.pt", "-o", out, "--to", "dcp")
    refused(result, f"{out}: the optimizer names no parameters", unwritten=[out])
    assert os.listdir(tmp_path) == []


def test_a_fused_training_dict_names_its_optimizer_by_fusectls_record(tmp_path):
    out = tmp_path / "out"
    ok(run_cli("fuse", FIXTURES / "training" / "llama-adamw.pt", "-r", "llama-qkv", "-o", out, "--to", "dcp"))
    back = read_dcp(str(out))
    optim = back.training.tree()["optim"]
    assert sorted(optim["state"]) == sorted(p for g in optim["param_groups"] for p in g["params"])
    assert set(optim["state"]) <= set(back.tensors) and "model.layers.0.self_attn.qkv_proj.weight" in optim["state"]
