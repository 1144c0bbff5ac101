"""End-to-end CLI tests: inspect, plan, fuse/unfuse round trips on real-format fixtures, rules.

Each fixture is copied into tmp_path first. Expected layouts are built here by hand from the
original tensors (numpy slicing of the stored bytes), never by calling fusectl's own ops.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import safetensors
import safetensors.numpy

from conftest import (
    FIXTURES,
    array_of,
    load_checkpoint_raw,
    ok,
    parse_safetensors,
    snapshot,
    write_rules,
)

LLAMA = "tiny-llama-gqa"
BF16 = "tiny-llama-gqa-bf16-sharded"
ALL_PRESETS = [
    "bert-qkv", "bert-qkv-interleaved", "gpt-neox-qkv", "llama-gate-up",
    "llama-qkv", "llama-rope", "mixtral-experts", "phi3-unfuse",
]
SPEC_INSPECT_KEYS = {"format", "files", "parameters", "ties", "unique_count", "total_bytes", "provenance"}


def assert_same_checkpoint(a, b):
    """Names, dtypes, shapes and bytes identical (file layout and metadata may differ)."""
    ta, tb = load_checkpoint_raw(a), load_checkpoint_raw(b)
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name][0] == tb[name][0], f"{name}: dtype {ta[name][0]} vs {tb[name][0]}"
        assert ta[name][1] == tb[name][1], f"{name}: shape {ta[name][1]} vs {tb[name][1]}"
        assert ta[name][2] == tb[name][2], f"{name}: bytes differ"


# ------------------------------------------------------------------------------------ inspect


def test_inspect_json_has_spec_keys_and_parameter_records(cli, copy_fixture):
    src = copy_fixture(LLAMA)
    report = ok(cli("inspect", src, "--json")).json()
    # SPEC §4: "at least" these keys; print the extra ones in the assertion if any is missing
    assert SPEC_INSPECT_KEYS <= set(report), sorted(report)
    assert report["format"] == "safetensors"
    assert [os.path.realpath(f) for f in report["files"]] == [os.path.realpath(src / "model.safetensors")]
    assert report["provenance"] is None
    assert report["ties"] == []

    stored = load_checkpoint_raw(src)
    params = report["parameters"]
    assert [p["name"] for p in params] == sorted(stored), "parameters must be in structural-name order"
    for p in params:
        assert set(p) == {"name", "unique", "dtype", "shape", "nbytes"}, p
        dtype, shape, raw = stored[p["name"]]
        assert p["unique"] == p["name"]
        assert p["dtype"] == dtype == "F32"
        assert p["shape"] == shape
        assert p["nbytes"] == len(raw)
    assert report["unique_count"] == len(stored) == 21
    assert report["total_bytes"] == sum(len(r) for _, _, r in stored.values())


def test_inspect_json_sharded_bf16(cli, copy_fixture):
    src = copy_fixture(BF16)
    report = ok(cli("inspect", src, "--json")).json()
    assert report["format"] == "safetensors-sharded"
    assert sorted(os.path.basename(f) for f in report["files"]) == [
        f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)
    ]
    assert {p["dtype"] for p in report["parameters"]} == {"BF16"}
    stored = load_checkpoint_raw(src)
    assert [p["name"] for p in report["parameters"]] == sorted(stored)
    assert report["total_bytes"] == sum(len(r) for _, _, r in stored.values())


def test_inspect_text_lists_every_parameter(cli, copy_fixture):
    src = copy_fixture(LLAMA)
    out = ok(cli("inspect", src)).stdout
    for name in load_checkpoint_raw(src):
        assert name in out
    assert "21 unique" in out


def test_inspect_reads_headers_only(cli, copy_fixture, monkeypatch):
    src = copy_fixture(BF16)
    import fusectl.tensors

    def forbidden(*a, **k):
        raise AssertionError("inspect read tensor data")

    monkeypatch.setattr(fusectl.tensors, "read_ranges", forbidden)
    monkeypatch.setattr(os, "preadv", forbidden)
    monkeypatch.setattr(os, "pread", forbidden)
    monkeypatch.setattr(os, "copy_file_range", forbidden)
    monkeypatch.setattr(np, "fromfile", forbidden)
    result = cli("inspect", src, "--json")
    assert result.exit_code == 0, result.output
    assert "inspect read tensor data" not in result.output
    assert len(result.json()["parameters"]) == 21
    # and the patch is effective: --detect-ties must read data, so it now fails
    assert cli("inspect", src, "--json", "--detect-ties").exit_code != 0


def test_inspect_missing_path(cli, tmp_path):
    result = cli("inspect", tmp_path / "nope.safetensors")
    assert result.exit_code == 2
    assert result.stderr.startswith("error:")
    assert "nope.safetensors" in result.stderr


# --------------------------------------------------------------------------------------- plan


def test_plan_text(cli, copy_fixture):
    src = copy_fixture(LLAMA)
    before = snapshot(src.parent)
    out = ok(cli("plan", src, "-r", "llama-qkv")).stdout
    assert "attn-qkv" in out
    assert "model.layers.0.self_attn.qkv_proj.weight" in out
    assert "model.layers.1.self_attn.qkv_proj.weight" in out
    assert "F32[64, 32]" in out
    assert "17 names" in out
    assert snapshot(src.parent) == before, "plan must not write anything"


def test_plan_json(cli, copy_fixture):
    src = copy_fixture(LLAMA)
    doc = ok(cli("plan", src, "-r", "llama-qkv", "-r", "llama-gate-up", "--json")).json()
    groups = doc["groups"]
    assert [g["rule"] for g in groups] == ["attn-qkv", "mlp-gate-up"]
    assert [g["op"] for g in groups] == ["concat", "concat"]
    qkv = groups[0]["steps"]
    assert len(qkv) == 2
    assert qkv[0]["inputs"] == [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"]
    assert qkv[0]["outputs"] == ["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv[0]["output_specs"] == [["F32", [64, 32]]]
    gate_up = groups[1]["steps"][0]
    assert gate_up["output_specs"] == [["F32", [128, 32]]]
    result = doc["result"]
    names = [p["name"] for p in result["parameters"]]
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.self_attn.q_proj.weight" not in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert result["unique_count"] == 21 - 2 * 2 - 2 * 1 == 15


def test_plan_reads_headers_only(cli, copy_fixture, monkeypatch):
    src = copy_fixture(LLAMA)
    import fusectl.tensors

    def forbidden(*a, **k):
        raise AssertionError("plan read tensor data")

    monkeypatch.setattr(fusectl.tensors, "read_ranges", forbidden)
    monkeypatch.setattr(os, "preadv", forbidden)
    monkeypatch.setattr(os, "pread", forbidden)
    ok(cli("plan", src, "-r", "llama-qkv", "-r", "llama-gate-up", "--json"))


def test_plan_without_rules_is_a_usage_error(cli, copy_fixture):
    src = copy_fixture(LLAMA)
    result = cli("plan", src)
    assert result.exit_code == 2
    assert "-r" in result.stderr


# ------------------------------------------------------------------------ fuse/unfuse: llama


def test_llama_fuse_layout_and_unfuse_round_trip(cli, copy_fixture, tmp_path):
    src = copy_fixture(LLAMA)
    before = snapshot(src)
    fused = tmp_path / "fused"
    ok(cli("fuse", src, "-r", "llama-qkv", "-r", "llama-gate-up", "-o", fused))
    orig = load_checkpoint_raw(src)
    out = load_checkpoint_raw(fused)
    for i in range(2):
        p = f"model.layers.{i}."
        q, k, v = (array_of(orig[p + f"self_attn.{x}_proj.weight"]) for x in "qkv")
        assert q.shape == (32, 32) and k.shape == (16, 32) and v.shape == (16, 32)
        qkv = array_of(out[p + "self_attn.qkv_proj.weight"])
        # GQA: unequal sizes, exact bytes
        assert qkv.tobytes() == np.concatenate([q, k, v]).tobytes()
        assert qkv.shape == (64, 32)
        gate, up = (array_of(orig[p + f"mlp.{x}_proj.weight"]) for x in ("gate", "up"))
        assert array_of(out[p + "mlp.gate_up_proj.weight"]).tobytes() == np.concatenate([gate, up]).tobytes()
        for gone in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                     "mlp.gate_proj.weight", "mlp.up_proj.weight"):
            assert p + gone not in out
    untouched = [n for n in orig if "_proj" not in n or "o_proj" in n or "down_proj" in n]
    for n in untouched:
        assert out[n] == orig[n]
    assert len(out) == 15

    restored = tmp_path / "restored"
    ok(cli("unfuse", fused, "-o", restored))
    assert_same_checkpoint(src, restored)
    assert snapshot(src) == before


def test_llama_output_keeps_hf_metadata_and_loads_with_safetensors(cli, copy_fixture, tmp_path):
    src = copy_fixture(LLAMA)
    fused = tmp_path / "fused"
    ok(cli("fuse", src, "-r", "llama-qkv", "-o", fused))
    path = fused / "model.safetensors"
    with safetensors.safe_open(str(path), framework="numpy") as f:
        assert f.metadata()["format"] == "pt"
        assert "fusectl" in f.metadata()
        qkv = f.get_tensor("model.layers.1.self_attn.qkv_proj.weight")
    loaded = safetensors.numpy.load_file(str(path))
    assert len(loaded) == 17
    orig = safetensors.numpy.load_file(str(src / "model.safetensors"))
    expected = np.concatenate([orig[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv"])
    np.testing.assert_array_equal(qkv, expected)
    for name, array in orig.items():
        if "self_attn" not in name or "o_proj" in name:
            np.testing.assert_array_equal(loaded[name], array)


def test_folder_output_copies_config_and_companions(cli, copy_fixture, tmp_path):
    src = copy_fixture(LLAMA)
    fused = tmp_path / "fused"
    ok(cli("fuse", src, "-r", "llama-qkv", "-o", fused))
    assert sorted(os.listdir(fused)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert (fused / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert (fused / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()
    # the fused folder is itself a usable input (config: variables resolve from the copy)
    ok(cli("plan", fused, "-r", "llama-gate-up"))


def test_single_file_output(cli, copy_fixture, tmp_path):
    src = copy_fixture(LLAMA)
    out = tmp_path / "fused.safetensors"
    ok(cli("fuse", src, "-r", "llama-qkv", "-o", out))
    assert out.is_file()
    assert not (tmp_path / "config.json").exists()
    tensors, meta = parse_safetensors(out)
    assert "model.layers.0.self_attn.qkv_proj.weight" in tensors
    assert meta["format"] == "pt"
    back = tmp_path / "back.safetensors"
    ok(cli("unfuse", out, "-o", back))
    assert_same_checkpoint(src, back)


def test_unfuse_with_rules_without_provenance_refuses_to_guess(cli, copy_fixture, tmp_path):
    src = copy_fixture(LLAMA)
    fused = tmp_path / "fused"
    ok(cli("fuse", src, "-r", "llama-qkv", "-o", fused))
    # strip provenance: rewrite the file with only the HF metadata
    path = fused / "model.safetensors"
    arrays = safetensors.numpy.load_file(str(path))
    safetensors.numpy.save_file(arrays, str(path), metadata={"format": "pt"})
    assert cli("inspect", fused, "--json").json()["provenance"] is None

    # qkv_proj could as well have been in the input, untouched: only a provenance could tell
    restored = tmp_path / "restored"
    result = cli("unfuse", fused, "-r", "llama-qkv", "-o", restored)
    assert result.exit_code == 2 and "has no fusectl provenance" in result.stderr
    assert not restored.exists()


def test_fuse_json_report(cli, copy_fixture, tmp_path):
    src = copy_fixture(LLAMA)
    fused = tmp_path / "fused"
    result = ok(cli("fuse", src, "-r", "llama-qkv", "-r", "llama-gate-up", "-o", fused, "--json"))
    doc = json.loads(result.stdout)  # the whole stdout is one JSON document
    for key in ("output", "tensors", "unique_bytes", "steps", "ties"):
        assert key in doc, key
    assert doc["tensors"] == 15
    assert doc["steps"] == 4
    assert doc["unique_bytes"] == sum(len(r) for _, _, r in load_checkpoint_raw(fused).values())
    assert doc["ties"] == []
    assert os.path.realpath(doc["output"]) == os.path.realpath(fused)


def test_fuse_records_provenance_shown_by_inspect(cli, copy_fixture, tmp_path):
    src = copy_fixture(LLAMA)
    fused = tmp_path / "fused"
    ok(cli("fuse", src, "-r", "llama-qkv", "-o", fused))
    prov = cli("inspect", fused, "--json").json()["provenance"]
    assert prov is not None
    assert [g["rule"] for g in prov["plan"]] == ["attn-qkv"]
    assert len(prov["plan"][0]["steps"]) == 2


def test_fuse_twice_accumulates_provenance_and_unfuse_undoes_both(cli, copy_fixture, tmp_path):
    src = copy_fixture(LLAMA)
    one, two, back = tmp_path / "one", tmp_path / "two", tmp_path / "back"
    ok(cli("fuse", src, "-r", "llama-qkv", "-o", one))
    ok(cli("fuse", one, "-r", "llama-gate-up", "-o", two))
    prov = cli("inspect", two, "--json").json()["provenance"]
    assert [g["rule"] for g in prov["plan"]] == ["attn-qkv", "mlp-gate-up"]
    ok(cli("unfuse", two, "-o", back))
    assert_same_checkpoint(src, back)


# ------------------------------------------------------------------------------ bf16 sharded


def test_bf16_sharded_round_trip_with_sharded_output(cli, copy_fixture, tmp_path):
    src = copy_fixture(BF16)
    before = snapshot(src)
    fused = tmp_path / "fused"
    ok(cli("fuse", src, "-r", "llama-qkv", "-r", "llama-gate-up", "-o", fused, "--max-shard-size", "20KB"))
    shards = sorted(n for n in os.listdir(fused) if n.endswith(".safetensors"))
    assert len(shards) >= 2, shards
    assert "model.safetensors.index.json" in os.listdir(fused)
    assert "config.json" in os.listdir(fused)
    index = json.loads((fused / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    total = 0
    for shard in shards:
        tensors, meta = parse_safetensors(fused / shard)
        assert meta.get("format") == "pt"
        size = sum(len(r) for _, _, r in tensors.values())
        assert size <= 20_000 or len(tensors) == 1, f"{shard}: {size} bytes"
        total += size
        for name in tensors:
            assert index["weight_map"][name] == shard
        with safetensors.safe_open(str(fused / shard), framework="numpy") as f:  # header is valid
            assert sorted(f.keys()) == sorted(tensors)
    assert index["metadata"]["total_size"] == total

    orig = load_checkpoint_raw(src)
    out = load_checkpoint_raw(fused)
    assert {d for d, _, _ in out.values()} == {"BF16"}
    for i in range(2):
        p = f"model.layers.{i}.self_attn."
        want = b"".join(orig[p + f"{x}_proj.weight"][2] for x in "qkv")
        assert out[p + "qkv_proj.weight"] == ("BF16", [64, 32], want)

    restored = tmp_path / "restored"
    ok(cli("unfuse", fused, "-o", restored, "--max-shard-size", "20KB"))
    assert_same_checkpoint(src, restored)
    assert snapshot(src) == before


def test_bf16_read_through_library_header_reader(cli, copy_fixture, tmp_path):
    """The sharded output read back with fusectl's own reader gives the same bytes as by hand."""
    from fusectl.io.formats.safetensors_file import read_header

    src = copy_fixture(BF16)
    fused = tmp_path / "fused"
    ok(cli("fuse", src, "-r", "llama-qkv", "-o", fused, "--max-shard-size", "20KB"))
    by_hand = load_checkpoint_raw(fused)
    seen = {}
    for shard in sorted(fused.glob("*.safetensors")):
        tensors, _ = read_header(str(shard))
        for name, t in tensors.items():
            seen[name] = t.read().tobytes()
            assert str(t.spec.dtype) == "BF16"
    assert seen == {n: r for n, (_, _, r) in by_hand.items()}


def test_unsharded_output_when_under_max_shard_size(cli, copy_fixture, tmp_path):
    src = copy_fixture(BF16)
    fused = tmp_path / "fused"
    ok(cli("fuse", src, "-r", "llama-qkv", "-o", fused, "--max-shard-size", "5GB"))
    assert sorted(n for n in os.listdir(fused) if "safetensors" in n) == ["model.safetensors"]


def test_sharded_input_keeps_its_sharding_by_default(cli, copy_fixture, tmp_path):
    src = copy_fixture(BF16)
    fused = tmp_path / "fused"
    ok(cli("fuse", src, "-r", "llama-qkv", "-o", fused))
    shards = sorted(n for n in os.listdir(fused) if n.endswith(".safetensors"))
    assert shards == sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))
    index = json.loads((fused / "model.safetensors.index.json").read_text())
    source = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    # every tensor that passed through unchanged stays in the shard it came from
    for name, shard in index["weight_map"].items():
        if name in source:
            assert shard == source[name], name


# ------------------------------------------------------------------------------------- phi3


def test_phi3_unfuse_preset_splits_rows(cli, copy_fixture, tmp_path):
    src = copy_fixture("tiny-phi3")
    out = tmp_path / "llama-names"
    ok(cli("fuse", src, "-r", "phi3-unfuse", "-o", out))
    orig = load_checkpoint_raw(src)
    split = load_checkpoint_raw(out)
    for i in range(2):
        p = f"model.layers.{i}."
        qkv = array_of(orig[p + "self_attn.qkv_proj.weight"])
        assert qkv.shape == (64, 32)
        q = array_of(split[p + "self_attn.q_proj.weight"])
        k = array_of(split[p + "self_attn.k_proj.weight"])
        v = array_of(split[p + "self_attn.v_proj.weight"])
        assert (q.shape, k.shape, v.shape) == ((32, 32), (16, 32), (16, 32))
        np.testing.assert_array_equal(q, qkv[:32])
        np.testing.assert_array_equal(k, qkv[32:48])
        np.testing.assert_array_equal(v, qkv[48:64])
        gate_up = array_of(orig[p + "mlp.gate_up_proj.weight"])
        np.testing.assert_array_equal(array_of(split[p + "mlp.gate_proj.weight"]), gate_up[:64])
        np.testing.assert_array_equal(array_of(split[p + "mlp.up_proj.weight"]), gate_up[64:])
        assert p + "self_attn.qkv_proj.weight" not in split
        assert p + "mlp.gate_up_proj.weight" not in split
    back = tmp_path / "back"
    ok(cli("unfuse", out, "-o", back))
    assert_same_checkpoint(src, back)


def test_phi3_split_then_llama_fuse_gives_back_phi3(cli, copy_fixture, tmp_path):
    """phi3-unfuse and llama-qkv/llama-gate-up are inverse layouts with the same names."""
    src = copy_fixture("tiny-phi3")
    out, again = tmp_path / "split", tmp_path / "again"
    ok(cli("fuse", src, "-r", "phi3-unfuse", "-o", out))
    ok(cli("fuse", out, "-r", "llama-qkv", "-r", "llama-gate-up", "-o", again))
    assert_same_checkpoint(src, again)


# -------------------------------------------------------------------------------- gpt-neox


def test_gpt_neox_deinterleave_matches_per_head_layout(cli, copy_fixture, tmp_path):
    src = copy_fixture("tiny-gpt-neox")
    out = tmp_path / "split"
    ok(cli("fuse", src, "-r", "gpt-neox-qkv", "-o", out))
    orig = load_checkpoint_raw(src)
    split = load_checkpoint_raw(out)
    heads, head_dim = 4, 8
    for i in range(2):
        p = f"gpt_neox.layers.{i}.attention."
        w = array_of(orig[p + "query_key_value.weight"])
        b = array_of(orig[p + "query_key_value.bias"])
        assert w.shape == (96, 32) and b.shape == (96,)
        per_head = w.reshape(heads, 3, head_dim, -1)
        per_head_b = b.reshape(heads, 3, head_dim)
        for j, part in enumerate(("query", "key", "value")):
            want = per_head[:, j].reshape(heads * head_dim, -1)
            got = array_of(split[p + f"{part}.weight"])
            assert got.shape == (32, 32)
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(array_of(split[p + f"{part}.bias"]), per_head_b[:, j].reshape(-1))
        assert p + "query_key_value.weight" not in split
    back = tmp_path / "back"
    ok(cli("unfuse", out, "-o", back))
    assert_same_checkpoint(src, back)


# ------------------------------------------------------------------------------------ bert


@pytest.mark.parametrize("preset", ["bert-qkv", "bert-qkv-interleaved"])
def test_bert_qkv_layouts_and_round_trip(cli, copy_fixture, tmp_path, preset):
    src = copy_fixture("tiny-bert")
    out = tmp_path / "fused"
    ok(cli("fuse", src, "-r", preset, "-o", out))
    orig = load_checkpoint_raw(src)
    fused = load_checkpoint_raw(out)
    heads, head_dim = 4, 8
    layers = sorted({n.split(".layer.")[1].split(".")[0] for n in orig if ".layer." in n})
    assert layers == ["0", "1"]
    for i in layers:
        prefix = next(n for n in orig if n.endswith(f"layer.{i}.attention.self.query.weight"))[: -len("query.weight")]
        for t in ("weight", "bias"):
            q, k, v = (array_of(orig[prefix + f"{x}.{t}"]) for x in ("query", "key", "value"))
            got = array_of(fused[prefix + f"qkv.{t}"])
            if preset == "bert-qkv":
                want = np.concatenate([q, k, v])
            else:
                rest = q.shape[1:]
                want = np.stack(
                    [x.reshape(heads, head_dim, *rest) for x in (q, k, v)], axis=1
                ).reshape(3 * heads * head_dim, *rest)
            assert got.shape == want.shape
            np.testing.assert_array_equal(got, want)
            for x in ("query", "key", "value"):
                assert prefix + f"{x}.{t}" not in fused
    back = tmp_path / "back"
    ok(cli("unfuse", out, "-o", back))
    assert_same_checkpoint(src, back)


def test_bert_interleaved_differs_from_plain_concat(cli, copy_fixture, tmp_path):
    """Guards the layout check above: the two presets must not produce the same bytes."""
    src = copy_fixture("tiny-bert")
    ok(cli("fuse", src, "-r", "bert-qkv", "-o", tmp_path / "a"))
    ok(cli("fuse", src, "-r", "bert-qkv-interleaved", "-o", tmp_path / "b"))
    a, b = load_checkpoint_raw(tmp_path / "a"), load_checkpoint_raw(tmp_path / "b")
    name = next(n for n in a if n.endswith("layer.0.attention.self.qkv.weight"))
    assert a[name][1] == b[name][1]
    assert a[name][2] != b[name][2]


# --------------------------------------------------------------------------------- mixtral


def test_mixtral_experts_stack(cli, copy_fixture, tmp_path):
    src = copy_fixture("tiny-mixtral")
    out = tmp_path / "stacked"
    ok(cli("fuse", src, "-r", "mixtral-experts", "-o", out))
    orig = load_checkpoint_raw(src)
    stacked = load_checkpoint_raw(out)
    for i in range(2):
        p = f"model.layers.{i}.block_sparse_moe.experts."
        for n, shape in ((1, (64, 32)), (2, (32, 64)), (3, (64, 32))):
            got = array_of(stacked[p + f"w{n}"])
            assert got.shape == (4, *shape)
            for e in range(4):
                np.testing.assert_array_equal(got[e], array_of(orig[p + f"{e}.w{n}.weight"]))
                assert p + f"{e}.w{n}.weight" not in stacked
        gate = f"model.layers.{i}.block_sparse_moe.gate.weight"
        assert stacked[gate] == orig[gate]
    back = tmp_path / "back"
    ok(cli("unfuse", out, "-o", back))
    assert_same_checkpoint(src, back)


# -------------------------------------------------------------------------------------- npz


def test_npz_output_round_trip(cli, copy_fixture, tmp_path):
    src = copy_fixture(LLAMA)
    npz = tmp_path / "fused.npz"
    ok(cli("fuse", src, "-r", "llama-qkv", "-o", npz))
    orig = safetensors.numpy.load_file(str(src / "model.safetensors"))
    with np.load(npz, allow_pickle=False) as z:
        qkv = z["model.layers.0.self_attn.qkv_proj.weight"]
        np.testing.assert_array_equal(
            qkv, np.concatenate([orig[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"])
        )
        np.testing.assert_array_equal(z["lm_head.weight"], orig["lm_head.weight"])
    report = ok(cli("inspect", npz, "--json")).json()
    assert report["format"] == "npz"
    assert report["provenance"] is not None
    back = tmp_path / "back.safetensors"
    ok(cli("unfuse", npz, "-o", back))
    assert_same_checkpoint(src, back)


def test_npz_bf16_round_trip_through_cli(cli, copy_fixture, tmp_path):
    src = copy_fixture(BF16)
    npz = tmp_path / "fused.npz"
    ok(cli("fuse", src, "-r", "llama-qkv", "-o", npz))
    report = ok(cli("inspect", npz, "--json")).json()
    assert {p["dtype"] for p in report["parameters"]} == {"BF16"}
    back = tmp_path / "back"
    ok(cli("unfuse", npz, "-o", back))
    assert_same_checkpoint(src, back)


# ------------------------------------------------------------------------------------ rules


def test_rules_list_names_every_preset(cli):
    out = ok(cli("rules", "list")).stdout
    lines = [line for line in out.splitlines() if line.strip()]
    names = [line.split()[0] for line in lines]
    for preset in ALL_PRESETS:
        assert preset in names, preset
    for line in lines:
        assert len(line.split(None, 1)) == 2, f"no description: {line!r}"


def test_rules_show_prints_toml(cli):
    import tomllib

    out = ok(cli("rules", "show", "llama-qkv")).stdout
    doc = tomllib.loads(out)
    assert doc["version"] == 1
    assert doc["rule"][0]["op"] == "concat"
    assert doc["rule"][0]["output"].endswith("self_attn.qkv_proj.{t}")


def test_rules_show_unknown_preset(cli):
    result = cli("rules", "show", "no-such-preset")
    assert result.exit_code == 2
    assert result.stderr.startswith("error:")
    assert "no-such-preset" in result.stderr
    assert "fusectl rules list" in result.stderr  # says where the presets are listed
    typo = cli("rules", "show", "llama-qvk")
    assert typo.exit_code == 2 and "did you mean 'llama-qkv'" in typo.stderr


def test_rules_file_path_is_used_before_preset_name(cli, copy_fixture, tmp_path):
    src = copy_fixture(LLAMA)
    rules = write_rules(tmp_path / "llama-qkv", """
version = 1
[[rule]]
name = "only-rename"
op = "rename"
input = "lm_head.weight"
output = "output.weight"
""")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        doc = ok(cli("plan", src, "-r", "llama-qkv", "--json")).json()
    finally:
        os.chdir(cwd)
    assert [g["rule"] for g in doc["groups"]] == ["only-rename"]
    assert rules.exists()


def test_version_and_help(cli):
    assert ok(cli("--version")).stdout.strip()
    for sub in ("inspect", "plan", "fuse", "unfuse"):
        out = ok(cli(sub, "--help")).stdout
        assert "Example" in out, sub


def test_inspect_text_escapes_control_characters_in_names(cli, tmp_path):
    """STYLE: names read from a file are escaped before printing (no raw \\r, BEL, ESC)."""
    from conftest import write_safetensors

    name = "evil\x07\rname\x1b]0;pwned\x07"
    path = write_safetensors(tmp_path / "evil.safetensors", {name: np.zeros(2, np.float32)})
    result = cli("inspect", path)
    assert result.exit_code == 0, result.output
    for ch in ("\x07", "\r", "\x1b"):
        assert ch not in result.stdout, f"{ch!r} printed raw"
    assert "evil" in result.stdout
    # JSON keeps the exact name (json escapes it)
    doc = ok(cli("inspect", path, "--json")).json()
    assert doc["parameters"][0]["name"] == name


def test_folder_output_keeps_the_whole_tree_of_the_input_folder(cli, copy_fixture, tmp_path):
    """sentence-transformers keeps modules in subfolders (1_Pooling/config.json); a module's
    own weights live there too (2_Dense/model.safetensors) and an empty module folder is part
    of the layout. Everything but the checkpoint's own top-level weights travels unchanged."""
    src = copy_fixture("tiny-bert")
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}\n')
    (src / "2_Dense").mkdir()
    safetensors.numpy.save_file({"linear.weight": np.ones((4, 32), np.float32)}, str(src / "2_Dense" / "model.safetensors"))
    (src / "3_Normalize").mkdir()
    (src / "modules.json").write_text("[]\n")
    (src / "pytorch_model.bin").write_bytes(b"stale weights in the old layout")
    fused, back = tmp_path / "fused", tmp_path / "back"
    ok(cli("fuse", src, "-r", "bert-qkv", "-o", fused))
    ok(cli("unfuse", fused, "-o", back))
    expected = {k: v for k, v in snapshot(src).items() if k not in ("model.safetensors", "pytorch_model.bin")}
    for out in (fused, back):
        got = {k: v for k, v in snapshot(out).items() if k != "model.safetensors"}
        assert got == expected
    assert_same_checkpoint(src, back)


@pytest.mark.parametrize("name", ["model.onnx", "out.gguf", "out.PT"])
def test_an_output_named_like_a_format_fusectl_does_not_write_is_refused(cli, copy_fixture, tmp_path, name):
    src = copy_fixture(LLAMA)
    before = snapshot(tmp_path)
    result = cli("fuse", src, "-r", "llama-qkv", "-o", tmp_path / name)
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and name in result.stderr
    assert ".safetensors, .npz, .pt, .pth, .bin, .ckpt, .params, .nd or a folder" in result.stderr
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "text, value",
    [("5GB", 5 * 10**9), ("20KB", 20_000), ("1GiB", 2**30), ("123", 123), ("1.5MB", 1_500_000), ("2 mib", 2 * 2**20)],
)
def test_max_shard_size_parses_sizes(text, value):
    from fusectl.cli import SizeType

    assert SizeType().convert(text, None, None) == value


@pytest.mark.parametrize("text", ["", "lots", "5XB", "-1GB", "0", "0KB"])
def test_max_shard_size_rejects(cli, copy_fixture, tmp_path, text):
    import click

    from fusectl.cli import SizeType

    with pytest.raises(click.BadParameter):
        SizeType().convert(text, None, None)
    out = tmp_path / "out"
    result = cli("fuse", copy_fixture(LLAMA), "-r", "llama-qkv", "-o", out, "--max-shard-size", text)
    assert result.exit_code == 2 and result.stderr.startswith("error: --max-shard-size") and not out.exists()


def test_the_public_api_does_what_the_cli_does(tmp_path):
    """import fusectl: fuse, unfuse, verify, plan and export as functions, names stable even
    after the verify subpackage is loaded."""
    import fusectl
    import fusectl.verification.runner  # noqa: F401 - loading a submodule must not replace fusectl.verify

    assert callable(fusectl.verify) and callable(fusectl.plan)
    assert set(fusectl.__all__) >= {"open_checkpoint", "plan", "fuse", "unfuse", "export", "verify"}
    fused, back = tmp_path / "fused", tmp_path / "back.safetensors"
    report = fusectl.fuse(FIXTURES / LLAMA, ["llama-qkv"], fused)
    assert report.steps == 2 and report.output == str(fused)
    assert fusectl.verify(FIXTURES / LLAMA, fused).passed
    fusectl.unfuse(fused, back)
    assert_same_checkpoint(FIXTURES / LLAMA, back)
    with pytest.raises(fusectl.FusectlError, match="already exists"):
        fusectl.fuse(FIXTURES / LLAMA, ["llama-qkv"], fused)


# ------------------------------------------------------------------------- the CLI is an edge

CLI_MAY_IMPORT = {"fusectl", "fusectl.api", "fusectl.errors", "fusectl.version", "click"}


def test_cli_imports_only_the_api_the_errors_the_version_click_and_the_standard_library():
    import ast
    import sys

    import fusectl.cli

    tree = ast.parse(open(fusectl.cli.__file__).read())
    imported = set()
    for node in ast.walk(tree):  # imports inside functions count too
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "fusectl" + (f".{node.module}" if node.module else "") if node.level else node.module
            if node.level and node.module is None:  # from . import api
                imported.update(f"fusectl.{alias.name}" for alias in node.names)
            else:
                imported.add(base)
    assert imported, "the walk found no import at all"
    outside = {name for name in imported
               if name not in CLI_MAY_IMPORT and name.split(".")[0] not in sys.stdlib_module_names}
    assert outside == set(), f"cli.py imports {sorted(outside)}; go through fusectl.api instead"
    assert "fusectl.api" in imported
