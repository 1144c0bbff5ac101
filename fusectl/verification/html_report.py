"""verify's report as one self-contained HTML page (``--html FILE.html``).

The page is made from the JSON report (:meth:`~fusectl.verification.report.VerifyReport.to_json`),
never from the objects behind it, so that each number it shows is the JSON's own: formatted for
reading, and kept raw in a ``data-value`` attribute (its JSON text) that a test or a script reads
back. It holds the header (what was compared, where, how, on which inputs, the runs), the
localization when the report has one, and every check, the failing ones first, each with its
statistics and an inline SVG histogram of |a−b| by decade. It asks nothing of the network: its
CSS is inline, it has no script, no image file, no link.

Names read from the inputs are escaped (HTML, and control characters as in the text report).
"""

from __future__ import annotations

import html
import json
import math
from typing import Iterable

from ..errors import printable

__all__ = ["STATISTICS", "format_number", "html_page"]

# a comparison's fields the page shows, in its order, with their labels
STATISTICS = (
    ("max_abs", "max abs"), ("mean_abs", "mean abs"), ("p99_abs", "p99 abs"),
    ("max_rel", "max rel"), ("mean_rel", "mean rel"), ("p99_rel", "p99 rel"),
    ("atol", "atol"), ("rtol", "rtol"), ("min_atol", "min atol"), ("min_rtol", "min rtol"),
    ("mismatches", "mismatches"), ("compared", "compared"),
)

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 72em; padding: 1em 2em; color: #1d2329; }
h1 { font-size: 1.5em; margin: .2em 0; } h2 { font-size: 1.15em; margin: 1.4em 0 .4em; }
.verdict { padding: .6em 1em; border-radius: 6px; }
.verdict.fail { background: #fde8e8; border-left: 6px solid #c62828; }
.verdict.pass { background: #e6f4ea; border-left: 6px solid #2e7d32; }
table { border-collapse: collapse; margin: .3em 0; }
th, td { text-align: left; padding: .15em .7em .15em 0; vertical-align: top; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
.facts th { color: #5f6b76; font-weight: normal; } .facts td.n { text-align: left; }
.check { border: 1px solid #d5dbe0; border-radius: 6px; margin: .6em 0; padding: .4em 1em; }
.check.fail { border-left: 6px solid #c62828; } .check.pass { border-left: 6px solid #2e7d32; }
.check.compact { margin: .25em 0; padding: .1em 1em; } .check.compact h3 { font-weight: normal; }
.check h3 { font-size: 1em; margin: .2em 0; } .status { font-weight: bold; }
.detail { color: #3d4650; }
.fail .status { color: #c62828; } .pass .status { color: #2e7d32; }
.stats th { color: #5f6b76; font-weight: normal; padding-right: .4em; }
.note { color: #3d4650; margin: .2em 0; }
code, .name { font-family: ui-monospace, monospace; word-break: break-all; }
svg.histogram { display: block; margin: .4em 0; }
svg.histogram .bar { fill: #5b7fa6; } svg.histogram .bar.zero { fill: #2e7d32; }
svg.histogram .bar.over { fill: #d9822b; }
svg.histogram .tol { stroke: #c62828; stroke-dasharray: 3 2; }
svg.histogram text { font: 10px ui-monospace, monospace; fill: #5f6b76; }
"""


def format_number(value) -> str:
    """A number of the JSON report as the page shows it: integers whole, other numbers to four
    significant digits, infinity as ``inf`` (the raw value rides in ``data-value``).

    >>> format_number(12345), format_number(0.000123456), format_number(float("inf")), format_number(None)
    ('12345', '0.0001235', 'inf', '—')
    """
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


def html_page(report: dict) -> bytes:
    """The page for ``report``, a verify report's JSON object (``VerifyReport.to_json()``), as
    UTF-8 bytes.

    :param report: the JSON report: its ``checks``, header fields, and when present ``runs``,
        ``inputs``, ``dims``, ``shared_initializers``, ``optimizer`` and ``localization``.
    :returns: the page; every check is a ``<section class="check">`` in the order failing
        first (then the report's order), with ``data-name``, ``data-kind``, ``data-passed``
        and, per statistic, a cell with ``data-field`` and ``data-value``.

    >>> page = html_page({"mode": "model", "reference": "a.onnx", "candidate": "b.onnx", "passed": True,
    ...                   "checks": []}).decode()
    >>> page.startswith("<!DOCTYPE html>") and "http" not in page
    True
    """
    checks = list(report.get("checks") or [])
    ordered = sorted(range(len(checks)), key=lambda i: checks[i]["passed"])  # stable: failing first
    failed = sum(not c["passed"] for c in checks)
    verdict = "PASS" if report.get("passed") else "FAIL"
    title = f"fusectl verify: {verdict} — {report.get('reference')} → {report.get('candidate')}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_text(title)}</title><style>{_STYLE}</style></head><body>",
        f'<header class="verdict {verdict.lower()}" id="verdict" data-passed="{_raw(report.get("passed"))}">',
        f"<h1>{verdict}: {len(checks) - failed} passed, {failed} failed</h1>",
        f'<p><span class="name">{_text(report.get("reference"))}</span> → '
        f'<span class="name">{_text(report.get("candidate"))}</span></p></header>',
        _header(report),
        _inputs(report.get("inputs") or [], report.get("dims") or {}),
        _runs(report.get("runs")),
        _optimizer(report.get("optimizer")),
    ]
    if report.get("localization") is not None:  # null: verify did not localize
        parts.append(_localization(report["localization"]))
    parts.append(f"<h2>Checks: {failed} failed, {len(checks) - failed} passed (the failing first)</h2>")
    parts += [_check(checks[i], i) for i in ordered]
    parts.append("</body></html>\n")
    return "\n".join(part for part in parts if part).encode()


def _text(value) -> str:
    """A value read from the report (a name, a path, a note) as page text."""
    return html.escape(printable(str(value)))


def _raw(value) -> str:
    """A value as a ``data-value`` attribute: its JSON text (``Infinity`` for inf), escaped."""
    return html.escape(json.dumps(value), quote=True)


def _number(value, field: str = "") -> str:
    """A table cell that shows a number and keeps it raw."""
    named = f' data-field="{html.escape(field)}"' if field else ""
    return f'<td class="n"{named} data-value="{_raw(value)}">{format_number(value)}</td>'


def _rows(rows: Iterable[tuple[str, str]], css: str = "facts") -> str:
    """A two-column table of (label, cell html) rows."""
    body = "".join(f"<tr><th>{html.escape(label)}</th>{cell}</tr>" for label, cell in rows)
    return f'<table class="{css}">{body}</table>' if body else ""


def _cell(value, field: str = "") -> str:
    """A cell for a field of any kind (named ``field`` in ``data-field`` when given): numbers raw
    and formatted, names escaped, lists and objects written out."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _number(value, field)
    if isinstance(value, bool):
        text = format_number(value)
    elif isinstance(value, (list, tuple)):
        text = ", ".join(map(str, value))
    elif isinstance(value, dict):
        text = ", ".join(f"{k} {format_number(v) if isinstance(v, (int, float)) else v}" for k, v in value.items())
    else:
        text = "" if value is None else str(value)
    named = f' data-field="{html.escape(field)}"' if field else ""
    return f'<td{named} data-value="{_raw(value)}">{_text(text) if text else "—"}</td>'


def _header(report: dict) -> str:
    """What was compared, where and how."""
    fields = [("mode", "mode"), ("reference", "reference"), ("candidate", "candidate"), ("provider", "provider"),
              ("precision", "precision"), ("seed", "seed")]
    rows = [(label, _cell(report.get(key), key))
            for key, label in fields if key in report]
    shared = report.get("shared_initializers")
    if shared and shared.get("count"):
        rows.append(("shared initializers", f'<td data-field="shared_initializers" data-value="{_raw(shared)}">'
                                             f'{shared["count"]} initializer(s), {shared["bytes"] / 1e6:.1f} MB '
                                             "loaded once for both sessions</td>"))
    return _rows(rows)


def _inputs(inputs: list, dims: dict) -> str:
    """The inputs the models ran on, and the named dimensions they were made with."""
    if not inputs and not dims:
        return ""
    rows = "".join(
        f'<tr data-name="{_raw(i.get("name"))}"><td class="name">{_text(i.get("name"))}</td>'
        f'<td>{_text(i.get("dtype"))}{_text(i.get("shape"))}</td><td>{_text(i.get("source"))}</td>'
        + (f'<td>[{i["range"][0]}, {i["range"][1]}] ({_text(i.get("range_from"))})</td>' if "range" in i else "<td></td>")
        + "</tr>" for i in inputs)
    table = ("<table><tr><th>input</th><th>dtype, shape</th><th>source</th><th>random integers in</th></tr>"
             f"{rows}</table>") if inputs else ""
    named = ("<p>dims " + ", ".join(f"<code>{_text(k)}</code>={int(v)}" for k, v in dims.items()) + "</p>") if dims else ""
    return f'<h2>Inputs</h2><section id="inputs">{table}{named}</section>'


def _runs(runs: dict | None) -> str:
    """The seeded runs: pass rate, seeds, the worst run (whose checks follow), each output's worst
    (nothing for one run: its checks say it all, as in the text report)."""
    if not runs or runs["count"] < 2:
        return ""
    worst, first_failing = runs["worst"], runs.get("first_failing")
    rows = [("runs", _number(runs["count"], "count")), ("passed", _number(runs["passed"], "passed")),
            ("pass rate", f'<td class="n" data-field="pass_rate" data-value="{_raw(runs["pass_rate"])}">'
                          f'{runs["pass_rate"]:.0%}</td>'),
            ("seeds", f'<td data-field="seeds" data-value="{_raw(runs["seeds"])}">'
                      f'{runs["seeds"][0]}–{runs["seeds"][1]}</td>'),
            ("worst run (its checks below)", _number(worst["seed"], "worst_seed")),
            ("first failing run", _number(None if first_failing is None else first_failing["seed"],
                                          "first_failing_seed"))]
    outputs = "".join(
        f'<tr data-name="{_raw(name)}"><td class="name">{_text(name)}</td>'
        + _number(entry["failed_runs"], "failed_runs") + _number(entry["max_abs"], "max_abs")
        + _number(entry["min_atol"], "min_atol") + _number(entry["min_rtol"], "min_rtol") + "</tr>"
        for name, entry in runs.get("outputs", {}).items())
    table = ("<table><tr><th>output</th><th>failed runs</th><th>max abs</th><th>min atol</th><th>min rtol</th></tr>"
             f"{outputs}</table>") if outputs else ""
    return f'<h2>Runs</h2><section id="runs">{_rows(rows)}{table}</section>'


def _optimizer(optimizer: dict | None) -> str:
    """A training checkpoint's optimizer state as checked (checkpoint mode)."""
    if not optimizer:
        return ""
    rows = _rows((key, _cell(value, key)) for key, value in optimizer.items())
    return f'<h2>Optimizer</h2><section id="optimizer">{rows}</section>'


def _localization(localization: dict) -> str:
    """Where the candidate first diverges: the first node whose output differs, and how the
    intermediates were paired and compared."""
    parts = ['<h2>Where it diverges</h2><section id="localization">',
             _rows((label, _cell(localization[key], key))
                   for key, label in (("compared", "intermediates compared"), ("paired_by", "paired by"),
                                      ("segments", "segments")) if key in localization)]
    if localization.get("note"):
        parts.append(f'<p class="note">{_text(localization["note"])}</p>')
    first = localization.get("first")
    if first is None:
        parts.append('<p class="first none">no intermediate tensor differs beyond tolerance</p>')
    else:
        facts = [(label, _cell(first.get(key), key))
                 for key, label in (("node", "first node"), ("op_type", "op"), ("output", "output"),
                                    ("reference_value", "reference value"), ("candidate_value", "candidate value"),
                                    ("weights", "weights"), ("rule", "rule")) if key in first]
        parts.append(f'<div class="first" data-node="{_raw(first.get("node"))}">{_rows(facts)}')
        if first.get("comparison"):
            parts.append(_comparison(first["comparison"]))
        parts.append("</div>")
    parts.append("</section>")
    return "".join(parts)


def _check(check: dict, index: int) -> str:
    """One check: status, kind, name, detail, and its comparison's statistics and histogram."""
    status = "PASS" if check["passed"] else "FAIL"
    compact = not check.get("comparison")  # a line: status, kind, name and what was found
    detail = f'<span class="detail">{_text(check["detail"])}</span>' if check.get("detail") else ""
    parts = [f'<section class="check {status.lower()}{" compact" if compact else ""}" data-index="{index}" '
             f'data-kind="{_raw(check["kind"])}" data-name="{_raw(check["name"])}" '
             f'data-passed="{_raw(check["passed"])}">',
             f'<h3><span class="status">{status}</span> {_text(check["kind"])} '
             f'<span class="name">{_text(check["name"])}</span>{" — " + detail if compact and detail else ""}</h3>']
    if not compact:
        if detail:
            parts.append(f'<p>{detail}</p>')
        parts.append(_comparison(check["comparison"]))
    parts.append("</section>")
    return "".join(parts)


def _comparison(m: dict) -> str:
    """A comparison's statistics, NaN/Inf counts, first mismatch, note and histogram."""
    head = [("dtype, shape", f"<td>{_text(m['dtype'])}{_text(m['shape'])}</td>")]
    if m.get("first_mismatch") is not None:
        head.append(("first mismatch", f'<td data-field="first_mismatch" data-value="{_raw(m["first_mismatch"])}">'
                                       f'{_text(m["first_mismatch"])}</td>'))
    parts = [_rows(head, "stats"), _stats_table(m)]
    nonfinite = m.get("nonfinite") or {}
    if any(any(counts.values()) for counts in nonfinite.values()):
        rows = "".join(f'<tr data-side="{side}"><th>{side}</th>'
                       + "".join(_number(counts[k], f"nonfinite.{side}.{k}") for k in ("nan", "+inf", "-inf"))
                       + "</tr>" for side, counts in nonfinite.items())
        parts.append(f'<table class="nonfinite"><tr><th></th><th>NaN</th><th>+inf</th><th>-inf</th></tr>{rows}</table>')
    if m.get("note"):
        parts.append(f'<p class="note">{_text(m["note"])}</p>')
    if m.get("histogram"):
        parts.append(_histogram(m["histogram"], m.get("atol", 0.0)))
    return "".join(parts)


def _stats_table(m: dict) -> str:
    """The statistics in two rows of six: absolute and relative errors, then tolerances and counts."""
    shown = [(key, label) for key, label in STATISTICS if key in m]
    rows = [shown[i:i + 6] for i in range(0, len(shown), 6)]
    body = "".join("<tr>" + "".join(f"<th>{label}</th>{_number(m[key], key)}" for key, label in row) + "</tr>"
                   for row in rows)
    return f'<table class="stats">{body}</table>'


def _histogram(histogram: dict, atol: float) -> str:
    """|a−b| by decade as an inline SVG bar chart: one bar for the equal elements, one per bin,
    heights on a log scale (one wrong element among millions still shows), atol marked."""
    edges, counts, zero = histogram["edges_log10"], histogram["counts"], histogram["zero"]
    bars = [("zero", "0", zero, "equal")]
    for i, count in enumerate(counts):
        if i == 0:
            label, what = f"<1e{edges[0]}", f"below 1e{edges[0]}"
        elif i == len(edges):
            label, what = f"≥1e{edges[-1]}", f"from 1e{edges[-1]} up"
        else:
            label, what = f"1e{edges[i - 1]}", f"from 1e{edges[i - 1]} to 1e{edges[i]}"
        bars.append((str(i), label, count, what))
    width, height, bottom, bar = 620, 150, 118, 30
    top = max(count for *_, count, _ in bars) or 1
    shapes = []
    for n, (key, label, count, what) in enumerate(bars):
        x = 8 + n * (bar + 4)
        h = 0.0 if not count else max(2.0, 100 * math.log10(1 + count) / math.log10(1 + top))
        # a bin whose every element is past atol shows in another colour (it may hold the mismatches)
        css = "bar zero" if key == "zero" else "bar over" if n > 1 and 10.0 ** edges[n - 2] >= atol else "bar"
        shapes.append(f'<rect class="{css}" data-bin="{key}" data-count="{int(count)}" x="{x}" y="{bottom - h:.1f}" '
                      f'width="{bar}" height="{h:.1f}"><title>{count} element(s) with |a−b| {what}</title></rect>')
        if count:
            shapes.append(f'<text x="{x + bar / 2}" y="{bottom - h - 3:.1f}" text-anchor="middle">{count}</text>')
        if n % 2 == 0 or n == len(bars) - 1:
            shapes.append(f'<text x="{x + bar / 2}" y="{bottom + 13}" text-anchor="middle">{html.escape(label)}</text>')
    if atol > 0:  # the line between the bins below and from atol's decade
        position = min(max(math.log10(atol), edges[0]), edges[-1])
        x = 8 + (1 + (position - edges[0]) + 1) * (bar + 4) - 2
        shapes.append(f'<line class="tol" x1="{x:.1f}" y1="8" x2="{x:.1f}" y2="{bottom}"></line>'
                      f'<text x="{x + 3:.1f}" y="16">atol {format_number(atol)}</text>')
    total = zero + sum(counts)
    return (f'<svg class="histogram" role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
            f'data-total="{total}" aria-label="|a−b| of {total} element(s) by decade">'
            f'<text x="8" y="{height - 4}">|a−b| by decade ({total} element(s) finite on both sides; '
            f'heights on a log scale)</text>{"".join(shapes)}</svg>')
