"""``verify A.onnx B.onnx``: run both on onnxruntime with the same inputs, compare every output."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Mapping

import ml_dtypes
import numpy as np

from ..errors import CheckpointError, VerifyError, option_name, printable, quote
from ..onnx.graph import external_data_files, load_model
from ..tolerance import default_tolerance
from .compare import check_tolerance, compare
from .input_ranges import DEFAULT, IntegerRange, integer_input_ranges
from .inputs_file import load_inputs_file
from .localize import Localization, localize_models
from .report import Check, VerifyReport
from .runner import (CPU, check_seed, declared_arrays, declared_shapes, make_inputs, ort_values,
                     random_integer_inputs, resolve_provider, run, session)
from .runs import OutputChecks, RunTally, compared_nothing, knob
from .shared_initializers import SharedInitializers, find_shared

__all__ = ["ModelVerifyReport", "OutputChecks", "load_inputs_file", "model_input_paths", "verify_models"]
from .upcast import has_bfloat16, upcast_bfloat16


@dataclass
class ModelVerifyReport(VerifyReport):
    """A model-mode report: also the named dynamic dimensions the inputs were made with,
    (in ``inputs``) the ``range`` and ``range_from`` of each random integer input, and the
    initializers both sessions ran on one copy of (``shared``: count and bytes)."""

    dims: dict[str, int] = field(default_factory=dict)
    shared: dict[str, int] = field(default_factory=lambda: SharedInitializers().to_json())
    # the seeded runs (``RunTally.to_json``): None for a report made by hand
    runs: dict | None = None
    # the inputs of the first failing run, for ``--save-inputs`` (not in the JSON)
    failing_inputs: dict[str, np.ndarray] | None = field(default=None, repr=False, compare=False)
    # where the graphs first diverge (``--localize``, or after a failing output); None: not looked for
    localization: Localization | None = None

    def to_json(self) -> dict:
        """The report's JSON (``--report``), with ``shared_initializers``, the named ``dims``, the
        ``runs`` and the ``localization`` (null when it did not run) added."""
        return {**super().to_json(), "shared_initializers": dict(self.shared), "runs": self.runs,
                "localization": self.localization.to_json() if self.localization is not None else None,
                "dims": dict(self.dims)}

    def to_text(self) -> str:
        """The report's text, with a line listing the inputs (and the dims and random integer
        ranges they were made with) after the first, and one saying what both sessions shared; the
        localization's lines before the result's."""
        head, *rest = super().to_text().split("\n")
        inputs = ", ".join(f"{printable(i['name'])} {i['dtype']}{i['shape']}"
                           + (" from file" if i["source"] == "file" else "") for i in self.inputs)
        line = f"  inputs: {inputs or 'none'}"
        if self.dims:
            line += "; dims " + ", ".join(f"{printable(n)}={v}" for n, v in self.dims.items())
        ranges = [f"{printable(i['name'])} in [{i['range'][0]}, {i['range'][1]}] ({printable(i['range_from'])})"
                  for i in self.inputs if "range" in i]
        if ranges:
            line += "\n  random integers: " + ", ".join(ranges)
        if self.shared["count"]:
            line += (f"\n  shared: {self.shared['count']} initializer(s), {self.shared['bytes'] / 1e6:.1f} MB "
                     "loaded once for both sessions")
        if self.runs and self.runs["count"] > 1:
            line += "\n" + self._runs_text()
        if self.localization is not None:
            rest[-1:-1] = self.localization.text_lines()
        return "\n".join([head, line, *rest])

    def _runs_text(self) -> str:
        """The runs' lines: the pass rate, the worst run (whose checks follow), each failing output."""
        runs, worst = self.runs, self.runs["worst"]
        first, last = runs["seeds"]
        lines = [f"  runs: {runs['passed']} of {runs['count']} passed ({runs['pass_rate']:.0%}), seeds {first}-{last}; "
                 f"checks below are of the worst run, seed {worst['seed']}"
                 + (f" ({len(worst['failed'])} failed)" if worst["failed"] else "")]
        for name, entry in runs["outputs"].items():
            if entry["failed_runs"]:
                tolerance = ("no finite tolerance would pass" if math.isinf(entry["min_atol"])
                             or math.isinf(entry["min_rtol"]) else
                             f"every run would pass with atol {entry['min_atol']:.3g} or rtol {entry['min_rtol']:.3g}")
                lines.append(f"  runs failed by {printable(name)}: {entry['failed_runs']} of {runs['count']}; "
                             f"max abs {entry['max_abs']:.3g}; {tolerance}")
        return "\n".join(lines)


class _Float32Inputs(Mapping[str, np.ndarray]):
    """``arrays`` with the bfloat16 ones as float32, converted on lookup, for models upcast to run on CPU."""

    def __init__(self, arrays: Mapping[str, np.ndarray]):
        self._arrays = arrays

    @property
    def declared(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Each input's shape and dtype as the upcast model sees it (bfloat16 declared as float32)."""
        return {k: (shape, np.dtype(np.float32) if dtype == ml_dtypes.bfloat16 else dtype)
                for k, (shape, dtype) in declared_arrays(self._arrays).items()}

    def __iter__(self):
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def __getitem__(self, name: str) -> np.ndarray:
        value = np.asarray(self._arrays[name])
        return value.astype(np.float32) if value.dtype == ml_dtypes.bfloat16 else value


def model_input_paths(path: str) -> list[str]:
    """The files verify reads for the model at ``path``: itself and its external data (checked)."""
    return [path, *external_data_files(path)]


def _integer_ranges(paths: list[str], names: list[str]) -> dict[str, IntegerRange]:
    """The range of each random integer input of ``names``, from the graphs at ``paths``."""
    if not names:
        return {}  # no graph to read: every integer input is given, or there is none
    try:
        models = [load_model(path) for path in paths]
    except CheckpointError:  # onnxruntime runs graphs onnx-ir cannot represent (maps)
        unread = IntegerRange(DEFAULT.low, DEFAULT.high, f"{DEFAULT.reason}: onnx-ir cannot read the graph")
        return {name: unread for name in names}
    return integer_input_ranges(models, names)


def _input_entry(spec) -> dict:
    """An input as the JSON report lists it."""
    entry = {"name": spec.name, "dtype": str(spec.dtype), "shape": list(spec.shape), "source": spec.source}
    if spec.range is not None:
        entry.update({"range": spec.range.to_json(), "range_from": spec.range.reason})
    return entry


def _check_outputs(sess, what: str) -> None:
    """verify compares tensors and sequences of tensors; a map or an optional it cannot."""
    for meta in sess.get_outputs():
        if not _COMPARABLE.fullmatch(meta.type):
            raise VerifyError(f"{printable(what)}: output {quote(meta.name)} has type {meta.type}; verify "
                              "compares tensors and sequences of tensors only")


_COMPARABLE = re.compile(r"tensor\([a-z0-9]+\)|seq\(tensor\([a-z0-9]+\)\)")


def _output_checks(name: str, expected, got, atol, rtol) -> list[Check]:
    """One check per tensor: the output itself, or each element of a sequence output."""
    if not isinstance(expected, list) and not isinstance(got, list):
        result = compare(name, np.asarray(expected), np.asarray(got), atol, rtol)
        return [Check("output", name, result.passed, result)]
    if not (isinstance(expected, list) and isinstance(got, list)):
        kinds = ["a sequence" if isinstance(v, list) else "a tensor" for v in (expected, got)]
        return [Check("output", name, False, detail=f"the reference gives {kinds[0]}, the candidate {kinds[1]}")]
    if len(expected) != len(got):
        return [Check("output", name, False,
                      detail=f"a sequence of {len(expected)} tensor(s) in the reference, {len(got)} in the candidate")]
    return [check for i, (a, b) in enumerate(zip(expected, got))
            for check in _output_checks(f"{name}[{i}]", a, b, atol, rtol)]


def _output_tolerances(names: list[str], checks: OutputChecks) -> None:
    """Every ``--tol`` names an output of one of the graphs."""
    for name in checks.tolerances:
        if name not in names:
            raise VerifyError(f"{knob('--tol', 'tolerances')} {printable(name)}: neither graph has an output "
                              f"named {quote(name)}; their outputs are {', '.join(map(printable, names))}")


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
    share: bool = True,
    output_checks: OutputChecks | None = None,
) -> ModelVerifyReport:
    """Run ``reference`` and ``candidate`` with identical inputs and compare outputs by name.

    ``inputs`` are arrays to feed by input name; the other inputs are seeded random, shaped by
    ``shapes`` (input name -> whole shape) and ``dims`` (dim_param name -> size), see
    :func:`fusectl.verification.runner.resolve_shapes`. On CPU, initializers both graphs hold
    alike in external data are loaded once for both sessions
    (:mod:`fusectl.verification.shared_initializers`; ``share=False`` loads each graph on its own).
    ``output_checks`` (:class:`OutputChecks`): per-output tolerances, and how many seeded runs;
    with several, the report's checks are the worst run's (the most failing checks, then the most
    mismatched elements, then the earliest), ``runs`` holds the pass rate and each output's worst
    statistics, and ``failing_inputs`` the first failing run's inputs. An output check that
    compared no finite element fails. ``output_checks.localize`` (by default, a failing output)
    then looks for the first node whose output differs, on the first failing run's inputs (else
    the first run's): the report's ``localization``
    (:func:`fusectl.verification.localize.localize_models`).

    :raises VerifyError: see :func:`fusectl.api.verify`; also a ``tolerances`` name that is no
        output, and several runs when every input is given (each run would be the same).
    """
    checks = output_checks or OutputChecks()
    atol = None if atol is None else check_tolerance("atol", atol)
    rtol = None if rtol is None else check_tolerance("rtol", rtol)
    seed = check_seed(seed)
    # before onnxruntime (or onnx-ir) reads a byte of them
    external = all([len(model_input_paths(path)) > 1 for path in (reference, candidate)])
    chosen = resolve_provider(provider)
    # onnxruntime has no bf16 CPU kernels: on CPU both models run upcast to float32
    upcast = chosen == CPU and (has_bfloat16(reference) or has_bfloat16(candidate))
    # a CUDA session would copy a CPU array to the device anyway (onnxruntime then uses its own)
    shared = (find_shared(reference, candidate) if share and external and chosen == CPU and not upcast
              else SharedInitializers())
    values = ort_values(shared.arrays)
    # several runs keep both sessions, each with its arena shrunk after each run (its intermediate
    # buffers are not held while the other session runs); measured, arenas off instead let freed
    # buffers fragment the heap and peak higher
    ref_sess = session(upcast_bfloat16(reference) if upcast else reference, chosen, reference, values)
    cand_sess = session(upcast_bfloat16(candidate) if upcast else candidate, chosen, candidate, values)
    _check_outputs(ref_sess, reference)
    _check_outputs(cand_sess, candidate)
    _output_tolerances(list(dict.fromkeys(o.name for s in (ref_sess, cand_sess) for o in s.get_outputs())), checks)
    given = _Float32Inputs(inputs or {}) if upcast else (inputs or {})
    random_inputs = [m.name for m in ref_sess.get_inputs() if m.name not in set(given)]
    if checks.runs > 1 and not random_inputs:
        raise VerifyError(f"{knob('--runs', 'runs')} {checks.runs} runs seeded random inputs, but "
                          f"{option_name('inputs')} gives every input, so each run would be the same; leave "
                          f"one out or drop {knob('--runs', 'runs')}")
    ranges = _integer_ranges(list(dict.fromkeys([reference, candidate])), random_integer_inputs(ref_sess, given))
    default_atol, default_rtol = default_tolerance(ml_dtypes.bfloat16) if upcast else (None, None)
    base_atol, base_rtol = default_atol if atol is None else atol, default_rtol if rtol is None else rtol
    tally = RunTally(seed)
    first_feeds = None  # the first run's inputs, to localize on when every run passes
    for index in range(checks.runs):
        feeds, specs, named = make_inputs(ref_sess, given, shapes or {}, dims or {}, seed + index, reference,
                                          hints=declared_shapes(cand_sess), ranges=ranges)
        cand_inputs = {m.name for m in cand_sess.get_inputs()}
        if cand_inputs != set(feeds):
            raise VerifyError(
                f"{candidate}: its inputs {sorted(cand_inputs)} differ from {reference}'s {sorted(feeds)}"
            )
        # with one run, each session is let go once run: its arena (the graph's intermediate
        # buffers) is not needed to run the other graph or to compare the outputs
        ref_out = run(ref_sess, feeds, reference, shrink=checks.runs > 1)
        if checks.runs == 1:
            del ref_sess
        cand_out = run(cand_sess, feeds, candidate, shrink=checks.runs > 1)
        if checks.runs == 1:
            del cand_sess
        run_checks = []
        for name, expected in ref_out.items():
            if name not in cand_out:
                run_checks.append(Check("output", name, False, detail=f"{candidate} has no output {name!r}"))
                continue
            out_atol, out_rtol = checks.tolerances.get(name, (base_atol, None))
            out_rtol = base_rtol if out_rtol is None else out_rtol
            run_checks += map(compared_nothing, _output_checks(name, expected, cand_out[name], out_atol, out_rtol))
        for name in sorted(set(cand_out) - set(ref_out)):
            run_checks.append(Check("output", name, False, detail=f"{reference} has no output {name!r}"))
        del ref_out, cand_out  # one run's outputs at a time
        tally.add(seed + index, run_checks, feeds)
        if index == 0 and checks.localize:
            first_feeds = feeds
        del feeds
    ref_sess = cand_sess = None  # several runs kept both sessions: localizing runs its own
    report = ModelVerifyReport("model", reference, candidate, chosen, seed=seed, dims=named, shared=shared.to_json(),
                               precision="fp32-upcast" if upcast else "native",
                               inputs=[_input_entry(s) for s in specs], runs=tally.to_json(),
                               failing_inputs=tally.failing_inputs)
    report.checks = list(tally.worst[3])
    if checks.localize or (checks.localize is None and not report.passed):
        failing = tally.first_failing
        which = "the first failing run" if failing else "the first run"
        if random_inputs:
            which += f" (seed {failing[1] if failing else seed})"
        report.localization = localize_models(
            reference, candidate, tally.failing_inputs or first_feeds, provider=chosen, atol=base_atol,
            rtol=base_rtol, initializers=values, upcast=upcast, note=f"inputs of {which}")
    return report
