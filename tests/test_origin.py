"""Rules loaded for provenance (rules/origin.py): the config values a rules file's vars read are
recorded, sorted, and an origin binds the same rules again from that record alone."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fusectl.errors import RuleError
from fusectl.rules.origin import ConfigReads, load_origin, load_recorded_rules
from fusectl.rules.presets import preset_text
from fusectl.rules.variables import ConfigLookupError

LLAMA = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32, "vocab_size": 100,
         "unused": [1, 2]}


def test_config_reads_remembers_only_what_was_read():
    reads = ConfigReads({"a": 1, "b": 2})
    assert len(reads) == 2 and sorted(reads) == ["a", "b"]
    assert "a" in reads and "c" not in reads
    assert reads.read == {}  # membership and iteration are not reads
    assert reads["b"] == 2
    assert reads.get("a") == 1
    assert reads.read == {"b": 2, "a": 1}
    with pytest.raises(KeyError):
        reads["c"]
    assert "c" not in reads.read


def test_a_preset_records_its_text_and_the_config_it_read():
    ruleset, origin = load_recorded_rules("llama-qkv", LLAMA)
    assert ruleset.source == "preset llama-qkv"
    assert origin.text == preset_text("llama-qkv")
    assert origin.rule == 0 and origin.block is None
    assert origin.config == (("hidden_size", 32), ("num_attention_heads", 4), ("num_key_value_heads", 2))
    sizes = ruleset.rules[0].op.sizes
    assert sizes == (32, 16, 16)


def test_a_rules_file_records_its_own_text(tmp_path):
    text = 'version = 1\n[[rule]]\nop = "rename"\ninput = "a.{x}"\noutput = "b.{x}"\n'
    path = tmp_path / "rules.toml"
    path.write_text(text)
    ruleset, origin = load_recorded_rules(str(path), None)
    assert ruleset.source == str(path)
    assert origin.text == text and origin.config == ()


def test_without_a_config_nothing_is_recorded_and_a_config_var_is_named_when_used():
    ruleset, origin = load_recorded_rules("llama-qkv", None)
    assert origin.config == ()
    with pytest.raises(ConfigLookupError) as err:
        ruleset.rules[0].op.inverse(None)  # what binding or inverting asks of the op
    message = str(err.value)
    assert "preset llama-qkv" in message and "'num_attention_heads'" in message
    assert "pass config=..." in message  # the library speaks in keyword arguments


def test_load_origin_binds_the_recorded_config_again():
    ruleset, origin = load_recorded_rules("llama-qkv", LLAMA)
    again = load_origin(origin, "out/provenance.json")
    assert again.source == "out/provenance.json"
    assert again.rules[0].op == ruleset.rules[0].op


def test_load_origin_of_a_record_missing_a_value_names_the_source_and_the_key():
    _, origin = load_recorded_rules("llama-qkv", LLAMA)
    short = replace(origin, config=origin.config[1:])  # hidden_size dropped from the record
    op = load_origin(short, "out/provenance.json").rules[0].op
    with pytest.raises(ConfigLookupError) as err:
        op.infer([], [])
    assert "out/provenance.json" in str(err.value) and "'hidden_size'" in str(err.value)


@pytest.mark.parametrize("make", [lambda p: p.mkdir(), lambda p: p.write_bytes(b"version = 1\n\xff\xfe")],
                         ids=["a folder", "not UTF-8"])
def test_a_rules_path_that_cannot_be_read_is_refused_naming_it(tmp_path, make):
    path = tmp_path / "rules.toml"
    make(path)
    with pytest.raises(RuleError) as err:
        load_recorded_rules(str(path), {})
    assert str(err.value).startswith(f"{path}: cannot read rules file (")


def test_a_name_that_is_neither_a_file_nor_a_preset_suggests_the_closest_presets():
    with pytest.raises(RuleError) as err:
        load_recorded_rules("llama-qvk", {})
    assert "'llama-qvk' is neither a rules file nor a preset; did you mean 'llama-qkv'" in str(err.value)
    assert "lstm-to-onnx" not in str(err.value)
