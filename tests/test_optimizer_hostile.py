"""Optimizer state that costs the mapping search, and names that look like state (issue 28).

One param group per parameter is an ordinary configuration (per-parameter weight decay or
learning rate); a torch.optim.AdamW file with 75 groups once grew to 5.9 GB in 60 s, and
``inspect``, ``convert`` and ``fuse --drop-optimizer`` all hung in the search that maps its
ids to parameters. The files here are built as torch.save writes AdamW's ``state_dict()``
(``step`` a 0-d float32 tensor, each group's hyperparameters as torch 2.x writes them), by the
torch.save writer of fusectl (no torch needed):

- 75 groups whose parameters have distinct shapes: mapped, fused and unfused bitwise, within a
  budget of a few steps per id (so never by trying subsets of groups);
- 75 groups whose parameters share shapes (a real model's biases and norms): refused at once,
  exit 2, nothing written, the message asking for param_names (an order file cannot tell
  groups apart);
- ``fuse --drop-optimizer``, ``convert`` and a rule that moves no parameter never map at all;
- a search past its budget is exit 2 naming the budget's variable.

Names with the state separator (``::``) are refused, never dropped from an output that exits 0,
and a ``step`` that is NaN is refused whether a number or a tensor.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

import fusectl
from conftest import ok, refused, run_cli, snapshot, write_rules
from fusectl.dtypes import BY_NAME
from fusectl.io import optimizer_state
from fusectl.io.formats.torch_writer import write_torch_file
from fusectl.tensors import ArrayTensor, TensorSpec
from test_training_flags import concat_rule
from test_training_output import _differences

GROUPS = 75


def array(values, dtype="F32") -> ArrayTensor:
    values = np.asarray(values, BY_NAME[dtype].numpy)
    return ArrayTensor(TensorSpec(BY_NAME[dtype], values.shape), values)


def adamw_file(path, shapes: dict[str, tuple], per_parameter: bool = True, step=3.0, extra_model=None):
    """A training dict of a model with ``shapes`` (name → shape, in order), trained by AdamW with
    one param group per parameter (each its own weight decay), as torch.save writes it."""
    rng = np.random.default_rng(0)
    model = collections.OrderedDict((n, array(rng.standard_normal(s))) for n, s in shapes.items())
    model.update(extra_model or {})
    state = {}
    for i, shape in enumerate(shapes.values()):
        state[i] = {"step": step if isinstance(step, float) else array(step),
                    "exp_avg": array(rng.standard_normal(shape)), "exp_avg_sq": array(rng.random(shape))}
    hyper = {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False, "foreach": None, "maximize": False,
             "capturable": False, "differentiable": False, "fused": None}
    ids = list(range(len(shapes)))
    if per_parameter:
        groups = [{**hyper, "weight_decay": 0.01 * (i % 3), "params": [i]} for i in ids]
    else:
        groups = [{**hyper, "weight_decay": 0.01, "params": ids}]
    write_torch_file(str(path), {"epoch": 2, "model_state_dict": model,
                                 "optimizer_state_dict": {"state": state, "param_groups": groups}})
    return path


def distinct_shapes() -> dict[str, tuple]:
    return {f"layers.{i}.weight": (i + 2, 3) for i in range(GROUPS)}


def shared_shapes() -> dict[str, tuple]:
    shapes = {}
    for i in range(GROUPS // 3):
        shapes.update({f"layers.{i}.weight": (8, 8), f"layers.{i}.norm.weight": (8,), f"layers.{i}.norm.bias": (8,)})
    return shapes


CONCAT = concat_rule(["layers.0.weight", "layers.1.weight"], "layers.01.weight")


@pytest.fixture
def never_mapped(monkeypatch):
    """A run in which proving the optimizer's mapping fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("the optimizer's ids were mapped to its parameters")

    monkeypatch.setattr(optimizer_state, "_placement", refuse)



def _assert_round_trips_bitwise(src, rules, tmp_path) -> None:
    """``src`` fused with ``rules`` and unfused: the whole training dict back, bitwise and in order."""
    ok(run_cli("fuse", src, "-r", rules, "-o", tmp_path / "fused.pt"))
    ok(run_cli("unfuse", tmp_path / "fused.pt", "-o", tmp_path / "back.pt"))
    assert _differences(fusectl.open_checkpoint(str(src)).training.tree(),
                        fusectl.open_checkpoint(str(tmp_path / "back.pt")).training.tree()) == []

def test_seventy_five_groups_of_distinct_shapes_map_fuse_and_unfuse_within_a_small_budget(tmp_path, monkeypatch):
    src = adamw_file(tmp_path / "train.pt", distinct_shapes())
    # a few steps per id: a search through subsets of the 75 groups could not stay within it
    monkeypatch.setenv("FUSECTL_MAX_ORDER_SEARCH", str(40 * GROUPS))
    report = ok(run_cli("inspect", src, "--json")).json()["optimizer"]
    assert report["problem"] is None and len(report["groups"]) == GROUPS
    rules = write_rules(tmp_path / "cat.toml", concat_rule(["layers.3.weight", "layers.4.weight"], "layers.3_4.weight"))
    # layers.3 (5, 3) and layers.4 (6, 3) sit in two groups: one fused tensor has one weight decay
    refused(run_cli("fuse", src, "-r", rules, "-o", tmp_path / "x.pt"), "param group", "--drop-optimizer",
            unwritten=[tmp_path / "x.pt"])
    rules = write_rules(tmp_path / "t.toml", 'version = 1\n[[rule]]\nop = "transpose"\ninput = "layers.{i}.weight"\n'
                                            'output = "layers.{i}.weight_t"\n')
    _assert_round_trips_bitwise(src, rules, tmp_path)


def test_seventy_five_groups_of_shared_shapes_are_refused_at_once_asking_for_names(tmp_path, monkeypatch):
    src = adamw_file(tmp_path / "train.pt", shared_shapes())
    before = snapshot(src)
    # decided within a quadratic budget (pairs of ids that could trade places), not 2**75 subsets
    monkeypatch.setenv("FUSECTL_MAX_ORDER_SEARCH", str(10 * GROUPS * GROUPS))
    rules = write_rules(tmp_path / "cat.toml", CONCAT)
    result = run_cli("fuse", src, "-r", rules, "-o", tmp_path / "out.pt")
    refused(result, "alike", "param_names", "--drop-optimizer", unwritten=[tmp_path / "out.pt"])
    assert "FUSECTL_MAX_ORDER_SEARCH" not in result.stderr
    report = ok(run_cli("inspect", src, "--json")).json()["optimizer"]
    assert "alike" in report["problem"] and report["parameters"] is None
    assert snapshot(src) == before


def test_drop_optimizer_convert_and_rules_that_move_no_parameter_never_map(tmp_path, never_mapped):
    src = adamw_file(tmp_path / "train.pt", shared_shapes(),
                     extra_model={"counter": array(np.array(7), "I64")})
    rules = write_rules(tmp_path / "cat.toml", CONCAT)
    result = ok(run_cli("fuse", src, "-r", rules, "--drop-optimizer", "-o", tmp_path / "model.pt", "--json"))
    assert result.json()["optimizer"]["state"] == "dropped"
    assert fusectl.open_checkpoint(str(tmp_path / "model.pt")).training.optimizer_key is None
    result = ok(run_cli("convert", src, "-o", tmp_path / "copy.pt", "--json"))
    assert result.json()["optimizer"]["state"] == "copied"
    assert _differences(fusectl.open_checkpoint(str(src)).training.tree(),
                        fusectl.open_checkpoint(str(tmp_path / "copy.pt")).training.tree()) == []
    drop = write_rules(tmp_path / "drop.toml", 'version = 1\n[[rule]]\nop = "drop"\ninput = "counter"\n')
    result = ok(run_cli("fuse", src, "-r", drop, "-o", tmp_path / "dropped.pt", "--json"))
    assert result.json()["optimizer"]["state"] == "copied"
    written = fusectl.open_checkpoint(str(tmp_path / "dropped.pt"))
    assert "counter" not in written.table.entries and len(written.table.entries) == len(shared_shapes())


def test_a_search_past_its_budget_is_refused_naming_the_variable(tmp_path, monkeypatch):
    src = adamw_file(tmp_path / "train.pt", distinct_shapes())
    monkeypatch.setenv("FUSECTL_MAX_ORDER_SEARCH", "10")
    rules = write_rules(tmp_path / "cat.toml", CONCAT)
    refused(run_cli("fuse", src, "-r", rules, "-o", tmp_path / "out.pt"), "FUSECTL_MAX_ORDER_SEARCH",
            "--param-order FILE", "--drop-optimizer", unwritten=[tmp_path / "out.pt"])


# --- names holding the state separator --------------------------------------------------------


@pytest.mark.parametrize("command", [["convert"], ["fuse", "-r", "RULES"], ["fuse", "-r", "RULES", "--drop-optimizer"]])
def test_an_input_tensor_named_like_a_state_is_refused_never_dropped(tmp_path, command):
    src = adamw_file(tmp_path / "train.pt", distinct_shapes(), per_parameter=False,
                     extra_model={"z::momentum_buffer": array(np.ones(3))})
    rules = write_rules(tmp_path / "cat.toml", CONCAT)
    args = [str(rules) if a == "RULES" else a for a in command]
    refused(run_cli(args[0], src, *args[1:], "-o", tmp_path / "out.pt"), "'z::momentum_buffer'", "another name",
            unwritten=[tmp_path / "out.pt"])
    # written alone, the model keeps it
    ok(run_cli("convert", src, "-o", tmp_path / "model.safetensors"))
    assert "z::momentum_buffer" in fusectl.open_checkpoint(str(tmp_path / "model.safetensors")).table.entries


@pytest.mark.parametrize("drop", [[], ["--drop-optimizer"]])
def test_a_rule_output_named_like_a_state_is_refused_never_dropped(tmp_path, drop):
    src = adamw_file(tmp_path / "train.pt", distinct_shapes(), per_parameter=False)
    for target in ("layers.0.weight", "layers.0.weight_t"):  # a parameter with state, then a new name
        rules = write_rules(tmp_path / "r.toml", f'version = 1\n[[rule]]\nop = "rename"\ninput = "layers.1.weight"\n'
                                                 f'output = "{target}::exp_avg"\n')
        refused(run_cli("fuse", src, "-r", rules, *drop, "-o", tmp_path / "out.pt"), "::exp_avg'",
                "another name", unwritten=[tmp_path / "out.pt"])


# --- a NaN step ------------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [float("nan"), np.float32("nan")], ids=["number", "tensor"])
def test_a_nan_step_is_refused_as_a_number_and_as_a_tensor(tmp_path, step):
    src = adamw_file(tmp_path / "train.pt", distinct_shapes(), per_parameter=False, step=step)
    rules = write_rules(tmp_path / "cat.toml", CONCAT)
    refused(run_cli("fuse", src, "-r", rules, "-o", tmp_path / "out.pt"), "'step'", "not a finite number",
            "--drop-optimizer", unwritten=[tmp_path / "out.pt"])
    ok(run_cli("fuse", src, "-r", rules, "--drop-optimizer", "-o", tmp_path / "out.pt"))


# --- with torch: a real AdamW of 75 groups ----------------------------------------------------------


def _real_adamw(path, named: bool):
    """torch.optim.AdamW on 25 blocks of Linear(8, 8) + LayerNorm(8) (75 parameters), one group per
    parameter (weight decay 0 for vectors), two steps taken, saved with torch.save; returns
    (the model, a fresh optimizer on it as the run built it, an input for one more step)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8, bias=False))
                                  for _ in range(25)])

    def optimizer():
        return torch.optim.AdamW([{"params": [(n, p) if named else p], "weight_decay": 0.0 if p.ndim == 1 else 0.01}
                                  for n, p in model.named_parameters()], lr=1e-3)

    opt = optimizer()
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1}, path)
    return model, optimizer, torch.randn(4, 8)


def _resumed(torch, model, optimizer, x, path) -> list:
    """The parameters after one more step resumed from ``path`` (torch.load, weights only)."""
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["model"])
    opt = optimizer()
    opt.load_state_dict(saved["optimizer"])
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_a_real_adamw_of_75_groups_is_refused_at_once_and_converts_and_resumes_bitwise(tmp_path):
    src = tmp_path / "real.pt"
    model, optimizer, x = _real_adamw(src, named=False)
    torch = pytest.importorskip("torch")
    report = ok(run_cli("inspect", src, "--json")).json()["optimizer"]
    assert len(report["groups"]) == GROUPS and "param_names" in report["problem"]
    ok(run_cli("convert", src, "-o", tmp_path / "copy.pt"))
    want = _resumed(torch, model, optimizer, x, src)
    got = _resumed(torch, model, optimizer, x, tmp_path / "copy.pt")
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    rules = write_rules(tmp_path / "t.toml", concat_rule(["0.0.weight", "1.0.weight"], "01.weight"))
    refused(run_cli("fuse", src, "-r", rules, "-o", tmp_path / "out.pt"), "param_names", "--drop-optimizer",
            unwritten=[tmp_path / "out.pt"])
    ok(run_cli("fuse", src, "-r", rules, "--drop-optimizer", "-o", tmp_path / "out.pt"))


def test_a_real_adamw_of_75_groups_saved_with_names_fuses_and_unfuses_bitwise(tmp_path):
    src = tmp_path / "named.pt"
    _real_adamw(src, named=True)
    rules = write_rules(tmp_path / "t.toml", 'version = 1\n[[rule]]\nop = "transpose"\ninput = "{i}.0.weight"\n'
                                            'output = "{i}.0.weight_t"\n')
    _assert_round_trips_bitwise(src, rules, tmp_path)
