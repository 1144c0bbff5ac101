"""PyTorch files as people have them, through every command (issue 11): training dicts folded
straight from a ``.pth`` against PyTorch's own results, a sharded ``pytorch_model*.bin`` folder,
``--key``, ``convert`` and ``verify``. The files are made by fixtures/generate_pytorch_inputs.py."""

from __future__ import annotations

import json

import numpy as np
import safetensors.numpy
from safetensors.numpy import load_file

from conftest import FIXTURES, ok, refused
from test_reparam import assert_rel_close
from test_rnn import _rnn_model, _run

REPARAM = FIXTURES / "reparam"
CRNN = REPARAM / "crnn_training.pth"  # zip format, {"model_state_dict", "optimizer_state_dict", ...}
VOCODER = REPARAM / "vocoder_training.pth"  # legacy format, {"model", "config_dict"}
LLAMA_BIN = FIXTURES / "tiny-llama-gqa-bin"


def test_inspect_picks_the_model_state_dict_of_a_training_dict_and_says_so(cli):
    report = json.loads(ok(cli("inspect", CRNN, "--json")).stdout)
    assert report["format"] == "pytorch" and report["state_dict_key"] == "model_state_dict"
    expected = load_file(REPARAM / "crnn_sequential.safetensors")
    got = {p["name"]: (p["dtype"], p["shape"]) for p in report["parameters"]}
    names = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64"}
    assert got == {n: (names[a.dtype], list(a.shape)) for n, a in expected.items()}
    text = ok(cli("inspect", CRNN)).stdout
    assert "state dict: model_state_dict (pass --key to choose another)" in text


def test_convert_of_a_training_dict_is_the_state_dict_bitwise(cli, tmp_path):
    out = tmp_path / "crnn.safetensors"
    ok(cli("convert", CRNN, "-o", out))
    got, expected = load_file(out), load_file(REPARAM / "crnn_sequential.safetensors")
    assert sorted(got) == sorted(expected)
    assert all(got[n].dtype == expected[n].dtype and got[n].tobytes() == expected[n].tobytes() for n in expected)


def test_conv_bn_fold_from_a_pth_matches_pytorchs_fusion(cli, tmp_path):
    out = tmp_path / "folded.safetensors"
    before = CRNN.read_bytes()
    ok(cli("fuse", CRNN, "-r", "conv-bn-fold", "-o", out))
    reference = load_file(REPARAM / "crnn_sequential.reference.safetensors")
    assert_rel_close({n: v for n, v in load_file(out).items() if n in reference}, reference, 1e-5)
    assert CRNN.read_bytes() == before


def test_lstm_to_onnx_from_a_pth_reproduces_pytorchs_lstm(cli, tmp_path):
    out = tmp_path / "packed.safetensors"
    ok(cli("fuse", CRNN, "--key", "model_state_dict", "-r", "conv-bn-fold", "-r", "lstm-to-onnx", "-o", out))
    got = load_file(out)
    io = load_file(REPARAM / "crnn_training.io.safetensors")
    model, outputs = _rnn_model("lstm", [(got["rnn.W_l0"], got["rnn.R_l0"], got["rnn.B_l0"])], dirs=2)
    result = _run(model, outputs, io["x"])
    for name in outputs:
        np.testing.assert_allclose(result[name], io[name], rtol=0, atol=1e-5, err_msg=name)


def test_weight_norm_fold_from_a_legacy_format_model_dict(cli, tmp_path):
    report = json.loads(ok(cli("inspect", VOCODER, "--json")).stdout)
    assert report["state_dict_key"] == "model"
    out = tmp_path / "folded.safetensors"
    ok(cli("fuse", VOCODER, "-r", "weight-norm-fold", "-o", out))
    assert_rel_close(load_file(out), load_file(REPARAM / "weight_norm_legacy.reference.safetensors"), 1e-6)


def test_verify_replays_on_the_pth_itself(cli, tmp_path):
    out = tmp_path / "folded.safetensors"
    ok(cli("fuse", CRNN, "-r", "conv-bn-fold", "-o", out))
    report = tmp_path / "report.json"
    ok(cli("verify", CRNN, out, "--report", report))
    assert json.loads(report.read_text())["passed"]


def test_a_key_that_is_not_a_state_dict_names_the_keys_there_are(cli):
    refused(cli("inspect", CRNN, "--key", "model"), str(CRNN), "model_state_dict")


def test_a_sharded_bin_folder_reads_like_its_safetensors_twin(cli, tmp_path):
    report = json.loads(ok(cli("inspect", LLAMA_BIN, "--json")).stdout)
    twin = json.loads(ok(cli("inspect", FIXTURES / "tiny-llama-gqa", "--json")).stdout)
    assert report["format"] == "pytorch-sharded" and len(report["files"]) == 2
    assert report["parameters"] == twin["parameters"] and report["ties"] == twin["ties"]
    a, b = tmp_path / "from-bin", tmp_path / "from-safetensors"
    ok(cli("fuse", LLAMA_BIN, "-r", "llama-qkv", "-r", "llama-gate-up", "-o", a))
    ok(cli("fuse", FIXTURES / "tiny-llama-gqa", "-r", "llama-qkv", "-r", "llama-gate-up", "-o", b))
    got = {n: v for f in sorted(a.glob("*.safetensors")) for n, v in safetensors.numpy.load_file(str(f)).items()}
    want = {n: v for f in sorted(b.glob("*.safetensors")) for n, v in safetensors.numpy.load_file(str(f)).items()}
    assert sorted(got) == sorted(want) and all(got[n].tobytes() == want[n].tobytes() for n in want)
    # the output folder is a safetensors folder: no stale .bin index travels with it
    assert not list(a.glob("*.bin*")) and (a / "config.json").exists()
