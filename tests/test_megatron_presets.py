"""Presets megatron-gpt-to-llama, megatron-moe-to-mixtral and llama-to-megatron-gpt on megatron-core's own
full parameters.

fixtures/megatron/reference/NAME-full.safetensors are the TP=1 parameters megatron-core itself
gathered from the trained checkpoints (fixtures/generate_megatron.py), under megatron's names;
fixtures/megatron/hf-config/ holds the Hugging Face config.json of each model, written by
transformers (fixtures/generate_megatron_hf_configs.py). Without torch: the output has exactly
a Llama's / Mixtral's names and shapes, its q/k/v and gate/up are the rows the fixture script's
layout facts name, and unfuse gives megatron's file back bitwise. With torch and transformers:
the output, loaded by ``from_pretrained``, computes megatron's own TP=1 logits within 1e-5. A Llama
without fusectl's provenance goes back with the forward preset llama-to-megatron-gpt, bitwise.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import (FIXTURES, array_of, load_checkpoint_raw, ok, parse_safetensors, refused, with_provenance,
                      write_safetensors)

REFERENCE = FIXTURES / "megatron" / "reference"
CONFIGS = FIXTURES / "megatron" / "hf-config"
# fixture variant → (preset, hf-config folder)
VARIANTS = {
    "gpt-tp2": ("megatron-gpt-to-llama", "llama"),
    "gpt-tp2-pp2": ("megatron-gpt-to-llama", "llama"),
    "tied-tp2": ("megatron-gpt-to-llama", "tied"),
    "moe-tp2": ("megatron-moe-to-mixtral", "mixtral"),
    "moe-ep2": ("megatron-moe-to-mixtral", "mixtral"),
}
VOCAB, HIDDEN, FFN, HEADS, GROUPS, LAYERS, EXPERTS = 64, 16, 32, 4, 2, 2, 4
HEAD = HIDDEN // HEADS


def hf_shapes(tied: bool, experts: int) -> dict[str, list[int]]:
    """The parameter names and shapes of transformers' LlamaForCausalLM / MixtralForCausalLM (as
    save_pretrained writes them) for the fixture model, written out from the config."""
    shapes = {"model.embed_tokens.weight": [VOCAB, HIDDEN], "model.norm.weight": [HIDDEN]}
    if not tied:
        shapes["lm_head.weight"] = [VOCAB, HIDDEN]
    for i in range(LAYERS):
        layer = f"model.layers.{i}."
        shapes |= {layer + "input_layernorm.weight": [HIDDEN], layer + "post_attention_layernorm.weight": [HIDDEN],
                   layer + "self_attn.q_proj.weight": [HEADS * HEAD, HIDDEN],
                   layer + "self_attn.k_proj.weight": [GROUPS * HEAD, HIDDEN],
                   layer + "self_attn.v_proj.weight": [GROUPS * HEAD, HIDDEN],
                   layer + "self_attn.o_proj.weight": [HIDDEN, HEADS * HEAD]}
        if experts:
            shapes[layer + "block_sparse_moe.gate.weight"] = [experts, HIDDEN]
            for e in range(experts):
                expert = f"{layer}block_sparse_moe.experts.{e}."
                shapes |= {expert + "w1.weight": [FFN, HIDDEN], expert + "w3.weight": [FFN, HIDDEN],
                           expert + "w2.weight": [HIDDEN, FFN]}
        else:
            shapes |= {layer + "mlp.gate_proj.weight": [FFN, HIDDEN], layer + "mlp.up_proj.weight": [FFN, HIDDEN],
                       layer + "mlp.down_proj.weight": [HIDDEN, FFN]}
    return shapes


def convert(cli, tmp_path, variant: str, out_name: str = "hf"):
    """``fuse`` the variant's full file with its preset and config into a folder; (input, output)."""
    preset, config = VARIANTS[variant]
    src = tmp_path / f"{variant}-full.safetensors"
    shutil.copy2(REFERENCE / src.name, src)
    out = tmp_path / out_name
    ok(cli("fuse", src, "-r", preset, "--config", CONFIGS / config / "config.json", "-o", out))
    return src, out


def full(variant: str) -> dict[str, np.ndarray]:
    return {name: array_of(t) for name, t in parse_safetensors(REFERENCE / f"{variant}-full.safetensors")[0].items()}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_output_has_the_hugging_face_names_and_shapes(cli, tmp_path, variant):
    _, out = convert(cli, tmp_path, variant)
    got = load_checkpoint_raw(out)
    want = hf_shapes(variant.startswith("tied"), EXPERTS if variant.startswith("moe") else 0)
    assert {n: t[1] for n, t in got.items()} == want
    assert all(t[0] == "F32" for t in got.values())


@pytest.mark.parametrize("variant", ["gpt-tp2", "moe-ep2"])
def test_rows_go_where_megatrons_layout_puts_them(cli, tmp_path, variant):
    """qkv rows per query group [q of its 2 heads; k; v]; fc1 [gate; up] (the layout facts of
    fixtures/generate_megatron.py, which its transformers check proved against megatron's logits)."""
    _, out = convert(cli, tmp_path, variant)
    got = {n: array_of(t) for n, t in parse_safetensors(out / "model.safetensors")[0].items()}
    src = full(variant)
    per_group = HEADS // GROUPS
    for i in range(LAYERS):
        qkv = src[f"decoder.layers.{i}.self_attention.linear_qkv.weight"].reshape(GROUPS, per_group + 2, HEAD, HIDDEN)
        attn = f"model.layers.{i}.self_attn."
        np.testing.assert_array_equal(got[attn + "q_proj.weight"], qkv[:, :per_group].reshape(-1, HIDDEN))
        np.testing.assert_array_equal(got[attn + "k_proj.weight"], qkv[:, per_group].reshape(-1, HIDDEN))
        np.testing.assert_array_equal(got[attn + "v_proj.weight"], qkv[:, per_group + 1].reshape(-1, HIDDEN))
        if variant.startswith("moe"):
            fc1 = src[f"decoder.layers.{i}.mlp.experts.local_experts.3.linear_fc1.weight"]
            gate, up = got[f"model.layers.{i}.block_sparse_moe.experts.3.w1.weight"], \
                got[f"model.layers.{i}.block_sparse_moe.experts.3.w3.weight"]
        else:
            fc1 = src[f"decoder.layers.{i}.mlp.linear_fc1.weight"]
            gate, up = got[f"model.layers.{i}.mlp.gate_proj.weight"], got[f"model.layers.{i}.mlp.up_proj.weight"]
        np.testing.assert_array_equal(np.concatenate([gate, up]), fc1)
        # guards: a plain split of qkv, or gate and up swapped, would not pass
        assert not np.array_equal(got[attn + "q_proj.weight"], src[f"decoder.layers.{i}.self_attention.linear_qkv.weight"][:16])
        assert not np.array_equal(gate, up)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_unfuse_gives_megatrons_file_back_bitwise(cli, tmp_path, variant):
    src, out = convert(cli, tmp_path, variant)
    back, again = tmp_path / "back.safetensors", tmp_path / "again.safetensors"
    ok(cli("unfuse", out, "-o", back))
    assert load_checkpoint_raw(back) == load_checkpoint_raw(src)
    preset, config = VARIANTS[variant]
    ok(cli("unfuse", out, "-r", preset, "--config", CONFIGS / config / "config.json", "-o", again))
    assert load_checkpoint_raw(again) == load_checkpoint_raw(src)


def test_tied_head_is_written_as_an_alias_of_the_embedding(cli, tmp_path):
    """Megatron stores no output_layer when the head shares the embedding; a config that ties
    makes lm_head an alias of model.embed_tokens (save_model's metadata), and back."""
    _, out = convert(cli, tmp_path, "tied-tp2")
    _, meta = parse_safetensors(out / "model.safetensors")
    assert meta["lm_head.weight"] == "model.embed_tokens.weight"
    back = tmp_path / "back.safetensors"
    ok(cli("unfuse", out, "-o", back))
    assert parse_safetensors(back)[1]["output_layer.weight"] == "embedding.word_embeddings.weight"


@pytest.mark.parametrize("variant, preset, config, needles", [
    # Megatron stores no output_layer for a tied head; a config that does not tie leaves none
    ("tied-tp2", "megatron-gpt-to-llama", "llama", ["rule 'head'", "matches nothing", "'output_layer.weight'"]),
    ("moe-tp2", "megatron-gpt-to-llama", "mixtral",
     ["rule 'not-moe'", "'decoder.layers.0.mlp.router.weight'", "megatron-moe-to-mixtral"]),
    ("gpt-tp2", "megatron-moe-to-mixtral", "mixtral", ["rule 'router'", "matches nothing"]),
])
def test_a_preset_or_config_that_does_not_fit_the_model_is_refused(cli, tmp_path, variant, preset, config, needles):
    src = tmp_path / "megatron.safetensors"
    shutil.copy2(REFERENCE / f"{variant}-full.safetensors", src)
    out = tmp_path / "out"
    refused(cli("fuse", src, "-r", preset, "--config", CONFIGS / config / "config.json", "-o", out),
            *needles, unwritten=[out])


@pytest.mark.parametrize("variant, extra", [
    ("moe-tp2", "decoder.layers.1.mlp.shared_experts.linear_fc1.weight"),  # an expert the rules do not cover
    ("moe-tp2", "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.bias"),
    ("gpt-tp2", "decoder.layers.0.input_layernorm.bias"),  # LayerNorm, not Llama's RMSNorm
    ("gpt-tp2", "embedding.position_embeddings.weight"),
])
def test_a_megatron_tensor_the_preset_does_not_cover_is_refused_by_name(cli, tmp_path, variant, extra):
    """Nothing is dropped or passed through under a Megatron name: a leftover stops the plan."""
    tensors = full(variant)
    tensors[extra] = np.zeros((FFN, HIDDEN), np.float32)
    src = write_safetensors(tmp_path / "extra.safetensors", tensors, {"format": "pt"})
    preset, config = VARIANTS[variant]
    out = tmp_path / "out"
    refused(cli("fuse", src, "-r", preset, "--config", CONFIGS / config / "config.json", "-o", out),
            f"'{extra}'", "preset " + preset, unwritten=[out])


def test_grouped_experts_map_like_local_experts(cli, tmp_path):
    """TEGroupedMLP's experts.linear_fc1.weightN / linear_fc2.weightN (not reachable on CPU, so
    renamed from the SequentialMLP fixture) give the same Mixtral file."""
    tensors = full("moe-tp2")
    grouped = {}
    for name, array in tensors.items():
        for fc in ("linear_fc1", "linear_fc2"):
            for e in range(EXPERTS):
                name = name.replace(f"experts.local_experts.{e}.{fc}.weight", f"experts.{fc}.weight{e}")
        grouped[name] = array
    src = write_safetensors(tmp_path / "grouped.safetensors", grouped, {"format": "pt"})
    assert "decoder.layers.1.mlp.experts.linear_fc1.weight3" in grouped
    out = tmp_path / "out"
    ok(cli("fuse", src, "-r", "megatron-moe-to-mixtral", "--config", CONFIGS / "mixtral" / "config.json", "-o", out))
    _, local = convert(cli, tmp_path, "moe-tp2", "local")
    assert load_checkpoint_raw(out) == load_checkpoint_raw(local)


def test_transformer_engine_norm_names_map_to_llamas(cli, tmp_path):
    """Transformer Engine's spec (and torch_dist) keeps the norms as linear_qkv.layer_norm_weight
    and linear_fc1.layer_norm_weight."""
    renamed = {name.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
               .replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"): array
               for name, array in full("gpt-tp2").items()}
    src = write_safetensors(tmp_path / "te.safetensors", renamed, {"format": "pt"})
    out = tmp_path / "out"
    ok(cli("fuse", src, "-r", "megatron-gpt-to-llama", "--config", CONFIGS / "llama" / "config.json", "-o", out))
    _, local = convert(cli, tmp_path, "gpt-tp2", "local")
    assert load_checkpoint_raw(out) == load_checkpoint_raw(local)


def test_a_config_whose_groups_disagree_is_refused(cli, tmp_path):
    config = json.loads((CONFIGS / "llama" / "config.json").read_text())
    config["num_key_value_heads"] = 4  # MHA: the qkv would be [64 rows], it has 32
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    src = tmp_path / "gpt.safetensors"
    shutil.copy2(REFERENCE / "gpt-tp2-full.safetensors", src)
    out = tmp_path / "out"
    refused(cli("fuse", src, "-r", "megatron-gpt-to-llama", "--config", path, "-o", out),
            "rule 'attn-qkv'", "'decoder.layers.0.self_attention.linear_qkv.weight'", unwritten=[out])


# ------------------------------------------------- Hugging Face Llama → Megatron (forward rules)


@pytest.mark.parametrize("variant", ["gpt-tp2", "gpt-tp2-pp2", "tied-tp2"])
def test_llama_without_provenance_goes_back_to_megatron_with_the_forward_preset(cli, tmp_path, variant):
    """A Llama fusectl did not write (here: the converted file with its provenance removed) cannot
    be unfused by rules; llama-to-megatron-gpt writes megatron-core's own full file bitwise."""
    src, out = convert(cli, tmp_path, variant)
    hub = with_provenance(out / "model.safetensors", tmp_path / "hub.safetensors")
    config = CONFIGS / VARIANTS[variant][1] / "config.json"
    guessed, megatron = tmp_path / "guessed.safetensors", tmp_path / "megatron.safetensors"
    refused(cli("unfuse", hub, "-r", "megatron-gpt-to-llama", "--config", config, "-o", guessed),
            "no fusectl provenance", "forward rules", unwritten=[guessed])
    ok(cli("fuse", hub, "-r", "llama-to-megatron-gpt", "--config", config, "-o", megatron))
    assert load_checkpoint_raw(megatron) == load_checkpoint_raw(src)
    if variant.startswith("tied"):
        assert parse_safetensors(megatron)[1]["output_layer.weight"] == "embedding.word_embeddings.weight"


def test_a_llama_tensor_megatron_has_no_place_for_is_refused_by_name(cli, copy_fixture, tmp_path):
    src = copy_fixture("tiny-llama-gqa")
    tensors, meta = parse_safetensors(src / "model.safetensors")
    tensors = {n: array_of(t) for n, t in tensors.items()}
    tensors["model.layers.1.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    write_safetensors(src / "model.safetensors", tensors, meta)
    out = tmp_path / "out"
    refused(cli("fuse", src, "-r", "llama-to-megatron-gpt", "-o", out),
            "rule 'uncovered'", "'model.layers.1.self_attn.rotary_emb.inv_freq'", unwritten=[out])


# ------------------------------------------------- transformers computes megatron's logits


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_transformers_on_the_output_computes_megatrons_logits(cli, tmp_path, variant):
    """The converted folder, loaded by ``from_pretrained`` (every weight used, none missing),
    against megatron-core's own TP=1 forward of the checkpoint (``logits_tp1``)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    _, out = convert(cli, tmp_path, variant)
    shutil.copy2(CONFIGS / VARIANTS[variant][1] / "config.json", out / "config.json")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    model.eval()
    reference = np.load(REFERENCE / f"{variant}.npz")
    with torch.no_grad():
        logits = model(torch.from_numpy(reference["input_ids"])).logits.numpy()
    assert logits.shape == reference["logits_tp1"].shape
    assert np.abs(logits - reference["logits_tp1"]).max() <= 1e-5
    if variant.startswith("tied"):
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_rank_files_fused_in_one_step_compute_megatrons_own_logits(cli, tmp_path, variant):
    """From what megatron-core wrote (every TP/PP/EP rank's ``model_optim_rng.pt``, read by
    fusectl/io/formats/megatron.py) to a Hugging Face folder in one ``fuse``: transformers'
    logits against megatron-core's forward at the parallelism it saved (``logits``)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    preset, config = VARIANTS[variant]
    out = tmp_path / "hf"
    ok(cli("fuse", FIXTURES / "megatron" / f"{variant}-legacy", "-r", preset,
           "--config", CONFIGS / config / "config.json", "-o", out))
    shutil.copy2(CONFIGS / config / "config.json", out / "config.json")
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    reference = np.load(REFERENCE / f"{variant}.npz")
    with torch.no_grad():
        logits = model(torch.from_numpy(reference["input_ids"])).logits.numpy()
    assert np.abs(logits - reference["logits"]).max() <= 1e-5
