"""Name patterns (SPEC §3): ``{x}``, ``{x:int}``, ``{x*}`` with its vanishing dot, repeated
placeholders, ``format``, and ambiguity errors at load and at match time."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusectl.errors import PlanError, RuleError
from fusectl.rules.patterns import Pattern


def match(pattern: str, name: str):
    return Pattern.parse(pattern).match(name)


# --- {x}: a non-empty, dot-free run ---------------------------------------------------


@pytest.mark.parametrize(
    "pattern, name, binding",
    [
        ("a.{x}.w", "a.q.w", {"x": "q"}),
        ("a.{x}.w", "a.q_proj.w", {"x": "q_proj"}),
        ("{x}", "anything_at_all", {"x": "anything_at_all"}),
        ("{x}.weight", "lm_head.weight", {"x": "lm_head"}),
        ("model.{x}", "model.norm", {"x": "norm"}),
        # part of a segment
        ("weight_ih_l{k}", "weight_ih_l0", {"k": "0"}),
        ("weight_ih_l{k}", "weight_ih_l0_reverse", {"k": "0_reverse"}),
        ("{m}_proj.weight", "q_proj.weight", {"m": "q"}),
        ("w{n}", "w3", {"n": "3"}),
    ],
)
def test_segment_placeholder_binds(pattern, name, binding):
    assert match(pattern, name) == binding


@pytest.mark.parametrize(
    "pattern, name",
    [
        ("a.{x}.w", "a.w"),  # {x} is not empty
        ("a.{x}.w", "a..w"),
        ("a.{x}.w", "a.b.c.w"),  # {x} never crosses a dot
        ("{x}", "a.b"),
        ("{x}", ""),
        ("weight_ih_l{k}", "weight_ih_l"),
        ("weight_ih_l{k}", "weight_hh_l0"),
        ("a.{x}.w", "a.q.w.extra"),  # whole names only
        ("a.{x}.w", "pre.a.q.w"),
        ("{m}_proj.weight", "q_proj.weight.x"),
    ],
)
def test_segment_placeholder_rejects(pattern, name):
    assert match(pattern, name) is None


def test_literal_text_is_not_a_regex():
    # "." and "+" in the literal part must match themselves only
    assert match("a.{x}.w", "aXqXw") is None
    assert match("a+b.{x}", "a+b.c") == {"x": "c"}
    assert match("a+b.{x}", "aab.c") is None
    assert match("(x).{y}", "(x).z") == {"y": "z"}


# --- {x:int}: digits only ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name, binding",
    [
        ("layers.0.w", {"i": "0"}),
        ("layers.7.w", {"i": "7"}),
        ("layers.10.w", {"i": "10"}),
        ("layers.123.w", {"i": "123"}),
    ],
)
def test_int_placeholder_binds_digits(name, binding):
    assert match("layers.{i:int}.w", name) == binding


@pytest.mark.parametrize("name", ["layers.a.w", "layers.1a.w", "layers.-1.w", "layers..w", "layers.1.5.w", "layers. 1.w"])
def test_int_placeholder_rejects_non_digits(name):
    assert match("layers.{i:int}.w", name) is None


def test_int_placeholder_inside_a_segment():
    p = Pattern.parse("{p*}.weight_ih_l{k:int}")
    assert p.match("rnn.weight_ih_l12") == {"p": "rnn", "k": "12"}
    assert p.match("rnn.weight_ih_l1_reverse") is None
    assert Pattern.parse("{p*}.weight_ih_l{k:int}_reverse").match("rnn.weight_ih_l1_reverse") == {
        "p": "rnn",
        "k": "1",
    }


def test_int_placeholder_next_to_segment_placeholder_in_one_segment():
    # "{a}_{b:int}" is unambiguous: {b} may only take the trailing digits
    assert match("{a}_{b:int}", "x_y_1") == {"a": "x_y", "b": "1"}
    assert match("{a}_{b:int}", "x_y") is None


# --- {x*}: zero or more whole segments, with the vanishing dot ---------------------------


@pytest.mark.parametrize(
    "name, binding",
    [
        ("weight_ih_l0", {"p": "", "k": "0"}),  # dot at the start vanishes
        ("rnn.weight_ih_l0", {"p": "rnn", "k": "0"}),
        ("enc.rnn.weight_ih_l0", {"p": "enc.rnn", "k": "0"}),
        ("a.b.c.d.weight_ih_l3", {"p": "a.b.c.d", "k": "3"}),
    ],
)
def test_multi_at_start(name, binding):
    assert match("{p*}.weight_ih_l{k:int}", name) == binding


@pytest.mark.parametrize("name", [".weight_ih_l0", "rnn..weight_ih_l0", "rnnweight_ih_l0", "rnn.weight_ih_lx"])
def test_multi_at_start_rejects(name):
    assert match("{p*}.weight_ih_l{k:int}", name) is None


@pytest.mark.parametrize(
    "name, binding",
    [
        ("model.w", {"m": ""}),  # dot in the middle vanishes: one dot stays
        ("model.x.w", {"m": "x"}),
        ("model.x.y.z.w", {"m": "x.y.z"}),
    ],
)
def test_multi_in_middle(name, binding):
    assert match("model.{m*}.w", name) == binding


@pytest.mark.parametrize("name", ["model..w", "modelw", "model.w.", ".model.w", "model.x..w"])
def test_multi_in_middle_rejects(name):
    assert match("model.{m*}.w", name) is None


@pytest.mark.parametrize(
    "name, binding",
    [
        ("model", {"s": ""}),  # dot at the end vanishes
        ("model.a", {"s": "a"}),
        ("model.a.b", {"s": "a.b"}),
    ],
)
def test_multi_at_end(name, binding):
    assert match("model.{s*}", name) == binding


@pytest.mark.parametrize("name", ["model.", "models", "model..a", "xmodel.a"])
def test_multi_at_end_rejects(name):
    assert match("model.{s*}", name) is None


def test_multi_alone_matches_any_dotted_name():
    assert match("{p*}", "a.b.c") == {"p": "a.b.c"}
    assert match("{p*}", "a") == {"p": "a"}
    assert match("{p*}", "a..b") is None


def test_multi_with_following_segment_placeholder():
    assert match("{p*}.{leaf}", "a.b.c") == {"p": "a.b", "leaf": "c"}
    assert match("{p*}.{leaf}", "c") == {"p": "", "leaf": "c"}
    assert match("{a}.{m*}.{c}", "x.y") == {"a": "x", "m": "", "c": "y"}
    assert match("{a}.{m*}.{c}", "x.k.l.y") == {"a": "x", "m": "k.l", "c": "y"}


# --- repeated placeholders bind the same text -------------------------------------------


def test_repeated_placeholder_binds_same_text():
    p = Pattern.parse("{x}.{x}")
    assert p.match("a.a") == {"x": "a"}
    assert p.match("a.b") is None
    q = Pattern.parse("layers.{i:int}.sub.{i:int}.w")
    assert q.match("layers.3.sub.3.w") == {"i": "3"}
    assert q.match("layers.3.sub.4.w") is None
    assert q.match("layers.3.sub.33.w") is None


# --- format -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pattern, binding, name",
    [
        ("{p*}.weight_ih_l{k:int}", {"p": "", "k": "1"}, "weight_ih_l1"),
        ("{p*}.weight_ih_l{k:int}", {"p": "enc.rnn", "k": "1"}, "enc.rnn.weight_ih_l1"),
        ("model.{m*}.w", {"m": ""}, "model.w"),
        ("model.{m*}.w", {"m": "a.b"}, "model.a.b.w"),
        ("model.{s*}", {"s": ""}, "model"),
        ("model.{s*}", {"s": "x"}, "model.x"),
        ("{p*}.{leaf}", {"p": "", "leaf": "bias"}, "bias"),
        ("{x}.{x}", {"x": "q"}, "q.q"),
        ("a.{x}_proj.{i:int}", {"x": "q", "i": "12"}, "a.q_proj.12"),
        ("plain.name", {}, "plain.name"),
    ],
)
def test_format(pattern, binding, name):
    assert Pattern.parse(pattern).format(binding) == name


def test_format_ignores_extra_keys_and_needs_every_placeholder():
    p = Pattern.parse("a.{x}")
    assert p.format({"x": "b", "unused": "z"}) == "a.b"
    with pytest.raises((KeyError, RuleError)):
        p.format({})


@st.composite
def pattern_and_binding(draw):
    """A pattern of literal and placeholder segments plus a binding whose values cannot
    collide with the literals, so the name it formats has exactly one binding."""
    multi_at = draw(st.integers(-1, 3))  # where {m*} goes, -1: nowhere
    n_segments = draw(st.integers(1, 4))
    segments: list[str] = []
    binding: dict[str, str] = {}
    counter = 0
    for k in range(n_segments):
        if k == multi_at:
            segments.append("{m*}")
            binding["m"] = ".".join(draw(st.lists(st.text("xyz", min_size=1, max_size=3), max_size=3)))
        kind = draw(st.sampled_from(["lit", "seg", "int", "seg+lit", "lit+int", "seg+int"]))
        lit = draw(st.text("abc_", min_size=1, max_size=3))
        name = f"v{counter}"
        counter += 1
        seg_value = draw(st.text("xyz", min_size=1, max_size=3))
        int_value = draw(st.from_regex(r"[0-9]{1,3}", fullmatch=True))
        if kind == "lit":
            segments.append(lit)
        elif kind == "seg":
            segments.append(f"{{{name}}}")
            binding[name] = seg_value
        elif kind == "int":
            segments.append(f"{{{name}:int}}")
            binding[name] = int_value
        elif kind == "seg+lit":
            segments.append(f"{{{name}}}{lit}")
            binding[name] = seg_value
        elif kind == "lit+int":
            segments.append(f"{lit}{{{name}:int}}")
            binding[name] = int_value
        else:
            segments.append(f"{{{name}}}_{{{name}i:int}}")
            binding[name] = seg_value
            binding[f"{name}i"] = int_value
    if multi_at >= n_segments:
        segments.append("{m*}")
        binding["m"] = ".".join(draw(st.lists(st.text("xyz", min_size=1, max_size=3), max_size=3)))
    return ".".join(segments), binding


@settings(max_examples=300, deadline=None)
@given(pattern_and_binding())
def test_format_then_match_round_trips(case):
    text, binding = case
    pattern = Pattern.parse(text)
    name = pattern.format(binding)
    assert ".." not in name and not name.startswith(".") and not name.endswith(".")
    assert pattern.match(name) == binding


# --- ambiguity ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "{a}_{b}",  # two free runs share one segment
        "x.{a}{b}.y",  # placeholders touch
        "{a}{b:int}",
        "{p*}.mid.{q*}",  # two multi placeholders
        "{p*}.{p*}",
        "{p*}x.w",  # {x*} not on a segment boundary
        "w.x{p*}",
        "{x:int}.{x}",  # one name, two kinds
    ],
)
def test_ambiguous_pattern_is_an_error_at_parse(text):
    with pytest.raises(RuleError) as e:
        Pattern.parse(text)
    assert text in str(e.value)


@pytest.mark.parametrize("text", ["{x", "a}", "{1x}", "{x:float}", "{}", "{x**}", "", "a.{x-y}"])
def test_malformed_pattern_is_an_error(text):
    with pytest.raises(RuleError):
        Pattern.parse(text)


def test_non_string_pattern_is_an_error():
    with pytest.raises(RuleError):
        Pattern.parse(3)  # type: ignore[arg-type]


def test_name_that_binds_two_ways_is_an_error_at_match():
    # "w{a}1{b:int}" loads, but "wx111" is {a}=x1,{b}=1 or {a}=x,{b}=11
    p = Pattern.parse("w{a}1{b:int}")
    assert p.match("wx12") == {"a": "x", "b": "2"}
    with pytest.raises(RuleError) as e:
        p.match("wx111")
    assert "wx111" in str(e.value)
    assert "w{a}1{b:int}" in str(e.value)


def test_pattern_names_and_placeholders():
    p = Pattern.parse("{p*}.layers.{i:int}.{m}_proj.{i:int}")
    assert p.names == frozenset({"p", "i", "m"})
    assert [(x.name, x.kind) for x in p.placeholders] == [
        ("p", "multi"),
        ("i", "int"),
        ("m", "seg"),
        ("i", "int"),
    ]
    assert str(p) == "{p*}.layers.{i:int}.{m}_proj.{i:int}"


# --- index arithmetic: {n+K} / {n-K} next to {n:int} -------------------------------------


def test_module_examples_hold():
    import doctest

    import fusectl.rules.patterns as patterns

    failed, tried = doctest.testmod(patterns)
    assert tried >= 8 and failed == 0


@pytest.mark.parametrize(
    "pattern, name, binding",
    [
        ("{p*}.{n+1}.running_mean", "cnn.1.running_mean", {"p": "cnn", "n": "0"}),
        ("{p*}.{n+1}.running_mean", "cnn.10.running_mean", {"p": "cnn", "n": "9"}),
        ("{p*}.{n+1}.running_mean", "1.running_mean", {"p": "", "n": "0"}),
        ("{p*}.{n-1}.x", "a.b.9.x", {"p": "a.b", "n": "10"}),
        ("{p*}.{n-1}.x", "0.x", {"p": "", "n": "1"}),
        ("l{n+12}", "l12", {"n": "0"}),
        ("blocks.{i:int}.to.{i+1}", "blocks.3.to.4", {"i": "3"}),
        ("blocks.{i+1}.from.{i:int}", "blocks.4.from.3", {"i": "3"}),
    ],
)
def test_offset_binds_the_index_it_shifts_from(pattern, name, binding):
    assert match(pattern, name) == binding


def test_offset_with_int_and_two_offsets_in_one_pattern_must_agree():
    p = Pattern.parse("b.{i:int}.{i+1}.{i+2}")
    assert p.match("b.7.8.9") == {"i": "7"}
    assert p.match("b.7.8.10") is None
    assert p.match("b.7.9.9") is None
    assert Pattern.parse("x{i+1}.y{i+2}").match("x3.y4") == {"i": "2"}
    assert Pattern.parse("x{i+1}.y{i+2}").match("x3.y5") is None
    # {n:int} keeps its own text; the shifted copy compares by value
    assert match("blocks.{i:int}.to.{i+1}", "blocks.09.to.10") == {"i": "09"}


@pytest.mark.parametrize(
    "pattern, name",
    [
        ("{p*}.{n+1}.running_mean", "cnn.0.running_mean"),  # n = -1 is no index
        ("{p*}.{n+2}.running_mean", "cnn.1.running_mean"),
        ("{p*}.{n+1}.running_mean", "cnn.01.running_mean"),  # leading zero: not canonical
        ("{p*}.{n+1}.running_mean", "cnn.00.running_mean"),
        ("{p*}.{n-1}.x", "a.007.x"),
        ("{p*}.{n+1}.running_mean", "cnn.a.running_mean"),
        ("{p*}.{n+1}.running_mean", "cnn.-1.running_mean"),
        ("{p*}.{n+1}.running_mean", "cnn..running_mean"),
        ("{p*}.{n+1}.running_mean", "cnn.1.weight"),
        ("blocks.{i:int}.to.{i+1}", "blocks.3.to.3"),
        ("blocks.{i:int}.to.{i+1}", "blocks.3.to.5"),
        ("blocks.{i:int}.to.{i-1}", "blocks.0.to.0"),
    ],
)
def test_offset_mismatch_is_no_match(pattern, name):
    assert match(pattern, name) is None


@pytest.mark.parametrize(
    "pattern, binding, name",
    [
        ("{p*}.{n+1}.running_mean", {"p": "cnn", "n": "4"}, "cnn.5.running_mean"),
        ("{p*}.{n+1}.running_mean", {"p": "", "n": "9"}, "10.running_mean"),
        ("{p*}.{n-1}.x", {"p": "a", "n": "10"}, "a.9.x"),
        ("{p*}.{n-3}.x", {"p": "a", "n": "3"}, "a.0.x"),
        ("b.{i:int}.{i+1}", {"i": "007"}, "b.007.8"),
        ("l{n+999}", {"n": "1"}, "l1000"),
    ],
)
def test_offset_format_writes_the_shifted_index(pattern, binding, name):
    assert Pattern.parse(pattern).format(binding) == name


def test_offset_format_below_zero_is_a_plan_error():
    with pytest.raises(PlanError) as e:
        Pattern.parse("{p*}.{n-1}.weight").format({"p": "cnn", "n": "0"})
    assert "{n-1}" in str(e.value) and "negative" in str(e.value) and "{p*}.{n-1}.weight" in str(e.value)


def test_offset_on_a_very_long_index_does_not_hit_int_limits():
    digits = "9" * 5000  # past Python's 4300-digit int() limit
    assert Pattern.parse("a.{n+1}").match("a.1" + "0" * 5000) == {"n": digits}
    assert Pattern.parse("a.{n+1}").format({"n": digits}) == "a.1" + "0" * 5000
    assert Pattern.parse("a.{n:int}.{n+1}").match(f"a.{digits}.1{'0' * 5000}") == {"n": digits}


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**30), st.integers(-999, 999).filter(bool), st.sampled_from(["", "enc", "a.b"]))
def test_offset_format_then_match_round_trips(n, k, prefix):
    text = f"{{p*}}.x{{n:int}}.y{{n{k:+d}}}"
    p = Pattern.parse(text)
    binding = {"p": prefix, "n": str(n)}
    if n + k < 0:
        with pytest.raises(PlanError):
            p.format(binding)
        return
    name = p.format(binding)
    assert name.endswith(f"x{n}.y{n + k}")
    assert p.match(name) == binding
    assert Pattern.parse(f"{{p*}}.y{{n{k:+d}}}").match(name.replace(f"x{n}.", "")) == binding


@pytest.mark.parametrize(
    "text, expect",
    [
        ("{p*+1}.w", "stands for segments"),
        ("a.{n:int+1}", "write {n+1}"),
        ("a.{n+0}", "write {n:int}"),
        ("a.{n-00}", "write {n:int}"),
        ("a.{n+01}", "offset '01'"),
        ("a.{n+1000}", "from 1 to 999"),
        ("a.{n}.{n+1}", "{n+1} shifts a whole number, but {n} binds 'n' as text; write {n:int}"),
        ("{n*}.{n+1}", "{n+1} shifts a whole number, but {n*} binds 'n' as segments"),
        ("a.{n:int}{n+1}", "touch"),
    ],
)
def test_offset_on_text_segments_or_badly_written_is_refused_at_parse(text, expect):
    with pytest.raises(RuleError) as e:
        Pattern.parse(text)
    assert text in str(e.value) and expect in str(e.value)


@pytest.mark.parametrize("text", ["a.{n+}", "a.{n+x}", "a.{n+-1}", "a.{n +1}", "a.{+1}"])
def test_malformed_offset_is_an_error(text):
    with pytest.raises(RuleError) as e:
        Pattern.parse(text)
    assert "{n+1}" in str(e.value)


def test_offset_placeholders_count_as_their_name():
    p = Pattern.parse("{p*}.{n+1}.{n-2}.w")
    assert p.names == frozenset({"p", "n"})
    assert [(x.name, x.kind, x.offset) for x in p.placeholders] == [
        ("p", "multi", 0), ("n", "int", 1), ("n", "int", -2)]


def test_name_that_binds_two_ways_with_an_offset_is_an_error_at_match():
    p = Pattern.parse("w{a}1{n+1}")
    assert p.match("wx12") == {"a": "x", "n": "1"}
    with pytest.raises(RuleError) as e:
        p.match("wx111")
    assert "wx111" in str(e.value) and "w{a}1{n+1}" in str(e.value)
