"""LoRA adapters (PEFT) follow their base through the same rules.

A PEFT LoRA folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` with, per
adapted module ``m``, ``base_model.model.m.lora_A.weight`` [r, in] and ``….lora_B.weight``
[out, r]; the module's weight changes by ΔW = s · B · A with s = alpha / r (alpha / √r with
``use_rslora``), r and alpha per module from ``rank_pattern`` / ``alpha_pattern``.

Rules are written for base weights ``m.weight``. An adapter folder's :class:`LoraAdapter` is a
*view* follower (``_protocols.View``): the planner binds the rules to its *base view* (one
name-and-shape-only ``m.weight`` [out, in] per adapted module, ``base_view``), then the adapter
lifts each base step through its op (``Op.lift`` with a :class:`LoraLift`):

- rename / drop: A and B renamed / dropped;
- concat of weights along the output axis: A' = the As stacked along the rank axis, B' = the
  Bs block-diagonal (rank Σr); when the parts share one A — one tensor in the table (tied), or
  made by one ``replicate`` step of the recorded provenance that no later step touched (the
  adapter came from a fused one) — A' = A and B' = the Bs concatenated (rank r). Both are
  facts of the headers and the provenance: planning reads no tensor data, and the merge checks
  the As are equal when it runs (a lying provenance is an error, not a wrong adapter);
- split along the output axis: A copied to every part, B split by rows (exact for any adapter);
- row permutations (reorder, interleave of one input, deinterleave, rope_permute): on B's rows;
- along the input axis, the mirror image (A block-diagonal or split by columns, B side by side);
- transpose: A' = Bᵀ, B' = Aᵀ.

Everything else (numeric folds, stack/unstack of experts) is refused naming the rule and the
adapter tensor; DoRA adapters (``use_dora``, magnitude vectors) are refused before any rule
binds. The scaling is kept exactly: a module whose rank changes gets ``rank_pattern`` /
``alpha_pattern`` entries; parts with different scalings are refused.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping, NoReturn, Sequence

from ..config_edit import ConfigEdit
from ..errors import CheckpointError, PlanError, quote
from ..executor import OpaqueTensor, apply_group
from ..ops import Op
from ..ops.layout import BlockDiagonal, Concat, Drop, MergeEqual, Rename, Replicate, Transpose
from ..steps import Plan, Step, StepGroup
from ..table import ParamTable
from ..tensors import TensorSpec
from .slabs import moved_ids

ADAPTER_CONFIG = "adapter_config.json"
PREFIX = "base_model.model."
# suffix → (factor, whether the module is an embedding)
_FACTORS = {".lora_A.weight": ("A", False), ".lora_B.weight": ("B", False),
            ".lora_embedding_A": ("A", True), ".lora_embedding_B": ("B", True)}
_DORA = ".lora_magnitude_vector"


@dataclass(frozen=True)
class LoraConfig:
    """What ``adapter_config.json`` says about ranks and scalings (and its text, kept whole)."""

    r: int
    alpha: float
    rank_pattern: dict
    alpha_pattern: dict
    use_rslora: bool
    use_dora: bool
    raw: dict = field(repr=False)
    where: str = ""

    @classmethod
    def parse(cls, raw: dict, where: str) -> "LoraConfig":
        """From ``adapter_config.json`` as parsed (``io.checkpoint.adapter_config``)."""
        if raw.get("peft_type", "LORA") != "LORA":
            raise CheckpointError(f"{where}: peft_type is {str(raw.get('peft_type'))[:40]!r}; fusectl lifts LoRA "
                                  "adapters only")
        r, alpha = raw.get("r", 8), raw.get("lora_alpha", 8)
        patterns = [raw.get("rank_pattern") or {}, raw.get("alpha_pattern") or {}]
        if (type(r) is not int or r <= 0 or type(alpha) not in (int, float) or not math.isfinite(alpha) or alpha <= 0
                or not all(isinstance(p, dict) for p in patterns)):
            raise CheckpointError(f"{where}: r must be a positive integer, lora_alpha a number and rank_pattern / "
                                  "alpha_pattern objects")
        if raw.get("fan_in_fan_out"):
            raise CheckpointError(f"{where}: fan_in_fan_out adapters (GPT-2 Conv1D layers, weights stored [in, out]) "
                                  "are not lifted by fusectl yet")
        if raw.get("lora_bias"):
            raise CheckpointError(f"{where}: lora_bias adapters (a bias on lora_B) are not lifted by fusectl yet")
        for flag in ("use_rslora", "use_dora"):
            if type(raw.get(flag, False)) is not bool:
                raise CheckpointError(f"{where}: {flag} must be true or false")
        for pattern, kind in zip(patterns, (int, (int, float))):
            for key, value in pattern.items():
                if (re.search(r"[\\^$*+?{}\[\]|()]", key) or not isinstance(value, kind) or isinstance(value, bool)
                        or not math.isfinite(value) or value <= 0):
                    raise CheckpointError(
                        f"{where}: pattern entry {quote(key[:80])}: {str(value)[:20]} — fusectl matches pattern keys "
                        "as module names or dotted suffixes (not regular expressions), with positive numeric values")
        return cls(r, alpha, patterns[0], patterns[1], bool(raw.get("use_rslora", False)),
                   bool(raw.get("use_dora", False)), raw, where)

    def rank_of(self, module: str) -> int:
        return _pattern_value(self.rank_pattern, module, self.r)

    def alpha_of(self, module: str) -> float:
        return _pattern_value(self.alpha_pattern, module, self.alpha)

    def scaling(self, rank: int, alpha: float) -> float:
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _matches(key: str, module: str) -> bool:
    """PEFT's ``(.*\\.)?(key)$`` for a key without regular-expression syntax."""
    return module == key or module.endswith("." + key)


def _pattern_value(pattern: Mapping, module: str, default):
    return next((v for k, v in pattern.items() if _matches(k, module)), default)


@dataclass
class LoraModule:
    """One adapted module: its factors' names in the adapter and its rank and alpha."""

    a: str
    b: str
    rank: int
    alpha: float
    embedding: bool = False


def lora_modules(table: ParamTable, lora: LoraConfig) -> dict[str, LoraModule]:
    """The adapted modules of an adapter's table, by base module name, for lifting or probing
    them; CheckpointError for a DoRA adapter (:func:`refuse_dora`) or a damaged one."""
    refuse_dora(table, lora)
    return _adapted_modules(table, lora)


def refuse_dora(table: ParamTable, lora: LoraConfig) -> None:
    """CheckpointError naming the adapter config when the adapter is DoRA: ``use_dora`` is
    true (the flag alone makes it one: PEFT creates magnitude vectors missing from the file
    when it loads it), or it holds magnitude vectors. DoRA rescales each row of W + s·B·A by
    a magnitude vector over the row's norm, which no lift of A and B moves and no ΔW probe
    checks."""
    magnitude = next((n for n in table.names() if _DORA in n), None)
    if not lora.use_dora and magnitude is None:
        return
    found = "use_dora is true" if lora.use_dora else f"the adapter holds DoRA magnitude vectors ({quote(magnitude)})"
    raise CheckpointError(
        f"{lora.where}: {found}: DoRA adapters are not supported (each row of W + s·B·A is rescaled by a "
        "magnitude vector, which fusectl does not lift or verify); merge the adapter into its base model "
        "(PEFT's merge_and_unload) and fuse the merged checkpoint instead")


def _adapted_modules(table: ParamTable, lora: LoraConfig) -> dict[str, LoraModule]:
    found: dict[tuple[str, bool], dict[str, str]] = {}
    for name in table.names():
        if not name.startswith(PREFIX):
            continue
        for suffix, (factor, embedding) in _FACTORS.items():
            if name.endswith(suffix):
                found.setdefault((name[len(PREFIX):-len(suffix)], embedding), {})[factor] = name
    modules = {}
    for (module, embedding), factors in sorted(found.items()):
        if set(factors) != {"A", "B"} or module in modules:
            raise CheckpointError(f"{quote(module)}: the adapter does not hold one lora_A and one lora_B for it "
                                  f"(found {', '.join(sorted(factors.values()))}); it is damaged")
        rank = lora.rank_of(module)
        if len(table.spec(factors["A"]).shape) != 2 or table.spec(factors["A"]).shape[0] != rank:
            raise CheckpointError(f"{lora.where}: the config gives {quote(module)} rank {rank}, but {quote(factors['A'])} "
                                  f"has shape {list(table.spec(factors['A']).shape)}; the adapter and its config disagree")
        modules[module] = LoraModule(factors["A"], factors["B"], rank, lora.alpha_of(module), embedding)
    # a LoRA tensor beside A and B (lora_B.bias) would be left behind; whole weights saved with
    # the adapter (modules_to_save) are not lifted and pass through as they are
    stray = [n for n in table.names() if ".lora_" in n and not n.endswith(tuple(_FACTORS)) and _DORA not in n]
    if stray:
        raise CheckpointError(f"{quote(stray[0])}: an adapter tensor fusectl does not know how to move (it lifts "
                              "lora_A and lora_B); the rules would leave it behind")
    return modules


def adapter_report(table: ParamTable, lora: LoraConfig) -> dict:
    """The adapted modules with their factors, rank, alpha and scaling (for ``inspect --json``)."""
    return {
        "r": lora.r, "lora_alpha": lora.alpha, "use_rslora": lora.use_rslora, "use_dora": lora.use_dora,
        "modules": {m: {"lora_A": info.a, "lora_B": info.b, "rank": info.rank, "alpha": info.alpha,
                        "scaling": lora.scaling(info.rank, info.alpha)}
                    for m, info in _adapted_modules(table, lora).items()},  # inspect shows DoRA ones too
    }


def base_view(table: ParamTable, modules: Mapping[str, LoraModule]) -> ParamTable:
    """One name-and-shape-only ``m.weight`` per adapted module (linear: [out, in] from B and A;
    embedding: [num_embeddings, dim])."""
    view = {}
    for module, m in modules.items():
        a, b = table.spec(m.a), table.spec(m.b)
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != b.shape[1]:
            raise CheckpointError(f"{quote(m.a)} {list(a.shape)} and {quote(m.b)} {list(b.shape)} are not the "
                                  "[r, in] and [out, r] factors of one LoRA module")
        shape = (a.shape[1], b.shape[0]) if m.embedding else (b.shape[0], a.shape[1])
        name = f"{module}.weight"
        view[name] = OpaqueTensor(TensorSpec(a.dtype, shape), name)
    return ParamTable.from_stored(view)


class LoraAdapter:
    """A PEFT LoRA adapter folder as a follower (``_protocols.Follower`` and ``View``): its
    ``adapter_config.json`` read once, when the checkpoint's followers are first asked for
    (``Checkpoint.followers``), and parsed when first needed. It keeps no state of a plan
    being lifted (:class:`_Lifting` is local to each call), so one opened checkpoint may be
    planned from several threads."""

    kind = "lora"
    stem = "adapter_model"  # written as adapter_model.safetensors

    def __init__(self, where: str, text: str, raw: dict, table: ParamTable, history: Plan | None = None):
        self.where, self.text, self.raw, self._table = where, text, raw, table
        self._history = history
        self._config: LoraConfig | None = None

    @classmethod
    def detect(cls, table: ParamTable, adapter_config: tuple[str, str, dict] | None,
               history: Plan | None) -> "LoraAdapter | None":
        """The adapter of a folder whose ``adapter_config`` is (path, text, parsed object)."""
        return None if adapter_config is None else cls(*adapter_config, table, history)

    @property
    def config(self) -> LoraConfig:
        if self._config is None:
            self._config = LoraConfig.parse(self.raw, self.where)
        return self._config

    def modules(self, table: ParamTable) -> dict[str, LoraModule]:
        """The adapted modules of ``table`` (this adapter's, or one a plan made of it)."""
        return lora_modules(table, self.config)

    # --- the follower contract -------------------------------------------------------------

    def claims(self, weight: str, table: ParamTable) -> list[str]:
        module = lora_modules(table, self.config).get(weight[: -len(".weight")] if weight.endswith(".weight") else "")
        return [] if module is None else [module.a, module.b]

    def report(self) -> dict:
        return adapter_report(self._table, self.config)

    def lift(self, step: Step, group: Sequence[Step], table: ParamTable, describe: str) -> list[Step]:
        """The steps A and B take for one base ``step`` (on the base view's ``m.weight``
        names), on ``table``, the adapter as the steps before left it."""
        return _Lifting(table, self.modules(table), self._history).lift(step, self.config, describe)

    # --- the view ------------------------------------------------------------------------

    def base_view(self, table: ParamTable) -> ParamTable:
        return base_view(table, self.modules(table))

    def config_files(self) -> dict[str, tuple[str, str]]:
        return {ADAPTER_CONFIG: (self.where, self.text)}

    def lift_plan(self, base: Plan, table: ParamTable, untie: bool) -> tuple[Plan, ParamTable]:
        """The ``base`` plan (bound to the base view) lifted to A and B, on a copy of ``table``;
        the last group rewrites ``adapter_config.json`` (target_modules, rank_pattern,
        alpha_pattern)."""
        current = table.copy()
        lifting = _Lifting(current, self.modules(table), self._history)
        groups: list[StepGroup] = []
        for group in base.groups:
            if not group.steps:
                continue  # a rules file's [config] edits the base's config.json, not the adapter's
            steps = [s for step in group.steps for s in lifting.lift(step, self.config, group.describe())]
            groups.append(apply_group(current, StepGroup(group.rule, group.source, tuple(steps)), untie))
            lifting.made(steps)
        edit = _config_edit(self.config, self.text, lifting.modules)
        if edit is not None:
            groups.append(StepGroup("adapter_config", ADAPTER_CONFIG, (), config=edit))
        return Plan(tuple(groups)), current


class _Lifting:
    """The state of lifting one plan: the adapted modules as the steps so far left them, and
    which step last made each adapter tensor (the recorded provenance's, then this plan's)."""

    def __init__(self, table: ParamTable, modules: Mapping[str, LoraModule], history: Plan | None):
        self.table = table
        self.modules = dict(modules)
        self.makers: dict[str, Step] = {}
        self.made(history.steps if history is not None else ())

    def made(self, steps: Sequence[Step]) -> None:
        for step in steps:
            for name in step.inputs:
                self.makers.pop(name, None)
            for name in step.outputs:
                self.makers[name] = step

    def shared(self, names: Sequence[str]) -> bool:
        """Whether ``names`` hold one factor, as the headers and the provenance say: one tensor
        in the table (tied), or the outputs of one recorded ``replicate`` step that no later
        step touched. No tensor data is read (SPEC §1); the merge checks equality when it runs."""
        first = self.table[names[0]]
        if all(self.table[n] is first for n in names):
            return True
        makers = {id(self.makers.get(n)) for n in names}
        maker = self.makers.get(names[0])
        return len(makers) == 1 and maker is not None and isinstance(maker.op, Replicate)

    def lift(self, step: Step, lora: LoraConfig, describe: str) -> list[Step]:
        lift = LoraLift(step, self.table, self.modules, lora, describe, self.shared)
        step.op.lift(lift)
        for module in lift.consumed:
            self.modules.pop(module, None)
        self.modules.update(lift.produced)
        return lift.steps


def _config_edit(lora: LoraConfig, text: str, modules: Mapping[str, LoraModule]) -> ConfigEdit | None:
    """``adapter_config.json`` for the adapted modules after the plan: ``target_modules`` names
    their leaves, and each module whose rank or alpha the config would not give it gets its own
    ``rank_pattern`` / ``alpha_pattern`` entry (exact names first: PEFT takes the first match)."""
    raw = lora.raw
    leaves = sorted({m.rsplit(".", 1)[-1] for m in modules})
    sets: dict[str, object] = {}
    targets = raw.get("target_modules")
    if isinstance(targets, list):
        kept = [t for t in targets if t in leaves]
        new = kept + [leaf for leaf in leaves if leaf not in kept]
        if new != targets:
            sets["target_modules"] = new
    elif targets != leaves:
        sets["target_modules"] = leaves
    for key, pattern, default, attr in (("rank_pattern", lora.rank_pattern, lora.r, "rank"),
                                        ("alpha_pattern", lora.alpha_pattern, lora.alpha, "alpha")):
        live = {k: v for k, v in pattern.items() if any(_matches(k, m) for m in modules)}
        exact = {m: getattr(info, attr) for m, info in sorted(modules.items())
                 if _pattern_value(live, m, default) != getattr(info, attr)}
        if exact or live != pattern:
            sets[key] = {**exact, **live}
    if not sets:
        return None
    return ConfigEdit(tuple((k, json.dumps(v)) for k, v in sets.items()), (), text, file=ADAPTER_CONFIG)


class LoraLift:
    """What one base step does to the A and B of the modules it consumes (``Op.lift``)."""

    def __init__(self, step: Step, table: ParamTable, modules: Mapping[str, LoraModule], lora: LoraConfig,
                 describe: str, shared: Callable[[Sequence[str]], bool]):
        self.step, self.table, self.lora, self.describe = step, table, lora, describe
        self._shared = shared
        self.ndim = len(step.input_specs[0].shape)
        self.steps: list[Step] = []
        self.inputs = [_module_of(n, describe) for n in step.inputs]
        self.parts = [modules[m] for m in self.inputs]
        self.consumed = list(self.inputs)
        self.produced: dict[str, LoraModule] = {}

    @property
    def outputs(self) -> list[str]:
        """The modules the step's outputs are the weights of (asked only by steps that keep
        the factorisation: a fold's outputs need not be weights)."""
        return [_module_of(n, self.describe) for n in self.step.outputs]

    # --- what an op may say --------------------------------------------------------------

    def refuse(self, why: str) -> NoReturn:
        raise PlanError(f"{self.describe}: cannot lift its {self.step.op.kind} step to the adapter's "
                        f"{self.parts[0].b!r}: {why}")

    def rename(self) -> None:
        for module, part, out in zip(self.inputs, self.parts, self.outputs):
            self._move(Rename(), [part.a], [out], "A")
            self._move(Rename(), [part.b], [out], "B")
            self.produced[out] = LoraModule(_name(out, "A", part), _name(out, "B", part), part.rank, part.alpha,
                                            part.embedding)

    def drop(self) -> None:
        for part in self.parts:
            self._move(Drop(), [part.a], [], "A")
            self._move(Drop(), [part.b], [], "B")

    def along(self, axis: int, make: Callable[[list[int], list[int]], Op]) -> None:
        if any(p.embedding for p in self.parts):
            self.refuse("an embedding's LoRA moves only by rename or drop")
        if self.ndim != 2 or axis not in (0, 1):
            self.refuse(f"LoRA factors follow a matrix along its rows or columns, not axis {axis} of "
                        f"{self.ndim} dimensions")
        rows = axis == 0
        # the factor that moves with the weight's slabs (B for rows, A for columns), and the other
        moving, other = ("B", "A") if rows else ("A", "B")
        scale = self._common_scaling()
        n_in, n_out = len(self.parts), len(self.outputs)
        lengths = [s.shape[axis] for s in self.step.input_specs]
        out_lengths = [s.shape[axis] for s in self.step.output_specs]
        op = make(lengths, out_lengths)
        if n_in == 1:
            part = self.parts[0]
            self._move(op, [_factor(part, moving)], self.outputs, moving)
            shared = Replicate(parts=n_out) if n_out > 1 else Rename()
            self._move(shared, [_factor(part, other)], self.outputs, other)
            for out in self.outputs:
                self.produced[out] = LoraModule(_name(out, "A", part), _name(out, "B", part), part.rank, part.alpha)
            return
        if n_out != 1:
            self.refuse(f"it maps {n_in} weights to {n_out}")
        out = self.outputs[0]
        others = [_factor(p, other) for p in self.parts]
        if self._shared(others):  # one shared A (B for columns): the moving factors take the op
            self._move(op, [_factor(p, moving) for p in self.parts], [out], moving)
            self._move(MergeEqual(), others, [out], other)
            rank, alpha = self.parts[0].rank, self.parts[0].alpha
        else:
            order = moved_ids(self.step.op, lengths, axis, self.ndim)[0].reshape(-1)
            if order.tolist() != list(range(sum(lengths))):
                self.refuse(f"its parts have different {other} factors, and it does more than concatenate "
                            f"them; fusectl lifts that only for a plain concat")
            # ΔW' = B' A' with the other factors side by side along the rank axis, the moving
            # ones block-diagonal: each part's rows (columns) see only its own rank slice
            self._move(BlockDiagonal(), [_factor(p, moving) for p in self.parts], [out], moving)
            self._move(Concat(axis=0 if rows else 1), others, [out], other)
            rank = sum(p.rank for p in self.parts)
            alpha = scale * (math.sqrt(rank) if self.lora.use_rslora else rank)
            if not math.isfinite(alpha):
                self.refuse(f"the fused module's alpha ({scale:g} × rank {rank}) is not a finite number")
            alpha = int(alpha) if float(alpha).is_integer() else alpha
        self.produced[out] = LoraModule(_name(out, "A", self.parts[0]), _name(out, "B", self.parts[0]), rank, alpha)

    def stack(self, axis: int) -> None:
        self.refuse("stacking experts is not lifted to adapters yet")

    def unstack(self, axis: int) -> None:
        self.refuse("unstacking experts is not lifted to adapters yet")

    def reshape(self) -> None:
        self.refuse("a reshape does not keep a low-rank factorisation")

    def transpose(self, perm: Sequence[int]) -> None:
        if tuple(perm) != (1, 0) or any(p.embedding for p in self.parts):
            self.refuse(f"only a matrix transpose is lifted (perm {list(perm)})")
        part, out = self.parts[0], self.outputs[0]
        # (s B A)ᵀ = s Aᵀ Bᵀ: the transposed B is the new A, the transposed A the new B
        self._step(Transpose(perm=(1, 0)), [part.b], [_name(out, "A", part)])
        self._step(Transpose(perm=(1, 0)), [part.a], [_name(out, "B", part)])
        self.produced[out] = LoraModule(_name(out, "A", part), _name(out, "B", part), part.rank, part.alpha)

    # --- mechanics ------------------------------------------------------------------------

    def _common_scaling(self) -> float:
        scalings = [self.lora.scaling(p.rank, p.alpha) for p in self.parts]
        if len(set(scalings)) > 1:
            detail = ", ".join(f"{m} {s:g} (r={p.rank}, alpha={p.alpha:g})"
                               for m, p, s in zip(self.inputs, self.parts, scalings))
            self.refuse(f"the parts' scalings differ ({detail}); one module has one scaling, so B would have to "
                        "be rescaled, which is not exact — fusectl does not do it")
        return scalings[0]

    def _move(self, op: Op, inputs: Sequence[str], modules: Sequence[str], factor: str) -> None:
        outputs = [_name(m, factor, self.parts[0]) for m in modules]
        if op.renames and list(inputs) == outputs:
            return  # the factor stays where it is (a row permutation done in place)
        self._step(op, inputs, outputs)

    def _step(self, op: Op, inputs: Sequence[str], outputs: Sequence[str]) -> None:
        specs = tuple(self.table.spec(n) for n in inputs)
        try:
            out_specs = tuple(op.infer(specs, list(inputs)))
        except PlanError as e:
            self.refuse(str(e))
        self.steps.append(Step(op, tuple(inputs), tuple(outputs), specs, out_specs))


def _module_of(weight: str, describe: str) -> str:
    if not weight.endswith(".weight"):
        raise PlanError(f"{describe}: {weight!r} is not a module's weight; an adapter's rules must map "
                        "m.weight to m'.weight")
    return weight[: -len(".weight")]


def _factor(part: LoraModule, factor: str) -> str:
    return part.a if factor == "A" else part.b


def _name(module: str, factor: str, like: LoraModule) -> str:
    """The adapter tensor of ``module``'s factor, spelled as ``like``'s (linear or embedding)."""
    suffix = f".lora_embedding_{factor}" if like.embedding else f".lora_{factor}.weight"
    return PREFIX + module + suffix
