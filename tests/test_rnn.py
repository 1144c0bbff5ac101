"""RNN presets: lstm-to-onnx, gru-to-onnx, lstm-to-mxnet-fused, gru-to-mxnet-fused (issue 5).

Fixtures (fixtures/rnn/, written by fixtures/generate_rnn.py with torch 2.13.0) hold PyTorch
state dicts and, in ``*.io.safetensors``, an input x [T, B, I] with PyTorch's outputs y, h_n
(and c_n) for zero initial states. The ONNX checks feed the packed W/R/B that ``fusectl fuse``
wrote into ONNX LSTM/GRU nodes built here with ``onnx.helper`` and run them on onnxruntime's
CPU provider. The layouts are also checked bitwise against tensors built here by hand from
PyTorch's names and gate order, and the MXNet vector against one assembled here in the
order MXNet documents. Nothing here uses fusectl's ops to build an expectation.
"""

from __future__ import annotations

import tomllib

import numpy as np
import pytest

from conftest import array_of, leftovers, ok, parse_safetensors, snapshot, write_safetensors

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

PRESETS = ["lstm-to-onnx", "gru-to-onnx", "lstm-to-mxnet-fused", "gru-to-mxnet-fused"]

# fixture: (kind, prefix of the RNN's names, layers, directions, other tensors in the file)
FIXTURES = {
    "lstm_bi2": ("lstm", "", 2, 2, []),
    "prefixed_lstm": ("lstm", "encoder.rnn.", 1, 1, ["head.weight", "head.bias"]),
    "gru1": ("gru", "", 1, 1, []),
    "gru_bi2": ("gru", "", 2, 2, []),
}
GATES = {"lstm": 4, "gru": 3}


def _load(path) -> dict[str, np.ndarray]:
    tensors, _ = parse_safetensors(path)
    return {name: array_of(entry) for name, entry in tensors.items()}


def _raw(path):
    return parse_safetensors(path)[0]


def _fuse(cli, copy_fixture, tmp_path, fixture, preset):
    src = copy_fixture(f"rnn/{fixture}.safetensors", f"{fixture}.safetensors")
    out = tmp_path / f"{fixture}.{preset}.safetensors"
    ok(cli("fuse", src, "-r", preset, "-o", out))
    return src, out


def _sfx(k: int, d: int) -> str:
    return f"_l{k}" + ("_reverse" if d else "")


def _gates(w: np.ndarray, kind: str, names: str) -> np.ndarray:
    """Rows of PyTorch's gates (i,f,g,o or r,z,n) re-emitted in the order ``names`` spells."""
    torch_order = "ifgo" if kind == "lstm" else "rzn"
    parts = dict(zip(torch_order, np.split(w, len(torch_order), axis=0)))
    return np.concatenate([parts[g] for g in names], axis=0)


# ---------------------------------------------------------------- presets load and document


@pytest.mark.parametrize("name", PRESETS)
def test_preset_is_listed_and_documented(cli, name):
    doc = tomllib.loads(ok(cli("rules", "show", name)).stdout)
    assert doc["version"] == 1
    description = doc.get("description")
    assert isinstance(description, str) and description.strip() and "\n" not in description
    assert all(rule.get("name") for rule in doc["rule"])
    assert {rule["op"] for rule in doc["rule"]} <= {"refuse", "rename", "reshape", "reorder", "concat", "stack"}
    listed = ok(cli("rules", "list")).stdout
    line = next(line for line in listed.splitlines() if line.split() and line.split()[0] == name)
    assert description in line


# ---------------------------------------------------------------- ONNX layout, bitwise


def _onnx_preset(kind: str) -> str:
    return f"{kind}-to-onnx"


@pytest.mark.parametrize("fixture", sorted(FIXTURES))
def test_onnx_layout_is_the_spec_table(cli, copy_fixture, tmp_path, fixture):
    kind, prefix, layers, dirs, others = FIXTURES[fixture]
    src, out = _fuse(cli, copy_fixture, tmp_path, fixture, _onnx_preset(kind))
    sd, got = _load(src), _load(out)
    expected_names = {f"{prefix}{m}_l{k}" for m in "WRB" for k in range(layers)} | set(others)
    assert set(got) == expected_names
    onnx_order = "iofc" if kind == "lstm" else "zrh"
    torch_names = "ifgo" if kind == "lstm" else "rzn"
    # ONNX letters -> PyTorch letters: c is PyTorch's g (LSTM), h is PyTorch's n (GRU)
    as_torch = onnx_order.replace("c", "g") if kind == "lstm" else onnx_order.replace("h", "n")
    assert sorted(as_torch) == sorted(torch_names)
    for k in range(layers):
        W, R, Bias = got[f"{prefix}W_l{k}"], got[f"{prefix}R_l{k}"], got[f"{prefix}B_l{k}"]
        hidden = sd[f"{prefix}weight_hh_l0"].shape[1]
        rows = GATES[kind] * hidden
        in_size = sd[f"{prefix}weight_ih{_sfx(k, 0)}"].shape[1]
        assert W.shape == (dirs, rows, in_size) and W.dtype == np.float32
        assert R.shape == (dirs, rows, hidden)
        assert Bias.shape == (dirs, 2 * rows)
        for d in range(dirs):  # direction 0 forward, 1 reverse
            s = _sfx(k, d)
            want_b = np.concatenate([_gates(sd[f"{prefix}bias_ih{s}"], kind, as_torch),
                                     _gates(sd[f"{prefix}bias_hh{s}"], kind, as_torch)])
            assert W[d].tobytes() == _gates(sd[f"{prefix}weight_ih{s}"], kind, as_torch).tobytes()
            assert R[d].tobytes() == _gates(sd[f"{prefix}weight_hh{s}"], kind, as_torch).tobytes()
            assert Bias[d].tobytes() == want_b.tobytes()
    for name in others:
        assert got[name].tobytes() == sd[name].tobytes()


# ---------------------------------------------------------------- ONNX numerics vs PyTorch


def _rnn_model(kind: str, packed: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]], dirs: int):
    """An ONNX graph: x [T, B, I] through one LSTM/GRU node per layer -> y [T, B, D*H], h_n, c_n."""
    nodes, inits = [], []
    h_outs, c_outs = [], []
    x = "x"
    direction = "bidirectional" if dirs == 2 else "forward"
    for k, (W, R, Bias) in enumerate(packed):
        hidden = R.shape[-1]
        names = [f"W_l{k}", f"R_l{k}"]
        inits += [numpy_helper.from_array(W, names[0]), numpy_helper.from_array(R, names[1])]
        if Bias is not None:
            names.append(f"B_l{k}")
            inits.append(numpy_helper.from_array(Bias, names[2]))
        outs = [f"Y_{k}", f"Yh_{k}"] + ([f"Yc_{k}"] if kind == "lstm" else [])
        attrs = {"hidden_size": hidden, "direction": direction}
        if kind == "gru":
            attrs["linear_before_reset"] = 1  # PyTorch's n = tanh(W_in x + b_in + r * (W_hn h + b_hn))
        nodes.append(helper.make_node(kind.upper(), [x] + names, outs, name=f"{kind}_{k}", **attrs))
        # Y [T, D, B, H] -> [T, B, D, H] -> [T, B, D*H]: the next layer's X (and PyTorch's y)
        nodes.append(helper.make_node("Transpose", [f"Y_{k}"], [f"Yt_{k}"], perm=[0, 2, 1, 3]))
        nodes.append(helper.make_node("Reshape", [f"Yt_{k}", "tbh"], [f"X_{k + 1}"]))
        x = f"X_{k + 1}"
        h_outs.append(f"Yh_{k}")
        c_outs.append(f"Yc_{k}")
    inits.append(numpy_helper.from_array(np.array([0, 0, -1], dtype=np.int64), "tbh"))
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    nodes.append(helper.make_node("Concat", h_outs, ["h_n"], axis=0))
    hidden, states = packed[-1][1].shape[-1], len(packed) * dirs
    outputs = {"y": ["T", "B", dirs * hidden], "h_n": [states, "B", hidden]}
    if kind == "lstm":
        nodes.append(helper.make_node("Concat", c_outs, ["c_n"], axis=0))
        outputs["c_n"] = [states, "B", hidden]
    graph = helper.make_graph(
        nodes, f"{kind}_stack",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", packed[0][0].shape[-1]])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n, shape in outputs.items()],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model, list(outputs)


def _run(model, outputs, x):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return dict(zip(outputs, sess.run(outputs, {"x": x})))


@pytest.mark.parametrize("fixture", sorted(FIXTURES))
def test_onnx_nodes_reproduce_pytorch(cli, copy_fixture, tmp_path, fixture, fixtures_dir):
    kind, prefix, layers, dirs, _ = FIXTURES[fixture]
    _, out = _fuse(cli, copy_fixture, tmp_path, fixture, _onnx_preset(kind))
    got = _load(out)
    io = _load(fixtures_dir / "rnn" / f"{fixture}.io.safetensors")
    packed = [(got[f"{prefix}W_l{k}"], got[f"{prefix}R_l{k}"], got[f"{prefix}B_l{k}"]) for k in range(layers)]
    model, outputs = _rnn_model(kind, packed, dirs)
    result = _run(model, outputs, io["x"])
    for name in outputs:
        assert result[name].shape == io[name].shape, name
        np.testing.assert_allclose(result[name], io[name], rtol=0, atol=1e-5, err_msg=f"{fixture}: {name}")


def test_onnx_without_unpacking_would_differ(cli, copy_fixture, tmp_path, fixtures_dir):
    """The check has teeth: PyTorch's own gate order fed to ONNX misses y by far more than 1e-5."""
    sd = _load(fixtures_dir / "rnn" / "lstm_bi2.safetensors")
    io = _load(fixtures_dir / "rnn" / "lstm_bi2.io.safetensors")
    packed = [(np.stack([sd[f"weight_ih{_sfx(k, d)}"] for d in range(2)]),
               np.stack([sd[f"weight_hh{_sfx(k, d)}"] for d in range(2)]),
               np.stack([np.concatenate([sd[f"bias_ih{_sfx(k, d)}"], sd[f"bias_hh{_sfx(k, d)}"]]) for d in range(2)]))
              for k in range(2)]
    model, outputs = _rnn_model("lstm", packed, 2)
    assert np.abs(_run(model, outputs, io["x"])["y"] - io["y"]).max() > 1e-2


# ---------------------------------------------------------------- unfuse: bitwise, all layouts


@pytest.mark.parametrize(
    "fixture,preset",
    [(f, _onnx_preset(FIXTURES[f][0])) for f in sorted(FIXTURES)]
    + [(f, f"{FIXTURES[f][0]}-to-mxnet-fused") for f in sorted(FIXTURES)]
    + [("lstm_proj", "lstm-to-mxnet-fused")],
)
def test_unfuse_with_provenance_is_bitwise(cli, copy_fixture, tmp_path, fixture, preset):
    src, out = _fuse(cli, copy_fixture, tmp_path, fixture, preset)
    before = snapshot(src)
    back = tmp_path / "back.safetensors"
    ok(cli("unfuse", out, "-o", back))
    assert _raw(back) == _raw(src)  # same names, dtypes, shapes and bytes
    assert snapshot(src) == before
    assert leftovers(tmp_path) == []


# ---------------------------------------------------------------- MXNet fused vector


def _mxnet_vector(sd: dict[str, np.ndarray], prefix: str, layers: int, dirs: int) -> np.ndarray:
    """MXNet's fused RNN parameter, built from the spec's ordering: every weight, then every
    bias; for each layer, for each direction (l, r): i2h, h2h (then h2r for projected LSTMs,
    weights only); each flattened row-major."""
    parts = []
    for t in ("weight", "bias"):
        for k in range(layers):
            for d in range(dirs):
                for g in ("ih", "hh", "hr"):
                    name = f"{prefix}{t}_{g}{_sfx(k, d)}"
                    if g == "hr" and (t == "bias" or name not in sd):
                        continue
                    parts.append(sd[name].reshape(-1))
    return np.concatenate(parts)


MXNET_CASES = {
    # fixture: expected length, written out from the shapes (G gates, H hidden, I input, D dirs)
    "lstm_bi2": 2 * (16 * 5 + 16 * 4) + 2 * (16 * 8 + 16 * 4) + 2 * 2 * (2 * 16),
    "prefixed_lstm": (16 * 5 + 16 * 4) + 2 * 16,
    "gru1": (12 * 5 + 12 * 4) + 2 * 12,
    "gru_bi2": 2 * (12 * 5 + 12 * 4) + 2 * (12 * 8 + 12 * 4) + 2 * 2 * (2 * 12),
    # proj_size 3, hidden 6: i2h [24, 5], h2h [24, 3], h2r [3, 6], biases 2 x 24
    "lstm_proj": (24 * 5 + 24 * 3 + 3 * 6) + 2 * 24,
}


@pytest.mark.parametrize("fixture", sorted(MXNET_CASES))
def test_mxnet_vector_length_and_order(cli, copy_fixture, tmp_path, fixture):
    kind, prefix, layers, dirs, others = FIXTURES.get(fixture, ("lstm", "", 1, 1, []))
    src, out = _fuse(cli, copy_fixture, tmp_path, fixture, f"{kind}-to-mxnet-fused")
    sd, got = _load(src), _load(out)
    assert set(got) == {f"{prefix}rnn_param"} | set(others)
    vec = got[f"{prefix}rnn_param"]
    assert vec.ndim == 1 and vec.dtype == np.float32
    assert vec.shape == (MXNET_CASES[fixture],)
    assert vec.tobytes() == _mxnet_vector(sd, prefix, layers, dirs).tobytes()
    for name in others:
        assert got[name].tobytes() == sd[name].tobytes()


def test_mxnet_layers_in_numeric_order(cli, tmp_path):
    """Eleven layers: layer 10 comes after layer 9 (numeric, not text order), in both presets."""
    rng = np.random.default_rng(0)
    hidden, in_size, layers = 2, 3, 11
    sd = {}
    for k in range(layers):
        sd[f"rnn.weight_ih_l{k}"] = rng.standard_normal((4 * hidden, in_size if k == 0 else hidden)).astype(np.float32)
        sd[f"rnn.weight_hh_l{k}"] = rng.standard_normal((4 * hidden, hidden)).astype(np.float32)
        sd[f"rnn.bias_ih_l{k}"] = rng.standard_normal(4 * hidden).astype(np.float32)
        sd[f"rnn.bias_hh_l{k}"] = rng.standard_normal(4 * hidden).astype(np.float32)
    src = write_safetensors(tmp_path / "deep.safetensors", sd)
    out = tmp_path / "deep.mx.safetensors"
    ok(cli("fuse", src, "-r", "lstm-to-mxnet-fused", "-o", out))
    assert _load(out)["rnn.rnn_param"].tobytes() == _mxnet_vector(sd, "rnn.", layers, 1).tobytes()
    out = tmp_path / "deep.onnx.safetensors"
    ok(cli("fuse", src, "-r", "lstm-to-onnx", "-o", out))
    got = _load(out)
    assert set(got) == {f"rnn.{m}_l{k}" for m in "WRB" for k in range(layers)}
    assert got["rnn.W_l10"][0].tobytes() == _gates(sd["rnn.weight_ih_l10"], "lstm", "iofg").tobytes()


# ---------------------------------------------------------------- refusals and limits


@pytest.mark.parametrize("preset", ["lstm-to-onnx", "gru-to-onnx", "gru-to-mxnet-fused"])
def test_proj_size_lstm_is_refused(cli, copy_fixture, tmp_path, preset):
    src = copy_fixture("rnn/lstm_proj.safetensors", "lstm_proj.safetensors")
    before = snapshot(tmp_path)
    out = tmp_path / "out" / "proj.safetensors"
    out.parent.mkdir()
    result = cli("fuse", src, "-r", preset, "-o", out)
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error:") and "Traceback" not in result.output
    assert "'weight_hr_l0'" in lines[-1] and "proj_size" in lines[-1]
    assert not out.exists() and list(out.parent.iterdir()) == []
    assert snapshot(tmp_path) == {**before, "out": "dir"}


def test_bias_free_rnn_gets_no_B(cli, tmp_path, fixtures_dir):
    """bias=False: W and R only (B is an optional ONNX input); MXNet's fused RNN needs biases."""
    sd = {k: v for k, v in _load(fixtures_dir / "rnn" / "lstm_bi2.safetensors").items() if "bias" not in k}
    src = write_safetensors(tmp_path / "nobias.safetensors", sd)
    out = tmp_path / "nobias.onnx.safetensors"
    ok(cli("fuse", src, "-r", "lstm-to-onnx", "-o", out))
    assert set(_load(out)) == {f"{m}_l{k}" for m in "WR" for k in range(2)}
    back = tmp_path / "back.safetensors"
    ok(cli("unfuse", out, "-o", back))
    assert _raw(back) == _raw(src)
    result = cli("fuse", src, "-r", "lstm-to-mxnet-fused", "-o", tmp_path / "mx.safetensors")
    assert result.exit_code == 2 and result.stderr.startswith("error:") and "bias_ih_l" in result.stderr
    assert not (tmp_path / "mx.safetensors").exists()


def test_not_an_rnn_is_an_error(cli, copy_fixture, tmp_path):
    src = copy_fixture("tied-embeddings.safetensors")
    for preset in PRESETS:
        result = cli("fuse", src, "-r", preset, "-o", tmp_path / "x.safetensors")
        assert result.exit_code == 2 and result.stderr.startswith("error:"), (preset, result.output)
        assert "weight_ih_l" in result.stderr


def test_unfuse_with_rules_skips_refuse_guards(tmp_path):
    from click.testing import CliRunner
    from safetensors.numpy import save_file
    from fusectl.cli import main as cli_main
    src = tmp_path / "m.safetensors"
    save_file({"a.w": np.ones((2, 2), np.float32)}, str(src))
    rules = tmp_path / "r.toml"
    rules.write_text('version = 1\n[[rule]]\nop = "refuse"\ninput = "{p*}.weight_hr_l{k:int}"\n'
                     'message = "no"\noptional = true\n[[rule]]\nop = "rename"\ninput = "a.w"\noutput = "b.w"\n')
    runner = CliRunner()
    fused, back = tmp_path / "f.safetensors", tmp_path / "b.safetensors"
    assert runner.invoke(cli_main, ["fuse", str(src), "-r", str(rules), "-o", str(fused)]).exit_code == 0
    result = runner.invoke(cli_main, ["unfuse", str(fused), "-r", str(rules), "-o", str(back)])
    assert result.exit_code == 0, result.output
