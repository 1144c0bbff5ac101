"""Entries of a training dict addressed by the tuple of their real keys, never by dotted text
(issue 28): a key holding a dot, and integer keys beside strings that print alike.

``{"run.1": {model, optimizer}}`` was exit 70 (the optimizer looked up as ``run`` → ``1``);
``{"1": decoy, 1: {model, optimizer}}`` showed the real model with the decoy's optimizer and
exit 70 on convert. Now each is read, inspected and converted from its own keys; a ``--key``
text that two dicts of tensors print as is refused, naming both.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

import fusectl
from conftest import ok, refused, run_cli, snapshot
from fusectl import dtypes
from fusectl.errors import CheckpointError, InternalError
from fusectl.io.key_path import key_repr, key_text, node_at, replaced, resolve, without
from fusectl.io.formats.torch_writer import write_torch_file
from fusectl.tensors import ArrayTensor, TensorSpec
from test_training_output import _differences as tree_differences

F32 = dtypes.BY_NAME["F32"]


def tensor(array) -> ArrayTensor:
    array = np.asarray(array, np.float32)
    return ArrayTensor(TensorSpec(F32, array.shape), array)


def run(scale: float) -> dict:
    """A model and its Adam-like optimizer, every value scaled by ``scale``."""
    model = collections.OrderedDict([("w", tensor(np.full((2, 3), scale))), ("b", tensor(np.full(2, scale)))])
    state = {0: {"step": tensor(np.array(3.0)), "exp_avg": tensor(np.full((2, 3), scale)),
                 "exp_avg_sq": tensor(np.full((2, 3), scale))},
             1: {"step": tensor(np.array(3.0)), "exp_avg": tensor(np.full(2, scale)),
                 "exp_avg_sq": tensor(np.full(2, scale))}}
    optimizer = {"state": state, "param_groups": [{"lr": 0.1 * scale, "betas": (0.9, 0.999), "eps": 1e-8,
                                                   "weight_decay": 0.0, "amsgrad": False, "params": [0, 1]}]}
    return {"model": model, "optimizer": optimizer}


# --- unit ------------------------------------------------------------------------------------


def test_a_path_reaches_the_entry_of_its_real_keys():
    tree = {"1": {"a": "text key"}, 1: {"a": "int key"}, "run.1": [{"a": "dotted"}]}
    assert node_at(tree, ("1", "a")) == "text key" and node_at(tree, (1, "a")) == "int key"
    assert node_at(tree, ("run.1", 0, "a")) == "dotted"
    out = replaced(tree, (1, "a"), "new")
    assert out[1] == {"a": "new"} and out["1"] == {"a": "text key"} and tree[1] == {"a": "int key"}
    assert list(out) == list(tree)


def test_replacing_keeps_each_dicts_type_and_order():
    tree = collections.OrderedDict([("z", 1), ("m", collections.OrderedDict([("b", 2), ("a", 3)]))])
    out = replaced(tree, ("m", "a"), 4)
    assert type(out) is collections.OrderedDict and type(out["m"]) is collections.OrderedDict
    assert list(out["m"].items()) == [("b", 2), ("a", 4)] and list(out) == ["z", "m"]
    assert without(tree, ("m",), {"b"})["m"] == collections.OrderedDict([("a", 3)])


def test_dotted_text_is_no_key_path():
    with pytest.raises(InternalError):
        node_at({"a": {"b": 1}}, "a.b")
    with pytest.raises(InternalError):
        replaced({"a": 1}, "a", 2)


def test_the_users_text_resolves_to_the_one_path_that_prints_so():
    paths = [("run.1", "model"), ("run", "1", "model"), (1, "model"), ("2", "model")]
    assert resolve("2.model", paths, "f.pt") == ("2", "model")
    assert resolve("1.model", paths, "f.pt") == (1, "model")
    assert resolve("3.model", paths, "f.pt") is None
    with pytest.raises(CheckpointError) as e:
        resolve("run.1.model", paths, "f.pt")
    assert "['run.1', 'model']" in str(e.value) and "['run', '1', 'model']" in str(e.value)
    assert key_text(("run.1", "model")) == "run.1.model" and key_repr(("1", 1)) == "['1', 1]"


# --- CLI ---------------------------------------------------------------------------------------


def test_a_training_dict_under_a_key_with_a_dot_is_read_and_converted_whole(tmp_path):
    src, out = tmp_path / "dotted.pt", tmp_path / "out.pt"
    write_torch_file(str(src), {"run.1": run(1.0), "epoch": 4})
    report = ok(run_cli("inspect", src, "--json")).json()
    assert report["state_dict_key"] == "run.1.model" and report["optimizer"]["where"] == "run.1.optimizer"
    assert report["optimizer"]["problem"] is None
    result = ok(run_cli("convert", src, "-o", out))
    # no step moves a parameter: the optimizer at its dotted key is written as read (optstate)
    assert "optimizer state (run.1.optimizer): copied as it is (no step moves it)" in result.stdout
    original, written = fusectl.open_checkpoint(str(src)), fusectl.open_checkpoint(str(out))
    assert tree_differences(original.training.tree(), written.training.tree()) == []


def test_an_integer_key_beside_a_string_that_prints_alike_is_its_own_entry(tmp_path):
    src, out = tmp_path / "decoy.pt", tmp_path / "out.pt"
    decoy = run(2.0)
    decoy["model"] = {"note": "no tensors here"}
    write_torch_file(str(src), {"1": decoy, 1: run(1.0)})
    report = ok(run_cli("inspect", src, "--json")).json()
    assert report["state_dict_key"] == "1.model"
    # the real model's optimizer (lr 0.1), not the decoy's (lr 0.2), mapped to its two parameters
    assert report["optimizer"]["groups"][0]["hyperparameters"]["lr"] == pytest.approx(0.1)
    assert report["optimizer"]["problem"] is None and set(report["optimizer"]["parameters"]) == {"w", "b"}
    ok(run_cli("convert", src, "-o", out))
    original, written = fusectl.open_checkpoint(str(src)), fusectl.open_checkpoint(str(out))
    assert tree_differences(original.training.tree(), written.training.tree()) == []
    tree = written.training.tree()
    assert list(tree) == ["1", 1] and tree["1"]["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.2)


def test_a_key_two_dicts_of_tensors_print_as_is_refused_naming_both(tmp_path):
    src, out = tmp_path / "twice.pt", tmp_path / "out.safetensors"
    write_torch_file(str(src), {"1": {"model": run(1.0)["model"]}, 1: {"model": run(2.0)["model"]}})
    before = snapshot(tmp_path)
    result = run_cli("convert", src, "--key", "1.model", "-o", out)
    refused(result, "'1.model'", "['1', 'model']", "[1, 'model']", unwritten=[out])
    # without --key the listing tells the two apart too
    refused(run_cli("convert", src, "-o", out), "['1', 'model']", "[1, 'model']", unwritten=[out])
    assert snapshot(tmp_path) == before
