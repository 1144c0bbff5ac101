"""``fuse`` of a training dict to a PyTorch file writes the whole training dict (issue 20).

fixtures/training/llama-adamw.pt and llama-sgd.pt fused with llama-qkv and llama-gate-up to
``.pt``: the model tensors are a safetensors fuse's, each fused state tensor is the concat of its
parts' states (bitwise), ``step`` is kept once, the param groups shrink from 16 + 5 ids to 10 + 5
with their hyperparameters, the other entries are kept. With torch and transformers (skipped
without; run by hand with ``/work/venv-gen/bin/python -m pytest``), the file fused in Phi-3's
parameter order resumes on ``Phi3ForCausalLM`` with the losses of the unfused resumed run.
``unfuse`` of each fused file (and of lightning.ckpt's) gives back the original training dict,
every tensor bitwise and every dict in its order.
"""

from __future__ import annotations

import collections
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import fusectl
from conftest import FIXTURES, ok, refused, run_cli, snapshot, write_rules
from fusectl.dtypes import BY_NAME
from fusectl.io.formats.torch_writer import write_torch_file
from fusectl.tensors import ArrayTensor, LazyTensor, TensorSpec

TRAINING = FIXTURES / "training"
TORCH = FIXTURES / "torch"
RULES = ["-r", "llama-qkv", "-r", "llama-gate-up"]
PARTS = {"self_attn.qkv_proj.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
         "mlp.gate_up_proj.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"]}


def array(values) -> ArrayTensor:
    values = np.asarray(values, np.float32)
    return ArrayTensor(TensorSpec(BY_NAME["F32"], values.shape), values)


def phi3_order() -> list[str]:
    """Phi-3's ``named_parameters()`` order (fixtures/README.md, "Training checkpoints")."""
    names = ["model.embed_tokens.weight"]
    for layer in (0, 1):
        p = f"model.layers.{layer}."
        names += [p + "self_attn.o_proj.weight", p + "self_attn.qkv_proj.weight", p + "mlp.gate_up_proj.weight",
                  p + "mlp.down_proj.weight", p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    return names + ["model.norm.weight", "lm_head.weight"]


def _fuse(tmp_path, kind="adamw", *extra):
    out = tmp_path / f"{kind}.pt"
    ok(run_cli("fuse", TRAINING / f"llama-{kind}.pt", *RULES, "-o", out, *extra))
    return out


def _optimizer(path):
    checkpoint = fusectl.open_checkpoint(str(path))
    state, mapping = checkpoint.optimizer_mapped
    return checkpoint, state, mapping


def _state(state, mapping, name, key):
    pid = next(p for p, n in mapping.names.items() if n == name)
    return state.states[pid][key]


def test_the_model_tensors_equal_a_safetensors_fuse(tmp_path):
    out = _fuse(tmp_path)
    ok(run_cli("fuse", TRAINING / "llama-adamw.pt", *RULES, "-o", tmp_path / "model.safetensors"))
    written = fusectl.open_checkpoint(str(out))
    reference = fusectl.open_checkpoint(str(tmp_path / "model.safetensors"))
    assert written.state_dict_key == "model_state_dict"
    assert sorted(written.table.names()) == sorted(reference.table.names())
    assert len(written.table.names()) == 15
    for name in reference.table.names():
        assert np.array_equal(written.table[name].read(), reference.table[name].read()), name
    assert written.provenance is not None and len(written.provenance.plan.groups) == 2


def test_the_provenance_records_the_models_steps_so_verify_and_unfuse_work(tmp_path):
    out = tmp_path / "fused.pt"
    fused = ok(run_cli("fuse", TRAINING / "llama-adamw.pt", *RULES, "-o", out, "--json")).json()
    alone = ok(run_cli("fuse", TRAINING / "llama-adamw.pt", *RULES, "-o", tmp_path / "m.safetensors",
                       "--json")).json()
    assert fused["steps"] == alone["steps"] == 4 and fused["ties"] == []
    assert fused["unique_bytes"] == alone["unique_bytes"] and fused["written_bytes"] > alone["written_bytes"]
    steps = fusectl.open_checkpoint(str(out)).provenance.plan.steps
    assert not any("::" in n for s in steps for n in (*s.inputs, *s.outputs))
    ok(run_cli("verify", TRAINING / "llama-adamw.pt", out))
    ok(run_cli("unfuse", out, "-o", tmp_path / "restored.safetensors"))
    restored = fusectl.open_checkpoint(str(tmp_path / "restored.safetensors"))
    original = fusectl.open_checkpoint(str(TRAINING / "llama-adamw.pt"))
    assert sorted(restored.table.names()) == sorted(original.table.names())
    for name in original.table.names():
        assert restored.table[name].read().tobytes() == original.table[name].read().tobytes(), name


@pytest.mark.parametrize("kind,keys", [("adamw", ["exp_avg", "exp_avg_sq"]), ("sgd", ["momentum_buffer"])])
def test_each_fused_state_is_the_concat_of_its_parts_states_and_step_is_kept_once(tmp_path, kind, keys):
    out = _fuse(tmp_path, kind)
    before, old, old_map = _optimizer(TRAINING / f"llama-{kind}.pt")
    _, new, new_map = _optimizer(out)
    assert new_map.source == f"fusectl's record in {out.name}"  # the parameter of each id, recorded
    for layer in (0, 1):
        for fused, parts in PARTS.items():
            name = f"model.layers.{layer}.{fused}"
            for key in keys:
                expected = np.concatenate([_state(old, old_map, f"model.layers.{layer}.{p}", key).read()
                                           for p in parts])
                got = _state(new, new_map, name, key).read()
                assert got.tobytes() == expected.tobytes(), (name, key)
            pid = next(p for p, n in new_map.names.items() if n == name)
            assert sorted(new.states[pid]) == sorted(old.states[0])
            if kind == "adamw":
                step = new.states[pid]["step"]
                assert step.spec.shape == () and step.read() == old.states[0]["step"].read()
    # an unfused parameter's state is its own, bitwise
    name = "model.layers.1.mlp.down_proj.weight"
    assert _state(new, new_map, name, keys[0]).read().tobytes() == \
        _state(old, old_map, name, keys[0]).read().tobytes()


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_param_groups_shrink_to_10_and_5_ids_with_their_hyperparameters_and_the_rest_is_kept(tmp_path, kind):
    out = _fuse(tmp_path, kind)
    before, old, _ = _optimizer(TRAINING / f"llama-{kind}.pt")
    after, new, _ = _optimizer(out)
    assert [len(g.params) for g in old.groups] == [16, 5]
    assert [list(g.params) for g in new.groups] == [list(range(10)), list(range(10, 15))]
    assert [g.hyper for g in new.groups] == [g.hyper for g in old.groups]
    assert sorted(new.states) == list(range(15))
    old_tree, new_tree = before.training.tree(), after.training.tree()
    assert list(new_tree) == list(old_tree) == ["model_state_dict", "optimizer_state_dict", "epoch", "step"]
    assert (new_tree["epoch"], new_tree["step"]) == (old_tree["epoch"], old_tree["step"]) == (1, 3)


def test_the_default_order_puts_a_fused_parameter_where_its_first_part_was(tmp_path):
    _, new, mapping = _optimizer(_fuse(tmp_path))
    names = [mapping.names[p] for p in new.groups[0].params]
    assert names[:5] == ["model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight",
                         "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
                         "model.layers.0.mlp.down_proj.weight"]


def test_param_order_out_numbers_each_group_in_the_given_order(tmp_path):
    order = tmp_path / "order.json"
    order.write_text(json.dumps(phi3_order()))
    out = tmp_path / "phi3.pt"
    report = fusectl.fuse(str(TRAINING / "llama-adamw.pt"), ["llama-qkv", "llama-gate-up"], str(out),
                          param_order_out=str(order))
    assert report.tensors == 15
    checkpoint, new, mapping = _optimizer(out)
    # the state dict is in the given order too, so the shapes prove the ids read back
    assert list(checkpoint.training.tree()["model_state_dict"]) == phi3_order()
    expected = [n for n in phi3_order() if "norm" not in n]
    assert [mapping.names[p] for p in new.groups[0].params] == expected
    assert [mapping.names[p] for p in new.groups[1].params] == [n for n in phi3_order() if "norm" in n]


def test_param_order_out_missing_a_parameter_is_exit_2_naming_it_and_nothing_written(tmp_path):
    order = tmp_path / "order.json"
    order.write_text(json.dumps([n for n in phi3_order() if n != "model.layers.1.mlp.gate_up_proj.weight"]))
    before = snapshot(tmp_path)
    result = run_cli("fuse", TRAINING / "llama-adamw.pt", *RULES, "-o", tmp_path / "out.pt",
                     "--param-order-out", order)
    assert result.exit_code == 2, result.output
    assert "'model.layers.1.mlp.gate_up_proj.weight' is not listed" in result.stderr
    assert "--param-order-out" in result.stderr
    assert snapshot(tmp_path) == before


def test_param_order_out_naming_a_tensor_the_fused_model_lacks_is_exit_2(tmp_path):
    order = tmp_path / "order.json"
    order.write_text(json.dumps(phi3_order() + ["model.layers.0.self_attn.q_proj.weight"]))
    result = run_cli("fuse", TRAINING / "llama-adamw.pt", *RULES, "-o", tmp_path / "out.pt",
                     "--param-order-out", order)
    assert result.exit_code == 2 and "'model.layers.0.self_attn.q_proj.weight' is not a tensor" in result.stderr
    assert not (tmp_path / "out.pt").exists()


def test_param_order_out_for_an_output_that_holds_the_model_only_is_exit_2(tmp_path):
    order = tmp_path / "order.json"
    order.write_text(json.dumps(phi3_order()))
    result = run_cli("fuse", TRAINING / "llama-adamw.pt", *RULES, "-o", tmp_path / "out.safetensors",
                     "--param-order-out", order)
    assert result.exit_code == 2 and "--param-order-out" in result.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_a_fold_on_a_training_dict_to_pt_is_exit_2_and_nothing_written(tmp_path):
    torch_dir = FIXTURES / "torch"
    table = fusectl.open_checkpoint(str(torch_dir / "training.pt")).table
    order = tmp_path / "order.json"
    order.write_text(json.dumps([n for n in table.entries if "running_" not in n and "num_batches" not in n]))
    before = snapshot(tmp_path)
    result = run_cli("fuse", torch_dir / "training.pt", "-r", "conv-bn-fold", "--param-order", order,
                     "-o", tmp_path / "out.pt")
    assert result.exit_code == 2, result.output
    assert "optimizer state" in result.stderr and "bn_fold computes" in result.stderr
    assert snapshot(tmp_path) == before


def test_a_safetensors_output_still_holds_the_model_only_with_the_note(tmp_path):
    result = ok(run_cli("fuse", TRAINING / "llama-adamw.pt", *RULES, "-o", tmp_path / "m.safetensors"))
    assert "optimizer state (optimizer_state_dict) is not written" in result.stderr


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_the_fused_training_dict_resumes_on_phi3_with_the_unfused_runs_losses(tmp_path, kind):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("resume_training", FIXTURES / "resume_training.py")
    resume_training = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(resume_training)
    order = tmp_path / "order.json"
    order.write_text(json.dumps(phi3_order()))
    out = _fuse(tmp_path, kind, "--param-order-out", order)
    ref = json.loads((FIXTURES / "reference" / f"training-{kind}.json").read_text())
    got = resume_training.resume(out, FIXTURES / ref["config"])
    assert got["arch"] == "phi3" and got["optimizer"] == kind
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]["resumed"])) <= 1e-6


def test_a_lightning_ckpt_is_written_whole_with_its_one_optimizer_moved(tmp_path):
    out = tmp_path / "fused.ckpt"
    ok(run_cli("fuse", TRAINING / "lightning.ckpt", *RULES, "-o", out))
    before, after = fusectl.open_checkpoint(str(TRAINING / "lightning.ckpt")), fusectl.open_checkpoint(str(out))
    assert after.training.optimizer_key == "optimizer_states.0"
    assert [len(g.params) for g in after.optimizer.groups] == [10, 5]
    old_tree, new_tree = before.training.tree(), after.training.tree()
    assert list(new_tree) == list(old_tree)
    for key in ("epoch", "global_step", "pytorch-lightning_version", "loops", "callbacks", "lr_schedulers"):
        assert new_tree[key] == old_tree[key], key


def _differences(a, b, where="") -> list[str]:
    """Where two training trees (``Checkpoint.training.tree()``) differ: a tensor's dtype, shape
    or bytes, a dict's keys or their order, a list's length, any other value."""
    if isinstance(a, LazyTensor) or isinstance(b, LazyTensor):
        if not (isinstance(a, LazyTensor) and isinstance(b, LazyTensor)):
            return [f"{where}: a tensor and {type(b if isinstance(a, LazyTensor) else a).__name__}"]
        if (a.spec.dtype, tuple(a.spec.shape)) != (b.spec.dtype, tuple(b.spec.shape)):
            return [f"{where}: {a.spec} != {b.spec}"]
        return [] if a.read().tobytes() == b.read().tobytes() else [f"{where}: other bytes"]
    if type(a) is not type(b):
        return [f"{where}: {type(a).__name__} != {type(b).__name__}"]
    if isinstance(a, dict):
        found = [] if list(a) == list(b) else [f"{where}: keys {list(a)} != {list(b)}"]
        return found + [d for k in a if k in b for d in _differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


@pytest.mark.parametrize("name", ["llama-adamw.pt", "llama-sgd.pt", "lightning.ckpt"])
def test_unfuse_of_a_fused_training_dict_gives_back_the_whole_training_dict_bitwise(tmp_path, name):
    # model, optimizer state and param groups, every other entry, and every dict's order
    suffix = name.rsplit(".", 1)[1]
    fused, back = tmp_path / f"fused.{suffix}", tmp_path / f"back.{suffix}"
    ok(run_cli("fuse", TRAINING / name, *RULES, "-o", fused))
    result = ok(run_cli("unfuse", fused, "-o", back, "--json"))
    assert result.json()["tensors"] == 21 and "is not written" not in result.stderr
    original, restored = fusectl.open_checkpoint(str(TRAINING / name)), fusectl.open_checkpoint(str(back))
    assert restored.training.optimizer_key == original.training.optimizer_key
    assert [g.params for g in restored.optimizer.groups] == [g.params for g in original.optimizer.groups]
    assert _differences(original.training.tree(), restored.training.tree()) == []
    assert list(restored.provenance.plan.steps) == []  # as for a model unfused: no steps recorded


def test_the_tree_comparison_sees_a_fused_training_dict_differ(tmp_path):
    out = _fuse(tmp_path)
    found = _differences(fusectl.open_checkpoint(str(TRAINING / "llama-adamw.pt")).training.tree(),
                         fusectl.open_checkpoint(str(out)).training.tree())
    assert any(d.startswith(".model_state_dict: keys") for d in found)
    assert any(d.startswith(".optimizer_state_dict.state.1.exp_avg: ") for d in found)


def test_unfuse_of_a_fused_training_dict_to_safetensors_still_holds_the_model_only(tmp_path):
    fused = _fuse(tmp_path)
    result = ok(run_cli("unfuse", fused, "-o", tmp_path / "back.safetensors"))
    assert "optimizer state (optimizer_state_dict) is not written" in result.stderr
    restored = fusectl.open_checkpoint(str(tmp_path / "back.safetensors"))
    assert restored.training is None and len(restored.table.names()) == 21


# --- an optimizer whose order the shapes do not prove (issue 28) ----------------------------------


def _crnn_order(tmp_path) -> Path:
    """fixtures/torch/training.pt's parameters in order, without its BatchNorm buffers (shaped like
    its biases, they keep the shapes from proving the order)."""
    table = fusectl.open_checkpoint(str(TORCH / "training.pt")).table
    order = tmp_path / "order.json"
    order.write_text(json.dumps([n for n in table.entries if "running_" not in n and "num_batches" not in n]))
    return order


def test_a_file_fused_with_param_order_unfuses_without_it_bitwise(tmp_path):
    from test_training_flags import RNN_BIAS

    fused, back = tmp_path / "fused.pt", tmp_path / "back.pt"
    rules = write_rules(tmp_path / "rnn.toml", RNN_BIAS)
    ok(run_cli("fuse", TORCH / "training.pt", "-r", rules, "--param-order", _crnn_order(tmp_path), "-o", fused))
    # the output records the parameter of each optimizer id: read back, it maps without help
    assert fusectl.open_checkpoint(str(fused)).optimizer_mapped[1].source == "fusectl's record in fused.pt"
    ok(run_cli("unfuse", fused, "-o", back))
    original = fusectl.open_checkpoint(str(TORCH / "training.pt"), param_order=str(_crnn_order(tmp_path)))
    assert _differences(original.training.tree(), fusectl.open_checkpoint(str(back)).training.tree()) == []


def test_a_fused_file_without_the_record_unfuses_with_param_order(tmp_path):
    from test_training_flags import RNN_BIAS, without_order_record

    fused, old, back = tmp_path / "fused.pt", tmp_path / "old.pt", tmp_path / "back.pt"
    rules = write_rules(tmp_path / "rnn.toml", RNN_BIAS)
    ok(run_cli("fuse", TORCH / "training.pt", "-r", rules, "--param-order", _crnn_order(tmp_path), "-o", fused))
    without_order_record(fused, old)  # as fusectl wrote it before it kept the record
    refused(run_cli("unfuse", old, "-o", back), "--param-order FILE", "--drop-optimizer", unwritten=[back])
    order = tmp_path / "fused-order.json"
    table = fusectl.open_checkpoint(str(old)).table
    order.write_text(json.dumps([n for n in table.entries if "running_" not in n and "num_batches" not in n]))
    ok(run_cli("unfuse", old, "--param-order", order, "-o", back))
    original = fusectl.open_checkpoint(str(TORCH / "training.pt"), param_order=str(_crnn_order(tmp_path)))
    assert _differences(original.training.tree(), fusectl.open_checkpoint(str(back)).training.tree()) == []
    report = fusectl.unfuse(str(old), str(tmp_path / "api.pt"), param_order=str(order))
    assert report.optimizer["state"] == "moved"


def test_the_optimizer_keeps_its_own_order_where_the_state_dict_has_another(tmp_path):
    # the optimizer was given b before a; the state dict holds a before b: each output id must stay
    # the state of the parameter load_state_dict pairs it with (the model's named_parameters())
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((4, 2)).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    model = collections.OrderedDict([("a.weight", array(a)), ("b.bias", array(b))])
    state = {0: {"step": 2.0, "exp_avg": array(b + 1), "exp_avg_sq": array(b * b)},
             1: {"step": 2.0, "exp_avg": array(a + 1), "exp_avg_sq": array(a * a)}}
    groups = [{"params": [0, 1], "lr": 0.1, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False}]
    src = tmp_path / "train.pt"
    write_torch_file(str(src), {"model": model, "optimizer": {"state": state, "param_groups": groups}})
    order = tmp_path / "order.json"
    order.write_text(json.dumps(["b.bias", "a.weight"]))
    rules = write_rules(tmp_path / "t.toml", 'version = 1\n[[rule]]\nop = "transpose"\ninput = "a.weight"\n'
                                              'output = "a.weight_t"\n')
    out = tmp_path / "out.pt"
    ok(run_cli("fuse", src, "-r", rules, "--param-order", order, "-o", out))
    written = fusectl.open_checkpoint(str(out))
    state, mapping = written.optimizer_mapped
    assert [mapping.names[p] for p in state.ids()] == ["b.bias", "a.weight_t"]
    assert list(written.table.entries) == ["a.weight_t", "b.bias"]  # the state dict keeps its own order
    assert np.array_equal(state.states[1]["exp_avg"].read(), (a + 1).T)
    ok(run_cli("unfuse", out, "-o", tmp_path / "back.pt"))
    assert _differences(fusectl.open_checkpoint(str(src)).training.tree(),
                        fusectl.open_checkpoint(str(tmp_path / "back.pt")).training.tree()) == []


def test_unfuse_puts_parts_fused_from_places_apart_back_in_the_optimizers_order(tmp_path):
    # w1 and w3 fused (a w1/w2/w3 MLP's gate and up), w2 between them in the optimizer: unfused,
    # each id must be its parameter's again; split in place, w3's state took id 1, w2's shape
    rng = np.random.default_rng(1)
    shapes = {"w1": (4, 3), "w2": (3, 4), "w3": (4, 3)}
    model = collections.OrderedDict((n, array(rng.standard_normal(s))) for n, s in shapes.items())
    state = {i: {"step": 3.0, "exp_avg": array(rng.standard_normal(s)), "exp_avg_sq": array(rng.random(s))}
             for i, s in enumerate(shapes.values())}
    groups = [{"params": [0, 1, 2], "lr": 0.1, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
               "amsgrad": False}]
    src, fused, back = tmp_path / "train.pt", tmp_path / "fused.pt", tmp_path / "back.pt"
    write_torch_file(str(src), {"model": model, "optimizer": {"state": state, "param_groups": groups}, "epoch": 4})
    rules = write_rules(tmp_path / "w13.toml", 'version = 1\n[[rule]]\nop = "concat"\ninputs = ["w1", "w3"]\n'
                                                'output = "w13"\n')
    ok(run_cli("fuse", src, "-r", rules, "-o", fused))
    ok(run_cli("unfuse", fused, "-o", back))
    restored = fusectl.open_checkpoint(str(back))
    state, mapping = restored.optimizer_mapped
    assert [mapping.names[p] for p in state.ids()] == ["w1", "w2", "w3"]
    assert _differences(fusectl.open_checkpoint(str(src)).training.tree(), restored.training.tree()) == []
