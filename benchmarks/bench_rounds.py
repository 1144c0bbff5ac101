"""What the benchmarks that time a fusectl command against ``cp -r && sync`` of its own output
share (distributed_bench, megatron_bench): the timed rounds, the table and its summary lines,
their options.

A *job* is one input and one fusectl command; each of its *methods* (``convert`` or ``fusectl``,
``cp+sync``, a framework's tool) writes one output, timed as a fresh process around fork..wait4
with its peak RSS (``fuse_bench.measure``). Every round runs every method once, in an order that
rotates from round to round, each after ``sync`` and ``--settle`` seconds of quiet so that no run
rides on or pays for the disk's flush of the one before. The summary judges the fusectl method by
the ratio of each round's two runs (the same load on a shared disk moves both) beside the ratio
of the medians, and its peak RSS minus the largest tensor (the bar: under 100 MB).
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time

import fuse_bench
from convert_bench import log
from fuse_bench import MB, BenchError

RSS_BAR_MB = 100      # the fusectl method's peak RSS minus the largest tensor


def folder_bytes(folder) -> int:
    """Bytes of every file under ``folder`` (or of the file ``folder``)."""
    if os.path.isfile(folder):
        return os.path.getsize(folder)
    return sum(os.path.getsize(os.path.join(d, name)) for d, _, names in os.walk(folder) for name in names)


def same_tensors(folder, reference) -> str:
    """Every tensor of the safetensors folder ``folder`` has the name, dtype, shape and bytes of
    ``reference``'s, read from the headers with no fusectl code.

    :raises BenchError: a name missing on either side, or a tensor that differs (the first one).
    """
    got, ref = fuse_bench.folder_headers(folder), fuse_bench.folder_headers(reference)
    if ref.keys() != got.keys():
        raise BenchError(f"{folder}: names differ from {reference}: {sorted(ref.keys() ^ got.keys())[:5]}")
    for name in sorted(got):
        if got[name][1:3] != ref[name][1:3] or fuse_bench.tensor_bytes(got[name]) != fuse_bench.tensor_bytes(ref[name]):
            raise BenchError(f"{folder}: {name} differs from {reference}")
    return f"{len(got)} tensors, names, dtypes, shapes and bytes equal to {reference}'s"


def timed_rounds(name, methods, args, command, output, after_first=None) -> list[dict]:
    """Every round of every method of one job: one record per run.

    :param name: the job, as the records and the log name it.
    :param methods: the methods, in the first round's order (rotated by one each round).
    :param args: the parsed options (``repeat``, ``settle``, ``timeout``).
    :param command: ``command(method, dst)``: the command line of a method writing ``dst``.
    :param output: ``output(method)``: where a method writes (removed before and after each round).
    :param after_first: called once after the first round, before its outputs are removed (a check).
    :raises BenchError: a run failed or timed out.
    """
    runs = []
    for rep in range(args.repeat):
        order = methods[rep % len(methods):] + methods[:rep % len(methods)]
        for method in order:
            dst = output(method)
            fuse_bench.remove(dst)
            os.sync()
            time.sleep(args.settle)
            wall, rss, utime, stime = fuse_bench.measure(command(method, dst), args.timeout)
            log(f"rep {rep + 1}/{args.repeat} {name:<12} {method:<8} {wall:7.2f} s {rss * 1024 / MB:7.0f} MB")
            runs.append(dict(checkpoint=name, method=method, rep=rep, wall_s=wall, peak_rss_kb=rss,
                             user_s=utime, sys_s=stime, output_bytes=folder_bytes(dst)))
        if rep == 0 and after_first is not None:
            after_first()
        for method in methods:
            fuse_bench.remove(output(method))
    return runs


def report(runs, facts, floor_kb, methods, main) -> tuple[str, dict]:
    """The table and the summary lines; the medians by (job, method).

    :param runs: the records of ``timed_rounds``.
    :param facts: job → ``input_bytes`` and ``largest_tensor_bytes``.
    :param floor_kb: the measuring wrapper's own peak RSS (a run at it is marked ``*``).
    :param methods: the methods, in the table's order.
    :param main: the fusectl method the summary judges (against ``cp+sync``, and a ``torch`` tool).
    """
    width = max([13, *map(len, facts)])
    row = "{0:<%d} {1:<8} {2:>9} {3:>13} {4:>9} {5:>12} {6:>14} {7:>10}" % width
    header = row.format("checkpoint", "method", "median s", "(min..max)", "out MB", "peak RSS MB",
                        "RSS-largest MB", "/ cp+sync")
    out, med = [header, "-" * len(header)], {}
    for name, fact in facts.items():
        largest = fact["largest_tensor_bytes"] / MB
        cp = [r["wall_s"] for r in runs if (r["checkpoint"], r["method"]) == (name, "cp+sync")]
        for method in methods:
            rs = [r for r in runs if (r["checkpoint"], r["method"]) == (name, method)]
            if not rs:
                continue
            walls = [r["wall_s"] for r in rs]
            wall = statistics.median(walls)
            rss = statistics.median(r["peak_rss_kb"] for r in rs) * 1024 / MB
            med[name, method] = (wall, rss)
            at_floor = "*" if min(r["peak_rss_kb"] for r in rs) <= floor_kb * 1.05 else " "
            ratio = f"{wall / statistics.median(cp):.2f}x" if cp else "-"
            out.append(row.format(name, method, f"{wall:.2f}", f"({min(walls):.2f}..{max(walls):.2f})",
                                  f"{rs[0]['output_bytes'] / MB:.0f}", f"{rss:.0f}{at_floor}",
                                  f"{rss - largest:.0f}", ratio))
        out.append(f"{'':<{width}} input {fact['input_bytes'] / MB:.0f} MB, largest tensor {largest:.0f} MB")
        out.append("")
    out.append(f"* = at the measuring wrapper's floor ({floor_kb * 1024 / MB:.1f} MB)")
    for name, fact in facts.items():
        largest = fact["largest_tensor_bytes"] / MB
        if (name, main) in med and (name, "cp+sync") in med:
            # the ratio of each round's two runs (close in time: a shared disk's load moves both)
            # beside the ratio of the medians; the bar is judged on the former
            labelled = [dict(r, size=r["checkpoint"]) for r in runs]
            out.append(f"{name}: {fuse_bench._round_ratios(labelled, name, main, 'cp+sync', med)}")
        if (name, main) in med:
            extra = med[name, main][1] - largest
            out.append(f"{name}: {main} peak RSS - largest tensor = {extra:.0f} MB "
                       f"({'within' if extra < RSS_BAR_MB else 'OVER'} the < {RSS_BAR_MB} MB bar)")
        if (name, main) in med and (name, "torch") in med:
            out.append(f"{name}: framework tool / {main}: {med[name, 'torch'][0] / med[name, main][0]:.2f}x "
                       f"the time, {med[name, 'torch'][1] / med[name, main][1]:.1f}x the peak RSS")
    return "\n".join(out), med


def add_round_arguments(parser, work: str) -> None:
    """The options of the timed rounds: --repeat, --settle, --work, --fusectl, --timeout, --json."""
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument("--settle", type=float, default=10.0,
                        help="seconds to wait after the sync before each timed run, so that no run "
                             "rides on or pays for the disk's flush of the one before (default 10)")
    parser.add_argument("--work", default=work, help=f"checkpoint cache and outputs (default {work})")
    parser.add_argument("--fusectl", help="fusectl executable (default: beside this Python, else PATH)")
    parser.add_argument("--timeout", type=float, default=1800, help="per-run limit in seconds (default 1800)")
    parser.add_argument("--json", metavar="FILE", help="write the raw numbers here")


def check_round_arguments(parser, args) -> None:
    """Refuse (exit 2) a --repeat under 1 or a negative --settle."""
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.settle < 0:
        parser.error("--settle must be 0 or more")


def measuring_setup(fusectl) -> tuple[str, int]:
    """Ready the environment for timed runs: (``fusectl --version``, the wrapper's RSS floor in KiB).

    The measured Pythons cache their compiled modules as an installed package does (where
    PYTHONDONTWRITEBYTECODE is set, every fusectl start compiled its ~50 modules again: ~0.1 s of
    each run here), so it is removed from this process's environment.
    """
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    version = subprocess.run([fusectl, "--version"], capture_output=True, text=True).stdout.strip()
    return version, min(fuse_bench.measure(["true"], 60)[1] for _ in range(3))


def finish(what, table, args, started, setup, record) -> None:
    """Print the run's title line, ``table`` and the total time; write --json FILE.

    :param what: what was measured against what, the title's start.
    :param args: the parsed options (``repeat``, ``settle``, ``json``).
    :param started: ``time.perf_counter()`` when the benchmark began.
    :param setup: (fusectl executable, its version, the wrapper's RSS floor in KiB).
    :param record: the benchmark's own entries of the JSON record (its facts and runs).
    """
    fusectl, version, floor_kb = setup
    print(f"\n{what}; {args.repeat} rounds, rotating order, sync and {args.settle:g} s before each run, "
          f"warm page cache; {os.cpu_count()} CPUs, {platform.platform()}; {version}\n")
    print(table)
    total = time.perf_counter() - started
    print(f"\ntotal benchmark time: {total:.0f} s")
    if args.json:
        fuse_bench.write_json(args.json, {
            "fusectl": fusectl, "fusectl_version": version, "machine": platform.platform(),
            "cpus": os.cpu_count(), "repeat": args.repeat, "settle_s": args.settle,
            "wrapper_rss_floor_kb": floor_kb, **record, "total_s": total})
