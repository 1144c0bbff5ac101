"""A rules file that does not fit a model says so before it asks the model's config for keys
(issue 18, item 13).

``fuse gpt2 -r llama-qkv`` used to fail on "var 'heads' needs config key
'num_attention_heads'": the vars were resolved when the rules loaded, before any name was
matched, hiding that the preset does not fit GPT-2 at all. Now a var whose config key is missing
is reported only when a rule that needs it binds; a rule whose patterns match nothing reports
that first, with the checkpoint's nearest names. Faults of the rules file itself (an undefined
var, a cycle) are still reported when it loads.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import FIXTURES, array_of, load_checkpoint_raw, ok, refused, write_rules, write_safetensors


@pytest.fixture
def gpt2(tmp_path):
    """A GPT-2-named tiny checkpoint (Conv1D c_attn [n_embd, 3 n_embd]) with GPT-2's config keys."""
    folder = tmp_path / "gpt2"
    folder.mkdir()
    tensors = {"wte.weight": np.zeros((16, 8), np.float32), "wpe.weight": np.zeros((4, 8), np.float32)}
    for i in range(2):
        tensors[f"h.{i}.attn.c_attn.weight"] = np.zeros((8, 24), np.float32)
        tensors[f"h.{i}.attn.c_attn.bias"] = np.zeros(24, np.float32)
        tensors[f"h.{i}.attn.c_proj.weight"] = np.zeros((8, 8), np.float32)
        tensors[f"h.{i}.mlp.c_fc.weight"] = np.zeros((8, 32), np.float32)
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8, "n_head": 2, "n_layer": 2,
                                                    "n_positions": 4, "vocab_size": 16}))
    return folder


@pytest.mark.parametrize("command", ["fuse", "plan", "verify"])
def test_a_preset_for_another_model_says_it_matches_nothing_not_which_config_key_is_missing(cli, tmp_path, gpt2,
                                                                                          command):
    out = tmp_path / "out"
    args = {"fuse": ["fuse", gpt2, "-r", "llama-qkv", "-o", out],
            "plan": ["plan", gpt2, "-r", "llama-qkv"],
            "verify": ["verify", gpt2, gpt2, "-r", "llama-qkv", "--report", out]}[command]
    result = cli(*args)
    refused(result, "rule 'attn-qkv' (preset llama-qkv) matches nothing",
            "no tensor fits '{p*}.layers.{i:int}.self_attn.q_proj.{t}'", "its nearest names are", "'h.0.attn.c_",
            unwritten=[out])
    assert "num_attention_heads" not in result.stderr


def test_the_missing_config_key_is_reported_once_the_rule_binds(cli, tmp_path):
    folder = tmp_path / "llama"
    shutil.copytree(FIXTURES / "tiny-llama-gqa", folder)
    config = json.loads((folder / "config.json").read_text())
    del config["num_attention_heads"]
    (folder / "config.json").write_text(json.dumps(config))
    refused(cli("fuse", folder, "-r", "llama-qkv", "-o", tmp_path / "out"),
            "error: rule 'attn-qkv' (preset llama-qkv): preset llama-qkv: var 'heads' needs config key "
            "'num_attention_heads', which config.json lacks", unwritten=[tmp_path / "out"])


def test_no_config_at_all_is_reported_once_the_rule_binds(cli, tmp_path):
    weights = tmp_path / "model.safetensors"
    shutil.copy(FIXTURES / "tiny-llama-gqa" / "model.safetensors", weights)
    refused(cli("plan", weights, "-r", "llama-qkv"), "rule 'attn-qkv' (preset llama-qkv)",
            "var 'heads' needs config key 'num_attention_heads', but there is no config.json", "pass --config FILE")


def test_a_var_computed_from_a_missing_key_names_the_var_that_reads_it(cli, tmp_path):
    """head_dim = hidden_size // heads: the error names 'heads' and its key, where it starts."""
    folder = tmp_path / "llama"
    shutil.copytree(FIXTURES / "tiny-llama-gqa", folder)
    (folder / "config.json").write_text(json.dumps({"hidden_size": 32}))
    rules = write_rules(tmp_path / "r.toml", """version = 1
[vars]
heads = "config:num_attention_heads"
head_dim = "config:hidden_size // heads"
[[rule]]
name = "split-q"
op = "split"
input = "{p*}.layers.0.self_attn.q_proj.weight"
outputs = ["{p*}.layers.0.self_attn.q_a.weight", "{p*}.layers.0.self_attn.q_b.weight"]
sizes = ["head_dim", "head_dim * 3"]
""")
    refused(cli("plan", folder, "-r", rules), "rule 'split-q'", "var 'heads' needs config key 'num_attention_heads'")


def test_an_optional_rule_that_matches_nothing_needs_no_config_key(cli, tmp_path):
    """Only the rules that bind ask the config: here the optional GQA rule matches nothing in a
    GPT-2 checkpoint, so its missing keys do not stop the rename that does bind (this used to
    fail on 'num_attention_heads')."""
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    write_safetensors(gpt2 / "model.safetensors", {"h.0.attn.c_attn.weight": np.ones((8, 24), np.float32)},
                      {"format": "pt"})
    (gpt2 / "config.json").write_text(json.dumps({"n_head": 2, "n_embd": 8}))
    rules = write_rules(tmp_path / "r.toml", """version = 1
[vars]
heads = "config:num_attention_heads"
[[rule]]
name = "rope"
op = "rope_permute"
optional = true
input = "{p*}.self_attn.q_proj.weight"
output = "{p*}.self_attn.q_proj.weight"
heads = "heads"
[[rule]]
name = "rename"
op = "rename"
input = "h.{i}.attn.c_attn.weight"
output = "h.{i}.attn.qkv.weight"
""")
    out = tmp_path / "out"
    ok(cli("fuse", gpt2, "-r", rules, "-o", out))
    written = load_checkpoint_raw(out)
    assert list(written) == ["h.0.attn.qkv.weight"]
    assert array_of(written["h.0.attn.qkv.weight"]).tobytes() == np.ones((8, 24), np.float32).tobytes()


@pytest.mark.parametrize("vars_text, needle", [
    ('[vars]\nheads = "config:num_attention_heads"\n', "'nope' is not defined in [vars]"),
    ('[vars]\na = "b"\nb = "a"\n', "refer to each other in a cycle"),
    ('[vars]\na = "2 ** 3"\n', "may use only integers"),
])
def test_faults_of_the_rules_file_itself_are_still_reported_when_it_loads(cli, tmp_path, gpt2, vars_text, needle):
    """A rule that matches nothing does not hide a mistake in the rules file: those do not
    depend on the model."""
    rules = write_rules(tmp_path / "r.toml", f"""version = 1
{vars_text}[[rule]]
name = "rp"
op = "rope_permute"
input = "{{p*}}.q_proj.weight"
output = "{{p*}}.q_proj.weight"
heads = "nope"
""")
    refused(cli("plan", gpt2, "-r", rules), str(tmp_path / "r.toml"), needle)
