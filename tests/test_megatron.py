"""io/formats/megatron: Megatron-LM legacy checkpoints read as one TP=1 PP=1 EP=1 checkpoint, without torch.

Against megatron-core's own result: ``fixtures/generate_megatron.py`` trained tiny GPTs with
megatron-core 0.16.1 and saved them at TP=2, TP=2 x PP=2, tied at TP=2 and at TP=2 x PP=2 (whose
last stage keeps a copy of the embedding as its head: checked equal, read as the one tensor the
TP=1 model has), MoE at EP=2 and at TP=2; it also
had megatron-core gather the full parameters into a TP=1 model (``reference/NAME-full.safetensors``).
``convert`` of each folder gives those tensors bitwise, names included; the joined optimizer
moments give back each rank's own moments under the documented split rule (the rule written
here from the generator's docstring, not fusectl's join). Hostile folders (a missing rank file,
ranks disagreeing on shapes or names, an ``args`` pickle naming a class outside the allow-list,
a truncated file, a latest file naming a missing iteration, ...) are refused: exit 2, one
``error:`` line naming the file, nothing written.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES, ok, refused, run_cli, snapshot
from test_megatron_fixtures import RANKS
from fusectl.errors import CheckpointError
from fusectl.io.formats.megatron import RECORDS, parallel_kind, read_megatron
from fusectl.io.formats.safetensors_file import read_safetensors
from fusectl.io.formats.torch_file import read_torch, read_torch_tree
from fusectl.io.registry import folder_format

MEGATRON = FIXTURES / "megatron"
ITER = "iter_0000010"
NAMES = ["gpt-tp2", "gpt-tp2-pp2", "tied-tp2", "tied-tp2-pp2", "moe-ep2", "moe-tp2"]


def reference(name: str) -> dict[str, bytes]:
    contents = read_safetensors(str(MEGATRON / "reference" / f"{name}-full.safetensors"))
    return {k: t.read().tobytes() for k, t in contents.tensors.items()}


@pytest.mark.parametrize("name", NAMES)
def test_convert_gives_megatrons_own_full_tensors_bitwise(tmp_path, name):
    out = tmp_path / "out"
    ok(run_cli("convert", MEGATRON / f"{name}-legacy", "-o", f"{out}/"))
    written = read_safetensors(str(out / "model.safetensors")).tensors
    expected = reference(name)
    assert sorted(written) == sorted(expected)
    for key, data in expected.items():
        assert written[key].read().tobytes() == data, key


@pytest.mark.parametrize("name", NAMES)
def test_the_iteration_folder_reads_as_its_save_folder_in_megatrons_module_order(name):
    top = read_megatron(str(MEGATRON / f"{name}-legacy"))
    inner = read_megatron(str(MEGATRON / f"{name}-legacy" / ITER))
    assert list(top.tensors) == list(inner.tensors) == list(top.order)
    assert top.files[0].endswith("latest_checkpointed_iteration.txt") and inner.files == top.files[1:]
    order = list(top.tensors)
    assert order[0] == "embedding.word_embeddings.weight"
    assert order[-1] == ("decoder.final_layernorm.weight" if name.startswith("tied") else "output_layer.weight")
    layers = [int(n.split(".")[2]) for n in order if n.startswith("decoder.layers.")]
    assert layers == sorted(layers)
    experts = [int(m.group(1)) for m in map(re.compile(r"decoder\.layers\.0\.mlp\.experts\.local_experts\.([0-9]+)"
                                                         r"\.linear_fc1\.weight").fullmatch, order) if m]
    assert experts == ([0, 1, 2, 3] if name.startswith("moe") else [])
    assert all(n.endswith("_extra_state") for n in top.ignored) and len(top.ignored) >= 9


def test_axis0_joins_are_file_ranges_and_fc1_takes_each_ranks_halves():
    contents = read_megatron(str(MEGATRON / "gpt-tp2-legacy"))
    fc1 = contents.tensors["decoder.layers.0.mlp.linear_fc1.weight"].byte_ranges()
    files = [r.path.split(os.sep)[-2] for r in fc1]
    assert files == ["mp_rank_00", "mp_rank_01", "mp_rank_00", "mp_rank_01"]  # gate_0, gate_1, up_0, up_1
    assert all(r.length == 16 * 16 * 4 for r in fc1)
    assert len(contents.tensors["embedding.word_embeddings.weight"].byte_ranges()) == 2
    assert contents.tensors["decoder.layers.0.mlp.linear_fc2.weight"].byte_ranges() is None  # axis 1: blocks


def split_rule(key: str, whole: np.ndarray, rank: int, tp: int) -> np.ndarray:
    """The documented TP rule (fixtures/generate_megatron.py): TP rank ``rank``'s piece."""
    if key.endswith("linear_fc1.weight"):
        gate, up = np.split(whole, 2)
        return np.concatenate([np.split(gate, tp)[rank], np.split(up, tp)[rank]])
    if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return np.split(whole, tp, axis=1)[rank]
    if key.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
        return np.split(whole, tp)[rank]
    return whole


@pytest.mark.parametrize("name", ["gpt-tp2", "moe-tp2", "tied-tp2"])
def test_the_joined_moments_split_back_into_each_ranks_own(name):
    contents = read_megatron(str(MEGATRON / f"{name}-legacy"))
    optimizer = contents.training.tree()["optimizer"]
    ids = {n: i for g in optimizer["param_groups"] for i, n in zip(g["params"], g["param_names"])}
    assert sorted(ids) == sorted(contents.tensors) and sorted(ids.values()) == list(range(len(ids)))
    for rank, folder in enumerate(RANKS[name]):
        tree, _ = read_torch_tree(str(MEGATRON / f"{name}-legacy" / ITER / folder / "model_optim_rng.pt"),
                                  records=RECORDS)
        model = [k for k, v in tree["model"].items() if v is not None]
        decayed = [k for k in model if len(tree["model"][k].spec.shape) > 1]
        local = decayed + [k for k in model if k not in decayed]  # megatron's id order
        for i, key in enumerate(local):
            mine = tree["optimizer"]["state"][i]
            joined = optimizer["state"][ids[key]]
            for moment in ("exp_avg", "exp_avg_sq"):
                np.testing.assert_array_equal(split_rule(key, joined[moment].read(), rank, 2), mine[moment].read(),
                                              err_msg=f"{key} {moment}")
            assert float(joined["step"].read()) == 3.0
    groups = optimizer["param_groups"]
    assert [g["wd_mult"] for g in groups] == [1.0, 0.0]
    assert all(len(contents.tensors[n].spec.shape) == 1 for n in groups[1]["param_names"])


def test_ep2_keeps_the_expert_parallel_group_with_every_expert():
    optimizer = read_megatron(str(MEGATRON / "moe-ep2-legacy")).training.tree()["optimizer"]
    groups = optimizer["param_groups"]
    assert [g["is_expert_parallel"] for g in groups] == [False, True, False]
    assert len(groups[1]["param_names"]) == 2 * 4 * 2  # layers x experts x (fc1, fc2)
    assert all(".local_experts." in n for n in groups[1]["param_names"])


def test_pp2_moments_of_the_second_stage_follow_their_renumbered_layer():
    optimizer = read_megatron(str(MEGATRON / "gpt-tp2-pp2-legacy")).training.tree()["optimizer"]
    ids = {n: i for g in optimizer["param_groups"] for i, n in zip(g["params"], g["param_names"])}
    tree, _ = read_torch_tree(str(MEGATRON / "gpt-tp2-pp2-legacy" / ITER / "mp_rank_01_001" / "model_optim_rng.pt"),
                              records=RECORDS)
    key = "decoder.layers.0.self_attention.linear_proj.weight"  # stage 1's first decayed weight: id 0
    joined = optimizer["state"][ids["decoder.layers.1.self_attention.linear_proj.weight"]]["exp_avg"].read()
    np.testing.assert_array_equal(split_rule(key, joined, 1, 2), tree["optimizer"]["state"][0]["exp_avg"].read())


def test_inspect_json_says_the_format_the_parallelism_and_each_kind():
    report = json.loads(ok(run_cli("inspect", "--json", MEGATRON / "gpt-tp2-pp2-legacy")).stdout)
    assert report["format"] == "megatron-legacy"
    dist = report["distributed"]
    assert {k: dist[k] for k in ("tp", "pp", "ep", "world_size", "num_layers", "iteration")} == \
        {"tp": 2, "pp": 2, "ep": 1, "world_size": 4, "num_layers": 2, "iteration": 10}
    kinds = dist["parallel"]
    assert kinds["decoder.layers.1.mlp.linear_fc1.weight"] == "column-swiglu"
    assert kinds["decoder.layers.1.self_attention.linear_proj.weight"] == "row"
    assert kinds["output_layer.weight"] == kinds["embedding.word_embeddings.weight"] == "column"
    assert kinds["decoder.final_layernorm.weight"] == "replicated"
    assert {p["name"]: p["shape"] for p in report["parameters"]}["decoder.layers.1.mlp.linear_fc1.weight"] == [64, 16]
    assert len(report["files"]) == 5 and report["optimizer"]["kind"]


def test_convert_to_pt_writes_the_model_and_the_joined_optimizer(tmp_path):
    out = tmp_path / "t.pt"
    ok(run_cli("convert", MEGATRON / "moe-tp2-legacy", "-o", out))
    tree, _ = read_torch_tree(str(out))
    expected = reference("moe-tp2")
    assert sorted(tree["model"]) == sorted(expected)
    assert all(tree["model"][k].read().tobytes() == v for k, v in expected.items())
    assert len(tree["optimizer"]["state"]) == len(expected)
    assert read_torch(str(out)).tensors


def test_the_kinds_by_name():
    assert parallel_kind("decoder.layers.0.mlp.linear_fc1.weight", False, 2) == "column"
    assert parallel_kind("decoder.layers.0.mlp.router.weight", True, 2) == "replicated"
    assert parallel_kind("decoder.layers.0.mlp.something.weight", True, 1) == "replicated"
    assert parallel_kind("decoder.layers.0.mlp.something.weight", True, 2) is None


def test_the_folders_are_recognised_and_torch_dist_is_not_read_as_legacy():
    assert folder_format(str(MEGATRON / "gpt-tp2-legacy")).name == "megatron-legacy"
    assert folder_format(str(MEGATRON / "gpt-tp2-legacy" / ITER)).name == "megatron-legacy"
    assert folder_format(str(MEGATRON / "gpt-tp2-legacy" / ITER / "mp_rank_00")) is None
    with pytest.raises(CheckpointError, match="torch_dist"):  # the registry reads it with megatron_dist's reader
        read_megatron(str(MEGATRON / "gpt-tp2-torch_dist"))


# ------------------------------------------------------------------------------- hostile folders


@pytest.fixture
def hostile(tmp_path):
    """A copy of a fixture folder to spoil, and the check that converting it is refused."""

    class Hostile:
        def copy(self, name: str) -> Path:
            folder = tmp_path / "in" / f"{name}-legacy"
            shutil.copytree(MEGATRON / f"{name}-legacy", folder)
            return folder

        def refused(self, folder: Path, *needles: str, out: str = "out.pt") -> str:
            before = snapshot(tmp_path / "in")
            target = tmp_path / out
            result = run_cli("convert", folder, "-o", target)
            refused(result, *needles, unwritten=[target])
            assert snapshot(tmp_path / "in") == before
            return result.stderr

    return Hostile()


def rank(folder: Path, name: str) -> Path:
    return folder / ITER / name / "model_optim_rng.pt"


def edit(path: Path, pattern: bytes, new: bytes, member: str = "data.pkl", count: int = 1) -> None:
    """Replace ``pattern`` (a regex) by ``new`` in a member of a torch.save zip (rebuilt): the
    bytes of the pattern's first group, if it has one, then ``new``."""
    with zipfile.ZipFile(path) as zf:
        members = [(info, zf.read(info)) for info in zf.infolist()]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as zf:
        for info, data in members:
            if info.filename.endswith("/" + member):
                data, n = re.subn(pattern, lambda m: (m.group(1) if m.re.groups else b"") + new, data, count=count,
                                   flags=re.DOTALL)
                assert n, pattern
            zf.writestr(info.filename, data)
    path.write_bytes(buffer.getvalue())


def test_a_missing_rank_file_is_refused_naming_it(hostile):
    folder = hostile.copy("gpt-tp2-pp2")
    os.remove(rank(folder, "mp_rank_01_001"))
    hostile.refused(folder, str(rank(folder, "mp_rank_01_001")), "missing", "PP=2")


def test_a_stale_rank_folder_is_refused_naming_it(hostile):
    folder = hostile.copy("gpt-tp2")
    shutil.copytree(folder / ITER / "mp_rank_01", folder / ITER / "mp_rank_02")
    hostile.refused(folder, str(folder / ITER / "mp_rank_02"), "stale")


@pytest.mark.parametrize("key, old", [("self_attention.linear_qkv.weight", b"QK\x00K\x10K\x10\x86"),
                                      ("input_layernorm.weight", b"QK\x00K\x10\x85")])
def test_ranks_that_disagree_on_a_shape_are_refused(hostile, key, old):
    folder = hostile.copy("gpt-tp2")
    new = old.replace(b"K\x10", b"K\x08", 1)
    edit(rank(folder, "mp_rank_01"), b"(" + re.escape(f"layers.0.{key}".encode()) + b".{0,40}?)" + re.escape(old), new)
    hostile.refused(folder, str(rank(folder, "mp_rank_01")), "disagree", "F32[8")


def test_a_replicated_tensor_that_differs_between_ranks_is_refused(hostile):
    folder = hostile.copy("gpt-tp2")
    edit(rank(folder, "mp_rank_01"), rb"^....", b"\x00\x00\x80\x7f", member="data/1")  # input_layernorm's storage
    hostile.refused(folder, str(rank(folder, "mp_rank_01")), "input_layernorm", "differs")


def test_ranks_that_disagree_on_names_are_refused(hostile):
    folder = hostile.copy("gpt-tp2")
    edit(rank(folder, "mp_rank_01"), rb"layers\.1\.input_layernorm", b"layers.1.input_layernxrm")
    hostile.refused(folder, str(rank(folder, "mp_rank_01")), "other tensors", "disagree")


def test_a_tensor_of_unknown_split_is_refused_at_tp2(hostile):
    folder = hostile.copy("gpt-tp2")
    for r in RANKS["gpt-tp2"]:
        edit(rank(folder, r), rb"layers\.1\.input_layernorm", b"layers.1.input_layernxrm")
    hostile.refused(folder, "input_layernxrm", "does not know how Megatron splits")


def test_an_args_pickle_naming_a_class_outside_the_allow_list_runs_nothing(hostile, tmp_path):
    folder = hostile.copy("gpt-tp2")
    marker = tmp_path / "ran"
    edit(rank(folder, "mp_rank_00"), rb"cargparse\nNamespace\n", b"cposix\nsystem\n")
    edit(rank(folder, "mp_rank_00"), rb"X\n\x00\x00\x00num_layers", b"X\n\x00\x00\x00" + b"touch ran!"[:10])
    stderr = hostile.refused(folder, str(rank(folder, "mp_rank_00")), "system")
    assert "posix" in stderr and not marker.exists()


@pytest.mark.parametrize("value, needles", [(b"K\x04", ("mp_rank_02", "missing", "TP=4")),
                                            (b"K\x00", ("tensor_model_parallel_size", "positive integer"))])
def test_args_that_disagree_with_the_files_are_refused(hostile, value, needles):
    folder = hostile.copy("gpt-tp2")
    edit(rank(folder, "mp_rank_00"), rb"(tensor_model_parallel_sizeq.)K\x02", value)
    hostile.refused(folder, *needles)


def test_ranks_whose_args_disagree_are_refused(hostile):
    folder = hostile.copy("gpt-tp2")
    edit(rank(folder, "mp_rank_01"), rb"(num_layersq.)K\x02", b"K\x03")
    hostile.refused(folder, str(rank(folder, "mp_rank_01")), "3 layers", "two saves")


def test_layers_that_do_not_add_up_to_args_are_refused(hostile):
    folder = hostile.copy("gpt-tp2")
    for r in RANKS["gpt-tp2"]:
        edit(rank(folder, r), rb"(num_layersq.)K\x02", b"K\x03")
    hostile.refused(folder, "3 layers", "hold 2")


def test_layers_with_a_gap_are_refused(hostile):
    folder = hostile.copy("gpt-tp2")
    for r in RANKS["gpt-tp2"]:
        edit(rank(folder, r), rb"decoder\.layers\.1\.", b"decoder.layers.3.", count=0)
    hostile.refused(folder, "layers [0, 3]")


def test_an_expert_past_its_ranks_share_is_refused(hostile):
    folder = hostile.copy("moe-ep2")
    edit(rank(folder, "mp_rank_00_001"), rb"local_experts\.1\.", b"local_experts.5.", count=0)
    hostile.refused(folder, "local_experts.5", "2 experts")


def test_experts_that_do_not_divide_over_the_ep_ranks_are_refused(hostile):
    folder = hostile.copy("moe-ep2")
    edit(rank(folder, "mp_rank_00_000"), rb"(num_expertsq.)K\x04", b"K\x03")
    hostile.refused(folder, "num_experts 3")


def test_a_truncated_rank_file_is_refused_naming_it(hostile):
    folder = hostile.copy("gpt-tp2")
    path = rank(folder, "mp_rank_01")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    hostile.refused(folder, str(path))


def test_a_rank_file_without_a_model_is_refused(hostile):
    folder = hostile.copy("gpt-tp2")
    edit(rank(folder, "mp_rank_01"), rb"X\x05\x00\x00\x00model", b"X\x05\x00\x00\x00modex")
    hostile.refused(folder, str(rank(folder, "mp_rank_01")), "'model'", "a state dict")


@pytest.mark.parametrize("text, needles", [("20", ("iter_0000020", "not there")), ("../x", ("'../x'",)),
                                           ("9" * 40, ("33+ bytes",))])
def test_a_latest_file_naming_no_iteration_folder_is_refused(hostile, text, needles):
    folder = hostile.copy("gpt-tp2")
    (folder / "latest_checkpointed_iteration.txt").write_text(text)
    hostile.refused(folder, str(folder / "latest_checkpointed_iteration.txt"), *needles)


def test_an_empty_iteration_folder_is_refused(hostile):
    folder = hostile.copy("gpt-tp2")
    shutil.rmtree(folder / ITER)
    (folder / ITER).mkdir()
    hostile.refused(folder, "no mp_rank_TT")


# ------------------------------------------------------------------------------- optimizers fusectl does not map


def test_a_distributed_optimizer_is_refused_by_a_pt_output_and_the_model_written_alone(hostile, tmp_path):
    folder = hostile.copy("gpt-tp2")
    (folder / ITER / "mp_rank_00" / "distrib_optim.pt").write_bytes(b"x")
    hostile.refused(folder, "distrib_optim.pt", "does not read yet", "no training dict")
    out = tmp_path / "model.pt"
    refused(run_cli("convert", folder, "-o", out, "--drop-optimizer"), "distrib_optim.pt", unwritten=[out])
    report = json.loads(ok(run_cli("inspect", "--json", folder)).stdout)
    assert "distrib_optim.pt" in report["optimizer"]["problem"]
    ok(run_cli("convert", folder, "-o", tmp_path / "model.safetensors"))
    written = read_safetensors(str(tmp_path / "model.safetensors")).tensors
    assert {k: t.read().tobytes() for k, t in written.items()} == reference("gpt-tp2")


def test_param_groups_fusectl_cannot_map_leave_the_model_readable(hostile, tmp_path):
    folder = hostile.copy("gpt-tp2")
    edit(rank(folder, "mp_rank_01"), rb"(is_expert_parallelr....)\x89", b"\x88")
    hostile.refused(folder, str(rank(folder, "mp_rank_01")), "param group 0", "whose state")
    out = tmp_path / "model.safetensors"
    ok(run_cli("convert", folder, "-o", out))
    assert sorted(read_safetensors(str(out)).tensors) == sorted(reference("gpt-tp2"))


def test_a_folder_saved_without_an_optimizer_holds_none(hostile, tmp_path):
    folder = hostile.copy("gpt-tp2")
    for r in RANKS["gpt-tp2"]:
        edit(rank(folder, r), rb"X\t\x00\x00\x00optimizer", b"X\t\x00\x00\x00optimizex")
    contents = read_megatron(str(folder))
    assert contents.training.optimizer_key is None and contents.optimizer is None


# ------------------------------------------------------------------------------- tied at PP > 1

TIED_PP2 = MEGATRON / "tied-tp2-pp2-legacy"


def head_copy(folder: Path, name: str = "mp_rank_01_001"):
    """The last stage's ``output_layer.weight`` of a TP rank, as megatron wrote it."""
    tree, _ = read_torch_tree(str(rank(folder, name)), records=RECORDS)
    return tree["model"]["output_layer.weight"]


def test_a_tied_head_on_the_last_stage_is_read_as_the_embedding_it_copies():
    contents = read_megatron(str(TIED_PP2))
    assert "output_layer.weight" not in contents.tensors and "output_layer.weight" not in contents.order
    assert contents.distributed["tied_head_copy"] == "output_layer.weight"
    assert "output_layer.weight" not in contents.distributed["parallel"]
    embedding = contents.tensors["embedding.word_embeddings.weight"].read()
    for tp, name in enumerate(["mp_rank_00_001", "mp_rank_01_001"]):  # megatron wrote the copy: equal
        assert head_copy(TIED_PP2, name).read().tobytes() == embedding[32 * tp:32 * (tp + 1)].tobytes()
    optimizer = contents.training.tree()["optimizer"]
    names = [n for g in optimizer["param_groups"] for n in g["param_names"]]
    assert sorted(names) == sorted(contents.tensors)  # the copy's moments went with it
    assert len(optimizer["state"]) == len(contents.tensors)


def test_tied_pp2_inspect_names_the_head_copy(tmp_path):
    report = json.loads(ok(run_cli("inspect", "--json", TIED_PP2)).stdout)
    assert report["distributed"]["tied_head_copy"] == "output_layer.weight"
    assert report["distributed"]["pp"] == 2 and report["distributed"]["world_size"] == 4
    assert "output_layer.weight" not in {p["name"] for p in report["parameters"]}
    assert "tied_head_copy" not in json.loads(ok(run_cli("inspect", "--json", MEGATRON / "gpt-tp2-pp2-legacy")).stdout)[
        "distributed"]


def test_tied_pp2_rewritten_at_its_parallelism_equals_megatrons_rank_files(tmp_path):
    from test_megatron_writer import assert_same_ranks

    out = tmp_path / "out"
    ok(run_cli("convert", TIED_PP2, "--to", "megatron", "--tp", "2", "--pp", "2", "--drop-optimizer", "-o", out))
    assert_same_ranks(out, TIED_PP2)


def test_tied_pp2_fused_to_llama_is_the_reference_fused(tmp_path):
    config = MEGATRON / "hf-config" / "tied" / "config.json"
    src = tmp_path / "tied-tp2-pp2-full.safetensors"
    shutil.copy2(MEGATRON / "reference" / src.name, src)
    ok(run_cli("fuse", TIED_PP2, "-r", "megatron-gpt-to-llama", "--config", config, "-o", tmp_path / "ranks"))
    ok(run_cli("fuse", src, "-r", "megatron-gpt-to-llama", "--config", config, "-o", tmp_path / "ref"))
    mine = read_safetensors(str(tmp_path / "ranks" / "model.safetensors")).tensors
    ref = read_safetensors(str(tmp_path / "ref" / "model.safetensors")).tensors
    assert sorted(mine) == sorted(ref) and "lm_head.weight" not in mine and "model.embed_tokens.weight" in mine
    for name, tensor in ref.items():
        assert mine[name].read().tobytes() == tensor.read().tobytes(), name


def test_tied_pp2_fused_to_llama_computes_megatrons_logits(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = MEGATRON / "hf-config" / "tied" / "config.json"
    out = tmp_path / "hf"
    ok(run_cli("fuse", TIED_PP2, "-r", "megatron-gpt-to-llama", "--config", config, "-o", out))
    shutil.copy2(config, out / "config.json")
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    reference = np.load(MEGATRON / "reference" / "tied-tp2-pp2.npz")
    with torch.no_grad():
        logits = model(torch.from_numpy(reference["input_ids"])).logits.numpy()
    assert np.abs(logits - reference["logits"]).max() <= 1e-5  # megatron's own forward at TP=2 x PP=2
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def spoil_head(folder: Path, name: str = "mp_rank_01_001", row: int = 5) -> None:
    """Change one float of a row of the last stage's head copy, in place (the zip is stored)."""
    byte = head_copy(folder, name).byte_ranges()[0]
    with open(byte.path, "r+b") as f:
        f.seek(byte.offset + row * 16 * 4)
        value = f.read(4)
        f.seek(byte.offset + row * 16 * 4)
        f.write(bytes([value[0] ^ 1]) + value[1:])


def test_a_last_stage_head_that_differs_from_the_embedding_is_refused(hostile):
    folder = hostile.copy("tied-tp2-pp2")
    spoil_head(folder)
    stderr = hostile.refused(folder, str(rank(folder, "mp_rank_01_001")), "output_layer.weight", "differs",
                             "embedding.word_embeddings.weight", "row 5")
    assert "mp_rank_01_000" in stderr


def test_a_last_stage_head_of_another_shape_is_refused(hostile):
    folder = hostile.copy("tied-tp2-pp2")
    for name in ("mp_rank_00_001", "mp_rank_01_001"):
        edit(rank(folder, name), rb"(output_layer\.weight.{0,40}?)" + re.escape(b"K K\x10\x86"), b"K\x10K\x20\x86")
    hostile.refused(folder, "output_layer.weight", "F32[16, 32]", "embedding.word_embeddings.weight")


def test_a_tied_head_without_an_embedding_is_refused(hostile):
    folder = hostile.copy("tied-tp2-pp2")
    for name in ("mp_rank_00_000", "mp_rank_01_000"):
        edit(rank(folder, name), rb"embedding\.word_embeddings\.weight", b"embeddinx.word_embeddings.weight")
    hostile.refused(folder, "output_layer.weight", "no stage holds")


def test_an_untied_save_at_pp2_keeps_its_head():
    contents = read_megatron(str(MEGATRON / "gpt-tp2-pp2-legacy"))
    assert "output_layer.weight" in contents.tensors and "tied_head_copy" not in contents.distributed
