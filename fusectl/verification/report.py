"""Verification reports: human text, stable JSON (``--report``), JUnit XML (``--junit``) and one
self-contained HTML page (``--html``, :mod:`fusectl.verification.html_report`)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from ..errors import OutputError, printable
from ..io.atomic import atomic_output
from .compare import Comparison

REPORT_VERSION = 1


def _would_pass(m: Comparison) -> str:
    if math.isinf(m.min_atol) or math.isinf(m.min_rtol):
        return "no finite tolerance would pass"
    return f"would pass with atol {m.min_atol:.3g} or rtol {m.min_rtol:.3g}"


def _nonfinite_text(m: Comparison) -> str:
    """"; NaN/+inf/-inf reference 4/0/0, candidate 4/0/0" where either side has any, else ""."""
    sides = [m.nonfinite[side] for side in ("reference", "candidate")]
    if not any(any(counts.values()) for counts in sides):
        return ""
    reference, candidate = ("/".join(str(counts[k]) for k in ("nan", "+inf", "-inf")) for counts in sides)
    return f"; NaN/+inf/-inf reference {reference}, candidate {candidate}"


@dataclass(frozen=True)
class Check:
    """One thing verify checked: a model output, a tensor, the inverse, the ties, a probe."""

    kind: str  # "output" | "tensor" | "inverse" | "ties" | "rules" | "state" | "optimizer" | "probe"
    name: str
    passed: bool
    comparison: Comparison | None = None
    detail: str = ""

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "name": self.name,
            "passed": self.passed,
            "detail": self.detail,
            "comparison": self.comparison.to_json() if self.comparison else None,
        }


@dataclass
class VerifyReport:
    mode: str  # "model" (two .onnx) or "checkpoint"
    reference: str
    candidate: str
    provider: str | None = None
    precision: str = "native"  # or "fp32-upcast" when bf16 ran as float32 on CPU
    seed: int = 0
    inputs: list[dict] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    # a training checkpoint's optimizer state as checked (``optimizer_check.OptimizerReplay.summary``)
    optimizer: dict | None = None

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_json(self) -> dict:
        return {
            "report_version": REPORT_VERSION,
            "mode": self.mode,
            "reference": self.reference,
            "candidate": self.candidate,
            "provider": self.provider,
            "precision": self.precision,
            "seed": self.seed,
            "inputs": self.inputs,
            "passed": self.passed,
            "failed": [c.name for c in self.checks if not c.passed],
            "checks": [c.to_json() for c in self.checks],
            "optimizer": self.optimizer,
        }

    def to_text(self) -> str:
        where = f" on {self.provider}" if self.provider else ""
        precision = " (bf16 upcast to float32)" if self.precision == "fp32-upcast" else ""
        lines = [f"verify {self.reference} -> {self.candidate} ({self.mode}){where}{precision}, seed {self.seed}"]
        summarized = {"tensor", "inverse", "state"}
        for kind in sorted(summarized):
            passed = [c for c in self.checks if c.kind == kind and c.passed]
            if passed:
                bitwise = sum(c.detail == "bitwise" for c in passed)
                lines.append(f"  PASS {kind}: {len(passed)} tensor(s) equal "
                             f"({bitwise} bitwise, {len(passed) - bitwise} within tolerance)")
        for c in self.checks:
            if c.kind in summarized and c.passed:
                continue
            status = "PASS" if c.passed else "FAIL"
            line = f"  {status} {c.kind} {printable(c.name)}"
            if c.comparison:
                m = c.comparison
                line += (f"  {m.dtype}{m.shape}: max abs {m.max_abs:.3g}, mean {m.mean_abs:.3g}, "
                         f"p99 {m.p99_abs:.3g}; max rel {m.max_rel:.3g}, p99 {m.p99_rel:.3g}; "
                         f"atol {m.atol:g} rtol {m.rtol:g}")
                if not m.passed and m.mismatches:
                    line += f"; {m.mismatches} element(s) differ, first at {m.first_mismatch}; {_would_pass(m)}"
                if m.note:
                    line += f"; {m.note}"
                line += _nonfinite_text(m)
            if c.detail:
                line += f"  ({c.detail})"
            lines.append(line)
        failed = sum(not c.passed for c in self.checks)
        lines.append(f"result: {'PASS' if self.passed else 'FAIL'} — "
                     f"{len(self.checks) - failed} passed, {failed} failed")
        return "\n".join(lines)

    def to_junit(self) -> bytes:
        failed = sum(not c.passed for c in self.checks)
        suite = ET.Element("testsuite", name="fusectl.verify", tests=str(len(self.checks)),
                           failures=str(failed), errors="0")
        props = ET.SubElement(suite, "properties")
        for key in ("mode", "reference", "candidate", "provider", "precision", "seed"):
            ET.SubElement(props, "property", name=key, value=str(getattr(self, key)))
        for c in self.checks:
            case = ET.SubElement(suite, "testcase", classname=f"fusectl.verification.{c.kind}", name=printable(c.name))
            if not c.passed:
                message = c.detail
                if c.comparison:
                    m = c.comparison
                    message = (f"{m.mismatches} element(s) differ; max abs {m.max_abs:.3g}, max rel "
                               f"{m.max_rel:.3g}; {_would_pass(m)}" + (f"; {m.note}" if m.note else "")
                               + (f"; {c.detail}" if c.detail else ""))
                ET.SubElement(case, "failure", message=printable(message))
        return ET.tostring(ET.ElementTree(suite).getroot(), encoding="utf-8", xml_declaration=True)

    def to_json_bytes(self) -> bytes:
        """The JSON report (:meth:`to_json`) as ``--report`` writes it: indented, one final newline."""
        return (json.dumps(self.to_json(), indent=2) + "\n").encode()

    def to_html(self) -> bytes:
        """The HTML page ``--html`` writes, made from :meth:`to_json` (so its numbers are the JSON's)."""
        from .html_report import html_page

        return html_page(self.to_json())

    def write(self, *, json_path: str | None = None, junit_path: str | None = None,
              html_path: str | None = None, inputs: Sequence[str] = (),
              on_note: Callable[[str], None] | None = None,
              extra: Sequence[tuple[str, Callable[[], bytes]]] = ()) -> None:
        """Write the JSON report to ``json_path``, JUnit XML to ``junit_path`` and the HTML page to
        ``html_path`` (any may be None), and each ``extra`` (path, what to write there) alike
        (``--save-inputs``).

        Each file is written under a temporary name beside it, flushed to disk and renamed into
        place (:func:`fusectl.io.atomic.atomic_output`), both renamed only once both are written:
        whatever fails (a full disk included) leaves neither a new file nor a torn one, and a
        file that was there before stays as it was. An existing file is replaced. A destination
        that exists and is not a regular file (``/dev/stdout``, a FIFO) cannot be replaced, so it
        is written straight through. ``inputs`` are files and folders no report may overwrite or
        land in (see :func:`check_report_destinations` for the check with the CLI's wording);
        ``on_note`` hears what was cleaned up after a killed run.

        Raises OutputError naming the file that could not be written.

        >>> import pathlib, tempfile
        >>> out = pathlib.Path(tempfile.mkdtemp(), "verify.json")
        >>> VerifyReport("model", "a.onnx", "b.onnx").write(json_path=str(out))
        >>> json.loads(out.read_text())["passed"]
        True
        >>> import shutil; shutil.rmtree(out.parent)
        """
        files = [(path, render) for path, render in ((json_path, self.to_json_bytes), (junit_path, self.to_junit),
                                                     (html_path, self.to_html), *extra) if path]
        streams = [(path, render) for path, render in files if _is_stream(path)]
        for path, render in streams:
            _write_stream(path, render())
        _replace_all([file for file in files if file not in streams], inputs, on_note)


def check_report_destinations(destinations: Mapping[str, str | None], inputs: Sequence[str]) -> None:
    """Refuse report files that would overwrite an input, land in an input folder, or collide.

    ``destinations`` maps an option (``--report``) to its path (None when not given);
    ``inputs`` are every file and folder verify reads: models, their external data,
    checkpoints and their shards, ``--inputs``, rules and config files. Links (symbolic and
    hard) are followed. Checked before anything runs, so a refused run writes nothing.
    """
    given = {option: path for option, path in destinations.items() if path}
    seen: dict[str, str] = {}
    for option, path in given.items():
        target = os.path.realpath(path)
        if target in seen:
            raise OutputError(f"{seen[target]} and {option} both name {printable(path)}; give each its own file")
        seen[target] = option
        if os.path.isdir(target):
            raise OutputError(f"{option} {printable(path)}: is a folder; name a file to write the report to")
        parent = os.path.dirname(target)
        if not os.path.isdir(parent):
            raise OutputError(f"{option} {printable(path)}: the folder {printable(parent)} does not exist; "
                              "create it or choose another path")
        for source in inputs:
            real = os.path.realpath(source)
            if target == real or _same_file(target, real):
                raise OutputError(f"{option} {printable(path)}: would overwrite the input {printable(source)}; "
                                  "choose another path for the report")
            if os.path.isdir(real) and target.startswith(real.rstrip(os.sep) + os.sep):
                raise OutputError(f"{option} {printable(path)}: would land inside the input folder "
                                  f"{printable(source)}; choose a path outside it")


def _is_stream(path: str) -> bool:
    """Whether ``path`` names something that exists and is not a regular file (a device, a FIFO)."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _write_stream(path: str, data: bytes) -> None:
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as e:  # ENOSPC at close carries no file name
        raise OutputError(f"{printable(path)}: {e.strerror or e}; check the path, permissions and free space") from e


def _replace_all(files: Sequence[tuple[str, Callable[[], bytes]]], inputs: Sequence[str],
                 on_note: Callable[[str], None] | None) -> None:
    """Write every file to its temporary, then rename them all into place (the last given first):
    a failure before the renames leaves every destination as it was."""
    try:
        with contextlib.ExitStack() as stack:
            temporaries = [(path, stack.enter_context(atomic_output(path, force=True, inputs=inputs,
                                                                    on_note=on_note)), render)
                           for path, render in files]
            for path, temporary, render in temporaries:
                try:
                    _write_synced(temporary, render())
                except OSError as e:  # raised here, so that the message names this report
                    raise _not_written(path, e) from e
    except OSError as e:  # while renaming into place
        raise _not_written(" and ".join(path for path, _ in files), e) from e


def _not_written(path: str, e: OSError) -> OutputError:
    return OutputError(f"{printable(path)}: {e.strerror or e} while writing it; no report file was written "
                       "(one that was there is left as it was); check the path, permissions and free space")


def _write_synced(path: str, data: bytes) -> None:
    """``data`` in a new file at ``path``, on disk when this returns (a full disk is raised here,
    not at some later close)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _same_file(a: str, b: str) -> bool:
    """Hard links: two names, one file."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
