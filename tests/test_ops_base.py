"""The op contract (ops/base.py): the defaults an op inherits (no inverse, no byte ranges, the
default lift refusing, no ONNX forms), parameters to JSON and back, and the shared checks
(an axis out of range, inputs of different dtypes) refused naming the tensor."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np
import pytest

from fusectl.dtypes import BY_NAME
from fusectl.errors import PlanError
from fusectl.ops import OPS
from fusectl.ops.base import Op, RowMover, leading_ones, normalize_axis, same_dtype
from fusectl.ops.layout import Concat, Transpose
from fusectl.tensors import TensorSpec

F32 = BY_NAME["F32"]


@dataclasses.dataclass(frozen=True)
class Scale(Op):
    """A test op: multiplies by ``factor``; inherits every default."""

    kind: ClassVar[str] = "test_scale"
    exact: ClassVar[bool] = False
    factor: float = 2.0
    axis: int = -1
    dims: tuple[int, ...] = (1, 2)

    def infer(self, specs, names):
        return [specs[0]]

    def apply(self, arrays):
        return [arrays[0] * self.factor]


@dataclasses.dataclass(frozen=True)
class Rows(RowMover, Op):
    kind: ClassVar[str] = "test_rows"
    axis: int = 0


class Lift:
    """Records what an op says through ``lift``."""

    def __init__(self):
        self.refusals = []

    def refuse(self, why):
        self.refusals.append(why)


def test_the_defaults_of_an_op():
    op = Scale()
    spec = TensorSpec(F32, (2, 3))
    assert op.for_present([True, False]) is op
    assert op.with_block_size((128, 128)) is op
    assert op.input_roles() == ()
    assert op.output_count([spec]) == 1
    assert op.inverse([spec]) is None and op.inverse(None) is None
    assert op.byte_ranges([()], [spec], 0) is None
    assert op.rule_inverse_problem("k") is None
    assert op.moves_rows([spec]) is False
    assert op.op_axis(3) == 2


def test_the_base_leaves_infer_and_apply_to_each_op():
    with pytest.raises(NotImplementedError):
        Op.infer(Scale(), [], [])
    with pytest.raises(NotImplementedError):
        Op.apply(Scale(), [])


def test_an_op_without_onnx_forms_says_which():
    with pytest.raises(NotImplementedError, match="test_scale has no ONNX un-fuse"):
        Scale().onnx_unfuse(None, [], [], [])
    with pytest.raises(NotImplementedError, match="test_scale has no probe"):
        Scale().probe(None, [], [], [], [])
    with pytest.raises(NotImplementedError, match="test_scale has no graph fold"):
        Scale().fold_in_graph(None, None, [])


def test_the_default_lift_refuses_naming_the_op():
    lift = Lift()
    Scale().lift(lift)
    assert lift.refusals == ["test_scale computes on the weight's values"]


def test_the_default_probe_reads_out_each_input_against_its_recovery():
    class Probe:
        ref, cand = "ref", "cand"

        def __init__(self):
            self.params, self.read = [], []

        def param(self, builder, array):
            self.params.append((builder, array.shape))
            return f"{builder}:{len(self.params)}"

        def readouts(self, k, ref, cand, shape):
            self.read.append((k, ref, cand, shape))

    @dataclasses.dataclass(frozen=True)
    class Recover(Scale):
        kind: ClassVar[str] = "test_recover"
        onnx_unfusable: ClassVar[bool] = True

        def onnx_unfuse(self, b, input_specs, output_specs, fused):
            return [f"{b} recovers {k} from {fused}" for k in range(len(input_specs))]

    p = Probe()
    before = [np.zeros((2, 3)), np.zeros((4, 3))]
    specs = [TensorSpec(F32, (2, 3)), TensorSpec(F32, (4, 3))]
    Recover().probe(p, before, [np.zeros((6, 3))], specs, [TensorSpec(F32, (6, 3))])
    assert p.params[0] == ("cand", (6, 3))  # the fused tensor goes to the candidate
    assert [r[0] for r in p.read] == [0, 1]
    assert p.read[0][2] == "cand recovers 0 from ['cand:1']"
    assert [r[3] for r in p.read] == [(2, 3), (4, 3)]
    assert p.read[1][1] == "ref:3"


def test_params_are_json_ready_and_read_back():
    op = Scale(factor=0.5, axis=1, dims=(3, 4))
    params = op.params()
    assert params == {"factor": 0.5, "axis": 1, "dims": [3, 4]}
    assert Scale.from_params(params) == op
    assert OPS["concat"].from_params({"axis": 0, "sizes": [2, 3]}) == Concat(axis=0, sizes=(2, 3))
    assert Transpose.from_params({"perm": [2, 0, 1]}).perm == (2, 0, 1)


def test_every_registered_op_reads_back_its_own_params():
    for kind, cls in OPS.items():
        op = cls()
        assert op.kind == kind
        assert cls.from_params(op.params()) == op, kind


def test_normalize_axis():
    assert normalize_axis(-1, 3, "w") == 2
    assert normalize_axis(0, 1, "w") == 0
    with pytest.raises(PlanError) as err:
        normalize_axis(3, 3, "layer.weight")
    assert str(err.value) == "'layer.weight' has 3 dimensions; axis 3 is out of range"
    with pytest.raises(PlanError, match=r"'g' has 2 dimensions; dim -3 is out of range"):
        normalize_axis(-3, 2, "g", "dim")


def test_same_dtype_names_the_odd_input_and_the_first():
    same_dtype([TensorSpec(F32, (1,))] * 2, ["a", "b"])
    with pytest.raises(PlanError) as err:
        same_dtype([TensorSpec(F32, (1,)), TensorSpec(F32, (1,)), TensorSpec(BY_NAME["BF16"], (1,))],
                   ["q", "k", "v"])
    assert "'v' is" in str(err.value) and "but 'q' is" in str(err.value)
    assert "inputs of one step must share a dtype" in str(err.value)


def test_a_row_mover_moves_rows_along_axis_zero_of_a_matrix():
    assert Rows(axis=0).moves_rows([TensorSpec(F32, (4, 3))])
    assert Rows(axis=-2).moves_rows([TensorSpec(F32, (4, 3))])
    assert not Rows(axis=1).moves_rows([TensorSpec(F32, (4, 3))])
    assert not Rows(axis=0).moves_rows([TensorSpec(F32, (4,))])  # a vector has no columns to window


def test_leading_ones():
    assert leading_ones((1, 1, 5), 2)
    assert leading_ones((7, 3), 0)
    assert not leading_ones((1, 2, 5), 2)
