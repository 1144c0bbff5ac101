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
from fusectl.followers.lora import PREFIX, _Lifting
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

FOLLOWERS = ("tensor", "channel", "block", "lora", "optimizer")

# what each pair does: "lifts" (checked numerically below) or the refusal's reason (a regex)
COMPUTES = "computes on the weight's values"
DECISIONS = {
    "rename": dict.fromkeys(FOLLOWERS, "lifts"),
    "drop": dict.fromkeys(FOLLOWERS, "lifts"),
    "concat": dict.fromkeys(FOLLOWERS, "lifts"),
    "split": dict.fromkeys(FOLLOWERS, "lifts"),
    "interleave": {"tensor": "lifts", "channel": "lifts", "block": "lifts",
                   "lora": "different A factors, and it does more than concatenate", "optimizer": "lifts"},
    "deinterleave": {"tensor": "lifts", "channel": "lifts", "block": "lie in different blocks", "lora": "lifts",
                     "optimizer": "lifts"},
    "stack": {"tensor": "lifts", "channel": "lifts", "block": "lifts",
              "lora": "stacking experts is not lifted", "optimizer": "lifts"},
    "unstack": {"tensor": "lifts", "channel": "lifts", "block": "lifts",
                "lora": "unstacking experts is not lifted", "optimizer": "lifts"},
    "transpose": {"tensor": "lifts", "channel": "lifts", "block": "are not the checkpoint's block size",
                  "lora": "lifts", "optimizer": "lifts"},
    "reshape": {"tensor": "lifts", "channel": "a reshape does not keep blocks",
                "block": "a reshape does not keep blocks", "lora": "does not keep a low-rank factorisation",
                "optimizer": "lifts"},
    "reorder": dict.fromkeys(FOLLOWERS, "lifts"),
    "rope_permute": {"tensor": "lifts", "channel": "lifts", "block": "different blocks", "lora": "lifts",
                     "optimizer": "lifts"},
    "merge_equal": dict.fromkeys(FOLLOWERS, "merge_equal " + COMPUTES),
    "replicate": dict.fromkeys(FOLLOWERS, "replicate " + COMPUTES),
    "block_diagonal": dict.fromkeys(FOLLOWERS, "block_diagonal " + COMPUTES),
    "block_diagonal_split": dict.fromkeys(FOLLOWERS, "block_diagonal_split " + COMPUTES),
    "weight_norm_fold": dict.fromkeys(FOLLOWERS, "weight_norm_fold " + COMPUTES),
    "weight_norm_unfold": dict.fromkeys(FOLLOWERS, "weight_norm_unfold " + COMPUTES),
    "spectral_norm_fold": dict.fromkeys(FOLLOWERS, "spectral_norm_fold " + COMPUTES),
    "bn_fold": dict.fromkeys(FOLLOWERS, "bn_fold " + COMPUTES),
    # the weight's own scale is consumed by the step; its others (input_scale) are dropped
    # an optimizer's moments belong to the quantized parameter: a dequantized one is another
    "dequantize": {"tensor": "lifts", "channel": "lifts", "block": "lifts", "lora": "is not a module's weight",
                   "optimizer": "drops the state while the parameter goes on"},
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


def _lift_lora(adapter, step, table):
    """The steps ``adapter`` lifts ``step`` to, and the adapted modules after it."""
    lifting = _Lifting(table, adapter.modules(table), None)
    return lifting.lift(step, adapter.config, RULE), lifting.modules


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
    assert adapter.lift(step, [step], table, RULE) == _lift_lora(adapter, step, table)[0]
    lifted, modules = _lift_lora(adapter, step, table)
    after = _run(lifted, arrays)
    assert not any(n.startswith(f"{PREFIX}a.") or n.startswith(f"{PREFIX}b.") for n in after if n not in
                   {_factor(o[: -len('.weight')], f) for o in step.outputs for f in "AB"})
    want = step.op.apply([_delta(arrays, w[: -len(".weight")]) for w in step.inputs])
    for out, expected in zip(step.outputs, want):
        module = modules[out[: -len(".weight")]]
        got = (module.alpha / module.rank) * (after[module.b].astype(np.float64) @ after[module.a])
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-9)


# ----------------------------------------------------------------- scales: the edges of the contract


def _scale_table(entries: dict[str, tuple[int, ...]]) -> ParamTable:
    return ParamTable.from_stored({n: ArrayTensor(TensorSpec(F32, s), np.ones(s, np.float32))
                                   for n, s in entries.items()})


def _lift_scales(op, inputs, outputs, entries, block=BLOCK, step_specs=None):
    table = _scale_table(entries)
    specs = tuple(table.spec(n) for n in inputs)
    out_specs = step_specs if step_specs is not None else tuple(op.infer(specs, list(inputs)))
    step = Step(op, tuple(inputs), tuple(outputs), specs, tuple(out_specs))
    return Scales(scheme=QuantScheme(block, "test")).lift(step, [step], table, RULE)


def test_scale_kinds_and_the_inspect_report_of_a_scale_that_fits_no_grid():
    from fusectl.followers.scales import Scale

    grid = Scale("weight_scale", "a.weight_scale", TensorSpec(F32, (1, 6)), (None, 1))
    assert grid.kind == "grid ['*', 1]"
    table = _scale_table({"a.weight": W, "a.weight_scale": (5,), "b.weight": W, "b.weight_scale_inv": (2, 2)})
    scales = Scales.detect(table, {"quantization_config": {"weight_block_size": list(BLOCK)}})
    assert scales.scheme == QuantScheme(BLOCK, "config.json quantization_config.weight_block_size")
    report = scales.report()
    assert report["weights"]["a.weight"] == [{"name": "a.weight_scale", "role": "weight_scale", "kind": "unrecognized"}]
    assert report["weights"]["b.weight"][0]["kind"] == "block 2x3"
    assert scales.claims("b.weight", table) == ["b.weight_scale_inv"] and scales.claims("c.weight", table) == []
    assert Scales(scheme=QuantScheme()).report() is None


def test_an_unknown_quantization_companion_stops_the_rule_but_another_weights_does_not():
    with pytest.raises(PlanError, match="'m.w1' has 'm.w1_qzeros' beside it"):
        _lift_scales(Rename(), ["m.w1"], ["m.w3"], {"m.w1": W, "m.w1_qzeros": (1,), "m.w2_qzeros": (1,)})
    assert _lift_scales(Rename(), ["m.w1"], ["m.w3"], {"m.w1": W, "m.w2_qzeros": (1,)}) == []


def test_parts_quantized_differently_are_refused_naming_both_scales():
    with pytest.raises(PlanError, match="'b.weight_scale'.*'a.weight_scale'.*different kinds"):
        _lift_scales(Concat(axis=0), ["a.weight", "b.weight"], ["o.weight"],
                     {"a.weight": W, "a.weight_scale": (4, 1), "b.weight": W, "b.weight_scale": (1,)})


def test_per_tensor_scales_of_different_shapes_cannot_merge():
    with pytest.raises(PlanError, match="a.weight_scale.*merged tensors must have one shape"):
        _lift_scales(Concat(axis=0), ["a.weight", "b.weight"], ["o.weight"],
                     {"a.weight": W, "a.weight_scale": (1,), "b.weight": W, "b.weight_scale": (1, 1)})


def test_a_step_of_many_weights_to_many_carries_no_per_tensor_scale():
    specs = (TensorSpec(F32, W),) * 2
    with pytest.raises(PlanError, match="maps 2 tensors to 2"):
        _lift_scales(Concat(axis=0), ["a.weight", "b.weight"], ["o.weight", "p.weight"],
                     {"a.weight": W, "a.weight_scale": (1,), "b.weight": W, "b.weight_scale": (1,)}, step_specs=specs)


class _Misplaced(Concat):
    """A concat whose op for the scales puts their blocks elsewhere (or fits no scale)."""

    def lift(self, lift):
        lift.along(0, lambda in_lengths, out_lengths: self.scales_op)


def test_an_op_whose_scale_op_does_not_move_whole_blocks_like_the_weights_is_refused():
    entries = {"a.weight": W, "a.weight_scale_inv": (2, 2), "b.weight": W, "b.weight_scale_inv": (2, 2)}
    for scales_op, needle in ((Reshape(shape=(7,)), "do not move as whole blocks"),
                              (Interleave(axis=0, groups=2), "do not move as whole blocks")):
        op = _Misplaced(axis=0)
        object.__setattr__(op, "scales_op", scales_op)
        with pytest.raises(PlanError, match=needle):
            _lift_scales(op, ["a.weight", "b.weight"], ["o.weight"], entries)


def test_scales_stack_and_unstack_along_the_first_axis_only():
    with pytest.raises(PlanError, match="stack along axis 0 only"):
        _lift_scales(Stack(axis=1), ["a.weight", "b.weight"], ["o.weight"],
                     {"a.weight": W, "a.weight_scale": (4, 1), "b.weight": W, "b.weight_scale": (4, 1)})
    with pytest.raises(PlanError, match="unstack along axis 0 only"):
        _lift_scales(Unstack(axis=1), ["a.weight"], [f"o{k}.weight" for k in range(4)],
                     {"a.weight": (2, 4, 6), "a.weight_scale": (2, 4, 1)})
    with pytest.raises(PlanError, match="one entry per stacked tensor"):
        _lift_scales(Unstack(axis=0), ["a.weight"], [f"o{k}.weight" for k in range(4)],
                     {"a.weight": W, "a.weight_scale_inv": (2, 2)})


def test_a_square_block_grid_transposes():
    (step,) = _lift_scales(Transpose(perm=(1, 0)), ["a.weight"], ["o.weight"],
                           {"a.weight": (4, 6), "a.weight_scale_inv": (2, 3)}, block=(2, 2))
    assert step.op == Transpose(perm=(1, 0)) and step.output_specs[0].shape == (3, 2)


def test_the_registry_detects_scales_everywhere_and_an_adapter_where_its_config_is():
    table = _scale_table({"a.weight": W})
    plain = detect(Source(table, {}))
    assert [type(f) for f in plain.followers] == [Scales] and plain.view is None
    assert plain.report("scales") is None and plain.report("lora") is None and plain.of("lora") is None
    adapter = detect(Source(table, None, ("adapter_config.json", "{}", {"r": 2}), None))
    assert isinstance(adapter.view, LoraAdapter) and adapter.view.config_files() == {
        "adapter_config.json": ("adapter_config.json", "{}")}
    assert [k.name for k in KINDS] == ["scales", "optimizer", "lora"]
    riders = adapter.riders()
    assert isinstance(riders, Riders) and riders.claimed(["a.weight"]) >= {"a.weight_scale_inv"}
    assert isinstance(Followers([]).riders(), Riders)


# ----------------------------------------------------------------- LoRA: the edges of the contract


def _adapter(entries: dict[str, tuple[int, ...]], raw=None, history=None):
    table = ParamTable.from_stored({n: ArrayTensor(TensorSpec(F32, s), np.ones(s, np.float32))
                                    for n, s in entries.items()})
    return LoraAdapter("adapter_config.json", "{}", raw or {"r": RANK, "lora_alpha": ALPHA}, table, history), table


def _factors(module, out=4, inp=6, rank=RANK, embedding=False):
    if embedding:
        return {f"{PREFIX}{module}.lora_embedding_A": (rank, out), f"{PREFIX}{module}.lora_embedding_B": (inp, rank)}
    return {_factor(module, "A"): (rank, inp), _factor(module, "B"): (out, rank)}


def _lora_step(op, inputs, outputs, shape=W, out_specs=None):
    specs = tuple(TensorSpec(F32, shape) for _ in inputs)
    outs = out_specs if out_specs is not None else tuple(op.infer(specs, [f"{n}.weight" for n in inputs]))
    return Step(op, tuple(f"{n}.weight" for n in inputs), tuple(f"{n}.weight" for n in outputs), specs, tuple(outs))


def test_a_damaged_adapter_is_refused_naming_the_tensor():
    from fusectl.errors import CheckpointError

    with pytest.raises(CheckpointError, match="does not hold one lora_A and one lora_B"):
        _adapter({_factor("a", "A"): (2, 6)})[0].modules(_adapter({_factor("a", "A"): (2, 6)})[1])
    adapter, table = _adapter({**_factors("a"), f"{PREFIX}a.lora_B.bias": (4,)})
    with pytest.raises(CheckpointError, match="lora_B.bias.*does not know how to move"):
        adapter.modules(table)
    adapter, table = _adapter({_factor("a", "A"): (2, 6), _factor("a", "B"): (4, 3)})
    with pytest.raises(CheckpointError, match="are not the"):
        adapter.base_view(table)


def test_whole_weights_saved_with_the_adapter_are_no_modules_and_claims_name_the_factors():
    adapter, table = _adapter({**_factors("a"), "lm_head.weight": (4, 6)})
    assert list(adapter.modules(table)) == ["a"]
    assert adapter.claims("a.weight", table) == [_factor("a", "A"), _factor("a", "B")]
    assert adapter.claims("lm_head.weight", table) == [] and adapter.claims("a.bias", table) == []
    assert adapter.report()["modules"]["a"]["rank"] == RANK


def test_tied_a_factors_are_one_shared_factor_the_concat_keeps_rank_r():
    adapter, table = _adapter({**_factors("a"), **_factors("b")})
    table.tie([_factor("a", "A"), _factor("b", "A")], keep=_factor("a", "A"))
    lifted, modules = _lift_lora(adapter, _lora_step(Concat(axis=0), ["a", "b"], ["o"]), table)
    assert [s.op.kind for s in lifted] == ["concat", "merge_equal"]
    assert modules["o"].rank == RANK


def test_a_column_concat_is_the_mirror_image_block_diagonal_a_and_b_side_by_side():
    adapter, table = _adapter({**_factors("a"), **_factors("b")})
    lifted, modules = _lift_lora(adapter, _lora_step(Concat(axis=1), ["a", "b"], ["o"]), table)
    assert [(s.op.kind, s.outputs) for s in lifted] == [("block_diagonal", (_factor("o", "A"),)),
                                                        ("concat", (_factor("o", "B"),))]
    assert lifted[1].op == Concat(axis=1) and modules["o"].rank == 2 * RANK


def test_lora_refusals_name_the_rule_and_the_factor():
    cases = [
        ({**_factors("a", embedding=True)}, _lora_step(Reorder(axis=0, chunks=2, order=(1, 0)), ["a"], ["o"]),
         "an embedding's LoRA moves only by rename or drop"),
        ({**_factors("a")}, _lora_step(Reorder(axis=0, chunks=2, order=(1, 0)), ["a"], ["o"], shape=(4, 6, 1)),
         "not axis"),
        ({**_factors("a"), **_factors("b")}, _lora_step(Concat(axis=0), ["a", "b"], ["o", "p"],
                                                        out_specs=(TensorSpec(F32, W),) * 2), "maps 2 weights to 2"),
        ({**_factors("a", embedding=True)}, _lora_step(Transpose(perm=(1, 0)), ["a"], ["o"]), "only a matrix transpose"),
        ({**_factors("a"), **_factors("b", rank=3)}, _lora_step(Concat(axis=0), ["a", "b"], ["o"]), "scalings differ"),
        ({**_factors("a"), **_factors("b", inp=5)}, _lora_step(Concat(axis=0), ["a", "b"], ["o"]),
         "has shape"),
    ]
    for entries, step, needle in cases:
        raw = {"r": RANK, "lora_alpha": ALPHA, "rank_pattern": {"b": 3}} if "scalings" in needle else None
        adapter, table = _adapter(entries, raw)
        with pytest.raises(PlanError, match=re.escape(RULE) + ".*lora_.*" + needle):
            adapter.lift(step, [step], table, RULE)


def test_lifting_a_plan_skips_config_groups_and_rewrites_a_string_target_modules():
    adapter, table = _adapter(_factors("a"), {"r": RANK, "lora_alpha": ALPHA, "target_modules": "a"})
    step = _lora_step(Rename(), ["a"], ["o"])
    base = Plan((StepGroup("[config]", "r.toml", ()), StepGroup("r", "r.toml", (step,))))
    plan, result = adapter.lift_plan(base, table, untie=False)
    assert [g.rule for g in plan.groups] == ["r", "adapter_config"]
    assert plan.groups[-1].config.sets == (("target_modules", '["o"]'),)
    assert sorted(result.names()) == [_factor("o", "A"), _factor("o", "B")]


def test_moved_ids_number_the_slabs_across_the_inputs():
    (ids,) = moved_ids(Interleave(axis=0, groups=2), [2, 2], 0, 2)
    assert ids.reshape(-1).tolist() == [0, 2, 1, 3]


def test_the_planner_knows_nothing_of_scales_or_adapters():
    """It binds rules to base weights; what rides on them comes through ``_protocols``."""
    import ast
    import pathlib

    import fusectl.planner

    source = pathlib.Path(fusectl.planner.__file__).read_text()
    assert not re.search(r"quantiz|adapter|scale|lora", source, re.IGNORECASE)
    imported = {node.module for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)}
    assert not any(m and m.split(".")[0] == "followers" for m in imported), imported
    assert "_protocols" in imported


def test_a_checkpoints_followers_are_detected_once(monkeypatch):
    import fusectl.followers
    import fusectl.io.checkpoint
    from fusectl.io.checkpoint import open_checkpoint

    calls = []
    real = fusectl.io.checkpoint.detect
    monkeypatch.setattr(fusectl.io.checkpoint, "detect", lambda source: calls.append(source) or real(source))
    checkpoint = open_checkpoint(str(pytest.importorskip("conftest").FIXTURES / "lora" / "llama-lora"))
    assert checkpoint.followers is checkpoint.followers
    assert len(calls) == 1 and isinstance(checkpoint.followers.view, LoraAdapter)
    assert isinstance(checkpoint.followers, fusectl.followers.Followers)


def test_two_views_of_one_checkpoint_are_a_bug_in_the_registry_not_a_plan():
    """A view replaces the base, so two at once could not both be served: Followers refuses."""
    from fusectl.errors import InternalError

    lora = next(k for k in KINDS if k.name == "lora")
    with pytest.raises(InternalError, match="are all views of one checkpoint"):
        Followers([(lora, LoraAdapter("a/adapter_config.json", "{}", {}, None)),
                   (lora, LoraAdapter("b/adapter_config.json", "{}", {}, None))])


# ----------------------------------------------------------------- optimizer state: the op × optimizer column


def _optimizer_case(op_kind: str, rng):
    from fusectl.followers.optimizer import OptimizerFollower
    from fusectl.io.optimizer_state import ParamMap, parse_optimizer
    op, inputs, outputs = CASES[op_kind]
    extra = (("a.weight_scale_inv", scale_shape("block", W)),) if op_kind == "dequantize" else ()
    step = _step(op, inputs, outputs, extra=extra)
    arrays, state = {}, {}
    for i, (n, s) in enumerate(inputs.items()):
        arrays[f"{n}.weight"] = rng.standard_normal(s).astype(np.float32)
        arrays[f"{n}.weight::exp_avg"] = rng.standard_normal(s).astype(np.float32)
        arrays[f"{n}.weight::step"] = np.array(3.0, np.float32)
        state[i] = {k: ArrayTensor(TensorSpec(F32, a.shape), a) for k, a in
                    (("exp_avg", arrays[f"{n}.weight::exp_avg"]), ("step", arrays[f"{n}.weight::step"]))}
    tree = {"state": state, "param_groups": [{"params": list(range(len(inputs))), "amsgrad": False}]}
    parsed = parse_optimizer(tree, "opt", "test.pt")
    follower = OptimizerFollower(parsed, ParamMap({i: f"{n}.weight" for i, n in enumerate(inputs)}, "test"))
    table = ParamTable.from_stored({n: ArrayTensor(TensorSpec(F32, a.shape), a) for n, a in arrays.items()})
    return step, table, arrays, follower


@pytest.mark.parametrize("op_kind", sorted(OPS))
def test_optimizer_state_takes_each_op_or_the_op_is_refused_naming_the_rule_and_the_optimizer(op_kind):
    rng = np.random.default_rng(1)
    step, table, arrays, follower = _optimizer_case(op_kind, rng)
    decision = DECISIONS[op_kind]["optimizer"]
    if decision != "lifts":
        with pytest.raises(PlanError, match=re.escape(RULE) + ".*Adam/AdamW.*" + decision):
            follower.lift(step, [step], table, RULE)
        return
    lifted = follower.lift(step, [step], table, RULE)
    after = _run([step, *lifted], arrays)
    assert not any(n.startswith(("a.", "b.")) for n in after), f"left behind: {sorted(after)}"
    if not step.outputs:
        assert after == {}
        return
    # the moment took exactly the weight's op; the step is kept once, unchanged
    want = step.op.apply([arrays[f"{w}::exp_avg"] for w in step.inputs])
    for out, expected in zip(step.outputs, want):
        np.testing.assert_array_equal(after[f"{out}::exp_avg"], expected)
        assert after[f"{out}::step"].shape == () and float(after[f"{out}::step"]) == 3.0
