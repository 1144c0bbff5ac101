"""A training dict's copies of the model (an EMA, an averaged model) take the model's plan.

timm's ``CheckpointSaver`` writes the model's EMA (``state_dict_ema``) beside the model, a
Lightning ``WeightAveraging`` checkpoint the average and the trained model, a training loop
keeping a ``torch.optim.swa_utils.AveragedModel`` its state dict (the model's names under
``module.``). Such a twin (``io.optimizer_state.Twin``) is a second model with the model's
names and shapes: the training code loads it into a second instance of the same class, so in a
fused checkpoint it must be fused exactly as the model is, numeric folds included (folding an
EMA is as valid as folding the model). Its steps are the model's, each re-derived on the
twin's own tensors (``Op.infer``: an EMA kept in float32 for a bfloat16 model keeps its
dtype); a step that reads a tensor the twin lacks, or holds in another shape, is a PlanError
naming the twin and the tensor, and nothing is written. The twin is tied as the model is.

>>> from fusectl.io.checkpoint import open_checkpoint
>>> c = open_checkpoint("fixtures/training/twins/timm.pth.tar")
>>> [(t.where, len(t.tensors)) for t in c.twins]
[('state_dict_ema', 12)]
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .errors import PlanError, TieError, printable, quote
from .executor import apply_group
from .followers.optimizer import STATE_SEP
from .io.checkpoint import Checkpoint
from .io.optimizer_state import Twin
from .steps import Plan, Step
from .table import ParamTable
from .ties import declare_ties


@dataclass(frozen=True)
class MovedTwin:
    """A twin after the model's plan: ``table`` its tensors by model name, ``plan`` the
    model's plan as it ran on them (its specs the twin's)."""

    twin: Twin
    table: ParamTable
    plan: Plan


def twin_table(twin: Twin) -> ParamTable:
    """The twin's tensors as a table (model names), each tensor stored once: names holding one
    tensor (the same object, or the same file bytes and spec) are tied, as in the model."""
    stored, aliases, seen = {}, {}, {}
    for name, tensor in twin.tensors.items():
        ranges = tensor.byte_ranges()
        identity = (tensor.spec, ranges) if ranges is not None else id(tensor)
        first = seen.setdefault(identity, name)
        if first == name:
            stored[name] = tensor
        else:
            aliases[name] = first
    table = ParamTable.from_stored(stored)
    for alias, kept in aliases.items():
        table.tie([alias], keep=kept)
    return table


def move_twins(checkpoint: Checkpoint, start: ParamTable, plan: Plan) -> list[MovedTwin]:
    """Each twin of ``checkpoint`` with ``plan`` (the model's steps: no optimizer state) run on
    it, tied as ``start`` (the table the model's plan started from) ties the model.

    :raises PlanError: a twin the plan does not bind to as it binds to the model (a tensor it
        reads missing from the twin, or of another shape; a step whose op refuses the twin's
        dtype), or tied otherwise than the model; naming the file, the twin and the tensor.
    """
    return [move_twin(checkpoint.path, twin, start, plan) for twin in checkpoint.twins]


def move_twin(path: str, twin: Twin, start: ParamTable, plan: Plan) -> MovedTwin:
    """One twin of the checkpoint at ``path`` after ``plan`` (see :func:`move_twins`)."""
    at = f"{printable(str(path))}: the model's copy {quote(twin.where)}"
    way_out = ("a copy of the model takes exactly the model's plan, so fusectl cannot write the training dict; "
               "write the model alone (a .safetensors output), or remove the entry")
    table = twin_table(twin)
    model_ties = [[m for m in g if m in table] for g in start.ties() if not any(STATE_SEP in m for m in g)]
    try:
        declare_ties(table, [g for g in model_ties if len(g) > 1], f"{at} (the model's ties)")
    except TieError as e:
        raise PlanError(f"{e}; {way_out}") from None
    tied = {frozenset(g) for g in model_ties}
    extra = next((g for g in table.ties() if frozenset(g) not in tied), None)
    if extra is not None:
        raise PlanError(f"{at} ties {', '.join(map(quote, extra))}, which the model does not tie; {way_out}")
    current = table.copy()
    groups = []
    for group in plan.groups:
        steps = []
        for step in group.steps:
            for name, spec in zip(step.inputs, step.input_specs):
                if name not in current:
                    raise PlanError(f"{at} does not bind like the model: {group.describe()} takes {quote(name)}, "
                                    f"which {quote(twin.where)} lacks; {way_out}")
                if current.spec(name).shape != spec.shape:
                    raise PlanError(f"{at} does not bind like the model: {group.describe()} takes {quote(name)} "
                                    f"as {list(spec.shape)}, {quote(twin.where)} holds {current.spec(name)}; "
                                    f"{way_out}")
            specs = tuple(current.spec(n) for n in step.inputs)
            try:
                outputs = tuple(step.op.infer(specs, step.inputs))
            except PlanError as e:
                raise PlanError(f"{at}: {group.describe()}: {e}; {way_out}") from None
            steps.append(Step(step.op, step.inputs, step.outputs, specs, outputs))
        # the model's plan broke these ties on purpose (--untie): the twin's break alike
        groups.append(apply_group(current, replace(group, steps=tuple(steps), untied=(), untied_stored=()),
                                  untie=True))
    return MovedTwin(twin, current, Plan(tuple(groups)))
