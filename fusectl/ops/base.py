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

    An op owns all its forms: besides ``infer`` / ``apply`` / ``inverse`` / ``byte_ranges``, the
    ClassVars below say how plans, ties and rules treat it, ``onnx_unfuse`` is its inverse as
    ONNX nodes, ``probe`` the graphs ``fusectl verify`` runs for it, and ``fold_in_graph`` how
    export folds it into a graph. Callers ask the op; none switches on ``kind``, which is only
    the name a rules file (and provenance) calls it by.
    """

    kind: ClassVar[str]
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
    # the outputs ARE the inputs under new names (same tensor, ties kept)
    renames: ClassVar[bool] = False
    # a rule of this op never breaks a tie
    keeps_ties: ClassVar[bool] = False
    # the op takes packed sub-byte dtypes (it moves whole tensors, never elements)
    moves_packed: ClassVar[bool] = False
    # a rule that only stops plans: not a rule that must match, and left out when inverting
    guard: ClassVar[bool] = False
    # ``over`` gathers the inputs' bindings; False: it names the outputs' index (unstack)
    gathers_over: ClassVar[bool] = True
    # the gathered indices must be 0..n-1 (they become positions along a new axis)
    indexed_over: ClassVar[bool] = False
    # ``onnx_unfuse`` builds ONNX nodes recovering a step's inputs from its outputs
    onnx_unfusable: ClassVar[bool] = False
    # ``probe`` builds the graphs ``fusectl verify`` compares for a step of this op
    probed: ClassVar[bool] = False
    # the export rewrites the graph's subgraph for this step's numeric fold (``fold_in_graph``)
    graph_foldable: ClassVar[bool] = False

    def for_present(self, present: Sequence[bool]) -> "Op":
        """The op to run when some optional inputs are absent (they are left out of its inputs)."""
        return self

    def for_names(self, names: Sequence[str | None]) -> "Op":
        """The op for one binding, given its input names in role order (None: an absent optional
        input): where the checkpoint's facts decide a parameter (bn_fold's MXNet fix_gamma)."""
        return self

    def with_block_size(self, block: tuple[int, int] | None) -> "Op":
        """The op with the checkpoint's quantization block size filled in where it needs one."""
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

    def rule_inverse_problem(self, over: str | None) -> str | None:
        """Why a rule of this op (gathering ``over``, or None) cannot be inverted from the rule
        alone, though the op has an inverse; None when it can."""
        return None

    def onnx_unfuse(self, b, input_specs: Sequence[TensorSpec], output_specs: Sequence[TensorSpec],
                    fused: list) -> list:
        """ONNX nodes recovering a step's inputs from its outputs ``fused`` (graph values), built
        with ``b`` (see ``onnx_forms``); one value per input, in order."""
        raise NotImplementedError(f"{self.kind} has no ONNX un-fuse")

    def probe(self, p, before: Sequence[np.ndarray], after: Sequence[np.ndarray],
              input_specs: Sequence[TensorSpec], output_specs: Sequence[TensorSpec]) -> None:
        """Add this step's probe to ``p`` (verify's probe graphs, duck-typed: ``ref`` and ``cand``
        builders, ``param(b, array)``, ``input(name, shape)``, ``output(name, ref, cand)``,
        ``readouts(k, ref, cand, shape)``): the layer computed from the unfused tensors
        ``before`` beside the same layer from the fused ``after``.

        The default, for ops with ``onnx_unfuse``: a readout of each input against the readout
        of that input recovered from the fused tensors in ONNX."""
        if not self.onnx_unfusable:
            raise NotImplementedError(f"{self.kind} has no probe")
        fused = [p.param(p.cand, a) for a in after]
        recovered = self.onnx_unfuse(p.cand, input_specs, output_specs, fused)
        for k, (array, spec) in enumerate(zip(before, input_specs)):
            p.readouts(k, p.param(p.ref, array), recovered[k], spec.shape)

    def moves_rows(self, input_specs: Sequence[TensorSpec]) -> bool:
        """Whether the step only moves whole rows (slabs along axis 0) of tensors that all keep
        their trailing axes, so that it commutes with taking the same columns of every tensor:
        verify then probes a window of columns instead of whole tensors."""
        return False

    def op_axis(self, ndim: int) -> int:
        """The op's ``axis`` as a non-negative axis of an ``ndim``-dimensional tensor (``infer``
        has checked it is in range)."""
        return self.axis % ndim

    def lift(self, lift) -> None:
        """Say through ``lift`` (a ``fusectl._protocols.Lift``) what this step does to the tensors
        that follow the weights it consumes — a quantized weight's scales, a LoRA adapter's A and
        B (``fusectl.followers``): call exactly one of its methods. The default refuses: an op
        that computes on values keeps neither scales nor low-rank factors exact."""
        lift.refuse(f"{self.kind} computes on the weight's values")

    def fold_in_graph(self, rewriter, step, values) -> None:
        """Fold this step into an exported graph through ``rewriter`` (the export's pass, duck-typed),
        ``values`` being the graph values of the step's inputs."""
        raise NotImplementedError(f"{self.kind} has no graph fold")

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


def normalize_axis(axis: int, ndim: int, name: str, what: str = "axis") -> int:
    """A non-negative axis, or a PlanError naming the tensor (``what``: the op's word for it)."""
    if not -ndim <= axis < ndim:
        raise PlanError(f"{name!r} has {ndim} dimensions; {what} {axis} is out of range")
    return axis % ndim


def same_dtype(specs: Sequence[TensorSpec], names: Sequence[str]) -> None:
    first = specs[0].dtype
    for spec, name in zip(specs, names):
        if spec.dtype != first:
            raise PlanError(
                f"{name!r} is {spec.dtype} but {names[0]!r} is {first}; "
                "inputs of one step must share a dtype"
            )


class RowMover:
    """Mixin for ops along ``axis`` that move whole slabs: rows when the axis is 0."""

    def moves_rows(self, input_specs) -> bool:
        ndim = len(input_specs[0].shape)
        return ndim >= 2 and self.op_axis(ndim) == 0


def leading_ones(shape: Sequence[int], axis: int) -> bool:
    """True when every axis before ``axis`` has length 1, so slabs along it are contiguous."""
    return all(d == 1 for d in shape[:axis])
