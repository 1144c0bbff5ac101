"""Shared fixtures for fusectl's tests: fixture paths, a CLI runner, directory snapshots.

Every test that writes copies its inputs into ``tmp_path`` first, so the committed fixtures
are never at risk and each test proves on its own that an input stays byte-identical.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np
import pytest
from click.testing import CliRunner

from fusectl.cli import main

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """The committed fixtures folder (read-only by convention: copy before writing near it)."""
    return FIXTURES


@pytest.fixture
def copy_fixture(tmp_path):
    """Copy a fixture (file or folder) into ``tmp_path/in/`` and return the copy's path."""

    def copy(name: str, dest: str | None = None) -> Path:
        src = FIXTURES / name
        root = tmp_path / "in"
        root.mkdir(exist_ok=True)
        dst = root / (dest or name)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)
        return dst

    return copy


@dataclass
class Result:
    """What one CLI run produced: exit code, stdout and stderr kept apart."""

    exit_code: int
    stdout: str
    stderr: str
    exception: BaseException | None

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def json(self):
        return json.loads(self.stdout)


def run_cli(*args) -> Result:
    """Run ``fusectl ARGS`` in-process through click's CliRunner (stdout and stderr apart); every
    option its messages name must be one of the command run (:func:`unknown_options`)."""
    runner = CliRunner()
    result = runner.invoke(main, [str(a) for a in args], catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        # an escaped exception is a bug: the CLI must map every error to a message
        stderr = result.stderr + f"\n[escaped exception: {type(result.exception).__name__}: {result.exception}]"
    else:
        stderr = result.stderr
    unknown = unknown_options([str(a) for a in args], stderr)
    assert not unknown, f"fusectl {' '.join(map(str, args[:1]))} names {unknown}, which it does not have:\n{stderr}"
    return Result(result.exit_code, result.stdout, stderr, result.exception)


_OPTION = re.compile(r"(?<![\w/.-])--[a-z][a-z0-9-]*")
_QUOTED_COMMAND = re.compile(r"`[^`]*`")  # a whole command a message spells out (another command's options)


def unknown_options(args: list[str], stderr: str) -> list[str]:
    """The options (``--name``) that ``stderr`` names but the subcommand ``args`` ran does not have
    (a message's advice must be followable as it is; a whole command it spells out in backticks
    is another command's). Empty for a run that names no subcommand."""
    command = next((main.commands[a] for a in args if a in main.commands), None)
    if command is None:
        return []
    if isinstance(command, click.Group):  # rules list / rules show
        sub = next((command.commands[a] for a in args if a in command.commands), None)
        command = sub or command
    have = {opt for param in [*command.params, *main.params] for opt in (*param.opts, *param.secondary_opts)}
    have |= {"--help", "--version"}  # click's own, on every command
    named = _OPTION.findall(_QUOTED_COMMAND.sub("", stderr))
    return sorted({n for n in named if n not in have})


@pytest.fixture
def cli():
    """``cli("fuse", path, "-r", "llama-qkv", "-o", out)`` → Result."""
    return run_cli


def ok(result: Result) -> Result:
    """Assert a run succeeded, showing its stderr when it did not."""
    assert result.exit_code == 0, f"exit {result.exit_code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def snapshot(root) -> dict[str, str]:
    """Every path under ``root`` (relative, files and folders) → sha256 of its bytes ('dir' for folders).

    Comparing two snapshots proves that nothing was added, removed or changed.
    """
    root = Path(root)
    out: dict[str, str] = {}
    if root.is_file():
        return {root.name: hashlib.sha256(root.read_bytes()).hexdigest()}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in filenames:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def leftovers(folder) -> list[str]:
    """Names in ``folder`` that a fusectl run leaves behind only by mistake (temp/old outputs)."""
    return sorted(n for n in os.listdir(folder) if "fusectl-tmp" in n or "fusectl-old" in n)


# ---------------------------------------------------------------- reading safetensors by hand


def parse_safetensors(path) -> tuple[dict[str, tuple[str, list[int], bytes]], dict[str, str]]:
    """An independent parser (no fusectl code): name → (dtype, shape, raw bytes), metadata."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    metadata = header.pop("__metadata__", {}) or {}
    body = data[8 + n :]
    tensors = {}
    for name, entry in header.items():
        b, e = entry["data_offsets"]
        tensors[name] = (entry["dtype"], list(entry["shape"]), body[b:e])
    return tensors, metadata


def load_checkpoint_raw(path) -> dict[str, tuple[str, list[int], bytes]]:
    """All stored tensors of a file, a sharded index or a Hugging Face folder, parsed by hand."""
    path = Path(path)
    if path.is_dir():
        indexes = list(path.glob("*.safetensors.index.json"))
        if indexes:
            path = indexes[0]
        else:
            (path,) = list(path.glob("*.safetensors"))
    if path.name.endswith(".index.json"):
        index = json.loads(path.read_text())
        out = {}
        for shard in sorted(set(index["weight_map"].values())):
            tensors, _ = parse_safetensors(path.parent / shard)
            for name in tensors:
                assert name not in out, f"{name} stored twice"
            out.update(tensors)
        assert set(out) == set(index["weight_map"]), "index and shards disagree"
        return out
    return parse_safetensors(path)[0]


def with_provenance(path, out, edit=None):
    """A copy of the single safetensors file ``path`` at ``out`` whose fusectl provenance record is
    ``edit(record)``, or removed when ``edit`` is None (a checkpoint fusectl did not write)."""
    tensors, meta = parse_safetensors(path)
    record = json.loads(meta.pop("fusectl"))
    if edit is not None:
        meta["fusectl"] = json.dumps(edit(record))
    return write_safetensors(out, {n: array_of(t) for n, t in tensors.items()}, meta)


def without_origins(record: dict) -> dict:
    """A provenance record as fusectl wrote it before it recorded each group's rules text (an
    ``edit`` for :func:`with_provenance`)."""
    for group in record["plan"]:
        group.pop("origin", None)
    return record


def metadata_of(path) -> dict[str, str]:
    """``__metadata__`` of a single safetensors file or a folder's (index) metadata."""
    path = Path(path)
    if path.is_dir():
        indexes = list(path.glob("*.safetensors.index.json"))
        if indexes:
            return json.loads(indexes[0].read_text()).get("metadata", {})
        (path,) = list(path.glob("*.safetensors"))
    return parse_safetensors(path)[1]


def array_of(entry) -> np.ndarray:
    """A parsed (dtype, shape, bytes) entry as a numpy array (ml_dtypes for bf16/fp8)."""
    from fusectl.dtypes import BY_NAME

    dtype, shape, raw = entry
    return np.frombuffer(raw, dtype=BY_NAME[dtype].numpy).reshape(shape)


def write_safetensors(path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None,
                      dtype_names: dict[str, str] | None = None) -> Path:
    """A safetensors file written by hand (so tests can build valid and broken inputs alike)."""
    header: dict[str, object] = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    blobs = []
    for name, array in tensors.items():
        raw = np.ascontiguousarray(array).tobytes()
        dtype = (dtype_names or {}).get(name) or _st_name(array.dtype)
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    raw_header = json.dumps(header).encode()
    raw_header += b" " * (-len(raw_header) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(raw_header)) + raw_header + b"".join(blobs))
    return Path(path)


def _st_name(dtype) -> str:
    from fusectl.dtypes import from_numpy

    return from_numpy(np.dtype(dtype), "test").safetensors


def write_rules(path, text: str) -> Path:
    Path(path).write_text(text)
    return Path(path)


# Python source of an expression: the peak resident memory, in kB, of the process that evaluates
# it, from its own /proc/self/status (VmHWM, which starts afresh at exec). A child the tests start
# measures itself with it: its ru_maxrss starts at the peak of the process it was forked from (a
# pytest worker's 1.3-1.8 GB, seen for every pickle bomb), not at its own (13 MB).
OWN_PEAK_KB = "int(next(line for line in open('/proc/self/status') if line.startswith('VmHWM:')).split()[1])"


class CaseTimeout(BaseException):
    """Raised by time_limit's alarm: a BaseException, so no error handler can swallow it."""


@contextmanager
def time_limit(seconds: int):
    """Fail the test instead of hanging (a FIFO's open blocks forever)."""
    def on_alarm(signum, frame):
        raise CaseTimeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    except CaseTimeout:
        pytest.fail(f"did not finish in {seconds} s")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def refused(result, *needles: str, unwritten=()) -> None:
    """Exit 2, one ``error:`` line naming each needle, no traceback, nothing written."""
    assert result.exit_code == 2, f"exit {result.exit_code}\n{result.output}"
    assert result.stderr.startswith("error:"), result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert "internal error" not in result.stderr and "Traceback" not in result.output
    for needle in needles:
        assert needle in result.stderr, f"{needle!r} not in {result.stderr}"
    for path in unwritten:
        assert not os.path.lexists(path), f"{path} was written"


# ------------------------------------------------- bad input: the refusal contract, in full

LLAMA = "tiny-llama-gqa"
BF16 = "tiny-llama-gqa-bf16-sharded"


@pytest.fixture
def area(tmp_path):
    """``in/`` for inputs, ``out/`` as the output's folder."""
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    return tmp_path


def assert_refused(result, out: Path, before: dict, inputs_root: Path, *needles: str):
    """Exit 2, ``error:`` naming each needle, no traceback, ``out`` not written, nothing left
    beside it, and every byte under ``inputs_root`` as in ``before`` (a :func:`snapshot`)."""
    text = result.output
    assert result.exit_code == 2, f"exit {result.exit_code}\n{text}"
    assert result.stderr.startswith("error:"), result.stderr
    assert "Traceback" not in text
    assert "internal error" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in result.stderr, f"{needle!r} not named in: {result.stderr}"
    assert not os.path.lexists(out), f"{out} was written"
    assert leftovers(out.parent) == [], leftovers(out.parent)
    assert snapshot(inputs_root) == before, "the input changed"


def refuse_case(cli, area, ckpt: Path, *args, needles=(), out_name="result"):
    """``fusectl fuse CKPT ARGS -o area/out/OUT_NAME`` must be refused (:func:`assert_refused`)."""
    out = area / "out" / out_name
    before = snapshot(area / "in")
    result = cli("fuse", ckpt, *args, "-o", out)
    assert_refused(result, out, before, area / "in", *needles)
    return result


def llama_tensors(copy_fixture):
    """The tiny llama's tensors (name → numpy array), from a copy at ``in/llama-src``."""
    import safetensors.numpy

    src = copy_fixture(LLAMA, "llama-src")
    return safetensors.numpy.load_file(str(src / "model.safetensors"))


# a concat of q_proj [hidden, hidden] with down_proj [hidden, intermediate]: its shapes do not fit
BAD_CONCAT_RULES = """
version = 1
[[rule]]
name = "bad-concat"
op = "concat"
inputs = ["model.layers.{i:int}.self_attn.q_proj.weight", "model.layers.{i:int}.mlp.down_proj.weight"]
output = "model.layers.{i:int}.nonsense.weight"
"""


def megatron_rank(rank: int, world: int, port: int):
    """Start one CPU rank of megatron-core (gloo, fixtures/generate_megatron.py's patches) in a
    process that ``torch.multiprocessing`` spawned; returns that script's module (its variants,
    ``build_model``, ``pipeline_forward``). Needs torch and megatron-core."""
    import sys

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(FIXTURES))
    import generate_megatron

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    generate_megatron.patch_for_cpu()
    return generate_megatron


def assert_megatron_logits(script: str, variant: str, out: Path, world: int) -> None:
    """Run ``script`` (a test file whose ``__main__`` spawns ``world`` megatron-core ranks that
    load the save ``out`` and write their logits to ``out/logits.npy``) and assert those logits
    equal megatron-core's recorded ones for ``variant`` (fixtures/megatron/reference) within 1e-5."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, script, variant, str(out), str(world)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    logits = np.load(out / "logits.npy")
    reference = np.load(FIXTURES / "megatron" / "reference" / f"{variant}.npz")["logits"]
    assert logits.shape == reference.shape
    assert np.abs(logits - reference).max() <= 1e-5


def megatron_forward_of(g, model, rank_file: str, folder: str, first: bool) -> None:
    """One megatron-core rank: ``load_state_dict(strict=True)`` of the ``model`` of ``rank_file``
    (a ``model_optim_rng.pt``, read by ``torch.load(weights_only=True)``), its forward on
    ``g.reference_ids()``; the ``first`` rank saves the logits to ``folder/logits.npy``; then the
    process group ends. ``g``: fixtures/generate_megatron.py, as :func:`megatron_rank` returns it."""
    import argparse

    import torch
    import torch.distributed as dist

    torch.serialization.add_safe_globals([argparse.Namespace])
    model.load_state_dict(torch.load(rank_file, weights_only=True)["model"], strict=True)
    model.eval()
    with torch.no_grad():
        logits, _ = g.pipeline_forward(model, g.reference_ids(), grad=False)
    if logits is not None and first:
        np.save(os.path.join(folder, "logits.npy"), logits.numpy())
    dist.barrier()
    dist.destroy_process_group()
