"""fixtures/megatron: the Megatron-LM checkpoints megatron-core 0.16.1 made on CPU, checked without torch.

``fixtures/generate_megatron.py`` (its docstring states the layouts) trained a tiny Llama-style
GPT with megatron-core and saved it at TP=2, TP=2 x PP=2, MoE at EP=2 and TP=2, tied at TP=2 and at
TP=2 x PP=2, legacy (``model_optim_rng.pt`` per rank) and torch_dist (gpt-tp2, moe-ep2,
tied-tp2-pp2); megatron-core itself gathered the
full parameters (``reference/NAME-full.safetensors``). Here fusectl's own torch-free readers
check that the committed files are what that docstring says: every rank file there and no
other, the pickles read through the allow-list with Megatron's extra classes as records, each
rank's tensor the piece of the full tensor the layout rule names (bitwise), the optimizer's
moments in the documented id order, the torch_dist index's global shapes and chunks, and the
logits references within the issue's bounds. No conversion code of fusectl is tested here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES
from fusectl.io.formats.dcp import RECORDS as DCP_RECORDS
from fusectl.io.formats.safetensors_file import read_safetensors
from fusectl.io.formats.torch_file import Records, read_pickle, read_torch_tree

MEGATRON = FIXTURES / "megatron"
ITER = "iter_0000010"
# the classes beyond the allow-list that Megatron-LM's model_optim_rng.pt and common.pt pickle
RECORDS = Records((
    "argparse.Namespace",
    "megatron.core.transformer.enums.AttnBackend",
    "numpy._core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.dtype",
))
# what .metadata of torch_dist pickles beyond plain DCP's (its all_local_plans)
PLANS = Records((*DCP_RECORDS.names, *(
    "torch.distributed.checkpoint.planner." + n
    for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"))))
# variant -> the rank folders Megatron-LM names (mp_rank_TT[_PPP][_EEE])
RANKS = {
    "gpt-tp2": ["mp_rank_00", "mp_rank_01"],
    "gpt-tp2-pp2": ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"],
    "moe-ep2": ["mp_rank_00_000", "mp_rank_00_001"],
    "moe-tp2": ["mp_rank_00", "mp_rank_01"],
    "tied-tp2": ["mp_rank_00", "mp_rank_01"],
    "tied-tp2-pp2": ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"],
}
TOP = ["args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler",
       "rng_state", "num_floating_point_operations_so_far"]
LAYERS = 2


def rank_file(name: str, rank: str) -> dict:
    tree, _ = read_torch_tree(str(MEGATRON / f"{name}-legacy" / ITER / rank / "model_optim_rng.pt"),
                              records=RECORDS)
    return tree


def full(name: str) -> dict[str, np.ndarray]:
    contents = read_safetensors(str(MEGATRON / "reference" / f"{name}-full.safetensors"))
    return {k: t.read() for k, t in contents.tensors.items()}


def tensors(tree: dict) -> dict[str, np.ndarray]:
    return {k: v.read() for k, v in tree["model"].items() if v is not None}


def tp_piece(key: str, whole: np.ndarray, rank: int, tp: int) -> np.ndarray:
    """The documented TP rule: which piece of the full tensor TP rank ``rank`` holds."""
    if key.endswith("linear_fc1.weight"):  # [gate_r; up_r] per rank
        gate, up = np.split(whole, 2)
        return np.concatenate([np.split(gate, tp)[rank], np.split(up, tp)[rank]])
    if key.endswith(("linear_proj.weight", "linear_fc2.weight")):  # RowParallel: axis 1
        return np.split(whole, tp, axis=1)[rank]
    if key.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
        return np.split(whole, tp)[rank]  # ColumnParallel / vocab: axis 0 (qkv: one group each)
    return whole  # norms, router: whole on every rank


@pytest.mark.parametrize("name", sorted(RANKS))
def test_legacy_folder_has_every_rank_and_no_other(name):
    folder = MEGATRON / f"{name}-legacy"
    assert (folder / "latest_checkpointed_iteration.txt").read_text() == "10"
    assert sorted(p.name for p in (folder / ITER).iterdir()) == RANKS[name]
    for rank in RANKS[name]:
        assert [p.name for p in (folder / ITER / rank).iterdir()] == ["model_optim_rng.pt"]


@pytest.mark.parametrize("name", sorted(RANKS))
def test_rank_files_read_with_megatrons_classes_as_records(name):
    tree = rank_file(name, RANKS[name][-1])
    assert list(tree) == TOP
    assert tree["checkpoint_version"] == 3.0 and tree["iteration"] == 10
    args = tree["args"]
    assert args.name == "argparse.Namespace"
    assert args.field("num_layers") == LAYERS and args.field("num_query_groups") == 2
    assert args.field("attention_backend").name == "megatron.core.transformer.enums.AttnBackend"
    tp, pp, ep = (args.field(f"{k}_model_parallel_size") for k in ("tensor", "pipeline", "expert"))
    assert len(RANKS[name]) == tp * pp * ep
    assert args.field("untie_embeddings_and_output_weights") is (not name.startswith("tied"))
    np_state = tree["rng_state"][0]["np_rng_state"]
    assert np_state[0] == "MT19937"


def test_megatrons_classes_are_needed():
    """Without the records the allow-list refuses the args pickle (what a reader must allow)."""
    from fusectl.errors import CheckpointError

    with pytest.raises(CheckpointError, match="argparse.Namespace|AttnBackend"):
        read_torch_tree(str(MEGATRON / "gpt-tp2-legacy" / ITER / "mp_rank_00" / "model_optim_rng.pt"))


@pytest.mark.parametrize("name", ["gpt-tp2", "moe-tp2", "tied-tp2"])
def test_tp2_shards_are_the_documented_pieces_of_megatrons_full_tensors(name):
    whole = full(name)
    ranks = [tensors(rank_file(name, r)) for r in RANKS[name]]
    assert set(ranks[0]) == set(ranks[1]) == set(whole)
    assert ("output_layer.weight" in whole) is (name != "tied-tp2")
    for key, value in whole.items():
        for rank, pieces in enumerate(ranks):
            np.testing.assert_array_equal(pieces[key], tp_piece(key, value, rank, 2), err_msg=key)


def test_qkv_interleave_is_per_group():
    """Rank r holds query group r whole: [q of its 2 heads; k; v] (rows 0-7, 8-11, 12-15)."""
    whole = full("gpt-tp2")["decoder.layers.0.self_attention.linear_qkv.weight"]
    groups = whole.reshape(2, 4, 4, 16)  # [group, 2 q heads + k + v, head_dim, hidden]
    shard = tensors(rank_file("gpt-tp2", "mp_rank_01"))["decoder.layers.0.self_attention.linear_qkv.weight"]
    np.testing.assert_array_equal(shard.reshape(4, 4, 16), groups[1])


def test_pp2_stages_number_their_layers_from_zero():
    whole = full("gpt-tp2-pp2")
    for pp in range(2):
        ranks = [tensors(rank_file("gpt-tp2-pp2", f"mp_rank_{tp:02d}_{pp:03d}")) for tp in range(2)]
        for local, pieces in ((k, [r[k] for r in ranks]) for k in ranks[0]):
            assert local.startswith("decoder.layers.0.") or local.startswith(
                ("embedding.",) if pp == 0 else ("decoder.final_layernorm", "output_layer."))
            key = local.replace("decoder.layers.0.", f"decoder.layers.{pp}.")
            for tp, piece in enumerate(pieces):
                np.testing.assert_array_equal(piece, tp_piece(key, whole[key], tp, 2), err_msg=local)


def test_a_tied_pp2_last_stage_holds_a_copy_of_the_embedding_as_its_head():
    whole = full("tied-tp2-pp2")
    assert "output_layer.weight" not in whole  # the TP=1 model's head reads the embedding
    for tp in range(2):
        first = tensors(rank_file("tied-tp2-pp2", f"mp_rank_{tp:02d}_000"))
        last = tensors(rank_file("tied-tp2-pp2", f"mp_rank_{tp:02d}_001"))
        assert "output_layer.weight" not in first and "embedding.word_embeddings.weight" not in last
        piece = tp_piece("embedding.word_embeddings.weight", whole["embedding.word_embeddings.weight"], tp, 2)
        np.testing.assert_array_equal(first["embedding.word_embeddings.weight"], piece)
        np.testing.assert_array_equal(last["output_layer.weight"], piece)


def test_torch_dist_moe_stacks_experts_over_layers_and_experts():
    folder = MEGATRON / "moe-ep2-torch_dist" / ITER
    meta = read_pickle((folder / ".metadata").read_bytes(), str(folder / ".metadata"), PLANS)
    entries = meta.field("state_dict_metadata")
    sizes = {k: tuple(v.field("size")) for k, v in entries.items() if v.field("size") is not None}
    assert sizes["decoder.layers.mlp.router.weight"] == (2, 4, 16)
    assert sizes["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (2, 4, 64, 16)
    assert sizes["decoder.layers.mlp.experts.experts.linear_fc2.weight"] == (2, 4, 16, 32)
    fc1 = sorted(tuple(c.field("offsets")) for c in
                 entries["decoder.layers.mlp.experts.experts.linear_fc1.weight"].field("chunks"))
    assert fc1 == [(layer, e, row, 0) for layer in range(2) for e in range(4) for row in (0, 32)]
    tied = read_pickle((MEGATRON / "tied-tp2-pp2-torch_dist" / ITER / ".metadata").read_bytes(), "tied", PLANS)
    assert "output_layer.weight" not in tied.field("state_dict_metadata")


def test_ep2_ranks_hold_their_experts_numbered_from_zero():
    whole = full("moe-ep2")
    for ep, rank in enumerate(RANKS["moe-ep2"]):
        pieces = tensors(rank_file("moe-ep2", rank))
        for key, piece in pieces.items():
            if ".local_experts." in key:
                head, tail = key.split(".local_experts.")
                local, rest = tail.split(".", 1)
                key = f"{head}.local_experts.{2 * ep + int(local)}.{rest}"
            np.testing.assert_array_equal(piece, whole[key], err_msg=key)
        assert sum(".local_experts." in k for k in pieces) == LAYERS * 2 * 2


@pytest.mark.parametrize("name", sorted(RANKS))
def test_optimizer_moments_follow_the_documented_id_order(name):
    """Ids run through the groups: decayed weights, expert-parallel ones (EP > 1 only), then
    the 1-D ones without weight decay; each group in the model's state-dict order."""
    for rank in RANKS[name]:
        tree = rank_file(name, rank)
        model = {k: v.spec.shape for k, v in tree["model"].items() if v is not None}
        groups = tree["optimizer"]["param_groups"]
        expert_parallel = any(g["is_expert_parallel"] for g in groups)
        is_expert = (lambda k: ".local_experts." in k) if expert_parallel else (lambda k: False)
        order = ([k for k, s in model.items() if len(s) > 1 and not is_expert(k)]
                 + [k for k in model if is_expert(k)]
                 + [k for k, s in model.items() if len(s) == 1])
        assert [g["wd_mult"] for g in groups] == [1.0] * (len(groups) - 1) + [0.0]
        assert [i for g in groups for i in g["params"]] == list(range(len(model)))
        state = tree["optimizer"]["state"]
        for i, key in enumerate(order):
            assert state[i]["exp_avg"].spec.shape == state[i]["exp_avg_sq"].spec.shape == model[key], key


def test_torch_dist_index_holds_stacked_layers_and_tp_invariant_fc1():
    folder = MEGATRON / "gpt-tp2-torch_dist" / ITER
    assert json.loads((folder / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    common, _ = read_torch_tree(str(folder / "common.pt"), records=RECORDS)
    assert sorted(common) == ["args", "checkpoint_version", "iteration", "num_floating_point_operations_so_far"]
    meta = read_pickle((folder / ".metadata").read_bytes(), str(folder / ".metadata"), PLANS)
    entries = meta.field("state_dict_metadata")
    sizes = {k: tuple(v.field("size")) for k, v in entries.items() if v.field("size") is not None}
    assert sizes == {
        "embedding.word_embeddings.weight": (64, 16),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (2, 16),
        "decoder.layers.self_attention.linear_qkv.weight": (2, 32, 16),
        "decoder.layers.self_attention.linear_proj.weight": (2, 16, 16),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (2, 16),
        "decoder.layers.mlp.linear_fc1.weight": (2, 64, 16),
        "decoder.layers.mlp.linear_fc2.weight": (2, 16, 32),
        "decoder.final_layernorm.weight": (16,),
        "output_layer.weight": (64, 16),
    }
    fc1 = sorted(tuple(c.field("offsets")) for c in entries["decoder.layers.mlp.linear_fc1.weight"].field("chunks"))
    assert fc1 == [(layer, row, 0) for layer in range(2) for row in (0, 16, 32, 48)]
    plans = meta.field("all_local_plans")
    assert len(plans) == 2 and all(p.name.endswith("planner.SavePlan") for p in plans)
    assert sorted(p.name for p in folder.iterdir() if p.suffix == ".distcp") == [
        "__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"]


@pytest.mark.parametrize("name", sorted(RANKS))
def test_references_agree_within_the_issues_bounds(name):
    ref = np.load(MEGATRON / "reference" / f"{name}.npz")
    assert ref["input_ids"].shape == (2, 8) and ref["logits"].shape == ref["logits_tp1"].shape == (2, 8, 64)
    diff = np.abs(ref["logits"] - ref["logits_tp1"]).max()
    assert diff == ref["max_abs_diff"] and diff <= 6e-7
    assert ref["hf_max_abs_diff"] <= 1e-5
    assert np.abs(ref["logits"]).max() > 0.1  # a trained model, not zeros


def test_everything_stays_small():
    assert sum(p.stat().st_size for p in MEGATRON.rglob("*") if p.is_file()) < 3_000_000
