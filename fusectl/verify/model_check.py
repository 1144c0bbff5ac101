"""``verify A.onnx B.onnx``: run both on onnxruntime with the same inputs, compare every output."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import ml_dtypes
import numpy as np

from ..errors import VerifyError, printable
from .compare import compare, default_tolerance
from .report import Check, VerifyReport
from .runner import CPU, declared_shapes, make_inputs, resolve_provider, run, session
from .upcast import has_bfloat16, upcast_bfloat16


@dataclass
class ModelVerifyReport(VerifyReport):
    """A model-mode report: also the named dynamic dimensions the inputs were made with."""

    dims: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {**super().to_json(), "dims": dict(self.dims)}

    def to_text(self) -> str:
        head, *rest = super().to_text().split("\n")
        inputs = ", ".join(f"{printable(i['name'])} {i['dtype']}{i['shape']}"
                           + (" from file" if i["source"] == "file" else "") for i in self.inputs)
        line = f"  inputs: {inputs or 'none'}"
        if self.dims:
            line += "; dims " + ", ".join(f"{printable(n)}={v}" for n, v in self.dims.items())
        return "\n".join([head, line, *rest])


def load_inputs_file(path: str | None) -> dict[str, np.ndarray]:
    if path is None:
        return {}
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError) as e:
        raise VerifyError(f"{path}: cannot read inputs ({e}); pass an .npz of named arrays") from e


def verify_models(
    reference: str,
    candidate: str,
    *,
    provider: str = "auto",
    atol: float | None = None,
    rtol: float | None = None,
    inputs: Mapping[str, np.ndarray] | None = None,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    dims: Mapping[str, int] | None = None,
    seed: int = 0,
) -> ModelVerifyReport:
    """Run ``reference`` and ``candidate`` with identical inputs and compare outputs by name.

    ``inputs`` are arrays to feed by input name; the other inputs are seeded random, shaped by
    ``shapes`` (input name -> whole shape) and ``dims`` (dim_param name -> size), see
    :func:`fusectl.verify.runner.resolve_shapes`.
    """
    chosen = resolve_provider(provider)
    # onnxruntime has no bf16 CPU kernels: on CPU both models run upcast to float32
    upcast = chosen == CPU and (has_bfloat16(reference) or has_bfloat16(candidate))
    ref_sess = session(upcast_bfloat16(reference) if upcast else reference, chosen, reference)
    cand_sess = session(upcast_bfloat16(candidate) if upcast else candidate, chosen, candidate)
    given = {k: (np.asarray(v, np.float32) if upcast and v.dtype == ml_dtypes.bfloat16 else v)
             for k, v in (inputs or {}).items()}
    feeds, specs, named = make_inputs(ref_sess, given, shapes or {}, dims or {}, seed, reference,
                                      hints=declared_shapes(cand_sess))
    cand_inputs = {m.name for m in cand_sess.get_inputs()}
    if cand_inputs != set(feeds):
        raise VerifyError(
            f"{candidate}: its inputs {sorted(cand_inputs)} differ from {reference}'s {sorted(feeds)}"
        )
    ref_out = run(ref_sess, feeds, reference)
    cand_out = run(cand_sess, feeds, candidate)
    report = ModelVerifyReport("model", reference, candidate, chosen, seed=seed, dims=named,
                               precision="fp32-upcast" if upcast else "native",
                               inputs=[{"name": s.name, "dtype": str(s.dtype), "shape": list(s.shape),
                                        "source": s.source} for s in specs])
    for name, expected in ref_out.items():
        if name not in cand_out:
            report.checks.append(Check("output", name, False, detail=f"{candidate} has no output {name!r}"))
            continue
        default_atol, default_rtol = default_tolerance(ml_dtypes.bfloat16) if upcast else (None, None)
        result = compare(name, np.asarray(expected), np.asarray(cand_out[name]),
                         default_atol if atol is None else atol, default_rtol if rtol is None else rtol)
        report.checks.append(Check("output", name, result.passed, result))
    for name in sorted(set(cand_out) - set(ref_out)):
        report.checks.append(Check("output", name, False, detail=f"{reference} has no output {name!r}"))
    return report
