"""Guards: rules that stop a plan, for layouts a preset must not silently mishandle."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ..errors import PlanError, printable, quote
from .base import Op


@dataclasses.dataclass(frozen=True)
class Refuse(Op):
    """Refuse every tensor the input pattern matches, with ``message`` saying why and what to do.

    Example: LSTMs with ``proj_size`` carry ``weight_hr_l{k}``, which ONNX's LSTM cannot take.
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
