"""How reports read (reports.py): sizes in decimal units, names escaped, a table's JSON, a
plan's JSON and text (notes, scales beside their weight, dropped tensors, config edits, ties),
and ``map``'s text. That each report renders bit for bit as its command prints it is in
test_api.py; here are the pieces, on small checkpoints written by hand."""

from __future__ import annotations

import numpy as np
import pytest

import fusectl
from conftest import FIXTURES, write_rules, write_safetensors
from fusectl.onnx.namemap import NameMap, Pair
from fusectl.reports import human, name_map_text, names_text, parameters_json, plan_json, plan_text, table_json

CONCAT = """
version = 1
[[rule]]
name   = "ab"
op     = "concat"
inputs = ["a", "b"]
output = "ab"
"""

RENAME_BIAS = """
version = 1
[[rule]]
name   = "bias"
op     = "rename"
input  = "proj.bias"
output = "proj.b"
"""

DROP = """
version = 1
[[rule]]
name  = "no-c"
op    = "drop"
input = "c"
"""


@pytest.mark.parametrize("nbytes, text", [(0, "0 B"), (999, "999 B"), (1000, "1.00 KB"), (1_234_567, "1.23 MB"),
                                          (999_999_999, "1000.00 MB"), (10**9, "1.00 GB"), (5 * 10**12, "5000.00 GB")])
def test_human_uses_decimal_units(nbytes, text):
    assert human(nbytes) == text


def test_names_text_escapes_what_a_file_may_hold():
    assert names_text([]) == ""
    assert names_text(["a.weight", "b\nc", "d\x1b[31m"]) == "a.weight, b\\nc, d\\x1b[31m"


@pytest.fixture
def abc(tmp_path):
    """a [2, 3] and b [1, 3] (float32), c [4] (int64), and their rules files."""
    path = write_safetensors(tmp_path / "m.safetensors", {"a": np.zeros((2, 3), np.float32),
                                                          "b": np.ones((1, 3), np.float32),
                                                          "c": np.arange(4, dtype=np.int64)})
    return path, write_rules(tmp_path / "concat.toml", CONCAT), write_rules(tmp_path / "drop.toml", DROP)


def test_table_json_lists_every_name_and_counts_unique_bytes_once():
    checkpoint = fusectl.api.open_input(str(FIXTURES / "tied-embeddings.safetensors"))
    table = checkpoint.table
    data = table_json(table)
    assert list(data) == ["parameters", "ties", "unique_count", "total_bytes"]
    assert data["parameters"] == parameters_json(table)
    assert [p["name"] for p in data["parameters"]] == table.names()
    tie = next(g for g in data["ties"])
    unique = {p["name"]: p["unique"] for p in data["parameters"]}
    assert len({unique[n] for n in tie}) == 1 and len(tie) == 2
    assert data["unique_count"] == len(table.names()) - 1
    nbytes = {p["name"]: p["nbytes"] for p in data["parameters"]}
    assert data["total_bytes"] == sum(nbytes.values()) - nbytes[tie[1]]


def test_plan_json_is_the_groups_then_the_result_table(abc):
    path, concat, _ = abc
    planned = fusectl.plan(str(path), [str(concat)])
    data = plan_json(planned.plan, planned.table)
    assert list(data) == ["groups", "result"]
    assert [g["rule"] for g in data["groups"]] == ["ab"]
    assert data["result"] == table_json(planned.table)
    assert {p["name"]: p["shape"] for p in data["result"]["parameters"]} == {"ab": [3, 3], "c": [4]}
    assert data["result"]["total_bytes"] == 3 * 3 * 4 + 4 * 8


def test_plan_text_of_an_exact_invertible_layout_step_has_no_note(abc):
    path, concat, _ = abc
    planned = fusectl.plan(str(path), [str(concat)])
    assert plan_text(planned.plan, planned.table).split("\n") == [
        "plan: 1 rule group(s), 1 step(s) (computed from headers)",
        f"rule 'ab' ({concat}): concat x1",
        "  a F32[2, 3], b F32[1, 3] -> ab F32[3, 3]",
        "result: 2 names, 2 unique parameters, 68 B",
    ]


def test_plan_text_marks_a_drop_one_way_and_its_output_dropped(abc):
    path, _, drop = abc
    planned = fusectl.plan(str(path), [str(drop)])
    lines = plan_text(planned.plan, planned.table).split("\n")
    assert lines[1] == f"rule 'no-c' ({drop}): drop x1 (one-way)"
    assert lines[2] == "  c I64[4] -> (dropped)"
    assert lines[-1] == "result: 2 names, 2 unique parameters, 36 B"


def test_plan_text_marks_a_numeric_fold_and_shows_its_config_edit():
    planned = fusectl.plan(str(FIXTURES / "fp8-llama"), ["fp8-dequant"])
    text = plan_text(planned.plan, planned.table)
    assert "rule 'dequantize-block' (preset fp8-dequant): dequantize x14 (one-way, numeric)" in text
    assert "  config.json: remove quantization_config" in text.split("\n")


def test_plan_text_shows_a_quantized_weights_scales_beside_it():
    planned = fusectl.plan(str(FIXTURES / "fp8-llama"), ["llama-qkv"])
    lines = plan_text(planned.plan, planned.table).split("\n")
    weight = next(k for k, line in enumerate(lines) if line.startswith("  model.layers.0.self_attn.q_proj.weight "))
    assert lines[weight + 1].startswith("    scale: model.layers.0.self_attn.q_proj.weight_scale_inv F32[2, 2]")
    assert lines[weight + 1].endswith("-> model.layers.0.self_attn.qkv_proj.weight_scale_inv F32[4, 2]")
    assert sum(line.startswith("    scale: ") for line in lines) == 2  # one per layer


def test_plan_text_counts_names_and_unique_parameters_apart_and_lists_the_ties(tmp_path):
    rules = write_rules(tmp_path / "r.toml", RENAME_BIAS)
    planned = fusectl.plan(str(FIXTURES / "tied-embeddings.safetensors"), [str(rules)])
    lines = plan_text(planned.plan, planned.table).split("\n")
    unique = table_json(planned.table)
    assert lines[-2] == f"result: 4 names, 3 unique parameters, {human(unique['total_bytes'])}"
    assert lines[-1] == "tied: embed.weight, head.weight"


def test_name_map_text_aligns_pairs_and_notes_what_differs():
    pairs = [Pair("embed.weight", "onnx::Gather_0", "content"),
             Pair("w", "w", "name", data="differs"),
             Pair("long.name.bias", "b\x07", "name", data="unknown")]
    text = name_map_text(NameMap(pairs, ["lost"], ["extra1", "extra2"]), "m.safetensors", "g.onnx", names=4)
    assert text.split("\n") == [
        "embed.weight    content     onnx::Gather_0",
        "w               name        w  (data differs: the graph holds something else under this name)",
        "long.name.bias  name        b\\x07  (data not checked: the checkpoint knows only the name)",
        "unmatched in m.safetensors: lost",
        "unmatched in g.onnx: extra1",
        "unmatched in g.onnx: extra2",
        "3 of 4 names paired; 2 graph initializer(s) unmatched",
        "1 pair(s) by name hold different data: w",
    ]


def test_name_map_text_of_nothing_paired():
    assert name_map_text(NameMap(), "m.safetensors", "g.onnx", names=0) == "0 of 0 names paired; 0 graph initializer(s) unmatched"
