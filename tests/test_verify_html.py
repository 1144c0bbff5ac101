"""``verify --html FILE.html`` (verification/html_report.py, issue 31): one self-contained page
whose checks come failing first and whose numbers are the JSON report's, read back from the page
with Python's html.parser and, where Debian's chromium is installed, from the DOM a real headless
browser rendered.

The failing pair is the BERT fixture against itself with one element of ``pooler.dense.weight``
changed: ``last_hidden_state`` (first in the graph's outputs) still passes, ``pooler_output``
fails, so a page that kept the report's order would show the passing check first."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from conftest import FIXTURES, parse_safetensors, run_cli, write_safetensors
from fusectl import api
from fusectl.verification.html_report import STATISTICS, format_number, html_page

BERT = FIXTURES / "onnx" / "bert"
CHANGED = "pooler.dense.weight"


class Page(HTMLParser):
    """What a test reads back from a page: each check (in page order) with its statistics cells
    and histogram bars, every other ``data-field`` cell, and every tag and attribute."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.checks: list[dict] = []
        self.fields: dict[str, list[tuple[str, str]]] = {}  # outside checks: field -> [(raw, text)]
        self.tags: set[str] = set()
        self.attributes: list[tuple[str, str]] = []
        self._cell: tuple[str, str] | None = None  # (field, raw) of the open cell
        self._text: list[str] = []
        self._depth = 0  # open <section> elements inside the current check
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.add(tag)
        self.attributes += [(k, v or "") for k, v in attrs.items()]
        if tag == "section" and "check" in (attrs.get("class") or "").split():
            self.checks.append({"name": json.loads(attrs["data-name"]), "passed": json.loads(attrs["data-passed"]),
                                "index": int(attrs["data-index"]), "cells": {}, "bars": {}, "total": None})
            self._depth = 1
        elif tag == "section" and self._depth:
            self._depth += 1
        if tag == "td" and "data-field" in attrs:
            self._cell, self._text = (attrs["data-field"], attrs["data-value"]), []
        if tag == "rect" and self._depth:
            self.checks[-1]["bars"][attrs["data-bin"]] = int(attrs["data-count"])
        if tag == "svg" and self._depth:
            self.checks[-1]["total"] = int(attrs["data-total"])

    def handle_data(self, data):
        if self._cell is not None:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            field, raw = self._cell
            if self._depth:
                self.checks[-1]["cells"][field] = (json.loads(raw), "".join(self._text))
            else:
                self.fields.setdefault(field, []).append((json.loads(raw), "".join(self._text)))
            self._cell = None
        if tag == "section" and self._depth:
            self._depth -= 1


def _changed_bert(path: Path) -> Path:
    """The BERT fixture with one element of the pooler's weight moved by 0.5."""
    model = onnx.load(str(BERT / "model.onnx"))
    tensor = next(t for t in model.graph.initializer if t.name == CHANGED)
    weights = numpy_helper.to_array(tensor).copy()
    weights.flat[3] += 0.5
    tensor.CopyFrom(numpy_helper.from_array(weights, CHANGED))
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def failing(tmp_path_factory):
    """(JSON report, HTML path) of a failing model-mode verify written with --report and --html."""
    tmp = tmp_path_factory.mktemp("html")
    candidate = _changed_bert(tmp / "bert-changed.onnx")
    report, page = tmp / "verify.json", tmp / "verify.html"
    result = run_cli("verify", BERT / "model.onnx", candidate, "--inputs", BERT / "io.npz",
                     "--report", report, "--html", page)
    assert result.exit_code == 1, result.output
    return json.loads(report.read_text()), page


def _reads_as(text: str, value) -> bool:
    """Whether a number shown as ``text`` reads as ``value`` to four significant digits."""
    if isinstance(value, int):
        return text == str(value)
    if math.isinf(value):
        return text == ("inf" if value > 0 else "-inf")
    return math.isclose(float(text), value, rel_tol=5e-4, abs_tol=0.0)


def _assert_shows(page: Page, doc: dict) -> None:
    """The page lists the report's checks, failing first, each with the report's numbers."""
    checks = doc["checks"]
    assert sorted((c["name"], c["passed"]) for c in page.checks) == sorted((c["name"], c["passed"]) for c in checks)
    passed = [c["passed"] for c in page.checks]
    assert passed == sorted(passed), "a passing check comes before a failing one"
    for shown in page.checks:
        check = checks[shown["index"]]
        assert (shown["name"], shown["passed"]) == (check["name"], check["passed"])
        m = check["comparison"]
        if m is None:
            assert not shown["cells"] and not shown["bars"]
            continue
        for field, _ in STATISTICS:
            raw, text = shown["cells"][field]
            assert raw == m[field], field
            assert _reads_as(text, m[field]), (field, text, m[field])
        histogram = m["histogram"]
        assert shown["bars"]["zero"] == histogram["zero"]
        assert [shown["bars"][str(i)] for i in range(len(histogram["counts"]))] == histogram["counts"]
        assert sum(shown["bars"].values()) == shown["total"] == m["compared"]


def test_the_page_shows_the_failing_check_first_with_the_json_reports_numbers(failing):
    doc, path = failing
    assert [c["name"] for c in doc["checks"]] == ["last_hidden_state", "pooler_output"]
    assert doc["failed"] == ["pooler_output"]
    page = Page(path.read_text(encoding="utf-8"))
    assert [c["name"] for c in page.checks] == ["pooler_output", "last_hidden_state"]
    _assert_shows(page, doc)
    pooler = page.checks[0]
    assert pooler["cells"]["mismatches"][0] == 1 and pooler["cells"]["max_abs"][0] > 0.01
    assert sum(count for key, count in pooler["bars"].items() if key != "zero") == 1  # the one changed element
    # the header is the report's
    for field in ("mode", "reference", "candidate", "provider", "precision", "seed"):
        assert page.fields[field] == [(doc[field], format_number(doc[field]) if field == "seed" else doc[field])]
    assert pooler["cells"]["first_mismatch"] == (doc["checks"][1]["comparison"]["first_mismatch"], "[0, 0]")


def test_the_histogram_in_the_json_report_counts_every_compared_element(failing):
    doc, _ = failing
    for check in doc["checks"]:
        histogram = check["comparison"]["histogram"]
        assert histogram["edges_log10"] == list(range(-12, 4))
        assert len(histogram["counts"]) == len(histogram["edges_log10"]) + 1
        assert histogram["zero"] + sum(histogram["counts"]) == check["comparison"]["compared"]
    passing = doc["checks"][0]["comparison"]
    assert passing["histogram"]["zero"] == passing["compared"] == 8 * 32  # bitwise equal


def test_the_page_asks_nothing_of_the_network(failing):
    _, path = failing
    text = path.read_text(encoding="utf-8")
    for needle in ("http:", "https:", "//", "url(", "@import"):
        assert needle not in text, needle
    page = Page(text)
    assert not page.tags & {"script", "link", "img", "iframe", "object", "embed", "base"}
    assert not [name for name, _ in page.attributes if name in {"src", "href", "srcset", "action", "xlink:href"}]
    assert text.startswith("<!DOCTYPE html>") and '<meta charset="utf-8">' in text


def _chromium_dom(path: Path, tmp_path: Path) -> str:
    """The DOM Debian's chromium rendered from ``path`` (flags as on this machine's probe)."""
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    result = subprocess.run(
        [shutil.which("chromium"), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--dump-dom", path.resolve().as_uri()],
        capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_a_headless_browser_renders_the_failing_check_first_with_the_same_numbers(failing, tmp_path):
    doc, path = failing
    dom = _chromium_dom(path, tmp_path)
    assert "<svg" in dom and "pooler_output" in dom  # rendered, not an error page
    page = Page(dom)
    assert [c["name"] for c in page.checks] == ["pooler_output", "last_hidden_state"]
    _assert_shows(page, doc)


def test_runs_show_the_pass_rate_and_the_worst_runs_checks(tmp_path):
    candidate = _changed_bert(tmp_path / "bert-changed.onnx")
    report, path = tmp_path / "verify.json", tmp_path / "verify.html"
    # --no-localize: the page's localization has fields of its own (min_atol …); this test reads the runs'
    result = run_cli("verify", BERT / "model.onnx", candidate, "--runs", "3", "--no-localize", "--report", report,
                     "--html", path)
    assert result.exit_code == 1, result.output
    doc, page = json.loads(report.read_text()), Page(path.read_text(encoding="utf-8"))
    runs = doc["runs"]
    assert runs["count"] == 3
    assert page.fields["count"] == [(3, "3")] and page.fields["passed"] == [(runs["passed"], str(runs["passed"]))]
    assert page.fields["pass_rate"][0][0] == runs["pass_rate"] and page.fields["seeds"] == [([0, 2], "0–2")]
    assert page.fields["worst_seed"] == [(runs["worst"]["seed"], str(runs["worst"]["seed"]))]
    assert [raw for raw, _ in page.fields["failed_runs"]] == [e["failed_runs"] for e in runs["outputs"].values()]
    assert [raw for raw, _ in page.fields["min_atol"]] == [e["min_atol"] for e in runs["outputs"].values()]
    _assert_shows(page, doc)


def test_a_checkpoint_verify_writes_its_page_too(tmp_path):
    # the Llama fixture fused, then one element of a fused weight moved by 0.01 (README's "bad/")
    fused = tmp_path / "fused.safetensors"
    assert run_cli("fuse", FIXTURES / "tiny-llama-gqa", "-r", "llama-qkv", "-o", fused, "--quiet").exit_code == 0
    tensors, metadata = parse_safetensors(fused)
    arrays = {name: np.frombuffer(raw, np.float32).reshape(shape).copy() for name, (_, shape, raw) in tensors.items()}
    changed = "model.layers.1.self_attn.qkv_proj.weight"
    arrays[changed][5, 7] += 0.01
    write_safetensors(fused, arrays, metadata)
    report, path = tmp_path / "verify.json", tmp_path / "verify.html"
    result = run_cli("verify", FIXTURES / "tiny-llama-gqa", fused, "--report", report, "--html", path)
    assert result.exit_code == 1, result.output
    doc, page = json.loads(report.read_text()), Page(path.read_text(encoding="utf-8"))
    assert doc["mode"] == "checkpoint" and page.fields["mode"] == [("checkpoint", "checkpoint")]
    assert len(page.checks) == len(doc["checks"]) > 20 and changed in doc["failed"]
    assert page.checks[0]["passed"] is False and page.checks[-1]["passed"] is True
    _assert_shows(page, doc)
    tensor = next(c for c in page.checks if c["name"] == changed)
    assert tensor["cells"]["mismatches"][0] == 1 and tensor["cells"]["max_abs"][0] == pytest.approx(0.01, rel=1e-3)


def test_the_page_is_refused_over_an_input_or_another_report(tmp_path):
    model = BERT / "model.onnx"
    over = run_cli("verify", model, model, "--html", model)
    assert over.exit_code == 2 and over.stderr.startswith("error: --html")
    assert "would overwrite the input" in over.stderr
    report = tmp_path / "same"
    same = run_cli("verify", model, model, "--report", report, "--html", report)
    assert same.exit_code == 2 and "both name" in same.stderr and "--html" in same.stderr
    assert not report.exists()


def test_the_api_writes_the_page_it_returns(tmp_path):
    path = tmp_path / "verify.html"
    result = api.verify(str(BERT / "model.onnx"), str(BERT / "model.onnx"), provider="cpu",
                        inputs=str(BERT / "io.npz"), html=str(path))
    assert result.passed and path.read_bytes() == result.to_html()
    assert sorted(os.listdir(tmp_path)) == ["verify.html"]  # no temporary left beside it


# -- pages made from hand-made reports ---------------------------------------------------------

def _comparison(name: str, **changes) -> dict:
    record = {"name": name, "dtype": "float32", "shape": [2, 3], "passed": False, "atol": 1e-5, "rtol": 1e-5,
              "mismatches": 2, "max_abs": 0.25, "mean_abs": 0.0625, "p99_abs": 0.25, "max_rel": math.inf,
              "mean_rel": 1.5, "p99_rel": 3.0, "min_atol": 0.25, "min_rtol": math.inf, "first_mismatch": [0, 1],
              "note": "", "compared": 6,
              "nonfinite": {"reference": {"nan": 0, "+inf": 0, "-inf": 0}, "candidate": {"nan": 0, "+inf": 0,
                                                                                          "-inf": 0}},
              "histogram": {"edges_log10": list(range(-12, 4)), "counts": [0] * 11 + [2] + [0] * 5, "zero": 4}}
    record.update(changes)
    return record


def _report(**extra) -> dict:
    return {"report_version": 1, "mode": "model", "reference": "a.onnx", "candidate": "b.onnx",
            "provider": "CPUExecutionProvider", "precision": "native", "seed": 0, "inputs": [], "passed": False,
            "failed": ["y"], "optimizer": None,
            "checks": [{"kind": "output", "name": "z", "passed": True, "detail": "", "comparison": None},
                       {"kind": "output", "name": "y", "passed": False, "detail": "",
                        "comparison": _comparison("y")}], **extra}


def test_the_localization_is_rendered_with_its_schema():
    localization = {
        "first": {"node": "/layer.1/MatMul", "op_type": "MatMul", "output": "/layer.1/MatMul_output_0",
                  "reference_value": "/layer.1/MatMul_output_0", "candidate_value": "/layer.1/fused_qkv_output_0",
                  "weights": ["layer.1.q.weight", "layer.1.k.weight"], "rule": "attn-qkv",
                  "comparison": _comparison("/layer.1/MatMul_output_0", max_abs=0.125)},
        "compared": 37, "paired_by": {"name": 30, "plan": 7}, "segments": 3,
        "note": "paired 37 of 40 intermediates"}
    page_text = html_page(_report(localization=localization)).decode()
    page = Page(page_text)
    assert 'id="localization"' in page_text and 'data-node="&quot;/layer.1/MatMul&quot;"' in page_text
    for field in ("node", "op_type", "output", "reference_value", "candidate_value", "rule"):
        assert page.fields[field] == [(localization["first"][field], localization["first"][field])]
    assert page.fields["weights"] == [(localization["first"]["weights"], "layer.1.q.weight, layer.1.k.weight")]
    # the localization's 37 intermediates, then the 6 elements of the first node's comparison
    assert page.fields["compared"] == [(37, "37"), (6, "6")] and page.fields["segments"] == [(3, "3")]
    assert page.fields["paired_by"] == [({"name": 30, "plan": 7}, "name 30, plan 7")]
    assert page.fields["max_abs"] == [(0.125, "0.125")]  # the first node's statistics
    assert "paired 37 of 40 intermediates" in page_text
    nothing = html_page(_report(localization={"first": None, "compared": 40, "paired_by": {"name": 40, "plan": 0},
                                              "segments": 1, "note": ""})).decode()
    assert "no intermediate tensor differs beyond tolerance" in nothing
    for missing in (_report(), _report(localization=None)):  # no key, or null: verify did not localize
        assert 'id="localization"' not in html_page(missing).decode()


def test_names_from_the_inputs_are_escaped_and_nonfinite_counts_shown():
    nonfinite = {"reference": {"nan": 4, "+inf": 1, "-inf": 0}, "candidate": {"nan": 4, "+inf": 0, "-inf": 2}}
    hostile = '<script>alert("x")</script>\x1b[31m'
    doc = _report()
    doc["checks"][1] = {"kind": "output", "name": hostile, "passed": False, "detail": "compared <nothing>",
                        "comparison": _comparison(hostile, nonfinite=nonfinite, note="2 element(s) NaN")}
    text = html_page(doc).decode()
    page = Page(text)
    assert "script" not in page.tags and "\x1b" not in text
    assert page.checks[0]["name"] == hostile  # read back whole from data-name
    assert "&lt;script&gt;" in text and "compared &lt;nothing&gt;" in text
    cells = page.checks[0]["cells"]
    assert cells["nonfinite.reference.nan"] == (4, "4") and cells["nonfinite.candidate.-inf"] == (2, "2")
    assert cells["max_rel"] == (math.inf, "inf") and cells["min_rtol"] == (math.inf, "inf")


def test_the_header_shows_shared_initializers_inputs_and_the_optimizer():
    doc = _report(shared_initializers={"count": 3, "bytes": 2_500_000}, dims={"batch": 2},
                  inputs=[{"name": "ids", "dtype": "int64", "shape": [2, 8], "source": "random", "range": [0, 127],
                           "range_from": "Gather of 'embed.weight', 128 rows"}],
                  optimizer={"reference": "optimizer_state_dict", "candidate": None, "status": "dropped",
                             "state_tensors": 0, "parameters": 4, "groups": 1, "passed": True})
    text = html_page(doc).decode()
    page = Page(text)
    assert page.fields["shared_initializers"] == [({"count": 3, "bytes": 2_500_000},
                                                   "3 initializer(s), 2.5 MB loaded once for both sessions")]
    assert "[0, 127] (Gather of &#x27;embed.weight&#x27;, 128 rows)" in text and "<code>batch</code>=2" in text
    assert page.fields["status"] == [("dropped", "dropped")] and page.fields["candidate"][-1] == (None, "—")
    assert page.fields["parameters"] == [(4, "4")] and page.fields["passed"][-1] == (True, "yes")


def test_the_histogram_marks_atol_and_the_bins_past_it():
    page = html_page(_report()).decode()
    assert 'class="tol"' in page and "atol 1e-05" in page
    # the one bin with counts lies past atol: it alone is drawn as possibly failing
    assert page.count('class="bar over"') == 8 + 1  # the decades from 1e-5 to 1e3, and from 1e3 up
    assert page.count('class="bar"') == 1 + 7  # below 1e-12, and the decades from 1e-12 to 1e-5
    exact = html_page(_report(checks=[{"kind": "output", "name": "y", "passed": False, "detail": "",
                                       "comparison": _comparison("y", atol=0.0, histogram=None)}])).decode()
    assert "<svg" not in exact


def test_format_number_matches_the_json_values():
    assert [format_number(v) for v in (0, 7, 1e-05, 0.1234567, math.inf, None, True)] == \
        ["0", "7", "1e-05", "0.1235", "inf", "—", "yes"]
