"""Faults while writing: killed runs, stale temporaries, full disks, and fusectl's own bugs."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

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
    import fusectl.planner

    def broken(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(fusectl.planner, "bind_and_lift", broken)
    src = copy_fixture("tiny-llama-gqa")
    result = cli("plan", src, "-r", "llama-qkv")
    assert result.exit_code == 70
    assert result.stderr.startswith("error: internal error: ZeroDivisionError: division by zero;")
    assert "bug in fusectl" in result.stderr and "--debug" in result.stderr
    assert "Traceback" not in result.output
    debug = cli("--debug", "plan", src, "-r", "llama-qkv")
    assert debug.exit_code == 70 and "Traceback" in debug.stderr


# ------------------------------------------------- a group (model + OUT.onnx.data) killed mid-replace

DIES_AT = """
import os, signal, sys

def dies_at(module, name, n, how):
    real, calls = getattr(module, name), []

    def wrapper(*args, **kwargs):
        calls.append(args)
        if len(calls) == n and how != "after":
            if how == "raise":
                raise OSError("injected failure")
            os.kill(os.getpid(), signal.SIGKILL)
        result = real(*args, **kwargs)
        if len(calls) == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(module, name, wrapper)

def kill_points(modules):  # each "module.function:N:how" of argv up to "--"; returns the rest
    stop = sys.argv.index("--")
    for spec in sys.argv[1:stop]:
        where, n, how = spec.split(":")
        module, name = where.split(".")
        dies_at(modules[module], name, int(n), how)
    return sys.argv[stop + 1:]
"""

GROUP_WRITER = DIES_AT + """
from pathlib import Path
from fusectl.io import atomic

(folder,) = kill_points({"os": os, "atomic": atomic})
data = os.path.join(folder, "out.onnx.data")
with atomic.atomic_output(os.path.join(folder, "out.onnx"), force=True, inputs=[], extra=[data]) as temp:
    Path(temp).write_bytes(b"new model")
    Path(atomic.temporary_name(data)).write_bytes(b"new data")
sys.exit(3)  # the kill point was never reached
"""

EXPORTER = DIES_AT + """
import onnx_ir
import fusectl.onnx.export
from fusectl.cli import main

fusectl.onnx.export.EXTERNAL_DATA_THRESHOLD = 16  # external data, as past 2 GB
main(kill_points({"os": os, "onnx_ir": onnx_ir}))
"""

OLD_PAIR = {"out.onnx": b"old model", "out.onnx.data": b"old data"}
NEW_PAIR = {"out.onnx": b"new model", "out.onnx.data": b"new data"}

# what a run replacing OUT.onnx + OUT.onnx.data is killed in, with (old) or without an old
# pair; "where:N:how" kills it before (or after) the N-th call, or makes that call raise.
# With an old pair os.rename sets aside (1) the data, (2) the model, renames in (3) the new
# data, (4) the new model; without one, (1) the data and (2) the model.
KILLS = {
    "flushing-the-temporaries": (True, ["atomic._sync_tree:1:before"], OLD_PAIR),
    "recorded-nothing-moved": (True, ["os.rename:1:before"], OLD_PAIR),
    "old-data-set-aside": (True, ["os.rename:2:before"], OLD_PAIR),
    "old-pair-set-aside": (True, ["os.rename:3:before"], OLD_PAIR),
    "new-data-in-no-model": (True, ["os.rename:4:before"], OLD_PAIR),
    "new-model-in": (True, ["os.rename:4:after"], NEW_PAIR),
    "removing-the-olds": (True, ["os.unlink:1:after"], NEW_PAIR),
    "rolling-back-a-failed-rename": (True, ["os.rename:4:raise", "os.replace:1:after"], OLD_PAIR),
    "fresh-new-data-in-no-model": (False, ["os.rename:2:before"], {}),
    "fresh-new-model-in": (False, ["os.rename:2:after"], NEW_PAIR),
}


def _kill_group_write(folder: Path, old: bool, specs) -> int:
    """Run a pair's replacement in a child killed with SIGKILL where ``specs`` say; its pid."""
    for name, data in OLD_PAIR.items() if old else ():
        (folder / name).write_bytes(data)
    return _killed(GROUP_WRITER, specs, [folder])


def _killed(script: str, specs, args) -> int:
    """Run ``script`` in a child that ``specs`` kill with SIGKILL; its pid."""
    child = subprocess.Popen([sys.executable, "-c", script, *specs, "--", *map(str, args)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL, stderr
    return child.pid


def _next_run(folder: Path, *, extra: bool = True) -> tuple[dict[str, bytes], list[str]]:
    """What the next run (of the pair, or of the model alone) finds once it has cleaned up, and
    its notes; it then writes its own output, and nothing of the killed run's is left."""
    from fusectl.io.atomic import atomic_output, temporary_name

    out, data, notes = folder / "out.onnx", folder / "out.onnx.data", []
    with atomic_output(str(out), force=True, inputs=[], on_note=notes.append,
                       extra=[str(data)] if extra else []) as temp:
        found = {p.name: p.read_bytes() for p in folder.iterdir()}
        Path(temp).write_bytes(b"next model")
        if extra:
            Path(temporary_name(str(data))).write_bytes(b"next data")
    assert [p.name for p in folder.iterdir() if ".fusectl-" in p.name] == []
    assert out.read_bytes() == b"next model"
    return found, notes


@pytest.mark.parametrize("kill", KILLS)
def test_a_group_killed_anywhere_is_found_whole_by_the_next_run(tmp_path, kill):
    """Killed at any point of replacing a model and its data file, the next run settles what
    was left: the whole old pair (or nothing) before the model's rename, the whole new pair after."""
    old, specs, expected = KILLS[kill]
    pid = _kill_group_write(tmp_path, old, specs)
    left = [p.name for p in tmp_path.iterdir() if ".fusectl-" in p.name]
    assert left and all(name.endswith(f"-{pid}") for name in left)
    found, notes = _next_run(tmp_path)
    assert found == expected
    assert notes and all(f"a killed run (pid {pid})" in note for note in notes)


@pytest.mark.parametrize("kill", ["new-data-in-no-model", "new-model-in"])
def test_a_killed_groups_record_settles_it_for_a_run_that_writes_only_the_model(tmp_path, kill):
    """The next export may keep its tensors inline: the model alone is its output, and the
    killed run's record still settles the data file with the model."""
    old, specs, expected = KILLS[kill]
    _kill_group_write(tmp_path, old, specs)
    found, _ = _next_run(tmp_path, extra=False)
    assert found == expected


def _drop_record(folder: Path, pid: int) -> None:
    (folder / f".out.onnx.fusectl-group-{pid}").unlink()


def _cut_record(folder: Path, pid: int) -> None:
    (folder / f".out.onnx.fusectl-group-{pid}").write_text('{"outputs": [["out.onnx.da')


def _forge_record(folder: Path, pid: int) -> None:
    (folder / f".out.onnx.fusectl-group-{pid}").write_text('{"outputs": [["../elsewhere", 1], ["out.onnx", 2]]}')


@pytest.mark.parametrize("kill, damage, note", [
    ("new-data-in-no-model", _drop_record, "restored {folder}/out.onnx.data from "),  # an older fusectl's
    ("flushing-the-temporaries", _cut_record, "removed {folder}/.out.onnx.fusectl-group-"),  # killed writing it
    ("new-data-in-no-model", _forge_record, "restored {folder}/out.onnx.data from "),  # names a file elsewhere
], ids=["no-record", "cut-short-record", "forged-record"])
def test_without_a_usable_record_a_missing_model_puts_its_old_pair_back(tmp_path, kill, damage, note):
    """No record, or one that cannot be trusted: a model missing with its old one set aside
    means the pair was not committed, and every old file of the pair is put back."""
    old, specs, expected = KILLS[kill]
    pid = _kill_group_write(tmp_path, old, specs)
    damage(tmp_path, pid)
    found, notes = _next_run(tmp_path)
    assert found == expected == OLD_PAIR
    assert any(n.startswith(note.format(folder=tmp_path)) for n in notes), notes


@pytest.mark.parametrize("kill, staged", [
    ("onnx_ir.save:1:after", True),  # the pair staged in .out.onnx.fusectl-tmp-PID.d, nothing renamed
    ("os.rename:4:before", False),  # the new data in place, the old model set aside
], ids=["saving", "between-the-renames"])
def test_an_export_killed_mid_replace_leaves_the_old_pair_for_the_next_export(cli, tmp_path, monkeypatch,
                                                                             kill, staged):
    """A real ``fusectl export`` writing OUT.onnx + OUT.onnx.data, killed with SIGKILL: the next
    export puts the old pair back whole (and, as always, needs --force to replace it)."""
    import fusectl.onnx.export

    fixture = Path(__file__).resolve().parent.parent / "fixtures" / "onnx" / "wnconv"
    fused = tmp_path / "fused"
    ok(cli("fuse", fixture, "-r", "weight-norm-fold", "-o", fused, "--quiet"))
    out = tmp_path / "out" / "model.onnx"
    out.parent.mkdir()
    for name, data in {"model.onnx": b"old model", "model.onnx.data": b"old data"}.items():
        (out.parent / name).write_bytes(data)
    command = ["export", fused, "--graph", fixture / "model.onnx", "-o", out, "--force"]
    pid = _killed(EXPORTER, [kill], command)
    assert (f".model.onnx.fusectl-tmp-{pid}.d" in os.listdir(out.parent)) == staged == out.exists()
    assert ((out.parent / "model.onnx.data").read_bytes() == b"old data") == staged
    result = cli(*command[:-1])
    assert result.exit_code == 2 and "model.onnx: already exists; pass --force" in result.stderr
    assert f"a killed run (pid {pid})" in result.stderr
    assert {p.name: p.read_bytes() for p in out.parent.iterdir()} == {"model.onnx": b"old model",
                                                                    "model.onnx.data": b"old data"}
    monkeypatch.setattr(fusectl.onnx.export, "EXTERNAL_DATA_THRESHOLD", 16)
    ok(cli(*command))
    assert sorted(os.listdir(out.parent)) == ["model.onnx", "model.onnx.data"]
