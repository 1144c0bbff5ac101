"""SPEC §5 round trip, end to end through files: for random checkpoints, dtypes and rules,
``unfuse(fuse(x))`` is bitwise identical to x — single-file, sharded and npz outputs."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st

from fusectl.cli import main
from fusectl.dtypes import ARRAY_DTYPES
from fusectl.io.checkpoint import open_checkpoint
from fusectl.io.formats.safetensors_file import SafetensorsWriter
from fusectl.tensors import TensorSpec

DTYPES = sorted(n for n in ARRAY_DTYPES if n != "BOOL")  # BOOL bytes other than 0/1 are not bools


def raw(dtype: str, shape, rng) -> np.ndarray:
    """Random bytes viewed as the dtype: NaN payloads, -0 and subnormals included."""
    d = ARRAY_DTYPES[dtype].numpy
    n = int(np.prod(shape)) * d.itemsize
    return rng.integers(0, 256, n, dtype=np.uint8).view(d).reshape(shape)


def write(path: Path, arrays: dict[str, np.ndarray], dtype: str) -> None:
    entries = [(n, TensorSpec(ARRAY_DTYPES[dtype], a.shape)) for n, a in arrays.items()]
    writer = SafetensorsWriter(str(path), entries, {})
    for n, a in arrays.items():
        writer.write(n, a)
    writer.close()


def contents(path: Path) -> dict[str, tuple[str, tuple, bytes]]:
    table = open_checkpoint(str(path)).table
    out = {}
    for name in table.names():
        tensor = table[name]
        out[name] = (str(tensor.spec.dtype), tensor.spec.shape, np.ascontiguousarray(tensor.read()).tobytes())
    return out


# each case: a rules file body and a function (layers, rows, cols, heads, rng, dtype) -> tensors
CASES = {
    "concat-unequal": ('[[rule]]\nop = "concat"\ninputs = ["{p*}.l{i:int}.a", "{p*}.l{i:int}.b"]\n'
                       'output = "{p*}.l{i:int}.ab"\n',
                       lambda L, r, c, h, g, d: {f"m.l{i}.{x}": raw(d, (r * (1 + (x == "b")), c), g)
                                                for i in range(L) for x in "ab"}),
    "concat-over": ('[[rule]]\nop = "concat"\ninput = "e.{k:int}.w"\nover = "k"\noutput = "all.w"\naxis = 1\n',
                    lambda L, r, c, h, g, d: {f"e.{i}.w": raw(d, (r, c), g) for i in range(L + 1)}),
    "interleave": ('[[rule]]\nop = "interleave"\ninputs = ["{p*}.q", "{p*}.k", "{p*}.v"]\noutput = "{p*}.qkv"\n'
                   'groups = 2\n', lambda L, r, c, h, g, d: {f"x{i}.{n}": raw(d, (2 * r, c), g)
                                                         for i in range(L) for n in "qkv"}),
    "deinterleave": ('[[rule]]\nop = "deinterleave"\ninput = "{p*}.qkv"\noutputs = ["{p*}.q", "{p*}.k", "{p*}.v"]\n'
                     'groups = 2\n', lambda L, r, c, h, g, d: {f"x{i}.qkv": raw(d, (6 * r, c), g) for i in range(L)}),
    "stack-over": ('[[rule]]\nop = "stack"\ninput = "{p*}.experts.{e:int}.w"\nover = "e"\noutput = "{p*}.experts.w"\n',
                   lambda L, r, c, h, g, d: {f"b.experts.{e}.w": raw(d, (r, c), g) for e in range(L + 1)}),
    "transpose": ('[[rule]]\nop = "transpose"\ninput = "{n}.w"\noutput = "{n}.wt"\n',
                  lambda L, r, c, h, g, d: {f"t{i}.w": raw(d, (r, c), g) for i in range(L)}),
    "reshape": ('[[rule]]\nop = "reshape"\ninput = "{n}.w"\noutput = "{n}.flat"\nshape = [-1]\n',
                lambda L, r, c, h, g, d: {f"t{i}.w": raw(d, (r, c), g) for i in range(L)}),
    "reorder": ('[[rule]]\nop = "reorder"\ninput = "{n}.w"\noutput = "{n}.w"\nchunks = 4\norder = [0, 3, 1, 2]\n',
                lambda L, r, c, h, g, d: {f"t{i}.w": raw(d, (4 * r, c), g) for i in range(L)}),
    "rope": ('[[rule]]\nop = "rope_permute"\ninput = "{n}.q"\noutput = "{n}.q"\nheads = 2\nto = "hf"\n',
             lambda L, r, c, h, g, d: {f"t{i}.q": raw(d, (4 * r, c), g) for i in range(L)}),
    "split": ('[[rule]]\nop = "split"\ninput = "{n}.ab"\noutputs = ["{n}.a", "{n}.b"]\nsizes = [1, 2]\naxis = 0\n',
              lambda L, r, c, h, g, d: {f"t{i}.ab": raw(d, (3, c), g) for i in range(L)}),
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=st.sampled_from(sorted(CASES)),
    dtype=st.sampled_from(DTYPES),
    layers=st.integers(1, 3),
    rows=st.integers(1, 3),
    cols=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    output=st.sampled_from(["file.safetensors", "sharded", "out.npz"]),
)
def test_unfuse_of_fuse_is_bitwise_identical(case, dtype, layers, rows, cols, seed, output):
    body, make = CASES[case]
    rng = np.random.default_rng(seed)
    arrays = make(layers, rows, cols, 2, rng, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = tmp / "in.safetensors"
        write(src, arrays, dtype)
        rules = tmp / "r.toml"
        rules.write_text("version = 1\n" + body)
        fused = tmp / output
        extra = ["--max-shard-size", "64"] if output == "sharded" else []
        runner = CliRunner()
        result = runner.invoke(main, ["fuse", str(src), "-r", str(rules), "-o", str(fused), "--quiet", *extra])
        assert result.exit_code == 0, result.output
        if output == "sharded":
            written = contents(fused)
            if len(written) > 1 and sum(len(v[2]) for v in written.values()) > 64:
                assert (fused / "model.safetensors.index.json").exists()
        back = tmp / "back.safetensors"
        result = runner.invoke(main, ["unfuse", str(fused), "-o", str(back), "--quiet"])
        assert result.exit_code == 0, result.output
        assert contents(back) == contents(src)
