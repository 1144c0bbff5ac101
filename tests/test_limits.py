"""Budgets on sizes from untrusted files (limits.py): the default, the environment variable that
raises it, a bad value of that variable, and the message a file past a budget gets. The
readers' own budgets are tested with the reader they guard (test_hostile_readers.py,
test_pickle_amplification.py, test_hostile_rules.py)."""

from __future__ import annotations

import pytest

from fusectl.errors import CheckpointError, FusectlError, RuleError
from fusectl.limits import LIMITS, check_limit, limit


def test_each_limit_has_a_variable_named_for_its_key():
    assert LIMITS["header-bytes"].variable == "FUSECTL_MAX_HEADER_BYTES"
    assert LIMITS["pickle-hash-keys"].variable == "FUSECTL_MAX_PICKLE_HASH_KEYS"
    assert len({spec.variable for spec in LIMITS.values()}) == len(LIMITS)
    assert all(spec.default >= 1 and spec.what for spec in LIMITS.values())


def test_the_default_holds_without_the_variable(monkeypatch):
    monkeypatch.delenv("FUSECTL_MAX_DIMS", raising=False)
    assert LIMITS["dims"].default == 64
    assert limit("dims") == min(64, _numpy_most_dims())


def test_the_variable_replaces_the_default(monkeypatch):
    monkeypatch.setenv("FUSECTL_MAX_DIMS", "3")
    assert limit("dims") == 3
    check_limit("dims", 3, "m.safetensors")
    with pytest.raises(CheckpointError) as e:
        check_limit("dims", 4, "m.safetensors")
    assert str(e.value) == ("m.safetensors: 4 dimensions of one tensor exceeds fusectl's limit of 3; "
                            "if the file is genuine, raise it with FUSECTL_MAX_DIMS=4")


@pytest.mark.parametrize("raw, says", [("lots", "is not a whole number"), ("0", "must be at least 1"),
                                       ("-5", "must be at least 1")])
def test_a_bad_variable_is_an_error_naming_it(monkeypatch, raw, says):
    monkeypatch.setenv("FUSECTL_MAX_TENSORS", raw)
    with pytest.raises(FusectlError) as e:
        limit("tensors")
    assert "FUSECTL_MAX_TENSORS" in str(e.value) and repr(raw) in str(e.value) and says in str(e.value)


def test_the_value_at_the_budget_passes_and_one_more_is_refused_with_the_error_asked_for():
    budget = limit("expression-chars")
    check_limit("expression-chars", budget, "rules.toml", RuleError)
    with pytest.raises(RuleError, match=r"rules\.toml: .* raise it with FUSECTL_MAX_EXPRESSION_CHARS="):
        check_limit("expression-chars", budget + 1, "rules.toml", RuleError)


def test_an_unknown_key_is_a_bug_not_a_budget():
    with pytest.raises(KeyError):
        limit("no-such-limit")


def _numpy_most_dims() -> int:
    import numpy as np

    return 64 if int(np.__version__.split(".")[0]) >= 2 else 32


def test_a_raised_dims_budget_stops_at_what_numpy_holds(monkeypatch):
    """numpy 1.x holds 32 dimensions, numpy 2 holds 64: past that an array cannot be made, so
    the budget stops there and the refusal names numpy, not the variable."""
    import numpy as np

    most = _numpy_most_dims()
    monkeypatch.setenv("FUSECTL_MAX_DIMS", "100")
    assert limit("dims") == most
    check_limit("dims", most, "m.safetensors")
    with pytest.raises(CheckpointError) as e:
        check_limit("dims", most + 1, "m.safetensors")
    assert str(e.value).startswith(f"m.safetensors: {most + 1} dimensions of one tensor, but numpy "
                                   f"{np.__version__} holds at most {most}")
    assert "FUSECTL_MAX_DIMS" not in str(e.value)
