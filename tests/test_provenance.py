"""The provenance record (io/provenance.py): unfuse without one, with a corrupt one or with an
edited one is refused naming the file; nothing is written."""

from __future__ import annotations

import numpy as np

from conftest import LLAMA, assert_refused, llama_tensors, ok, snapshot, write_rules, write_safetensors


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
