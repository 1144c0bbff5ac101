"""Reading untrusted files (io/untrusted.py), called directly: ``check_regular_file`` and
``open_input`` (regular files only, nothing opened that could block or act), ``load_json``
(depth and integer budgets, NaN/Infinity, strict ``-0``), ``read_json_file`` (the byte budget).

The same refusals through the command line, on configs, indexes, provenances and npz members,
are in test_hostile_readers.py (hostile JSON, FIFOs and devices as inputs), test_io_edges.py
(open failing after the check, a FIFO swapped in, JSON deeper than Python parses) and
test_fuzz.py."""

from __future__ import annotations

import gc
import json
import math
import os
import re
import socket

import pytest

from conftest import time_limit
from fusectl.errors import CheckpointError, FusectlError, VerifyError
from fusectl.io import untrusted
from fusectl.io.untrusted import (MalformedJSON, check_regular_file, collector_paused, is_generated, json_depth,
                                  load_json, open_input, read_json_bytes, read_json_file)


# ------------------------------------------------------------------------------ input files


def test_proc_and_sys_are_generated_and_their_lookalikes_are_not(tmp_path):
    assert is_generated("/proc") and is_generated("/proc/self/status") and is_generated("/sys/kernel")
    (tmp_path / "procedure").write_text("x")
    assert not is_generated(str(tmp_path / "procedure")) and not is_generated("/processes")
    (tmp_path / "link").symlink_to("/proc/self/status")
    assert is_generated(str(tmp_path / "link"))  # a link is judged by where it leads


def test_a_regular_file_gives_its_stat(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"12345")
    assert check_regular_file(str(path)).st_size == 5


def test_a_missing_file_names_it_and_says_what_to_give(tmp_path):
    path = tmp_path / "missing.safetensors"
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: no such file; name the checkpoint file itself")):
        check_regular_file(str(path))


def test_a_folder_is_not_a_regular_file(tmp_path):
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path}: is a folder, not a regular file")):
        check_regular_file(str(tmp_path))


def test_a_fifo_is_refused_without_being_opened(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with time_limit(10), pytest.raises(CheckpointError, match="is a FIFO \\(named pipe\\), not a regular file"):
        open_input(str(fifo))


def test_a_socket_is_not_a_regular_file(tmp_path):
    path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        with pytest.raises(CheckpointError, match="is a socket, not a regular file"):
            check_regular_file(str(path))


def test_a_device_is_not_a_regular_file():
    with pytest.raises(CheckpointError, match="/dev/null: is a device, not a regular file"):
        check_regular_file("/dev/null")


def test_a_kernel_generated_file_is_refused_naming_where_it_leads(tmp_path):
    link = tmp_path / "config.json"
    link.symlink_to("/proc/self/status")
    with pytest.raises(CheckpointError) as info:
        check_regular_file(str(link))
    assert str(info.value).startswith(f"{link}: resolves to /proc/")
    assert "fusectl never reads /proc or /sys" in str(info.value)


def test_a_nul_byte_in_a_name_cannot_be_read():
    with pytest.raises(CheckpointError, match="cannot read it"):
        check_regular_file("model\0.safetensors")


def test_the_caller_chooses_the_error_the_name_shown_and_the_hint(tmp_path):
    with pytest.raises(VerifyError, match=re.escape("--inputs x.npz: is a folder, not a regular file; fusectl "
                                                    "reads only regular files — pass an .npz")):
        check_regular_file(str(tmp_path), error=VerifyError, what="--inputs x.npz", hint="pass an .npz")


def test_open_input_gives_a_readable_binary_file(tmp_path):
    path = tmp_path / "m.bin"
    path.write_bytes(b"\x00\x01")
    with open_input(str(path)) as f:
        assert f.read() == b"\x00\x01"


# ------------------------------------------------------------------------------------- JSON


def test_valid_json_parses_as_json_does():
    text = '{"a": [1, 2.5, "x", null, true], "b": {"c": -3}}'
    assert load_json(text, "x.json") == json.loads(text)
    assert load_json(text.encode(), "x.json") == json.loads(text)


def test_minus_zero_reads_as_a_float_as_strict_readers_read_it():
    value = load_json("[-0, 0, -1]", "x.json")
    assert value == [0.0, 0, -1]
    assert isinstance(value[0], float) and math.copysign(1, value[0]) == -1
    assert isinstance(value[1], int) and isinstance(value[2], int)


@pytest.mark.parametrize("text, detail", [
    ('{"n": NaN}', "holds NaN, which JSON does not allow"),
    ('[Infinity]', "holds Infinity, which JSON does not allow"),
    ('[-Infinity]', "holds -Infinity, which JSON does not allow"),
    ('[1e999]', "holds the number 1e999, too large for a float"),
])
def test_numbers_json_does_not_allow_are_refused(text, detail):
    with pytest.raises(MalformedJSON) as info:
        load_json(text, "config.json", "the config")
    assert str(info.value) == f"config.json: the config {detail}; the file is corrupt"
    assert info.value.detail == detail


def test_text_that_does_not_parse_is_malformed_json_with_the_parsers_reason():
    with pytest.raises(MalformedJSON) as info:
        load_json('{"a": 1', "model.safetensors.index.json", "the index")
    assert str(info.value).startswith("model.safetensors.index.json: the index is not valid JSON (")
    assert str(info.value).endswith("); the file is corrupt")
    assert "Expecting" in info.value.detail
    assert isinstance(info.value, CheckpointError)


def test_bytes_that_are_not_utf8_name_the_byte():
    with pytest.raises(MalformedJSON, match=re.escape("x.json: the JSON is not valid JSON (byte 6 is not UTF-8)")) as info:
        load_json(b'{"a": \xff}', "x.json")
    assert info.value.detail == "byte 6 is not UTF-8"


def test_nesting_past_the_budget_is_refused_before_parsing(monkeypatch):
    monkeypatch.setenv("FUSECTL_MAX_JSON_DEPTH", "3")
    assert load_json("[[[1]]]", "x.json") == [[[1]]]
    with pytest.raises(CheckpointError, match=re.escape("x.json: the JSON: 4 levels of JSON nesting exceeds "
                                                        "fusectl's limit of 3; if the file is genuine, raise it "
                                                        "with FUSECTL_MAX_JSON_DEPTH=4")):
        load_json("[[[[1]]]]", "x.json")


def test_brackets_inside_strings_do_not_count_as_nesting(monkeypatch):
    monkeypatch.setenv("FUSECTL_MAX_JSON_DEPTH", "2")
    text = '{"a": ["[[[[{{{{", "\\\\", "\\"[[["]}'
    assert load_json(text, "x.json") == json.loads(text)


def test_json_depth_is_exact_past_the_budget_and_bounded_below_it():
    raw = b'{"k": "[[[[[[", "v": [[[]]]}'
    assert json_depth(raw, budget=100) <= 100
    assert json_depth(raw, budget=2) == 4  # the brackets in the string are cut out
    assert json_depth(b"[" * 50 + b"]" * 50, budget=10) == 50


def test_an_integer_longer_than_the_budget_is_refused(monkeypatch):
    monkeypatch.setenv("FUSECTL_MAX_INTEGER_DIGITS", "5")
    assert load_json("[12345, -12345, 1234567.5]", "x.json") == [12345, -12345, 1234567.5]
    for text in ("[123456]", "[-123456]"):
        with pytest.raises(CheckpointError, match=re.escape("x.json: the JSON: 6 digits in one integer exceeds "
                                                            "fusectl's limit of 5")):
            load_json(text, "x.json")


def test_nesting_deeper_than_python_parses_is_refused_as_depth(monkeypatch):
    monkeypatch.setenv("FUSECTL_MAX_JSON_DEPTH", "10000000")
    with pytest.raises(CheckpointError, match="x.json: the JSON \\(at least\\): 10000001 levels of JSON nesting"):
        load_json("[" * 200_000 + "]" * 200_000, "x.json")


def test_object_pairs_hook_sees_duplicate_keys():
    pairs = load_json('{"a": 1, "a": 2}', "x.json", object_pairs_hook=list)
    assert pairs == [("a", 1), ("a", 2)]


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_left_as_it_was(enabled):
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        with collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled() is enabled
        with pytest.raises(MalformedJSON):
            load_json("[NaN]", "x.json")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


# ------------------------------------------------------------------------------ JSON files


def test_a_json_file_is_read_and_named_in_its_errors(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"hidden_size": 8}')
    assert read_json_file(str(path), "the config") == {"hidden_size": 8}
    path.write_text('{"hidden_size": NaN}')
    with pytest.raises(MalformedJSON, match=re.escape(f"{path}: the config holds NaN")):
        read_json_file(str(path), "the config")


def test_a_json_file_past_the_byte_budget_is_refused_unread(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"a": "x" * 100}))
    monkeypatch.setenv("FUSECTL_MAX_JSON_BYTES", "50")
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: {path.stat().st_size} bytes of a JSON file")):
        read_json_bytes(str(path), "the config")


def test_a_json_file_that_grows_while_read_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    path.write_text("[1]")
    monkeypatch.setenv("FUSECTL_MAX_JSON_BYTES", "10")
    real = untrusted.open_input

    def growing(p):
        f = real(p)
        path.write_text("[" + "1, " * 20 + "1]")  # after the size was taken
        return f

    monkeypatch.setattr(untrusted, "open_input", growing)
    with pytest.raises(CheckpointError, match="bytes of a JSON file .* exceeds fusectl's limit of 10"):
        read_json_bytes(str(path), "the config")


def test_a_json_file_that_fails_while_read_names_it_and_the_reason(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    path.write_text("{}")

    class Failing:
        """The file, whose read fails as a dying disk's does."""

        def __init__(self, p):
            self.file = open(p, "rb")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def fileno(self):
            return self.file.fileno()

        def read(self):
            raise OSError(5, "Input/output error")

    monkeypatch.setattr(untrusted, "open_input", Failing)
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: cannot read the config: Input/output error")):
        read_json_bytes(str(path), "the config")


def test_a_json_file_that_is_not_a_regular_file_is_refused(tmp_path):
    with pytest.raises(FusectlError, match="is a folder, not a regular file"):
        read_json_file(str(tmp_path), "the config")
