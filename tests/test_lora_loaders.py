"""LoRA adapters lifted by fusectl, loaded by the real loaders (transformers + peft).

The fixtures (``fixtures/generate_lora.py``) hold a Llama base with a LoRA on every projection
(one with its own rank and alpha) and a Phi-3 base with a LoRA on its fused ``qkv_proj`` /
``gate_up_proj`` (dense B), with the logits transformers + peft computed for each. Here the
adapter and its base go through the same rules with fusectl and are loaded back by peft onto
the other layout's model class: the logits must stay those of the original within 1e-5.

These tests need torch, transformers and peft; they are skipped where those are not installed
(CI runs without them; ``tests/test_lora.py`` checks the same lift with numpy).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import FIXTURES, ok

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LORA = FIXTURES / "lora"


def _logits(model, input_ids) -> np.ndarray:
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(input_ids), use_cache=False).logits.numpy()


def _recorded(name: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(LORA / name))


def test_a_llama_lora_fused_with_the_base_loads_as_phi3_and_gives_the_same_logits(cli, tmp_path):
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    ok(cli("fuse", LORA / "llama-base", "-r", "llama-qkv", "-r", "llama-gate-up", "-o", base))
    ok(cli("fuse", LORA / "llama-lora", "--config", LORA / "llama-base" / "config.json",
           "-r", "llama-qkv", "-r", "llama-gate-up", "-o", adapter))
    llama = json.loads((LORA / "llama-base" / "config.json").read_text())
    config = transformers.Phi3Config(**{k: llama[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
        "bos_token_id", "eos_token_id", "pad_token_id")}, rope_parameters=llama["rope_parameters"])
    model = transformers.Phi3ForCausalLM(config)
    from safetensors.torch import load_file

    missing, unexpected = model.load_state_dict(load_file(str(base / "model.safetensors")), strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m]
    model = peft.PeftModel.from_pretrained(model, str(adapter))
    recorded = _recorded("llama-lora-logits.safetensors")
    got = _logits(model, recorded["input_ids"])
    np.testing.assert_allclose(got, recorded["logits"], atol=1e-5, rtol=0)
    assert np.abs(recorded["logits"] - recorded["base_logits"]).max() > 0.1  # the LoRA matters


def test_a_phi3_lora_with_dense_b_split_by_phi3_unfuse_loads_onto_the_llama_layout(cli, tmp_path):
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    ok(cli("fuse", LORA / "phi3-base", "-r", "phi3-unfuse", "-o", base))
    ok(cli("fuse", LORA / "phi3-lora", "--config", LORA / "phi3-base" / "config.json",
           "-r", "phi3-unfuse", "-o", adapter))
    config = transformers.LlamaConfig.from_json_file(str(LORA / "phi3-as-llama-config.json"))
    model = transformers.LlamaForCausalLM(config)
    from safetensors.torch import load_file

    missing, unexpected = model.load_state_dict(load_file(str(base / "model.safetensors")), strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m]
    model = peft.PeftModel.from_pretrained(model, str(adapter))
    recorded = _recorded("phi3-lora-logits.safetensors")
    got = _logits(model, recorded["input_ids"])
    np.testing.assert_allclose(got, recorded["logits"], atol=1e-5, rtol=0)
