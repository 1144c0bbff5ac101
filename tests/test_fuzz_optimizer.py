"""Fuzz: malformed optimizer state in training dicts, in every form fusectl reads (issue 20).

The four training dicts of fixtures/training/forms/ (ids 0..n-1, keyed by name, flattened,
keyed by object ids) are read, their optimizer entry broken one way — a wrong type for
``state``, ``param_groups``, a group, its ``params`` or a hyperparameter; an id missing from the
groups, a state for an id or a name no group lists, a state of another shape, an id listed
twice, a name no parameter has, ids of two kinds; in the flattened form a key of neither kind,
a parameter or hyperparameter missing from a key, a nested state — and written back as a torch
file by ``io.formats.torch_writer`` (no torch needed). ``fuse -r llama-qkv -o out.pt`` of each must
refuse it: exit 2, one ``error:`` line naming the file and its optimizer state, nothing written,
the input untouched, no traceback (test_fuzz.check_contract) — never a file with a state moved to
the wrong parameter. The same file read through the API raises CheckpointError. Each mutation
runs on every form it applies to, ``max(1, FUSECTL_FUZZ_CASES // 30)`` times with its own random
stream (``FUSECTL_FUZZ_SEED``).
"""

from __future__ import annotations

import collections
import copy
import os
import random

import numpy as np
import pytest

import fusectl
from conftest import FIXTURES
from fusectl.dtypes import BY_NAME
from fusectl.errors import CheckpointError
from fusectl.io.formats.torch_writer import write_torch_file
from fusectl.tensors import ArrayTensor, LazyTensor, TensorSpec
from test_fuzz import CASES, SEED, check_contract

FORMS = FIXTURES / "training" / "forms"
FILES = {"ids": "tied-adamw.pt", "names": "named.pt", "flat": "named-flat.pt", "object-ids": "object-ids.pt"}
NESTED = ("ids", "names", "object-ids")
REPEAT = max(1, CASES // 30)
GHOST = "model.ghost.weight"


def tensor(*shape) -> ArrayTensor:
    return ArrayTensor(TensorSpec(BY_NAME["F32"], shape), np.zeros(shape, np.float32))


def _base(form: str):
    """(the training tree with the model from the table, the optimizer key, the parameter shapes)."""
    checkpoint = fusectl.open_checkpoint(str(FORMS / FILES[form]))
    tree = dict(checkpoint.training.tree())
    key = checkpoint.state_dict_key
    tree[key] = collections.OrderedDict((n, checkpoint.table.entries[n]) for n in tree[key])
    shapes = {n: checkpoint.table.spec(n).shape for n in checkpoint.table.entries}
    return tree, checkpoint.training.optimizer_key, shapes


def _with_state(opt: dict) -> list:
    return [p for p, s in opt["state"].items() if any(isinstance(v, LazyTensor) for v in s.values())]


def _other_shape(rng, shape) -> tuple:
    return rng.choice([tuple(shape) + (1,), tuple(reversed(shape)) if len(set(shape)) > 1 else (shape[0] + 1,),
                       (3,), ()]) if shape else (2,)


# --- the nested forms: {"state": {id: {...}}, "param_groups": [...]} ---------------------------------


def state_type(rng, opt, shapes):
    opt["state"] = rng.choice([[], "x", 3, None, (1,), [{}]])


def groups_type(rng, opt, shapes):
    opt["param_groups"] = rng.choice([{}, "x", None, 5, [], ({},)])


def group_type(rng, opt, shapes):
    groups = opt["param_groups"]
    groups[rng.randrange(len(groups))] = rng.choice([5, "x", None, [], {"lr": 0.1}])


def params_type(rng, opt, shapes):
    group = rng.choice(opt["param_groups"])
    group["params"] = rng.choice([[1.5], "abc", None, [None], [[0]], [True], 7, {"a": 1}, [(1,)]])


def hyper_type(rng, opt, shapes):
    group = rng.choice(opt["param_groups"])
    choice = rng.randrange(4)
    if choice == 0:
        group[5] = 0.1  # a hyperparameter named by a number
    elif choice == 1:
        deep: object = 1.0
        for _ in range(12):
            deep = [deep]
        group["lr"] = deep
    else:
        group[rng.choice(["lr", "betas", "custom"])] = rng.choice([tensor(2), {1: 2.0}, {"a": tensor(3)}])


def id_missing_from_groups(rng, opt, shapes):
    pid = rng.choice(_with_state(opt))
    for group in opt["param_groups"]:
        group["params"] = [p for p in group["params"] if p != pid]


def state_for_unknown_id(rng, opt, shapes):
    pid = rng.choice(_with_state(opt))
    ghost = GHOST if type(pid) is str else rng.choice([999, 2**40 + 7, -1])
    opt["state"][ghost] = dict(opt["state"][pid])


def shape_mismatch(rng, opt, shapes, names=None):
    pid = rng.choice(_with_state(opt))
    entry = opt["state"][pid]
    key = rng.choice([k for k, v in entry.items() if isinstance(v, LazyTensor) and v.spec.shape])
    entry[key] = tensor(*_other_shape(rng, entry[key].spec.shape))


def step_shape(rng, opt, shapes):
    entry = opt["state"][rng.choice(_with_state(opt))]
    entry["step"] = tensor(*rng.choice([(3,), (2, 2)]))


def duplicate_id(rng, opt, shapes):
    groups = opt["param_groups"]
    source = rng.choice(groups)
    rng.choice(groups)["params"].append(rng.choice(source["params"]))


def mixed_ids(rng, opt, shapes):
    group = rng.choice(opt["param_groups"])
    n = rng.randrange(len(group["params"]))
    pid = group["params"][n]
    new = 0 if type(pid) is str else str(pid)
    group["params"][n] = new
    if pid in opt["state"]:
        opt["state"][new] = opt["state"].pop(pid)


def state_entry(rng, opt, shapes):
    pid = rng.choice(_with_state(opt))
    choice = rng.randrange(3)
    if choice == 0:
        opt["state"][pid] = rng.choice([[], "x", 5, None])
    elif choice == 1:
        opt["state"][pid]["exp_avg"] = rng.choice(["x", None, [1.0], {"a": 1}])
    else:
        opt["state"][pid][rng.choice([5, -1])] = tensor(2)  # (the writer keys dicts by text or integers)


def state_key_type(rng, opt, shapes):
    pid = rng.choice(_with_state(opt))
    opt["state"][str(pid) if type(pid) is int else rng.choice([0, 2**40])] = opt["state"].pop(pid)


def name_unknown(rng, opt, shapes):
    pid = rng.choice(_with_state(opt))
    new = rng.choice([GHOST, f"module.{pid}", pid.upper()])
    for group in opt["param_groups"]:
        group["params"] = [new if p == pid else p for p in group["params"]]
    opt["state"][new] = opt["state"].pop(pid)


def not_a_pair(rng, opt, shapes):
    del opt[rng.choice(["state", "param_groups"])]


# --- the flattened form: {"state.<name>.<key>": ..., "param_groups.<name>.<hyper>": ...} -------------


def _flat_names(opt) -> list[str]:
    return list(dict.fromkeys(k[len("param_groups."):].rpartition(".")[0] for k in opt
                              if k.startswith("param_groups.")))


def _flat_state_keys(opt) -> list[str]:
    return [k for k, v in opt.items() if k.startswith("state.") and isinstance(v, LazyTensor) and v.spec.shape]


def flat_foreign_key(rng, opt, shapes):
    opt[rng.choice(["stat.model.norm.weight.exp_avg", "x", "", 5, "params", "state"])] = tensor(2)


def flat_no_parameter(rng, opt, shapes):
    name = rng.choice(_flat_names(opt))
    opt[rng.choice(["param_groups.lr", "param_groups..lr", f"param_groups.{name}.", "param_groups."])] = 0.1


def flat_unknown_name(rng, opt, shapes):
    opt[rng.choice([f"state.{GHOST}.exp_avg", "state.exp_avg", "state.model.exp_avg"])] = tensor(8)


def flat_nested_state(rng, opt, shapes):
    key = rng.choice(_flat_state_keys(opt))
    opt[key + rng.choice([".0", ".row", ".a.b"])] = opt.pop(key)


def flat_hyper_type(rng, opt, shapes):
    key = rng.choice([k for k in opt if k.startswith("param_groups.")])
    opt[key] = rng.choice([tensor(2), {1: 2.0}, {"a": tensor(3)}])


def flat_state_type(rng, opt, shapes):
    opt[rng.choice(_flat_state_keys(opt))] = rng.choice(["x", None, [1.0], {"a": 1}])


def flat_shape_mismatch(rng, opt, shapes):
    key = rng.choice(_flat_state_keys(opt))
    opt[key] = tensor(*_other_shape(rng, opt[key].spec.shape))


def flat_params_key(rng, opt, shapes):
    name = rng.choice(_flat_names(opt))
    opt[f"param_groups.{name}.{rng.choice(['params', 'param_names'])}"] = [name]


def flat_drop_groups(rng, opt, shapes):
    names = [n for n in _flat_names(opt) if any(k.startswith(f"state.{n}.") for k in opt)]
    drop = set(rng.sample(names, rng.choice([1, len(names)])))
    for k in [k for k in opt if k.startswith("param_groups.") and k[13:].rpartition(".")[0] in drop]:
        del opt[k]
    if len(drop) == len(names):  # every parameter with state gone: drop the rest of the groups too
        for k in [k for k in opt if k.startswith("param_groups.")]:
            del opt[k]


def flat_step_shape(rng, opt, shapes):
    key = rng.choice([k for k in opt if k.startswith("state.") and k.endswith(".step")])
    opt[key] = tensor(3)


NESTED_MUTATIONS = [state_type, groups_type, group_type, params_type, hyper_type, id_missing_from_groups,
                    state_for_unknown_id, shape_mismatch, step_shape, duplicate_id, mixed_ids, state_entry,
                    state_key_type, not_a_pair]
FLAT_MUTATIONS = [flat_foreign_key, flat_no_parameter, flat_unknown_name, flat_nested_state, flat_hyper_type,
                  flat_state_type, flat_shape_mismatch, flat_params_key, flat_drop_groups, flat_step_shape]
CASE_LIST = ([(form, m) for m in NESTED_MUTATIONS for form in NESTED] + [("names", name_unknown)]
             + [("flat", m) for m in FLAT_MUTATIONS])


@pytest.mark.parametrize("form, mutation, repeat",
                         [(f, m, r) for f, m in CASE_LIST for r in range(REPEAT)],
                         ids=[f"{f}-{m.__name__}-{r}" for f, m in CASE_LIST for r in range(REPEAT)])
def test_a_broken_optimizer_is_refused_cleanly_and_nothing_is_written(tmp_path, form, mutation, repeat):
    rng = random.Random(f"{SEED}-optimizer-{form}-{mutation.__name__}-{repeat}")
    tree, key, shapes = _base(form)
    opt = copy.copy(tree[key])
    if "state" in opt:
        opt["state"] = {p: dict(s) for p, s in opt["state"].items()}
        opt["param_groups"] = [{**g, "params": list(g["params"])} for g in opt["param_groups"]]
    mutation(rng, opt, shapes)
    tree[key] = opt
    src = tmp_path / "in"
    src.mkdir()
    (src / "config.json").write_bytes((FORMS / "config.json").read_bytes())
    path = src / FILES[form]
    write_torch_file(str(path), tree)
    out = tmp_path / "out" / "fused.pt"
    out.parent.mkdir()
    result = check_contract(["fuse", path, "-r", "llama-qkv", "-o", out, "--quiet"], culprit=path, inputs=src,
                            out=out)
    assert result.exit_code == 2, f"{mutation.__name__} on {form} was written:\n{result.stderr}"
    first = result.stderr.splitlines()[0]
    assert "optimizer state" in first and len(result.stderr.strip().splitlines()) == 1, result.stderr
    with pytest.raises(CheckpointError):
        fusectl.open_checkpoint(str(path)).training_table()


def test_the_fuzz_base_files_themselves_fuse(tmp_path):
    # the unbroken tree, rewritten the same way, is read and fused: the refusals come from the mutations
    for form in FILES:
        tree, key, _ = _base(form)
        src = tmp_path / form
        src.mkdir()
        (src / "config.json").write_bytes((FORMS / "config.json").read_bytes())
        write_torch_file(str(src / FILES[form]), tree)
        result = check_contract(["fuse", src / FILES[form], "-r", "llama-qkv", "-o", tmp_path / f"{form}.pt",
                                 "--quiet"], culprit=src / FILES[form], inputs=src, out=tmp_path / f"{form}.pt")
        assert result.exit_code == 0, result.stderr
        assert os.path.getsize(tmp_path / f"{form}.pt") > 0
