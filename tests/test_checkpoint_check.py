"""``verify REFERENCE CANDIDATE`` in checkpoint mode (verification/checkpoint_check.py), at the
edges the fixtures' fuses never reach: tensors one side lacks, tensors of another dtype, a
plan that does not apply to the reference, a recorded rule that no longer binds (or binds to
more) on the reference, a provenance naming a shipped preset that cannot say which rule made a
group, and an adapter fused twice (the ΔW probes take only the second fuse's steps).

The main cases are in test_verify.py (replay, inverse, ties, probes), test_byte_ranges.py
(streamed byte comparison) and test_verify_provenance_rules.py (steps re-derived from their
recorded rule)."""

from __future__ import annotations

import json
import shutil

import numpy as np

from conftest import FIXTURES, ok, refused, with_provenance, write_rules, write_safetensors

CONCAT = """
version = 1
[[rule]]
name   = "ab"
op     = "concat"
inputs = ["{p}.a", "{p}.b"]
output = "{p}.ab"
"""


def _fused(cli, tmp_path, tensors: dict[str, np.ndarray], name="candidate.safetensors"):
    """``tensors`` fused with the concat rule: the candidate."""
    src = write_safetensors(tmp_path / f"src-{name}", tensors)
    out = tmp_path / name
    ok(cli("fuse", src, "-r", write_rules(tmp_path / "ab.toml", CONCAT), "-o", out))
    return out


def _verify_json(cli, tmp_path, reference, candidate, *args):
    report = tmp_path / "report.json"
    result = cli("verify", reference, candidate, "--provider", "cpu", "--report", report, *args)
    assert result.exit_code == 1, result.output
    return {c["name"]: c for c in json.loads(report.read_text())["checks"] if not c["passed"]}, result


def _ones(*shape, dtype=np.float32):
    return np.arange(np.prod(shape), dtype=dtype).reshape(shape)


def test_tensors_only_the_reference_has_fail_as_missing_and_the_rule_no_longer_binds(cli, tmp_path):
    candidate = _fused(cli, tmp_path, {"l0.a": _ones(2, 3), "l0.b": _ones(1, 3)})
    reference = write_safetensors(tmp_path / "ref.safetensors", {"l0.a": _ones(2, 3), "l0.b": _ones(1, 3),
                                                                 "l1.a": _ones(2, 3), "l1.b": _ones(2, 4)})
    failed, _ = _verify_json(cli, tmp_path, reference, candidate)
    assert failed["l1.a"]["detail"] == failed["l1.b"]["detail"] == "missing from the candidate"
    rules = failed[f"rule 'ab' ({tmp_path / 'ab.toml'})"]["detail"]
    assert rules.startswith("the recorded rule: the recorded rule does not bind to the reference: rule 'ab' (")
    assert rules.endswith("'l1.b' has shape [2, 4] but 'l1.a' has [2, 3]; they must agree on every axis but 0")


def test_a_recorded_rule_that_binds_to_more_on_the_reference_fails_counting_steps(cli, tmp_path):
    candidate = _fused(cli, tmp_path, {"l0.a": _ones(2, 3), "l0.b": _ones(1, 3)})
    reference = write_safetensors(tmp_path / "ref.safetensors", {"l0.a": _ones(2, 3), "l0.b": _ones(1, 3),
                                                                 "l1.a": _ones(2, 3), "l1.b": _ones(2, 3)})
    failed, _ = _verify_json(cli, tmp_path, reference, candidate)
    assert failed[f"rule 'ab' ({tmp_path / 'ab.toml'})"]["detail"] == \
        "the recorded rule: the rule gives 2 step(s), the provenance records 1"


def test_tensors_only_the_candidate_has_fail_as_missing_from_the_replayed_reference(cli, tmp_path):
    candidate = _fused(cli, tmp_path, {"l0.a": _ones(2, 3), "l0.b": _ones(1, 3), "extra": _ones(2)})
    reference = write_safetensors(tmp_path / "ref.safetensors", {"l0.a": _ones(2, 3), "l0.b": _ones(1, 3)})
    failed, _ = _verify_json(cli, tmp_path, reference, candidate)
    assert failed["extra"]["detail"] == "missing from the reference after the plan"
    assert set(failed) == {"extra"}


def test_a_tensor_the_plan_leaves_alone_in_another_dtype_fails_naming_both_specs(cli, tmp_path):
    candidate = _fused(cli, tmp_path, {"l0.a": _ones(2, 3), "l0.b": _ones(1, 3), "c": _ones(2, dtype=np.float16)})
    reference = write_safetensors(tmp_path / "ref.safetensors", {"l0.a": _ones(2, 3), "l0.b": _ones(1, 3),
                                                                 "c": _ones(2)})
    failed, _ = _verify_json(cli, tmp_path, reference, candidate)
    assert failed["c"]["detail"] == "expected F32[2], found F16[2]"
    assert set(failed) == {"c"}


def test_a_plan_that_does_not_apply_to_the_reference_is_refused(cli, tmp_path):
    candidate = _fused(cli, tmp_path, {"l0.a": _ones(2, 3), "l0.b": _ones(1, 3)})
    reference = write_safetensors(tmp_path / "ref.safetensors", {"other": _ones(2)})
    refused(cli("verify", reference, candidate, "--provider", "cpu"),
            f"the candidate's plan does not apply to {reference}", "'l0.a'")


def _preset_candidate(cli, tmp_path, edit):
    src = tmp_path / "bert"
    shutil.copytree(FIXTURES / "tiny-bert", src)
    fused = tmp_path / "fused.safetensors"
    ok(cli("fuse", src, "-r", "bert-qkv", "-o", fused))
    return src, with_provenance(fused, tmp_path / "candidate.safetensors", edit)


def test_a_group_naming_a_rule_its_preset_lacks_fails_saying_so(cli, tmp_path):
    def renamed(record):
        for group in record["plan"]:
            group.pop("origin", None)
            group["rule"] = "ghost"
        return record

    src, candidate = _preset_candidate(cli, tmp_path, renamed)
    failed, _ = _verify_json(cli, tmp_path, src, candidate)
    assert failed["rule 'ghost' (preset bert-qkv)"]["detail"] == \
        "not re-derived: the provenance names preset bert-qkv, which has no rule 'ghost'"
    assert [c for c in failed if c != "rule 'ghost' (preset bert-qkv)"] == []


def test_a_shipped_preset_that_does_not_bind_to_the_reference_fails_saying_why(cli, tmp_path):
    """No rules text recorded, so the group is re-derived from the preset as shipped, whose vars
    need config keys the reference has no config.json for."""
    def old(record):
        for group in record["plan"]:
            group.pop("origin", None)
        return record

    src, candidate = _preset_candidate(cli, tmp_path, old)
    (src / "config.json").unlink()
    failed, _ = _verify_json(cli, tmp_path, src, candidate)
    detail = failed["rule 'bert-qkv' (preset bert-qkv)"]["detail"]
    assert detail.startswith("preset bert-qkv as shipped: the recorded rule does not bind to the reference: ")
    assert detail.endswith("var 'hidden' needs config key 'hidden_size', but there is no config.json beside the "
                           "checkpoint; pass --config FILE")


def test_an_adapter_fused_twice_is_probed_for_the_second_fuse_only(cli, tmp_path):
    config = FIXTURES / "lora" / "llama-base" / "config.json"
    once, twice = tmp_path / "once", tmp_path / "twice"
    ok(cli("fuse", FIXTURES / "lora" / "llama-lora", "--config", config, "-r", "llama-qkv", "-o", once))
    ok(cli("fuse", once, "--config", config, "-r", "llama-gate-up", "-o", twice))
    report = tmp_path / "report.json"
    ok(cli("verify", once, twice, "--config", config, "--provider", "cpu", "--report", report))
    probes = [c["name"] for c in json.loads(report.read_text())["checks"] if c["kind"] == "probe"]
    assert probes and all("mlp-gate-up" in name for name in probes)
    assert any("ΔW = s·B·A of model.layers.0.mlp.gate_up_proj" in name for name in probes)
