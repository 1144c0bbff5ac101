"""fusectl/io/streaming.py: range copies in the kernel or through a buffer give the source's
bytes; where the kernel cannot copy, the rest goes through the buffer; writeback is asked for
window by window, in order, to the end of the file, and its thread closes what it opened."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest

import fusectl.io.streaming as streaming
from fusectl.errors import CheckpointError
from fusectl.tensors import ByteRange


@pytest.fixture
def sources(tmp_path):
    rng = __import__("random").Random(7)
    files = {}
    for name, size in (("a.bin", 3 << 20), ("b.bin", 200_001)):
        path = tmp_path / name
        path.write_bytes(rng.randbytes(size))
        files[name] = str(path)
    return files


def _ranges(files):
    a, b = files["a.bin"], files["b.bin"]
    return [ByteRange(a, 1, 1_500_000), ByteRange(b, 4097, 100_000), ByteRange(a, 2_000_000, 1_145_727),
            ByteRange(b, 0, 0), ByteRange(b, 0, 7)]


def _expected(ranges, head):
    out = bytearray(head)
    for r in ranges:
        with open(r.path, "rb") as f:
            f.seek(r.offset)
            out += f.read(r.length)
    return bytes(out)


def _copy(tmp_path, ranges, **kwargs):
    dst = tmp_path / "out.bin"
    head = b"h" * 12_345  # the copies start at an unaligned offset, as after a safetensors header
    with open(dst, "wb", buffering=0) as f:
        streaming.write_all(f.fileno(), head)
        streaming.copy_ranges(ranges, f.fileno(), None, **kwargs)
    return dst.read_bytes(), _expected(ranges, head)


def test_kernel_copy_gives_the_source_bytes(tmp_path, sources, monkeypatch):
    calls = []
    real = os.copy_file_range
    monkeypatch.setattr(os, "copy_file_range", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(os, "preadv", _refuse)
    got, expected = _copy(tmp_path, _ranges(sources))
    assert got == expected
    assert calls  # the kernel did copy


def test_buffered_copy_gives_the_source_bytes_and_shows_every_chunk(tmp_path, sources, monkeypatch):
    monkeypatch.setattr(os, "copy_file_range", _refuse)
    chunks = []
    got, expected = _copy(tmp_path, _ranges(sources), seen=lambda c: chunks.append(bytes(c)))
    assert got == expected
    assert b"".join(chunks) == expected[12_345:]


@pytest.mark.parametrize("code", [errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP])
@pytest.mark.parametrize("after", [0, 1])
def test_where_the_kernel_cannot_copy_the_rest_goes_through_the_buffer(tmp_path, sources, monkeypatch, code, after):
    real = os.copy_file_range
    calls = {"n": 0}

    def partly(src, dst, count, offset_src=None, offset_dst=None):
        calls["n"] += 1
        if calls["n"] > after:
            raise OSError(code, os.strerror(code))
        return real(src, dst, min(count, 4096 * 3 + 5), offset_src)

    monkeypatch.setattr(os, "copy_file_range", partly)
    monkeypatch.setattr(streaming, "_kernel_copies", True)
    got, expected = _copy(tmp_path, _ranges(sources))
    assert got == expected


def test_a_kernel_copy_error_that_is_not_unsupported_is_raised(tmp_path, sources, monkeypatch):
    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "copy_file_range", full)
    monkeypatch.setattr(os, "write", _refuse)
    with pytest.raises(OSError) as e:
        with open(tmp_path / "out.bin", "wb", buffering=0) as f:
            streaming.copy_ranges(_ranges(sources), f.fileno(), None)
    assert e.value.errno == errno.ENOSPC


@pytest.mark.parametrize("kernel", [True, False])
def test_a_source_shorter_than_its_range_is_refused(tmp_path, sources, monkeypatch, kernel):
    if not kernel:
        monkeypatch.setattr(os, "copy_file_range", _cross_device)
    size = os.path.getsize(sources["b.bin"])
    with pytest.raises(CheckpointError, match="b.bin: ended early"):
        _copy(tmp_path, [ByteRange(sources["b.bin"], size - 10, 11)])


def test_writeback_is_asked_window_by_window_to_the_end(tmp_path, sources, monkeypatch):
    asked = []
    done = threading.Event()

    def advise(fd, offset, length, advice):
        assert advice == os.POSIX_FADV_DONTNEED
        asked.append((offset, length))
        if length == 0:
            done.set()

    monkeypatch.setattr(streaming, "_ADVISE", advise)
    monkeypatch.setattr(streaming, "WINDOW", 1 << 20)
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    dst = tmp_path / "out.bin"
    with open(dst, "wb", buffering=0) as f:
        writeback = streaming.Writeback(f.fileno())
        streaming.write_all(f.fileno(), b"h" * 12_345, writeback)
        streaming.copy_ranges(_ranges(sources), f.fileno(), None, writeback=writeback)
        writeback.finish()
    assert done.wait(30)
    size = dst.stat().st_size
    # contiguous windows from 0, each at least a window long, then the rest to the end
    starts = [o for o, _ in asked]
    assert starts[0] == 0 and asked[-1][1] == 0
    assert all(o + n == nxt for (o, n), nxt in zip(asked, starts[1:]))
    assert all(n >= 1 << 20 for _, n in asked[:-1])
    assert len(asked) >= size // (2 << 20)
    if before is not None:  # the thread closed the descriptor it duplicated
        deadline = time.monotonic() + 30
        while len(os.listdir("/proc/self/fd")) > before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(os.listdir("/proc/self/fd")) == before


def test_writeback_advice_that_fails_fails_nothing(tmp_path, monkeypatch):
    done = threading.Event()

    def advise(fd, offset, length, advice):
        done.set()
        raise OSError(errno.EINVAL, "no")

    monkeypatch.setattr(streaming, "_ADVISE", advise)
    with open(tmp_path / "out.bin", "wb", buffering=0) as f:
        streaming.write_all(f.fileno(), b"x" * 100)
        streaming.start_writeback(f.fileno())
    assert done.wait(30)
    assert (tmp_path / "out.bin").read_bytes() == b"x" * 100


def _cross_device(*args):
    raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))


def _refuse(*args, **kwargs):
    raise AssertionError("this path must not be taken")
