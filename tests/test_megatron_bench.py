"""Smoke test of benchmarks/megatron_bench.py: its three commands (Hugging Face Llama → Megatron
legacy TP=2 PP=2, back, and reshard to TP=1 PP=1) run on the tiny model, without torch. No time is
asserted: what runs, what it measures, and that its checks refuse what differs."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_rounds  # noqa: E402
import fuse_bench  # noqa: E402
import megatron_bench as bench  # noqa: E402
from fuse_bench import BenchError  # noqa: E402


def _fusectl() -> str:
    beside = Path(sys.executable).parent / "fusectl"
    return str(beside) if beside.exists() else shutil.which("fusectl")


def test_measures_every_command_and_checks_the_round_trips(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)   # main() drops it: undone after
    out = tmp_path / "bench.json"
    status = bench.main(["--sizes", "tiny", "--repeat", "2", "--settle", "0", "--work", str(tmp_path / "w"),
                         "--fusectl", _fusectl(), "--json", str(out)])
    assert status == 0
    record = json.loads(out.read_text())
    names = [f"tiny {op}" for op in bench.OPS]
    assert list(record["checkpoints"]) == names
    [hf] = [p for p in (tmp_path / "w" / "checkpoints").glob("llama-f32-tiny-*") if p.is_dir()]
    model_bytes = bench_rounds.folder_bytes(str(hf)) - (hf / "config.json").stat().st_size \
        - (hf / "model.safetensors.index.json").stat().st_size
    for name in names:
        runs = [r for r in record["runs"] if r["checkpoint"] == name]
        assert sorted((r["method"], r["rep"]) for r in runs) == [("cp+sync", 0), ("cp+sync", 1),
                                                                  ("fusectl", 0), ("fusectl", 1)]
        # cp+sync copies what the command wrote: the same bytes every time
        assert len({r["output_bytes"] for r in runs}) == 1
        assert all(r["wall_s"] > 0 and r["peak_rss_kb"] > 0 for r in runs)
        facts = record["checkpoints"][name]
        assert facts["output_bytes"] == runs[0]["output_bytes"] > model_bytes   # the weights, and headers
        # the largest tensor the table subtracts is the model's: its embedding, fp32
        config = bench.SIZES["tiny"]
        assert facts["largest_tensor_bytes"] == 4 * config["vocab_size"] * config["hidden_size"]
    assert record["checkpoints"]["tiny to-megatron"]["source"] == str(hf)
    assert record["commands"]["to-megatron"][:4] == ["fusectl", "fuse", "HF", "-r"]
    logged = capsys.readouterr()
    assert "tiny to-megatron: 4 rank files: OK" in logged.err
    assert "tiny reshard: 1 rank file: OK" in logged.err
    assert "tiny to-hf: 39 tensors, names, dtypes, shapes and bytes equal to" in logged.err
    assert "tiny reshard, back to HF: 39 tensors" in logged.err
    for name in names:
        assert f"{name}: fusectl/(cp+sync) (both durable on disk): medians " in logged.out
        assert f"{name}: fusectl peak RSS - largest tensor = " in logged.out
    # outputs are cleaned up; the generated model is kept for the next run
    assert not any((tmp_path / "w" / "out").iterdir())
    assert bench.ensure_model(str(tmp_path / "w"), "tiny") == str(hf)


def test_the_checks_refuse_what_differs(tmp_path):
    fusectl = _fusectl()
    hf = tmp_path / "hf"
    fuse_bench.generate_checkpoint(str(hf), bench.SIZES["tiny"], 1 << 20, 0, dtype="F32")
    meg, back = tmp_path / "meg", tmp_path / "back"
    assert os.system(" ".join(bench.op_command("to-megatron", fusectl, str(hf), None, str(meg)))) == 0
    assert os.system(" ".join(bench.op_command("to-hf", fusectl, str(hf), str(meg), str(back)))) == 0
    assert bench.check_ranks(str(meg), 2, 2) == "4 rank files"
    with pytest.raises(BenchError, match="rank folders"):
        bench.check_ranks(str(meg), 1, 1)
    assert bench_rounds.same_tensors(str(back), str(hf)).startswith("39 tensors")
    [shard] = sorted(back.glob("*.safetensors"))[-1:]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01                                             # the last tensor's last byte
    shard.write_bytes(bytes(data))
    with pytest.raises(BenchError, match="differs from"):
        bench_rounds.same_tensors(str(back), str(hf))
    with pytest.raises(ValueError):
        bench.op_command("sideways", fusectl, str(hf), str(meg), str(back))


def test_report_judges_the_fusectl_method():
    facts = {"2GB reshard": {"input_bytes": 2e9, "output_bytes": 2e9, "largest_tensor_bytes": 262e6}}
    runs = [dict(checkpoint="2GB reshard", method=m, rep=rep, wall_s=w, peak_rss_kb=kb, output_bytes=2e9)
            for rep, (m, w, kb) in enumerate([("fusectl", 3.0, 300_000), ("cp+sync", 2.0, 7000),
                                              ("fusectl", 2.0, 300_000), ("cp+sync", 4.0, 7000)])]
    for r in runs:
        r["rep"] //= 2                                          # two rounds of two runs
    table, med = bench_rounds.report(runs, facts, 7000, bench.METHODS, "fusectl")
    assert med["2GB reshard", "fusectl"] == (2.5, 300_000 * 1024 / 1e6)
    assert ("2GB reshard: fusectl/(cp+sync) (both durable on disk): medians 2.50 s / 3.00 s = 0.83x; per round "
            "median 1.00x (0.50..1.50 over 2 rounds), limit 1.0x: within") in table
    assert "fusectl peak RSS - largest tensor = 45 MB (within the < 100 MB bar)" in table


@pytest.mark.parametrize("argv", [["--sizes", "3GB"], ["--sizes", ""], ["--repeat", "0"], ["--settle", "-1"]])
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2
