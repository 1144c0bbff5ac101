#!/usr/bin/env python3
"""Benchmark: ``fusectl verify`` against reading both checkpoints, and a split+transpose fuse's memory.

What it measures
    On the synthetic sharded bf16 Llama-style checkpoints of ``fuse_bench.py`` (about 1 GB and
    about 2.4 GB; same generator, same cache), the wall time and the peak resident memory (RSS) of:

      read    ``sh -c 'cat "$@" > /dev/null' sh FILES...`` over every .safetensors file of the
              input checkpoint and of its fused output: reading both checkpoints once, the
              least any tensor-by-tensor comparison of the two has to do;
      verify  ``fusectl verify INPUT FUSED`` (its report on stdout goes to a log file), where
              FUSED is INPUT fused with ``-r llama-qkv -r llama-gate-up``, made once per size,
              untimed, and kept under WORKDIR/out/verify-FUSED-<size>. verify must pass (exit 0);
              anything else stops the benchmark with the log's tail;
      fuse-split-transpose
              ``fusectl fuse INPUT -r RULES -o OUT --quiet --force`` with a rules file (written to
              WORKDIR/split-transpose.toml) that splits every layer's ``mlp.gate_proj.weight`` in
              two halves along axis 0 (``gate_a``, ``gate_b``) and transposes ``gate_a``
              (``gate_a_t``). ``gate_b`` and every other tensor are copied as byte ranges while
              ``gate_a_t`` is computed: were anything of the split kept until the end of the
              write, the peak RSS would grow with the number of layers (8 vs 24).

    The summary prints the goals (issue 22): verify/read median time <= 1.5x and verify peak RSS
    <= 200 MB per size; fuse-split-transpose peak RSS flat from the 1 GB to the 2.4 GB checkpoint
    (SPEC section 5: peak memory does not grow with the checkpoint's size), i.e. within a few MB.

    The fixed cost of a tiny verify: ``fusectl verify fixtures/tiny-llama-gqa FUSED`` (FUSED: the
    fixture fused with the same rules, made once under WORKDIR/out) against ``fusectl --version``,
    alternating, 5 runs each, printed under the table as a ratio.

How it measures
    With ``fuse_bench.py``'s machinery, imported, not copied: every run is a fresh process under
    its fork/exec/wait4 wrapper (wall time around fork..wait4, peak RSS the child's ``ru_maxrss``;
    the wrapper's floor, measured on ``true``, is printed); repetitions alternate the order of
    the methods (rotated by the repetition number) after one untimed warm-up round
    (``--warmup``); both checkpoints are read once before measuring, so the page cache is warm;
    before each run the previous split+transpose output is deleted and ``sync`` is called.
    fusectl's start-up alone (``fusectl --version``) is measured and printed under the table,
    beside the tiny verify. With PYTHONDONTWRITEBYTECODE set, Python compiles fusectl's modules
    on every run (no .pyc is kept; an installed package has them): the benchmark says so.
    After the first split+transpose run of each size, one layer's output is checked against the
    input from the safetensors headers: ``gate_b`` must be the second half of ``gate_proj``'s
    bytes and ``gate_a_t`` the transpose of its first half. The cached fused output is checked
    with ``fuse_bench.check_fused`` when it is made.

How to run
    /work/main/.venv/bin/python benchmarks/verify_bench.py                  # 1GB and 2.4GB, 3 reps
    /work/main/.venv/bin/python benchmarks/verify_bench.py --json verify.json
    /work/main/.venv/bin/python benchmarks/verify_bench.py --sizes tiny --repeat 1   # smoke test
    /work/main/.venv/bin/python benchmarks/verify_bench.py --refresh        # re-make FUSED outputs
    /work/main/.venv/bin/python benchmarks/verify_bench.py --sizes 2.4GB --methods read,verify --repeat 7

What it needs
    What ``fuse_bench.py`` needs (Linux, a venv with fusectl, numpy and ml_dtypes; fusectl is
    looked up beside ``sys.executable``, else on PATH; ``--fusectl`` overrides), plus ``sh`` and
    ``cat`` on PATH and onnxruntime (verify runs each step kind on it). Disk under ``--workdir``
    (default /work/bench-data, never committed): the checkpoints (~3.4 GB, shared with
    fuse_bench.py), the fused outputs (~3.4 GB, kept) and one split+transpose output at a time
    (<= 2.4 GB). The default run takes a few minutes on a 2-core VM, most of it in verify.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fuse_bench  # noqa: E402  (the benchmarks folder is not a package)
from verify_models_bench import measure_verify  # noqa: E402
from fuse_bench import MB, SIZES, BenchError  # noqa: E402

METHODS = ["read", "verify", "fuse-split-transpose"]
DEFAULT_SIZES = ["1GB", "2.4GB"]
VERIFY_RATIO_GOAL = 1.5     # verify / read, median wall time (issue 22)
VERIFY_RSS_GOAL_MB = 200
FLAT_RSS_MB = 5             # "a few MB": split+transpose peak RSS growth still called flat

SPLIT_TRANSPOSE_RULES = """\
version = 1
description = "verify_bench: split each gate_proj in two halves, transpose the first"

[[rule]]
name    = "gate-split"
op      = "split"
input   = "model.layers.{i:int}.mlp.gate_proj.weight"
outputs = ["model.layers.{i:int}.mlp.gate_a.weight",
           "model.layers.{i:int}.mlp.gate_b.weight"]
axis    = 0

[[rule]]
name   = "gate-a-transpose"
op     = "transpose"
input  = "model.layers.{i:int}.mlp.gate_a.weight"
output = "model.layers.{i:int}.mlp.gate_a_t.weight"
perm   = [1, 0]
"""


# --------------------------------------------------------------------------------------------
# inputs: the fused checkpoint verify compares against, the split+transpose rules
# --------------------------------------------------------------------------------------------

def ensure_fused(src, fused, label, fusectl, version, refresh, log, check=True):
    """``src`` fused with fuse_bench.RULES at ``fused``, made (untimed) unless already there."""
    marker = fused + ".complete.json"  # beside, not inside, as for the checkpoints
    params = {"source": src, "rules": fuse_bench.RULES, "fusectl_version": version}
    if not refresh and os.path.isdir(fused) and os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == params:
                log(f"[{label}] reusing {fused}")
                return fused
    fuse_bench.remove(marker)
    t0 = time.perf_counter()
    subprocess.run(fuse_bench.command("fuse", src, fused, fusectl), check=True, stdout=subprocess.DEVNULL)
    if check:
        log("  " + fuse_bench.check_fused(src, fused, SIZES[label], f"{label} verify-FUSED"))
    with open(marker, "w") as f:
        json.dump(params, f, indent=2)
    log(f"[{label}] fused {src} -> {fused} in {time.perf_counter() - t0:.1f} s (untimed)")
    return fused


def check_split_transpose(src, dst, cfg, what):
    """One middle layer: gate_b == second half of gate_proj, gate_a_t == first half transposed."""
    a, b = fuse_bench.folder_headers(src), fuse_bench.folder_headers(dst)
    p = f"model.layers.{cfg['num_hidden_layers'] // 2}.mlp."
    gate = a[p + "gate_proj.weight"]
    rows, cols = gate[2]
    expected = {p + "gate_a_t.weight": (cols, rows // 2), p + "gate_b.weight": (rows // 2, cols)}
    for name, shape in expected.items():
        if name not in b or b[name][2] != shape:
            found = b[name][2] if name in b else "missing"
            raise BenchError(f"{what}: {dst}: {name} should have shape {shape}, found {found}")
    if p + "gate_proj.weight" in b or p + "gate_a.weight" in b:
        raise BenchError(f"{what}: {dst}: gate_proj or gate_a of layer {p} is still in the output")
    whole = np.frombuffer(fuse_bench.tensor_bytes(gate), np.uint16).reshape(rows, cols)  # bf16 bits
    half_a = np.frombuffer(fuse_bench.tensor_bytes(b[p + "gate_a_t.weight"]), np.uint16).reshape(cols, rows // 2)
    half_b = np.frombuffer(fuse_bench.tensor_bytes(b[p + "gate_b.weight"]), np.uint16).reshape(rows // 2, cols)
    if not np.array_equal(half_b, whole[rows // 2:]):
        raise BenchError(f"{what}: {dst}: {p}gate_b.weight is not the second half of gate_proj.weight")
    if not np.array_equal(half_a, whole[:rows // 2].T):
        raise BenchError(f"{what}: {dst}: {p}gate_a_t.weight is not the first half of gate_proj.weight, "
                         "transposed")
    if fuse_bench.tensor_bytes(a[p + "up_proj.weight"]) != fuse_bench.tensor_bytes(b[p + "up_proj.weight"]):
        raise BenchError(f"{what}: {dst}: {p}up_proj.weight differs from the input")
    return f"{what}: {p}gate_b == gate_proj[{rows // 2}:], gate_a_t == gate_proj[:{rows // 2}].T: OK"


# --------------------------------------------------------------------------------------------
# running one method
# --------------------------------------------------------------------------------------------

def run_method(method, label, paths, fusectl, timeout):
    """Measure one run of ``method`` on size ``label``: (wall s, peak RSS KiB, user s, sys s)."""
    src, fused, out, rules, log_file = (paths[label][k] for k in ("src", "fused", "out", "rules", "log"))
    if method == "read":
        files = fuse_bench.checkpoint_files(src) + fuse_bench.checkpoint_files(fused)
        return fuse_bench.measure(["sh", "-c", 'cat "$@" > /dev/null', "sh", *files], timeout)
    if method == "verify":
        # verify has no --quiet: its report goes to a file, shown if it fails
        return measure_verify(fusectl, [src, fused], log_file, timeout)
    if method == "fuse-split-transpose":
        fuse_bench.remove(out)
        os.sync()
        try:
            return fuse_bench.measure([fusectl, "fuse", src, "-r", rules, "-o", out, "--quiet", "--force"],
                                      timeout)
        finally:
            os.sync()
    raise ValueError(method)


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------

def medians(runs):
    """{(size, method): (median wall s, median peak RSS MB)} over the measured runs."""
    grouped = {}
    for r in runs:
        grouped.setdefault((r["size"], r["method"]), []).append(r)
    return {key: (statistics.median(r["wall_s"] for r in rs),
                  statistics.median(r["peak_rss_kb"] for r in rs) * 1024 / MB)
            for key, rs in grouped.items()}


def report(runs, labels, sizes_bytes, floor_kb):
    """The table and the summary lines against the goals."""
    med = medians(runs)
    columns = f"{'size':<7} {'method':<21} {'median s':>9} {'min s':>7} {'max s':>7} {'peak RSS MB':>12}"
    out = [columns, "-" * len(columns)]
    for label in labels:
        for method in METHODS:
            walls = [r["wall_s"] for r in runs if (r["size"], r["method"]) == (label, method)]
            if not walls:
                continue
            lowest_kb = min(r["peak_rss_kb"] for r in runs if (r["size"], r["method"]) == (label, method))
            floor_mark = "*" if lowest_kb <= floor_kb * 1.05 else " "
            out.append(f"{label:<7} {method:<21} {med[label, method][0]:>9.2f} {min(walls):>7.2f} "
                       f"{max(walls):>7.2f} {med[label, method][1]:>11.0f}{floor_mark}")
        out.append("")
    out.append(f"* = at the measuring wrapper's floor ({floor_kb * 1024 / MB:.1f} MB): at most this")
    for label in labels:
        if (label, "verify") not in med or (label, "read") not in med:
            continue
        ratio = med[label, "verify"][0] / med[label, "read"][0]
        verdict = "within" if ratio <= VERIFY_RATIO_GOAL else "OVER"
        out.append(f"{label}: verify / read (median wall) = {ratio:.2f}x "
                   f"({verdict} the {VERIFY_RATIO_GOAL:g}x goal)")
    for label in labels:
        if (label, "verify") not in med:
            continue
        rss = med[label, "verify"][1]
        verdict = "within" if rss <= VERIFY_RSS_GOAL_MB else "OVER"
        out.append(f"{label}: verify peak RSS (median) = {rss:.0f} MB ({verdict} the {VERIFY_RSS_GOAL_MB} MB goal)")
    if len(labels) >= 2:
        lo, hi = min(labels, key=sizes_bytes.get), max(labels, key=sizes_bytes.get)
        extra_gb = (sizes_bytes[hi] - sizes_bytes[lo]) / 1e9
        for method in ("fuse-split-transpose", "verify"):
            if (lo, method) not in med or (hi, method) not in med:
                continue
            r_lo, r_hi = med[lo, method][1], med[hi, method][1]
            flat = "flat" if abs(r_hi - r_lo) <= FLAT_RSS_MB else "GROWS"
            goal = f" ({flat}: goal within {FLAT_RSS_MB} MB)" if method == "fuse-split-transpose" else ""
            out.append(f"{method} peak RSS {lo} -> {hi}: {r_lo:.0f} MB -> {r_hi:.0f} MB "
                       f"({r_hi - r_lo:+.1f} MB, {(r_hi - r_lo) / extra_gb:+.1f} MB per extra GB){goal}")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     epilog="See the top of this file for what is measured and how.")
    fuse_bench.add_common_arguments(parser, repeat=3)
    parser.add_argument("--refresh", action="store_true", help="re-make the cached fused outputs")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated, from {', '.join(METHODS)} (default: all)")
    args = parser.parse_args(argv)

    started = time.perf_counter()

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    labels = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = ", ".join(repr(label) for label in labels if label not in SIZES)
    if unknown or not labels:
        parser.error(f"--sizes: unknown or no size {unknown}; choose from {', '.join(SIZES)}")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or any(m not in METHODS for m in methods):
        parser.error(f"--methods: choose from {', '.join(METHODS)}")
    fusectl = args.fusectl or fuse_bench.find_fusectl()
    workdir = os.path.abspath(args.workdir)
    out_dir = os.path.join(workdir, "out")
    os.makedirs(out_dir, exist_ok=True)
    shard_bytes = int(args.shard_size * MB)
    sizes_bytes = {label: fuse_bench.checkpoint_bytes(SIZES[label]) for label in labels}

    # checkpoints may be generated, fused outputs may be made, one split output at a time
    need = 1.1 * (max(sizes_bytes.values()) + 2 * sum(sizes_bytes.values()))
    free = shutil.disk_usage(workdir).free
    if free < need:
        raise BenchError(f"{workdir}: {free / 1e9:.1f} GB free, need up to {need / 1e9:.1f} GB")

    version = subprocess.run([fusectl, "--version"], capture_output=True, text=True).stdout.strip()
    rules = os.path.join(workdir, "split-transpose.toml")
    with open(rules, "w") as f:
        f.write(SPLIT_TRANSPOSE_RULES)
    paths = {}
    for label in labels:
        src = fuse_bench.ensure_checkpoint(workdir, label, SIZES[label], shard_bytes, args.seed, log)
        fused = ensure_fused(src, os.path.join(out_dir, f"verify-FUSED-{label}"), label, fusectl,
                             version, args.refresh, log)
        paths[label] = dict(src=src, fused=fused, rules=rules,
                            out=os.path.join(out_dir, f"{label}-split-transpose"),
                            log=os.path.join(out_dir, f"verify-{label}.log"))
        fuse_bench.warm(fuse_bench.checkpoint_files(src) + fuse_bench.checkpoint_files(fused))
    floor_kb = min(fuse_bench.measure(["true"], 60)[1] for _ in range(3))
    log(f"fusectl: {fusectl} ({version}); wrapper RSS floor {floor_kb} KiB")

    runs, checked = [], set()
    for rep in range(-args.warmup, args.repeat):
        order = methods[rep % len(methods):] + methods[:rep % len(methods)]
        name = f"rep {rep + 1}/{args.repeat}" if rep >= 0 else "warm-up"
        for label in labels:
            for method in order:
                wall, rss, utime, stime = run_method(method, label, paths, fusectl, args.timeout)
                log(f"{name:<9} {label:<6} {method:<21} {wall:7.2f} s  {rss * 1024 / MB:7.0f} MB")
                if rep >= 0:
                    runs.append(dict(size=label, method=method, rep=rep, order=order.index(method),
                                     wall_s=wall, peak_rss_kb=rss, user_s=utime, sys_s=stime))
                if method == "fuse-split-transpose" and label not in checked:
                    log("  " + check_split_transpose(paths[label]["src"], paths[label]["out"], SIZES[label],
                                                     f"{label} {method}"))
                    checked.add(label)
    for label in labels:
        fuse_bench.remove(paths[label]["out"])
    os.sync()
    tiny_src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "tiny-llama-gqa")
    tiny = ensure_fused(tiny_src, os.path.join(out_dir, "verify-FUSED-tiny-fixture"), "tiny-fixture", fusectl,
                        version, args.refresh, log, check=False)
    startup, tiny_runs = [], []
    for _ in range(5):
        startup.append(fuse_bench.measure([fusectl, "--version"], 60))
        tiny_runs.append(fuse_bench.measure(["sh", "-c", 'exec "$@" > /dev/null', "sh", fusectl, "verify",
                                             tiny_src, tiny], 120))

    print()
    print(f"fusectl verify vs reading both checkpoints, and fuse split+transpose; bf16 Llama-style, "
          f"shards <= {args.shard_size:.0f} MB; {args.repeat} runs each, alternating order, warm page cache")
    for label in labels:
        read_gb = sum(os.path.getsize(p) for p in fuse_bench.checkpoint_files(paths[label]["src"])
                      + fuse_bench.checkpoint_files(paths[label]["fused"])) / 1e9
        print(f"  {label}: {sizes_bytes[label] / 1e9:.2f} GB, {SIZES[label]['num_hidden_layers']} layers, "
              f"{len(fuse_bench.checkpoint_files(paths[label]['src']))} shards; read = {read_gb:.2f} GB")
    print()
    print(report(runs, labels, sizes_bytes, floor_kb))
    print(f"fusectl start-up alone (`fusectl --version`, 5 runs): median "
          f"{statistics.median(w for w, *_ in startup):.2f} s, "
          f"{statistics.median(r for _, r, *_ in startup) * 1024 / MB:.0f} MB")
    tiny_s, start_s = statistics.median(w for w, *_ in tiny_runs), statistics.median(w for w, *_ in startup)
    print(f"tiny verify (`fusectl verify fixtures/tiny-llama-gqa FUSED`, 5 runs alternating with --version): "
          f"median {tiny_s:.2f} s = {tiny_s / start_s:.1f}x start-up, "
          f"{statistics.median(r for _, r, *_ in tiny_runs) * 1024 / MB:.0f} MB")
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        print("note: PYTHONDONTWRITEBYTECODE is set: fusectl's modules were compiled on every run (no .pyc)")
    total = time.perf_counter() - started
    print(f"\ntotal benchmark time: {total:.0f} s")
    if args.json:
        fuse_bench.write_json(args.json, {
            "fusectl": fusectl, "fusectl_version": version, "python": sys.version,
            "machine": platform.platform(), "cpus": os.cpu_count(), "repeat": args.repeat,
            "warmup_rounds": args.warmup, "shard_bytes": shard_bytes, "wrapper_rss_floor_kb": floor_kb,
            "split_transpose_rules": SPLIT_TRANSPOSE_RULES,
            "fusectl_startup": [dict(wall_s=w, peak_rss_kb=r, user_s=u, sys_s=s) for w, r, u, s in startup],
            "tiny_verify": [dict(wall_s=w, peak_rss_kb=r, user_s=u, sys_s=s) for w, r, u, s in tiny_runs],
            "sizes": {label: {"config": SIZES[label], "bytes": sizes_bytes[label],
                              "source": paths[label]["src"], "fused": paths[label]["fused"]}
                      for label in labels},
            "runs": runs, "total_s": total,
        })
    return 0


if __name__ == "__main__":
    sys.exit(fuse_bench.exit_status(main, "verify_bench"))
