"""io/optimizer_state.py and the training-dict parts of io/formats/torch_file.py: an optimizer's
state_dict read from headers, and each state mapped to its parameter only where the names or
the shapes prove it."""

from __future__ import annotations

import json

import pytest

from fusectl.dtypes import BY_NAME
from fusectl.errors import CheckpointError
from fusectl.io.checkpoint import open_checkpoint
from fusectl.io.optimizer_state import (is_optimizer_dict, map_parameters, optimizer_tree, parse_optimizer,
                                        read_order, training_tree)
from fusectl.tensors import ByteRange, FileTensor, LazyTensor, TensorSpec

from conftest import FIXTURES

F32 = BY_NAME["F32"]
TORCH = FIXTURES / "torch"


def t(*shape) -> FileTensor:
    return FileTensor(TensorSpec(F32, shape), ByteRange("f", 0, 0))


def params(*shapes):
    return [(f"p{i}", TensorSpec(F32, s)) for i, s in enumerate(shapes)]


def adam(shapes, groups=None):
    groups = groups or [list(range(len(shapes)))]
    return {"state": {i: {"step": t(), "exp_avg": t(*s), "exp_avg_sq": t(*s)} for i, s in enumerate(shapes)},
            "param_groups": [{"params": g, "lr": 0.1, "betas": (0.9, 0.999), "amsgrad": False} for g in groups]}


def crnn_order(path, key=None):
    table = open_checkpoint(str(path), key=key).table
    return [n for n in table.entries if "running_" not in n and "num_batches" not in n]


# --- reading ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name, key, where, keys", [
    ("training.pt", None, "optimizer_state_dict", ["step", "exp_avg", "exp_avg_sq"]),
    ("training-legacy.pt", None, "optimizer_state_dict", ["step", "exp_avg", "exp_avg_sq"]),
    ("model-state.pt", None, "optimizer_state", ["momentum_buffer"]),
    ("two-models.pt", "model", "opt", ["step", "exp_avg", "exp_avg_sq"]),
])
def test_the_optimizer_beside_the_model_is_read_from_headers(name, key, where, keys):
    ckpt = open_checkpoint(str(TORCH / name), key=key)
    state = ckpt.optimizer
    assert state.where == where and state.keys() == keys
    assert len(state.ids()) == 17 and all(isinstance(v, LazyTensor) for s in state.states.values()
                                          for k, v in s.items() if k != "step" or keys[0] == "step")
    assert state.groups[0].hyper["lr"] in (0.001, 0.1)


def test_a_state_dict_at_the_top_level_has_no_optimizer():
    assert open_checkpoint(str(TORCH / "dtypes.pt")).optimizer is None
    assert open_checkpoint(str(FIXTURES / "tied-embeddings.safetensors")).optimizer is None


def test_the_training_tree_keeps_every_other_entry_and_replaces_model_and_optimizer():
    ckpt = open_checkpoint(str(TORCH / "model-state.pt"))
    tree = ckpt.training.tree()
    assert tree["step"] == 7 and isinstance(tree["model_state"]["cnn.0.weight"], LazyTensor)
    out = training_tree(tree, ("model_state",), {"x": 1}, ("optimizer_state",), optimizer_tree(ckpt.optimizer))
    assert out["model_state"] == {"x": 1} and out["step"] == 7 and tree["model_state"] != {"x": 1}
    assert parse_optimizer(out["optimizer_state"], "optimizer_state", "f").states.keys() == ckpt.optimizer.states.keys()
    lightning = training_tree({"optimizer_states": [{"a": 1}], "state_dict": {}}, None, None, ("optimizer_states", 0), 5)
    assert lightning["optimizer_states"] == [5]


# --- malformed optimizer dicts: clean errors only ---------------------------------------------


@pytest.mark.parametrize("tree, message", [
    ([], "not an optimizer's state_dict"),
    ({"state": {}}, "not an optimizer's state_dict"),
    ({"state": [], "param_groups": [{"params": []}]}, "'state' is a list"),
    ({"state": {}, "param_groups": {}}, "'param_groups' is a dict"),
    ({"state": {}, "param_groups": []}, "not a non-empty list"),
    ({"state": {}, "param_groups": [5]}, r"param_groups\[0\] is an int"),
    ({"state": {}, "param_groups": [{"lr": 1}]}, "not a dict with 'params'"),
    ({"state": {}, "param_groups": [{"params": [1.5]}]}, "not a list of parameter ids"),
    ({"state": {}, "param_groups": [{"params": [0]}, {"params": [0]}]}, "listed twice"),
    ({"state": {1: {}}, "param_groups": [{"params": [0]}]}, "which no param group lists"),
    ({"state": {0: []}, "param_groups": [{"params": [0]}]}, "not a dict"),
    ({"state": {0: {"exp_avg": "x"}}, "param_groups": [{"params": [0]}]}, "neither a tensor nor a number"),
    ({"state": {0: {1: t(2)}}, "param_groups": [{"params": [0]}]}, "not text"),
    ({"state": {(0,): {}}, "param_groups": [{"params": [0]}]}, "not a parameter id"),
    ({"state": {}, "param_groups": [{"params": [0], "lr": object()}]}, "not plain data"),
    ({"state": {}, "param_groups": [{"params": [0], "param_names": ["a", "b"]}]}, "'param_names' is not"),
    ({"state": {}, "param_groups": [{"params": [0, "p1"]}]}, "both integers and names"),
    # the flattened form (torch.distributed.checkpoint)
    ({"state.a.exp_avg": t(2), "param_groups.a.lr": 0.1, "extra": 1}, "'extra' is neither a state nor"),
    ({"param_groups.a.lr": 0.1, 5: t(2)}, "the key 5 is neither"),
    ({"state.a.exp_avg": t(2)}, "without param_groups"),
    ({"param_groups.lr": 0.1, "param_groups.a.lr": 0.1}, "'param_groups.lr' names no parameter"),
    ({"param_groups.a.params": ["a"]}, "a parameter list"),
    ({"state.b.exp_avg": t(2), "param_groups.a.lr": 0.1}, "'state.b.exp_avg' names no parameter"),
    ({"state.a.exp_avg.x": t(2), "param_groups.a.lr": 0.1}, "'exp_avg.x' of 'a' is nested"),
    ({"state.a.exp_avg": "x", "param_groups.a.lr": 0.1}, "neither a tensor nor a number"),
    ({"state.a.exp_avg": t(2), "param_groups.a.lr": object()}, "not plain data"),
])
def test_a_malformed_optimizer_dict_is_a_clean_error(tree, message):
    with pytest.raises(CheckpointError, match=message):
        parse_optimizer(tree, "opt", "f.pt")


def test_a_shape_mismatch_and_a_missing_parameter_are_clean_errors():
    state = parse_optimizer({"state": {0: {"exp_avg": t(3)}}, "param_groups": [{"params": [0], "param_names": ["p0"]}]},
                            "opt", "f.pt")
    with pytest.raises(CheckpointError, match=r"state 'exp_avg' of 'p0' is \[3\], the parameter is \[4\]"):
        map_parameters(state, params((4,)), "f.pt")
    with pytest.raises(CheckpointError, match="does not hold"):
        map_parameters(state, [("q", TensorSpec(F32, (3,)))], "f.pt")
    with pytest.raises(CheckpointError, match="lists 2 parameters, the state dict holds only 1"):
        map_parameters(parse_optimizer(adam([(2,), (3,)]), "opt", "f"), params((2,)), "f.pt")
    with pytest.raises(CheckpointError, match="do not fit the state dict's order"):
        map_parameters(parse_optimizer(adam([(2,), (3,)]), "opt", "f"), params((3,), (2,)), "f.pt")


def test_a_state_of_another_shape_or_a_step_of_many_numbers_is_a_clean_error():
    def mapped(entry):
        tree = {"state": {0: entry}, "param_groups": [{"params": [0], "betas": (0.9, 0.99), "amsgrad": False}]}
        return map_parameters(parse_optimizer(tree, "opt", "f.pt"), params((4,)), "f.pt")
    with pytest.raises(CheckpointError, match=r"state 'exp_avg_sq' of 'p0' is \[3\], the parameter is \[4\]"):
        mapped({"step": t(), "exp_avg": t(4), "exp_avg_sq": t(3)})  # an elementwise optimizer: every state
    with pytest.raises(CheckpointError, match=r"state 'step' of 'p0' is \[3\], not one number"):
        mapped({"step": t(3), "exp_avg": t(4), "exp_avg_sq": t(4)})
    assert mapped({"step": t(), "exp_avg": t(4), "exp_avg_sq": t(4)}).names == {0: "p0"}


def test_the_flattened_form_splits_each_key_at_a_listed_name_and_groups_runs_of_equal_hyperparameters():
    tree = {"state.m.w.exp_avg": t(2), "state.m.w.step": t(), "state.m.w2.exp_avg": t(3),
            "param_groups.m.w.lr": 0.1, "param_groups.m.w.betas": (0.9, 0.99), "param_groups.m.w2.lr": 0.1,
            "param_groups.m.w2.betas": (0.9, 0.99), "param_groups.n.lr": 0.0, "param_groups.n.betas": (0.9, 0.99),
            "param_groups.o.lr": 0.1, "param_groups.o.betas": (0.9, 0.99)}
    state = parse_optimizer(tree, "optim", "f.pt")
    assert state.form == "flat" and state.rest == {}
    assert [g.params for g in state.groups] == [("m.w", "m.w2"), ("n",), ("o",)]  # runs, in the file's order
    assert state.groups[0].hyper == {"lr": 0.1, "betas": [0.9, 0.99]}
    assert state.states == {"m.w": {"exp_avg": tree["state.m.w.exp_avg"], "step": tree["state.m.w.step"]},
                            "m.w2": {"exp_avg": tree["state.m.w2.exp_avg"]}}
    got = map_parameters(state, [("m.w", TensorSpec(F32, (2,))), ("m.w2", TensorSpec(F32, (3,))),
                                 ("n", TensorSpec(F32, (1,))), ("o", TensorSpec(F32, (1,)))], "f")
    assert got.source == "state keys" and got.names == {p: p for p in ("m.w", "m.w2", "n", "o")}


def test_an_optimizer_dict_is_recognised_nested_or_flattened():
    assert is_optimizer_dict({"state": {}, "param_groups": []})
    assert is_optimizer_dict({"state.a.exp_avg": t(2), "param_groups.a.lr": 0.1})
    assert not is_optimizer_dict({"state.a.exp_avg": t(2)})  # a model with a module named "state"
    assert not is_optimizer_dict({"param_groups.a.lr": 0.1, "w": t(2)})
    assert not is_optimizer_dict({}) and not is_optimizer_dict([])


def test_a_name_keyed_state_may_use_a_tied_alias():
    keyed = parse_optimizer({"state": {"head": {"exp_avg": t(2)}}, "param_groups": [{"params": ["head"]}]}, "o", "f")
    assert keyed.form == "names"
    got = map_parameters(keyed, [("embed", TensorSpec(F32, (2,)))], "f", aliases={"head": "embed", "embed": "embed"})
    assert got.names == {"head": "embed"}
    with pytest.raises(CheckpointError, match="names the parameter 'head', which the model's state dict does not hold"):
        map_parameters(keyed, [("embed", TensorSpec(F32, (2,)))], "f")
    both = parse_optimizer({"state": {}, "param_groups": [{"params": ["head", "embed"]}]}, "o", "f")
    with pytest.raises(CheckpointError, match="'head' and 'embed', name one parameter, 'embed'"):
        map_parameters(both, [("embed", TensorSpec(F32, (2,)))], "f", aliases={"head": "embed", "embed": "embed"})


def test_object_ids_map_by_the_groups_order_whatever_their_values():
    # torch < 0.4: ids are id(param), in no order; the groups' lists give it
    big = [140_000_000_000_208, 140_000_000_000_016, 139_999_999_999_904]
    tree = {"state": {big[2]: {"exp_avg": t(3)}, big[0]: {"exp_avg": t(2)}, big[1]: {"exp_avg": t(4)}},
            "param_groups": [{"params": big[:2], "lr": 0.1}, {"params": big[2:], "lr": 0.0}]}
    got = map_parameters(parse_optimizer(tree, "o", "f"), params((2,), (3,), (4,)), "f")
    assert got.names == {big[0]: "p0", big[1]: "p2", big[2]: "p1"} and got.source == "state dict order"


# --- the mapping --------------------------------------------------------------------------------


def test_names_come_from_param_names_or_from_name_keys():
    tree = adam([(2,), (3,)])
    tree["param_groups"][0]["param_names"] = ["p1x", "p0x"]
    tree["state"] = {0: {"exp_avg": t(3)}, 1: {"exp_avg": t(2)}}
    got = map_parameters(parse_optimizer(tree, "o", "f"), [("p0x", TensorSpec(F32, (2,))), ("p1x", TensorSpec(F32, (3,)))], "f")
    assert got.names == {0: "p1x", 1: "p0x"} and got.source == "param_names"
    keyed = {"state": {"p0": {"exp_avg": t(2)}}, "param_groups": [{"params": ["p0"]}]}
    assert map_parameters(parse_optimizer(keyed, "o", "f"), params((2,)), "f").source == "state keys"


def test_shapes_prove_an_order_with_buffers_skipped_and_groups_interleaved():
    # decay (2-D) and no-decay (1-D) groups, as transformers' Trainer builds them; a buffer of shape [7]
    tree = adam([(4, 2), (4, 4), (2,), (4,)], groups=[[0, 1], [2, 3]])
    got = map_parameters(parse_optimizer(tree, "o", "f"), params((4, 2), (2,), (7,), (4, 4), (4,)), "f")
    assert got.names == {0: "p0", 1: "p3", 2: "p1", 3: "p4"} and got.source == "state dict order"


def test_equal_shapes_in_one_group_keep_their_order_but_across_groups_they_could_swap():
    one = adam([(4,), (4,)])
    assert map_parameters(parse_optimizer(one, "o", "f"), params((4,), (4,)), "f").names == {0: "p0", 1: "p1"}
    two = adam([(4,), (4,)], groups=[[0], [1]])
    # an order file orders parameters, not groups: the message asks for names instead
    with pytest.raises(CheckpointError, match=r"id 0 fits '(p0|p1)' and '(p1|p0)' alike.*no order file.*param_names"):
        map_parameters(parse_optimizer(two, "o", "f"), params((4,), (4,)), "f")
    with pytest.raises(CheckpointError, match=r"no order file"):
        map_parameters(parse_optimizer(two, "o", "f"), params((4,), (4,)), "f", order=["p0", "p1"])


def test_an_id_without_state_is_placed_by_the_others_or_refused():
    tree = adam([(2,), (3,)])
    tree["param_groups"][0]["params"] = [0, 5, 1]
    got = map_parameters(parse_optimizer(tree, "o", "f"), params((2,), (9,), (3,)), "f")
    assert got.names == {0: "p0", 5: "p1", 1: "p2"}
    with pytest.raises(CheckpointError, match="id 5 fits"):
        map_parameters(parse_optimizer(tree, "o", "f"), params((2,), (9,), (8,), (3,)), "f")


def test_a_batchnorm_buffer_of_a_bias_shape_is_refused_and_an_order_file_settles_it(tmp_path):
    ckpt = open_checkpoint(str(TORCH / "training.pt"))
    with pytest.raises(CheckpointError, match="'cnn.1.bias' and 'cnn.1.running_mean'.*param_order"):
        ckpt.optimizer_mapped
    order = tmp_path / "order.json"
    order.write_text(json.dumps(crnn_order(TORCH / "training.pt")))
    mapped = open_checkpoint(str(TORCH / "training.pt"), param_order=str(order)).optimizer_mapped[1]
    assert mapped.source == str(order) and mapped.names[0] == "cnn.0.weight" and mapped.names[16] == "fc.bias"
    assert len(open_checkpoint(str(TORCH / "training.pt"), param_order=str(order)).training_table().entries) == 23 + 17 * 3


@pytest.mark.parametrize("text, message", [
    ("{}", "JSON list of distinct names"), ('["a", "a"]', "distinct"), ('["nope"]', "not a parameter"),
])
def test_a_bad_order_file_is_a_clean_error(tmp_path, text, message):
    order = tmp_path / "order.json"
    order.write_text(text)
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(str(TORCH / "training.pt"), param_order=str(order)).optimizer_mapped
    if text == "{}":
        with pytest.raises(CheckpointError):
            read_order(str(order))
