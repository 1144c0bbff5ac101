"""PyTorch files are told by their content, whatever their name (issue 18, item 15): torchvision's
and pytorch/examples' ``checkpoint.pth.tar``, ``.tar``, ``.model``, ``.pkl``, ``.checkpoint``, no
suffix. A TorchScript or torch.export archive is refused saying what it is and what to do, and a
file that is none of these is refused naming what it looks like (fusectl/io/sniff.py).

The fixtures come from fixtures/generate_torch_names.py (torch 2.13); each checkpoint's
``*.expected.safetensors`` is ``torch.load(weights_only=True)["state_dict"]`` of it.
"""

from __future__ import annotations

import gzip
import io
import json
import pickle
import shutil
import struct
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES, ok, parse_safetensors, refused, run_cli, snapshot, time_limit
from fusectl.errors import CheckpointError
from fusectl.io.checkpoint import open_checkpoint, takes_key
from fusectl.io.sniff import check_pytorch, zip_names

NAMES = FIXTURES / "torch-names"
CHECKPOINTS = ["checkpoint", "checkpoint-legacy"]  # zip and legacy torch.save, as checkpoint*.pth.tar
# the names checkpoints carry in the wild; fusectl reads all of them by content
WILD_NAMES = ["checkpoint.pth.tar", "model_best.pth.tar", "ckpt.tar", "net.model", "weights.pkl",
              "epoch_3.checkpoint", "last.ckpt", "model.pt", "checkpoint"]


def expected(stem: str) -> tuple[dict, dict]:
    tensors, metadata = parse_safetensors(NAMES / f"{stem}.expected.safetensors")
    return tensors, json.loads(metadata["expected"])


def copied(tmp_path: Path, source: Path, name: str) -> Path:
    folder = tmp_path / "in"
    folder.mkdir(exist_ok=True)
    shutil.copyfile(source, folder / name)
    return folder / name


def refuse(tmp_path: Path, path: Path, *needles: str) -> str:
    """``convert PATH`` is exit 2 naming the file and each needle, writes nothing, leaves the input."""
    before = snapshot(path)
    out = tmp_path / "out.safetensors"
    with time_limit(20):
        result = run_cli("convert", path, "-o", out)
    refused(result, str(path), *needles, unwritten=[out])
    assert snapshot(path) == before
    return result.stderr


# ------------------------------------------------------------------------------ PyTorch files by content


@pytest.mark.parametrize("stem", CHECKPOINTS)
@pytest.mark.parametrize("name", WILD_NAMES)
def test_a_torch_save_file_is_read_under_any_name(tmp_path, stem, name):
    tensors, info = expected(stem)
    path = copied(tmp_path, NAMES / f"{stem}.pth.tar", name)
    report = ok(run_cli("inspect", path, "--json")).json()
    assert report["format"] == "pytorch"
    assert [p["name"] for p in report["parameters"]] == sorted(info["names"])
    out = tmp_path / "out.safetensors"
    ok(run_cli("convert", path, "-o", out))
    converted, _ = parse_safetensors(out)
    assert converted == tensors  # dtype, shape and bytes of what torch.load returned


@pytest.mark.parametrize("stem", CHECKPOINTS)
def test_the_state_dict_of_a_pth_tar_training_dict_is_chosen_and_key_applies(tmp_path, stem):
    _, info = expected(stem)
    path = copied(tmp_path, NAMES / f"{stem}.pth.tar", "checkpoint.pth.tar")
    checkpoint = open_checkpoint(str(path))
    assert checkpoint.state_dict_key == info["key"] == "state_dict"  # not 'optimizer', not 'best_acc1'
    assert takes_key(str(path))
    assert ok(run_cli("inspect", path, "--key", "state_dict", "--json")).json()["parameters"]
    refused(run_cli("inspect", path, "--key", "optimizer"), str(path), "optimizer")
    bare = copied(tmp_path, NAMES / f"{stem}.pth.tar", "checkpoint")
    assert takes_key(str(bare))
    assert open_checkpoint(str(bare), key="state_dict").table.names() == checkpoint.table.names()


def test_key_is_still_refused_for_formats_the_suffix_decides(tmp_path):
    src = FIXTURES / "tied-embeddings.safetensors"
    assert not takes_key(str(src))
    refused(run_cli("inspect", src, "--key", "state_dict"), "--key selects a state dict inside a PyTorch file")
    text = copied(tmp_path, NAMES / "checkpoint.expected.safetensors", "notes.txt")
    assert not takes_key(str(text))


# ------------------------------------------------------------------------------ PyTorch's other archives


@pytest.mark.parametrize("name", ["scripted.jit", "model.pt", "traced.pth", "model"])
def test_a_torchscript_archive_is_refused_saying_what_it_is_and_what_to_do(tmp_path, name):
    path = copied(tmp_path, NAMES / "scripted.jit", name)
    message = refuse(tmp_path, path, "a TorchScript archive (torch.jit.save", "not a torch.save state dict",
                     "never loads code from a file", f"torch.save(torch.jit.load('{path}').state_dict(), 'model.pt')")
    assert "unsupported checkpoint format" not in message and "__torch__" not in message


def test_a_torch_export_archive_is_refused_saying_what_it_is(tmp_path):
    path = copied(tmp_path, NAMES / "exported.pt2", "exported.pt2")
    refuse(tmp_path, path, "a torch.export archive (torch.export.save", "not a torch.save state dict",
           f"torch.save(torch.export.load('{path}').state_dict, 'model.pt')")


# ------------------------------------------------------------------------------ look-alikes


def _tar(data: bytes) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo("checkpoint.pth")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _zip(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return out.getvalue()


def _npz() -> bytes:
    out = io.BytesIO()
    np.savez(out, w=np.zeros(3, np.float32))
    return out.getvalue()


CHECKPOINT_BYTES = (NAMES / "checkpoint.pth.tar").read_bytes()
LOOK_ALIKES = {
    "empty": (b"", "an empty file"),
    "lfs-pointer": (b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"ab" * 32 + b"\nsize 6393\n",
                    "a Git LFS pointer", "git lfs pull"),
    "real-tar": (_tar(CHECKPOINT_BYTES), "a tar archive", "tar -xf"),
    "gzip": (gzip.compress(CHECKPOINT_BYTES, mtime=0), "gzip-compressed data", "gunzip"),
    "hdf5": (b"\x89HDF\r\n\x1a\n" + bytes(64), "an HDF5 file (Keras or TensorFlow .h5 weights)"),
    "gguf": (b"GGUF\x03\x00\x00\x00" + bytes(32), "a GGUF file (llama.cpp)"),
    "safetensors": ((FIXTURES / "tied-embeddings.safetensors").read_bytes(), "a safetensors file",
                    "ends in .safetensors"),
    "onnx": (b"\x08\x08\x12\x07pytorch" + bytes(16), "an ONNX model", "ends in .onnx"),
    "npz": (_npz(), "an .npz archive (numpy.savez)", "ends in .npz"),
    "other-zip": (_zip({"readme.txt": b"hi", "weights/w.bin": b"\0" * 8}), "a zip archive but not one torch.save",
                  "'readme.txt', 'weights/w.bin'"),
    "zip-without-version": (_zip({"archive/data.pkl": pickle.dumps({}, protocol=2)}), "not one torch.save writes",
                            "'archive/data.pkl'"),
    "empty-zip": (_zip({}), "a zip archive but not one torch.save writes (it is empty"),
    "html": (b"<!DOCTYPE html>\n<html><head><title>model</title>", "an HTML page", "download the file itself"),
    "text": (b"epoch 3, loss 0.25\n", "a text file (it starts with 'epoch 3, loss 0.25\\n')"),
    "binary": (bytes(range(7, 64)), "not a format fusectl knows (the file starts with b'\\x07\\x08"),
}


@pytest.mark.parametrize("name", ["weights.pth.tar", "pytorch_model.bin", "model"])
@pytest.mark.parametrize("case", sorted(LOOK_ALIKES))
def test_a_file_that_is_no_pytorch_file_is_refused_naming_what_it_looks_like(tmp_path, case, name):
    data, *needles = LOOK_ALIKES[case]
    path = tmp_path / "in" / name
    path.parent.mkdir()
    path.write_bytes(data)
    message = refuse(tmp_path, path, *needles)
    assert "unsupported checkpoint format" not in message and "internal error" not in message
    assert not takes_key(str(path)) or name.endswith(".bin")


def test_a_pickle_that_torch_save_did_not_write_is_left_to_the_pytorch_reader(tmp_path):
    path = tmp_path / "in" / "stats.pkl"
    path.parent.mkdir()
    path.write_bytes(pickle.dumps({"mean": [0.5, 0.5]}, protocol=4))
    check_pytorch(str(path))  # a pickle: the reader's scan decides, and says why it refuses
    refuse(tmp_path, path, "not a PyTorch checkpoint")


def test_a_shard_that_is_an_lfs_pointer_is_named(tmp_path):
    src = tmp_path / "model"
    shutil.copytree(FIXTURES / "tiny-llama-gqa-bin", src)
    shard = sorted(src.glob("pytorch_model-*.bin"))[0]
    shard.write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"cd" * 32 + b"\nsize 60000\n")
    out = tmp_path / "out"
    refused(run_cli("fuse", src, "-r", "llama-qkv", "-o", out, "--quiet"), str(shard), "a Git LFS pointer",
            unwritten=[out])


# ------------------------------------------------------------------------------ what sniffing reads


class CountingFile(io.BytesIO):
    """A file that counts the bytes read from it."""

    def __init__(self, data: bytes):
        super().__init__(data)
        self.bytes_read = 0

    def read(self, size=-1):
        data = super().read(size)
        self.bytes_read += len(data)
        return data


def test_sniffing_reads_the_central_directory_not_the_members(tmp_path):
    big = _zip({"archive/data.pkl": b"\x80\x02}.", "archive/data/0": bytes(20 << 20), "archive/version": b"3\n"})
    f = CountingFile(big)
    assert zip_names("big.pt", f, len(big)) == ["archive/data.pkl", "archive/data/0", "archive/version"]
    assert f.bytes_read < 70_000  # the last 64 KiB (the end record's search window) and the directory


def test_torch_save_zip64_directories_are_read(tmp_path):
    # torch.save writes zip64 end records on every file; Python's zipfile does only when asked
    data = (NAMES / "checkpoint.pth.tar").read_bytes()
    assert b"PK\x06\x06" in data[-200:]
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert zip_names("c.pt", io.BytesIO(data), len(data)) == zf.namelist()


def test_a_zip_listing_more_records_than_the_budget_is_refused_before_reading_them(tmp_path, monkeypatch):
    path = tmp_path / "in" / "many.pth.tar"
    path.parent.mkdir()
    path.write_bytes(_zip({"archive/data.pkl": b"\x80\x02}.", "archive/version": b"3\n",
                           **{f"archive/data/{i}": b"" for i in range(30)}}))
    monkeypatch.setenv("FUSECTL_MAX_TENSORS", "10")
    refuse(tmp_path, path, "the zip archive's records (one per storage)", "FUSECTL_MAX_TENSORS=11")


@pytest.mark.parametrize("cut", ["end-record", "directory", "oversized-directory"])
def test_a_broken_zip_directory_is_refused_as_corrupt(tmp_path, cut):
    data = bytearray((NAMES / "checkpoint.pth.tar").read_bytes())
    end = data.rfind(b"PK\x05\x06")
    if cut == "end-record":
        data = data[:end]
    elif cut == "directory":
        directory = data.find(b"PK\x01\x02")
        data[directory:directory + 4] = b"XXXX"
    else:
        zip64 = data.rfind(b"PK\x06\x06")
        data[zip64 + 40:zip64 + 48] = struct.pack("<Q", 1 << 40)
    path = tmp_path / "in" / "broken.pth.tar"
    path.parent.mkdir()
    path.write_bytes(bytes(data))
    refuse(tmp_path, path, "a zip archive with", "the file is truncated or corrupt")
    with pytest.raises(CheckpointError):
        check_pytorch(str(path))
