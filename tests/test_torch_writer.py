"""io/formats/torch_writer: torch.save zip archives written without torch.

Read back three ways: fusectl's reader (io/formats/torch_file), an independent loader here (zipfile and
pickle with stand-ins for torch's globals: the tree exactly as pickled), and — where torch is
installed — ``torch.load(weights_only=True)``, byte-compared with ``torch.save`` of the same object.
"""

from __future__ import annotations

import collections
import json
import pickle
import subprocess
import sys
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from conftest import OWN_PEAK_KB, load_checkpoint_raw, ok, run_cli, write_safetensors
from fusectl import dtypes
from fusectl.errors import CheckpointError, InternalError, OutputError
from fusectl.io.checkpoint import open_checkpoint
from fusectl.io.registry import format_named, output_kind
from fusectl.io.formats.safetensors_file import read_safetensors
from fusectl.io.formats.torch_file import METADATA_RECORD, Records, read_pytorch, read_torch, read_torch_tree
from fusectl.io.formats.torch_writer import TorchWriter, _Pickler, crc_of_ranges, write_torch_file
from fusectl.tensors import ArrayTensor, ByteRange, FileTensor, LazyTensor, TensorSpec

WRITTEN = [d for d in dtypes.ARRAY_DTYPES.values()]
RNG = np.random.default_rng(20)


def tensor(dtype: str, shape: tuple[int, ...]) -> ArrayTensor:
    spec = TensorSpec(dtypes.BY_NAME[dtype], shape)
    raw = RNG.integers(0, 256, spec.nbytes, dtype=np.uint8)
    if dtype == "BOOL":
        raw &= 1
    return ArrayTensor(spec, raw.view(spec.dtype.numpy).reshape(shape))


# ------------------------------------------------------------------------------- an independent loader


class _Storage:
    def __init__(self, data: bytes):
        self.data = data


class _Loaded:
    """A tensor as the pickle rebuilds it: its storage record and its view."""

    def __init__(self, storage, offset, size, stride, dtype):
        self.storage, self.offset, self.size, self.stride, self.dtype = storage, offset, size, stride, dtype

    def array(self) -> np.ndarray:
        """The tensor's data: fusectl writes whole contiguous storages (checked here)."""
        expected, step = [], 1
        for n in reversed(self.size):
            expected.insert(0, step)
            step *= max(n, 1)
        assert self.offset == 0 and tuple(self.stride) == tuple(expected)
        flat = np.frombuffer(self.storage.data, self.dtype)
        assert flat.size == int(np.prod(self.size))
        return flat.reshape(self.size).copy()


TORCH_NUMPY = {"float8_e4m3fn": dtypes.BY_NAME["F8_E4M3"].numpy, "float8_e5m2": dtypes.BY_NAME["F8_E5M2"].numpy,
               "float8_e4m3fnuz": dtypes.BY_NAME["F8_E4M3FNUZ"].numpy, "float8_e8m0fnu": dtypes.BY_NAME["F8_E8M0"].numpy,
               "float8_e5m2fnuz": dtypes.BY_NAME["F8_E5M2FNUZ"].numpy, "uint16": np.uint16, "uint32": np.uint32,
               "uint64": np.uint64}
STORAGE_NUMPY = {"FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
                 "BFloat16Storage": dtypes.BY_NAME["BF16"].numpy, "LongStorage": np.int64, "IntStorage": np.int32,
                 "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
                 "ComplexFloatStorage": np.complex64}


def load_tree(path):
    """The pickled tree of a torch.save zip, tensors as :class:`_Loaded`, without torch or fusectl."""
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        prefix = names[0].split("/")[0]
        assert zf.read(f"{prefix}/byteorder") == b"little"
        records = {n[len(prefix) + 6:]: zf.read(n) for n in names if n.startswith(f"{prefix}/data/")}
        data = zf.read(f"{prefix}/data.pkl")
    assert data[:2] == b"\x80\x02"
    storages: dict[str, tuple] = {}

    class Loader(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) == ("collections", "OrderedDict"):
                return collections.OrderedDict
            if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
                return lambda s, o, size, stride, grad, hooks: _Loaded(s[0], o, size, stride, s[1])
            if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):
                return lambda s, o, size, stride, grad, hooks, dtype: _Loaded(s[0], o, size, stride, dtype)
            if module == "torch" and name in STORAGE_NUMPY:
                return ("typed", name)
            if module == "torch" and name in TORCH_NUMPY:
                return TORCH_NUMPY[name]
            if (module, name) == ("torch.storage", "UntypedStorage"):
                return ("untyped", name)
            raise AssertionError(f"unexpected global {module}.{name}")

        def persistent_load(self, pid):
            kind, cls, key, location, numel = pid
            assert kind == "storage" and location == "cpu"
            dtype = np.dtype(STORAGE_NUMPY[cls[1]] if cls[0] == "typed" else np.uint8)
            assert len(records[key]) == numel * dtype.itemsize
            if key not in storages:
                storages[key] = (_Storage(records[key]), dtype)
            return storages[key]

    return Loader(__import__("io").BytesIO(data)).load()


def plain(tree):
    """The tree with tensors as (dtype name, shape, bytes), for comparison."""
    if isinstance(tree, _Loaded):
        array = tree.array()
        return ("tensor", str(array.dtype), array.shape, array.tobytes())
    if isinstance(tree, LazyTensor):
        array = tree.read()
        return ("tensor", str(array.dtype), array.shape, array.tobytes())
    if isinstance(tree, dict):
        return (type(tree).__name__, [(k, plain(v)) for k, v in tree.items()])
    if isinstance(tree, (list, tuple)):
        return (type(tree).__name__, [plain(v) for v in tree])
    return (type(tree).__name__, tree)


# ------------------------------------------------------------------------------- without torch


@pytest.mark.parametrize("dtype", [d.safetensors for d in WRITTEN])
def test_every_dtype_round_trips_through_the_reader(tmp_path, dtype):
    state = {"w": tensor(dtype, (3, 5)), "s": tensor(dtype, ()), "e": tensor(dtype, (2, 0, 3))}
    out = tmp_path / "m.pt"
    write_torch_file(str(out), state)
    back = read_torch(str(out))
    assert list(back.tensors) == ["w", "s", "e"] and back.aliases == {}
    for name, t in state.items():
        assert back.tensors[name].spec == t.spec
        assert back.tensors[name].read().tobytes() == t.read().tobytes()
        assert isinstance(back.tensors[name], FileTensor)  # stored, aligned, little-endian: one file range
    assert plain(load_tree(out)) == plain(state)


def test_storage_records_are_stored_and_aligned_to_64_bytes(tmp_path):
    out = tmp_path / "m.pt"
    write_torch_file(str(out), {f"t{k}": tensor("F32", (k + 1,)) for k in range(12)})
    with zipfile.ZipFile(out) as zf:
        assert zf.testzip() is None  # every CRC right
        infos = zf.infolist()
        names = [i.filename for i in infos]
        raw = out.read_bytes()
        for info in infos:
            assert info.compress_type == zipfile.ZIP_STORED
            name_len, extra_len = np.frombuffer(raw[info.header_offset + 26:info.header_offset + 30], "<u2")
            assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0
    assert names == ["m/data.pkl", "m/.format_version", "m/.storage_alignment", "m/byteorder",
                     *[f"m/data/{k}" for k in range(12)], "m/version", "m/.data/serialization_id"]
    with zipfile.ZipFile(out) as zf:
        assert zf.read("m/version") == b"3\n" and zf.read("m/byteorder") == b"little"
        assert len(zf.read("m/.data/serialization_id")) == 40


def test_nested_trees_are_pickled_as_they_are(tmp_path):
    w, b = tensor("F32", (4, 2)), tensor("BF16", (4,))
    tree = {
        "model": collections.OrderedDict([("w", w), ("b", b)]),
        "optimizer": {"state": {0: {"step": tensor("F32", ()), "exp_avg": tensor("F32", (4, 2))}, 1: {}},
                      "param_groups": [{"lr": 1e-3, "params": [0, 1], "betas": (0.9, 0.999), "amsgrad": False,
                                        "foreach": None, "name": "décay", "big": 2**70, "neg": -5,
                                        "mid": 70000, "wide": (1, 2, 3, 4)}]},
        "epoch": 3, "empty": ([], {}, ()), "one": [1], "loss": float("inf"),
    }
    out = tmp_path / "train.pt"
    write_torch_file(str(out), tree)
    assert plain(load_tree(out)) == plain(tree)
    assert read_torch(str(out)).key == "model"


def test_the_same_tensor_twice_is_one_storage_and_one_object(tmp_path):
    w = tensor("F16", (3, 3))
    out = tmp_path / "tied.pt"
    write_torch_file(str(out), collections.OrderedDict([("embed", w), ("head", w), ("other", tensor("F16", (3, 3)))]))
    with zipfile.ZipFile(out) as zf:
        assert sorted(n for n in zf.namelist() if "/data/" in n) == ["tied/data/0", "tied/data/1"]
    loaded = load_tree(out)
    assert loaded["embed"] is loaded["head"] and loaded["other"] is not loaded["embed"]
    assert read_torch(str(out)).aliases == {"head": "embed"}


@dataclass(frozen=True, eq=False)
class _Strided(LazyTensor):
    """A source whose data comes as it is given: a non-contiguous or big-endian array."""

    spec: TensorSpec
    array: np.ndarray

    def read(self):
        return self.array


@dataclass(frozen=True, eq=False)
class _Ranges(LazyTensor):
    """A source of several byte ranges, never read (its bytes are copied)."""

    spec: TensorSpec
    ranges: tuple[ByteRange, ...]

    def byte_ranges(self):
        return self.ranges

    def read(self):
        pytest.fail("read instead of copied")


@dataclass(frozen=True, eq=False)
class _Broken(LazyTensor):
    spec: TensorSpec

    def read(self):
        raise OSError("the source went away")


def test_non_contiguous_and_big_endian_sources_are_written_contiguous_and_little_endian(tmp_path):
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    big = np.arange(6, dtype=">i4").reshape(2, 3)
    out = tmp_path / "m.pt"
    write_torch_file(str(out), {"t": _Strided(TensorSpec(dtypes.BY_NAME["F32"], (4, 3)), base.T),
                                "b": _Strided(TensorSpec(dtypes.BY_NAME["I32"], (2, 3)), big)})
    back = read_torch(str(out))
    np.testing.assert_array_equal(back.tensors["t"].read(), base.T)
    assert back.tensors["b"].read().dtype == np.dtype("<i4")
    np.testing.assert_array_equal(back.tensors["b"].read(), big)
    with zipfile.ZipFile(out) as zf:
        assert zf.read("m/data/1") == np.arange(6, dtype="<i4").tobytes()


def test_byte_ranges_are_copied_from_their_files(tmp_path):
    src = tmp_path / "a.safetensors"
    write_safetensors(src, {"x": np.arange(10, dtype=np.float32), "y": np.arange(6, dtype=np.int64)})
    read = read_safetensors(str(src)).tensors
    x = read["x"].location
    two = _Ranges(TensorSpec(dtypes.BY_NAME["F32"], (2, 2)),  # two ranges, from two places
                  (ByteRange(x.path, x.offset + 24, 8), ByteRange(x.path, x.offset, 8)))
    done = []
    out = tmp_path / "m.pt"
    write_torch_file(str(out), {"x": read["x"], "y": read["y"], "two": two}, on_progress=done.append)
    assert done == [40, 48, 16]
    back = read_torch(str(out)).tensors
    np.testing.assert_array_equal(back["x"].read(), np.arange(10, dtype=np.float32))
    np.testing.assert_array_equal(back["y"].read(), np.arange(6, dtype=np.int64))
    np.testing.assert_array_equal(back["two"].read(), np.array([[6, 7], [0, 1]], np.float32))


@pytest.mark.parametrize("root, needle", [
    ({"a": [1, range(2)]}, "the object['a'][1] is a range"),
    ({"a": (1, bytearray(b"x"))}, "the object['a'][1] is a bytearray"),
    ({"a": np.float32(1)}, "the object['a'] is a float32"),
    ({(1, 2): 3}, "the object has a key '(1, 2)' of type tuple"),
    ({"q": {"w": tensor("U8", (4,))}, "f4": {"w": FileTensor(TensorSpec(dtypes.BY_NAME["F4"], (4,)),
                                                               ByteRange("x", 0, 2))}},
     "the object['f4']['w'] is a F4[4] tensor; PyTorch has no F4 dtype"),
])
def test_what_torch_cannot_hold_is_refused_before_anything_is_written(tmp_path, root, needle):
    out = tmp_path / "m.pt"
    with pytest.raises(OutputError) as refused:
        write_torch_file(str(out), root)
    assert str(refused.value).startswith(f"{out}: ") and needle in str(refused.value)
    assert not out.exists()


@pytest.mark.parametrize("value", [{1, 2}, frozenset({"x"}), set(), 1 + 2j, b"a\xffb", [b"x", b"y"],
                                   {"tags": {(1, 2), "t"}, "z": [1j, 1j]}])
def test_sets_complex_numbers_and_bytes_are_pickled_as_python_pickles_them(tmp_path, value):
    # what the reader's allow-list reads (a container written whole keeps such entries)
    assert _Pickler("m.pt").dump(value) == pickle.dumps(value, protocol=2)
    out = tmp_path / "m.pt"
    write_torch_file(str(out), {"w": tensor("F32", (2,)), "value": value})
    assert read_torch_tree(str(out))[0]["value"] == value


def test_records_are_pickled_as_python_pickles_the_objects_they_stand_for(tmp_path):
    # a format's own classes (DeepSpeed's loss scaler, its stage enum) read as records and
    # written back: an object made by NEWOBJ with its state (BUILD), an enum called with its value
    import argparse
    import http
    records = Records(("argparse.Namespace", "http.HTTPStatus"))
    namespace = records.classes["argparse.Namespace"]()
    namespace.__setstate__({"lr": 0.1, "betas": (0.9, 0.999)})
    status = records.classes["http.HTTPStatus"](200)
    for record, real in ((namespace, argparse.Namespace(lr=0.1, betas=(0.9, 0.999))), (status, http.HTTPStatus.OK)):
        assert _Pickler("m.pt").dump(record) == pickle.dumps(real, protocol=2)
    out = tmp_path / "m.pt"
    write_torch_file(str(out), {"args": namespace, "status": status, "again": namespace})
    back = read_torch_tree(str(out), records=records)[0]
    assert back["again"] is back["args"]  # one object, memoized
    assert (back["args"].name, back["args"].args, back["args"].state) == \
        ("argparse.Namespace", (), {"lr": 0.1, "betas": (0.9, 0.999)})
    assert (back["status"].name, back["status"].args, back["status"].state) == ("http.HTTPStatus", (200,), None)


def test_a_folder_that_does_not_exist_is_an_output_error(tmp_path):
    with pytest.raises(OutputError, match="cannot be written"):
        write_torch_file(str(tmp_path / "no" / "m.pt"), {})


def test_the_state_dict_writer_keeps_ties_and_metadata(tmp_path):
    a, b = tensor("F32", (2, 2)), tensor("I64", (3,))
    out = tmp_path / "model.pt"
    metadata = {"format": "pt", "lm_head.weight": "embed.weight", "fusectl": "{}"}
    writer = TorchWriter(str(out), [("embed.weight", a.spec), ("b", b.spec)], metadata)
    with pytest.raises(InternalError, match="expected 'embed.weight' next"):
        writer.write("b", b.read())
    writer = TorchWriter(str(out), [("embed.weight", a.spec), ("b", b.spec)], metadata)
    writer.write("embed.weight", a.read())
    writer.write("b", b.read())
    writer.close()
    tree = load_tree(out)
    assert type(tree) is collections.OrderedDict and list(tree) == ["embed.weight", "lm_head.weight", "b"]
    assert tree["lm_head.weight"] is not tree["embed.weight"]  # two tensors, as a state dict holds them
    assert tree["lm_head.weight"].storage is tree["embed.weight"].storage  # on one storage
    contents = read_pytorch(str(out))
    assert contents.aliases == {"lm_head.weight": "embed.weight"}
    assert contents.metadata == metadata and contents.provenance_text == "{}"
    with zipfile.ZipFile(out) as zf:
        assert json.loads(zf.read(f"model/{METADATA_RECORD}")) == metadata


def test_a_metadata_record_that_is_not_strings_is_refused(tmp_path):
    from fusectl.errors import CheckpointError

    out = tmp_path / "m.pt"
    write_torch_file(str(out), {"w": tensor("F32", (2,))}, metadata={"fusectl": "x"})
    with zipfile.ZipFile(out) as zf:
        records = {i.filename: zf.read(i) for i in zf.infolist()}
    records[f"m/{METADATA_RECORD}"] = b'{"fusectl": 3}'
    with zipfile.ZipFile(out, "w") as zf:
        for name, data in records.items():
            zf.writestr(name, data)
    with pytest.raises(CheckpointError, match="must map strings to strings"):
        read_pytorch(str(out))


def test_pt_outputs_are_the_pytorch_row():
    assert [output_kind(p) for p in ("m.pt", "pytorch_model.bin", "m.pth", "m.ckpt")] == ["pytorch"] * 4
    assert format_named("pytorch").output is not None


def test_convert_safetensors_to_pt_and_back_is_bitwise(cli, copy_fixture, tmp_path):
    src = copy_fixture("tiny-llama-gqa")
    for name in ("model.pt", "pytorch_model.bin"):
        pt, back = tmp_path / name, tmp_path / f"back-{name}.safetensors"
        ok(cli("convert", src, "-o", pt, "--quiet"))
        ok(cli("convert", pt, "-o", back, "--quiet"))
        assert load_checkpoint_raw(back) == load_checkpoint_raw(src)
        assert open_checkpoint(str(pt)).format == "pytorch"


def test_fuse_to_pt_then_unfuse_restores_the_source(cli, copy_fixture, tmp_path):
    src = copy_fixture("tiny-llama-gqa")
    fused, back = tmp_path / "fused.pt", tmp_path / "back"
    ok(cli("fuse", src, "-r", "llama-qkv", "-o", fused, "--quiet"))
    assert any(k.endswith("qkv_proj.weight") for k in read_torch(str(fused)).tensors)
    ok(cli("unfuse", fused, "-o", back, "--quiet"))
    assert load_checkpoint_raw(back) == load_checkpoint_raw(src)


_MEASURE = f"""
import sys
from fusectl.io.formats.safetensors_file import read_safetensors
from fusectl.io.formats.torch_writer import write_torch_file
write_torch_file(sys.argv[2], dict(read_safetensors(sys.argv[1]).tensors))
print({OWN_PEAK_KB})
"""


def test_peak_memory_does_not_grow_with_the_checkpoint(tmp_path):
    peaks = []
    for mb in (8, 256):
        src = tmp_path / f"{mb}.safetensors"
        header = json.dumps({"w": {"dtype": "F32", "shape": [mb << 18], "data_offsets": [0, mb << 20]}}).encode()
        with open(src, "wb") as f:
            f.write(len(header).to_bytes(8, "little") + header)
            f.truncate(8 + len(header) + (mb << 20))  # sparse: zeros
        done = subprocess.run([sys.executable, "-c", _MEASURE, str(src), str(tmp_path / f"{mb}.pt")],
                              capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent)
        assert done.returncode == 0, done.stderr
        peaks.append(int(done.stdout) * 1024)  # kilobytes on Linux
        assert (tmp_path / f"{mb}.pt").stat().st_size > mb << 20
    assert peaks[1] - peaks[0] < 32 << 20, peaks


# ------------------------------------------------------------------------------- with torch


def _torch():
    return pytest.importorskip("torch")


def _as_torch(torch, tree, made=None):
    """The tree with torch tensors (one per tensor object: a tensor met twice is one)."""
    made = {} if made is None else made
    if isinstance(tree, LazyTensor):
        if id(tree) not in made:
            bits = _as_torch_bits(torch, tree)
            out = torch.empty(tuple(bits.shape), dtype=bits.dtype)  # contiguous strides, as torch makes them
            made[id(tree)] = out.copy_(bits)
        return made[id(tree)]
    if isinstance(tree, dict):
        return type(tree)((k, _as_torch(torch, v, made)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return type(tree)(_as_torch(torch, v, made) for v in tree)
    return tree


def _as_torch_bits(torch, tree):
    if True:
        array = tree.read()
        name = {v: k for k, v in {**TORCH_NUMPY, "bfloat16": dtypes.BY_NAME["BF16"].numpy}.items()}.get(array.dtype)
        if name is not None:  # numpy cannot hand these to torch: through their bits
            view = torch.from_numpy(array.view(f"u{array.dtype.itemsize}").copy())
            return view.view(getattr(torch, name))
        return torch.from_numpy(np.array(array, order="C"))


def _same(torch, a, b) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert a.reshape(-1).view(torch.uint8).numpy().tobytes() == b.reshape(-1).view(torch.uint8).numpy().tobytes()
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(torch, a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(torch, x, y)
    else:
        assert a == b or (a != a and b != b)


def _torch_dtypes(torch):
    return [d.safetensors for d in WRITTEN if d.safetensors not in ("F8_E5M2FNUZ", "F8_E4M3FNUZ")
            or hasattr(torch, "float8_e4m3fnuz")]


def _compare_with_torch_save(torch, tmp_path, tree):
    """Ours and torch.save's of the same tree: torch.load gives the same objects, and the files
    are byte for byte the same but for the serialization id (torch's is random)."""
    ours, theirs = tmp_path / "a" / "m.pt", tmp_path / "b" / "m.pt"
    ours.parent.mkdir(exist_ok=True)
    theirs.parent.mkdir(exist_ok=True)
    write_torch_file(str(ours), tree)
    torch.save(_as_torch(torch, tree), str(theirs))
    _same(torch, torch.load(str(ours), weights_only=True), torch.load(str(theirs), weights_only=True))
    _same(torch, torch.load(str(ours), weights_only=True, mmap=True), _as_torch(torch, tree))
    with zipfile.ZipFile(ours) as a, zipfile.ZipFile(theirs) as b:
        our_id, their_id = a.read("m/.data/serialization_id"), b.read("m/.data/serialization_id")
        our_crc, their_crc = a.getinfo("m/.data/serialization_id").CRC, b.getinfo("m/.data/serialization_id").CRC
    patched = theirs.read_bytes().replace(their_id, our_id).replace(their_crc.to_bytes(4, "little"),
                                                                    our_crc.to_bytes(4, "little"))
    assert patched == ours.read_bytes()


def test_torch_load_reads_every_dtype_as_torch_save_writes_it(tmp_path):
    torch = _torch()
    tree = collections.OrderedDict()
    for k, name in enumerate(_torch_dtypes(torch)):
        tree[f"{name}.w"] = tensor(name, (2, 3))
        tree[f"{name}.s"] = tensor(name, ())
        tree[f"{name}.e"] = tensor(name, (2, 0, 3))
    _compare_with_torch_save(torch, tmp_path, tree)


def test_torch_load_of_an_optimizer_like_dict_is_what_torch_save_gives(tmp_path):
    torch = _torch()
    w, b = tensor("F32", (4, 2)), tensor("F32", (4,))
    tree = {
        "model": collections.OrderedDict([("w", w), ("b", b), ("tied", w)]),
        "optimizer": {"state": {0: {"step": tensor("F32", ()), "exp_avg": tensor("F32", (4, 2)),
                                    "exp_avg_sq": tensor("F32", (4, 2))},
                                1: {"step": tensor("F32", ()), "exp_avg": tensor("F32", (4,)),
                                    "exp_avg_sq": tensor("F32", (4,))}},
                      "param_groups": [{"lr": 1e-3, "params": [0, 1], "betas": (0.9, 0.999), "eps": 1e-8,
                                        "weight_decay": 0.01, "amsgrad": False, "foreach": None,
                                        "maximize": False, "capturable": False, "differentiable": False,
                                        "fused": None, "decoupled_weight_decay": True}]},
        "epoch": 3, "global_step": 70000, "best": -1.5, "big": 2**80, "neg": -(2**40), "note": "ünï",
        "nested": [(1, 2, 3, 4), [[]], {5: (None,)}], "single": collections.OrderedDict([("x", 1)]),
    }
    _compare_with_torch_save(torch, tmp_path, tree)
    loaded = torch.load(str(tmp_path / "a" / "m.pt"), weights_only=True)
    assert loaded["model"]["w"] is loaded["model"]["tied"]
    assert loaded["model"]["w"].data_ptr() == loaded["model"]["tied"].data_ptr()
    assert loaded["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    model = torch.nn.Linear(2, 4)
    opt = torch.optim.AdamW(model.parameters())
    opt.load_state_dict(loaded["optimizer"])  # what the training code does with it
    assert torch.equal(opt.state[model.weight]["exp_avg"], _as_torch(torch, tree["optimizer"]["state"][0]["exp_avg"]))


@pytest.mark.parametrize("count", [999, 1000, 1001, 2000])
def test_long_dicts_and_lists_are_batched_as_torch_save_batches_them(tmp_path, count):
    torch = _torch()
    tree = {"d": {f"k{k}": k for k in range(count)}, "o": collections.OrderedDict((k, k) for k in range(count)),
            "l": list(range(count)), "t": [tensor("I8", (1,)) for _ in range(12)]}
    _compare_with_torch_save(torch, tmp_path, tree)


def test_a_fused_pt_output_loads_in_torch_with_ties_shared(cli, copy_fixture, tmp_path):
    torch = _torch()
    src = copy_fixture("tiny-llama-gqa")
    out = tmp_path / "fused.pt"
    ok(cli("fuse", src, "-r", "llama-qkv", "-o", out, "--quiet"))
    state = torch.load(str(out), weights_only=True)
    assert type(state) is collections.OrderedDict
    for name, t in read_torch(str(out)).tensors.items():
        assert torch.equal(state[name], _as_torch(torch, t))


def test_zip64_fields_are_read_by_zipfile_by_fusectl_and_by_torch(tmp_path, monkeypatch):
    """Past 4 GiB a record's sizes and offset go in zip64 fields; with the limit lowered, every
    record but the first few takes that path here."""
    from fusectl.io.formats import torch_writer

    monkeypatch.setattr(torch_writer, "_ZIP64_AT", 200)
    tree = {"big": tensor("F32", (100,)), "small": tensor("I8", (3,)), "empty": tensor("F16", (0,))}
    out = tmp_path / "m.pt"
    write_torch_file(str(out), tree, metadata={"fusectl": "x"})
    with zipfile.ZipFile(out) as zf:
        assert zf.testzip() is None
        assert zf.getinfo("m/data/0").file_size == 400
    back = read_pytorch(str(out))
    assert back.provenance_text == "x"
    for name, t in tree.items():
        assert back.tensors[name].read().tobytes() == t.read().tobytes()
    assert plain(load_tree(out)) == plain(tree)
    try:
        import torch
    except ImportError:
        return
    _same(torch, torch.load(str(out), weights_only=True), _as_torch(torch, tree))


def test_a_failure_while_writing_leaves_no_file_and_a_packed_state_dict_is_refused_unopened(tmp_path):
    out = tmp_path / "m.pt"
    with pytest.raises(OSError, match="went away"):
        write_torch_file(str(out), {"ok": tensor("F32", (2,)), "broken": _Broken(TensorSpec(dtypes.BY_NAME["F32"], (2,)))})
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OutputError, match=r"the object\['w'\] is a F6_E2M3\[4\] tensor; PyTorch has no F6_E2M3"):
        TorchWriter(str(out), [("w", TensorSpec(dtypes.BY_NAME["F6_E2M3"], (4,)))], {})
    assert list(tmp_path.iterdir()) == []


def test_records_copied_from_file_ranges_carry_the_crc_of_their_bytes(tmp_path):
    # the bytes are copied by the kernel while their CRC-32 is read off the source on a thread:
    # zipfile checks every record's CRC against the bytes it reads back
    source = tmp_path / "source.safetensors"
    rng = np.random.default_rng(3)
    arrays = {"a": rng.standard_normal((300, 70)).astype(np.float32), "b": rng.integers(0, 9, 1001).astype(np.int64)}
    write_safetensors(source, arrays)
    out = tmp_path / "out.pt"
    ok(run_cli("convert", source, "-o", out))
    with zipfile.ZipFile(out) as archive:
        assert archive.testzip() is None
        data = sorted(n for n in archive.namelist() if "/data/" in n)
        assert len(data) == 2
    back = read_pytorch(str(out))
    for name, array in arrays.items():
        assert np.array_equal(back.tensors[name].read(), array)


def test_the_crc_of_a_range_past_the_end_of_its_file_is_a_clean_error(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    buffer = memoryview(bytearray(32))
    assert crc_of_ranges((ByteRange(str(path), 10, 50),), buffer) == zlib.crc32(b"x" * 50)
    with pytest.raises(CheckpointError, match="ended early"):
        crc_of_ranges((ByteRange(str(path), 90, 50),), buffer)


def test_a_source_changed_while_its_record_is_copied_is_a_clean_error_and_nothing_is_written(tmp_path, monkeypatch):
    # the bytes and their CRC are read separately: a source that changes in between is refused
    import fusectl.io.formats.torch_writer as torch_writer

    source = tmp_path / "source.safetensors"
    write_safetensors(source, {"a": np.arange(4096, dtype=np.float32)})
    copy = torch_writer.copy_ranges

    def copy_then_touch(ranges, *args, **kwargs):
        copy(ranges, *args, **kwargs)
        with open(source, "ab") as f:
            f.write(b"more")

    monkeypatch.setattr(torch_writer, "copy_ranges", copy_then_touch)
    out = tmp_path / "out.pt"
    result = run_cli("convert", source, "-o", out)
    assert result.exit_code == 2 and "changed while fusectl was reading it" in result.stderr
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["source.safetensors"]


def test_a_bare_pickle_holds_records_as_keys_and_dtype_globals_and_no_tensor():
    """``pickle_tree``: what a DCP ``.metadata`` holds — records as dict keys, ``torch.<dtype>``
    globals — as ``pickle`` itself would write it; a tensor is refused (a bare pickle has no
    storage to keep it in)."""
    from fusectl.io.formats.torch_file import dtype_global, dtype_of, global_name, read_pickle
    from fusectl.io.formats.torch_writer import pickle_tree
    records = Records(("pkg.Index",))
    key = records.classes["pkg.Index"]()
    key.state = {"fqn": "w"}
    data = pickle_tree({key: [dtype_global(dtypes.BY_NAME["BF16"]), 3]}, "meta")
    assert b"ctorch\nbfloat16\n" in data and b"cpkg\nIndex\n" in data
    (back_key, value), = read_pickle(data, "meta", records).items()
    assert back_key.state == {"fqn": "w"} and dtype_of(value[0]) == dtypes.BY_NAME["BF16"] and value[1] == 3
    assert global_name(value[0]) == "torch.bfloat16" and global_name(3) is None and dtype_of(key) is None
    with pytest.raises(OutputError, match="meta: holds a tensor"):
        pickle_tree({"w": tensor("F32", (2,))}, "meta")
