"""MoE presets for transformers 5: the output is bitwise the state_dict transformers 5 builds.

transformers 5 keeps experts fused in memory (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]) while ``save_pretrained`` writes the per-expert names.
fixtures/generate_moe_hf5.py saved a tiny Mixtral and Qwen2-MoE that way and wrote what
``from_pretrained`` loads from them (``*.hf5-memory.safetensors``): the tests compare with that,
not with a formula of ours. The last test re-checks with torch and transformers when present.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import array_of, load_checkpoint_raw, ok, parse_safetensors, refused, write_safetensors

MODELS = {
    # model: (fixture folder under moe-hf5/, disk → memory preset, memory → disk preset)
    "mixtral": ("tiny-mixtral", "mixtral-experts-hf5", "mixtral-experts-hf5-unfuse"),
    "qwen2-moe": ("tiny-qwen2-moe", "qwen2-moe-experts-hf5", "qwen2-moe-experts-hf5-unfuse"),
}
EXPERT_INTER = 8  # moe-hf5's expert width (fixtures/generate_moe_hf5.py)


def _model(name, copy_fixture):
    folder, to_memory, to_disk = MODELS[name]
    src = copy_fixture(f"moe-hf5/{folder}", folder)
    memory = copy_fixture(f"moe-hf5/{folder}.hf5-memory.safetensors", f"{folder}.hf5-memory.safetensors")
    return src, memory, to_memory, to_disk


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fuse_gives_transformers5_in_memory_state_dict(cli, copy_fixture, tmp_path, name):
    src, memory, to_memory, _ = _model(name, copy_fixture)
    out = tmp_path / "out"
    ok(cli("fuse", src, "-r", to_memory, "-o", out))
    got = load_checkpoint_raw(out)
    want = parse_safetensors(memory)[0]
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for tensor in want:
        assert got[tensor] == want[tensor], f"{tensor} differs from transformers 5's"
    # guards: the disk layout is not already the memory one, and gate differs from up, so a
    # swapped concat order could not pass
    assert set(load_checkpoint_raw(src)) != set(want)
    gate_up = array_of(want["model.layers.0.mlp.experts.gate_up_proj"])
    assert not np.array_equal(gate_up[:, :EXPERT_INTER], gate_up[:, EXPERT_INTER:])
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()


def test_qwen2_moe_shared_expert_and_router_keep_their_names(cli, copy_fixture, tmp_path):
    src, _, to_memory, _ = _model("qwen2-moe", copy_fixture)
    out = tmp_path / "out"
    ok(cli("fuse", src, "-r", to_memory, "-o", out))
    got, disk = load_checkpoint_raw(out), load_checkpoint_raw(src)
    kept = [n for n in disk if ".shared_expert" in n or n.endswith(".mlp.gate.weight")]
    assert len(kept) == 2 * 5  # per layer: shared_expert gate/up/down, shared_expert_gate, gate
    assert all(got[n] == disk[n] for n in kept)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_unfuse_of_the_fused_output_is_bitwise_the_original(cli, copy_fixture, tmp_path, name):
    src, _, to_memory, _ = _model(name, copy_fixture)
    out, back = tmp_path / "out", tmp_path / "back"
    ok(cli("fuse", src, "-r", to_memory, "-o", out))
    ok(cli("unfuse", out, "-o", back))
    assert load_checkpoint_raw(back) == load_checkpoint_raw(src)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_verify_passes_on_the_fused_output(cli, copy_fixture, tmp_path, name):
    src, _, to_memory, _ = _model(name, copy_fixture)
    out = tmp_path / "out"
    ok(cli("fuse", src, "-r", to_memory, "-o", out))
    result = ok(cli("verify", src, out))
    assert "result: PASS" in result.stdout and " 0 failed" in result.stdout


@pytest.mark.parametrize("name", sorted(MODELS))
def test_unfuse_preset_turns_the_in_memory_state_dict_into_the_saved_file(cli, copy_fixture, tmp_path, name):
    """A state_dict saved from memory (no provenance) → bitwise what save_pretrained wrote."""
    src, memory, _, to_disk = _model(name, copy_fixture)
    out, back = tmp_path / "disk.safetensors", tmp_path / "memory.safetensors"
    ok(cli("fuse", memory, "-r", to_disk, "-o", out))
    assert load_checkpoint_raw(out) == load_checkpoint_raw(src)
    ok(cli("unfuse", out, "-o", back))
    assert load_checkpoint_raw(back) == parse_safetensors(memory)[0]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_unfuse_preset_inverted_without_provenance_is_refused(cli, copy_fixture, tmp_path, name):
    """Without a provenance, names cannot prove that the on-disk tensors came out of the -unfuse
    preset (a router left alone looks the same), so `unfuse -r` refuses and points to the forward
    preset; `fuse -r <to-memory preset>` is the way (tested above)."""
    src, _, _, to_disk = _model(name, copy_fixture)
    out = tmp_path / "memory.safetensors"
    refused(cli("unfuse", src / "model.safetensors", "-r", to_disk, "-o", out),
            "(inverse)", to_disk, "would be a guess", "no fusectl provenance", unwritten=[out])


# ------------------------------------------------------------------------------ refusals


def test_expert_width_that_disagrees_with_config_is_refused(cli, copy_fixture, tmp_path):
    src, _, to_memory, _ = _model("mixtral", copy_fixture)
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] = 2 * EXPERT_INTER
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    refused(cli("fuse", src, "-r", to_memory, "-o", out),
            "rule 'gate-up'", "mixtral-experts-hf5", "sizes say 16", unwritten=[out])


def test_a_missing_expert_is_refused(cli, copy_fixture, tmp_path):
    src, _, to_memory, _ = _model("mixtral", copy_fixture)
    tensors, meta = parse_safetensors(src / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    write_safetensors(src / "model.safetensors", {n: array_of(t) for n, t in tensors.items()}, meta)
    out = tmp_path / "out"
    refused(cli("fuse", src, "-r", to_memory, "-o", out),
            "rule 'stack-up'", "indices 0..2", "'model.layers.1.block_sparse_moe.experts.*.w3.weight'",
            unwritten=[out])


def test_mixtral_unfuse_preset_refuses_a_qwen2_moe_state_dict(cli, copy_fixture, tmp_path):
    """In memory both look alike but for Qwen2-MoE's shared expert: Mixtral names would be wrong."""
    _, memory, _, _ = _model("qwen2-moe", copy_fixture)
    out = tmp_path / "out.safetensors"
    refused(cli("fuse", memory, "-r", "mixtral-experts-hf5-unfuse", "-o", out),
            "rule 'not-qwen2-moe'", "shared_expert_gate", "qwen2-moe-experts-hf5-unfuse", unwritten=[out])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_presets_applied_the_wrong_way_round_are_refused(cli, copy_fixture, tmp_path, name):
    src, memory, to_memory, to_disk = _model(name, copy_fixture)
    folder = tmp_path / "memory-folder"
    folder.mkdir()
    shutil.copy2(memory, folder / "model.safetensors")
    shutil.copy2(src / "config.json", folder / "config.json")
    out, out2 = tmp_path / "out", tmp_path / "out2"
    refused(cli("fuse", folder, "-r", to_memory, "-o", out), "rule 'stack-gate'", "matches nothing", unwritten=[out])
    refused(cli("fuse", src, "-r", to_disk, "-o", out2), "rule 'split-gate-up'", "matches nothing", unwritten=[out2])


# ------------------------------------------------------------- with torch and transformers


@pytest.mark.parametrize("name", sorted(MODELS))
def test_transformers5_loads_the_fused_output_strictly_and_computes_the_same(cli, copy_fixture, tmp_path, name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("the fused expert layout is transformers 5's")
    src, _, to_memory, _ = _model(name, copy_fixture)
    out = tmp_path / "out"
    ok(cli("fuse", src, "-r", to_memory, "-o", out))
    model_class = {"mixtral": transformers.MixtralForCausalLM, "qwen2-moe": transformers.Qwen2MoeForCausalLM}[name]
    transformers.logging.set_verbosity_error()
    reference = model_class.from_pretrained(src).eval()
    model = model_class(reference.config).eval()
    model.load_state_dict(safetensors_torch.load_file(out / "model.safetensors"), strict=True)
    loaded, info = model_class.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids = torch.tensor([[1, 5, 9, 30, 2, 17, 4], [3, 3, 28, 0, 11, 6, 21]])
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        # tolerance, not equality: CPU kernels may take another path for a tensor mmapped at
        # another alignment (1.5e-8 seen); gate and up swapped moves them by ~1e-3
        for candidate in (model, loaded.eval()):
            torch.testing.assert_close(candidate(input_ids=ids).logits, want, rtol=0, atol=1e-6)
    state, want_state = model.state_dict(), reference.state_dict()
    assert all(torch.equal(state[k], want_state[k]) for k in want_state)
