"""The optimizer state forms besides torch.optim's ids 0..n-1 (issue 20), on fixtures/training/forms/.

A tiny model with its embedding tied to ``lm_head``, trained with AdamW in two groups and saved
as ``optimizer.state_dict()`` (``tied-adamw.pt``), as torch.distributed.checkpoint's
``get_optimizer_state_dict`` writes it, nested (``named.pt``: keyed by parameter name) and
flattened (``named-flat.pt``: ``state.<name>.<key>``, ``param_groups.<name>.<hyper>``), and an
Adam run keyed by Python object ids as torch < 0.4 saved it (``object-ids.pt``). Each maps to
its parameters (by name, or by the groups' order), ``fuse -r llama-qkv`` writes it back in its
form with the q/k/v states concatenated and the tied pair's one state kept, ``unfuse`` gives
back the training dict bitwise; with torch (skipped without), each fused file loads into the
fused model (``load_state_dict`` / ``set_optimizer_state_dict``) and resumes with the unfused
run's losses, bit for bit (fixtures/optimizer_forms.py), where a fresh optimizer does not.
"""

from __future__ import annotations

import collections
import importlib.util
import json

import numpy as np
import pytest

import fusectl
from conftest import FIXTURES, ok, run_cli
from fusectl.io.formats.torch_file import read_torch
from fusectl.io.formats.torch_writer import write_torch_file
from test_training_output import _differences

FORMS = FIXTURES / "training" / "forms"
FILES = {"tied-adamw.pt": ("ids", "optimizer_state_dict"), "named.pt": ("names", "optimizer"),
         "named-flat.pt": ("flat", "optim"), "object-ids.pt": ("ids", "optimizer_state_dict")}
LAYER = "model.layers.0.self_attn."
PARTS = [LAYER + p for p in ("q_proj.weight", "k_proj.weight", "v_proj.weight")]
QKV = LAYER + "qkv_proj.weight"
EMBED = "model.embed_tokens.weight"
ORDER = [EMBED, "model.layers.0.input_layernorm.weight", "model.layers.0.input_layernorm.bias", *PARTS,
         LAYER + "o_proj.weight", "model.norm.weight", "model.norm.bias"]  # named_parameters(), lm_head tied
GROUPS = [[EMBED, *PARTS, LAYER + "o_proj.weight"],
          ["model.layers.0.input_layernorm.weight", "model.layers.0.input_layernorm.bias", "model.norm.weight",
           "model.norm.bias"]]


def _mapped(path):
    checkpoint = fusectl.open_checkpoint(str(path))
    state, mapping = checkpoint.optimizer_mapped
    return checkpoint, state, mapping


def _states_by_name(state, mapping) -> dict:
    return {name: state.states.get(pid, {}) for pid, name in mapping.names.items()}


def _fuse(tmp_path, name):
    out = tmp_path / f"fused-{name}"
    ok(run_cli("fuse", FORMS / name, "-r", "llama-qkv", "-o", out))
    return out


def _forms():
    spec = importlib.util.spec_from_file_location("optimizer_forms", FIXTURES / "optimizer_forms.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- reading and mapping ----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FILES))
def test_each_form_is_read_and_every_state_mapped_to_its_parameter(name):
    form, where = FILES[name]
    checkpoint, state, mapping = _mapped(FORMS / name)
    assert state.form == form and state.where == where == checkpoint.training.optimizer_key
    assert mapping.source == ("state keys" if form != "ids" else "state dict order")
    assert [[mapping.names[p] for p in g.params] for g in state.groups] == GROUPS
    specs = {n: checkpoint.table.spec(n) for n in ORDER}
    for pname, entry in _states_by_name(state, mapping).items():
        assert sorted(entry) == ["exp_avg", "exp_avg_sq", "step"], pname
        assert entry["exp_avg"].spec.shape == entry["exp_avg_sq"].spec.shape == specs[pname].shape, pname
    # the tied pair is one parameter with one state: lm_head.weight is the embedding's alias
    assert "lm_head.weight" not in mapping.names.values() and len(mapping.names) == 9
    assert checkpoint.table.unique_name("lm_head.weight") == EMBED


def test_the_name_keyed_forms_hold_the_states_the_ids_form_holds_bitwise():
    _, ids, ids_map = _mapped(FORMS / "tied-adamw.pt")
    reference = _states_by_name(ids, ids_map)
    for name in ("named.pt", "named-flat.pt"):
        _, state, mapping = _mapped(FORMS / name)
        got = _states_by_name(state, mapping)
        assert sorted(got) == sorted(reference)
        for pname, entry in got.items():
            for key, value in entry.items():
                assert value.read().tobytes() == reference[pname][key].read().tobytes(), (name, pname, key)
    _, state, _ = _mapped(FORMS / "named-flat.pt")
    assert [g.hyper["weight_decay"] for g in state.groups] == [0.1, 0.0]  # groups: runs of equal hyperparameters
    assert state.groups[0].hyper == ids.groups[0].hyper


def test_object_ids_are_large_integers_mapped_by_the_groups_order():
    _, state, mapping = _mapped(FORMS / "object-ids.pt")
    ids = state.ids()
    assert min(ids) > 2**20 and len(set(ids)) == 9  # not 0..n-1
    assert [mapping.names[p] for p in ids] == [n for g in GROUPS for n in g]
    assert all(type(entry["step"]) is int for entry in state.states.values())  # the era's Python int


def _rewritten(tmp_path, name, edit) -> str:
    """FORMS/name's training tree, edited by ``edit(tree)``, written as a new torch file beside a
    config (the model from the table: a tied pair one tensor, so one storage, as torch.save has it)."""
    checkpoint = fusectl.open_checkpoint(str(FORMS / name))
    tree = dict(checkpoint.training.tree())
    tree[checkpoint.state_dict_key] = collections.OrderedDict(
        (n, checkpoint.table.entries[n]) for n in tree[checkpoint.state_dict_key])
    tree = edit(tree)
    folder = tmp_path / "in"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_bytes((FORMS / "config.json").read_bytes())
    out = folder / name
    write_torch_file(str(out), tree)
    return str(out)


def test_names_need_no_order_where_ids_follow_the_state_dicts_order(tmp_path):
    def shuffled(tree):
        key = "model" if "model" in tree else "model_state_dict"
        model = tree[key]
        return {**tree, key: collections.OrderedDict((n, model[n]) for n in reversed(list(model)))}
    checkpoint = fusectl.open_checkpoint(_rewritten(tmp_path, "named.pt", shuffled))
    by_name = checkpoint.optimizer_mapped[1]
    # the tie's name in the table is now lm_head.weight (first in the file): the state follows it
    assert by_name.names == {n: checkpoint.table.unique_name(n) for n in ORDER}
    assert by_name.names[EMBED] == "lm_head.weight"
    # integer ids trust the state dict's order (the documented assumption): reversed, the shapes
    # still fit, and q's state (id 1) would go to o_proj, equal in shape; names need no order
    by_id = fusectl.open_checkpoint(_rewritten(tmp_path, "tied-adamw.pt", shuffled)).optimizer_mapped[1]
    assert by_id.names[1] == LAYER + "o_proj.weight" and by_id.source == "state dict order"


def test_a_state_keyed_by_the_tied_alias_maps_to_the_parameter_and_keeps_its_key(tmp_path):
    def aliased(tree):
        opt = tree["optimizer"]
        state = {("lm_head.weight" if k == EMBED else k): v for k, v in opt["state"].items()}
        groups = [{**g, "params": ["lm_head.weight" if p == EMBED else p for p in g["params"]]}
                  for g in opt["param_groups"]]
        return {**tree, "optimizer": {"state": state, "param_groups": groups}}
    path = _rewritten(tmp_path, "named.pt", aliased)
    assert fusectl.open_checkpoint(path).optimizer_mapped[1].names["lm_head.weight"] == EMBED
    out = tmp_path / "fused.pt"
    ok(run_cli("fuse", path, "-r", "llama-qkv", "-o", out))
    written = fusectl.open_checkpoint(str(out)).training.tree()["optimizer"]
    assert list(written["state"])[:2] == ["lm_head.weight", QKV]


# --- fuse: the form kept, the states moved ------------------------------------------------------


@pytest.mark.parametrize("name", list(FILES))
def test_fuse_writes_the_optimizer_in_its_form_with_qkv_concatenated_and_the_tied_state_once(tmp_path, name):
    form, where = FILES[name]
    _, old, old_map = _mapped(FORMS / name)
    out = _fuse(tmp_path, name)
    after, new, new_map = _mapped(out)
    assert new.form == form and new.where == where
    tree = after.training.tree()[where]
    if form == "ids":
        assert sorted(tree["state"]) == list(range(7))
        assert [g["params"] for g in tree["param_groups"]] == [[0, 1, 2], [3, 4, 5, 6]]
    elif form == "names":
        assert list(tree["state"]) == [EMBED, QKV, LAYER + "o_proj.weight", *GROUPS[1]]
        assert [g["params"] for g in tree["param_groups"]] == [[EMBED, QKV, LAYER + "o_proj.weight"], GROUPS[1]]
    else:
        assert list(tree)[3:6] == [f"state.{QKV}.{k}" for k in ("step", "exp_avg", "exp_avg_sq")]
        assert not any(p in k for k in tree for p in PARTS)
        assert sum(k.startswith("param_groups.") for k in tree) == 7 * 11
    before, moved = _states_by_name(old, old_map), _states_by_name(new, new_map)
    assert len(moved) == 7 and "lm_head.weight" not in moved
    for key in ("exp_avg", "exp_avg_sq"):
        expected = np.concatenate([before[p][key].read() for p in PARTS])
        assert moved[QKV][key].read().tobytes() == expected.tobytes(), key
        assert moved[EMBED][key].read().tobytes() == before[EMBED][key].read().tobytes()  # the tied pair's one state
    step = moved[QKV]["step"]
    assert (step if type(step) is int else step.read()) == \
        (before[PARTS[0]]["step"] if type(step) is int else before[PARTS[0]]["step"].read())
    # the model keeps the tie: lm_head.weight is stored once, as the embedding's alias
    assert read_torch(str(out), key=after.state_dict_key).aliases == {"lm_head.weight": EMBED}


@pytest.mark.parametrize("name", list(FILES))
def test_unfuse_gives_back_the_training_dict_bitwise(tmp_path, name):
    fused, back = _fuse(tmp_path, name), tmp_path / f"back-{name}"
    ok(run_cli("unfuse", fused, "-o", back))
    original = fusectl.open_checkpoint(str(FORMS / name)).training.tree()
    restored = fusectl.open_checkpoint(str(back)).training.tree()
    if name == "object-ids.pt":  # written as torch.optim writes ids since 0.4: 0..n-1 in the groups' order
        opt = original["optimizer_state_dict"]
        new_id = {p: n for n, p in enumerate(p for g in opt["param_groups"] for p in g["params"])}
        original = {**original, "optimizer_state_dict": {
            "state": {new_id[p]: s for p, s in opt["state"].items()},
            "param_groups": [{**g, "params": [new_id[p] for p in g["params"]]} for g in opt["param_groups"]]}}
    assert _differences(original, restored) == []


def test_the_comparison_sees_a_state_moved_to_the_wrong_parameter(tmp_path):
    def swapped(tree):  # q's and o's states (both [8, 8]) exchanged
        opt = dict(tree["optimizer"])
        state = dict(opt["state"])
        state[PARTS[0]], state[LAYER + "o_proj.weight"] = state[LAYER + "o_proj.weight"], state[PARTS[0]]
        return {**tree, "optimizer": {**opt, "state": state}}
    restored = fusectl.open_checkpoint(_rewritten(tmp_path, "named.pt", swapped)).training.tree()
    found = _differences(fusectl.open_checkpoint(str(FORMS / "named.pt")).training.tree(), restored)
    assert any("q_proj" in d for d in found) and any("o_proj" in d for d in found)


# --- with torch: the fused files resume ----------------------------------------------------------


@pytest.mark.parametrize("name", list(FILES))
def test_each_fused_form_resumes_on_the_fused_model_with_the_unfused_runs_losses(tmp_path, name):
    pytest.importorskip("torch")
    forms = _forms()
    reference = json.loads((FIXTURES / "reference" / "optimizer-forms.json").read_text())
    kind = "adam" if name == "object-ids.pt" else "adamw"
    out = _fuse(tmp_path, name)
    fused = forms.resume(out)
    unfused = forms.resume(FORMS / name)
    assert fused["fused"] and not unfused["fused"] and fused["form"] == FILES[name][0]
    assert fused["losses"] == unfused["losses"]  # bit for bit: both resumed here, in this process
    recorded = reference["uninterrupted"][kind]  # on another machine: its CPU may round otherwise
    assert len(fused["losses"]) == len(recorded)
    assert max(abs(a - b) for a, b in zip(fused["losses"], recorded)) <= 1e-5
    ok(run_cli("unfuse", out, "-o", tmp_path / "back.pt"))
    assert forms.resume(tmp_path / "back.pt")["losses"] == unfused["losses"]


def test_a_fresh_optimizer_on_the_fused_model_does_not_give_those_losses(tmp_path):
    torch = pytest.importorskip("torch")
    forms = _forms()
    reference = json.loads((FIXTURES / "reference" / "optimizer-forms.json").read_text())
    out = _fuse(tmp_path, "tied-adamw.pt")
    forms.deterministic()
    model = forms.TinyLM(fused=True)
    model.load_state_dict(torch.load(out, weights_only=True)["model_state_dict"])
    losses = forms.train(model, forms.make_optimizer(model), forms.batches()[forms.SAVED:])
    assert max(abs(a - b) for a, b in zip(losses, reference["uninterrupted"]["adamw"])) > 1e-3
