"""The API does the use cases; the CLI renders them.

Each report object's ``to_json()`` is, bit for bit, what ``--json`` prints, and its ``to_text()``
what the command prints; ``fusectl.verify`` refuses what ``fusectl verify`` refuses with the same
message (options named as keyword arguments instead of flags).
"""

from __future__ import annotations

import json
import shutil

import pytest

import fusectl
from fusectl import api
from fusectl.errors import FusectlError, OutputError, TieError, VerifyError, cli_vocabulary
from fusectl.inspection import InspectReport

from conftest import FIXTURES, ok, snapshot, write_rules
from test_ties import TRANSPOSE_EMBED  # a rule that transposes one member of a tie

BERT = FIXTURES / "onnx" / "bert"
GRAPH = str(BERT / "model.onnx")
BERT_CKPT = str(BERT / "model.safetensors")
LLAMA = str(FIXTURES / "tiny-llama-gqa")


def printed(data) -> str:
    """What the CLI's --json prints for ``data``."""
    return json.dumps(data, indent=2) + "\n"


# ------------------------------------------------------------------------------------ inspect

INSPECTED = [
    ("tied-embeddings.safetensors", {}),
    ("tiny-llama-gqa", {}),
    ("fp8-llama", {}),
    ("lora/llama-lora", {}),
    ("torch/training.pt", {"key": "model_state_dict"}),
    ("onnx/bert/model.onnx", {}),
    ("tiny-llama-tied", {}),
]


@pytest.mark.parametrize("detect", [False, True], ids=["headers", "detect-ties"])
@pytest.mark.parametrize("name,options", INSPECTED, ids=[n for n, _ in INSPECTED])
def test_inspect_report_is_the_cli_json_bit_for_bit(cli, name, options, detect):
    path = str(FIXTURES / name)
    flags = [a for k, v in options.items() for a in (f"--{k}", v)] + (["--detect-ties"] if detect else [])
    report = fusectl.inspect(path, detect_ties=detect, **options)
    assert isinstance(report, InspectReport)
    assert printed(report.to_json()) == ok(cli("inspect", path, "--json", *flags)).stdout
    with cli_vocabulary():
        assert report.to_text() + "\n" == ok(cli("inspect", path, *flags)).stdout
    assert ("suspected_ties" in report.to_json()) == detect


def test_inspect_json_keys_in_their_documented_order():
    keys = list(fusectl.inspect(str(FIXTURES / "fp8-llama"), detect_ties=True).to_json())
    assert keys == ["format", "files", "parameters", "ties", "unique_count", "total_bytes", "provenance",
                    "config", "state_dict_key", "ignored", "quantization", "adapter", "optimizer", "twins", "distributed",
                    "suspected_ties",
                    "constant_groups_skipped"]


def test_inspect_text_names_the_key_option_in_the_callers_words():
    report = fusectl.inspect(str(FIXTURES / "torch" / "training.pt"), key="model_state_dict")
    assert "state dict: model_state_dict (pass key to choose another)" in report.to_text()
    with cli_vocabulary():
        assert "state dict: model_state_dict (pass --key to choose another)" in report.to_text()


def test_inspect_of_an_opened_checkpoint_is_named_by_its_path():
    checkpoint = api.open_input(str(FIXTURES / "tied-embeddings.safetensors"))
    report = fusectl.inspect(checkpoint)
    assert report.path == checkpoint.path
    assert report.to_json() == fusectl.inspect(checkpoint.path).to_json()


def test_inspect_key_on_a_safetensors_file_is_refused_as_on_the_cli(cli):
    path = str(FIXTURES / "tiny-llama-gqa")
    result = cli("inspect", path, "--key", "x")
    assert result.exit_code == 2
    with pytest.raises(FusectlError) as e, cli_vocabulary():
        fusectl.inspect(path, key="x")
    assert result.stderr == f"error: {e.value}\n"


# ------------------------------------------------------------------------- plan, fuse, export


@pytest.mark.parametrize("fixture,rules", [("tiny-llama-gqa", ["llama-qkv", "llama-gate-up"]),
                                           ("fp8-llama", ["llama-qkv"]), ("tiny-llama-tied", ["llama-qkv"])])
def test_planned_renders_as_plan_prints(cli, fixture, rules):
    path = str(FIXTURES / fixture)
    flags = [a for r in rules for a in ("-r", r)]
    planned = fusectl.plan(path, rules)
    assert printed(planned.to_json()) == ok(cli("plan", path, *flags, "--json")).stdout
    with cli_vocabulary():
        assert planned.to_text() + "\n" == ok(cli("plan", path, *flags)).stdout


def test_untied_groups_in_plan_text_name_the_option_in_the_callers_words(tmp_path):
    rules = write_rules(tmp_path / "t.toml", TRANSPOSE_EMBED)
    planned = fusectl.plan(str(FIXTURES / "tied-embeddings.safetensors"), [str(rules)], untie=True)
    assert "  untied (untie=True): embed.weight, head.weight" in planned.to_text()
    with cli_vocabulary():
        assert "  untied (--untie): embed.weight, head.weight" in planned.to_text()


def test_fuse_report_json_and_text(cli, tmp_path):
    out = tmp_path / "fused"
    report = fusectl.fuse(LLAMA, ["llama-qkv"], out)
    data = report.to_json()
    cli_data = ok(cli("fuse", LLAMA, "-r", "llama-qkv", "-o", tmp_path / "fused2", "--json")).json()
    assert list(data) == list(cli_data) == ["output", "tensors", "unique_bytes", "written_bytes", "copied_bytes",
                                            "steps", "ties", "seconds", "optimizer", "twins"]
    assert {k: v for k, v in data.items() if k not in ("output", "seconds")} == \
        {k: v for k, v in cli_data.items() if k not in ("output", "seconds")}
    assert data["output"] == str(out) and report.seconds >= 0
    assert report.to_text().startswith(f"wrote {out}: {report.tensors} tensors, ")
    assert report.to_text().endswith(f" copied without decoding) in {report.seconds:.2f}s")
    restored = fusectl.unfuse(out, tmp_path / "restored")
    assert restored.to_json()["steps"] == 0


def test_export_report_renders_as_export_prints(cli, tmp_path):
    fused = tmp_path / "fused"
    fusectl.fuse(str(BERT), ["bert-qkv"], fused)
    report = fusectl.export(fused, GRAPH, tmp_path / "api.onnx")
    result = ok(cli("export", fused, "--graph", GRAPH, "-o", tmp_path / "cli.onnx"))
    assert report.to_text().replace("api.onnx", "cli.onnx") + "\n" == result.stdout
    as_json = ok(cli("export", fused, "--graph", GRAPH, "-o", tmp_path / "cli2.onnx", "--json")).json()
    assert {**report.to_json(), "output": as_json["output"]} == as_json


def test_name_map_text_is_what_map_prints(cli):
    result = api.map_names(BERT_CKPT, GRAPH)
    names = len(api.open_input(BERT_CKPT).table.names())
    assert api.name_map_text(result, BERT_CKPT, GRAPH, names) + "\n" == ok(cli("map", BERT_CKPT, GRAPH)).stdout


def test_presets_are_what_rules_list_prints(cli):
    listed = ok(cli("rules", "list")).stdout.splitlines()
    presets = api.presets()
    assert [line.split()[0] for line in listed] == list(presets)
    assert all(line.endswith(description) for line, description in zip(listed, presets.values()))
    assert api.preset_text("llama-qkv") == ok(cli("rules", "show", "llama-qkv")).stdout


# ------------------------------------------------------------------------------------- verify


def test_verify_report_text_is_what_verify_prints(cli, tmp_path):
    fused = tmp_path / "fused"
    fusectl.fuse(LLAMA, ["llama-qkv"], fused)
    report = fusectl.verify(LLAMA, fused, provider="cpu")
    assert report.passed
    assert report.to_text() + "\n" == ok(cli("verify", LLAMA, fused, "--provider", "cpu")).stdout


def test_verify_writes_the_report_files_it_is_given(tmp_path):
    report = fusectl.verify(GRAPH, GRAPH, provider="cpu", report=str(tmp_path / "v.json"),
                            junit=str(tmp_path / "v.xml"))
    assert json.loads((tmp_path / "v.json").read_text()) == report.to_json()
    assert (tmp_path / "v.xml").read_bytes() == report.to_junit()


def test_verify_takes_inputs_as_an_npz_path_or_arrays():
    from fusectl.verification.inputs_file import load_inputs_file

    from_path = fusectl.verify(GRAPH, GRAPH, provider="cpu", inputs=str(BERT / "io.npz"))
    arrays = dict(load_inputs_file(str(BERT / "io.npz")))
    from_arrays = fusectl.verify(GRAPH, GRAPH, provider="cpu", inputs=arrays)
    assert from_path.passed and from_path.to_json() == from_arrays.to_json()


def verify_cases(tmp_path):
    """(CLI arguments, API arguments) pairs that verify refuses before comparing anything."""
    fused = str(tmp_path / "fused")
    fusectl.fuse(LLAMA, ["llama-qkv"], fused)
    same = str(tmp_path / "same")
    return [
        ([GRAPH, BERT_CKPT], (GRAPH, BERT_CKPT), {}),
        ([BERT_CKPT, GRAPH], (BERT_CKPT, GRAPH), {}),
        ([GRAPH, GRAPH, "--key", "x"], (GRAPH, GRAPH), {"key": "x"}),
        ([LLAMA, fused, "--key", "x"], (LLAMA, fused), {"key": "x"}),
        ([LLAMA, fused, "--dim", "batch=2"], (LLAMA, fused), {"dims": {"batch": 2}}),
        ([LLAMA, fused, "--input", "x=2"], (LLAMA, fused), {"shapes": {"x": (2,)}}),
        ([LLAMA, fused, "--inputs", "x.npz"], (LLAMA, fused), {"inputs": "x.npz"}),
        ([LLAMA, fused, "--report", f"{LLAMA}/config.json"], (LLAMA, fused), {"report": f"{LLAMA}/config.json"}),
        ([LLAMA, fused, "--report", same, "--junit", same], (LLAMA, fused), {"report": same, "junit": same}),
        ([GRAPH, GRAPH, "--report", GRAPH], (GRAPH, GRAPH), {"report": GRAPH}),
        ([GRAPH, GRAPH, "--junit", str(BERT)], (GRAPH, GRAPH), {"junit": str(BERT)}),
    ]


def test_verify_refuses_what_the_cli_refuses_with_the_same_message(cli, tmp_path):
    before = snapshot(FIXTURES / "tiny-llama-gqa")
    for cli_args, api_args, kwargs in verify_cases(tmp_path):
        result = cli("verify", *cli_args)
        assert result.exit_code == 2, (cli_args, result.output)
        with pytest.raises((VerifyError, OutputError)) as e, cli_vocabulary():
            fusectl.verify(*api_args, **kwargs)
        assert result.stderr == f"error: {e.value}\n", cli_args
    assert not (tmp_path / "same").exists()
    assert snapshot(FIXTURES / "tiny-llama-gqa") == before


@pytest.mark.parametrize("kwargs,says", [
    ({"dims": {"batch": 2}}, "dims applies to two .onnx models; with checkpoints, verify makes its own inputs"),
    ({"shapes": {"x": (2,)}}, "shapes applies to two .onnx models"),
    ({"inputs": "x.npz"}, "inputs applies to two .onnx models"),
    ({"key": "x"}, "key selects a state dict inside a PyTorch file; neither "),
])
def test_verify_options_that_do_not_apply_are_named_as_keywords(tmp_path, kwargs, says):
    fused = tmp_path / "fused"
    fusectl.fuse(LLAMA, ["llama-qkv"], fused)
    with pytest.raises(VerifyError, match="^" + says.replace(".", r"\.").replace("(", r"\(")):
        fusectl.verify(LLAMA, fused, **kwargs)


def test_verify_of_a_graph_and_a_checkpoint_says_so_not_no_provenance():
    with pytest.raises(VerifyError) as e:
        fusectl.verify(GRAPH, BERT_CKPT)
    message = str(e.value)
    assert "provenance" not in message
    assert f"{GRAPH} is an ONNX graph but {BERT_CKPT} is a checkpoint" in message
    assert f'fusectl.export("{BERT_CKPT}", "{GRAPH}", "OUT.onnx")' in message
    with pytest.raises(VerifyError) as e, cli_vocabulary():
        fusectl.verify(GRAPH, BERT_CKPT)
    assert f"`fusectl export {BERT_CKPT} --graph {GRAPH} -o OUT.onnx`" in str(e.value)


def test_verify_key_with_graphs_is_refused():
    with pytest.raises(VerifyError, match="^key selects a state dict inside a PyTorch checkpoint; it does not"):
        fusectl.verify(GRAPH, GRAPH, key="model")


def test_verify_key_reaches_only_the_pytorch_input(cli, tmp_path):
    src = str(FIXTURES / "reparam" / "crnn_training.pth")
    out = tmp_path / "folded.safetensors"
    fusectl.fuse(src, ["conv-bn-fold"], out, key="model_state_dict")
    report = fusectl.verify(src, str(out), key="model_state_dict", provider="cpu")
    assert report.passed and report.mode == "checkpoint"
    with cli_vocabulary():
        assert report.to_text() + "\n" == ok(cli("verify", src, out, "--key", "model_state_dict",
                                                  "--provider", "cpu")).stdout


def test_verify_report_destination_named_as_a_keyword(tmp_path):
    with pytest.raises(OutputError, match=f"^report {GRAPH}: would overwrite the input {GRAPH}"):
        fusectl.verify(GRAPH, GRAPH, report=GRAPH)


# ------------------------------------------------------------------------ the caller's words


def test_a_tie_break_says_untie_true_through_the_api_and_untie_on_the_cli(cli, tmp_path):
    rules = write_rules(tmp_path / "t.toml", TRANSPOSE_EMBED)
    src = str(FIXTURES / "tied-embeddings.safetensors")
    result = cli("fuse", src, "-r", rules, "-o", tmp_path / "cli.safetensors")
    assert result.exit_code == 2 and "Pass --untie to write the members as separate copies" in result.stderr
    with pytest.raises(TieError) as e:
        fusectl.fuse(src, [str(rules)], tmp_path / "api.safetensors")
    assert "Pass untie=True to write the members as separate copies" in str(e.value)
    assert "--untie" not in str(e.value)
    assert result.stderr == f"error: {str(e.value).replace('untie=True', '--untie')}\n"
    assert not (tmp_path / "cli.safetensors").exists() and not (tmp_path / "api.safetensors").exists()


def test_unfuse_without_provenance_says_rules_through_the_api_and_r_on_the_cli(cli, tmp_path):
    result = cli("unfuse", LLAMA, "-o", tmp_path / "cli")
    assert result.exit_code == 2
    assert result.stderr.endswith("no fusectl provenance to undo; pass -r RULES to invert rules instead\n")
    with pytest.raises(FusectlError, match=r"no fusectl provenance to undo; pass rules=\[\.\.\.\] to invert"):
        fusectl.unfuse(LLAMA, tmp_path / "api")
    assert not (tmp_path / "cli").exists() and not (tmp_path / "api").exists()


def test_the_cli_vocabulary_ends_with_the_command(cli, tmp_path):
    ok(cli("inspect", LLAMA))  # a command ran (and left its vocabulary) in this thread
    from fusectl.errors import option

    assert option("untie") == "untie=True"


def test_an_opened_checkpoint_is_taken_as_it_is(tmp_path):
    shutil.copytree(FIXTURES / "tiny-llama-gqa", tmp_path / "in")
    checkpoint = api.open_input(tmp_path / "in")
    assert api.open_input(checkpoint) is checkpoint
    assert fusectl.plan(checkpoint, ["llama-qkv"]).checkpoint is checkpoint
