"""fusectl.io.formats.torch_file: torch.save files read without torch, safely, lazily.

Good fixtures (fixtures/torch/, written by fixtures/generate_torch.py with torch 2.13) are
compared bit for bit with what torch.load returned for them, recorded beside each file in
NAME.expected.safetensors (parsed here by conftest's independent parser). Hostile fixtures are
described in fixtures/torch/hostile.json. Edge cases the generator cannot make with torch are
built here as pickles, opcode by opcode.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import pickle
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES, OWN_PEAK_KB, parse_safetensors, time_limit
from fusectl.errors import CheckpointError
from fusectl.io.formats import torch_file
from fusectl.io.formats.torch_file import ALLOWED_GLOBALS, TorchContents, TorchViewTensor, read_torch
from fusectl.tensors import FileTensor

TORCH = FIXTURES / "torch"
GOOD = sorted(p.name[: -len(".expected.safetensors")] for p in TORCH.glob("*.expected.safetensors"))
HOSTILE = json.loads((TORCH / "hostile.json").read_text())
PWNED = "fusectl-pwned"


def fixture(stem: str) -> Path:
    return next(p for p in (TORCH / f"{stem}.pt", TORCH / f"{stem}.bin") if p.exists())


def expected(stem: str) -> tuple[dict, dict]:
    tensors, metadata = parse_safetensors(TORCH / f"{stem}.expected.safetensors")
    return tensors, json.loads(metadata["expected"])


def read_all(contents: TorchContents) -> dict[str, np.ndarray]:
    return {name: tensor.read() for name, tensor in contents.tensors.items()}


# ------------------------------------------------------------------------------ good files


def test_the_fixture_set_is_complete():
    assert {"dtypes", "dtypes-legacy", "views", "views-legacy", "tied", "tied-legacy", "overlap", "protocol4",
            "deflated", "big-endian", "training", "training-legacy", "model-state", "model-config", "nested",
            "mixed", "two-models", "bert", "big-endian-fp8", "legacy-protocol1"} <= set(GOOD)
    total = sum(p.stat().st_size for p in TORCH.iterdir())
    assert total < 1_000_000


@pytest.mark.parametrize("stem", GOOD)
def test_reads_what_torch_load_returns(stem):
    tensors, info = expected(stem)
    contents = read_torch(str(fixture(stem)), None if stem != "two-models" else info["key"])
    assert contents.key == info["key"]
    assert contents.aliases == info["aliases"]
    assert contents.ignored == info["ignored"]
    assert list(contents.tensors) == [n for n in info["names"] if n not in info["aliases"]]
    for name in info["names"]:
        tensor = contents.tensors[contents.aliases.get(name, name)]
        dtype, shape, raw = tensors[name]
        assert (str(tensor.spec.dtype), list(tensor.spec.shape)) == (dtype, shape), name
        array = tensor.read()
        assert array.dtype == tensor.spec.dtype.numpy and array.shape == tensor.spec.shape, name
        assert array.tobytes() == raw, name
        assert tensor.has_data()


@pytest.mark.parametrize("stem", GOOD)
def test_byte_ranges_hold_the_tensor(stem):
    tensors, info = expected(stem)
    contents = read_torch(str(fixture(stem)), info["key"] if stem == "two-models" else None)
    data = fixture(stem).read_bytes()
    for name, tensor in contents.tensors.items():
        ranges = tensor.byte_ranges()
        if ranges is not None:
            assert b"".join(data[r.offset:r.offset + r.length] for r in ranges) == tensors[name][2], name
            assert all(r.path == str(fixture(stem)) for r in ranges)


@pytest.mark.parametrize("stem", ["dtypes", "dtypes-legacy", "tied", "tied-legacy", "protocol4", "training",
                                  "training-legacy", "model-state", "bert", "mixed"])
def test_contiguous_tensors_are_file_ranges(stem):
    contents = read_torch(str(fixture(stem)), None)
    assert all(type(t) is FileTensor for t in contents.tensors.values())


def test_bert_bin_holds_the_tiny_bert_weights():
    # bert.bin is torch.save(BertModel.from_pretrained("fixtures/tiny-bert").state_dict()): what a
    # pytorch_model.bin holds, with the same tensors as the safetensors file
    reference, _ = parse_safetensors(FIXTURES / "tiny-bert" / "model.safetensors")
    contents = read_torch(str(fixture("bert")))
    assert set(contents.tensors) == set(reference) and not contents.aliases
    for name, tensor in contents.tensors.items():
        assert (str(tensor.spec.dtype), list(tensor.spec.shape)) == reference[name][:2]
        assert tensor.read().tobytes() == reference[name][2], name


def test_views_are_laid_out_on_read():
    contents = read_torch(str(fixture("views")))
    strided = {n for n, t in contents.tensors.items() if t.byte_ranges() is None}
    assert strided == {"transposed", "narrow", "expanded", "conj", "neg", "bf16_transposed", "fp8_transposed",
                       "u16_transposed"}
    assert all(isinstance(contents.tensors[n], TorchViewTensor) for n in strided)
    # rows 1-2 of a 4x6 grid are one range inside the grid's storage; so is element [2, 5]
    (rows,) = contents.tensors["row_slice"].byte_ranges()
    (element,) = contents.tensors["element"].byte_ranges()
    storage_start = rows.offset - 6 * 4
    assert rows.length == 2 * 6 * 4 and element == type(element)(element.path, storage_start + (2 * 6 + 5) * 4, 4)
    transposed = contents.tensors["transposed"].read()
    assert transposed.flags.c_contiguous and transposed.flags.writeable


def test_compressed_and_big_endian_files_have_no_byte_ranges():
    deflated = read_torch(str(fixture("deflated")))
    assert all(t.byte_ranges() is None for t in deflated.tensors.values())
    big = read_torch(str(fixture("big-endian")))
    plain = {n for n, t in big.tensors.items() if t.byte_ranges() is not None}
    assert plain == {"u8", "bool"}  # one byte per element: nothing to swap


def test_shared_storage_makes_aliases():
    tied = read_torch(str(fixture("tied")))
    assert tied.aliases == {"head.weight": "embed.weight"}
    assert list(tied.tensors) == ["embed.weight", "proj.weight", "proj.bias"]
    overlap = read_torch(str(fixture("overlap")))
    assert overlap.aliases == {"a_again": "a"}
    # overlapping differently, reshaped, transposed: separate tensors over the same bytes
    assert {"a", "b", "a_reshaped", "a_transposed", "whole", "other"} == set(overlap.tensors)
    a, b = overlap.tensors["a"].byte_ranges()[0], overlap.tensors["b"].byte_ranges()[0]
    assert b.offset == a.offset + 6 * 4


def test_training_dict_key_selection():
    training = read_torch(str(fixture("training")))
    assert training.key == "model_state_dict"
    assert training.candidates == {("model_state_dict",): 23}
    assert read_torch(str(fixture("training")), "model_state_dict").tensors.keys() == training.tensors.keys()
    adam = read_torch(str(fixture("training")), "optimizer_state_dict.state.0")
    assert set(adam.tensors) == {"step", "exp_avg", "exp_avg_sq"} and adam.key == "optimizer_state_dict.state.0"
    assert read_torch(str(fixture("model-state"))).key == "model_state"
    assert read_torch(str(fixture("model-config"))).key == "model"
    nested = read_torch(str(fixture("nested")))
    assert nested.key == "state.model" and nested.candidates == {(): 1, ("state", "model"): 23}
    top = read_torch(str(fixture("nested")), "")
    assert top.key is None and list(top.tensors) == ["step"] and top.ignored == ["state", "meta"]
    mixed = read_torch(str(fixture("mixed")))
    assert mixed.key is None and mixed.candidates == {(): 3, ("sub",): 1}


def test_ambiguous_training_dict_lists_the_candidates(tmp_path):
    # "ema" beside "model" is the model's EMA (fusectl.twins): the model is read by default
    path = str(fixture("two-models"))
    assert read_torch(path).key == "model" and read_torch(path, "ema").key == "ema"
    from fusectl.io.formats.torch_file import read_torch_tree
    from fusectl.io.formats.torch_writer import write_torch_file
    tree, _ = read_torch_tree(path)
    two = str(tmp_path / "two.pt")  # two models under keys that say nothing of which is which
    write_torch_file(two, {("other" if k == "ema" else k): v for k, v in tree.items()})
    with pytest.raises(CheckpointError) as e:
        read_torch(two)
    message = str(e.value)
    assert two in message and "'model' (23 tensors)" in message and "'other' (23 tensors)" in message
    assert "pass key with" in message and "'opt" not in message  # optimizer state is no candidate
    assert read_torch(two, "model").key == "model"


@pytest.mark.parametrize("key, what", [("nope", "does not exist"), ("optimizer_state_dict", "is not a dict of tensors"),
                                       ("epoch", "does not exist"), ("", "is not a dict of tensors")])
def test_a_wrong_key_names_the_keys_there_are(key, what):
    path = str(fixture("training"))
    with pytest.raises(CheckpointError) as e:
        read_torch(path, key)
    assert path in str(e.value) and what in str(e.value) and "'model_state_dict' (23 tensors)" in str(e.value)


# ------------------------------------------------------------------------------ hostile files


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_files_are_refused(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the payloads would touch their file
    if HOSTILE[name]["refused_before_unpickling"]:
        monkeypatch.setattr(torch_file._Loader, "load", _must_not_unpickle)
    path = str(TORCH / name)
    with time_limit(60):  # a hang guard, not a timing: a budget that misses would run for minutes
        with pytest.raises(CheckpointError) as e:
            contents = read_torch(path)
            read_all(contents)
    message = str(e.value)
    assert message.startswith(path), message
    for needle in HOSTILE[name]["needles"]:
        assert needle in message, message
    assert not (tmp_path / PWNED).exists() and not os.path.exists(PWNED)


def _must_not_unpickle(self):
    raise AssertionError("the pickle was unpickled: the scan should have refused it first")


def test_payloads_never_run_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("bad-os-system.pt", "bad-os-system-legacy.pt", "bad-stack-global.pt", "bad-eval.pt",
                 "bad-eval-protocol2.pt"):
        raw = (TORCH / name).read_bytes()
        assert b"touch " + PWNED.encode() in raw or PWNED.encode() in zipfile_text(TORCH / name)
        with pytest.raises(CheckpointError, match="which fusectl refuses"):
            read_torch(str(TORCH / name))
    assert os.listdir(tmp_path) == []


def zipfile_text(path: Path) -> bytes:
    try:
        with zipfile.ZipFile(path) as zf:
            return b"".join(zf.read(n) for n in zf.namelist())
    except zipfile.BadZipFile:
        return b""


_MEASURE = f"""
import sys
from fusectl.errors import CheckpointError
from fusectl.io.formats.torch_file import read_torch
before = {OWN_PEAK_KB}
try:
    read_torch(sys.argv[1])
except CheckpointError as e:
    print("refused:", e)
print({OWN_PEAK_KB} - before)
"""


def test_a_huge_list_is_refused_with_little_memory():
    path = str(TORCH / "bad-huge-list.pt")
    assert os.path.getsize(path) < 10_000  # 3,000,000 items, deflated
    result = subprocess.run([sys.executable, "-c", _MEASURE, path], capture_output=True, text=True, timeout=60,
                            cwd=Path(__file__).resolve().parent.parent)
    refusal, measures = result.stdout.strip().splitlines()
    kilobytes = int(measures)  # the subprocess timeout above guards a hang; speed is for benchmarks/
    assert "FUSECTL_MAX_PICKLE_ITEMS" in refusal
    assert kilobytes < 64_000, kilobytes


# ------------------------------------------------------------------------------ hand-made pickles


def s(text: str) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(raw)) + raw


def i(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if -(2**31) <= n < 2**31:
        return b"J" + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def g(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def tup(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"t"


OD = g("collections", "OrderedDict") + b")R"


def storage(key: str = "0", cls: str = "FloatStorage", numel: int = 4, module: str = "torch", legacy: bool = False):
    return tup(s("storage"), g(module, cls), s(key), s("cpu"), i(numel), *([b"N"] if legacy else [])) + b"Q"


def tensor(st: bytes | None = None, offset: int = 0, size=(4,), stride=(1,), fn: str = "_rebuild_tensor_v2",
           extra: bytes = b"", raw_size: bytes | None = None, raw_stride: bytes | None = None) -> bytes:
    st = storage() if st is None else st
    size_op = raw_size if raw_size is not None else tup(*map(i, size))
    stride_op = raw_stride if raw_stride is not None else tup(*map(i, stride))
    return g("torch._utils", fn) + tup(st, i(offset), size_op, stride_op, b"\x89", OD, extra) + b"R"


def dict_of(*pairs: tuple[bytes, bytes]) -> bytes:
    return b"}(" + b"".join(k + v for k, v in pairs) + b"u"


def pkl(body: bytes) -> bytes:
    return b"\x80\x02" + body + b"."


FLOATS4 = struct.pack("<4f", 1.5, -2.0, 3.25, 4.0)


def torch_zip(path: Path, data_pkl: bytes, records: dict[str, bytes] | None = None, folder: str = "archive",
              byteorder: bytes | None = b"little", compression: int = zipfile.ZIP_STORED, extra=()) -> str:
    with zipfile.ZipFile(path, "w", compression) as zf:
        zf.writestr(f"{folder}/data.pkl", data_pkl)
        if byteorder is not None:
            zf.writestr(f"{folder}/byteorder", byteorder)
        for key, data in (records if records is not None else {"0": FLOATS4}).items():
            zf.writestr(f"{folder}/data/{key}", data)
        for name, data in extra:
            zf.writestr(name, data)
        zf.writestr(f"{folder}/version", b"3\n")
    return str(path)


def legacy_file(path: Path, main: bytes, storages=(("0", 4, FLOATS4),), magic: int = 0x1950A86A20F9469CFC6C,
                version: int = 1001, keys: bytes | None = None) -> str:
    import pickle

    head = pickle.dumps(magic, protocol=2) + pickle.dumps(version, protocol=2) + pickle.dumps({"little_endian": True},
                                                                                               protocol=2)
    key_list = keys if keys is not None else pickle.dumps([k for k, _, _ in storages], protocol=2)
    body = b"".join(struct.pack("<q", n) + d for _, n, d in storages)
    path.write_bytes(head + main + key_list + body)
    return str(path)


def refused(path: str, *needles: str, key: str | None = None, read: bool = False) -> str:
    with pytest.raises(CheckpointError) as e:
        contents = read_torch(path, key)
        if read:
            read_all(contents)
    message = str(e.value)
    assert path in message, message
    for needle in needles:
        assert needle in message, message
    return message


def test_hand_made_file_reads(tmp_path):
    path = torch_zip(tmp_path / "m.pt", pkl(dict_of((s("w"), tensor()))), folder="any-name")
    contents = read_torch(path)
    assert contents.tensors["w"].read().tolist() == [1.5, -2.0, 3.25, 4.0]
    # the same in the legacy format
    legacy = legacy_file(tmp_path / "l.pt", pkl(dict_of((s("w"), tensor(storage(legacy=True))))))
    assert read_torch(legacy).tensors["w"].read().tolist() == [1.5, -2.0, 3.25, 4.0]
    # fp8 in the legacy format: an UntypedStorage counted in bytes (torch 2.13 writes it, but its
    # own loader fails on it: 'UntypedStorage' has no attribute 'dtype')
    fp8 = g("torch._utils", "_rebuild_tensor_v3") + tup(
        storage(module="torch.storage", cls="UntypedStorage", numel=4, legacy=True), i(0), tup(i(2), i(2)),
        tup(i(1), i(2)), b"\x89", OD, g("torch", "float8_e4m3fn")) + b"R"
    untyped = legacy_file(tmp_path / "u.pt", pkl(dict_of((s("f"), fp8))), storages=[("0", 4, b"\x38\x40\x44\x48")])
    f = read_torch(untyped).tensors["f"]
    assert str(f.spec.dtype) == "F8_E4M3" and f.byte_ranges() is None  # transposed
    assert f.read().astype(np.float32).tolist() == [[1.0, 3.0], [2.0, 4.0]]


def test_allow_list():
    assert "torch._utils._rebuild_tensor_v2" in ALLOWED_GLOBALS and "collections.OrderedDict" in ALLOWED_GLOBALS
    assert not any(g.startswith(("os.", "posix.", "subprocess.", "numpy.")) for g in ALLOWED_GLOBALS)
    assert "builtins.eval" not in ALLOWED_GLOBALS and "builtins.getattr" not in ALLOWED_GLOBALS


@pytest.mark.parametrize("opcode, name", [(b"i", "INST"), (b"o", "OBJ"), (b"\x81", "NEWOBJ"), (b"\x92", "NEWOBJ_EX"),
                                          (b"\x82\x01", "EXT1"), (b"\x83\x01\x00", "EXT2"),
                                          (b"\x84\x01\x00\x00\x00", "EXT4"), (b"\x97", "NEXT_BUFFER"),
                                          (b"\x98", "READONLY_BUFFER")])
def test_object_building_opcodes_are_refused(tmp_path, opcode, name):
    path = torch_zip(tmp_path / "m.pt", b"\x80\x04" + b"N" + opcode + b".")
    refused(path, f"opcode {name}")


@pytest.mark.parametrize("body, needle", [
    (b"\x8c\x02os\x94\x8c\x06system\x94\x93", "'os.system'"),  # STACK_GLOBAL, protocol 4
    (b"\x8c\x02os\x940\x8c\x06system\x940h\x00h\x01\x93", "'os.system'"),  # both strings from the memo
    (b"N\x8c\x06system\x93", "STACK_GLOBAL without two strings"),
    (b"\x8c\x02os\x8c" + b"\x06system" + b"\x94\x93", "'os.system'"),
])
def test_stack_global_is_checked(tmp_path, body, needle):
    path = torch_zip(tmp_path / "m.pt", b"\x80\x04" + body + b")R.")
    refused(path, needle)


@pytest.mark.parametrize("body, needle", [
    (b"r\xff\xff\xff\x7fN", "memo index 2147483647"),  # the C unpickler would size its memo by it
    (b"N\x94h\x05", "memo entry 5 read before"),
    (b"j\x07\x00\x00\x00", "memo entry 7 read before"),
    (b"q\x00", "PUT with an empty stack"),
    (b"\x94", "empty stack"),
    (b"Np9\n", "memo index 9 (only 3 opcodes"),
    (b"g9\n", "memo entry 9 read before"),
    (b"gx\n", "not a small number"),
    (b"e", "needs a MARK"),
    (b"(e", "items added to nothing"),
    (b"Na", "APPEND with too few"),
    (b"NNs", "SETITEM with too few"),
    (b"\x85", "TUPLE with too few"),
    (b"NR", "REDUCE with too few"),
    (b"Nb", "BUILD with too few"),
    (b"Q", "BINPERSID with an empty stack"),
    (b"0", "POP with an empty stack"),
    (b"2", "DUP with an empty stack"),
    (b"N\x93", "STACK_GLOBAL with too few"),
    (b"NN", "does not hold exactly one object"),
    (b"\xff", "unknown opcode 0xff"),
    (b"\x80\x09N", "pickle protocol 9"),
    (b"T\xff\xff\xff\xffN", "negative length"),
    (b"\x8b\xff\xff\xff\xffN", "negative length"),
    (b"X\x02\x00\x00\x00\xff\xfe", "not UTF-8"),
    (b"X\xff\xff\xff\x00", "past the end of the pickle"),
    (b"\x95\xff\xff\x00\x00\x00\x00\x00\x00N", "a frame of"),
    (b"P0\n", "a persistent id that is not a storage"),
    (b"(0", "STOP with a stack"),  # POP of a MARK leaves nothing
])
def test_malformed_pickles_are_refused_by_the_scan(tmp_path, body, needle):
    path = torch_zip(tmp_path / "m.pt", b"\x80\x02" + body + b".")
    refused(path, needle)


@pytest.mark.parametrize("data", [b"\x80\x02", b"\x80\x02N", b"\x80\x02X\x05\x00", b"\x80\x02cos\n", b"\x80\x02K",
                                  b"\x80\x02q", b"\x80\x02h", b"\x80\x02r\x00", b"\x80\x02j\x00", b"\x80\x02\x8a",
                                  b"\x80\x02\x8a\x05\x00", b"\x80", b"\x80\x04\x95\x00"])
def test_truncated_pickles_are_refused(tmp_path, data):
    refused(torch_zip(tmp_path / "m.pt", data), "truncated")


def test_pickle_text_opcodes(tmp_path):
    # protocol 0 spellings: GLOBAL, INT, LONG, FLOAT, STRING, UNICODE, PUT/GET, DICT, LIST, TUPLE, POP, DUP, POP_MARK
    body = (b"(dp0\n" + b"S'w'\n" + tensor() + b"s" + b"S'n'\nI12\ns" + b"S'l'\nL99L\ns" + b"S'f'\nF1.5\ns"
            + b"S'u'\nVtext\ns" + b"S'x'\n(I1\nI2\nlp1\ns" + b"S'y'\ng1\ns" + b"S'z'\n(I1\ntN0s" + b"(NN1"
            + b"S'd'\nN20s")
    path = torch_zip(tmp_path / "m.pt", b"\x80\x02" + body + b".")
    contents = read_torch(path)
    assert list(contents.tensors) == ["w"] and contents.ignored == ["n", "l", "f", "u", "x", "y", "z", "d"]


@pytest.mark.parametrize("body, env, needle", [
    (b"\x8b\x20\x00\x00\x00" + b"\x01" * 32, {}, "FUSECTL_MAX_INTEGER_DIGITS"),
    (b"\x8b\x00\x01\x00\x00" + b"\x01" * 256, {}, "FUSECTL_MAX_INTEGER_DIGITS"),
    (b"I" + b"9" * 40 + b"\n", {}, "FUSECTL_MAX_INTEGER_DIGITS"),
    (b"(" + b"N" * 50 + b"l", {"FUSECTL_MAX_PICKLE_ITEMS": "10"}, "FUSECTL_MAX_PICKLE_ITEMS"),
    (b"]" + b"Na" * 20, {"FUSECTL_MAX_PICKLE_ITEMS": "10"}, "FUSECTL_MAX_PICKLE_ITEMS"),
    (b"}" + b"NNs" * 20, {"FUSECTL_MAX_PICKLE_ITEMS": "10"}, "FUSECTL_MAX_PICKLE_ITEMS"),
    (b"]" + (b"(" + b"N" * 6 + b"e") * 3, {"FUSECTL_MAX_PICKLE_ITEMS": "10"}, "FUSECTL_MAX_PICKLE_ITEMS"),
    (b"N" + b"\x85" * 70, {}, "FUSECTL_MAX_PICKLE_DEPTH"),
    (b"]" * 70 + b"a" * 69, {}, "FUSECTL_MAX_PICKLE_DEPTH"),
    (b"N" * 70000 + b"(" + b"l" + b"0" * 70000, {"FUSECTL_MAX_PICKLE_ITEMS": "60000"},
     "items waiting on the pickle stack"),
    (b"N0" * 70000 + b"N", {"FUSECTL_MAX_PICKLE_OPCODES": "1000"}, "FUSECTL_MAX_PICKLE_OPCODES"),
    (b"N0" * 10 + b"N", {"FUSECTL_MAX_PICKLE_OPCODES": "10"}, "FUSECTL_MAX_PICKLE_OPCODES"),
])
def test_pickle_budgets(tmp_path, monkeypatch, body, env, needle):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    path = torch_zip(tmp_path / "m.pt", b"\x80\x02" + body + b".")
    with time_limit(20):
        refused(path, needle)


def test_pickle_bytes_budget(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSECTL_MAX_PICKLE_BYTES", "100")
    body = pkl(dict_of((s("w"), tensor()), (s("pad"), s("x" * 200))))
    refused(torch_zip(tmp_path / "m.pt", body), "FUSECTL_MAX_PICKLE_BYTES")
    legacy = legacy_file(tmp_path / "l.pt", pkl(dict_of((s("w"), tensor(storage(legacy=True))), (s("pad"), s("x" * 200)))))
    refused(legacy, "FUSECTL_MAX_PICKLE_BYTES")


def test_keys_with_colliding_hashes_are_bounded(tmp_path):
    # integers k * (2**61 - 1) + 7 all hash to 7: each insertion into a dict scans every earlier
    # key, so 50,000 of them would keep the unpickler busy for about ten seconds (2,000,000 for hours)
    big = [(k * (2**61 - 1) + 7).to_bytes(10, "little") for k in range(1, 50_001)]
    body = b"}(" + b"".join(b"\x8a\x0a" + raw + b"N" for raw in big) + b"u"
    path = torch_zip(tmp_path / "m.pt", b"\x80\x02" + body + b".", compression=zipfile.ZIP_DEFLATED)
    with time_limit(60):  # a hang guard; the budget named in the refusal is what bounds the work
        refused(path, "FUSECTL_MAX_PICKLE_HASH_KEYS")


@pytest.mark.parametrize("body", [
    b"}(" + (b"G" + bytes(8) + b"N") * 11 + b"u",  # SETITEMS, float keys
    b"}" + (b"\x8a\x08" + bytes(8) + b"Ns") * 11,  # SETITEM, 8-byte integers
    b"(" + (b"F1.5\nN") * 11 + b"d",  # DICT, text floats
    b"(" + (b"I1234567890123456789\nN") * 11 + b"d",  # DICT, long text integers
    b"(" + (b"NN\x86") * 11 + b"\x91",  # FROZENSET of tuples
    b"\x8f(" + b"G" + bytes(8) + b"G" + bytes(8) + b"\x90" + b"(" + (b"G" + bytes(8)) * 9 + b"\x90",  # ADDITEMS
    b"}(" + (g("builtins", "complex") + tup(i(1), i(2)) + b"RN") * 11 + b"u",  # call results
])
def test_hash_key_budget_in_the_scan(tmp_path, monkeypatch, body):
    monkeypatch.setenv("FUSECTL_MAX_PICKLE_HASH_KEYS", "10")
    monkeypatch.setattr(torch_file._Loader, "load", _must_not_unpickle)
    refused(torch_zip(tmp_path / "m.pt", b"\x80\x04" + body + b"."), "FUSECTL_MAX_PICKLE_HASH_KEYS")


# a tuple holding one inner tuple 6 times, at each of 60 levels: a few hundred bytes, but hashing
# it visits 6**60 items (Python keeps no tuple hash), so as a dict key or set member it would hang
DAG_TUPLE = b"Nq\x000" + b"".join(b"(" + b"h\x00" * 6 + b"tq\x000" for _ in range(60)) + b"h\x00"


def test_a_tuple_that_is_costly_to_hash_is_no_key(tmp_path):
    with time_limit(10):
        refused(torch_zip(tmp_path / "m.pt", pkl(b"}" + DAG_TUPLE + b"Ns")), "FUSECTL_MAX_PICKLE_HASH_KEYS")
        as_member = g("builtins", "set") + tup(b"](" + DAG_TUPLE + b"e") + b"R"
        refused(torch_zip(tmp_path / "n.pt", pkl(dict_of((s("w"), tensor()), (s("x"), as_member)))),
                "FUSECTL_MAX_PICKLE_HASH_KEYS")
        # as a value it is harmless
        contents = read_torch(torch_zip(tmp_path / "o.pt", pkl(dict_of((s("w"), tensor()), (s("x"), DAG_TUPLE)))))
        assert contents.ignored == ["x"]


def test_hash_key_budget_of_sets_and_ordered_dicts(tmp_path, monkeypatch):
    floats = b"](" + b"".join(b"G" + struct.pack(">d", k + 0.5) for k in range(11)) + b"e"
    pairs = b"](" + b"".join(tup(b"G" + struct.pack(">d", k + 0.5), b"N") for k in range(11)) + b"e"
    strings = b"](" + b"".join(tup(s(f"k{k}"), i(k)) for k in range(11)) + b"e"
    monkeypatch.setenv("FUSECTL_MAX_PICKLE_HASH_KEYS", "10")
    for value in (g("builtins", "set") + tup(floats) + b"R", g("__builtin__", "frozenset") + tup(floats) + b"R",
                  g("collections", "OrderedDict") + tup(pairs) + b"R"):
        refused(torch_zip(tmp_path / "m.pt", pkl(dict_of((s("w"), tensor()), (s("x"), value)))),
                "FUSECTL_MAX_PICKLE_HASH_KEYS")
    fine = [g("collections", "OrderedDict") + tup(strings) + b"R", g("collections", "OrderedDict") + tup(b"}") + b"R",
            g("builtins", "set") + tup(b"](" + i(1) + i(2**40) + s("x") + b"\x88e") + b"R"]
    contents = read_torch(torch_zip(tmp_path / "n.pt", pkl(dict_of((s("w"), tensor()), *[(s(f"v{k}"), v)
                                                                                           for k, v in enumerate(fine)]))))
    assert contents.ignored == ["v0", "v1", "v2"]
    for value, needle in [(g("collections", "OrderedDict") + tup(b"N") + b"R", "an OrderedDict of something other"),
                          (g("collections", "OrderedDict") + tup(b"](" + tup(i(1)) + b"e") + b"R", "other than pairs")]:
        refused(torch_zip(tmp_path / "o.pt", pkl(dict_of((s("x"), value)))), needle)


def test_a_deep_tuple_key_cannot_crash_the_process(tmp_path):
    # without the scan's depth budget, hashing this key overflows CPython's C stack (SIGSEGV)
    body = b"}N" + b"\x85" * 100_000 + b"Ns"
    refused(torch_zip(tmp_path / "m.pt", b"\x80\x02" + body + b".", compression=zipfile.ZIP_DEFLATED),
            "FUSECTL_MAX_PICKLE_DEPTH")


def test_dicts_nested_through_the_memo_are_bounded(tmp_path):
    # the scan sees each dict filled while its children are still empty; the walk finds the depth
    dicts = b"".join(b"}r" + struct.pack("<I", k) for k in range(80))
    links = b"".join(b"j" + struct.pack("<I", k) + s("d") + b"j" + struct.pack("<I", k + 1) + b"s0" for k in range(79))
    body = dicts + b"0" * 79 + links
    message = refused(torch_zip(tmp_path / "m.pt", b"\x80\x02" + body + b"."), "FUSECTL_MAX_PICKLE_DEPTH")
    assert "d.d.d" in message


def test_dict_cycles_are_walked_once(tmp_path):
    body = b"}q\x00(" + s("w") + tensor() + s("self") + b"h\x00" + s("again") + b"h\x00u"
    contents = read_torch(torch_zip(tmp_path / "m.pt", pkl(body)))
    assert list(contents.tensors) == ["w"] and contents.ignored == ["self", "again"]
    assert contents.candidates == {(): 1}
    assert read_torch(torch_zip(tmp_path / "m.pt", pkl(body)), "self").key == "self"


@pytest.mark.parametrize("value, needle", [
    (tensor(size=(8,)), "reaches byte 32 of its storage '0', which holds 16"),
    (tensor(offset=1), "reaches byte 20"),
    (tensor(size=(2, 2), stride=(3, 1)), "reaches byte 20"),
    (tensor(size=(2,), stride=(-1,)), "strides (-1,) is not a tuple of whole numbers"),
    (tensor(raw_size=tup(s("x"))), "shape ('x',) is not a tuple"),
    (tensor(size=(2, 2), stride=(1,)), "two tuples of one length"),
    (tensor(raw_size=b"N"), "two tuples of one length"),
    (tensor(offset=-1), "storage offset -1 is not a whole number"),
    (g("torch._utils", "_rebuild_tensor") + tup(storage(), b"}", tup(i(1)), tup(i(1))) + b"R",
     "storage offset dict is not"),
    (tensor(raw_size=tup(*[i(1)] * 8), raw_stride=tup(*[i(1)] * 7, s("x"))), "(1, 1, 1, 1, 1, 1, ...) is not"),
    # a tuple that holds itself 6 times, 60 levels deep: shown one level deep, not 6**60 times
    (tensor(raw_size=b"Nq\x000" + b"".join(b"(" + b"h\x00" * 6 + b"tq\x000" for _ in range(60)) + b"h\x00\x85",
            raw_stride=tup(i(1))), "shape ((...),) is not"),
    (tensor(raw_size=b"](" + i(1) + b"]e\x85", raw_stride=tup(i(1))), "shape ([...],) is not"),
    (tensor(raw_size=tup(i(2**70)), raw_stride=tup(i(1))), "is not a tuple of whole numbers"),
    (tensor(size=(1,) * 65, stride=(1,) * 65), "65 dimensions of one tensor, but numpy"),  # more than any holds
    (tensor(extra=b"}" + s("conj") + b"\x88s"), "a conjugate view of a F32 tensor"),
    (tensor(storage(cls="ByteStorage", numel=16), extra=b"}" + s("neg") + b"\x88s"), "a negative view of a U8"),
    (tensor(extra=b"}" + s("sparse") + b"\x88s"), "metadata other than PyTorch's conj/neg"),
    (tensor(extra=s("x")), "metadata other than"),
    (g("torch._utils", "_rebuild_tensor_v3") + tup(storage(module="torch.storage", cls="UntypedStorage", numel=16),
                                                   i(0), tup(i(1)), tup(i(1)), b"\x89", OD, g("torch", "complex128"))
     + b"R", "dtype torch.complex128 is not one fusectl reads"),
    (tup(storage(), i(0)) + b"0" + g("torch._utils", "_rebuild_tensor") + tup(s("x"), i(0), tup(i(1)), tup(i(1)))
     + b"R", "its storage is not a storage reference"),
])
def test_tensor_records_are_checked(tmp_path, value, needle):
    path = torch_zip(tmp_path / "m.pt", pkl(dict_of((s("w"), value))), {"0": FLOATS4 * 4} if "ByteStorage" in str(value)
                     else None)
    message = refused(path, needle)
    assert "'w'" in message or "DIMS" in message or "complex128" in message


@pytest.mark.parametrize("value, needle", [
    (g("torch._utils", "_rebuild_parameter") + tup(i(1), b"\x88", OD) + b"R", "a Parameter whose data is not a tensor"),
    (g("torch._tensor", "_rebuild_from_type_v2") + tup(g("torch", "Size"), g("torch", "Tensor"), tup(), b"}") + b"R",
     "without a tensor rebuild function"),
    (g("torch._tensor", "_rebuild_from_type_v2") + tup(g("torch._utils", "_rebuild_tensor_v2"), g("torch", "FloatStorage"),
                                                       tup(), b"}") + b"R", "a tensor subclass"),
    (g("torch._tensor", "_rebuild_from_type_v2") + tup(g("torch._utils", "_rebuild_tensor_v2"), g("torch", "Tensor"),
                                                       b"N", b"}") + b"R", "without an argument tuple"),
    (g("torch._utils", "_rebuild_tensor_v3") + tup(storage(), i(0), tup(i(1)), tup(i(1)), b"\x89", OD, b"N") + b"R",
     "_rebuild_tensor_v3 without a dtype"),
    (g("torch._utils", "_rebuild_tensor_v2") + tup(storage()) + b"R", "_rebuild_tensor_v2 called with 1 arguments"),
    (tensor() + b"}b", "BUILD on a tensor"),
    (storage() + b"}b", "BUILD on a storage"),
    (g("torch", "FloatStorage") + b"}b", "BUILD on torch.FloatStorage"),
    (g("torch", "Size") + b"}b", "BUILD on torch.Size"),
    (OD + b"Nb", "an OrderedDict with a state that is not a dict"),
    (g("torch", "Size") + tup(s("x")) + b"R", "torch.Size of something other than whole numbers"),
    (g("builtins", "set") + tup(i(5)) + b"R", "a set of something other than a list"),
    (g("__builtin__", "complex") + tup(s("1"), i(0)) + b"R", "a complex number of something other than numbers"),
    (g("_codecs", "encode") + tup(s("x"), s("rot13")) + b"R", "_codecs.encode other than"),
    (g("torch", "FloatStorage") + tup() + b"R", "not callable"),
    (s("not a pid") + b"Q", "a persistent id that is not a storage"),
    (tup(s("module"), i(1), i(2), i(3), i(4)) + b"Q", "a persistent id that is not a storage"),
    (tup(s("storage"), g("torch", "float32"), s("0"), s("cpu"), i(4)) + b"Q", "whose type is not a storage class"),
    (tup(s("storage"), g("torch", "FloatStorage"), i(0), s("cpu"), i(4)) + b"Q", "not (type, key, location, size)"),
    (tup(s("storage"), g("torch", "FloatStorage"), s("0"), s("cpu"), i(4), tup(s("0"), i(0), i(4))) + b"Q",
     "a storage view (written by PyTorch before 1.0"),
    (tup(s("storage"), g("torch", "ComplexDoubleStorage"), s("0"), s("cpu"), i(4)) + b"Q",
     "is a torch.ComplexDoubleStorage, a dtype fusectl does not read"),
    (tup(storage(), storage(numel=2)), "referenced as two different storages"),
    (tup(storage(), storage(cls="IntStorage")), "referenced as two different storages"),
    (b"}" + b"]" + b"Ns", "corrupt pickle (TypeError"),  # an unhashable key
])
def test_what_the_loader_refuses(tmp_path, value, needle):
    refused(torch_zip(tmp_path / "m.pt", pkl(dict_of((s("w"), value)))), needle)


def test_plain_values_beside_the_tensors(tmp_path):
    values = [
        (s("size"), g("torch", "Size") + tup(tup(i(2), i(3))) + b"R"),
        (s("set"), g("builtins", "set") + tup(b"](" + i(1) + i(2) + b"e") + b"R"),
        (s("frozen"), g("builtins", "frozenset") + tup(tup(i(1))) + b"R"),
        (s("z"), g("builtins", "complex") + tup(i(1), i(2)) + b"R"),
        (s("bytes"), g("_codecs", "encode") + tup(s("\u00ff\u0000"), s("latin1")) + b"R"),
        (s("param"), g("torch._utils", "_rebuild_parameter_with_state")
         + tup(tensor(), b"\x88", OD, b"}" + s("note") + i(1) + b"s") + b"R"),
        (s("typed"), g("torch._tensor", "_rebuild_from_type_v2")
         + tup(g("torch._utils", "_rebuild_tensor_v2"), g("torch", "Tensor"),
               tup(storage(), i(0), tup(i(2)), tup(i(1)), b"\x89", OD), b"}") + b"R"),
        (s("old"), g("torch._utils", "_rebuild_tensor") + tup(storage(), i(2), tup(i(2)), tup(i(1))) + b"R"),
        (s("module_metadata"), OD + b"}" + s("_metadata") + b"}sb"),
        (s("frozen_strings"), b"(" + s("a") + s("b") + b"\x91"),
        (i(7), tensor(size=(1,))),
        (b"N", tensor()),
    ]
    contents = read_torch(torch_zip(tmp_path / "m.pt", pkl(dict_of(*values))))
    assert list(contents.tensors) == ["param", "typed", "old", "7"] and contents.aliases == {}
    assert contents.ignored == ["size", "set", "frozen", "z", "bytes", "module_metadata", "frozen_strings", "None"]
    assert contents.tensors["old"].read().tolist() == [3.25, 4.0]


def test_int_keys_become_names_and_must_not_collide(tmp_path):
    path = torch_zip(tmp_path / "m.pt", pkl(dict_of((i(0), tensor()), (s("0"), tensor(size=(2,))))))
    refused(path, "two entries are named '0'")


def test_tensor_names_are_checked(tmp_path, monkeypatch):
    refused(torch_zip(tmp_path / "m.pt", pkl(dict_of((s("bad\udc80"), tensor())))), "lone UTF-16 surrogate")
    monkeypatch.setenv("FUSECTL_MAX_NAME_BYTES", "40")
    refused(torch_zip(tmp_path / "n.pt", pkl(dict_of((s("n" * 50), tensor())))), "FUSECTL_MAX_NAME_BYTES")
    refused(torch_zip(tmp_path / "k.pt", pkl(dict_of((s("w"), tensor(storage(key="k" * 50)))))),
            "FUSECTL_MAX_NAME_BYTES")
    monkeypatch.setenv("FUSECTL_MAX_TENSORS", "1")
    refused(torch_zip(tmp_path / "t.pt", pkl(dict_of((s("a"), tensor()), (s("b"), tensor(size=(2,)))))),
            "FUSECTL_MAX_TENSORS")


@pytest.mark.parametrize("body, needle", [
    (tensor(), "a single tensor, with no name"),
    (b"](" + tensor() + b"e", "a list"),
    (tup(tensor()), "a tuple"),
    (i(3), "a int"),
    (b"}", "a dict"),
    (dict_of((s("optimizer"), dict_of((s("w"), tensor())))), "optimizer state does not count"),
])
def test_files_without_a_state_dict(tmp_path, body, needle):
    message = refused(torch_zip(tmp_path / "m.pt", pkl(body)), "holds no dict of tensors", needle)
    assert ("optimizer state" in message) == ("optimizer" in needle)


def test_scalar_only_candidates(tmp_path):
    # no dict holds a tensor of one dimension or more: a single dict of scalars is still read
    scalar = tensor(size=(), stride=())
    path = torch_zip(tmp_path / "m.pt", pkl(dict_of((s("a"), dict_of((s("step"), scalar))))))
    assert read_torch(path).key == "a"
    many = torch_zip(tmp_path / "n.pt", pkl(dict_of(*[(s(f"k{n}"), dict_of((s("s"), scalar))) for n in range(25)])))
    message = refused(many, "holds several dicts of tensors", "and 5 more")
    assert message.count("(1 tensors)") == 20


def test_expanded_views_are_bounded(tmp_path, monkeypatch):
    # a stride of 0 lets 16 stored bytes describe a tensor of any size: reading it makes them all
    huge = tensor(size=(2**40,), stride=(0,))
    refused(torch_zip(tmp_path / "m.pt", pkl(dict_of((s("w"), huge)))), "'w'", "FUSECTL_MAX_EXPANDED_BYTES")
    small = tensor(size=(3, 4), stride=(0, 1))
    contents = read_torch(torch_zip(tmp_path / "n.pt", pkl(dict_of((s("w"), small)))))
    assert contents.tensors["w"].read().tolist() == [[1.5, -2.0, 3.25, 4.0]] * 3
    monkeypatch.setenv("FUSECTL_MAX_EXPANDED_BYTES", "47")
    refused(str(tmp_path / "n.pt"), "FUSECTL_MAX_EXPANDED_BYTES=48")


def test_empty_tensors_need_no_bytes(tmp_path):
    body = dict_of((s("e"), tensor(storage(numel=0), size=(0, 3), stride=(3, 1))),
                   (s("far"), tensor(storage(key="1"), offset=100, size=(2, 0), stride=(1, 1))))
    contents = read_torch(torch_zip(tmp_path / "m.pt", pkl(body), {"0": b"", "1": FLOATS4}))
    assert contents.tensors["e"].read().shape == (0, 3) and contents.tensors["far"].read().shape == (2, 0)
    assert contents.tensors["e"].byte_ranges()[0].length == 0
    view = TorchViewTensor(contents.tensors["e"].spec, None, 0, (3, 1))
    assert view.read().shape == (0, 3)


def test_big_endian_uint16_on_an_untyped_storage_is_refused():
    # torch.save stores uint16/32/64 (and fp8) tensors on an UntypedStorage; torch.load swaps a
    # big-endian storage by the storage's dtype (uint8 there): it returns these values unswapped,
    # not what the big-endian writer saved (the generator checks both), so no answer is right
    path = str(fixture("bad-big-endian-uint16"))
    refused(path, "tensor 'u16'", "a U16 tensor on a storage of 1-byte elements in a big-endian file",
            "torch.load leaves its bytes as they are", "save the state dict with safetensors")


def test_big_endian_fp8_on_an_untyped_storage_is_read():
    # one byte per element: nothing to swap, as torch.load (the fixture's expected tensors) agrees
    contents = read_torch(str(fixture("big-endian-fp8")))
    assert {n for n, t in contents.tensors.items() if t.byte_ranges() is not None} == {"f8_e4m3", "f8_e5m2", "f8_e8m0"}
    assert contents.tensors["f32"].read().tolist() == [1.0, -2.0, 3.5]


@pytest.mark.parametrize("cls, dtype, record", [
    ("UntypedStorage", "uint16", b"\x01\x00\x02\x00\xff\xff"),  # issue 18: torch.load reads [1, 2, 65535]
    ("UntypedStorage", "uint32", bytes(12)),
    ("UntypedStorage", "uint64", bytes(24)),
    ("FloatStorage", "int16", bytes(6)),  # torch would reverse groups of 4 bytes, then read 2-byte numbers
])
def test_big_endian_tensors_whose_storage_differs_in_width_are_refused(tmp_path, cls, dtype, record):
    module = "torch.storage" if cls == "UntypedStorage" else "torch"
    numel = len(record) if cls == "UntypedStorage" else len(record) // 4 + 1
    value = g("torch._utils", "_rebuild_tensor_v3") + tup(
        storage(module=module, cls=cls, numel=numel), i(0), tup(i(3)), tup(i(1)), b"\x89", OD, g("torch", dtype)) + b"R"
    data = record if cls == "UntypedStorage" else record + bytes(numel * 4 - len(record))
    path = torch_zip(tmp_path / "m.pt", pkl(dict_of((s("u"), value))), {"0": data}, byteorder=b"big")
    refused(path, "tensor 'u'", "in a big-endian file", "refuses rather than guess")
    little = torch_zip(tmp_path / "l.pt", pkl(dict_of((s("u"), value))), {"0": data})
    assert read_torch(little).tensors["u"].read().shape == (3,)  # little-endian: the bytes are what they are


def test_legacy_protocol_0_is_refused_as_what_it_is(tmp_path):
    message = refused(str(fixture("bad-legacy-protocol0")), "written with pickle protocol 0",
                      "torch.load cannot read such a file either", "save it again with torch.save's default protocol")
    assert "not a PyTorch checkpoint" not in message
    # the same in a zip (torch.save(..., pickle_protocol=0)): a text persistent id
    body = b"(dp0\nVw\np1\n" + g("torch._utils", "_rebuild_tensor_v2") + b"(P('storage', <class 'torch.FloatStorage'>, '0', 'cpu', 4, None)\nI0\n(I4\nt(I1\ntI00\n" \
        + g("collections", "OrderedDict") + b"(tRtRs."
    refused(torch_zip(tmp_path / "z.pt", body), "written with pickle protocol 0")


def test_legacy_protocol_1_is_read_where_torch_weights_only_refuses():
    # torch.load(weights_only=True) knows only protocol 2's opcodes; the fixture's expected
    # tensors come from torch.load(weights_only=False) on this file, which torch wrote itself
    raw = fixture("legacy-protocol1").read_bytes()
    assert raw.startswith(b"L119547037146038801333356L\n.M\xe9\x03.")  # the magic number as text, then 1001
    contents = read_torch(str(fixture("legacy-protocol1")))
    assert list(contents.tensors) == ["w", "w_t", "ids", "half"]


# ------------------------------------------------------------------------------ containers


def test_not_a_torch_file(tmp_path):
    for name, data in [("empty.pt", b""), ("text.pt", b"hello world"), ("npz.pt", None)]:
        path = tmp_path / name
        if data is None:
            np.savez(path.with_suffix(".npz"), a=np.zeros(2))
            path.with_suffix(".npz").rename(path)
        else:
            path.write_bytes(data)
        message = refused(str(path), "not a torch.save checkpoint" if data is None else "not a PyTorch checkpoint")
        if data is not None:
            assert ("(the file is empty;" if not data else "(the file starts with b'hell';") in message, message
    refused(str(tmp_path / "missing.pt"), "no such file")
    refused(str(tmp_path), "not a regular file")


@pytest.mark.filterwarnings("ignore:Duplicate name")
def test_zip_structure_errors(tmp_path):
    good = pkl(dict_of((s("w"), tensor())))
    refused(torch_zip(tmp_path / "a.pt", good, byteorder=b"middle"), "byteorder record says b'middle'")
    refused(torch_zip(tmp_path / "h.pt", good, byteorder=b"little" * 10), "holds 60 bytes, not a byte order")
    refused(torch_zip(tmp_path / "b.pt", good, records={}), "'archive/data/0' is missing")
    refused(torch_zip(tmp_path / "c.pt", good, records={"0": FLOATS4 + b"xx"}), "holds 18 bytes", "declares")
    refused(torch_zip(tmp_path / "d.pt", good, extra=[("archive/data.pkl", good)]), "two records 'archive/data.pkl'")
    with zipfile.ZipFile(tmp_path / "e.pt", "w") as zf:
        zf.writestr("data.pkl", good)
    refused(str(tmp_path / "e.pt"), "without a data.pkl record")
    with zipfile.ZipFile(tmp_path / "f.pt", "w") as zf:
        zf.writestr("archive/other", b"")
    refused(str(tmp_path / "f.pt"), "without a data.pkl record")
    refused(torch_zip(tmp_path / "g.pt", b"\x80\x02" + g("os", "system") + b"."), "'os.system'")


def _patch_central(path: str, member: str, offset: int, value: bytes) -> None:
    raw = bytearray(Path(path).read_bytes())
    at = raw.find(b"PK\x01\x02")
    while at >= 0:
        name_len = struct.unpack("<H", raw[at + 28:at + 30])[0]
        if raw[at + 46:at + 46 + name_len] == member.encode():
            raw[at + offset:at + offset + len(value)] = value
            Path(path).write_bytes(bytes(raw))
            return
        at = raw.find(b"PK\x01\x02", at + 4)
    raise AssertionError(member)


def test_zip_member_errors(tmp_path):
    good = pkl(dict_of((s("w"), tensor())))
    encrypted = torch_zip(tmp_path / "a.pt", good)
    _patch_central(encrypted, "archive/data/0", 8, b"\x01\x00")  # general purpose flags: encrypted
    refused(encrypted, "'w'", "is encrypted")
    method = torch_zip(tmp_path / "b.pt", good, compression=zipfile.ZIP_DEFLATED)
    _patch_central(method, "archive/data/0", 10, b"\x63\x00")  # compression method 99
    refused(method, "'w'", "compression method 99")
    moved = torch_zip(tmp_path / "c.pt", good)
    with zipfile.ZipFile(moved) as zf:
        at = zf.getinfo("archive/data/0").header_offset
    # local header offset: 5 bytes into its own header, not a header. (Pointing it into another
    # record would overlap that one, which Python 3.13's zipfile refuses when that one is read.)
    _patch_central(moved, "archive/data/0", 42, struct.pack("<I", at + 5))
    refused(moved, "'w'", "corrupt zip header")
    with zipfile.ZipFile(tmp_path / "c.pt") as zf:  # the pickle and other records are intact
        assert zf.read("archive/data.pkl") == good


def test_compressed_records(tmp_path, monkeypatch):
    good = pkl(dict_of((s("w"), tensor())))
    path = torch_zip(tmp_path / "a.pt", good, compression=zipfile.ZIP_DEFLATED)
    contents = read_torch(path)
    assert contents.tensors["w"].byte_ranges() is None
    assert contents.tensors["w"].read().tolist() == [1.5, -2.0, 3.25, 4.0]
    monkeypatch.setenv("FUSECTL_MAX_DECOMPRESSED_BYTES", "8")
    refused(path, "FUSECTL_MAX_DECOMPRESSED_BYTES")


def test_a_corrupt_compressed_pickle(tmp_path):
    path = torch_zip(tmp_path / "a.pt", pkl(dict_of((s("w"), tensor()))), compression=zipfile.ZIP_DEFLATED)
    raw = bytearray(Path(path).read_bytes())
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("archive/data.pkl")
    start = info.header_offset + 30 + len(info.filename)
    raw[start:start + 4] = b"\xff\xff\xff\xff"
    Path(path).write_bytes(bytes(raw))
    refused(path, "'archive/data.pkl' cannot be read")


def test_data_that_changes_after_reading_the_header(tmp_path):
    stored = Path(torch_zip(tmp_path / "a.pt", pkl(dict_of((s("w"), tensor(size=(2, 2), stride=(1, 2)))))))
    contents = read_torch(str(stored))
    stored.write_bytes(stored.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated or changed"):
        contents.tensors["w"].read()
    stored.unlink()
    with pytest.raises(CheckpointError, match="cannot read it"):
        contents.tensors["w"].read()
    deflated = Path(torch_zip(tmp_path / "b.pt", pkl(dict_of((s("w"), tensor()))), compression=zipfile.ZIP_DEFLATED))
    contents = read_torch(str(deflated))
    deflated.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot be decompressed"):
        contents.tensors["w"].read()
    torch_zip(deflated, pkl(dict_of((s("w"), tensor()))), records={"0": b"\x00"}, compression=zipfile.ZIP_DEFLATED)
    with pytest.raises(CheckpointError, match="ended after 1 bytes"):
        contents.tensors["w"].read()


def test_legacy_structure_errors(tmp_path):
    main = pkl(dict_of((s("w"), tensor(storage(legacy=True)))))
    refused(legacy_file(tmp_path / "a.pt", main, magic=12345), "no magic number")
    refused(legacy_file(tmp_path / "b.pt", main, version=1000), "not version 1001")
    refused(legacy_file(tmp_path / "c.pt", main, keys=pkl(s("0"))), "not a list of strings")
    refused(legacy_file(tmp_path / "d.pt", main, keys=pkl(b"](" + s("0") + s("1") + b"e")), "does not match")
    refused(legacy_file(tmp_path / "e.pt", main, storages=[("0", -1, b"")]), "holds -1 elements")
    refused(legacy_file(tmp_path / "f.pt", main, storages=[]), "does not match")
    cut = legacy_file(tmp_path / "g.pt", main)
    Path(cut).write_bytes(Path(cut).read_bytes()[:-18])  # into the storage's count
    refused(cut, "'w'", "past the end of the file")
    refused(legacy_file(tmp_path / "h.pt", pkl(g("collections", "OrderedDict")), keys=b"", storages=[]), "truncated")
    with_global = tmp_path / "i.pt"
    with_global.write_bytes(pkl(OD))
    refused(str(with_global), "no magic number")
    refused(legacy_file(tmp_path / "j.pt", main, keys=pkl(b"](" + s("0") + b"e" + OD + b"0")), "which fusectl refuses")
    refused(legacy_file(tmp_path / "k.pt", main, keys=pkl(s("x") + b"Q")), "a persistent id that is not a storage")


def test_legacy_files_larger_than_the_first_read(tmp_path):
    names = [(s(f"w{n}" + "x" * 2000), tensor(storage(legacy=True))) for n in range(5000)]
    path = legacy_file(tmp_path / "a.pt", pkl(dict_of(*names)))
    assert os.path.getsize(path) > 8 << 20
    contents = read_torch(path)
    assert len(contents.tensors) == 1 and len(contents.aliases) == 4999


# ------------------------------------------------------------------------------ truncations


def _survives(path: str) -> None:
    try:
        contents = read_torch(path)
        read_all(contents)
    except CheckpointError:
        pass


def test_truncations_of_every_good_file(tmp_path):
    path = tmp_path / "cut.pt"
    with time_limit(60):
        for stem in GOOD:
            data = fixture(stem).read_bytes()
            for cut in sorted({1, 4, 30, len(data) // 3, len(data) // 2, len(data) - 30, len(data) - 1}):
                path.write_bytes(data[:cut])
                _survives(str(path))


# --------------------------------------------------------------- records: classes a format allows


@dataclasses.dataclass
class _Chunk:  # pickled by its module and name: read back only where a Records names it
    offsets: tuple
    sizes: tuple


def test_a_record_class_is_read_as_its_name_arguments_and_state():
    from fusectl.io.formats.torch_file import Record, Records, read_pickle
    name = f"{__name__}._Chunk"
    data = pickle.dumps({"c": _Chunk((0, 4), (4, 8)), "e": enum_value()}, protocol=4)
    got = read_pickle(data, "m", Records((name, f"{__name__}._Stage")))
    assert isinstance(got["c"], Record) and got["c"].name == name
    assert got["c"].state == {"offsets": (0, 4), "sizes": (4, 8)} and got["c"].field("sizes") == (4, 8)
    assert got["e"].name == f"{__name__}._Stage" and got["e"].args == (2,)
    with pytest.raises(CheckpointError, match=f"'{name}', which fusectl refuses"):
        read_pickle(data, "m", Records((f"{__name__}._Stage",)))  # the same pickle, the class not allowed


class _Stage(enum.IntEnum):
    TWO = 2


def enum_value():
    return _Stage.TWO


def test_newobj_is_refused_for_any_global_not_allowed_as_a_record():
    from fusectl.io.formats.torch_file import Records, read_pickle
    newobj_of_size = b"\x80\x04\x8c\x05torch\x8c\x04Size\x93)\x81."  # torch.Size.__new__(torch.Size)
    with pytest.raises(CheckpointError, match="opcode NEWOBJ"):
        read_pickle(newobj_of_size, "m", Records(()))
    with pytest.raises(CheckpointError, match="opcode NEWOBJ"):  # a record class given arguments
        read_pickle(b"\x80\x04\x8c\x01a\x8c\x01B\x93K\x01\x85\x81.", "m", Records(("a.B",)))
    with pytest.raises(CheckpointError, match="storage"):  # a bare pickle references no storage
        read_pickle(b"\x80\x04(\x8c\x07storageN\x8c\x01kN\x8c\x03cpuK\x00tQ.", "m", Records(()))


def test_a_torch_save_zip_inside_a_larger_file_is_read_at_its_span(tmp_path):
    """One item of a DCP .distcp file: a whole torch.save archive at an offset; its tensors are
    ranges of the larger file, and a span past the file's end or onto other bytes is refused."""
    from fusectl.io.formats.torch_file import read_torch_tree
    from fusectl.io.formats.torch_writer import write_torch_file
    from fusectl.tensors import ArrayTensor, TensorSpec
    from fusectl import dtypes
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    write_torch_file(str(tmp_path / "item.pt"), {"w": ArrayTensor(TensorSpec(dtypes.BY_NAME["F32"], (3, 4)), array)},
                     metadata={})
    item = (tmp_path / "item.pt").read_bytes()
    big = tmp_path / "__0_0.distcp"
    big.write_bytes(b"x" * 1000 + item + b"y" * 500)
    tree, _ = read_torch_tree(str(big), span=(1000, len(item)))
    assert tree["w"].byte_ranges()[0].offset > 1000
    np.testing.assert_array_equal(tree["w"].read(), array)
    with pytest.raises(CheckpointError, match="runs past the end of the file"):
        read_torch_tree(str(big), span=(1000, len(item) + 501))
    with pytest.raises(CheckpointError, match="is not a torch.save archive"):
        read_torch_tree(str(big), span=(999, len(item)))
