"""LoRA adapters through layout rules, checked with numpy (no torch): the adapter's update
ΔW = s · B · A of every module after the rules equals the rules applied to the updates before,
fuse then unfuse is bitwise, and what cannot be lifted is refused.

The fixtures are peft's own files (``fixtures/generate_lora.py``); ``tests/test_lora_loaders.py``
loads the results with transformers + peft where those are installed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import FIXTURES, array_of, load_checkpoint_raw, metadata_of, ok, refused, write_rules, write_safetensors

LORA = FIXTURES / "lora"
P = "base_model.model.model.layers.0"
LLAMA_CONFIG = LORA / "llama-base" / "config.json"
PHI3_CONFIG = LORA / "phi3-base" / "config.json"


def tensors(folder) -> dict[str, np.ndarray]:
    return {n: array_of(e) for n, e in load_checkpoint_raw(folder).items()}


def delta(folder, module: str) -> np.ndarray:
    """s · B · A of one module, with s from the folder's adapter_config.json (peft's rules)."""
    t = tensors(folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    a, b = t[f"base_model.model.{module}.lora_A.weight"], t[f"base_model.model.{module}.lora_B.weight"]
    leaf_keys = lambda pattern: next((v for k, v in pattern.items() if module == k or module.endswith("." + k)), None)  # noqa: E731
    r = leaf_keys(config["rank_pattern"]) or config["r"]
    alpha = leaf_keys(config["alpha_pattern"]) or config["lora_alpha"]
    assert a.shape[0] == r, (module, a.shape, r)
    return (alpha / r) * (b.astype(np.float64) @ a.astype(np.float64))


def fuse(cli, src, out, *rules, config=LLAMA_CONFIG):
    return ok(cli("fuse", src, "--config", config, *[x for r in rules for x in ("-r", r)], "-o", out))


def test_qkv_and_gate_up_lift_to_block_diagonal_b_and_stacked_a_with_the_scaling_kept(cli, tmp_path):
    out = tmp_path / "fused"
    fuse(cli, LORA / "llama-lora", out, "llama-qkv", "llama-gate-up")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    for layer in (0, 1):
        attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        want = np.concatenate([delta(LORA / "llama-lora", f"{attn}.{p}_proj") for p in "qkv"])
        np.testing.assert_allclose(delta(out, f"{attn}.qkv_proj"), want, atol=1e-6)
        want = np.concatenate([delta(LORA / "llama-lora", f"{mlp}.{p}_proj") for p in ("gate", "up")])
        np.testing.assert_allclose(delta(out, f"{mlp}.gate_up_proj"), want, atol=1e-6)
    config = json.loads((out / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    assert config["rank_pattern"]["model.layers.0.self_attn.qkv_proj"] == 10  # 4 + 4 + 2
    assert config["alpha_pattern"]["model.layers.0.self_attn.qkv_proj"] == 20  # scaling 2 kept
    before = json.loads((LORA / "llama-lora" / "adapter_config.json").read_text())
    assert {k: v for k, v in config.items() if k not in ("target_modules", "rank_pattern", "alpha_pattern")} == \
        {k: v for k, v in before.items() if k not in ("target_modules", "rank_pattern", "alpha_pattern")}
    t = tensors(out)
    b = t[f"{P}.self_attn.qkv_proj.lora_B.weight"]
    assert b.shape == (64, 10) and not b[:32, 4:].any() and not b[32:48, :4].any()  # block-diagonal


def test_fuse_then_unfuse_of_an_adapter_is_bitwise_with_its_config(cli, tmp_path):
    out, back = tmp_path / "fused", tmp_path / "back"
    fuse(cli, LORA / "llama-lora", out, "llama-qkv", "llama-gate-up")
    ok(cli("unfuse", out, "-o", back))
    assert load_checkpoint_raw(back) == load_checkpoint_raw(LORA / "llama-lora")
    for name in ("adapter_config.json", "README.md"):
        assert (back / name).read_bytes() == (LORA / "llama-lora" / name).read_bytes()


def test_a_dense_phi3_lora_splits_exactly_and_fuses_back_to_rank_r(cli, tmp_path):
    split, again = tmp_path / "split", tmp_path / "again"
    fuse(cli, LORA / "phi3-lora", split, "phi3-unfuse", config=PHI3_CONFIG)
    whole = delta(LORA / "phi3-lora", "model.layers.0.self_attn.qkv_proj")
    parts = [delta(split, f"model.layers.0.self_attn.{p}_proj") for p in "qkv"]
    np.testing.assert_allclose(np.concatenate(parts), whole, atol=1e-6)
    t = tensors(split)
    assert np.array_equal(t[f"{P}.self_attn.q_proj.lora_A.weight"], t[f"{P}.self_attn.v_proj.lora_A.weight"])
    # the parts share one A: fusing them again gives the original rank-4 adapter, bitwise
    fuse(cli, split, again, "llama-qkv", "llama-gate-up", config=PHI3_CONFIG)
    original = load_checkpoint_raw(LORA / "phi3-lora")
    got = load_checkpoint_raw(again)
    assert got == original
    config = json.loads((again / "adapter_config.json").read_text())
    assert config["rank_pattern"] == {} and config["alpha_pattern"] == {}


def test_verify_passes_a_lifted_adapter_and_catches_one_changed_element_of_b(cli, tmp_path):
    out = tmp_path / "fused"
    fuse(cli, LORA / "llama-lora", out, "llama-qkv", "llama-gate-up")
    result = ok(cli("verify", LORA / "llama-lora", out))
    assert "ΔW = s·B·A of model.layers.1.mlp.gate_up_proj" in result.stdout
    t = tensors(out)
    name = f"{P}.self_attn.qkv_proj.lora_B.weight"
    t[name] = t[name].copy()
    t[name][40, 5] += 0.25
    meta = metadata_of(out)
    write_safetensors(out / "adapter_model.safetensors", t, meta)
    result = cli("verify", LORA / "llama-lora", out)
    assert result.exit_code == 1, result.output
    failed = [line for line in result.stdout.splitlines() if line.strip().startswith("FAIL")]
    assert any("ΔW = s·B·A of model.layers.0.self_attn.qkv_proj" in line for line in failed), result.stdout


def test_verify_catches_a_lost_rank_pattern(cli, tmp_path):
    """The tensors are right but adapter_config.json lost the fused module's rank and alpha:
    peft would scale ΔW by 8/4 — the replay compares tensors only, the ΔW probe catches it."""
    out = tmp_path / "fused"
    fuse(cli, LORA / "llama-lora", out, "llama-qkv")
    path = out / "adapter_config.json"
    config = json.loads(path.read_text())
    config["alpha_pattern"] = {}
    path.write_text(json.dumps(config))
    result = cli("verify", LORA / "llama-lora", out)
    assert result.exit_code == 1, result.output


def test_verify_with_rules_instead_of_the_provenance(cli, tmp_path):
    out = tmp_path / "fused"
    fuse(cli, LORA / "llama-lora", out, "llama-qkv")
    ok(cli("verify", LORA / "llama-lora", out, "-r", "llama-qkv", "--config", LLAMA_CONFIG))


def test_a_row_permutation_moves_b_rows_and_keeps_a(cli, tmp_path):
    rules = write_rules(tmp_path / "r.toml", '''version = 1
[[rule]]
op = "rope_permute"
input = "{p*}.self_attn.q_proj.weight"
output = "{p*}.self_attn.q_proj.weight"
heads = 4
''')
    out = tmp_path / "out"
    fuse(cli, LORA / "llama-lora", out, rules)
    before, after = tensors(LORA / "llama-lora"), tensors(out)
    q = f"{P}.self_attn.q_proj"
    assert np.array_equal(after[f"{q}.lora_A.weight"], before[f"{q}.lora_A.weight"])
    rows = before[f"{q}.lora_B.weight"].reshape(4, 4, 2, 4).transpose(0, 2, 1, 3).reshape(32, 4)
    assert np.array_equal(after[f"{q}.lora_B.weight"], rows)
    ok(cli("verify", LORA / "llama-lora", out))


def test_transpose_swaps_the_factors(cli, tmp_path):
    rules = write_rules(tmp_path / "r.toml", 'version = 1\n[[rule]]\nop = "transpose"\n'
                        'input = "{p*}.mlp.down_proj.weight"\noutput = "{p*}.mlp.down_t.weight"\n')
    out = tmp_path / "out"
    fuse(cli, LORA / "llama-lora", out, rules)
    np.testing.assert_allclose(delta(out, "model.layers.0.mlp.down_t"),
                               delta(LORA / "llama-lora", "model.layers.0.mlp.down_proj").T, atol=1e-6)


def test_a_column_concat_puts_the_as_block_diagonal_and_the_bs_side_by_side(cli, tmp_path):
    rules = write_rules(tmp_path / "r.toml", '''version = 1
[[rule]]
op = "concat"
inputs = ["{p*}.self_attn.q_proj.weight", "{p*}.self_attn.o_proj.weight"]
output = "{p*}.self_attn.qo.weight"
axis = 1
''')
    out = tmp_path / "out"
    fuse(cli, LORA / "llama-lora", out, rules)
    want = np.concatenate([delta(LORA / "llama-lora", f"model.layers.0.self_attn.{p}_proj") for p in "qo"], axis=1)
    np.testing.assert_allclose(delta(out, "model.layers.0.self_attn.qo"), want, atol=1e-6)
    ok(cli("verify", LORA / "llama-lora", out))


def test_parts_with_different_scalings_are_refused(cli, tmp_path, copy_fixture):
    folder = copy_fixture("lora/llama-lora", "lora")
    config = json.loads((folder / "adapter_config.json").read_text())
    config["alpha_pattern"] = {"v_proj": 8}  # rank 2, alpha 8: scaling 4 against 2
    (folder / "adapter_config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    refused(cli("fuse", folder, "--config", LLAMA_CONFIG, "-r", "llama-qkv", "-o", out),
            "attn-qkv", "scalings differ", "v_proj", unwritten=[out])


@pytest.mark.parametrize("rule,needle", [
    ('op = "reshape"\ninput = "{p*}.mlp.down_proj.weight"\noutput = "{p*}.mlp.down_proj.weight"\nshape = [-1]',
     "low-rank"),
    ('op = "weight_norm_unfold"\ninput = "{p*}.mlp.down_proj.weight"\ng = "{p*}.mlp.down_proj.g"\n'
     'v = "{p*}.mlp.down_proj.v"\ndim = 0', "computes on the weight"),
])
def test_an_unsupported_lift_is_refused_naming_the_rule_and_the_adapter_tensor(cli, tmp_path, rule, needle):
    rules = write_rules(tmp_path / "r.toml", f'version = 1\n[[rule]]\nname = "bad"\n{rule}\n')
    out = tmp_path / "out"
    refused(cli("fuse", LORA / "llama-lora", "--config", LLAMA_CONFIG, "-r", rules, "-o", out),
            "rule 'bad'", "lora_B.weight", needle, unwritten=[out])


def test_a_dora_adapter_is_refused(cli, tmp_path, copy_fixture):
    folder = copy_fixture("lora/llama-lora", "lora")
    t = tensors(folder)
    t[f"{P}.self_attn.q_proj.lora_magnitude_vector"] = np.ones(32, np.float32)
    write_safetensors(folder / "adapter_model.safetensors", t, {"format": "pt"})
    refused(cli("fuse", folder, "--config", LLAMA_CONFIG, "-r", "llama-qkv", "-o", tmp_path / "out"),
            "DoRA", "lora_magnitude_vector", unwritten=[tmp_path / "out"])


def test_a_hostile_adapter_config_is_refused_within_the_json_budgets(cli, tmp_path, copy_fixture):
    folder = copy_fixture("lora/llama-lora", "lora")
    (folder / "adapter_config.json").write_text('{"r": ' + "[" * 100_000 + "]" * 100_000 + "}")
    refused(cli("plan", folder, "--config", LLAMA_CONFIG, "-r", "llama-qkv"), "adapter_config.json")


@pytest.mark.parametrize("edit,needle", [
    ({"r": 0}, "positive integer"),
    ({"rank_pattern": {"v_pr(o)+j": 2}}, "regular expressions"),
    ({"peft_type": "IA3"}, "LoRA adapters only"),
])
def test_a_bad_adapter_config_is_an_error(cli, tmp_path, copy_fixture, edit, needle):
    folder = copy_fixture("lora/llama-lora", "lora")
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(edit)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    refused(cli("plan", folder, "--config", LLAMA_CONFIG, "-r", "llama-qkv"), "adapter_config.json", needle)


def test_a_base_and_its_adapter_fused_with_one_rules_list(cli, tmp_path):
    """The README's workflow: the same -r list for the base and for each adapter."""
    rules = ["llama-qkv", "llama-gate-up"]
    fuse(cli, LORA / "llama-base", tmp_path / "base", *rules)
    fuse(cli, LORA / "llama-lora", tmp_path / "adapter", *rules, config=LLAMA_CONFIG)
    base = tensors(tmp_path / "base")
    adapter = tensors(tmp_path / "adapter")
    for name in adapter:
        module = name[len("base_model.model."):].rsplit(".lora_", 1)[0]
        assert f"{module}.weight" in base, module


def test_an_adapter_saved_as_bin_lifts_like_its_safetensors_twin(cli, tmp_path):
    """peft's save_pretrained(safe_serialization=False) writes adapter_model.bin (torch.save),
    read without torch; the output is adapter_model.safetensors, as peft prefers."""
    fuse(cli, LORA / "llama-lora-bin", tmp_path / "from-bin", "llama-qkv", "llama-gate-up")
    fuse(cli, LORA / "llama-lora", tmp_path / "from-st", "llama-qkv", "llama-gate-up")
    assert (tmp_path / "from-bin" / "adapter_model.safetensors").exists()
    assert load_checkpoint_raw(tmp_path / "from-bin") == load_checkpoint_raw(tmp_path / "from-st")


def test_inspect_reports_the_adapters_modules_ranks_and_scalings(cli):
    report = ok(cli("inspect", LORA / "llama-lora", "--json")).json()["adapter"]
    assert report["r"] == 4 and report["lora_alpha"] == 8
    v = report["modules"]["model.layers.0.self_attn.v_proj"]
    assert (v["rank"], v["alpha"], v["scaling"]) == (2, 4, 2.0)
    assert v["lora_A"] == f"{P}.self_attn.v_proj.lora_A.weight"
    assert len(report["modules"]) == 14
    text = ok(cli("inspect", LORA / "llama-lora")).stdout
    assert "LoRA adapter: 14 module(s), rank 2, 4, scaling 2" in text
    assert ok(cli("inspect", LORA / "llama-base", "--json")).json()["adapter"] is None


@pytest.mark.parametrize("edit,needle", [
    ({"rank_pattern": {"q_proj": 0}}, "positive numeric"),
    ({"alpha_pattern": {"v_proj": -2}}, "positive numeric"),
    ({"rank_pattern": {"v_proj": 3}}, "disagree"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"lora_bias": True}, "lora_bias"),
    ({"use_rslora": "false"}, "true or false"),
])
def test_adapter_configs_fusectl_cannot_lift_exactly_are_refused(cli, tmp_path, copy_fixture, edit, needle):
    folder = copy_fixture("lora/llama-lora", "lora")
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(edit)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    refused(cli("fuse", folder, "--config", LLAMA_CONFIG, "-r", "llama-qkv", "-o", tmp_path / "out"), needle,
            unwritten=[tmp_path / "out"])


def test_a_huge_alpha_that_would_overflow_is_refused(cli, tmp_path, copy_fixture):
    folder = copy_fixture("lora/llama-lora", "lora")
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update({"lora_alpha": 1.7e308, "alpha_pattern": {"v_proj": 0.85e308}})
    (folder / "adapter_config.json").write_text(json.dumps(config))
    refused(cli("fuse", folder, "--config", LLAMA_CONFIG, "-r", "llama-qkv", "-o", tmp_path / "out"), "finite",
            unwritten=[tmp_path / "out"])
