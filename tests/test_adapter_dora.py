"""DoRA adapters are refused by every command that lifts or probes an adapter (issue 18, item 11).

DoRA rescales each row of W + s·B·A by a magnitude vector; fusectl moves A and B only, so an
adapter whose config says ``use_dora: true`` is refused whether or not the file holds the
magnitude vectors (PEFT creates missing ones when it loads the adapter), and so is one that
holds them under ``use_dora: false``. ``fixtures/lora/llama-dora`` is a real PEFT DoRA adapter
(fixtures/generate_dora.py); the others are the LoRA fixture with its config or tensors edited.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from conftest import FIXTURES, ok, refused, write_safetensors

LORA = FIXTURES / "lora"
CONFIG = LORA / "llama-base" / "config.json"
NOT_SUPPORTED = ("DoRA adapters are not supported", "merge_and_unload")


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def _set_dora(folder: Path, value: bool) -> Path:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config["use_dora"] = value
    path.write_text(json.dumps(config, indent=2))
    return folder


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    return dict(safetensors.numpy.load_file(str(folder / "adapter_model.safetensors")))


def _flagged_without_magnitudes(tmp_path: Path) -> Path:
    """The issue's case: the LoRA fixture with use_dora: true, no magnitude vectors."""
    return _set_dora(_copy(LORA / "llama-lora", tmp_path / "flagged"), True)


def _real_without_magnitudes(tmp_path: Path) -> Path:
    """PEFT's DoRA adapter with its magnitude vectors removed (use_dora still true)."""
    folder = _copy(LORA / "llama-dora", tmp_path / "stripped")
    kept = {k: v for k, v in _tensors(folder).items() if "lora_magnitude_vector" not in k}
    write_safetensors(folder / "adapter_model.safetensors", kept, {"format": "pt"})
    return folder


def test_the_real_dora_fixture_is_what_the_tests_assume():
    config = json.loads((LORA / "llama-dora" / "adapter_config.json").read_text())
    assert config["use_dora"] is True and config["peft_type"] == "LORA"
    assert sum("lora_magnitude_vector" in k for k in _tensors(LORA / "llama-dora")) == 4


ADAPTERS = {
    "real": lambda tmp: _copy(LORA / "llama-dora", tmp / "dora"),
    "real-without-magnitudes": _real_without_magnitudes,
    "flagged-without-magnitudes": _flagged_without_magnitudes,
}


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
@pytest.mark.parametrize("command", ["fuse", "plan", "verify -r", "unfuse -r"])
def test_a_dora_adapter_is_refused_naming_its_config(cli, tmp_path, adapter, command):
    folder = ADAPTERS[adapter](tmp_path)
    out = tmp_path / "out"
    args = {
        "fuse": ["fuse", folder, "--config", CONFIG, "-r", "llama-qkv", "-o", out],
        "plan": ["plan", folder, "--config", CONFIG, "-r", "llama-qkv"],
        "verify -r": ["verify", folder, folder, "--config", CONFIG, "-r", "llama-qkv", "--report", out],
        "unfuse -r": ["unfuse", folder, "--config", CONFIG, "-r", "llama-qkv", "-o", out],
    }[command]
    refused(cli(*args), f"error: {folder / 'adapter_config.json'}: use_dora is true", *NOT_SUPPORTED,
            unwritten=[out])


def test_verify_from_the_provenance_refuses_a_dora_pair(cli, tmp_path):
    """A candidate fused before this check (its config says use_dora: true) has a provenance
    to verify from; its ΔW probes would ignore the magnitudes, so verify refuses it too."""
    reference = _copy(LORA / "llama-lora", tmp_path / "ref")
    candidate = tmp_path / "fused"
    ok(cli("fuse", reference, "--config", CONFIG, "-r", "llama-qkv", "-o", candidate))
    ok(cli("verify", reference, candidate))
    for folder in (reference, candidate):
        _set_dora(folder, True)
    report = tmp_path / "r.json"
    refused(cli("verify", reference, candidate, "--report", report), "adapter_config.json: use_dora is true",
            *NOT_SUPPORTED, unwritten=[report])


def test_magnitude_vectors_under_use_dora_false_are_refused_naming_one(cli, tmp_path):
    folder = _set_dora(_copy(LORA / "llama-dora", tmp_path / "dora"), False)
    out = tmp_path / "out"
    refused(cli("fuse", folder, "--config", CONFIG, "-r", "llama-qkv", "-o", out),
            f"{folder / 'adapter_config.json'}: the adapter holds DoRA magnitude vectors",
            "'base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector'", *NOT_SUPPORTED,
            unwritten=[out])


def test_the_check_runs_before_any_rule_binds(cli, tmp_path):
    """A rules file that does not fit the adapter still gets the DoRA refusal first: no plan
    of a DoRA adapter is worth fixing."""
    folder = _flagged_without_magnitudes(tmp_path)
    refused(cli("plan", folder, "--config", CONFIG, "-r", "bert-qkv"), "use_dora is true")


def test_inspect_still_shows_a_dora_adapter(cli):
    report = ok(cli("inspect", LORA / "llama-dora", "--json")).json()
    assert report["adapter"]["use_dora"] is True
    assert sorted(report["adapter"]["modules"]) == [f"model.layers.{i}.self_attn.{p}_proj"
                                                    for i in (0, 1) for p in ("q", "v")]


def test_a_plain_lora_adapter_still_fuses(cli, tmp_path):
    folder = _set_dora(_copy(LORA / "llama-lora", tmp_path / "lora"), False)
    ok(cli("fuse", folder, "--config", CONFIG, "-r", "llama-qkv", "-o", tmp_path / "out"))
