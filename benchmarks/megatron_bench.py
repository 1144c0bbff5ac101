#!/usr/bin/env python3
"""Benchmark: fusectl to and from Megatron-LM legacy checkpoints (``model_optim_rng.pt`` per
rank) against ``cp -r && sync`` of each output (issue 30: "Streaming and flat memory as for the
other formats").

What it measures
    A Hugging Face Llama folder of random fp32 weights (``fuse_bench.generate_checkpoint``: no
    torch; GQA, SwiGLU, untied head, shards of at most 500 MB; generated once, cached under
    ``--work``, default /tmp/fusectl-megbench):

      1.2GB  hidden 2048, 4 layers, 32 heads in 8 query groups, ffn 5632, vocab 32000:
             1.25 GB of weights, largest tensor 262 MB (the embedding and the head)
      2GB    the same with 8 layers: 1.97 GB (so the two show whether memory grows with the model)
      tiny   hidden 256, 4 layers, 8 heads in 4 groups, vocab 1000 (the smoke test's)

    and three fusectl commands on it, one after the other (the first one's output is the input of
    the other two):

      to-megatron  ``fusectl fuse HF -r llama-to-megatron-gpt --to megatron --tp 2 --pp 2 -o MEG``:
                   four rank files, each a torch.save dict (``args``, ``iteration``, its
                   ``model``): q/k/v interleaved per query group, gate/up joined, then cut in
                   rows (column-parallel) or columns (row-parallel) by TP rank, layers by stage
      to-hf        ``fusectl fuse MEG -r megatron-gpt-to-llama --config HF/config.json -o HF2``:
                   the rank files joined and taken apart again, written as safetensors
      reshard      ``fusectl convert MEG --to megatron -o MEG1``: TP=2 PP=2 joined into one
                   TP=1 PP=1 rank file

    Each command is timed beside ``cp -r REF OUT && sync``, REF the very output the command
    wrote in an untimed first run (the least writing that output can cost), in rounds
    (``bench_rounds.timed_rounds``: rotating order, ``sync`` and ``--settle`` seconds before each
    run, each a fresh process timed around fork..wait4, its peak RSS its ``ru_maxrss``). The
    summary gives command / (cp+sync) as the ratio of the medians and as the median of each
    round's own ratio, and peak RSS minus the model's largest tensor (the bar: under 100 MB, flat
    with the model's size).

    Megatron's own consolidation is not timed: megatron-core 0.16.1 (/work/venvs/megatron) does
    not read legacy rank files at all (no module of it names ``model_optim_rng.pt``: loading them
    is ``megatron.training.checkpointing``'s, and resharding a save is Megatron-LM's
    tools/checkpoint/convert.py, neither in the package, both needing the model code and
    torch.distributed set up per rank); its ``resharding`` refits live tensors between running
    ranks, and ``dist_checkpointing.load`` reads a torch_dist save, which these commands do not
    write.

How it checks
    Before any timed run: MEG has the four rank files ``mp_rank_0T_00P/model_optim_rng.pt`` and
    MEG1 one ``mp_rank_00/``; HF2 equals HF bitwise (every tensor's name, dtype, shape and bytes,
    read from the safetensors headers with no fusectl code), and so does MEG1 taken back to
    Hugging Face (``fusectl fuse MEG1 -r megatron-gpt-to-llama``, untimed): the round trip through
    TP=2 PP=2, and through the reshard, loses nothing. A failed check stops with exit status 1.

How to run
    python benchmarks/megatron_bench.py                            # 2GB, 3 rounds
    python benchmarks/megatron_bench.py --repeat 2 --settle 10 --json out.json
    python benchmarks/megatron_bench.py --sizes tiny --settle 0     # seconds, for a try

    Run it with the Python of a venv where fusectl is installed (fusectl is looked up beside
    it). Disk at 2GB: 2 GB for the input, 8 GB for the three reference outputs and the check's
    folder, and two outputs of one command at a time.

Figures (this machine: 2-core Firecracker VM, Linux 6.18, 23 GB RAM, ext4 on a virtio disk, all
shared with 4 other jobs running tests: load average 3-5 during the runs; fusectl 0.1.0;
``--repeat 2 --settle 10``, one run per size; "per round" is the median of each round's
fusectl / (cp+sync), with its range)

    | size  | command     | fusectl | cp+sync | ratio of medians | per round          | peak RSS |
    |-------|-------------|---------|---------|------------------|--------------------|----------|
    | 1.2GB | to-megatron | 4.48 s  | 4.13 s  | 1.09x            | 1.09x (1.01..1.17) | 120 MB   |
    | 1.2GB | to-hf       | 2.32 s  | 0.93 s  | 2.50x            | 2.59x (1.59..3.59) | 111 MB   |
    | 1.2GB | reshard     | 3.53 s  | 1.65 s  | 2.14x            | 2.69x (1.66..3.71) | 124 MB   |
    | 2GB   | to-megatron | 6.11 s  | 5.86 s  | 1.04x            | 1.19x (0.59..1.80) | 121 MB   |
    | 2GB   | to-hf       | 7.26 s  | 7.71 s  | 0.94x            | 1.06x (0.56..1.57) | 112 MB   |
    | 2GB   | reshard     | 8.01 s  | 9.44 s  | 0.85x            | 1.05x (0.41..1.69) | 125 MB   |

    Every output is 1246 MB (1.2GB) or 1967 MB (2GB); every check passed (both round trips
    bitwise). Memory is flat: 111-125 MB at both sizes (and 41-50 MB for the tiny model), below
    the largest tensor (262 MB), so never a whole model nor a whole embedding; what it holds above
    the start-up's ~45 MB is one row-parallel weight split or joined on its columns in memory
    (``linear_fc2`` [2048, 5632] fp32 is 46 MB, its half 23 MB: 69 MB), so it grows with
    hidden x ffn, not with the number of layers. Time: at 2GB the disk decides (cp+sync of the
    same 1967 MB took 4.4 to 12.4 s; in each round the second run was the slower, whichever it
    was, even after the 10 s settle); at 1.2GB, where cp+sync took 0.8-2.5 s, fusectl is 2-2.7x
    it reading rank files and 1.1x writing them. Where the time goes (cProfile, 1.2GB, warm
    cache, in-process): to-hf 1.28 s, of it copy_file_range of the 893 MB that are file ranges
    0.45 s, writing the 350 MB computed (the row-parallel weights joined on their columns)
    0.30 s, reading their pieces 0.25 s; to-megatron 2.55 s, of it copy_file_range 0.68 s,
    writing computed tensors 0.44 s, the q/k/v interleave per query group computed in memory
    0.33 s (``Interleave`` has no byte ranges, though each group's q, k and v are row runs of
    the inputs), reading row-parallel weights to cut their columns 0.36 s.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_rounds  # noqa: E402  (the benchmarks folder is not a package)
import fuse_bench  # noqa: E402
from bench_rounds import folder_bytes  # noqa: E402
from convert_bench import comma_list, log  # noqa: E402
from fuse_bench import MB, BenchError  # noqa: E402

GENERATOR_VERSION = 1  # bump when the generated bytes or layout change, to invalidate the cache
WORK = "/tmp/fusectl-megbench"
LLAMA = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=8,
             vocab_size=32000)
SIZES = {
    "1.2GB": dict(LLAMA, num_hidden_layers=4),
    "2GB": dict(LLAMA, num_hidden_layers=8),
    "tiny": dict(hidden_size=256, intermediate_size=704, num_attention_heads=8, num_key_value_heads=4,
                 vocab_size=1000, num_hidden_layers=4),
}
TP, PP = 2, 2
OPS = ["to-megatron", "to-hf", "reshard"]
METHODS = ["fusectl", "cp+sync"]
SHARD_BYTES = 500_000_000
SEED = 0


def ensure_model(work, label) -> str:
    """The cached Hugging Face fp32 folder of size ``label``, generated if missing."""
    params = {"config": SIZES[label], "shard_bytes": SHARD_BYTES, "seed": SEED, "dtype": "F32",
              "version": GENERATOR_VERSION}
    t0 = time.perf_counter()
    folder, shards = fuse_bench.cached_folder(
        os.path.join(work, "checkpoints"), f"llama-f32-{label}", params,
        lambda temp: fuse_bench.generate_checkpoint(temp, SIZES[label], SHARD_BYTES, SEED, dtype="F32"))
    log(f"[{label}] reusing {folder}" if shards is None else
        f"[{label}] generated {folder}: {folder_bytes(folder) / 1e9:.2f} GB in {shards} shards, "
        f"{time.perf_counter() - t0:.0f} s")
    return folder


def op_command(op, fusectl, hf, meg, dst) -> list[str]:
    """The command line of ``op`` writing ``dst``: from the Llama folder ``hf`` or the rank files
    ``meg`` (to-megatron's output)."""
    if op == "to-megatron":
        return [fusectl, "fuse", hf, "-r", "llama-to-megatron-gpt", "--to", "megatron", "--tp", str(TP),
                "--pp", str(PP), "-o", dst, "--quiet", "--force"]
    if op == "to-hf":
        return [fusectl, "fuse", meg, "-r", "megatron-gpt-to-llama", "--config", os.path.join(hf, "config.json"),
                "-o", dst, "--quiet", "--force"]
    if op == "reshard":
        return [fusectl, "convert", meg, "--to", "megatron", "-o", dst, "--quiet", "--force"]
    raise ValueError(op)


def rank_folders(folder) -> list[str]:
    """The names of the rank folders of a Megatron legacy save that hold a model_optim_rng.pt."""
    return sorted(os.path.basename(os.path.dirname(path))
                  for path in glob.glob(os.path.join(folder, "*", "mp_rank_*", "model_optim_rng.pt")))


def check_ranks(folder, tp, pp) -> str:
    """``folder`` holds one rank file for each of ``tp`` x ``pp`` ranks, in Megatron's names."""
    if pp == 1:
        want = [f"mp_rank_{t:02d}" for t in range(tp)]
    else:
        want = [f"mp_rank_{t:02d}_{p:03d}" for t in range(tp) for p in range(pp)]
    got = rank_folders(folder)
    if got != want:
        raise BenchError(f"{folder}: rank folders {got}, want {want}")
    return f"{len(got)} rank file{'s' if len(got) > 1 else ''}"


def run_op(label, op, src, hf, reference, largest, args, tools) -> tuple[list, dict]:
    """Every round of fusectl and cp+sync for one command: (runs, facts)."""
    name = f"{label} {op}"
    out_dir = os.path.join(tools["work"], "out")
    fuse_bench.warm(os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs)

    def command(method, dst):
        if method == "fusectl":
            return op_command(op, tools["fusectl"], hf, src, dst)
        return ["sh", "-c", 'cp -r "$0" "$1" && sync', reference, dst]

    runs = bench_rounds.timed_rounds(name, METHODS, args, command,
                                     lambda method: os.path.join(out_dir, f"{label}-{op}-{method}"))
    facts = {"input_bytes": folder_bytes(src), "output_bytes": folder_bytes(reference),
             "largest_tensor_bytes": largest, "source": src}
    return runs, facts


def run_size(label, args, tools) -> tuple[list, dict]:
    """The references of the three commands (untimed, checked), then each command's rounds."""
    hf = ensure_model(tools["work"], label)
    out_dir = os.path.join(tools["work"], "out")
    os.makedirs(out_dir, exist_ok=True)
    refs = {op: os.path.join(out_dir, f"{label}-{op}-reference") for op in OPS}
    back = os.path.join(out_dir, f"{label}-reshard-back")
    for path in [*refs.values(), back]:
        fuse_bench.remove(path)
    for op in OPS:
        fuse_bench.measure(op_command(op, tools["fusectl"], hf, refs["to-megatron"], refs[op]), args.timeout)
    fuse_bench.measure([tools["fusectl"], "fuse", refs["reshard"], "-r", "megatron-gpt-to-llama", "--config",
                        os.path.join(hf, "config.json"), "-o", back, "--quiet"], args.timeout)
    log(f"  {label} to-megatron: {check_ranks(refs['to-megatron'], TP, PP)}: OK")
    log(f"  {label} reshard: {check_ranks(refs['reshard'], 1, 1)}: OK")
    log(f"  {label} to-hf: {bench_rounds.same_tensors(refs['to-hf'], hf)}: OK")
    log(f"  {label} reshard, back to HF: {bench_rounds.same_tensors(back, hf)}: OK")
    fuse_bench.remove(back)
    largest = max(entry[4] for entry in fuse_bench.folder_headers(hf).values())
    runs, facts = [], {}
    try:
        for op in OPS:
            src = hf if op == "to-megatron" else refs["to-megatron"]
            got, facts[f"{label} {op}"] = run_op(label, op, src, hf, refs[op], largest, args, tools)
            runs += got
    finally:
        for path in refs.values():
            fuse_bench.remove(path)
    return runs, facts


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     epilog="See the top of this file for what is measured and how.")
    parser.add_argument("--sizes", default="2GB", help=f"from {', '.join(SIZES)} (default 2GB)")
    bench_rounds.add_round_arguments(parser, WORK)
    args = parser.parse_args(argv)
    args.sizes = comma_list(parser, "--sizes", args.sizes, SIZES)
    bench_rounds.check_round_arguments(parser, args)
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    fusectl = args.fusectl or fuse_bench.find_fusectl()
    version, floor_kb = bench_rounds.measuring_setup(fusectl)
    tools = {"work": os.path.abspath(args.work), "fusectl": fusectl}
    runs, facts = [], {}
    for label in args.sizes:
        got, more = run_size(label, args, tools)
        runs += got
        facts.update(more)
    table, _ = bench_rounds.report(runs, facts, floor_kb, METHODS, "fusectl")
    bench_rounds.finish(f"fusectl to and from Megatron-LM legacy TP={TP} PP={PP} vs cp -r of each output && sync",
                        table, args, started, (fusectl, version, floor_kb),
                        {"tp": TP, "pp": PP, "commands": {op: op_command(op, "fusectl", "HF", "MEG", "OUT") for op in OPS},
                         "checkpoints": facts, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(fuse_bench.exit_status(main, "megatron_bench"))
