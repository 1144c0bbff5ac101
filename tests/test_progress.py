"""Progress on stderr: drawn only on a terminal (or when asked), at most five times a second,
always at 100%, ended by a newline; silent otherwise and with ``--quiet``."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys

import pytest

from conftest import FIXTURES, load_checkpoint_raw
from fusectl import api, progress
from fusectl.progress import Progress

GB = 10**9


class Clock:
    """A stand-in for time.monotonic that moves only when told."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(progress.time, "monotonic", c)
    return c


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def frames(text: str) -> list[str]:
    """The redraws written so far: each starts with a carriage return."""
    return text.split("\r")[1:]


def test_an_enabled_bar_draws_percent_and_gigabytes(capsys, clock):
    bar = Progress("writing", 4 * GB, enabled=True)
    bar.advance(GB)
    assert capsys.readouterr().err == "\rwriting  25%  1.00/4.00 GB"


def test_redraws_are_throttled_to_five_a_second(capsys, clock):
    bar = Progress("writing", 10 * GB, enabled=True)
    bar.advance(GB)  # the first advance always draws
    clock.now += 0.1
    bar.advance(GB)  # 0.1 s later: skipped
    clock.now += 0.05
    bar.advance(GB)  # 0.15 s after the last draw: still skipped
    clock.now += 0.1
    bar.advance(GB)  # 0.25 s after the last draw: drawn, with everything done so far
    assert frames(capsys.readouterr().err) == ["writing  10%  1.00/10.00 GB", "writing  40%  4.00/10.00 GB"]
    assert bar.done == 4 * GB


def test_the_last_advance_always_draws_100_percent(capsys, clock):
    bar = Progress("writing", 2 * GB, enabled=True)
    bar.advance(GB)
    bar.advance(GB)  # no time has passed, but the work is complete
    bar.finish()
    assert capsys.readouterr().err == "\rwriting  50%  1.00/2.00 GB\rwriting 100%  2.00/2.00 GB\n"


def test_a_disabled_bar_writes_nothing_but_still_counts(capsys, clock):
    bar = Progress("writing", 100, enabled=False)
    bar.advance(60)
    bar.advance(40)
    bar.finish()
    assert capsys.readouterr().err == ""
    assert bar.done == 100


@pytest.mark.parametrize("tty", [True, False])
def test_by_default_the_bar_follows_whether_stderr_is_a_terminal(monkeypatch, clock, tty):
    stream = Terminal() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    bar = Progress("writing", GB, enabled=None)
    bar.advance(GB)
    bar.finish()
    assert bar.enabled is tty
    assert stream.getvalue() == ("\rwriting 100%  1.00/1.00 GB\n" if tty else "")


def test_an_empty_total_does_not_divide_by_zero(capsys, clock):
    bar = Progress("writing", 0, enabled=True)
    bar.advance(0)
    bar.finish()
    err = capsys.readouterr().err
    assert err.startswith("\rwriting ") and err.endswith(" 0.00/0.00 GB\n")


def test_fuse_draws_progress_up_to_every_byte_written(tmp_path, capsys):
    out = tmp_path / "fused.safetensors"
    report = api.fuse(FIXTURES / "tiny-llama-gqa", ["llama-qkv"], out, progress=True)
    err = capsys.readouterr().err
    total = sum(len(raw) for _, _, raw in load_checkpoint_raw(out).values())
    assert report.unique_bytes == total
    assert err.startswith("\rwriting ") and err.endswith("\n")
    assert frames(err.rstrip("\n"))[-1] == f"writing 100%  {total / 1e9:.2f}/{total / 1e9:.2f} GB"


def test_fuse_without_progress_is_silent(tmp_path, capsys):
    api.fuse(FIXTURES / "tiny-llama-gqa", ["llama-qkv"], tmp_path / "fused.safetensors", progress=False)
    assert capsys.readouterr().err == ""


def _fuse_on_a_terminal(tmp_path, *extra) -> tuple[int, str]:
    """Run ``python -m fusectl fuse`` with stderr on a pseudo-terminal; (exit code, what it drew)."""
    leader, follower = pty.openpty()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "fusectl", "fuse", str(FIXTURES / "tiny-llama-gqa"), "-r", "llama-qkv",
             "-o", str(tmp_path / "fused.safetensors"), *extra],
            stdout=subprocess.DEVNULL, stderr=follower, timeout=60, cwd=FIXTURES.parent)
    finally:
        os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the terminal has no writer left
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    return done.returncode, b"".join(chunks).decode()


def test_the_command_line_shows_progress_on_a_terminal(tmp_path):
    code, drawn = _fuse_on_a_terminal(tmp_path)
    assert code == 0
    assert "\rwriting 100%" in drawn, repr(drawn)


def test_quiet_hides_progress_on_a_terminal(tmp_path):
    code, drawn = _fuse_on_a_terminal(tmp_path, "--quiet")
    assert code == 0
    assert "writing" not in drawn, repr(drawn)
