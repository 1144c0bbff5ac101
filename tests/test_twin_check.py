"""``verify`` of a training dict's copies of the model (verification/twin_check.py): a copy on
one side only, and a reference copy the plan does not bind to, each fail naming the copy.

The reference is timm's training dict with an EMA (fixtures/training/twins/timm.pth.tar); each
candidate is its fuse, rewritten by fusectl's own torch writer with one thing changed."""

from __future__ import annotations

import json

from conftest import run_cli
from fusectl.io.formats.torch_file import read_torch_tree
from fusectl.io.formats.torch_writer import write_torch_file
from test_training_twins import TWINS

REFERENCE = TWINS / "timm.pth.tar"
EMA = "state_dict_ema"


def _fused(tmp_path):
    fused = tmp_path / "fused.pth"
    result = run_cli("fuse", REFERENCE, "-r", "llama-qkv", "-o", fused)
    assert result.exit_code == 0, result.output
    return fused


def _rewritten(path, out, edit):
    tree, metadata = read_torch_tree(str(path))
    edit(tree)
    write_torch_file(str(out), tree, metadata=metadata)
    return out


def _twin_checks(reference, candidate, tmp_path) -> tuple[int, list[dict]]:
    report = tmp_path / "report.json"
    result = run_cli("verify", reference, candidate, "--provider", "cpu", "--report", report)
    return result.exit_code, [c for c in json.loads(report.read_text())["checks"] if c["kind"] == "twin"]


def test_a_copy_the_candidate_lacks_fails_naming_it(tmp_path):
    candidate = _rewritten(_fused(tmp_path), tmp_path / "no-ema.pth", lambda tree: tree.pop(EMA))
    code, checks = _twin_checks(REFERENCE, candidate, tmp_path)
    assert code == 1
    assert [(c["name"], c["passed"], c["detail"]) for c in checks] == [(EMA, False, "missing from the candidate")]


def test_a_copy_only_the_candidate_has_fails_naming_it(tmp_path):
    fused = _fused(tmp_path)
    reference = _rewritten(REFERENCE, tmp_path / "reference-no-ema.pth", lambda tree: tree.pop(EMA))
    code, checks = _twin_checks(reference, fused, tmp_path)
    assert code == 1
    assert [(c["name"], c["passed"], c["detail"]) for c in checks] == [(EMA, False, "not in the reference")]


def test_a_reference_copy_the_plan_cannot_move_fails_naming_it(tmp_path):
    """The reference's copy lacks a tensor the plan reads: the check says what the plan found."""
    fused = _fused(tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"
    reference = _rewritten(REFERENCE, tmp_path / "reference-short-ema.pth", lambda tree: tree[EMA].pop(name))
    code, checks = _twin_checks(reference, fused, tmp_path)
    assert code == 1
    assert [(c["name"], c["passed"]) for c in checks] == [(EMA, False)]
    assert name in checks[0]["detail"]
