"""Reparametrization folds against what PyTorch itself produced (fixtures/reparam/)."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file, save_file

from fusectl.cli import main
from fusectl.dtypes import BY_NAME
from fusectl.errors import PlanError
from fusectl.ops.reparam import BnFold, SpectralNormFold, WeightNormFold, WeightNormUnfold
from fusectl.tensors import TensorSpec

REPARAM = Path(__file__).resolve().parent.parent / "fixtures" / "reparam"


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result


def fuse(tmp_path, ckpt, *rules, name="out.safetensors", extra=()):
    out = tmp_path / name
    args = ["fuse", ckpt, *[x for r in rules for x in ("-r", r)], "-o", out, "--quiet", *extra]
    result = run(*args)
    assert result.exit_code == 0, result.output
    return out


def assert_rel_close(actual: dict, expected: dict, rtol: float):
    assert sorted(actual) == sorted(expected)
    for name in expected:
        a, e = actual[name], expected[name]
        assert a.dtype == e.dtype and a.shape == e.shape, name
        scale = np.max(np.abs(e))
        err = np.max(np.abs(a.astype(np.float64) - e.astype(np.float64)))
        assert err <= rtol * scale, f"{name}: max error {err:.3g} > {rtol} x {scale:.3g}"


@pytest.mark.parametrize("stem", ["weight_norm_legacy", "weight_norm_parametrizations"])
def test_weight_norm_fold_matches_pytorch_for_every_dim(tmp_path, stem):
    # one preset folds Linear dim 0/1/None, Conv1d, grouped Conv1d, ConvTranspose1d and dim 2
    out = fuse(tmp_path, REPARAM / f"{stem}.safetensors", "weight-norm-fold")
    assert_rel_close(load_file(out), load_file(REPARAM / f"{stem}.reference.safetensors"), 1e-6)


@pytest.mark.parametrize("stem", ["spectral_norm_legacy", "spectral_norm_parametrizations"])
def test_spectral_norm_fold_matches_pytorch(tmp_path, stem):
    # includes ConvTranspose2d(8,4,4) (dim 1, equal axes) and ConvTranspose2d dim 0 where
    # both axes fit len(u) and the power-iteration pair decides
    out = fuse(tmp_path, REPARAM / f"{stem}.safetensors", "spectral-norm-fold")
    assert_rel_close(load_file(out), load_file(REPARAM / f"{stem}.reference.safetensors"), 1e-5)


def test_conv_bn_fold_matches_torch_fusion_and_drops_counters(tmp_path):
    out = fuse(tmp_path, REPARAM / "conv_bn.safetensors", "conv-bn-fold")
    folded = load_file(out)
    assert not any("num_batches_tracked" in n or ".bn" in n for n in folded)
    assert_rel_close(folded, load_file(REPARAM / "conv_bn.reference.safetensors"), 1e-5)


CONVT_RULES = """
version = 1
[[rule]]
name = "up"
op = "bn_fold"
weight = "{m}.weight"
bias = "{m}.bias"
gamma = "{m}_bn.weight"
beta = "{m}_bn.bias"
mean = "{m}_bn.running_mean"
var = "{m}_bn.running_var"
output_weight = "{m}.weight"
output_bias = "{m}.bias"
layer = "conv_transpose"
groups = GROUPS
"""


def _conv_transpose2d(x, w, b, stride, groups):
    """Direct ConvTranspose2d (no padding) in float64, written from its definition."""
    n, cin, h, wd = x.shape
    cin_g, cout_g, k, _ = w.shape[0] // groups, w.shape[1], w.shape[2], w.shape[3]
    out = np.zeros((n, cout_g * groups, (h - 1) * stride + k, (wd - 1) * stride + k))
    for i in range(cin):
        g = i // cin_g
        for j in range(cout_g):
            for y in range(h):
                for xx in range(wd):
                    out[:, g * cout_g + j, y * stride:y * stride + k, xx * stride:xx * stride + k] += (
                        x[:, i, y, xx][:, None, None] * w[i, j]
                    )
    return out + b[None, :, None, None]


def test_grouped_conv_transpose_bn_fold_reproduces_pytorch_outputs(tmp_path):
    # torch.nn.utils.fusion gets grouped ConvTranspose wrong; the fixture stores the real
    # eval-mode output of conv_transpose -> BatchNorm, which the folded layer must reproduce
    rules = tmp_path / "up.toml"
    rules.write_text(CONVT_RULES.replace("{m}", "up").replace("GROUPS", "2"))
    out = fuse(tmp_path, REPARAM / "convtranspose_bn.safetensors", rules, extra=["--untie"])
    folded = load_file(out)
    io = load_file(REPARAM / "convtranspose_bn.io.safetensors")
    y = _conv_transpose2d(io["x"].astype(np.float64), folded["up.weight"].astype(np.float64),
                          folded["up.bias"].astype(np.float64), stride=2, groups=2)
    assert y.shape == io["y"].shape
    np.testing.assert_allclose(y, io["y"], rtol=1e-5, atol=1e-5)


def test_ungrouped_conv_transpose_and_linear_bn_fold_match_torch_fusion(tmp_path):
    rules = tmp_path / "r.toml"
    rules.write_text(
        CONVT_RULES.replace("{m}", "up1").replace("GROUPS", "1")
        + CONVT_RULES.split("[[rule]]")[1].join(["[[rule]]", ""]).replace("{m}", "fc")
        .replace('"conv_transpose"', '"linear"').replace("groups = GROUPS", "").replace('"up"', '"fc"')
    )
    out = fuse(tmp_path, REPARAM / "convtranspose_bn.safetensors", rules)
    folded, reference = load_file(out), load_file(REPARAM / "convtranspose_bn.reference.safetensors")
    for name in ("up1.weight", "up1.bias", "fc.weight", "fc.bias"):
        np.testing.assert_allclose(folded[name], reference[name], rtol=1e-5, atol=1e-6 * np.abs(reference[name]).max())


def test_legacy_to_parametrizations_renames_exactly_and_round_trips(tmp_path):
    src = REPARAM / "weight_norm_legacy.safetensors"
    out = fuse(tmp_path, src, "weight-norm-legacy-to-parametrizations")
    renamed = load_file(out)
    expected = load_file(REPARAM / "weight_norm_parametrizations.safetensors")
    assert sorted(renamed) == sorted(expected)  # exactly the names PyTorch's new API writes
    for name in expected:
        assert renamed[name].tobytes() == expected[name].tobytes()
    back = tmp_path / "back.safetensors"
    assert run("unfuse", out, "-o", back, "--quiet").exit_code == 0
    original, restored = load_file(src), load_file(back)
    assert sorted(original) == sorted(restored)
    assert all(original[n].tobytes() == restored[n].tobytes() for n in original)
    via_preset = fuse(tmp_path, out, "weight-norm-parametrizations-to-legacy", name="legacy.safetensors")
    assert all(load_file(via_preset)[n].tobytes() == original[n].tobytes() for n in original)


def test_spectral_legacy_to_parametrizations_uses_pytorch_names(tmp_path):
    out = fuse(tmp_path, REPARAM / "spectral_norm_legacy.safetensors", "spectral-norm-legacy-to-parametrizations")
    assert sorted(load_file(out)) == sorted(load_file(REPARAM / "spectral_norm_parametrizations.safetensors"))


def test_fold_unfold_fold_reproduces_first_fold(tmp_path):
    src = REPARAM / "weight_norm_legacy.safetensors"
    folded = fuse(tmp_path, src, "weight-norm-fold")
    unfolded = tmp_path / "unfolded.safetensors"
    assert run("unfuse", folded, "-o", unfolded, "--quiet").exit_code == 0
    names = sorted(load_file(unfolded))
    assert names == sorted(load_file(src))
    again = fuse(tmp_path, unfolded, "weight-norm-fold", name="again.safetensors")
    assert_rel_close(load_file(again), load_file(folded), 1e-6)


@pytest.mark.parametrize("stem,preset", [("spectral_norm_legacy", "spectral-norm-fold"), ("conv_bn", "conv-bn-fold")])
def test_unfuse_of_one_way_fold_is_refused(tmp_path, stem, preset):
    out = fuse(tmp_path, REPARAM / f"{stem}.safetensors", preset)
    back = tmp_path / "back.safetensors"
    result = run("unfuse", out, "-o", back)
    assert result.exit_code == 2
    assert "one-way" in result.output and "rule '" in result.output
    assert not back.exists()


def _bad(tmp_path, tensors, preset_or_rules, expect):
    src = tmp_path / "in.safetensors"
    save_file(tensors, str(src))
    before = src.read_bytes()
    out = tmp_path / "out.safetensors"
    result = run("fuse", src, "-r", preset_or_rules, "-o", out)
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error:") or "\nerror:" in result.output
    assert expect in result.output
    assert "Traceback" not in result.output
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if "fusectl-tmp" in p.name] == []
    assert src.read_bytes() == before


def test_zero_norm_slice_is_an_error_naming_the_tensor(tmp_path):
    v = np.ones((3, 4), np.float32)
    v[1] = 0
    _bad(tmp_path, {"lin.weight_g": np.ones((3, 1), np.float32), "lin.weight_v": v},
         "weight-norm-fold", "lin.weight_v")


def test_nonpositive_sigma_is_an_error(tmp_path):
    w = np.eye(3, 2, dtype=np.float32)  # only axis 0 fits len(u) = 3
    _bad(tmp_path, {"lin.weight_orig": w, "lin.weight_u": np.array([1, 0, 0], np.float32),
                    "lin.weight_v": np.array([-1, 0], np.float32)}, "spectral-norm-fold", "σ")


def test_negative_variance_is_an_error(tmp_path):
    bn = {f"bn1.{k}": np.ones(2, np.float32) for k in ("weight", "bias", "running_mean")}
    bn["bn1.running_var"] = np.array([1.0, -1.0], np.float32)
    _bad(tmp_path, {"conv1.weight": np.ones((2, 1, 1, 1), np.float32), **bn}, "conv-bn-fold", "var=bn1.running_var")


def test_spectral_auto_dim_asks_for_dim_when_nothing_decides():
    op = SpectralNormFold()
    w = np.ones((4, 4, 3, 3), np.float32)
    u = np.ones(4, np.float32)
    v = np.ones(36, np.float32)
    # all-ones data: both axes align perfectly, so neither decides
    with pytest.raises(Exception, match="set dim"):
        op.apply([w, u, v])


def test_weight_norm_auto_dim_reads_g_shape():
    f32 = BY_NAME["F32"]
    op = WeightNormFold()
    spec = lambda *s: TensorSpec(f32, s)
    assert op.infer([spec(1, 1, 5), spec(8, 4, 5)], ["g", "v"]) == [spec(8, 4, 5)]
    with pytest.raises(PlanError, match="more than one axis"):
        op.infer([spec(8, 1, 5), spec(8, 4, 5)], ["g", "v"])


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float64])
def test_numeric_ops_cast_back_to_the_stored_dtype(dtype):
    rng = np.random.default_rng(0)
    v = rng.standard_normal((4, 3)).astype(dtype)
    g = rng.uniform(0.5, 2, (4, 1)).astype(dtype)
    (w,) = WeightNormFold().apply([g, v])
    assert w.dtype == np.dtype(dtype)
    expected = v.astype(np.float64) * g.astype(np.float64) / np.linalg.norm(v.astype(np.float64), axis=1, keepdims=True)
    tol = {np.float16: 2e-3, ml_dtypes.bfloat16: 1e-2, np.float64: 1e-12}[dtype]
    np.testing.assert_allclose(w.astype(np.float64), expected, rtol=tol, atol=tol)
    g2, v2 = WeightNormUnfold(dim=0).apply([w])
    assert g2.shape == (4, 1) and v2 is w


def test_bn_fold_without_bias_treats_it_as_zeros():
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    gamma, beta = np.array([2, 3], np.float32), np.array([1, -1], np.float32)
    mean, var = np.array([0.5, 1], np.float32), np.array([4 - 1e-5, 9 - 1e-5], np.float32)
    op = BnFold(layer="linear").for_present([True, False, True, True, True, True])
    folded, bias = op.apply([w, gamma, beta, mean, var])
    np.testing.assert_allclose(folded, w * np.array([[1.0], [1.0]]), rtol=1e-6)  # gamma/sqrt(var+eps) = 1
    np.testing.assert_allclose(bias, [0.5 * -1 + 1, -1 * 1 - 1], rtol=1e-6)


def test_weight_norm_fold_of_0d_tensors(tmp_path):
    src = tmp_path / "s.safetensors"
    save_file({"m.weight_g": np.array(2.0, np.float32), "m.weight_v": np.array(-3.0, np.float32)}, str(src))
    out = fuse(tmp_path, src, "weight-norm-fold")
    assert load_file(out)["m.weight"] == np.float32(-2.0)  # g * v / |v|
