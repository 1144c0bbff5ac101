"""Reading untrusted files: regular files only (``open_input``), and JSON whose nesting and
integer sizes stay within their budgets (``load_json``).

>>> load_json(b'{"hidden_size": 4096}', "config.json")
{'hidden_size': 4096}
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import re
import stat
from typing import BinaryIO, Callable

import numpy as np

from ..errors import CheckpointError, FusectlError, printable
from ..limits import check_limit, limit

# ------------------------------------------------------------------------------ input files

# pseudo filesystems whose "regular" files are generated on read (/proc/self/environ, /sys/...)
_PSEUDO_ROOTS = ("/proc", "/sys")


def is_generated(path: str) -> bool:
    """Whether ``path`` resolves into /proc or /sys, whose files the kernel makes up as they are read."""
    real = os.path.realpath(path)
    return any(real == root or real.startswith(root + "/") for root in _PSEUDO_ROOTS)


def check_regular_file(path: str, *, error: type[FusectlError] = CheckpointError,
                       hint: str = "name the checkpoint file itself", what: str | None = None) -> os.stat_result:
    """The stat of ``path`` when it resolves to a regular file outside /proc and /sys; ``error``
    naming it (as ``what``, default the path) otherwise, with ``hint`` saying what to give instead.

    Nothing is opened: a FIFO (whose ``open`` blocks), a device (whose ``open`` may act) or a
    socket is refused without being touched.
    """
    what = what or printable(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise error(f"{what}: no such file; {hint}") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the name
        raise error(f"{what}: cannot read it ({getattr(e, 'strerror', None) or e})") from e
    if not stat.S_ISREG(info.st_mode):
        kind = ("a folder" if stat.S_ISDIR(info.st_mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(info.st_mode)
                else "a socket" if stat.S_ISSOCK(info.st_mode)
                else "a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode) else "not a file")
        raise error(f"{what}: is {kind}, not a regular file; fusectl reads only regular files — {hint}")
    if is_generated(path):
        raise error(f"{what}: resolves to {printable(os.path.realpath(path))}, not a regular file "
                    f"but one the kernel generates; fusectl never reads /proc or /sys — {hint}")
    return info


def open_input(path: str) -> BinaryIO:
    """Open ``path`` for reading when it resolves to a regular file; CheckpointError otherwise.

    The file is checked before it is opened (``check_regular_file``), then opened non-blocking
    and checked again, so a swap after the check cannot make it block.
    """
    check_regular_file(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CheckpointError(f"{printable(path)}: cannot read it ({e.strerror})") from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{printable(path)}: changed into something other than a regular file "
                                  "while fusectl opened it; name the checkpoint file itself")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


# ------------------------------------------------------------------------------------- JSON


class MalformedJSON(CheckpointError):
    """JSON text that does not parse (or holds NaN/Infinity); ``detail`` says why, for callers
    that word the error their own way."""

    def __init__(self, message: str, detail: str):
        super().__init__(message)
        self.detail = detail


class _Refused(Exception):
    """Raised inside a parse hook; load_json turns it into a FusectlError."""


class _OverBudget(Exception):
    """Raised inside a parse hook for a value past a budget: (limit key, value)."""


_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'"[]{}')
_STRING = re.compile(rb'"[^"]*"')
_DIGITS_ONLY = bytes(0x30 if 0x30 <= c <= 0x39 else 0x20 for c in range(256))
_CHUNK = 1 << 20


def load_json(text: bytes | str, where: str, what: str = "the JSON", *, object_pairs_hook: Callable | None = None):
    """Parse JSON from an untrusted file within the ``json-depth`` and ``integer-digits`` budgets.

    Nesting is measured on the raw text before parsing (so 10^5 nested brackets cost
    a scan, not a RecursionError); integers longer than the budget are refused as they are
    parsed, NaN and ±Infinity (not JSON) are refused, and ``-0`` reads as the float ``-0.0``
    as strict JSON readers (serde_json, hence the safetensors library) read it. ``where`` and
    ``what`` name the source in errors: ``"config.json: the config is not valid JSON (...)"``.

    >>> load_json('[[[1]]]', "x.json")
    [[[1]]]
    >>> load_json('{"n": NaN}', "x.json")
    Traceback (most recent call last):
    ...
    fusectl.io.untrusted.MalformedJSON: x.json: the JSON holds NaN, which JSON does not allow; the file is corrupt
    """
    if isinstance(text, bytes):
        raw = text
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            detail = f"byte {e.start} is not UTF-8"
            raise MalformedJSON(f"{where}: {what} is not valid JSON ({detail}); the file is corrupt", detail) from None
    else:
        raw = text.encode("utf-8", "surrogatepass")
    check_limit("json-depth", json_depth(raw, limit("json-depth")), f"{where}: {what}")
    digits = limit("integer-digits")
    # the hook costs a call per integer: attach it only when some integer may need it
    hook = _bounded_int(digits) if b"-0" in raw or _has_digit_run(raw, digits + 1) else None
    try:
        with collector_paused():
            return json.loads(text, parse_int=hook, parse_float=_finite_float, parse_constant=_no_constant,
                              object_pairs_hook=object_pairs_hook)
    except _OverBudget as e:
        check_limit(*e.args, f"{where}: {what}")
        raise
    except _Refused as e:
        raise MalformedJSON(f"{where}: {what} {e}; the file is corrupt", str(e)) from None
    except json.JSONDecodeError as e:
        raise MalformedJSON(f"{where}: {what} is not valid JSON ({e}); the file is corrupt", str(e)) from e
    except RecursionError:  # the scan above bounds nesting; this is the parser's own guard
        check_limit("json-depth", limit("json-depth") + 1, f"{where}: {what} (at least)")
        raise


def read_json_file(path: str, what: str):
    """The JSON in the file at ``path`` (a regular file within the ``json-bytes`` budget), parsed
    by :func:`load_json`; ``what`` names it in errors (``"the index"``, ``"the config"``)."""
    return load_json(read_json_bytes(path, what), path, what)


def read_json_bytes(path: str, what: str) -> bytes:
    """The bytes of the JSON file at ``path``, refused past the ``json-bytes`` budget before and
    after reading (a file that grows while read is caught too)."""
    try:
        with open_input(path) as f:
            check_limit("json-bytes", os.fstat(f.fileno()).st_size, path)
            raw = f.read()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what}: {e.strerror}") from e
    check_limit("json-bytes", len(raw), path)
    return raw


def json_depth(raw: bytes, budget: int) -> int:
    """How deeply arrays and objects nest in the JSON text ``raw``, found without parsing:
    exact when over ``budget``, else an upper bound that is at most ``budget``.

    Brackets inside strings are counted first (a few C-speed passes); only when that count
    is over the budget are the strings cut out and the brackets counted again.

    >>> json_depth(b'{"a": [[1], 2], "b[[[": {}}', budget=2)
    3
    """
    depth = _bracket_depth(raw.translate(None, _NOT_BRACKETS))
    if depth <= budget:
        return depth
    # escaped backslashes, then escaped quotes, go first; the quotes left then pair up
    structure = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    return _bracket_depth(_STRING.sub(b"", structure.replace(b'""', b"")))


def _bracket_depth(brackets: bytes) -> int:
    deepest = level = 0
    for start in range(0, len(brackets), _CHUNK):
        chunk = np.frombuffer(brackets, np.uint8, min(_CHUNK, len(brackets) - start), start)
        levels = np.cumsum(np.where((chunk == 0x5B) | (chunk == 0x7B), 1, -1).astype(np.int32)) + level
        deepest = max(deepest, int(levels.max()))
        level = int(levels[-1])
    return deepest


def _has_digit_run(raw: bytes, length: int) -> bool:
    return raw.translate(_DIGITS_ONLY).find(b"0" * length) >= 0 if len(raw) >= length else False


def _bounded_int(digits: int) -> Callable[[str], object]:
    def parse(literal: str):
        if len(literal) - (literal[0] == "-") > digits:
            raise _OverBudget("integer-digits", len(literal) - (literal[0] == "-"))
        if literal == "-0":
            return -0.0
        return int(literal)

    return parse


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _Refused(f"holds the number {literal[:20]}, too large for a float")
    return value


def _no_constant(name: str):
    raise _Refused(f"holds {name}, which JSON does not allow")


@contextlib.contextmanager
def collector_paused():
    """Pause the cyclic garbage collector: parsing a 10^6-entry header allocates millions of
    containers, none of them in a cycle, and a collection per 700 allocations tripled its time."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
