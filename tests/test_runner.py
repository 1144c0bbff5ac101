"""fusectl.verification.runner: the sizes of a model's dynamic input axes (``resolve_shapes``).

Each source of a named dimension's size (``DimensionSizes``: --dim, --input, --inputs arrays,
the other model, the defaults) is tested on its own, then the precedence between them, then the
refusals. End-to-end runs through onnxruntime are in test_verify.py.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from fusectl.errors import VerifyError, cli_vocabulary
from fusectl.verification.runner import BATCH_DEFAULT, LENGTH_DEFAULT, DimensionSizes, resolve_shapes

MASKED = {"ids": ("batch", "seq"), "mask": ("batch", "seq")}


@pytest.fixture(autouse=True)
def command_line_words():
    """The sources are named as the command line spells them (--dim, --input, --inputs); the
    API's words (dims, shapes, inputs) are tested once, below."""
    with cli_vocabulary():
        yield


def test_through_the_api_the_sources_are_its_keyword_arguments():
    """A new thread starts outside the fixture's vocabulary: there the API's words are used."""
    def message(**sources) -> str:
        try:
            resolve_shapes(MASKED, **sources)
        except VerifyError as e:
            return str(e)
        raise AssertionError("resolve_shapes did not refuse")

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert pool.submit(message, shapes={"idz": (1, 2)}).result().startswith("shapes idz: the model has no input")
        assert pool.submit(message, dims={"sequence": 3}).result().startswith("dims sequence: the model has no dynamic")
    assert message(shapes={"idz": (1, 2)}).startswith("--input idz:")


def fails(needle: str, declared=MASKED, **sources) -> str:
    with pytest.raises(VerifyError) as e:
        resolve_shapes(declared, **sources)
    message = str(e.value)
    assert needle in message, message
    return message


# ------------------------------------------------------------------------------ each source on its own
def test_dim_option_sizes_every_input_that_uses_it():
    sizes = DimensionSizes(MASKED, dims={"seq": 7})
    sizes.from_dim_options()
    assert sizes.values == {"seq": (7, "--dim seq=7", True)}
    assert resolve_shapes(MASKED, dims={"seq": 7}) == ({"ids": (2, 7), "mask": (2, 7)}, {"batch": 2, "seq": 7})


def test_input_option_gives_its_named_dims_to_the_other_inputs():
    sizes = DimensionSizes(MASKED, shapes={"ids": (3, 8)})
    sizes.from_input_options()
    assert sizes.values == {"batch": (3, "--input ids=3x8", True), "seq": (8, "--input ids=3x8", True)}
    assert resolve_shapes(MASKED, shapes={"ids": (3, 8)}) == ({"ids": (3, 8), "mask": (3, 8)}, {"batch": 3, "seq": 8})


def test_input_option_sets_a_whole_shape_with_unnamed_and_fixed_axes():
    declared = {"x": (None, 4, "seq")}
    assert resolve_shapes(declared, shapes={"x": (5, 4, 9)}) == ({"x": (5, 4, 9)}, {"seq": 9})


def test_inputs_arrays_give_their_sizes_and_are_not_made():
    sizes = DimensionSizes(MASKED, given={"ids": (4, 5)})
    sizes.from_inputs_arrays()
    assert sizes.values == {"batch": (4, "--inputs array ids", False), "seq": (5, "--inputs array ids", False)}
    assert resolve_shapes(MASKED, given={"ids": (4, 5)}) == ({"mask": (4, 5)}, {"batch": 4, "seq": 5})


def test_an_inputs_array_of_another_rank_gives_nothing():
    # its rank is refused later, with the array's dtype and shape (_check_given)
    sizes = DimensionSizes(MASKED, given={"ids": (4, 5, 6)})
    sizes.from_inputs_arrays()
    assert sizes.values == {}


def test_inputs_arrays_that_disagree_are_left_to_onnxruntime():
    shapes, dims = resolve_shapes({**MASKED, "other": ("batch",)}, given={"ids": (4, 5), "mask": (6, 5)})
    assert shapes == {"other": (4,)} and dims == {"batch": 4, "seq": 5}  # the first array's size


def test_other_model_gives_its_fixed_sizes():
    sizes = DimensionSizes(MASKED, hints={"ids": (1, None), "mask": (1, "seq")})
    sizes.from_other_model()
    assert sizes.values == {"batch": (1, "the other model", False)}
    assert resolve_shapes(MASKED, hints={"ids": (1, None)}) == ({"ids": (1, 16), "mask": (1, 16)},
                                                                {"batch": 1, "seq": 16})


def test_other_model_of_another_rank_gives_nothing():
    assert resolve_shapes(MASKED, hints={"ids": (1, 3, 5)})[1] == {"batch": 2, "seq": 16}


def test_other_model_sizes_an_unnamed_axis():
    declared = {"x": (None, None, 3)}
    assert resolve_shapes(declared, hints={"x": (7, None, 3)})[0] == {"x": (7, LENGTH_DEFAULT, 3)}
    assert resolve_shapes(declared, hints={"x": (7, 9)})[0] == {"x": (BATCH_DEFAULT, LENGTH_DEFAULT, 3)}


def test_defaults_by_the_axes_a_dimension_appears_on():
    sizes = DimensionSizes({"pos": ("sequence",), "ids": ("batch", "sequence"), "lengths": ("batch",)})
    sizes.from_defaults()
    # 'sequence' leads in pos but not in ids: 16; 'batch' leads everywhere: 2
    assert sizes.values == {"sequence": (LENGTH_DEFAULT, "default", False), "batch": (BATCH_DEFAULT, "default", False)}
    assert (BATCH_DEFAULT, LENGTH_DEFAULT) == (2, 16)


def test_defaults_of_unnamed_axes_by_position():
    assert resolve_shapes({"u": (None, None, 3)}) == ({"u": (2, 16, 3)}, {})
    assert resolve_shapes({"scalar": ()}) == ({"scalar": ()}, {})


def test_the_dims_returned_are_every_named_dimension_in_order_of_first_use():
    declared = {"a": ("z", "y"), "b": ("x", "z")}
    assert list(resolve_shapes(declared)[1]) == ["z", "y", "x"]


# ------------------------------------------------------------------------------ precedence
def test_dim_option_wins_over_the_other_model_and_the_defaults():
    sizes = DimensionSizes(MASKED, dims={"batch": 3}, hints={"ids": (5, 6)})
    assert sizes.resolve() == ({"ids": (3, 6), "mask": (3, 6)}, {"batch": 3, "seq": 6})
    assert sizes.values["batch"] == (3, "--dim batch=3", True) and sizes.values["seq"] == (6, "the other model", False)


def test_an_inputs_array_wins_over_the_other_model():
    shapes, dims = resolve_shapes(MASKED, given={"ids": (4, 5)}, hints={"mask": (7, 8)})
    assert shapes == {"mask": (4, 5)} and dims == {"batch": 4, "seq": 5}  # onnxruntime then names the clash


def test_options_that_agree_are_fine():
    assert resolve_shapes(MASKED, shapes={"ids": (3, 8)}, dims={"seq": 8})[1] == {"batch": 3, "seq": 8}
    assert resolve_shapes(MASKED, shapes={"ids": (3, 8), "mask": (3, 8)})[0] == {"ids": (3, 8), "mask": (3, 8)}


def test_an_input_option_that_disagrees_with_a_dim_option_names_both():
    message = fails("--input ids=3x8 sets dimension 'seq' to 8, but --dim seq=9 sets it to 9", shapes={"ids": (3, 8)},
                    dims={"seq": 9})
    assert message.endswith("give one size per named dimension")


def test_two_input_options_that_disagree_name_both():
    fails("--input mask=4x8 sets dimension 'batch' to 4, but --input ids=3x8 sets it to 3",
          shapes={"ids": (3, 8), "mask": (4, 8)})


def test_an_inputs_array_that_disagrees_with_an_option_names_both():
    fails("--inputs array mask sets dimension 'batch' to 5, but --input ids=3x8 sets it to 3",
          shapes={"ids": (3, 8)}, given={"mask": (5, 8)})
    fails("--inputs array ids sets dimension 'seq' to 8, but --dim seq=4 sets it to 4", dims={"seq": 4},
          given={"ids": (2, 8)})


def test_resolve_asks_the_sources_in_their_documented_order():
    asked = []

    class Recording(DimensionSizes):
        pass

    for method in ("check_names", "from_dim_options", "from_input_options", "from_inputs_arrays", "from_other_model",
                   "from_defaults"):
        def record(self, _method=method):
            asked.append(_method)
            getattr(DimensionSizes, _method)(self)
        setattr(Recording, method, record)
    assert Recording(MASKED).resolve() == ({"ids": (2, 16), "mask": (2, 16)}, {"batch": 2, "seq": 16})
    assert asked == ["check_names", "from_dim_options", "from_input_options", "from_inputs_arrays", "from_other_model",
                     "from_defaults"]


# ------------------------------------------------------------------------------ refusals
def test_an_input_option_the_model_lacks():
    fails("--input idz: the model has no input named 'idz'; its inputs are ids, mask", shapes={"idz": (1, 2)})
    fails("--input x: the model has no input named 'x'; its inputs are none", declared={}, shapes={"x": (1,)})


def test_a_dim_option_the_model_lacks():
    fails("--dim sequence: the model has no dynamic dimension named 'sequence'; its named dimensions are batch, seq",
          dims={"sequence": 4})
    fails("its named dimensions are none (set whole shapes with --input NAME=D0xD1...)", declared={"x": (None, 3)},
          dims={"b": 1})


def test_an_unknown_input_is_named_before_an_unknown_dim():
    fails("--input idz:", shapes={"idz": (1,)}, dims={"nope": 1})


def test_an_input_given_both_ways():
    fails("--input ids: --inputs already gives this input; give it one way", shapes={"ids": (1, 2)},
          given={"ids": (1, 2)})


def test_an_input_option_of_the_wrong_rank_or_fixed_size():
    declared = {"ids": ("batch", 4)}
    fails("--input ids=3: the model's input ids has 2 dimensions, not 1", declared=declared, shapes={"ids": (3,)})
    fails("--input ids=3x5: axis 1 of ids is fixed at 4 in the model; give 4 there", declared=declared,
          shapes={"ids": (3, 5)})
    fails("--input ids=3x5: encoder.onnx's input ids", declared={"ids": (7,)}, shapes={"ids": (3, 5)},
          what="encoder.onnx")


def test_names_from_a_model_or_an_option_are_escaped():
    hostile = "x\x1b[31m"
    message = fails("--dim x\\x1b[31m", dims={hostile: 1})
    assert "\x1b" not in message
    message = fails("--input x\\x1b[31m", shapes={hostile: (1,)})
    assert "\x1b" not in message
