"""``inspect``'s report (inspection.py): :class:`InspectReport`'s text line by line, and
:func:`inspect_checkpoint` on checkpoints built here (equal tensors, constant tensors, a PyTorch
file holding more than tensors, scales without a block size).

That ``to_json()`` is what ``fusectl inspect --json`` prints bit for bit, and ``to_text()`` what
``fusectl inspect`` prints, for seven fixtures with and without --detect-ties, is in
test_api.py (``test_inspect_report_is_the_cli_json_bit_for_bit``, and the key order in
``test_inspect_json_keys_in_their_documented_order``)."""

from __future__ import annotations

import json

import numpy as np

import fusectl
from conftest import FIXTURES, ok, write_safetensors
from fusectl.errors import cli_vocabulary
from fusectl.inspection import InspectReport, inspect_checkpoint
from fusectl.io.checkpoint import open_checkpoint
from test_torch_reader import tensor, torch_zip


def _report(**fields) -> InspectReport:
    summary = {"parameters": [{"name": "embed", "unique": "embed", "dtype": "F32", "shape": [4, 2], "nbytes": 32},
                              {"name": "head\x07", "unique": "embed", "dtype": "F32", "shape": [4, 2], "nbytes": 32},
                              {"name": "w", "unique": "w", "dtype": "BF16", "shape": [2], "nbytes": 4}],
               "ties": [["embed", "head\x07"]], "unique_count": 2, "total_bytes": 36}
    base = dict(path="ckpt", format="safetensors", files=["ckpt/model.safetensors"], summary=summary,
                provenance=None, provenance_groups=0, provenance_steps=0, config=None, state_dict_key=None,
                ignored=[], quantization=None, adapter=None)
    return InspectReport(**{**base, **fields})


def test_text_of_a_plain_checkpoint_lists_each_name_and_its_tie():
    assert _report().to_text().split("\n") == [
        "ckpt: safetensors, 1 file(s), 2 unique parameters, 36 B",
        "  embed     F32    [4, 2]          ",
        "  head\\x07  F32    [4, 2]            -> embed",
        "  w         BF16   [2]             ",
        "tied: embed, head\\x07",
    ]


def test_text_says_what_was_found_beside_the_tensors():
    adapter = {"modules": {"a": {"rank": 4, "scaling": 2.0}, "b": {"rank": 8, "scaling": 0.5}}}
    quantization = {"block_size": [128, 64], "block_size_source": "config.json",
                    "weights": {"w": [{"kind": "block 128x64"}, {"kind": "per-tensor"}]}}
    report = _report(state_dict_key="ema", ignored=["step", "optimizer"], suspected_ties=[["w", "v"]],
                     constant_groups_skipped=3, adapter=adapter, quantization=quantization,
                     provenance={"plan": []}, provenance_groups=2, provenance_steps=5)
    with cli_vocabulary():
        lines = report.to_text().split("\n")
    assert lines[1:3] == ["state dict: ema (pass --key to choose another)", "ignored (not tensors): step, optimizer"]
    assert lines[-6:] == [
        "tied: embed, head\\x07",
        "suspected tie (equal content): w, v; adopt with --detect-ties on fuse/plan or [ties] in a rules file",
        "not suspected: 3 group(s) of equal tensors whose elements are all one value (all-ones norms, zero "
        "biases), which are equal by chance",
        "LoRA adapter: 2 module(s), rank 4, 8, scaling 0.5, 2",
        "quantized: 1 weight(s) with scales (block 128x64, per-tensor); block size 128x64 (config.json)",
        "provenance: 2 rule group(s), 5 step(s) recorded by fusectl",
    ]


def test_json_holds_ties_found_only_when_they_were_looked_for():
    assert "suspected_ties" not in _report().to_json()
    found = _report(suspected_ties=[], constant_groups_skipped=0).to_json()
    assert found["suspected_ties"] == [] and found["constant_groups_skipped"] == 0
    assert _report().to_json()["parameters"] == _report().summary["parameters"]


def test_detected_ties_leave_out_the_known_ones_and_count_constant_groups(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 2)).astype(np.float32)
    path = write_safetensors(tmp_path / "m.safetensors", {
        "a.weight": w, "b.weight": w.copy(), "c.weight": rng.standard_normal((3, 2)).astype(np.float32),
        "n1.weight": np.ones(4, np.float32), "n2.weight": np.ones(4, np.float32),
    })
    checkpoint = open_checkpoint(str(path))
    assert inspect_checkpoint(checkpoint).suspected_ties is None
    report = inspect_checkpoint(checkpoint, detect_ties=True)
    assert report.suspected_ties == [["a.weight", "b.weight"]]
    assert report.constant_groups_skipped == 1
    tied = inspect_checkpoint(open_checkpoint(str(FIXTURES / "tied-embeddings.safetensors")), detect_ties=True)
    assert tied.summary["ties"] == [["embed.weight", "head.weight"]] and tied.suspected_ties == []


def test_the_report_is_named_as_the_caller_named_the_checkpoint():
    checkpoint = open_checkpoint(str(FIXTURES / "tiny-llama-gqa"))
    assert inspect_checkpoint(checkpoint).path == str(checkpoint.path)
    report = inspect_checkpoint(checkpoint, "my-model")
    assert report.path == "my-model" and report.to_text().startswith("my-model: safetensors, 1 file(s), ")


def test_what_a_pytorch_file_holds_beside_its_tensors_is_listed_as_ignored(cli, tmp_path):
    body = b"(dp0\nS'w'\n" + tensor() + b"sS'epoch'\nI12\nsS'lr'\nF0.5\ns"
    path = torch_zip(tmp_path / "m.pt", b"\x80\x02" + body + b".")
    report = fusectl.inspect(str(path))
    assert report.ignored == ["epoch", "lr"]
    assert "ignored (not tensors): epoch, lr" in report.to_text().split("\n")
    assert ok(cli("inspect", path, "--json")).stdout == json.dumps(report.to_json(), indent=2) + "\n"


def test_scales_without_a_block_size_say_how_to_set_one():
    report = fusectl.inspect(str(FIXTURES / "fp8-llama-channel"))
    assert report.quantization["block_size"] is None
    line = report.to_text().split("\n")[-1]
    assert line == ("quantized: 7 weight(s) with scales (per-channel, per-tensor); block size not set "
                    "(no block scales, or set quantization_config.weight_block_size)")


def test_a_fused_checkpoint_reports_its_provenance(tmp_path):
    out = tmp_path / "fused.safetensors"
    fusectl.fuse(str(FIXTURES / "tiny-llama-gqa"), ["llama-qkv", "llama-gate-up"], out)
    report = fusectl.inspect(str(out))
    assert report.provenance is not None and report.provenance_groups == 2
    assert report.provenance_steps == len(report.provenance["plan"][0]["steps"]) + len(report.provenance["plan"][1]["steps"])
    assert report.to_text().endswith(f"provenance: 2 rule group(s), {report.provenance_steps} step(s) recorded by fusectl")
