#!/usr/bin/env python3
"""Benchmark: what a light fusectl command costs at start-up, as a ratio to ``python -c "import numpy"``.

What it measures
    The wall time (and peak resident memory) of fresh processes, each divided by the median of
    the reference measured in the same run:

      numpy           ``python -c "import numpy"`` -- the reference: the interpreter and numpy,
                      which every command that reads a checkpoint needs;
      python          ``python -c pass``: the interpreter's own start, which ``--version``
                      should approach (issue 22);
      version         ``fusectl --version``;
      rules           ``fusectl rules list``;
      inspect         ``fusectl inspect fixtures/tiny-llama-gqa`` (float32, one file);
      plan            ``fusectl plan fixtures/tiny-llama-gqa -r llama-qkv``;
      inspect-SIZE    ``fusectl inspect`` of ``fuse_bench.py``'s synthetic sharded bf16 Llama-style
                      checkpoint (default the 2.4 GB one: 5 shards, 219 tensors; same generator,
                      same cache), headers only.

    Issue 22's limit: inspect of the sharded folder within 2x ``import numpy``; the summary
    prints every ratio and that verdict. Beside each command, which of the heavy packages (numpy,
    ml_dtypes, onnx, onnx_ir, onnxruntime) one run of it under ``python -X importtime`` imported,
    and ml_dtypes' own import time there: the figures say what is paid, the list says why.

How it measures
    With ``fuse_bench.py``'s machinery, imported, not copied: every run is a fresh process under
    its fork/exec/wait4 wrapper (wall time around fork..wait4, peak RSS the child's
    ``ru_maxrss``); repetitions alternate the order of the commands (rotated by the repetition
    number) after one untimed warm-up round (``--warmup``); the checkpoint is read once before
    measuring, so the page cache is warm. Once, untimed, ``fusectl inspect --json`` of the
    sharded checkpoint must list exactly the tensors the generator wrote, with their dtype and
    shape; a mismatch stops the benchmark with exit status 1.

How to run
    /work/main/.venv/bin/python benchmarks/startup_bench.py                   # 2.4GB, 10 reps
    /work/main/.venv/bin/python benchmarks/startup_bench.py --json startup.json
    /work/main/.venv/bin/python benchmarks/startup_bench.py --size tiny --repeat 2   # smoke test

What it needs
    What ``fuse_bench.py`` needs (Linux, a venv with fusectl, numpy and ml_dtypes; fusectl is
    looked up beside ``sys.executable``, else on PATH; ``--fusectl`` overrides); the reference
    and the import lists use ``sys.executable``, which should be the Python fusectl runs on.
    Disk under ``--workdir`` (default /work/bench-data, never committed): the checkpoint
    (2.4 GB, shared with fuse_bench.py and verify_bench.py). About half a minute on a 2-core VM
    once the checkpoint exists.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fuse_bench  # noqa: E402  (the benchmarks folder is not a package)
from fuse_bench import MB, SIZES, BenchError  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = os.path.join(ROOT, "fixtures", "tiny-llama-gqa")
REFERENCE = "numpy"
INSPECT_RATIO_LIMIT = 2.0  # inspect of the sharded folder / import numpy (issue 22)
HEAVY = ["numpy", "ml_dtypes", "onnx", "onnx_ir", "onnxruntime"]


def commands(fusectl, sharded, label):
    """{name: argv} of what is measured, the reference first."""
    return {
        REFERENCE: [sys.executable, "-c", "import numpy"],
        "python": [sys.executable, "-c", "pass"],
        "version": [fusectl, "--version"],
        "rules": [fusectl, "rules", "list"],
        "inspect": [fusectl, "inspect", SMALL],
        "plan": [fusectl, "plan", SMALL, "-r", "llama-qkv"],
        f"inspect-{label}": [fusectl, "inspect", sharded],
    }


def imports_of(argv):
    """{heavy package: cumulative import s} of one run of ``argv`` under ``python -X importtime``
    (fusectl's console script is a Python file: run by this Python, it imports what it imports alone)."""
    args = argv[1:] if argv[0] == sys.executable else argv
    done = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True,
                          timeout=120)
    if done.returncode != 0:
        raise BenchError(f"exit status {done.returncode}: python -X importtime {' '.join(args)}\n"
                         f"{done.stderr[-2000:]}")
    found = {}
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and (name := line.rsplit("|", 1)[1].strip()) in HEAVY:
            found[name] = int(line.split("|")[1]) / 1e6
    return found


def check_inspect(fusectl, sharded, cfg, what):
    """``fusectl inspect --json`` of the checkpoint lists the generator's tensors, dtypes and shapes."""
    done = subprocess.run([fusectl, "inspect", "--json", sharded], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise BenchError(f"{what}: fusectl inspect --json {sharded}: exit status {done.returncode}\n"
                         f"{done.stderr[-2000:]}")
    listed = {p["name"]: (p["dtype"], tuple(p["shape"])) for p in json.loads(done.stdout)["parameters"]}
    expected = {name: ("BF16", shape) for name, shape in fuse_bench.llama_tensors(cfg)}
    if listed != expected:
        wrong = sorted(set(listed.items()) ^ set(expected.items()))[:5]
        raise BenchError(f"{what}: inspect lists {len(listed)} tensors, the generator wrote {len(expected)}; "
                         f"first differences: {wrong}")
    return f"{what}: inspect --json lists the {len(expected)} tensors written, dtypes and shapes: OK"


def report(runs, names, imports):
    """The table (median, min, max, ratio to the reference, peak RSS, heavy imports) and the verdict."""
    walls = {n: [r["wall_s"] for r in runs if r["command"] == n] for n in names}
    med = {n: statistics.median(w) for n, w in walls.items()}
    columns = (f"{'command':<16} {'median s':>9} {'min s':>7} {'max s':>7} {'x numpy':>8} {'peak RSS MB':>12}"
               f"  imports (ml_dtypes' own import s)")
    out = [columns, "-" * len(columns)]
    for n in names:
        rss = statistics.median(r["peak_rss_kb"] for r in runs if r["command"] == n) * 1024 / MB
        heavy = ", ".join(imports[n]) or "-"
        if "ml_dtypes" in imports[n]:
            heavy += f" ({imports[n]['ml_dtypes']:.2f} s)"
        out.append(f"{n:<16} {med[n]:>9.3f} {min(walls[n]):>7.3f} {max(walls[n]):>7.3f} "
                   f"{med[n] / med[REFERENCE]:>7.2f}x {rss:>12.0f}  {heavy}")
    sharded = names[-1]
    ratio = med[sharded] / med[REFERENCE]
    verdict = "within" if ratio <= INSPECT_RATIO_LIMIT else "OVER"
    out.append("")
    out.append(f"version / python -c pass (median wall) = {med['version'] / med['python']:.2f}x "
               f"({med['version']:.3f} s / {med['python']:.3f} s: what --version adds to the interpreter's start)")
    out.append(f"{sharded} / import numpy (median wall) = {ratio:.2f}x "
               f"({med[sharded]:.3f} s / {med[REFERENCE]:.3f} s; {verdict} the {INSPECT_RATIO_LIMIT:g}x limit)")
    return "\n".join(out), ratio


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     epilog="See the top of this file for what is measured and how.")
    parser.add_argument("--repeat", type=int, default=10, help="runs per command (default 10)")
    parser.add_argument("--size", default="2.4GB", choices=sorted(SIZES),
                        help="the sharded checkpoint inspected (fuse_bench.py's sizes; default 2.4GB)")
    parser.add_argument("--workdir", default="/work/bench-data",
                        help="checkpoint cache (default /work/bench-data)")
    parser.add_argument("--shard-size", type=float, default=500, help="input shard cap in MB (default 500)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds before measuring (default 1)")
    parser.add_argument("--json", metavar="FILE", help="write the raw numbers here")
    parser.add_argument("--fusectl", help="fusectl executable (default: beside this Python, else PATH)")
    parser.add_argument("--timeout", type=float, default=120, help="per-run limit in seconds (default 120)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")

    started = time.perf_counter()

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    fusectl = args.fusectl or fuse_bench.find_fusectl()
    workdir = os.path.abspath(args.workdir)
    version = subprocess.run([fusectl, "--version"], capture_output=True, text=True).stdout.strip()
    cfg = SIZES[args.size]
    sharded = fuse_bench.ensure_checkpoint(workdir, args.size, cfg, int(args.shard_size * MB), args.seed, log)
    fuse_bench.warm(fuse_bench.checkpoint_files(sharded))
    log("  " + check_inspect(fusectl, sharded, cfg, args.size))
    measured = commands(fusectl, sharded, args.size)
    names = list(measured)
    imports = {n: imports_of(argv) for n, argv in measured.items()}
    log(f"fusectl: {fusectl} ({version}); reference: {sys.executable} -c 'import numpy'")

    runs = []
    for rep in range(-args.warmup, args.repeat):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            wall, rss, utime, stime = fuse_bench.measure(measured[name], args.timeout)
            if rep >= 0:
                runs.append(dict(command=name, rep=rep, order=order.index(name), wall_s=wall,
                                 peak_rss_kb=rss, user_s=utime, sys_s=stime))
        log(f"{f'rep {rep + 1}/{args.repeat}' if rep >= 0 else 'warm-up':<10} done")

    table, ratio = report(runs, names, imports)
    print()
    print(f"fusectl start-up against `python -c \"import numpy\"`; {args.repeat} runs each, alternating order, "
          f"warm page cache; {args.size}: {fuse_bench.checkpoint_bytes(cfg) / 1e9:.2f} GB bf16, "
          f"{len(fuse_bench.checkpoint_files(sharded))} shards")
    print()
    print(table)
    total = time.perf_counter() - started
    print(f"\ntotal benchmark time: {total:.0f} s")
    if args.json:
        fuse_bench.write_json(args.json, {
            "fusectl": fusectl, "fusectl_version": version, "python": sys.version,
            "machine": platform.platform(), "cpus": os.cpu_count(), "repeat": args.repeat,
            "warmup_rounds": args.warmup, "checkpoint": sharded, "size": args.size,
            "commands": {n: measured[n] for n in names}, "imports": imports,
            "inspect_ratio": ratio, "runs": runs, "total_s": total,
        })
    return 0


if __name__ == "__main__":
    sys.exit(fuse_bench.exit_status(main, "startup_bench"))
