"""verify's random integer inputs take the range the graph gives them (token ids across the
whole embedding), and the report says which range and why."""

from __future__ import annotations

import json

import onnx
import onnx.parser
import pytest
from onnx import numpy_helper

from conftest import FIXTURES, ok
from fusectl import api
from fusectl.onnx.graph import load_model
from fusectl.verification.input_ranges import integer_input_ranges
from fusectl.verification.runner import CPU, make_inputs, session

LLAMA = FIXTURES / "onnx" / "llama"
BERT = FIXTURES / "onnx" / "bert"
HEAD = '<ir_version: 8, opset_import: ["" : 17]>\n'


def table(rows: int, name: str = "", cols: int = 2) -> str:
    """An inline float tensor (an initializer ``name``) of ``rows`` x ``cols``; row i holds i."""
    values = ", ".join(f"{float(i)}" for i in range(rows) for _ in range(cols))
    return f"float[{rows}, {cols}] {name + ' = ' if name else ''}{{{values}}}"


def graph(tmp_path, text: str, name: str = "g.onnx"):
    model = onnx.parser.parse_model(HEAD + text)
    onnx.checker.check_model(model, full_check=True)
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def inputs_of(cli, tmp_path, reference, candidate=None, *options) -> dict[str, dict]:
    report = tmp_path / "verify.json"
    ok(cli("verify", reference, candidate or reference, "--report", report, *options))
    return {i["name"]: i for i in json.loads(report.read_text())["inputs"]}


# ------------------------------------------------------------- the exported fixtures (torch.onnx)


def test_llama_token_ids_span_the_vocabulary_its_config_declares(cli, tmp_path):
    vocab = json.loads((LLAMA / "config.json").read_text())["vocab_size"]
    ids = inputs_of(cli, tmp_path, LLAMA / "model.onnx")["input_ids"]
    assert ids["range"] == [0, vocab - 1] and ids["source"] == "random"
    assert ids["range_from"] == f"Gather of 'model.embed_tokens.weight', {vocab} rows"


def test_bert_ids_span_the_vocabulary_and_the_attention_mask_stays_0_or_1(cli, tmp_path):
    vocab = json.loads((BERT / "config.json").read_text())["vocab_size"]
    result = ok(cli("verify", BERT / "model.onnx", BERT / "model.onnx", "--report", tmp_path / "r.json"))
    found = {i["name"]: i for i in json.loads((tmp_path / "r.json").read_text())["inputs"]}
    assert found["input_ids"]["range"] == [0, vocab - 1]
    assert found["attention_mask"]["range"] == [0, 1]
    assert found["attention_mask"]["range_from"] == "the default: no Gather indexes with it"
    assert (f"  random integers: input_ids in [0, {vocab - 1}] (Gather of 'embeddings.word_embeddings.weight', "
            f"{vocab} rows), attention_mask in [0, 1] (the default: no Gather indexes with it)") in result.stdout


def test_an_embedding_wrong_past_row_1_fails_verify(cli, tmp_path):
    """The case of the issue: rows 0 and 1 intact, every other row changed. Ids 0 and 1 alone
    (the old default) compared equal outputs; ids across the vocabulary do not."""
    model = onnx.load(str(LLAMA / "model.onnx"))
    embedding = next(t for t in model.graph.initializer if t.name == "model.embed_tokens.weight")
    rows = numpy_helper.to_array(embedding).copy()
    rows[2:] += 0.5
    embedding.CopyFrom(numpy_helper.from_array(rows, embedding.name))
    candidate = tmp_path / "candidate.onnx"
    onnx.save(model, str(candidate))
    result = cli("verify", LLAMA / "model.onnx", candidate)
    assert result.exit_code == 1, result.output
    assert "FAIL output logits" in result.stdout


def test_the_random_ids_reach_across_the_range_and_no_further(tmp_path):
    path = graph(tmp_path, f"""
g (int64[N] ids) => (float[N, 2] y) <{table(300, "emb")}> {{
    y = Gather(emb, ids)
}}""")
    ranges = integer_input_ranges([load_model(str(path))], ["ids"])
    sess = session(str(path), CPU, "g")
    feeds, specs, _ = make_inputs(sess, {}, {"ids": (4096,)}, {}, 0, "g", ranges=ranges)
    assert feeds["ids"].min() == 0 and feeds["ids"].max() == 299
    assert specs[0].range.to_json() == [0, 299]


def test_inputs_from_a_file_override_every_range(cli, tmp_path):
    found = inputs_of(cli, tmp_path, BERT / "model.onnx", None, "--inputs", BERT / "io.npz")
    assert found["input_ids"] == {"name": "input_ids", "dtype": "int64", "shape": [1, 8], "source": "file"}


# ------------------------------------------------------------------- inline graphs (onnx.parser)

GATHER_OF_10 = "Gather of 'emb', 10 rows"
NO_GATHER = "the default: no Gather indexes with it"
CASES = {
    "a Cast, Unsqueeze and Squeeze between the input and the Gather": (f"""
g (int32[2, 3] ids) => (float[2, 3, 2] y) <{table(10, "emb")}, int64[1] axes = {{0}}> {{
    wide = Cast<to=7>(ids)
    more = Unsqueeze(wide, axes)
    back = Squeeze(more, axes)
    y = Gather(emb, back)
}}""", [0, 9], GATHER_OF_10),
    "a narrowing Cast caps the range at its type": (f"""
g (int64[4] ids) => (float[4, 2] y) <{table(300, "emb")}> {{
    small = Cast<to=3>(ids)
    wide = Cast<to=7>(small)
    y = Gather(emb, wide)
}}""", [0, 127], "Gather of 'emb', 300 rows; 127 is the largest value of the integer type on the way"),
    "two Gathers that disagree: the smaller table": (f"""
g (int64[5] ids) => (float[5, 2] y) <{table(10, "big")}, {table(6, "small")}> {{
    a = Gather(big, ids)
    b = Gather(small, ids)
    y = Add(a, b)
}}""", [0, 5], "Gather of 'small', 6 rows"),
    "a Gather on the last axis: that axis": (f"""
g (int64[3] ids) => (float[10, 3] y) <{table(10, "emb", 4)}> {{
    y = Gather<axis=-1>(emb, ids)
}}""", [0, 3], "Gather of 'emb', 4 rows"),
    "a Gather of a Constant node: its rows": (f"""
g (int64[3] ids) => (float[3, 2] y) {{
    emb = Constant<value = {table(5, "emb_value")}>()
    y = Gather(emb, ids)
}}""", [0, 4], "Gather of 'emb', 5 rows"),
    "a mask through arithmetic and Where keeps 0 or 1": ("""
g (int64[2, 4] ids, float[2, 4] x) => (float[2, 4] y) <int64 zero = {0}, float minus = {-1e9}> {
    f = Cast<to=1>(ids)
    scaled = Mul(x, f)
    keep = Equal(ids, zero)
    y = Where(keep, minus, scaled)
}""", [0, 1], NO_GATHER),
    "an integer the graph only passes on keeps 0 or 1": ("""
g (uint8[4] ids) => (uint8[4] y) {
    y = Identity(ids)
}""", [0, 1], NO_GATHER),
    "an input that is also a count (Range) keeps 0 or 1": (f"""
g (int64 ids) => (float[2] y, float[N, 2] z) <{table(10, "emb")}, int64 zero = {{0}}, int64 one = {{1}}> {{
    counted = Range(zero, ids, one)
    y = Gather(emb, ids)
    z = Gather(emb, counted)
}}""", [0, 1], "the default: it feeds Range, whose valid values verify cannot tell"),
    "a Gather of a computed table of unknown size keeps 0 or 1": (f"""
g (int64[3] ids) => (float[3, 2] y) <{table(10, "emb")}, float two = {{2.0}}> {{
    doubled = Mul(emb, two)
    y = Gather(doubled, ids)
}}""", [0, 1], "the default: it feeds a Gather of a table of unknown size, whose valid values verify cannot tell"),
    **{f"a {dtype} input caps the range at its type": (f"""
g ({dtype}[4] ids) => (float[4, 2] y) <{table(300, "emb")}> {{
    wide = Cast<to=7>(ids)
    y = Gather(emb, wide)
}}""", [0, largest], "Gather of 'emb', 300 rows; {largest} is the largest value of the integer type on the way"
       .format(largest=largest)) for dtype, largest in (("uint8", 255), ("int8", 127))},
}


@pytest.mark.parametrize("text, expected, why", CASES.values(), ids=CASES.keys())
def test_the_range_the_graph_gives(cli, tmp_path, text, expected, why):
    ids = inputs_of(cli, tmp_path, graph(tmp_path, text))["ids"]
    assert (ids["range"], ids["range_from"]) == (expected, why)


def test_the_candidates_smaller_table_bounds_both(cli, tmp_path):
    text = """
g (int64[5] ids) => (float[5, 2] y) <TABLE> {
    y = Gather(emb, ids)
}"""
    reference = graph(tmp_path, text.replace("TABLE", table(10, "emb")), "reference.onnx")
    candidate = graph(tmp_path, text.replace("TABLE", table(7, "emb")), "candidate.onnx")
    assert inputs_of(cli, tmp_path, reference, candidate)["ids"]["range"] == [0, 6]


def test_a_gather_inside_a_subgraph_bounds_the_input_and_a_bool_stays_bool(tmp_path):
    path = graph(tmp_path, f"""
g (int64[3] ids, bool c) => (float[3, 2] y) <{table(10, "emb")}> {{
    y = If(c) <then_branch = g1 () => (float[3, 2] a) {{ a = Gather(emb, ids) }},
                else_branch = g2 () => (float[3, 2] b) {{ narrow = Cast<to=6>(ids)
                                                        b = Gather(emb, narrow) }}>
}}""")
    report = api.verify(str(path), str(path))
    ids, c = report.inputs
    assert (ids["range"], ids["range_from"]) == ([0, 9], GATHER_OF_10)
    assert c == {"name": "c", "dtype": "bool", "shape": [], "source": "random"}
