"""The follower contract, for every op × follower pair (``fusectl._protocols.Follower``).

For each op kind a rule may name (``fusectl.ops.OPS``), one step of it on weights that carry a
follower — a per-tensor, a per-channel or a block scale (``followers.scales``), or a LoRA
adapter's A and B (``followers.lora``) — either lifts, and then running the base step and the
lifted steps gives the base op applied to the dequantized weights (to ΔW = s·B·A), or refuses
with a PlanError naming the rule and the follower tensor. A new op without a decision here
fails ``test_every_op_has_a_decision_for_every_follower``.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from fusectl.dtypes import BY_NAME
from fusectl.errors import PlanError
from fusectl.followers import KINDS, Followers, LoraAdapter, Riders, Scales, Source, detect
from fusectl.followers.lora import PREFIX
from fusectl.followers.scales import QuantScheme
from fusectl.followers.slabs import moved_ids
from fusectl.ops import OPS
from fusectl.ops.dequantize import Dequantize, expand_scale, scale_grid
from fusectl.ops.guard import Refuse
from fusectl.ops.layout import (BlockDiagonal, BlockDiagonalSplit, Concat, Deinterleave, Drop, Interleave, MergeEqual,
                                Rename, Reorder, Replicate, Reshape, RopePermute, Split, Stack, Transpose, Unstack)
from fusectl.ops.reparam import BnFold, SpectralNormFold, WeightNormFold, WeightNormUnfold
from fusectl.steps import Plan, Step, StepGroup
from fusectl.table import ParamTable
from fusectl.tensors import ArrayTensor, TensorSpec

F32 = BY_NAME["F32"]
W = (4, 6)
BLOCK = (2, 3)
RULE = "rule 'r' (test)"
RANK, ALPHA = 2, 4

# op kind -> (op, the step's input weights and shapes, its output weights); ``None`` as the
# op's outputs: the step is built without ``infer`` (an op that computes, refused regardless)
CASES = {
    "rename": (Rename(), {"a": W}, ["o"]),
    "drop": (Drop(), {"a": W}, []),
    "concat": (Concat(axis=0), {"a": W, "b": W}, ["o"]),
    "split": (Split(axis=0, sizes=(2, 2), parts=2), {"a": W}, ["o", "p"]),
    "interleave": (Interleave(axis=0, groups=2), {"a": W, "b": W}, ["o"]),
    "deinterleave": (Deinterleave(axis=0, groups=2, sizes=(2, 2), parts=2), {"a": W}, ["o", "p"]),
    "stack": (Stack(axis=0), {"a": W, "b": W}, ["o"]),
    "unstack": (Unstack(axis=0), {"a": (2, *W)}, ["o", "p"]),
    "transpose": (Transpose(perm=(1, 0)), {"a": W}, ["o"]),
    "reshape": (Reshape(shape=(6, 4)), {"a": W}, ["o"]),
    "reorder": (Reorder(axis=0, chunks=2, order=(1, 0)), {"a": W}, ["o"]),
    "rope_permute": (RopePermute(heads=1, to="hf"), {"a": W}, ["o"]),
    "merge_equal": (MergeEqual(), {"a": W, "b": W}, ["o"]),
    "replicate": (Replicate(parts=2), {"a": W}, ["o", "p"]),
    "block_diagonal": (BlockDiagonal(), {"a": W, "b": W}, ["o"]),
    "block_diagonal_split": (BlockDiagonalSplit(rows=(2, 2), cols=(3, 3), parts=2), {"a": W}, ["o", "p"]),
    "weight_norm_fold": (WeightNormFold(), {"a": W, "b": W}, None),
    "weight_norm_unfold": (WeightNormUnfold(), {"a": W}, None),
    "spectral_norm_fold": (SpectralNormFold(), {"a": W, "b": W, "c": W}, None),
    "bn_fold": (BnFold(), {"a": W, "b": W, "c": W, "d": W, "e": W, "f": W}, None),
    "dequantize": (Dequantize(block=BLOCK), {"a": W}, ["o"]),
    "refuse": (Refuse(message="never"), {"a": W}, None),
}

FOLLOWERS = ("tensor", "channel", "block", "lora")

# what each pair does: "lifts" (checked numerically below) or the refusal's reason (a regex)
COMPUTES = "computes on the weight's values"
DECISIONS = {
    "rename": dict.fromkeys(FOLLOWERS, "lifts"),
    "drop": dict.fromkeys(FOLLOWERS, "lifts"),
    "concat": dict.fromkeys(FOLLOWERS, "lifts"),
    "split": dict.fromkeys(FOLLOWERS, "lifts"),
    "interleave": {"tensor": "lifts", "channel": "lifts", "block": "lifts",
                   "lora": "different A factors, and it does more than concatenate"},
    "deinterleave": {"tensor": "lifts", "channel": "lifts", "block": "lie in different blocks", "lora": "lifts"},
    "stack": {"tensor": "lifts", "channel": "lifts", "block": "lifts",
              "lora": "stacking experts is not lifted"},
    "unstack": {"tensor": "lifts", "channel": "lifts", "block": "lifts",
                "lora": "unstacking experts is not lifted"},
    "transpose": {"tensor": "lifts", "channel": "lifts", "block": "are not the checkpoint's block size",
                  "lora": "lifts"},
    "reshape": {"tensor": "lifts", "channel": "a reshape does not keep blocks",
                "block": "a reshape does not keep blocks", "lora": "does not keep a low-rank factorisation"},
    "reorder": dict.fromkeys(FOLLOWERS, "lifts"),
    "rope_permute": {"tensor": "lifts", "channel": "lifts", "block": "different blocks", "lora": "lifts"},
    "merge_equal": dict.fromkeys(FOLLOWERS, "merge_equal " + COMPUTES),
    "replicate": dict.fromkeys(FOLLOWERS, "replicate " + COMPUTES),
    "block_diagonal": dict.fromkeys(FOLLOWERS, "block_diagonal " + COMPUTES),
    "block_diagonal_split": dict.fromkeys(FOLLOWERS, "block_diagonal_split " + COMPUTES),
    "weight_norm_fold": dict.fromkeys(FOLLOWERS, "weight_norm_fold " + COMPUTES),
    "weight_norm_unfold": dict.fromkeys(FOLLOWERS, "weight_norm_unfold " + COMPUTES),
    "spectral_norm_fold": dict.fromkeys(FOLLOWERS, "spectral_norm_fold " + COMPUTES),
    "bn_fold": dict.fromkeys(FOLLOWERS, "bn_fold " + COMPUTES),
    # the weight's own scale is consumed by the step; its others (input_scale) are dropped
    "dequantize": {"tensor": "lifts", "channel": "lifts", "block": "lifts", "lora": "is not a module's weight"},
    "refuse": dict.fromkeys(FOLLOWERS, "refuse " + COMPUTES),
}


def test_every_op_has_a_decision_for_every_follower():
    assert sorted(CASES) == sorted(OPS), "give each new op a case and a decision for every follower"
    assert sorted(DECISIONS) == sorted(OPS)
    assert all(sorted(d) == sorted(FOLLOWERS) for d in DECISIONS.values())


# ----------------------------------------------------------------- scales


def scale_shape(kind: str, weight: tuple[int, ...]) -> tuple[int, ...]:
    if kind == "tensor":
        return (1,)
    if kind == "channel":
        return (*weight[:-1], 1)
    return (*weight[:-2], -(-weight[-2] // BLOCK[0]), -(-weight[-1] // BLOCK[1]))


def scale_role(kind: str) -> str:
    return "weight_scale_inv" if kind == "block" else "weight_scale"


def _step(op, inputs: dict[str, tuple[int, ...]], outputs, names=lambda n: f"{n}.weight", extra=()) -> Step:
    ins = tuple(names(n) for n in inputs) + tuple(n for n, _ in extra)
    specs = tuple(TensorSpec(F32, s) for s in inputs.values()) + tuple(TensorSpec(F32, s) for _, s in extra)
    if outputs is None:  # an op that computes on values: refused before its outputs matter
        return Step(op, ins, ("o.weight",), specs, specs[:1])
    return Step(op, ins, tuple(names(n) for n in outputs), specs, tuple(op.infer(specs, list(ins))))


def _scales_case(kind_of_op: str, kind: str, rng):
    op, inputs, outputs = CASES[kind_of_op]
    role = scale_role(kind)
    arrays = {f"{n}.weight": rng.standard_normal(s).astype(np.float32) for n, s in inputs.items()}
    # equal per-tensor scales: parts that merge into one weight must share theirs
    shared = rng.random(scale_shape(kind, W)).astype(np.float32) + 0.5
    for n, s in inputs.items():
        arrays[f"{n}.{role}"] = shared if kind == "tensor" else rng.random(scale_shape(kind, s)).astype(np.float32) + 0.5
    extra = ()
    if kind_of_op == "dequantize":  # the step consumes the weight's scale; its input_scale is dropped
        extra = ((f"a.{role}", scale_shape(kind, W)),)
        arrays["a.input_scale"] = np.ones((1,), np.float32)
    step = _step(op, inputs, outputs, extra=extra)
    table = ParamTable.from_stored({n: ArrayTensor(TensorSpec(F32, a.shape), a) for n, a in arrays.items()})
    return step, table, arrays


def _run(steps, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = dict(arrays)
    for step in steps:
        results = step.op.apply([out[n] for n in step.inputs])
        for n in step.inputs:
            out.pop(n, None)
        out.update(zip(step.outputs, results))
    return out


def _dequantized(weight, scale):
    grid = scale_grid(weight.shape, scale.shape, BLOCK)
    assert grid is not None, (weight.shape, scale.shape)
    return weight * expand_scale(scale, weight.shape, grid)


@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
@pytest.mark.parametrize("op_kind", sorted(OPS))
def test_a_scale_follows_each_op_or_the_op_is_refused_naming_the_rule_and_the_scale(op_kind, kind):
    rng = np.random.default_rng(0)
    step, table, arrays = _scales_case(op_kind, kind, rng)
    scales = Scales(scheme=QuantScheme(BLOCK, "test"))
    decision = DECISIONS[op_kind][kind]
    if decision != "lifts":
        with pytest.raises(PlanError, match=re.escape(RULE) + ".*" + decision) as caught:
            step.op.lift(_ScaleProbe(scales, step, table))
        assert f"a.{scale_role(kind)}" in str(caught.value)
        return
    lifted = scales.lift(step, [step], table, RULE)
    assert lifted, "a weight's scales must move with it"
    after = _run([step, *lifted], arrays)
    assert not any(n.startswith(("a.", "b.")) for n in after), f"left behind: {sorted(after)}"
    if op_kind == "dequantize":
        assert [s.op.kind for s in lifted] == ["drop"] and lifted[0].inputs == ("a.input_scale",)
        return
    role = scale_role(kind)
    for out in step.outputs:
        assert f"{out[: -len('weight')]}{role}" in after, f"{out} lost its scale"
    # dequantizing after the step = the step on the dequantized weights
    want = step.op.apply([_dequantized(arrays[w], arrays[f"{w[:-len('weight')]}{role}"]) for w in step.inputs])
    for out, expected in zip(step.outputs, want):
        got = _dequantized(after[out], after[f"{out[:-len('weight')]}{role}"])
        np.testing.assert_array_equal(got, expected)


class _ScaleProbe:
    """Calls ``Scales.lift`` as the op's ``lift`` would be reached: the contract's refusals."""

    def __init__(self, scales, step, table):
        self.scales, self.step, self.table = scales, step, table
        self.ndim = len(step.input_specs[0].shape)

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.scales.lift(self.step, [self.step], self.table, RULE)


# ----------------------------------------------------------------- LoRA


def _factor(module: str, factor: str) -> str:
    return f"{PREFIX}{module}.lora_{factor}.weight"


def _lora_case(op_kind: str, rng):
    op, inputs, outputs = CASES[op_kind]
    arrays = {}
    for n, shape in inputs.items():
        arrays[_factor(n, "A")] = rng.standard_normal((RANK, shape[-1])).astype(np.float32)
        arrays[_factor(n, "B")] = rng.standard_normal((shape[-2], RANK)).astype(np.float32)
    table = ParamTable.from_stored({n: ArrayTensor(TensorSpec(F32, a.shape), a) for n, a in arrays.items()})
    extra = (("a.weight_scale_inv", (2, 2)),) if op_kind == "dequantize" else ()
    step = _step(op, inputs, outputs, extra=extra)
    adapter = LoraAdapter("adapter_config.json", "{}", {"r": RANK, "lora_alpha": ALPHA}, table)
    return step, table, arrays, adapter


def _delta(arrays, module: str, rank=RANK, alpha=ALPHA) -> np.ndarray:
    return (alpha / rank) * (arrays[_factor(module, "B")].astype(np.float64) @ arrays[_factor(module, "A")])


@pytest.mark.parametrize("op_kind", sorted(OPS))
def test_a_lora_adapter_follows_each_op_or_the_op_is_refused_naming_the_rule_and_a_factor(op_kind):
    rng = np.random.default_rng(1)
    step, table, arrays, adapter = _lora_case(op_kind, rng)
    decision = DECISIONS[op_kind]["lora"]
    if decision != "lifts":
        with pytest.raises(PlanError, match=re.escape(RULE) + ".*" + decision) as caught:
            adapter.lift(step, [step], table, RULE)
        assert "lora_B" in str(caught.value) or "a.weight_scale_inv" in str(caught.value)
        return
    lifted = adapter.lift(step, [step], table, RULE)
    after = _run(lifted, arrays)
    modules = adapter._lifting.modules
    assert not any(n.startswith(f"{PREFIX}a.") or n.startswith(f"{PREFIX}b.") for n in after if n not in
                   {_factor(o[: -len('.weight')], f) for o in step.outputs for f in "AB"})
    want = step.op.apply([_delta(arrays, w[: -len(".weight")]) for w in step.inputs])
    for out, expected in zip(step.outputs, want):
        module = modules[out[: -len(".weight")]]
        got = (module.alpha / module.rank) * (after[module.b].astype(np.float64) @ after[module.a])
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-9)
