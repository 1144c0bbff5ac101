"""Tied parameters: discovery (save_model metadata, [ties], --detect-ties) and survival through plans."""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors
import safetensors.numpy

from conftest import (
    array_of,
    leftovers,
    load_checkpoint_raw,
    ok,
    parse_safetensors,
    refused,
    snapshot,
    write_rules,
    write_safetensors,
)
from fusectl.ties import aliases_from_config

TIED = "tied-embeddings.safetensors"

RENAME_HEAD = """
version = 1
[[rule]]
name   = "head-to-lm-head"
op     = "rename"
input  = "head.weight"
output = "lm_head.weight"
"""

TRANSPOSE_EMBED = """
version = 1
[[rule]]
name   = "embed-transpose"
op     = "transpose"
input  = "embed.weight"
output = "embed.weight"
"""


def params_by_name(report):
    return {p["name"]: p for p in report["parameters"]}


def report_of(cli, path, *flags) -> dict:
    """``fusectl inspect PATH --json FLAGS``, which must succeed, parsed."""
    return ok(cli("inspect", path, "--json", *flags)).json()


def fused(cli, src, rules, out, *flags):
    """``fusectl fuse SRC -r RULES -o OUT FLAGS``, which must succeed; OUT parsed by hand
    (tensors, metadata)."""
    ok(cli("fuse", src, "-r", rules, "-o", out, *flags))
    return parse_safetensors(out)


def fused_with(cli, src, tmp_path, text, *flags, rules="rules.toml", out="out.safetensors"):
    """Write the rules ``text`` to ``tmp_path/rules``, fuse ``src`` with them into
    ``tmp_path/out`` (which must succeed) → (out path, tensors, metadata)."""
    out = tmp_path / out
    tensors, meta = fused(cli, src, write_rules(tmp_path / rules, text), out, *flags)
    return out, tensors, meta


# ----------------------------------------------------------------------- save_model metadata


def test_inspect_reports_save_model_tie(cli, copy_fixture):
    src = copy_fixture(TIED)
    report = report_of(cli, src)
    assert report["ties"] == [["embed.weight", "head.weight"]]
    params = params_by_name(report)
    assert sorted(params) == ["embed.weight", "head.weight", "proj.bias", "proj.weight"]
    assert params["head.weight"]["unique"] == "embed.weight"
    assert params["embed.weight"]["unique"] == "embed.weight"
    assert params["head.weight"]["shape"] == [64, 16]
    assert report["unique_count"] == 3
    # the tied tensor counts once
    assert report["total_bytes"] == 64 * 16 * 4 + 16 * 16 * 4 + 16 * 4


def test_inspect_text_shows_tie(cli, copy_fixture):
    src = copy_fixture(TIED)
    out = ok(cli("inspect", src)).stdout
    assert "tied: embed.weight, head.weight" in out


def test_plain_copy_keeps_tie_stored_once(cli, copy_fixture, tmp_path):
    """A rule that touches neither member keeps the tie; the output stores it once."""
    src = copy_fixture(TIED)
    out, tensors, meta = fused_with(cli, src, tmp_path, """
version = 1
[[rule]]
name = "proj-rename"
op = "rename"
input = "proj.{t}"
output = "linear.{t}"
""", rules="proj.toml")
    assert sorted(tensors) == ["embed.weight", "linear.bias", "linear.weight"]
    assert meta["head.weight"] == "embed.weight"
    report = report_of(cli, out)
    assert report["ties"] == [["embed.weight", "head.weight"]]


# --------------------------------------------------------------------------- rename survives


def test_rename_of_one_member_keeps_tie(cli, copy_fixture, tmp_path):
    src = copy_fixture(TIED)
    before = snapshot(src.parent)
    out, tensors, meta = fused_with(cli, src, tmp_path, RENAME_HEAD, rules="rename.toml")
    # stored once, under the member that was stored in the input
    assert sorted(tensors) == ["embed.weight", "proj.bias", "proj.weight"]
    orig, _ = parse_safetensors(src)
    assert tensors["embed.weight"] == orig["embed.weight"]
    # save_model convention: {alias: kept}
    assert meta.get("lm_head.weight") == "embed.weight"
    assert "head.weight" not in meta, "the old alias name must not survive the rename"
    # fusectl provenance records the alias too
    provenance = json.loads(meta["fusectl"])
    assert provenance["aliases"] == {"lm_head.weight": "embed.weight"}

    report = report_of(cli, out)
    assert report["ties"] == [["embed.weight", "lm_head.weight"]]
    assert params_by_name(report)["lm_head.weight"]["unique"] == "embed.weight"
    assert snapshot(src.parent) == before


def test_rename_output_loads_with_safetensors_and_save_model_metadata(cli, copy_fixture, tmp_path):
    """What safetensors.torch.load_model needs: the kept tensor stored, {alias: kept} in metadata."""
    src = copy_fixture(TIED)
    out, _, _ = fused_with(cli, src, tmp_path, RENAME_HEAD, rules="rename.toml")
    with safetensors.safe_open(str(out), framework="numpy") as f:
        meta = f.metadata()
        kept = meta["lm_head.weight"]
        assert kept in f.keys()
        head = f.get_tensor(kept)
    embed = safetensors.numpy.load_file(str(src))["embed.weight"]
    np.testing.assert_array_equal(head, embed)


def test_rename_then_unfuse_restores_original_tie(cli, copy_fixture, tmp_path):
    src = copy_fixture(TIED)
    out, _, _ = fused_with(cli, src, tmp_path, RENAME_HEAD, rules="rename.toml")
    back = tmp_path / "back.safetensors"
    ok(cli("unfuse", out, "-o", back))
    report = report_of(cli, back)
    assert report["ties"] == [["embed.weight", "head.weight"]]
    assert load_checkpoint_raw(back) == load_checkpoint_raw(src)
    assert parse_safetensors(back)[1].get("head.weight") == "embed.weight"


def test_rename_of_stored_member_keeps_tie(cli, copy_fixture, tmp_path):
    """Renaming the stored member (embed.weight) keeps one stored copy and the alias."""
    src = copy_fixture(TIED)
    out, tensors, meta = fused_with(cli, src, tmp_path, """
version = 1
[[rule]]
name = "embed-rename"
op = "rename"
input = "embed.weight"
output = "wte.weight"
""", rules="rename.toml")
    assert len(tensors) == 3
    stored = [n for n in ("head.weight", "wte.weight") if n in tensors]
    assert len(stored) == 1
    alias = ({"head.weight", "wte.weight"} - set(stored)).pop()
    assert meta[alias] == stored[0]
    report = report_of(cli, out)
    assert report["ties"] == [["head.weight", "wte.weight"]]


def test_same_transform_on_every_member_keeps_tie(cli, copy_fixture, tmp_path):
    src = copy_fixture(TIED)
    out, tensors, meta = fused_with(cli, src, tmp_path, """
version = 1
[[rule]]
name = "both-transpose"
op = "transpose"
input = "{m}.weight"
output = "{m}.weight_t"
optional = true
""", rules="t.toml")
    embed_t = [n for n in ("embed.weight_t", "head.weight_t") if n in tensors]
    assert len(embed_t) == 1, sorted(tensors)
    orig = array_of(parse_safetensors(src)[0]["embed.weight"])
    np.testing.assert_array_equal(array_of(tensors[embed_t[0]]), orig.T)
    report = report_of(cli, out)
    assert ["embed.weight_t", "head.weight_t"] in report["ties"]


# ------------------------------------------------------------------------- transform one only


def test_transform_of_one_member_is_refused(cli, copy_fixture, tmp_path):
    src = copy_fixture(TIED)
    rules = write_rules(tmp_path / "t.toml", TRANSPOSE_EMBED)
    before = snapshot(tmp_path)
    out = tmp_path / "out.safetensors"
    refused(cli("fuse", src, "-r", rules, "-o", out), "embed-transpose", "embed.weight", "head.weight", "--untie",
            unwritten=[out])
    assert leftovers(tmp_path) == []
    assert snapshot(tmp_path) == before


def test_plan_refuses_transform_of_one_member(cli, copy_fixture, tmp_path):
    src = copy_fixture(TIED)
    rules = write_rules(tmp_path / "t.toml", TRANSPOSE_EMBED)
    result = cli("plan", src, "-r", rules)
    assert result.exit_code == 2
    assert "embed-transpose" in result.stderr and "head.weight" in result.stderr


def test_transform_of_one_member_with_untie_writes_both(cli, copy_fixture, tmp_path):
    src = copy_fixture(TIED)
    out, tensors, meta = fused_with(cli, src, tmp_path, TRANSPOSE_EMBED, "--untie", rules="t.toml")
    assert sorted(tensors) == ["embed.weight", "head.weight", "proj.bias", "proj.weight"]
    orig = array_of(parse_safetensors(src)[0]["embed.weight"])
    np.testing.assert_array_equal(array_of(tensors["embed.weight"]), orig.T)
    np.testing.assert_array_equal(array_of(tensors["head.weight"]), orig)
    assert "head.weight" not in {k for k, v in meta.items() if k != "fusectl" and k != "format"}
    report = report_of(cli, out)
    assert report["ties"] == []
    assert report["unique_count"] == 4


def test_plan_with_untie_reports_untied_group(cli, copy_fixture, tmp_path):
    src = copy_fixture(TIED)
    rules = write_rules(tmp_path / "t.toml", TRANSPOSE_EMBED)
    text = ok(cli("plan", src, "-r", rules, "--untie")).stdout
    assert "untie" in text and "head.weight" in text
    doc = ok(cli("plan", src, "-r", rules, "--untie", "--json")).json()
    assert doc["groups"][0]["untied"] == [["embed.weight", "head.weight"]]
    assert doc["result"]["ties"] == []


def test_consuming_one_member_into_larger_tensor_is_refused(cli, copy_fixture, tmp_path):
    src = copy_fixture(TIED)
    rules = write_rules(tmp_path / "c.toml", """
version = 1
[[rule]]
name = "embed-into-stack"
op = "concat"
inputs = ["embed.weight", "proj.weight"]
output = "fused.weight"
axis = 0
""")
    out = tmp_path / "out.safetensors"
    refused(cli("fuse", src, "-r", rules, "-o", out), "embed-into-stack", "head.weight", unwritten=[out])


# ------------------------------------------------------------------------------------ [ties]


@pytest.fixture
def twins(tmp_path):
    """A file that stores two bitwise-equal tensors and one that differs by one element."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 4)).astype(np.float32)
    other = w.copy()
    other[3, 2] += 1.0
    folder = tmp_path / "in"
    folder.mkdir()
    same = write_safetensors(folder / "same.safetensors", {
        "encoder.embed.weight": w, "decoder.embed.weight": w.copy(), "bias": np.zeros(4, np.float32),
    })
    diff = write_safetensors(folder / "diff.safetensors", {
        "encoder.embed.weight": w, "decoder.embed.weight": other,
    })
    return same, diff, w


TIES_RULES = """
version = 1
[ties]
groups = [["encoder.embed.weight", "decoder.embed.weight"]]
[[rule]]
name = "bias-rename"
op = "rename"
input = "bias"
output = "b"
optional = true
"""


def test_ties_section_merges_bitwise_equal_tensors(cli, twins, tmp_path):
    same, _, w = twins
    rules = write_rules(tmp_path / "ties.toml", TIES_RULES)
    doc = ok(cli("plan", same, "-r", rules, "--json")).json()
    assert doc["result"]["ties"] == [["decoder.embed.weight", "encoder.embed.weight"]]
    # both names were stored in the input, and no loader restores an alias the model does not
    # declare itself: by default both stay stored
    tensors, meta = fused(cli, same, rules, tmp_path / "kept.safetensors")
    assert sorted(tensors) == ["b", "decoder.embed.weight", "encoder.embed.weight"]
    assert "encoder.embed.weight" not in meta and "decoder.embed.weight" not in meta
    for name in ("decoder.embed.weight", "encoder.embed.weight"):
        np.testing.assert_array_equal(array_of(tensors[name]), w)
    # --write-ties-once stores one copy: the first in sorted order of the stored members
    out = tmp_path / "out.safetensors"
    tensors, meta = fused(cli, same, rules, out, "--write-ties-once")
    assert sorted(tensors) == ["b", "decoder.embed.weight"]
    assert meta["encoder.embed.weight"] == "decoder.embed.weight"
    np.testing.assert_array_equal(array_of(tensors["decoder.embed.weight"]), w)
    report = report_of(cli, out)
    assert report["ties"] == [["decoder.embed.weight", "encoder.embed.weight"]]


def test_ties_section_refuses_different_tensors(cli, twins, tmp_path):
    _, diff, _ = twins
    rules = write_rules(tmp_path / "ties.toml", TIES_RULES)
    before = snapshot(tmp_path)
    out = tmp_path / "out.safetensors"
    refused(cli("fuse", diff, "-r", rules, "-o", out), "encoder.embed.weight", "decoder.embed.weight", "ties.toml",
            unwritten=[out])
    assert snapshot(tmp_path) == before
    assert cli("plan", diff, "-r", rules).exit_code == 2


def test_ties_section_missing_member_becomes_alias(cli, copy_fixture, tmp_path):
    src = copy_fixture("tiny-llama-gqa")
    out, tensors, meta = fused_with(cli, src, tmp_path, """
version = 1
[ties]
groups = [["model.embed_tokens.weight", "output.weight"]]
[[rule]]
name = "norm-rename"
op = "rename"
input = "model.norm.weight"
output = "model.final_norm.weight"
""", rules="ties.toml")
    assert "output.weight" not in tensors
    assert meta["output.weight"] == "model.embed_tokens.weight"
    report = report_of(cli, out)
    assert ["model.embed_tokens.weight", "output.weight"] in report["ties"]


def test_ties_section_member_none_present_is_an_error(cli, twins, tmp_path):
    same, _, _ = twins
    rules = write_rules(tmp_path / "ties.toml", """
version = 1
[ties]
groups = [["nope.a", "nope.b"]]
[[rule]]
op = "rename"
input = "bias"
output = "b"
""")
    result = cli("plan", same, "-r", rules)
    assert result.exit_code == 2
    assert "nope.a" in result.stderr


def test_conflicting_tie_sources_are_an_error(cli, tmp_path):
    """save_model metadata says head→embed, provenance says head→proj: refuse."""
    rng = np.random.default_rng(1)
    e = rng.standard_normal((4, 4)).astype(np.float32)
    prov = json.dumps({"format_version": 1, "fusectl_version": "0", "plan": [],
                       "aliases": {"head.weight": "proj.weight"}})
    path = write_safetensors(tmp_path / "c.safetensors",
                             {"embed.weight": e, "proj.weight": e + 1},
                             metadata={"head.weight": "embed.weight", "fusectl": prov})
    result = cli("inspect", path, "--json")
    assert result.exit_code == 2
    assert result.stderr.startswith("error:")
    assert "head.weight" in result.stderr


# ------------------------------------------------------------------------------ --detect-ties


def test_inspect_detect_ties_reports_suspected(cli, twins):
    same, diff, _ = twins
    report = report_of(cli, same, "--detect-ties")
    assert report["suspected_ties"] == [["decoder.embed.weight", "encoder.embed.weight"]]
    assert report["ties"] == [], "suspected ties are reported, not adopted"
    text = ok(cli("inspect", same, "--detect-ties")).stdout
    assert "suspected" in text and "decoder.embed.weight" in text
    assert report_of(cli, diff, "--detect-ties")["suspected_ties"] == []


def test_detect_ties_does_not_repeat_known_ties(cli, copy_fixture):
    src = copy_fixture(TIED)
    report = report_of(cli, src, "--detect-ties")
    assert report["suspected_ties"] == []
    assert report["ties"] == [["embed.weight", "head.weight"]]


def test_detect_ties_ignores_equal_bytes_with_different_shape(cli, tmp_path):
    a = np.arange(8, dtype=np.float32)
    path = write_safetensors(tmp_path / "s.safetensors", {"a": a, "b": a.reshape(2, 4)})
    assert report_of(cli, path, "--detect-ties")["suspected_ties"] == []


def test_fuse_detect_ties_adopts(cli, twins, tmp_path):
    same, _, _ = twins
    rules = write_rules(tmp_path / "r.toml", """
version = 1
[[rule]]
op = "rename"
input = "bias"
output = "b"
""")
    plan = ok(cli("plan", same, "-r", rules, "--detect-ties", "--json")).json()
    assert plan["result"]["ties"] == [["decoder.embed.weight", "encoder.embed.weight"]]
    # adopted for planning, but both stay stored: a standard loader would not restore an alias
    tensors, meta = fused(cli, same, rules, tmp_path / "out.safetensors", "--detect-ties")
    assert sorted(tensors) == ["b", "decoder.embed.weight", "encoder.embed.weight"]
    assert "encoder.embed.weight" not in meta
    # --write-ties-once writes the adopted tie as an alias
    tensors, meta = fused(cli, same, rules, tmp_path / "once.safetensors", "--detect-ties", "--write-ties-once")
    assert len(tensors) == 2
    assert meta["encoder.embed.weight"] == "decoder.embed.weight"
    # without the flag, both stay stored
    assert len(fused(cli, same, rules, tmp_path / "out2.safetensors")[0]) == 3


def test_detect_ties_never_suspects_constant_tensors(cli, tmp_path):
    path = tmp_path / "norms.safetensors"
    safetensors.numpy.save_file({
        "a.norm.weight": np.ones(8, np.float32), "b.norm.weight": np.ones(8, np.float32),
        "a.bias": np.zeros(8, np.float32), "b.bias": np.zeros(8, np.float32),
        "c.bias": np.zeros(8, np.float32),
        "x": np.arange(8, dtype=np.float32), "y": np.arange(8, dtype=np.float32),
    }, str(path))
    report = report_of(cli, path, "--detect-ties")
    assert report["suspected_ties"] == [["x", "y"]]
    assert report["constant_groups_skipped"] == 2
    text = ok(cli("inspect", path, "--detect-ties")).output
    assert "suspected tie (equal content): x, y" in text
    assert "not suspected: 2 group(s)" in text
    plan = ok(cli("plan", path, "--detect-ties", "--json", "-r", write_rules(tmp_path / "r.toml", """
version = 1
[[rule]]
op = "rename"
input = "x"
output = "z"
"""))).json()
    # x and y adopted (the rename keeps the tie); none of the constant tensors
    assert plan["result"]["ties"] == [["y", "z"]]


# ------------------------------------------------------------------------ more tie survival


def test_drop_of_alias_removes_tie(cli, copy_fixture, tmp_path):
    src = copy_fixture(TIED)
    out, tensors, meta = fused_with(cli, src, tmp_path, """
version = 1
[[rule]]
name = "drop-head"
op = "drop"
input = "head.weight"
""", rules="d.toml")
    assert sorted(tensors) == ["embed.weight", "proj.bias", "proj.weight"]
    assert "head.weight" not in meta
    assert report_of(cli, out)["ties"] == []


def test_drop_of_stored_member_keeps_other_name(cli, copy_fixture, tmp_path):
    src = copy_fixture(TIED)
    _, tensors, meta = fused_with(cli, src, tmp_path, """
version = 1
[[rule]]
name = "drop-embed"
op = "drop"
input = "embed.weight"
""", rules="d.toml")
    assert sorted(tensors) == ["head.weight", "proj.bias", "proj.weight"]
    assert tensors["head.weight"] == parse_safetensors(src)[0]["embed.weight"]
    assert "embed.weight" not in meta


def test_tie_survives_sharded_output(cli, copy_fixture, tmp_path):
    src = copy_fixture(TIED)
    rules = write_rules(tmp_path / "rename.toml", RENAME_HEAD)
    out = tmp_path / "sharded"
    ok(cli("fuse", src, "-r", rules, "-o", out, "--max-shard-size", "1KB"))
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) >= 2
    holder = [s for s in shards if "embed.weight" in parse_safetensors(s)[0]]
    assert len(holder) == 1
    assert parse_safetensors(holder[0])[1]["lm_head.weight"] == "embed.weight"
    report = report_of(cli, out)
    assert report["ties"] == [["embed.weight", "lm_head.weight"]]
    back = tmp_path / "back.safetensors"
    ok(cli("unfuse", out, "-o", back))
    assert report_of(cli, back)["ties"] == [["embed.weight", "head.weight"]]


def test_untie_then_unfuse_restores_the_tie(cli, copy_fixture, tmp_path):
    """SPEC §5: unfuse(fuse(x)) is x. The untied copies are bitwise equal again after the
    inverse, and the provenance records which group was untied, so the tie comes back."""
    src = copy_fixture(TIED)
    out, _, _ = fused_with(cli, src, tmp_path, TRANSPOSE_EMBED, "--untie", rules="t.toml")
    back = tmp_path / "back.safetensors"
    ok(cli("unfuse", out, "-o", back))
    tensors, meta = parse_safetensors(back)
    assert tensors.get("embed.weight") == parse_safetensors(src)[0]["embed.weight"]
    report = report_of(cli, back)
    assert report["ties"] == [["embed.weight", "head.weight"]]
    assert sorted(tensors) == ["embed.weight", "proj.bias", "proj.weight"]


def test_splitting_every_member_alike_keeps_the_parts_tied_and_unfuse_restores(cli, copy_fixture, tmp_path):
    src = copy_fixture(TIED)
    out, _, _ = fused_with(cli, src, tmp_path, 'version = 1\n[[rule]]\nop = "split"\ninput = "{m}.weight"\n'
                                               'outputs = ["{m}.a", "{m}.b"]\n', rules="s.toml")
    back = tmp_path / "back.safetensors"
    report = report_of(cli, out)
    assert ["embed.a", "head.a"] in report["ties"] and ["embed.b", "head.b"] in report["ties"]
    ok(cli("unfuse", out, "-o", back))
    assert report_of(cli, back)["ties"] == [["embed.weight", "head.weight"]]
    assert parse_safetensors(back)[0]["embed.weight"] == parse_safetensors(src)[0]["embed.weight"]


def test_unfuse_after_untie_of_an_adopted_tie_keeps_both_stored_tensors(cli, tmp_path):
    """a and b are equal and both stored; --detect-ties adopts the tie, a concat breaks it
    (--untie). unfuse ties them again for the plan, but the input stored both, so both are
    stored again: the round trip is the identity (a save_model alias stays an alias, see
    test_untie_then_unfuse_restores_the_tie)."""
    w = np.arange(8, dtype=np.float32).reshape(2, 4)
    src = tmp_path / "dup.safetensors"
    safetensors.numpy.save_file({"a.weight": w, "b.weight": w.copy(), "c.weight": -w}, str(src))
    out, _, meta = fused_with(cli, src, tmp_path, 'version = 1\n[[rule]]\nop = "concat"\n'
                                                  'inputs = ["a.weight", "c.weight"]\noutput = "ac.weight"\n',
                              "--detect-ties", "--untie", rules="cat.toml", out="f.safetensors")
    back = tmp_path / "u.safetensors"
    plan = json.loads(json.dumps(meta))["fusectl"]
    group = json.loads(plan)["plan"][0]
    assert group["untied"] == [["a.weight", "b.weight"]] and group["untied_stored"] == [["a.weight", "b.weight"]]
    ok(cli("unfuse", out, "-o", back))
    tensors, meta = parse_safetensors(back)
    assert sorted(tensors) == ["a.weight", "b.weight", "c.weight"]
    assert "b.weight" not in meta
    assert tensors == parse_safetensors(src)[0]


@pytest.mark.parametrize("config, stored, want", [
    # Megatron's GPTModel read with the Llama config.json it becomes: a shared head is not stored
    ({"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True},
     ["embedding.word_embeddings.weight"], {"output_layer.weight": "embedding.word_embeddings.weight"}),
    ({"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False}, ["embedding.word_embeddings.weight"], {}),
    ({"architectures": ["LlamaForCausalLM"]},
     ["embedding.word_embeddings.weight", "output_layer.weight"], {}),  # stored: untied, kept apart
    ({"architectures": ["LlamaModel"], "tie_word_embeddings": True}, ["embedding.word_embeddings.weight"], {}),
])
def test_a_config_ties_megatrons_head_only_when_it_is_not_stored(config, stored, want):
    assert aliases_from_config(config, stored) == want
