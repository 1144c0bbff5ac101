"""MXNet NDArray files (fusectl.io.formats.mxnet_params) against what real MXNet 1.9.1 wrote and read:
fixtures/mxnet/ (fixtures/generate_mxnet.py) holds the files and, in mxnet.json and arrays.npz,
mx.nd.load's names, dtypes, shapes and bytes for each, and its verdict on broken files
(hostile/verdicts.json). No MXNet is needed here."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from conftest import FIXTURES, leftovers, ok, run_cli, snapshot
from fusectl import dtypes
from fusectl.errors import CheckpointError, OutputError
from fusectl.io.checkpoint import open_checkpoint
from fusectl.io.registry import format_of, takes_key
from fusectl.io.formats.mxnet_params import METADATA_MAGIC, MXNetWriter, read_mxnet, record_header
from fusectl.tensors import FileTensor, TensorSpec

MX = FIXTURES / "mxnet"
SEEN = json.loads((MX / "mxnet.json").read_text())["files"]
ARRAYS = np.load(MX / "arrays.npz")
VERDICTS = json.loads((MX / "hostile" / "verdicts.json").read_text())
# MXNet's dtype names → fusectl's
DTYPE = {"float32": "F32", "float64": "F64", "float16": "F16", "uint8": "U8", "int32": "I32", "int8": "I8",
         "int64": "I64", "bool": "BOOL", "bfloat16": "BF16"}
READ = sorted(rel for rel, seen in SEEN.items() if "refused" not in seen
              and all(a["stype"] == "default" for a in seen["arrays"]))
# files whose records MXNet 1.9.1 reads but no longer writes (V1, pre-V1): written again as V2
OLD_RECORDS = {"raw/v1.nd"}


def mxnet_view(rel: str) -> list[tuple[str, str, list[int], bytes]]:
    """(name, fusectl dtype, shape, bytes) of every array, as mx.nd.load gave them."""
    seen = SEEN[rel]
    names = seen["names"] if seen["names"] is not None else [str(k) for k in range(len(seen["arrays"]))]
    out = []
    for k, (name, array) in enumerate(zip(names, seen["arrays"])):
        data = ARRAYS[f"{rel.replace('/', '__')}__{k}"]
        out.append((name, DTYPE[array["dtype"]], array["shape"], data.tobytes()))
    return out


def our_view(path: Path) -> list[tuple[str, str, list[int], bytes]]:
    contents = read_mxnet(str(path))
    return [(n, t.spec.dtype.safetensors, list(t.spec.shape), t.read().tobytes()) for n, t in contents.tensors.items()]


def test_the_fixtures_cover_what_the_issue_asks_for():
    assert {"lstm/lstm.params", "lstm/lstm-0000.params", "gru/gru.params", "gru/gru-0000.params",
            "lstm-proj/proj.params", "fused-cell/lstm-0000.params", "conv-bn/bn-noscale.params",
            "conv-bn/bn-scale-0000.params", "attention/attention-0000.params", "tied/tied.params",
            "tied/tied-0000.params", "prefixed/prefixed-unique.params", "raw/list.nd", "raw/numpy-shape.nd",
            "raw/v1.nd", "raw/sparse.nd", "raw/none.nd"} <= set(SEEN)
    assert {DTYPE[a["dtype"]] for a in SEEN["raw/dtypes.nd"]["arrays"]} == set(DTYPE.values())
    assert sum(p.stat().st_size for p in MX.rglob("*") if p.is_file()) < 1_200_000


@pytest.mark.parametrize("rel", READ)
def test_the_reader_gives_what_mx_nd_load_gave_bitwise(rel):
    assert our_view(MX / rel) == mxnet_view(rel)


@pytest.mark.parametrize("rel", READ)
def test_inspect_reports_mxnets_names_dtypes_and_shapes(rel):
    report = json.loads(ok(run_cli("inspect", "--json", MX / rel)).stdout)
    assert report["format"] == "mxnet"
    stored = {p["name"]: (p["dtype"], p["shape"]) for p in report["parameters"] if p["name"] == p["unique"]}
    assert stored == {name: (dtype, shape) for name, dtype, shape, _ in mxnet_view(rel)}


def test_every_tensor_is_a_byte_range_of_the_file_at_any_offset():
    contents = read_mxnet(str(MX / "raw" / "dtypes.nd"))
    offsets = [t.location.offset for t in contents.tensors.values()]
    assert all(isinstance(t, FileTensor) for t in contents.tensors.values())
    assert any(o % 8 for o in offsets)  # unaligned: MXNet pads nothing
    assert contents.tensors["bf16"].spec.dtype.numpy == np.dtype(ml_dtypes.bfloat16)


def test_old_and_numpy_shape_records_read_as_mxnet_reads_them():
    v1 = dict((n, (d, s)) for n, d, s, _ in our_view(MX / "raw" / "v1.nd"))
    assert v1 == {"v1": ("F32", [2, 3]), "pre_v1": ("F32", [2, 3]), "pre_v1_int64": ("I64", [3])}
    v3 = read_mxnet(str(MX / "raw" / "numpy-shape.nd")).tensors
    assert v3["scalar"].spec.shape == () and v3["scalar"].read().item() == 3.5
    assert v3["empty"].spec.shape == (0, 3) and v3["empty"].spec.nbytes == 0
    assert read_mxnet(str(MX / "raw" / "empty.nd")).tensors["empty"].spec.shape == (2, 0)


def test_a_list_without_names_is_named_by_position():
    assert SEEN["raw/list.nd"]["names"] is None
    assert list(read_mxnet(str(MX / "raw" / "list.nd")).tensors) == ["0", "1"]


@pytest.mark.parametrize("rel, name, storage", [("raw/sparse.nd", "rows", "row_sparse"),
                                                ("raw/none.nd", "nothing", "none array")])
def test_sparse_and_none_arrays_are_refused_naming_the_array(rel, name, storage):
    result = run_cli("inspect", MX / rel)
    assert result.exit_code == 2 and result.stderr.startswith("error: ")
    assert f"array '{name}'" in result.stderr and storage in result.stderr and rel.split("/")[1] in result.stderr


def test_a_file_without_a_suffix_is_told_by_the_list_magic(tmp_path):
    for name in ("weights", "weights.pt", "model-0000"):
        path = Path(shutil.copy(MX / "raw" / "small.nd", tmp_path / name))
        assert format_of(str(path)).name == "mxnet" and not takes_key(str(path))
        assert open_checkpoint(str(path)).format == "mxnet"
    assert format_of(str(tmp_path / "x.params")).name == "mxnet"  # by suffix, unread


def test_a_folder_is_not_searched_for_params_files(tmp_path):
    shutil.copy(MX / "prefixed" / "prefixed.params", tmp_path / "model.params")
    with pytest.raises(CheckpointError, match="holds no .safetensors"):
        open_checkpoint(str(tmp_path))


# ------------------------------------------------------------------------------ the writer


def write(path: Path, tensors: dict[str, np.ndarray | tuple], metadata=None, specs=None) -> Path:
    specs = specs or {n: TensorSpec(dtypes.from_numpy(a.dtype, n), a.shape) for n, a in tensors.items()}
    writer = MXNetWriter(str(path), list(specs.items()), metadata or {})
    for name, data in tensors.items():
        writer.write(name, data)
    writer.close()
    return path


@pytest.mark.parametrize("rel", READ)
def test_the_writer_writes_mxnets_bytes_and_reads_back_bitwise(tmp_path, rel):
    contents = read_mxnet(str(MX / rel))
    specs = {n: t.spec for n, t in contents.tensors.items()}
    from_ranges = write(tmp_path / "ranges.nd", {n: t.byte_ranges() for n, t in contents.tensors.items()}, specs=specs)
    from_arrays = write(tmp_path / "arrays.nd", {n: t.read() for n, t in contents.tensors.items()}, specs=specs)
    assert from_ranges.read_bytes() == from_arrays.read_bytes()
    if rel not in OLD_RECORDS:
        assert from_ranges.read_bytes() == (MX / rel).read_bytes()
    assert our_view(from_ranges) == mxnet_view(rel)


def test_metadata_goes_after_the_names_and_comes_back(tmp_path):
    arrays = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    plain = write(tmp_path / "plain.params", arrays)
    kept = write(tmp_path / "kept.params", arrays, {"fusectl": "{}", "note": "é"})
    assert kept.read_bytes().startswith(plain.read_bytes())
    assert kept.read_bytes()[len(plain.read_bytes()):].startswith(METADATA_MAGIC)
    contents = read_mxnet(str(kept))
    assert contents.metadata == {"fusectl": "{}", "note": "é"} and contents.provenance_text == "{}"


def test_a_0d_tensor_makes_the_numpy_shape_form(tmp_path):
    path = write(tmp_path / "s.nd", {"s": np.array(2.5, np.float32), "v": np.ones(2, np.float16)})
    assert struct.unpack_from("<I", path.read_bytes(), 24)[0] == 0xF993FACA
    assert [(n, s) for n, _, s, _ in our_view(path)] == [("s", []), ("v", [2])]
    assert record_header(TensorSpec(dtypes.BY_NAME["F32"], ()), True)[:4] == struct.pack("<I", 0xF993FACA)


@pytest.mark.parametrize("dtype", ["U16", "U32", "U64", "I16", "C64", "F8_E4M3"])
def test_a_dtype_mxnet_cannot_hold_is_refused_before_writing(tmp_path, dtype):
    spec = TensorSpec(dtypes.BY_NAME[dtype], (2,))
    with pytest.raises(OutputError, match=f"tensor 'w' is {dtype}, which MXNet's NDArray files cannot hold"):
        MXNetWriter(str(tmp_path / "x.params"), [("w", spec)], {})
    assert not (tmp_path / "x.params").exists()


def test_fuse_to_params_and_unfuse_from_its_provenance_is_bitwise(tmp_path):
    rules = tmp_path / "cells.toml"
    rules.write_text('version = 1\n[[rule]]\nname = "cells"\nop = "concat"\n'
                     'inputs = ["_unfused.{l}.{d}_cell.i2h_weight", "_unfused.{l}.{d}_cell.h2h_weight"]\n'
                     'output = "_unfused.{l}.{d}_cell.weight"\naxis = 1\n')
    fused, back = tmp_path / "fused.params", tmp_path / "back.params"
    ok(run_cli("fuse", MX / "lstm" / "lstm.params", "-r", rules, "-o", fused, "--quiet"))
    assert read_mxnet(str(fused)).tensors["_unfused.1.r_cell.weight"].spec.shape == (16, 12)
    ok(run_cli("unfuse", fused, "-o", back, "--quiet"))
    assert sorted(our_view(back)) == sorted(mxnet_view("lstm/lstm.params"))
    ok(run_cli("convert", MX / "lstm" / "lstm.params", "-o", tmp_path / "same.params", "--quiet"))
    assert read_mxnet(str(tmp_path / "same.params")).metadata  # the provenance, after the names


# ------------------------------------------------------------------------------ broken files


# what fusectl refuses though mx.nd.load reads it, and the reason it gives
REFUSED_ON_PURPOSE = {"trailing-bytes": "bytes follow the names", "names-duplicate": "two arrays are named 'a'"}


@pytest.mark.parametrize("case", sorted(VERDICTS))
def test_a_broken_file_is_refused_where_mxnet_refuses_it(tmp_path, case):
    src = tmp_path / "in"
    src.mkdir()
    path = Path(shutil.copy(MX / "hostile" / f"{case}.nd", src / f"{case}.nd"))
    before = snapshot(src)
    verdict = VERDICTS[case]
    out = tmp_path / "out.safetensors"
    result = run_cli("convert", path, "-o", out, "--quiet")
    assert "Traceback" not in result.output and "escaped exception" not in result.stderr, result.stderr
    assert snapshot(src) == before
    if isinstance(verdict, str) or case in REFUSED_ON_PURPOSE:
        assert verdict.startswith("refused: ") if isinstance(verdict, str) else True
        assert result.exit_code == 2, f"mx.nd.load: {verdict}\nfusectl: {result.stdout}"
        first = result.stderr.splitlines()[0]
        assert first.startswith("error: ") and f"{case}.nd" in first and len(result.stderr.splitlines()) == 1
        assert REFUSED_ON_PURPOSE.get(case, "") in first
        assert not out.exists() and leftovers(tmp_path) == []
    else:
        ok(result)
        ours = [[n, t.spec.dtype.safetensors, list(t.spec.shape)] for n, t in read_mxnet(str(path)).tensors.items()]
        assert ours == [[n, DTYPE[d], s] for n, d, s, _ in verdict]


@pytest.mark.parametrize("limit, value, needle", [("FUSECTL_MAX_TENSORS", "1", "arrays"),
                                                  ("FUSECTL_MAX_DIMS", "1", "dimensions"),
                                                  ("FUSECTL_MAX_NAME_BYTES", "3", "name")])
def test_every_size_from_the_file_is_budgeted(monkeypatch, limit, value, needle):
    monkeypatch.setenv(limit, value)
    path = MX / "raw" / ("unicode.nd" if "NAME" in limit else "small.nd")
    with pytest.raises(CheckpointError, match=limit):
        read_mxnet(str(path))


def _file(records: bytes, count: int, names: bytes = struct.pack("<Q", 0)) -> bytes:
    return struct.pack("<QQQ", 0x112, 0, count) + records + names


@pytest.mark.parametrize("data, needle", [
    (_file(struct.pack("<I", 0xF993FAC9) + struct.pack("<ii", 1, 1) + struct.pack("<q", 2) + struct.pack("<i", 1)
           + struct.pack("<i", 2) + struct.pack("<q", 2) + struct.pack("<iii", 1, 0, 8), 1), "index array 0"),
    (_file(struct.pack("<I", 0xF993FACA) + struct.pack("<i", 1) + struct.pack("<i", 1) + struct.pack("<q", 2), 1),
     "numpy-shape record of row_sparse"),
    (_file(struct.pack("<I", 0xF993FAC9) + struct.pack("<ii", 0, 1) + struct.pack("<q", 2**40)
           + struct.pack("<iii", 1, 0, 0), 1), "past the end of the file"),
    (_file(struct.pack("<I", 70), 1), "no record magic"),
    (_file(b"", 0, struct.pack("<Q", 0) + METADATA_MAGIC + struct.pack("<Q", 99) + b"{}"), "metadata says 99"),
    (_file(b"", 0, struct.pack("<Q", 0) + METADATA_MAGIC + struct.pack("<Q", 2) + b"[]"), "map strings to strings"),
], ids=["sparse-index-type", "sparse-numpy-shape", "data-past-the-end", "no-magic", "metadata-length",
        "metadata-not-strings"])
def test_malformed_records_are_refused_saying_what(tmp_path, data, needle):
    path = tmp_path / "bad.params"
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match="bad.params") as refused:
        read_mxnet(str(path))
    assert needle in str(refused.value)


def test_an_empty_array_of_absurd_dims_is_refused(tmp_path):
    record = (struct.pack("<I", 0xF993FAC9) + struct.pack("<ii", 0, 3) + struct.pack("<3q", 0, 2**62, 2**62)
              + struct.pack("<iii", 1, 0, 0))
    path = tmp_path / "wide.nd"
    path.write_bytes(_file(record, 1))
    with pytest.raises(CheckpointError, match=r"wide.nd: array 0 \(of 1\) is F32\[0, 4611686018427387904, "):
        read_mxnet(str(path))
