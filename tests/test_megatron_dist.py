"""Megatron-LM torch_dist checkpoints read without torch (fusectl/io/formats/megatron_dist.py).

fixtures/megatron/gpt-tp2-torch_dist is the TP=2 model megatron-core 0.16.1 saved with
``dist_checkpointing.save`` (fixtures/generate_megatron.py); reference/gpt-tp2-full.safetensors
holds what megatron-core's own ``dist_checkpointing.load`` put into a TP=1 model of it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import FIXTURES, ok, refused, run_cli, snapshot
from test_megatron import edit, reference
from fusectl.errors import CheckpointError
from fusectl.io.formats.megatron_dist import read_megatron_dist
from fusectl.io.formats.safetensors_file import read_safetensors
from fusectl.io.registry import folder_format
from fusectl.io.sniff import is_megatron_dist

MEGATRON = FIXTURES / "megatron"
SAVE = MEGATRON / "gpt-tp2-torch_dist"
ITER = SAVE / "iter_0000010"
LLAMA = MEGATRON / "hf-config" / "llama" / "config.json"


def test_convert_gives_megatrons_own_tp1_tensors_bitwise(tmp_path):
    out = tmp_path / "out"
    ok(run_cli("convert", SAVE, "-o", f"{out}/"))
    written = read_safetensors(str(out / "model.safetensors")).tensors
    expected = reference("gpt-tp2")
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


def test_fuse_to_llama_gives_what_the_reference_gives(tmp_path):
    src = tmp_path / "gpt-tp2-full.safetensors"
    shutil.copy2(MEGATRON / "reference" / src.name, src)
    ok(run_cli("fuse", SAVE, "-r", "megatron-gpt-to-llama", "--config", LLAMA, "-o", tmp_path / "dist"))
    ok(run_cli("fuse", src, "-r", "megatron-gpt-to-llama", "--config", LLAMA, "-o", tmp_path / "ref"))
    dist = read_safetensors(str(tmp_path / "dist" / "model.safetensors")).tensors
    ref = read_safetensors(str(tmp_path / "ref" / "model.safetensors")).tensors
    assert sorted(dist) == sorted(ref) and "model.layers.1.self_attn.k_proj.weight" in dist
    for name, tensor in ref.items():
        assert dist[name].read().tobytes() == tensor.read().tobytes(), name


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
