#!/usr/bin/env python3
"""Benchmark: ``fusectl fuse`` against ``cp -r`` and a naive in-memory fuse (SPEC section 5).

What it measures
    For synthetic sharded bf16 Llama-style checkpoints (Hugging Face layout: ``config.json``,
    ``model-0000k-of-0000n.safetensors`` shards of at most ~500 MB, ``model.safetensors.index.json``,
    GQA with 32 heads / 8 KV heads) of about 1 GB and about 2.4 GB, the wall time and the peak
    resident memory (RSS) of four ways of producing an output of the same bytes:

      cp     ``cp -r SRC DST`` -- the speed limit: the same bytes copied, nothing re-laid out;
      cp+sync  ``cp -r SRC DST && sync`` -- the same, on disk: fusectl fsyncs every output file
             before renaming it into place, so this is the like-for-like baseline (issue 22's
             limit: fuse <= 1.0x cp+sync);
      cp+fsync ``cp -r SRC DST && sync DST/* DST`` -- the same, but only the output's files are
             flushed (what fusectl does): ``sync`` alone also waits for whatever else on the
             machine is dirty, which flatters fuse when other processes write;
      fuse   ``fusectl fuse SRC -r llama-qkv -r llama-gate-up -o DST --quiet --force``;
      base   with ``--baseline EXE``: ``EXE fuse ...`` as fuse, another fusectl (the code before a
             change) measured in the same rounds;
      naive  ``python benchmarks/fuse_bench.py --naive SRC DST``: what a script without fusectl
             does -- read every shard wholly into memory, build a dict of all arrays (bf16 via
             ml_dtypes), ``np.concatenate`` q/k/v and gate/up per layer, then build each output
             shard wholly in memory and write it.

    SPEC section 5 asks that fusing runs within 1.3x of ``cp`` and that its peak memory does not
    grow with the checkpoint's size; the summary prints both figures (fuse/cp median time ratio,
    fuse RSS growth from the 1 GB to the 2.4 GB checkpoint). Issue 22 asks for fuse <= 1.0x
    ``cp -r && sync``: the summary prints fuse/(cp+sync) and fuse/(cp+fsync) both as the ratio
    of medians and as the median of each round's own ratio (both runs in the same round, so
    drift cancels), with that ratio's range over the rounds as the measure of the noise.

    With ``--fp8`` the checkpoints are block-FP8 instead (DeepSeek-V3 / Qwen3-FP8 layout): every
    linear weight ``X.weight`` is F8_E4M3 [out, in] with ``X.weight_scale_inv`` F32
    [ceil(out/128), ceil(in/128)], embeddings, norms and lm_head stay BF16, and config.json has
    ``quantization_config`` (fp8, e4m3, dynamic, ``weight_block_size`` [128, 128]). Same shapes
    and sharding, twice the layers (16 and 48; one byte a parameter) so the sizes stay about
    1 GB and 2.4 GB. fuse concatenates each q/k/v (gate/up) weight and its scale grid; the naive
    baseline does the same (F8_E4M3 via ml_dtypes). The weights are random bytes with the
    exponent's top bit cleared (finite, never the NaN encodings 0x7F/0xFF), the scales random
    positive finite F32. They are cached as ``llama-fp8-LABEL-<hash>`` beside the bf16 ones.

How it measures
    * Every run is a fresh process, started by a tiny wrapper (``python -S -I -c``, about 6.6 MB)
      that forks, execs the command and reaps it with ``os.wait4``: wall time is taken around
      fork..wait4, peak RSS is the child's own ``ru_maxrss``. (A forked child's ``ru_maxrss``
      also counts the RSS of the process it was forked from at exec time, which is why the
      wrapper is tiny and not this driver; the wrapper's floor is measured on ``true`` and printed:
      a value at the floor means "at most this".)
    * Repetitions alternate: in repetition r the methods run in an order rotated by r, so drift
      (page cache, thermal, neighbours) hits every method alike. One untimed warm-up round
      (``--warmup``) runs first: on a fresh VM the first runs pay for first-touch of guest memory.
    * fusectl's fixed start-up cost (``fusectl --version``: interpreter, imports) is measured too
      and printed under the table, to tell start-up from copy throughput.
    * Before each run the previous output is deleted and ``sync`` is called, so writeback of one
      run does not bleed into the next. ``cp`` is timed without a final sync (page-cache
      throughput, the source warm in the cache); fusectl fsyncs its output before the rename, as
      ``cp+sync`` does with ``sync``.
    * Once per size, after the first fuse and the first naive run, the output is checked against
      the input from the safetensors headers: one layer's ``qkv_proj`` must equal concat(q, k, v)
      bytes and its ``gate_up_proj`` concat(gate, up); every other tensor must be present with the
      same dtype and shape. With ``--fp8`` the same holds for ``qkv_proj.weight_scale_inv`` and
      ``gate_up_proj.weight_scale_inv`` (no unfused ``q_proj.weight_scale_inv`` etc. may remain),
      and the output's config.json must keep ``weight_block_size`` [128, 128]. A mismatch stops
      the benchmark with exit status 1.
    * If fuse/cp exceeds the 1.3x bar, one fuse run of the largest size is profiled with cProfile
      (untimed) and the top functions are printed.

How to run
    /work/venv/bin/python benchmarks/fuse_bench.py                 # default: 1GB and 2.4GB, 5 reps
    /work/venv/bin/python benchmarks/fuse_bench.py --repeat 3 --json bench.json
    /work/venv/bin/python benchmarks/fuse_bench.py --sizes tiny --repeat 1   # smoke test, seconds
    /work/venv/bin/python benchmarks/fuse_bench.py --fp8           # block-FP8 checkpoints instead
    /work/venv/bin/python benchmarks/fuse_bench.py --fp8 --sizes tiny --repeat 1   # its smoke test
    /work/venv/bin/python benchmarks/fuse_bench.py --profile       # also profile one fuse run
    /work/venv/bin/python benchmarks/fuse_bench.py --methods cp,cp+sync,cp+fsync,fuse --baseline OLD
                                            # no naive runs; OLD (a fusectl) timed in the same rounds
    /work/venv/bin/python benchmarks/fuse_bench.py --naive SRC DST # the naive baseline alone

What it needs
    Linux (``os.wait4``, ``fork``), GNU ``cp`` on PATH, the Python of a venv where fusectl is
    installed (``fusectl`` is looked up beside ``sys.executable``, else on PATH; ``--fusectl``
    overrides) with numpy and ml_dtypes. Disk under ``--workdir`` (default /work/bench-data, which
    must not be committed): the checkpoints (~3.4 GB, and ~3.4 GB more for ``--fp8``, generated
    once and reused while their parameters are unchanged) plus one output at a time (<= 2.4 GB). Memory: the naive baseline
    holds about twice the largest checkpoint (~4.5 GB). The default run takes about 1.5 minutes
    on a 2-core VM (ext4, warm cache); generating the checkpoints the first time adds ~10 s.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

GENERATOR_VERSION = 1  # bump when the generated bytes or layout change, to invalidate the cache
ALIGN = 8
MB = 1e6

# Llama-style shapes (TinyLlama-like: hidden 2048, 32 heads, 8 KV heads, head_dim 64);
# the number of layers sets the size: embeddings + lm_head are 262 MB, each layer ~90 MB.
BASE = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=32000)
SIZES = {
    "1GB": dict(BASE, num_hidden_layers=8),      # 0.98 GB
    "2.4GB": dict(BASE, num_hidden_layers=24),   # 2.43 GB
    # smoke test only (not in the default run): a few MB, several shards
    "tiny": dict(hidden_size=256, intermediate_size=704, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=1000, num_hidden_layers=4),
}
DEFAULT_SIZES = ["1GB", "2.4GB"]
# --fp8: the same shapes in block-FP8 (DeepSeek-V3 / Qwen3-FP8 layout). A linear weight is one
# byte a parameter (plus a F32 scale per 128x128 block, ~0.02%), so twice the layers give about
# the same bytes: each layer ~45 MB. Every block boundary of a fused tensor must fall on a
# multiple of 128 rows (fusectl refuses a ragged one), so tiny gets KV rows that are 128.
FP8_BLOCK = 128
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
FP8_SIZES = {
    "1GB": dict(BASE, num_hidden_layers=16),     # 0.98 GB
    "2.4GB": dict(BASE, num_hidden_layers=48),   # 2.43 GB
    "tiny": dict(hidden_size=512, intermediate_size=1408, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=1000, num_hidden_layers=4),
}
METHODS = ["cp", "cp+sync", "cp+fsync", "fuse", "base", "naive"]
DEFAULT_METHODS = ["cp", "cp+sync", "cp+fsync", "fuse", "naive"]
RULES = ["llama-qkv", "llama-gate-up"]

# The measuring wrapper: fork, exec, wait4. Kept tiny (run with -S -I, imports only builtins)
# because a child's ru_maxrss includes the RSS of the process it was forked from.
WRAPPER = r"""
import os, sys, time
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[1], sys.argv[1:])
    finally:
        os._exit(127)
_, status, ru = os.wait4(pid, 0)
t1 = time.perf_counter()
sys.stdout.write("\n@@RESULT %r %d %d %r %r\n" % (t1 - t0, ru.ru_maxrss,
                 os.waitstatus_to_exitcode(status), ru.ru_utime, ru.ru_stime))
"""


class BenchError(Exception):
    """A failed run or a failed correctness check: the benchmark stops loudly."""


# --------------------------------------------------------------------------------------------
# safetensors helpers (headers only; no fusectl code is used, so the check is independent)
# --------------------------------------------------------------------------------------------

def header_blob(entries, metadata=None) -> bytes:
    """8-byte LE length + JSON header (space-padded to a multiple of 8) for back-to-back tensors."""
    header = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def read_header(path):
    """{name: (path, dtype, shape, absolute offset, nbytes)} of one safetensors file."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    base = 8 + length
    return {
        name: (path, e["dtype"], tuple(e["shape"]), base + e["data_offsets"][0],
               e["data_offsets"][1] - e["data_offsets"][0])
        for name, e in header.items()
    }


def checkpoint_files(folder):
    """The safetensors files of a Hugging Face folder (via the index when there is one)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, name) for name in files]
    single = os.path.join(folder, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise BenchError(f"{folder}: neither model.safetensors.index.json nor model.safetensors")


def folder_headers(folder):
    tensors = {}
    for path in checkpoint_files(folder):
        for name, entry in read_header(path).items():
            if name in tensors:
                raise BenchError(f"{folder}: tensor {name} is stored twice")
            tensors[name] = entry
    return tensors


def tensor_bytes(entry) -> bytes:
    path, _, _, offset, nbytes = entry
    with open(path, "rb") as f:
        data = os.pread(f.fileno(), nbytes, offset)
    if len(data) != nbytes:
        raise BenchError(f"{path}: short read at {offset}")
    return data


# --------------------------------------------------------------------------------------------
# synthetic checkpoints
# --------------------------------------------------------------------------------------------

def llama_tensors(cfg):
    """(name, shape) in the module order transformers' LlamaForCausalLM state_dict() uses."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    out = [("model.embed_tokens.weight", (cfg["vocab_size"], h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (cfg["vocab_size"], h))]
    return out


LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")


ITEMSIZE = {"F32": 4, "BF16": 2, "F8_E4M3": 1}


def checkpoint_items(cfg, fp8=False, dtype="BF16"):
    """(name, safetensors dtype, shape, nbytes) of the checkpoint, in state_dict() order.

    bf16 (``dtype`` BF16, or F32 for an fp32 checkpoint): every tensor ``dtype``. fp8: each linear
    weight ``X.weight`` F8_E4M3 [out, in] followed by ``X.weight_scale_inv`` F32
    [ceil(out/128), ceil(in/128)]; embeddings, norms, lm_head ``dtype``.
    """
    items = []
    for name, shape in llama_tensors(cfg):
        if fp8 and LINEAR.fullmatch(name):
            grid = tuple(-(-n // FP8_BLOCK) for n in shape)
            items += [(name, "F8_E4M3", shape, math.prod(shape)),
                      (name + "_scale_inv", "F32", grid, 4 * math.prod(grid))]
        else:
            items.append((name, dtype, shape, ITEMSIZE[dtype] * math.prod(shape)))
    return items


def checkpoint_bytes(cfg, fp8=False) -> int:
    return sum(item[-1] for item in checkpoint_items(cfg, fp8))


def pack_shards(items, max_bytes):
    """Greedy, in order, as transformers' shard_checkpoint does (a bigger tensor goes alone)."""
    shards, size = [[]], 0
    for item in items:
        nbytes = item[-1]
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    return shards


# per dtype, the mask that keeps a random element finite: the exponent's top bit cleared
# (|x| < 2; for F8_E4M3 this also rules out its only NaN encodings, 0x7F and 0xFF), and for the
# F32 scales the sign bit too (positive scales)
RANDOM_MASKS = {"BF16": np.uint16(0xBFFF), "F8_E4M3": np.uint8(0xBF), "F32": np.uint32(0x3FFFFFFF)}


def write_random(fd, nbytes, rng, dtype="BF16", chunk=32 << 20):
    """Append ``nbytes`` of random finite ``dtype`` elements (see RANDOM_MASKS), in chunks."""
    mask = RANDOM_MASKS[dtype]
    left = nbytes
    while left:
        n = min(left, chunk)
        words = rng.bit_generator.random_raw((n + 7) // 8)  # fastest numpy source of bits
        elements = words.view(mask.dtype)
        np.bitwise_and(elements, mask, out=elements)
        view = memoryview(words.view(np.uint8))[:n]
        while view:
            view = view[os.write(fd, view):]
        left -= n


def generate_checkpoint(folder, cfg, shard_bytes, seed, fp8=False, dtype="BF16"):
    """Write a Hugging Face-layout sharded Llama checkpoint (bf16 or ``dtype`` F32, or block-FP8
    with ``fp8``) to ``folder`` (streamed)."""
    os.makedirs(folder)
    rng = np.random.default_rng(seed)
    items = checkpoint_items(cfg, fp8, dtype)
    shards = pack_shards(items, shard_bytes)
    files = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map = {}
    for file, shard in zip(files, shards):
        # safetensors (and so save_pretrained) lays a file out by dtype, widest first, and
        # sorted by name within a dtype
        shard = sorted(shard, key=lambda item: (-ITEMSIZE[item[1]], item[0]))
        blob = header_blob([(n, d, s, b) for n, d, s, b in shard], {"format": "pt"})
        fd = os.open(os.path.join(folder, file), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, blob)
            for name, dtype, _, nbytes in shard:
                write_random(fd, nbytes, rng, dtype)
                weight_map[name] = file
        finally:
            os.close(fd)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(i[-1] for i in items)},
                   "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        f.write("\n")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        **cfg,
        "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False,
        "torch_dtype": "float32" if dtype == "F32" else "bfloat16",
        "attention_bias": False, "mlp_bias": False,
    }
    if fp8:
        config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    return len(files)


def cached_folder(root, stem, params, build):
    """``ROOT/STEM-<hash of params>``, made with ``build(temp)`` unless complete: (folder, result).

    ``build`` makes a new folder at ``temp`` (beside the final one, renamed into place when build
    returns); the marker FOLDER.complete.json (beside, not inside: cp -r must copy only the
    checkpoint) is written last. ``result`` is what build returned, None when the folder was reused.
    """
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
    os.makedirs(root, exist_ok=True)
    folder = os.path.join(root, f"{stem}-{key}")
    marker = folder + ".complete.json"
    if os.path.isdir(folder) and os.path.exists(marker):
        return folder, None
    shutil.rmtree(folder, ignore_errors=True)
    temp = tempfile.mkdtemp(prefix=f".{stem}-", dir=root)
    os.rmdir(temp)
    try:
        result = build(temp)
        os.rename(temp, folder)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    with open(marker, "w") as f:
        json.dump(params, f, indent=2)
    return folder, result


def ensure_checkpoint(workdir, label, cfg, shard_bytes, seed, log, fp8=False):
    """The cached checkpoint for these parameters, generated if missing or stale.

    bf16 checkpoints are ``WORKDIR/checkpoints/llama-LABEL-<hash>``, block-FP8 ones
    ``llama-fp8-LABEL-<hash>``: both kinds coexist in one cache.
    """
    params = {"config": cfg, "shard_bytes": shard_bytes, "seed": seed, "version": GENERATOR_VERSION}
    stem = f"llama-{label}"
    if fp8:  # (bf16 keeps its parameters as they were, so its cached checkpoints stay valid)
        params["quantization_config"] = QUANTIZATION_CONFIG
        stem = f"llama-fp8-{label}"
    t0 = time.perf_counter()
    folder, shards = cached_folder(os.path.join(workdir, "checkpoints"), stem, params,
                                   lambda temp: generate_checkpoint(temp, cfg, shard_bytes, seed, fp8))
    if shards is None:
        log(f"[{label}] reusing {folder}")
    else:
        log(f"[{label}] generated {folder}: {checkpoint_bytes(cfg, fp8) / 1e9:.2f} GB in {shards} shards, "
            f"{time.perf_counter() - t0:.1f} s")
    return folder


# --------------------------------------------------------------------------------------------
# the naive baseline (run as: fuse_bench.py --naive SRC DST)
# --------------------------------------------------------------------------------------------

def naive_fuse(src, dst):
    """Fuse q/k/v and gate/up the way a throwaway script would: everything in memory."""
    import ml_dtypes

    dtypes = {"BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16),
              "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
              "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}
    files = checkpoint_files(src)
    shard_cap = max(os.path.getsize(p) for p in files)
    tensors, keep = {}, []
    for path in files:
        buf = np.fromfile(path, dtype=np.uint8)  # the whole shard in memory
        keep.append(buf)
        (length,) = struct.unpack("<Q", buf[:8].tobytes())
        header = json.loads(buf[8:8 + length].tobytes())
        header.pop("__metadata__", None)
        base = 8 + length
        for name, e in header.items():
            b, end = e["data_offsets"]
            tensors[name] = buf[base + b:base + end].view(dtypes[e["dtype"]]).reshape(e["shape"])
    layers = sorted({int(m.group(1)) for n in tensors if (m := re.match(r"model\.layers\.(\d+)\.", n))})
    for i in layers:
        p = f"model.layers.{i}."
        # block-FP8: each weight's scale grid [out/128, in/128] is concatenated the same way
        for suffix in ("weight", "weight_scale_inv"):
            if p + "self_attn.q_proj." + suffix not in tensors:
                continue
            tensors[p + "self_attn.qkv_proj." + suffix] = np.concatenate(
                [tensors.pop(p + f"self_attn.{x}_proj." + suffix) for x in "qkv"], axis=0)
            tensors[p + "mlp.gate_up_proj." + suffix] = np.concatenate(
                [tensors.pop(p + "mlp.gate_proj." + suffix), tensors.pop(p + "mlp.up_proj." + suffix)], axis=0)
    names = {dt: code for code, dt in dtypes.items()}
    items = [(n, tensors[n].nbytes) for n in sorted(tensors)]
    shards = pack_shards(items, shard_cap)  # one output file per input-shard-sized chunk
    os.makedirs(dst)
    weight_map = {}
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        head = header_blob([(n, names[tensors[n].dtype], tensors[n].shape, b) for n, b in shard],
                           {"format": "pt"})
        blob = bytearray(len(head) + sum(b for _, b in shard))  # the whole file in memory
        blob[:len(head)] = head
        pos = len(head)
        for n, b in shard:
            blob[pos:pos + b] = tensors[n].reshape(-1).view(np.uint8).data
            pos += b
            weight_map[n] = file
        with open(os.path.join(dst, file), "wb") as f:
            f.write(blob)
        del blob
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(b for _, b in items)}, "weight_map": weight_map}, f, indent=2)
    for companion in os.listdir(src):
        if companion.endswith(".json") and companion != "model.safetensors.index.json":
            shutil.copy2(os.path.join(src, companion), os.path.join(dst, companion))


# --------------------------------------------------------------------------------------------
# correctness
# --------------------------------------------------------------------------------------------

FUSED = (("self_attn.qkv_proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
         ("mlp.gate_up_proj", ["mlp.gate_proj", "mlp.up_proj"]))


def check_fused(src, dst, cfg, what):
    """dst must hold src with q/k/v and gate/up of every layer fused (bytes checked for one).

    In a block-FP8 checkpoint (src has ``q_proj.weight_scale_inv``) the scale grids are fused
    alongside their weights: qkv_proj.weight_scale_inv == concat of the three scales, and no
    unfused scale may remain.
    """
    a, b = folder_headers(src), folder_headers(dst)
    layers = cfg["num_hidden_layers"]
    suffixes = ["weight"] + (["weight_scale_inv"] if "model.layers.0.self_attn.q_proj.weight_scale_inv" in a
                             else [])
    expected = {}
    for name, (_, dtype, shape, _, _) in a.items():
        m = re.fullmatch(r"(model\.layers\.\d+\.)(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.weight(_scale_inv)?",
                         name)
        if not m:
            expected[name] = (dtype, shape)
    for i in range(layers):
        p = f"model.layers.{i}."
        for fused, parts in FUSED:
            for suffix in suffixes:
                shapes = [a[f"{p}{x}.{suffix}"][2] for x in parts]
                expected[f"{p}{fused}.{suffix}"] = (a[f"{p}{parts[0]}.{suffix}"][1],
                                                    (sum(s[0] for s in shapes),) + shapes[0][1:])
    got = {n: (e[1], e[2]) for n, e in b.items()}
    if got != expected:
        missing = sorted(set(expected) - set(got))[:5]
        extra = sorted(set(got) - set(expected))[:5]
        wrong = sorted(n for n in set(got) & set(expected) if got[n] != expected[n])[:5]
        raise BenchError(f"{what}: {dst} does not hold the fused tensors: missing {missing}, "
                         f"unexpected {extra}, wrong dtype/shape {wrong}")
    i = layers // 2  # one layer, from the middle of the checkpoint
    p = f"model.layers.{i}."
    for fused, parts in FUSED:
        for suffix in suffixes:
            want = b"".join(tensor_bytes(a[f"{p}{x}.{suffix}"]) for x in parts)
            have = tensor_bytes(b[f"{p}{fused}.{suffix}"])
            if have != want:
                first = None
                if len(have) == len(want):
                    first = int(np.flatnonzero(np.frombuffer(have, np.uint8) != np.frombuffer(want, np.uint8))[0])
                raise BenchError(f"{what}: {dst}: {p}{fused}.{suffix} is not concat("
                                 f"{', '.join(f'{x}.{suffix}' for x in parts)}) of the input "
                                 f"(first differing byte: {first}, sizes {len(have)} vs {len(want)})")
    # an untouched tensor from the same layer, for good measure
    for name in [f"{p}self_attn.o_proj.{suffix}" for suffix in suffixes] + ["lm_head.weight"]:
        if tensor_bytes(a[name]) != tensor_bytes(b[name]):
            raise BenchError(f"{what}: {dst}: {name} differs from the input")
    if len(suffixes) > 1:  # the fused scales mean nothing to a loader without the block size
        with open(os.path.join(dst, "config.json")) as f:
            qc = json.load(f).get("quantization_config") or {}
        if qc.get("weight_block_size") != [FP8_BLOCK, FP8_BLOCK]:
            raise BenchError(f"{what}: {dst}/config.json: quantization_config.weight_block_size is "
                             f"{qc.get('weight_block_size')!r}, not [{FP8_BLOCK}, {FP8_BLOCK}]")
    scales = " (weights and weight_scale_inv)" if len(suffixes) > 1 else ""
    return f"{what}: layer {i} qkv_proj == concat(q,k,v), gate_up_proj == concat(gate,up){scales}, " \
           f"{len(got)} tensors with the expected dtypes/shapes: OK"


# --------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------

def remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def measure(cmd, timeout):
    """Run ``cmd`` under the fork/exec/wait4 wrapper: (wall s, peak RSS KiB, user s, sys s)."""
    wrapper = [sys.executable, "-S", "-I", "-c", WRAPPER]
    proc = subprocess.Popen(wrapper + cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the wrapper's own process group: it and its child
        proc.communicate()
        raise BenchError(f"timed out after {timeout} s: {' '.join(cmd)}")
    text = out.decode(errors="replace")
    m = re.search(r"^@@RESULT (\S+) (\d+) (-?\d+) (\S+) (\S+)$", text, re.M)
    if proc.returncode != 0 or not m:
        raise BenchError(f"wrapper failed ({proc.returncode}): {' '.join(cmd)}\n{err.decode(errors='replace')}")
    wall, rss, rc, utime, stime = float(m[1]), int(m[2]), int(m[3]), float(m[4]), float(m[5])
    if rc != 0:
        raise BenchError(f"exit status {rc}: {' '.join(cmd)}\nstdout:\n{text[:m.start()][-2000:]}\n"
                         f"stderr:\n{err.decode(errors='replace')[-4000:]}")
    return wall, rss, utime, stime


def command(method, src, dst, fusectl):
    if method == "cp":
        return ["cp", "-r", src, dst]
    if method == "cp+sync":  # as durable as fusectl's output, which is fsynced before its rename
        return ["sh", "-c", 'cp -r "$0" "$1" && sync', src, dst]
    if method == "cp+fsync":  # only the output's files and folder flushed, as fusectl does
        return ["sh", "-c", 'cp -r "$0" "$1" && sync "$1"/* "$1"', src, dst]
    if method in ("fuse", "base"):
        rules = [a for r in RULES for a in ("-r", r)]
        exe = fusectl[method] if isinstance(fusectl, dict) else fusectl  # {"fuse": EXE, "base": EXE}, or one EXE
        return [exe, "fuse", src, *rules, "-o", dst, "--quiet", "--force"]
    if method == "naive":
        return [sys.executable, os.path.abspath(__file__), "--naive", src, dst]
    raise ValueError(method)


def find_fusectl():
    beside = os.path.join(os.path.dirname(sys.executable), "fusectl")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("fusectl")
    if not found:
        raise BenchError("fusectl not found beside this Python nor on PATH; pass --fusectl")
    return found


def warm(paths):
    """Read files once so the first measured run does not pay for cold page cache."""
    for path in paths:
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


def profile_fuse(src, dst, out_dir, log):
    """One untimed fuse under cProfile; prints where the time goes."""
    import pstats

    stats_file = os.path.join(out_dir, "fuse.prof")
    remove(dst)
    os.sync()
    cmd = [sys.executable, "-m", "cProfile", "-o", stats_file, "-m", "fusectl", "fuse", src,
           *[a for r in RULES for a in ("-r", r)], "-o", dst, "--quiet", "--force"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    log(f"\ncProfile of one fuse run of {src} ({time.perf_counter() - t0:.2f} s with profiling), "
        f"stats in {stats_file}:")
    remove(dst)
    stats = pstats.Stats(stats_file, stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(10)
    stats.sort_stats("cumulative").print_stats("fusectl", 12)


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------

def summarize(runs, labels, sizes_bytes, floor_kb):
    lines = []
    header = (f"{'size':<7} {'method':<8} {'median s':>9} {'min s':>7} {'max s':>7} {'GB/s':>6} "
              f"{'peak RSS MB':>11} {'(min..max)':>15} {'user s':>7} {'sys s':>6}")
    lines.append(header)
    lines.append("-" * len(header))
    med = {}
    for label in labels:
        for method in METHODS:
            rs = [r for r in runs if r["size"] == label and r["method"] == method]
            if not rs:
                continue
            walls = [r["wall_s"] for r in rs]
            rss = [r["peak_rss_kb"] * 1024 / MB for r in rs]
            m_wall, m_rss = statistics.median(walls), statistics.median(rss)
            med[label, method] = (m_wall, m_rss)
            at_floor = "*" if min(r["peak_rss_kb"] for r in rs) <= floor_kb * 1.05 else " "
            lines.append(
                f"{label:<7} {method:<8} {m_wall:>9.2f} {min(walls):>7.2f} {max(walls):>7.2f} "
                f"{sizes_bytes[label] / 1e9 / m_wall:>6.2f} {m_rss:>10.0f}{at_floor} "
                f"{f'({min(rss):.0f}..{max(rss):.0f})':>15} "
                f"{statistics.median(r['user_s'] for r in rs):>7.2f} "
                f"{statistics.median(r['sys_s'] for r in rs):>6.2f}")
        lines.append("")
    lines.append(f"* = at the measuring wrapper's floor ({floor_kb * 1024 / MB:.1f} MB): the command's "
                 f"own peak is at most this")
    for label in labels:
        if (label, "cp") in med and (label, "fuse") in med:
            ratio = med[label, "fuse"][0] / med[label, "cp"][0]
            naive = (f", naive/cp = {med[label, 'naive'][0] / med[label, 'cp'][0]:.2f}x"
                     if (label, "naive") in med else "")
            verdict = "within" if ratio <= 1.3 else "OVER"
            lines.append(f"{label}: fuse/cp (median wall) = {ratio:.2f}x ({verdict} the 1.3x bar){naive}")
        for fuse in ("fuse", "base"):
            for ref in ("cp+sync", "cp+fsync", "cp"):
                if (label, ref) in med and (label, fuse) in med:
                    lines.append(f"{label}: {_round_ratios(runs, label, fuse, ref, med)}")
        if (label, "base") in med and (label, "fuse") in med:
            lines.append(f"{label}: {_round_ratios(runs, label, 'fuse', 'base', med)}")
    fused = [label for label in labels if (label, "fuse") in med]
    if len(fused) >= 2:
        lo, hi = min(fused, key=sizes_bytes.get), max(fused, key=sizes_bytes.get)
        r_lo, r_hi = med[lo, "fuse"][1], med[hi, "fuse"][1]
        extra_gb = (sizes_bytes[hi] - sizes_bytes[lo]) / 1e9
        lines.append(f"fuse peak RSS {lo} -> {hi}: {r_lo:.0f} MB -> {r_hi:.0f} MB "
                     f"({r_hi - r_lo:+.0f} MB, {100 * (r_hi / r_lo - 1):+.1f}%, "
                     f"{(r_hi - r_lo) / extra_gb:+.0f} MB per extra GB of checkpoint)")
        if (lo, "naive") in med and (hi, "naive") in med:
            n_lo, n_hi = med[lo, "naive"][1], med[hi, "naive"][1]
            lines.append(f"naive peak RSS {lo} -> {hi}: {n_lo:.0f} MB -> {n_hi:.0f} MB "
                         f"({n_hi - n_lo:+.0f} MB, {(n_hi - n_lo) / extra_gb:+.0f} MB per extra GB)")
    return "\n".join(lines), med


def _round_ratios(runs, label, a, b, med) -> str:
    """a/b as the ratio of the medians, and as the median (min..max) of each round's own ratio."""
    walls = {(r["method"], r["rep"]): r["wall_s"] for r in runs if r["size"] == label}
    rounds = sorted({rep for method, rep in walls if method == a} & {rep for method, rep in walls if method == b})
    per = [walls[a, rep] / walls[b, rep] for rep in rounds]
    durable = " (both durable on disk)" if b.startswith("cp+") else ""
    limit = ", limit 1.0x: " + ("within" if statistics.median(per) <= 1.0 else "OVER") if b == "cp+sync" else ""
    return (f"{a}/({b}){durable}: medians {med[label, a][0]:.2f} s / {med[label, b][0]:.2f} s = "
            f"{med[label, a][0] / med[label, b][0]:.2f}x; per round median {statistics.median(per):.2f}x "
            f"({min(per):.2f}..{max(per):.2f} over {len(per)} rounds){limit}")


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------

def startup_line(what: str, measured) -> str:
    """``WHAT, N runs: median S s, M MB`` over ``measure()`` results."""
    return (f"{what}, {len(measured)} runs: median {statistics.median(m[0] for m in measured):.2f} s, "
            f"{statistics.median(m[1] for m in measured) * 1024 / MB:.0f} MB")


def write_json(path: str, record) -> None:
    """``record`` as indented JSON with a final newline (the --json FILE of a benchmark)."""
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")


def exit_status(main, name: str) -> int:
    """Run a benchmark's ``main()``: a failed run or check prints one ``NAME: FAILED:`` line, gives 1."""
    try:
        return main()
    except BenchError as e:
        failure = str(e)
    except subprocess.CalledProcessError as e:
        failure = f"exit status {e.returncode}: {' '.join(map(str, e.cmd))}"
    print(f"{name}: FAILED: {failure}", file=sys.stderr)
    return 1


def add_common_arguments(parser, repeat: int) -> None:
    """The options fuse_bench and verify_bench share (same checkpoints: same --shard-size, --seed)."""
    parser.add_argument("--repeat", type=int, default=repeat, help=f"repetitions per size and method (default {repeat})")
    parser.add_argument("--sizes", default=",".join(DEFAULT_SIZES),
                        help=f"comma-separated, from {', '.join(SIZES)} (default {','.join(DEFAULT_SIZES)})")
    parser.add_argument("--workdir", default="/work/bench-data",
                        help="checkpoint cache and scratch outputs (default /work/bench-data)")
    parser.add_argument("--shard-size", type=float, default=500, help="input shard cap in MB (default 500)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed rounds of every size and method before measuring (default 1)")
    parser.add_argument("--json", metavar="FILE", help="write the raw numbers here")
    parser.add_argument("--fusectl", help="fusectl executable (default: beside this Python, else PATH)")
    parser.add_argument("--timeout", type=float, default=900, help="per-run limit in seconds (default 900)")


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="See the top of this file for what is measured and how.")
    add_common_arguments(parser, repeat=5)
    parser.add_argument("--profile", action="store_true",
                        help="profile one fuse run of the largest size even when within the bar")
    parser.add_argument("--fp8", action="store_true",
                        help="block-FP8 checkpoints (F8_E4M3 linear weights + F32 weight_scale_inv "
                             "per 128x128 block, twice the layers for about the same bytes) instead of bf16")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help=f"methods to time, comma-separated, from {','.join(METHODS)} "
                             f"(default {','.join(DEFAULT_METHODS)}; base needs --baseline)")
    parser.add_argument("--baseline", metavar="EXE",
                        help="another fusectl (the code before a change), timed as method 'base' in the same rounds")
    parser.add_argument("--naive", nargs=2, metavar=("SRC", "DST"),
                        help="run only the naive baseline on SRC, writing DST (what the benchmark times)")
    args = parser.parse_args(argv)

    if args.naive:
        naive_fuse(*args.naive)
        return 0

    started = time.perf_counter()

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    sizes = FP8_SIZES if args.fp8 else SIZES
    kind = "block-FP8 (F8_E4M3, F32 scales per 128x128 block)" if args.fp8 else "bf16"
    labels = [s.strip() for s in args.sizes.split(",") if s.strip()]
    for label in labels:
        if label not in sizes:
            parser.error(f"--sizes: unknown size {label!r}; choose from {', '.join(sizes)}")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for method in methods:
        if method not in METHODS:
            parser.error(f"--methods: unknown method {method!r}; choose from {', '.join(METHODS)}")
    if args.baseline and "base" not in methods:
        methods.append("base")
    if "base" in methods and not args.baseline:
        parser.error("--methods base needs --baseline EXE")
    fusectl = {"fuse": args.fusectl or find_fusectl(), "base": args.baseline}
    workdir = os.path.abspath(args.workdir)
    out_dir = os.path.join(workdir, "out")
    os.makedirs(out_dir, exist_ok=True)
    shard_bytes = int(args.shard_size * MB)
    sizes_bytes = {label: checkpoint_bytes(sizes[label], args.fp8) for label in labels}

    need = max(sizes_bytes.values()) * 1.1 + sum(sizes_bytes.values())
    free = shutil.disk_usage(workdir).free
    if free < need:
        raise BenchError(f"{workdir}: {free / 1e9:.1f} GB free, need about {need / 1e9:.1f} GB")

    sources = {label: ensure_checkpoint(workdir, label, sizes[label], shard_bytes, args.seed, log, args.fp8)
               for label in labels}
    for folder in sources.values():
        warm(checkpoint_files(folder))
    fusectl_version = subprocess.run([fusectl["fuse"], "--version"], capture_output=True, text=True).stdout.strip()
    floor_kb = min(measure(["true"], 60)[1] for _ in range(3))
    log(f"fusectl: {fusectl['fuse']} ({fusectl_version}); wrapper RSS floor {floor_kb} KiB")
    if args.baseline:
        log(f"baseline: {args.baseline}")

    runs, checked = [], set()
    for rep in range(-args.warmup, args.repeat):
        order = methods[rep % len(methods):] + methods[:rep % len(methods)]
        name = f"rep {rep + 1}/{args.repeat}" if rep >= 0 else "warm-up"
        for label in labels:
            for method in order:
                src = sources[label]
                dst = os.path.join(out_dir, f"{label}-{method}")
                remove(dst)
                os.sync()
                wall, rss, utime, stime = measure(command(method, src, dst, fusectl), args.timeout)
                log(f"{name:<9} {label:<6} {method:<8} {wall:7.2f} s  {rss * 1024 / MB:7.0f} MB")
                if rep >= 0:
                    runs.append(dict(size=label, method=method, rep=rep, order=order.index(method),
                                     wall_s=wall, peak_rss_kb=rss, user_s=utime, sys_s=stime))
                if method in ("fuse", "base", "naive") and (label, method) not in checked:
                    log("  " + check_fused(src, dst, sizes[label], f"{label} {method}"))
                    checked.add((label, method))
                remove(dst)
    os.sync()
    startup = [measure([fusectl["fuse"], "--version"], 60) for _ in range(5)]

    table, med = summarize(runs, labels, sizes_bytes, floor_kb)
    print()
    print(f"fusectl fuse vs cp -r vs naive in-memory fuse; {kind} Llama-style (32 heads / 8 KV heads), "
          f"shards <= {args.shard_size:.0f} MB; {args.repeat} runs each, alternating order, "
          f"sync before each run, warm page cache")
    for label in labels:
        cfg = sizes[label]
        print(f"  {label}: {sizes_bytes[label] / 1e9:.2f} GB ({sizes_bytes[label]} bytes), "
              f"{cfg['num_hidden_layers']} layers, "
              f"{len(checkpoint_files(sources[label]))} shards")
    print()
    print(table)
    print(f"fusectl start-up alone (`fusectl --version`, 5 runs): median "
          f"{statistics.median(w for w, *_ in startup):.2f} s, "
          f"{statistics.median(r for _, r, *_ in startup) * 1024 / MB:.0f} MB")

    largest = max(labels, key=sizes_bytes.get)
    over = any(med[label, "fuse"][0] / med[label, "cp"][0] > 1.3 for label in labels
               if (label, "fuse") in med and (label, "cp") in med)
    if over or args.profile:
        profile_fuse(sources[largest], os.path.join(out_dir, f"{largest}-profile"), out_dir, log)

    total = time.perf_counter() - started
    print(f"\ntotal benchmark time: {total:.0f} s")
    if args.json:
        write_json(args.json, {
            "fusectl": fusectl["fuse"], "baseline": args.baseline, "methods": methods, "fusectl_version": fusectl_version, "python": sys.version,
            "machine": platform.platform(), "cpus": os.cpu_count(),
            "repeat": args.repeat, "shard_bytes": shard_bytes, "rules": RULES,
            "format": "fp8" if args.fp8 else "bf16",
            "quantization_config": QUANTIZATION_CONFIG if args.fp8 else None,
            "wrapper_rss_floor_kb": floor_kb, "warmup_rounds": args.warmup,
            "fusectl_startup": [dict(wall_s=w, peak_rss_kb=r, user_s=u, sys_s=y) for w, r, u, y in startup],
            "sizes": {label: {"config": sizes[label], "bytes": sizes_bytes[label],
                              "source": sources[label]} for label in labels},
            "runs": runs, "total_s": total,
        })
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main, "fuse_bench"))
