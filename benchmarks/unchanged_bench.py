#!/usr/bin/env python3
"""The figures issue 22 must not slow down: unfuse, convert, block-FP8 fuse and LoRA fuse, this
fusectl against a baseline fusectl, in alternating rounds on the same checkpoints.

    python benchmarks/unchanged_bench.py --baseline OLD_FUSECTL --repeat 5

Each job runs in a fresh process after ``sync``, the two fusectls in alternating order, and its
output is removed before the next run. The jobs, on ``fuse_bench.py``'s synthetic Llama-style
checkpoints (cached under ``--workdir``, never committed):

- ``unfuse``: the bf16 checkpoint fused with llama-qkv and llama-gate-up (made once, untimed),
  undone from its provenance into a folder;
- ``convert``: the sharded bf16 folder written as one ``.safetensors`` file;
- ``fuse-fp8``: the block-FP8 checkpoint (``fuse_bench.py --fp8``) fused with both rules, its
  scales moved beside its weights;
- ``fuse-lora``: a PEFT LoRA adapter of the bf16 model (rank ``--lora-rank`` on q/k/v/o and
  gate/up/down of every layer, bf16, made here) fused with both rules and the base's
  config.json: q/k/v's Bs become block-diagonal (computed), the rest moves as bytes.

The baseline is any fusectl executable, such as a wrapper that runs an older commit's code:
``PYTHONPATH=/path/to/old/checkout exec python -P -m fusectl "$@"``. The report gives, per job,
both medians, their ratio (this / baseline) and the median of the per-round ratios with their
range (the noise), and both peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fuse_bench  # noqa: E402  (the benchmarks folder is not a package)
from fuse_bench import FP8_SIZES, MB, SIZES  # noqa: E402
from verify_bench import ensure_fused  # noqa: E402

JOBS = ["unfuse", "convert", "fuse-fp8", "fuse-lora"]
LORA_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def lora_shapes(cfg: dict, rank: int) -> list[tuple[str, tuple[int, int]]]:
    """(name, shape) of every lora_A and lora_B of the adapter, in PEFT's names."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    kv = hidden // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    out_in = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv, hidden),
              "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, hidden),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    shapes = []
    for i in range(cfg["num_hidden_layers"]):
        for module in LORA_MODULES:
            out, inp = out_in[module]
            prefix = f"base_model.model.model.layers.{i}.{module}"
            shapes += [(f"{prefix}.lora_A.weight", (rank, inp)), (f"{prefix}.lora_B.weight", (out, rank))]
    return shapes


def generate_lora(folder: str, cfg: dict, rank: int, seed: int, base: str) -> int:
    """A PEFT LoRA folder (adapter_model.safetensors in bf16, adapter_config.json) at ``folder``;
    returns its tensors' bytes."""
    os.makedirs(folder)
    rng = np.random.default_rng(seed)
    entries = [(name, "BF16", shape, 2 * shape[0] * shape[1]) for name, shape in lora_shapes(cfg, rank)]
    fd = os.open(os.path.join(folder, "adapter_model.safetensors"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, fuse_bench.header_blob(entries, {"format": "pt"}))
        for *_, nbytes in entries:  # random finite bf16 values, as fuse_bench writes its weights
            fuse_bench.write_random(fd, nbytes, rng, "BF16")
    finally:
        os.close(fd)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False, "use_dora": False, "use_rslora": False, "task_type": "CAUSAL_LM",
              "base_model_name_or_path": base, "target_modules": sorted(m.rsplit(".", 1)[1] for m in LORA_MODULES)}
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return sum(e[-1] for e in entries)


def job_command(job: str, exe: str, inputs: dict, dst: str) -> list[str]:
    rules = [a for r in fuse_bench.RULES for a in ("-r", r)]
    if job == "unfuse":
        return [exe, "unfuse", inputs["fused"], "-o", dst, "--quiet", "--force"]
    if job == "convert":
        return [exe, "convert", inputs["bf16"], "-o", dst + ".safetensors", "--quiet", "--force"]
    if job == "fuse-fp8":
        return [exe, "fuse", inputs["fp8"], *rules, "-o", dst, "--quiet", "--force"]
    if job == "fuse-lora":
        return [exe, "fuse", inputs["lora"], "--config", os.path.join(inputs["bf16"], "config.json"), *rules,
                "-o", dst, "--quiet", "--force"]
    raise ValueError(job)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, metavar="EXE", help="the fusectl to compare against")
    parser.add_argument("--fusectl", help="this fusectl (default: beside this Python, else PATH)")
    parser.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, from {','.join(JOBS)}")
    parser.add_argument("--size", default="2.4GB", choices=sorted(SIZES))
    parser.add_argument("--repeat", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    parser.add_argument("--lora-rank", type=int, default=64)
    parser.add_argument("--workdir", default="/work/bench-data", help="checkpoint cache (default /work/bench-data)")
    parser.add_argument("--shard-size", type=float, default=500, help="input shard cap in MB (default 500)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="write the raw numbers here")
    parser.add_argument("--timeout", type=float, default=900, help="per-run limit in seconds (default 900)")
    args = parser.parse_args(argv)
    jobs = args.jobs.split(",")
    for job in jobs:
        if job not in JOBS:
            parser.error(f"--jobs: unknown job {job!r}; choose from {', '.join(JOBS)}")

    def log(message):
        print(message, file=sys.stderr, flush=True)

    exes = {"this": args.fusectl or fuse_bench.find_fusectl(), "baseline": args.baseline}
    cfg, shard_bytes = SIZES[args.size], int(args.shard_size * MB)
    bf16 = fuse_bench.ensure_checkpoint(args.workdir, args.size, cfg, shard_bytes, args.seed, log)
    inputs = {"bf16": bf16}
    if "fuse-fp8" in jobs:
        inputs["fp8"] = fuse_bench.ensure_checkpoint(args.workdir, args.size, FP8_SIZES[args.size], shard_bytes,
                                                     args.seed, log, fp8=True)
    os.makedirs(os.path.join(args.workdir, "out"), exist_ok=True)  # the fused input and the scratch output
    if "unfuse" in jobs:
        version = subprocess.run([exes["this"], "--version"], capture_output=True, text=True, check=True).stdout
        inputs["fused"] = ensure_fused(bf16, os.path.join(args.workdir, "out", f"unchanged-FUSED-{args.size}"),
                                       args.size, exes["this"], version.strip(), False, log)
    if "fuse-lora" in jobs:
        params = {"config": cfg, "rank": args.lora_rank, "seed": args.seed, "modules": LORA_MODULES,
                  "values": "write_random"}  # (a cached adapter of other values is made again)
        inputs["lora"], _ = fuse_bench.cached_folder(
            os.path.join(args.workdir, "checkpoints"), f"lora-{args.size}-r{args.lora_rank}", params,
            lambda temp: generate_lora(temp, cfg, args.lora_rank, args.seed, bf16))
    for path in inputs.values():
        fuse_bench.warm(os.path.join(path, name) for name in sorted(os.listdir(path)))
    scratch = os.path.join(args.workdir, "out", "unchanged-scratch")
    runs: dict[tuple[str, str], list] = {(job, who): [] for job in jobs for who in exes}
    started = time.perf_counter()
    for rnd in range(args.warmup + args.repeat):
        for job in jobs:
            order = list(exes) if rnd % 2 == 0 else list(reversed(exes))
            for who in order:
                fuse_bench.remove(scratch)
                fuse_bench.remove(scratch + ".safetensors")
                subprocess.run(["sync"], check=True)
                measured = fuse_bench.measure(job_command(job, exes[who], inputs, scratch), args.timeout)
                if rnd >= args.warmup:
                    runs[(job, who)].append(measured)
        log(f"round {rnd + 1}/{args.warmup + args.repeat} done" + (" (warm-up)" if rnd < args.warmup else ""))
    fuse_bench.remove(scratch)
    fuse_bench.remove(scratch + ".safetensors")

    print(f"\nthis fusectl ({exes['this']}) against the baseline ({exes['baseline']}); {args.size} checkpoints, "
          f"{args.repeat} rounds, alternating order, medians")
    print(f"\n{'job':10} {'this s':>8} {'base s':>8} {'this/base':>10} {'per round (range)':>24} "
          f"{'this MB':>8} {'base MB':>8}")
    print("-" * 82)
    record = {"size": args.size, "repeat": args.repeat, "fusectl": exes, "lora_rank": args.lora_rank, "jobs": {}}
    for job in jobs:
        this, base = runs[(job, "this")], runs[(job, "baseline")]
        t, b = statistics.median(m[0] for m in this), statistics.median(m[0] for m in base)
        per_round = [x[0] / y[0] for x, y in zip(this, base)]
        rss = [statistics.median(m[1] for m in r) * 1024 / MB for r in (this, base)]
        spread = f"{statistics.median(per_round):.2f}x ({min(per_round):.2f}..{max(per_round):.2f})"
        print(f"{job:10} {t:8.2f} {b:8.2f} {t / b:9.2f}x {spread:>24} {rss[0]:8.0f} {rss[1]:8.0f}")
        record["jobs"][job] = {"this": this, "baseline": base}
    print(f"\ntotal benchmark time: {time.perf_counter() - started:.0f} s")
    if args.json:
        fuse_bench.write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(fuse_bench.exit_status(main, "unchanged_bench"))
