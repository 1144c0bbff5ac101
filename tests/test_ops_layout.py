"""Layout ops (SPEC §3): exact for every dtype, invertible bitwise, ``infer`` predicts
``apply``, and ``byte_ranges`` (when given) names exactly the bytes ``apply`` makes.

Property tests draw random shapes, axes and groups and data made of random raw bytes (with
-0, all-ones and NaN-payload patterns planted), viewed as every dtype fusectl knows. Semantic
tests build the expected layouts by hand with explicit loops, or read them from fixtures made
by the frameworks' own formulas.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from conftest import BAD_CONCAT_RULES, LLAMA, refuse_case, write_rules
from fusectl.dtypes import ARRAY_DTYPES, BY_NAME
from fusectl.errors import PlanError
from fusectl.ops.layout import (
    Concat,
    Deinterleave,
    Drop,
    Interleave,
    Rename,
    Reorder,
    Reshape,
    RopePermute,
    Split,
    Stack,
    Transpose,
    Unstack,
)
from fusectl.tensors import ByteRange, TensorSpec


FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
DTYPE_NAMES = sorted(ARRAY_DTYPES)
F32 = BY_NAME["F32"]

PROPERTY = settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --- data ---------------------------------------------------------------------------------


def special_patterns(itemsize: int) -> list[bytes]:
    """Bit patterns layout ops must carry unchanged: -0, all ones (a NaN with payload for
    IEEE floats), a quiet NaN with a low payload bit, and +0."""
    if itemsize == 1:
        return [b"\x80", b"\xff", b"\x7f", b"\x00", b"\x01"]
    return [
        b"\x00" * (itemsize - 1) + b"\x80",
        b"\xff" * itemsize,
        b"\x01" + b"\xff" * (itemsize - 2) + b"\x7f",
        b"\x00" * itemsize,
    ]


def raw_array(seed: int, dtype_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random raw bytes viewed as ``dtype_name`` (NaN payloads, -0, subnormals all possible)."""
    dtype = BY_NAME[dtype_name].numpy
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    buf = bytearray(rng.bytes(n * dtype.itemsize))
    specials = special_patterns(dtype.itemsize)
    for k in range(n):
        if rng.random() < 0.25:
            pattern = specials[rng.integers(len(specials))]
            buf[k * dtype.itemsize : (k + 1) * dtype.itemsize] = pattern
    if dtype_name == "BOOL":
        # only 0 and 1 are booleans; numpy itself folds other bytes to 1 when it copies a scalar
        buf = bytearray(b & 1 for b in buf)
    return np.frombuffer(bytes(buf), dtype=dtype).reshape(shape).copy()


def raw(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def assert_bitwise_equal(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert raw(got) == raw(want)


def spec_of(a: np.ndarray, dtype_name: str) -> TensorSpec:
    return TensorSpec(BY_NAME[dtype_name], tuple(a.shape))


def labelled(shape: tuple[int, ...]) -> np.ndarray:
    """Distinct float32 values, so a misplaced element always shows."""
    return np.arange(math.prod(shape), dtype=np.float32).reshape(shape)


# --- the round-trip harness ----------------------------------------------------------


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ops_layout")


def file_ranges(path: Path, arrays: list[np.ndarray], seed: int) -> list[tuple[ByteRange, ...]]:
    """Write the inputs' bytes to ``path`` in a shuffled order with gaps, each input cut into
    one to three ranges; return each input's ranges."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(arrays))
    ranges: list[tuple[ByteRange, ...]] = [()] * len(arrays)
    blob = bytearray(rng.bytes(int(rng.integers(0, 7))))
    for k in order:
        data = raw(arrays[k])
        cuts = sorted(int(c) for c in rng.integers(0, len(data) + 1, size=int(rng.integers(0, 3))))
        bounds = [0, *cuts, len(data)]
        pieces = []
        for lo, hi in zip(bounds, bounds[1:]):
            if hi > lo:
                pieces.append(ByteRange(str(path), len(blob), hi - lo))
                blob += data[lo:hi]
                blob += rng.bytes(int(rng.integers(0, 5)))  # junk between ranges
        ranges[k] = tuple(pieces)
    path.write_bytes(bytes(blob))
    return ranges


def read_back(ranges: tuple[ByteRange, ...]) -> bytes:
    out = b""
    for r in ranges:
        with open(r.path, "rb") as f:
            f.seek(r.offset)
            chunk = f.read(r.length)
        assert len(chunk) == r.length
        out += chunk
    return out


def check_op(op, arrays: list[np.ndarray], dtype_name: str, scratch: Path, seed: int,
             rule_inverse: bool = True) -> list[np.ndarray]:
    """Every property a layout op promises, on one example; returns the outputs."""
    names = [f"t{k}.weight" for k in range(len(arrays))]
    specs = [spec_of(a, dtype_name) for a in arrays]
    originals = [a.copy() for a in arrays]

    out_specs = op.infer(specs, names)
    outs = op.apply(arrays)
    # inputs are never modified
    for a, b in zip(arrays, originals):
        assert_bitwise_equal(a, b)
    # infer predicts exactly what apply makes
    assert len(outs) == len(out_specs) == op.output_count(specs)
    for out, spec in zip(outs, out_specs):
        assert out.dtype == spec.dtype.numpy
        assert tuple(out.shape) == spec.shape
    # a layout op moves bytes: the multiset of elements' bytes is unchanged
    itemsize = BY_NAME[dtype_name].itemsize
    def elements(arrs):
        return sorted(raw(a)[i : i + itemsize] for a in arrs for i in range(0, a.size * itemsize, itemsize))
    if op.kind not in ("drop",):
        assert elements(outs) == elements(arrays)

    # the planned inverse restores every input bitwise
    inverse = op.inverse(specs)
    assert inverse is not None
    assert inverse.infer(out_specs, [f"o{k}" for k in range(len(outs))]) == specs
    back = inverse.apply(outs)
    assert len(back) == len(arrays)
    for b, a in zip(back, originals):
        assert_bitwise_equal(b, a)

    # byte ranges, where the op offers them, are exactly the bytes apply made
    ranges = file_ranges(scratch / "inputs.bin", arrays, seed)
    for index, out in enumerate(outs):
        got = op.byte_ranges(ranges, specs, index)
        if got is not None:
            assert sum(r.length for r in got) == out_specs[index].nbytes
            assert read_back(got) == raw(out)

    # the inverse a rule alone can state (unfuse -r) also restores the inputs
    if rule_inverse:
        try:
            from_rule = op.inverse(None)
        except PlanError:
            from_rule = None
        if from_rule is not None:
            for b, a in zip(from_rule.apply(outs), originals):
                assert_bitwise_equal(b, a)
    return outs


# --- strategies -----------------------------------------------------------------------


# every dtype gets its own run, so none is left to chance
every_dtype = pytest.mark.parametrize("dtype", DTYPE_NAMES)
seeds = st.integers(0, 2**32 - 1)
dims = st.integers(0, 3)
nonzero_dims = st.integers(1, 3)


def shapes(min_dims=1, max_dims=3, side=dims):
    return st.lists(side, min_size=min_dims, max_size=max_dims).map(tuple)


def arrays_for(seed, dtype_name, shape_list):
    return [raw_array(seed + k, dtype_name, s) for k, s in enumerate(shape_list)]


@every_dtype
@PROPERTY
@given(seed=seeds, shape=shapes(0, 4))
def test_rename_property(scratch, dtype, seed, shape):
    (a,) = arrays_for(seed, dtype, [shape])
    (out,) = check_op(Rename(), [a], dtype, scratch, seed)
    assert_bitwise_equal(out, a)


@every_dtype
@PROPERTY
@given(seed=seeds, data=st.data())
def test_concat_property(scratch, dtype, seed, data):
    base = list(data.draw(shapes(1, 3)))
    axis = data.draw(st.integers(-len(base), len(base) - 1))
    lengths = data.draw(st.lists(dims, min_size=1, max_size=4))
    shape_list = []
    for n in lengths:
        s = list(base)
        s[axis] = n
        shape_list.append(tuple(s))
    with_sizes = data.draw(st.booleans())
    op = Concat(axis=axis, sizes=tuple(lengths) if with_sizes else None)
    arrays = arrays_for(seed, dtype, shape_list)
    (out,) = check_op(op, arrays, dtype, scratch, seed)
    assert out.shape[axis] == sum(lengths)


@every_dtype
@PROPERTY
@given(seed=seeds, data=st.data())
def test_split_property(scratch, dtype, seed, data):
    shape = list(data.draw(shapes(1, 3)))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    if data.draw(st.booleans()):
        sizes = tuple(data.draw(st.lists(dims, min_size=1, max_size=4)))
        shape[axis] = sum(sizes)
        op = Split(axis=axis, sizes=sizes, parts=len(sizes))
    else:
        parts = data.draw(st.integers(1, 4))
        each = data.draw(dims)
        sizes = (each,) * parts
        shape[axis] = parts * each
        op = Split(axis=axis, sizes=None, parts=parts)
    (a,) = arrays_for(seed, dtype, [tuple(shape)])
    outs = check_op(op, [a], dtype, scratch, seed)
    assert [o.shape[axis] for o in outs] == list(sizes)


@every_dtype
@PROPERTY
@given(seed=seeds, data=st.data())
def test_interleave_property(scratch, dtype, seed, data):
    base = list(data.draw(shapes(1, 3)))
    axis = data.draw(st.integers(-len(base), len(base) - 1))
    groups = data.draw(st.integers(1, 4))
    per_group = data.draw(st.lists(dims, min_size=1, max_size=4))
    shape_list = []
    for k in per_group:
        s = list(base)
        s[axis] = groups * k
        shape_list.append(tuple(s))
    sizes = tuple(groups * k for k in per_group) if data.draw(st.booleans()) else None
    op = Interleave(axis=axis, groups=groups, sizes=sizes)
    arrays = arrays_for(seed, dtype, shape_list)
    check_op(op, arrays, dtype, scratch, seed)


@every_dtype
@PROPERTY
@given(seed=seeds, data=st.data())
def test_deinterleave_property(scratch, dtype, seed, data):
    shape = list(data.draw(shapes(1, 3)))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    groups = data.draw(st.integers(1, 4))
    if data.draw(st.booleans()):
        per_group = data.draw(st.lists(dims, min_size=1, max_size=4))
        sizes = tuple(groups * k for k in per_group)
        op = Deinterleave(axis=axis, groups=groups, sizes=sizes, parts=len(sizes))
    else:
        parts = data.draw(st.integers(1, 4))
        k = data.draw(dims)
        sizes = (groups * k,) * parts
        op = Deinterleave(axis=axis, groups=groups, sizes=None, parts=parts)
    shape[axis] = sum(sizes)
    (a,) = arrays_for(seed, dtype, [tuple(shape)])
    outs = check_op(op, [a], dtype, scratch, seed)
    assert [o.shape[axis] for o in outs] == list(sizes)


@every_dtype
@PROPERTY
@given(seed=seeds, data=st.data())
def test_stack_property(scratch, dtype, seed, data):
    shape = data.draw(shapes(0, 3))
    n = data.draw(st.integers(1, 4))
    axis = data.draw(st.integers(-(len(shape) + 1), len(shape)))
    arrays = arrays_for(seed, dtype, [shape] * n)
    (out,) = check_op(Stack(axis=axis), arrays, dtype, scratch, seed, rule_inverse=True)
    assert out.shape[axis] == n


@every_dtype
@PROPERTY
@given(seed=seeds, data=st.data())
def test_unstack_property(scratch, dtype, seed, data):
    shape = list(data.draw(shapes(1, 4)))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    # an axis of length 0 unstacks into no tensors, from which nothing can be stacked back
    shape[axis] = data.draw(nonzero_dims)
    shape = tuple(shape)
    (a,) = arrays_for(seed, dtype, [shape])
    outs = check_op(Unstack(axis=axis), [a], dtype, scratch, seed)
    assert len(outs) == shape[axis]


@every_dtype
@PROPERTY
@given(seed=seeds, data=st.data())
def test_transpose_property(scratch, dtype, seed, data):
    shape = data.draw(shapes(1, 4))  # scalars: test_transpose_of_a_scalar_keeps_its_shape
    perm = tuple(data.draw(st.permutations(range(len(shape)))))
    (a,) = arrays_for(seed, dtype, [shape])
    (out,) = check_op(Transpose(perm=perm), [a], dtype, scratch, seed)
    assert out.shape == tuple(shape[p] for p in perm)


@every_dtype
@PROPERTY
@given(seed=seeds, data=st.data())
def test_reshape_property(scratch, dtype, seed, data):
    shape = data.draw(shapes(0, 4, side=nonzero_dims))
    target = list(data.draw(st.permutations(shape)))
    for _ in range(data.draw(st.integers(0, 2))):
        target.insert(data.draw(st.integers(0, len(target))), 1)
    if target and data.draw(st.booleans()):
        target[data.draw(st.integers(0, len(target) - 1))] = -1
    if data.draw(st.booleans()) and math.prod(shape) > 0:
        target = [-1]
    (a,) = arrays_for(seed, dtype, [shape])
    (out,) = check_op(Reshape(shape=tuple(target)), [a], dtype, scratch, seed, rule_inverse=False)
    assert out.size == a.size


@every_dtype
@PROPERTY
@given(seed=seeds, data=st.data())
def test_reorder_property(scratch, dtype, seed, data):
    shape = list(data.draw(shapes(1, 3)))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    chunks = data.draw(st.integers(1, 4))
    order = tuple(data.draw(st.permutations(range(chunks))))
    shape[axis] = chunks * data.draw(dims)
    (a,) = arrays_for(seed, dtype, [tuple(shape)])
    (out,) = check_op(Reorder(axis=axis, chunks=chunks, order=order), [a], dtype, scratch, seed)
    assert out.shape == a.shape


@every_dtype
@PROPERTY
@given(seed=seeds, data=st.data())
def test_rope_permute_property(scratch, dtype, seed, data):
    heads = data.draw(st.integers(1, 4))
    half = data.draw(st.integers(1, 3))
    rows = heads * 2 * half
    shape = (rows,) if data.draw(st.booleans()) else (rows, data.draw(dims))
    to = data.draw(st.sampled_from(["hf", "meta"]))
    (a,) = arrays_for(seed, dtype, [shape])
    (out,) = check_op(RopePermute(heads=heads, to=to), [a], dtype, scratch, seed)
    assert out.shape == a.shape


# --- byte ranges are offered where the output is a plain copy -------------------------


@pytest.mark.parametrize(
    "op, shapes_",
    [
        (Rename(), [(3, 2)]),
        (Reshape(shape=(-1,)), [(3, 2)]),
        (Concat(axis=0), [(1, 2), (3, 2)]),
        (Concat(axis=1), [(1, 2), (1, 3)]),  # leading axes of length 1: still contiguous
        (Split(axis=0, sizes=(1, 2), parts=2), [(3, 2)]),
        (Stack(axis=0), [(2, 2), (2, 2)]),
        (Unstack(axis=0), [(3, 2)]),
        (Reorder(axis=0, chunks=2, order=(1, 0)), [(4, 2)]),
    ],
)
def test_plain_copies_offer_byte_ranges(scratch, op, shapes_):
    arrays = [labelled(s) + 100 * k for k, s in enumerate(shapes_)]
    specs = [spec_of(a, "F32") for a in arrays]
    ranges = file_ranges(scratch / "copy.bin", arrays, 0)
    outs = op.apply(arrays)
    for index, out in enumerate(outs):
        got = op.byte_ranges(ranges, specs, index)
        assert got is not None
        assert read_back(got) == raw(out)


# --- semantics, built by hand ----------------------------------------------------------


def test_interleave_per_head_qkv_gpt_neox_layout():
    heads, hd, cols = 3, 2, 4
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((heads * hd, cols)).astype(np.float32) for _ in range(3))
    # GPT-NeoX: fused.view(heads, 3 * hd, cols); per head rows q_h, then k_h, then v_h
    expected = np.empty((3 * heads * hd, cols), np.float32)
    for h in range(heads):
        for j, t in enumerate((q, k, v)):
            for r in range(hd):
                expected[h * 3 * hd + j * hd + r] = t[h * hd + r]
    (fused,) = Interleave(axis=0, groups=heads).apply([q, k, v])
    assert_bitwise_equal(fused, expected)
    got = Deinterleave(axis=0, groups=heads, parts=3).apply([expected])
    for g, want in zip(got, (q, k, v)):
        assert_bitwise_equal(g, want)


def test_interleave_bias_per_head():
    heads = 2
    q = np.array([1, 2, 3, 4, 5, 6], np.float32)
    k = q + 10
    v = q + 20
    (fused,) = Interleave(axis=0, groups=heads).apply([q, k, v])
    assert fused.tolist() == [1, 2, 3, 11, 12, 13, 21, 22, 23, 4, 5, 6, 14, 15, 16, 24, 25, 26]


def test_interleave_along_axis_1():
    a = labelled((2, 4))
    b = labelled((2, 2)) + 100
    (out,) = Interleave(axis=1, groups=2).apply([a, b])
    expected = np.empty((2, 6), np.float32)
    for r in range(2):
        expected[r] = [a[r, 0], a[r, 1], b[r, 0], a[r, 2], a[r, 3], b[r, 1]]
    assert_bitwise_equal(out, expected)


def test_gpt_neox_fixture_deinterleaves_like_transformers():
    """transformers' GPTNeoXAttention: qkv.view(..., heads, 3 * head_dim) then chunk(3)."""
    weights = load_file(str(FIXTURES / "tiny-gpt-neox" / "model.safetensors"))
    heads, hidden = 4, 32
    hd = hidden // heads
    for suffix in ("weight", "bias"):
        fused = weights[f"gpt_neox.layers.0.attention.query_key_value.{suffix}"]
        view = fused.reshape(heads, 3 * hd, -1)
        want = [view[:, j * hd : (j + 1) * hd].reshape((heads * hd,) + fused.shape[1:]) for j in range(3)]
        got = Deinterleave(axis=0, groups=heads, parts=3).apply([fused])
        for g, w in zip(got, want):
            assert_bitwise_equal(g, w)
        (again,) = Interleave(axis=0, groups=heads).apply(got)
        assert_bitwise_equal(again, fused)


def test_interleave_gqa_per_kv_group_unequal_sizes():
    heads, kv_heads, hd, cols = 4, 2, 2, 3
    q = labelled((heads * hd, cols))
    k = labelled((kv_heads * hd, cols)) + 1000
    v = labelled((kv_heads * hd, cols)) + 2000
    q_per_group = heads // kv_heads * hd
    rows = []
    for g in range(kv_heads):
        for r in range(q_per_group):
            rows.append(q[g * q_per_group + r])
        for r in range(hd):
            rows.append(k[g * hd + r])
        for r in range(hd):
            rows.append(v[g * hd + r])
    expected = np.stack(rows)
    op = Interleave(axis=0, groups=kv_heads)
    specs = [spec_of(t, "F32") for t in (q, k, v)]
    assert op.infer(specs, ["q", "k", "v"]) == [TensorSpec(F32, ((heads + 2 * kv_heads) * hd, cols))]
    (fused,) = op.apply([q, k, v])
    assert_bitwise_equal(fused, expected)
    sizes = (heads * hd, kv_heads * hd, kv_heads * hd)
    back = Deinterleave(axis=0, groups=kv_heads, sizes=sizes, parts=3).apply([expected])
    for b, want in zip(back, (q, k, v)):
        assert_bitwise_equal(b, want)
    # the planned inverse recovers the unequal sizes from the specs
    inverse = op.inverse(specs)
    for b, want in zip(inverse.apply([fused]), (q, k, v)):
        assert_bitwise_equal(b, want)


def test_reorder_lstm_ifgo_to_iofc():
    hidden, inp = 3, 2
    w = labelled((4 * hidden, inp))  # PyTorch gate order i, f, g, o
    expected = np.empty_like(w)
    onnx_order = [0, 3, 1, 2]  # ONNX i, o, f, c
    for out_gate, in_gate in enumerate(onnx_order):
        for r in range(hidden):
            expected[out_gate * hidden + r] = w[in_gate * hidden + r]
    op = Reorder(axis=0, chunks=4, order=(0, 3, 1, 2))
    (out,) = op.apply([w])
    assert_bitwise_equal(out, expected)
    (back,) = op.inverse([spec_of(w, "F32")]).apply([out])
    assert_bitwise_equal(back, w)


def test_reorder_lstm_bias_and_stacked_axis_1():
    hidden = 2
    b = np.array([0, 1, 10, 11, 20, 21, 30, 31], np.float32)  # i f g o
    (out,) = Reorder(axis=0, chunks=4, order=(0, 3, 1, 2)).apply([b])
    assert out.tolist() == [0, 1, 30, 31, 10, 11, 20, 21]
    stacked = np.stack([labelled((4 * hidden, 3)), labelled((4 * hidden, 3)) + 100])  # [D, 4H, I]
    (out,) = Reorder(axis=1, chunks=4, order=(0, 3, 1, 2)).apply([stacked])
    for d in range(2):
        for out_gate, in_gate in enumerate([0, 3, 1, 2]):
            for r in range(hidden):
                assert_bitwise_equal(out[d, out_gate * hidden + r], stacked[d, in_gate * hidden + r])


def test_reorder_gru_rzn_to_zrn():
    w = np.array([[0], [1], [10], [11], [20], [21]], np.float32)  # r r z z n n
    (out,) = Reorder(axis=0, chunks=3, order=(1, 0, 2)).apply([w])
    assert out[:, 0].tolist() == [10, 11, 0, 1, 20, 21]


@pytest.mark.parametrize("name, heads", [("q_proj", 4), ("k_proj", 2)])
def test_rope_permute_matches_transformers_converter(name, heads):
    meta = load_file(str(FIXTURES / "tiny-rope-meta.safetensors"))[f"model.layers.0.self_attn.{name}.weight"]
    hf = load_file(str(FIXTURES / "tiny-rope-hf.safetensors"))[f"model.layers.0.self_attn.{name}.weight"]
    assert not np.array_equal(meta, hf)
    (to_hf,) = RopePermute(heads=heads, to="hf").apply([meta])
    assert_bitwise_equal(to_hf, hf)
    (to_meta,) = RopePermute(heads=heads, to="meta").apply([hf])
    assert_bitwise_equal(to_meta, meta)


def test_rope_permute_head_count_matters():
    meta = load_file(str(FIXTURES / "tiny-rope-meta.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    hf = load_file(str(FIXTURES / "tiny-rope-hf.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    (wrong,) = RopePermute(heads=2, to="hf").apply([meta])
    assert not np.array_equal(wrong, hf)


def test_rope_permute_rows_by_hand():
    # one head, 6 rows: Meta pairs (0,1) (2,3) (4,5) → HF halves [0, 2, 4 | 1, 3, 5]
    w = labelled((6, 2))
    (out,) = RopePermute(heads=1, to="hf").apply([w])
    assert out[:, 0].tolist() == [w[r, 0] for r in (0, 2, 4, 1, 3, 5)]
    # two heads, 4 rows each: the permutation stays inside each head
    b = np.arange(8, dtype=np.float32)
    (out,) = RopePermute(heads=2, to="hf").apply([b])
    assert out.tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_split_with_sizes():
    w = labelled((6, 2))
    a, b, c = Split(axis=0, sizes=(3, 1, 2), parts=3).apply([w])
    assert_bitwise_equal(a, np.array([w[0], w[1], w[2]]))
    assert_bitwise_equal(b, np.array([w[3]]))
    assert_bitwise_equal(c, np.array([w[4], w[5]]))
    x = labelled((2, 5))
    a, b = Split(axis=1, sizes=(4, 1), parts=2).apply([x])
    assert_bitwise_equal(a, np.array([[x[r, j] for j in range(4)] for r in range(2)]))
    assert_bitwise_equal(b, np.array([[x[r, 4]] for r in range(2)]))


def test_split_equal_parts():
    w = labelled((6,))
    outs = Split(axis=0, parts=3).apply([w])
    assert [o.tolist() for o in outs] == [[0, 1], [2, 3], [4, 5]]


def test_concat_order_and_axis():
    a, b = labelled((2, 1)), labelled((2, 2)) + 10
    (out,) = Concat(axis=-1).apply([a, b])
    assert out.tolist() == [[0, 10, 11], [1, 12, 13]]


def test_stack_and_unstack_by_hand():
    arrays = [labelled((2, 3)) + 100 * e for e in range(4)]
    (out,) = Stack(axis=1).apply(arrays)
    assert out.shape == (2, 4, 3)
    for i, e, j in itertools.product(range(2), range(4), range(3)):
        assert out[i, e, j] == arrays[e][i, j]
    parts = Unstack(axis=1).apply([out])
    assert len(parts) == 4
    for e in range(4):
        assert_bitwise_equal(parts[e], arrays[e])
    (last,) = Stack(axis=-1).apply([arrays[0], arrays[1]])
    assert last.shape == (2, 3, 2)
    assert last[1, 2, 1] == arrays[1][1, 2]


def test_transpose_by_hand():
    x = labelled((2, 3, 4))
    op = Transpose(perm=(2, 0, 1))
    (out,) = op.apply([x])
    assert out.shape == (4, 2, 3)
    for i, j, k in itertools.product(range(2), range(3), range(4)):
        assert out[k, i, j] == x[i, j, k]
    assert op.inverse([spec_of(x, "F32")]) == Transpose(perm=(1, 2, 0))


def test_transpose_of_a_scalar_keeps_its_shape():
    x = np.array(3.5, np.float32)
    op = Transpose(perm=())
    (planned,) = op.infer([spec_of(x, "F32")], ["scale"])
    assert planned.shape == ()
    (out,) = op.apply([x])
    assert out.shape == ()
    assert raw(out) == raw(x)


def test_reshape_keeps_bytes_and_records_shape():
    x = labelled((2, 3, 4))
    op = Reshape(shape=(-1, 4))
    assert op.infer([spec_of(x, "F32")], ["x"]) == [TensorSpec(F32, (6, 4))]
    (out,) = op.apply([x])
    assert raw(out) == raw(x) and out.shape == (6, 4)
    assert op.inverse([spec_of(x, "F32")]) == Reshape(shape=(2, 3, 4))


def test_drop_is_one_way():
    assert Drop().infer([TensorSpec(F32, (2,))], ["x"]) == []
    assert Drop().apply([labelled((2,))]) == []
    assert Drop().inverse([TensorSpec(F32, (2,))]) is None
    assert Drop().inverse(None) is None


def test_rule_level_inverses_need_what_the_rule_states():
    # sizes stated in the rule: invertible without shapes
    assert Concat(axis=0, sizes=(4, 2)).inverse(None) == Split(axis=0, sizes=(4, 2), parts=2)
    assert Interleave(axis=0, groups=2, sizes=(4, 2)).inverse(None) == Deinterleave(
        axis=0, groups=2, sizes=(4, 2), parts=2
    )
    with pytest.raises(PlanError):
        Concat(axis=0).inverse(None)
    with pytest.raises(PlanError):
        Interleave(axis=0, groups=2).inverse(None)
    with pytest.raises(PlanError):
        Reshape(shape=(-1,)).inverse(None)
    assert RopePermute(heads=4, to="hf").inverse(None) == RopePermute(heads=4, to="meta")
    assert Reorder(axis=0, chunks=4, order=(0, 3, 1, 2)).inverse(None) == Reorder(
        axis=0, chunks=4, order=(0, 2, 3, 1)
    )


# --- plan-time checks name the offending tensor ---------------------------------------


def spec(shape, dtype="F32"):
    return TensorSpec(BY_NAME[dtype], tuple(shape))


@pytest.mark.parametrize(
    "op, specs, names, culprit",
    [
        pytest.param(Concat(axis=0), [spec((2, 3)), spec((2, 4))], ["q.w", "k.w"], "k.w", id="concat-shape"),
        pytest.param(Concat(axis=0), [spec((2, 3)), spec((2, 3), "F16")], ["q.w", "k.w"], "k.w", id="concat-dtype"),
        pytest.param(Concat(axis=0), [spec((2, 3)), spec((2, 3, 1))], ["q.w", "k.w"], "k.w", id="concat-ndim"),
        pytest.param(Concat(axis=2), [spec((2, 3)), spec((2, 3))], ["q.w", "k.w"], "q.w", id="concat-axis"),
        pytest.param(Concat(axis=0, sizes=(2, 5)), [spec((2, 3)), spec((4, 3))], ["q.w", "k.w"], "k.w", id="concat-sizes"),
        pytest.param(Split(axis=0, sizes=(3, 3), parts=2), [spec((5, 2))], ["qkv.w"], "qkv.w", id="split-sizes-sum"),
        pytest.param(Split(axis=0, parts=3), [spec((5, 2))], ["qkv.w"], "qkv.w", id="split-unequal"),
        pytest.param(Split(axis=-3, parts=1), [spec((5, 2))], ["qkv.w"], "qkv.w", id="split-axis"),
        pytest.param(Split(axis=0, sizes=(-1, 5), parts=2), [spec((4, 2))], ["qkv.w"], "qkv.w", id="split-negative-first-size"),
        pytest.param(Split(axis=0, sizes=(5, -1), parts=2), [spec((4, 2))], ["qkv.w"], "qkv.w", id="split-negative-last-size"),
        pytest.param(Deinterleave(axis=0, groups=1, sizes=(-2, 6), parts=2), [spec((4, 2))], ["qkv.w"], "qkv.w", id="deinterleave-negative-size"),
        pytest.param(Interleave(axis=0, groups=3), [spec((6, 2)), spec((4, 2))], ["q.w", "k.w"], "k.w", id="interleave-groups"),
        pytest.param(Interleave(axis=0, groups=2), [spec((6, 2)), spec((4, 3))], ["q.w", "k.w"], "k.w", id="interleave-shape"),
        pytest.param(Deinterleave(axis=0, groups=2, sizes=(3, 3), parts=2), [spec((6, 2))], ["qkv.w"], "qkv.w", id="deinterleave-groups"),
        pytest.param(Stack(axis=0), [spec((2, 3)), spec((3, 2))], ["e0.w", "e1.w"], "e1.w", id="stack-shape"),
        pytest.param(Stack(axis=0), [spec((2, 3)), spec((2, 3), "BF16")], ["e0.w", "e1.w"], "e1.w", id="stack-dtype"),
        pytest.param(Stack(axis=3), [spec((2, 3)), spec((2, 3))], ["e0.w", "e1.w"], "e0.w", id="stack-axis"),
        pytest.param(Unstack(axis=2), [spec((2, 3))], ["experts.w"], "experts.w", id="unstack-axis"),
        pytest.param(Transpose(perm=(0, 0)), [spec((2, 3))], ["mlp.fc1.weight"], "mlp.fc1.weight", id="transpose-repeat"),
        pytest.param(Transpose(perm=(1, 0)), [spec((2, 3, 4))], ["mlp.fc1.weight"], "mlp.fc1.weight", id="transpose-ndim"),
        pytest.param(Reshape(shape=(4, 2)), [spec((2, 3))], ["mlp.fc1.weight"], "mlp.fc1.weight", id="reshape-count"),
        pytest.param(Reshape(shape=(-1, -1)), [spec((2, 3))], ["mlp.fc1.weight"], "mlp.fc1.weight", id="reshape-two-unknowns"),
        pytest.param(Reshape(shape=(4, -1)), [spec((2, 3))], ["mlp.fc1.weight"], "mlp.fc1.weight", id="reshape-unknown-misfit"),
        pytest.param(Reorder(axis=0, chunks=4, order=(0, 3, 1, 2)), [spec((6, 2))], ["weight_ih_l0"], "weight_ih_l0", id="reorder-chunks"),
        pytest.param(RopePermute(heads=4, to="hf"), [spec((12, 8))], ["q_proj.weight"], "q_proj.weight", id="rope-rows"),
        pytest.param(RopePermute(heads=2, to="hf"), [spec((8, 2, 2))], ["q_proj.weight"], "q_proj.weight", id="rope-ndim"),
    ],
)
def test_infer_rejects_and_names_the_tensor(op, specs, names, culprit):
    with pytest.raises(PlanError) as e:
        op.infer(specs, names)
    assert culprit in str(e.value)


@pytest.mark.parametrize(
    "op",
    [
        Reorder(axis=0, chunks=4, order=(0, 1, 2)),
        Reorder(axis=0, chunks=2, order=(0, 0)),
        RopePermute(heads=2, to="llama"),
    ],
)
def test_infer_rejects_bad_parameters(op):
    with pytest.raises(PlanError):
        op.infer([spec((8, 2))], ["w"])


# --- bad input through the CLI: refused in full (conftest.assert_refused) ----------------


def test_shape_mismatch_in_concat(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    rules = write_rules(area / "in" / "shape.toml", BAD_CONCAT_RULES + "axis = 0\n")
    refuse_case(cli, area, src, "-r", rules, needles=["bad-concat", "down_proj"])
