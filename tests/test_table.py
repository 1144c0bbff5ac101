"""The parameter table (table.py): tie groups, the unique name a group is stored under, what an
output writes, and the edits steps make (remove, add, tie) — a tie of different specs refused."""

from __future__ import annotations

import numpy as np
import pytest

from fusectl.dtypes import BY_NAME
from fusectl.errors import TieError
from fusectl.table import ParamTable
from fusectl.tensors import ArrayTensor, TensorSpec


def tensor(shape=(2,), dtype="F32"):
    spec = TensorSpec(BY_NAME[dtype], shape)
    return ArrayTensor(spec, np.zeros(shape, BY_NAME[dtype].numpy))


def tied_table():
    """emb/head/out tied (emb alone stored), plus an untied bias."""
    shared, bias = tensor(), tensor((3,))
    return ParamTable({"head.weight": shared, "emb.weight": shared, "out.weight": shared, "bias": bias},
                      {"emb.weight", "bias"}), shared, bias


def test_from_stored_is_untied_and_every_name_stored():
    a, b = tensor(), tensor((4,))
    table = ParamTable.from_stored({"b": b, "a": a})
    assert table.names() == ["a", "b"]
    assert table.stored == {"a", "b"}
    assert table.ties() == []
    assert table.unique() == [("a", a), ("b", b)]
    assert "a" in table and "c" not in table
    assert table["b"] is b
    assert table.spec("b") == TensorSpec(BY_NAME["F32"], (4,))


def test_spec_of_an_absent_name_is_a_key_error():
    with pytest.raises(KeyError):
        ParamTable().spec("missing")


def test_ties_and_aliases_are_sorted():
    table, shared, bias = tied_table()
    assert table.ties() == [["emb.weight", "head.weight", "out.weight"]]
    assert table.aliases_of("out.weight") == ["emb.weight", "head.weight", "out.weight"]
    assert table.aliases_of("bias") == ["bias"]
    assert sorted(table.groups().values()) == [["bias"], ["emb.weight", "head.weight", "out.weight"]]


def test_the_unique_name_is_a_stored_member_before_the_first_sorted():
    shared = tensor()
    table = ParamTable({"a.weight": shared, "z.weight": shared}, {"z.weight"})
    assert table.unique_name("a.weight") == "z.weight"
    assert table.unique_names() == {"a.weight": "z.weight", "z.weight": "z.weight"}
    # none stored (names recovered from a plan): the first sorted
    unstored = ParamTable({"b": shared, "a": shared}, set())
    assert unstored.unique_name("b") == "a"
    # several stored: the first sorted of them
    both = ParamTable({"c": shared, "b": shared, "a": shared}, {"b", "c"})
    assert both.unique_name("a") == "b"


def test_unique_lists_each_parameter_once_in_unique_name_order():
    table, shared, bias = tied_table()
    assert table.unique() == [("bias", bias), ("emb.weight", shared)]


def test_written_keeps_every_stored_member_of_a_tie():
    shared = tensor()
    # a tie adopted from equal content over two stored names: both stay in the output
    table = ParamTable({"a": shared, "b": shared, "c": shared}, {"a", "b"})
    assert [name for name, _ in table.written()] == ["a", "b"]
    assert all(t is shared for _, t in table.written())
    table.store_once()
    assert table.stored == {"a"}
    assert [name for name, _ in table.written()] == ["a"]


def test_groups_are_recomputed_after_each_edit():
    table, shared, bias = tied_table()
    assert table.ties()  # cached now
    table.remove(["head.weight", "out.weight"])
    assert table.ties() == []
    assert "head.weight" not in table
    table.add({"lm_head.weight": shared})
    assert table.ties() == [["emb.weight", "lm_head.weight"]]
    table.tie(["bias2"], keep="bias")  # a new name tied to an existing one
    assert table.aliases_of("bias2") == ["bias", "bias2"]


def test_remove_forgets_the_stored_mark():
    table, _, _ = tied_table()
    table.remove(["emb.weight"])
    assert "emb.weight" not in table.stored
    assert table.unique_name("head.weight") == "head.weight"
    with pytest.raises(KeyError):
        table.remove(["emb.weight"])  # gone already


def test_tie_makes_every_name_share_keeps_tensor():
    a, b = tensor(), tensor()
    table = ParamTable.from_stored({"a": a, "b": b})
    table.tie(["a", "b"], keep="a")
    assert table["b"] is a
    assert table.ties() == [["a", "b"]]


def test_a_tie_of_different_specs_is_refused_naming_both():
    table = ParamTable.from_stored({"emb.weight": tensor((2,)), "head.weight": tensor((3,), "BF16")})
    with pytest.raises(TieError) as err:
        table.tie(["emb.weight", "head.weight"], keep="emb.weight")
    message = str(err.value)
    assert "'head.weight'" in message and "'emb.weight'" in message
    assert "tie ['emb.weight', 'head.weight']" in message


def test_copy_is_independent():
    table, shared, _ = tied_table()
    twin = table.copy()
    twin.remove(["bias"])
    twin.store_once()
    assert "bias" in table and "bias" in table.stored
    assert twin.names() == ["emb.weight", "head.weight", "out.weight"]
    assert twin["emb.weight"] is shared
