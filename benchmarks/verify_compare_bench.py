#!/usr/bin/env python3
"""Benchmark: peak memory of ``fusectl verify A.onnx B.onnx`` comparing one large output, against
onnxruntime running both graphs and holding their outputs.

What it measures
    Two graphs of a few hundred bytes with no inputs and one float32 [N, N] output ``y`` (N =
    4096 by default: 64 MiB): A is ``ConstantOfShape([N, N], 1.0)``; B adds
    ``RandomUniform([N, N], -1e-6, 1e-6, seed=1)`` to the same constant, so every element
    differs from A's by a random amount within verify's float32 tolerance (verify passes, and
    its statistics see a realistic spread of errors). The peak resident memory (RSS) and wall
    time of:

      run-both  a tiny script that creates an onnxruntime session of A and of B (CPU), runs each
                once and holds both outputs: what the graphs and their outputs cost by themselves;
      verify    ``fusectl verify A.onnx B.onnx`` (text report to a log file). It must pass
                (exit 0); anything else stops the benchmark.

    The summary prints the medians and what verify holds beyond run-both, per byte of the
    output: the comparison's own memory (issue 28: it was about 19 bytes per output byte, 1.28 GB
    for N = 4096; compare.py now compares CHUNK elements at a time). Times are printed beside the
    memory but are not the point (other load on the machine moves them; RSS it does not).

How it measures
    With ``fuse_bench.py``'s machinery, imported, not copied: every run is a fresh process under
    its fork/exec/wait4 wrapper (peak RSS is the child's ``ru_maxrss``; the wrapper's floor,
    measured on ``true``, is printed); repetitions alternate the order of the two methods after
    one untimed warm-up round (``--warmup``). The graphs are written to WORKDIR/models.

How to run
    /work/main/.venv/bin/python benchmarks/verify_compare_bench.py                # N = 4096, 3 reps
    /work/main/.venv/bin/python benchmarks/verify_compare_bench.py --size 1024 --repeat 1   # smoke
    /work/main/.venv/bin/python benchmarks/verify_compare_bench.py --fusectl /path/to/other/fusectl
    /work/main/.venv/bin/python benchmarks/verify_compare_bench.py --json vc.json

What it needs
    Linux, a venv with fusectl, numpy, onnx and onnxruntime (fusectl is looked up beside
    ``sys.executable``, else on PATH; ``--fusectl`` overrides). Memory: about 4 x N^2 x 4 bytes
    for onnxruntime's buffers and the two outputs, plus what verify adds (an older fusectl's
    comparison about 16 x N^2 x 4 more: 1.5 GB in all for N = 4096). The default run takes about
    half a minute on a 2-core VM.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fuse_bench  # noqa: E402  (the benchmarks folder is not a package)
from fuse_bench import MB  # noqa: E402
from verify_models_bench import log, measure_rounds, measure_verify, prepare, print_runs  # noqa: E402

METHODS = ["run-both", "verify"]

# both graphs in onnxruntime, each run once, both outputs held until the end
RUN_BOTH = r"""
import sys
import onnxruntime
outputs = []
for path in sys.argv[1:]:
    sess = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    outputs.append(sess.run(None, {}))
"""


def write_graphs(folder: str, size: int) -> tuple[str, str]:
    """A.onnx (a constant [size, size] output) and B.onnx (the constant plus uniform noise of
    ±1e-6, seed 1) in ``folder``."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper, save

    def graph(noise: bool):
        shape = numpy_helper.from_array(np.array([size, size], np.int64), "shape")
        one = helper.make_tensor("value", TensorProto.FLOAT, [1], [1.0])
        nodes = [helper.make_node("ConstantOfShape", ["shape"], ["one" if noise else "y"], value=one)]
        if noise:
            nodes += [helper.make_node("RandomUniform", [], ["noise"], shape=[size, size], low=-1e-6, high=1e-6,
                                       seed=1.0, dtype=TensorProto.FLOAT),
                      helper.make_node("Add", ["one", "noise"], ["y"])]
        output = helper.make_tensor_value_info("y", TensorProto.FLOAT, [size, size])
        g = helper.make_graph(nodes, "verify-compare-bench", [], [output], [shape])
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        return model

    os.makedirs(folder, exist_ok=True)
    paths = os.path.join(folder, "A.onnx"), os.path.join(folder, "B.onnx")
    for path, noise in zip(paths, (False, True)):
        save(graph(noise), path)
    return paths


def run_method(method: str, graphs: tuple[str, str], out_dir: str, fusectl: str, timeout: float):
    """Measure one run of ``method``: (wall s, peak RSS KiB, user s, sys s)."""
    if method == "run-both":
        return fuse_bench.measure([sys.executable, "-c", RUN_BOTH, *graphs], timeout)
    if method == "verify":
        return measure_verify(fusectl, list(graphs), os.path.join(out_dir, "verify-compare.log"), timeout)
    raise ValueError(method)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     epilog="See the top of this file for what is measured and how.")
    parser.add_argument("--size", type=int, default=4096, help="the output is float32 [SIZE, SIZE] (default 4096)")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions per method (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds before measuring (default 1)")
    parser.add_argument("--workdir", default="/work/bench-data", help="graphs and scratch files (default /work/bench-data)")
    parser.add_argument("--json", metavar="FILE", help="write the raw numbers here")
    parser.add_argument("--fusectl", help="fusectl executable (default: beside this Python, else PATH)")
    parser.add_argument("--timeout", type=float, default=600, help="per-run limit in seconds (default 600)")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.size < 1:
        parser.error("--repeat and --size must be at least 1")

    started = time.perf_counter()
    fusectl, workdir, out_dir, version = prepare(args)
    graphs = write_graphs(os.path.join(workdir, "models", f"verify-compare-{args.size}"), args.size)
    floor_kb = min(fuse_bench.measure(["true"], 60)[1] for _ in range(3))
    log(f"fusectl: {fusectl} ({version}); graphs {os.path.getsize(graphs[0])} and {os.path.getsize(graphs[1])} "
        f"bytes; wrapper RSS floor {floor_kb} KiB")

    runs, med = measure_rounds(METHODS, args.repeat, args.warmup,
                               lambda method: run_method(method, graphs, out_dir, fusectl, args.timeout), log, width=9)
    output_bytes = args.size * args.size * 4
    print()
    print(f"fusectl verify A.onnx B.onnx vs onnxruntime running both: one float32 [{args.size}, {args.size}] "
          f"output ({output_bytes / MB:.0f} MB); {args.repeat} runs each, alternating order")
    print_runs(runs, METHODS, med, width=9)
    print(f"(wrapper RSS floor {floor_kb * 1024 / MB:.1f} MB)")
    extra = med["verify"][1] - med["run-both"][1]
    print(f"verify - run-both peak RSS (medians) = {extra:.0f} MB = {extra * MB / output_bytes:.2f} bytes per "
          "output byte (fusectl's imports and the comparison)")
    total = time.perf_counter() - started
    print(f"\ntotal benchmark time: {total:.0f} s")
    if args.json:
        where = dict(fusectl=fusectl, fusectl_version=version, python=sys.version, machine=platform.platform(),
                     cpus=os.cpu_count())
        measured = dict(repeat=args.repeat, warmup_rounds=args.warmup, size=args.size, output_bytes=output_bytes,
                        wrapper_rss_floor_kb=floor_kb, extra_mb=extra, runs=runs, total_s=total)
        fuse_bench.write_json(args.json, {**where, **measured})
    return 0


if __name__ == "__main__":
    sys.exit(fuse_bench.exit_status(main, "verify_compare_bench"))
