"""Fail CI when coverage falls under the bar: in all, and for each module of fusectl/.

    python .ci/coverage_gate.py coverage.json --total 97 --module 93

reads the JSON report of coverage.py (``--cov-report=json:FILE``), prints every module under the
per-module bar with its percentage, and exits 1 when the total or any module is under its bar.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="coverage.py's JSON report")
    parser.add_argument("--total", type=float, required=True, help="the least percentage in all")
    parser.add_argument("--module", type=float, required=True, help="the least percentage for each module")
    args = parser.parse_args(argv)
    with open(args.report) as f:
        report = json.load(f)
    total = report["totals"]["percent_covered"]
    modules = {path: entry["summary"]["percent_covered"] for path, entry in report["files"].items()}
    under = sorted((percent, path) for path, percent in modules.items() if percent < args.module)
    lowest = min(modules.values(), default=100.0)
    print(f"coverage: {total:.1f} % in all (bar {args.total:g} %), lowest module {lowest:.1f} % "
          f"(bar {args.module:g} %), {len(modules)} modules")
    for percent, path in under:
        print(f"  under the bar: {path} {percent:.1f} %")
    if total < args.total or under:
        print("coverage: FAILED", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
