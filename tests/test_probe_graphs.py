"""The probes' graphs are written as ONNX protobuf bytes without the onnx package: the bytes must
be those onnx.helper and onnx.numpy_helper give for the same graph (the real thing, built here
with onnx), for every op kind's probe and for each attribute and constant form; and checkpoint
mode must not import onnx (nor ml_dtypes through it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from fusectl.tensors import TensorSpec
from fusectl.dtypes import BY_NAME
from fusectl.verification.probes import OPSET, GraphBuilder, build_probe
from test_op_forms import EXAMPLES, KINDS, example_step

ROOT = Path(__file__).resolve().parent.parent


class OnnxHelperBuilder(GraphBuilder):
    """The same builder over onnx.helper: messages, serialized by onnx."""

    def const(self, array, stem="c"):
        name = self.fresh(stem)
        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def _node(self, op, inputs, outputs, attrs):
        self.nodes.append(helper.make_node(op, list(inputs), list(outputs), **attrs))

    def input(self, name, shape):
        self.inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape)))
        return name

    def output(self, value, name, spec=None):
        self._node("Identity", [value], [name], {})
        elem, shape = (TensorProto.FLOAT, None) if spec is None else (spec.dtype.onnx, list(spec.shape))
        self.outputs.append(helper.make_tensor_value_info(name, elem, shape))

    def model(self):
        graph = helper.make_graph(self.nodes, "probe", self.inputs, self.outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = 8
        return model.SerializeToString()


def _every_form(b: GraphBuilder) -> bytes:
    x = b.input("x", [2, 3])
    w = b.const(np.arange(6, dtype=np.float32).reshape(3, 2) - 2.5)
    b.const(np.zeros((0, 4), np.float32))  # empty
    s = b.const(np.float32(1.5))  # 0-d
    b.const(np.array([[1, 0], [0, 1]], np.bool_))
    parts = b.node("Split", [w, b.ints([1, 2])], 2, axis=0)
    t = b.one("Transpose", [parts[1]], perm=[1, 0])
    r = b.one("Reshape", [t, b.ints([-1, 2**40])], allowzero=1)  # negative, past 32 bits
    b.one("BatchNormalization", [x, s, s, s, s], epsilon=1e-5, momentum=None)  # None: left out
    n = b.one("ReduceSumSquare", [x, b.ints([-1])], keepdims=0)
    b.output(r, "y")
    b.output(n, "z", TensorSpec(BY_NAME["F16"], (2,)))
    return b.model()


def test_every_attribute_and_constant_form_is_written_as_onnx_writes_it():
    assert _every_form(GraphBuilder()) == _every_form(OnnxHelperBuilder())


def test_an_attribute_of_another_kind_is_refused():
    with pytest.raises(TypeError, match="probe attribute mode"):
        GraphBuilder().one("Pad", ["x"], mode="constant")


@pytest.mark.parametrize("kind", [k for k in KINDS if EXAMPLES[k][0].probed])
def test_each_op_kinds_probe_is_the_graph_onnx_helper_gives(kind, monkeypatch):
    step, inputs, outputs = example_step(kind)
    ours = build_probe(step, inputs, outputs, seed=0)
    for method in ("const", "_node", "input", "output", "model"):
        monkeypatch.setattr(GraphBuilder, method, getattr(OnnxHelperBuilder, method))
    theirs = build_probe(step, inputs, outputs, seed=0)
    assert ours.reference == theirs.reference and ours.candidate == theirs.candidate


def test_checkpoint_verify_imports_neither_onnx_nor_ml_dtypes(tmp_path):
    """A float32 checkpoint's verify (probes run on onnxruntime) loads no onnx, no onnx-ir and no
    ml_dtypes: the fixed cost of a small verify stays near start-up."""
    fused = tmp_path / "fused"
    code = ("import sys; from fusectl import api; "
            f"api.fuse({str(ROOT / 'fixtures/tiny-llama-gqa')!r}, ['llama-qkv', 'llama-gate-up'], {str(fused)!r}); "
            f"r = api.verify({str(ROOT / 'fixtures/tiny-llama-gqa')!r}, {str(fused)!r}); "
            "assert r.passed and any(c.kind == 'probe' for c in r.checks), r; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('onnx', 'onnx_ir', 'ml_dtypes', 'onnxruntime')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, check=True).stdout
    loaded = {m.split(".")[0] for m in eval(out)}
    assert loaded == {"onnxruntime"}


def test_bf16_probe_data_is_read_as_bits_and_widened_exactly(tmp_path):
    """A bf16 tensor held in a file reaches the probe as ml_dtypes' own float32 conversion, bit
    for bit (signed zeros, subnormals, infinities, NaN payloads), whole or cut to its columns."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from fusectl.executor import Evaluation
    from fusectl.io.checkpoint import open_checkpoint
    from fusectl.verification.probes import _columns, _probe_data

    bits = np.random.default_rng(3).integers(0, 1 << 16, (70, 90), dtype=np.uint16)
    bits[0, :6] = [0x0000, 0x8000, 0x0001, 0x7F80, 0xFF80, 0x7FC1]  # ±0, subnormal, ±inf, a NaN
    save_file({"w": bits.view(ml_dtypes.bfloat16)}, str(tmp_path / "m.safetensors"))
    tensor = open_checkpoint(str(tmp_path / "m.safetensors")).table["w"]
    want = bits.view(ml_dtypes.bfloat16).astype(np.float32)
    for windowed, cut in ((False, lambda a: a), (True, _columns)):
        got = _probe_data(Evaluation([tensor]), tensor, windowed)
        assert got.dtype == np.float32 and got.tobytes() == np.ascontiguousarray(cut(want)).tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64])
def test_probe_data_of_a_dtype_numpy_has_is_the_tensor_read_whole_or_cut(tmp_path, dtype):
    """A float32/float16/int64 tensor's window comes from a mapping of its file range: the same
    values as the tensor read whole and cut."""
    from safetensors.numpy import save_file

    from fusectl.executor import Evaluation
    from fusectl.io.checkpoint import open_checkpoint
    from fusectl.verification.probes import _columns, _probe_data

    values = (np.random.default_rng(5).standard_normal((70, 90)) * 100).astype(dtype)
    save_file({"w": values}, str(tmp_path / "m.safetensors"))
    tensor = open_checkpoint(str(tmp_path / "m.safetensors")).table["w"]
    for windowed, want in ((False, values), (True, _columns(values))):
        got = _probe_data(Evaluation([tensor]), tensor, windowed)
        assert got.dtype == dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


def test_windowed_probe_data_of_a_truncated_file_is_an_error_naming_it(tmp_path):
    """The window is copied from a mapping of the file; a file found shorter than its tensor is
    read instead, which names it (a mapping past the end would end the process with SIGBUS)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from fusectl.errors import CheckpointError
    from fusectl.executor import Evaluation
    from fusectl.io.checkpoint import open_checkpoint
    from fusectl.verification.probes import _probe_data

    path = tmp_path / "m.safetensors"
    save_file({"w": np.ones((70, 90), ml_dtypes.bfloat16)}, str(path))
    tensor = open_checkpoint(str(path)).table["w"]
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(CheckpointError, match="m.safetensors: expected .* the file is truncated"):
        _probe_data(Evaluation([tensor]), tensor, True)
