"""Hugging Face Trainer folders (``checkpoint-N/``) read, fused and unfused whole (issue 20).

fixtures/training/trainer/checkpoint-2/ is a real ``transformers.Trainer`` checkpoint of a tiny
LlamaForCausalLM (fixtures/generate_training.py): model.safetensors, config.json, optimizer.pt
(AdamW in Trainer's decay / no-decay groups, 16 + 5 ids), scheduler.pt, rng_state.pth,
trainer_state.json, training_args.bin, generation_config.json. The safetensors header keeps no
parameter order, so the optimizer is mapped with ``--param-order`` (the Llama's
``named_parameters()`` order, written out below) and refused without it. A fuse to a folder
writes the fused model, optimizer.pt with its state moved and every other file byte for byte;
unfuse gives the folder back (the model's tensors and optimizer.pt's tree bitwise, optimizer.pt's
records all equal but torch.save's random serialization id). With torch and transformers
(skipped without; run by hand with ``/work/venv-gen/bin/python -m pytest``), the folder
converted to the Phi-3 layout resumes with ``Trainer.train(resume_from_checkpoint=...)`` on
Phi3ForCausalLM and logs the losses of the Llama run resumed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import zipfile

import numpy as np
import pytest

import fusectl
from conftest import FIXTURES, ok, run_cli, snapshot
from fusectl.io.formats.torch_file import read_torch_tree
from test_training_output import PARTS, _differences, phi3_order

CHECKPOINT = FIXTURES / "training" / "trainer" / "checkpoint-2"
RULES = ["-r", "llama-qkv", "-r", "llama-gate-up"]
OTHER_FILES = ["config.json", "generation_config.json", "rng_state.pth", "scheduler.pt", "trainer_state.json",
               "training_args.bin"]
# the [config] edits that make the fused Llama's config.json a Phi-3 one (what
# fixtures/resume_training.phi3_config builds: Phi-3's rope over the whole head, no dropout)
PHI3_CONFIG = """version = 1
description = "config.json of a Llama fused with llama-qkv and llama-gate-up, as Phi-3's"

[config]
set = { architectures = ["Phi3ForCausalLM"], model_type = "phi3", original_max_position_embeddings = 64, resid_pdrop = 0.0, embd_pdrop = 0.0, rope_parameters = { rope_type = "default", rope_theta = 10000.0, partial_rotary_factor = 1.0 } }
remove = ["attention_bias", "mlp_bias", "pretraining_tp", "head_dim"]
"""


def llama_order() -> list[str]:
    """LlamaForCausalLM's ``named_parameters()`` order for the fixture (2 layers, untied)."""
    names = ["model.embed_tokens.weight"]
    for layer in (0, 1):
        p = f"model.layers.{layer}."
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    return names + ["model.norm.weight", "lm_head.weight"]


@pytest.fixture
def orders(tmp_path):
    """(the Llama order file, the Phi-3 order file), outside every output."""
    folder = tmp_path / "orders"
    folder.mkdir()
    llama, phi3 = folder / "llama.json", folder / "phi3.json"
    llama.write_text(json.dumps(llama_order()))
    phi3.write_text(json.dumps(phi3_order()))
    return llama, phi3


def _fuse(tmp_path, orders, *extra, name="fused"):
    out = tmp_path / name
    ok(run_cli("fuse", CHECKPOINT, *RULES, "--param-order", orders[0], "-o", out, *extra))
    return out


def _mapped(path, **kwargs):
    checkpoint = fusectl.open_checkpoint(str(path), **kwargs)
    state, mapping = checkpoint.optimizer_mapped
    return checkpoint, state, mapping


def _state(state, mapping, name, key):
    pid = next(p for p, n in mapping.names.items() if n == name)
    return state.states[pid][key]


# ------------------------------------------------------------------------------------- reading


def test_the_folder_reads_as_its_safetensors_model_with_the_trainer_files_as_companions():
    checkpoint = fusectl.open_checkpoint(str(CHECKPOINT))
    assert checkpoint.format == "safetensors" and checkpoint.files == [str(CHECKPOINT / "model.safetensors")]
    assert [c.relative for c in checkpoint.companions] == OTHER_FILES  # optimizer.pt is the optimizer
    assert checkpoint.training.optimizer_key == "optimizer.pt"
    assert str(CHECKPOINT / "optimizer.pt") in checkpoint.input_paths()
    state = checkpoint.optimizer
    assert [len(g.params) for g in state.groups] == [16, 5]
    assert [g.hyper["weight_decay"] for g in state.groups] == [0.1, 0.0]
    assert sorted(state.keys()) == ["exp_avg", "exp_avg_sq", "step"]


def test_inspect_shows_the_optimizer_and_how_to_give_its_order():
    result = ok(run_cli("inspect", CHECKPOINT, "--json"))
    optimizer = result.json()["optimizer"]
    assert optimizer["where"] == "optimizer.pt" and optimizer["kind"] == "Adam/AdamW" and optimizer["exact"]
    assert [g["params"] for g in optimizer["groups"]] == [16, 5]
    assert "--param-order FILE" in optimizer["problem"] and "--param-order-from-model" in optimizer["problem"]


def test_param_order_maps_every_state_to_its_parameter_by_the_given_order(orders):
    checkpoint, state, mapping = _mapped(CHECKPOINT, param_order=str(orders[0]))
    assert mapping.source == str(orders[0])
    decay = [n for n in llama_order() if "norm" not in n]
    assert [mapping.names[p] for p in state.groups[0].params] == decay
    assert [mapping.names[p] for p in state.groups[1].params] == [n for n in llama_order() if "norm" in n]
    for pid, name in mapping.names.items():
        assert state.states[pid]["exp_avg"].spec.shape == checkpoint.table[name].spec.shape


@pytest.mark.parametrize("command", ["fuse", "plan"])
def test_without_the_order_the_shapes_do_not_prove_it_exit_2_and_nothing_written(tmp_path, command):
    before = snapshot(tmp_path)
    out = ["-o", tmp_path / "out"] if command == "fuse" else []
    result = run_cli(command, CHECKPOINT, *RULES, *out)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and "Traceback" not in result.output
    assert "optimizer.pt" in result.stderr and "--param-order FILE" in result.stderr
    assert "--param-order-from-model" in result.stderr
    assert snapshot(tmp_path) == before


def test_training_args_bin_is_never_unpickled_only_copied(tmp_path, orders):
    # a pickle that would run a command if anything unpickled it (or that the allow-list refuses)
    folder = tmp_path / "checkpoint-2"
    shutil.copytree(CHECKPOINT, folder)
    marker = tmp_path / "ran"

    class Hostile:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (folder / "training_args.bin").write_bytes(pickle.dumps(Hostile()))
    ok(run_cli("inspect", folder, "--param-order", orders[0]))
    out = tmp_path / "out"
    ok(run_cli("fuse", folder, *RULES, "--param-order", orders[0], "-o", out))
    assert (out / "training_args.bin").read_bytes() == (folder / "training_args.bin").read_bytes()
    assert not marker.exists()


def test_a_pytorch_model_bin_folder_is_mapped_by_its_state_dict_order(tmp_path):
    # the Trainer's own .pt/.pth/.bin files are never taken for the model's weights
    from fusectl.io.formats.torch_writer import write_torch_file
    import collections
    folder = tmp_path / "checkpoint-2"
    shutil.copytree(CHECKPOINT, folder)
    table = fusectl.open_checkpoint(str(CHECKPOINT)).table
    (folder / "model.safetensors").unlink()
    write_torch_file(str(folder / "pytorch_model.bin"),
                     collections.OrderedDict((n, table[n]) for n in llama_order()))
    checkpoint, state, mapping = _mapped(folder)
    assert checkpoint.format == "pytorch" and mapping.source == "state dict order"
    assert [mapping.names[p] for p in state.groups[0].params] == [n for n in llama_order() if "norm" not in n]
    out = tmp_path / "out"
    ok(run_cli("fuse", folder, *RULES, "-o", out))
    assert sorted(os.listdir(out)) == sorted(["model.safetensors", "optimizer.pt", *OTHER_FILES])


# ------------------------------------------------------------------------------------- writing


def test_the_output_folder_holds_the_fused_model_optimizer_pt_and_every_other_file_byte_for_byte(tmp_path, orders):
    before = snapshot(CHECKPOINT)
    out = _fuse(tmp_path, orders)
    assert sorted(os.listdir(out)) == sorted(["model.safetensors", "optimizer.pt", *OTHER_FILES])
    for name in OTHER_FILES:
        assert (out / name).read_bytes() == (CHECKPOINT / name).read_bytes(), name
    model = fusectl.open_checkpoint(str(out / "model.safetensors"))
    assert len(model.table.names()) == 15 and model.provenance is not None
    assert snapshot(CHECKPOINT) == before


def test_the_output_optimizer_pt_is_the_moved_state_in_trainers_groups(tmp_path, orders):
    out = _fuse(tmp_path, orders)
    tree, record = read_torch_tree(str(out / "optimizer.pt"))
    assert list(tree) == ["state", "param_groups"]
    assert [g["params"] for g in tree["param_groups"]] == [list(range(10)), list(range(10, 15))]
    original, _ = read_torch_tree(str(CHECKPOINT / "optimizer.pt"))
    assert [{k: v for k, v in g.items() if k != "params"} for g in tree["param_groups"]] == \
        [{k: v for k, v in g.items() if k != "params"} for g in original["param_groups"]]
    names = json.loads(record["fusectl.param_names"])
    assert json.loads(record["fusectl.original_param_order"]) == llama_order()
    # the default order: the input's, each fused parameter where its first part was
    assert names[:4] == ["model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight",
                         "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"]
    _, old, old_map = _mapped(CHECKPOINT, param_order=str(orders[0]))
    _, new, new_map = _mapped(out)
    assert new_map.source == "fusectl's record in optimizer.pt"
    assert [new_map.names[p] for p in new.ids()] == names
    for layer in (0, 1):
        for fused, parts in PARTS.items():
            name = f"model.layers.{layer}.{fused}"
            for key in ("exp_avg", "exp_avg_sq"):
                expected = np.concatenate([_state(old, old_map, f"model.layers.{layer}.{p}", key).read()
                                           for p in parts])
                assert _state(new, new_map, name, key).read().tobytes() == expected.tobytes(), (name, key)
            first = f"model.layers.{layer}.{parts[0]}"
            assert _state(new, new_map, name, "step").read() == _state(old, old_map, first, "step").read()


def test_param_order_out_numbers_each_group_in_phi3s_order(tmp_path, orders):
    out = _fuse(tmp_path, orders, "--param-order-out", orders[1])
    _, state, mapping = _mapped(out)
    assert [mapping.names[p] for p in state.groups[0].params] == [n for n in phi3_order() if "norm" not in n]
    assert [mapping.names[p] for p in state.groups[1].params] == [n for n in phi3_order() if "norm" in n]


def test_config_edits_write_the_phi3_config_and_a_note_asks_for_the_new_order(tmp_path, orders):
    rules = tmp_path / "phi3-config.toml"
    rules.write_text(PHI3_CONFIG)
    out = tmp_path / "phi3"
    result = ok(run_cli("fuse", CHECKPOINT, *RULES, "-r", rules, "--param-order", orders[0], "-o", out))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Phi3ForCausalLM"] and config["model_type"] == "phi3"
    assert "head_dim" not in config
    assert "--param-order-out FILE or --param-order-from-model" in result.stderr
    quiet = ok(run_cli("fuse", CHECKPOINT, *RULES, "-r", rules, "--param-order", orders[0], "-o", tmp_path / "p2",
                       "--param-order-out", orders[1]))
    assert "--param-order-out" not in quiet.stderr


def test_a_bad_output_order_is_exit_2_and_nothing_written(tmp_path, orders):
    bad = tmp_path / "orders" / "short.json"
    bad.write_text(json.dumps(phi3_order()[:-1]))
    before = snapshot(tmp_path)
    result = run_cli("fuse", CHECKPOINT, *RULES, "--param-order", orders[0], "-o", tmp_path / "out",
                     "--param-order-out", bad)
    assert result.exit_code == 2 and "'lm_head.weight' is not listed" in result.stderr
    assert snapshot(tmp_path) == before


def test_a_failure_while_writing_optimizer_pt_leaves_nothing(tmp_path, orders, monkeypatch):
    import fusectl.io.formats.torch_writer as torch_writer

    def fail(path, root, **kwargs):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(5, "Input/output error", path)

    monkeypatch.setattr(torch_writer, "write_torch_file", fail)
    before = snapshot(tmp_path)
    result = run_cli("fuse", CHECKPOINT, *RULES, "--param-order", orders[0], "-o", tmp_path / "out")
    assert result.exit_code == 2 and "Input/output error" in result.stderr
    assert snapshot(tmp_path) == before


def test_a_single_file_output_holds_the_model_only_with_the_note(tmp_path, orders):
    result = ok(run_cli("fuse", CHECKPOINT, *RULES, "--param-order", orders[0], "-o", tmp_path / "m.safetensors"))
    assert "optimizer state (optimizer.pt) is not written" in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors", "orders"]


def test_convert_to_a_folder_copies_optimizer_pt_as_it_is(tmp_path):
    out = tmp_path / "out"
    result = ok(run_cli("convert", CHECKPOINT, "-o", out))
    assert "not written" not in result.stderr
    for name in ["optimizer.pt", *OTHER_FILES]:
        assert (out / name).read_bytes() == (CHECKPOINT / name).read_bytes(), name


def test_an_edited_record_is_refused_naming_the_file(tmp_path, orders):
    out = _fuse(tmp_path, orders)
    from fusectl.io.formats.torch_writer import write_torch_file
    tree, record = read_torch_tree(str(out / "optimizer.pt"))
    record["fusectl.param_names"] = json.dumps(json.loads(record["fusectl.param_names"])[:-1])
    write_torch_file(str(tmp_path / "edited.pt"), tree, metadata=record)
    os.replace(tmp_path / "edited.pt", out / "optimizer.pt")
    result = run_cli("unfuse", out, "-o", tmp_path / "back")
    assert result.exit_code == 2 and "fusectl's record names 14 parameters" in result.stderr
    assert not (tmp_path / "back").exists()


# ------------------------------------------------------------------------------------- unfuse


def _optimizer_records(path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


@pytest.mark.parametrize("out_order", [None, "phi3"])
def test_unfuse_gives_the_folder_back_model_and_optimizer_bitwise(tmp_path, orders, out_order):
    extra = ["--param-order-out", orders[1]] if out_order else []
    fused = _fuse(tmp_path, orders, *extra)
    back = tmp_path / "back"
    result = ok(run_cli("unfuse", fused, "-o", back, "--json"))
    assert result.json()["tensors"] == 21 and "not written" not in result.stderr
    assert sorted(os.listdir(back)) == sorted(os.listdir(CHECKPOINT))
    for name in OTHER_FILES:
        assert (back / name).read_bytes() == (CHECKPOINT / name).read_bytes(), name
    original, restored = fusectl.open_checkpoint(str(CHECKPOINT)), fusectl.open_checkpoint(str(back))
    assert sorted(restored.table.names()) == sorted(original.table.names())
    for name in original.table.names():
        assert restored.table[name].read().tobytes() == original.table[name].read().tobytes(), name
    # optimizer.pt: the same tree, in the original order whatever order the fuse wrote
    assert _differences(read_torch_tree(str(CHECKPOINT / "optimizer.pt"))[0],
                        read_torch_tree(str(back / "optimizer.pt"))[0]) == []
    records, ours = _optimizer_records(CHECKPOINT / "optimizer.pt"), _optimizer_records(back / "optimizer.pt")
    assert set(ours) - set(records) == {"optimizer/fusectl_metadata.json"}
    assert [n for n in records if records[n] != ours[n]] == ["optimizer/.data/serialization_id"]


def test_a_fused_folder_whose_optimizer_lost_the_record_unfuses_with_param_order(tmp_path, orders):
    # the Trainer saved optimizer.pt again (training on): fusectl's record is gone (issue 28)
    fused = _fuse(tmp_path, orders)
    from fusectl.io.formats.torch_writer import write_torch_file
    tree, _ = read_torch_tree(str(fused / "optimizer.pt"))
    write_torch_file(str(tmp_path / "resaved.pt"), tree)
    os.replace(tmp_path / "resaved.pt", fused / "optimizer.pt")
    back = tmp_path / "back"
    result = run_cli("unfuse", fused, "-o", back)
    assert result.exit_code == 2 and "--param-order FILE" in result.stderr and not back.exists()
    assert "--param-order-from-model" not in result.stderr  # unfuse has no such option
    fused_order = tmp_path / "orders" / "fused.json"
    names = [n.replace("q_proj", "qkv_proj").replace("gate_proj", "gate_up_proj") for n in llama_order()
             if not any(p in n for p in ("k_proj", "v_proj", "up_proj")) or "gate_up" in n]
    fused_order.write_text(json.dumps(names))
    ok(run_cli("unfuse", fused, "--param-order", fused_order, "-o", back))
    # each part where its fused parameter was: the Llama's order again
    assert _differences(read_torch_tree(str(CHECKPOINT / "optimizer.pt"))[0],
                        read_torch_tree(str(back / "optimizer.pt"))[0]) == []


# ------------------------------------------------------------------------------ torch + transformers


def _resume_training():
    spec = importlib.util.spec_from_file_location("resume_training", FIXTURES / "resume_training.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_phi3_folder_resumes_with_trainer_and_logs_the_llama_runs_losses(tmp_path, orders):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    rt = _resume_training()
    rules = tmp_path / "phi3-config.toml"
    rules.write_text(PHI3_CONFIG)
    out = tmp_path / "phi3" / "checkpoint-2"
    out.parent.mkdir()
    # both orders from the models' code: the Llama's from config.json, Phi-3's from the edited one
    ok(run_cli("fuse", CHECKPOINT, *RULES, "-r", rules, "--param-order-from-model", "-o", out))
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(out))
    assert type(model).__name__ == "Phi3ForCausalLM"
    phi3 = rt.trainer_resume(out, model, tmp_path / "run-phi3")
    llama = rt.trainer_resume(CHECKPOINT, transformers.LlamaForCausalLM(rt.llama_config()), tmp_path / "run-llama")
    ref = json.loads((FIXTURES / "reference" / "trainer-losses.json").read_text())
    assert sorted(phi3) == sorted(llama) == ref["resumed_steps"] == [3, 4, 5]
    assert max(abs(phi3[s] - llama[s]) for s in llama) <= 1e-5
    assert max(abs(phi3[s] - r) for s, r in zip(ref["resumed_steps"], ref["losses"]["resumed"])) <= 1e-5
    # the order matters: the ids in the Llama's order do not load into Phi-3's optimizer
    wrong = tmp_path / "wrong" / "checkpoint-2"
    wrong.parent.mkdir()
    ok(run_cli("fuse", CHECKPOINT, *RULES, "-r", rules, "--param-order", orders[0], "-o", wrong))
    with pytest.raises(RuntimeError):
        rt.trainer_resume(wrong, transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(wrong)), tmp_path / "run-wrong")


def _torch_missing() -> bool:
    return importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None


@pytest.mark.skipif(not _torch_missing(), reason="torch and transformers are installed")
def test_param_order_from_model_without_torch_is_exit_2_saying_what_is_missing(tmp_path):
    before = snapshot(tmp_path)
    result = run_cli("fuse", CHECKPOINT, *RULES, "--param-order-from-model", "-o", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert "--param-order-from-model needs torch and transformers" in result.stderr
    assert "--param-order FILE" in result.stderr
    assert snapshot(tmp_path) == before


def test_the_order_from_the_models_code_is_the_llamas_named_parameters():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from fusectl.errors import CheckpointError
    from fusectl.io.model_order import order_from_model
    config = json.loads((CHECKPOINT / "config.json").read_text())
    held = [t.spec.shape for t in fusectl.open_checkpoint(str(CHECKPOINT)).table.entries.values()]
    assert order_from_model(config, "config.json", held) == llama_order()
    _, state, mapping = _mapped(CHECKPOINT, param_order_from_model=True)
    assert mapping.source.endswith("(the model's code)")
    assert [mapping.names[p] for p in state.groups[0].params] == [n for n in llama_order() if "norm" not in n]
    for bad, said in ((dict(config, architectures=["NoSuchForCausalLM"]), "has no model class"),
                      (dict(config, architectures=["os.system"]), "has no model class"),
                      ({k: v for k, v in config.items() if k != "model_type"}, "no 'architectures' and 'model_type'")):
        with pytest.raises(CheckpointError, match=said):
            order_from_model(bad, "config.json", held)


def test_plan_lists_the_state_steps_under_their_parameters(orders):
    planned = ok(run_cli("plan", CHECKPOINT, *RULES, "--param-order", orders[0], "--json")).json()
    outputs = [o for g in planned["groups"] for s in g["steps"] for o in s["outputs"]]
    assert "model.layers.0.self_attn.qkv_proj.weight::exp_avg" in outputs
    assert "model.layers.1.mlp.gate_up_proj.weight::exp_avg_sq" in outputs


def test_an_adapters_trainer_folder_fuses_its_adapter_as_before(tmp_path):
    # a PEFT adapter's optimizer.pt holds the adapter's state: not mapped (yet), never copied stale
    folder = tmp_path / "checkpoint-2"
    shutil.copytree(FIXTURES / "lora" / "llama-lora", folder)
    for name in ("optimizer.pt", "scheduler.pt", "trainer_state.json"):
        shutil.copy2(CHECKPOINT / name, folder / name)
    out = tmp_path / "out"
    ok(run_cli("fuse", folder, *RULES, "--config", FIXTURES / "lora" / "llama-base" / "config.json", "-o", out))
    assert "optimizer.pt" not in os.listdir(out) and "adapter_model.safetensors" in os.listdir(out)
    assert (out / "scheduler.pt").read_bytes() == (CHECKPOINT / "scheduler.pt").read_bytes()
