"""The command line's own edges: a run stopped by SIGTERM or Ctrl-C leaves nothing, a closed
stdout ends quietly, an I/O error becomes one ``error:`` line, and usage mistakes say what
to give."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import FIXTURES, leftovers, ok, snapshot
from fusectl import api, progress
from fusectl.errors import PlanError

LLAMA = "tiny-llama-gqa"


@pytest.fixture
def sigterm_restored():
    """The CLI installs its own SIGTERM handler; put pytest's back afterwards."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def _stop_after_first_tensor(monkeypatch, stop):
    """Make ``stop()`` happen while the output is being written, after its first tensor."""
    real_advance = progress.Progress.advance

    def advance(self, nbytes):
        real_advance(self, nbytes)
        stop()

    monkeypatch.setattr(progress.Progress, "advance", advance)


def _terminate():
    """SIGTERM to this process, only once fusectl handles it (the default action would end pytest)."""
    assert callable(signal.getsignal(signal.SIGTERM)), "fusectl installed no SIGTERM handler"
    os.kill(os.getpid(), signal.SIGTERM)


def _interrupt():
    raise KeyboardInterrupt


def _fuse_interrupted(cli, *args):
    """Run ``fuse``; a KeyboardInterrupt fusectl lets escape fails the test instead of ending pytest."""
    try:
        return cli("fuse", *args)
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped the command line")


@pytest.mark.parametrize("out_name", ["fused", "fused.safetensors", "fused.npz"])
def test_sigterm_while_writing_is_exit_143_and_leaves_no_output(cli, copy_fixture, tmp_path, monkeypatch,
                                                               sigterm_restored, out_name):
    src = copy_fixture(LLAMA)
    before = snapshot(src)
    out = tmp_path / out_name
    _stop_after_first_tensor(monkeypatch, _terminate)
    result = cli("fuse", src, "-r", "llama-qkv", "-o", out, "--quiet")
    assert result.exit_code == 143, result.output
    assert result.stderr == "error: terminated; no output was written\n"
    assert not os.path.lexists(out) and leftovers(tmp_path) == []
    assert snapshot(src) == before


@pytest.mark.parametrize("stage", ["onnx.load", "onnxruntime"])
def test_sigterm_inside_a_third_partys_call_is_exit_143_not_its_error(cli, tmp_path, monkeypatch, sigterm_restored,
                                                                      stage):
    """fusectl turns errors of any type from onnx or onnxruntime into a domain error (exit 2);
    a termination that arrives inside such a call is no error of theirs and still ends the run."""
    if stage == "onnx.load":
        import onnx
        real, owner, attr = onnx.load, onnx, "load"
    else:
        import onnxruntime
        real, owner, attr = onnxruntime.InferenceSession, onnxruntime, "InferenceSession"

    def terminated(*args, **kwargs):
        _terminate()
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, attr, terminated)
    model = FIXTURES / "onnx" / "convbn" / "model.onnx"
    report = tmp_path / "report.json"
    result = cli("verify", model, model, "--report", report)
    assert result.exit_code == 143, result.output
    assert result.stderr == "error: terminated; no output was written\n"
    assert not os.path.lexists(report) and leftovers(tmp_path) == []


def test_ctrl_c_while_writing_is_exit_130_and_leaves_no_output(cli, copy_fixture, tmp_path, monkeypatch):
    src = copy_fixture(LLAMA)
    out = tmp_path / "fused"

    _stop_after_first_tensor(monkeypatch, _interrupt)
    result = _fuse_interrupted(cli, src, "-r", "llama-qkv", "-o", out, "--quiet")
    assert result.exit_code == 130, result.output
    assert result.stderr == "error: interrupted; no output was written\n"
    assert not os.path.lexists(out) and leftovers(tmp_path) == []


def test_ctrl_c_with_force_keeps_the_previous_output(cli, copy_fixture, tmp_path, monkeypatch):
    src = copy_fixture(LLAMA)
    out = tmp_path / "fused.safetensors"
    ok(cli("fuse", src, "-r", "llama-qkv", "-o", out, "--quiet"))
    before = snapshot(out)

    _stop_after_first_tensor(monkeypatch, _interrupt)
    result = _fuse_interrupted(cli, src, "-r", "llama-qkv", "-r", "llama-gate-up", "-o", out, "--force", "--quiet")
    assert result.exit_code == 130, result.output
    assert snapshot(out) == before and leftovers(tmp_path) == []


@pytest.mark.parametrize("args, code", [(["inspect", LLAMA, "--json"], 0), (["inspect", "no-such-folder"], 2),
                                        (["plan", LLAMA, "-r", "no-such-preset"], 2)], ids=["ok", "missing", "bad-rule"])
def test_the_command_ends_its_process_with_every_byte_written_and_its_exit_code(args, code):
    """``cli.run`` ends the process without the interpreter's teardown: what the command printed
    (a JSON document of many kilobytes into a pipe) is all there, and so is the exit code."""
    done = subprocess.run([sys.executable, "-m", "fusectl", *args], capture_output=True, text=True,
                          cwd=FIXTURES, timeout=120)
    assert done.returncode == code, done.stderr
    if code == 0:
        assert len(done.stdout) > 4096 and json.loads(done.stdout)["parameters"]
        assert done.stderr == ""
    else:
        assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1 and done.stdout == ""


def test_stdout_closed_early_ends_quietly_with_141():
    """``fusectl inspect --json | head -0``: no traceback, no 'Exception ignored' at exit."""
    child = subprocess.Popen([sys.executable, "-m", "fusectl", "inspect", str(FIXTURES / LLAMA), "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=FIXTURES.parent)
    child.stdout.close()  # before the child has written a byte (it is still importing)
    stderr = child.stderr.read().decode()
    assert child.wait(timeout=60) == 141
    assert stderr == ""


@pytest.mark.parametrize("option", ["--report", "--junit"])
def test_a_report_that_cannot_be_written_is_exit_2(cli, tmp_path, option):
    model = FIXTURES / "onnx" / "bert" / "model.onnx"
    result = cli("verify", model, model, "--inputs", FIXTURES / "onnx" / "bert" / "io.npz", option, "/dev/full")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "No space left on device; check the path, permissions and free space" in result.stderr
    assert "Traceback" not in result.output and "internal error" not in result.stderr


def test_a_report_that_cannot_be_written_is_named_in_the_error(cli, tmp_path):
    model = FIXTURES / "onnx" / "bert" / "model.onnx"
    result = cli("verify", model, model, "--inputs", FIXTURES / "onnx" / "bert" / "io.npz", "--report", "/dev/full")
    assert result.exit_code == 2
    assert "/dev/full" in result.stderr, result.stderr


def test_fuse_without_rules_is_a_usage_error(cli, copy_fixture, tmp_path):
    src = copy_fixture(LLAMA)
    out = tmp_path / "fused"
    result = cli("fuse", src, "-o", out)
    assert result.exit_code == 2
    assert "give at least one -r RULES (a rules file or a preset name)" in result.stderr
    assert not os.path.lexists(out)


def test_the_library_refuses_a_plan_without_rules():
    with pytest.raises(PlanError, match="give at least one rules file or preset name"):
        api.plan(FIXTURES / LLAMA, [])


def test_plan_text_lists_the_ties_the_result_keeps(cli):
    result = ok(cli("plan", FIXTURES / "tiny-llama-tied", "-r", "llama-qkv"))
    lines = result.stdout.splitlines()
    assert lines[-1] == "tied: lm_head.weight, model.embed_tokens.weight"
    assert any(line.startswith("result: ") for line in lines)
