"""``--to megatron --ckpt-format torch_dist``: Megatron-LM torch_dist saves written without torch
(fusectl/io/formats/megatron_dist_writer.py), read back, and loaded by megatron-core itself.

fixtures/megatron/*-torch_dist were saved by the real megatron-core 0.16.1 with
``dist_checkpointing.save`` (fixtures/generate_megatron.py); reference/NAME.npz holds the logits
megatron-core computed before saving. The round trips compare every tensor bitwise with what
fusectl's own readers give of the fixture; the megatron-core tests (run where torch and
megatron-core are: this interpreter, else /work/venvs/megatron) load fusectl's output with
``dist_checkpointing.load`` at TP=2 and at TP=1, compare every parameter with the same load of
megatron's own save, and compare the model's logits with megatron-core's saved reference.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES, megatron_rank, ok, parse_safetensors, refused

from fusectl.errors import PlanError
from fusectl.io.formats.dcp import DcpFolder
from fusectl.io.formats.megatron import read_megatron
from fusectl.io.formats.megatron_dist import layer_name, read_megatron_dist, stacked_slot
from fusectl.io.formats.megatron_dist_writer import write_megatron_dist
from fusectl.io.formats.torch_file import read_torch_tree
from fusectl.io.formats.megatron import RECORDS

MEGATRON = FIXTURES / "megatron"
CONFIG = MEGATRON / "hf-config" / "llama" / "config.json"
DIST = ("gpt-tp2-torch_dist", "tied-tp2-pp2-torch_dist", "moe-ep2-torch_dist")
LEGACY = ("gpt-tp2-legacy", "gpt-tp2-pp2-legacy", "tied-tp2-legacy", "tied-tp2-pp2-legacy", "moe-ep2-legacy",
          "moe-tp2-legacy")


def assert_same_model(written, original) -> None:
    """The same names in the same order, each tensor of the same spec and bitwise equal."""
    assert list(written) == list(original)
    for name, tensor in original.items():
        assert written[name].spec == tensor.spec, name
        assert written[name].read().tobytes() == tensor.read().tobytes(), name


def iteration(folder: Path) -> Path:
    latest = (folder / "latest_checkpointed_iteration.txt").read_text().strip()
    return folder / ("release" if latest == "release" else f"iter_{int(latest):07d}")


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("variant", DIST)
def test_torch_dist_save_rewritten_reads_back_bitwise(cli, tmp_path, variant):
    out = tmp_path / "out"
    ok(cli("convert", MEGATRON / variant, "--to", "megatron", "--ckpt-format", "torch_dist", "-o", out))
    assert sorted(os.listdir(out)) == ["iter_0000010", "latest_checkpointed_iteration.txt"]
    assert sorted(os.listdir(out / "iter_0000010")) == [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
    assert json.loads((out / "iter_0000010" / "metadata.json").read_text()) == \
        json.loads((MEGATRON / variant / "iter_0000010" / "metadata.json").read_text())
    assert_same_model(read_megatron_dist(str(out)).tensors, read_megatron_dist(str(MEGATRON / variant)).tensors)


def test_torch_dist_keys_and_global_shapes_are_megatrons(tmp_path):
    """The written index holds megatron's own keys, shapes and dtypes (tensors and extra state),
    every stacked layer (and expert) one chunk of its own; no rng_state."""
    for variant in DIST:
        out = tmp_path / variant
        write_megatron_dist(str(out), read_megatron_dist(str(MEGATRON / variant)).tensors, tp=1, pp=1,
                            config=json.loads(CONFIG.read_text()) | {"num_experts_per_tok": 2}, tied="tied" in variant,
                            iteration=10)
        mine, theirs = DcpFolder(str(out / "iter_0000010")), DcpFolder(str(MEGATRON / variant / "iter_0000010"))
        expected = {k for k in theirs.entries if not k.startswith("rng_state/")}
        assert set(mine.entries) == expected, variant
        for key in expected:
            if mine.is_tensor(key):
                assert mine.tensor(key).spec == theirs.tensor(key).spec, key
                chunks = mine.entries[key].state["chunks"]
                stacked = key.startswith("decoder.layers.")
                assert len(chunks) == (np.prod(mine.tensor(key).spec.shape[:2 if ".experts." in key else 1])
                                       if stacked else 1), key
        common, _ = read_torch_tree(str(out / "iter_0000010" / "common.pt"), records=RECORDS)
        assert common["args"].field("ckpt_format") == "torch_dist"
        assert common["args"].field("num_experts") == (4 if "moe" in variant else None)
        assert common["iteration"] == 10 and common["checkpoint_version"] == 3.0


@pytest.mark.parametrize("variant", LEGACY)
def test_legacy_save_to_torch_dist_reads_back_as_the_legacy_read(cli, tmp_path, variant):
    out = tmp_path / "out"
    ok(cli("convert", MEGATRON / variant, "--to", "megatron", "--ckpt-format", "torch_dist", "--drop-optimizer",
           "-o", out))
    original = read_megatron(str(MEGATRON / variant)).tensors
    if "tied" in variant:  # the legacy read keeps no head of a tied model at PP=1, and torch_dist stores none
        original = {k: v for k, v in original.items() if k != "output_layer.weight"}
    assert_same_model(read_megatron_dist(str(out)).tensors, original)


def test_legacy_and_torch_dist_of_one_model_write_the_same_tensors(cli, tmp_path):
    """megatron's legacy and torch_dist saves of one trained model give byte-identical .distcp files."""
    ok(cli("convert", MEGATRON / "gpt-tp2-legacy", "--to", "megatron", "--ckpt-format", "torch_dist",
           "--drop-optimizer", "-o", tmp_path / "a"))
    ok(cli("convert", MEGATRON / "gpt-tp2-torch_dist", "--to", "megatron", "--ckpt-format", "torch_dist",
           "-o", tmp_path / "b"))
    assert (tmp_path / "a/iter_0000010/__0_0.distcp").read_bytes() == \
        (tmp_path / "b/iter_0000010/__0_0.distcp").read_bytes()


def test_same_input_gives_byte_identical_output(cli, tmp_path):
    for n in (1, 2):
        ok(cli("convert", MEGATRON / "moe-ep2-torch_dist", "--to", "megatron", "--ckpt-format", "torch_dist",
               "-o", tmp_path / f"out{n}"))
    assert tree(tmp_path / "out1") == tree(tmp_path / "out2")


def test_hugging_face_llama_to_torch_dist_and_unfuse_back(cli, tmp_path):
    """A Llama made from megatron's parameters, fused to megatron-core's names and written as
    torch_dist at TP=2 in one run: the parameters of megatron's own torch_dist save, its
    config.json beside; the provenance in common.pt lets unfuse undo the recorded history."""
    llama = tmp_path / "llama"
    ok(cli("fuse", MEGATRON / "reference" / "gpt-tp2-full.safetensors", "-r", "megatron-gpt-to-llama", "--config",
           CONFIG, "-o", llama))
    shutil.copy(CONFIG, llama / "config.json")
    out = tmp_path / "out"
    ok(cli("fuse", llama, "-r", "llama-to-megatron-gpt", "--to", "megatron", "--ckpt-format", "torch_dist", "--tp",
           "2", "-o", out))
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert (out / "config.json").read_bytes() == CONFIG.read_bytes()
    assert_same_model(read_megatron_dist(str(out)).tensors, read_megatron_dist(str(MEGATRON / "gpt-tp2-torch_dist")).tensors)
    common, _ = read_torch_tree(str(out / "release" / "common.pt"), records=RECORDS)
    assert common["args"].field("tensor_model_parallel_size") == 2
    back = tmp_path / "back"
    ok(cli("unfuse", out, "-o", back))
    restored = parse_safetensors(back / "model.safetensors")[0]
    full = parse_safetensors(MEGATRON / "reference" / "gpt-tp2-full.safetensors")[0]
    assert restored == full  # the whole recorded history undone: megatron's parameters, names and bytes


def test_mixtral_unfused_to_torch_dist_equals_megatrons_moe_save(cli, tmp_path):
    """megatron's MoE parameters fused to a Hugging Face Mixtral, unfused straight to torch_dist:
    the tensors of megatron's own EP=2 torch_dist save; args count the experts and the top-k."""
    mixtral = tmp_path / "mixtral"
    ok(cli("fuse", MEGATRON / "reference" / "moe-ep2-full.safetensors", "-r", "megatron-moe-to-mixtral", "--config",
           MEGATRON / "hf-config" / "mixtral" / "config.json", "-o", mixtral))
    shutil.copy(MEGATRON / "hf-config" / "mixtral" / "config.json", mixtral / "config.json")
    out = tmp_path / "out"
    ok(cli("unfuse", mixtral, "--to", "megatron", "--ckpt-format", "torch_dist", "-o", out))
    assert_same_model(read_megatron_dist(str(out)).tensors, read_megatron_dist(str(MEGATRON / "moe-ep2-torch_dist")).tensors)
    common, _ = read_torch_tree(str(out / "release" / "common.pt"), records=RECORDS)
    assert (common["args"].field("num_experts"), common["args"].field("moe_router_topk")) == (4, 2)


def test_api_keyword_and_the_legacy_default():
    """``ckpt_format`` is the API's keyword: refused without ``to="megatron"``; ``"torch"`` writes
    the legacy rank files, as leaving it out does."""
    import tempfile

    from fusectl import convert

    folder = Path(tempfile.mkdtemp())
    with pytest.raises(PlanError, match="ckpt_format"):
        convert(str(MEGATRON / "gpt-tp2-torch_dist"), str(folder / "a"), ckpt_format="torch_dist")
    assert not (folder / "a").exists()
    convert(str(MEGATRON / "gpt-tp2-torch_dist"), str(folder / "b"), to="megatron", ckpt_format="torch", tp=2)
    assert sorted(os.listdir(folder / "b" / "iter_0000010")) == ["mp_rank_00", "mp_rank_01"]


def test_mapping_is_one_both_ways():
    """stacked_slot (the writer's) inverts layer_name (the reader's) over every fixture key."""
    for variant in DIST:
        for name in read_megatron_dist(str(MEGATRON / variant)).tensors:
            slot = stacked_slot(name)
            if slot is not None:
                key, index = slot
                assert layer_name(key, *index) == name


# ------------------------------------------------------------------------------- refused


def test_ckpt_format_without_to_megatron_is_refused(cli, tmp_path):
    out = tmp_path / "out"
    refused(cli("convert", MEGATRON / "gpt-tp2-torch_dist", "--ckpt-format", "torch_dist", "-o", out),
            "--ckpt-format", "--to megatron", unwritten=[out])
    refused(cli("convert", MEGATRON / "gpt-tp2-torch_dist", "--to", "dcp", "--ckpt-format", "torch", "-o", out),
            "--ckpt-format", unwritten=[out])


def test_an_optimizer_is_refused_not_dropped_silently(cli, tmp_path):
    out = tmp_path / "out"
    refused(cli("convert", MEGATRON / "gpt-tp2-legacy", "--to", "megatron", "--ckpt-format", "torch_dist", "-o", out),
            "optimizer", "--drop-optimizer", unwritten=[out])


def test_unwritable_cases_are_refused_before_writing(cli, tmp_path):
    out = tmp_path / "out"
    refused(cli("convert", MEGATRON / "gpt-tp2-torch_dist", "--to", "megatron", "--ckpt-format", "torch_dist",
                "--tp", "3", "-o", out), "--tp", unwritten=[out])
    refused(cli("convert", MEGATRON / "gpt-tp2-torch_dist", "--to", "megatron", "--ckpt-format", "torch_dist",
                "-o", tmp_path / "model.safetensors"), "folder", unwritten=[tmp_path / "model.safetensors"])
    refused(cli("convert", FIXTURES / "tiny-llama-gqa", "--to", "megatron", "--ckpt-format", "torch_dist",
                "-o", out), "llama-to-megatron-gpt", unwritten=[out])
    result = cli("convert", MEGATRON / "gpt-tp2-torch_dist", "--to", "megatron", "--ckpt-format", "zarr", "-o", out)
    assert result.exit_code == 2 and not out.exists()


def test_a_layer_that_does_not_stack_is_refused_naming_it(tmp_path):
    model = dict(read_megatron_dist(str(MEGATRON / "gpt-tp2-torch_dist")).tensors)
    model["decoder.layers.1.mlp.linear_fc2.weight"] = model["embedding.word_embeddings.weight"]
    with pytest.raises(PlanError, match="decoder.layers.1.mlp.linear_fc2.weight"):
        write_megatron_dist(str(tmp_path / "out"), model, tp=1, pp=1, config=json.loads(CONFIG.read_text()),
                            tied=False)
    model = dict(read_megatron_dist(str(MEGATRON / "moe-ep2-torch_dist")).tensors)
    model["decoder.layers.1.mlp.experts.local_experts.4.linear_fc2.weight"] = \
        model["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"]
    with pytest.raises(PlanError, match=r"layer 1 holds experts \[0, 1, 2, 3, 4\]"):  # sizes_of, before stacking
        write_megatron_dist(str(tmp_path / "out"), model, tp=1, pp=1, config=json.loads(CONFIG.read_text()),
                            tied=False)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------- megatron-core itself

VENV = Path("/work/venvs/megatron/bin/python")


def _interpreter() -> str | None:
    """A Python with torch and megatron-core: this one, else the megatron venv's; None: none."""
    try:
        import megatron.core  # noqa: F401
        import torch  # noqa: F401
        return sys.executable
    except ImportError:
        return str(VENV) if VENV.exists() else None


def load_and_compare(rank: int, world: int, name: str, written: str, original: str, out: str, tp: str, pp: str,
                     port: int) -> None:
    """One rank: megatron-core's GPTModel at ``tp`` × ``pp`` (the other ranks expert-parallel)
    loads fusectl's save and megatron's own with ``dist_checkpointing.load``; every parameter
    bitwise equal; the logits of fusectl's saved by the last stage's first TP rank."""
    import torch
    import torch.distributed as dist

    g = megatron_rank(rank, world, port)
    from megatron.core import dist_checkpointing, parallel_state

    spec = g.VARIANTS[name]
    tp, pp = int(tp), int(pp)
    ep = world // (tp * pp)
    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    models = []
    for folder in (written, original):
        torch.manual_seed(g.SEED + 1)  # a fresh init: everything must come from the load
        model = g.build_model(spec, tp, pp, ep)
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(iteration(Path(folder))))
        model.load_state_dict(loaded["model"])
        models.append(model)
    mine, theirs = (m.state_dict() for m in models)
    assert list(mine) == list(theirs)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(mine[key], value), key
    models[0].eval()
    with torch.no_grad():
        logits, _ = g.pipeline_forward(models[0], g.reference_ids(), grad=False)
    if logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0 and \
            parallel_state.get_data_parallel_rank() == 0:
        np.save(out, logits.numpy())
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("variant, source", [("gpt-tp2", "gpt-tp2-torch_dist"), ("tied-tp2-pp2", "tied-tp2-pp2-torch_dist"),
                                             ("moe-ep2", "moe-ep2-torch_dist"), ("gpt-tp2", "reference/gpt-tp2-full.safetensors")])
def test_megatron_core_loads_the_written_save_at_any_parallelism(cli, tmp_path, variant, source):
    """megatron-core's own dist_checkpointing.load of fusectl's save, at TP=2 and TP=1 (EP=2 and
    EP=1 for MoE; TP=2 × PP=2 too for the tied model, whose last stage loads its head from the
    embedding's key), gives every parameter bitwise as its load of megatron's save, and the
    logits megatron-core computed before saving (within 1e-5)."""
    python = _interpreter()
    if python is None:
        pytest.skip("torch and megatron-core are not installed here (nor /work/venvs/megatron)")
    out = tmp_path / "out"
    config = ["--config", CONFIG] if source.endswith(".safetensors") else []
    ok(cli("convert", MEGATRON / source, *config, "--to", "megatron", "--ckpt-format", "torch_dist", "-o", out))
    reference = np.load(MEGATRON / "reference" / f"{variant}.npz")
    root = Path(__file__).resolve().parent.parent
    layouts = {"moe-ep2": [(1, 1, 2), (1, 1, 1)], "tied-tp2-pp2": [(2, 1, 2), (1, 1, 1), (2, 2, 4)]}
    for tp, pp, world in layouts.get(variant, [(2, 1, 2), (1, 1, 1)]):
        logits = tmp_path / f"logits-{tp}-{pp}-{world}.npy"
        run = subprocess.run([python, __file__, variant, str(out), str(MEGATRON / f"{variant}-torch_dist"),
                              str(logits), str(tp), str(pp), str(world)], capture_output=True, text=True,
                             timeout=300, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
        assert run.returncode == 0, run.stderr[-3000:]
        got = np.load(logits)
        assert got.shape == reference["logits"].shape
        assert np.abs(got - reference["logits"]).max() <= 1e-5, (tp, pp, world)


if __name__ == "__main__":  # the ranks of the test above, spawned by torch.multiprocessing
    import torch.multiprocessing as mp

    port = 29700 + os.getpid() % 1000
    mp.spawn(load_and_compare, args=(int(sys.argv[7]), *sys.argv[1:7], port), nprocs=int(sys.argv[7]))
