"""The provenance record (io/provenance.py): unfuse without one, with a corrupt one or with an
edited one is refused naming the file; nothing is written. A recorded rule origin edited field by
field is refused naming the field (the other fields of the record: test_io_edges.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import (FIXTURES, LLAMA, assert_refused, llama_tensors, ok, parse_safetensors, snapshot, write_rules,
                      write_safetensors)
from fusectl.errors import CheckpointError
from fusectl.io.provenance import Provenance
from fusectl.rules.presets import preset_text


def test_unfuse_without_provenance(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    out = area / "out" / "restored"
    before = snapshot(area / "in")
    result = cli("unfuse", src, "-o", out)
    assert_refused(result, out, before, area / "in", "provenance", "-r")


def test_unfuse_with_corrupt_provenance(cli, area, copy_fixture):
    copy_fixture(LLAMA)
    tensors = llama_tensors(copy_fixture)
    path = write_safetensors(area / "in" / "p.safetensors", tensors, {"format": "pt", "fusectl": "{broken"})
    out = area / "out" / "restored"
    before = snapshot(area / "in")
    result = cli("unfuse", path, "-o", out)
    assert_refused(result, out, before, area / "in", "p.safetensors", "provenance")


def test_edited_provenance_is_refused(cli, area, tmp_path):
    src = write_safetensors(area / "in" / "m.safetensors", {"w": np.arange(9, dtype=np.float32).reshape(3, 3)})
    rules = write_rules(tmp_path / "r.toml", 'version = 1\n[[rule]]\nop = "reshape"\ninput = "w"\noutput = "flat"\nshape = [-1]\n')
    fused = area / "in" / "f.safetensors"
    ok(cli("fuse", src, "-r", rules, "-o", fused))
    raw = fused.read_bytes()
    tampered = area / "in" / "t.safetensors"
    # the record says the reshape made F32[9]; claim F32[4] (same header length: one digit each)
    tampered.write_bytes(raw.replace(b'[\\"F32\\",[9]]', b'[\\"F32\\",[4]]', 1))
    assert tampered.read_bytes() != raw
    out = area / "out" / "u.safetensors"
    result = cli("unfuse", tampered, "-o", out)
    assert result.exit_code == 2, result.output
    assert not out.exists()


# ------------------------------------------------------------ recorded rule origins, field by field


def _recorded(cli, tmp_path) -> dict:
    """The provenance of the tiny llama fused with llama-qkv and llama-gate-up: two groups, each
    recording its preset's rules text."""
    out = tmp_path / "fused.safetensors"
    ok(cli("fuse", FIXTURES / LLAMA, "-r", "llama-qkv", "-r", "llama-gate-up", "-o", out))
    return json.loads(parse_safetensors(out)[1]["fusectl"])


ORIGIN_EDITS = {
    "not-object": (lambda o: "preset", "rule group 0: origin must be an object, not 'preset'"),
    "unknown-key": (lambda o: {**o, "signed": 1}, "the unknown key 'signed'"),
    "sha-not-text": (lambda o: {**o, "rules_sha256": 5}, "rules_sha256 must be a string and rule a whole number"),
    "rule-negative": (lambda o: {**o, "rule": -1}, "rules_sha256 must be a string and rule a whole number"),
    "rule-bool": (lambda o: {**o, "rule": True}, "rules_sha256 must be a string and rule a whole number"),
    "text-not-text": (lambda o: {**o, "text": ["x"]}, "origin: text must be a string"),
    "text-surrogate": (lambda o: {**o, "text": "\ud800"}, "text holds a lone UTF-16 surrogate, which is not text"),
    "no-text": (lambda o: {k: v for k, v in o.items() if k != "text"},
                "names no text an earlier group recorded"),
    "config-not-ints": (lambda o: {**o, "config": {"hidden_size": "32"}},
                        "config must map config keys to the integers the rules' vars read"),
    "block-one": (lambda o: {**o, "block": [128]}, "block must be null or two positive integers"),
    "block-zero": (lambda o: {**o, "block": [128, 0]}, "block must be null or two positive integers"),
}


@pytest.mark.parametrize("edit", sorted(ORIGIN_EDITS))
def test_an_edited_rule_origin_is_refused_naming_the_field(cli, tmp_path, edit):
    doc = _recorded(cli, tmp_path)
    change, needle = ORIGIN_EDITS[edit]
    doc["plan"][0]["origin"] = change(doc["plan"][0]["origin"])
    with pytest.raises(CheckpointError) as info:
        Provenance.loads(json.dumps(doc), "m.safetensors")
    assert str(info.value).startswith("m.safetensors: fusectl provenance is unreadable (rule group 0")
    assert needle in str(info.value), info.value


def test_the_recorded_origin_reads_back_with_its_text_and_config(cli, tmp_path):
    doc = _recorded(cli, tmp_path)
    plan = Provenance.loads(json.dumps(doc), "m.safetensors").plan
    assert [g.origin.text for g in plan.groups] == [preset_text("llama-qkv"), preset_text("llama-gate-up")]
    assert dict(plan.groups[0].origin.config)  # the config values the vars read
    assert all(type(v) is int for v in dict(plan.groups[0].origin.config).values())
