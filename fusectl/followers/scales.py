"""Scales follow their quantized weights through every layout rule, or the rule stops.

A weight ``X.weight`` is quantized when the table holds one of its *scales*:
``X.weight_scale_inv`` (block scales: DeepSeek-V3, Qwen3-FP8, transformers ``fp8``),
``X.weight_scale`` (compressed-tensors / ModelOpt: per tensor, per channel or per block) or
``X.input_scale`` (a static activation scale). A weight not named ``….weight`` (a stacked
``experts.w1``) has ``experts.w1_scale_inv``, ``experts.w1_scale``, ``experts.w1_input_scale``.
Rules are written for weights; :class:`Scales` (a rider follower, ``_protocols.Follower``)
derives the steps their scales take from each step's op (``Op.lift`` with a :class:`ScaleLift`):
the same op on the scale grid where whole blocks move to whole blocks (``slabs.moved_ids``
proves it), one scale for all where per-tensor scales are equal, refused otherwise.

A consumed tensor with any other scale-like companion (``weight_zero_point``, GPTQ/AWQ
``qzeros``/``scales``/``g_idx``, MXFP4 ``*_scales`` beside ``*_blocks``) stops the rule:
fusectl does not know how those move, and a checkpoint whose scales no longer belong to their
weights loads and computes garbage.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping, NoReturn, Sequence

import numpy as np

from ..errors import PlanError, option, quote
from ..ops import Op
from ..ops.dequantize import Grid, scale_grid
from ..ops.layout import Drop, MergeEqual, Rename, Replicate, Stack, Transpose, Unstack
from ..steps import RuleOrigin, Step
from ..table import ParamTable
from ..tensors import TensorSpec
from .slabs import moved_ids

# the scales fusectl moves: role → how the scale's name is made from the weight's
ROLES = ("weight_scale_inv", "weight_scale", "input_scale")

# leaves of tensors that are scales, zero points or packed blocks of a quantized weight
_SCALE_LIKE = re.compile(r"(^|_)(scale|scales|scale_inv|zero_point|zeros|qzeros|qweight|g_idx|blocks)(_\d+)?$")


def _dequantize_hint() -> str:
    """How to dequantize first, in the caller's words (``-r fp8-dequant``, ``rules=[...]``)."""
    return option("rules", "fp8-dequant")


def scale_name(weight: str, role: str) -> str:
    """The name of ``weight``'s scale in ``role``.

    >>> scale_name("model.q_proj.weight", "input_scale")
    'model.q_proj.input_scale'
    >>> scale_name("experts.w1", "weight_scale_inv")
    'experts.w1_scale_inv'
    """
    if role == "input_scale":
        return weight[: -len("weight")] + "input_scale" if weight.endswith("weight") else weight + "_input_scale"
    suffix = role[len("weight"):]
    return weight + suffix


def scale_names(weights: set[str]) -> set[str]:
    """Every name a scale of one of ``weights`` would have (whether or not it exists)."""
    return {scale_name(w, role) for w in weights for role in ROLES}


@dataclass(frozen=True)
class QuantScheme:
    """What a checkpoint's quantization config says: the block size of block scales."""

    block: tuple[int, int] | None = None
    source: str = ""

    def describe_block(self) -> str:
        return f"{self.block[0]}x{self.block[1]}" if self.block else "unknown"


def scheme_from(config: Mapping | None, rule_blocks: Sequence[tuple[tuple[int, int], str]] = ()) -> QuantScheme:
    """The block size from a rules file's ``[quantization]`` (first given), else from
    ``config.json``'s ``quantization_config`` (``weight_block_size``, or a compressed-tensors
    group's ``block_structure``)."""
    for block, source in rule_blocks:
        return QuantScheme(block, f"{source} [quantization]")
    qc = config.get("quantization_config") if isinstance(config, Mapping) else None
    if not isinstance(qc, Mapping):
        return QuantScheme()
    if "weight_block_size" in qc:
        return QuantScheme(_block(qc["weight_block_size"], "quantization_config.weight_block_size"),
                           "config.json quantization_config.weight_block_size")
    groups = qc.get("config_groups")
    if isinstance(groups, Mapping):
        for name, group in groups.items():
            weights = group.get("weights") if isinstance(group, Mapping) else None
            if isinstance(weights, Mapping) and weights.get("block_structure") is not None:
                where = f"quantization_config.config_groups.{name}.weights.block_structure"
                return QuantScheme(_block(weights["block_structure"], where), f"config.json {where}")
    return QuantScheme()


def _block(value: object, where: str) -> tuple[int, int] | None:
    if isinstance(value, str) and re.fullmatch(r"\d{1,9}x\d{1,9}", value):
        value = [int(v) for v in value.split("x")]
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2
            or not all(type(v) is int and 0 < v < 2**31 for v in value)):
        raise PlanError(f"config.json: {where} is {str(value)[:80]}; it must be two positive integers "
                        "(rows, columns); fix the config or give [quantization] block_size in a rules file")
    return (value[0], value[1])


@dataclass(frozen=True)
class Scale:
    """One scale of a quantized weight, and how its grid lines up with the weight."""

    role: str
    name: str
    spec: TensorSpec
    grid: Grid

    @property
    def kind(self) -> str:
        """``per-tensor``, ``per-channel``, ``block RxC`` or the grid, for reports."""
        steps = [g for g in self.grid if g is not None]
        if not steps:
            return "per-tensor"
        if any(g > 1 for g in steps):
            return "block " + "x".join(str(g) for g in self.grid[-2:] if g is not None)
        if self.grid[-1] is None and len(steps) == len(self.grid) - 1:
            return "per-channel"
        return "grid " + str(["*" if g is None else g for g in self.grid])


def scales_of(table: ParamTable, weight: str, scheme: QuantScheme) -> list[Scale]:
    """The scales ``table`` holds for ``weight``; a PlanError when one fits no grid of it."""
    out = []
    spec = table.spec(weight)
    for role in ROLES:
        name = scale_name(weight, role)
        if name == weight or name not in table:
            continue
        scale = table.spec(name)
        grid = scale_grid(spec.shape, scale.shape, scheme.block)
        if grid is None:
            hint = (f" with blocks of {scheme.describe_block()} ({scheme.source})" if scheme.block else
                    "; if it is a block scale, the block size is unknown: set quantization_config."
                    "weight_block_size in config.json or [quantization] block_size = [rows, columns] in a rules file")
            raise PlanError(f"{name!r} has shape {list(scale.shape)}, which is neither a per-tensor, per-channel "
                            f"nor a block scale of {weight!r} {list(spec.shape)}{hint}")
        out.append(Scale(role, name, scale, grid))
    return out


def quantization_report(table: ParamTable, config: Mapping | None) -> dict | None:
    """The quantized weights of a table, each with its scales' names, roles and kinds, and the
    block size (for ``inspect --json``); None when no weight has scales."""
    scheme = scheme_from(config)
    weights = {}
    for name in table.names():
        roles = [role for role in ROLES if scale_name(name, role) in table]
        if not roles:
            continue
        try:
            found = [(s.name, s.role, s.kind) for s in scales_of(table, name, scheme)]
        except PlanError:  # inspect shows what it can; a rule on this weight says why
            found = [(scale_name(name, role), role, "unrecognized") for role in roles]
        weights[name] = [{"name": n, "role": r, "kind": k} for n, r, k in found]
    if not weights:
        return None
    return {"block_size": list(scheme.block) if scheme.block else None,
            "block_size_source": scheme.source or None, "weights": weights}


def scale_step_of(step: Step, steps: Sequence[Step]) -> Step | None:
    """The step among ``steps`` that moves the weight scales (``weight_scale_inv`` or
    ``weight_scale``) of ``step``'s weights, as :meth:`Scales.lift` planned it; None if none does."""
    for role in ("weight_scale_inv", "weight_scale"):
        names = tuple(scale_name(n, role) for n in step.inputs)
        for other in steps:
            if other.inputs == names:
                return other
    return None


class _Modules:
    """The table's names grouped by module (everything before the last dot)."""

    def __init__(self, names: Sequence[str]):
        self.leaves: dict[str, list[str]] = {}
        for name in names:
            module, _, leaf = name.rpartition(".")
            self.leaves.setdefault(module, []).append(leaf)

    def unknown_scales(self, name: str, known: set[str]) -> list[str]:
        """Scale-like companions of ``name`` that are not in ``known``."""
        module, _, leaf = name.rpartition(".")
        stem = re.sub(r"(^|_)(weight|blocks|qweight)$", "", leaf)
        out = []
        for other in self.leaves.get(module, ()):
            full = f"{module}.{other}" if module else other
            if full == name or full in known or not _SCALE_LIKE.search(other):
                continue
            if stem and not other.startswith(stem + "_"):
                continue
            out.append(full)
        return out


class Scales:
    """The scales of a checkpoint's quantized weights, as a follower (``_protocols.Follower``)
    riding in the table the rules bind: every checkpoint has one, since any weight a rule
    consumes may have scales beside it (found by name on the table as earlier rules left it).

    ``scheme`` (the block size of block scales) is read from ``config.json`` when first needed
    (a malformed one is an error only for a plan that needs it); :meth:`for_plan` gives the
    scales for one plan, whose rules file's ``[quantization]`` may set it instead.
    """

    kind = "scales"

    def __init__(self, config: Mapping | None = None, table: ParamTable | None = None,
                 scheme: QuantScheme | None = None):
        self._config, self._table, self._scheme = config, table, scheme
        self._modules: tuple[object, _Modules | None] | None = None  # (group, its table's modules)

    @classmethod
    def detect(cls, table: ParamTable, config: Mapping | None) -> "Scales":
        return cls(config, table)

    @property
    def scheme(self) -> QuantScheme:
        if self._scheme is None:
            self._scheme = scheme_from(self._config)
        return self._scheme

    def for_plan(self, rulesets: Sequence = (), origin: RuleOrigin | None = None) -> "Scales":
        """The scales for a plan of ``rulesets`` (the first ``[quantization]`` block size wins
        over config.json's), or for binding again a group recorded with ``origin`` (its block)."""
        if origin is not None:
            return Scales(scheme=QuantScheme(origin.block, "the provenance"))
        return Scales(scheme=scheme_from(self._config, [(r.block_size, r.source) for r in rulesets if r.block_size]))

    # --- what the planner asks (``_protocols.Riders``) ------------------------------------

    def claimed(self, names: Iterable[str]) -> set[str]:
        """Every name a scale of one of ``names`` would have (a pattern such as ``q_proj.{t}``
        binds a weight and its scales alike: the scales then move with their weight)."""
        return scale_names(set(names))

    def complete(self, op: Op) -> Op:
        return op.with_block_size(self.scheme.block)

    def recorded(self, origin: RuleOrigin) -> RuleOrigin:
        return replace(origin, block=self.scheme.block)

    # --- the follower contract -------------------------------------------------------------

    def claims(self, weight: str, table: ParamTable) -> list[str]:
        return [name for role in ROLES if (name := scale_name(weight, role)) != weight and name in table]

    def report(self) -> dict | None:
        return quantization_report(self._table, self._config) if self._table is not None else None

    def lift(self, step: Step, group: Sequence[Step], table: ParamTable, describe: str) -> list[Step]:
        """The steps the scales of the quantized weights ``step`` consumes take; a PlanError
        naming the weight, the scale and why when they cannot follow exactly, or when a consumed
        tensor has a scale-like companion fusectl does not know."""
        consumed = {n for s in group for n in s.inputs}
        scales = {name: scales_of(table, name, self.scheme) for name in step.inputs}
        known = {s.name for found in scales.values() for s in found} | consumed
        modules = self._modules_of(group, table)
        for name in step.inputs:
            unknown = modules.unknown_scales(name, known) if modules else []
            if unknown:
                raise PlanError(
                    f"{describe}: {name!r} has {quote(unknown[0])} beside it, a quantization tensor "
                    f"fusectl does not know how to move with it (it moves weight_scale_inv, weight_scale "
                    f"and input_scale); the rule would leave it behind. Dequantize the model first, "
                    f"or leave this tensor out of the rule")
        lifted: list[Step] = []
        for role in ROLES:
            present = [next((s for s in scales[n] if s.role == role), None) for n in step.inputs]
            if not any(present):
                continue
            if any(p is not None and p.name in consumed for p in present):
                continue  # the rule moves this scale itself (dequantize's scale, an explicit rule)
            lift = ScaleLift(step, role, present, self.scheme, describe)
            step.op.lift(lift)
            lifted.extend(lift.steps)
        return lifted

    def _modules_of(self, group: Sequence[Step], table: ParamTable) -> "_Modules | None":
        """The table's names by module, grouped once per rule (a table of 10^6 names)."""
        if self._modules is None or self._modules[0] is not group:
            self._modules = (group, _Modules(table.names()) if table.entries else None)
        return self._modules[1]


class ScaleLift:
    """What one step does to one role of scales (``weight_scale_inv`` of q, k and v); the op
    says which of the methods below applies (``Op.lift``)."""

    def __init__(self, step: Step, role: str, scales: Sequence[Scale | None], scheme: QuantScheme, describe: str):
        self.step, self.role, self.scheme, self.describe = step, role, scheme, describe
        self.ndim = len(step.input_specs[0].shape)
        self.steps: list[Step] = []
        self._present = list(scales)
        self.scales: list[Scale] = [s for s in scales if s is not None]
        self.grid = self.scales[0].grid
        self.outputs = [scale_name(o, self.role) for o in step.outputs]

    def _alike(self) -> None:
        """Every part of a step that moves parts together has a scale of one kind."""
        step, first = self.step, self.scales[0]
        # a step's inputs that are themselves scales (dequantize's) have none of their own
        own_scales = scale_names(set(step.inputs))
        missing = [n for n, s in zip(step.inputs, self._present) if s is None and n not in own_scales]
        if missing:
            raise PlanError(f"{self.describe}: {first.name!r} scales {step.inputs[self._present.index(first)]!r}, "
                            f"but {missing[0]!r} has no {scale_name(missing[0], self.role)!r}; the parts of one "
                            f"step must be quantized alike. Dequantize first ({_dequantize_hint()})")
        for s in self.scales:
            if s.grid != first.grid or s.spec.dtype != first.spec.dtype:
                raise PlanError(f"{self.describe}: {s.name!r} ({s.kind}, {s.spec}) and {first.name!r} ({first.kind}, "
                                f"{first.spec}) are scales of different kinds; the parts of one step must be "
                                f"quantized alike. Dequantize first ({_dequantize_hint()})")

    # --- what an op may say --------------------------------------------------------------

    def refuse(self, why: str) -> NoReturn:
        s = self.scales[0]
        weight = self.step.inputs[self._present.index(s)]
        if "fp8-dequant" not in why:
            why += f"; dequantize first ({_dequantize_hint()})"
        raise PlanError(f"{self.describe}: {weight!r} is quantized ({s.name!r}, {s.kind}); "
                        f"its {self.step.op.kind} step cannot carry the scale exactly: {why}")

    def rename(self) -> None:
        for scale, out in zip(self.scales, self.outputs):
            if scale.name != out:
                self._add(Rename(), [scale], [out])

    def drop(self) -> None:
        for scale in self.scales:
            self._add(Drop(), [scale], [])

    def along(self, axis: int, make: Callable[[list[int], list[int]], Op]) -> None:
        """The step moves slabs of its weights along ``axis`` (concat, split, interleave,
        reorder, rope_permute); ``make(in_lengths, out_lengths)`` is the same op for the scales,
        given their lengths along that axis."""
        self._alike()
        step = self.step
        g = self.grid[axis]
        n_in, n_out = len(step.inputs), len(step.outputs)
        if g is None:  # one scale for the whole axis: equal scales merge, a split copies it
            if n_in > 1 and n_out == 1:
                self._add(MergeEqual(), self.scales, self.outputs)
            elif n_in == 1 and n_out > 1:
                self._add(Replicate(parts=n_out), self.scales, self.outputs)
            elif n_in == n_out == 1:
                self.rename()
            else:
                self.refuse(f"it maps {n_in} tensors to {n_out}")
            return
        in_lengths = [s.shape[axis] for s in step.input_specs]
        block_map = self._block_map(axis, g, in_lengths)
        scale_in = [s.spec.shape[axis] for s in self.scales]
        scale_out = [-(-o.shape[axis] // g) for o in step.output_specs]
        if n_in == n_out == 1 and block_map[0].tolist() == list(range(scale_in[0])):
            self.rename()  # rows move only inside their blocks (rope_permute of 128-row heads)
            return
        op = make(scale_in, scale_out)
        specs = [s.spec for s in self.scales]
        try:
            out_specs = op.infer(specs, [s.name for s in self.scales])
            moved = moved_ids(op, scale_in, axis, self.ndim)
        except (PlanError, ValueError):  # the op does not fit the scale's lengths
            moved = None
        if moved is None or any(m.reshape(-1).tolist() != b.tolist() for m, b in zip(moved, block_map)) \
                or [o.shape[axis] for o in out_specs] != scale_out:
            self.refuse(f"its blocks of {g} along axis {axis} do not move as whole blocks; "
                        f"dequantize first ({_dequantize_hint()})")
        self._add(op, self.scales, self.outputs, out_specs)

    def stack(self, axis: int) -> None:
        self._alike()
        if axis != 0:
            self.refuse(f"scales stack along axis 0 only (this stacks along axis {axis})")
        self._add(Stack(axis=0), self.scales, self.outputs)

    def unstack(self, axis: int) -> None:
        if axis != 0:
            self.refuse(f"scales unstack along axis 0 only (this unstacks along axis {axis})")
        if self.grid[0] is None:
            self._add(Replicate(parts=len(self.outputs)), self.scales, self.outputs)
        elif self.grid[0] == 1 and len(self.scales[0].spec.shape) >= 1:
            self._add(Unstack(axis=0), self.scales, self.outputs)
        else:
            self.refuse("its scale does not have one entry per stacked tensor")

    def transpose(self, perm: Sequence[int]) -> None:
        self._alike()
        if all(g is None for g in self.grid):
            self.rename()
            return
        scale = self.scales[0]
        if len(scale.spec.shape) != self.ndim:
            self.refuse(f"its {scale.kind} scale {list(scale.spec.shape)} would not line up with the "
                        "transposed weight")
        moved = [self.grid[p] for p in perm]
        expected = scale_grid(self.step.output_specs[0].shape,
                              tuple(scale.spec.shape[p] for p in perm), self.scheme.block)
        if expected != tuple(moved):
            self.refuse(f"the transposed blocks ({moved}) are not the checkpoint's block size "
                        f"{self.scheme.describe_block()}")
        self._add(Transpose(perm=tuple(perm)), self.scales, self.outputs)

    def reshape(self) -> None:
        if all(g is None for g in self.grid):
            self.rename()
        else:
            self.refuse("a reshape does not keep blocks, channels or rows of the scale grid")

    # --- mechanics ------------------------------------------------------------------------

    def _add(self, op: Op, scales: Sequence[Scale], outputs: Sequence[str],
             out_specs: Sequence[TensorSpec] | None = None) -> None:
        specs = tuple(s.spec for s in scales)
        names = [s.name for s in scales]
        if out_specs is None:
            try:
                out_specs = op.infer(specs, names)
            except PlanError as e:
                self.refuse(str(e))
        self.steps.append(Step(op, tuple(names), tuple(outputs), specs, tuple(out_specs)))

    def _block_map(self, axis: int, g: int, in_lengths: list[int]) -> list[np.ndarray]:
        """For each output of the weight step, the block (numbered across the inputs' scales)
        each of its g-long blocks comes from; refuses when a block mixes rows of two blocks."""
        step = self.step
        starts = np.cumsum([0, *in_lengths])
        moved = moved_ids(step.op, in_lengths, axis, self.ndim)
        part = lambda rows: np.searchsorted(starts, rows, side="right") - 1  # noqa: E731
        block_starts = np.cumsum([0, *[-(-n // g) for n in in_lengths]])
        out = []
        used: set[int] = set()
        for o, rows in enumerate(moved):
            rows = rows.reshape(-1)
            k = part(rows)
            blocks = block_starts[k] + (rows - starts[k]) // g
            mapped = []
            for j in range(0, len(rows), g):
                these = np.unique(blocks[j:j + g])
                if len(these) != 1 or int(these[0]) in used:
                    self._refuse_block(o, j, g, rows[j:j + g], k[j:j + g], starts, axis)
                used.add(int(these[0]))
                mapped.append(int(these[0]))
            out.append(np.array(mapped, dtype=np.int64))
        return out

    def _refuse_block(self, o, j, g, rows, parts, starts, axis) -> None:
        step = self.step
        where = "row" if axis == 0 else f"index along axis {axis}"
        change = next((i for i in range(1, len(parts)) if parts[i] != parts[i - 1]), None)
        if change is not None:
            detail = (f"{where}s {j}..{j + len(rows) - 1} of {step.outputs[o]!r} fall in one {g}-long block of "
                      f"its {self.role} but come from {step.inputs[parts[0]]!r} and {step.inputs[parts[change]]!r}: "
                      f"the boundary at {where} {j + change} is not a multiple of the block size {g} "
                      "(only the last part may end inside a block)")
        else:
            local = rows - starts[parts[0]]
            detail = (f"{where}s {j}..{j + len(rows) - 1} of {step.outputs[o]!r} fall in one {g}-long block of "
                      f"its {self.role} but come from {where}s {int(local.min())}..{int(local.max())} of "
                      f"{step.inputs[parts[0]]!r}, which lie in different blocks or are split apart")
        self.refuse(f"{detail}. Dequantize first ({_dequantize_hint()}), or use a layout whose parts "
                    f"fill whole blocks of {g}")

