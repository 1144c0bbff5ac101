"""Replacing an output atomically: written under a temporary name, flushed, renamed into place.

An output may be a group: a main output and further files that belong with it (an ONNX model
and its external data ``OUT.onnx.data``). The group is replaced as one: whatever fails, and
wherever a run is killed, the next run finds either the whole old group or the whole new one.
Everything lives beside the output; ``PID`` is the writing process's id:

- ``.NAME.fusectl-tmp-PID``: where the new ``NAME`` is written (``temporary_name``);
- ``.NAME.fusectl-old-PID``: the old ``NAME``, set aside while the new group is renamed in;
- ``.MAIN.fusectl-group-PID``: the group's record — each member's name and the inode of its
  new file — written before anything is renamed and removed last.

``atomic_output`` replaces a group in five steps:

1. the body writes every temporary; each is flushed (its files, then its folders);
2. the record is written and flushed;
3. every member that exists is moved aside to its ``old`` name;
4. every temporary is renamed into place, the extras first and the main output last: that
   last rename commits the group;
5. the group is settled — the set-aside olds, then the record, are removed — and the parent
   folder is flushed.

Settling decides from the record and the files alone: the group is committed if and only if
the main output in place is the new file (its inode is the recorded one). If not — anything failed or was
interrupted (any exception, KeyboardInterrupt too) before the main output's rename — settling
rolls back: each new file renamed in goes, each old one comes back, the temporaries go. Every
step of settling can be repeated, so a run killed while settling is settled again.

A run killed with SIGKILL leaves its files behind; the next ``atomic_output`` that writes any
member of the group settles it from its record once the killed process is gone:

- killed in step 1 or 2: the old group (or none) stands, beside temporaries and maybe a record
  cut short; the next run removes them (a record that cannot be read was cut short before
  anything was renamed);
- killed in step 3 or 4 before the main output's rename: some members set aside, some new
  extras in place; the next run removes the new extras and puts the old group back;
- killed after the main output's rename: the new group stands, beside olds and the record; the
  next run removes them.

Leftovers without a usable record (an older fusectl's) are settled for the group the next run
writes: a missing main output with its ``old`` beside it means the group was not committed,
and every old member is put back over whatever stands in its place; a new extra with no old
one cannot be told from a file of someone else's, and stays.

The flushes make a finished replacement survive a crash of the machine as well; the whole-group
guarantee is for a run that dies, not for a disk that loses what it was told to write.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from ..errors import OutputError, option, option_name

Note = Callable[[str], None]


@contextlib.contextmanager
def atomic_output(path: str, *, force: bool, inputs: Sequence[str], on_note: Note | None = None,
                  extra: Sequence[str] = ()) -> Iterator[str]:
    """Yield a temporary path beside ``path``; rename it into place only if the body succeeds.

    ``extra`` names further outputs in the same folder that belong with the main one (an ONNX
    model's external data): the body writes each at ``temporary_name(extra)``, and the group
    is replaced as one (see the module's docstring). Leftovers of a killed run for any of these
    outputs are settled first, each step reported through ``on_note``.

    >>> import pathlib, tempfile
    >>> out = pathlib.Path(tempfile.mkdtemp(), "notes.txt")
    >>> with atomic_output(str(out), force=False, inputs=[]) as temp:
    ...     _ = pathlib.Path(temp).write_text("new")
    ...     out.exists()  # not yet: it is renamed into place once the body has succeeded
    False
    >>> out.read_text()
    'new'
    >>> shutil.rmtree(out.parent)
    """
    note = on_note or _silent
    outputs = [*extra, path]  # the order of the renames: the main output last
    finals = [os.path.realpath(output) for output in outputs]
    parent = os.path.dirname(finals[-1])
    if any(os.path.dirname(final) != parent for final in finals):
        raise ValueError(f"{path}: the outputs {list(extra)} that go with it must be in its folder {parent}")
    for output, final in reversed(list(zip(outputs, finals))):  # the main output's errors first
        _refuse_input(output, final, inputs)
    if not os.path.isdir(parent):
        raise OutputError(f"{path}: the folder {parent} does not exist")
    group = _Group(parent, [os.path.basename(final) for final in finals], os.getpid(), {})
    _clean_stale(parent, group.names, note)
    for output, final in reversed(list(zip(outputs, finals))):
        if os.path.lexists(final) and not force:
            raise OutputError(f"{output}: already exists; pass {option('force')} to replace it")
    for name in group.names:
        _remove(group.temp(name))
    try:
        try:
            yield group.temp(group.main)
            for name in group.names:
                _sync_tree(group.temp(name))
            group.record()
        except OSError as e:
            if e.errno in _NO_SPACE:
                raise OutputError(f"{path}: {e.strerror} while writing it; nothing was written. "
                                  f"Free some space (or choose another {option_name('out')}) and run again") from e
            raise
        group.swap_in()
    finally:
        group.settle(_silent)
    _sync(parent)


def temporary_name(path: str) -> str:
    """Where ``atomic_output`` has an output written: ``.NAME.fusectl-tmp-PID`` beside it."""
    return _beside(os.path.realpath(path), "tmp", os.getpid())


def _beside(final: str, kind: str, pid: int) -> str:
    """``.NAME.fusectl-KIND-PID`` beside ``final``: a temporary, a set-aside old, a group's record."""
    return os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.fusectl-{kind}-{pid}")


@dataclass
class _Group:
    """The outputs one run replaces together, and the names its files take beside them."""

    parent: str
    names: list[str]  # the extras first, the main output last
    pid: int
    new: dict[str, int] | None  # name → inode of its new file; None: not recorded (older fusectl)

    @property
    def main(self) -> str:
        return self.names[-1]

    def final(self, name: str) -> str:
        return os.path.join(self.parent, name)

    def temp(self, name: str) -> str:
        return self._beside(name, "tmp")

    def old(self, name: str) -> str:
        return self._beside(name, "old")

    @property
    def record_path(self) -> str:
        return self._beside(self.main, "group")

    def _beside(self, name: str, kind: str) -> str:
        return _beside(self.final(name), kind, self.pid)

    def record(self) -> None:
        """Note each new file's inode, on disk before any rename, for whoever settles the group."""
        self.new = {name: os.lstat(self.temp(name)).st_ino for name in self.names}
        with open(self.record_path, "w") as f:
            json.dump({"outputs": [[name, self.new[name]] for name in self.names]}, f)
            f.flush()
            os.fsync(f.fileno())

    @classmethod
    def read(cls, parent: str, main: str, pid: int) -> _Group | None:
        """The group a run recorded, or None where its record was cut short (nothing was renamed)."""
        group = cls(parent, [main], pid, None)
        try:
            with open(group.record_path) as f:
                outputs = [(str(name), int(inode)) for name, inode in json.load(f)["outputs"]]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        names = [name for name, _ in outputs]
        if not names or names[-1] != main or any(os.path.basename(n) != n or n in ("", ".", "..") for n in names):
            return None
        return cls(parent, names, pid, dict(outputs))

    def swap_in(self) -> None:
        """Set every existing member aside, then rename each new one in, the main output last."""
        for name in self.names:
            if os.path.lexists(self.final(name)):
                os.rename(self.final(name), self.old(name))
        for name in self.names:
            os.rename(self.temp(name), self.final(name))

    def committed(self) -> bool:
        if self.new is None:
            main = self.main
            return not (os.path.lexists(self.old(main)) and not os.path.lexists(self.final(main)))
        return self._is_new(self.main)

    def settle(self, note: Note) -> None:
        """Keep the new group if its main output is in place, else put the old one back; then
        remove the olds, the temporaries and the record (last, so that this can be repeated)."""
        committed = self.committed()
        for name in self.names:
            final, old = self.final(name), self.old(name)
            if not committed and self._is_new(name):
                _remove(final)
                note(f"removed {final}, which a killed run (pid {self.pid}) had renamed into place "
                     "before the rest of its group")
            if os.path.lexists(old) and (not committed or not os.path.lexists(final)):
                os.replace(old, final)
                note(f"restored {final} from {old}, where a killed run (pid {self.pid}) had moved it")
            self._drop(old, note)
            self._drop(self.temp(name), note)
        self._drop(self.record_path, note)

    def _is_new(self, name: str) -> bool:
        if not self.new or name not in self.new:
            return False
        try:
            return os.lstat(self.final(name)).st_ino == self.new[name]
        except FileNotFoundError:
            return False

    def _drop(self, leftover: str, note: Note) -> None:
        if os.path.lexists(leftover):
            _remove(leftover)
            note(_removed(leftover, self.pid))


def _refuse_input(output: str, target: str, inputs: Sequence[str]) -> None:
    """An output may not overwrite an input, hold one, or land inside an input folder."""
    for source in inputs:
        source = os.path.realpath(source)
        if target == source or source.startswith(target.rstrip(os.sep) + os.sep):
            raise OutputError(f"{output}: the output would overwrite the input {source}; choose another {option_name('out')}")
        if os.path.isdir(source) and target.startswith(source.rstrip(os.sep) + os.sep):
            raise OutputError(f"{output}: the output would land inside the input folder {source}; "
                              f"choose another {option_name('out')}")


_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_LEFTOVER = re.compile(r"\.(?P<base>.+)\.fusectl-(?P<kind>tmp|old|group)-(?P<pid>[0-9]+)(?:\.d)?")


def _clean_stale(parent: str, names: Sequence[str], on_note: Note) -> None:
    """Settle what runs that are gone left for the outputs ``names``: each group they recorded
    that holds one of them, else (no record) these outputs as one group; then remove any other
    temporary of theirs (a staging folder ``.NAME.fusectl-tmp-PID.d``, a record cut short)."""
    dead: dict[int, list[re.Match]] = {}
    for entry in sorted(os.listdir(parent)):
        m = _LEFTOVER.fullmatch(entry)
        if m and not _alive(int(m["pid"])):
            dead.setdefault(int(m["pid"]), []).append(m)
    for pid, found in dead.items():
        recorded = (_Group.read(parent, m["base"], pid) for m in found if m["kind"] == "group")
        groups = [g for g in recorded if g is not None and set(g.names) & set(names)]
        if not groups and any(m["base"] in names for m in found):
            groups = [_Group(parent, list(names), pid, None)]
        for group in groups:
            group.settle(on_note)
        for m in found:
            leftover = os.path.join(parent, m.string)
            if m["base"] in names and os.path.lexists(leftover):
                _remove(leftover)
                on_note(_removed(leftover, pid))


def _removed(leftover: str, pid: int) -> str:
    return f"removed {leftover}, left by a killed run (pid {pid})"


def _silent(message: str) -> None:
    """Settling its own group, a run has nothing to report: the error it raises says it all."""


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process, or no such pid on this platform: leave it
    return True


def _sync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(path: str) -> None:
    """fsync a file, or every file and folder under a folder (files first)."""
    if not os.path.isdir(path):
        _sync(path)
        return
    folders = []
    for root, _, files in os.walk(path):
        folders.append(root)
        for name in files:
            _sync(os.path.join(root, name))
    for folder in reversed(folders):
        _sync(folder)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)
