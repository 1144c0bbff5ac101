"""Pickles that build far more than their size: the ``pickle-memory`` budget (issue 18, item 5).

The memo lets a few bytes name one large object again and again, and the allowed calls copy
what they are given, so a 2 MB pickle that calls ``torch.Size`` 400 times on one memoized list
of a million numbers would build 3 GB. fusectl's scan counts every object an opcode or a call
would build, sized from what the call is given, and refuses the file before anything is
unpickled. The hostile pickles are written here by hand, opcode by opcode.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import OWN_PEAK_KB, time_limit
from fusectl.errors import CheckpointError
from fusectl.io.formats import torch_file
from fusectl.io.formats.torch_file import read_torch
from test_torch_reader import OD, dict_of, g, i, legacy_file, pkl, refused, s, storage, tensor, torch_zip

ROOT = Path(__file__).resolve().parent.parent
BUDGET = "FUSECTL_MAX_PICKLE_MEMORY"


def memoized(value: bytes) -> bytes:
    """``value`` put in memo slot 0 and popped: ``GET0`` names it again."""
    return value + b"r\x00\x00\x00\x00" + b"0"


GET0 = b"j\x00\x00\x00\x00"


def calls(function: bytes, args: bytes, times: int) -> bytes:
    """A list of ``times`` results of ``function(*args)``."""
    return b"(" + (function + args + b"R") * times + b"l"


def with_junk(junk: bytes) -> bytes:
    """A state dict with one good tensor and ``junk`` beside it."""
    return pkl(dict_of((s("w"), tensor()), (s("junk"), junk)))


def int_list(n: int) -> bytes:
    return b"(" + b"K\x01" * n + b"l"


def distinct_int_list(n: int) -> bytes:
    return b"(" + b"".join(b"J" + struct.pack("<i", k) for k in range(n)) + b"l"


def text(n: int) -> bytes:
    return b"X" + struct.pack("<I", n) + b"a" * n


# ------------------------------------------------------------------------------ the three bombs of the issue

_MEASURE = f"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # keeps a run of older code from taking the machine
from fusectl.cli import main
sys.argv = ["fusectl", "inspect", sys.argv[1]]
try:
    main()
finally:
    print("peak_kb", {OWN_PEAK_KB}, file=sys.stderr)
"""


def bomb(path: Path, body: bytes) -> Path:
    torch_zip(path, body)
    return path


BOMBS = {
    # 400 calls of torch.Size on one memoized list of 1,000,000 ones: 3.2 GB from 2 MB
    "size": lambda: with_junk(memoized(int_list(1_000_000)) + calls(g("torch", "Size"), GET0 + b"\x85", 400)),
    # 300 latin-1 encodings of one memoized 8 MB string: 2.4 GB
    "encode": lambda: with_junk(memoized(text(8_000_000)) + calls(g("_codecs", "encode"), GET0 + s("latin1") + b"\x86",
                                                                  300)),
    # 40 sets of one memoized list of 1,000,000 distinct numbers: 1.4 GB from 5 MB
    "set": lambda: with_junk(memoized(distinct_int_list(1_000_000)) + calls(g("builtins", "set"), GET0 + b"\x85", 40)),
    # no call at all: 4,300,000 empty sets (232 bytes each) from 4.3 MB
    "empty-sets": lambda: with_junk(b"(" + (b"(" + b"\x8f" * 1_900_000 + b"l") * 2 + b"(" + b"\x8f" * 500_000 + b"l"
                                    + b"l"),
}


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_memory_bombs_exit_2_with_little_memory(tmp_path, name):
    path = bomb(tmp_path / f"{name}.pt", BOMBS[name]())
    assert os.path.getsize(path) < 10_000_000
    result = subprocess.run([sys.executable, "-c", _MEASURE, str(path)], capture_output=True, text=True, timeout=300,
                            cwd=ROOT)
    lines = result.stderr.strip().splitlines()
    peak_kb = int(lines[-1].split()[1])
    assert result.returncode == 2, result.stderr[-2000:]
    assert lines[0].startswith(f"error: {path}") and BUDGET in lines[0], lines[0]
    assert "bytes of objects that unpickling a PyTorch checkpoint would build" in lines[0]
    assert peak_kb < 1 << 20, peak_kb  # 1 GiB: no .pt under 10 MB may take more
    assert not list(tmp_path.glob("*fusectl*"))


def test_a_child_measures_its_own_peak_not_the_one_it_was_forked_from():
    """What the bombs above read: a parent that held 300 MB starts a child, whose own peak is
    the interpreter's (its ru_maxrss would say 300 MB: a forked child inherits the peak)."""
    child = f"print({OWN_PEAK_KB})"
    parent = ("import subprocess, sys; held = bytearray(300 << 20); held[::4096] = bytes(len(held[::4096]) * [1]);"
              f"print(subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True).stdout)")
    done = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert 1_000 < int(done.stdout) < 100_000, done.stdout  # kB


# ------------------------------------------------------------------------------ every allowed call, in the scan


def _must_not_unpickle(self):
    raise AssertionError("the pickle was unpickled: the scan should have refused it first")


def amplified(function: bytes, argument: bytes, extra: bytes = b"", times: int = 50) -> bytes:
    return with_junk(memoized(argument) + calls(function, b"(" + GET0 + extra + b"t", times))


PAIRS = b"(" + b"(K\x01K\x02t" * 20_000 + b"l"
CASES = {
    "torch.Size": amplified(g("torch", "Size"), int_list(20_000)),
    "builtins.set": amplified(g("builtins", "set"), int_list(20_000)),
    "builtins.frozenset": amplified(g("builtins", "frozenset"), int_list(20_000)),
    "__builtin__.set": amplified(g("__builtin__", "set"), int_list(20_000)),
    "__builtin__.frozenset": amplified(g("__builtin__", "frozenset"), int_list(20_000)),
    "collections.OrderedDict of pairs": amplified(g("collections", "OrderedDict"), PAIRS),
    "collections.OrderedDict of a dict": amplified(g("collections", "OrderedDict"),
                                                   b"}(" + b"".join(i(k) + b"N" for k in range(20_000)) + b"u"),
    "_codecs.encode": amplified(g("_codecs", "encode"), text(200_000), s("latin1")),
    "APPENDS onto a memoized list": with_junk(memoized(b"]") + (GET0 + b"(" + b"K\x01" * 10_000 + b"e0") * 40
                                              + GET0),
    "SETITEMS onto a memoized dict": with_junk(memoized(b"}") + (GET0 + b"(" + b"".join(i(k) + b"N" for k in range(5_000))
                                                                 + b"u0") * 20 + GET0),
    "ADDITEMS onto a memoized set": with_junk(memoized(b"\x8f") + (GET0 + b"(" + b"".join(i(k) for k in range(5_000))
                                                                   + b"\x900") * 20 + GET0),
    "ADDITEMS onto a set a call made": with_junk(memoized(g("builtins", "set") + b")R")
                                                 + (GET0 + b"(" + b"".join(i(k) for k in range(5_000)) + b"\x900") * 20
                                                 + GET0),
    "SETITEMS onto an OrderedDict": with_junk(memoized(OD) + (GET0 + b"(" + b"".join(i(k) + b"N" for k in range(5_000))
                                                              + b"u0") * 20 + GET0),
    "empty containers": with_junk(b"(" + b"}]\x8f" * 20_000 + b"l"),
    "long strings": with_junk(b"(" + text(500_000) * 10 + b"l"),
    "a memo index far out": with_junk(b"N" * 400_000 + b"0" * 400_000 + b"Nr\x00\x1a\x06\x00"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_what_a_pickle_builds_is_counted_before_unpickling(tmp_path, monkeypatch, case):
    path = torch_zip(tmp_path / "m.pt", CASES[case])
    monkeypatch.setenv(BUDGET, "4000000")
    monkeypatch.setattr(torch_file._Loader, "load", _must_not_unpickle)
    with time_limit(20):
        message = refused(path, BUDGET, "bytes of objects that unpickling a PyTorch checkpoint would build")
    if case.startswith(("torch.", "builtins.", "__builtin__.", "collections.", "_codecs.")):
        assert f"(a call of '{case.split()[0]}')" in message, message


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_budget_raised_reads_the_same_files(tmp_path, monkeypatch, case):
    path = torch_zip(tmp_path / "m.pt", CASES[case])
    monkeypatch.setenv(BUDGET, "400000000")
    with time_limit(20):
        contents = read_torch(path)
    assert list(contents.tensors) == ["w"] and contents.ignored == ["junk"]


def test_the_pickles_of_a_legacy_file_share_one_budget(tmp_path, monkeypatch):
    # the legacy format is five pickles (magic, version, system info, the object, the keys)
    main = pkl(dict_of((s("w"), tensor(storage(legacy=True))), (s("junk"), memoized(int_list(20_000))
                                                                 + calls(g("torch", "Size"), GET0 + b"\x85", 50))))
    path = legacy_file(tmp_path / "l.pt", main)
    monkeypatch.setenv(BUDGET, "4000000")
    monkeypatch.setattr(torch_file._Loader, "load", _must_not_unpickle)
    refused(path, BUDGET, "(a call of 'torch.Size')")
    # a key list that is large on its own is counted after the object pickle's bytes
    keys = pkl(memoized(int_list(200_000)) + b"(" + s("0") + b"l")
    small = pkl(dict_of((s("w"), tensor(storage(legacy=True))), (s("junk"), int_list(150_000))))
    monkeypatch.setattr(torch_file._Loader, "load", torch_file.pickle.Unpickler.load)
    monkeypatch.delenv(BUDGET)
    assert list(read_torch(legacy_file(tmp_path / "k.pt", small, keys=keys)).tensors) == ["w"]
    monkeypatch.setenv(BUDGET, "3500000")  # more than either pickle builds, less than both
    refused(legacy_file(tmp_path / "k.pt", small, keys=keys), BUDGET)


def test_the_loader_counts_what_calls_copy_too(tmp_path, monkeypatch):
    # a second lock: were the scan's sizes wrong, the loader's stand-ins count before they copy
    monkeypatch.setattr(torch_file, "scan", lambda data, pos, where, complete, allowed, memory=0: (len(data), 0))
    monkeypatch.setenv(BUDGET, "4000000")
    for name in ("torch.Size", "builtins.frozenset", "collections.OrderedDict of pairs", "_codecs.encode"):
        path = torch_zip(tmp_path / "m.pt", CASES[name])
        refused(path, BUDGET, f"(a call of '{name.split()[0]}')")


def test_calls_that_build_little_are_not_charged_for_their_arguments(tmp_path, monkeypatch):
    # BUILD on an OrderedDict keeps no state, a parameter rebuilt from a tensor copies nothing:
    # naming one large memoized object many times costs a pointer each
    monkeypatch.setenv(BUDGET, "4000000")
    big = memoized(b"}(" + b"".join(i(k) + b"N" for k in range(10_000)) + b"u")
    built = b"(" + (OD + GET0 + b"b") * 2_000 + b"l"
    path = torch_zip(tmp_path / "m.pt", with_junk(big + built))
    assert list(read_torch(path).tensors) == ["w"]


def test_a_memoized_huge_shape_is_refused_at_the_first_tensor(tmp_path):
    # 200 tensors whose shape and strides are one memoized list of 1,000,000 numbers
    views = b"".join(s(f"t{k}") + tensor(raw_size=GET0, raw_stride=GET0) for k in range(200))
    path = torch_zip(tmp_path / "m.pt", pkl(memoized(int_list(1_000_000)) + b"}(" + s("w") + tensor() + views + b"u"))
    with time_limit(20):
        refused(path, "1000000 dimensions of one tensor, but numpy")  # more than any numpy holds


def test_the_default_budget_reads_real_checkpoints():
    # every good fixture (torch.save output) is far below the default budget
    for path in sorted((ROOT / "fixtures" / "torch").glob("*.expected.safetensors")):
        stem = path.name[: -len(".expected.safetensors")]
        source = next(p for p in (path.with_name(f"{stem}.pt"), path.with_name(f"{stem}.bin")) if p.exists())
        try:
            read_torch(str(source))
        except CheckpointError as e:  # two fixtures need a key; none may hit a budget
            assert "pass key with" in str(e), e  # the API names its keyword
