"""The training checkpoints of fixtures/training/ and their reference losses (issue 20).

``fixtures/generate_training.py`` wrote them with torch: a tiny Llama trained a few steps, saved
as a plain training dict (AdamW and SGD, two param groups), as a Lightning ``.ckpt`` and as a
Trainer ``checkpoint-2/`` folder, with the losses of resuming each (``fixtures/reference/``).
These tests need no torch: the files are there and well formed (fusectl's reader opens the model
state of each; the optimizer state is in the pickle), and the references say what the tests of
the optimizer-state conversion compare with. One test, skipped without torch and transformers,
resumes the committed files and finds the recorded losses.
"""

from __future__ import annotations

import json
import math
import pickletools
import zipfile

import pytest

import fusectl
from conftest import FIXTURES

TRAINING = FIXTURES / "training"
REFERENCE = FIXTURES / "reference"
TRAINER = TRAINING / "trainer" / "checkpoint-2"
K = 5
# the tiny Llama of resume_training.py: hidden 16, 4 heads / 2 kv heads of 4, intermediate 32
SHAPES = {"self_attn.q_proj.weight": (16, 16), "self_attn.k_proj.weight": (8, 16),
          "self_attn.v_proj.weight": (8, 16), "mlp.gate_proj.weight": (32, 16),
          "mlp.up_proj.weight": (32, 16)}
TRAINER_FILES = ["config.json", "generation_config.json", "model.safetensors", "optimizer.pt",
                 "rng_state.pth", "scheduler.pt", "trainer_state.json", "training_args.bin"]


def _reference(name: str) -> dict:
    return json.loads((REFERENCE / name).read_text())


def _pickle_strings(path) -> set[str]:
    """Every string the zip's data.pkl pushes (keys and class names), read with pickletools only."""
    with zipfile.ZipFile(path) as archive:
        [pkl] = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        data = archive.read(pkl)
    return {arg for _, arg, _ in pickletools.genops(data) if isinstance(arg, str)}


def _assert_tiny_llama(checkpoint, prefix: str = "") -> None:
    table = checkpoint.table
    specs = {name: tuple(table.spec(name).shape) for name in table.names()}
    assert len(specs) == 21
    for layer in (0, 1):
        for suffix, shape in SHAPES.items():
            assert specs[f"{prefix}model.layers.{layer}.{suffix}"] == shape
    assert specs[f"{prefix}lm_head.weight"] == (64, 16)


@pytest.mark.parametrize("name", ["llama-adamw.pt", "llama-sgd.pt"])
def test_a_training_dict_opens_at_its_model_state_with_the_tiny_llamas_names(name):
    checkpoint = fusectl.open_checkpoint(str(TRAINING / name), key="model_state_dict")
    assert checkpoint.format == "pytorch" and checkpoint.state_dict_key == "model_state_dict"
    _assert_tiny_llama(checkpoint)
    strings = _pickle_strings(TRAINING / name)
    assert {"model_state_dict", "optimizer_state_dict", "epoch", "step", "state", "param_groups"} <= strings
    moments = {"exp_avg", "exp_avg_sq"} if "adamw" in name else {"momentum_buffer"}
    others = {"exp_avg", "exp_avg_sq", "momentum_buffer"} - moments
    assert moments <= strings and not others & strings


def test_the_lightning_checkpoint_holds_the_model_under_its_attribute_name():
    checkpoint = fusectl.open_checkpoint(str(TRAINING / "lightning.ckpt"), key="state_dict")
    _assert_tiny_llama(checkpoint, prefix="model.")
    strings = _pickle_strings(TRAINING / "lightning.ckpt")
    assert {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks", "global_step",
            "pytorch-lightning_version", "exp_avg", "exp_avg_sq"} <= strings


def test_the_trainer_folder_has_every_file_the_trainer_writes():
    assert sorted(p.name for p in TRAINER.iterdir()) == TRAINER_FILES
    _assert_tiny_llama(fusectl.open_checkpoint(str(TRAINER)))
    assert {"exp_avg", "exp_avg_sq", "param_groups"} <= _pickle_strings(TRAINER / "optimizer.pt")
    assert json.loads((TRAINER / "trainer_state.json").read_text())["global_step"] == 2
    assert json.loads((TRAINER / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_the_training_fixtures_stay_small():
    total = sum(p.stat().st_size for p in TRAINING.rglob("*") if p.is_file())
    assert total < 600_000


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_the_reference_has_k_losses_per_run_and_the_moments_matter(kind):
    ref = _reference(f"training-{kind}.json")
    assert ref["k"] == K and ref["optimizer"] == kind and (FIXTURES / ref["file"]).is_file()
    runs = ref["losses"]
    assert sorted(runs) == ["fresh_optimizer", "fused_by_hand", "resumed", "uninterrupted"]
    for losses in runs.values():
        assert len(losses) == K and all(math.isfinite(x) and x > 0 for x in losses)
    assert runs["resumed"] == runs["uninterrupted"]
    assert max(abs(a - b) for a, b in zip(runs["fused_by_hand"], runs["resumed"])) <= 1e-6
    # the first loss is the saved weights' alone; from the second on the moments move it
    assert runs["fresh_optimizer"][0] == runs["resumed"][0]
    assert max(abs(a - b) for a, b in zip(runs["fresh_optimizer"], runs["resumed"])) > 1e-3


def test_the_references_param_order_is_the_checkpoints_and_phi3s():
    ref = _reference("training-adamw.json")
    llama, phi3 = ref["param_groups"]["llama"], ref["param_groups"]["phi3"]
    table = fusectl.open_checkpoint(str(TRAINING / "llama-adamw.pt"), key="model_state_dict").table
    assert sorted(n for group in llama for n in group) == sorted(table.names())
    assert all("norm" in n for n in llama[1]) and not any("norm" in n for n in llama[0])
    # Phi3ForCausalLM declares o_proj before qkv_proj: the fused ids are not where q's were
    assert phi3[0][1:5] == ["model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.qkv_proj.weight",
                            "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight"]
    assert phi3[1] == llama[1] and (phi3[0][0], phi3[0][-1]) == (llama[0][0], llama[0][-1])


def test_the_trainer_reference_resumes_where_checkpoint_2_stopped():
    ref = _reference("trainer-losses.json")
    assert ref["files"] == TRAINER_FILES and ref["resumed_steps"] == [3, 4, 5]
    losses = ref["losses"]
    assert len(losses["uninterrupted"]) == 5 and losses["resumed"] == losses["uninterrupted"][2:]
    assert max(abs(a - b) for a, b in zip(losses["fused_by_hand"], losses["resumed"])) <= 1e-5


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_resuming_the_committed_file_gives_the_recorded_losses(kind):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import importlib.util

    spec = importlib.util.spec_from_file_location("resume_training", FIXTURES / "resume_training.py")
    resume_training = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(resume_training)
    ref = _reference(f"training-{kind}.json")
    got = resume_training.resume(FIXTURES / ref["file"], FIXTURES / ref["config"])
    assert got["arch"] == "llama" and got["optimizer"] == kind
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]["resumed"])) <= 1e-5
