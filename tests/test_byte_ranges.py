"""verify's byte comparison of layout-only tables: streamed in chunks, and the proof it leaves
lets the inverse check hold without reading anything again."""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest

from fusectl.errors import CheckpointError
from fusectl.tensors import ByteRange
from fusectl.verification.byte_ranges import ByteCorrespondence, RangeComparer, Segment, aligned, equal_pairs
from fusectl.verification.checkpoint_check import compare_tables

# fusectl.verify is also the API function: reach the module through the import system
byte_ranges = importlib.import_module("fusectl.verification.byte_ranges")


def test_aligned_cuts_both_lists_at_each_others_boundaries():
    left = (ByteRange("a", 0, 4), ByteRange("a", 10, 6))
    right = (ByteRange("b", 100, 7), ByteRange("b", 0, 0), ByteRange("b", 50, 3))
    assert list(aligned(left, right)) == [
        Segment("a", 0, "b", 100, 4), Segment("a", 10, "b", 104, 3), Segment("a", 13, "b", 50, 3)]


@pytest.fixture
def files(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8).tobytes()
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(data)
    b.write_bytes(data[500:] + data[:500])  # halves swapped
    return str(a), str(b), data


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_comparer_finds_equal_and_different_bytes_across_chunk_boundaries(files, chunk, monkeypatch, tmp_path):
    monkeypatch.setattr(byte_ranges, "CHUNK", chunk)
    a, b, data = files
    comparer = RangeComparer()
    try:
        assert comparer.equal([ByteRange(a, 0, 1000)], [ByteRange(b, 500, 500), ByteRange(b, 0, 500)])
        assert not comparer.equal([ByteRange(a, 0, 1000)], [ByteRange(b, 0, 1000)])
        # one byte changed near the end is found
        changed = tmp_path / "c.bin"
        changed.write_bytes(data[:998] + bytes([data[998] ^ 1]) + data[999:])
        assert not comparer.equal([ByteRange(a, 0, 1000)], [ByteRange(str(changed), 0, 1000)])
    finally:
        comparer.close()


@pytest.fixture
def big(tmp_path):
    """Two files of equal random bytes, each 2.5 windows of 8 KiB past a 3-byte header."""
    data = np.random.default_rng(1).integers(0, 256, 3 + 20480, dtype=np.uint8).tobytes()
    a, b = tmp_path / "big-a.bin", tmp_path / "big-b.bin"
    a.write_bytes(data)
    b.write_bytes(data)
    return a, b, data


@pytest.mark.parametrize("where", [3, 3 + 8191, 3 + 8192, 3 + 16383, 3 + 16384, 3 + 20479],
                         ids=["first", "window-end", "window-start", "2nd-window-end", "3rd-window-start", "last"])
@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
def test_one_byte_anywhere_in_a_multi_window_range_differs(big, where, mapped, monkeypatch):
    """A range of several windows (offset not on a page) differs by one bit: at the first byte,
    on each side of a window boundary, at the last byte; mapped, and read where it cannot be."""
    monkeypatch.setattr(byte_ranges, "CHUNK", 8192)
    if not mapped:
        def refuse(*args):
            raise OSError("no mmap here")
        monkeypatch.setattr(byte_ranges, "Mapped", refuse)
    a, b, data = big
    ranges = lambda path: [ByteRange(str(path), 3, 20480)]  # noqa: E731
    comparer = RangeComparer()
    try:
        assert comparer.equal(ranges(a), ranges(b))
        b.write_bytes(data[:where] + bytes([data[where] ^ 0x80]) + data[where + 1:])
        assert not comparer.equal(ranges(a), ranges(b))
    finally:
        comparer.close()


def test_a_file_that_shrinks_between_windows_is_named_not_mapped_past_its_end(big, monkeypatch):
    """A file truncated while it is compared, before its next window, raises CheckpointError
    naming it and the window (each window is mapped only once the file holds it: a mapping
    read past the file's end would raise SIGBUS)."""
    monkeypatch.setattr(byte_ranges, "CHUNK", 8192)
    a, b, data = big
    same = byte_ranges._same

    def truncate_after_first(x, y):
        os.truncate(b, 3 + 10000)
        return same(x, y)

    monkeypatch.setattr(byte_ranges, "_same", truncate_after_first)
    comparer = RangeComparer()
    try:
        with pytest.raises(CheckpointError, match=r"big-b.bin: expected 8192 bytes at offset 8195, got 1808"):
            comparer.equal([ByteRange(str(a), 3, 20480)], [ByteRange(str(b), 3, 20480)])
    finally:
        comparer.close()


def test_a_one_byte_difference_in_a_multi_window_tensor_fails_naming_it(tmp_path, monkeypatch):
    """Through verify's table comparison: the tensor whose last byte differs fails, by name,
    with the figures of its computed comparison; the equal one passes bitwise."""
    monkeypatch.setattr(byte_ranges, "CHUNK", 4096)
    x = np.random.default_rng(2).standard_normal((64, 100)).astype(np.float32)  # 6.25 windows
    y = x.copy()
    y.reshape(-1).view(np.uint8)[-1] ^= 1
    ref = _table(tmp_path, "r.safetensors", {"same": x, "w": x})
    cand = _table(tmp_path, "c.safetensors", {"same": x, "w": y})
    checks = {c.name: c for c in compare_tables("tensor", ref, cand, None, None)}
    assert checks["same"].passed and checks["same"].detail == "bitwise"
    assert not checks["w"].passed and checks["w"].comparison.mismatches == 1
    assert checks["w"].comparison.first_mismatch == [63, 99]


def test_comparer_names_a_file_that_is_shorter_than_its_ranges(files):
    a, b, _ = files
    comparer = RangeComparer()
    with pytest.raises(CheckpointError, match="b.bin: expected 100 bytes at offset 950"):
        comparer.equal([ByteRange(a, 0, 100)], [ByteRange(b, 950, 100)])
    comparer.close()


@pytest.mark.parametrize("workers", [1, 2, 5])
def test_pairs_shared_among_threads_answer_as_in_turn(files, workers, monkeypatch):
    monkeypatch.setattr(byte_ranges, "WORKERS", workers)
    monkeypatch.setattr(byte_ranges, "CHUNK", 64)
    a, b, _ = files
    whole = [ByteRange(a, 0, 1000)]
    pairs = [(whole, [ByteRange(b, 500, 500), ByteRange(b, 0, 500)]), (whole, [ByteRange(b, 0, 1000)])] * 5
    assert equal_pairs(pairs) == [True, False] * 5
    assert equal_pairs([]) == []
    # two pairs reach past the end of b: the first of them is the error raised
    short = pairs[:3] + [([ByteRange(a, 0, 100)], [ByteRange(b, 950, 100)])] + pairs[:3] + [
        ([ByteRange(a, 0, 100)], [ByteRange(b, 990, 100)])]
    with pytest.raises(CheckpointError, match="expected 100 bytes at offset 950"):
        equal_pairs(short)


def test_correspondence_covers_only_bytes_proven_with_the_same_pairing():
    proof = ByteCorrespondence()
    proof.add([ByteRange("r", 0, 100)], [ByteRange("c", 1000, 100)])
    proof.add([ByteRange("r", 100, 50)], [ByteRange("c", 1100, 50)])  # adjacent: merged
    proof.freeze()
    assert proof.covers([ByteRange("r", 20, 120)], [ByteRange("c", 1020, 120)])
    assert proof.covers([ByteRange("r", 40, 10), ByteRange("r", 0, 10)],
                        [ByteRange("c", 1040, 20)]) is False  # second part pairs r[0:10] with c[1050:]
    assert not proof.covers([ByteRange("r", 140, 20)], [ByteRange("c", 1140, 20)])  # past the end
    assert not proof.covers([ByteRange("r", 0, 10)], [ByteRange("c", 0, 10)])  # another pairing
    assert not proof.covers([ByteRange("x", 0, 10)], [ByteRange("c", 1000, 10)])


def _table(tmp_path, name, tensors):
    from safetensors.numpy import save_file

    from fusectl.io.checkpoint import open_checkpoint

    save_file(tensors, str(tmp_path / name))
    return open_checkpoint(str(tmp_path / name)).table


def test_a_proven_pair_is_not_read_again_and_an_unproven_one_is(tmp_path, monkeypatch):
    x = np.arange(20, dtype=np.float32).reshape(4, 5)
    ref = _table(tmp_path, "r.safetensors", {"a": x, "b": x + 1})
    cand = _table(tmp_path, "c.safetensors", {"a": x, "b": x + 1})
    proof = ByteCorrespondence()
    checks = compare_tables("tensor", ref, cand, None, None, record=proof)
    assert [(c.name, c.passed, c.detail) for c in checks] == [("a", True, "bitwise"), ("b", True, "bitwise")]
    proof.freeze()

    reads = []
    original, mapped = os.preadv, byte_ranges.Mapped
    monkeypatch.setattr(os, "preadv", lambda *args: reads.append(args[0]) or original(*args))
    monkeypatch.setattr(byte_ranges, "Mapped", lambda *args: reads.append(args[0]) or mapped(*args))
    again = compare_tables("inverse", ref, cand, None, None, proven=proof)
    assert [c.passed for c in again] == [True, True] and reads == []
    swapped = cand.copy()
    swapped.add({"a": cand["b"], "b": cand["a"]})
    failed = compare_tables("inverse", ref, swapped, None, None, proven=proof)
    assert [c.passed for c in failed] == [False, False] and reads
    assert failed[0].comparison.max_abs == 1.0
