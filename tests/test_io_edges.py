"""Reading checkpoints at their edges: folders holding several or no weight files, odd sharded
indexes, npz archives built by hand, provenance records edited field by field, unreadable
paths and files swapped while opened, and the FUSECTL_MAX_* budgets set to nonsense.

Each bad input is exit 2 with one ``error:`` line naming the file (and the tensor or field),
no traceback, and nothing written.
"""

from __future__ import annotations

import copy
import errno
import io
import json
import os
import struct
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest

from conftest import leftovers, ok, parse_safetensors, snapshot, time_limit, write_rules, write_safetensors, refused
from fusectl.errors import CheckpointError
from fusectl.io import untrusted
from fusectl.io.formats import npz_file
from fusectl.io.provenance import plan_from_json, plan_to_json
from fusectl.io.untrusted import open_input

RENAME = 'version = 1\n[[rule]]\nop = "rename"\ninput = "w"\noutput = "v"\n'


def _weights(path: Path, **tensors) -> Path:
    return write_safetensors(path, tensors or {"w": np.arange(6, dtype=np.float32).reshape(2, 3)})


def _sharded(folder: Path, shards: dict[str, dict[str, np.ndarray]], weight_map: dict[str, str] | None = None,
             **index) -> Path:
    """A folder of hand-written shards and a ``model.safetensors.index.json`` (weight_map derived
    from the shards unless given)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, tensors in shards.items():
        write_safetensors(folder / name, tensors)
    if weight_map is None:
        weight_map = {t: name for name, tensors in shards.items() for t in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map, **index}))
    return folder


# --------------------------------------------------------------------- folders and indexes


def test_a_folder_holding_only_an_npz_reads_it(cli, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    np.savez(folder / "weights.npz", w=np.arange(4, dtype=np.int16))
    report = ok(cli("inspect", folder, "--json")).json()
    assert report["format"] == "npz"
    assert [os.path.basename(f) for f in report["files"]] == ["weights.npz"]
    assert [(p["name"], p["dtype"], p["shape"]) for p in report["parameters"]] == [("w", "I16", [4])]


def test_a_folder_holding_two_weight_files_asks_which(cli, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    _weights(folder / "a.safetensors")
    _weights(folder / "b.safetensors")
    refused(cli("inspect", folder), f"{folder}: holds a.safetensors, b.safetensors; name the one to read")


def test_a_folder_holding_no_weight_file_says_what_it_looks_for(cli, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.msgpack").write_bytes(b"\0" * 8)  # Flax weights: not read
    refused(cli("inspect", folder), f"{folder}: holds no .safetensors, .safetensors.index.json, .npz, PyTorch "
                                    "(.pt, .pth, .bin, .ckpt, *.bin.index.json) file")


def test_an_index_without_metadata_reads(cli, tmp_path):
    folder = _sharded(tmp_path / "ckpt", {"a.safetensors": {"x": np.ones(2, np.float32)},
                                          "b.safetensors": {"y": np.zeros(3, np.uint8)}})
    report = ok(cli("inspect", folder, "--json")).json()
    assert report["format"] == "safetensors-sharded"
    assert report["provenance"] is None
    assert {p["name"]: p["shape"] for p in report["parameters"]} == {"x": [2], "y": [3]}


def test_an_index_with_an_empty_weight_map_is_refused(cli, tmp_path):
    folder = _sharded(tmp_path / "ckpt", {"a.safetensors": {"x": np.ones(2, np.float32)}}, weight_map={})
    refused(cli("inspect", folder), "model.safetensors.index.json", "'weight_map' is empty")


def test_a_tensor_stored_in_two_shards_is_refused(cli, tmp_path):
    folder = _sharded(tmp_path / "ckpt", {"a.safetensors": {"x": np.ones(2, np.float32)},
                                          "b.safetensors": {"x": np.zeros(2, np.float32), "y": np.ones(1, np.uint8)}},
                      weight_map={"x": "a.safetensors", "y": "b.safetensors"})
    refused(cli("inspect", folder), "b.safetensors: tensor 'x' is also stored in another shard")


def test_provenance_in_an_index_that_is_not_text_is_refused(cli, tmp_path):
    folder = _sharded(tmp_path / "ckpt", {"a.safetensors": {"x": np.ones(2, np.float32)}},
                      metadata={"fusectl": {"format_version": 1}})
    refused(cli("inspect", folder), "model.safetensors.index.json", "'fusectl' metadata entry must be a string")


def test_a_config_that_is_not_an_object_is_refused(cli, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    _weights(folder / "model.safetensors")
    (folder / "config.json").write_text("[4096, 32]")
    out = tmp_path / "out.safetensors"
    refused(cli("fuse", folder, "-r", write_rules(tmp_path / "r.toml", RENAME), "-o", out),
            "config.json: config must be a JSON object", unwritten=[out])


def test_a_config_path_through_a_file_is_refused(cli, tmp_path):
    """``--config model.safetensors/config.json``: the path's folder is a file (ENOTDIR, not ENOENT)."""
    model = _weights(tmp_path / "model.safetensors")
    config = model / "config.json"
    refused(cli("inspect", model, "--config", config), f"{config}: cannot read it (Not a directory)")


def test_a_file_that_cannot_be_opened_is_refused(cli, tmp_path, monkeypatch):
    """os.open failing after the file was found (permissions; root would not see EACCES)."""
    model = _weights(tmp_path / "model.safetensors")
    real_open = os.open

    def deny(path, *args, **kwargs):
        if os.fspath(path) == str(model):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(untrusted.os, "open", deny)
    refused(cli("inspect", model), f"{model}: cannot read it (Permission denied)")


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_file_swapped_for_a_fifo_after_the_check_is_refused_without_blocking(tmp_path, monkeypatch):
    """The check passed on a regular file, then a FIFO took its place: the non-blocking open
    returns at once, the second check refuses it, and the descriptor is closed."""
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    monkeypatch.setattr(untrusted, "check_regular_file", lambda path: None)  # the regular file it was
    before = _open_fds()
    with time_limit(10), pytest.raises(CheckpointError, match="changed into something other than a regular file"):
        open_input(str(fifo))
    assert _open_fds() == before


def test_json_nested_deeper_than_python_parses_is_an_error_even_with_a_raised_budget(cli, tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    _weights(folder / "model.safetensors")
    depth = 200_000
    (folder / "config.json").write_text('{"a": ' + "[" * depth + "]" * depth + "}")
    monkeypatch.setenv("FUSECTL_MAX_JSON_DEPTH", str(10 * depth))
    refused(cli("inspect", folder), "config.json", "levels of JSON nesting", "FUSECTL_MAX_JSON_DEPTH")


# ------------------------------------------------------------------------------- budgets


@pytest.mark.parametrize("value, needle", [
    ("many", "FUSECTL_MAX_TENSORS='many' is not a whole number; unset it or give a number"),
    ("0", "FUSECTL_MAX_TENSORS='0' must be at least 1"),
    ("-5", "FUSECTL_MAX_TENSORS='-5' must be at least 1"),
])
def test_a_budget_variable_that_is_not_a_positive_number_is_refused(cli, tmp_path, monkeypatch, value, needle):
    model = _weights(tmp_path / "model.safetensors")
    monkeypatch.setenv("FUSECTL_MAX_TENSORS", value)
    refused(cli("inspect", model), needle)


def test_a_budget_variable_raises_the_limit(cli, tmp_path, monkeypatch):
    model = _weights(tmp_path / "model.safetensors", a=np.ones(1, np.uint8), b=np.ones(1, np.uint8))
    monkeypatch.setenv("FUSECTL_MAX_TENSORS", "1")
    refused(cli("inspect", model), "exceeds fusectl's limit of 1", "FUSECTL_MAX_TENSORS=2")
    monkeypatch.setenv("FUSECTL_MAX_TENSORS", "2")
    ok(cli("inspect", model))


# ------------------------------------------------------------------------------------ npz


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _npy_header(header: str) -> bytes:
    """An npy 1.0 stream whose header dict is ``header`` (padded as numpy pads it), no data."""
    text = header.encode("latin1")
    text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text


def _zip(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # zipfile warns of a duplicate name
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
            for name, data in members:
                zf.writestr(name, data)
    return path


GOOD = _npy(np.arange(3, dtype=np.float32))


@pytest.mark.parametrize("members, needles", [
    ([("w.npy", b"this is not an npy stream")], ["array 'w': unreadable"]),
    ([("w.npy", _npy_header("{'descr': '<f4', 'fortran_order': False, 'shape': (-1, 2), }"))],
     ["array 'w': shape (-1, 2) is not a tuple of whole numbers"]),
    ([("w.npy", GOOD), ("w.npy", GOOD)], ["array 'w': the archive holds two members of this name"]),
    ([("w.npy", GOOD), ("__fusectl_metadata__.npy", _npy(np.frombuffer(b'["a", "b"]', np.uint8)))],
     ["member __fusectl_metadata__ must map strings to strings"]),
    ([("w.npy", GOOD), ("__fusectl_metadata__.npy", _npy(np.frombuffer(b'{"k": "\\ud800"}', np.uint8)))],
     ["member __fusectl_metadata__ holds a lone UTF-16 surrogate"]),
], ids=["garbage", "negative-dim", "duplicate", "metadata-list", "metadata-surrogate"])
def test_a_hand_built_npz_is_refused_naming_the_member(cli, tmp_path, members, needles):
    src = _zip(tmp_path / "in.npz", members)
    before = snapshot(src)
    out = tmp_path / "out.safetensors"
    refused(cli("fuse", src, "-r", write_rules(tmp_path / "r.toml", RENAME), "-o", out),
            "in.npz", *needles, unwritten=[out])
    assert snapshot(src) == before


@pytest.mark.parametrize("array, dtype", [(np.zeros(2, np.complex128), "complex128"), (np.array(["ab", "c"]), "<U2")])
def test_an_npz_array_of_a_dtype_safetensors_lacks_is_refused(cli, tmp_path, array, dtype):
    src = tmp_path / "in.npz"
    np.savez(src, ok=np.ones(2, np.float32), odd=array)
    refused(cli("inspect", src), "in.npz: array 'odd': unsupported numpy dtype " + dtype)


def test_a_tensor_named_like_fusectls_npz_members_cannot_be_written_to_npz(cli, tmp_path):
    src = _weights(tmp_path / "in.safetensors", w=np.ones(2, np.float32), __fusectl_metadata__=np.ones(1, np.uint8))
    out = tmp_path / "out.npz"
    refused(cli("fuse", src, "-r", write_rules(tmp_path / "r.toml", RENAME), "-o", out),
            "tensor '__fusectl_metadata__' has a name fusectl reserves in npz files", unwritten=[out])
    assert leftovers(tmp_path) == []
    # the same checkpoint is fine as safetensors, which has no reserved names
    ok(cli("fuse", src, "-r", tmp_path / "r.toml", "-o", tmp_path / "out.safetensors"))


def test_a_failure_while_writing_an_npz_leaves_no_output(cli, tmp_path, monkeypatch):
    src = _weights(tmp_path / "in.safetensors", w=np.ones(2, np.float32), u=np.zeros(3, np.int8))
    out = tmp_path / "out.npz"

    def full_disk(self, name, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)

    monkeypatch.setattr(npz_file.NpzWriter, "write", full_disk)
    refused(cli("fuse", src, "-r", write_rules(tmp_path / "r.toml", RENAME), "-o", out, "--quiet"),
            "No space left on device", unwritten=[out])
    assert leftovers(tmp_path) == []


# ----------------------------------------------------------------------- edited provenance


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> tuple[dict[str, np.ndarray], dict]:
    """The tensors and provenance record of a real fuse output (a rename of ``w`` to ``v``)."""
    from conftest import run_cli

    tmp = tmp_path_factory.mktemp("record")
    src = _weights(tmp / "in.safetensors", w=np.arange(6, dtype=np.float32).reshape(2, 3), u=np.ones(3, np.float32))
    out = tmp / "fused.safetensors"
    ok(run_cli("fuse", src, "-r", write_rules(tmp / "r.toml", RENAME), "-o", out))
    tensors, metadata = parse_safetensors(out)
    arrays = {name: np.frombuffer(raw, np.float32).reshape(shape) for name, (_, shape, raw) in tensors.items()}
    return arrays, json.loads(metadata["fusectl"])


def _set(path, value):
    """A mutation setting the field at ``path`` (keys and indexes) of the record to ``value``."""
    def mutate(doc):
        target = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return mutate


STEP = ("plan", 0, "steps", 0)
EDITS = {
    "version-not-text": (_set(("fusectl_version",), 5), "fusectl_version must be a string"),
    "unknown-key": (_set(("signed_by",), "me"), "the record has the unknown key 'signed_by'"),
    "group-not-object": (_set(("plan", 0), 5), "rule group 0 must be an object, not 5"),
    "group-op-not-text": (_set(("plan", 0, "op"), ["rename"]), "rule group 0: op must be a string"),
    "untied-stored-stranger": (lambda d: d["plan"][0].update(untied=[["v", "u"]], untied_stored=[["w"]]),
                               "rule group 0: untied_stored must name members of each untied group"),
    "step-not-object": (_set(("plan", 0, "steps", 0), "rename"),
                        "rule group 0, step 0 must be an object, not 'rename'"),
    "params-not-object": (_set((*STEP, "params"), []), "rule group 0, step 0: params must be an object, not []"),
    "exact-not-bool": (_set((*STEP, "exact"), "yes"), "rule group 0, step 0: exact must be true or false"),
    "one-way-not-bool": (_set((*STEP, "one_way"), 0), "rule group 0, step 0: one_way must be true or false"),
    "unknown-dtype": (_set((*STEP, "input_specs", 0, 0), "F99"), "input_specs: unknown dtype 'F99'"),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_edited_provenance_field_is_refused_naming_it(cli, tmp_path, record, edit):
    arrays, doc = record
    mutate, needle = EDITS[edit]
    doc = copy.deepcopy(doc)
    mutate(doc)
    path = write_safetensors(tmp_path / "edited.safetensors", arrays, metadata={"fusectl": json.dumps(doc)})
    out = tmp_path / "restored.safetensors"
    for args in (("inspect", path), ("unfuse", path, "-o", out)):
        refused(cli(*args), "edited.safetensors", "fusectl provenance is unreadable", needle, unwritten=[out])


def test_an_alias_naming_a_tensor_that_is_also_stored_is_refused(cli, tmp_path, record):
    """Both ``u`` and ``v`` are stored, with their own bytes: ``u`` cannot also be an alias of ``v``."""
    arrays, doc = record
    doc = {**doc, "aliases": {"u": "v"}}
    arrays = {**arrays, "u": np.ones((2, 3), np.float32)}  # the shape of v, so only the tie is wrong
    path = write_safetensors(tmp_path / "aliased.safetensors", arrays, metadata={"fusectl": json.dumps(doc)})
    refused(cli("inspect", path), "aliased.safetensors", "'u' is stored and also recorded as an alias of 'v'")


def test_the_unedited_record_reads_back(cli, tmp_path, record):
    """The baseline of the edits above: the same file with the record as written is accepted."""
    arrays, doc = record
    path = write_safetensors(tmp_path / "same.safetensors", arrays, metadata={"fusectl": json.dumps(doc)})
    report = ok(cli("inspect", path, "--json")).json()
    assert report["provenance"]["plan"] == doc["plan"]


def test_a_plan_survives_its_json_form(record):
    _, doc = record
    plan = plan_from_json(doc["plan"])
    assert plan_to_json(plan) == doc["plan"]
    assert [(s.inputs, s.outputs) for s in plan.steps] == [(("w",), ("v",))]


def test_plan_from_json_names_where_a_bad_plan_came_from(record):
    _, doc = record
    broken = copy.deepcopy(doc["plan"])
    broken[0]["steps"][0]["op"] = "teleport"
    with pytest.raises(CheckpointError) as caught:
        plan_from_json(broken, "job.json")
    assert str(caught.value).startswith("job.json: fusectl provenance is unreadable (rule group 0, step 0: op "
                                        "'teleport' is not an op this fusectl knows)")
