"""``verify --report`` / ``--junit`` on a full disk: no torn file, no new file, an old one untouched."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

from conftest import FIXTURES, ok
from fusectl import api
from fusectl.errors import OutputError

BERT = FIXTURES / "onnx" / "bert" / "model.onnx"
BERT_IO = FIXTURES / "onnx" / "bert" / "io.npz"
OLD = b'{"an": "earlier report"}\n'


def full_disk(monkeypatch, room: int, *, at_fsync: bool = False) -> None:
    """A disk with ``room`` bytes left for the files fusectl writes under a temporary name: an
    ``os.write`` past that lands what fits, the next raises ENOSPC, as a real full disk does;
    with ``at_fsync`` the writes land and the flush fails (delayed allocation, quotas, NFS)."""
    real_open, real_write, real_fsync = os.open, os.write, os.fsync
    temporaries: set[int] = set()
    left = [room]

    def open_(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        if "fusectl-tmp" in os.fspath(path):
            temporaries.add(fd)
        return fd

    def write(fd, data):
        if fd not in temporaries:
            return real_write(fd, data)
        if left[0] == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        landed = real_write(fd, memoryview(data)[:left[0]])
        left[0] -= landed
        return landed

    def fsync(fd):
        if at_fsync and fd in temporaries:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "fsync", fsync)


def verify(cli, *options):
    return cli("verify", BERT, BERT, "--inputs", BERT_IO, *options)


def assert_refused_naming(result, path) -> None:
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: {path}: No space left on device while writing it"), result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output
    assert "internal error" not in result.stderr


@pytest.mark.parametrize("option, name", [("--report", "verify.json"), ("--junit", "verify.xml")])
@pytest.mark.parametrize("room", [0, 100], ids=["disk-full", "fills-mid-file"])
def test_a_report_on_a_full_disk_leaves_no_file(cli, tmp_path, monkeypatch, option, name, room):
    full_disk(monkeypatch, room)
    out = tmp_path / name
    result = verify(cli, option, out)
    assert_refused_naming(result, out)
    assert os.listdir(tmp_path) == []  # neither the report nor a temporary, a record or an old file


@pytest.mark.parametrize("option, name", [("--report", "verify.json"), ("--junit", "verify.xml")])
def test_a_full_disk_leaves_an_existing_report_as_it_was(cli, tmp_path, monkeypatch, option, name):
    out = tmp_path / name
    out.write_bytes(OLD)
    full_disk(monkeypatch, 100)
    assert_refused_naming(verify(cli, option, out), out)
    assert out.read_bytes() == OLD and os.listdir(tmp_path) == [name]


def test_a_flush_that_fails_leaves_no_report(cli, tmp_path, monkeypatch):
    out = tmp_path / "verify.json"
    full_disk(monkeypatch, 1 << 30, at_fsync=True)
    assert_refused_naming(verify(cli, "--report", out), out)
    assert os.listdir(tmp_path) == []


def test_when_the_junit_file_does_not_fit_the_json_report_is_not_written_either(cli, tmp_path, monkeypatch):
    report, junit = tmp_path / "verify.json", tmp_path / "verify.xml"
    report.write_bytes(OLD)
    whole = len(api.verify(str(BERT), str(BERT), inputs=dict(_arrays())).to_json_bytes())
    full_disk(monkeypatch, whole + 10)  # the JSON fits, the XML after it does not
    assert_refused_naming(verify(cli, "--report", report, "--junit", junit), junit)
    assert report.read_bytes() == OLD and os.listdir(tmp_path) == ["verify.json"]


def test_reports_replace_earlier_ones_whole_and_leave_nothing_beside_them(cli, tmp_path):
    report, junit = tmp_path / "verify.json", tmp_path / "verify.xml"
    report.write_bytes(OLD)
    ok(verify(cli, "--report", report, "--junit", junit))
    assert sorted(os.listdir(tmp_path)) == ["verify.json", "verify.xml"]
    doc = json.loads(report.read_text())
    assert doc["passed"] and doc["mode"] == "model"
    assert junit.read_bytes().startswith(b"<?xml") and b"</testsuite>" in junit.read_bytes()


def test_a_killed_runs_temporary_report_is_removed_by_the_next_run(cli, tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # its pid now belongs to no process
    stale = tmp_path / f".verify.json.fusectl-tmp-{child.pid}"
    stale.write_bytes(b'{"torn": ')
    result = ok(verify(cli, "--report", tmp_path / "verify.json"))
    assert f"note: removed {stale}, left by a killed run (pid {child.pid})" in result.stderr
    assert os.listdir(tmp_path) == ["verify.json"]


def test_the_library_writes_reports_atomically_too(tmp_path, monkeypatch):
    result = api.verify(str(BERT), str(BERT), inputs=dict(_arrays()))
    out = tmp_path / "verify.xml"
    result.write(junit_path=str(out))
    assert out.read_bytes() == result.to_junit()
    full_disk(monkeypatch, 0)
    with pytest.raises(OutputError, match="verify.json: No space left on device") as refused:
        result.write(junit_path=str(out), json_path=str(tmp_path / "verify.json"))
    assert "no report file was written" in str(refused.value)
    assert out.read_bytes() == result.to_junit() and os.listdir(tmp_path) == ["verify.xml"]


def test_a_report_may_not_overwrite_what_the_library_reads(tmp_path):
    result = api.verify(str(BERT), str(BERT), inputs=dict(_arrays()))
    model = tmp_path / "model.onnx"
    model.write_bytes(BERT.read_bytes())
    with pytest.raises(OutputError, match="would overwrite the input"):
        result.write(json_path=str(model), inputs=[str(model)])
    assert model.read_bytes() == BERT.read_bytes()


def _arrays():
    import numpy as np

    with np.load(BERT_IO) as archive:
        return {name: archive[name] for name in ("input_ids", "attention_mask")}
