"""Faults while writing: killed runs, stale temporaries, full disks, and fusectl's own bugs."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import safetensors.numpy

from conftest import leftovers, ok, snapshot, write_rules

TRANSPOSE_ALL = """
version = 1
[[rule]]
op = "transpose"
input = "w{i:int}"
output = "t{i:int}"
"""


def _dead_pid() -> int:
    """A pid that belonged to a process which has exited."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_killed_runs_temporary_output_is_removed_by_the_next_run(cli, copy_fixture, tmp_path):
    src = copy_fixture("tiny-llama-gqa")
    pid = _dead_pid()
    stale = tmp_path / f".fused.fusectl-tmp-{pid}"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half a file")
    other = tmp_path / f".unrelated.fusectl-tmp-{pid}"  # another output's: not ours to touch
    other.write_bytes(b"x")
    result = ok(cli("fuse", src, "-r", "llama-qkv", "-o", tmp_path / "fused", "--quiet"))
    assert not stale.exists() and other.exists()
    assert f"note: removed {stale}, left by a killed run (pid {pid})" in result.stderr


def test_a_previous_output_moved_aside_by_a_killed_run_is_put_back(cli, copy_fixture, tmp_path):
    """Killed between moving the old output aside and renaming the new one into place: the
    next run restores the old one (then --force is needed to replace it, as always)."""
    src = copy_fixture("tiny-llama-gqa")
    out = tmp_path / "fused.safetensors"
    ok(cli("fuse", src, "-r", "llama-qkv", "-o", out))
    before = out.read_bytes()
    pid = _dead_pid()
    moved = tmp_path / f".fused.safetensors.fusectl-old-{pid}"
    os.rename(out, moved)
    result = cli("fuse", src, "-r", "llama-qkv", "-o", out)
    assert result.exit_code == 2 and "already exists; pass --force" in result.stderr
    assert f"note: restored {out}" in result.stderr
    assert out.read_bytes() == before and not moved.exists()


def test_a_live_processs_temporary_output_is_left_alone(cli, copy_fixture, tmp_path):
    src = copy_fixture("tiny-llama-gqa")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        busy = tmp_path / f".fused.fusectl-tmp-{sleeper.pid}"
        busy.mkdir()
        ok(cli("fuse", src, "-r", "llama-qkv", "-o", tmp_path / "fused", "--quiet"))
        assert busy.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_kill_minus_9_mid_write_then_a_rerun_succeeds_and_leaves_nothing(tmp_path):
    """A real process killed with SIGKILL while it writes ~200 MB: no output appears, the
    rerun succeeds, says what it removed, and no temporary output remains."""
    src = tmp_path / "big.safetensors"
    rng = np.random.default_rng(0)
    safetensors.numpy.save_file({f"w{i}": rng.standard_normal((1024, 1024), dtype=np.float32)
                                 for i in range(48)}, str(src))
    rules = write_rules(tmp_path / "t.toml", TRANSPOSE_ALL)
    out = tmp_path / "out.safetensors"
    command = [sys.executable, "-m", "fusectl", "fuse", str(src), "-r", str(rules), "-o", str(out), "--quiet"]
    before = snapshot(src)
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    temp = tmp_path / f".out.safetensors.fusectl-tmp-{proc.pid}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (temp.exists() and temp.stat().st_size > 1 << 20):
        if proc.poll() is not None:
            pytest.fail("fuse finished before it could be killed; make the input bigger")
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert temp.exists() and not out.exists()
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    assert f"removed {temp}" in rerun.stderr
    assert leftovers(tmp_path) == [] and out.exists()
    assert snapshot(src) == before
    back = safetensors.numpy.load_file(str(out))
    np.testing.assert_array_equal(back["t7"], safetensors.numpy.load_file(str(src))["w7"].T)


def test_a_full_disk_while_copying_a_companion_names_the_output(cli, copy_fixture, tmp_path, monkeypatch):
    src = copy_fixture("tiny-llama-gqa")

    def full(source, target, *args, **kwargs):  # shutil names the source first, the target second
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(source), None, str(target))

    monkeypatch.setattr(shutil, "copy2", full)
    out = tmp_path / "fused"
    before = snapshot(src)
    result = cli("fuse", src, "-r", "llama-qkv", "-o", out)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {out}: No space left on device while writing it")
    assert "config.json" not in result.stderr
    assert not out.exists() and leftovers(tmp_path) == [] and snapshot(src) == before


def test_a_bug_in_fusectl_exits_70_and_says_to_report_it(cli, copy_fixture, monkeypatch):
    import fusectl.api

    def broken(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(fusectl.api, "make_plan", broken)
    src = copy_fixture("tiny-llama-gqa")
    result = cli("plan", src, "-r", "llama-qkv")
    assert result.exit_code == 70
    assert result.stderr.startswith("error: internal error: ZeroDivisionError: division by zero;")
    assert "bug in fusectl" in result.stderr and "--debug" in result.stderr
    assert "Traceback" not in result.output
    debug = cli("--debug", "plan", src, "-r", "llama-qkv")
    assert debug.exit_code == 70 and "Traceback" in debug.stderr
