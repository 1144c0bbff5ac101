"""A container output of a training dict keeps every entry of the container (issue 28.1).

A Lightning checkpoint saved without its optimizer (``save_checkpoint(weights_only=True)``, as
PESTO ships its ``mir-1k.ckpt``: ``epoch``, ``global_step``, ``loops``, ``hparams``…) and a
``{model, step}`` dict were written to ``.ckpt``/``.pt`` as a bare state dict, exit 0: PESTO's
loader then failed with ``KeyError: 'hparams'``. Now any PyTorch output of a training dict,
with or without an optimizer, is the whole container with only the model's tensors changed:
``convert`` gives the tree back unchanged, ``fuse`` changes only the state dict, ``unfuse``
gives the input back; entries of the state dict that are not tensors, and a top-level state
dict's other entries, stay where they were. An output that holds the model's tensors only
(``.safetensors``, a folder) says which entries it leaves out.

The Lightning shape is fixtures/training/lightning.ckpt (a real ``lightning.Trainer``
checkpoint) without what ``weights_only=True`` leaves out (``callbacks``,
``optimizer_states``, ``lr_schedulers``) and with the hyperparameters
``save_hyperparameters`` adds; the trees are written with ``fusectl.io.formats.torch_writer`` (byte for
byte what torch.save writes, ``test_torch_writer.py``). With torch installed, ``torch.load``
reads each output as the input, entry for entry.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

import fusectl
from conftest import FIXTURES, ok, run_cli
from fusectl import dtypes, training_output
from fusectl.io.formats.torch_file import read_torch_tree
from fusectl.io.formats.torch_writer import write_torch_file
from fusectl.tensors import ArrayTensor, LazyTensor, TensorSpec
from test_training_output import _differences as tree_differences

TRAINING = FIXTURES / "training"
RULES = ["-r", "llama-qkv", "-r", "llama-gate-up"]
CONFIG = ["--config", TRAINING / "config.json"]
F32 = dtypes.BY_NAME["F32"]


def tensor(array) -> ArrayTensor:
    array = np.asarray(array, np.float32)
    return ArrayTensor(TensorSpec(F32, array.shape), array)


def lightning_weights_only(path) -> dict:
    """fixtures/training/lightning.ckpt as ``Trainer.save_checkpoint(path, weights_only=True)``
    writes it, with the hyperparameters of a module that saved them; returns the tree."""
    tree, _ = read_torch_tree(str(TRAINING / "lightning.ckpt"))
    kept = {k: v for k, v in tree.items() if k not in ("callbacks", "optimizer_states", "lr_schedulers")}
    kept.update(hparams_name="kwargs", hyper_parameters={"lr": 0.001, "betas": (0.9, 0.999), "layers": [2, 2]})
    write_torch_file(str(path), kept)
    return kept


def model_step(path) -> dict:
    """``{"model": state dict, "step": 1200}``, the state dict holding a number among its tensors."""
    rng = np.random.default_rng(0)
    model = collections.OrderedDict([("w", tensor(rng.standard_normal((3, 2)))), ("version", 2),
                                     ("b", tensor(rng.standard_normal(3)))])
    tree = {"model": model, "step": 1200, "note": "run 7"}
    write_torch_file(str(path), tree)
    return tree


def tree_of(path):
    return fusectl.open_checkpoint(str(path)).training.tree()


def test_a_lightning_checkpoint_without_optimizer_converts_whole(tmp_path):
    src, out = tmp_path / "weights.ckpt", tmp_path / "copy.ckpt"
    lightning_weights_only(src)
    result = ok(run_cli("convert", src, "-o", out))
    assert "not written" not in result.output
    assert tree_differences(tree_of(src), tree_of(out)) == []
    assert list(read_torch_tree(str(out))[0]) == ["epoch", "global_step", "pytorch-lightning_version", "state_dict",
                                                   "loops", "hparams_name", "hyper_parameters"]


def test_a_fused_lightning_checkpoint_without_optimizer_changes_only_its_state_dict(tmp_path):
    src, fused, back = tmp_path / "weights.ckpt", tmp_path / "fused.ckpt", tmp_path / "back.ckpt"
    lightning_weights_only(src)
    ok(run_cli("fuse", src, *RULES, *CONFIG, "-o", fused))
    before, after = tree_of(src), tree_of(fused)
    assert list(after) == list(before)
    assert tree_differences({k: v for k, v in before.items() if k != "state_dict"},
                            {k: v for k, v in after.items() if k != "state_dict"}) == []
    names = list(after["state_dict"])
    assert "model.model.layers.0.self_attn.qkv_proj.weight" in names and len(names) == 15
    # the fused tensor where its first part was: after the embedding, before o_proj
    assert names[:3] == ["model.model.embed_tokens.weight", "model.model.layers.0.self_attn.qkv_proj.weight",
                         "model.model.layers.0.self_attn.o_proj.weight"]
    ok(run_cli("unfuse", fused, "-o", back))
    assert tree_differences(before, tree_of(back)) == []


def test_a_model_and_step_dict_keeps_its_step_and_the_state_dicts_other_entries(tmp_path):
    src, out, fused = tmp_path / "m.pt", tmp_path / "copy.pt", tmp_path / "fused.pt"
    model_step(src)
    ok(run_cli("convert", src, "-o", out))
    assert tree_differences(tree_of(src), tree_of(out)) == []
    rules = tmp_path / "rename.toml"
    rules.write_text('version = 1\n[[rule]]\nop = "rename"\ninput = "w"\noutput = "weight"\n')
    ok(run_cli("fuse", src, "-r", rules, "-o", fused))
    tree = read_torch_tree(str(fused))[0]
    assert tree["step"] == 1200 and tree["note"] == "run 7"
    assert list(tree["model"]) == ["weight", "version", "b"] and tree["model"]["version"] == 2


def test_a_top_level_state_dict_keeps_its_other_entries(tmp_path):
    out = tmp_path / "copy.pt"
    ok(run_cli("convert", FIXTURES / "torch" / "mixed.pt", "-o", out))
    assert tree_differences(read_torch_tree(str(FIXTURES / "torch" / "mixed.pt"))[0], read_torch_tree(str(out))[0]) == []


def test_a_model_only_output_names_the_entries_it_leaves_out(tmp_path):
    src = tmp_path / "weights.ckpt"
    lightning_weights_only(src)
    result = ok(run_cli("convert", src, "-o", tmp_path / "model.safetensors"))
    assert "'hyper_parameters'" in result.stderr and "'epoch'" in result.stderr and "not written" in result.stderr


def test_without_its_optimizer_a_training_dict_still_drops_only_the_optimizer(tmp_path):
    # --drop-optimizer: the optimizer out, every other entry in
    out = tmp_path / "dropped.pt"
    ok(run_cli("convert", TRAINING / "llama-adamw.pt", "--drop-optimizer", "-o", out))
    before, after = tree_of(TRAINING / "llama-adamw.pt"), tree_of(out)
    assert list(after) == [k for k in before if k != "optimizer_state_dict"]
    assert tree_differences({k: before[k] for k in after}, after) == []


@pytest.mark.parametrize("command", ["convert", "fuse"])
def test_a_tensor_missing_from_the_dict_to_write_is_a_bug_and_nothing_is_written(tmp_path, monkeypatch, command):
    # a model tensor that did not reach the tree: exit 70, never an output short of it (with or
    # without an optimizer: write_container and write_training share the check)
    out = tmp_path / "out.pt"
    if command == "convert":
        src = tmp_path / "m.pt"
        model_step(src)
        args = ["convert", src]
    else:
        args = ["fuse", TRAINING / "llama-adamw.pt", *RULES, *CONFIG]
    made = training_output.model_dict

    def losing_one(*given, **kwargs):
        node = made(*given, **kwargs)
        node.pop(next(k for k in reversed(node) if isinstance(node[k], LazyTensor)))
        return node

    monkeypatch.setattr(training_output, "model_dict", losing_one)
    result = run_cli(*args, "-o", out)
    assert result.exit_code == 70 and "is not in the training dict to write" in result.stderr
    assert not out.exists() and not list(tmp_path.glob(".*fusectl-tmp*"))


@pytest.mark.parametrize("make", [lightning_weights_only, model_step])
def test_torch_loads_the_output_as_the_input(tmp_path, make):
    torch = pytest.importorskip("torch")
    src, out = tmp_path / "in.pt", tmp_path / "out.pt"
    make(src)
    ok(run_cli("convert", src, "-o", out))
    a, b = torch.load(src, weights_only=True), torch.load(out, weights_only=True)

    def same(x, y) -> bool:
        if type(x) is not type(y):
            return False
        if isinstance(x, torch.Tensor):
            return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        if isinstance(x, dict):
            return list(x) == list(y) and all(same(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(same(p, q) for p, q in zip(x, y))
        return x == y

    assert same(a, b)
    assert not any(isinstance(v, LazyTensor) for v in b.values())
