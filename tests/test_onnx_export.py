"""map and export against graphs written by torch's real ONNX exporters (fixtures/onnx/)."""

from __future__ import annotations

import collections
import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper
import safetensors.numpy
from safetensors.numpy import save_file

from fusectl.cli import main

ONNX = Path(__file__).resolve().parent.parent / "fixtures" / "onnx"


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def ok(result):
    assert result.exit_code == 0, result.output
    return result


def op_counts(path) -> collections.Counter:
    return collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def run_model(path, io):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: io[i.name] for i in sess.get_inputs()}
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def fused_export(tmp_path, name, *presets):
    src = ONNX / name
    fused = tmp_path / "fused"
    ok(run("fuse", src, *[x for p in presets for x in ("-r", p)], "-o", fused, "--quiet"))
    out = tmp_path / "fused.onnx"
    ok(run("export", fused, "--graph", src / "model.onnx", "-o", out))
    return fused, out


# --------------------------------------------------------------------------------- map


def test_map_pairs_every_anonymous_matmul_initializer_of_the_torchscript_bert():
    result = ok(run("map", ONNX / "bert" / "model.safetensors", ONNX / "bert" / "model.onnx", "--json"))
    doc = json.loads(result.output)
    expected = json.loads((ONNX / "bert" / "initializers.json").read_text())["model.onnx"]["initializers"]
    got = {(p["initializer"]): (p["structural"], p["how"]) for p in doc["pairs"]}
    for init in expected:
        if init["equal_to_transposed"]:
            assert got[init["name"]] == (init["equal_to_transposed"][0], "transposed"), init["name"]
        elif init["equal_to"]:
            assert got[init["name"]][0] in init["equal_to"]
    assert doc["unmatched_checkpoint"] == [] and doc["unmatched_graph"] == []
    assert sum(p["initializer"].startswith("onnx::MatMul_") for p in doc["pairs"]) == 12


def test_map_finds_dynamo_val_initializers_and_reports_graph_only_constants():
    doc = json.loads(ok(run("map", ONNX / "llama", ONNX / "llama" / "model.onnx", "--json")).output)
    assert doc["unmatched_checkpoint"] == []
    pairs = {p["structural"]: p for p in doc["pairs"]}
    assert pairs["lm_head.weight"]["initializer"] == "val_382" and pairs["lm_head.weight"]["how"] == "transposed"
    assert "unsqueeze_14" in doc["unmatched_graph"]  # rotary tables are the graph's own


def test_map_allows_a_common_prefix(tmp_path):
    from safetensors.numpy import load_file
    arrays = load_file(str(ONNX / "bert" / "model.safetensors"))
    prefixed = tmp_path / "prefixed.safetensors"
    save_file({f"bert.{k}": v for k, v in arrays.items()}, str(prefixed))
    doc = json.loads(ok(run("map", prefixed, ONNX / "bert" / "model.onnx", "--json")).output)
    assert doc["checkpoint_prefix"] == "bert." and doc["unmatched_checkpoint"] == []
    assert ("bert.embeddings.word_embeddings.weight", "name") in {(p["structural"], p["how"]) for p in doc["pairs"]}


def test_lstm_to_onnx_preset_equals_the_torch_exporters_packed_weights(tmp_path):
    fused = tmp_path / "lstm.safetensors"
    ok(run("fuse", ONNX / "lstm", "-r", "lstm-to-onnx", "-o", fused, "--quiet"))
    doc = json.loads(ok(run("map", fused, ONNX / "lstm" / "model.onnx", "--json")).output)
    how = {p["structural"]: (p["initializer"], p["how"]) for p in doc["pairs"]}
    # bit-identical to what torch's exporter packed for the ONNX LSTM nodes
    assert how["rnn.W_l0"] == ("onnx::LSTM_379", "content")
    assert how["rnn.R_l1"] == ("onnx::LSTM_427", "content")
    assert how["rnn.B_l0"] == ("onnx::LSTM_378", "content")
    assert doc["unmatched_graph"] == []


# ------------------------------------------------------------------------------- export


@pytest.mark.parametrize("name,presets,op,before,after", [
    ("bert", ["bert-qkv"], "MatMul", 16, 12),
    ("llama", ["llama-qkv", "llama-gate-up"], "MatMul", 19, 13),
    ("convbn", ["conv-bn-fold"], "BatchNormalization", 2, 0),
    ("wnconv", ["weight-norm-fold"], "ReduceL2", 3, 0),
    ("lstm", ["lstm-to-onnx"], "LSTM", 2, 2),
])
def test_export_rewrites_the_graph_and_reproduces_pytorch(tmp_path, name, presets, op, before, after):
    fused, out = fused_export(tmp_path, name, *presets)
    assert op_counts(ONNX / name / "model.onnx")[op] == before
    assert op_counts(out)[op] == after
    onnx.checker.check_model(str(out))
    io = np.load(ONNX / name / "io.npz")
    for output, value in run_model(out, io).items():
        np.testing.assert_allclose(value, io[output], rtol=1e-4, atol=1e-4)
    # the initializers are the fused checkpoint's parameters, by name, and nothing else of weight size
    from fusectl.io.checkpoint import open_checkpoint
    names = {i.name for i in onnx.load(str(out)).graph.initializer}
    assert set(open_checkpoint(str(fused)).table.names()) - {n for n in open_checkpoint(str(fused)).table.names()
                                                               if "num_batches" in n} <= names
    ok(run("verify", ONNX / name / "model.onnx", out, "--inputs", ONNX / name / "io.npz"))


def test_export_fuses_qkv_into_one_matmul_and_a_split_per_layer(tmp_path):
    _, out = fused_export(tmp_path, "bert", "bert-qkv")
    graph = onnx.load(str(out)).graph
    splits = [n for n in graph.node if n.op_type == "Split"]
    assert len(splits) == 2  # one per layer, after the fused MatMul + bias Add
    producers = {o: n for n in graph.node for o in n.output}
    for split in splits:
        add = producers[split.input[0]]
        assert add.op_type == "Add"
        assert any(producers.get(i) is not None and producers[i].op_type == "MatMul" for i in add.input)


def test_a_perturbed_fused_weight_makes_model_verify_fail(tmp_path):
    _, out = fused_export(tmp_path, "bert", "bert-qkv")
    model = onnx.load(str(out))
    init = next(i for i in model.graph.initializer if i.name == "encoder.layer.1.attention.self.qkv.weight")
    array = numpy_helper.to_array(init).copy()
    array[2, 6] += 0.5
    init.CopyFrom(numpy_helper.from_array(array, init.name))
    bad = tmp_path / "bad.onnx"
    onnx.save(model, str(bad))
    report = tmp_path / "r.json"
    result = run("verify", ONNX / "bert" / "model.onnx", bad, "--inputs", ONNX / "bert" / "io.npz", "--report", report)
    assert result.exit_code == 1
    assert "last_hidden_state" in json.loads(report.read_text())["failed"]


def test_export_refuses_a_checkpoint_whose_weights_differ_from_the_graph(tmp_path):
    from fusectl.io.formats.safetensors_file import read_header
    src = tmp_path / "bert"
    shutil.copytree(ONNX / "bert", src)
    weights = src / "model.safetensors"
    location = read_header(str(weights))[0]["encoder.layer.1.attention.self.query.weight"].location
    with open(weights, "r+b") as f:
        f.seek(location.offset + 4 * 70)
        f.write(np.float32(3.0).tobytes())
    fused = tmp_path / "fused"
    ok(run("fuse", src, "-r", "bert-qkv", "-o", fused, "--quiet"))
    out = tmp_path / "out.onnx"
    result = run("export", fused, "--graph", ONNX / "bert" / "model.onnx", "-o", out)
    assert result.exit_code == 2
    assert "onnx::MatMul_390" in result.output and "encoder.layer.1.attention.self.query.weight" in result.output
    assert not out.exists()


def test_a_tied_embedding_used_transposed_is_one_initializer_and_a_transpose(tmp_path):
    rng = np.random.default_rng(0)
    embed = rng.standard_normal((10, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["embed.weight", "ids"], ["h"]),
         helper.make_node("MatMul", ["h", "onnx::MatMul_7"], ["logits"])],
        "tied",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 3, 10])],
        [numpy_helper.from_array(embed, "embed.weight"), numpy_helper.from_array(embed.T.copy(), "onnx::MatMul_7")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    graph_path = tmp_path / "tied.onnx"
    onnx.save(model, str(graph_path))
    ckpt = tmp_path / "tied.safetensors"
    save_file({"embed.weight": embed}, str(ckpt), metadata={"head.weight": "embed.weight"})
    out = tmp_path / "out.onnx"
    ok(run("export", ckpt, "--graph", graph_path, "-o", out))
    exported = onnx.load(str(out)).graph
    assert [i.name for i in exported.initializer] == ["embed.weight"]
    assert [n.op_type for n in exported.node].count("Transpose") == 1
    ids = np.array([[1, 5, 9]], np.int64)
    (logits,) = ort.InferenceSession(str(out)).run(None, {"ids": ids})
    np.testing.assert_allclose(logits, embed[ids] @ embed.T, rtol=1e-6)


@pytest.mark.parametrize("head_equal", [True, False])
def test_a_tied_head_held_under_its_own_name_is_checked_like_any_named_initializer(tmp_path, head_equal):
    """An untied graph's ``head.weight`` against a checkpoint where head.weight is tied to
    embed.weight: the initializer pairs with its name and is replaced by the tied tensor when it
    holds it, refused when it holds other data (it was kept as the graph's own, exit 0)."""
    rng = np.random.default_rng(1)
    embed = rng.standard_normal((10, 4)).astype(np.float32)
    head = embed if head_equal else rng.standard_normal((10, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["embed.weight", "ids"], ["h"]),
         helper.make_node("Transpose", ["head.weight"], ["head_t"], perm=[1, 0]),
         helper.make_node("MatMul", ["h", "head_t"], ["logits"])],
        "untied",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 3, 10])],
        [numpy_helper.from_array(embed, "embed.weight"), numpy_helper.from_array(head.copy(), "head.weight")],
    )
    graph_path = tmp_path / "untied.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(graph_path))
    ckpt = tmp_path / "tied.safetensors"
    save_file({"embed.weight": embed}, str(ckpt), metadata={"head.weight": "embed.weight"})
    out = tmp_path / "out.onnx"
    result = run("export", ckpt, "--graph", graph_path, "-o", out)
    if not head_equal:
        assert result.exit_code == 2 and not out.exists()
        assert result.stderr.startswith("error: graph initializer 'head.weight' has the name of checkpoint tensor "
                                        "'head.weight' but holds other data")
        return
    ok(result)
    assert [i.name for i in onnx.load(str(out)).graph.initializer] == ["embed.weight"]
    ids = np.array([[1, 5, 9]], np.int64)
    (logits,) = ort.InferenceSession(str(out)).run(None, {"ids": ids})
    np.testing.assert_allclose(logits, embed[ids] @ embed.T, rtol=1e-6)


ALBERT = ONNX.parent / "onnx-export" / "albert"


def test_every_use_of_albert_s_shared_layer_fuses_its_qkv(tmp_path):
    """TorchScript's ALBERT (3 hidden layers, one shared layer): each use of the shared q/k/v
    reads its own transposed initializer or an Identity copy of one; all three uses fuse (was 1)."""
    fused = tmp_path / "fused"
    ok(run("fuse", ALBERT, "-r", ALBERT / "qkv.toml", "-o", fused, "--quiet"))
    out = tmp_path / "out.onnx"
    report = json.loads(ok(run("export", fused, "--graph", ALBERT / "model.onnx", "-o", out, "--json")).stdout)
    assert report["fused_matmuls"] == 3 and report["not_fused"] == [] and report["unused"] == []
    # per use: 3 projections + dense + 2 feed-forward + 2 attention products become 1 + 1 + 2 + 2
    assert (op_counts(ALBERT / "model.onnx")["MatMul"], op_counts(out)["MatMul"]) == (1 + 3 * 8, 1 + 3 * 6)
    io = np.load(ALBERT / "io.npz")
    for output, value in run_model(out, io).items():
        np.testing.assert_allclose(value, io[output], rtol=1e-5, atol=1e-5)
    ok(run("verify", ALBERT / "model.onnx", out, "--inputs", ALBERT / "io.npz"))


def test_export_refuses_an_existing_output_and_leaves_no_partial_file(tmp_path):
    fused, out = fused_export(tmp_path, "wnconv", "weight-norm-fold")
    before = out.read_bytes()
    result = run("export", fused, "--graph", ONNX / "wnconv" / "model.onnx", "-o", out)
    assert result.exit_code == 2 and "--force" in result.output and out.read_bytes() == before
    # a graph whose exporter constant-folded weight_norm into anonymous initializers cannot take
    # the unfolded checkpoint: refused, nothing written
    bad = tmp_path / "bad.onnx"
    result = run("export", ONNX / "wnconv", "--graph", ONNX / "wnconv" / "model_folded.onnx", "-o", bad)
    assert result.exit_code == 2 and "'conv1.parametrizations.weight.original1' float32[8, 4, 3]" in result.output
    assert "initializer 'onnx::Conv_26' float32[8, 4, 3]" in result.output and "-r weight-norm-fold" in result.output
    assert not bad.exists() and not [p for p in tmp_path.iterdir() if "fusectl-tmp" in p.name]


@pytest.mark.parametrize("name, preset, graph", [
    ("wnconv", "weight-norm-fold", "model_folded.onnx"),
    ("convbn", "conv-bn-fold", "model_folded.onnx"),
])
def test_a_folded_checkpoint_takes_the_place_of_the_folds_an_exporter_made(tmp_path, name, preset, graph):
    """TorchScript with constant folding computes the same folds into anonymous initializers
    (onnx::Conv_26); fusectl's fold equals them within float32 rounding, not bitwise, so they
    pair as "close" and the export holds the checkpoint's own folded weights."""
    fused = tmp_path / "fused"
    ok(run("fuse", ONNX / name, "-r", preset, "-o", fused, "--quiet"))
    doc = json.loads(ok(run("map", fused, ONNX / name / graph, "--json")).output)
    assert any(p["how"] == "content" and p["data"] == "close" for p in doc["pairs"])
    out = tmp_path / "out.onnx"
    ok(run("export", fused, "--graph", ONNX / name / graph, "-o", out))
    io = dict(np.load(ONNX / name / "io.npz"))
    np.testing.assert_allclose(run_model(out, io)["y"], io["y"], atol=1e-4, rtol=0)
    graph_names = {i.name for i in onnx.load(str(out)).graph.initializer}
    assert not any(n.startswith("onnx::") for n in graph_names), graph_names


def test_map_pairs_names_whose_first_segment_differs(tmp_path):
    """A DataParallel checkpoint (``module.``) against a graph exported through a wrapper
    (``m.``): one leading segment swapped on both sides."""
    import safetensors.numpy as stn

    tensors = stn.load_file(str(ONNX / "convbn" / "model.safetensors"))
    ckpt = tmp_path / "dp.safetensors"
    save_file({f"module.{k}": v for k, v in tensors.items()}, str(ckpt))
    model = onnx.load(str(ONNX / "convbn" / "model.onnx"))
    for init in model.graph.initializer:
        old = init.name
        init.name = f"m.{old}"
        for node in model.graph.node:
            node.input[:] = [f"m.{old}" if i == old else i for i in node.input]
    graph = tmp_path / "wrapped.onnx"
    onnx.save(model, str(graph))
    doc = json.loads(ok(run("map", ckpt, graph, "--json")).output)
    assert (doc["graph_prefix"], doc["checkpoint_prefix"]) == ("m.", "module.")
    assert {p["how"] for p in doc["pairs"]} == {"name"} and len(doc["pairs"]) == 11


def test_export_of_a_corrupt_graph_is_exit_2(tmp_path):
    graph = tmp_path / "corrupt.onnx"
    graph.write_bytes(b"not a protobuf at all")
    result = run("export", ONNX / "bert", "--graph", graph, "-o", tmp_path / "o.onnx")
    assert result.exit_code == 2 and "corrupt.onnx" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "o.onnx").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["corrupt.onnx"]


# ------------------------------------------------------- initializers paired by name hold data


def _convbn_ckpt(tmp_path, folder="convbn"):
    src = tmp_path / "src"
    shutil.copytree(ONNX / folder, src)
    return src / "model.safetensors"


def test_map_reports_pairs_by_name_whose_data_differ():
    """The dynamo exporter folds BatchNorm into each Conv and keeps the Conv's names."""
    doc = json.loads(ok(run("map", ONNX / "convbn" / "model.safetensors", ONNX / "convbn" / "model_dynamo.onnx", "--json")).output)
    data = {p["structural"]: p["data"] for p in doc["pairs"]}
    assert data == {"conv1.weight": "differs", "conv2.weight": "differs", "conv2.bias": "differs"}
    text = ok(run("map", ONNX / "convbn" / "model.safetensors", ONNX / "convbn" / "model_dynamo.onnx")).output
    assert "3 pair(s) by name hold different data: conv1.weight, conv2.bias, conv2.weight" in text
    # the TorchScript graph without folding holds the checkpoint's own data
    doc = json.loads(ok(run("map", ONNX / "convbn" / "model.safetensors", ONNX / "convbn" / "model.onnx", "--json")).output)
    assert {p["data"] for p in doc["pairs"]} == {"equal"}


@pytest.mark.parametrize("folder", ["convbn", "convbn_bias"])
@pytest.mark.parametrize("fold_first", [False, True], ids=["unfolded-checkpoint", "conv-bn-fold-checkpoint"])
def test_export_on_a_dynamo_graph_that_folded_batchnorm_reproduces_pytorch(tmp_path, fold_first, folder):
    """convbn_bias: every Conv has a bias, so the dynamo graph keeps conv1.weight AND conv1.bias
    as names for the folded values; before data was checked, export put the raw checkpoint
    tensors back and exited 0 with a graph 1.7-10 off."""
    ckpt = _convbn_ckpt(tmp_path, folder)
    if fold_first:
        folded = tmp_path / "folded.safetensors"
        ok(run("fuse", ckpt, "-r", "conv-bn-fold", "-o", folded, "--quiet"))
        ckpt = folded
    out = tmp_path / "out.onnx"
    result = ok(run("export", ckpt, "--graph", ONNX / folder / "model_dynamo.onnx", "-o", out, "--json"))
    assert json.loads(result.output)["folded"] == 2
    io = dict(np.load(ONNX / folder / "io.npz"))
    np.testing.assert_allclose(run_model(out, io)["y"], io["y"], atol=1e-4, rtol=0)
    # the exported weights are the checkpoint's fold, not the graph's copies
    if fold_first:
        names = {i.name for i in onnx.load(str(out)).graph.initializer}
        assert names == {"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias"}


def test_export_refuses_an_exporter_fold_that_the_checkpoint_does_not_reproduce(tmp_path):
    """The checkpoint's BatchNorm differs from the one the exporter folded: nothing explains
    the graph's conv1.weight, so export stops instead of writing a graph that computes
    something else."""
    ckpt = _convbn_ckpt(tmp_path)
    tensors = safetensors.numpy.load_file(str(ckpt))
    tensors["bn1.running_var"] = tensors["bn1.running_var"] * 2
    save_file(tensors, str(ckpt))
    out = tmp_path / "out.onnx"
    result = run("export", ckpt, "--graph", ONNX / "convbn" / "model_dynamo.onnx", "-o", out)
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: graph initializer 'conv1.weight' has the name of checkpoint tensor 'conv1.weight'")
    assert "optimize=False" in result.output
    assert not out.exists() and not [p for p in tmp_path.iterdir() if "fusectl-tmp" in p.name]


@pytest.mark.parametrize("initializer", ["embeddings.LayerNorm.weight", "encoder.layer.0.attention.self.query.bias"])
def test_export_refuses_a_named_initializer_whose_data_was_swapped(tmp_path, initializer):
    model = onnx.load(str(ONNX / "bert" / "model.onnx"))
    init = next(i for i in model.graph.initializer if i.name == initializer)
    array = numpy_helper.to_array(init)
    init.CopyFrom(numpy_helper.from_array(array[::-1].copy(), init.name))
    graph = tmp_path / "swapped.onnx"
    onnx.save(model, str(graph))
    doc = json.loads(ok(run("map", ONNX / "bert" / "model.safetensors", graph, "--json")).output)
    assert [p["structural"] for p in doc["pairs"] if p["data"] == "differs"] == [initializer]
    out = tmp_path / "out.onnx"
    result = run("export", ONNX / "bert", "--graph", graph, "-o", out)
    assert result.exit_code == 2, result.output
    assert f"graph initializer {initializer!r} has the name of checkpoint tensor {initializer!r}" in result.output
    assert "max abs difference" in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_an_export_with_external_data_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """Past 2 GB (here: any size, the threshold lowered) the model and OUT.onnx.data are staged
    under temporary names and renamed into place together; a failure leaves neither."""
    import errno
    import os

    import fusectl.io.atomic as atomic
    import fusectl.onnx.export as export

    monkeypatch.setattr(export, "EXTERNAL_DATA_THRESHOLD", 0)
    fused = tmp_path / "fused"
    ok(run("fuse", ONNX / "bert", "-r", "bert-qkv", "-o", fused, "--quiet"))
    out = tmp_path / "out.onnx"
    ok(run("export", fused, "--graph", ONNX / "bert" / "model.onnx", "-o", out))
    assert (tmp_path / "out.onnx.data").is_file()
    io = dict(np.load(ONNX / "bert" / "io.npz"))
    np.testing.assert_allclose(run_model(out, io)["last_hidden_state"], io["last_hidden_state"], atol=1e-4)
    # the data file is an output too: not replaced without --force, never left half written
    second = tmp_path / "second.onnx"
    (tmp_path / "second.onnx.data").write_bytes(b"someone else's")
    result = run("export", fused, "--graph", ONNX / "bert" / "model.onnx", "-o", second)
    assert result.exit_code == 2 and "second.onnx.data: already exists" in result.output
    assert (tmp_path / "second.onnx.data").read_bytes() == b"someone else's" and not second.exists()

    def disk_full(path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic, "_sync_tree", disk_full)
    third = tmp_path / "third.onnx"
    result = run("export", fused, "--graph", ONNX / "bert" / "model.onnx", "-o", third)
    assert result.exit_code == 2 and "No space left on device" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fused", "out.onnx", "out.onnx.data", "second.onnx.data"]


# ------------------------------------------- external data: the model and OUT.data as one output


@pytest.fixture
def wnconv_fused(tmp_path):
    fused = tmp_path / "fused"
    ok(run("fuse", ONNX / "wnconv", "-r", "weight-norm-fold", "-o", fused, "--quiet"))
    return fused


@pytest.fixture
def small_threshold(monkeypatch):
    """Models past a few bytes take external data, as models past 2 GB do."""
    import fusectl.onnx.export as export

    monkeypatch.setattr(export, "EXTERNAL_DATA_THRESHOLD", 16)


def export_api(fused, out, **kwargs):
    from fusectl.io.checkpoint import open_checkpoint
    from fusectl.onnx.export import export_model

    return export_model(open_checkpoint(str(fused)), str(ONNX / "wnconv" / "model.onnx"), str(out), **kwargs)


def names_in(folder) -> list[str]:
    return sorted(p.name for p in Path(folder).iterdir())


def test_past_the_threshold_the_model_keeps_its_tensors_in_out_data_beside_it(tmp_path, wnconv_fused,
                                                                            monkeypatch):
    import fusectl.onnx.export as export

    inline = tmp_path / "inline.onnx"
    ok(run("export", wnconv_fused, "--graph", ONNX / "wnconv" / "model.onnx", "-o", inline))
    assert not (tmp_path / "inline.onnx.data").exists()
    monkeypatch.setattr(export, "EXTERNAL_DATA_THRESHOLD", 16)
    out = tmp_path / "sub" / "out.onnx"
    out.parent.mkdir()
    report = json.loads(ok(run("export", wnconv_fused, "--graph", ONNX / "wnconv" / "model.onnx", "-o", out,
                               "--json")).output)
    assert report["external_data"] is True and names_in(out.parent) == ["out.onnx", "out.onnx.data"]
    model = onnx.load(str(out), load_external_data=False)
    locations = {e.value for i in model.graph.initializer if i.data_location == TensorProto.EXTERNAL
                 for e in i.external_data if e.key == "location"}
    assert locations == {"out.onnx.data"}  # relative: the pair can move together
    assert len(model.graph.initializer) == report["initializers"]
    onnx.checker.check_model(str(out))
    io = dict(np.load(ONNX / "wnconv" / "io.npz"))
    got, expected = run_model(out, io), run_model(inline, io)
    assert got.keys() == expected.keys() == {"y"}
    np.testing.assert_array_equal(got["y"], expected["y"])
    np.testing.assert_allclose(got["y"], io["y"], atol=1e-4, rtol=0)


def _fail_in_save(monkeypatch, error):
    import onnx_ir

    real = onnx_ir.save

    def save(model, path, **kwargs):
        real(model, path, **kwargs)  # the staged files are written, then the save fails
        raise error

    monkeypatch.setattr(onnx_ir, "save", save)


def _fail_in_checker(monkeypatch, error):
    def check_model(path, *args, **kwargs):
        assert os.path.isfile(path) and os.path.isfile(os.path.join(os.path.dirname(path), "out.onnx.data"))
        raise error

    monkeypatch.setattr(onnx.checker, "check_model", check_model)


FAILURES = {
    "save-oserror": (_fail_in_save, lambda: OSError("disk on fire"), OSError),
    "save-interrupted": (_fail_in_save, KeyboardInterrupt, KeyboardInterrupt),
    "checker-refuses": (_fail_in_checker, lambda: onnx.checker.ValidationError("bad graph"), Exception),
    "checker-interrupted": (_fail_in_checker, KeyboardInterrupt, KeyboardInterrupt),
}


@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize("existing", [False, True], ids=["no-old-output", "old-pair"])
def test_a_failed_external_data_export_leaves_nothing_and_an_old_pair_whole(tmp_path, wnconv_fused, monkeypatch,
                                                                          small_threshold, failure, existing):
    from fusectl.onnx.export import ExportError

    out = tmp_path / "out.onnx"
    if existing:
        out.write_bytes(b"old model")
        (tmp_path / "out.onnx.data").write_bytes(b"old data")
    before = names_in(tmp_path)
    inject, error, raised = FAILURES[failure]
    inject(monkeypatch, error())
    with pytest.raises(raised) as caught:
        export_api(wnconv_fused, out, force=True)
    if failure == "checker-refuses":
        assert isinstance(caught.value, ExportError) and "fails onnx.checker: bad graph" in str(caught.value)
    assert names_in(tmp_path) == before  # no temporary, staged or set-aside file either
    if existing:
        assert out.read_bytes() == b"old model" and (tmp_path / "out.onnx.data").read_bytes() == b"old data"


@pytest.mark.parametrize("existing", [False, True], ids=["no-old-output", "old-pair"])
def test_an_export_that_fails_between_its_two_renames_puts_the_old_pair_back(tmp_path, wnconv_fused, monkeypatch,
                                                                           small_threshold, existing):
    """The new data file is in place, the model's rename fails: the old pair comes back whole
    (or, with none, the new data file goes)."""
    out = tmp_path / "out.onnx"
    if existing:
        out.write_bytes(b"old model")
        (tmp_path / "out.onnx.data").write_bytes(b"old data")
    before = names_in(tmp_path)
    real = os.rename
    target = os.path.realpath(out)
    renames = []

    def rename(src, dst):
        renames.append(os.path.basename(dst))
        if dst == target and "fusectl-tmp" in os.path.basename(src):
            assert (tmp_path / "out.onnx.data").read_bytes() != b"old data"  # the new data is in place
            raise OSError("rename failed")
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="rename failed"):
        export_api(wnconv_fused, out, force=True)
    assert "out.onnx" in renames
    assert names_in(tmp_path) == before
    if existing:
        assert out.read_bytes() == b"old model" and (tmp_path / "out.onnx.data").read_bytes() == b"old data"


def test_a_failure_after_both_renames_keeps_the_new_pair(tmp_path, wnconv_fused, monkeypatch, small_threshold):
    """Flushing the folder fails once the new model is in place: the new pair stays, consistent,
    and the old data file set aside goes."""
    import fusectl.io.atomic as atomic

    out = tmp_path / "out.onnx"
    out.write_bytes(b"old model")
    (tmp_path / "out.onnx.data").write_bytes(b"old data")
    real = atomic._sync

    def sync(path):
        if os.path.isdir(path):
            raise OSError("folder flush failed")
        real(path)

    monkeypatch.setattr(atomic, "_sync", sync)
    with pytest.raises(OSError, match="folder flush failed"):
        export_api(wnconv_fused, out, force=True)
    assert names_in(tmp_path) == ["fused", "out.onnx", "out.onnx.data"]
    io = dict(np.load(ONNX / "wnconv" / "io.npz"))
    np.testing.assert_allclose(run_model(out, io)["y"], io["y"], atol=1e-4, rtol=0)


def test_an_output_reached_through_a_symlink_keeps_its_data_file_beside_the_real_model(tmp_path, wnconv_fused,
                                                                                     small_threshold):
    """The data file is named after, and written beside, the model the link points to: the
    location the model records is relative to the model itself."""
    real = tmp_path / "models" / "real.onnx"
    real.parent.mkdir()
    real.write_bytes(b"old model")
    link = tmp_path / "link.onnx"
    link.symlink_to(real)
    export_api(wnconv_fused, link, force=True)
    assert names_in(real.parent) == ["real.onnx", "real.onnx.data"] and link.is_symlink()
    assert names_in(tmp_path) == ["fused", "link.onnx", "models"]
    io = dict(np.load(ONNX / "wnconv" / "io.npz"))
    np.testing.assert_allclose(run_model(real, io)["y"], io["y"], atol=1e-4, rtol=0)
