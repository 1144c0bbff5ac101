"""``verify`` re-derives each recorded step from its recorded rule (issue 18, item 3).

A provenance that names preset ``bert-qkv`` but whose steps (and data) concatenate query, value,
key is self-consistent: replaying its steps gives the candidate. Only binding the rule it names
again shows that the rule gives query, key, value.
"""

from __future__ import annotations

import hashlib
import json

from conftest import ok, with_provenance, without_origins, write_rules
from fusectl.rules.presets import preset_text

BERT = "tiny-bert"
LIE = preset_text("bert-qkv").replace(
    'attention.self.key.{t}",\n          "{p*}.layer.{i:int}.attention.self.value.{t}"',
    'attention.self.value.{t}",\n          "{p*}.layer.{i:int}.attention.self.key.{t}"')


def _claiming_the_preset(keep_origin: bool):
    text = preset_text("bert-qkv")

    def edit(record):
        for group in record["plan"]:
            group["source"] = "preset bert-qkv"
            group.pop("origin", None)
            if keep_origin:
                group["origin"] = {"rules_sha256": hashlib.sha256(text.encode()).hexdigest(), "rule": 0,
                                   "config": {"hidden_size": 32}, "block": None, "text": text}
        return record
    return edit


def _lying_candidate(cli, copy_fixture, tmp_path, keep_origin: bool):
    assert LIE != preset_text("bert-qkv")
    src = copy_fixture(BERT)
    fused = tmp_path / "fused.safetensors"
    ok(cli("fuse", src, "-r", write_rules(tmp_path / "lie.toml", LIE), "-o", fused))
    return src, with_provenance(fused, tmp_path / "candidate.safetensors", _claiming_the_preset(keep_origin))


def test_a_provenance_whose_steps_its_recorded_rule_does_not_give_fails(cli, copy_fixture, tmp_path):
    src, candidate = _lying_candidate(cli, copy_fixture, tmp_path, keep_origin=True)
    result = cli("verify", src, candidate, "--provider", "cpu")
    assert result.exit_code == 1, result.output
    assert "FAIL rules rule 'bert-qkv' (preset bert-qkv)" in result.stdout
    assert "step 0: the provenance records concat ['encoder.layer.0.attention.self.query.bias', " \
           "'encoder.layer.0.attention.self.value.bias'" in result.stdout
    # everything else about the lie holds together: the steps replay to the candidate's data
    assert "FAIL tensor" not in result.stdout and "FAIL probe" not in result.stdout


def test_an_old_provenance_naming_a_preset_is_checked_against_the_shipped_preset(cli, copy_fixture, tmp_path):
    """The issue's case: a record without rules texts (as fusectl wrote before) that names a
    preset is re-derived from the shipped preset with the reference's config.json."""
    src, candidate = _lying_candidate(cli, copy_fixture, tmp_path, keep_origin=False)
    report = tmp_path / "report.json"
    result = cli("verify", src, candidate, "--provider", "cpu", "--report", report)
    assert result.exit_code == 1, result.output
    failed = [c for c in json.loads(report.read_text())["checks"] if not c["passed"]]
    assert [(c["kind"], c["name"]) for c in failed] == [("rules", "rule 'bert-qkv' (preset bert-qkv)")]
    assert "but the rule 'bert-qkv' gives concat ['encoder.layer.0.attention.self.query.bias', " \
           "'encoder.layer.0.attention.self.key.bias'" in failed[0]["detail"]


def test_an_honest_fuse_is_re_derived(cli, copy_fixture, tmp_path):
    src = copy_fixture(BERT)
    fused = tmp_path / "fused"
    ok(cli("fuse", src, "-r", "bert-qkv", "-o", fused))
    result = ok(cli("verify", src, fused, "--provider", "cpu"))
    assert "PASS rules rule 'bert-qkv' (preset bert-qkv)  (4 step(s) re-derived from the recorded rule)" in result.stdout


def test_a_provenance_without_rules_text_of_a_rules_file_fails_naming_what_to_do(cli, copy_fixture, tmp_path):
    """A record with no rules text that names no shipped preset (written before fusectl kept
    rules texts, or a lie with its origin dropped) cannot be re-derived: the rules check fails,
    saying to pass -r, which then checks the steps against the rules."""
    src = copy_fixture(BERT)
    rules = write_rules(tmp_path / "honest.toml", preset_text("bert-qkv"))
    fused = tmp_path / "fused.safetensors"
    ok(cli("fuse", src, "-r", rules, "-o", fused))
    candidate = with_provenance(fused, tmp_path / "old.safetensors", without_origins)
    result = cli("verify", src, candidate, "--provider", "cpu")
    assert result.exit_code == 1, result.output
    assert "FAIL rules rule 'bert-qkv'" in result.stdout and "records no rules text" in result.stdout
    assert "pass -r RULES" in result.stdout
    assert "FAIL tensor" not in result.stdout and "FAIL probe" not in result.stdout
    ok(cli("verify", src, candidate, "--provider", "cpu", "-r", rules))


def test_other_rules_recorded_under_a_presets_name_fail(cli, copy_fixture, tmp_path):
    """The lie keeps its own rules text (and its matching hash) but names preset bert-qkv: the
    steps follow the recorded text, so the group is also re-derived from the preset as shipped."""
    src = copy_fixture(BERT)
    fused = tmp_path / "fused.safetensors"
    ok(cli("fuse", src, "-r", write_rules(tmp_path / "lie.toml", LIE), "-o", fused))

    def renamed(record):
        for group in record["plan"]:
            group["source"] = "preset bert-qkv"
        return record

    candidate = with_provenance(fused, tmp_path / "candidate.safetensors", renamed)
    result = cli("verify", src, candidate, "--provider", "cpu")
    assert result.exit_code == 1, result.output
    assert "FAIL rules rule 'bert-qkv' (preset bert-qkv)" in result.stdout
    assert "preset bert-qkv as shipped: step 0: the provenance records concat" in result.stdout


def test_recorded_config_values_the_reference_contradicts_fail(cli, copy_fixture, tmp_path):
    src = copy_fixture(BERT)
    fused = tmp_path / "fused.safetensors"
    ok(cli("fuse", src, "-r", "bert-qkv", "-o", fused))

    def other_size(record):
        record["plan"][0]["origin"]["config"] = {"hidden_size": 16}
        return record

    candidate = with_provenance(fused, tmp_path / "candidate.safetensors", other_size)
    result = cli("verify", src, candidate, "--provider", "cpu")
    assert result.exit_code == 1, result.output
    assert "the rule was bound with config 'hidden_size' = 16, but the reference's config.json says 32" in result.stdout


def test_a_recorded_rules_text_that_does_not_match_its_hash_is_refused(cli, copy_fixture, tmp_path):
    src = copy_fixture(BERT)
    fused = tmp_path / "fused.safetensors"
    ok(cli("fuse", src, "-r", "bert-qkv", "-o", fused))

    def swapped(record):
        record["plan"][0]["origin"]["text"] = LIE
        return record

    candidate = with_provenance(fused, tmp_path / "candidate.safetensors", swapped)
    result = cli("verify", src, candidate, "--provider", "cpu")
    assert result.exit_code == 2 and "the rules text does not have the recorded SHA-256" in result.stderr
    assert "fusectl provenance is unreadable" in result.stderr


def test_a_recorded_rule_index_past_the_file_fails(cli, copy_fixture, tmp_path):
    src = copy_fixture(BERT)
    fused = tmp_path / "fused.safetensors"
    ok(cli("fuse", src, "-r", "bert-qkv", "-o", fused))

    def past(record):
        record["plan"][0]["origin"]["rule"] = 7
        return record

    candidate = with_provenance(fused, tmp_path / "candidate.safetensors", past)
    result = cli("verify", src, candidate, "--provider", "cpu")
    assert result.exit_code == 1, result.output
    assert "the recorded rules do not load: preset bert-qkv has no rule 'bert-qkv' at index 7" in result.stdout
