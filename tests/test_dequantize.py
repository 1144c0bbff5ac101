"""Dequantize and scale grids (ops/dequantize.py): how block, per-channel and per-tensor scales
line up with a weight, the values w · s rounded into the output dtype (ragged last blocks
cropped), the checkpoint's block size filled in, and each refusal naming the tensor."""

from __future__ import annotations

import numpy as np
import pytest

from fusectl.dtypes import BY_NAME
from fusectl.errors import PlanError
from fusectl.ops.dequantize import Dequantize, expand_scale, scale_grid
from fusectl.tensors import TensorSpec

FP8, F32, BF16 = BY_NAME["F8_E4M3"], BY_NAME["F32"], BY_NAME["BF16"]
NAMES = ["m.weight", "m.weight_scale_inv"]


def spec(dtype, *shape):
    return TensorSpec(dtype, shape)


@pytest.mark.parametrize("weight, scale, block, grid", [
    ((256, 384), (2, 3), (128, 128), (128, 128)),
    ((300, 200), (3, 2), (128, 128), (128, 128)),  # ragged last blocks
    ((320, 256), (320, 1), None, (1, None)),  # per channel
    ((320, 256), (320,), None, (1, None)),  # per channel, trailing axis broadcast
    ((4, 96, 64), (), None, (None, None, None)),  # per tensor
    ((4, 96, 64), (1, 1, 1), None, (None, None, None)),
    ((128, 256), (1, 2), (128, 128), (128, 128)),  # one block row, not a broadcast
    ((8, 256, 384), (8, 2, 3), (128, 128), (1, 128, 128)),  # experts stacked: blocks on the last two
    ((256, 384), (2, 3), None, None),  # a block scale without a block size fits nothing
    ((256, 384), (1, 2, 3), (128, 128), None),  # more axes than the weight
    ((256, 384), (5, 1), (128, 128), None),
])
def test_scale_grid(weight, scale, block, grid):
    assert scale_grid(weight, scale, block) == grid


def test_expand_scale_repeats_blocks_and_crops_the_ragged_end():
    scale = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    out = expand_scale(scale, (3, 5), (2, 3))
    assert out.shape == (3, 5)
    assert out.tolist() == [[1, 1, 1, 2, 2], [1, 1, 1, 2, 2], [3, 3, 3, 4, 4]]
    # per channel: one entry per row, broadcast over the columns (left to numpy)
    rows = expand_scale(np.array([2.0, 3.0], np.float32), (2, 4), (1, None))
    assert rows.shape == (2, 1) and (np.ones((2, 4)) * rows).tolist() == [[2.0] * 4, [3.0] * 4]


def test_apply_multiplies_by_the_block_scale():
    weight = np.arange(12, dtype=np.float32).reshape(3, 4).astype(FP8.numpy)
    scale = np.array([[0.5, 2.0], [4.0, 1.0]], np.float32)
    out = Dequantize(block=(2, 2), dtype="float32").apply([weight, scale])[0]
    assert out.dtype == np.float32
    expected = weight.astype(np.float32) * np.array([[0.5, 0.5, 2, 2], [0.5, 0.5, 2, 2], [4, 4, 1, 1]])
    np.testing.assert_array_equal(out, expected)


def test_apply_rounds_into_bfloat16_by_default():
    weight = np.array([[1.0, 3.0]], np.float32).astype(FP8.numpy)
    scale = np.array([[1.0 / 3.0]], np.float32)
    out = Dequantize().apply([weight, scale])[0]
    assert out.dtype == BF16.numpy
    expected = (np.array([[1.0, 3.0]], np.float32) * np.float32(1.0 / 3.0)).astype(BF16.numpy)
    np.testing.assert_array_equal(out.view(np.uint16), expected.view(np.uint16))


def test_an_int8_weight_dequantizes_to_float16():
    weight = np.array([[-128, 127]], np.int8)
    out = Dequantize(dtype="float16").apply([weight, np.array([[0.5]], np.float32)])[0]
    assert out.dtype == np.float16 and out.tolist() == [[-64.0, 63.5]]


def test_infer_gives_the_weights_shape_in_the_output_dtype():
    op = Dequantize(block=(128, 128), dtype="float16")
    out = op.infer([spec(FP8, 256, 200), spec(F32, 2, 2)], NAMES)
    assert out == [spec(BY_NAME["F16"], 256, 200)]
    assert Dequantize().infer([spec(BY_NAME["I8"], 4, 4), spec(BF16, 4, 1)], NAMES) == [spec(BF16, 4, 4)]


def test_with_block_size_fills_in_only_an_empty_block():
    assert Dequantize().with_block_size((128, 64)).block == (128, 64)
    assert Dequantize().with_block_size([32, 32]).block == (32, 32)
    mine = Dequantize(block=(16, 16))
    assert mine.with_block_size((128, 128)) is mine
    empty = Dequantize()
    assert empty.with_block_size(None) is empty


def test_another_dtype_is_refused_listing_the_choices():
    with pytest.raises(PlanError) as err:
        Dequantize(dtype="int8").infer([spec(FP8, 2, 2), spec(F32, 1, 1)], NAMES)
    assert str(err.value) == "dequantize: dtype = 'int8'; use one of bfloat16, float16, float32"


@pytest.mark.parametrize("weight, scale", [(BY_NAME["I32"], F32), (BY_NAME["U8"], F32), (FP8, BY_NAME["I32"])])
def test_a_weight_or_scale_of_the_wrong_kind_is_refused_naming_both(weight, scale):
    with pytest.raises(PlanError) as err:
        Dequantize().infer([spec(weight, 2, 2), spec(scale, 1, 1)], NAMES)
    message = str(err.value)
    assert f"'m.weight' is {weight} and 'm.weight_scale_inv' is {scale}" in message
    assert "needs a float8 (or int8) weight and a floating-point scale" in message


@pytest.mark.parametrize("block", [(128,), (128, 0), (128, -1), (1, 2, 3)])
def test_a_block_that_is_not_two_positive_integers_is_refused(block):
    with pytest.raises(PlanError, match=r"dequantize: block = .*; give two positive integers \(rows, columns\)"):
        Dequantize(block=block).infer([spec(FP8, 256, 256), spec(F32, 2, 2)], NAMES)


def test_a_scale_fitting_no_grid_is_refused_with_a_hint_to_set_the_block_size():
    with pytest.raises(PlanError) as err:
        Dequantize().infer([spec(FP8, 256, 384), spec(F32, 2, 3)], NAMES)
    message = str(err.value)
    assert message.startswith("'m.weight_scale_inv' has shape [2, 3], which is neither a per-tensor, "
                              "per-channel nor a block scale of 'm.weight' [256, 384]")
    assert "set the block size (quantization_config.weight_block_size" in message


def test_with_a_block_size_the_refusal_names_the_blocks_instead():
    with pytest.raises(PlanError) as err:
        Dequantize(block=(64, 64)).infer([spec(FP8, 256, 384), spec(F32, 2, 3)], NAMES)
    message = str(err.value)
    assert "with blocks [64, 64]" in message
    assert "set the block size" not in message


def test_dequantize_is_one_way_and_drops_the_weights_other_scales():
    assert Dequantize().inverse(None) is None
    assert Dequantize().inverse([spec(FP8, 2, 2), spec(F32, 1, 1)]) is None

    class Lift:
        dropped = False

        def drop(self):
            self.dropped = True

    lift = Lift()
    Dequantize().lift(lift)
    assert lift.dropped
