"""Probes for LoRA adapters: each module's ΔW = s · B · A, composed through the base plan.

A lifted adapter is right when every module's update is the update the base plan makes of the
reference's: for each base step (a concat of q, k and v into qkv), the reference parts' ΔW
(``s_k · B_k · A_k``, float32) against the candidate's fused ``s' · B' · A'`` un-fused in ONNX
by the step's op — the same probe graphs as the other steps (``build_probe``). A scaling lost
from ``rank_pattern``, a B block in the wrong rows, a swapped A all change ΔW.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..dtypes import BY_NAME
from ..executor import Evaluation, walk
from ..followers.lora import LoraConfig, LoraModule
from ..io.checkpoint import Checkpoint
from ..steps import Plan
from ..table import ParamTable
from ..tensors import ArrayTensor, TensorSpec
from .probes import PROBE_COLUMNS, _run_probe, build_probe, column_window
from .report import Check


def adapter_probes(base: Plan, reference: Checkpoint, candidate: Checkpoint, provider: str, seed: int,
                   atol: float | None, rtol: float | None) -> list[Check]:
    """One probe per base step whose outputs the candidate holds (every module, not once per
    shape: the modules' updates differ, and each is a few small matrix products)."""
    ref_adapter, cand_adapter = reference.followers.view, candidate.followers.view
    ref_lora, cand_lora = ref_adapter.config, cand_adapter.config
    ref_modules = ref_adapter.modules(reference.table)
    cand_modules = cand_adapter.modules(candidate.table)
    deltas = ParamTable.from_stored({f"{m}.weight": _delta_tensor(reference.table, info, ref_lora)
                                     for m, info in ref_modules.items()})
    checks = []
    for group, before, _ in walk(deltas, base, "adapter probes"):
        for step in group.steps:
            modules = [n[: -len(".weight")] for n in step.outputs]
            if not step.op.probed or not all(m in cand_modules for m in modules):
                continue
            window = column_window(step)
            cut = (lambda a: np.ascontiguousarray(a[:, :PROBE_COLUMNS])) if window else (lambda a: a)
            evaluation = Evaluation([before[n] for n in step.inputs])
            ins = [cut(evaluation.array(before[n])) for n in step.inputs]
            outs = [_delta(candidate.table, cand_modules[m], cand_lora, PROBE_COLUMNS if window else None)
                    for m in modules]
            probe = build_probe(step, ins, outs, seed, window)
            if probe is not None:
                labelled = replace(probe, label=f"ΔW = s·B·A of {', '.join(modules)}: {probe.label}")
                checks.append(_run_probe(labelled, group.describe(), provider, atol, rtol))
    return checks


def _delta(table: ParamTable, info: LoraModule, lora: LoraConfig, columns: int | None = None) -> np.ndarray:
    """s · B · A in float32 (an embedding's transposed: [num_embeddings, dim]), or its first
    ``columns`` columns."""
    a = table[info.a].read().astype(np.float32)
    b = table[info.b].read().astype(np.float32)
    s = np.float32(lora.scaling(info.rank, info.alpha))
    if info.embedding:
        delta = (b @ a).T * s
        return delta[:, :columns] if columns else delta
    return (b @ (a[:, :columns] if columns else a)) * s


def _delta_tensor(table: ParamTable, info: LoraModule, lora: LoraConfig) -> ArrayTensor:
    delta = _delta(table, info, lora)
    return ArrayTensor(TensorSpec(BY_NAME["F32"], delta.shape), delta)
