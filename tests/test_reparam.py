"""Reparametrization folds against what PyTorch itself produced (fixtures/reparam/)."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file, save_file

from fusectl.cli import main
from fusectl.dtypes import BY_NAME
from fusectl.errors import ComputeError, PlanError
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


def _conv1d(x, w, b, padding, dilation=1):
    """PyTorch's conv1d (stride 1, one group) in float64."""
    x = np.pad(x, ((0, 0), (0, 0), (padding, padding)))
    length = x.shape[2] - dilation * (w.shape[2] - 1)
    out = sum(np.einsum("oi,bit->bot", w[:, :, k], x[:, :, k * dilation:k * dilation + length]) for k in range(w.shape[2]))
    return out + b[None, :, None]


def test_conv_bn_fold_folds_attributes_named_conv_and_bn_as_pytorch_computes(tmp_path):
    # AttaCut's ConvolutionBatchNorm ({m}.conv + {m}.bn, dilated Conv1d) and a top-level
    # conv + bn: the folded model gives the eval-mode output PyTorch stored
    out = fuse(tmp_path, REPARAM / "conv_bn_attr.safetensors", "conv-bn-fold")
    folded = load_file(out)
    assert sorted(folded) == sorted(f"{m}.{t}" for m in ("conv", "conv1.conv", "conv2.conv") for t in ("weight", "bias"))
    assert_rel_close(folded, load_file(REPARAM / "conv_bn_attr.reference.safetensors"), 1e-5)
    io = load_file(REPARAM / "conv_bn_attr.io.safetensors")
    f = {n: a.astype(np.float64) for n, a in folded.items()}
    h = np.maximum(_conv1d(io["x"].astype(np.float64), f["conv.weight"], f["conv.bias"], padding=1), 0)
    y = np.maximum(_conv1d(h, f["conv1.conv.weight"], f["conv1.conv.bias"], padding=1),
                   _conv1d(h, f["conv2.conv.weight"], f["conv2.conv.bias"], padding=6, dilation=3))
    np.testing.assert_allclose(y, io["y"], rtol=1e-5, atol=1e-5)


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


# ------------------------------------------------ nn.Sequential naming: {n} + {n+1}, layer auto


def test_conv_bn_fold_of_sequential_names_matches_torch_fusion(tmp_path):
    """A CRNN built from nn.Sequential: cnn.0+1, cnn.4 (no bias)+5, cnn.7+8 are Conv2d+BN2d,
    head.0+1 Linear+BN1d; the LSTM between them passes through. Through the real CLI."""
    src = REPARAM / "crnn_sequential.safetensors"
    before = src.read_bytes()
    out = tmp_path / "out.safetensors"
    result = run("fuse", src, "-r", "conv-bn-fold", "-o", out)
    assert result.exit_code == 0, result.output
    folded, original = load_file(out), load_file(src)
    reference = load_file(REPARAM / "crnn_sequential.reference.safetensors")
    untouched = sorted(n for n in original if n.startswith("rnn."))
    assert len(untouched) == 8
    assert sorted(folded) == sorted([*reference, *untouched])  # no BN tensor, no counter left
    assert "cnn.4.bias" in folded and "cnn.4.bias" not in original  # the bias-free conv gained one
    assert_rel_close({n: folded[n] for n in reference}, reference, 1e-5)
    assert all(folded[n].tobytes() == original[n].tobytes() for n in untouched)
    assert src.read_bytes() == before


def test_sequential_fold_reproduces_the_model_outputs(tmp_path):
    # the eval-mode head output PyTorch stored: Linear on the folded weights gives it back
    out = fuse(tmp_path, REPARAM / "crnn_sequential.safetensors", "conv-bn-fold")
    folded = load_file(out)
    io = load_file(REPARAM / "crnn_sequential.io.safetensors")
    y = io["x_head"].astype(np.float64) @ folded["head.0.weight"].T.astype(np.float64) + folded["head.0.bias"]
    np.testing.assert_allclose(y, io["y_head"], rtol=1e-5, atol=1e-5)


def test_sequential_steps_record_the_layer_auto_resolved_to(tmp_path):
    result = run("plan", REPARAM / "crnn_sequential.safetensors", "-r", "conv-bn-fold", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    layers = {s["inputs"][0]: s["params"]["layer"] for g in doc["groups"] for s in g["steps"] if s["op"] == "bn_fold"}
    assert layers == {"cnn.0.weight": "conv", "cnn.4.weight": "conv", "cnn.7.weight": "conv", "head.0.weight": "linear"}


def _bn(prefix, c, counter=True):
    rng = np.random.default_rng(len(prefix) + c)
    t = {f"{prefix}.{k}": rng.uniform(0.5, 1.5, c).astype(np.float32)
         for k in ("weight", "bias", "running_mean", "running_var")}
    if counter:
        t[f"{prefix}.num_batches_tracked"] = np.array(10, np.int64)
    return t


def _ckpt(tmp_path, tensors, name="in.safetensors"):
    path = tmp_path / name
    save_file(tensors, str(path))
    return path


def test_bn_at_index_0_of_a_sequential_is_left_alone(tmp_path):
    # Sequential(BatchNorm2d, Conv2d, BatchNorm2d): s.0 has nothing before it
    tensors = {**_bn("s.0", 3), "s.1.weight": np.ones((4, 3, 1, 1), np.float32), **_bn("s.2", 4)}
    out = fuse(tmp_path, _ckpt(tmp_path, tensors), "conv-bn-fold")
    folded = load_file(out)
    assert sorted(folded) == sorted([*_bn("s.0", 3), "s.1.weight", "s.1.bias"])
    assert all(folded[n].tobytes() == tensors[n].tobytes() for n in _bn("s.0", 3))


def test_bn_after_a_relu_is_an_error_naming_the_missing_weight(tmp_path):
    # Sequential(Conv2d, ReLU, BatchNorm2d): the BN at 2 finds no layer weight at 1
    tensors = {"f.0.weight": np.ones((4, 3, 1, 1), np.float32), "f.0.bias": np.zeros(4, np.float32), **_bn("f.2", 4)}
    _bad(tmp_path, tensors, "conv-bn-fold", "'f.1.weight' not found (the rule found 'f.2.running_mean')")


def test_only_running_statistics_find_bn_bindings(tmp_path):
    """A layer weight pattern also fits the BN's own weight (cnn.1.weight as {n}=1): that is no
    binding, and neither is a torchvision conv{n} without bn{n}."""
    tensors = {"cnn.0.weight": np.ones((2, 1, 3, 3), np.float32), **_bn("cnn.1", 2),
               "cnn.3.weight": np.ones((2, 2, 3, 3), np.float32),  # a conv with no BN after it
               "m.conv2.weight": np.ones((2, 2, 1, 1), np.float32), "m.conv2.bias": np.ones(2, np.float32)}
    out = fuse(tmp_path, _ckpt(tmp_path, tensors), "conv-bn-fold")
    assert sorted(load_file(out)) == ["cnn.0.bias", "cnn.0.weight", "cnn.3.weight", "m.conv2.bias", "m.conv2.weight"]


@pytest.mark.parametrize("missing, expect", [
    ("bn1.running_var", "'bn1.running_var' not found (the rule found 'bn1.running_mean')"),
    ("bn1.weight", "'bn1.weight' not found"),
    ("conv1.weight", "'conv1.weight' not found"),
])
def test_a_bn_found_by_its_statistics_needs_every_other_input(tmp_path, missing, expect):
    tensors = {"conv1.weight": np.ones((2, 1, 1, 1), np.float32), **_bn("bn1", 2)}
    del tensors[missing]
    _bad(tmp_path, tensors, "conv-bn-fold", expect)


def _spec(*shape):
    return TensorSpec(BY_NAME["F32"], shape)


@pytest.mark.parametrize("shape, layer", [((6, 8), "linear"), ((6, 2, 5), "conv"), ((6, 2, 3, 3), "conv"),
                                          ((6, 2, 3, 3, 3), "conv")])
def test_layer_auto_reads_the_weight_rank(shape, layer):
    op = BnFold(layer="auto")
    specs = [_spec(*shape), _spec(6), *[_spec(6)] * 4]
    assert op.for_present(specs).layer == layer
    assert op.infer(specs, [f"x{k}" for k in range(6)]) == [_spec(*shape), _spec(6)]
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(s.shape).astype(np.float32) for s in specs]
    arrays[5] = np.abs(arrays[5]) + 0.5
    for a, b in zip(op.apply(arrays), BnFold(layer=layer).apply(arrays)):
        assert a.tobytes() == b.tobytes()


def test_layer_auto_refuses_a_weight_of_rank_1_naming_it():
    with pytest.raises(PlanError, match="'w' has shape \\[6\\]; layer = \"auto\""):
        BnFold(layer="auto").infer([_spec(6), *[_spec(6)] * 5], ["w", "b", "g", "be", "m", "v"])


def test_unknown_layer_keeps_its_error(tmp_path):
    rules = tmp_path / "r.toml"
    rules.write_text(CONVT_RULES.replace("{m}", "fc").replace("groups = GROUPS", "")
                     .replace('"conv_transpose"', '"deconv"'))
    _bad(tmp_path, load_file(REPARAM / "convtranspose_bn.safetensors"), rules,
         'layer = \'deconv\'; use "auto", "conv", "linear" or "conv_transpose"')


def test_shifted_index_below_zero_is_an_error_naming_the_rule(tmp_path):
    rules = tmp_path / "r.toml"
    rules.write_text('version = 1\n[[rule]]\nname = "back"\nop = "rename"\n'
                     'input = "l.{i:int}.w"\noutput = "l.{i-1}.w"\n')
    _bad(tmp_path, {"l.0.w": np.ones(2, np.float32)}, rules, "rule 'back'")
    _bad(tmp_path, {"l.0.w": np.ones(2, np.float32)}, rules, "{i-1} with i = 0 is -1; no name has a negative index")


# ------------------------------------------------------------------ refusals at plan time, op by op

WN = ["l.weight_g", "l.weight_v"]


def test_weight_norm_refuses_tensors_that_are_not_floating_point():
    with pytest.raises(PlanError, match=r"^'l.weight_g' is I32; weight_norm_fold needs floating-point tensors$"):
        WeightNormFold().infer([TensorSpec(BY_NAME["I32"], (4, 1)), _spec(4, 3)], WN)
    with pytest.raises(PlanError, match=r"'w' is I8; weight_norm_unfold needs floating-point tensors"):
        WeightNormUnfold().infer([TensorSpec(BY_NAME["I8"], (4, 3))], ["w"])


def test_weight_norm_refuses_g_of_another_rank_than_v():
    with pytest.raises(PlanError) as err:
        WeightNormFold().infer([_spec(4), _spec(4, 3)], WN)
    assert str(err.value) == ("'l.weight_g' has shape [4] but 'l.weight_v' has [4, 3]; g must have v's rank "
                              "(size-1 axes but one) or be 0-d")


@pytest.mark.parametrize("op", [WeightNormFold(dim="rows"), WeightNormUnfold(dim="rows"), WeightNormFold(dim=1.5)])
def test_a_dim_that_is_not_an_integer_auto_or_none_is_refused(op):
    specs = [_spec(4, 1), _spec(4, 3)] if op.kind == "weight_norm_fold" else [_spec(4, 3)]
    with pytest.raises(PlanError, match=rf"^{op.kind}: dim = .*; use an integer, \"auto\" or \"none\"$"):
        op.infer(specs, WN[:len(specs)])


def test_an_explicit_dim_refuses_g_of_another_shape():
    with pytest.raises(PlanError) as err:
        WeightNormFold(dim=1).infer([_spec(4, 1), _spec(4, 3)], WN)
    assert str(err.value) == "'l.weight_g' has shape [4, 1]; with dim 1 g must be [1, 3]"


def test_g_and_v_must_agree_along_dim():
    with pytest.raises(PlanError) as err:
        WeightNormFold(dim=0).infer([_spec(3, 1), _spec(4, 2)], WN)
    assert str(err.value) == "'l.weight_g' has 3 entries along dim 0, 'l.weight_v' has 4"


def test_weight_norm_fold_inverts_from_the_rule_only_with_an_explicit_dim():
    assert WeightNormFold(dim=1).inverse(None) == WeightNormUnfold(dim=1)
    assert WeightNormFold(dim="none").inverse(None) == WeightNormUnfold(dim="none")
    with pytest.raises(PlanError, match=r"dim = \"auto\" cannot be undone from the rule alone; set dim or unfuse "
                                        "with the provenance"):
        WeightNormFold().inverse(None)


def test_weight_norm_unfold_needs_an_explicit_dim_and_gives_two_outputs():
    op = WeightNormUnfold(dim="auto")
    assert op.output_count([_spec(4, 3)]) == 2
    with pytest.raises(PlanError, match=r"^weight_norm_unfold needs dim \(an integer or \"none\"\), not \"auto\"$"):
        op.infer([_spec(4, 3)], ["w"])
    assert WeightNormUnfold(dim="none").infer([_spec(4, 3)], ["w"]) == [_spec(), _spec(4, 3)]
    with pytest.raises(PlanError, match=r"'w' has 2 dimensions; dim 2 is out of range"):
        WeightNormUnfold(dim=2).infer([_spec(4, 3)], ["w"])


SN = ["l.weight_orig", "l.weight_u", "l.weight_v"]


def test_spectral_norm_refuses_u_or_v_that_are_not_vectors():
    with pytest.raises(PlanError) as err:
        SpectralNormFold().infer([_spec(4, 3), _spec(4, 1), _spec(3)], SN)
    assert str(err.value) == "'l.weight_u' and 'l.weight_v' must be vectors (shapes [4, 1], [3])"


@pytest.mark.parametrize("dim", [2, -3, "none"])
def test_spectral_norm_refuses_a_dim_the_weight_does_not_have(dim):
    with pytest.raises(PlanError, match=rf"^'l.weight_orig' has 2 dimensions; dim {dim} is invalid$"):
        SpectralNormFold(dim=dim).infer([_spec(4, 3), _spec(4), _spec(3)], SN)


@pytest.mark.parametrize("dim, words", [("auto", "no axis 0 or 1 fits"), (1, "no dim 1 fits")])
def test_spectral_norm_refuses_vectors_that_fit_no_axis(dim, words):
    with pytest.raises(PlanError) as err:
        SpectralNormFold(dim=dim).infer([_spec(4, 3), _spec(5), _spec(3)], SN)
    assert str(err.value) == f"'l.weight_orig' has shape [4, 3], but u has 5 and v 3 entries: {words}"


def test_spectral_norm_accepts_the_dim_that_fits():
    assert SpectralNormFold(dim=-1).infer([_spec(4, 3), _spec(3), _spec(4)], SN) == [_spec(4, 3)]


BN = ["conv.weight", "conv.bias", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"]


@pytest.mark.parametrize("op, weight, words", [
    (BnFold(layer="linear"), (6, 2, 3), "'conv.weight' has shape [6, 2, 3]; a linear weight is (out, in)"),
    (BnFold(layer="conv"), (6,), "'conv.weight' has shape [6]; a conv weight has at least 2 dimensions"),
    (BnFold(layer="conv_transpose", groups=4), (6, 1, 3), "'conv.weight': 6 input channels do not split into "
                                                          "4 groups"),
    (BnFold(layer="conv_transpose", groups=0), (6, 1, 3), "'conv.weight': 6 input channels do not split into "
                                                          "0 groups"),
])
def test_bn_fold_refuses_a_weight_that_is_not_its_layers(op, weight, words):
    with pytest.raises(PlanError) as err:
        op.infer([_spec(*weight)] + [_spec(6)] * 5, BN)
    assert str(err.value) == words


def test_bn_fold_refuses_statistics_of_the_wrong_length_with_a_conv_transpose_hint():
    with pytest.raises(PlanError) as err:
        BnFold(layer="conv").infer([_spec(6, 2, 3, 3), _spec(6), _spec(6), _spec(6), _spec(2), _spec(6)], BN)
    assert str(err.value) == ("'bn.running_mean' has shape [2]; 'conv.weight' has 6 output channels as a conv "
                              "weight; if 'conv.weight' is a ConvTranspose (its output channels are axis 1), "
                              "write a bn_fold rule with layer = \"conv_transpose\"")


def test_bn_fold_refuses_integer_statistics():
    with pytest.raises(PlanError, match=r"'bn.running_var' is I64; bn_fold needs floating-point tensors"):
        BnFold().infer([_spec(6, 2, 3)] + [_spec(6)] * 4 + [TensorSpec(BY_NAME["I64"], (6,))], BN)


def test_verify_probes_a_grouped_conv_transpose_fold(tmp_path):
    rules = tmp_path / "up.toml"
    rules.write_text(CONVT_RULES.replace("{m}", "up").replace("GROUPS", "2"))
    src = REPARAM / "convtranspose_bn.safetensors"
    out = fuse(tmp_path, src, rules, extra=["--untie"])
    report = tmp_path / "verify.json"
    result = run("verify", src, out, "--report", report)
    assert result.exit_code == 0, result.output
    checks = json.loads(report.read_text())
    assert checks["passed"] is True
    probes = [c for c in checks["checks"] if c["kind"] == "probe"]
    assert len(probes) == 1 and probes[0]["passed"]
    assert probes[0]["name"].startswith(f"rule 'up' ({rules}): bn_fold F32[4, 3, 3, 3]")
    # the layer's output: 4 input channels → 2 groups × 3, a 3×3 input grown by the 3×3 kernel
    assert "float32[1, 6, 5, 5]" in result.output


def _fold(op, w, gamma, var=1.0):
    c = gamma.shape[0]
    return op.apply([w, np.zeros(c, w.dtype), gamma.astype(w.dtype), np.zeros(c, w.dtype), np.zeros(c, w.dtype),
                     np.full(c, var, w.dtype)])


def test_bn_fold_refuses_a_channel_its_scale_underflows_to_zero_of_a_grouped_conv_transpose():
    # ConvTranspose2d(4, 6, groups=2): weight [4, 3, k, k]; channel 4 is group 1's j = 1 (rows 2-3, column 1)
    op = BnFold(layer="conv_transpose", groups=2)
    w = np.ones((4, 3, 2, 2), np.float16)
    gamma = np.ones(6, np.float32)
    gamma[4] = 1e-30  # float16 holds it as 0 already: the channel's scale is 0, not a vanished one
    _fold(op, w, gamma)
    gamma[4] = 1e-4  # a scale float16 holds, times weights that make the folded channel underflow
    w[2:, 1] = 1e-4
    with pytest.raises(ComputeError, match=r"1 output channel\(s\) \(first: 4\) become all zeros: .* float16"):
        _fold(op, w, gamma)
    w[2:, 1] = 0  # a channel that was all zeros stays so: nothing vanished
    folded, _ = _fold(op, w, gamma)
    assert not folded[2:, 1].any() and folded[:2].all()


def test_bn_fold_keeps_a_channel_whose_gamma_is_zero():
    # gamma 0 zeroes a channel on purpose (a pruned channel): that is the fold, not an underflow
    folded, bias = _fold(BnFold(), np.ones((3, 2, 1, 1), np.float32), np.array([1.0, 0.0, 2.0], np.float32))
    assert folded[1, 0, 0, 0] == 0.0
    np.testing.assert_allclose(folded[[0, 2], 0, 0, 0], np.array([1.0, 2.0]) / np.sqrt(1 + 1e-5), rtol=1e-6)


@pytest.mark.parametrize("eps", [float("inf"), float("nan"), -1e-5])
def test_bn_fold_plans_only_with_a_finite_eps_at_least_0_wherever_it_came_from(eps):
    spec = TensorSpec(BY_NAME["F32"], (3,))
    with pytest.raises(PlanError, match="finite number ≥ 0"):
        BnFold(eps=eps).infer([TensorSpec(BY_NAME["F32"], (3, 2, 1, 1)), spec, spec, spec, spec, spec],
                              ["w", "b", "g", "be", "m", "v"])
