"""atomic_output replaces a group — a main output and the files that go with it — as one.

Failures and interrupts inside one run; runs killed with SIGKILL are in test_output_faults.py.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from conftest import BAD_CONCAT_RULES, BF16, LLAMA, assert_refused, leftovers, load_checkpoint_raw, ok, snapshot, write_rules
from fusectl.errors import OutputError
from fusectl.io import atomic
from fusectl.io.atomic import atomic_output, temporary_name


OLD = {"out.onnx": b"old model", "out.onnx.data": b"old data"}
NEW = {"out.onnx": b"new model", "out.onnx.data": b"new data"}


def contents(folder) -> dict[str, bytes]:
    """Every file in ``folder`` and its bytes: a temporary, set-aside or record file shows up too."""
    return {p.name: p.read_bytes() for p in Path(folder).iterdir()}


def write_pair(folder, *, fail: BaseException | None = None, force: bool = True) -> None:
    """Replace OUT.onnx and OUT.onnx.data as one group with NEW; ``fail`` is raised in the body."""
    out, data = Path(folder) / "out.onnx", Path(folder) / "out.onnx.data"
    with atomic_output(str(out), force=force, inputs=[], extra=[str(data)]) as temp:
        Path(temp).write_bytes(NEW["out.onnx"])
        Path(temporary_name(str(data))).write_bytes(NEW["out.onnx.data"])
        if fail is not None:
            raise fail


def prepare(folder, old: bool) -> dict[str, bytes]:
    """The folder's files before the write: nothing, or an old pair."""
    for name, data in OLD.items() if old else ():
        (Path(folder) / name).write_bytes(data)
    return contents(folder)


@pytest.fixture(params=[False, True], ids=["no-old-pair", "old-pair"])
def before(request, tmp_path) -> dict[str, bytes]:
    return prepare(tmp_path, request.param)


def test_success_replaces_the_whole_group_and_leaves_nothing_else(tmp_path, before):
    write_pair(tmp_path)
    assert contents(tmp_path) == NEW


@pytest.mark.parametrize("error", [RuntimeError("bug in the body"), KeyboardInterrupt()], ids=lambda e: type(e).__name__)
def test_a_failure_in_the_body_leaves_the_old_group_or_nothing(tmp_path, before, error):
    with pytest.raises(type(error)):
        write_pair(tmp_path, fail=error)
    assert contents(tmp_path) == before


def _renames(old: bool) -> list[str]:
    """The renames of a pair's replacement, in order: olds aside, then the extra, then the main output."""
    aside = ["aside out.onnx.data", "aside out.onnx"] if old else []
    return [*aside, "in out.onnx.data", "in out.onnx"]


def _step(src: str, dst: str) -> str:
    if ".fusectl-old-" in dst:
        return f"aside {os.path.basename(src)}"
    assert ".fusectl-tmp-" in src
    return f"in {os.path.basename(dst)}"


def _failing_rename(monkeypatch, n: int, error: BaseException, *, after: bool) -> list[str]:
    """os.rename raises ``error`` at its ``n``-th call: instead of renaming, or ``after`` it."""
    real, calls = os.rename, []

    def rename(src, dst):
        calls.append((src, dst))
        if len(calls) == n and not after:
            raise error
        real(src, dst)
        if len(calls) == n:
            raise error

    monkeypatch.setattr(os, "rename", rename)
    return calls


@pytest.mark.parametrize("after", [False, True], ids=["instead-of-the-rename", "after-the-rename"])
@pytest.mark.parametrize("error", [OSError(errno.EIO, "rename failed"), KeyboardInterrupt()], ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("old, n", [
    pytest.param(old, n, id=f"{'old' if old else 'no-old'}-pair-{n}:{step.replace(' ', '-')}")
    for old in (False, True) for n, step in enumerate(_renames(old), 1)
])
def test_a_failure_at_any_rename_leaves_one_whole_group(tmp_path, monkeypatch, old, n, error, after):
    """Until the main output's rename has happened the old group (or nothing) comes back;
    from then on the new group stands. Either way no temporary, old or record file remains."""
    before = prepare(tmp_path, old)
    steps = _renames(old)
    calls = _failing_rename(monkeypatch, n, error, after=after)
    with pytest.raises(type(error)):
        write_pair(tmp_path)
    assert [_step(src, dst) for src, dst in calls] == steps[:n]
    committed = steps[n - 1] == "in out.onnx" and after
    assert contents(tmp_path) == (NEW if committed else before)


def test_a_failure_after_the_commit_keeps_the_new_group_and_drops_the_olds(tmp_path, monkeypatch):
    prepare(tmp_path, old=True)

    def flush(path):
        raise OSError(errno.EIO, "folder flush failed")

    monkeypatch.setattr(atomic, "_sync", flush)  # files are flushed by _sync_tree, the folder by _sync
    monkeypatch.setattr(atomic, "_sync_tree", lambda path: None)
    with pytest.raises(OSError, match="folder flush failed"):
        write_pair(tmp_path)
    assert contents(tmp_path) == NEW


def test_a_folder_output_is_put_back_whole_when_its_rename_fails(tmp_path, monkeypatch):
    out = tmp_path / "fused"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old")
    _failing_rename(monkeypatch, 2, OSError(errno.EIO, "rename failed"), after=False)
    with pytest.raises(OSError, match="rename failed"):
        with atomic_output(str(out), force=True, inputs=[]) as temp:
            os.makedirs(temp)
            Path(temp, "model.safetensors").write_bytes(b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fused"]
    assert contents(out) == {"model.safetensors": b"old"}


def test_a_full_disk_while_recording_the_group_names_the_output_and_writes_nothing(tmp_path, monkeypatch, before):
    real = atomic.json.dump

    def dump(obj, f, **kwargs):
        real(obj, f, **kwargs)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic.json, "dump", dump)
    with pytest.raises(OutputError, match=r"out\.onnx: No space left on device while writing it; nothing was written"):
        write_pair(tmp_path)
    assert contents(tmp_path) == before


def test_each_output_of_a_group_needs_force_and_none_may_be_an_input(tmp_path):
    (tmp_path / "out.onnx.data").write_bytes(b"someone else's")
    with pytest.raises(OutputError, match=r"out\.onnx\.data: already exists; pass force=True"):
        write_pair(tmp_path, force=False)
    data = str(tmp_path / "out.onnx.data")
    with pytest.raises(OutputError, match="would overwrite the input"):
        with atomic_output(str(tmp_path / "out.onnx"), force=True, inputs=[data], extra=[data]):
            pytest.fail("the body ran")
    assert contents(tmp_path) == {"out.onnx.data": b"someone else's"}


def test_the_files_of_a_group_must_share_a_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match="must be in its folder"):
        with atomic_output(str(tmp_path / "out.onnx"), force=True, inputs=[],
                           extra=[str(tmp_path / "sub" / "out.onnx.data")]):
            pytest.fail("the body ran")
    assert contents(tmp_path / "sub") == {}


def test_what_a_live_run_left_is_not_touched(tmp_path):
    """A run still going owns its files: this process's own, and those of a pid that cannot be
    asked (another user's, or too big for this platform) are left as they are."""
    unknown = 10**20  # os.kill raises OverflowError: as for another user's process, assume it lives
    theirs = {f".out.onnx.fusectl-group-{unknown}": b"{}", f".out.onnx.fusectl-old-{unknown}": b"their old model",
              f".out.onnx.data.fusectl-tmp-{unknown}": b"their data", f".other.fusectl-tmp-{os.getpid()}": b"mine"}
    for name, data in theirs.items():
        (tmp_path / name).write_bytes(data)
    write_pair(tmp_path)
    assert contents(tmp_path) == {**theirs, **NEW}


# --- bad input through the CLI: refused in full (conftest.assert_refused) ----------------


def test_existing_output_without_force(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    out = area / "out" / "fused.safetensors"
    out.write_bytes(b"precious")
    before_in = snapshot(area / "in")
    result = cli("fuse", src, "-r", "llama-qkv", "-o", out)
    assert result.exit_code == 2
    assert result.stderr.startswith("error:")
    assert "fused.safetensors" in result.stderr and "--force" in result.stderr
    assert out.read_bytes() == b"precious"
    assert leftovers(out.parent) == []
    assert snapshot(area / "in") == before_in


def test_existing_output_with_force_is_replaced(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    out = area / "out" / "fused.safetensors"
    out.write_bytes(b"precious")
    ok(cli("fuse", src, "-r", "llama-qkv", "-o", out, "--force"))
    assert "model.layers.0.self_attn.qkv_proj.weight" in load_checkpoint_raw(out)
    assert leftovers(out.parent) == []


def test_existing_folder_output_with_force_is_replaced(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    out = area / "out" / "fused"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    ok(cli("fuse", src, "-r", "llama-qkv", "-o", out, "--force"))
    assert not (out / "stale.txt").exists()
    assert (out / "model.safetensors").exists()
    assert leftovers(out.parent) == []


def test_failed_run_with_force_keeps_old_output(cli, area, copy_fixture):
    """A failing run with --force leaves the previous output exactly as it was."""
    src = copy_fixture(LLAMA)
    out = area / "out" / "fused"
    ok(cli("fuse", src, "-r", "llama-qkv", "-o", out))
    old = snapshot(area / "out")
    rules = write_rules(area / "in" / "shape.toml", BAD_CONCAT_RULES)
    result = cli("fuse", src, "-r", rules, "-o", out, "--force")
    assert result.exit_code == 2 and result.stderr.startswith("error:")
    assert snapshot(area / "out") == old


def test_write_failure_with_force_keeps_old_output(cli, area, copy_fixture, monkeypatch):
    """A failure in the middle of writing (disk full) leaves the old output and no temp file."""
    import fusectl.io.formats.safetensors_file as st

    src = copy_fixture(LLAMA)
    out = area / "out" / "fused"
    ok(cli("fuse", src, "-r", "llama-qkv", "-o", out))
    old = snapshot(area / "out")
    before_in = snapshot(area / "in")

    real_write_all = st.write_all
    calls = {"n": 0}

    def failing_write_all(fd, data, *rest):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write_all(fd, data, *rest)

    def failing_copy(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(st, "write_all", failing_write_all)
    monkeypatch.setattr(st, "copy_ranges", failing_copy)
    result = cli("fuse", src, "-r", "llama-qkv", "-r", "llama-gate-up", "-o", out, "--force")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error:")
    assert "Traceback" not in result.output
    assert snapshot(area / "out") == old
    assert leftovers(area / "out") == []
    assert snapshot(area / "in") == before_in


def test_write_failure_without_existing_output_leaves_nothing(cli, area, copy_fixture, monkeypatch):
    import fusectl.io.formats.safetensors_file as st

    src = copy_fixture(BF16)

    def failing_copy(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(st, "copy_ranges", failing_copy)
    out = area / "out" / "fused"
    before = snapshot(area / "in")
    result = cli("fuse", src, "-r", "llama-qkv", "-o", out, "--max-shard-size", "20KB")
    assert_refused(result, out, before, area / "in")
    assert os.listdir(area / "out") == []


def test_output_equal_to_input_file(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    model = src / "model.safetensors"
    before = snapshot(area / "in")
    for extra in ([], ["--force"]):
        result = cli("fuse", model, "-r", "llama-qkv", "-o", model, *extra,
                     "--config", src / "config.json")
        assert result.exit_code == 2, result.output
        assert result.stderr.startswith("error:")
        assert "model.safetensors" in result.stderr
        assert snapshot(area / "in") == before
        assert leftovers(src) == []


def test_output_equal_to_input_folder(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    before = snapshot(area / "in")
    result = cli("fuse", src, "-r", "llama-qkv", "-o", src, "--force")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error:")
    assert snapshot(area / "in") == before
    assert leftovers(area / "in") == []


def test_output_folder_containing_input_shard(cli, area, copy_fixture):
    """-o naming the sharded input's folder (spelled differently) is still the input."""
    src = copy_fixture(BF16)
    before = snapshot(area / "in")
    result = cli("fuse", src / "model.safetensors.index.json", "-r", "llama-qkv",
                 "-o", str(src) + "/", "--force")
    assert result.exit_code == 2, result.output
    assert snapshot(area / "in") == before


def test_output_parent_missing(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    out = area / "out" / "no" / "such" / "dir" / "x.safetensors"
    before = snapshot(area / "in")
    result = cli("fuse", src, "-r", "llama-qkv", "-o", out)
    assert result.exit_code == 2
    assert result.stderr.startswith("error:")
    assert not out.exists()
    assert snapshot(area / "in") == before


def test_output_is_the_input_through_a_symlink(cli, area, copy_fixture):
    """-o naming the input's real path while CKPT is a symlink to it: still the input."""
    src = copy_fixture(LLAMA)
    link = area / "in" / "link"
    link.symlink_to(src, target_is_directory=True)
    before = snapshot(src)
    result = cli("fuse", link, "-r", "llama-qkv", "-o", src, "--force")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error:")
    assert snapshot(src) == before, "the input was overwritten"
    assert leftovers(area / "in") == []


def test_output_symlink_pointing_at_the_input(cli, area, copy_fixture):
    """-o is a symlink to the input file: refuse rather than risk replacing what it names."""
    src = copy_fixture(LLAMA)
    model = src / "model.safetensors"
    link = area / "out" / "alias.safetensors"
    link.symlink_to(model)
    before = snapshot(src)
    result = cli("fuse", src, "-r", "llama-qkv", "-o", link, "--force")
    # whatever the outcome, the input's bytes must be intact
    assert snapshot(src) == before
    assert "Traceback" not in result.output


def test_output_inside_the_input_folder_is_refused(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    before = snapshot(area / "in")
    # the folder itself is the input; and a file input's config.json is an input too
    for ckpt, out in ((src, src / "fused.safetensors"), (src / "model.safetensors", src / "config.json")):
        result = cli("fuse", ckpt, "-r", "llama-qkv", "-o", out, "--force")
        assert result.exit_code == 2, result.output
        assert "input" in result.stderr
    assert snapshot(area / "in") == before
