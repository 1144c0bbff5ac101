"""The format registry (fusectl.io.registry): every row recognised by its suffix or content,
picked in a folder in preference order, read into one Contents, written back where it has a
writer (a round trip), and io/ importing nothing from onnx/ or verification/."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES, write_safetensors
from fusectl.errors import CheckpointError, OutputError
from fusectl.io.checkpoint import open_checkpoint
from fusectl.io.contents import Contents
from fusectl.io.registry import (FORMATS, WEIGHT_SUFFIXES, format_by_suffix, format_named, format_of, output_format,
                                output_kind, pick_in_folder, takes_key)
from fusectl.io.formats.npz_file import NpzWriter

IO = Path(__file__).resolve().parent.parent / "fusectl" / "io"
ARRAYS = {"a.weight": np.arange(12, dtype=np.float32).reshape(3, 4), "b.bias": np.arange(5, dtype=np.int64)}


def _npz(path: Path) -> Path:
    entries = [(n, _spec(a)) for n, a in ARRAYS.items()]
    writer = NpzWriter(str(path), entries, {"format": "pt"})
    for name, array in ARRAYS.items():
        writer.write(name, array)
    writer.close()
    return path


def _spec(array: np.ndarray):
    from fusectl.dtypes import from_numpy
    from fusectl.tensors import TensorSpec

    return TensorSpec(from_numpy(array.dtype, "test"), array.shape)


def sample(name: str, tmp_path: Path) -> Path:
    """A small real file of the format ``name``, in a folder of its own under ``tmp_path``."""
    folder = tmp_path / name
    folder.mkdir()
    if name == "safetensors":
        return write_safetensors(folder / "model.safetensors", ARRAYS, {"format": "pt"})
    if name == "npz":
        return _npz(folder / "model.npz")
    if name == "pytorch":
        return Path(shutil.copy(FIXTURES / "torch" / "tied.pt", folder / "model.pt"))
    if name == "onnx":
        return Path(shutil.copy(FIXTURES / "onnx" / "bert" / "model.onnx", folder / "model.onnx"))
    if name == "mxnet":
        return Path(shutil.copy(FIXTURES / "mxnet" / "prefixed" / "prefixed.params", folder / "model.params"))
    source = {"safetensors-sharded": "tiny-llama-gqa-bf16-sharded", "pytorch-sharded": "tiny-llama-gqa-bin"}[name]
    shutil.rmtree(folder)
    shutil.copytree(FIXTURES / source, folder)
    return next(folder.glob("*.index.json"))


NAMES = [f.name for f in FORMATS if f.folder is None]  # the formats of files (folder formats: test_deepspeed_zero.py, test_deepspeed_universal.py,
# test_dcp.py, test_dcp_safetensors.py, test_megatron.py, test_megatron_dist.py)


def test_the_checkpoint_format_names_stay():
    assert NAMES == ["safetensors", "safetensors-sharded", "npz", "pytorch", "pytorch-sharded", "onnx", "mxnet"]
    assert [f.name for f in FORMATS if f.folder] == ["deepspeed-zero", "deepspeed-universal",
                                                      "megatron-torch_dist", "dcp", "dcp-safetensors",
                                                      "megatron-legacy"]
    assert [format_named(n).name for n in NAMES] == NAMES
    with pytest.raises(KeyError):
        format_named("gguf")
    assert [f.name for f in FORMATS if f.takes_key] == ["pytorch", "dcp"]


@pytest.mark.parametrize("name", NAMES)
def test_every_row_is_recognised_read_into_contents_and_opened(tmp_path, name):
    path = sample(name, tmp_path)
    fmt = format_of(str(path))
    assert fmt.name == name
    assert (format_by_suffix(str(path)) is None) == (fmt.told_by is not None)
    contents = fmt.read(str(path))
    assert isinstance(contents, Contents) and contents.tensors
    assert contents.files[0] == str(path) or name.endswith("-sharded")
    assert all(Path(f).is_file() for f in contents.files)
    checkpoint = open_checkpoint(str(path))
    assert checkpoint.format == name and checkpoint.files == list(contents.files)
    stored = set(contents.tensors) | set(contents.aliases)
    assert set(checkpoint.table.names()) >= set(contents.tensors) and stored <= set(checkpoint.table.names())
    for tensor in list(contents.tensors.values())[:3]:  # lazy: data is read only on request
        assert tensor.read().shape == tensor.spec.shape


def test_the_readers_give_what_each_format_holds(tmp_path):
    st = format_named("safetensors").read(str(sample("safetensors", tmp_path)))
    assert st.metadata == {"format": "pt"} and st.provenance_text is None
    np.testing.assert_array_equal(st.tensors["a.weight"].read(), ARRAYS["a.weight"])
    npz = format_named("npz").read(str(sample("npz", tmp_path)))
    assert npz.metadata == {"format": "pt"}
    np.testing.assert_array_equal(npz.tensors["b.bias"].read(), ARRAYS["b.bias"])
    tied = format_named("pytorch").read(str(sample("pytorch", tmp_path)))
    assert tied.aliases == {"head.weight": "embed.weight"} and tied.state_dict_key is None
    sharded = format_named("pytorch-sharded").read(str(sample("pytorch-sharded", tmp_path)))
    assert len(sharded.files) == 2 and sharded.provenance_text is None


def test_a_pytorch_file_is_told_by_its_content_under_any_name(tmp_path):
    for name in ("weights.pth.tar", "weights", "weights.model"):
        path = Path(shutil.copy(FIXTURES / "torch" / "tied.pt", tmp_path / name))
        assert format_of(str(path)).name == "pytorch" and takes_key(str(path))
        assert open_checkpoint(str(path)).format == "pytorch"
    disguised = Path(shutil.copy(sample("safetensors", tmp_path), tmp_path / "weights.model"))
    assert format_of(str(disguised)).name == "pytorch"  # by content: its reader says what it is instead
    assert not takes_key(str(disguised))
    with pytest.raises(CheckpointError, match="a safetensors file, by its header"):
        open_checkpoint(str(disguised))


@pytest.mark.parametrize("name", [n for n in NAMES if n != "pytorch"])
def test_key_is_refused_for_every_row_that_does_not_take_it(tmp_path, name):
    path = sample(name, tmp_path)
    assert not takes_key(str(path))
    with pytest.raises(CheckpointError, match="key selects a state dict inside a PyTorch file"):
        open_checkpoint(str(path), key="model")


# the picking order of a folder, most preferred first
PREFERENCE = [("safetensors-sharded", "model.safetensors.index.json"), ("safetensors", "model.safetensors"),
              ("npz", "model.npz"), ("pytorch-sharded", "pytorch_model.bin.index.json"),
              ("pytorch", "pytorch_model.bin")]


def test_a_folder_is_read_through_the_rows_in_preference_order(tmp_path):
    assert [f.name for f in sorted((f for f in FORMATS if f.folder_rank is not None),
                                   key=lambda f: f.folder_rank)] == [n for n, _ in PREFERENCE]
    for _, file_name in PREFERENCE:
        (tmp_path / file_name).write_bytes(b"")  # picking looks at names only
    (tmp_path / "model.onnx").write_bytes(b"")  # never picked in a folder
    (tmp_path / "model.params").write_bytes(b"")
    for name, file_name in PREFERENCE:
        path, fmt = pick_in_folder(str(tmp_path))
        assert (Path(path).name, fmt.name) == (file_name, name)
        (tmp_path / file_name).unlink()
    with pytest.raises(CheckpointError) as refused:
        pick_in_folder(str(tmp_path))
    assert str(refused.value) == (f"{tmp_path}: holds no .safetensors, .safetensors.index.json, .npz, PyTorch "
                                  "(.pt, .pth, .bin, .ckpt, *.bin.index.json) file")


def test_two_files_of_the_preferred_rank_ask_which_to_read(tmp_path):
    for name in ("a.pt", "b.ckpt", "model.npz", "model.npz.txt"):
        (tmp_path / name).write_bytes(b"")
    assert pick_in_folder(str(tmp_path))[1].name == "npz"
    (tmp_path / "model.npz").unlink()
    with pytest.raises(CheckpointError, match=r": holds a.pt, b.ckpt; name the one to read instead of the folder$"):
        pick_in_folder(str(tmp_path))


def _write(fmt, out: Path, contents: Contents, shards: int) -> None:
    entries = [(n, t.spec) for n, t in contents.tensors.items()]
    cut = [entries[k::shards] for k in range(shards)]
    writer = fmt.output.open(str(out), cut, lambda _: {"format": "pt"}, {"note": "round trip"})
    for shard in cut:
        for name, _ in shard:
            writer.write(name, contents.tensors[name].read())
    writer.close()


@pytest.mark.parametrize("name", [f.name for f in FORMATS if f.output is not None])
def test_every_row_with_a_writer_reads_back_what_it_wrote(tmp_path, name):
    fmt = format_named(name)
    source = format_named("safetensors").read(str(sample("safetensors", tmp_path)))
    out = tmp_path / ("out" if fmt.output.folder else f"out{fmt.suffixes[0]}")
    assert output_format(str(out)) is fmt
    _write(fmt, out, source, shards=2 if fmt.output.folder else 1)
    written = out / "model.safetensors.index.json" if fmt.output.folder else out
    assert format_of(str(written)) is fmt
    back = fmt.read(str(written))
    assert back.metadata == {"format": "pt", **({} if fmt.output.folder else {"note": "round trip"})}
    assert set(back.tensors) == set(source.tensors)
    for tensor_name, tensor in source.tensors.items():
        assert back.tensors[tensor_name].spec == tensor.spec
        np.testing.assert_array_equal(back.tensors[tensor_name].read(), tensor.read())
    assert open_checkpoint(str(written)).format == name


def test_an_output_path_is_written_by_the_row_its_suffix_names(tmp_path):
    assert [output_kind(p) for p in ("o.safetensors", "o.npz", "out", "out.d/", "o.tensors", "o.pt", "o.pth",
                                     "pytorch_model.bin", "o.ckpt", "m-0000.params", "o.nd")] == \
        ["safetensors", "npz", "folder", "folder", "folder", "pytorch", "pytorch", "pytorch", "pytorch", "mxnet",
         "mxnet"]
    for suffix in (".onnx", ".json", ".pkl", ".h5", ".gguf", ".zip", ".PT", ".Safetensors", ".NPZ"):
        with pytest.raises(OutputError) as refused:
            output_kind(f"o{suffix}")
        assert str(refused.value) == (f"o{suffix}: fusectl writes .safetensors, .npz, .pt, .pth, .bin, .ckpt, .params, "
                                      f".nd or a folder, not {suffix}; choose OUT.safetensors, OUT.npz, OUT.pt, "
                                      "OUT.params or a folder name")


def test_weight_files_are_every_rows_and_the_formats_fusectl_does_not_read():
    assert set(WEIGHT_SUFFIXES) == {".safetensors", ".safetensors.index.json", ".bin.index.json", ".pt", ".pth",
                                    ".bin", ".ckpt", ".npz", ".onnx", ".onnx_data", ".msgpack", ".h5", ".params", ".nd", ".distcp"}


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported, at the module's top level) for every import in ``path``, absolute."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ["fusectl", "io"][: 3 - node.level] if node.level else []
            found.append((".".join([*base, node.module or ""]).strip("."), id(node) in top))
    return found


def test_io_imports_nothing_from_onnx_or_verification_and_onnx_libraries_only_lazily():
    modules = sorted(IO.glob("*.py"))
    assert len(modules) > 10
    for module in modules:
        for name, top_level in _imports(module):
            assert not name.startswith(("fusectl.onnx", "fusectl.verification")), (module.name, name)
            assert not (top_level and name.split(".")[0] in ("onnx", "onnx_ir", "onnxruntime")), (module.name, name)


def test_opening_a_safetensors_file_loads_neither_torch_nor_onnx_readers(tmp_path):
    path = sample("safetensors", tmp_path)
    code = ("import sys; from fusectl.io.checkpoint import open_checkpoint; open_checkpoint(sys.argv[1]); "
            "print(sorted(m for m in ('onnx', 'onnx_ir', 'fusectl.io.formats.torch_file', 'fusectl.io.formats.onnx_file') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                          cwd=IO.parent.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
