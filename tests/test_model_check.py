"""``verify A.onnx B.onnx`` called as a library (verification/model_check.py): the model-mode
report (its ``dims`` in JSON, the inputs line in text), the bfloat16 inputs a CPU run upcasts,
where the random integer ranges come from when onnx-ir cannot read a graph that onnxruntime runs,
and outputs one side lacks.

Through ``fusectl verify``: test_verify.py (model mode), test_verify_edges.py (outputs that
differ in kind, length or shape, dims, seeds), test_verify_hostile.py (models verify cannot run,
bad --inputs), test_verify_int_ranges.py (ranges read from the graph) and test_upcast.py."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper

from fusectl.errors import VerifyError
from fusectl.verification.model_check import (ModelVerifyReport, _Float32Inputs, _integer_ranges, model_input_paths,
                                              verify_models)
from fusectl.verification.report import Check

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _save(path: Path, nodes, inputs, outputs, value_info=(), opsets=(("", 17),)) -> str:
    graph = helper.make_graph(nodes, "g", inputs, outputs, value_info=list(value_info))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return str(path)


def _identity(path: Path, outputs=("y",), dtype=F, shape=(2, "n")) -> str:
    """Each of ``outputs`` = x (of ``dtype`` and ``shape``)."""
    return _save(path, [helper.make_node("Identity", ["x"], [o]) for o in outputs],
                 [helper.make_tensor_value_info("x", dtype, list(shape))],
                 [helper.make_tensor_value_info(o, dtype, list(shape)) for o in outputs])


def test_the_report_lists_inputs_dims_and_random_integer_ranges():
    report = ModelVerifyReport("model", "a.onnx", "b.onnx", "CPUExecutionProvider", dims={"batch": 2, "seq": 5},
                               inputs=[{"name": "ids", "dtype": "int64", "shape": [2, 5], "source": "random",
                                        "range": [0, 99], "range_from": "Gather of 'embed'"},
                                       {"name": "mask", "dtype": "int64", "shape": [2, 5], "source": "file"}])
    report.checks.append(Check("output", "logits", True, detail="equal"))
    lines = report.to_text().split("\n")
    assert lines[0] == "verify a.onnx -> b.onnx (model) on CPUExecutionProvider, seed 0"
    assert lines[1] == "  inputs: ids int64[2, 5], mask int64[2, 5] from file; dims batch=2, seq=5"
    assert lines[2] == "  random integers: ids in [0, 99] (Gather of 'embed')"
    data = report.to_json()
    assert data["dims"] == {"batch": 2, "seq": 5} and list(data)[-1] == "dims"
    assert data["inputs"][0]["range"] == [0, 99]


def test_a_model_without_inputs_says_none():
    assert ModelVerifyReport("model", "a", "b").to_text().split("\n")[1] == "  inputs: none"


def test_bfloat16_inputs_are_seen_and_fed_as_float32():
    arrays = {"x": np.ones(3, ml_dtypes.bfloat16), "ids": np.arange(2, dtype=np.int64)}
    upcast = _Float32Inputs(arrays)
    assert len(upcast) == 2 and list(upcast) == ["x", "ids"]
    assert upcast.declared == {"x": ((3,), np.dtype(np.float32)), "ids": ((2,), np.dtype(np.int64))}
    assert upcast["x"].dtype == np.float32 and upcast["x"].tolist() == [1.0, 1.0, 1.0]
    assert upcast["ids"].dtype == np.int64 and upcast["ids"].tolist() == [0, 1]


def test_a_model_reads_its_external_data_files_too(tmp_path):
    import onnx
    from onnx import numpy_helper

    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", F, [64])], [helper.make_tensor_value_info("y", F, [64])],
                              [numpy_helper.from_array(np.ones(64, np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.data",
                    size_threshold=0)
    assert model_input_paths(str(tmp_path / "m.onnx")) == [str(tmp_path / "m.onnx"), str(tmp_path / "m.data")]
    assert verify_models(str(tmp_path / "m.onnx"), str(tmp_path / "m.onnx"), provider="cpu").passed


def test_integer_ranges_are_read_only_for_inputs_that_need_them(tmp_path):
    garbage = tmp_path / "g.onnx"
    garbage.write_bytes(b"not onnx")
    assert _integer_ranges([str(garbage)], []) == {}  # nothing to read: the graph is not opened


def test_a_graph_onnx_ir_cannot_read_gives_integer_inputs_the_default_range(tmp_path):
    """onnxruntime runs a graph with a sequence of maps inside; onnx-ir does not represent it, so
    the random integer input takes the default range, saying why."""
    maps = helper.make_sequence_type_proto(helper.make_map_type_proto(I64, helper.make_tensor_type_proto(F, [])))
    model = _save(tmp_path / "zipmap.onnx",
                  [helper.make_node("Identity", ["ids"], ["y"]),
                   helper.make_node("ZipMap", ["x"], ["m"], domain="ai.onnx.ml", classlabels_int64s=[0, 1])],
                  [helper.make_tensor_value_info("ids", I64, [3]), helper.make_tensor_value_info("x", F, [1, 2])],
                  [helper.make_tensor_value_info("y", I64, [3])], value_info=[helper.make_value_info("m", maps)],
                  opsets=(("", 17), ("ai.onnx.ml", 3)))
    report = verify_models(model, model, provider="cpu")
    assert report.passed
    (ids,) = [i for i in report.inputs if i["name"] == "ids"]
    assert ids["range"] == [0, 1] and ids["range_from"] == "the default: onnx-ir cannot read the graph"


def test_outputs_one_side_lacks_fail_by_name_and_the_rest_compare(tmp_path):
    a = _identity(tmp_path / "a.onnx", outputs=("y", "z"))
    b = _identity(tmp_path / "b.onnx", outputs=("y", "w"))
    report = verify_models(a, b, provider="cpu", dims={"n": 3})
    failed = {c.name: c.detail for c in report.checks if not c.passed}
    assert failed == {"z": f"{b} has no output 'z'", "w": f"{a} has no output 'w'"}
    assert [c.name for c in report.checks if c.passed] == ["y"]
    assert report.dims == {"n": 3} and report.inputs[0]["shape"] == [2, 3]


def test_the_seed_makes_the_random_inputs(tmp_path):
    model = _identity(tmp_path / "m.onnx", dtype=F, shape=(4,))
    assert verify_models(model, model, provider="cpu", seed=3).seed == 3
    with pytest.raises(VerifyError, match="seed"):
        verify_models(model, model, provider="cpu", seed=-1)


def test_given_inputs_are_fed_and_reported_from_file(tmp_path):
    model = _identity(tmp_path / "m.onnx", shape=(4,))
    report = verify_models(model, model, provider="cpu", inputs={"x": np.arange(4, dtype=np.float32)})
    assert report.inputs == [{"name": "x", "dtype": "float32", "shape": [4], "source": "file"}]


def test_a_bfloat16_model_on_cpu_runs_upcast_with_bfloat16_tolerances(tmp_path):
    model = _identity(tmp_path / "bf16.onnx", dtype=TensorProto.BFLOAT16, shape=(4,))
    report = verify_models(model, model, provider="cpu", inputs={"x": np.ones(4, ml_dtypes.bfloat16)})
    assert report.precision == "fp32-upcast" and report.passed
    (check,) = report.checks
    assert (check.comparison.atol, check.comparison.rtol) == (1e-2, 1e-2)
    assert check.comparison.dtype == "float32"  # compared as the upcast model computes it
