"""Guards: rules that stop a plan, for layouts a preset must not silently mishandle."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ..errors import PlanError, printable, quote
from .base import Op


@dataclasses.dataclass(frozen=True)
class Refuse(Op):
    """Refuse every tensor the input pattern matches, with ``message`` saying why and what to do.

    Rule keys: ``op = "refuse"``, ``input``, ``message``; no output. A guard: a match stops the
    plan with a PlanError naming the tensor and giving the message. Write it with
    ``optional = true``: like any rule's, a match of nothing is otherwise an error (but a rules
    file in which only guards match nothing is not one that fits no model). Inverse: none
    needed; inverting a rules file leaves its guards out. Example: LSTMs with ``proj_size``
    carry ``weight_hr_l{k}``, which ONNX's LSTM cannot take.

    >>> from fusectl.dtypes import BY_NAME
    >>> from fusectl.tensors import TensorSpec
    >>> Refuse(message="use lstm-to-mxnet-fused").infer([TensorSpec(BY_NAME["F32"], (4, 2))], ["lstm.weight_hr_l0"])
    Traceback (most recent call last):
    ...
    fusectl.errors.PlanError: 'lstm.weight_hr_l0': use lstm-to-mxnet-fused

    Rule::

        [[rule]]
        op       = "refuse"
        input    = "{p*}.weight_hr_l{k}"
        message  = "this LSTM has proj_size, which ONNX's LSTM cannot express"
        optional = true
    """

    kind: ClassVar[str] = "refuse"
    guard: ClassVar[bool] = True
    outputs_field: ClassVar[str | None] = None
    message: str = "this tensor is not supported by these rules"

    def infer(self, specs, names):
        raise PlanError(f"{quote(names[0])}: {printable(self.message)}")

    def output_count(self, specs):
        return 0

    def apply(self, arrays):  # pragma: no cover - infer always refuses first
        raise PlanError(self.message)
