"""``verify A.onnx B.onnx``: run both on onnxruntime with the same inputs, compare every output."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..errors import VerifyError
from .compare import compare
from .report import Check, VerifyReport
from .runner import make_inputs, resolve_provider, run, session


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
    seed: int = 0,
) -> VerifyReport:
    """Run ``reference`` and ``candidate`` with identical inputs and compare outputs by name."""
    chosen = resolve_provider(provider)
    ref_sess = session(reference, chosen, reference)
    cand_sess = session(candidate, chosen, candidate)
    feeds, specs = make_inputs(ref_sess, inputs or {}, shapes or {}, seed, reference)
    cand_inputs = {m.name for m in cand_sess.get_inputs()}
    if cand_inputs != set(feeds):
        raise VerifyError(
            f"{candidate}: its inputs {sorted(cand_inputs)} differ from {reference}'s {sorted(feeds)}"
        )
    ref_out = run(ref_sess, feeds, reference)
    cand_out = run(cand_sess, feeds, candidate)
    report = VerifyReport("model", reference, candidate, chosen, seed=seed,
                          inputs=[{"name": s.name, "dtype": str(s.dtype), "shape": list(s.shape),
                                   "source": s.source} for s in specs])
    for name, expected in ref_out.items():
        if name not in cand_out:
            report.checks.append(Check("output", name, False, detail=f"{candidate} has no output {name!r}"))
            continue
        result = compare(name, np.asarray(expected), np.asarray(cand_out[name]), atol, rtol)
        report.checks.append(Check("output", name, result.passed, result))
    for name in sorted(set(cand_out) - set(ref_out)):
        report.checks.append(Check("output", name, False, detail=f"{reference} has no output {name!r}"))
    return report
