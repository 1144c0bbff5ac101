"""[config] edits (config_edit.py): what apply does to a config text, the text an edit records
so that its inverse writes the original back byte for byte, the provenance form, and refusals
of configs and records that are not what an edit needs."""

from __future__ import annotations

import json

import pytest

from fusectl.config_edit import ConfigEdit, resolve_edits
from fusectl.errors import PlanError

QUANTIZED = '{"quantization_config": {"fmt": "e4m3", "quant_method": "fp8"},  "hidden_size": 8}'


def test_apply_sets_keys_and_removes_dotted_paths():
    edit = ConfigEdit(sets=(("torch_dtype", '"bfloat16"'), ("n", "3")), removes=("quantization_config.fmt",))
    out = edit.apply(QUANTIZED, "config.json")
    assert json.loads(out) == {"quantization_config": {"quant_method": "fp8"}, "hidden_size": 8,
                               "torch_dtype": "bfloat16", "n": 3}
    assert out.endswith("}\n") and out.startswith("{\n  ")  # indented, one trailing newline


def test_removing_an_absent_path_changes_nothing_else():
    edit = ConfigEdit(removes=("missing", "hidden_size.deeper", "nothing.here.at_all"))
    assert json.loads(edit.apply(QUANTIZED, "config.json")) == json.loads(QUANTIZED)


def test_apply_writes_ascii():
    out = ConfigEdit(sets=(("name", json.dumps("modèle")),)).apply("{}", "config.json")
    assert "\\u00e8" in out and out.isascii()


def test_a_config_that_is_not_json_is_refused_naming_it():
    with pytest.raises(PlanError) as err:
        ConfigEdit(removes=("a",)).apply("{not json", "model/config.json")
    assert "model/config.json: not valid JSON" in str(err.value)
    assert "[config] edits need a readable config.json" in str(err.value)


def test_a_config_that_is_not_an_object_is_refused_naming_it():
    with pytest.raises(PlanError, match=r"model/config.json: must be a JSON object"):
        ConfigEdit(removes=("a",)).apply("[1, 2]", "model/config.json")


def test_the_inverse_writes_the_recorded_text_back_byte_for_byte():
    edit = ConfigEdit(removes=("quantization_config",), before=QUANTIZED, file="adapter_config.json")
    inverse = edit.inverse()
    assert inverse.restore == QUANTIZED and inverse.file == "adapter_config.json"
    assert inverse.apply("{}", "config.json") == QUANTIZED
    assert inverse.apply("not even json", "config.json") == QUANTIZED


def test_an_edit_not_bound_to_a_checkpoint_has_no_inverse():
    with pytest.raises(PlanError) as err:
        ConfigEdit(removes=("quantization_config",)).inverse()
    assert "cannot be undone from the rules file alone" in str(err.value)
    assert "unfuse with the provenance" in str(err.value)


def test_describe_lists_sets_then_removes():
    edit = ConfigEdit(sets=(("torch_dtype", '"bfloat16"'),), removes=("quantization_config",))
    assert edit.describe() == 'config.json: set torch_dtype = "bfloat16", remove quantization_config'
    assert ConfigEdit(restore="{}", file="adapter_config.json").describe() == \
        "adapter_config.json: restore the original"


def test_to_json_leaves_out_defaults_and_from_json_reads_it_back():
    edit = ConfigEdit(sets=(("torch_dtype", '"bfloat16"'), ("layers", "[1, 2]")), removes=("a.b",),
                      before="{}", restore=None, file="adapter_config.json")
    record = edit.to_json()
    assert record == {"set": {"torch_dtype": "bfloat16", "layers": [1, 2]}, "remove": ["a.b"],
                      "before": "{}", "file": "adapter_config.json"}
    assert ConfigEdit.from_json(json.loads(json.dumps(record)), "provenance") == edit
    assert ConfigEdit().to_json() == {}
    restore = ConfigEdit(restore="{}")
    assert restore.to_json() == {"restore": "{}"}
    assert ConfigEdit.from_json(restore.to_json(), "provenance") == restore


@pytest.mark.parametrize("raw, words", [
    ([], "a config edit is an object with set, remove, before, restore or file"),
    ({"sets": {}}, "a config edit is an object with set, remove, before, restore or file"),
    ({"file": "other.json"}, "a config edit's file is config.json or adapter_config.json"),
    ({"set": []}, "a config edit's set is an object"),
    ({"remove": "a"}, "remove a list of key paths"),
    ({"remove": [""]}, "remove a list of key paths"),
    ({"remove": [3]}, "remove a list of key paths"),
    ({"before": 3}, "before and restore texts"),
    ({"restore": ["x"]}, "before and restore texts"),
])
def test_a_record_that_is_not_an_edit_is_refused_naming_where(raw, words):
    with pytest.raises(PlanError) as err:
        ConfigEdit.from_json(raw, "out/provenance.json group 2")
    assert str(err.value).startswith("out/provenance.json group 2: ")
    assert words in str(err.value)


def test_resolve_edits_records_each_edits_before_text_in_turn():
    first = ConfigEdit(removes=("quantization_config",))
    second = ConfigEdit(sets=(("torch_dtype", '"bfloat16"'),))
    resolved, after = resolve_edits([first, second], QUANTIZED, "config.json")
    assert resolved[0].before == QUANTIZED
    assert resolved[1].before == first.apply(QUANTIZED, "config.json")
    assert json.loads(after) == {"hidden_size": 8, "torch_dtype": "bfloat16"}
    # undoing them in reverse order gives back the original text exactly
    text = after
    for edit in reversed(resolved):
        text = edit.inverse().apply(text, "config.json")
    assert text == QUANTIZED


def test_resolve_edits_keeps_an_edit_already_bound():
    bound = ConfigEdit(removes=("a",), before='{"a": 1}')
    restore = ConfigEdit(restore='{"b": 2}')
    resolved, after = resolve_edits([bound, restore], '{"a": 5, "c": 1}', "config.json")
    assert resolved == [bound, restore]
    assert after == '{"b": 2}'


def test_resolve_edits_names_the_file_when_the_config_is_unreadable():
    with pytest.raises(PlanError, match=r"^ckpt/config.json: not valid JSON"):
        resolve_edits([ConfigEdit(removes=("a",))], "", "ckpt/config.json")
