"""Hostile inputs to the readers: safetensors headers the safetensors library rejects, JSON
nested or numbered to exhaust the parser, edited provenances, budgets, FIFOs and devices, and
links that leave an input folder (SPEC §2, §4, §6 "Trust boundary").

Every refusal is checked against the bad-input contract: exit 2, one stderr line beginning
``error:`` that names the file, no traceback or "internal error", no output, input unchanged.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import stat
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.numpy

from conftest import FIXTURES, leftovers, ok, run_cli, time_limit, write_rules, write_safetensors
from fusectl.errors import CheckpointError, OutputError
from fusectl.io.checkpoint import open_checkpoint
from fusectl.io.formats.npz_file import NpzWriter
from fusectl.io.formats.safetensors_file import read_header
from fusectl.tensors import TensorSpec
from fusectl.dtypes import BY_NAME

LLAMA = "tiny-llama-gqa"
SHARDED = "tiny-llama-gqa-bf16-sharded"


# ------------------------------------------------------------------------------------ helpers


def state(root: Path) -> dict[str, str]:
    """Like conftest.snapshot, but never opens a FIFO or device, nor follows a link."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            info = os.lstat(path)
            key = os.path.relpath(path, root)
            if os.path.islink(path):
                out[key] = "link:" + os.readlink(path)
            elif stat.S_ISREG(info.st_mode):
                out[key] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            else:
                out[key] = f"mode:{info.st_mode:o}"
    return out


def assert_refused(result, *needles, inputs: Path | None = None, before: dict | None = None,
                   out: Path | None = None):
    """The bad-input contract, and each needle in the error."""
    where = f"exit {result.exit_code}\n{result.stderr}"
    assert result.exit_code == 2, where
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), where
    assert "Traceback" not in result.output and "internal error" not in result.stderr, where
    assert "[escaped exception" not in result.stderr, where
    for needle in needles:
        assert str(needle) in result.stderr, f"{needle!r} not named in: {result.stderr}"
    if out is not None:
        assert not os.path.lexists(out), f"{out} was written"
        assert leftovers(out.parent) == []
    if inputs is not None:
        assert state(inputs) == before, "the input changed"


def refuse(args, *needles, inputs: Path, out: Path | None = None):
    before = state(inputs)
    with time_limit(20):
        result = run_cli(*args)
    assert_refused(result, *needles, inputs=inputs, before=before, out=out)
    return result


def st_file(path: Path, header_text: str | bytes, data: bytes, length: int | None = None) -> Path:
    raw = header_text.encode() if isinstance(header_text, str) else header_text
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def with_metadata(path: Path, edit) -> Path:
    """Rewrite ``path``'s header with ``edit(metadata)`` applied (the data bytes unchanged)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"] = edit(header["__metadata__"])
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    return path


def npz_with_members(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, payload in members.items():
            zf.writestr(name, payload)
    return path


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, allow_pickle=False)
    return buffer.getvalue()


DEEP = "[" * 100_000 + "1" + "]" * 100_000
HUGE = "9" * 5000


# -------------------------------------------------------- 1. as strict as the safetensors library


def test_a_header_length_one_byte_short_is_refused(tmp_path):
    """The header is padded with spaces, so one byte less still parses: the data section then
    starts a byte early and every tensor would be read shifted (1.0 read as -2.6e-43)."""
    src = tmp_path / "in"
    src.mkdir()
    path = write_safetensors(src / "model.safetensors", {"model.norm.weight": np.ones(4, np.float32)})
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert data[8 + n - 1 : 8 + n] == b" ", "the fixture must be padded for this case"
    path.write_bytes(struct.pack("<Q", n - 1) + data[8:])
    with pytest.raises(Exception):
        safetensors.numpy.load_file(str(path))  # the reference refuses it
    refuse(["inspect", path], "model.safetensors", "follow the header", inputs=src)


def _library_reads(path: Path):
    """name -> (dtype, shape, bytes) as the safetensors library reads the file; None when it refuses."""
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            for key in f.keys():
                f.get_slice(key)
        return {name: (t["dtype"], list(t["shape"]), bytes(t["data"]))
                for name, t in safetensors.deserialize(path.read_bytes())}
    except Exception:
        return None


# the corpus's base file: several dtypes, a zero-size tensor, a packed sub-byte one
_BASE = [
    ("model.embed.weight", "F32", [2, 3]),
    ("model.norm.weight", "F16", [5]),
    ("empty.bias", "I64", [0]),
    ("bytes", "U8", [3]),
    ("half", "BF16", [2, 2]),
    ("packed", "F4", [4]),
    ("wide", "F64", [1]),
]
_MARK = "__mark_{}__"  # replaced in the JSON text by what json.dumps cannot write


def _base_entries() -> tuple[list[list], bytes]:
    entries, offset = [], 0
    for name, dtype, shape in _BASE:
        nbytes = int(np.prod(shape)) * BY_NAME[dtype].bits // 8
        entries.append([name, {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}])
        offset += nbytes
    data = bytes(random.Random(7).randrange(256) for _ in range(offset))
    return entries, data


def _header_text(entries, metadata=None, marks=()) -> str:
    header = {}
    if metadata is not _NO_METADATA:
        header["__metadata__"] = metadata
    for name, entry in entries:
        header[name] = entry
    text = json.dumps(header, ensure_ascii=True)
    for k, literal in enumerate(marks):
        text = text.replace(json.dumps(_MARK.format(k)), literal)
    return text


_NO_METADATA = object()


def _malformed(rng: random.Random) -> tuple[bytes, str]:
    """One mutated safetensors file (bytes) and what was done to it."""
    entries, data = _base_entries()
    metadata: object = {"format": "pt"}
    marks: list[str] = []
    prefix, suffix = "", " " * rng.randrange(0, 9)
    length_delta = 0
    k = rng.randrange(len(entries))
    name, entry = entries[k]
    b, e = entry["data_offsets"]

    def mark(literal: str) -> str:
        marks.append(literal)
        return _MARK.format(len(marks) - 1)

    kind = rng.choice([
        "none", "truncate", "length", "flip", "shift", "gap", "overlap", "trailing", "dtype", "huge-shape",
        "bad-offsets", "bad-shape", "dtype-list", "whitespace", "metadata", "fields", "names", "misaligned",
        "inside", "order", "dims",
    ])
    if kind == "length":
        length_delta = rng.choice([-8, -7, -3, -2, -1, 1, 2, 5, 8])
    elif kind == "shift":
        d = rng.choice([-3, -1, 1, 2, 8])
        entry["data_offsets"] = [b + d, e + d]
    elif kind == "gap":
        del entries[k]
    elif kind == "overlap":
        entry["data_offsets"] = list(entries[rng.randrange(len(entries))][1]["data_offsets"])
    elif kind == "dtype":
        entry["dtype"] = rng.choice(["F33", "", "f32", "I32", "U32", "I16", "BF16", "F8_E4M3", "BOOL", "C64",
                                     "F6_E2M3", "Q4_K", "f32 "])
    elif kind == "huge-shape":
        entry["shape"] = rng.choice([[2**40, 2**40], [2**63], [2**64 - 1], [2**64], [0, 2**64 - 1],
                                     [2**64 - 1, 0], [2**40, 2**40, 0], [10**30], [mark(HUGE)]])
    elif kind == "bad-offsets":
        entry["data_offsets"] = rng.choice([
            [mark("NaN"), e], [b, mark("Infinity")], [-8, e], [float(b), e], [b, float(e)], [True, e],
            [b, [e]], [b, e, e], [b], "0", None, [mark("-0"), e] if b == 0 else [b, mark(f"{e}.0")],
            [b, mark(f"{e}e0")], [b, 10**20],
        ])
    elif kind == "bad-shape":
        entry["shape"] = rng.choice([[-1], [1.5], [True], [mark("-0")], None, "4", [[2]], [mark("2e0")]])
    elif kind == "dtype-list":
        entry["dtype"] = rng.choice([["F32"], [entry["dtype"]], 7, None, {"x": 1}])
    elif kind == "whitespace":
        prefix, suffix = rng.choice([(" ", ""), ("\n", ""), ("", "\n"), ("", "\t"), ("", "\r\n"), ("", "\x00"),
                                     ("\ufeff", ""), ("", "  \n  ")])
    elif kind == "metadata":
        metadata = rng.choice([None, [], {"a": 1}, "s", {"format": {"pt": 1}}, {}, _NO_METADATA, {"k": None}])
    elif kind == "fields":
        choice = rng.randrange(4)
        if choice == 0:
            entry["extra"] = 1
        elif choice == 1:
            del entry[rng.choice(list(entry))]
        elif choice == 2:
            entries[k][1] = {"data_offsets": entry["data_offsets"], "shape": entry["shape"], "dtype": entry["dtype"]}
        else:
            entries[k][1] = rng.choice([[], "x", None, 1])
    elif kind == "names":
        entries[k][0] = rng.choice(["\ud800x", "a\ud83d\ude00", "\x00", "", "\x1b[31m", "a" * 5000, "é", "a[[[[b"])
    elif kind == "misaligned":
        entries.append(["odd", {"dtype": "F4", "shape": [3], "data_offsets": [len(data), len(data) + 1]}])
        data += b"\x00"
    elif kind == "inside":
        entries.append(["zero", {"dtype": "F32", "shape": [0], "data_offsets": [b + 1, b + 1]}])
    elif kind == "order":
        rng.shuffle(entries)
    elif kind == "dims":
        entry["shape"] = entry["shape"] + [1] * rng.choice([1, 40, 70])
    text = prefix + _header_text(entries, metadata, marks) + suffix
    raw = text.encode("utf-8", "surrogatepass")
    blob = struct.pack("<Q", len(raw) + length_delta) + raw + data
    if kind == "truncate":
        blob = blob[: rng.randrange(len(blob))]
    elif kind == "flip":
        blob = bytearray(blob)
        for _ in range(rng.randint(1, 3)):
            blob[8 + rng.randrange(len(raw))] = rng.randrange(256)
        blob = bytes(blob)
    elif kind == "trailing":
        blob += bytes(rng.randint(1, 16))
    return blob, kind


def test_malformed_safetensors_files_agree_with_the_library(tmp_path):
    """A seeded corpus of malformed files: each one the library rejects, fusectl rejects
    (exit 2, an ``error:`` naming the file); each one both accept reads the same, bitwise."""
    rng = random.Random(20240611)
    src = tmp_path / "in"
    src.mkdir()
    path = src / "model.safetensors"
    counts = {"rejected by both": 0, "read alike": 0, "refused by fusectl only": 0}
    for case in range(400):
        blob, kind = _malformed(rng)
        path.write_bytes(blob)
        expected = _library_reads(path)
        result = run_cli("inspect", path)
        where = f"case {case} ({kind}): exit {result.exit_code}\n{result.stderr}"
        assert result.exit_code in (0, 2), where
        assert "internal error" not in result.stderr and "Traceback" not in result.output, where
        if result.exit_code == 2:
            assert result.stderr.startswith("error: ") and "model.safetensors" in result.stderr, where
        if expected is None:
            assert result.exit_code == 2, f"the library rejects it, fusectl read it: {where}"
            counts["rejected by both"] += 1
            continue
        if result.exit_code == 2:
            counts["refused by fusectl only"] += 1
            continue
        tensors, _ = read_header(str(path))
        assert set(tensors) == set(expected), where
        for name, (dtype, shape, raw) in expected.items():
            tensor = tensors[name]
            assert (tensor.spec.dtype.safetensors, list(tensor.spec.shape)) == (dtype, shape), where
            assert tensor.read().tobytes() == raw, f"{name} is read differently: {where}"
        counts["read alike"] += 1
    assert all(counts.values()), counts  # the corpus exercises every outcome


def test_the_unmutated_corpus_base_is_read_like_the_library(tmp_path):
    entries, data = _base_entries()
    path = st_file(tmp_path / "m.safetensors", _header_text(entries, {"format": "pt"}) + "   ", data)
    expected = _library_reads(path)
    tensors, metadata = read_header(str(path))
    assert metadata == {"format": "pt"}
    assert {n: t.read().tobytes() for n, t in tensors.items()} == {n: v[2] for n, v in expected.items()}


@pytest.mark.parametrize("data, needle", [
    (b"\0" * 24, "bytes follow the header"),   # 8 trailing bytes
    (b"\0" * 8, "lie outside"),
])
def test_data_section_must_be_covered_exactly(tmp_path, data, needle):
    header = '{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'
    src = tmp_path / "in"
    src.mkdir()
    path = st_file(src / "m.safetensors", header, data)
    refuse(["inspect", path], "m.safetensors", needle, inputs=src)


def test_a_gap_between_tensors_is_refused(tmp_path):
    header = ('{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},'
              '"b":{"dtype":"U8","shape":[4],"data_offsets":[8,12]}}')
    src = tmp_path / "in"
    src.mkdir()
    path = st_file(src / "m.safetensors", header, b"\1" * 12)
    refuse(["inspect", path], "m.safetensors", "'a'", "'b'", "gap", inputs=src)


def test_zero_size_tensors_and_any_entry_order_are_read(tmp_path):
    """What the library accepts is read: entries in any order, fields in any order, empty tensors."""
    header = ('{"b":{"shape":[2],"dtype":"U8","data_offsets":[2,4]},"e":{"dtype":"F32","shape":[0],'
              '"data_offsets":[2,2]},"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}   ')
    path = st_file(tmp_path / "m.safetensors", header, b"\1\2\3\4")
    assert _library_reads(path) is not None
    tensors, _ = read_header(str(path))
    assert tensors["a"].read().tobytes() == b"\1\2" and tensors["b"].read().tobytes() == b"\3\4"
    assert tensors["e"].spec.shape == (0,)


@pytest.mark.parametrize("header", [
    ' {"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
    '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}\n',
    '{"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}',
    '{"a\\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
    '{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,1]}}',
    '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"__metadata__":[]}',
])
def test_what_the_format_forbids_is_refused(tmp_path, header):
    """Leading or non-space padding (the format says: begins with '{', padded with spaces),
    -0 (a float to strict JSON readers), lone surrogates, part-byte sizes, a list as metadata."""
    src = tmp_path / "in"
    src.mkdir()
    path = st_file(src / "m.safetensors", header, b"\1" if "[0,1]" in header else b"")
    refuse(["inspect", path], "m.safetensors", inputs=src)


# ----------------------------------------------------------------- 2. JSON nesting and integers


def _model_folder(tmp_path) -> Path:
    src = tmp_path / "in"
    shutil.copytree(FIXTURES / LLAMA, src)
    return src


def test_deep_json_in_a_safetensors_header_is_refused(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    path = st_file(src / "m.safetensors", '{"__metadata__":{"a":' + DEEP + "}}", b"")
    refuse(["inspect", path], "m.safetensors", "FUSECTL_MAX_JSON_DEPTH", inputs=src)


def test_a_huge_integer_in_a_safetensors_header_is_refused(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    path = st_file(src / "m.safetensors", '{"a":{"dtype":"U8","shape":[' + HUGE + '],"data_offsets":[0,1]}}', b"\0")
    refuse(["inspect", path], "m.safetensors", "FUSECTL_MAX_INTEGER_DIGITS", inputs=src)


@pytest.mark.parametrize("value, needle", [
    (DEEP, "FUSECTL_MAX_JSON_DEPTH"),
    (HUGE, "FUSECTL_MAX_INTEGER_DIGITS"),
    ("-" + HUGE, "FUSECTL_MAX_INTEGER_DIGITS"),
    ("Infinity", "Infinity"),
    ("NaN", "NaN"),
    ("1e999", "1e999"),
])
def test_hostile_json_in_config_is_refused(tmp_path, value, needle):
    src = _model_folder(tmp_path)
    (src / "config.json").write_text('{"hidden_size": 64, "x": ' + value + "}")
    refuse(["inspect", src], "config.json", needle, inputs=src)
    out = tmp_path / "out"
    refuse(["fuse", src, "-r", "llama-qkv", "-o", out, "--quiet"], "config.json", needle, inputs=src, out=out)


@pytest.mark.parametrize("value, needle", [(DEEP, "FUSECTL_MAX_JSON_DEPTH"), (HUGE, "FUSECTL_MAX_INTEGER_DIGITS")])
def test_hostile_json_in_an_index_is_refused(tmp_path, value, needle):
    src = tmp_path / "in"
    shutil.copytree(FIXTURES / SHARDED, src)
    index = src / "model.safetensors.index.json"
    text = index.read_text()
    index.write_text(text.replace('"metadata": {', '"metadata": {"deep": ' + value + ", ", 1))
    assert index.read_text() != text
    refuse(["inspect", src], "model.safetensors.index.json", needle, inputs=src)


@pytest.fixture(scope="module")
def fused(tmp_path_factory) -> Path:
    """A fused file whose metadata holds fusectl's provenance."""
    out = tmp_path_factory.mktemp("fused") / "fused.safetensors"
    ok(run_cli("fuse", FIXTURES / LLAMA, "-r", "llama-qkv", "-o", out, "--quiet"))
    return out


def _edited(tmp_path, fused: Path, edit_text) -> tuple[Path, Path]:
    src = tmp_path / "in"
    src.mkdir()
    path = src / "fused.safetensors"
    shutil.copy(fused, path)
    with_metadata(path, lambda m: {**m, "fusectl": edit_text(m["fusectl"])})
    return src, path


@pytest.mark.parametrize("value, needle", [(DEEP, "FUSECTL_MAX_JSON_DEPTH"), (HUGE, "FUSECTL_MAX_INTEGER_DIGITS")])
def test_hostile_json_in_a_provenance_is_refused(tmp_path, fused, value, needle):
    src, path = _edited(tmp_path, fused, lambda text: text[:-1] + ', "x": ' + value + "}")
    refuse(["inspect", path], "fused.safetensors", needle, inputs=src)
    out = tmp_path / "back.safetensors"
    refuse(["unfuse", path, "-o", out], "fused.safetensors", needle, inputs=src, out=out)


@pytest.mark.parametrize("value, needle", [(DEEP, "FUSECTL_MAX_JSON_DEPTH"), (HUGE, "FUSECTL_MAX_INTEGER_DIGITS")])
def test_hostile_json_in_an_npz_metadata_member_is_refused(tmp_path, value, needle):
    src = tmp_path / "in"
    src.mkdir()
    meta = np.frombuffer(('{"a": ' + value + "}").encode(), np.uint8)
    path = npz_with_members(src / "m.npz", {"w.npy": npy_bytes(np.ones(3, np.float32)),
                                             "__fusectl_metadata__.npy": npy_bytes(meta)})
    refuse(["inspect", path], "m.npz", needle, inputs=src)


def test_brackets_inside_names_do_not_count_as_nesting(tmp_path):
    name = "w" + "[" * 200 + "\\\"]"
    path = write_safetensors(tmp_path / "m.safetensors", {name: np.ones(2, np.float32)})
    tensors, _ = read_header(str(path))
    assert list(tensors) == [name]


def test_the_depth_budget_can_be_raised(tmp_path, monkeypatch):
    src = _model_folder(tmp_path)
    (src / "config.json").write_text('{"hidden_size": 64, "x": ' + "[" * 80 + "]" * 80 + "}")
    refuse(["inspect", src], "config.json", "FUSECTL_MAX_JSON_DEPTH=81", inputs=src)
    monkeypatch.setenv("FUSECTL_MAX_JSON_DEPTH", "81")
    ok(run_cli("inspect", src))


# ------------------------------------------------------------------------- 3. dtype as a list


def test_a_dtype_given_as_a_list_is_refused(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    path = st_file(src / "m.safetensors", '{"w":{"dtype":["F32"],"shape":[1],"data_offsets":[0,4]}}', b"\0" * 4)
    refuse(["inspect", path], "m.safetensors", "'w'", "dtype must be a string", inputs=src)


# ------------------------------------------------------------------------ 4. edited provenances


def _edit_first_step(key, value):
    def edit(text):
        doc = json.loads(text)
        doc["plan"][0]["steps"][0][key] = value
        return json.dumps(doc)
    return edit


@pytest.mark.parametrize("edit", [
    _edit_first_step("input_specs", [[]]),
    _edit_first_step("input_specs", [["F32", ["4"]], ["F32", [1]], ["F32", [1]]]),
    _edit_first_step("outputs", []),
    _edit_first_step("output_specs", []),
    _edit_first_step("params", {"axis": "0"}),
    _edit_first_step("params", {"axis": 0, "sizes": None, "bogus": 1}),
    _edit_first_step("inputs", [None]),
    _edit_first_step("op", ["concat"]),
    lambda text: text.replace('"axis":0', '"axis":Infinity', 1),
    lambda text: text.replace('"plan":[', '"plan":[{"rule":1,"source":"x","steps":[]},', 1),
    lambda text: text.replace('"aliases":{', '"aliases":{"a":3,', 1),
    lambda text: text.replace('"inputs":["', '"inputs":["\\ud800', 1),
], ids=["empty-spec", "string-dim", "empty-outputs", "empty-output-specs", "string-axis", "unknown-param",
        "null-input", "op-list", "infinity", "rule-number", "alias-number", "lone-surrogate"])
def test_a_malformed_provenance_is_unreadable(tmp_path, fused, edit):
    src, path = _edited(tmp_path, fused, edit)
    for args, out in ((["inspect", path], None), (["unfuse", path, "-o", tmp_path / "back.safetensors"],
                                                   tmp_path / "back.safetensors")):
        refuse(args, "fused.safetensors", "fusectl provenance is unreadable", "edited or corrupted",
               inputs=src, out=out)


@pytest.mark.parametrize("params", [{"axis": 5}, {"axis": 1}, {"axis": 0, "sizes": [1, 2, 3]}])
def test_a_provenance_of_the_right_types_but_wrong_sense_is_refused(tmp_path, fused, params):
    """An axis out of range, or one the recorded shapes do not fit: the op re-derives the outputs."""
    src, path = _edited(tmp_path, fused, _edit_first_step("params", params))
    refuse(["inspect", path], "fused.safetensors", "provenance", inputs=src)
    out = tmp_path / "back.safetensors"
    refuse(["unfuse", path, "-o", out], "fused.safetensors", "provenance", inputs=src, out=out)


def test_an_untouched_provenance_still_unfuses(tmp_path, fused):
    out = tmp_path / "back.safetensors"
    ok(run_cli("unfuse", fused, "-o", out, "--quiet"))
    original, _ = read_header(str(FIXTURES / LLAMA / "model.safetensors"))
    back, _ = read_header(str(out))
    assert {n: t.read().tobytes() for n, t in back.items()} == {n: t.read().tobytes() for n, t in original.items()}


# ------------------------------------------------------------------------------- 5. budgets


def test_the_tensor_budget(tmp_path, monkeypatch):
    src = tmp_path / "in"
    src.mkdir()
    path = write_safetensors(src / "m.safetensors", {f"t{k}": np.zeros(1, np.uint8) for k in range(4)})
    monkeypatch.setenv("FUSECTL_MAX_TENSORS", "3")
    refuse(["inspect", path], "m.safetensors", "4 tensors", "FUSECTL_MAX_TENSORS=4", inputs=src)
    monkeypatch.setenv("FUSECTL_MAX_TENSORS", "4")
    ok(run_cli("inspect", path))


def test_the_tensor_budget_counts_every_shard_and_npz_member(tmp_path, monkeypatch):
    src = tmp_path / "in"
    shutil.copytree(FIXTURES / SHARDED, src)
    count = len(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"])
    monkeypatch.setenv("FUSECTL_MAX_TENSORS", str(count - 1))
    refuse(["inspect", src], "model.safetensors.index.json", "FUSECTL_MAX_TENSORS", inputs=src)
    npz = npz_with_members(src / "x.npz", {f"t{k}.npy": npy_bytes(np.ones(1)) for k in range(count)})
    refuse(["inspect", npz], "x.npz", "FUSECTL_MAX_TENSORS", inputs=src)


def test_the_header_bytes_budget_is_checked_before_reading(tmp_path, monkeypatch):
    src = tmp_path / "in"
    src.mkdir()
    path = write_safetensors(src / "m.safetensors", {"w": np.zeros(2, np.float32)})
    monkeypatch.setenv("FUSECTL_MAX_HEADER_BYTES", "16")
    refuse(["inspect", path], "m.safetensors", "FUSECTL_MAX_HEADER_BYTES", inputs=src)


def test_a_large_header_shares_specs(tmp_path):
    """10^4 tensors of one shape hold one TensorSpec (what keeps a 10^6-tensor header cheap)."""
    count = 10_000
    entries = ",".join(f'"layer.{k}.w":{{"dtype":"F32","shape":[0,8],"data_offsets":[0,0]}}' for k in range(count))
    path = st_file(tmp_path / "m.safetensors", "{" + entries + "}", b"")
    tensors, _ = read_header(str(path))
    assert len(tensors) == count
    assert len({id(t.spec) for t in tensors.values()}) == 1


# ------------------------------------------------------------------------------ 6. long names


def test_a_70000_character_name_is_refused_on_read(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    long_name = "x" * 70_000
    path = write_safetensors(src / "m.safetensors", {"w": np.ones(2, np.float32), long_name: np.ones(2, np.float32)})
    rules = write_rules(tmp_path / "r.toml", 'version = 1\n[[rule]]\nop = "rename"\ninput = "w"\noutput = "v"\n')
    out = tmp_path / "out.npz"
    refuse(["fuse", path, "-r", rules, "-o", out], "m.safetensors", "FUSECTL_MAX_NAME_BYTES", inputs=src, out=out)
    refuse(["inspect", path], "m.safetensors", "FUSECTL_MAX_NAME_BYTES", inputs=src)


def test_a_long_npz_member_name_is_refused(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    path = npz_with_members(src / "m.npz", {"y" * 5000 + ".npy": npy_bytes(np.ones(2, np.float32))})
    refuse(["inspect", path], "m.npz", "FUSECTL_MAX_NAME_BYTES", inputs=src)


def test_the_npz_writer_refuses_a_name_zip_cannot_store(tmp_path):
    with pytest.raises(OutputError, match="zip"):
        NpzWriter(str(tmp_path / "o.npz"), [("z" * 70_000, TensorSpec(BY_NAME["F32"], (1,)))], {})


# --------------------------------------------------------------- 7. FIFOs, devices and /proc


@pytest.mark.parametrize("member", ["model.safetensors", "config.json", "model.safetensors.index.json"])
def test_a_fifo_in_a_folder_is_refused_without_blocking(tmp_path, member):
    src = tmp_path / "in"
    shutil.copytree(FIXTURES / (SHARDED if "index" in member else LLAMA), src)
    (src / member).unlink()
    os.mkfifo(src / member)
    refuse(["inspect", src], member, "FIFO", inputs=src)


def test_a_fifo_named_directly_is_refused_without_blocking(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    for name in ("w.safetensors", "w.npz"):
        os.mkfifo(src / name)
        refuse(["inspect", src / name], name, "FIFO", inputs=src)
    os.mkfifo(src / "c.json")
    refuse(["inspect", FIXTURES / LLAMA / "model.safetensors", "--config", src / "c.json"], "c.json", "FIFO",
           inputs=src)


def test_a_fifo_companion_is_refused(tmp_path):
    src = _model_folder(tmp_path)
    os.mkfifo(src / "tokenizer.json")
    refuse(["inspect", src], "tokenizer.json", "FIFO", inputs=src)


def test_devices_and_proc_files_are_never_read(tmp_path):
    src = _model_folder(tmp_path)
    (src / "config.json").unlink()
    (src / "config.json").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="device"):
        open_checkpoint(str(src), allow_outside_links=True)
    (src / "config.json").unlink()
    (src / "config.json").symlink_to("/proc/self/environ")
    with pytest.raises(CheckpointError, match="/proc"):
        open_checkpoint(str(src), allow_outside_links=True)
    refuse(["inspect", src], "config.json", "/proc", inputs=src)


# ------------------------------------------------------------------- 8. links leaving a folder


@pytest.fixture
def outside(tmp_path) -> Path:
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    (folder / "secret.txt").write_text('{"not_for_the_output": true}')
    return folder


@pytest.mark.parametrize("link, target", [
    ("tokenizer.json", "/etc/passwd"),
    ("x", "/proc/self/environ"),
    ("config.json", "OUTSIDE/secret.txt"),
    ("sub", "OUTSIDE"),
    ("nested/deeper/tok.json", "OUTSIDE/secret.txt"),
])
def test_links_out_of_an_input_folder_are_refused(tmp_path, outside, link, target):
    src = _model_folder(tmp_path)
    target = target.replace("OUTSIDE", str(outside))
    path = src / link
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    path.symlink_to(target)
    refuse(["inspect", src], link.split("/")[-1], target, inputs=src)
    out = tmp_path / "out"
    refuse(["fuse", src, "-r", "llama-qkv", "-o", out, "--quiet"], link.split("/")[-1], inputs=src, out=out)
    if not target.startswith("/proc"):
        checkpoint = open_checkpoint(str(src), allow_outside_links=True)
        assert checkpoint.table.names()


def test_a_weight_file_or_shard_linked_outside_is_refused(tmp_path, outside):
    src = _model_folder(tmp_path)
    (src / "model.safetensors").rename(outside / "model.safetensors")
    (src / "model.safetensors").symlink_to(outside / "model.safetensors")
    refuse(["inspect", src], "model.safetensors", str(outside), inputs=src)
    assert open_checkpoint(str(src), allow_outside_links=True).table.names()
    # named directly, the same link is the user's choice
    ok(run_cli("inspect", src / "model.safetensors"))

    sharded = tmp_path / "sharded"
    shutil.copytree(FIXTURES / SHARDED, sharded)
    shard = "model-00002-of-00003.safetensors"
    (sharded / shard).rename(outside / shard)
    (sharded / shard).symlink_to(outside / shard)
    refuse(["inspect", sharded], shard, str(outside), inputs=sharded)
    refuse(["inspect", sharded / "model.safetensors.index.json"], shard, inputs=sharded)
    assert open_checkpoint(str(sharded), allow_outside_links=True).table.names()


def test_links_inside_the_folder_and_loops_are_followed(tmp_path):
    src = _model_folder(tmp_path)
    (src / "sub").mkdir()
    (src / "sub" / "tok.json").write_text("{}")
    (src / "tokenizer.json").symlink_to("sub/tok.json")
    (src / "sub" / "loop").symlink_to("..", target_is_directory=True)
    with time_limit(20):
        checkpoint = open_checkpoint(str(src))
    relative = {c.relative for c in checkpoint.companions}
    assert {"tokenizer.json", os.path.join("sub", "tok.json")} <= relative
    out = tmp_path / "out"
    ok(run_cli("fuse", src, "-r", "llama-qkv", "-o", out, "--quiet"))
    assert (out / "tokenizer.json").read_text() == "{}"


def _hf_cache(tmp_path) -> Path:
    """A Hugging Face cache: snapshots/<rev>/ holds links to ../../blobs/<sha256>."""
    repo = tmp_path / "hub" / "models--org--tiny-llama"
    blobs, snapshot_dir = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot_dir.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        data = (FIXTURES / LLAMA / name).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        (snapshot_dir / name).symlink_to(Path("..") / ".." / "blobs" / digest)
    return snapshot_dir


def test_a_hugging_face_cache_snapshot_is_read(tmp_path):
    snapshot_dir = _hf_cache(tmp_path)
    result = ok(run_cli("inspect", snapshot_dir, "--json"))
    assert result.json()["parameters"]
    out = tmp_path / "out"
    ok(run_cli("fuse", snapshot_dir, "-r", "llama-qkv", "-o", out, "--quiet"))
    assert (out / "config.json").read_bytes() == (FIXTURES / LLAMA / "config.json").read_bytes()
    assert not (out / "config.json").is_symlink()


def test_a_hugging_face_snapshot_link_out_of_its_repository_is_refused(tmp_path, outside):
    snapshot_dir = _hf_cache(tmp_path)
    (snapshot_dir / "tokenizer.json").symlink_to(outside / "secret.txt")
    refuse(["inspect", snapshot_dir], "tokenizer.json", str(outside), inputs=tmp_path / "hub")


# -------------------------------------------------------------------------------- 9. dims


def test_more_dims_than_the_budget_are_refused(tmp_path, monkeypatch):
    src = tmp_path / "in"
    src.mkdir()
    shape = json.dumps([1] * 5)
    path = st_file(src / "m.safetensors", '{"w":{"dtype":"U8","shape":' + shape + ',"data_offsets":[0,1]}}', b"\1")
    assert _library_reads(path) is not None  # the library has no such limit; fusectl's budget refuses it
    monkeypatch.setenv("FUSECTL_MAX_DIMS", "4")
    refuse(["inspect", path], "m.safetensors", "'w'", "FUSECTL_MAX_DIMS=5", inputs=src)
    monkeypatch.setenv("FUSECTL_MAX_DIMS", "5")
    ok(run_cli("inspect", path))


@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_more_dims_than_numpy_holds_are_refused_whatever_the_budget(tmp_path, monkeypatch, command):
    """numpy 1.x holds 32 dims, numpy 2 holds 64: a tensor past that is bad input naming numpy,
    whatever FUSECTL_MAX_DIMS says (on numpy 1.26 a 42-dim tensor passed the header check and
    convert exited 70 with numpy's ValueError)."""
    most = 64 if int(np.__version__.split(".")[0]) >= 2 else 32
    src = tmp_path / "in"
    src.mkdir()
    shape = json.dumps([1] * (most + 1))
    path = st_file(src / "m.safetensors", '{"w":{"dtype":"U8","shape":' + shape + ',"data_offsets":[0,1]}}', b"\1")
    monkeypatch.setenv("FUSECTL_MAX_DIMS", "100")
    out = tmp_path / "out.safetensors"
    refuse([command, path, *(["-o", out] if command == "convert" else [])], "m.safetensors", "'w'",
           f"{most + 1} dimensions of one tensor, but numpy {np.__version__} holds at most {most}",
           inputs=src, out=out)


def test_a_provenance_spec_with_more_dims_than_the_budget_is_refused(tmp_path, fused, monkeypatch):
    def edit(text):
        doc = json.loads(text)
        doc["plan"][0]["steps"][0]["input_specs"][0] = ["F32", [1] * 5]
        return json.dumps(doc)
    src, path = _edited(tmp_path, fused, edit)
    monkeypatch.setenv("FUSECTL_MAX_DIMS", "4")
    refuse(["inspect", path], "fused.safetensors", "FUSECTL_MAX_DIMS=5", inputs=src)


@pytest.mark.parametrize("command", ["inspect", "fuse", "verify"])
def test_follow_symlinks_lets_a_user_allow_links_out_of_the_folder(tmp_path, command):
    """A tokenizer linked from elsewhere (a secret in the real report): refused by every
    command that opens the folder, unless --follow-symlinks says the user means it."""
    src = tmp_path / "model"
    shutil.copytree(FIXTURES / "tiny-llama-gqa", src)
    secret = tmp_path / "secret.txt"
    secret.write_text("HF_TOKEN=hf_xxx\n")
    os.symlink(secret, src / "tokenizer.json")
    out = tmp_path / "out"
    candidate = tmp_path / "candidate"
    if command == "verify":
        ok(run_cli("fuse", src, "-r", "llama-qkv", "-o", candidate, "--quiet", "--follow-symlinks"))
    args = {"inspect": ["inspect", src], "fuse": ["fuse", src, "-r", "llama-qkv", "-o", out, "--quiet"],
            "verify": ["verify", src, candidate]}[command]
    refused = run_cli(*args)
    assert refused.exit_code == 2, refused.output
    assert "tokenizer.json" in refused.stderr and str(secret) in refused.stderr
    assert "--follow-symlinks" in refused.stderr
    assert not out.exists()
    allowed = run_cli(*args, "--follow-symlinks")
    assert allowed.exit_code == 0, allowed.output
    if command == "fuse":
        assert (out / "tokenizer.json").read_text() == "HF_TOKEN=hf_xxx\n"


def test_a_folder_output_keeps_linked_subfolders_and_skips_cycles_and_vcs(tmp_path):
    """`b -> a` inside the folder is part of the tree (copied as a folder); `a/up -> ..` is a
    cycle (skipped, not walked forever); `.git` is never copied (a clone's .git/lfs holds the
    old weights again); a link to itself is an error naming it."""
    src = tmp_path / "model"
    shutil.copytree(FIXTURES / "tiny-llama-gqa", src)
    (src / "a").mkdir()
    (src / "a" / "x.txt").write_text("x\n")
    os.symlink("a", src / "b")
    os.symlink("..", src / "a" / "up")
    (src / ".git" / "lfs").mkdir(parents=True)
    (src / ".git" / "lfs" / "blob").write_bytes(b"old weights")
    out = tmp_path / "out"
    ok(run_cli("fuse", src, "-r", "llama-qkv", "-o", out, "--quiet"))
    assert (out / "a" / "x.txt").read_text() == "x\n" and (out / "b" / "x.txt").read_text() == "x\n"
    assert not (out / ".git").exists() and not (out / "a" / "up").exists()
    os.symlink("loop", src / "loop")
    result = run_cli("inspect", src)
    assert result.exit_code == 2 and "loop" in result.stderr and "leads back to itself" in result.stderr
