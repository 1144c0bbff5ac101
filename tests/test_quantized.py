"""Quantized checkpoints: scales follow their weights through layout rules, or the rule stops.

The FP8 fixtures (``fixtures/generate_quantized.py``) are made with transformers' own FP8
quantizer (block 128x128, DeepSeek-V3 / Qwen3-FP8 layout) and compressed-tensors' per-channel
layout; the tensors here are compared byte for byte with a hand parser (``conftest``), and the
dequantized weights with PyTorch's (``fixtures/reference``) where it made them.
"""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest

from conftest import FIXTURES, array_of, load_checkpoint_raw, metadata_of, ok, refused, write_rules, write_safetensors
from fusectl.dtypes import BY_NAME
from fusectl.errors import PlanError
from fusectl.ops.dequantize import Dequantize, expand_scale, scale_grid
from fusectl.steps import Step
from fusectl.followers.scales import QuantScheme, Scales, scale_name, scheme_from
from fusectl.table import ParamTable
from fusectl.tensors import TensorSpec

LAYER = "model.layers.0"
ATTN, MLP = f"{LAYER}.self_attn", f"{LAYER}.mlp"


def raw(path):
    return load_checkpoint_raw(path)


# ----------------------------------------------------------------- block FP8: fuse and unfuse


def test_block_fp8_qkv_and_gate_up_fuse_as_byte_concats_of_weights_and_scales(cli, tmp_path):
    out = tmp_path / "fused"
    ok(cli("fuse", FIXTURES / "fp8-llama", "-r", "llama-qkv", "-r", "llama-gate-up", "-o", out))
    before, after = raw(FIXTURES / "fp8-llama"), raw(out)
    for layer in (0, 1):
        attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        for fused, parts in ((f"{attn}.qkv_proj", [f"{attn}.{p}_proj" for p in "qkv"]),
                             (f"{mlp}.gate_up_proj", [f"{mlp}.{p}_proj" for p in ("gate", "up")])):
            for suffix, dtype in ((".weight", "F8_E4M3"), (".weight_scale_inv", "F32")):
                got = after[fused + suffix]
                assert got[0] == dtype
                assert got[2] == b"".join(before[p + suffix][2] for p in parts)
                assert got[1][0] == sum(before[p + suffix][1][0] for p in parts)
                for p in parts:
                    assert p + suffix not in after
    # every scale still belongs to a weight of the output
    for name in after:
        if name.endswith("_scale_inv"):
            assert name[: -len("_scale_inv")] in after


def test_block_fp8_unfuse_restores_the_input_bitwise_config_included(cli, tmp_path):
    fused, back = tmp_path / "fused", tmp_path / "back"
    ok(cli("fuse", FIXTURES / "fp8-llama", "-r", "llama-qkv", "-r", "llama-gate-up", "-o", fused))
    ok(cli("unfuse", fused, "-o", back))
    assert raw(back) == raw(FIXTURES / "fp8-llama")
    assert (back / "config.json").read_bytes() == (FIXTURES / "fp8-llama" / "config.json").read_bytes()


def test_a_ragged_kv_layout_is_refused_naming_the_scale_block_and_boundary(cli, tmp_path):
    out = tmp_path / "fused"
    result = cli("fuse", FIXTURES / "fp8-llama-ragged", "-r", "llama-qkv", "-o", out)
    refused(result, f"{ATTN}.q_proj.weight_scale_inv", "block size 128", "boundary at row 288",
            f"{ATTN}.k_proj.weight", f"{ATTN}.v_proj.weight", "fp8-dequant", unwritten=[out])
    assert not list(tmp_path.iterdir())


def test_gate_up_of_320_rows_is_refused_at_row_320(cli, tmp_path):
    result = cli("plan", FIXTURES / "fp8-llama-ragged", "-r", "llama-gate-up")
    refused(result, f"{MLP}.gate_proj.weight_scale_inv", "boundary at row 320")


def test_a_ragged_last_part_is_allowed(tmp_path, cli):
    """Only the last part may end inside a block: [256 | 64] concatenates, scales [2 | 1]."""
    f8 = ml_dtypes.float8_e4m3fn
    rng = np.random.default_rng(0)
    tensors = {"a.weight": rng.standard_normal((256, 128)).astype(f8),
               "a.weight_scale_inv": rng.random((2, 1)).astype(np.float32),
               "b.weight": rng.standard_normal((64, 128)).astype(f8),
               "b.weight_scale_inv": rng.random((1, 1)).astype(np.float32)}
    path = write_safetensors(tmp_path / "m.safetensors", tensors)
    rules = write_rules(tmp_path / "r.toml", 'version = 1\n[quantization]\nblock_size = [128, 128]\n'
                        '[[rule]]\nop = "concat"\ninputs = ["a.weight", "b.weight"]\noutput = "ab.weight"\n')
    ok(cli("fuse", path, "-r", rules, "-o", tmp_path / "out.safetensors"))
    got = raw(tmp_path / "out.safetensors")
    assert got["ab.weight_scale_inv"][1] == [3, 1]
    swapped = write_rules(tmp_path / "s.toml", 'version = 1\n[quantization]\nblock_size = [128, 128]\n'
                          '[[rule]]\nop = "concat"\ninputs = ["b.weight", "a.weight"]\noutput = "ba.weight"\n')
    refused(cli("plan", path, "-r", swapped), "b.weight_scale_inv", "boundary at row 64")


def test_verify_passes_a_fused_fp8_checkpoint_and_catches_one_changed_scale_element(cli, tmp_path):
    out = tmp_path / "fused"
    ok(cli("fuse", FIXTURES / "fp8-llama", "-r", "llama-qkv", "-r", "llama-gate-up", "-o", out))
    ok(cli("verify", FIXTURES / "fp8-llama", out))
    # change one element of one fused scale, in place in the output file
    path = out / "model.safetensors"
    data = bytearray(path.read_bytes())
    entry = raw(out)[f"{ATTN}.qkv_proj.weight_scale_inv"]
    at = bytes(data).index(entry[2])
    value = np.frombuffer(bytes(data[at:at + 4]), np.float32)[0]
    data[at:at + 4] = np.float32(value * 1.5).tobytes()
    path.write_bytes(bytes(data))
    result = cli("verify", FIXTURES / "fp8-llama", out)
    assert result.exit_code == 1, result.output
    assert "qkv_proj.weight_scale_inv" in result.stdout


# ----------------------------------------------------------------- per-channel (compressed-tensors)


def test_per_channel_scales_follow_their_rows_and_equal_input_scales_merge(cli, tmp_path):
    out, back = tmp_path / "fused", tmp_path / "back"
    ok(cli("fuse", FIXTURES / "fp8-llama-channel", "-r", "llama-qkv", "-r", "llama-gate-up", "-o", out))
    before, after = raw(FIXTURES / "fp8-llama-channel"), raw(out)
    parts = [f"{ATTN}.{p}_proj" for p in "qkv"]
    assert after[f"{ATTN}.qkv_proj.weight_scale"][2] == b"".join(before[p + ".weight_scale"][2] for p in parts)
    assert after[f"{ATTN}.qkv_proj.weight_scale"][1] == [512, 1]
    assert after[f"{ATTN}.qkv_proj.input_scale"] == before[f"{ATTN}.q_proj.input_scale"]
    assert after[f"{MLP}.gate_up_proj.input_scale"] == before[f"{MLP}.gate_proj.input_scale"]
    ok(cli("unfuse", out, "-o", back))
    assert raw(back) == before  # the merged input scale is copied back to q, k and v
    ok(cli("verify", FIXTURES / "fp8-llama-channel", out))


def test_unequal_per_tensor_scales_are_refused_not_requantized(cli, tmp_path, copy_fixture):
    folder = copy_fixture("fp8-llama-channel")
    tensors = raw(folder)
    arrays = {n: array_of(e) for n, e in tensors.items()}
    arrays[f"{ATTN}.k_proj.input_scale"] = (arrays[f"{ATTN}.k_proj.input_scale"].astype(np.float32) * 2).astype(
        arrays[f"{ATTN}.k_proj.input_scale"].dtype)
    write_safetensors(folder / "model.safetensors", arrays)
    out = tmp_path / "fused"
    result = cli("fuse", folder, "-r", "llama-qkv", "-o", out)
    refused(result, "attn-qkv", f"{ATTN}.q_proj.input_scale", "does not requantize", unwritten=[out])


# ----------------------------------------------------------------- experts (stack / unstack)


def test_expert_scales_stack_with_their_weights_and_unstack_back(cli, tmp_path):
    out, back = tmp_path / "stacked", tmp_path / "back"
    ok(cli("fuse", FIXTURES / "fp8-moe", "-r", "mixtral-experts", "-o", out))
    before, after = raw(FIXTURES / "fp8-moe"), raw(out)
    moe = f"{LAYER}.block_sparse_moe.experts"
    for n in (1, 2, 3):
        scale = after[f"{moe}.w{n}_scale_inv"]
        assert scale[1] == [4, 1, 1]
        assert scale[2] == b"".join(before[f"{moe}.{e}.w{n}.weight_scale_inv"][2] for e in range(4))
    assert not any(".0.w1.weight_scale_inv" in n for n in after)
    ok(cli("unfuse", out, "-o", back))
    assert raw(back) == before
    ok(cli("verify", FIXTURES / "fp8-moe", out))


# ----------------------------------------------------------------- fp8-dequant


def _dequantized(weight, scale, block=(128, 128)) -> np.ndarray:
    """float32(w) · scale, block-broadcast with np.kron (not fusectl's code), rounded to bf16."""
    w = array_of(weight).astype(np.float32)
    s = array_of(scale).astype(np.float32)
    if s.shape == (w.shape[0], 1) or s.size == 1:
        full = np.broadcast_to(s.reshape(s.shape + (1,) * (w.ndim - s.ndim)), w.shape)
    else:
        full = np.kron(s, np.ones(block, np.float32))[: w.shape[0], : w.shape[1]]
    return (w * full).astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("fixture", ["fp8-llama", "fp8-llama-ragged", "fp8-llama-channel", "fp8-moe"])
def test_fp8_dequant_is_float32_w_times_scale_rounded_to_bf16_bitwise(cli, tmp_path, fixture):
    out = tmp_path / "plain"
    ok(cli("fuse", FIXTURES / fixture, "-r", "fp8-dequant", "-o", out))
    before, after = raw(FIXTURES / fixture), raw(out)
    weights = [n for n in before if n.endswith(".weight") and (n + "_scale_inv" in before or n + "_scale" in before)]
    assert weights
    for name in weights:
        scale = before.get(name + "_scale_inv") or before[name + "_scale"]
        assert after[name][0] == "BF16" and after[name][1] == before[name][1]
        assert after[name][2] == _dequantized(before[name], scale).tobytes(), name
    assert not [n for n in after if n.endswith(("_scale", "_scale_inv"))]
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    config = json.loads((FIXTURES / fixture / "config.json").read_text())
    del config["quantization_config"]
    assert json.loads((out / "config.json").read_text()) == config


@pytest.mark.parametrize("fixture,reference", [
    ("fp8-llama-ragged", "fp8-llama-ragged-dequantized.safetensors"),
    ("fp8-llama-channel", "fp8-llama-channel-dequantized.safetensors"),
])
def test_fp8_dequant_equals_pytorchs_dequantized_weights(cli, tmp_path, fixture, reference):
    path = FIXTURES / "reference" / reference
    out = tmp_path / "plain"
    ok(cli("fuse", FIXTURES / fixture, "-r", "fp8-dequant", "-o", out))
    want, got = raw(path), raw(out)
    assert want
    for name, entry in want.items():
        assert got[name] == entry, name


@pytest.mark.parametrize("dtype,st", [("float16", "F16"), ("float32", "F32")])
def test_dequantize_to_another_dtype(cli, tmp_path, dtype, st):
    rules = write_rules(tmp_path / "r.toml", f'''version = 1
[[rule]]
op = "dequantize"
weight = "{{m*}}.weight"
scale = "{{m*}}.weight_scale_inv"
output = "{{m*}}.weight"
dtype = "{dtype}"
''')
    out = tmp_path / "plain.safetensors"
    ok(cli("fuse", FIXTURES / "fp8-llama-ragged", "-r", rules, "-o", out))
    got, before = raw(out), raw(FIXTURES / "fp8-llama-ragged")
    name = f"{ATTN}.k_proj.weight"
    assert got[name][0] == st
    w = array_of(before[name]).astype(np.float32)
    s = np.kron(array_of(before[name + "_scale_inv"]), np.ones((128, 128), np.float32))[: w.shape[0], : w.shape[1]]
    assert array_of(got[name]).tobytes() == (w * s).astype(BY_NAME[st].numpy).tobytes()


def test_fp8_dequant_is_one_way(cli, tmp_path):
    out = tmp_path / "plain"
    ok(cli("fuse", FIXTURES / "fp8-llama", "-r", "fp8-dequant", "-o", out))
    refused(cli("unfuse", out, "-o", tmp_path / "back"), "one-way", "dequantize", unwritten=[tmp_path / "back"])


# ----------------------------------------------------------------- refusals


def _with_extra(copy_fixture, name: str, array: np.ndarray):
    folder = copy_fixture("fp8-llama")
    arrays = {n: array_of(e) for n, e in raw(folder).items()}
    arrays[name] = array
    write_safetensors(folder / "model.safetensors", arrays)
    return folder


@pytest.mark.parametrize("companion", ["weight_zero_point", "output_scale", "qzeros", "g_idx", "weight_scales"])
def test_an_unknown_companion_of_a_consumed_weight_stops_the_rule(cli, tmp_path, copy_fixture, companion):
    name = f"{ATTN}.k_proj.{companion}"
    folder = _with_extra(copy_fixture, name, np.zeros((1,), np.float32))
    out = tmp_path / "fused"
    refused(cli("fuse", folder, "-r", "llama-qkv", "-o", out), name, "attn-qkv", unwritten=[out])


def test_a_companion_of_an_untouched_weight_is_left_alone(cli, tmp_path, copy_fixture):
    folder = _with_extra(copy_fixture, f"{ATTN}.o_proj.weight_zero_point", np.zeros((1,), np.float32))
    ok(cli("fuse", folder, "-r", "llama-qkv", "-o", tmp_path / "fused"))


def test_a_numeric_fold_of_a_quantized_weight_is_refused(cli, tmp_path):
    f8 = ml_dtypes.float8_e4m3fn
    tensors = {"l.weight_g": np.ones((4, 1), np.float32), "l.weight_v": np.ones((4, 8), f8),
               "l.weight_v_scale_inv": np.ones((1, 1), np.float32)}
    path = write_safetensors(tmp_path / "m.safetensors", tensors)
    out = tmp_path / "out.safetensors"
    refused(cli("fuse", path, "-r", "weight-norm-fold", "-o", out), "l.weight_v", "dequantize first",
            unwritten=[out])


def test_a_part_without_a_scale_is_refused(cli, tmp_path, copy_fixture):
    folder = copy_fixture("fp8-llama")
    arrays = {n: array_of(e) for n, e in raw(folder).items()
              if n not in (f"{ATTN}.v_proj.weight_scale_inv", f"{MLP}.up_proj.weight_scale_inv")}
    write_safetensors(folder / "model.safetensors", arrays)
    refused(cli("plan", folder, "-r", "llama-gate-up"), f"{MLP}.up_proj.weight", "quantized alike")
    # llama-qkv's pattern (q_proj.{t}) binds the scales too: the missing one is named as missing
    refused(cli("plan", folder, "-r", "llama-qkv"), f"{ATTN}.v_proj.weight_scale_inv", "not found")


def test_a_block_scale_without_a_block_size_is_refused_asking_for_it(cli, tmp_path, copy_fixture):
    folder = copy_fixture("fp8-llama")
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]["weight_block_size"]
    (folder / "config.json").write_text(json.dumps(config))
    refused(cli("plan", folder, "-r", "llama-qkv"), f"{ATTN}.q_proj.weight_scale_inv", "block size")
    rules = write_rules(tmp_path / "q.toml", "version = 1\n[quantization]\nblock_size = [128, 128]\n")
    ok(cli("plan", folder, "-r", rules, "-r", "llama-qkv"))


def test_a_malformed_block_size_in_config_is_an_error(cli, copy_fixture):
    folder = copy_fixture("fp8-llama")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [128, "x"]
    (folder / "config.json").write_text(json.dumps(config))
    refused(cli("plan", folder, "-r", "llama-qkv"), "weight_block_size")


# ----------------------------------------------------------------- inspect and plan


def test_inspect_reports_quantized_weights_with_scale_kind_and_block_size(cli):
    report = ok(cli("inspect", FIXTURES / "fp8-llama", "--json")).json()["quantization"]
    assert report["block_size"] == [128, 128]
    assert report["weights"][f"{ATTN}.k_proj.weight"] == [
        {"name": f"{ATTN}.k_proj.weight_scale_inv", "role": "weight_scale_inv", "kind": "block 128x128"}]
    assert len(report["weights"]) == 14
    channel = ok(cli("inspect", FIXTURES / "fp8-llama-channel", "--json")).json()["quantization"]
    kinds = {s["role"]: s["kind"] for s in channel["weights"][f"{ATTN}.q_proj.weight"]}
    assert kinds == {"weight_scale": "per-channel", "input_scale": "per-tensor"}
    assert ok(cli("inspect", FIXTURES / "tiny-llama-gqa", "--json")).json()["quantization"] is None
    text = ok(cli("inspect", FIXTURES / "fp8-llama")).stdout
    assert "quantized: 14 weight(s) with scales (block 128x128); block size 128x128" in text


def test_plan_shows_each_scale_beside_its_weight(cli):
    lines = ok(cli("plan", FIXTURES / "fp8-llama", "-r", "llama-qkv")).stdout.splitlines()
    at = next(k for k, line in enumerate(lines) if f"{ATTN}.qkv_proj.weight F8_E4M3" in line)
    assert lines[at + 1].strip().startswith(f"scale: {ATTN}.q_proj.weight_scale_inv")


# ----------------------------------------------------------------- lifting, op by op


F8 = BY_NAME["F8_E4M3"]
F32 = BY_NAME["F32"]


def _table(entries: dict[str, tuple]) -> ParamTable:
    from fusectl.tensors import FileTensor, ByteRange

    tensors = {}
    for name, (dtype, shape) in entries.items():
        spec = TensorSpec(dtype, tuple(shape))
        tensors[name] = FileTensor(spec, ByteRange("x", 0, spec.nbytes))
    return ParamTable.from_stored(tensors)


def _lift(op, inputs, outputs, entries, block=(128, 128)):
    table = _table(entries)
    specs = tuple(table.spec(n) for n in inputs)
    step = Step(op, tuple(inputs), tuple(outputs), specs, tuple(op.infer(specs, inputs)))
    return Scales(scheme=QuantScheme(block, "test")).lift(step, [step], table, "rule 'r' (test)")


def test_reorder_of_whole_blocks_reorders_the_scale_grid():
    from fusectl.ops.layout import Reorder

    steps = _lift(Reorder(axis=0, chunks=4, order=(0, 2, 1, 3)), ["w.weight"], ["r.weight"],
                  {"w.weight": (F8, (512, 256)), "w.weight_scale_inv": (F32, (4, 2))})
    (step,) = steps
    assert step.op == Reorder(axis=0, chunks=4, order=(0, 2, 1, 3)) and step.outputs == ("r.weight_scale_inv",)


def test_reorder_of_parts_of_blocks_keeps_them_inside_or_is_refused():
    from fusectl.ops.layout import Reorder

    entries = {"w.weight": (F8, (256, 256)), "w.weight_scale_inv": (F32, (2, 2))}
    # 64-row chunks swapped inside the first 128-row block: the scale grid stays as it is
    (step,) = _lift(Reorder(axis=0, chunks=4, order=(1, 0, 2, 3)), ["w.weight"], ["r.weight"], entries)
    assert step.op.kind == "rename"
    # chunks 1 and 2 swapped across blocks: each block would mix rows of two blocks
    with pytest.raises(PlanError, match="w.weight_scale_inv.*different blocks"):
        _lift(Reorder(axis=0, chunks=4, order=(0, 2, 1, 3)), ["w.weight"], ["r.weight"], entries)


def test_rope_permute_inside_128_row_heads_keeps_the_scale():
    from fusectl.ops.layout import RopePermute

    steps = _lift(RopePermute(heads=2, to="hf"), ["q.weight"], ["q2.weight"],
                  {"q.weight": (F8, (256, 256)), "q.weight_scale_inv": (F32, (2, 2))})
    assert [(s.op.kind, s.inputs, s.outputs) for s in steps] == [("rename", ("q.weight_scale_inv",), ("q2.weight_scale_inv",))]
    # a 256-row head mixes rows of two blocks
    with pytest.raises(PlanError, match="different blocks"):
        _lift(RopePermute(heads=1, to="hf"), ["q.weight"], ["q2.weight"],
              {"q.weight": (F8, (256, 256)), "q.weight_scale_inv": (F32, (2, 2))})


def test_interleave_of_whole_blocks_interleaves_the_scales():
    from fusectl.ops.layout import Interleave

    (step,) = _lift(Interleave(axis=0, groups=2), ["a.weight", "b.weight"], ["ab.weight"],
                    {"a.weight": (F8, (256, 128)), "a.weight_scale_inv": (F32, (2, 1)),
                     "b.weight": (F8, (512, 128)), "b.weight_scale_inv": (F32, (4, 1))})
    assert step.op.kind == "interleave" and step.output_specs[0].shape == (6, 1)


def test_split_cuts_the_scale_grid_on_block_boundaries_and_the_last_part_may_be_ragged():
    from fusectl.ops.layout import Split

    (step,) = _lift(Split(axis=0, sizes=(256, 64), parts=2), ["w.weight"], ["a.weight", "b.weight"],
                    {"w.weight": (F8, (320, 128)), "w.weight_scale_inv": (F32, (3, 1))})
    assert step.op == Split(axis=0, sizes=(2, 1), parts=2)
    with pytest.raises(PlanError, match="w.weight_scale_inv"):
        _lift(Split(axis=0, sizes=(64, 256), parts=2), ["w.weight"], ["a.weight", "b.weight"],
              {"w.weight": (F8, (320, 128)), "w.weight_scale_inv": (F32, (3, 1))})


def test_transpose_transposes_a_square_block_grid_and_refuses_a_per_channel_scale():
    from fusectl.ops.layout import Transpose

    (step,) = _lift(Transpose(perm=(1, 0)), ["w.weight"], ["t.weight"],
                    {"w.weight": (F8, (256, 384)), "w.weight_scale_inv": (F32, (2, 3))})
    assert step.output_specs[0].shape == (3, 2)
    with pytest.raises(PlanError, match="would not line up"):
        _lift(Transpose(perm=(1, 0)), ["w.weight"], ["t.weight"],
              {"w.weight": (F8, (256, 384)), "w.weight_scale": (F32, (256,))})
    with pytest.raises(PlanError, match="block size"):
        _lift(Transpose(perm=(1, 0)), ["w.weight"], ["t.weight"],
              {"w.weight": (F8, (256, 384)), "w.weight_scale_inv": (F32, (2, 6))}, block=(128, 64))


def test_a_column_concat_of_per_channel_scales_merges_them_only_when_equal():
    from fusectl.ops.layout import Concat

    (step,) = _lift(Concat(axis=1), ["a.weight", "b.weight"], ["ab.weight"],
                    {"a.weight": (F8, (64, 32)), "a.weight_scale": (F32, (64, 1)),
                     "b.weight": (F8, (64, 48)), "b.weight_scale": (F32, (64, 1))}, block=None)
    assert step.op.kind == "merge_equal"


def test_rename_and_drop_take_every_scale_along():
    from fusectl.ops.layout import Drop, Rename

    entries = {"w.weight": (F8, (64, 32)), "w.weight_scale": (F32, (64, 1)), "w.input_scale": (F32, (1,))}
    steps = _lift(Rename(), ["w.weight"], ["v.weight"], entries)
    assert sorted(s.outputs for s in steps) == [("v.input_scale",), ("v.weight_scale",)]
    steps = _lift(Drop(), ["w.weight"], [], entries)
    assert sorted(s.inputs for s in steps) == [("w.input_scale",), ("w.weight_scale",)]


def test_scale_names_and_grids():
    assert scale_name("a.weight", "weight_scale_inv") == "a.weight_scale_inv"
    assert scale_name("experts.w13_weight", "input_scale") == "experts.w13_input_scale"
    assert scale_grid((320, 256), (3, 2), (128, 128)) == (128, 128)
    assert scale_grid((320, 256), (2, 2), (128, 128)) is None
    assert scale_grid((8, 320, 256), (8,), None) == (1, None, None)
    assert scheme_from({"quantization_config": {"config_groups": {"g": {"weights": {"block_structure": "64x32"}}}}}) \
        == QuantScheme((64, 32), "config.json quantization_config.config_groups.g.weights.block_structure")


def test_expand_scale_crops_ragged_blocks():
    s = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    full = expand_scale(s, (3, 3), scale_grid((3, 3), (2, 2), (2, 2)))
    assert full.tolist() == [[1, 1, 2], [1, 1, 2], [3, 3, 4]]


def test_dequantize_checks_the_scale_fits():
    op = Dequantize(block=(128, 128))
    with pytest.raises(PlanError, match="neither a per-tensor"):
        op.infer((TensorSpec(F8, (256, 256)), TensorSpec(F32, (3, 2))), ("w", "s"))


# ----------------------------------------------------------------- [config] edits


def test_a_config_section_edits_the_output_config_and_unfuse_restores_it_bitwise(cli, tmp_path):
    rules = write_rules(tmp_path / "r.toml", '''version = 1
[[rule]]
op = "rename"
input = "model.norm.weight"
output = "model.final_norm.weight"

[config]
set = { model_type = "llama-fused", fused = { qkv = true } }
remove = ["quantization_config.fmt", "rope_theta"]
''')
    out, back = tmp_path / "fused", tmp_path / "back"
    ok(cli("fuse", FIXTURES / "fp8-llama", "-r", rules, "-o", out))
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama-fused" and config["fused"] == {"qkv": True}
    assert "fmt" not in config["quantization_config"] and "rope_theta" not in config
    plan = ok(cli("plan", FIXTURES / "fp8-llama", "-r", rules)).stdout
    assert "config.json: set model_type" in plan
    ok(cli("unfuse", out, "-o", back))
    assert (back / "config.json").read_bytes() == (FIXTURES / "fp8-llama" / "config.json").read_bytes()
    refused(cli("unfuse", out, "-r", rules, "-o", tmp_path / "b2"), "[config]", "provenance")


def test_a_config_section_on_a_single_file_output_is_noted(cli, tmp_path):
    out = tmp_path / "plain.safetensors"
    result = ok(cli("fuse", FIXTURES / "fp8-llama", "-r", "fp8-dequant", "-o", out))
    assert "no config.json is written" in result.stderr


@pytest.mark.parametrize("body,needle", [
    ('[config]\nset = 3\n', "set must be a table"),
    ('[config]\nremove = ["a..b"]\n', "remove must be a list"),
    ('[config]\nbogus = 1\n', "unknown key 'bogus'"),
    ('[config]\n', "change nothing"),
    ('[config]\nset = { when = 1979-05-27 }\n', "JSON values"),
    ('[quantization]\nblock_size = [128]\n', "block_size"),
    ('[quantization]\nsize = 3\n', "unknown key 'size'"),
])
def test_bad_config_and_quantization_sections_are_errors(cli, tmp_path, body, needle):
    rules = write_rules(tmp_path / "r.toml", "version = 1\n" + body)
    refused(cli("plan", FIXTURES / "fp8-llama", "-r", rules), needle)


def test_the_dequantized_probe_fails_when_scale_rows_are_swapped(cli, tmp_path):
    """The fused weight's bytes are right but its scale's block rows are swapped: the layer
    w · s differs, so the probe on dequantized tensors fails (beside the byte comparison)."""
    out = tmp_path / "fused"
    ok(cli("fuse", FIXTURES / "fp8-llama", "-r", "llama-qkv", "-o", out))
    path = out / "model.safetensors"
    data = path.read_bytes()
    entry = raw(out)[f"{ATTN}.qkv_proj.weight_scale_inv"]
    scale = array_of(entry)
    assert not np.array_equal(scale[0], scale[3])
    path.write_bytes(data.replace(entry[2], scale[[3, 1, 2, 0]].tobytes()))
    result = cli("verify", FIXTURES / "fp8-llama", out)
    assert result.exit_code == 1, result.output
    failed = [line for line in result.stdout.splitlines() if line.strip().startswith("FAIL")]
    assert any("dequantized concat" in line for line in failed), result.stdout


def test_config_edits_without_a_config_are_left_out_with_a_note(cli, tmp_path):
    source = tmp_path / "m.safetensors"
    shutil.copy(FIXTURES / "fp8-llama" / "model.safetensors", source)
    out = tmp_path / "plain"
    block = write_rules(tmp_path / "q.toml", "version = 1\n[quantization]\nblock_size = [128, 128]\n")
    result = ok(cli("fuse", source, "-r", block, "-r", "fp8-dequant", "-o", out))
    assert "has no config.json" in result.stderr and not (out / "config.json").exists()
    provenance = ok(cli("inspect", out, "--json")).json()["provenance"]
    assert [g["op"] for g in provenance["plan"]] == ["dequantize"]


@pytest.mark.parametrize("record", [5, {"set": 3}, {"remove": [""]}, {"restore": 7}, {"bogus": 1}])
def test_a_malformed_config_record_in_the_provenance_is_refused(cli, tmp_path, record):
    out = tmp_path / "fused"
    rules = write_rules(tmp_path / "r.toml", 'version = 1\n[config]\nremove = ["rope_theta"]\n')
    ok(cli("fuse", FIXTURES / "fp8-llama", "-r", "llama-qkv", "-r", rules, "-o", out))
    tensors = {n: array_of(e) for n, e in raw(out).items()}
    meta = metadata_of(out)
    provenance = json.loads(meta["fusectl"])
    provenance["plan"][-1]["config"] = record
    meta["fusectl"] = json.dumps(provenance)
    write_safetensors(out / "model.safetensors", tensors, meta)
    refused(cli("unfuse", out, "-o", tmp_path / "back"), "config", unwritten=[tmp_path / "back"])


def test_a_numbered_scale_companion_stops_the_rule(cli, tmp_path, copy_fixture):
    """NVFP4 / ModelOpt write a second scale, weight_scale_2: not known, so not left behind."""
    name = f"{ATTN}.k_proj.weight_scale_2"
    folder = _with_extra(copy_fixture, name, np.ones((1,), np.float32))
    refused(cli("fuse", folder, "-r", "llama-qkv", "-o", tmp_path / "out"), name, unwritten=[tmp_path / "out"])


def test_a_negative_axis_moves_per_channel_scales_like_axis_0(cli, tmp_path):
    f8 = ml_dtypes.float8_e4m3fn
    rng = np.random.default_rng(1)
    tensors = {"a.weight": rng.standard_normal((8, 4)).astype(f8), "a.weight_scale": rng.random(8).astype(np.float32),
               "b.weight": rng.standard_normal((4, 4)).astype(f8), "b.weight_scale": rng.random(4).astype(np.float32)}
    path = write_safetensors(tmp_path / "m.safetensors", tensors)
    rules = write_rules(tmp_path / "r.toml", 'version = 1\n[[rule]]\nop = "concat"\ninputs = ["a.weight", "b.weight"]\n'
                        'output = "ab.weight"\naxis = -2\n')
    ok(cli("fuse", path, "-r", rules, "-o", tmp_path / "out.safetensors"))
    got = raw(tmp_path / "out.safetensors")["ab.weight_scale"]
    assert got[1] == [12] and got[2] == tensors["a.weight_scale"].tobytes() + tensors["b.weight_scale"].tobytes()
