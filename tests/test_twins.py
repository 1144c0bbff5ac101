"""A copy of the model in a training dict (twins.py) that the model's plan does not bind to as it
binds to the model: tied otherwise than the model, a tensor of another shape, a tensor an op
refuses. Each is exit 2 naming the file, the copy and the tensor, and nothing is written. And
what ``inspect`` says of each copy.

The input is timm's training dict with an EMA (fixtures/training/twins/timm.pth.tar), its copy
edited and written back by fusectl's own torch writer."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import run_cli, snapshot
from fusectl.dtypes import from_numpy
from fusectl.io.formats.torch_file import read_torch_tree
from fusectl.io.formats.torch_writer import write_torch_file
from fusectl.tensors import ArrayTensor, TensorSpec
from test_training_twins import TWINS

EMA = "state_dict_ema"
Q, K = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"


def _array(values: np.ndarray) -> ArrayTensor:
    return ArrayTensor(TensorSpec(from_numpy(values.dtype, "test"), values.shape), values)


def _tie_k_to_q(ema):
    ema[K] = ema[Q]  # one object: one storage, a tie the model does not have


def _k_of_another_shape(ema):
    ema[K] = _array(np.zeros((3, 5), np.float32))


def _k_in_half_precision(ema):
    ema[K] = _array(ema[K].read().astype(np.float16))


@pytest.mark.parametrize("edit, words", [
    (_tie_k_to_q, [f"ties '{K}', '{Q}', which the model does not tie"]),
    (_k_of_another_shape, [f"takes '{K}' as", "'state_dict_ema' holds"]),
    (_k_in_half_precision, ["attn-qkv", K]),
], ids=["a tie the model lacks", "another shape", "another dtype"])
def test_a_copy_the_plan_does_not_bind_like_the_model_is_refused(tmp_path, edit, words):
    src = tmp_path / "in"
    src.mkdir()
    tree, metadata = read_torch_tree(str(TWINS / "timm.pth.tar"))
    edit(tree[EMA])
    path = src / "timm.pth"
    write_torch_file(str(path), tree, metadata=metadata)
    before = snapshot(src)
    out = tmp_path / "out" / "fused.pth"
    out.parent.mkdir()
    result = run_cli("fuse", path, "-r", "llama-qkv", "--config", TWINS / "config.json", "-o", out)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: {path}: the model's copy '{EMA}'") and result.stderr.count("\n") == 1
    for word in [*words, "a copy of the model takes exactly the model's plan"]:
        assert word in result.stderr, result.stderr
    assert list(out.parent.iterdir()) == [] and snapshot(src) == before


@pytest.mark.parametrize("name, line", [
    ("timm.pth.tar", "copy of the model: state_dict_ema: 12 of its tensors (F32, I64); it takes the model's plan"),
    ("averaged.pt", "copy of the model: ema: 12 of its tensors (F32, I64), names under module., other entries "
                    "kept: n_averaged; it takes the model's plan"),
])
def test_inspect_says_what_each_copy_holds(name, line):
    result = run_cli("inspect", TWINS / name)
    assert result.exit_code == 0, result.output
    assert line in result.stdout.splitlines()
