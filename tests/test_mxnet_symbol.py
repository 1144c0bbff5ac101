"""An MXNet ``-symbol.json`` read as data (fusectl.io.formats.mxnet_symbol): the attributes MXNet 1.9.1
wrote for the fixtures' BatchNorm and RNN operators (fixtures/generate_mxnet.py), the variables
two operators share as ties in ``inspect``, and broken graphs refused naming the file."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import FIXTURES, ok, run_cli
from fusectl.errors import CheckpointError
from fusectl.io.checkpoint import open_checkpoint
from fusectl.io.formats.mxnet_symbol import RNN, parse_symbol, read_symbol

MX = FIXTURES / "mxnet"


def test_batchnorm_eps_and_fix_gamma_as_gluon_exported_them():
    noscale, = read_symbol(str(MX / "conv-bn" / "bn-noscale-symbol.json")).batch_norms()
    scale, = read_symbol(str(MX / "conv-bn" / "bn-scale-symbol.json")).batch_norms()
    assert (noscale.eps, noscale.fix_gamma, scale.eps, scale.fix_gamma) == (2e-5, True, 2e-5, False)
    assert (noscale.gamma, noscale.beta, noscale.moving_mean, noscale.moving_var) == (
        "convbn_batchnorm0_gamma", "convbn_batchnorm0_beta", "convbn_batchnorm0_running_mean",
        "convbn_batchnorm0_running_var")
    assert noscale.axis == 1 and not noscale.use_global_stats


@pytest.mark.parametrize("stem, expected", [
    ("lstm/lstm", RNN("lstm0_rnn0", "lstm", 4, 2, True, None, None)),
    ("gru/gru", RNN("gru0_rnn0", "gru", 4, 2, True, None, None)),
    ("lstm-proj/proj", RNN("lstm1_rnn0", "lstm", 4, 1, False, 2, None)),
    ("fused-cell/lstm", RNN("lstm_rnn", "lstm", 4, 2, True, None, "lstm_parameters")),
])
def test_rnn_attributes_as_mxnet_wrote_them(stem, expected):
    assert read_symbol(str(MX / f"{stem}-symbol.json")).rnns() == [expected]


def test_attributes_mxnet_leaves_out_take_the_operators_defaults():
    symbol = parse_symbol({"nodes": [{"op": "null", "name": "x", "inputs": []},
                                     {"op": "BatchNorm", "name": "bn", "inputs": [[0, 0]]},
                                     {"op": "RNN", "name": "r", "attr": {"mode": "gru", "state_size": "3",
                                                                         "num_layers": "1"}, "inputs": [[0, 0, 0]]}]},
                          "m-symbol.json")
    bn, = symbol.batch_norms()
    assert (bn.eps, bn.fix_gamma, bn.gamma) == (1e-3, True, None)
    assert symbol.rnns() == [RNN("r", "gru", 3, 1, False, None, None)]


@pytest.mark.parametrize("attrs, needle", [({"mode": "lstm", "state_size": "x", "num_layers": "1"}, "state_size is 'x'"),
                                           ({"mode": "elman", "state_size": "2", "num_layers": "1"}, "mode 'elman'"),
                                           ({"mode": "lstm", "num_layers": "1"}, "state_size is None"),
                                           ({"mode": "lstm", "state_size": "-2", "num_layers": "1"}, "out of range"),
                                           ({"mode": "lstm", "state_size": "2", "num_layers": "1",
                                             "bidirectional": "maybe"}, "not True or False")])
def test_a_bad_attribute_is_refused_naming_the_node(attrs, needle):
    symbol = parse_symbol({"nodes": [{"op": "RNN", "name": "r", "attrs": attrs, "inputs": []}]}, "m-symbol.json")
    with pytest.raises(CheckpointError, match="m-symbol.json: node 'r' \\(RNN\\)") as refused:
        symbol.rnns()
    assert needle in str(refused.value)


def test_the_shared_variable_of_a_tied_export_is_read_by_two_operators():
    symbol = read_symbol(str(MX / "tied" / "tied-symbol.json"))
    shared = symbol.shared_variables()
    assert list(shared) == ["tied_embedding0_weight"]
    assert [(node.op, node.role(k)) for node, k in shared["tied_embedding0_weight"]] == [
        ("Embedding", "weight"), ("FullyConnected", "weight")]
    assert not read_symbol(str(MX / "lstm" / "lstm-symbol.json")).shared_variables()



def test_an_exported_tied_net_shows_its_tie_from_the_symbol():
    report = json.loads(ok(run_cli("inspect", "--json", MX / "tied" / "tied-0000.params")).stdout)
    assert report["files"][-1].endswith("tied-symbol.json")
    assert report["ties"] == [["arg:tied_dense1_weight", "arg:tied_embedding0_weight"]]
    text = ok(run_cli("inspect", MX / "tied" / "tied-0000.params")).stdout
    assert "tied: arg:tied_dense1_weight, arg:tied_embedding0_weight" in text


def test_a_deduplicated_save_parameters_file_stores_the_last_name_once_and_takes_ties(tmp_path):
    names = json.loads((MX / "mxnet.json").read_text())["files"]["tied/tied.params"]["names"]
    assert "decoder.weight" in names and "embedding.weight" not in names
    rules = tmp_path / "ties.toml"
    rules.write_text('version = 1\n[ties]\ngroups = [["embedding.weight", "decoder.weight"]]\n')
    out = tmp_path / "out.safetensors"
    ok(run_cli("fuse", MX / "tied" / "tied.params", "-r", rules, "-o", out, "--quiet"))
    assert open_checkpoint(str(out)).table.ties() == [["decoder.weight", "embedding.weight"]]


def test_a_broken_symbol_beside_the_params_is_refused_naming_it(tmp_path):
    shutil.copy(MX / "tied" / "tied-0000.params", tmp_path / "tied-0000.params")
    symbol = tmp_path / "tied-symbol.json"
    for text, needle in (('{"nodes": 3}', "not an MXNet symbol"), ("[", "tied-symbol.json"),
                         ('{"nodes": [{"op": "null", "name": "a", "inputs": [[5, 0, 0]]}]}', "of an earlier node"),
                         ('{"nodes": [{"op": "RNN", "name": "r", "attrs": {"mode": 3}}]}', "attrs must map")):
        symbol.write_text(text)
        result = run_cli("inspect", tmp_path / "tied-0000.params")
        assert result.exit_code == 2 and "tied-symbol.json" in result.stderr and needle in result.stderr, text


