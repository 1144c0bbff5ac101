"""io/formats/deepspeed_zero: DeepSpeed ZeRO 1-3 checkpoints read without torch or DeepSpeed.

Against DeepSpeed's own results, made by committed scripts and saved beside the checkpoints:
``fixtures/generate_distributed.py`` (a tiny Llama, tied and untied, on 2 ranks) and
``fixtures/generate_deepspeed_padded.py`` (a model whose partitions carry padding, with a frozen
parameter and a float16 buffer). Every tensor is bitwise ``zero_to_fp32``'s (its reference read
with fusectl's own torch reader: no torch needed), names and order included; the moments are
bitwise what ``ds_to_universal`` wrote. The bf16 folders (``generate_distributed.py``: ZeRO 1,
which is DeepSpeed's BF16_Optimizer and which ``zero_to_fp32`` refuses, ZeRO 2 and 3) give the
fp32 master weights, bitwise ``ds_to_universal``'s (and ``zero_to_fp32``'s where it reads them),
never the bf16 copies of the model states, which are those weights rounded; the CLI reads, converts and fuses the folders; hostile
folders are refused, exit 2, nothing written. Where torch is installed, the converted files
resume and reproduce the uninterrupted run's losses.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest

import fusectl
from conftest import FIXTURES, ok, refused, run_cli, snapshot
from fusectl.errors import CheckpointError
from fusectl.io.formats.deepspeed_zero import RECORDS, read_zero
from fusectl.io.formats.safetensors_file import read_safetensors
from fusectl.io.formats.torch_file import read_torch, read_torch_tree
from fusectl.io.formats.torch_writer import write_torch_file
from fusectl.tensors import ByteRange, FileTensor, TensorSpec

DIST = FIXTURES / "distributed"
PADDED = FIXTURES / "deepspeed-padded"
TAG = "global_step3"
SAVED = 3  # steps before the save (fixtures/resume_training.py)
LLAMA = ["zero1", "zero2", "zero3", "zero2-tied", "zero3-tied", "bf16-zero2", "bf16-zero3"]
CASES = [(DIST, n) for n in LLAMA] + [(PADDED, n) for n in ("zero1", "zero2", "zero3")]
IDS = [f"{root.name}/{n}" for root, n in CASES]
# bf16 (generate_distributed.py --mixed-only); zero_to_fp32 refuses bf16-zero1 (BF16_Optimizer)
MIXED = ["bf16-zero1", "bf16-zero2", "bf16-zero3"]
ATTENTION = ("q_proj", "k_proj", "v_proj")


def _reference(root: Path, name: str):
    """zero_to_fp32's state dict (torch.save'd by the generator), read with fusectl's torch reader."""
    return read_torch(str(root / "reference" / f"{name}.pt"))


def _bytes(tensor) -> bytes:
    return tensor.read().tobytes()


def _stage(name: str) -> int:
    return int(name.split("zero")[1][0])


@pytest.mark.parametrize("root,name", CASES, ids=IDS)
def test_every_tensor_is_zero_to_fp32s_bitwise_in_its_order_with_its_ties(root, name):
    contents = read_zero(str(root / name))
    ref = _reference(root, name)
    assert list(contents.order) == (ref.order or [*ref.tensors, *ref.aliases])
    assert dict(contents.aliases) == ref.aliases
    assert list(contents.tensors) == list(ref.tensors)
    for key, tensor in ref.tensors.items():
        assert contents.tensors[key].spec == tensor.spec, key
        assert _bytes(contents.tensors[key]) == _bytes(tensor), key
    stage = _stage(name)
    assert contents.variant == f"deepspeed-zero{stage}"
    assert contents.distributed == {"world_size": 2, "stage": stage, "tag": TAG, "ds_version": "0.19.8"}


def test_the_tag_folder_reads_as_its_save_folder():
    whole, tag = read_zero(str(DIST / "zero2")), read_zero(str(DIST / "zero2" / TAG))
    assert list(whole.order) == list(tag.order)
    assert all(whole.tensors[n].byte_ranges() == tag.tensors[n].byte_ranges() for n in whole.tensors)
    assert whole.files == [str(DIST / "zero2" / "latest"), *tag.files]


def test_a_parameter_is_the_byte_ranges_of_each_ranks_file():
    optim = [str(DIST / "zero3" / TAG / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt") for r in (0, 1)]
    q = read_zero(str(DIST / "zero3")).tensors["model.layers.0.self_attn.q_proj.weight"]
    assert [r.path for r in q.byte_ranges()] == optim  # ZeRO 3: half of it on each rank
    assert [r.length for r in q.byte_ranges()] == [q.spec.nbytes // 2] * 2
    # the padded model's ZeRO 2: a.bias (5) is 4 elements of rank 0's partition and 1 of rank 1's
    bias = read_zero(str(PADDED / "zero2")).tensors["a.bias"]
    assert [(os.path.basename(r.path), r.length) for r in bias.byte_ranges()] == \
        [("zero_pp_rank_0_mp_rank_00_optim_states.pt", 16), ("zero_pp_rank_1_mp_rank_00_optim_states.pt", 4)]
    # ZeRO 3 pads the last rank's share: a.weight (15) is 8 + 7 elements
    weight = read_zero(str(PADDED / "zero3")).tensors["a.weight"]
    assert [r.length for r in weight.byte_ranges()] == [32, 28]


def _saved_groups(root: Path, name: str) -> list[dict]:
    """The base optimizer's param groups as DeepSpeed saved them in rank 0's file."""
    [path] = (root / name / TAG).glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt")  # bf16_ in bf16
    tree, _ = read_torch_tree(str(path), records=RECORDS)
    node = tree["optimizer_state_dict"]
    base = node["optimizer_state_dict"] if "fp32_flat_groups" in node else node["base_optimizer_state"]
    return base["param_groups"]


@pytest.mark.parametrize("root,name", [*CASES, (DIST, "bf16-zero1")], ids=[*IDS, "distributed/bf16-zero1"])
def test_the_training_state_is_a_torch_optimizer_state_dict_of_deepspeeds_groups(root, name):
    contents = read_zero(str(root / name))
    tree = contents.training.tree()
    assert list(tree) == ["model", "optimizer"]
    assert list(tree["model"]) == list(contents.order)
    for alias, kept in contents.aliases.items():
        assert tree["model"][alias] is tree["model"][kept]
    shapes, _ = read_torch_tree(str(root / name / TAG / os.path.basename(contents.files[1])), records=RECORDS)
    saved = _saved_groups(root, name)
    groups = tree["optimizer"]["param_groups"]
    assert [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in saved]
    assert [g["param_names"] for g in groups] == [list(s) for s in shapes["param_shapes"]]
    assert [i for g in groups for i in g["params"]] == list(range(sum(len(s) for s in shapes["param_shapes"])))
    state = tree["optimizer"]["state"]
    names = [n for g in groups for n in g["param_names"]]
    assert sorted(state) == list(range(len(names)))
    steps = [entry["step"] for entry in state.values()]
    assert len({id(s) for s in steps}) == len(steps)  # torch steps each in place: one tensor each
    assert {float(s.read()) for s in steps} == {float(SAVED)}
    for pid, name_ in enumerate(names):
        assert list(state[pid]) == ["step", "exp_avg", "exp_avg_sq"]
        assert state[pid]["exp_avg"].spec == state[pid]["exp_avg_sq"].spec == contents.tensors[name_].spec
    # what fusectl's optimizer mapping reads: every id named, by param_names
    assert fusectl.open_checkpoint(str(root / name)).optimizer_mapped[1].source == "param_names"


@pytest.mark.parametrize("root,name", [(DIST, "zero2"), (DIST, "zero3"), (PADDED, "zero2"), (PADDED, "zero3")],
                         ids=["distributed/zero2", "distributed/zero3", "padded/zero2", "padded/zero3"])
def test_the_moments_are_ds_to_universals_bitwise(root, name):
    # ds_to_universal wrote each parameter's moments in a file of its own: read them as they are
    tree = read_zero(str(root / name)).training.tree()["optimizer"]
    names = [n for g in tree["param_groups"] for n in g["param_names"]]
    zero = root / f"{name}-universal" / TAG / "zero"
    for pid, param in enumerate(names):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if key == "step" and not (zero / param / "step.pt").exists():  # ZeRO 3's conversion writes none
                continue
            saved, _ = read_torch_tree(str(zero / param / f"{key}.pt"))
            saved = saved["param"] if isinstance(saved, dict) else saved
            ours = tree["state"][pid][key]
            assert ours.spec.numel == saved.spec.numel and _bytes(ours) == _bytes(saved), (param, key)


def _universal_reference(name: str) -> dict:
    """ds_to_universal's files of a mixed folder, gathered by the generator in one: {parameter:
    {"fp32", "exp_avg", "exp_avg_sq"[, "step"]: tensor}} (ZeRO 3's flat, as it writes them)."""
    tree, _ = read_torch_tree(str(DIST / "reference" / f"{name}-universal.pt"))
    return tree


@pytest.mark.parametrize("name", MIXED)
def test_bf16_folders_give_the_fp32_master_weights_and_moments_bitwise_ds_to_universals(name):
    contents = read_zero(str(DIST / name))
    universal = _universal_reference(name)
    tree = contents.training.tree()["optimizer"]
    names = [n for g in tree["param_groups"] for n in g["param_names"]]
    assert sorted(names) == sorted(universal) == sorted(contents.tensors)
    for pid, param in enumerate(names):
        saved = universal[param]
        ours = {"fp32": contents.tensors[param], **tree["state"][pid]}
        assert ours["fp32"].spec.dtype.safetensors == "F32" and ours["fp32"].spec.numel == saved["fp32"].spec.numel
        for key, tensor in saved.items():  # ZeRO 3's conversion writes no step
            assert _bytes(ours[key]) == _bytes(tensor), (param, key)
    assert contents.variant == f"deepspeed-zero{_stage(name)}"
    optimizer = {"optimizer": "BF16_Optimizer"} if name == "bf16-zero1" else {}
    assert contents.distributed == {"world_size": 2, "stage": _stage(name), "tag": TAG, "ds_version": "0.19.8",
                                    **optimizer}


def test_bf16_zero1_is_in_the_order_of_its_param_shapes():
    # zero_to_fp32 refuses BF16_Optimizer's files; its order would be param_shapes' (no buffers)
    contents = read_zero(str(DIST / "bf16-zero1"))
    shapes, _ = read_torch_tree(str(DIST / "bf16-zero1" / TAG / "mp_rank_00_model_states.pt"), records=RECORDS)
    assert list(contents.order) == [n for group in shapes["param_shapes"] for n in group]
    assert [contents.tensors[n].spec.shape for n in contents.order] == \
        [tuple(s) for group in shapes["param_shapes"] for s in group.values()]


@pytest.mark.parametrize("name", ["bf16-zero1", "bf16-zero2"])
def test_the_bf16_weights_of_the_model_states_are_the_fp32_master_weights_rounded(name):
    import ml_dtypes
    module = read_torch(str(DIST / name / TAG / "mp_rank_00_model_states.pt"), key="module").tensors
    master = read_zero(str(DIST / name)).tensors
    assert sorted(module) == sorted(master)
    rounded_differs = 0
    for key, tensor in master.items():
        assert module[key].spec.dtype.safetensors == "BF16" and module[key].spec.shape == tensor.spec.shape
        fp32 = tensor.read()
        assert _bytes(module[key]) == fp32.astype(ml_dtypes.bfloat16).tobytes(), key  # round to nearest even
        rounded_differs += int((fp32.astype(ml_dtypes.bfloat16).astype("float32") != fp32).sum())
    assert rounded_differs > 0  # fusectl gives the fp32 weights, not the bf16 ones widened


def test_bf16_zero3_model_states_hold_empty_placeholders_and_fusectl_the_fp32_weights():
    module = read_torch(str(DIST / "bf16-zero3" / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt"),
                        key="module").tensors
    assert {t.spec.dtype.safetensors for t in module.values()} == {"BF16"} and {t.spec.numel for t in module.values()} == {0}
    assert {t.spec.dtype.safetensors for t in read_zero(str(DIST / "bf16-zero3")).tensors.values()} == {"F32"}


def test_inspect_json_of_a_bf16_optimizer_folder():
    report = ok(run_cli("inspect", "--json", DIST / "bf16-zero1")).json()
    assert report["format"] == "deepspeed-zero1"
    assert report["distributed"] == {"world_size": 2, "stage": 1, "tag": TAG, "ds_version": "0.19.8",
                                     "optimizer": "BF16_Optimizer"}
    assert {p["dtype"] for p in report["parameters"]} == {"F32"} and len(report["parameters"]) == 21
    assert report["optimizer"]["kind"] == "Adam/AdamW" and report["optimizer"]["exact"]
    report = ok(run_cli("inspect", "--json", DIST / "bf16-zero3")).json()
    assert report["format"] == "deepspeed-zero3" and report["distributed"]["world_size"] == 2


def test_convert_a_bf16_optimizer_folder_to_pt_and_to_a_folder(tmp_path):
    ok(run_cli("convert", DIST / "bf16-zero1", "-o", tmp_path / "out.pt"))
    ok(run_cli("convert", DIST / "bf16-zero1", "-o", tmp_path / "out"))
    universal = _universal_reference("bf16-zero1")
    written = read_torch(str(tmp_path / "out.pt"), key="model").tensors
    folder = read_safetensors(str(tmp_path / "out" / "model.safetensors")).tensors
    for param, saved in universal.items():
        assert _bytes(written[param]) == _bytes(folder[param]) == _bytes(saved["fp32"]), param
    tree, _ = read_torch_tree(str(tmp_path / "out.pt"))
    state = tree["optimizer"]["state"]
    names = [n for g in tree["optimizer"]["param_groups"] for n in g["param_names"]]
    assert all(_bytes(state[pid]["exp_avg_sq"]) == _bytes(universal[n]["exp_avg_sq"]) for pid, n in enumerate(names))


def test_inspect_json_says_the_format_the_ranks_the_global_shapes_and_the_optimizer():
    report = ok(run_cli("inspect", "--json", DIST / "zero3-tied")).json()
    assert report["format"] == "deepspeed-zero3"
    assert report["distributed"] == {"world_size": 2, "stage": 3, "tag": TAG, "ds_version": "0.19.8"}
    shapes = {p["name"]: p["shape"] for p in report["parameters"]}
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == [8, 16] and len(shapes) == 21
    assert report["ties"] == [["lm_head.weight", "model.embed_tokens.weight"]]
    optimizer = report["optimizer"]
    assert optimizer["kind"] == "Adam/AdamW" and optimizer["exact"] and optimizer["order_from"] == "param_names"
    assert [g["params"] for g in optimizer["groups"]] == [15, 5]
    text = ok(run_cli("inspect", DIST / "zero1")).stdout
    assert "deepspeed-zero1" in text and "world size 2, stage 1, tag global_step3" in text


@pytest.mark.parametrize("name", ["zero2", "zero3-tied"])
def test_convert_to_pt_writes_the_weights_and_the_optimizer_state(tmp_path, name):
    out = tmp_path / "out.pt"
    ok(run_cli("convert", DIST / name, "-o", out))
    written = read_torch(str(out), key="model")
    ref = _reference(DIST, name)
    assert (written.order or [*written.tensors, *written.aliases]) == (ref.order or [*ref.tensors, *ref.aliases])
    assert written.aliases == ref.aliases
    assert all(_bytes(written.tensors[k]) == _bytes(t) for k, t in ref.tensors.items())
    tree, _ = read_torch_tree(str(out))
    ours = read_zero(str(DIST / name)).training.tree()["optimizer"]
    assert tree["optimizer"]["param_groups"] == ours["param_groups"]
    for pid, entry in ours["state"].items():
        assert {k: _bytes(v) for k, v in tree["optimizer"]["state"][pid].items()} == \
            {k: _bytes(v) for k, v in entry.items()}
    if "tied" not in name:
        losses = _resume_pt(out, DIST / name / "config.json")
        _assert_resumes(losses, f"deepspeed-{name}", 1e-6)


def test_convert_to_a_folder_writes_hugging_face_safetensors(tmp_path):
    out = tmp_path / "out"
    ok(run_cli("convert", DIST / "zero2-tied", "-o", out))
    index = read_safetensors(str(out / "model.safetensors"))  # one file (rank files are no shards)
    ref = _reference(DIST, "zero2-tied")
    assert sorted(index.tensors) == sorted(ref.tensors)
    assert all(_bytes(index.tensors[k]) == _bytes(t) for k, t in ref.tensors.items())
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True  # the folder's config
    reopened = fusectl.open_checkpoint(str(out))
    assert reopened.table.unique_name("lm_head.weight") == "model.embed_tokens.weight"


def test_deepspeeds_own_scripts_in_the_save_folder_do_not_travel_into_a_folder_output(tmp_path):
    """DeepSpeed copies zero_to_fp32.py and zero_to_torch.py into every save folder: its code,
    not the model's files; the folder's config.json travels."""
    folder = tmp_path / "zero2"
    shutil.copytree(DIST / "zero2", folder)
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        (folder / script).write_text("# DeepSpeed's script\n")
    ok(run_cli("convert", folder, "-o", tmp_path / "out"))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]


def _phi3_order(tmp_path: Path) -> Path:
    """The parameter order of Phi3ForCausalLM of the tiny Llama's sizes (o_proj before qkv_proj),
    as the training fixtures' reference records it."""
    groups = json.loads((FIXTURES / "reference" / "training-adamw.json").read_text())["param_groups"]["phi3"]
    path = tmp_path / "phi3-order.json"
    path.write_text(json.dumps([n for g in groups for n in g]))
    return path


def test_fuse_moves_the_moments_with_the_weights(tmp_path):
    out = tmp_path / "fused.pt"
    ok(run_cli("fuse", DIST / "zero2", "-r", "llama-qkv", "-r", "llama-gate-up", "-o", out,
               "--param-order-out", _phi3_order(tmp_path)))
    source = read_zero(str(DIST / "zero2"))
    tree = source.training.tree()["optimizer"]
    moment = {n: tree["state"][pid] for pid, n in enumerate(n for g in tree["param_groups"] for n in g["param_names"])}
    fused, _ = read_torch_tree(str(out))
    names = [n for g in fused["optimizer"]["param_groups"] for n in g["param_names"]]
    state = dict(zip(names, (fused["optimizer"]["state"][pid] for pid in range(len(names)))))
    for layer in (0, 1):
        prefix = f"model.layers.{layer}.self_attn."
        parts = [f"{prefix}{p}.weight" for p in ATTENTION]
        qkv = f"{prefix}qkv_proj.weight"
        assert _bytes(fused["model"][qkv]) == b"".join(_bytes(source.tensors[p]) for p in parts)
        for key in ("exp_avg", "exp_avg_sq"):
            assert _bytes(state[qkv][key]) == b"".join(_bytes(moment[p][key]) for p in parts)
        assert float(state[qkv]["step"].read()) == float(SAVED)
    _assert_resumes(_resume_pt(out, DIST / "zero2" / "config.json"), "deepspeed-zero2", 1e-6)


# ------------------------------------------------------------------------------- resumed with torch


def _distributed_train():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import importlib.util
    import sys
    sys.path.insert(0, str(FIXTURES))  # distributed_train imports resume_training beside it
    spec = importlib.util.spec_from_file_location("distributed_train", FIXTURES / "distributed_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _resume_pt(path: Path, config: Path) -> list[float]:
    """Load a training file written by fusectl into the model of its layout and AdamW, train the
    run's next steps in one process; their losses."""
    dt = _distributed_train()
    import torch
    saved = torch.load(str(path), weights_only=True)
    dt.rt.deterministic()
    _, model = dt.build_model(json.loads(config.read_text()), fused=dt.is_fused(saved["model"]))
    model.load_state_dict(saved["model"], strict=True)
    optimizer = dt.make_optimizer(model)
    optimizer.load_state_dict(saved["optimizer"])
    return dt.rt.train(model, optimizer, dt.rt.batches()[dt.SAVED:dt.SAVED + dt.K])


def _assert_resumes(losses: list[float], run: str, tolerance: float) -> None:
    recorded = json.loads((DIST / "reference" / "losses.json").read_text())[run]
    [uninterrupted] = recorded.values()
    assert len(losses) == len(uninterrupted) - SAVED
    assert max(abs(a - b) for a, b in zip(losses, uninterrupted[SAVED:])) <= tolerance, (losses, uninterrupted)


# ------------------------------------------------------------------------------- hostile folders


@pytest.fixture
def hostile(tmp_path):
    """A copy of a fixture folder to spoil, and the check that converting it is refused."""

    class Hostile:
        def copy(self, name: str, root: Path = DIST) -> Path:
            folder = tmp_path / "in" / name
            shutil.copytree(root / name, folder)
            return folder

        def refused(self, folder: Path, *needles: str) -> str:
            before = snapshot(tmp_path / "in")
            out = tmp_path / "out.pt"
            result = run_cli("convert", folder, "-o", out)
            refused(result, *needles, unwritten=[out])
            assert snapshot(tmp_path / "in") == before
            assert not [n for n in os.listdir(tmp_path) if "fusectl" in n]
            return result.stderr

    return Hostile()


def _rewrite(path: Path, edit) -> None:
    """Read a DeepSpeed file with fusectl's reader, ``edit`` its tree, write it back (the lazy
    tensors read from the old file: written beside it first)."""
    tree, _ = read_torch_tree(str(path), records=RECORDS)
    edit(tree)
    new = path.with_name(path.name + ".new")
    write_torch_file(str(new), tree)
    os.replace(new, path)


def _repickle(path: Path, old: bytes, new: bytes) -> None:
    """Replace ``old`` by ``new`` in the pickle of a torch.save zip (the archive rebuilt)."""
    with zipfile.ZipFile(path) as zf:
        members = [(info, zf.read(info)) for info in zf.infolist()]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as zf:
        for info, data in members:
            if info.filename.endswith("/data.pkl"):
                assert data.count(old) == 1, old
                data = data.replace(old, new)
            zf.writestr(info.filename, data)
    path.write_bytes(buffer.getvalue())


def _shorter(flat, numel: int) -> FileTensor:
    """The first ``numel`` elements of a flat tensor read from a file."""
    where = flat.byte_ranges()[0]
    return FileTensor(TensorSpec(flat.spec.dtype, (numel,)), ByteRange(where.path, where.offset,
                                                                      numel * flat.spec.dtype.itemsize))


def _optim(folder: Path, rank: int, prefix: str = "") -> Path:
    return folder / TAG / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


@pytest.mark.parametrize("text", ["../zero3", "/etc", "global_step3/../../x", "..", "", "\x00\x01", "nope"])
def test_a_latest_that_names_anything_but_a_folder_beside_it_is_refused(hostile, text):
    folder = hostile.copy("zero2")
    (folder / "latest").write_text(text)
    hostile.refused(folder, str(folder / "latest"))


def test_a_truncated_optimizer_states_file_is_refused_naming_it(hostile):
    folder = hostile.copy("zero2")
    path = _optim(folder, 1)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    hostile.refused(folder, str(path))


def test_a_storage_record_shorter_than_its_partition_is_refused_naming_the_file(hostile):
    folder = hostile.copy("zero3")
    path = _optim(folder, 1)
    with zipfile.ZipFile(path) as zf:
        members = [(info.filename, zf.read(info)) for info in zf.infolist()]
    biggest = max((m for m in members if "/data/" in m[0]), key=lambda m: len(m[1]))[0]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, data in members:
            zf.writestr(name, data[: len(data) // 2] if name == biggest else data)
    hostile.refused(folder, str(path))


@pytest.mark.parametrize("name,rank", [("zero2", 1), ("zero3", 0), ("bf16-zero1", 1), ("bf16-zero3", 0)])
def test_a_missing_rank_file_is_refused_naming_it(hostile, name, rank):
    folder = hostile.copy(name)
    path = _optim(folder, rank, "bf16_" if name.startswith("bf16") else "")
    path.unlink()
    hostile.refused(folder, str(path), "missing")


def test_a_missing_zero3_model_states_file_is_refused_naming_it(hostile):
    folder = hostile.copy("zero3")
    path = folder / TAG / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    path.unlink()
    hostile.refused(folder, str(path), "missing")


def test_a_rank_file_past_the_world_size_is_refused(hostile):
    folder = hostile.copy("zero2")
    shutil.copy(_optim(folder, 1), _optim(folder, 2))
    hostile.refused(folder, str(_optim(folder, 2)), "2 ranks")


def test_world_sizes_that_disagree_are_refused(hostile):
    folder = hostile.copy("zero2")

    def edit(tree):
        tree["optimizer_state_dict"]["partition_count"] = [4, 4]
    _rewrite(_optim(folder, 1), edit)
    hostile.refused(folder, str(_optim(folder, 1)), "4 ranks")


def test_shapes_that_do_not_add_up_to_the_partitions_are_refused(hostile):
    folder = hostile.copy("zero2")
    states = folder / TAG / "mp_rank_00_model_states.pt"

    def edit(tree):
        tree["param_shapes"][0]["lm_head.weight"] = (65, 16)
    _rewrite(states, edit)
    hostile.refused(folder, "flat group 0", "do not add up")


def test_a_partition_cut_short_on_one_rank_is_refused(hostile):
    folder = hostile.copy("zero2")

    def edit(tree):
        flats = tree["optimizer_state_dict"]["single_partition_of_fp32_groups"]
        flats[0] = _shorter(flats[0], 100)
    _rewrite(_optim(folder, 0), edit)
    hostile.refused(folder, str(_optim(folder, 0)), str(_optim(folder, 1)), "equal slices")


def test_shapes_that_disagree_between_ranks_are_refused(hostile):
    folder = hostile.copy("zero3")
    states = folder / TAG / "zero_pp_rank_1_mp_rank_00_model_states.pt"

    def edit(tree):
        tree["param_shapes"][1]["model.norm.weight"] = (18,)
    _rewrite(states, edit)
    hostile.refused(folder, str(states), "disagree")


def test_moments_that_do_not_follow_the_weights_are_refused(hostile):
    folder = hostile.copy("zero2")

    def edit(tree):
        state = tree["optimizer_state_dict"]["base_optimizer_state"]["state"][1]
        state["exp_avg"] = _shorter(state["exp_avg"], 30)
    _rewrite(_optim(folder, 1), edit)
    hostile.refused(folder, str(_optim(folder, 1)), "exp_avg", "layout")


def test_an_optimizer_state_that_is_not_zeros_is_refused(hostile):
    # DeepSpeed's bf16 optimizer without ZeRO saves no zero_stage (its files are bf16_zero_pp_rank_…)
    folder = hostile.copy("zero1")

    def edit(tree):
        del tree["optimizer_state_dict"]["zero_stage"]
    for rank in (0, 1):
        _rewrite(_optim(folder, rank), edit)
        os.rename(_optim(folder, rank), _optim(folder, rank).with_name("bf16_" + _optim(folder, rank).name))
    hostile.refused(folder, "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_stage")


@pytest.mark.parametrize("spoil", ["renamed", "loss_scaler", "no clip_grad"])
def test_a_bf16_optimizer_file_that_is_not_quite_its_layout_is_refused(hostile, spoil):
    # BF16_Optimizer's files are read by what they are: named bf16_…, its keys, no loss scaler
    folder = hostile.copy("bf16-zero1")
    for rank in (0, 1):
        path = _optim(folder, rank, "bf16_")
        if spoil == "renamed":
            os.rename(path, _optim(folder, rank))
        else:
            def edit(tree):
                node = tree["optimizer_state_dict"]
                if spoil == "loss_scaler":
                    node["loss_scaler"] = 1.0
                else:
                    del node["clip_grad"]
            _rewrite(path, edit)
    hostile.refused(folder, "zero_pp_rank_0_mp_rank_00_optim_states.pt", "no zero_stage", "BF16_Optimizer")


def test_an_elastic_optimizer_state_without_param_groups_is_refused(hostile):
    folder = hostile.copy("zero2")

    def edit(tree):
        base = tree["optimizer_state_dict"]["base_optimizer_state"]
        tree["optimizer_state_dict"]["base_optimizer_state"] = [base["state"][0], base["state"][1]]
    _rewrite(_optim(folder, 0), edit)
    hostile.refused(folder, str(_optim(folder, 0)), "elastic")


def test_a_loss_scaler_replaced_by_os_system_is_refused_and_runs_nothing(hostile, tmp_path):
    folder = hostile.copy("zero2")
    marker = tmp_path / "ran"
    # the loss scaler's object (GLOBAL, its memo, EMPTY_TUPLE, NEWOBJ) becomes os.system("touch MARKER"):
    # what an unrestricted unpickler (torch.load(weights_only=False), which DeepSpeed uses) would run
    command = f"touch {marker}".encode()
    payload = b"cos\nsystem\nq\x04X" + len(command).to_bytes(4, "little") + command + b"\x85R"
    _repickle(_optim(folder, 0), b"cdeepspeed.runtime.fp16.loss_scaler\nLossScaler\nq\x04)\x81", payload)
    hostile.refused(folder, str(_optim(folder, 0)), "os.system")
    assert not marker.exists()


def test_a_tie_to_a_name_the_checkpoint_does_not_hold_is_refused(hostile):
    folder = hostile.copy("zero2-tied")
    states = folder / TAG / "mp_rank_00_model_states.pt"

    def edit(tree):
        tree["shared_params"] = {"lm_head.weight": "model.nothing.weight"}
    _rewrite(states, edit)
    hostile.refused(folder, str(states), "model.nothing.weight")


def test_a_folder_without_deepspeed_files_is_not_read_as_one(tmp_path):
    (tmp_path / "latest").write_text("global_step3")
    (tmp_path / TAG).mkdir()
    with pytest.raises(CheckpointError, match="no ZeRO optimizer states files"):
        read_zero(str(tmp_path))


def test_a_rank_file_linked_from_outside_the_folder_is_refused(hostile, tmp_path):
    folder = hostile.copy("zero2")
    outside = tmp_path / "elsewhere.pt"
    shutil.move(_optim(folder, 1), outside)
    os.symlink(outside, _optim(folder, 1))
    hostile.refused(folder, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    ok(run_cli("inspect", folder, "--follow-symlinks"))  # read when the user allows it


@pytest.mark.parametrize("name", ["zero2", "zero3", "zero3-universal"])
def test_a_folder_output_is_not_cut_along_the_rank_files(tmp_path, name):
    # the ranks' files (a universal checkpoint's one file per tensor) are no shards of the model:
    # a folder output holds it in one file up to --max-shard-size's default
    out = tmp_path / "out"
    ok(run_cli("convert", DIST / name, "-o", out))
    assert sorted(n for n in os.listdir(out) if n.endswith(".safetensors")) == ["model.safetensors"]


def test_a_latest_that_is_not_utf8_is_refused(hostile):
    folder = hostile.copy("zero2")
    (folder / "latest").write_bytes(b"\xff\xfeglobal_step3")
    hostile.refused(folder, "latest")


def test_a_zero3_model_states_file_of_a_rank_that_wrote_no_optimizer_states_is_refused(hostile):
    folder = hostile.copy("zero3")
    tag = folder / TAG
    shutil.copy(tag / "zero_pp_rank_1_mp_rank_00_model_states.pt", tag / "zero_pp_rank_2_mp_rank_00_model_states.pt")
    hostile.refused(folder, "zero_pp_rank_2_mp_rank_00_model_states.pt", "mixes two saves")
