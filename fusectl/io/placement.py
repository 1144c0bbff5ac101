"""Which parameter each optimizer id is, proven by shapes: a bounded search.

torch.optim numbers its parameters group by group, each group in the order it was given them.
A training dict keeps the model's tensors in a sequence (the state dict's order, or an order
file), with buffers among them. A *placement* puts each group's ids, in their order, on tensors
of that sequence at increasing positions — groups interleave freely, buffers are skipped —
each id on a tensor shaped like its state (an id without shaped state fits any tensor). The
ids are proven only when exactly one placement exists.

Deciding that is NP-hard in general (a sequence as a shuffle of many sequences), so the search
is staged, each stage polynomial or bounded before it works:

1. each id's *domain*: the positions it can take in its own group's chain alone (the earliest
   and the latest greedy fit, then the tensors of its shape between them) — a sound superset of
   where any placement puts it, its size known before a list is built;
2. a matching of ids to positions within their domains (Hopcroft–Karp): none means no
   placement; when the matching is unique (no alternating cycle, no id that could move to a
   skipped tensor) and keeps each group in order, it is the one placement. One parameter per
   group (per-parameter learning rates) is exactly this case: no order ties its ids, so the
   matching decides it in near-linear time, and a second matching that also keeps the groups'
   order is a proof of ambiguity;
3. otherwise, a count (up to two) of the placements by dynamic programming over the sequence,
   its transitions restricted to the domains, whose every state is paid for from the
   ``order-search`` budget before it is made.

Every stage spends from one budget (``limits``: ``order-search``), so a hostile file is refused
within it, and an honest one past it is told how to give the order.

>>> from fusectl.dtypes import BY_NAME
>>> from fusectl.tensors import TensorSpec
>>> seq = [(n, TensorSpec(BY_NAME["F32"], s)) for n, s in [("w", (4, 2)), ("b", (4,)), ("v", (2,))]]
>>> place([[0, 1]], {0: (4, 2), 1: (2,)}, seq).names
{0: 'w', 1: 'v'}
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

from ..errors import CheckpointError
from ..limits import LIMITS, limit
from ..tensors import TensorSpec


@dataclass(frozen=True)
class Placement:
    """What the search found: ``names`` id → parameter name for the one placement; when there is
    none, ``names`` is None and ``second`` None; when two exist, ``names`` is one and
    ``second`` the other."""

    names: dict | None
    second: dict | None = None


class SearchTooLarge(CheckpointError):
    """The placement search would pass its budget (``order-search``); raised before it does."""


def place(groups: Sequence[Sequence], shapes: dict, sequence: Sequence[tuple[str, TensorSpec]],
          where: str = "the optimizer state") -> Placement:
    """The placements of ``groups`` (each a list of ids, in order) on ``sequence`` ((name, spec)
    in order), ``shapes`` id → the shape its state requires (None: any).

    :returns: a :class:`Placement`: no placement, exactly one, or two of them.
    :raises SearchTooLarge: the search would pass the ``order-search`` budget (``where`` names
        the optimizer in the message).
    """
    search = _Search(groups, shapes, sequence, where)
    domains = search.domains()
    if domains is None:
        return Placement(None)
    first = search.matching(domains)
    if first is None:
        return Placement(None)
    other = search.other_matching(domains, first)
    if other is None:  # the only matching: the one placement, if it keeps every group's order
        return Placement(search.names(first) if search.ordered(first) else None)
    if search.ordered(first) and search.ordered(other):
        return Placement(search.names(first), search.names(other))
    return search.count(domains)


def possible_positions(groups: Sequence[Sequence], shapes: dict, sequence: Sequence[tuple[str, TensorSpec]],
                       where: str = "the optimizer state") -> set[int] | None:
    """The positions of ``sequence`` that some placement could give an id (a sound superset:
    the union of the domains); None when no placement exists."""
    search = _Search(groups, shapes, sequence, where)
    domains = search.domains()
    if domains is None:
        return None
    return {q for domain in domains for q in domain}


class _Search:
    """One search, spending from one budget."""

    def __init__(self, groups, shapes, sequence, where):
        self.groups = [list(g) for g in groups]
        self.shapes = [[shapes.get(p) for p in g] for g in self.groups]
        self.sequence = list(sequence)
        self.n = len(self.sequence)
        self.where = where
        self.budget = limit("order-search")
        self.spent = 0
        self.by_shape: dict[tuple, list[int]] = {}
        for k, (_, spec) in enumerate(self.sequence):
            self.by_shape.setdefault(tuple(spec.shape), []).append(k)
        self.ids = [(g, j) for g, group in enumerate(self.groups) for j in range(len(group))]
        self.slack = self.n - len(self.ids)

    def spend(self, amount: int) -> None:
        """Pay ``amount`` steps of work before doing it; SearchTooLarge past the budget."""
        self.spent += amount
        if self.spent > self.budget:
            spec = LIMITS["order-search"]
            raise SearchTooLarge(
                f"{self.where}: proving which parameter each of its {len(self.ids)} states is from their shapes "
                f"(in {len(self.groups)} param group(s), among {self.n} tensors) takes more than fusectl's limit "
                f"of {self.budget} {spec.what}; raise it with {spec.variable}")

    # --- stage 1: domains -------------------------------------------------------------------

    def domains(self) -> list[list[int]] | None:
        """Each id's positions (in ``self.ids``' order), or None when a group's chain fits nowhere."""
        if self.slack < 0:
            return None
        self.spend(len(self.ids))
        bounds = []
        for shapes in self.shapes:
            lows, highs = self._earliest(shapes), self._latest(shapes)
            if lows is None or highs is None or any(lo > hi for lo, hi in zip(lows, highs)):
                return None
            bounds.extend(zip(lows, highs, shapes))
        sizes = [self._count(shape, lo, hi) for lo, hi, shape in bounds]
        self.spend(sum(sizes))  # the lists below hold this many positions
        domains = []
        for lo, hi, shape in bounds:
            if shape is None:
                domains.append(list(range(lo, hi + 1)))
            else:
                at = self.by_shape.get(tuple(shape), [])
                domains.append(at[bisect.bisect_left(at, lo):bisect.bisect_right(at, hi)])
        return domains if all(domains) else None

    def _earliest(self, shapes) -> list[int] | None:
        out, pos = [], -1
        for shape in shapes:
            if shape is None:
                pos += 1
            else:
                at = self.by_shape.get(tuple(shape), [])
                i = bisect.bisect_right(at, pos)
                pos = at[i] if i < len(at) else self.n
            if pos >= self.n:
                return None
            out.append(pos)
        return out

    def _latest(self, shapes) -> list[int] | None:
        out, pos = [], self.n
        for shape in reversed(shapes):
            if shape is None:
                pos -= 1
            else:
                at = self.by_shape.get(tuple(shape), [])
                i = bisect.bisect_left(at, pos) - 1
                pos = at[i] if i >= 0 else -1
            if pos < 0:
                return None
            out.append(pos)
        return out[::-1]

    def _count(self, shape, lo: int, hi: int) -> int:
        if shape is None:
            return hi - lo + 1
        at = self.by_shape.get(tuple(shape), [])
        return bisect.bisect_right(at, hi) - bisect.bisect_left(at, lo)

    # --- stage 2: matchings -----------------------------------------------------------------

    def matching(self, domains: list[list[int]]) -> list[int] | None:
        """A position for every id, each in its domain, no two alike (Hopcroft–Karp); None when
        there is none."""
        ids = len(domains)
        match_id = [-1] * ids
        owner = [-1] * self.n
        while True:
            # breadth first from the unmatched ids: each id's distance in alternating layers
            self.spend(ids + sum(len(d) for d in domains))
            dist = [-1] * ids
            queue = [a for a in range(ids) if match_id[a] < 0]
            for a in queue:
                dist[a] = 0
            found = False
            head = 0
            while head < len(queue):
                a = queue[head]
                head += 1
                for q in domains[a]:
                    b = owner[q]
                    if b < 0:
                        found = True
                    elif dist[b] < 0:
                        dist[b] = dist[a] + 1
                        queue.append(b)
            if not found:
                break
            # depth first along the layers, iteratively: each unmatched id looks for a free position
            nxt = [0] * ids
            for root in range(ids):
                if match_id[root] >= 0:
                    continue
                path = [root]
                while path:
                    a = path[-1]
                    descended = False
                    while nxt[a] < len(domains[a]):
                        q = domains[a][nxt[a]]
                        nxt[a] += 1
                        b = owner[q]
                        if b < 0:  # augment: each id of the path takes the position its successor held
                            for x in reversed(path):
                                match_id[x], owner[q], q = q, x, match_id[x]
                            path = []
                            descended = True
                            break
                        if dist[b] == dist[a] + 1:
                            path.append(b)
                            descended = True
                            break
                    if not descended:
                        dist[a] = -1  # a dead end in this phase
                        path.pop()
        if any(m < 0 for m in match_id):
            return None
        return match_id

    def other_matching(self, domains: list[list[int]], first: list[int]) -> list[int] | None:
        """Another matching than ``first``, or None when ``first`` is the only one: an id that
        could take a position no id holds, or an alternating cycle (each id of it taking the
        position of the next)."""
        owner = [-1] * self.n
        for a, q in enumerate(first):
            owner[q] = a
        self.spend(sum(len(d) for d in domains))
        group_of, first_of = [], []
        for g, group in enumerate(self.groups):
            group_of += [g] * len(group)
            first_of += [len(first_of)] * len(group)
        moved = None
        for a, domain in enumerate(domains):
            for q in domain:
                if owner[q] >= 0:
                    continue
                other = list(first)
                other[a] = q
                start, end = first_of[a], first_of[a] + len(self.groups[group_of[a]])
                if (a == start or other[a - 1] < q) and (a + 1 == end or q < other[a + 1]):
                    return other  # a skipped tensor the id could take, its group still in order
                moved = moved or other
        if moved is not None:
            return moved
        # a cycle in the graph a → b where a's domain holds b's position
        state = [0] * len(domains)  # 0 unseen, 1 on the path, 2 done
        for root in range(len(domains)):
            if state[root]:
                continue
            path, edges = [root], [iter(domains[root])]
            state[root] = 1
            while path:
                a = path[-1]
                for q in edges[-1]:
                    b = owner[q]
                    if b == a:
                        continue
                    if state[b] == 1:  # a cycle: from b along the path back to a
                        cycle = path[path.index(b):]
                        other = list(first)
                        for x, y in zip(cycle, cycle[1:] + cycle[:1]):
                            other[x] = first[y]
                        return other
                    if state[b] == 0:
                        state[b] = 1
                        path.append(b)
                        edges.append(iter(domains[b]))
                        break
                else:
                    state[a] = 2
                    path.pop()
                    edges.pop()
        return None

    def ordered(self, positions: list[int]) -> bool:
        """Whether ``positions`` (per id) keep each group's ids in increasing order."""
        i = 0
        for group in self.groups:
            row = positions[i:i + len(group)]
            i += len(group)
            if any(x >= y for x, y in zip(row, row[1:])):
                return False
        return True

    def names(self, positions: list[int]) -> dict:
        return {self.groups[g][j]: self.sequence[positions[i]][0] for i, (g, j) in enumerate(self.ids)}

    # --- stage 3: counting ------------------------------------------------------------------

    def count(self, domains: list[list[int]]) -> Placement:
        """The placements counted up to two over the sequence: a state is how many ids of each
        group are placed (one integer, group ``g``'s count its digit in base ``len(group) + 1``);
        position ``k`` goes to the next id of a group whose domain holds it, or is skipped (at
        most ``slack`` times). A layer maps each state to ``3 * placed + ways`` (ways at most 2).
        A state that left an id unplaced past its domain's last position is dropped. Each loop
        pays one step, each new state eight (its memory), before it is made."""
        radix, unit = [], 1
        for group in self.groups:
            radix.append(unit)
            unit *= len(group) + 1
        takers: list[list[tuple[int, int, int]]] = [[] for _ in range(self.n)]
        due: list[list[tuple[int, int, int]]] = [[] for _ in range(self.n)]  # ids whose domain ends at k
        for i, (g, j) in enumerate(self.ids):
            digit = (radix[g], len(self.groups[g]) + 1, j)
            for q in domains[i]:
                takers[q].append(digit)
            due[domains[i][-1]].append(digit)
        layers: list[dict] = [{0: 1}]
        for k in range(self.n):
            here: dict = {}
            for state, value in layers[-1].items():
                ways, count = value % 3, value // 3
                self.spend(1 + len(takers[k]))
                moves = [(state, count)] if k - count < self.slack else []
                moves += [(state + r, count + 1) for r, base, j in takers[k] if state // r % base == j]
                self.spend(len(due[k]) * len(moves))
                for nxt, placed in moves:
                    if any(nxt // r % base <= j for r, base, j in due[k]):
                        continue  # an id whose last position this was is still unplaced: a dead end
                    old = here.get(nxt)
                    if old is None:
                        self.spend(8)
                        here[nxt] = 3 * placed + ways
                    else:
                        here[nxt] = 3 * placed + min(2, old % 3 + ways)
            if not here:
                return Placement(None)
            layers.append(here)
        end = sum(r * len(g) for r, g in zip(radix, self.groups))
        ways = layers[-1].get(end, 0) % 3
        if ways == 0:
            return Placement(None)
        walk = self._walks(layers, domains, radix, end)
        first = next(walk)
        return Placement(first, next(walk) if ways > 1 else None)

    def _walks(self, layers, domains, radix, end):
        """The placements reaching ``end``, walked back from it (every state of ``layers`` is
        reachable from the start, so no walk is a dead end); the caller takes one or two."""
        index = {(g, j): i for i, (g, j) in enumerate(self.ids)}
        member = [set(d) for d in domains]

        def steps_back(k: int, state: int) -> list:
            prev_layer = layers[k - 1]
            out = []
            if state in prev_layer and k - 1 - prev_layer[state] // 3 < self.slack:
                out.append((state, None))
            for g, r in enumerate(radix):
                j = state // r % (len(self.groups[g]) + 1)
                if j > 0 and k - 1 in member[index[(g, j - 1)]] and state - r in prev_layer:
                    out.append((state - r, self.groups[g][j - 1]))
            return out

        stack = [(self.n, end, steps_back(self.n, end))]
        chosen: list = []
        while stack:
            k, state, options = stack[-1]
            if k == 0:
                yield {pid: name for pid, name in chosen if pid is not None}
                stack.pop()
                if chosen:
                    chosen.pop()
                continue
            if not options:
                stack.pop()
                if chosen:
                    chosen.pop()
                continue
            prev, pid = options.pop(0)
            chosen.append((pid, self.sequence[k - 1][0]))
            stack.append((k - 1, prev, steps_back(k - 1, prev) if k - 1 else []))
