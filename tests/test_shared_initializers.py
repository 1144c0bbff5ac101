"""Initializers two graphs hold alike, loaded once for both sessions of ``verify A.onnx B.onnx``
(verification/shared_initializers.py, and what model_check.py and runner.py do with them).

What is shared: a name both main graphs hold in external data with one dtype, one shape and
equal bytes. What never is: the same name with other bytes, dtype or shape, a name a subgraph
defines too, tensors inside the model file. Sharing never changes a result: the fixtures'
graphs, saved with external data, give the same outputs bit for bit and the same reports with
sharing on and off, and a pair that differs in one element still fails. The benchmark of the
memory it saves is benchmarks/verify_models_bench.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fusectl.verification import model_check
from fusectl.verification.model_check import verify_models
from fusectl.verification.runner import CPU, make_inputs, ort_values, run, session
from fusectl.verification.shared_initializers import SharedInitializers, find_shared

ROOT = Path(__file__).resolve().parent.parent
F = TensorProto.FLOAT


def _external(model: onnx.ModelProto, path: Path) -> str:
    """``model`` saved at ``path`` with every tensor in ``PATH.data``."""
    model.ir_version = min(model.ir_version or 8, 10)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=128)
    return str(path)


def _chain(path: Path, weights: dict[str, np.ndarray], *, reshape: dict[str, list[int]] | None = None,
           cast: tuple[str, ...] = ()) -> str:
    """y = x @ w0 @ w1 ... (x float32 [2, 8]), each weight an external initializer; a weight in
    ``reshape`` is stored in another shape and reshaped back, one in ``cast`` is cast to float."""
    nodes, inits, h = [], [], "x"
    for i, (name, w) in enumerate(weights.items()):
        inits.append(numpy_helper.from_array(w, name))
        src = name
        if name in (reshape or {}):
            inits.append(numpy_helper.from_array(np.array(reshape[name], np.int64), name + "_shape"))
            nodes.append(helper.make_node("Reshape", [name, name + "_shape"], [name + "_r"]))
            src = name + "_r"
        if name in cast:
            nodes.append(helper.make_node("Cast", [src], [name + "_f"], to=F))
            src = name + "_f"
        out = "y" if i == len(weights) - 1 else f"h{i}"
        nodes.append(helper.make_node("MatMul", [h, src], [out]))
        h = out
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [2, 8])],
                              [helper.make_tensor_value_info("y", F, [2, 8])], inits)
    return _external(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def _weights(n: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"w{i}": rng.standard_normal((8, 8)).astype(np.float32) for i in range(n)}


def _both(a: str, b: str, **kwargs):
    """verify_models with sharing on and off: (shared report, unshared report)."""
    return verify_models(a, b, provider="cpu", **kwargs), verify_models(a, b, provider="cpu", share=False, **kwargs)


def _same_results(on, off) -> None:
    assert on.passed == off.passed
    assert [c.to_json() for c in on.checks] == [c.to_json() for c in off.checks]
    assert off.shared == {"count": 0, "bytes": 0}


def test_a_pair_sharing_initializers_reports_their_count_and_bytes(tmp_path):
    w = _weights()
    other = {**w, "w2": w["w2"].T.copy()}  # one of three differs
    a, b = _chain(tmp_path / "a.onnx", w), _chain(tmp_path / "b.onnx", other)
    assert sorted(find_shared(a, b).arrays) == ["w0", "w1"]
    on, off = _both(a, b)
    assert on.shared == {"count": 2, "bytes": 2 * 8 * 8 * 4}
    _same_results(on, off)
    assert on.to_json()["shared_initializers"] == {"count": 2, "bytes": 512}
    assert "  shared: 2 initializer(s), 0.0 MB loaded once for both sessions" in on.to_text().split("\n")
    assert not any(line.startswith("  shared:") for line in off.to_text().split("\n"))


def test_the_cli_report_has_the_shared_bytes(tmp_path):
    from click.testing import CliRunner

    from fusectl.cli import main

    w = _weights()
    a, b = _chain(tmp_path / "a.onnx", w), _chain(tmp_path / "b.onnx", dict(w))
    result = CliRunner().invoke(main, ["verify", a, b, "--provider", "cpu", "--report", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "r.json").read_text())["shared_initializers"] == {"count": 3, "bytes": 768}
    assert "shared: 3 initializer(s)" in result.output


def test_the_same_name_with_other_bytes_shares_nothing_and_still_fails(tmp_path):
    w = _weights()
    changed = {k: v.copy() for k, v in w.items()}
    changed["w1"][3, 5] += 0.01  # one element of one weight
    a, b = _chain(tmp_path / "a.onnx", w), _chain(tmp_path / "b.onnx", changed)
    assert sorted(find_shared(a, b).arrays) == ["w0", "w2"]
    on, off = _both(a, b)
    assert not on.passed and on.to_json()["failed"] == ["y"]
    assert on.checks[0].comparison.mismatches > 0
    _same_results(on, off)
    # every weight differs: nothing is shared, and the result is what it was
    other = _chain(tmp_path / "c.onnx", {k: v + 1 for k, v in w.items()})
    on, off = _both(a, other)
    assert on.shared == {"count": 0, "bytes": 0} and not on.passed
    _same_results(on, off)


def test_the_same_bytes_in_another_shape_or_dtype_are_not_shared(tmp_path):
    w = _weights()
    a = _chain(tmp_path / "a.onnx", w)
    flat = _chain(tmp_path / "flat.onnx", {**w, "w1": w["w1"].reshape(64)}, reshape={"w1": [8, 8]})
    assert sorted(find_shared(a, flat).arrays) == ["w0", "w2"]
    on, off = _both(a, flat)
    assert on.passed and on.shared["count"] == 2
    _same_results(on, off)
    ints = _chain(tmp_path / "ints.onnx", {**w, "w1": w["w1"].view(np.int32)}, cast=("w1",))
    assert sorted(find_shared(a, ints).arrays) == ["w0", "w2"]
    on, off = _both(a, ints)
    assert not on.passed  # the int32 reading of float bits is another weight
    _same_results(on, off)


def test_a_name_a_subgraph_defines_too_is_not_shared(tmp_path):
    w = _weights(2)
    a = _chain(tmp_path / "a.onnx", w)
    inner = helper.make_graph([helper.make_node("Constant", [], ["w0"], value=numpy_helper.from_array(w["w1"]))],
                              "then", [], [helper.make_tensor_value_info("w0", F, [8, 8])])
    model = onnx.load(a)
    model.graph.node.insert(0, helper.make_node("If", ["c"], ["unused"], then_branch=inner, else_branch=inner))
    model.graph.initializer.append(numpy_helper.from_array(np.array(True), "c"))
    b = _external(model, tmp_path / "b.onnx")
    assert sorted(find_shared(a, b).arrays) == ["w1"]


def test_tensors_inside_the_model_file_are_not_shared(tmp_path):
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", F, [2, 8])], [helper.make_tensor_value_info("y", F, [2, 8])],
                              [numpy_helper.from_array(_weights(1)["w0"], "w")])
    inline = tmp_path / "inline.onnx"
    # IR 8 given: make_model writes the installed onnx's newest IR, which an older onnxruntime refuses
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(inline))
    report = verify_models(str(inline), str(inline), provider="cpu")
    assert report.passed and report.shared == {"count": 0, "bytes": 0}


def test_the_sessions_really_run_on_the_shared_copy(tmp_path, monkeypatch):
    """What find_shared hands over is what both sessions compute with: a lie about one weight
    (the other bytes given as 'shared') shows in the outputs, so a report of shared bytes means
    onnxruntime did not load its own."""
    w = _weights()
    a, b = _chain(tmp_path / "a.onnx", w), _chain(tmp_path / "b.onnx", dict(w))
    assert verify_models(a, b, provider="cpu").passed
    real = find_shared(a, b)
    lie = SharedInitializers({**real.arrays, "w1": real.arrays["w1"] * 2})
    x = {"x": np.ones((2, 8), np.float32)}
    for path in (a, b):
        honest = run(session(path, CPU, path), x, path)["y"]
        lied = run(session(path, CPU, path, ort_values(lie.arrays)), x, path)["y"]
        np.testing.assert_allclose(lied, 2 * honest, rtol=1e-5)
    monkeypatch.setattr(model_check, "find_shared", lambda *_: lie)
    report = verify_models(a, b, provider="cpu")
    assert report.passed and report.shared["count"] == 3  # both sessions took the same (wrong) copy


# (reference, candidate, whether they share): pairs of one graph share every external tensor; a
# graph and its folded or dynamo export share none (convbn's conv weights keep their names and
# shapes but the BN scale is folded into their bytes: same name, other bytes)
FIXTURE_PAIRS = [("onnx/bert/model.onnx", "onnx/bert/model.onnx", True),
                 ("onnx/llama/model.onnx", "onnx/llama/model.onnx", True),
                 ("onnx/convbn/model.onnx", "onnx/convbn/model.onnx", True),
                 ("onnx/convbn/model.onnx", "onnx/convbn/model_dynamo.onnx", False),
                 ("onnx/wnconv/model.onnx", "onnx/wnconv/model_folded.onnx", False),
                 ("onnx/lstm/model.onnx", "onnx/lstm/model.onnx", True),
                 ("onnx/lstm/model.onnx", "onnx/lstm/model_unfolded.onnx", False),
                 ("onnx/convbn_bias/model_dynamo.onnx", "onnx/convbn_bias/model_dynamo.onnx", True),
                 ("onnx-wild/gemm-heads/model.onnx", "onnx-wild/gemm-heads/model.onnx", True)]


def _without_prepacking(path: str):
    """A session of ``path`` with onnxruntime's pre-packing off, as a sharing session has it."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.add_session_config_entry("session.disable_prepacking", "1")
    return onnxruntime.InferenceSession(path, options, providers=[CPU])


@pytest.mark.parametrize("ref,cand,shares", FIXTURE_PAIRS,
                         ids=[f"{r}-vs-{c.rsplit('/', 1)[-1]}" for r, c, _ in FIXTURE_PAIRS])
def test_fixture_graphs_with_external_data_give_the_same_results_shared_or_not(tmp_path, ref, cand, shares):
    a = _external(onnx.load(str(ROOT / "fixtures" / ref)), tmp_path / "a.onnx")
    b = _external(onnx.load(str(ROOT / "fixtures" / cand)), tmp_path / "b.onnx")
    on, off = _both(a, b)
    _same_results(on, off)
    shared = find_shared(a, b)
    assert on.shared == shared.to_json() and (on.shared["count"] > 0) == shares
    if not shares:
        return
    # bit for bit: each graph's outputs on the shared copy equal its outputs on its own tensors
    # (pre-packing off in both: packing a weight may round the last bit of a sum differently)
    plain = {path: _without_prepacking(path) for path in (a, b)}
    feeds, _, _ = make_inputs(plain[a], {}, {}, {}, 0, a)
    values = ort_values(shared.arrays)
    for path in (a, b):
        alone, together = run(plain[path], feeds, path), run(session(path, CPU, path, values), feeds, path)
        assert list(alone) == list(together)
        for name in alone:
            np.testing.assert_array_equal(np.asarray(together[name]), np.asarray(alone[name]), err_msg=name)


def test_a_model_onnx_ir_cannot_read_shares_nothing(tmp_path):
    w = _weights()
    a, b = _chain(tmp_path / "a.onnx", w), _chain(tmp_path / "b.onnx", w)
    assert sorted(find_shared(a, b).arrays) == ["w0", "w1", "w2"]
    Path(b + ".data").unlink()  # its external data gone: load_model refuses it
    assert find_shared(a, b).arrays == {}
    assert find_shared(b, a).arrays == {}


def test_a_data_file_that_shrinks_after_the_comparison_is_refused_naming_it(tmp_path, monkeypatch):
    from fusectl.errors import CheckpointError
    from fusectl.verification import shared_initializers

    w = _weights()
    a, b = _chain(tmp_path / "a.onnx", w), _chain(tmp_path / "b.onnx", w)

    class Shrinking(shared_initializers.RangeComparer):
        def close(self):  # every comparison done: another process truncates the file meanwhile
            super().close()
            with open(a + ".data", "r+b") as f:
                f.truncate(16)

    monkeypatch.setattr(shared_initializers, "RangeComparer", Shrinking)
    with pytest.raises(CheckpointError, match=r"a\.onnx\.data: shorter than the \d+ bytes it held a moment ago"):
        find_shared(a, b)
