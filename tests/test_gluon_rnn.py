"""Gluon RNN and attention layouts, proven against MXNet's own outputs (issue 21).

fixtures/mxnet/ (fixtures/generate_mxnet.py, MXNet 1.9.1) holds Gluon LSTM, GRU and RNN layers
(2 layers, bidirectional), an LSTM with projection, a legacy FusedRNNCell checkpoint with its
one flat ``arg:lstm_parameters`` (and MXNet's own ``unpack_weights`` of it) and an
interleaved-QKV self-attention block, each with the input and MXNet's output (``NAME.io.npz``)
and what ``mx.nd.load`` read (``arrays.npz``). The ONNX checks feed the W/R/B that
``fusectl fuse -r gluon-rnn-to-torch -r lstm-to-onnx`` wrote into ONNX LSTM/GRU/RNN nodes
(tests/test_rnn.py builds them with ``onnx.helper``) and compare onnxruntime's output with
MXNet's; the projection LSTM, which ONNX cannot express, runs in torch's ``nn.LSTM`` (skipped
without torch). Nothing here builds an expectation with fusectl's ops: the expected values are
MXNet's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import FIXTURES, array_of, ok, parse_safetensors, snapshot, write_rules, write_safetensors

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from test_rnn import _rnn_model, _run  # noqa: E402  (the ONNX LSTM/GRU graph of the RNN presets' tests)

MX = FIXTURES / "mxnet"
MANIFEST = json.loads((MX / "mxnet.json").read_text())["files"]
ARRAYS = np.load(MX / "arrays.npz")
T, B, I, H = 5, 2, 3, 4  # the generator's sizes
PRESETS = ["gluon-rnn-to-torch", "torch-rnn-to-gluon", "torch-birnn-to-gluon", "torch-rnn-to-gluon-export",
           "mxnet-fused-lstm-to-torch", "mxnet-fused-lstm-proj-to-torch", "mxnet-fused-gru-to-torch",
           "mxnet-fused-rnn-to-torch"]
# fixture file -> (kind, the PyTorch prefix gluon-rnn-to-torch gives, layers, directions)
GLUON = {
    "lstm/lstm.params": ("lstm", "", 2, 2),
    "lstm/lstm-0000.params": ("lstm", "lstm0.", 2, 2),
    "gru/gru.params": ("gru", "", 2, 2),
    "gru/gru-0000.params": ("gru", "gru0.", 2, 2),
    "rnn/rnn.params": ("rnn", "", 2, 2),
    "rnn/rnn-0000.params": ("rnn", "rnn0.", 2, 2),
}
ONNX_PRESET = {"lstm": ["-r", "lstm-to-onnx"], "gru": ["-r", "gru-to-onnx"], "rnn": []}


def mxnet_arrays(rel: str) -> dict[str, np.ndarray]:
    """What mx.nd.load read of fixture ``rel``, by name."""
    key = rel.replace("/", "__")
    return {name: ARRAYS[f"{key}__{k}"] for k, name in enumerate(MANIFEST[rel]["names"])}


def load(path) -> dict[str, np.ndarray]:
    return {name: array_of(entry) for name, entry in parse_safetensors(path)[0].items()}


def io_of(rel: str) -> dict[str, np.ndarray]:
    folder = rel.split("/")[0]
    name = {"lstm-proj": "proj", "fused-cell": "lstm"}.get(folder, folder)
    return dict(np.load(MX / folder / f"{name}.io.npz"))


def fuse(cli, tmp_path, src, *args, name="out.safetensors"):
    out = tmp_path / name
    ok(cli("fuse", src, *args, "-o", out))
    return out


def _sfx(k: int, d: int) -> str:
    return f"_l{k}" + ("_reverse" if d else "")


def _vanilla_packed(sd: dict[str, np.ndarray], prefix: str, layers: int, dirs: int):
    """ONNX RNN's W [D,H,I], R [D,H,H], B [D,2H] straight from PyTorch names (one gate: nothing to reorder)."""
    return [(np.stack([sd[f"{prefix}weight_ih{_sfx(k, d)}"] for d in range(dirs)]),
             np.stack([sd[f"{prefix}weight_hh{_sfx(k, d)}"] for d in range(dirs)]),
             np.stack([np.concatenate([sd[f"{prefix}bias_ih{_sfx(k, d)}"], sd[f"{prefix}bias_hh{_sfx(k, d)}"]])
                       for d in range(dirs)]))
            for k in range(layers)]


def _onnx_y(kind: str, packed, dirs: int, x: np.ndarray) -> np.ndarray:
    if kind != "rnn":
        model, outputs = _rnn_model(kind, packed, dirs)
        return _run(model, outputs, x)["y"]
    model, outputs = _rnn_model("gru", packed, dirs)  # the same graph with RNN nodes
    for node in model.graph.node:
        if node.op_type == "GRU":
            node.op_type = "RNN"
            del node.attribute[:]
            node.attribute.extend([onnx.helper.make_attribute("hidden_size", packed[0][1].shape[-1]),
                                   onnx.helper.make_attribute("direction", "bidirectional" if dirs == 2 else "forward"),
                                   onnx.helper.make_attribute("activations", ["Tanh"] * dirs)])
    onnx.checker.check_model(model, full_check=True)
    return _run(model, outputs, x)["y"]


def onnx_output(kind: str, fused: dict[str, np.ndarray], prefix: str, layers: int, dirs: int, x) -> np.ndarray:
    """MXNet's input through ONNX nodes fed the packed tensors fusectl wrote."""
    if kind == "rnn":
        packed = _vanilla_packed(fused, prefix, layers, dirs)
    else:
        packed = [(fused[f"{prefix}W_l{k}"], fused[f"{prefix}R_l{k}"], fused[f"{prefix}B_l{k}"]) for k in range(layers)]
    return _onnx_y(kind, packed, dirs, x)


# ---------------------------------------------------------------- presets exist and are described


@pytest.mark.parametrize("name", PRESETS)
def test_preset_is_listed_and_shown(cli, name):
    assert name in ok(cli("rules", "list")).stdout
    assert "[[rule]]" in ok(cli("rules", "show", name)).stdout


# ---------------------------------------------------------------- Gluon names -> PyTorch -> ONNX == MXNet


@pytest.mark.parametrize("rel", sorted(GLUON))
def test_gluon_layer_through_torch_names_and_onnx_reproduces_mxnet(cli, tmp_path, rel):
    kind, prefix, layers, dirs = GLUON[rel]
    out = fuse(cli, tmp_path, MX / rel, "-r", "gluon-rnn-to-torch", *ONNX_PRESET[kind])
    io = io_of(rel)
    y = onnx_output(kind, load(out), prefix, layers, dirs, io["x"])
    assert y.shape == io["y"].shape == (T, B, dirs * H)
    np.testing.assert_allclose(y, io["y"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("rel", ["lstm/lstm.params", "gru/gru.params"])
def test_the_check_has_teeth_a_wrong_gate_order_misses_mxnet(cli, tmp_path, rel):
    """Gluon's tensors fed to ONNX as they are (no i,f,g,o -> i,o,f,c reorder) miss MXNet's output."""
    kind, prefix, layers, dirs = GLUON[rel]
    sd = load(fuse(cli, tmp_path, MX / rel, "-r", "gluon-rnn-to-torch"))
    y = _onnx_y(kind, _vanilla_packed(sd, prefix, layers, dirs), dirs, io_of(rel)["x"])
    assert np.abs(y - io_of(rel)["y"]).max() > 1e-2


def test_the_names_are_pytorchs_and_the_bytes_mxnets(cli, tmp_path):
    out = load(fuse(cli, tmp_path, MX / "lstm/lstm-0000.params", "-r", "gluon-rnn-to-torch"))
    mx = mxnet_arrays("lstm/lstm-0000.params")
    assert sorted(out) == sorted(f"lstm0.{t}_{g}{_sfx(k, d)}" for t in ("weight", "bias") for g in ("ih", "hh")
                                 for k in range(2) for d in range(2))
    assert out["lstm0.weight_ih_l1_reverse"].tobytes() == mx["arg:lstm0_r1_i2h_weight"].tobytes()
    assert out["lstm0.bias_hh_l0"].tobytes() == mx["arg:lstm0_l0_h2h_bias"].tobytes()


@pytest.mark.parametrize("rel,kind,layers,dirs,proj", [
    ("lstm-proj/proj.params", "lstm", 1, 1, 2), ("lstm-proj/proj-0000.params", "lstm", 1, 1, 2),
    ("lstm/lstm.params", "lstm", 2, 2, 0), ("gru/gru-0000.params", "gru", 2, 2, 0), ("rnn/rnn.params", "rnn", 2, 2, 0)])
def test_torch_loads_the_names_strictly_and_reproduces_mxnet(cli, tmp_path, rel, kind, layers, dirs, proj):
    """PyTorch's own layers take the names (load_state_dict strict) and compute MXNet's output,
    the projection LSTM included (ONNX's LSTM has no projection)."""
    th = pytest.importorskip("torch")
    sd = load(fuse(cli, tmp_path, MX / rel, "-r", "gluon-rnn-to-torch"))
    prefix = next(n for n in sd if "weight_ih_l0" in n)[: -len("weight_ih_l0")]
    cls = {"lstm": th.nn.LSTM, "gru": th.nn.GRU, "rnn": th.nn.RNN}[kind]
    kwargs = {"proj_size": proj} if proj else {}
    module = cls(I, H, num_layers=layers, bidirectional=dirs == 2, **kwargs)
    module.load_state_dict({n[len(prefix):]: th.from_numpy(v.copy()) for n, v in sd.items()}, strict=True)
    io = io_of(rel)
    with th.no_grad():
        y = module(th.from_numpy(io["x"]))[0].numpy()
    assert y.shape == io["y"].shape
    np.testing.assert_allclose(y, io["y"], rtol=0, atol=1e-5)


# ---------------------------------------------------------------- PyTorch names -> Gluon names


@pytest.mark.parametrize("rel,back", [("lstm/lstm.params", "torch-birnn-to-gluon"),
                                      ("gru/gru.params", "torch-birnn-to-gluon"),
                                      ("rnn/rnn.params", "torch-birnn-to-gluon"),
                                      ("lstm-proj/proj.params", "torch-rnn-to-gluon"),
                                      ("lstm/lstm-0000.params", "torch-rnn-to-gluon-export"),
                                      ("lstm-proj/proj-0000.params", "torch-rnn-to-gluon-export")])
def test_torch_names_go_back_to_gluons_names_and_bytes(cli, tmp_path, rel, back):
    torch_named = fuse(cli, tmp_path, MX / rel, "-r", "gluon-rnn-to-torch")
    back_path = fuse(cli, tmp_path, torch_named, "-r", back, name="back.params")
    from fusectl.io.formats.mxnet_params import read_mxnet

    got = {n: t.read() for n, t in read_mxnet(str(back_path)).tensors.items()}
    want = mxnet_arrays(rel)
    assert sorted(got) == sorted(want)
    for name, array in want.items():
        assert got[name].tobytes() == array.tobytes(), name


def test_direction_mismatches_are_clean_errors(cli, tmp_path):
    bi = fuse(cli, tmp_path, MX / "lstm/lstm.params", "-r", "gluon-rnn-to-torch", name="bi.safetensors")
    uni = fuse(cli, tmp_path, MX / "lstm-proj/proj.params", "-r", "gluon-rnn-to-torch", name="uni.safetensors")
    refused = cli("fuse", bi, "-r", "torch-rnn-to-gluon", "-o", tmp_path / "x.params")
    assert refused.exit_code == 2 and "torch-birnn-to-gluon" in refused.stderr and "Traceback" not in refused.output
    missing = cli("fuse", uni, "-r", "torch-birnn-to-gluon", "-o", tmp_path / "y.params")
    assert missing.exit_code == 2 and "_reverse" in missing.stderr
    assert not (tmp_path / "x.params").exists() and not (tmp_path / "y.params").exists()


# ---------------------------------------------------------------- the flat vector


def test_the_fused_cells_vector_splits_into_mxnets_own_unpacked_weights(cli, tmp_path):
    """fusectl's split of arg:lstm_parameters equals MXNet's FusedRNNCell.unpack_weights, gate by gate,
    with the sizes read off lstm-symbol.json (input_size from the vector's length)."""
    out = load(fuse(cli, tmp_path, MX / "fused-cell/lstm-0000.params", "-r", "mxnet-fused-lstm-to-torch"))
    unpacked = mxnet_arrays("fused-cell/lstm-unpacked.params")
    assert len(out) == 16
    for k in range(2):
        for d, side in enumerate("lr"):
            for kind, torch_kind in (("i2h", "ih"), ("h2h", "hh")):
                for t in ("weight", "bias"):
                    gates = np.concatenate([unpacked[f"lstm_{side}{k}_{kind}_{g}_{t}"] for g in "ifco"])
                    got = out[f"lstm.{t}_{torch_kind}{_sfx(k, d)}"]
                    assert got.shape == gates.shape and got.tobytes() == gates.tobytes(), (k, d, kind, t)


def test_the_fused_cells_vector_through_onnx_reproduces_mxnet(cli, tmp_path):
    out = load(fuse(cli, tmp_path, MX / "fused-cell/lstm-0000.params",
                    "-r", "mxnet-fused-lstm-to-torch", "-r", "lstm-to-onnx"))
    io = io_of("fused-cell/lstm-0000.params")
    np.testing.assert_allclose(onnx_output("lstm", out, "lstm.", 2, 2, io["x"]), io["y"], rtol=0, atol=1e-5)


def test_the_fused_cells_vector_comes_back_bitwise(cli, tmp_path):
    """vector -> per-gate -> vector: the file's bytes, by the forward preset and by unfuse."""
    src = MX / "fused-cell/lstm-0000.params"
    stored = mxnet_arrays("fused-cell/lstm-0000.params")["arg:lstm_parameters"]
    per_gate = fuse(cli, tmp_path, src, "-r", "mxnet-fused-lstm-to-torch")
    again = load(fuse(cli, tmp_path, per_gate, "-r", "lstm-to-mxnet-fused", name="again.safetensors"))
    assert list(again) == ["lstm.rnn_param"] and again["lstm.rnn_param"].tobytes() == stored.tobytes()
    before = snapshot(tmp_path)
    back = tmp_path / "back.params"
    ok(cli("unfuse", per_gate, "-o", back))
    from fusectl.io.formats.mxnet_params import read_mxnet

    tensors = read_mxnet(str(back)).tensors
    assert list(tensors) == ["arg:lstm_parameters"]
    assert tensors["arg:lstm_parameters"].read().tobytes() == stored.tobytes()
    assert {k: v for k, v in snapshot(tmp_path).items() if k != "back.params"} == before


CONFIGS = {  # what each layer's RNN operator says in its -symbol.json, plus the input size
    "lstm/lstm.params": ("lstm", {"state_size": 4, "num_layers": 2, "bidirectional": 1, "input_size": 3}),
    "gru/gru.params": ("gru", {"state_size": 4, "num_layers": 2, "bidirectional": 1, "input_size": 3}),
    "rnn/rnn.params": ("rnn", {"state_size": 4, "num_layers": 2, "bidirectional": 1, "input_size": 3}),
    "lstm-proj/proj.params": ("lstm-proj", {"state_size": 4, "num_layers": 1, "bidirectional": 0, "input_size": 3,
                                            "projection_size": 2}),
}


@pytest.mark.parametrize("rel", sorted(CONFIGS))
def test_per_gate_to_flat_to_per_gate_is_bitwise(cli, tmp_path, rel):
    kind, config = CONFIGS[rel]
    (tmp_path / "config.json").write_text(json.dumps(config))
    torch_named = fuse(cli, tmp_path, MX / rel, "-r", "gluon-rnn-to-torch", name="torch.safetensors")
    fused_preset = "gru-to-mxnet-fused" if kind == "gru" else "lstm-to-mxnet-fused"
    flat = fuse(cli, tmp_path, torch_named, "-r", fused_preset, name="flat.safetensors")
    assert list(load(flat)) == ["rnn_param"]
    back = fuse(cli, tmp_path, flat, "-r", f"mxnet-fused-{kind}-to-torch", "--config", tmp_path / "config.json",
                name="back.safetensors")
    want = parse_safetensors(torch_named)[0]
    got = parse_safetensors(back)[0]
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], name


def test_the_symbol_gives_the_sizes_of_its_rnn(tmp_path):
    from fusectl.io.checkpoint import open_checkpoint

    assert open_checkpoint(str(MX / "fused-cell/lstm-0000.params")).config == {
        "state_size": 4, "num_layers": 2, "bidirectional": 1, "input_size": 3}
    assert open_checkpoint(str(MX / "lstm-proj/proj-0000.params")).config == {
        "state_size": 4, "num_layers": 1, "bidirectional": 0, "projection_size": 2}  # no flat vector: no input size
    assert open_checkpoint(str(MX / "lstm/lstm.params")).config is None  # save_parameters: no symbol


def test_a_config_json_beside_or_given_wins_over_the_symbol(cli, tmp_path):
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"state_size": 4, "num_layers": 2, "bidirectional": 1, "input_size": 5}))
    result = cli("plan", MX / "fused-cell/lstm-0000.params", "-r", "mxnet-fused-lstm-to-torch", "--config", wrong)
    assert result.exit_code == 2
    assert "'cut'" in result.stderr and "736" in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize("what,config,needle", [
    ("sizes that do not add up", {"state_size": 4, "num_layers": 2, "bidirectional": 1, "input_size": 4}, "add up"),
    ("hidden size that does not divide", {"state_size": 5, "num_layers": 2, "bidirectional": 1, "input_size": 3},
     "add up"),
    ("a missing var", {"state_size": 4, "num_layers": 2, "bidirectional": 1}, "input_size"),
    ("bidirectional as a boolean", {"state_size": 4, "num_layers": 2, "bidirectional": True, "input_size": 3},
     "not an integer"),
    ("no layers", {"state_size": 4, "num_layers": 0, "bidirectional": 1, "input_size": 3}, "negative"),
])
def test_bad_sizes_are_clean_errors_and_write_nothing(cli, tmp_path, what, config, needle):
    flat = write_safetensors(tmp_path / "flat.safetensors",
                             {"rnn_param": mxnet_arrays("fused-cell/lstm-0000.params")["arg:lstm_parameters"]})
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    before = snapshot(tmp_path)
    result = cli("fuse", flat, "-r", "mxnet-fused-lstm-to-torch", "--config", tmp_path / "cfg.json",
                 "-o", tmp_path / "out.safetensors")
    assert result.exit_code == 2, what
    assert needle in result.stderr and result.stderr.startswith("error:") and "Traceback" not in result.output
    assert snapshot(tmp_path) == before


def test_without_a_symbol_or_config_the_var_asks_for_config(cli, tmp_path):
    flat = write_safetensors(tmp_path / "flat.safetensors",
                             {"rnn_param": mxnet_arrays("fused-cell/lstm-0000.params")["arg:lstm_parameters"]})
    result = cli("plan", flat, "-r", "mxnet-fused-lstm-to-torch")
    assert result.exit_code == 2 and "--config" in result.stderr and "needs config key" in result.stderr


def test_the_wrong_mode_is_refused_by_its_sizes(cli):
    """An LSTM's vector given to the GRU preset: the symbol's sizes do not add up for 3 gates."""
    result = cli("plan", MX / "fused-cell/lstm-0000.params", "-r", "mxnet-fused-gru-to-torch")
    assert result.exit_code == 2 and "736" in result.stderr


def test_the_symbol_leaves_out_what_it_cannot_tell():
    from fusectl.io.formats.mxnet_symbol import parse_symbol

    nodes = [{"op": "null", "name": "data", "inputs": []}, {"op": "null", "name": "p", "inputs": []}]
    rnn = {"op": "RNN", "name": "r", "inputs": [[0, 0, 0], [1, 0, 0]],
           "attrs": {"mode": "gru", "state_size": "4", "num_layers": "1"}}
    one = parse_symbol({"nodes": nodes + [rnn]}, "s.json")
    assert one.rnn_config({"arg:p": (3 * 4 * (3 + 4) + 2 * 3 * 4,)})["input_size"] == 3
    assert "input_size" not in one.rnn_config({"arg:p": (3 * 4 * (3 + 4) + 2 * 3 * 4 + 1,)})  # does not fit
    assert "input_size" not in one.rnn_config({"arg:p": (2 * 3 * 4,)})  # nothing left for i2h
    two = parse_symbol({"nodes": nodes + [rnn, dict(rnn, name="r2")]}, "s.json")
    assert two.rnn_config({"arg:p": (108,)}) is None
    odd = parse_symbol({"nodes": nodes + [dict(rnn, attrs={"mode": "gru", "state_size": "many"})]}, "s.json")
    assert odd.rnn_config({"arg:p": (108,)}) is None  # the params file still reads


def test_an_export_whose_rnn_node_is_not_mxnets_still_reads(tmp_path):
    import shutil

    from fusectl.io.checkpoint import open_checkpoint

    for name in ("lstm-0000.params", "lstm-symbol.json"):
        shutil.copy(MX / "fused-cell" / name, tmp_path / name)
    symbol = json.loads((tmp_path / "lstm-symbol.json").read_text())
    next(n for n in symbol["nodes"] if n["op"] == "RNN")["attrs"]["mode"] = "sru"
    (tmp_path / "lstm-symbol.json").write_text(json.dumps(symbol))
    checkpoint = open_checkpoint(str(tmp_path / "lstm-0000.params"))
    assert checkpoint.config is None and checkpoint.table.names() == ["arg:lstm_parameters"]


# ---------------------------------------------------------------- interleaved QKV


QKV_SPLIT = """version = 1
[[rule]]
op      = "deinterleave"
input   = "{p}.{t}"
outputs = ["{p}.query.{t}", "{p}.key.{t}", "{p}.value.{t}"]
groups  = 2
"""


def _attention(q, k, v, wo, bo, x, heads):
    """Self-attention in numpy from separate q, k, v projections (the consumer; MXNet's output is the judge)."""
    t, b, units = x.shape
    d = units // heads

    def heads_of(w, bias):  # [T, B, units] -> [B, heads, T, d]
        return (x @ w.T + bias).reshape(t, b, heads, d).transpose(1, 2, 0, 3)

    qh, kh, vh = heads_of(*q), heads_of(*k), heads_of(*v)
    scores = qh @ kh.transpose(0, 1, 3, 2) / np.sqrt(d)
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    context = (scores / scores.sum(-1, keepdims=True)) @ vh  # [B, heads, T, d]
    return context.transpose(2, 0, 1, 3).reshape(t, b, units) @ wo.T + bo


@pytest.mark.parametrize("rel,qkv,proj", [("attention/attention.params", "qkv", "proj"),
                                          ("attention/attention-0000.params", "arg:attn_dense0", "arg:attn_dense1")])
def test_interleaved_qkv_split_reproduces_mxnets_attention(cli, tmp_path, rel, qkv, proj):
    sep = "." if qkv == "qkv" else "_"
    rules = write_rules(tmp_path / "split.toml", QKV_SPLIT.replace('"{p}.{t}"', f'"{qkv}{sep}{{t}}"')
                        .replace('"{p}.', f'"{qkv}.'))
    out = load(fuse(cli, tmp_path, MX / rel, "-r", rules))
    io = io_of(rel)
    parts = [(out[f"{qkv}.{r}.weight"], out[f"{qkv}.{r}.bias"]) for r in ("query", "key", "value")]
    wo, bo = out[f"{proj}{sep}weight"], out[f"{proj}{sep}bias"]
    y = _attention(*parts, wo, bo, io["x"].astype(np.float64), 2)
    np.testing.assert_allclose(y, io["y"], rtol=0, atol=1e-5)
    # teeth: the same rows cut as plain thirds (no interleave) miss MXNet's output
    stored = mxnet_arrays(rel)
    thirds = list(zip(np.split(stored[f"{qkv}{sep}weight"], 3), np.split(stored[f"{qkv}{sep}bias"], 3)))
    wrong = _attention(*thirds, wo, bo, io["x"].astype(np.float64), 2)
    assert np.abs(wrong - io["y"]).max() > 1e-2


# ---------------------------------------------------------------- inspect and plan on every real file


@pytest.mark.parametrize("rel,preset", [
    ("lstm/lstm.params", "gluon-rnn-to-torch"), ("lstm/lstm-0000.params", "gluon-rnn-to-torch"),
    ("gru/gru.params", "gluon-rnn-to-torch"), ("gru/gru-0000.params", "gluon-rnn-to-torch"),
    ("rnn/rnn.params", "gluon-rnn-to-torch"), ("rnn/rnn-0000.params", "gluon-rnn-to-torch"),
    ("lstm-proj/proj.params", "gluon-rnn-to-torch"), ("lstm-proj/proj-0000.params", "gluon-rnn-to-torch"),
    ("fused-cell/lstm-0000.params", "mxnet-fused-lstm-to-torch"),
])
def test_inspect_and_plan_work_on_the_real_files(cli, rel, preset):
    doc = json.loads(ok(cli("inspect", MX / rel, "--json")).stdout)
    assert sorted(p["name"] for p in doc["parameters"]) == sorted(MANIFEST[rel]["names"])
    plan = json.loads(ok(cli("plan", MX / rel, "-r", preset, "--json")).stdout)
    assert plan["groups"] and all(not s.get("one_way") for g in plan["groups"] for s in g["steps"])
