"""Presets: every shipped rules file loads, documents itself, and keeps SPEC §3's output names.

Layouts are checked against tensors built here from the inputs (or, for llama-rope, against
the fixture permuted by transformers' own conversion formula), not against fusectl's ops.
"""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import numpy as np
import pytest

from conftest import array_of, load_checkpoint_raw, ok, parse_safetensors, write_safetensors
from conftest import FIXTURES, LLAMA, refuse_case
from fusectl.rules.presets import load_rules_arg, preset_names


PRESETS = {
    # preset: (fixture it applies to, names it must produce in layer 0)
    "llama-qkv": ("tiny-llama-gqa", ["model.layers.0.self_attn.qkv_proj.weight"]),
    "llama-gate-up": ("tiny-llama-gqa", ["model.layers.0.mlp.gate_up_proj.weight"]),
    "phi3-unfuse": ("tiny-phi3", [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"]
                    + ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]),
    "bert-qkv": ("tiny-bert", ["encoder.layer.0.attention.self.qkv.weight",
                               "encoder.layer.0.attention.self.qkv.bias"]),
    "bert-qkv-interleaved": ("tiny-bert", ["encoder.layer.0.attention.self.qkv.weight",
                                           "encoder.layer.0.attention.self.qkv.bias"]),
    "gpt-neox-qkv": ("tiny-gpt-neox", [f"gpt_neox.layers.0.attention.{x}.{t}"
                                       for x in ("query", "key", "value") for t in ("weight", "bias")]),
    "mixtral-experts": ("tiny-mixtral", [f"model.layers.0.block_sparse_moe.experts.w{n}" for n in (1, 2, 3)]),
    "mixtral-experts-hf5": ("moe-hf5/tiny-mixtral", [f"model.layers.0.mlp.experts.{x}_proj" for x in ("gate_up", "down")]
                            + ["model.layers.0.mlp.gate.weight"]),
    "qwen2-moe-experts-hf5": ("moe-hf5/tiny-qwen2-moe", [f"model.layers.0.mlp.experts.{x}_proj" for x in ("gate_up", "down")]
                              + ["model.layers.0.mlp.shared_expert_gate.weight"]),
    "llama-rope": ("tiny-rope-meta.safetensors", ["model.layers.0.self_attn.q_proj.weight",
                                                  "model.layers.0.self_attn.k_proj.weight"]),
    "megatron-gpt-to-llama": ("megatron/reference/gpt-tp2-full.safetensors",
                              [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkvo"] + ["lm_head.weight"]),
    "llama-to-megatron-gpt": ("tiny-llama-gqa", ["decoder.layers.0.self_attention.linear_qkv.weight",
                                                "decoder.layers.0.mlp.linear_fc1.weight", "output_layer.weight"]),
    "mixtral-to-megatron-moe": ("tiny-mixtral", ["decoder.layers.0.mlp.router.weight",
                                                 "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"]),
    "megatron-moe-to-mixtral": ("megatron/reference/moe-tp2-full.safetensors",
                                [f"model.layers.0.block_sparse_moe.experts.3.w{n}.weight" for n in (1, 2, 3)]
                                + ["model.layers.0.block_sparse_moe.gate.weight"]),
}
# presets whose fixture is a file without a config.json beside it: the config given with --config
CONFIG_FOR = {"megatron-gpt-to-llama": "megatron/hf-config/llama/config.json",
              "megatron-moe-to-mixtral": "megatron/hf-config/mixtral/config.json"}

LLAMA_CONFIG = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64}


def test_preset_names_match_the_contract():
    assert sorted(PRESETS) == [n for n in preset_names() if n in PRESETS]
    assert set(PRESETS) <= set(preset_names())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_text_is_valid_rules(cli, name):
    text = ok(cli("rules", "show", name)).stdout
    doc = tomllib.loads(text)
    assert doc["version"] == 1
    assert isinstance(doc.get("description"), str) and doc["description"].strip()
    assert doc["rule"], "a preset without rules"
    for rule in doc["rule"]:
        assert rule.get("name"), f"{name}: every preset rule has a name for messages"
    listed = ok(cli("rules", "list")).stdout
    line = next(line for line in listed.splitlines() if line.split()[0] == name)
    assert doc["description"] in line


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_loads_with_fixture_config(name, fixtures_dir):
    fixture = PRESETS[name][0]
    config_path = fixtures_dir / CONFIG_FOR.get(name, f"{fixture}/config.json")
    config = json.loads(config_path.read_text()) if config_path.exists() else LLAMA_CONFIG
    ruleset = load_rules_arg(name, config)
    assert ruleset.rules
    assert ruleset.source == f"preset {name}"
    assert all(rule.name for rule in ruleset.rules)


def _ckpt_args(name, copy_fixture, tmp_path):
    fixture, _ = PRESETS[name]
    src = copy_fixture(fixture, Path(fixture).name)
    args = [src]
    if name == "llama-rope":
        config = tmp_path / "rope-config.json"
        config.write_text(json.dumps(LLAMA_CONFIG))
        args += ["--config", config]
    elif name in CONFIG_FOR:
        args += ["--config", FIXTURES / CONFIG_FOR[name]]
    return src, args


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_output_names(cli, copy_fixture, tmp_path, name):
    src, args = _ckpt_args(name, copy_fixture, tmp_path)
    doc = ok(cli("plan", *args, "-r", name, "--json")).json()
    names = {p["name"] for p in doc["result"]["parameters"]}
    for expected in PRESETS[name][1]:
        assert expected in names, f"{name}: {expected} missing from {sorted(names)}"
    assert doc["groups"], "the preset did nothing"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_round_trip_through_provenance(cli, copy_fixture, tmp_path, name):
    src, args = _ckpt_args(name, copy_fixture, tmp_path)
    out, back = tmp_path / "out.safetensors", tmp_path / "back.safetensors"
    ok(cli("fuse", *args, "-r", name, "-o", out))
    ok(cli("unfuse", out, "-o", back))
    assert load_checkpoint_raw(back) == load_checkpoint_raw(src)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_round_trip_through_inverted_rules(cli, copy_fixture, tmp_path, name):
    """unfuse -r PRESET inverts the preset's rules, binding by binding, where the provenance
    proves the forward rule made each tensor; without provenance nothing is proven, not even an
    in-place step (llama-rope), and every binding is refused naming a tensor
    (tests/test_unfuse_rules_proof.py)."""
    src, args = _ckpt_args(name, copy_fixture, tmp_path)
    out = tmp_path / "out.safetensors"
    ok(cli("fuse", *args, "-r", name, "-o", out))
    tensors, meta = parse_safetensors(out)
    meta.pop("fusectl")
    stripped = write_safetensors(tmp_path / "stripped.safetensors",
                                 {n: array_of(t) for n, t in tensors.items()}, meta)
    extra = args[1:]
    if len(args) == 1:  # the config.json beside the fixture, beside the output too
        shutil.copy2(src / "config.json", tmp_path / "config.json")
    back = tmp_path / "back.safetensors"
    ok(cli("unfuse", out, "-r", name, "-o", back, *extra))
    assert load_checkpoint_raw(back) == load_checkpoint_raw(src)
    guessed = tmp_path / "guessed.safetensors"
    result = cli("unfuse", stripped, "-r", name, "-o", guessed, *extra)
    assert result.exit_code == 2 and "may be a tensor the forward rule left alone" in result.stderr
    assert not guessed.exists()


# ------------------------------------------------------------------------------- llama-rope


def test_llama_rope_matches_transformers_conversion(cli, copy_fixture, tmp_path):
    """Meta → HF with the preset equals the fixture that transformers' permute produced."""
    src = copy_fixture("tiny-rope-meta.safetensors")
    hf = copy_fixture("tiny-rope-hf.safetensors")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_CONFIG))
    out = tmp_path / "out.safetensors"
    ok(cli("fuse", src, "-r", "llama-rope", "-o", out, "--config", config))
    got, _ = parse_safetensors(out)
    want, _ = parse_safetensors(hf)
    assert got == want
    # guard: the permutation is not the identity on this data
    assert parse_safetensors(src)[0] != want


def test_llama_rope_unfuse_gives_meta_order(cli, copy_fixture, tmp_path):
    src = copy_fixture("tiny-rope-meta.safetensors")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_CONFIG))
    out, back = tmp_path / "out.safetensors", tmp_path / "back.safetensors"
    ok(cli("fuse", src, "-r", "llama-rope", "-o", out, "--config", config))
    ok(cli("unfuse", out, "-o", back))
    assert parse_safetensors(back)[0] == parse_safetensors(src)[0]


# ----------------------------------------------------------------- prefixes and biases ({p*}, {t})


def _llama_like(prefix: str, with_bias: bool, dtype=np.float32):
    rng = np.random.default_rng(7)
    p = f"{prefix}." if prefix else ""
    tensors = {}
    for i in range(2):
        for x, rows in (("q", 32), ("k", 16), ("v", 16)):
            tensors[f"{p}layers.{i}.self_attn.{x}_proj.weight"] = rng.standard_normal((rows, 32)).astype(dtype)
            if with_bias:
                tensors[f"{p}layers.{i}.self_attn.{x}_proj.bias"] = rng.standard_normal(rows).astype(dtype)
        for x in ("gate", "up"):
            tensors[f"{p}layers.{i}.mlp.{x}_proj.weight"] = rng.standard_normal((64, 32)).astype(dtype)
        tensors[f"{p}layers.{i}.mlp.down_proj.weight"] = rng.standard_normal((32, 64)).astype(dtype)
    tensors[f"{p}norm.weight"] = np.ones(32, dtype)
    return tensors


@pytest.mark.parametrize("prefix", ["", "model", "language_model.model", "a.b.c.model"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_llama_presets_with_any_prefix_and_bias(cli, tmp_path, prefix, with_bias):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    tensors = _llama_like(prefix, with_bias)
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    out = tmp_path / "out"
    ok(cli("fuse", folder, "-r", "llama-qkv", "-r", "llama-gate-up", "-o", out))
    got = load_checkpoint_raw(out)
    p = f"{prefix}." if prefix else ""
    for i in range(2):
        a = f"{p}layers.{i}.self_attn."
        want = np.concatenate([tensors[a + f"{x}_proj.weight"] for x in "qkv"])
        assert got[a + "qkv_proj.weight"] == ("F32", [64, 32], want.tobytes())
        if with_bias:
            want_b = np.concatenate([tensors[a + f"{x}_proj.bias"] for x in "qkv"])
            assert got[a + "qkv_proj.bias"] == ("F32", [64], want_b.tobytes())
        else:
            assert a + "qkv_proj.bias" not in got
        m = f"{p}layers.{i}.mlp."
        want = np.concatenate([tensors[m + "gate_proj.weight"], tensors[m + "up_proj.weight"]])
        assert got[m + "gate_up_proj.weight"][2] == want.tobytes()
    assert len(got) == len(tensors) - (2 * 3 * (2 if with_bias else 1) + 2 * 2) + (2 * (2 if with_bias else 1) + 2)
    back = tmp_path / "back"
    ok(cli("unfuse", out, "-o", back))
    assert load_checkpoint_raw(back) == load_checkpoint_raw(folder)


def test_presets_chain_with_a_user_rules_file(cli, copy_fixture, tmp_path):
    """-r applies in order: a later rule sees the names an earlier preset produced."""
    src = copy_fixture("tiny-llama-gqa")
    rules = tmp_path / "rename.toml"
    rules.write_text("""
version = 1
[[rule]]
name = "qkv-to-wqkv"
op = "rename"
input = "{p*}.layers.{i:int}.self_attn.qkv_proj.weight"
output = "{p*}.layers.{i:int}.attention.wqkv.weight"
""")
    doc = ok(cli("plan", src, "-r", "llama-qkv", "-r", rules, "--json")).json()
    names = {p["name"] for p in doc["result"]["parameters"]}
    assert "model.layers.1.attention.wqkv.weight" in names
    assert not any("qkv_proj" in n for n in names)
    # reversed order: the rename finds nothing and says so
    result = cli("plan", src, "-r", rules, "-r", "llama-qkv")
    assert result.exit_code == 2
    assert "qkv-to-wqkv" in result.stderr


# ------------------------------------------------------------------------------- conv-bn-fold


def test_conv_bn_fold_preset_lists_both_namings_and_every_rule_is_optional(cli):
    doc = tomllib.loads(ok(cli("rules", "show", "conv-bn-fold")).stdout)
    assert "Sequential" in doc["description"] and "torchvision" in doc["description"]
    assert [r["name"] for r in doc["rule"]] == ["conv-bn", "conv-bn-attr", "downsample-bn", "sequential-bn",
                                                "bn-counters", "bn-attr-counters", "downsample-counters",
                                                "sequential-counters"]
    assert all(r["optional"] is True for r in doc["rule"])  # a model with one naming only still fits
    line = next(x for x in ok(cli("rules", "list")).stdout.splitlines() if x.split()[0] == "conv-bn-fold")
    assert doc["description"] in line


def _bn(prefix, c, seed):
    rng = np.random.default_rng(seed)
    t = {f"{prefix}.{k}": rng.uniform(0.5, 1.5, c).astype(np.float32) for k in ("weight", "bias", "running_mean", "running_var")}
    t[f"{prefix}.num_batches_tracked"] = np.array(3, np.int64)
    return t


def test_conv_bn_fold_handles_torchvision_and_sequential_names_in_one_model(cli, tmp_path):
    """A torchvision-named block beside Sequential stacks (MobileNet's Conv2dNormActivation is
    features.{i}.0 + features.{i}.1): every pair folds, exactly their counters go."""
    rng = np.random.default_rng(3)
    tensors = {
        "stem.conv1.weight": rng.standard_normal((4, 3, 3, 3)).astype(np.float32), **_bn("stem.bn1", 4, 1),
        "layer1.0.downsample.0.weight": rng.standard_normal((4, 4, 1, 1)).astype(np.float32),
        **_bn("layer1.0.downsample.1", 4, 2),
        "features.0.0.weight": rng.standard_normal((8, 4, 3, 3)).astype(np.float32), **_bn("features.0.1", 8, 3),
        "features.1.0.weight": rng.standard_normal((8, 1, 3, 3)).astype(np.float32), **_bn("features.1.1", 8, 4),
        "classifier.1.weight": rng.standard_normal((5, 8)).astype(np.float32),
        "classifier.1.bias": rng.standard_normal(5).astype(np.float32), **_bn("classifier.2", 5, 5),
        "norm.0.running_mean": np.zeros(2, np.float32), "norm.0.num_batches_tracked": np.array(1, np.int64),
    }
    src = write_safetensors(tmp_path / "in.safetensors", tensors)
    out = tmp_path / "out.safetensors"
    ok(cli("fuse", src, "-r", "conv-bn-fold", "-o", out))
    got = load_checkpoint_raw(out)
    layers = ["stem.conv1", "layer1.0.downsample.0", "features.0.0", "features.1.0", "classifier.1"]
    assert sorted(got) == sorted([f"{m}.{t}" for m in layers for t in ("weight", "bias")]
                                 + ["norm.0.running_mean", "norm.0.num_batches_tracked"])
    # the grouped/depthwise-shaped conv folds per output channel like any other
    w = tensors["features.1.0.weight"]
    bn = {k: tensors[f"features.1.1.{k}"].astype(np.float64) for k in ("weight", "bias", "running_mean", "running_var")}
    scale = bn["weight"] / np.sqrt(bn["running_var"] + 1e-5)
    folded = np.frombuffer(got["features.1.0.weight"][2], np.float32).reshape(w.shape)
    np.testing.assert_allclose(folded, w * scale[:, None, None, None], rtol=1e-6)
    bias = np.frombuffer(got["features.1.0.bias"][2], np.float32)
    np.testing.assert_allclose(bias, -bn["running_mean"] * scale + bn["bias"], rtol=1e-6, atol=1e-7)


# --- bad input through the CLI: refused in full (conftest.assert_refused) ----------------


def test_preset_that_does_not_exist(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    refuse_case(cli, area, src, "-r", "llama-qkv-typo", needles=["llama-qkv-typo"])


@pytest.mark.parametrize("typo,meant", [("llama-qvk", "'llama-qkv'"), ("conv-bn", "'conv-bn-fold'"),
                                        ("weight_norm_fold", "'weight-norm-fold'")])
def test_a_typoed_preset_suggests_the_closest_names_not_all_of_them(cli, area, copy_fixture, typo, meant):
    src = copy_fixture(LLAMA)
    result = refuse_case(cli, area, src, "-r", typo, needles=[f"{typo!r} is neither a rules file nor a preset",
                                                              f"did you mean {meant}"])
    quoted = result.stderr.count("'")
    assert quoted <= 2 * 4, result.stderr  # the typo and at most three names, not all the presets
    assert f"all {len(preset_names())} presets" in result.stderr and "fusectl rules list" in result.stderr


def test_a_name_like_no_preset_points_at_the_list(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    result = refuse_case(cli, area, src, "-r", "qwerty", needles=["no preset has a similar name", "fusectl rules list"])
    assert "llama-qkv" not in result.stderr
