"""Readers and writers: safetensors (header reader, streaming writer, shards) and npz.

Files written by fusectl are checked with the ``safetensors`` package's own reader and with an
independent hand parser (conftest.parse_safetensors), never only with fusectl's reader.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from hypothesis import given, settings, strategies as st

from conftest import load_checkpoint_raw, ok, parse_safetensors
from fusectl.dtypes import ARRAY_DTYPES, BY_NAME
from fusectl.errors import CheckpointError
from fusectl.io.formats.npz_file import NpzWriter, read_npz
from fusectl.io.output import plan_shards
from fusectl.io.formats.safetensors_file import SafetensorsWriter, header_bytes, read_header
from fusectl.tensors import TensorSpec

# safetensors' own dtype list (the Rust crate's Dtype enum, as its error message spells it)
SAFETENSORS_DTYPES = {
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
    "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64",
    "F64", "I64", "U64",
}
# dtypes numpy + safetensors.numpy can materialize (fp8 types are not numpy attributes)
NUMPY_LOADABLE = {"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "F16", "BF16", "F32", "F64", "C64"}


def sample(dtype_name: str, shape, seed: int = 0) -> np.ndarray:
    """Deterministic data with every byte pattern mixed in (NaN payloads included for floats)."""
    dtype = BY_NAME[dtype_name].numpy
    n = int(np.prod(shape)) if shape else 1
    raw = np.random.default_rng(seed).integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8)
    if dtype_name == "BOOL":
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def write_with_fusectl(path, arrays: dict[str, np.ndarray], metadata=None):
    entries = [(n, TensorSpec(_dtype_of(a), a.shape)) for n, a in arrays.items()]
    writer = SafetensorsWriter(str(path), entries, metadata or {})
    for n, a in arrays.items():
        writer.write(n, a)
    writer.close()
    return path


def _dtype_of(array: np.ndarray):
    from fusectl.dtypes import from_numpy

    return from_numpy(array.dtype, "test")


# --------------------------------------------------------------------------- safetensors writer


@pytest.mark.parametrize("dtype_name", sorted(ARRAY_DTYPES))
def test_every_dtype_round_trips_through_writer_and_reader(tmp_path, dtype_name):
    arrays = {
        "a.weight": sample(dtype_name, (3, 5), seed=1),
        "scalar": sample(dtype_name, (), seed=2),
        "empty": sample(dtype_name, (0, 4), seed=3),
        "b.bias": sample(dtype_name, (7,), seed=4),
    }
    path = write_with_fusectl(tmp_path / "x.safetensors", arrays, {"k": "v"})
    tensors, meta = read_header(str(path))
    assert meta == {"k": "v"}
    assert list(tensors) == list(arrays)
    for name, array in arrays.items():
        t = tensors[name]
        assert str(t.spec.dtype) == dtype_name
        assert t.spec.shape == array.shape
        got = t.read()
        assert got.dtype == array.dtype
        assert got.tobytes() == array.tobytes(), name
    # the independent parser agrees byte for byte
    by_hand, meta2 = parse_safetensors(path)
    assert meta2 == {"k": "v"}
    for name, array in arrays.items():
        assert by_hand[name] == (dtype_name, list(array.shape), array.tobytes())


@pytest.mark.parametrize("dtype_name", sorted(ARRAY_DTYPES))
def test_every_written_dtype_is_a_safetensors_dtype(tmp_path, dtype_name):
    """A file fusectl writes must open in the safetensors package, whatever its dtype."""
    path = write_with_fusectl(tmp_path / "x.safetensors", {"t": sample(dtype_name, (2, 2))})
    with safetensors.safe_open(str(path), framework="numpy") as f:
        assert f.get_slice("t").get_dtype() == dtype_name
        assert f.get_slice("t").get_shape() == [2, 2]


@pytest.mark.parametrize("dtype_name", sorted(NUMPY_LOADABLE))
def test_safetensors_numpy_loads_writer_output(tmp_path, dtype_name):
    arrays = {"x": sample(dtype_name, (4, 3), 5), "y": sample(dtype_name, (2,), 6)}
    path = write_with_fusectl(tmp_path / "x.safetensors", arrays, {"format": "pt"})
    loaded = safetensors.numpy.load_file(str(path))
    for name, array in arrays.items():
        assert loaded[name].dtype == array.dtype
        assert loaded[name].tobytes() == array.tobytes()
    with safetensors.safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}


def test_reader_reads_files_written_by_safetensors(tmp_path):
    arrays = {
        "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
        "bf16": np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16),
        "i64": np.array([-1, 2**40], dtype=np.int64),
        "f16": np.ones((2, 2), np.float16),
    }
    path = tmp_path / "ref.safetensors"
    safetensors.numpy.save_file(arrays, str(path), metadata={"format": "np"})
    tensors, meta = read_header(str(path))
    assert meta == {"format": "np"}
    assert sorted(tensors) == sorted(arrays)
    for name, array in arrays.items():
        assert tensors[name].read().tobytes() == array.tobytes()
        assert tensors[name].spec.shape == array.shape


@pytest.mark.parametrize("meta", [{}, {"a": "b"}, {"format": "pt", "x" * 13: "y" * 5}])
@pytest.mark.parametrize("names", [["a"], ["abc", "de"], ["model.layers.0.q", "zz" * 9]])
def test_header_is_8_byte_aligned(tmp_path, meta, names):
    arrays = {n: np.ones(3, np.float32) for n in names}
    path = write_with_fusectl(tmp_path / "x.safetensors", arrays, meta)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert n % 8 == 0
    assert (8 + n) % 8 == 0
    header = json.loads(data[8 : 8 + n])  # padding must keep it valid JSON
    assert header.get("__metadata__", {}) == meta
    raw = header_bytes([(k, TensorSpec(BY_NAME["F32"], (3,))) for k in names], meta)
    assert len(raw) % 8 == 0


def test_tensors_are_contiguous_and_fill_the_file(tmp_path):
    arrays = {"b": sample("F16", (3,)), "a": sample("F64", (5,)), "c": sample("U8", (7,))}
    path = write_with_fusectl(tmp_path / "x.safetensors", arrays)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    spans = sorted(tuple(e["data_offsets"]) for k, e in header.items() if k != "__metadata__")
    assert spans[0][0] == 0
    for (b0, e0), (b1, e1) in zip(spans, spans[1:]):
        assert e0 == b1
    assert spans[-1][1] == len(data) - 8 - n


def test_writer_copies_byte_ranges_from_another_file(tmp_path):
    src_arrays = {"x": sample("BF16", (4, 8), 1), "y": sample("I32", (5,), 2)}
    src = write_with_fusectl(tmp_path / "src.safetensors", src_arrays)
    tensors, _ = read_header(str(src))
    entries = [("y2", tensors["y"].spec), ("x2", tensors["x"].spec), ("z", TensorSpec(BY_NAME["U8"], (3,)))]
    dst = tmp_path / "dst.safetensors"
    writer = SafetensorsWriter(str(dst), entries, {})
    writer.write("y2", tensors["y"].byte_ranges())
    writer.write("x2", tensors["x"].byte_ranges())
    writer.write("z", np.array([1, 2, 3], np.uint8))
    writer.close()
    got, _ = parse_safetensors(dst)
    assert got["x2"] == ("BF16", [4, 8], src_arrays["x"].tobytes())
    assert got["y2"] == ("I32", [5], src_arrays["y"].tobytes())
    assert got["z"][2] == b"\x01\x02\x03"


def test_writer_concatenates_split_ranges(tmp_path):
    """Two ranges of one file written as one tensor (how a zero-copy concat writes)."""
    a, b = sample("F32", (2, 3), 1), sample("F32", (1, 3), 2)
    src = write_with_fusectl(tmp_path / "src.safetensors", {"a": a, "b": b})
    tensors, _ = read_header(str(src))
    dst = tmp_path / "dst.safetensors"
    writer = SafetensorsWriter(str(dst), [("ab", TensorSpec(BY_NAME["F32"], (3, 3)))], {})
    writer.write("ab", tensors["a"].byte_ranges() + tensors["b"].byte_ranges())
    writer.close()
    np.testing.assert_array_equal(safetensors.numpy.load_file(str(dst))["ab"], np.concatenate([a, b]))


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(sorted(ARRAY_DTYPES)),
            st.lists(st.integers(0, 5), min_size=0, max_size=3),
        ),
        min_size=1,
        max_size=6,
    ),
    st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8), max_size=3),
)
def test_writer_reader_property(tmp_path_factory, items, meta):
    path = tmp_path_factory.mktemp("prop") / "x.safetensors"
    arrays = {f"t{k}.{d.lower()}": sample(d, tuple(shape), k) for k, (d, shape) in enumerate(items)}
    write_with_fusectl(path, arrays, meta)
    tensors, got_meta = read_header(str(path))
    assert got_meta == meta
    for name, array in arrays.items():
        assert tensors[name].read().tobytes() == array.tobytes()
        assert tensors[name].spec.shape == array.shape


# ------------------------------------------------------------------------------ header reader


@pytest.mark.parametrize(
    "blob, needle",
    [
        (b"", "too short"),
        (b"\x00" * 5, "too short"),
        (struct.pack("<Q", 500) + b"{}", "past the end"),
        (struct.pack("<Q", 4) + b"nope", "JSON"),
        (struct.pack("<Q", 2) + b"[]", "object"),
    ],
)
def test_read_header_rejects_corrupt_files(tmp_path, blob, needle):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    with pytest.raises(CheckpointError) as info:
        read_header(str(path))
    assert needle in str(info.value)
    assert "bad.safetensors" in str(info.value)


@pytest.mark.parametrize(
    "entry, needle",
    [
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}, "needs 8 bytes"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 800]}, "outside"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, "data_offsets"),
        ({"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}, "shape"),
        ({"dtype": "F32", "shape": [2]}, "data_offsets"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "extra": 1}, "exactly"),
        ({"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}, "X9"),
    ],
)
def test_read_header_validates_entries(tmp_path, entry, needle):
    raw = json.dumps({"w\x1bname": entry}).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 16)
    with pytest.raises(CheckpointError) as info:
        read_header(str(path))
    message = str(info.value)
    assert needle in message
    assert "\x1b" not in message, "names read from a file must be escaped"


def test_read_header_metadata_must_be_strings(tmp_path):
    raw = json.dumps({"__metadata__": {"a": 1}}).encode()
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(CheckpointError):
        read_header(str(path))


@pytest.mark.parametrize("dtype, shape, nbytes", [("F4", [4], 2), ("F6_E2M3", [4], 3), ("F6_E3M2", [8], 6)])
def test_sub_byte_safetensors_dtypes_are_read(tmp_path, dtype, shape, nbytes):
    """SPEC §2: every safetensors dtype. F4/F6 pack several elements per byte."""
    raw = json.dumps({"w": {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}}).encode()
    raw += b" " * (-len(raw) % 8)
    path = tmp_path / "sub.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\x11" * nbytes)
    with safetensors.safe_open(str(path), framework="numpy") as f:  # the reference accepts it
        assert f.get_slice("w").get_dtype() == dtype
    tensors, _ = read_header(str(path))
    assert tensors["w"].spec.nbytes == nbytes


# ---------------------------------------------------------------------------------- sharding


@pytest.mark.parametrize("max_size", [1, 50, 100, 101, 250, 10_000])
def test_plan_shards_respects_max_size(max_size):
    sizes = [40, 60, 10, 120, 30, 30, 30, 5]
    entries = [(f"t{k}", TensorSpec(BY_NAME["U8"], (s,))) for k, s in enumerate(sizes)]
    shards = plan_shards(entries, max_size)
    assert [n for shard in shards for n, _ in shard] == [n for n, _ in entries], "order kept"
    for shard in shards:
        assert shard, "no empty shard"
        total = sum(s.nbytes for _, s in shard)
        assert total <= max_size or len(shard) == 1
    # greedy: a shard is closed only when the next tensor would not fit
    for a, b in zip(shards, shards[1:]):
        assert sum(s.nbytes for _, s in a) + b[0][1].nbytes > max_size


def _table_from_file(path):
    from fusectl.table import ParamTable

    tensors, meta = read_header(str(path))
    return ParamTable.from_stored(tensors), meta


@pytest.mark.parametrize("max_size", [64, 300, 1000, 10**9])
def test_folder_output_shards_under_max_size(tmp_path, max_size):
    from fusectl.write import write_table
    from fusectl.steps import Plan

    arrays = {f"layer.{k}.w": sample("F32", (k + 1, 16), k) for k in range(8)}  # 64..512 bytes
    src = write_with_fusectl(tmp_path / "src.safetensors", arrays)
    table, _ = _table_from_file(src)
    out = tmp_path / "out"
    write_table(table, Plan(), str(out), inputs=[str(src)], passthrough={"format": "pt"},
                max_shard_size=max_size)
    files = sorted(os.listdir(out))
    shards = [f for f in files if f.endswith(".safetensors")]
    if max_size >= sum(a.nbytes for a in arrays.values()):
        assert shards == ["model.safetensors"]
        assert "model.safetensors.index.json" not in files
    else:
        assert len(shards) > 1
        assert all(f"-of-{len(shards):05d}.safetensors" in s for s in shards)
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(arrays)
        assert index["metadata"]["total_size"] == sum(a.nbytes for a in arrays.values())
        for shard in shards:
            tensors, meta = parse_safetensors(out / shard)
            assert meta["format"] == "pt"
            size = sum(len(r) for _, _, r in tensors.values())
            assert size <= max_size or len(tensors) == 1
            for name in tensors:
                assert index["weight_map"][name] == shard
    got = load_checkpoint_raw(out)
    for name, array in arrays.items():
        assert got[name][2] == array.tobytes()
    # each shard opens with safetensors itself
    for shard in shards:
        safetensors.numpy.load_file(str(out / shard))


# --------------------------------------------------------------------------------------- npz


NPZ_DTYPES = sorted(ARRAY_DTYPES)


def _write_npz(path, arrays, metadata=None):
    entries = [(n, TensorSpec(_dtype_of(a), a.shape)) for n, a in arrays.items()]
    writer = NpzWriter(str(path), entries, metadata or {})
    for n, a in arrays.items():
        writer.write(n, a)
    writer.close()


@pytest.mark.parametrize("dtype_name", NPZ_DTYPES)
def test_npz_round_trip_every_dtype(tmp_path, dtype_name):
    arrays = {"a.w": sample(dtype_name, (3, 4), 1), "b": sample(dtype_name, (5,), 2), "s": sample(dtype_name, (), 3)}
    path = tmp_path / "x.npz"
    _write_npz(path, arrays, {"fusectl": "{}", "format": "pt"})
    contents = read_npz(str(path))
    tensors, meta = contents.tensors, contents.metadata
    assert meta == {"fusectl": "{}", "format": "pt"} and contents.provenance_text == "{}"
    assert sorted(tensors) == sorted(arrays)
    for name, array in arrays.items():
        t = tensors[name]
        assert str(t.spec.dtype) == dtype_name
        assert t.spec.shape == array.shape
        got = t.read()
        assert got.dtype == array.dtype
        assert got.tobytes() == array.tobytes()


def test_npz_native_dtypes_load_with_numpy(tmp_path):
    arrays = {"f32": sample("F32", (2, 3)), "i8": sample("I8", (4,)), "bf16": sample("BF16", (2, 2))}
    path = tmp_path / "x.npz"
    _write_npz(path, arrays)
    with np.load(path, allow_pickle=False) as z:
        assert z["f32"].tobytes() == arrays["f32"].tobytes()
        assert z["i8"].dtype == np.int8
        # extension dtypes are stored as same-width uints with the real dtype recorded
        assert z["bf16"].dtype.itemsize == 2
        assert z["bf16"].tobytes() == arrays["bf16"].tobytes()


def test_npz_written_by_numpy_is_read(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3))
    np.savez(tmp_path / "plain.npz", a=a, b=b)
    np.savez_compressed(tmp_path / "packed.npz", a=a, b=b)
    for name in ("plain.npz", "packed.npz"):
        contents = read_npz(str(tmp_path / name))
        tensors, meta = contents.tensors, contents.metadata
        assert meta == {} and contents.provenance_text is None
        np.testing.assert_array_equal(tensors["a"].read(), a)
        np.testing.assert_array_equal(tensors["b"].read(), b)


def test_npz_uncompressed_members_are_zero_copy_ranges(tmp_path):
    arrays = {"w": sample("F32", (8, 8))}
    _write_npz(tmp_path / "x.npz", arrays)
    tensors = read_npz(str(tmp_path / "x.npz")).tensors
    ranges = tensors["w"].byte_ranges()
    assert ranges is not None
    (r,) = ranges
    with open(r.path, "rb") as f:
        f.seek(r.offset)
        assert f.read(r.length) == arrays["w"].tobytes()


def test_npz_from_fusectl_to_safetensors_via_cli(cli, tmp_path):
    """bf16 and fp8 survive safetensors → npz → safetensors through the CLI, byte for byte."""
    arrays = {
        "bf16": sample("BF16", (4, 4), 1),
        "e4m3": sample("F8_E4M3", (3, 5), 2),
        "e5m2": sample("F8_E5M2", (6,), 3),
        "f32": sample("F32", (2, 2), 4),
    }
    src = write_with_fusectl(tmp_path / "src.safetensors", arrays)
    rules = tmp_path / "r.toml"
    rules.write_text('version = 1\n[[rule]]\nop = "rename"\ninput = "f32"\noutput = "f32.renamed"\n')
    npz = tmp_path / "x.npz"
    ok(cli("fuse", src, "-r", rules, "-o", npz))
    report = ok(cli("inspect", npz, "--json")).json()
    assert {p["name"]: p["dtype"] for p in report["parameters"]} == {
        "bf16": "BF16", "e4m3": "F8_E4M3", "e5m2": "F8_E5M2", "f32.renamed": "F32",
    }
    back = tmp_path / "back.safetensors"
    ok(cli("unfuse", npz, "-o", back))
    got, _ = parse_safetensors(back)
    want, _ = parse_safetensors(src)
    assert got == want


def test_npz_member_that_is_not_an_array_is_refused(tmp_path):
    path = tmp_path / "x.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("readme.txt", "hi")
    with pytest.raises(CheckpointError) as info:
        read_npz(str(path))
    assert "readme.txt" in str(info.value)


def test_writer_invariants_are_real_errors_not_asserts(tmp_path):
    """They hold under python -O too: a bug in the order of writes is an InternalError (exit 70)."""
    from fusectl import dtypes
    from fusectl.errors import InternalError
    from fusectl.io.formats.safetensors_file import SafetensorsWriter
    from fusectl.tensors import TensorSpec

    spec = TensorSpec(dtypes.BY_NAME["F32"], (2,))
    writer = SafetensorsWriter(str(tmp_path / "w.safetensors"), [("a", spec), ("b", spec)], {})
    with pytest.raises(InternalError, match="expected 'a' next, got 'b'"):
        writer.write("b", np.zeros(2, np.float32))
    writer = SafetensorsWriter(str(tmp_path / "x.safetensors"), [("a", spec)], {})
    with pytest.raises(InternalError, match="arrived as float64"):
        writer.write("a", np.zeros(2, np.float64))
    writer = SafetensorsWriter(str(tmp_path / "y.safetensors"), [("a", spec)], {})
    with pytest.raises(InternalError, match="never written"):
        writer.close()


def test_nothing_stays_cached_when_some_outputs_of_a_step_are_copied_and_others_computed(tmp_path, monkeypatch):
    """split, then transpose one part: the other part is written as a byte range and never
    asks for the split's arrays, so counting it as a use kept them cached until the write
    ended (memory growing with the checkpoint)."""
    import fusectl.write as write
    from conftest import run_cli, write_rules, write_safetensors

    made = []

    class Recording(write.Evaluation):
        def __init__(self, roots):
            super().__init__(roots)
            made.append(self)

    monkeypatch.setattr(write, "Evaluation", Recording)
    src = tmp_path / "w.safetensors"
    write_safetensors(src, {f"l{i}.w": np.arange(64, dtype=np.float32).reshape(8, 8) + i for i in range(3)})
    rules = write_rules(tmp_path / "r.toml", """
version = 1
[[rule]]
op = "split"
input = "l{i:int}.w"
outputs = ["l{i:int}.a", "l{i:int}.b"]
[[rule]]
op = "transpose"
input = "l{i:int}.a"
output = "l{i:int}.at"
""")
    out = tmp_path / "out.safetensors"
    result = run_cli("fuse", src, "-r", rules, "-o", out, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["copied_bytes"] == 3 * 4 * 32  # the b parts, as ranges
    (materializer,) = made
    assert materializer.cached() == 0
    back = safetensors.numpy.load_file(str(out))
    np.testing.assert_array_equal(back["l1.at"], (np.arange(64, dtype=np.float32).reshape(8, 8) + 1)[:4].T)
    np.testing.assert_array_equal(back["l2.b"], (np.arange(64, dtype=np.float32).reshape(8, 8) + 2)[4:])
