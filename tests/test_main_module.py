"""``python -m fusectl`` is the command line: same version, same exit codes, same ``error:`` line."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys

import pytest

from conftest import FIXTURES
from fusectl import __version__

ROOT = FIXTURES.parent


def run_module(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """Run the package as ``__main__`` in-process (so coverage sees it); (exit code, stdout, stderr).
    ``cli.run`` ends its process with ``os._exit``: here that raises SystemExit with the code."""
    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setattr(sys, "argv", ["fusectl", *map(str, args)])
    monkeypatch.setattr(os, "_exit", exit_now)
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("fusectl", run_name="__main__", alter_sys=True)
    out = capsys.readouterr()
    code = exited.value.code
    return (0 if code is None else code), out.out, out.err


def test_version(monkeypatch, capsys):
    code, out, err = run_module(monkeypatch, capsys, "--version")
    assert (code, out, err) == (0, f"fusectl, version {__version__}\n", "")


def test_a_missing_checkpoint_is_exit_2_with_one_error_line(monkeypatch, capsys, tmp_path):
    missing = tmp_path / "nowhere.safetensors"
    code, out, err = run_module(monkeypatch, capsys, "inspect", missing)
    assert code == 2
    assert out == ""
    assert err == f"error: {missing}: no such file or directory\n"


def test_an_unknown_command_is_a_usage_error(monkeypatch, capsys):
    code, out, err = run_module(monkeypatch, capsys, "frobnicate")
    assert code == 2
    assert "No such command 'frobnicate'" in err and "Traceback" not in err


def test_rules_list_names_every_preset(monkeypatch, capsys):
    from fusectl.rules.presets import preset_names

    code, out, _ = run_module(monkeypatch, capsys, "rules", "list")
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()] == preset_names()


def test_python_dash_m_runs_the_command_line():
    """The real interpreter entry point, as a user types it."""
    done = subprocess.run([sys.executable, "-m", "fusectl", "--version"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"fusectl, version {__version__}\n", "")


def test_python_dash_m_fails_with_exit_2_and_no_traceback(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 3)
    done = subprocess.run([sys.executable, "-m", "fusectl", "inspect", str(bad)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith("error: ") and str(bad) in done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
