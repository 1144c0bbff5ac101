"""The range of a random integer input, read from the graph (verification/input_ranges.py): the
smallest Gather table it indexes bounds it (followed through Casts and ops passing values on, a
narrowing Cast capping it), arithmetic keeps [0, 1], and any use whose valid values cannot be
told — a shape, an axis, a Cast without a target, a table of unknown size — keeps [0, 1] and
says which op."""

from __future__ import annotations

import onnx_ir as ir
import pytest

from fusectl.verification.input_ranges import DEFAULT, DEFAULT_REASON, IntegerRange, integer_input_ranges

HEAD = '<ir_version: 8, opset_import: ["" : 17, "com.example" : 1]>\n'


def table(rows: int, cols: int = 2) -> str:
    return f"float[{rows}, {cols}] emb = {{{', '.join(['0.'] * (rows * cols))}}}"


def model(text: str) -> ir.Model:
    return ir.from_onnx_text(HEAD + text)


def range_of(text: str, name: str = "ids") -> IntegerRange:
    return integer_input_ranges([model(text)], [name])[name]


def test_a_gather_bounds_its_indices_by_the_tables_rows():
    got = range_of(f"""g (int64[3] ids) => (float[3, 2] y) <{table(7)}> {{ y = Gather(emb, ids) }}""")
    assert got == IntegerRange(0, 6, "Gather of 'emb', 7 rows")
    assert got.to_json() == [0, 6]


def test_values_passed_on_reach_the_gather():
    got = range_of(f"""g (int64[2, 3] ids) => (float[6, 2] y) <{table(9)}, int64[1] flat = {{-1}}> {{
        r = Reshape(ids, flat)
        t = Identity(r)
        y = Gather(emb, t)
    }}""")
    assert (got.low, got.high) == (0, 8)


def test_a_narrowing_cast_caps_the_range_and_says_so():
    got = range_of(f"""g (int64[3] ids) => (float[3, 2] y) <{table(1000)}> {{
        small = Cast<to=2>(ids)
        y = Gather(emb, small)
    }}""")
    assert got == IntegerRange(0, 255, "Gather of 'emb', 1000 rows; 255 is the largest value of the integer type "
                                       "on the way")


def test_a_cast_to_float_is_arithmetic_from_there_on():
    got = range_of("""g (int64[3] ids) => (float[3] y) {
        y = Cast<to=1>(ids)
    }""")
    assert got == IntegerRange(0, 1, "the default: no Gather indexes with it")


def test_the_smallest_table_of_every_graph_wins():
    first = model(f"""g (int64[3] ids) => (float[3, 2] y) <{table(10)}> {{ y = Gather(emb, ids) }}""")
    second = model(f"""g (int64[3] ids) => (float[3, 2] y) <{table(4)}> {{ y = Gather(emb, ids) }}""")
    assert integer_input_ranges([first, second], ["ids"])["ids"] == IntegerRange(0, 3, "Gather of 'emb', 4 rows")


def test_an_input_a_graph_lacks_or_that_is_not_an_integer_keeps_the_default():
    text = f"""g (int64[3] ids, float[3] x) => (float[3, 2] y, float[3] z) <{table(10)}> {{
        y = Gather(emb, ids)
        z = Identity(x)
    }}"""
    ranges = integer_input_ranges([model(text)], ["x", "absent"])
    assert ranges["x"] == ranges["absent"] == IntegerRange(0, 1, f"{DEFAULT_REASON}: no Gather indexes with it")
    assert DEFAULT == IntegerRange(0, 1, "the default")


@pytest.mark.parametrize("body, op", [
    ("y = Reshape(x, ids)", "Reshape"),  # a shape, not values passed on
    ("y = CumSum(x, ids)", "CumSum"),  # an axis
    ("y = Custom<>(ids)", "com.example.Custom"),
    ("y = Range(ids, ids, ids)", "Range"),
])
def test_a_use_whose_valid_values_cannot_be_told_keeps_the_default_naming_it(body, op):
    body = body.replace("Custom<>", "com.example.Custom")
    got = range_of(f"""g (int64[1] ids, float[4] x) => (float[N] y) {{ {body} }}""")
    assert got == IntegerRange(0, 1, f"{DEFAULT_REASON}: it feeds {op}, whose valid values verify cannot tell")


def test_an_unknown_use_in_one_graph_outweighs_a_gather_in_another():
    gather = model(f"""g (int64[3] ids) => (float[3, 2] y) <{table(10)}> {{ y = Gather(emb, ids) }}""")
    shape = model("""g (int64[1] ids, float[4] x) => (float[N] y) { y = Reshape(x, ids) }""")
    got = integer_input_ranges([gather, shape], ["ids"])["ids"]
    assert (got.low, got.high) == (0, 1) and "it feeds Reshape" in got.reason


def test_cumsum_of_the_input_itself_is_arithmetic():
    got = range_of("""g (int64[4] ids) => (int64[4] y) <int64 axis = {0}> { y = CumSum(ids, axis) }""")
    assert got.reason == f"{DEFAULT_REASON}: no Gather indexes with it"


def test_a_cast_without_a_target_is_a_use_that_cannot_be_told():
    m = model("""g (int64[3] ids) => (int64[3] y) { y = Cast<to=7>(ids) }""")
    cast = next(iter(m.graph))
    del cast.attributes["to"]
    got = integer_input_ranges([m], ["ids"])["ids"]
    assert got.reason == f"{DEFAULT_REASON}: it feeds Cast, whose valid values verify cannot tell"


def test_a_cast_to_a_type_onnx_does_not_define_is_a_use_that_cannot_be_told():
    m = model("""g (int64[3] ids) => (int64[3] y) { y = Cast<to=7>(ids) }""")
    next(iter(m.graph)).attributes["to"] = ir.AttrInt64("to", 999)
    assert "it feeds Cast" in integer_input_ranges([m], ["ids"])["ids"].reason


@pytest.mark.parametrize("text", [
    # a table computed by the graph: its size is not declared
    """g (int64[3] ids, float[5, 2] t) => (float[3, 2] y) <float two = {2.0}> {
        doubled = Mul(t, two)
        y = Gather(doubled, ids)
    }""",
    # a gathered axis out of range
    f"""g (int64[3] ids) => (float[3, 2] y) <{table(5)}> {{ y = Gather<axis=4>(emb, ids) }}""",
    # a symbolic size along the gathered axis
    """g (int64[3] ids, float[N, 2] t) => (float[3, 2] y) { y = Gather(t, ids) }""",
])
def test_a_gather_of_a_table_of_unknown_size_keeps_the_default(text):
    got = range_of(text)
    assert got == IntegerRange(0, 1, f"{DEFAULT_REASON}: it feeds a Gather of a table of unknown size, "
                                     "whose valid values verify cannot tell")


def test_a_gather_with_no_data_input_is_of_unknown_size():
    m = model(f"""g (int64[3] ids) => (float[3, 2] y) <{table(5)}> {{ y = Gather(emb, ids) }}""")
    next(iter(m.graph)).replace_input_with(0, None)
    assert "a Gather of a table of unknown size" in integer_input_ranges([m], ["ids"])["ids"].reason


def test_the_gathered_size_of_a_graph_input_with_a_declared_shape():
    got = range_of("""g (int64[3] ids, float[6, 2] t) => (float[3, 2] y) { y = Gather(t, ids) }""")
    assert got == IntegerRange(0, 5, "Gather of 't', 6 rows")


def test_a_gather_of_the_input_as_data_passes_its_values_on():
    got = range_of(f"""g (int64[3] ids, int64[2] pick) => (float[2, 2] y) <{table(8)}> {{
        chosen = Gather(ids, pick)
        y = Gather(emb, chosen)
    }}""")
    assert (got.high, got.reason) == (7, "Gather of 'emb', 8 rows")
