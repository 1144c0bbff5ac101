"""``fusectl map CKPT OTHER`` with two checkpoints (fusectl.checkpoint_map): Gluon 2.0's
structural names (save_parameters) against an export's prefixed unique names, on the files real
MXNet 1.9.1 wrote (fixtures/mxnet/: the prefixed net, Conv+BatchNorm, the tied net saved with and
without deduplicate), by name where the names agree and by unique content where they do not;
equal bytes that nothing tells apart are refused, never guessed. And the ties of a deduplicated
save_parameters file, declared with [ties] or adopted with --detect-ties."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import FIXTURES, ok, refused, write_rules
from fusectl.io.checkpoint import open_checkpoint

MX = FIXTURES / "mxnet"
LOADED = json.loads((MX / "mxnet.json").read_text())["files"]  # what mx.nd.load read of each file
ARRAYS = np.load(MX / "arrays.npz")


def mxnet_arrays(rel: str) -> dict[str, np.ndarray]:
    """The arrays mx.nd.load read of fixtures/mxnet/REL, by name."""
    names = LOADED[rel]["names"]
    return {name: ARRAYS[f"{rel.replace('/', '__')}__{k}"] for k, name in enumerate(names)}


def pairs_of(doc) -> list[tuple[str, str, str]]:
    return [(p["checkpoint"], p["other"], p["how"]) for p in doc["pairs"]]


def check_pairs_against_mxnet(doc, first: str, other: str) -> None:
    """Every pair holds what MXNet loaded from both files under those names, bitwise."""
    a, b = mxnet_arrays(first), mxnet_arrays(other)
    for p in doc["pairs"]:
        assert a[p["checkpoint"]].tobytes() == b[p["other"]].tobytes(), p
        assert p["data"] == "equal"


@pytest.mark.parametrize("first, other, expected", [
    ("prefixed/prefixed.params", "prefixed/prefixed-0000.params",
     [("0.bias", "arg:model_fc1_bias", "content"), ("0.weight", "arg:model_fc1_weight", "content"),
      ("1.bias", "arg:model_fc2_bias", "content"), ("1.weight", "arg:model_fc2_weight", "content")]),
    ("prefixed/prefixed-unique.params", "prefixed/prefixed-0000.params",
     [("model_fc1_bias", "arg:model_fc1_bias", "name"), ("model_fc1_weight", "arg:model_fc1_weight", "name"),
      ("model_fc2_bias", "arg:model_fc2_bias", "name"), ("model_fc2_weight", "arg:model_fc2_weight", "name")]),
    ("conv-bn/bn-scale.params", "conv-bn/bn-scale-0000.params",
     [("bn.beta", "arg:convbn_batchnorm0_beta", "content"), ("bn.gamma", "arg:convbn_batchnorm0_gamma", "content"),
      ("bn.running_mean", "aux:convbn_batchnorm0_running_mean", "content"),
      ("bn.running_var", "aux:convbn_batchnorm0_running_var", "content"),
      ("conv.bias", "arg:convbn_conv0_bias", "content"), ("conv.weight", "arg:convbn_conv0_weight", "content")]),
])
def test_gluon_structural_names_pair_with_the_export(cli, first, other, expected):
    doc = ok(cli("map", str(MX / first), str(MX / other), "--json")).json()
    assert pairs_of(doc) == expected
    assert (doc["unmatched_checkpoint"], doc["unmatched_other"], doc["ambiguous"]) == ([], [], [])
    check_pairs_against_mxnet(doc, first, other)


def test_the_deduplicated_file_pairs_its_one_name_with_both_of_the_export(cli):
    """save_parameters(deduplicate=True) kept the shared weight once, as decoder.weight; the export
    stores it once too, and its symbol names the second reader's alias."""
    doc = ok(cli("map", str(MX / "tied/tied.params"), str(MX / "tied/tied-0000.params"), "--json")).json()
    assert ("decoder.weight", "arg:tied_embedding0_weight", "content") in pairs_of(doc)
    assert ("decoder.weight", "arg:tied_dense1_weight", "content") in pairs_of(doc)
    # the decoder's bias lives in the embedding's ParameterDict (params=): names disagree, bytes pair
    assert ("decoder.bias", "arg:tied_embedding0_bias", "content") in pairs_of(doc)
    assert doc["unmatched_checkpoint"] == doc["unmatched_other"] == []
    check_pairs_against_mxnet({"pairs": [p for p in doc["pairs"] if p["other"] != "arg:tied_dense1_weight"]},
                              "tied/tied.params", "tied/tied-0000.params")


def test_copies_of_a_tied_weight_pair_with_the_one_parameter(cli):
    """save_parameters without deduplicate stores the shared weight under both names."""
    doc = ok(cli("map", str(MX / "tied/tied-full.params"), str(MX / "tied/tied-0000.params"), "--json")).json()
    for name in ("embedding.weight", "decoder.weight"):
        assert {(p["other"]) for p in doc["pairs"] if p["checkpoint"] == name} == {
            "arg:tied_embedding0_weight", "arg:tied_dense1_weight"}


def test_map_text_lists_the_pairs_and_a_summary(cli):
    first, other = str(MX / "prefixed/prefixed.params"), str(MX / "prefixed/prefixed-0000.params")
    lines = ok(cli("map", first, other)).stdout.splitlines()
    assert lines[0].split() == ["0.bias", "arg:model_fc1_bias", "(content)"]
    assert lines[-1] == f"4 of 4 names of {first} paired with 4 of 4 of {other}; 0 ambiguous group(s)"


def test_equal_bytes_nothing_tells_apart_are_refused_after_the_report(cli, tmp_path):
    ones = np.ones(3, np.float32)
    first, other = tmp_path / "a.npz", tmp_path / "b.npz"
    np.savez(first, **{"a.x": ones, "a.y": ones, "a.w": np.arange(4, dtype=np.float32)})
    np.savez(other, **{"p": ones, "q": ones, "r": np.arange(4, dtype=np.float32)})
    result = cli("map", str(first), str(other), "--json")
    refused(result, "hold equal bytes that nothing tells apart", "a.x, a.y", "p, q")
    doc = json.loads(result.stdout)
    assert pairs_of(doc) == [("a.w", "r", "content")]
    assert doc["ambiguous"] == [{"checkpoint": ["a.x", "a.y"], "other": ["p", "q"], "dtype": "float32", "shape": [3]}]
    assert "ambiguous: a.x, a.y in" in cli("map", str(first), str(other)).stdout


def test_a_role_tells_equal_bytes_apart(cli, tmp_path):
    """A fresh BatchNorm: gamma and running_var both ones, beta and running_mean both zeros; each
    name's last word pairs them, one per role."""
    ones, zeros = np.ones(3, np.float32), np.zeros(3, np.float32)
    first, other = tmp_path / "a.npz", tmp_path / "b.npz"
    np.savez(first, **{"bn.gamma": ones, "bn.running_var": ones, "bn.beta": zeros, "bn.running_mean": zeros})
    np.savez(other, **{"arg:n_batchnorm0_gamma": ones, "aux:n_batchnorm0_running_var": ones,
                       "arg:n_batchnorm0_beta": zeros, "aux:n_batchnorm0_running_mean": zeros})
    doc = ok(cli("map", str(first), str(other), "--json")).json()
    assert pairs_of(doc) == [("bn.beta", "arg:n_batchnorm0_beta", "role"), ("bn.gamma", "arg:n_batchnorm0_gamma", "role"),
                             ("bn.running_mean", "aux:n_batchnorm0_running_mean", "role"),
                             ("bn.running_var", "aux:n_batchnorm0_running_var", "role")]


def test_a_pair_by_name_whose_bytes_differ_says_so(cli, tmp_path):
    first, other = tmp_path / "a.npz", tmp_path / "b.npz"
    np.savez(first, **{"model.w": np.ones(2, np.float32)})
    np.savez(other, **{"w": np.zeros(2, np.float32)})
    doc = ok(cli("map", str(first), str(other), "--json")).json()
    assert doc["pairs"] == [{"checkpoint": "model.w", "other": "w", "how": "name", "data": "differs"}]
    assert doc["checkpoint_prefix"] == "model."


def test_an_unreadable_other_checkpoint_is_refused(cli, tmp_path):
    bad = tmp_path / "b.params"
    bad.write_bytes(b"not mxnet")
    refused(cli("map", str(MX / "tied/tied.params"), str(bad)), "b.params")


# ------------------------------------------------------------------ ties of save_parameters files

TIES = 'version = 1\n[ties]\ngroups = [["embedding.weight", "decoder.weight"]]\n'


def test_ties_declares_the_name_a_deduplicated_file_left_out(cli, tmp_path):
    """tied.params holds decoder.weight only: [ties] names embedding.weight, which becomes an alias
    of it; the output is tied, and maps name for name onto the export's one parameter."""
    src = str(MX / "tied/tied.params")
    assert "embedding.weight" not in open_checkpoint(src).table
    out = tmp_path / "tied.safetensors"
    ok(cli("fuse", src, "-r", str(write_rules(tmp_path / "ties.toml", TIES)), "-o", str(out)))
    report = ok(cli("inspect", str(out), "--json")).json()
    assert report["ties"] == [["decoder.weight", "embedding.weight"]]
    doc = ok(cli("map", str(out), str(MX / "tied/tied-0000.params"), "--json")).json()
    assert {p["checkpoint"] for p in doc["pairs"] if p["other"] == "arg:tied_embedding0_weight"} == {
        "decoder.weight", "embedding.weight"}


def test_detect_ties_cannot_see_a_tie_stored_once(cli):
    """The deduplicated file holds one copy: nothing is equal to anything, nothing is suspected."""
    report = ok(cli("inspect", str(MX / "tied/tied.params"), "--detect-ties", "--json")).json()
    assert report["ties"] == [] and not report.get("suspected_ties")


RENAME = 'version = 1\n[[rule]]\nop = "rename"\ninput = "hidden.{x}"\noutput = "body.{x}"\n'


def test_detect_ties_adopts_the_copies_of_a_file_saved_without_deduplicate(cli, tmp_path):
    """tied-full.params (save_parameters' default, deduplicate=False) stores the shared weight
    twice: --detect-ties suspects them on inspect and adopts them as one parameter on plan and fuse
    (--write-ties-once stores it once; without it the output keeps both copies, as transformers wants)."""
    src = str(MX / "tied/tied-full.params")
    report = ok(cli("inspect", src, "--detect-ties", "--json")).json()
    assert report["ties"] == [] and report["suspected_ties"] == [["decoder.weight", "embedding.weight"]]
    rules = str(write_rules(tmp_path / "rename.toml", RENAME))
    assert ok(cli("plan", src, "-r", rules, "--detect-ties", "--json")).json()["result"]["ties"] == [
        ["decoder.weight", "embedding.weight"]]
    assert ok(cli("plan", src, "-r", rules, "--json")).json()["result"]["ties"] == []
    out = tmp_path / "tied.safetensors"
    ok(cli("fuse", src, "-r", rules, "--detect-ties", "--write-ties-once", "-o", str(out)))
    assert ok(cli("inspect", str(out), "--json")).json()["ties"] == [["decoder.weight", "embedding.weight"]]
