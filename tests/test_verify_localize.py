"""``verify A.onnx B.onnx --localize``: the first node whose output differs (verification/localize.py,
issue 31).

The graphs are the torch exporters' fixtures (fixtures/onnx/llama, bert, lstm) and their fused
exports, made here as ``test_onnx_export.py`` makes them (``fuse`` with the model's presets, then
``export --graph``). One element of one weight of the candidate is changed; localization must
name the node that reads that weight: a fused MatMul (its output paired with the parts' outputs
side by side, through the plan), a MatMul left as the exporter made it (paired by name) or an
LSTM. The node expected is found here from the graph itself: the one that multiplies by the
weight, directly or through its Transpose.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import run_cli
from fusectl import api
from fusectl.errors import VerifyError
from fusectl.onnx.graph import load_model
from fusectl.verification import localize as localize_module
from fusectl.verification.localize import Localization, localize_models, pair_values
from fusectl.verification.model_check import verify_models
from fusectl.verification.runner import CPU
from fusectl.verification.runs import OutputChecks

ONNX = Path(__file__).resolve().parent.parent / "fixtures" / "onnx"
PRESETS = {"llama": ["llama-qkv", "llama-gate-up"], "bert": ["bert-qkv"], "lstm": ["lstm-to-onnx"]}
KEYS = {"first", "compared", "paired_by", "segments", "note"}
FIRST_KEYS = {"node", "op_type", "output", "reference_value", "candidate_value", "weights", "rule", "comparison"}


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """The fused export of each fixture, by name."""
    folder = tmp_path_factory.mktemp("exports")
    made = {}
    for name, presets in PRESETS.items():
        fused, out = folder / f"{name}-fused", folder / f"{name}.onnx"
        result = run_cli("fuse", ONNX / name, *[x for p in presets for x in ("-r", p)], "-o", fused, "--quiet")
        assert result.exit_code == 0, result.stderr
        result = run_cli("export", fused, "--graph", ONNX / name / "model.onnx", "-o", out)
        assert result.exit_code == 0, result.stderr
        made[name] = out
    return made


def _changed(source: Path, out: Path, weight: str, index: tuple[int, ...], delta: float = 0.5) -> Path:
    """``source`` with one element of initializer ``weight`` moved by ``delta``."""
    model = onnx.load(str(source))
    init = next(i for i in model.graph.initializer if i.name == weight)
    array = numpy_helper.to_array(init).copy()
    array[index] += delta
    init.CopyFrom(numpy_helper.from_array(array, weight))
    onnx.save(model, str(out))
    return out


def _reader_of(path: Path, weight: str) -> onnx.NodeProto:
    """The node that computes with ``weight`` (directly or through a Transpose of it)."""
    nodes = onnx.load(str(path)).graph.node
    names = {weight} | {n.output[0] for n in nodes if n.op_type == "Transpose" and n.input[0] == weight}
    (node,) = [n for n in nodes if n.op_type != "Transpose" and names & set(n.input)]
    return node


def _feeds(name: str) -> dict[str, np.ndarray]:
    io = np.load(ONNX / name / "io.npz")
    model = onnx.load(str(ONNX / name / "model.onnx"))
    return {i.name: io[i.name] for i in model.graph.input}


@pytest.mark.parametrize("name,weight,index,rule,by", [
    ("llama", "model.layers.1.mlp.gate_up_proj.weight", (40, 3), "mlp-gate-up", "plan"),
    ("llama", "model.layers.0.self_attn.qkv_proj.weight", (50, 5), "attn-qkv", "plan"),
    ("llama", "model.layers.0.self_attn.o_proj.weight", (3, 9), None, "name"),
    ("bert", "encoder.layer.1.attention.self.qkv.weight", (70, 3), "bert-qkv", "plan"),
    ("bert", "encoder.layer.0.intermediate.dense.weight", (5, 7), None, "name"),
    ("lstm", "rnn.W_l1", (0, 5, 3), "W-directions", "name"),
])
def test_one_changed_weight_element_is_localized_to_the_node_that_reads_it(tmp_path, exports, name, weight,
                                                                            index, rule, by):
    bad = _changed(exports[name], tmp_path / "bad.onnx", weight, index)
    report = tmp_path / "r.json"
    result = run_cli("verify", ONNX / name / "model.onnx", bad, "--inputs", ONNX / name / "io.npz",
                     "--report", report)
    assert result.exit_code == 1, result.stderr
    doc = json.loads(report.read_text())["localization"]
    assert set(doc) == KEYS and set(doc["first"]) == FIRST_KEYS
    first, node = doc["first"], _reader_of(bad, weight)
    assert (first["node"], first["op_type"], first["output"]) == (node.name, node.op_type, node.output[0])
    assert first["candidate_value"] == node.output[0]
    assert weight in first["weights"]
    if rule is None:
        assert first["rule"] is None
    else:
        assert rule in first["rule"].split(", ")
    comparison = first["comparison"]
    assert not comparison["passed"] and comparison["mismatches"] > 0 and comparison["max_abs"] > 1e-4
    # through the plan, the reference side is the parts' outputs side by side
    assert first["reference_value"].startswith("concat(") == (by == "plan")
    assert doc["compared"] > 0 and (doc["paired_by"]["plan"] > 0 or by == "name")
    assert f"localize: first divergence at node {node.name} ({node.op_type})" in result.stdout


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_an_unchanged_export_localizes_nothing(tmp_path, exports, name):
    report = tmp_path / "r.json"
    result = run_cli("verify", ONNX / name / "model.onnx", exports[name], "--inputs", ONNX / name / "io.npz",
                     "--localize", "--report", report)
    assert result.exit_code == 0, result.stdout + result.stderr
    doc = json.loads(report.read_text())["localization"]
    assert doc["first"] is None
    pairs, unpaired = pair_values(load_model(str(ONNX / name / "model.onnx")).graph,
                                  load_model(str(exports[name])).graph)
    assert doc["compared"] == len(pairs) == sum(doc["paired_by"].values()) and unpaired == 0
    assert doc["paired_by"]["plan"] == {"llama": 14, "bert": 10, "lstm": 0}[name]
    assert "localize: no paired intermediate differs" in result.stdout


def test_localization_runs_on_a_failure_by_default_and_never_with_no_localize(tmp_path, exports):
    bad = _changed(exports["bert"], tmp_path / "bad.onnx", "encoder.layer.0.intermediate.dense.weight", (5, 7))
    reference, io = ONNX / "bert" / "model.onnx", ONNX / "bert" / "io.npz"
    report = tmp_path / "r.json"
    result = run_cli("verify", reference, bad, "--inputs", io, "--no-localize", "--report", report)
    assert result.exit_code == 1 and "localize:" not in result.stdout
    assert json.loads(report.read_text())["localization"] is None
    # a pass does not localize unless asked
    result = run_cli("verify", reference, exports["bert"], "--inputs", io, "--report", report)
    assert result.exit_code == 0 and json.loads(report.read_text())["localization"] is None


def test_segments_are_bounded_and_the_search_stops_at_the_first_that_diverges(tmp_path, exports, monkeypatch):
    """With room for one value a segment, each segment exposes one pair of each graph; the search
    ends with the segment of the changed layer, before the layers after it."""
    asked = []
    run = localize_module._Segments.run

    def counting(self, names, feeds):
        asked.append(len(names))
        return run(self, names, feeds)

    monkeypatch.setattr(localize_module, "FIRST_SEGMENT", 1)
    monkeypatch.setattr(localize_module, "SEGMENT_BYTES", 1)
    monkeypatch.setattr(localize_module._Segments, "run", counting)
    weight = "model.layers.0.self_attn.o_proj.weight"
    bad = _changed(exports["llama"], tmp_path / "bad.onnx", weight, (3, 9))
    result = localize_models(str(ONNX / "llama" / "model.onnx"), str(bad), _feeds("llama"), provider=CPU)
    assert result.first["node"] == _reader_of(bad, weight).name
    assert result.segments == result.compared and max(asked) <= 3  # a plan pair reads up to 3 reference values
    assert result.compared < sum(result.paired_by.values())


def test_a_candidate_without_provenance_names_no_rule_and_says_why(tmp_path, exports):
    model = onnx.load(str(exports["llama"]))
    assert [p.key for p in model.metadata_props] == ["fusectl"]  # export records the plan
    del model.metadata_props[:]
    weight = "model.layers.1.mlp.gate_up_proj.weight"
    plain = tmp_path / "plain.onnx"
    onnx.save(model, str(plain))
    bad = _changed(plain, tmp_path / "bad.onnx", weight, (40, 3))
    result = localize_models(str(ONNX / "llama" / "model.onnx"), str(bad), _feeds("llama"), provider=CPU)
    assert result.first["weights"] == [weight] and result.first["rule"] is None
    assert "records no fusectl provenance" in result.note


def test_localize_is_for_models_only_and_takes_a_bool():
    result = run_cli("verify", ONNX / "bert", ONNX / "bert", "--localize")
    assert result.exit_code == 2 and "--localize applies to two .onnx models" in result.stderr
    with pytest.raises(VerifyError, match="OutputChecks.localize"):
        OutputChecks(localize="yes")
    with pytest.raises(VerifyError, match="OutputChecks.localize applies to two .onnx models"):
        api.verify(ONNX / "bert", ONNX / "bert", output_checks=OutputChecks(localize=False))


def test_the_text_names_the_node_its_weights_and_the_pairs():
    doc = Localization(first={"node": "mm", "op_type": "MatMul", "output": "y",
                              "reference_value": "concat(a, b, axis=-1)", "candidate_value": "y",
                              "weights": ["w"], "rule": "qkv",
                              "comparison": {"name": "y", "dtype": "float32", "shape": [2, 4], "passed": False,
                                             "atol": 1e-5, "rtol": 1e-5, "mismatches": 1, "max_abs": 0.5,
                                             "mean_abs": 0.1, "p99_abs": 0.5, "max_rel": 2.0, "mean_rel": 0.2,
                                             "p99_rel": 2.0, "min_atol": 0.5, "min_rtol": 2.0,
                                             "first_mismatch": [0, 1]}},
                       compared=3, paired_by={"name": 2, "plan": 1}, segments=1, note="inputs of the first run")
    assert doc.text_lines() == [
        "  localize: first divergence at node mm (MatMul) output y against reference concat(a, b, axis=-1): "
        "float32[2, 4], max abs 0.5, max rel 2, 1 element(s) differ, first at [0, 1]",
        "  localize: weights w, rule qkv; 3 paired value(s) compared (2 paired by name, 1 through the plan) "
        "in 1 segment(s)",
        "  localize: inputs of the first run",
    ]


def test_an_unreadable_provenance_names_no_rule_and_says_why(tmp_path, exports):
    model = onnx.load(str(exports["llama"]))
    model.metadata_props[0].value = "{not json"
    edited = tmp_path / "edited.onnx"
    onnx.save(model, str(edited))
    bad = _changed(edited, tmp_path / "bad.onnx", "model.layers.0.mlp.gate_up_proj.weight", (4, 3))
    result = localize_models(str(ONNX / "llama" / "model.onnx"), str(bad), _feeds("llama"), provider=CPU)
    assert result.first["rule"] is None and "fusectl provenance is unreadable" in result.note


def test_values_with_no_pair_are_counted_and_several_runs_localize_the_first_failing_one(tmp_path):
    """A MatMul chain against the same chain ending in a Gemm of the transposed weight: the last
    output pairs with nothing (other op types, unnamed nodes); with a changed first weight, the
    first failing of three runs is localized to the first MatMul."""
    rng = np.random.default_rng(0)
    w0, w1 = (rng.standard_normal((4, 4)).astype(np.float32) for _ in range(2))

    def save(path, w0, gemm):
        last = (helper.make_node("Gemm", ["h0", "w1"], ["y"], transB=1) if gemm
                else helper.make_node("MatMul", ["h0", "w1"], ["y"]))
        graph = helper.make_graph([helper.make_node("MatMul", ["x", "w0"], ["h0"]), last], "g",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                                  [numpy_helper.from_array(w0, "w0"),
                                   numpy_helper.from_array(np.ascontiguousarray(w1.T) if gemm else w1, "w1")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        onnx.save(model, str(path))
        return path

    reference = save(tmp_path / "a.onnx", w0, gemm=False)
    changed = w0.copy()
    changed[1, 2] += 1.0
    candidate = save(tmp_path / "b.onnx", changed, gemm=True)
    report = tmp_path / "r.json"
    result = run_cli("verify", reference, candidate, "--runs", "3", "--report", report)
    assert result.exit_code == 1, result.stderr
    doc = json.loads(report.read_text())["localization"]
    assert doc["first"]["node"] == "h0" and doc["first"]["weights"] == ["w0"]  # an unnamed node: its output
    assert doc["compared"] == 1 and doc["paired_by"] == {"name": 1, "plan": 0}
    assert "1 value(s) of the candidate have no pair" in doc["note"]
    assert "the first failing run (seed 0)" in doc["note"]


def test_a_graph_onnx_ir_cannot_read_is_not_localized_and_verify_says_so(tmp_path):
    """onnxruntime runs a graph with a sequence of maps inside; onnx-ir does not represent it."""
    scalar = helper.make_tensor_type_proto(TensorProto.FLOAT, [])
    maps = helper.make_sequence_type_proto(helper.make_map_type_proto(TensorProto.INT64, scalar))
    zipmap = helper.make_node("ZipMap", ["x"], ["m"], domain="ai.onnx.ml", classlabels_int64s=[0, 1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"]), zipmap], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
                              value_info=[helper.make_value_info("m", maps)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.onnx.ml", 3)])
    model.ir_version = 8
    path = str(tmp_path / "zipmap.onnx")
    onnx.save(model, path)
    report = verify_models(path, path, provider="cpu", output_checks=OutputChecks(localize=True))
    assert report.passed and report.localization.first is None and report.localization.compared == 0
    assert "not localized: " in report.localization.note and "zipmap.onnx" in report.localization.note
