"""bfloat16 models on onnxruntime's CPU provider (fusectl.verification.upcast): a bf16 type anywhere in
the model is found from the protobuf alone, and the upcast model is all float32 — initializers,
Constants, Cast targets, declared types — computing what the bf16 model computes."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from fusectl.errors import CheckpointError
from fusectl.verification.model_check import verify_models
from fusectl.verification.upcast import has_bfloat16, upcast_bfloat16

F, B, H = TensorProto.FLOAT, TensorProto.BFLOAT16, TensorProto.FLOAT16
ON_CPU = pytest.mark.skipif("CUDAExecutionProvider" in onnxruntime.get_available_providers(),
                            reason="with CUDA, bf16 runs natively")


def _bf16(values) -> np.ndarray:
    """``values`` rounded to bfloat16, as float32 (what a bf16 tensor holds)."""
    return np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _bf16_tensor(name: str, values) -> TensorProto:
    values = _bf16(values)
    return helper.make_tensor(name, B, list(values.shape), values.ravel().tolist())


def _save(path: Path, nodes, inputs, outputs, initializers=(), value_info=()) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers), value_info=list(value_info))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom", 1)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


def _vi(name: str, elem_type: int = F, shape=(2,)):
    return helper.make_tensor_value_info(name, elem_type, list(shape))


def _identity(path: Path, x_type=F, y_type=None, **kw) -> Path:
    """x -> Identity -> y, with the given declared types; extra nodes/initializers/value_info in ``kw``."""
    x = x_type if isinstance(x_type, onnx.ValueInfoProto) else _vi("x", x_type)
    if not isinstance(y_type, onnx.ValueInfoProto):
        y_type = _vi("y", y_type or (x_type if isinstance(x_type, int) else F))
    y = y_type
    return _save(path, [helper.make_node("Identity", ["x"], ["y"]), *kw.pop("nodes", ())], [x], [y], **kw)


def _branch(initializer: TensorProto) -> onnx.GraphProto:
    return helper.make_graph([helper.make_node("Identity", [initializer.name], ["t"])], "branch", [],
                             [helper.make_tensor_value_info("t", initializer.data_type, [2])], [initializer])


MODELS = {
    "float32 only": (False, lambda p: _identity(
        p, initializers=[numpy_helper.from_array(np.ones(2, np.float32), "w")])),
    "float16 Cast": (False, lambda p: _identity(p, nodes=[helper.make_node("Cast", ["x"], ["h"], to=H)])),
    "bf16 code as another op's attribute": (
        False, lambda p: _identity(p, nodes=[helper.make_node("Quantize", ["x"], ["q"], domain="custom", to=B)])),
    "sequence of float": (False, lambda p: _identity(p, y_type=helper.make_tensor_sequence_value_info("y", F, [2]))),
    "map of int64 to float": (False, lambda p: _identity(p, y_type=helper.make_value_info(
        "y", helper.make_map_type_proto(TensorProto.INT64, helper.make_tensor_type_proto(F, [2]))))),
    "input without a declared type": (False, lambda p: _identity(p, x_type=helper.make_empty_tensor_value_info("x"))),
    "bf16 input": (True, lambda p: _identity(p, x_type=B)),
    "bf16 output": (True, lambda p: _identity(p, y_type=B)),
    "bf16 value_info": (True, lambda p: _identity(p, value_info=[_vi("y", B)])),
    "bf16 sparse input": (True, lambda p: _identity(p, x_type=helper.make_sparse_tensor_value_info("x", B, [2]))),
    "sequence of bf16": (True, lambda p: _identity(p, y_type=helper.make_tensor_sequence_value_info("y", B, [2]))),
    "optional bf16": (True, lambda p: _identity(p, y_type=helper.make_value_info(
        "y", helper.make_optional_type_proto(helper.make_tensor_type_proto(B, [2]))))),
    "map of int64 to bf16": (True, lambda p: _identity(p, y_type=helper.make_value_info(
        "y", helper.make_map_type_proto(TensorProto.INT64, helper.make_tensor_type_proto(B, [2]))))),
    "bf16 initializer": (True, lambda p: _identity(p, initializers=[_bf16_tensor("w", [1, 2])])),
    "Cast to bf16": (True, lambda p: _identity(p, nodes=[helper.make_node("Cast", ["x"], ["b"], to=B)])),
    "bf16 Constant": (True, lambda p: _identity(p, nodes=[helper.make_node("Constant", [], ["c"],
                                                                           value=_bf16_tensor("c", [1, 2]))])),
    "bf16 initializer in an If branch": (True, lambda p: _identity(p, nodes=[helper.make_node(
        "If", ["cond"], ["z"], then_branch=_branch(_bf16_tensor("b", [1, 2])),
        else_branch=_branch(numpy_helper.from_array(np.ones(2, np.float32), "e")))])),
    "bf16 initializer in a graphs attribute": (True, lambda p: _identity(p, nodes=[helper.make_node(
        "Holder", [], ["h"], domain="custom", bodies=[_branch(_bf16_tensor("b", [1, 2]))])])),
}


@pytest.mark.parametrize("case", sorted(MODELS))
def test_has_bfloat16_finds_every_place_a_bf16_type_can_be(tmp_path, case):
    expected, build = MODELS[case]
    assert has_bfloat16(str(build(tmp_path / "m.onnx"))) is expected


def test_has_bfloat16_does_not_load_external_data(tmp_path):
    """A bf16 initializer whose data file is missing is still recognised from its declared type."""
    tensor = _bf16_tensor("w", [1, 2])
    tensor.data_location = TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "missing.bin"
    tensor.ClearField("int32_data")
    assert has_bfloat16(str(_identity(tmp_path / "m.onnx", initializers=[tensor])))


def test_has_bfloat16_refuses_a_file_that_is_not_onnx(tmp_path):
    path = tmp_path / "junk.onnx"
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=r"junk\.onnx: not a readable ONNX model"):
        has_bfloat16(str(path))


def test_has_bfloat16_refuses_a_folder(tmp_path):
    with pytest.raises(CheckpointError, match="is a folder, not a regular file"):
        has_bfloat16(str(tmp_path))


# ----------------------------------------------------------------------------------- upcast

W, C = [1.5, -2.0], [0.3, 3.1]


def _bf16_model(path: Path, w=W, c=C) -> Path:
    """y = float(bf16(x) * w + c): a bf16 initializer, a bf16 Constant, a Cast to bf16 and back."""
    return _save(path, [
        helper.make_node("Cast", ["x"], ["xb"], to=B),
        helper.make_node("Constant", [], ["c"], value=_bf16_tensor("cv", c)),
        helper.make_node("Mul", ["xb", "w"], ["m"]),
        helper.make_node("Add", ["m", "c"], ["yb"]),
        helper.make_node("Cast", ["yb"], ["y"], to=F),
    ], [_vi("x")], [_vi("y")], initializers=[_bf16_tensor("w", w)], value_info=[_vi("m", B)])


def test_the_upcast_model_holds_no_bfloat16(tmp_path):
    upcast = onnx.load_from_string(upcast_bfloat16(str(_bf16_model(tmp_path / "m.onnx"))))
    (tmp_path / "up.onnx").write_bytes(upcast.SerializeToString())
    assert not has_bfloat16(str(tmp_path / "up.onnx"))
    (w,) = upcast.graph.initializer
    assert w.data_type == F
    np.testing.assert_array_equal(numpy_helper.to_array(w), _bf16(W))
    const = next(n for n in upcast.graph.node if n.op_type == "Constant")
    value = numpy_helper.to_array(const.attribute[0].t)
    assert value.dtype == np.float32
    np.testing.assert_array_equal(value, _bf16(C))
    assert [a.i for n in upcast.graph.node if n.op_type == "Cast" for a in n.attribute] == [F, F]


def test_the_upcast_model_runs_on_cpu_with_the_bf16_weights(tmp_path):
    data = upcast_bfloat16(str(_bf16_model(tmp_path / "m.onnx")))
    sess = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    x = np.array([2.0, 0.5], np.float32)
    (y,) = sess.run(None, {"x": x})
    # the weights keep their bf16 rounding; only the arithmetic is float32
    np.testing.assert_allclose(y, x * _bf16(W) + _bf16(C), rtol=1e-6)


@ON_CPU
def test_verify_on_cpu_tells_apart_bf16_models_whose_constants_differ(cli, tmp_path):
    a = _bf16_model(tmp_path / "a.onnx")
    ok = cli("verify", a, _bf16_model(tmp_path / "same.onnx"), "--provider", "cpu")
    assert ok.exit_code == 0, ok.output
    assert "bf16 upcast to float32" in ok.stdout
    other = cli("verify", a, _bf16_model(tmp_path / "b.onnx", c=[0.3, 4.0]), "--provider", "cpu")
    assert other.exit_code == 1, other.output
    assert "FAIL output y" in other.stdout


@ON_CPU
def test_bf16_arrays_given_to_the_library_are_fed_as_float32(tmp_path):
    model = _save(tmp_path / "m.onnx", [helper.make_node("Mul", ["x", "w"], ["y"])], [_vi("x", B)], [_vi("y", B)],
                  initializers=[_bf16_tensor("w", W)])
    x = np.array([2.0, -1.0], ml_dtypes.bfloat16)
    report = verify_models(str(model), str(model), provider="cpu", inputs={"x": x})
    assert report.passed and report.precision == "fp32-upcast"
    assert report.inputs == [{"name": "x", "dtype": "float32", "shape": [2], "source": "file"}]


def _if_model(path: Path) -> Path:
    """y = float(If(cond, then: bf16(x) + b, else: bf16(x))) with ``b`` a bf16 initializer of the branch."""
    then = helper.make_graph([helper.make_node("Add", ["xb", "b"], ["t"])], "then", [], [_vi("t", B)],
                             [_bf16_tensor("b", [1.0, 2.0])])
    other = helper.make_graph([helper.make_node("Identity", ["xb"], ["e"])], "else", [], [_vi("e", B)])
    return _save(path, [helper.make_node("Cast", ["x"], ["xb"], to=B),
                        helper.make_node("If", ["cond"], ["yb"], then_branch=then, else_branch=other),
                        helper.make_node("Cast", ["yb"], ["y"], to=F)],
                 [_vi("x"), helper.make_tensor_value_info("cond", TensorProto.BOOL, [])], [_vi("y")])


@ON_CPU
def test_a_bf16_initializer_inside_a_subgraph_is_upcast_too(tmp_path):
    model = str(_if_model(tmp_path / "m.onnx"))
    report = verify_models(model, model, provider="cpu",
                           inputs={"x": np.array([1.0, 2.0], np.float32), "cond": np.array(True)})
    assert report.passed


def _loop_model(path: Path) -> Path:
    """y = float(Loop n times: v = v + v, starting from bf16(x)): the body's inputs are bf16."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"]), helper.make_node("Add", ["v_in", "v_in"], ["v_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("c_in", TensorProto.BOOL, []), _vi("v_in", B)],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []), _vi("v_out", B)])
    return _save(path, [helper.make_node("Cast", ["x"], ["xb"], to=B),
                        helper.make_node("Loop", ["n", "cond", "xb"], ["vb"], body=body),
                        helper.make_node("Cast", ["vb"], ["y"], to=F)],
                 [_vi("x"), helper.make_tensor_value_info("n", TensorProto.INT64, []),
                  helper.make_tensor_value_info("cond", TensorProto.BOOL, [])], [_vi("y")])


@ON_CPU
def test_bf16_loop_carried_values_are_upcast_too(tmp_path):
    model = str(_loop_model(tmp_path / "m.onnx"))
    report = verify_models(model, model, provider="cpu", inputs={
        "x": np.array([1.0, 2.0], np.float32), "n": np.array(2, np.int64), "cond": np.array(True)})
    assert report.passed
