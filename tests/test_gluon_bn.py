"""Gluon Conv + BatchNorm folds against real MXNet 1.9.1 (fixtures/mxnet/conv-bn/, written by
fixtures/generate_mxnet.py): for BatchNorm(scale=False) — MXNet's fix_gamma, the file holding a
gamma MXNet ignores — and scale=True, from the save_parameters file and from the export, the folded
layer run by an independent numpy convolution reproduces MXNet's own inference output; fix_gamma
and eps come from the -symbol.json beside an export, and a save_parameters file, which cannot say,
makes the rule say (the Gluon presets are explicit, a rule that does not write fix_gamma is refused)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from conftest import FIXTURES, ok, refused, snapshot, write_rules
from fusectl.io.checkpoint import open_checkpoint
from fusectl.ops.reparam import BatchNormFacts, BnFold, NormFacts

CONV_BN = FIXTURES / "mxnet" / "conv-bn"
# MXNet's output is float32; the numpy consumer computes in float64 from the folded float32 tensors
TOLERANCE = 1e-5

STRUCTURAL = """version = 1
[[rule]]
op = "bn_fold"
weight = "conv.weight"
bias = "conv.bias"
gamma = "bn.gamma"
beta = "bn.beta"
mean = "bn.running_mean"
var = "bn.running_var"
output_weight = "conv.weight"
output_bias = "conv.bias"
"""


def conv2d(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Convolution (stride 1, no padding, NCHW) plus bias, in float64: MXNet's Convolution as Gluon's
    Conv2D(3, 3) runs it."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    kh, kw = w.shape[2:]
    h, wd = x.shape[2] - kh + 1, x.shape[3] - kw + 1
    out = np.zeros((x.shape[0], w.shape[0], h, wd))
    for i in range(kh):
        for j in range(kw):
            out += np.einsum("nchw,oc->nohw", x[:, :, i:i + h, j:j + wd], w[:, :, i, j])
    return out + b.astype(np.float64)[None, :, None, None]


def folded_output(path, weight: str, bias: str, stem: str) -> float:
    """The max abs difference between the folded layer (from the .npz at ``path``) on MXNet's input
    and MXNet's output."""
    io = np.load(CONV_BN / f"{stem}.io.npz")
    with np.load(path) as folded:
        tensors = [name for name in folded.files if not name.startswith("__fusectl")]
        assert sorted(tensors) == sorted([weight, bias])  # BatchNorm's four tensors are gone
        y = conv2d(io["x"], folded[weight], folded[bias])
    return float(np.max(np.abs(y - io["y"])))


def fold_steps(cli, ckpt, rules: str) -> list[dict]:
    """The steps ``plan --json`` shows for ``rules`` on ``ckpt``."""
    return [step for group in ok(cli("plan", str(ckpt), "-r", rules, "--json")).json()["groups"]
            for step in group["steps"]]


@pytest.fixture
def conv_bn(tmp_path):
    """A copy of fixtures/mxnet/conv-bn (the exports need their -symbol.json beside them)."""
    return shutil.copytree(CONV_BN, tmp_path / "conv-bn")


@pytest.mark.parametrize("stem", ["bn-noscale", "bn-scale"])
def test_export_folds_with_the_symbols_fix_gamma_and_eps(cli, conv_bn, tmp_path, stem):
    before = snapshot(conv_bn)
    out = tmp_path / "folded.npz"
    ok(cli("fuse", str(conv_bn / f"{stem}-0000.params"), "-r", "gluon-bn-fold", "-o", str(out)))
    assert folded_output(out, "arg:convbn_conv0_weight", "arg:convbn_conv0_bias", stem) <= TOLERANCE
    assert snapshot(conv_bn) == before


@pytest.mark.parametrize("stem, fix_gamma", [("bn-noscale", "true"), ("bn-scale", "false")])
def test_save_parameters_folds_with_the_rules_fix_gamma(cli, conv_bn, tmp_path, stem, fix_gamma):
    rules = write_rules(tmp_path / "r.toml", STRUCTURAL + f"fix_gamma = {fix_gamma}\neps = 2e-5\n")
    out = tmp_path / "folded.npz"
    ok(cli("fuse", str(conv_bn / f"{stem}.params"), "-r", str(rules), "-o", str(out)))
    assert folded_output(out, "conv.weight", "conv.bias", stem) <= TOLERANCE


def test_the_gamma_mxnet_ignores_is_in_the_file_and_would_change_the_result(cli, conv_bn, tmp_path):
    """The bug this fixes: folding the stored gamma of a scale=False BatchNorm is far off MXNet."""
    stored = open_checkpoint(str(conv_bn / "bn-noscale.params")).table["bn.gamma"].read()
    assert not np.allclose(stored, 1)  # the file holds a gamma, and it is not ones
    rules = write_rules(tmp_path / "r.toml", STRUCTURAL + "fix_gamma = false\neps = 2e-5\n")
    out = tmp_path / "wrong.npz"
    ok(cli("fuse", str(conv_bn / "bn-noscale.params"), "-r", str(rules), "-o", str(out)))
    assert folded_output(out, "conv.weight", "conv.bias", "bn-noscale") > 0.1


def test_an_ignored_gamma_does_not_change_the_fold(cli, conv_bn, tmp_path):
    """Any gamma at all, under fix_gamma = true: the folded tensors are bitwise the same."""
    table = open_checkpoint(str(conv_bn / "bn-noscale.params")).table
    arrays = {name: table[name].read() for name in table.names()}
    results = []
    for k, gamma in enumerate([arrays["bn.gamma"], np.array([7.0, -3.0, 0.25], np.float32)]):
        src = tmp_path / f"in{k}.npz"
        np.savez(src, **{**arrays, "bn.gamma": gamma})
        rules = write_rules(tmp_path / "r.toml", STRUCTURAL + "fix_gamma = true\neps = 2e-5\n")
        out = tmp_path / f"out{k}.npz"
        ok(cli("fuse", str(src), "-r", str(rules), "-o", str(out)))
        with np.load(out) as folded:
            results.append({name: folded[name].tobytes() for name in ("conv.weight", "conv.bias")})
    assert results[0] == results[1]
    assert folded_output(tmp_path / "out1.npz", "conv.weight", "conv.bias", "bn-noscale") <= TOLERANCE


def test_a_rule_without_fix_gamma_on_an_export_takes_the_symbols(cli, conv_bn, tmp_path):
    """What the issue saw (a PyTorch-style rule folding the ignored gamma, exit 0) cannot happen on
    an export: fix_gamma and eps not written are the symbol's."""
    rules = write_rules(tmp_path / "r.toml", STRUCTURAL.replace('"conv.', '"arg:convbn_conv0_')
                        .replace('"bn.running', '"aux:convbn_batchnorm0_running').replace('"bn.', '"arg:convbn_batchnorm0_')
                        .replace(".weight\"", "_weight\"").replace(".bias\"", "_bias\"").replace(".gamma\"", "_gamma\"")
                        .replace(".beta\"", "_beta\"").replace("running.mean", "running_mean"))
    out = tmp_path / "folded.npz"
    (step,) = fold_steps(cli, conv_bn / "bn-noscale-0000.params", str(rules))
    ok(cli("fuse", str(conv_bn / "bn-noscale-0000.params"), "-r", str(rules), "-o", str(out)))
    assert (step["params"]["fix_gamma"], step["params"]["eps"]) == (True, 2e-5)
    assert folded_output(out, "arg:convbn_conv0_weight", "arg:convbn_conv0_bias", "bn-noscale") <= TOLERANCE


@pytest.mark.parametrize("rule_tail", ["", 'fix_gamma = "symbol"\n'])
def test_save_parameters_without_fix_gamma_is_refused(cli, conv_bn, tmp_path, rule_tail):
    rules = write_rules(tmp_path / "r.toml", STRUCTURAL + rule_tail)
    out = tmp_path / "folded.npz"
    result = cli("fuse", str(conv_bn / "bn-noscale.params"), "-r", str(rules), "-o", str(out))
    refused(result, "bn-noscale.params has no -symbol.json", "fix_gamma = true", "gluon-bn-fold-no-scale",
            unwritten=[out])


def test_gluon_bn_fold_refuses_a_save_parameters_file(cli, conv_bn, tmp_path):
    out = tmp_path / "folded.npz"
    refused(cli("fuse", str(conv_bn / "bn-scale.params"), "-r", "gluon-bn-fold", "-o", str(out)),
            "no -symbol.json", "gluon-bn-fold-scale", unwritten=[out])


@pytest.mark.parametrize("preset, stem", [("gluon-bn-fold-scale", "bn-noscale"), ("gluon-bn-fold-no-scale", "bn-scale")])
def test_an_explicit_preset_that_contradicts_the_symbol_is_refused(cli, conv_bn, tmp_path, preset, stem):
    out = tmp_path / "folded.npz"
    refused(cli("fuse", str(conv_bn / f"{stem}-0000.params"), "-r", preset, "-o", str(out)),
            "convbn_batchnorm0_fwd", "has fix_gamma", "gluon-bn-fold", unwritten=[out])


@pytest.mark.parametrize("stem, preset", [("bn-noscale", "gluon-bn-fold-no-scale"), ("bn-scale", "gluon-bn-fold-scale")])
def test_the_explicit_presets_fold_a_save_parameters_file_with_gluons_default_eps(cli, conv_bn, tmp_path, stem, preset):
    """The fixtures' BatchNorms have epsilon 2e-5, not Gluon's default 1e-5: the preset's fold is
    that far from MXNet (below 1e-4, above the fold with the right eps)."""
    out = tmp_path / "folded.npz"
    (step,) = fold_steps(cli, conv_bn / f"{stem}.params", preset)
    ok(cli("fuse", str(conv_bn / f"{stem}.params"), "-r", preset, "-o", str(out)))
    assert step["params"]["fix_gamma"] is (preset == "gluon-bn-fold-no-scale")
    assert folded_output(out, "conv.weight", "conv.bias", stem) < 1e-4


@pytest.mark.parametrize("eps", ["1e999", "-1e-05", "nan", "inf"])
def test_a_symbol_eps_that_is_not_a_finite_number_at_least_0_is_refused_naming_the_node(cli, conv_bn, tmp_path, eps):
    # 1e999 read as infinity folded with exit 0 into all-zero weights: the layer made a constant
    symbol = conv_bn / "bn-scale-symbol.json"
    symbol.write_text(symbol.read_text().replace('"eps": "2e-05"', f'"eps": "{eps}"'))
    before = snapshot(conv_bn)
    out = tmp_path / "folded.npz"
    refused(cli("fuse", str(conv_bn / "bn-scale-0000.params"), "-r", "gluon-bn-fold", "-o", str(out)),
            "bn-scale-symbol.json", "'convbn_batchnorm0_fwd' (BatchNorm)", f"eps is '{eps}', not a finite number ≥ 0",
            unwritten=[out])
    assert snapshot(conv_bn) == before


def test_a_pairing_the_graph_contradicts_is_refused():
    facts = BatchNormFacts("m-0000.params", "m-symbol.json",
                           (NormFacts("bn0_fwd", "bn0_gamma", 1e-5, False, 1, "conv1_fwd", "Convolution", "conv1_weight"),))
    names = ["arg:conv0_weight", None, "arg:bn0_gamma", "arg:bn0_beta", "aux:bn0_running_mean", "aux:bn0_running_var"]
    with pytest.raises(Exception, match="whose weight is 'conv1_weight', not 'arg:conv0_weight'"):
        facts.resolve(BnFold(), names)
    deconv = BatchNormFacts("m", "s", (NormFacts("bn0_fwd", "bn0_gamma", 1e-5, False, 1, "d", "Deconvolution", "conv0_weight"),))
    with pytest.raises(Exception, match="conv_transpose"):
        deconv.resolve(BnFold(), names)
    assert deconv.resolve(BnFold(layer="conv_transpose"), names).layer == "conv_transpose"


def test_fix_gamma_symbol_on_a_checkpoint_that_is_no_mxnet_file_is_refused(cli, tmp_path):
    table = open_checkpoint(str(CONV_BN / "bn-scale.params")).table
    src = tmp_path / "m.npz"
    np.savez(src, **{name: table[name].read() for name in table.names()})
    out = tmp_path / "out.npz"
    refused(cli("fuse", str(src), "-r", "gluon-bn-fold", "-o", str(out)), 'fix_gamma = "symbol"', "no MXNet",
            unwritten=[out])


def test_fix_gamma_takes_true_false_or_symbol(cli, conv_bn, tmp_path):
    rules = write_rules(tmp_path / "r.toml", STRUCTURAL + 'fix_gamma = "yes"\n')
    refused(cli("plan", str(conv_bn / "bn-scale.params"), "-r", str(rules)), "fix_gamma", '"symbol"')


@pytest.mark.parametrize("ckpt, preset", [("bn-noscale-0000.params", "gluon-bn-fold"),
                                          ("bn-noscale.params", "gluon-bn-fold-no-scale")])
def test_verify_rederives_the_fold_with_the_same_facts(cli, conv_bn, tmp_path, ckpt, preset):
    """verify replays the recorded rule on the reference with its symbol's facts (and its probe
    runs BatchNormalization with gamma 1 where fix_gamma is set)."""
    out = tmp_path / "folded.params"
    ok(cli("fuse", str(conv_bn / ckpt), "-r", preset, "-o", str(out)))
    result = ok(cli("verify", str(conv_bn / ckpt), str(out)))
    assert "re-derived from the recorded rule" in result.stdout and "FAIL" not in result.stdout
