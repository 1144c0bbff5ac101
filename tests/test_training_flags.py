"""The flags of a training checkpoint (issue 20): ``--untie-training``, ``--drop-optimizer``, and
``convert`` / ``unfuse -r`` of a training dict to a PyTorch file written whole.

- ``--untie`` that breaks a tie of trained parameters in a plan carrying the optimizer's state
  is exit 2 with nothing written, the error naming ``--untie-training``; with it, each untied
  member gets its own copy of the one state (its own storage: torch's optimizer updates
  moments in place) and the report says the trajectory changes.
- ``--drop-optimizer`` writes the model alone (a ``.pt`` output: the training dict without its
  optimizer, Lightning's without ``optimizer_states`` and ``lr_schedulers``), so that
  folds, whole-tensor optimizers and parts with unequal steps — each refused without it, the
  error naming it — go through.
- ``convert`` of a training dict to ``.pt`` gives back the whole dict bitwise; ``fuse`` then
  ``unfuse -r`` with the same rules gives back the original optimizer bitwise.

Tied training dicts are written here with ``fusectl.io.formats.torch_writer`` (byte for byte what
torch.save writes, ``test_torch_writer.py``); with torch installed, the untied output is loaded
into a real AdamW, whose moments must be separate tensors.
"""

from __future__ import annotations

import collections
import json
import zipfile

import numpy as np
import pytest

import fusectl
from conftest import FIXTURES, ok, refused, run_cli, snapshot, write_rules
from fusectl import dtypes
from fusectl.errors import TieError
from fusectl.io.optimizer_state import RECORD_KEYS
from fusectl.io.formats.torch_writer import write_torch_file
from fusectl.tensors import ArrayTensor, LazyTensor, TensorSpec
from test_ties import TRANSPOSE_EMBED
from test_training_output import _differences as tree_differences

TRAINING = FIXTURES / "training"
TORCH = FIXTURES / "torch"
RULES = ["-r", "llama-qkv", "-r", "llama-gate-up"]
CONFIG = ["--config", TRAINING / "config.json"]  # for a file written here, away from the fixtures' config.json
F32 = dtypes.BY_NAME["F32"]


def concat_rule(inputs: list[str], output: str) -> str:
    """A rules file of one concat of ``inputs`` into ``output`` (axis 0)."""
    return f'version = 1\n[[rule]]\nop = "concat"\ninputs = {json.dumps(inputs)}\noutput = "{output}"\n'


# fixtures/torch/training.pt's bidirectional RNN biases concatenated: parameters of an optimizer
# whose order the shapes do not prove (its BatchNorm buffers are shaped like biases)
RNN_BIAS = concat_rule(["rnn.bias_ih_l0", "rnn.bias_hh_l0"], "rnn.bias_l0")
DROP_COUNTERS = 'version = 1\n[[rule]]\nop = "drop"\ninput = "{m*}.num_batches_tracked"\n'


def tensor(array) -> ArrayTensor:
    array = np.asarray(array, np.float32)
    return ArrayTensor(TensorSpec(F32, array.shape), array)


def write_tied(path, state_keys=("exp_avg", "exp_avg_sq"), hyper=None) -> dict:
    """A training dict of a model whose ``head.weight`` is ``embed.weight`` (one tensor: one
    storage, as torch.save writes a tied module), trained by an AdamW-like optimizer with
    ``state_keys``; returns the arrays written."""
    rng = np.random.default_rng(0)
    arrays = {"embed.weight": rng.standard_normal((6, 4)), "proj.weight": rng.standard_normal((4, 4))}
    embed = tensor(arrays["embed.weight"])
    model = collections.OrderedDict([("embed.weight", embed), ("proj.weight", tensor(arrays["proj.weight"])),
                                     ("head.weight", embed)])
    state = {}
    for pid, name in enumerate(("embed.weight", "proj.weight")):
        state[pid] = {"step": tensor(np.array(3.0))}
        for k, key in enumerate(state_keys):
            arrays[f"{name}::{key}"] = rng.standard_normal(arrays[name].shape) * (k + 1)
            state[pid][key] = tensor(arrays[f"{name}::{key}"])
    group = hyper or {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0.01, "amsgrad": False}
    optimizer = {"state": state, "param_groups": [{**group, "params": [0, 1]}]}
    write_torch_file(str(path), {"model_state_dict": model, "optimizer_state_dict": optimizer, "epoch": 2})
    return arrays


def metadata_record(path) -> dict:
    """fusectl's metadata record of a ``.pt`` (its provenance), as ``write_torch_file`` takes it
    (empty for a file fusectl did not write)."""
    with zipfile.ZipFile(path) as z:
        name = next((n for n in z.namelist() if n.endswith("/fusectl_metadata.json")), None)
        return json.loads(z.read(name)) if name is not None else {}


def rewrite(src, dst, edit) -> None:
    """``dst``: the training dict of ``src`` with ``edit(tree)`` applied, its provenance kept."""
    tree = fusectl.open_checkpoint(str(src)).training.tree()
    edit(tree)
    write_torch_file(str(dst), tree, metadata=metadata_record(src))


def without_order_record(src, dst) -> None:
    """``dst``: ``src`` as fusectl wrote training dicts before it recorded the parameter of each
    optimizer id (issue 28): the same tree and provenance, no ``fusectl.param_names``."""
    record = {k: v for k, v in metadata_record(src).items() if k not in RECORD_KEYS}
    write_torch_file(str(dst), fusectl.open_checkpoint(str(src)).training.tree(), metadata=record)


def _optimizer(path):
    checkpoint = fusectl.open_checkpoint(str(path))
    state, mapping = checkpoint.optimizer_mapped
    by_name = {name: state.states[pid] for pid, name in mapping.names.items()}
    return checkpoint, state, by_name


# --- --untie on a training checkpoint -------------------------------------------------------------


@pytest.mark.parametrize("command", ["fuse", "plan"])
def test_untie_of_a_trained_tie_is_exit_2_naming_untie_training_and_nothing_written(tmp_path, command):
    write_tied(tmp_path / "tied.pt")
    rules = write_rules(tmp_path / "t.toml", TRANSPOSE_EMBED)
    before = snapshot(tmp_path)
    out = ["-o", tmp_path / "out.pt"] if command == "fuse" else []
    result = run_cli(command, tmp_path / "tied.pt", "-r", rules, "--untie", *out)
    refused(result, "'embed.weight', 'head.weight'", "sum of their gradients", "--untie-training", "--drop-optimizer")
    assert snapshot(tmp_path) == before


def test_untie_of_a_trained_tie_through_the_api_names_the_keyword(tmp_path):
    write_tied(tmp_path / "tied.pt")
    rules = write_rules(tmp_path / "t.toml", TRANSPOSE_EMBED)
    with pytest.raises(TieError, match=r"untie_training=True.*drop_optimizer=True"):
        fusectl.fuse(str(tmp_path / "tied.pt"), [str(rules)], str(tmp_path / "out.pt"), untie=True)
    assert not (tmp_path / "out.pt").exists()


def test_untie_training_gives_each_member_a_copy_of_the_one_state_and_says_the_trajectory_changes(tmp_path):
    arrays = write_tied(tmp_path / "tied.pt")
    rules = write_rules(tmp_path / "t.toml", TRANSPOSE_EMBED)
    out = tmp_path / "out.pt"
    report = ok(run_cli("fuse", tmp_path / "tied.pt", "-r", rules, "--untie-training", "-o", out, "--json")).json()
    assert report["optimizer"] == {"where": "optimizer_state_dict", "state": "moved",
                                   "untied": [["embed.weight", "head.weight"]], "trajectory_changes": True}
    text = ok(run_cli("fuse", tmp_path / "tied.pt", "-r", rules, "--untie-training", "-o", tmp_path / "o2.pt"))
    assert "untied 'embed.weight', 'head.weight'" in text.stdout and "another trajectory" in text.stdout
    checkpoint, state, by_name = _optimizer(out)
    assert checkpoint.table.ties() == [] and sorted(by_name) == ["embed.weight", "head.weight", "proj.weight"]
    for key in ("exp_avg", "exp_avg_sq"):
        one = arrays[f"embed.weight::{key}"].astype(np.float32)
        assert by_name["head.weight"][key].read().tobytes() == one.tobytes()
        assert by_name["embed.weight"][key].read().tobytes() == np.ascontiguousarray(one.T).tobytes()
    # each member's state is its own storage: no two state entries share bytes in the file
    ranges = [v.byte_ranges() for s in by_name.values() for v in s.values() if isinstance(v, LazyTensor)]
    assert len({r[0].offset for r in ranges}) == len(ranges) == 9
    assert by_name["head.weight"]["step"].read() == by_name["embed.weight"]["step"].read() == 3.0
    assert [len(g.params) for g in state.groups] == [3]
    ok(run_cli("verify", tmp_path / "tied.pt", out))


def test_unfuse_of_an_untied_training_dict_ties_it_again_bitwise(tmp_path):
    write_tied(tmp_path / "tied.pt")
    rules = write_rules(tmp_path / "t.toml", TRANSPOSE_EMBED)
    ok(run_cli("fuse", tmp_path / "tied.pt", "-r", rules, "--untie-training", "-o", tmp_path / "out.pt"))
    # the provenance records the model's broken tie only: the state follows its parameters by rule
    groups = fusectl.open_checkpoint(str(tmp_path / "out.pt")).provenance.plan.groups
    assert [g.untied for g in groups] == [(("embed.weight", "head.weight"),)]
    ok(run_cli("unfuse", tmp_path / "out.pt", "-o", tmp_path / "back.pt"))
    original = fusectl.open_checkpoint(str(tmp_path / "tied.pt"))
    restored = fusectl.open_checkpoint(str(tmp_path / "back.pt"))
    assert restored.table.ties() == [["embed.weight", "head.weight"]]
    assert tree_differences(original.training.tree(), restored.training.tree()) == []


def test_the_untied_states_load_into_torchs_adamw_as_separate_tensors(tmp_path):
    torch = pytest.importorskip("torch")
    write_tied(tmp_path / "tied.pt")
    rules = write_rules(tmp_path / "t.toml", TRANSPOSE_EMBED)
    out = tmp_path / "out.pt"
    ok(run_cli("fuse", tmp_path / "tied.pt", "-r", rules, "--untie-training", "-o", out))
    saved = torch.load(out, weights_only=True)
    params = [torch.nn.Parameter(saved["model_state_dict"][n].clone())
              for n in ("embed.weight", "proj.weight", "head.weight")]
    optimizer = torch.optim.AdamW(params)
    optimizer.load_state_dict(saved["optimizer_state_dict"])
    moments = [optimizer.state[p]["exp_avg"] for p in params]
    steps = [optimizer.state[p]["step"] for p in params]
    assert len({m.data_ptr() for m in moments}) == 3 and len({id(s) for s in steps}) == 3
    sum(p.sum() for p in params).backward()
    optimizer.step()
    assert [float(s) for s in steps] == [4.0, 4.0, 4.0]  # each counted once, not twice


def test_untie_with_the_optimizer_not_written_needs_no_second_flag(tmp_path):
    write_tied(tmp_path / "tied.pt")
    rules = write_rules(tmp_path / "t.toml", TRANSPOSE_EMBED)
    report = ok(run_cli("fuse", tmp_path / "tied.pt", "-r", rules, "--untie", "-o", tmp_path / "m.safetensors",
                        "--json")).json()
    assert report["optimizer"]["state"] == "not written" and report["optimizer"]["untied"] == []
    report = ok(run_cli("fuse", tmp_path / "tied.pt", "-r", rules, "--untie", "--drop-optimizer",
                        "-o", tmp_path / "m.pt", "--json")).json()
    assert report["optimizer"]["state"] == "dropped"
    assert fusectl.open_checkpoint(str(tmp_path / "m.pt")).training.optimizer_key is None


# --- --drop-optimizer ---------------------------------------------------------------------------


def _order(tmp_path):
    table = fusectl.open_checkpoint(str(TORCH / "training.pt")).table
    path = tmp_path / "order.json"
    path.write_text(json.dumps([n for n in table.entries if "running_" not in n and "num_batches" not in n]))
    return path


def test_a_fold_of_a_training_dict_is_refused_naming_drop_optimizer_and_goes_through_with_it(tmp_path):
    order = _order(tmp_path)
    before = snapshot(tmp_path)
    refused(run_cli("fuse", TORCH / "training.pt", "-r", "conv-bn-fold", "--param-order", order,
                    "-o", tmp_path / "out.pt"), "bn_fold computes", "--drop-optimizer")
    assert snapshot(tmp_path) == before
    result = ok(run_cli("fuse", TORCH / "training.pt", "-r", "conv-bn-fold", "--drop-optimizer",
                        "-o", tmp_path / "out.pt", "--json"))
    assert result.json()["optimizer"] == {"where": "optimizer_state_dict", "state": "dropped", "untied": [],
                                          "trajectory_changes": False}
    assert "not written" not in result.stderr  # dropped on purpose: no note
    ok(run_cli("fuse", TORCH / "training.pt", "-r", "conv-bn-fold", "-o", tmp_path / "ref.safetensors"))
    dropped = fusectl.open_checkpoint(str(tmp_path / "out.pt"))
    alone = fusectl.open_checkpoint(str(tmp_path / "ref.safetensors"))
    # the training dict without its optimizer, every other entry as it was
    original = fusectl.open_checkpoint(str(TORCH / "training.pt")).training.tree()
    kept = dropped.training.tree()
    assert dropped.training.optimizer_key is None and dropped.state_dict_key == "model_state_dict"
    assert list(kept) == [k for k in original if k != "optimizer_state_dict"]
    others = [k for k in kept if k != "model_state_dict"]
    assert tree_differences({k: original[k] for k in others}, {k: kept[k] for k in others}) == []
    assert sorted(dropped.table.names()) == sorted(alone.table.names())
    for name in alone.table.names():
        assert dropped.table[name].read().tobytes() == alone.table[name].read().tobytes(), name
    text = ok(run_cli("fuse", TORCH / "training.pt", "-r", "conv-bn-fold", "--drop-optimizer",
                      "-o", tmp_path / "o2.pt")).stdout
    assert "optimizer state (optimizer_state_dict): dropped (--drop-optimizer): the output holds the model without it" \
        in text


def test_plan_with_drop_optimizer_plans_a_fold_without_state_steps(tmp_path):
    refused(run_cli("plan", TORCH / "training.pt", "-r", "conv-bn-fold", "--param-order", _order(tmp_path)),
            "--drop-optimizer")
    planned = ok(run_cli("plan", TORCH / "training.pt", "-r", "conv-bn-fold", "--drop-optimizer", "--json")).json()
    names = [n for g in planned["groups"] for s in g["steps"] for n in (*s["inputs"], *s["outputs"])]
    assert names and not any("::" in n for n in names)


def test_an_order_the_shapes_cannot_prove_names_drop_optimizer_too(tmp_path):
    rules = write_rules(tmp_path / "rnn.toml", RNN_BIAS)
    refused(run_cli("fuse", TORCH / "training.pt", "-r", rules, "-o", tmp_path / "out.pt"), "--param-order FILE",
            "--drop-optimizer", unwritten=[tmp_path / "out.pt"])


def test_convert_needs_no_order_as_no_parameter_moves(tmp_path):
    # issue 28: the shapes of training.pt do not prove its order (BatchNorm buffers shaped like
    # biases), yet convert moves nothing: its optimizer is written as read, unmapped
    result = ok(run_cli("convert", TORCH / "training.pt", "-o", tmp_path / "out.pt", "--json"))
    assert result.json()["optimizer"]["state"] == "copied"
    original, written = fusectl.open_checkpoint(str(TORCH / "training.pt")), fusectl.open_checkpoint(str(tmp_path / "out.pt"))
    assert tree_differences(original.training.tree(), written.training.tree()) == []


def test_a_rule_that_moves_no_parameter_needs_no_order_either(tmp_path):
    # dropping the BatchNorm counters (buffers of a shape no state has) moves no optimizer state
    rules = write_rules(tmp_path / "drop.toml", DROP_COUNTERS)
    result = ok(run_cli("fuse", TORCH / "training.pt", "-r", rules, "-o", tmp_path / "out.pt", "--json"))
    assert result.json()["optimizer"]["state"] == "copied"
    original, written = fusectl.open_checkpoint(str(TORCH / "training.pt")), fusectl.open_checkpoint(str(tmp_path / "out.pt"))
    assert sorted(written.table.names()) == sorted(n for n in original.table.names() if "num_batches" not in n)
    key = original.training.optimizer_key
    assert tree_differences(original.training.tree()[key], written.training.tree()[key]) == []


def test_a_whole_tensor_optimizer_is_refused_naming_drop_optimizer_and_goes_through_with_it(tmp_path):
    write_tied(tmp_path / "ada.pt", state_keys=("exp_avg_sq_row",), hyper={"lr": 0.01, "scale_parameter": True})
    rules = write_rules(tmp_path / "t.toml", TRANSPOSE_EMBED.replace("embed.weight", "proj.weight"))
    refused(run_cli("fuse", tmp_path / "ada.pt", "-r", rules, "-o", tmp_path / "out.pt"),
            "Adafactor is not elementwise", "--drop-optimizer", unwritten=[tmp_path / "out.pt"])
    ok(run_cli("fuse", tmp_path / "ada.pt", "-r", rules, "--drop-optimizer", "-o", tmp_path / "out.pt"))
    assert len(fusectl.open_checkpoint(str(tmp_path / "out.pt")).table.names()) == 3


def test_parts_with_unequal_steps_are_refused_naming_drop_optimizer_and_go_through_with_it(tmp_path):
    src = tmp_path / "steps.pt"

    def later_q(tree):
        tree["optimizer_state_dict"]["state"][1]["step"] = tensor(np.array(4.0))  # q_proj of layer 0

    rewrite(TRAINING / "llama-adamw.pt", src, later_q)
    refused(run_cli("fuse", src, *RULES, *CONFIG, "-o", tmp_path / "out.pt"), "q_proj.weight::step",
            "the values 4.0, 3.0, 3.0", "--drop-optimizer", unwritten=[tmp_path / "out.pt"])
    ok(run_cli("fuse", src, *RULES, *CONFIG, "--drop-optimizer", "-o", tmp_path / "out.pt"))


def test_drop_optimizer_on_a_checkpoint_without_one_is_exit_2(tmp_path):
    refused(run_cli("fuse", FIXTURES / "tiny-llama-gqa", "-r", "llama-qkv", "--drop-optimizer",
                    "-o", tmp_path / "out"), "--drop-optimizer", "no optimizer state", unwritten=[tmp_path / "out"])


# --- convert and unfuse -r of a training dict to a PyTorch file ----------------------------------------


@pytest.mark.parametrize("name", ["llama-adamw.pt", "llama-sgd.pt", "lightning.ckpt"])
def test_convert_of_a_training_dict_to_pytorch_writes_the_whole_dict_bitwise(tmp_path, name):
    out = tmp_path / f"out.{name.rsplit('.', 1)[1]}"
    result = ok(run_cli("convert", TRAINING / name, "-o", out, "--json"))
    assert result.json()["optimizer"]["state"] == "copied" and "not written" not in result.stderr
    original, converted = fusectl.open_checkpoint(str(TRAINING / name)), fusectl.open_checkpoint(str(out))
    assert tree_differences(original.training.tree(), converted.training.tree()) == []


def test_convert_to_safetensors_or_with_drop_optimizer_writes_the_model_only(tmp_path):
    result = ok(run_cli("convert", TRAINING / "llama-adamw.pt", "-o", tmp_path / "m.safetensors"))
    assert "optimizer state (optimizer_state_dict) is not written" in result.stderr
    result = ok(run_cli("convert", TRAINING / "llama-adamw.pt", "-o", tmp_path / "m.pt", "--drop-optimizer"))
    assert "not written" not in result.stderr
    converted = fusectl.open_checkpoint(str(tmp_path / "m.pt"))
    assert converted.training.optimizer_key is None and len(converted.table.names()) == 21


def test_a_lightning_ckpt_with_drop_optimizer_is_what_save_weights_only_writes(tmp_path):
    out = tmp_path / "weights.ckpt"
    ok(run_cli("fuse", TRAINING / "lightning.ckpt", *RULES, "--drop-optimizer", "-o", out))
    original = fusectl.open_checkpoint(str(TRAINING / "lightning.ckpt")).training.tree()
    kept = fusectl.open_checkpoint(str(out)).training.tree()
    assert list(kept) == [k for k in original if k not in ("optimizer_states", "lr_schedulers")]
    assert len(kept["state_dict"]) == 15
    for key in ("epoch", "global_step", "loops", "callbacks"):
        assert kept[key] == original[key], key


def test_a_trainer_folder_with_drop_optimizer_is_the_model_folder_without_the_runs_state(tmp_path):
    # without optimizer.pt, a Trainer resuming from the scheduler and trainer_state.json left
    # beside the model would go on with a fresh optimizer and say nothing: none of them is written
    source = TRAINING / "trainer" / "checkpoint-2"
    out = tmp_path / "model"
    result = ok(run_cli("fuse", source, *RULES, "--drop-optimizer", "-o", out, "--json"))
    assert json.loads(result.stdout)["optimizer"]["state"] == "dropped"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert (out / "generation_config.json").read_bytes() == (source / "generation_config.json").read_bytes()
    fused = fusectl.open_checkpoint(str(out))
    assert fused.training is None and "model.layers.0.self_attn.qkv_proj.weight" in fused.table


@pytest.mark.parametrize("name", ["llama-adamw.pt", "llama-sgd.pt", "lightning.ckpt"])
def test_fuse_then_unfuse_with_rules_gives_back_the_optimizer_bitwise(tmp_path, name):
    suffix = name.rsplit(".", 1)[1]
    fused, back = tmp_path / f"fused.{suffix}", tmp_path / f"back.{suffix}"
    ok(run_cli("fuse", TRAINING / name, *RULES, "-o", fused))
    result = ok(run_cli("unfuse", fused, *RULES, *CONFIG, "-o", back, "--json"))
    assert result.json()["tensors"] == 21 and result.json()["optimizer"]["state"] == "moved"
    original, restored = fusectl.open_checkpoint(str(TRAINING / name)), fusectl.open_checkpoint(str(back))
    assert restored.training.optimizer_key == original.training.optimizer_key
    assert tree_differences(original.training.tree(), restored.training.tree()) == []


def test_unfuse_with_rules_to_safetensors_still_holds_the_model_only(tmp_path):
    fused = tmp_path / "fused.pt"
    ok(run_cli("fuse", TRAINING / "llama-adamw.pt", *RULES, "-o", fused))
    result = ok(run_cli("unfuse", fused, *RULES, *CONFIG, "-o", tmp_path / "back.safetensors"))
    assert "optimizer state (optimizer_state_dict) is not written" in result.stderr
    assert fusectl.open_checkpoint(str(tmp_path / "back.safetensors")).training is None
