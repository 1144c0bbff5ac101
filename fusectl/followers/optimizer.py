"""A training checkpoint's optimizer state, as a follower of the parameters it belongs to.

The state tensors sit in the table beside their parameters, named ``<parameter>::<key>``
(``model.layers.0.self_attn.q_proj.weight::exp_avg``; ``io.checkpoint.Checkpoint.training_table``
puts them there). A state tensor shaped like its parameter takes exactly the parameter's steps:
the step's own op, with the same parameters, on the state tensors (a concat of q, k and v
concatenates their ``exp_avg`` the same way). A per-parameter number (``step``, NAdam's
``mu_product``, ASGD's ``eta`` and ``mu``) must be equal across the parts of a fused tensor
and is kept once (``merge_equal``, which refuses unequal parts when it runs; a split copies it).
The parts of one step must sit in one param group.

That is exact only for optimizers whose update is elementwise (:data:`EXACT`); the ones whose
update depends on a whole tensor, or whose state is block-quantized, are recognised by their
state keys and group hyperparameters and refused (:data:`REFUSED`), as is a state key fusectl
does not know. Ops that compute on values (folds) refuse through ``Op.lift``.

>>> recognise({"exp_avg", "exp_avg_sq", "step"}, [{"betas": [0.9, 0.999], "amsgrad": False}])
('Adam/AdamW', None)
>>> recognise({"exp_avg_sq_row", "exp_avg_sq_col", "step"}, [{}])[0]
'Adafactor'
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable, NoReturn, Sequence

from ..errors import ComputeError, PlanError, option, quote
from ..ops import Op
from ..ops.layout import Drop, MergeEqual, Rename, Replicate
from ..steps import Step
from ..table import ParamTable

# the separator of a state tensor's name in a table: ``<parameter>::<state key>``. A table with
# optimizer state holds it in no other name: a tensor of the model whose name holds it is refused
# when the training checkpoint is read (``Checkpoint.training_table``), written
# (``training_output``) or made by a rule (:meth:`OptimizerFollower.lift`), never taken for state
STATE_SEP = "::"

# state entries that are one number per parameter, not shaped like it
SCALAR_KEYS = frozenset({"step", "mu_product", "eta", "mu"})

# elementwise optimizers: (name, the state keys it may hold, a hyperparameter it always has or None)
EXACT: tuple[tuple[str, frozenset, str | None], ...] = (
    ("SGD", frozenset({"momentum_buffer"}), "dampening"),
    ("Adam/AdamW", frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}), "amsgrad"),
    ("NAdam", frozenset({"step", "mu_product", "exp_avg", "exp_avg_sq"}), "momentum_decay"),
    ("Lion", frozenset({"exp_avg"}), "betas"),
    ("RAdam", frozenset({"step", "exp_avg", "exp_avg_sq"}), None),
    ("Adamax", frozenset({"step", "exp_avg", "exp_inf"}), None),
    ("Adagrad", frozenset({"step", "sum"}), "lr_decay"),
    ("Adadelta", frozenset({"step", "square_avg", "acc_delta"}), "rho"),
    ("RMSprop", frozenset({"step", "square_avg", "momentum_buffer", "grad_avg"}), "alpha"),
    ("Rprop", frozenset({"step", "prev", "step_size"}), "etas"),
    ("ASGD", frozenset({"step", "eta", "mu", "ax"}), "t0"),
)

# (name, state keys that mark it, hyperparameters that mark it, why a layout rule changes its trajectory)
REFUSED: tuple[tuple[str, frozenset, frozenset, str], ...] = (
    ("bitsandbytes 8-bit", frozenset({"state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2"}), frozenset(),
     "its states are block-quantized, so moving rows would mix quantization blocks"),
    ("Adafactor", frozenset({"exp_avg_sq_row", "exp_avg_sq_col"}), frozenset({"scale_parameter", "relative_step"}),
     "its second moment is factored over a whole matrix's rows and columns"),
    ("Shampoo/SOAP", frozenset({"GG", "Q", "preconditioner", "precond"}), frozenset({"precondition_frequency"}),
     "its preconditioners span a whole tensor"),
    ("Muon", frozenset(), frozenset({"ns_steps", "ns_coefficients", "use_muon"}),
     "its update orthogonalises a whole matrix"),
    ("LAMB/LARS", frozenset(), frozenset({"trust_clip", "trust_coeff", "trust_coefficient", "always_adapt"}),
     "its trust ratio is a norm over a whole tensor"),
)


def refuse_separator(names: Iterable[str], where: str, error: type[Exception] = PlanError,
                     remedy: str = "give it another name, or write the model alone to a .safetensors file") -> None:
    """``error`` naming the first of ``names`` (tensors of the model) that holds :data:`STATE_SEP`:
    in a training checkpoint such a name would read as an optimizer state, and be written as one."""
    found = next((n for n in names if STATE_SEP in n), None)
    if found is not None:
        raise error(f"{where}: the tensor {quote(found)} holds {STATE_SEP!r} in its name, which in a training "
                    f"checkpoint marks an optimizer state (<parameter>{STATE_SEP}<key>), so fusectl would take it for "
                    f"one; {remedy}")


def recognise(keys: set, hypers: Sequence[dict]) -> tuple[str, str | None]:
    """(the optimizer's name, why its state cannot follow a layout rule or None) from its
    state ``keys`` and its groups' hyperparameters ``hypers``."""
    names = {h for hyper in hypers for h in hyper}
    for name, marks, hyper_marks, why in REFUSED:
        if keys & marks or names & hyper_marks:
            return name, why
    for name, allowed, mark in EXACT:
        if keys <= allowed and (mark is None or mark in names):
            return name, None
    unknown = sorted(keys - set().union(*(allowed for _, allowed, _ in EXACT)))
    if unknown:
        return "unknown", (f"its state key {quote(unknown[0])} is none fusectl knows to be elementwise "
                           "(it moves SGD, Adam/AdamW, NAdam, RAdam, Adamax, Adagrad, Adadelta, RMSprop, Rprop, "
                           "ASGD and Lion state)")
    return "unknown", ("its state keys and hyperparameters match no optimizer fusectl knows to be elementwise")


@dataclasses.dataclass(frozen=True)
class MergeEqualState(MergeEqual):
    """``merge_equal`` of a per-parameter number the optimizer holds as a tensor (``step``): the
    parts of one fused parameter must hold the same value. Its value is data, so this is checked
    when the step runs; a ComputeError in the optimizer's words when they differ."""

    def apply(self, arrays):
        try:
            return super().apply(arrays)
        except ComputeError:
            values = ", ".join(repr(a.tolist()) for a in arrays)
            raise ComputeError(f"the parts of one fused parameter hold the values {values}; one fused parameter "
                               "keeps one, so they must be equal (were the parts trained for different steps?); "
                               f"pass {option('drop_optimizer')} to write the model without its optimizer "
                               "state") from None


class OptimizerFollower:
    """A training checkpoint's optimizer state as a rider (``_protocols.Rider``).

    Built from the optimizer state and its parameter mapping (``io.optimizer_state``), the
    mapping given as it is or as a function that proves it when first asked for: a plan whose
    table holds no state tensors (``--drop-optimizer``, an output of the model alone) lifts
    nothing and never needs it. Its tensors are found in the table by name, so a plan on a
    table without them moves nothing."""

    kind = "optimizer"

    def __init__(self, state, mapping):
        self.state = state
        self._mapping = mapping if callable(mapping) else (lambda: mapping)
        self.keys = state.keys()
        self.name, self.why = recognise(set(self.keys), [g.hyper for g in state.groups])

    @functools.cached_property
    def mapping(self):
        """Which parameter each id is (``io.optimizer_state.ParamMap``), proven on first use."""
        return self._mapping()

    @functools.cached_property
    def group_of(self) -> dict:
        return {name: self.state.group_of(pid) for pid, name in self.mapping.names.items()}

    @functools.cached_property
    def numbers(self) -> dict:
        return {name: {k: v for k, v in self.state.states.get(pid, {}).items() if not hasattr(v, "spec")}
                for pid, name in self.mapping.names.items()}

    @classmethod
    def detect(cls, optimizer) -> "OptimizerFollower | None":
        return cls(*optimizer) if optimizer is not None else None

    def for_plan(self, rulesets: Sequence = (), origin=None) -> "OptimizerFollower":
        return OptimizerFollower(self.state, self._mapping)  # its own groups and numbers per plan

    def claimed(self, names: Iterable[str]) -> set[str]:
        return {f"{n}{STATE_SEP}{k}" for n in names for k in self.keys}

    def complete(self, op: Op) -> Op:
        return op

    def recorded(self, origin):
        return origin

    def claims(self, weight: str, table: ParamTable) -> list[str]:
        return [name for k in self.keys if (name := f"{weight}{STATE_SEP}{k}") in table]

    def report(self) -> dict:
        """The optimizer as ``inspect --json`` shows it (documented in README: "optimizer")."""
        state = self.state
        ids = {name: pid for pid, name in self.mapping.names.items()}
        steps = sorted({float(v) if not isinstance(v, bool) else v for n in self.numbers.values()
                        for k, v in n.items() if k == "step"})
        return {
            "where": state.where,
            "kind": self.name,
            "exact": self.why is None,
            "refused_because": self.why,
            "order_from": self.mapping.source,
            "groups": [{"params": len(g.params), "hyperparameters": g.hyper} for g in state.groups],
            "step": steps[0] if len(steps) == 1 else (steps or None),
            "parameters": {name: {"id": ids[name], "group": self.group_of[name],
                                  "state": sorted(state.states.get(ids[name], {}))}
                           for name in self.mapping.names.values()},
        }

    def lift(self, step: Step, group: Sequence[Step], table: ParamTable, describe: str) -> list[Step]:
        """The steps the optimizer state of ``step``'s inputs takes (none when they have none in
        ``table``); a PlanError naming the rule, the parameter and the optimizer otherwise."""
        refuse_separator(step.outputs, describe, remedy="give the rule's output another name")
        if not any(self.claims(n, table) for n in step.inputs):
            return []  # a table of the model alone (its optimizer not written), or untrained parameters
        lift = OptimizerLift(self, step, table, describe)
        if self.why is not None:
            lift.refuse(f"{self.name} is not elementwise: {self.why}")
        step.op.lift(lift)  # each layout answer checks the parts first (OptimizerLift.check)
        for out in step.outputs:
            self.group_of[out] = lift.group
            self.numbers[out] = lift.number_values
        return lift.steps


class OptimizerLift:
    """What one step does to the optimizer state of its inputs (``_protocols.Lift``)."""

    def __init__(self, follower: OptimizerFollower, step: Step, table: ParamTable, describe: str):
        self.follower, self.step, self.table, self.describe = follower, step, table, describe
        self.ndim = len(step.input_specs[0].shape)
        self.steps: list[Step] = []
        keys = [k for k in follower.keys if any(f"{n}{STATE_SEP}{k}" in table for n in step.inputs)]
        self.shaped = [k for k in keys if k not in SCALAR_KEYS or self._spec(k).shape == step.input_specs[0].shape]
        self.scalars = [k for k in keys if k not in self.shaped]
        self.group: int | None = None
        self.number_values: dict = {}

    def _spec(self, key: str):
        name = next(f"{n}{STATE_SEP}{key}" for n in self.step.inputs if f"{n}{STATE_SEP}{key}" in self.table)
        return self.table.spec(name)

    def check(self) -> None:
        """The parts have the same state keys, sit in one param group, and share their numbers."""
        step, f = self.step, self.follower
        for key in self.shaped + self.scalars:
            missing = [n for n in step.inputs if f"{n}{STATE_SEP}{key}" not in self.table]
            if missing:
                have = next(n for n in step.inputs if n not in missing)
                self.refuse(f"{have!r} has optimizer state {key!r} but {missing[0]!r} has none (a parameter the "
                            "optimizer did not train, or a state not yet created); the parts of one step must "
                            "have the same state")
        groups = [f.group_of.get(n, f.group_of.get(self.table.unique_name(n)) if n in self.table else None)
                  for n in step.inputs]
        if len(set(groups)) > 1:
            i = next(i for i, g in enumerate(groups) if g != groups[0])
            raise PlanError(f"{self.describe}: {step.inputs[0]!r} is in param group {groups[0]} and {step.inputs[i]!r} "
                            f"in param group {groups[i]} of the optimizer ({f.name}); one fused tensor has one "
                            "learning rate and decay, so its parts must sit in one group — put them in one "
                            f"group before saving, leave them out of the rule, or pass {option('drop_optimizer')} "
                            "to write the model without its optimizer state")
        self.group = groups[0]
        numbers = [f.numbers.get(n, {}) for n in step.inputs]
        for key in dict.fromkeys(k for n in numbers for k in n):
            values = [n.get(key) for n in numbers]
            if len(set(map(repr, values))) > 1:
                i = next(i for i, v in enumerate(values) if repr(v) != repr(values[0]))
                raise PlanError(f"{self.describe}: optimizer state {key!r} is {values[0]!r} for {step.inputs[0]!r} "
                                f"but {values[i]!r} for {step.inputs[i]!r}; the parts of one fused tensor take one "
                                "value, so they must be equal (were the parts trained for different steps?); pass "
                                f"{option('drop_optimizer')} to write the model without its optimizer state")
            self.number_values[key] = values[0]

    # --- what an op may say --------------------------------------------------------------

    def refuse(self, why: str) -> NoReturn:
        keys = ", ".join(self.follower.keys)
        raise PlanError(f"{self.describe}: {self.step.inputs[0]!r} has optimizer state ({self.follower.name}: "
                        f"{keys}); its {self.step.op.kind} step cannot carry it exactly: {why}. Pass "
                        f"{option('drop_optimizer')} to write the model without its optimizer state, or leave "
                        "this tensor out of the rule")

    def rename(self) -> None:
        self._same()
        self._numbers()

    def drop(self) -> None:
        if self.step.outputs:
            self.refuse("it drops the state while the parameter goes on under a new value")
        self.check()
        for key in self.shaped + self.scalars:
            names = self._names(key)
            self.steps.append(Step(Drop(), tuple(names), (), tuple(self.table.spec(n) for n in names), ()))

    def along(self, axis, make) -> None:
        self._same()
        self._numbers()

    def stack(self, axis) -> None:
        self._same()
        self._numbers()

    def unstack(self, axis) -> None:
        self._same()
        self._numbers()

    def transpose(self, perm) -> None:
        self._same()
        self._numbers()

    def reshape(self) -> None:
        self._same()
        self._numbers()

    # --- mechanics ------------------------------------------------------------------------

    def _names(self, key: str) -> list[str]:
        return [f"{n}{STATE_SEP}{key}" for n in self.step.inputs]

    def _outs(self, key: str) -> list[str]:
        return [f"{o}{STATE_SEP}{key}" for o in self.step.outputs]

    def _same(self) -> None:
        """Each shaped state takes the step's own op: same op, same parameters."""
        self.check()
        op = self.step.op
        for key in self.shaped:
            self._add(op, self._names(key), self._outs(key))

    def _numbers(self) -> None:
        """Per-parameter numbers held as tensors: kept once (merged when equal, copied to each part)."""
        n_in, n_out = len(self.step.inputs), len(self.step.outputs)
        for key in self.scalars:
            names, outs = self._names(key), self._outs(key)
            if n_in == n_out:
                for i, o in zip(names, outs):
                    if i != o:
                        self._add(Rename(), [i], [o])
            elif n_out == 1:
                self._add(MergeEqualState(), names, outs)
            elif n_in == 1:
                self._add(Replicate(parts=n_out), names, outs)
            else:
                self.refuse(f"it maps {n_in} tensors to {n_out}, and {key!r} has one value per parameter")

    def _add(self, op: Op, names: Sequence[str], outputs: Sequence[str]) -> None:
        specs = tuple(self.table.spec(n) for n in names)
        try:
            out_specs = op.infer(specs, list(names))
        except PlanError as e:
            self.refuse(str(e))
        self.steps.append(Step(op, tuple(names), tuple(outputs), specs, tuple(out_specs)))
