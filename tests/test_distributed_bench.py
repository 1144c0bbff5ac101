"""Smoke test of benchmarks/distributed_bench.py: its measuring code run on the committed 2-rank
fixtures (fixtures/distributed/: FSDP2/DCP, ZeRO-2, ZeRO-3), without torch (``--methods
convert,cp+sync``; the frameworks' tools are the benchmark's business where they are installed).
No time is asserted: what runs, what it measures and what its checks refuse."""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import distributed_bench as bench  # noqa: E402
from fuse_bench import BenchError  # noqa: E402

FIXTURES = ROOT / "fixtures" / "distributed"
KINDS = ("dcp", "zero2", "zero3")


def _fusectl() -> str:
    beside = Path(sys.executable).parent / "fusectl"
    return str(beside) if beside.exists() else shutil.which("fusectl")


def _largest(folder: Path) -> int:
    """The largest tensor of a safetensors folder, read here from the headers."""
    largest = 0
    for path in folder.glob("*.safetensors"):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        largest = max([largest, *(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values())])
    return largest


def test_measures_convert_and_cp_on_every_fixture_kind(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)   # main() drops it: undone after
    out = tmp_path / "bench.json"
    argv = [a for kind in KINDS for a in ("--checkpoint", f"{kind}={FIXTURES / kind}")]
    status = bench.main([*argv, "--methods", "convert,cp+sync", "--repeat", "2", "--settle", "0",
                         "--work", str(tmp_path / "w"), "--fusectl", _fusectl(), "--json", str(out)])
    assert status == 0
    record = json.loads(out.read_text())
    names = [f"{kind}:{kind}" for kind in KINDS]
    assert list(record["checkpoints"]) == names
    for name in names:
        runs = [r for r in record["runs"] if r["checkpoint"] == name]
        assert sorted((r["method"], r["rep"]) for r in runs) == [("convert", 0), ("convert", 1),
                                                                  ("cp+sync", 0), ("cp+sync", 1)]
        # cp+sync copies what convert wrote: the same bytes every time
        assert len({r["output_bytes"] for r in runs}) == 1
        assert all(r["wall_s"] > 0 and r["peak_rss_kb"] > 0 for r in runs)
        facts = record["checkpoints"][name]
        assert facts["output_bytes"] == runs[0]["output_bytes"]
        assert facts["input_bytes"] > facts["output_bytes"]      # the optimizer state is not written
    # the largest tensor the table subtracts is the fixture's, read independently
    converted = tmp_path / "zero2-out"
    assert os.system(f"{_fusectl()} convert {FIXTURES / 'zero2'} -o {converted} --quiet") == 0
    assert record["checkpoints"]["zero2:zero2"]["largest_tensor_bytes"] == _largest(converted)
    table = capsys.readouterr().out
    for name in names:
        assert f"{name}: convert/(cp+sync) (both durable on disk): medians " in table
        assert f"{name}: convert peak RSS - largest tensor = " in table
    # outputs are cleaned up; the checkpoints are left alone
    assert not any((tmp_path / "w" / "out").iterdir())


def test_check_output_refuses_what_differs(tmp_path):
    fusectl = _fusectl()
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        assert os.system(f"{fusectl} convert {FIXTURES / 'zero2'} -o {folder} --quiet") == 0
    assert bench.check_output(str(a), None, str(b)).endswith("bytes equal to zero_to_fp32's")
    [path] = b.glob("*.safetensors")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF                                            # the last tensor's last byte
    path.write_bytes(bytes(data))
    with pytest.raises(BenchError, match="differs from"):
        bench.check_output(str(a), None, str(b))
    config = json.loads((FIXTURES / "zero2" / "config.json").read_text())
    with pytest.raises(BenchError, match="missing|unexpected|wrong"):
        bench.check_output(str(a), dict(config, num_hidden_layers=config["num_hidden_layers"] + 1))


def test_report_ratios_and_bars():
    facts = {"zero2-x": {"input_bytes": 3e9, "output_bytes": 1e9, "largest_tensor_bytes": 200e6}}
    runs = [dict(checkpoint="zero2-x", method=m, rep=0, wall_s=w, peak_rss_kb=kb, output_bytes=1e9)
            for m, w, kb in (("convert", 3.0, 250_000), ("cp+sync", 2.0, 7000), ("torch", 12.0, 2_000_000))]
    table, med = bench.report(runs, facts, floor_kb=7000)
    assert med["zero2-x", "convert"] == (3.0, 250_000 * 1024 / 1e6)
    assert ("zero2-x: convert/(cp+sync) (both durable on disk): medians 3.00 s / 2.00 s = 1.50x; per round "
            "median 1.50x (1.50..1.50 over 1 rounds), limit 1.0x: OVER") in table
    assert "convert peak RSS - largest tensor = 56 MB (within the < 100 MB bar)" in table
    assert "framework tool / convert: 4.00x the time, 8.0x the peak RSS" in table


@pytest.mark.parametrize("argv", [["--checkpoint", "zero2"], ["--checkpoint", "bogus=/"],
                                  ["--checkpoint", "dcp=/no/such/folder"], ["--kinds", "zero4"],
                                  ["--methods", "cat"], ["--repeat", "0"], ["--settle", "-1"]])
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2
