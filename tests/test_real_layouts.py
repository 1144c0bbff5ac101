"""What a user's folder holds survives: transformers' tied embeddings and a sentence-transformers
folder, both saved by the real libraries (fixtures/generate.py). The loaders themselves run only
where they are installed (never in CI): the tests then load the outputs as a user would."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import load_checkpoint_raw, ok, parse_safetensors, snapshot

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
TIED = FIXTURES / "tiny-llama-tied"
ST = FIXTURES / "tiny-st"


def _without_weights(snap: dict) -> dict:
    return {k: v for k, v in snap.items() if not k.endswith(".safetensors")}


def assert_same_tensors(a, b):
    ta, tb = load_checkpoint_raw(a), load_checkpoint_raw(b)
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name] == tb[name], name


def test_inspect_shows_the_tie_transformers_declares_in_config(cli):
    assert "lm_head.weight" not in parse_safetensors(TIED / "model.safetensors")[0]
    report = ok(cli("inspect", TIED, "--json")).json()
    assert report["ties"] == [["lm_head.weight", "model.embed_tokens.weight"]]
    head = next(p for p in report["parameters"] if p["name"] == "lm_head.weight")
    assert head["unique"] == "model.embed_tokens.weight" and head["shape"] == [128, 32]
    assert report["unique_count"] == 20


@pytest.mark.parametrize("detect", [False, True], ids=["plain", "detect-ties"])
def test_fuse_and_unfuse_of_a_tied_model_store_what_transformers_loads(cli, tmp_path, detect):
    src = tmp_path / "src"
    shutil.copytree(TIED, src)
    before = snapshot(src)
    fused, back = tmp_path / "fused", tmp_path / "back"
    flags = ["--detect-ties"] if detect else []
    ok(cli("fuse", src, "-r", "llama-qkv", "-r", "llama-gate-up", *flags, "-o", fused, "--quiet"))
    ok(cli("unfuse", fused, "-o", back, "--quiet"))
    for out in (fused, back):
        tensors, meta = parse_safetensors(out / "model.safetensors")
        assert "lm_head.weight" not in tensors  # transformers' convention: the tie is not stored twice
        assert meta["lm_head.weight"] == "model.embed_tokens.weight"
        assert _without_weights(snapshot(out)) == _without_weights(before)
    # every tensor of the input, and nothing else, bitwise (no norm lost to a constant "tie")
    assert_same_tensors(src, back)
    assert snapshot(src) == before


def test_a_tied_model_loads_in_transformers_after_fuse_and_unfuse(cli, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    fused, back = tmp_path / "fused", tmp_path / "back"
    ok(cli("fuse", TIED, "-r", "llama-qkv", "-r", "llama-gate-up", "--detect-ties", "-o", fused, "--quiet"))
    ok(cli("unfuse", fused, "-o", back, "--quiet"))
    io = np.load(FIXTURES / "tiny-llama-tied.io.npz")
    model, info = transformers.LlamaForCausalLM.from_pretrained(str(back), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    original = transformers.LlamaForCausalLM.from_pretrained(str(TIED))
    with torch.no_grad():
        logits = model(torch.tensor(io["input_ids"])).logits.numpy()
        expected = original(torch.tensor(io["input_ids"])).logits.numpy()
    # bitwise against the original run here; the recorded logits came from another machine's
    # float32 arithmetic (a last-bit difference there is the CPU's, not the checkpoint's)
    np.testing.assert_array_equal(logits, expected)
    np.testing.assert_allclose(logits, io["logits"], rtol=1e-5, atol=1e-6)


def test_fuse_and_unfuse_of_a_sentence_transformers_folder_keep_every_other_file(cli, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ST, src)
    before = snapshot(src)
    assert "1_Pooling/config.json" in before
    fused, back = tmp_path / "fused", tmp_path / "back"
    ok(cli("fuse", src, "-r", "bert-qkv", "-o", fused, "--quiet"))
    ok(cli("unfuse", fused, "-o", back, "--quiet"))
    for out in (fused, back):
        assert _without_weights(snapshot(out)) == _without_weights(before)
    assert_same_tensors(src, back)
    assert json.loads((back / "modules.json").read_text())[1]["path"] == "1_Pooling"


def test_a_sentence_transformers_folder_embeds_as_before_after_fuse_and_unfuse(cli, tmp_path):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    fused, back = tmp_path / "fused", tmp_path / "back"
    ok(cli("fuse", ST, "-r", "bert-qkv", "-o", fused, "--quiet"))
    ok(cli("unfuse", fused, "-o", back, "--quiet"))
    io = np.load(FIXTURES / "tiny-st.io.npz")
    sentences = [str(s) for s in io["sentences"]]
    embeddings = sentence_transformers.SentenceTransformer(str(back), device="cpu").encode(sentences)
    before = sentence_transformers.SentenceTransformer(str(ST), device="cpu").encode(sentences)
    np.testing.assert_array_equal(embeddings, before)  # bit for bit: both computed here, in this process
    # recorded on another machine, whose CPU may round otherwise
    np.testing.assert_allclose(embeddings, io["embeddings"], rtol=1e-5, atol=1e-6)
