"""The op contract: an op is one small frozen class that plans shapes, applies, and inverts."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Sequence

import numpy as np

from ..errors import PlanError
from ..tensors import ByteRange, TensorSpec


@dataclasses.dataclass(frozen=True)
class Op:
    """Base of every op. Subclasses are frozen dataclasses whose fields are the op's parameters.

    ``inputs_field`` / ``outputs_field`` say how a rule names its tensors: ``"input"`` (one
    pattern), ``"inputs"`` (a list, or one pattern with ``over``), ``"output"``, ``"outputs"``.
    Ops whose tensors play distinct roles name them instead: ``named_inputs = ("g", "v")``.
    """

    kind: ClassVar[str]
    summary: ClassVar[str] = ""
    inputs_field: ClassVar[str] = "input"
    outputs_field: ClassVar[str] = "output"
    # exact ops move bytes (bitwise for every dtype); numeric ones compute in float32/64
    exact: ClassVar[bool] = True
    named_inputs: ClassVar[tuple[str, ...]] = ()
    named_outputs: ClassVar[tuple[str, ...]] = ()
    # tensors a rule or a binding may lack (e.g. bn_fold's bias); by position in the inputs
    optional_inputs: ClassVar[frozenset[int]] = frozenset()
    # named inputs whose matches find a rule's bindings (empty: every input's). A binding found
    # this way needs the other inputs (optional ones aside), or it is an error naming the tensor
    # missing; names that only fit the others are not bindings (a BatchNorm's own
    # ``weight`` matched by a layer-weight pattern)
    binding_inputs: ClassVar[tuple[str, ...]] = ()

    def for_present(self, present: Sequence[bool]) -> "Op":
        """The op to run when some optional inputs are absent (they are left out of its inputs)."""
        return self

    def input_roles(self) -> tuple[str, ...]:
        """Role names of the inputs this op takes (empty for ops with positional inputs)."""
        return self.named_inputs

    def infer(self, specs: Sequence[TensorSpec], names: Sequence[str]) -> list[TensorSpec]:
        """Check the inputs' dtypes and shapes and return the outputs' (PlanError naming
        the offending tensor when they do not fit)."""
        raise NotImplementedError

    def output_count(self, specs: Sequence[TensorSpec]) -> int:
        """How many outputs ``infer`` returns; ops whose count depends on shapes override."""
        return 1

    def apply(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Compute the outputs from the inputs' data."""
        raise NotImplementedError

    def inverse(self, specs: Sequence[TensorSpec] | None) -> "Op | None":
        """The op that undoes this one, given the input specs it saw; None when one-way.

        ``specs`` is None when inverting a rule rather than a planned step: an op whose
        inverse needs shapes the rule does not state raises PlanError."""
        return None

    def byte_ranges(
        self, ranges: Sequence[tuple[ByteRange, ...]], specs: Sequence[TensorSpec], index: int
    ) -> tuple[ByteRange, ...] | None:
        """Output ``index`` as file ranges of the inputs, when it is a plain byte copy."""
        return None

    def params(self) -> dict:
        """The op's parameters as JSON-ready data (for plans and provenance)."""
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_params(cls, params: dict) -> "Op":
        return cls(**{k: _frozen(v) for k, v in params.items()})


def _jsonable(value):
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def _frozen(value):
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def normalize_axis(axis: int, ndim: int, name: str) -> int:
    """A non-negative axis, or a PlanError naming the tensor."""
    if not -ndim <= axis < ndim:
        raise PlanError(f"{name!r} has {ndim} dimensions; axis {axis} is out of range")
    return axis % ndim


def same_dtype(specs: Sequence[TensorSpec], names: Sequence[str]) -> None:
    first = specs[0].dtype
    for spec, name in zip(specs, names):
        if spec.dtype != first:
            raise PlanError(
                f"{name!r} is {spec.dtype} but {names[0]!r} is {first}; "
                "inputs of one step must share a dtype"
            )


def leading_ones(shape: Sequence[int], axis: int) -> bool:
    """True when every axis before ``axis`` has length 1, so slabs along it are contiguous."""
    return all(d == 1 for d in shape[:axis])
