"""Megatron-LM torch_dist checkpoints read without torch (fusectl/io/formats/megatron_dist.py).

fixtures/megatron/gpt-tp2-torch_dist is the TP=2 model megatron-core 0.16.1 saved with
``dist_checkpointing.save`` (fixtures/generate_megatron.py); reference/gpt-tp2-full.safetensors
holds what megatron-core's own ``dist_checkpointing.load`` put into a TP=1 model of it. Likewise
moe-ep2-torch_dist (MoE, EP=2: experts stacked over layers and experts) and tied-tp2-pp2-torch_dist
(tied at TP=2 x PP=2: the last stage's head copy saved as a replica of the embedding).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES, ok, refused, run_cli, snapshot
from test_megatron import edit, reference
from fusectl.errors import CheckpointError
from fusectl.io.formats.megatron import read_megatron
from fusectl.io.formats.megatron_dist import read_megatron_dist
from fusectl.io.formats.safetensors_file import read_safetensors
from fusectl.io.registry import folder_format
from fusectl.io.sniff import is_megatron_dist

MEGATRON = FIXTURES / "megatron"
SAVE = MEGATRON / "gpt-tp2-torch_dist"
ITER = SAVE / "iter_0000010"
LLAMA = MEGATRON / "hf-config" / "llama" / "config.json"
MOE = MEGATRON / "moe-ep2-torch_dist"
TIED_PP2 = MEGATRON / "tied-tp2-pp2-torch_dist"
# torch_dist folder → (its reference, preset, hf-config)
SAVES = {SAVE: ("gpt-tp2", "megatron-gpt-to-llama", "llama"), MOE: ("moe-ep2", "megatron-moe-to-mixtral", "mixtral"),
         TIED_PP2: ("tied-tp2-pp2", "megatron-gpt-to-llama", "tied")}


@pytest.mark.parametrize("save", SAVES, ids=lambda p: p.name)
def test_convert_gives_megatrons_own_tp1_tensors_bitwise(tmp_path, save):
    out = tmp_path / "out"
    ok(run_cli("convert", save, "-o", f"{out}/"))
    written = read_safetensors(str(out / "model.safetensors")).tensors
    expected = reference(SAVES[save][0])
    assert sorted(written) == sorted(expected)
    for key, data in expected.items():
        assert written[key].read().tobytes() == data, key


def test_the_iteration_folder_reads_as_its_save_folder_in_module_order():
    top, inner = read_megatron_dist(str(SAVE)), read_megatron_dist(str(ITER))
    assert list(top.tensors) == list(inner.tensors)
    assert top.files[0].endswith("latest_checkpointed_iteration.txt") and inner.files == top.files[1:]
    layer = [n.split(".", 3)[3] for n in top.tensors if n.startswith("decoder.layers.0.")]
    assert layer == ["input_layernorm.weight", "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight",
                     "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    names = list(top.tensors)
    assert names[0] == "embedding.word_embeddings.weight" and names[-1] == "output_layer.weight"
    assert names.index("decoder.layers.1.input_layernorm.weight") > names.index("decoder.layers.0.mlp.linear_fc2.weight")


def test_byte_items_are_listed_not_opened():
    contents = read_megatron_dist(str(SAVE))
    assert len(contents.ignored) == 10
    assert sum("_extra_state/shard_" in n for n in contents.ignored) == 8
    assert sorted(n for n in contents.ignored if n.startswith("rng_state/")) == ["rng_state/shard_0.0_1.2",
                                                                                 "rng_state/shard_0.1_1.2"]
    assert not any(n.endswith("_extra_state") or "rng" in n for n in contents.tensors)


def test_a_layer_is_file_ranges_of_the_stacked_tensor_or_blocks_of_them():
    contents = read_megatron_dist(str(SAVE))
    stacked_fc1 = 2 * 64 * 16 * 4
    fc1 = contents.tensors["decoder.layers.1.mlp.linear_fc1.weight"].byte_ranges()
    # [gate_all; up_all]: each rank wrote its gate rows and its up rows of each layer as chunks
    assert [r.length for r in fc1] == [16 * 16 * 4] * 4 and sum(r.length for r in fc1) < stacked_fc1
    qkv = contents.tensors["decoder.layers.0.self_attention.linear_qkv.weight"].byte_ranges()
    assert sum(r.length for r in qkv) == 32 * 16 * 4
    assert contents.tensors["decoder.layers.0.self_attention.linear_proj.weight"].byte_ranges() is None  # axis 2 cut
    norm = contents.tensors["decoder.layers.1.pre_mlp_layernorm.weight"].byte_ranges()
    assert sum(r.length for r in norm) == 16 * 4


def test_inspect_json_says_the_format_and_the_parallelism():
    report = json.loads(ok(run_cli("inspect", "--json", SAVE)).stdout)
    assert report["format"] == "megatron-torch_dist"
    assert report["distributed"] == {"tp": 2, "pp": 1, "ep": 1, "num_layers": 2, "iteration": 10, "world_size": 2}
    assert len(report["ignored"]) == 10
    assert {p["name"]: p["shape"] for p in report["parameters"]}["decoder.layers.1.mlp.linear_fc1.weight"] == [64, 16]


@pytest.mark.parametrize("save", SAVES, ids=lambda p: p.name)
def test_fuse_with_its_preset_gives_what_the_reference_gives(tmp_path, save):
    name, preset, config = SAVES[save]
    config = MEGATRON / "hf-config" / config / "config.json"
    src = tmp_path / f"{name}-full.safetensors"
    shutil.copy2(MEGATRON / "reference" / src.name, src)
    ok(run_cli("fuse", save, "-r", preset, "--config", config, "-o", tmp_path / "dist"))
    ok(run_cli("fuse", src, "-r", preset, "--config", config, "-o", tmp_path / "ref"))
    dist = read_safetensors(str(tmp_path / "dist" / "model.safetensors")).tensors
    ref = read_safetensors(str(tmp_path / "ref" / "model.safetensors")).tensors
    assert sorted(dist) == sorted(ref) and "model.layers.1.self_attn.k_proj.weight" in dist
    assert ("lm_head.weight" in dist) is (save != TIED_PP2)
    for name, tensor in ref.items():
        assert dist[name].read().tobytes() == tensor.read().tobytes(), name


@pytest.mark.parametrize("save", [MOE, TIED_PP2], ids=lambda p: p.name)
def test_fused_with_its_preset_transformers_computes_megatrons_logits(tmp_path, save):
    """From megatron-core's torch_dist files to a Hugging Face folder in one ``fuse``:
    transformers' logits against megatron-core's own forward at the parallelism it saved."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    name, preset, config = SAVES[save]
    config = MEGATRON / "hf-config" / config / "config.json"
    out = tmp_path / "hf"
    ok(run_cli("fuse", save, "-r", preset, "--config", config, "-o", out))
    shutil.copy2(config, out / "config.json")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    reference = np.load(MEGATRON / "reference" / f"{name}.npz")
    with torch.no_grad():
        logits = model.eval()(torch.from_numpy(reference["input_ids"])).logits.numpy()
    assert np.abs(logits - reference["logits"]).max() <= 1e-5


def test_moe_experts_unstack_into_megatrons_local_experts_in_module_order():
    contents = read_megatron_dist(str(MOE))
    assert list(contents.tensors) == list(read_megatron(str(MEGATRON / "moe-ep2-legacy")).tensors)
    layer = [n.split(".", 3)[3] for n in contents.tensors if n.startswith("decoder.layers.1.")]
    assert layer[:5] == ["input_layernorm.weight", "self_attention.linear_proj.weight",
                         "self_attention.linear_qkv.weight", "pre_mlp_layernorm.weight", "mlp.router.weight"]
    assert layer[5:] == [f"mlp.experts.local_experts.{e}.linear_fc{i}.weight" for e in range(4) for i in (1, 2)]
    assert not any(".experts.experts." in n for n in contents.tensors)
    # an expert of a layer is file ranges: fc1 its gate chunk and its up chunk, fc2 one chunk
    fc1 = contents.tensors["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"].byte_ranges()
    assert [r.length for r in fc1] == [32 * 16 * 4] * 2
    fc2 = contents.tensors["decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight"].byte_ranges()
    assert [r.length for r in fc2] == [16 * 32 * 4]
    assert sum("experts.experts.linear_fc" in n and "_extra_state" in n for n in contents.ignored) == 16


def test_moe_inspect_json_says_ep2():
    report = json.loads(ok(run_cli("inspect", "--json", MOE)).stdout)
    assert report["format"] == "megatron-torch_dist"
    assert report["distributed"] == {"tp": 1, "pp": 1, "ep": 2, "num_layers": 2, "iteration": 10, "world_size": 2}
    shapes = {p["name"]: p["shape"] for p in report["parameters"]}
    assert shapes["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"] == [64, 16]
    assert shapes["decoder.layers.0.mlp.router.weight"] == [4, 16]


def test_a_tied_save_at_pp2_holds_one_embedding():
    contents = read_megatron_dist(str(TIED_PP2))
    assert "output_layer.weight" not in contents.tensors
    assert list(contents.tensors) == list(read_megatron(str(MEGATRON / "tied-tp2-pp2-legacy")).tensors)
    assert contents.distributed["pp"] == 2 and contents.distributed["world_size"] == 4


def test_the_folders_are_recognised_before_dcp_and_legacy():
    assert folder_format(str(SAVE)).name == "megatron-torch_dist"
    assert folder_format(str(ITER)).name == "megatron-torch_dist"
    assert folder_format(str(MEGATRON / "gpt-tp2-legacy")).name == "megatron-legacy"
    assert folder_format(str(FIXTURES / "distributed" / "dcp")).name == "dcp"


# ------------------------------------------------------------------------------- hostile folders


@pytest.fixture
def spoilt(tmp_path):
    """A copy of the torch_dist save folder to spoil; ``refused(*needles)`` checks convert."""

    class Spoilt:
        folder = tmp_path / "in" / "gpt-tp2-torch_dist"
        inner = folder / "iter_0000010"

        def refused(self, *needles: str) -> str:
            before = snapshot(tmp_path / "in")
            target = tmp_path / "out"
            result = run_cli("convert", self.folder, "-o", f"{target}/")
            refused(result, *needles, unwritten=[target])
            assert snapshot(tmp_path / "in") == before
            return result.stderr

    shutil.copytree(SAVE, Spoilt.folder)
    return Spoilt()


def test_common_pt_naming_a_class_outside_the_allow_list_runs_nothing(spoilt, tmp_path):
    common = spoilt.inner / "common.pt"
    edit(common, rb"cargparse\nNamespace\n", b"cposix\nsystem\n")
    stderr = spoilt.refused(str(common), "posix")
    assert "system" in stderr and not (tmp_path / "ran").exists()


def test_a_stacked_tensor_whose_layers_disagree_with_num_layers_is_refused(spoilt):
    edit(spoilt.inner / "common.pt", rb"(num_layersq.)K\x02", b"K\x03")
    spoilt.refused(str(spoilt.inner / ".metadata"), "common.pt", "3 layers", "stacked tensor")


@pytest.mark.parametrize("backend", ["zarr", None])
def test_metadata_json_naming_another_backend_is_refused(spoilt, backend):
    (spoilt.inner / "metadata.json").write_text(json.dumps({"sharded_backend": backend}))
    spoilt.refused(str(spoilt.inner / "metadata.json"), "zarr" if backend else "no backend", "torch_dist")


def test_stacked_moe_experts_are_refused_by_name(spoilt):
    metadata = spoilt.inner / ".metadata"
    metadata.write_bytes(metadata.read_bytes().replace(b"mlp.linear_fc2", b"mlp.experts.f2"))
    spoilt.refused("decoder.layers.mlp.experts.f2.weight", "MoE experts")


@pytest.fixture
def spoilt_moe(tmp_path):
    """A copy of the MoE torch_dist save to spoil."""
    folder = tmp_path / "in" / MOE.name
    shutil.copytree(MOE, folder)
    return folder


def refused_moe(tmp_path, folder: Path, *needles: str) -> str:
    before = snapshot(tmp_path / "in")
    target = tmp_path / "out"
    result = run_cli("convert", folder, "-o", f"{target}/")
    refused(result, *needles, unwritten=[target])
    assert snapshot(tmp_path / "in") == before
    return result.stderr


def test_an_expert_chunk_missing_is_refused_naming_the_key(spoilt_moe, tmp_path):
    metadata = spoilt_moe / "iter_0000010" / ".metadata"
    raw = metadata.read_bytes()  # layer 1's expert 3: its gate chunk said to be expert 2's (3 is left a hole)
    metadata.write_bytes(raw.replace(b"(K\x01K\x03K\x00K\x00t", b"(K\x01K\x02K\x00K\x00t", 1))
    refused_moe(tmp_path, spoilt_moe, "decoder.layers.mlp.experts.experts.linear_fc1.weight")


def test_stacked_experts_that_disagree_with_num_experts_are_refused(spoilt_moe, tmp_path):
    edit(spoilt_moe / "iter_0000010" / "common.pt", rb"(num_expertsq.)K\x04", b"K\x02")
    refused_moe(tmp_path, spoilt_moe, "decoder.layers.mlp.experts.experts.linear_fc1.weight", "2 experts",
                "args.num_experts")


def test_experts_stacked_under_an_unknown_name_are_refused_naming_it(spoilt_moe, tmp_path):
    metadata = spoilt_moe / "iter_0000010" / ".metadata"
    metadata.write_bytes(metadata.read_bytes().replace(b"experts.experts.linear_fc2", b"experts.expertz.linear_fc2"))
    refused_moe(tmp_path, spoilt_moe, "decoder.layers.mlp.experts.expertz.linear_fc2.weight", "MoE experts",
                "legacy format")


def test_stacked_experts_without_num_experts_in_args_are_refused(spoilt_moe, tmp_path):
    edit(spoilt_moe / "iter_0000010" / "common.pt", rb"(num_expertsq.)K\x04", b"N")
    refused_moe(tmp_path, spoilt_moe, "decoder.layers.mlp.experts.experts.linear_fc1.weight", "no experts")


@pytest.mark.parametrize("missing", ["metadata.json", "common.pt"])
def test_a_missing_file_of_the_iteration_folder_is_refused(spoilt, missing):
    (spoilt.inner / missing).unlink()
    with pytest.raises(CheckpointError, match=f"{missing}: missing"):
        read_megatron_dist(str(spoilt.folder))


def test_common_pt_without_args_is_refused(spoilt):
    edit(spoilt.inner / "common.pt", rb"X\x04\x00\x00\x00args", b"X\x04\x00\x00\x00argz")
    with pytest.raises(CheckpointError, match="common.pt.*args"):
        read_megatron_dist(str(spoilt.folder))


def test_a_missing_rank_file_is_refused_naming_it(spoilt):
    (spoilt.inner / "__1_0.distcp").unlink()
    spoilt.refused("__1_0.distcp", "missing")


def test_a_folder_that_cannot_be_listed_is_not_torch_dist(monkeypatch):
    def unlistable(path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(os, "listdir", unlistable)
    assert not is_megatron_dist(str(SAVE))
    monkeypatch.undo()
    assert is_megatron_dist(str(SAVE)) and is_megatron_dist(str(ITER)) and not is_megatron_dist(str(SAVE / "nothing"))
