"""io/placement.py: which parameter each optimizer id is, by shapes, within the order-search budget.

Every answer (none, one, two placements) is checked against an independent brute force on small
random cases; one parameter per param group (per-parameter learning rates, issue 28) is decided
by the matching in a handful of steps, proven or refused; a search that would pass the budget
is refused before it does the work.
"""

from __future__ import annotations

import random

import pytest

from fusectl.dtypes import BY_NAME
from fusectl.errors import CheckpointError
from fusectl.io import placement
from fusectl.io.placement import SearchTooLarge, place, possible_positions
from fusectl.tensors import TensorSpec

F32 = BY_NAME["F32"]


def sequence(shapes):
    return [(f"t{k}", TensorSpec(F32, s)) for k, s in enumerate(shapes)]


def brute(groups, shapes, seq, most=3):
    """Every placement (up to ``most``), by trying each tensor for each group's next id."""
    n, ids = len(seq), sum(map(len, groups))
    found = []

    def walk(k, placed, chosen):
        if len(found) >= most:
            return
        if k == n:
            if all(placed[g] == len(group) for g, group in enumerate(groups)):
                found.append(dict(chosen))
            return
        if k - sum(placed) < n - ids:
            walk(k + 1, placed, chosen)
        for g, group in enumerate(groups):
            j = placed[g]
            if j < len(group) and shapes[group[j]] in (None, seq[k][1].shape):
                placed[g] += 1
                chosen[group[j]] = seq[k][0]
                walk(k + 1, placed, chosen)
                placed[g] -= 1
                del chosen[group[j]]

    walk(0, [0] * len(groups), {})
    return found


def is_placement(groups, shapes, seq, names) -> bool:
    at = {name: k for k, (name, _) in enumerate(seq)}
    if len(set(names.values())) != len(names) or set(names) != {p for g in groups for p in g}:
        return False
    for group in groups:
        positions = [at[names[p]] for p in group]
        if positions != sorted(set(positions)):
            return False
        if any(shapes[p] not in (None, seq[at[names[p]]][1].shape) for p in group):
            return False
    return True


@pytest.mark.parametrize("seed", range(4))
def test_none_one_or_two_placements_as_a_brute_force_finds_them(seed):
    rng = random.Random(seed)
    for _ in range(400):
        count, slack = rng.randint(1, 7), rng.randint(0, 3)
        shapes_at = [rng.choice([(1,), (2,), (3,)]) for _ in range(count + slack)]
        seq = sequence(shapes_at)
        groups, shapes = [[] for _ in range(rng.randint(1, 4))], {}
        for pid, k in enumerate(sorted(rng.sample(range(len(seq)), count))):
            rng.choice(groups).append(pid)
            shapes[pid] = None if rng.random() < 0.2 else shapes_at[k]
        groups = [g for g in groups if g]
        if rng.random() < 0.2:
            rng.shuffle(seq)  # often no placement then
        want = brute(groups, shapes, seq)
        got = place(groups, shapes, seq)
        if not want:
            assert got.names is None
        elif len(want) == 1:
            assert got.names == want[0] and got.second is None
        else:
            assert got.second is not None and got.names != got.second
            assert is_placement(groups, shapes, seq, got.names) and is_placement(groups, shapes, seq, got.second)


def test_one_parameter_per_group_is_proven_by_distinct_shapes_in_a_few_steps(monkeypatch):
    shapes_at = [(k + 1, 3) for k in range(75)]
    groups = [[k] for k in range(75)]
    # the budget of a handful of steps per id: a search that tried the groups' subsets would pass it
    monkeypatch.setenv("FUSECTL_MAX_ORDER_SEARCH", str(20 * 75))
    got = place(groups, {k: s for k, s in enumerate(shapes_at)}, sequence(shapes_at))
    assert got.names == {k: f"t{k}" for k in range(75)} and got.second is None


def test_one_parameter_per_group_with_equal_shapes_is_two_placements_in_a_few_steps(monkeypatch):
    shapes_at = [(8,) if k % 3 else (8, 8) for k in range(75)]
    # a few steps per pair of ids that could trade places: polynomial, not the groups' 2**75 subsets
    monkeypatch.setenv("FUSECTL_MAX_ORDER_SEARCH", str(4 * 75 * 75))
    got = place([[k] for k in range(75)], {k: s for k, s in enumerate(shapes_at)}, sequence(shapes_at))
    assert got.second is not None and got.names != got.second


def test_a_search_past_its_budget_is_refused_before_it_does_the_work(monkeypatch):
    # two groups of ids without state among buffers: the count would hold thousands of states
    groups = [list(range(0, 30)), list(range(30, 60))]
    shapes = dict.fromkeys(range(60))
    seq = sequence([(1,)] * 70)
    search = placement._Search(groups, shapes, seq, "f.pt: optimizer state 'opt'")
    monkeypatch.setenv("FUSECTL_MAX_ORDER_SEARCH", "5000")
    search.budget = placement.limit("order-search")
    with pytest.raises(SearchTooLarge) as e:
        search.count(search.domains())
    assert search.spent <= 5000 + 200  # one state's price past the budget at most, never a layer's
    assert isinstance(e.value, CheckpointError)
    assert "f.pt: optimizer state 'opt'" in str(e.value) and "FUSECTL_MAX_ORDER_SEARCH" in str(e.value)


def test_possible_positions_hold_every_placement_and_leave_out_tensors_no_id_fits():
    groups, shapes = [[0, 1], [2]], {0: (4, 4), 1: (4,), 2: (4,)}
    seq = sequence([(4, 4), (7,), (4,), (3, 3), (4,)])
    found = possible_positions(groups, shapes, seq)
    assert found == {0, 2, 4}
    assert possible_positions([[0]], {0: (5,)}, seq) is None
