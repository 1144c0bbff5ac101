"""Real training files that ship inside pip wheels: their optimizer state follows the rules.

Resemblyzer 0.1.4 (``pip install resemblyzer``) ships ``resemblyzer/pretrained.pt``, the voice
encoder of Real-Time-Voice-Cloning as its training loop saved it: ``{"step", "model_state",
"optimizer_state"}``, a 3-layer ``nn.LSTM`` (hidden 256) and a linear layer with Adam's
``exp_avg`` / ``exp_avg_sq`` / ``step`` (step 1,564,500) for each of its 16 parameters, in the
legacy (pre-zip) torch format, storages on ``cuda:0`` and the state keyed by Python object ids.
``lstm-to-onnx`` re-lays it out for ONNX's LSTM (gates i,f,g,o → i,o,f,c, biases concatenated,
a direction axis): each moment must be its weight's re-layout, ``step`` kept, and ``unfuse``
must give every tensor back bitwise. Skipped where the wheel is not installed (its weights are
never committed).

SevenNet 0.13.0 (``pip install --no-deps sevenn==0.13.0``) ships its pretrained interatomic
potential as a training checkpoint: an e3nn model (121 tensors, 34 of them parameters, the rest
``output_mask`` and Wigner-3j buffers shaped like some parameters), Adam's state in one group,
and a pickled config that calls ``torch.device`` (refused without torch: it is re-saved here with
torch, its state dicts only). Its order must be given once (issue 28): fused with
``--param-order``, the output records the parameter of each id, so ``unfuse`` needs no order and
gives back what ``torch.load`` reads as the original, every tensor bitwise and every dict in order.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import fusectl
from conftest import ok, run_cli

HIDDEN = 256


def _pretrained() -> Path:
    spec = importlib.util.find_spec("resemblyzer")  # finds the package without importing it (torch, librosa)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("resemblyzer is not installed (pip install resemblyzer)")
    path = Path(next(iter(spec.submodule_search_locations))) / "pretrained.pt"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


def _states(path) -> tuple[dict, dict]:
    """(parameter name → its array, parameter name → {state key → array or number})."""
    checkpoint = fusectl.open_checkpoint(str(path))
    state, mapping = checkpoint.optimizer_mapped
    model = {name: checkpoint.table.entries[name].read() for name in checkpoint.table.entries}
    moments = {mapping.names[pid]: {k: (v.read() if hasattr(v, "read") else v) for k, v in entry.items()}
               for pid, entry in state.states.items()}
    return model, moments


def _iofc(rows: np.ndarray) -> np.ndarray:
    i, f, g, o = np.split(rows, 4)
    return np.concatenate([i, o, f, g])


def test_resemblyzers_adam_moments_follow_the_lstm_to_onnx_layout_and_unfuse_bitwise(tmp_path):
    source = _pretrained()
    fused, back = tmp_path / "fused.pt", tmp_path / "back.pt"
    ok(run_cli("fuse", source, "-r", "lstm-to-onnx", "-o", fused))
    ok(run_cli("unfuse", fused, "-o", back))

    model, moments = _states(source)
    fused_model, fused_moments = _states(fused)
    assert len(moments) == 16 and len(fused_moments) == 13
    for layer in range(3):
        for key in ("exp_avg", "exp_avg_sq"):
            w = fused_moments[f"lstm.W_l{layer}"][key]
            assert w.shape[0] == 1 and np.array_equal(w[0], _iofc(moments[f"lstm.weight_ih_l{layer}"][key]))
            r = fused_moments[f"lstm.R_l{layer}"][key]
            assert np.array_equal(r[0], _iofc(moments[f"lstm.weight_hh_l{layer}"][key]))
            b = fused_moments[f"lstm.B_l{layer}"][key]
            want = np.concatenate([_iofc(moments[f"lstm.bias_{k}_l{layer}"][key]) for k in ("ih", "hh")])
            assert np.array_equal(b[0], want)
        assert np.array_equal(fused_model[f"lstm.W_l{layer}"][0], _iofc(model[f"lstm.weight_ih_l{layer}"]))
        assert float(fused_moments[f"lstm.W_l{layer}"]["step"]) == float(moments[f"lstm.weight_ih_l{layer}"]["step"])

    back_model, back_moments = _states(back)
    assert list(back_model) == list(model)
    for name, array in model.items():
        assert back_model[name].dtype == array.dtype and np.array_equal(back_model[name], array), name
        for key, value in moments[name].items():
            assert np.array_equal(np.asarray(back_moments[name][key]), np.asarray(value)), f"{name}::{key}"


def _sevennet(tmp_path) -> tuple[Path, Path]:
    """SevenNet-0's checkpoint as its state dicts re-saved with torch, and its parameter order
    (the state dict without e3nn's buffers: ``output_mask``, the Wigner-3j ``_w3j_*``, and the
    convolutions' ``denominator``)."""
    spec = importlib.util.find_spec("sevenn")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sevenn is not installed (pip install --no-deps sevenn==0.13.0)")
    path = Path(next(iter(spec.submodule_search_locations))) / "pretrained_potentials" / "SevenNet_0__11Jul2024" / \
        "checkpoint_sevennet_0.pth"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    torch = pytest.importorskip("torch")
    checkpoint = torch.load(path, weights_only=False, map_location="cpu")  # the real framework reads its config
    source = tmp_path / "sevennet.pt"
    torch.save({k: checkpoint[k] for k in ("model_state_dict", "optimizer_state_dict", "scheduler_state_dict",
                                           "epoch")}, source)
    order = tmp_path / "order.json"
    order.write_text(json.dumps([n for n in checkpoint["model_state_dict"]
                                 if not any(b in n for b in ("output_mask", "_w3j_", "denominator"))]))
    return source, order


def test_sevennets_training_checkpoint_fused_with_an_order_unfuses_without_it_bitwise(tmp_path):
    source, order = _sevennet(tmp_path)
    torch = pytest.importorskip("torch")
    rules = tmp_path / "t.toml"
    rules.write_text('version = 1\n[[rule]]\nop = "transpose"\ninput = "{i}_convolution.weight_nn.layer1.weight"\n'
                     'output = "{i}_convolution.weight_nn.layer1.weight_t"\n')
    fused, back = tmp_path / "fused.pt", tmp_path / "back.pt"
    ok(run_cli("fuse", source, "-r", rules, "--param-order", order, "-o", fused))
    ok(run_cli("unfuse", fused, "-o", back))

    def equal(a, b, where="") -> None:
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), where
        elif isinstance(a, dict):
            assert list(a) == list(b), where
            for k in a:
                equal(a[k], b[k], f"{where}.{k}")
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b)):
                equal(x, y, f"{where}[{i}]")
        else:
            assert a == b, where

    equal(torch.load(source, weights_only=True), torch.load(back, weights_only=True))
