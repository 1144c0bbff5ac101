"""The optimizer state of a training checkpoint, read from headers, and mapped to its parameters.

A training dict (``{"model_state_dict": …, "optimizer_state_dict": {"state", "param_groups"},
"epoch": …}``, a Lightning ``.ckpt``'s ``optimizer_states`` list) holds the optimizer's
``state_dict()`` beside the model's: per parameter *id* a dict of state (``exp_avg``,
``momentum_buffer``, a ``step``), and the ``param_groups`` whose ``params`` lists give the ids
in the order the optimizer was given its parameters, with each group's hyperparameters. Three
forms of it are read (``OptimizerState.form``): ``"ids"``, torch.optim's integer ids (0..n-1, or
the Python object ids of torch < 0.4: both mean the groups' order); ``"names"``,
torch.distributed.checkpoint's ``get_optimizer_state_dict`` (``state`` keyed by parameter name,
``params`` lists of names); and ``"flat"``, its ``flatten_optimizer_state_dict=True`` form (one
flat dict: ``state.<name>.<key>`` and ``param_groups.<name>.<hyperparameter>``, each
parameter's hyperparameters repeated, so a group is a run of parameters with equal ones).
:func:`parse_optimizer` turns that tree (dicts, lists, scalars and lazy tensors, as
``io.torch_file`` reads it) into an :class:`OptimizerState`; :func:`map_parameters` proves which
parameter each id is (:class:`ParamMap`), or says why it cannot.

>>> state = parse_optimizer({"state": {}, "param_groups": [{"params": [0], "lr": 0.1}]}, "opt", "f.pt")
>>> state.groups[0].hyper
{'lr': 0.1}
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..errors import CheckpointError, option, printable, quote
from ..followers.optimizer import SCALAR_KEYS, STATE_SEP, recognise
from ..tensors import LazyTensor, TensorSpec
from .key_path import KeyPath, key_text, node_at, replaced, without
from .placement import SearchTooLarge, place, possible_positions

# where an optimizer's state_dict sits beside the model's, in a training dict
OPTIMIZER_KEYS = ("optimizer_state_dict", "optimizer", "optimizer_state", "opt", "optim")
LIGHTNING_KEY = "optimizer_states"
FLAT_PREFIXES = ("state.", "param_groups.")  # the keys of a flattened optimizer state_dict
_MAX_NESTING = 8  # dotted parts a flattened state key may add after its parameter's name
# what gives the order, in the same words for every caller: inspect --json shows a message as data
ORDER_HOW = ("give the order of the parameters the optimizer was given: a JSON list "
             "[n for n, _ in model.named_parameters()] in a file (--param-order FILE; param_order= in the API)")


@dataclass(frozen=True)
class ParamGroup:
    """One of the optimizer's ``param_groups``: its parameter ids in order, its hyperparameters
    (JSON-able values: ``lr``, ``betas`` as a list, …) and, when the optimizer recorded them
    (``torch.optim`` with named parameters), the parameters' names."""

    params: tuple
    hyper: dict
    param_names: tuple[str, ...] | None = None


@dataclass(frozen=True)
class OptimizerState:
    """An optimizer's ``state_dict()`` as read: ``where`` its dotted key in the training dict,
    ``groups`` its param groups, ``states`` parameter id (a name in the name-keyed forms) →
    state key → a lazy tensor or a number; ``rest`` the optimizer dict's other entries (kept as
    read); ``form`` which of the three forms it was read from."""

    where: str
    groups: tuple[ParamGroup, ...]
    states: dict
    rest: dict = field(default_factory=dict)
    form: str = "ids"  # "ids", "names" or "flat" (the module docstring)

    def ids(self) -> list:
        """Every parameter id, in group order."""
        return [i for g in self.groups for i in g.params]

    def group_of(self, pid) -> int:
        """The index of the group that lists ``pid``."""
        return next(n for n, g in enumerate(self.groups) if pid in g.params)

    def keys(self) -> list[str]:
        """Every state key, in first-seen order."""
        return list(dict.fromkeys(k for s in self.states.values() for k in s))


@dataclass(frozen=True)
class ParamMap:
    """Which parameter each optimizer id is: ``names`` id → parameter name, and ``source`` where
    the order came from (``"param_names"``, ``"state keys"``, ``"state dict order"``, ``"FILE"``)."""

    names: dict
    source: str


def parse_optimizer(tree: object, where: str, path: str) -> OptimizerState:
    """The :class:`OptimizerState` of an optimizer's ``state_dict()`` read as ``tree``.

    :param tree: ``{"state": {id: {key: tensor or number}}, "param_groups": [{"params": [...], ...}]}``
        (ids integers, or parameter names), or the flattened form ``{"state.<name>.<key>": …,
        "param_groups.<name>.<hyperparameter>": …}``, with tensors as
        :class:`~fusectl.tensors.LazyTensor`.
    :param where: its dotted key in the training dict (for messages).
    :param path: the file (for messages).
    :raises CheckpointError: naming the entry that is not what ``torch.optim`` writes: a
        missing or mistyped ``state``/``param_groups``, an id listed twice, ids both integers and
        names, a state for an id no group lists, a hyperparameter that is not plain data; in the
        flattened form a key of neither kind, a state for a name no ``param_groups.`` key lists.
    """
    at = f"{printable(path)}: optimizer state {quote(where)}"
    if _looks_flat(tree):
        return _parse_flat(tree, where, at)
    if not isinstance(tree, dict) or "state" not in tree or "param_groups" not in tree:
        raise CheckpointError(f"{at}: not an optimizer's state_dict (a dict with 'state' and 'param_groups'); "
                              "name the training dict's optimizer entry or re-save it with optimizer.state_dict()")
    raw_states, raw_groups = tree["state"], tree["param_groups"]
    if not isinstance(raw_states, dict):
        raise CheckpointError(f"{at}: 'state' is {_kind(raw_states)}, not a dict of parameter id → state")
    if not isinstance(raw_groups, (list, tuple)) or not raw_groups:
        raise CheckpointError(f"{at}: 'param_groups' is {_kind(raw_groups)}, not a non-empty list of groups")
    groups, seen = [], set()
    for n, g in enumerate(raw_groups):
        gat = f"{at}: param_groups[{n}]"
        if not isinstance(g, dict) or "params" not in g:
            raise CheckpointError(f"{gat} is {_kind(g)}, not a dict with 'params'")
        params = g["params"]
        if not isinstance(params, (list, tuple)) or not all(_is_id(p) for p in params):
            raise CheckpointError(f"{gat}: 'params' is not a list of parameter ids (integers or names)")
        for p in params:
            if p in seen:
                raise CheckpointError(f"{gat}: parameter id {_shown(p)} is listed twice; the file is corrupt")
            seen.add(p)
        names = g.get("param_names")
        if names is not None:
            if not isinstance(names, (list, tuple)) or len(names) != len(params) or \
                    not all(type(x) is str for x in names):
                raise CheckpointError(f"{gat}: 'param_names' is not a list of {len(params)} names, one per id")
            names = tuple(names)
        hyper = {}
        for k, v in g.items():
            if k in ("params", "param_names"):
                continue
            if type(k) is not str:
                raise CheckpointError(f"{gat}: a hyperparameter named {_kind(k)}, not text")
            hyper[k] = _plain(v, f"{gat}: hyperparameter {quote(k)}")
        groups.append(ParamGroup(tuple(params), hyper, names))
    if len({type(p) for p in seen}) > 1:
        raise CheckpointError(f"{at}: its parameter ids are both integers and names; torch.optim writes one or "
                              "the other, so the file is corrupt or was edited")
    states = {}
    for pid, s in raw_states.items():
        if not _is_id(pid):
            raise CheckpointError(f"{at}: a state keyed by {_kind(pid)}, not a parameter id")
        if pid not in seen:
            raise CheckpointError(f"{at}: a state for parameter id {_shown(pid)}, which no param group lists; "
                                  "the optimizer dict is corrupt or was edited")
        if not isinstance(s, dict):
            raise CheckpointError(f"{at}: the state of id {_shown(pid)} is {_kind(s)}, not a dict")
        entry = {}
        for k, v in s.items():
            if type(k) is not str:
                raise CheckpointError(f"{at}: the state of id {_shown(pid)} has a key {_kind(k)}, not text")
            if not isinstance(v, LazyTensor) and type(v) not in (int, float, bool):
                raise CheckpointError(f"{at}: state {quote(k)} of id {_shown(pid)} is {_kind(v)}, "
                                      "neither a tensor nor a number")
            entry[k] = v
        states[pid] = entry
    rest = {k: v for k, v in tree.items() if k not in ("state", "param_groups")}
    form = "names" if seen and all(type(p) is str for p in seen) else "ids"
    return OptimizerState(where, tuple(groups), states, rest, form)


def is_optimizer_dict(tree: object) -> bool:
    """Whether ``tree`` is an optimizer's ``state_dict()``: with ``state`` and ``param_groups``
    (torch.optim, torch.distributed.checkpoint), or flattened (every key ``state.…`` or
    ``param_groups.…``, some of the latter)."""
    if not isinstance(tree, dict):
        return False
    if "state" in tree and "param_groups" in tree:
        return True
    return bool(tree) and all(type(k) is str and k.startswith(FLAT_PREFIXES) for k in tree) and \
        any(k.startswith("param_groups.") for k in tree)


def _looks_flat(tree: object) -> bool:
    """A dict that is meant as a flattened optimizer state_dict (a key of it says so), however
    malformed the rest: :func:`_parse_flat` says what is wrong."""
    return isinstance(tree, dict) and "state" not in tree and "param_groups" not in tree and \
        any(type(k) is str and k.startswith(FLAT_PREFIXES) for k in tree)


def _parse_flat(tree: dict, where: str, at: str) -> OptimizerState:
    """The flattened form (torch.distributed.checkpoint's ``_flatten_optim_state_dict``): each
    parameter's hyperparameters under ``param_groups.<name>.<hyperparameter>`` (the last dotted
    part: torch's group keys are identifiers), its state under ``state.<name>.<key>`` (the name
    the longest that a ``param_groups.`` key lists). A group is a run of parameters, in the
    file's order, with equal hyperparameters (the form keeps no group boundaries: torch rebuilds
    the groups from the live optimizer)."""
    how = ("a flattened optimizer state_dict holds only state.<parameter>.<key> and "
           "param_groups.<parameter>.<hyperparameter> entries")
    hypers: dict[str, dict] = {}
    state_items = []
    for k, v in tree.items():
        if type(k) is not str or not k.startswith(FLAT_PREFIXES):
            raise CheckpointError(f"{at}: the key {_shown(k) if _is_id(k) else _kind(k)} is neither a state nor a "
                                  f"param_groups entry; {how}")
        if k.startswith("param_groups."):
            name, _, hyper = k[len("param_groups."):].rpartition(".")
            if not name or not hyper:
                raise CheckpointError(f"{at}: the key {quote(k)} names no parameter and hyperparameter; {how}")
            if hyper in ("params", "param_names"):
                raise CheckpointError(f"{at}: the key {quote(k)} is a parameter list, which the flattened form "
                                      "does not hold; the file is corrupt or was edited")
            hypers.setdefault(name, {})[hyper] = _plain(v, f"{at}: hyperparameter {quote(k)}")
        else:
            state_items.append((k, v))
    if not hypers:
        raise CheckpointError(f"{at}: a flattened optimizer state_dict without param_groups.<parameter>."
                              f"<hyperparameter> entries; {how}")
    runs: list[tuple[list[str], dict]] = []
    for name, hyper in hypers.items():
        if runs and runs[-1][1] == hyper:
            runs[-1][0].append(name)
        else:
            runs.append(([name], hyper))
    states: dict[str, dict] = {}
    for k, v in state_items:
        rest = k[len("state."):]
        name = key = None
        pos = len(rest)
        for _ in range(_MAX_NESTING):  # the longest listed name first: the key is what is left
            pos = rest.rfind(".", 0, pos)
            if pos <= 0:
                break
            if rest[:pos] in hypers:
                name, key = rest[:pos], rest[pos + 1:]
                break
        if name is None:
            raise CheckpointError(f"{at}: the key {quote(k[:200])} names no parameter that a param_groups."
                                  "<parameter>.<hyperparameter> key lists; the state of a parameter the optimizer "
                                  "does not hold, so the file is corrupt or was edited")
        if "." in key or not key:
            raise CheckpointError(f"{at}: the state {quote(key)} of {quote(name)} is nested (a dict of state, as "
                                  "Shampoo keeps); fusectl moves per-parameter tensors and numbers only")
        if not isinstance(v, LazyTensor) and type(v) not in (int, float, bool):
            raise CheckpointError(f"{at}: state {quote(key)} of {quote(name)} is {_kind(v)}, neither a tensor "
                                  "nor a number")
        states.setdefault(name, {})[key] = v
    groups = tuple(ParamGroup(tuple(names), hyper) for names, hyper in runs)
    return OptimizerState(where, groups, states, {}, "flat")


def map_parameters(state: OptimizerState, params: Sequence[tuple[str, TensorSpec]], path: str,
                   order: Sequence[str] | None = None, order_source: str | None = None,
                   aliases: Mapping[str, str] | None = None) -> ParamMap:
    """Which parameter each of ``state``'s ids is, proven by names or shapes.

    :param params: the model's parameters as (name, spec), in the state dict's order, each
        tied group once (buffers are not marked in a state dict: they may be among them).
    :param order: the parameter names in the order the optimizer was given them
        (``[n for n, _ in model.named_parameters()]``), read from ``order_source``; used
        instead of the state dict's order.
    :param aliases: every name of the state dict → the name ``params`` gives its tensor (a
        tied name → its group's): an optimizer that names a parameter may use any of a tied
        group's names.
    :returns: a :class:`ParamMap`. Names come from the groups' ``param_names`` when present,
        from name keys when the ids are names; else each group's ids, in their order, must sit
        in the parameters' order as one increasing sequence (groups interleaved, buffers
        skipped) whose shapes equal the states' shapes — and exactly one such placement may
        exist (ids without shaped state are placed by the others around them).
    :raises CheckpointError: a state whose shape differs from its parameter's, a name that is
        not a parameter, no placement, or two placements (naming the two parameters that could
        swap and how to give the order).
    """
    at = f"{printable(path)}: optimizer state {quote(state.where)}"
    specs = dict(params)
    tied = aliases or {}
    elementwise = recognise(set(state.keys()), [g.hyper for g in state.groups])[1] is None
    if all(g.param_names is not None for g in state.groups):
        names = {p: tied.get(n, n) for g in state.groups for p, n in zip(g.params, g.param_names)}
        source = "param_names"
    elif all(type(p) is str for p in state.ids()):
        names = {p: tied.get(p, p) for p in state.ids()}
        source = "state keys"
    else:
        if order is not None:
            missing = [n for n in order if n not in specs]
            if missing:
                raise CheckpointError(f"{printable(order_source or 'the order')}: {quote(missing[0])} is not a "
                                      "parameter of the checkpoint; give the names of model.named_parameters()")
            sequence = [(n, specs[n]) for n in order]
        else:
            sequence = list(params)
        names = _placement(state, sequence, at, order is not None)
        source = order_source if order is not None else "state dict order"
    for pid, name in names.items():
        if name not in specs:
            said = f"names the parameter {quote(name)}" if pid == name else \
                f"names parameter id {_shown(pid)} {quote(name)}"
            raise CheckpointError(f"{at}: the optimizer {said}, which the model's state dict does not hold; load "
                                  "the model whose optimizer this is (one saved with a prefix such as 'module.' "
                                  "has other names)")
        _check_shapes(state.states.get(pid, {}), name, specs[name].shape, elementwise, at)
    names = {p: names[p] for p in state.ids() if p in names}
    if len(set(names.values())) != len(names):
        twice = next(n for n in names.values() if list(names.values()).count(n) > 1)
        pids = [p for p, n in names.items() if n == twice]
        raise CheckpointError(f"{at}: two parameter ids, {_shown(pids[0])} and {_shown(pids[1])}, name one "
                              f"parameter, {quote(twice)} (a tied parameter is one, with one state); the "
                              "optimizer dict is corrupt")
    return ParamMap(names, source)


def _check_shapes(entry: Mapping, name: str, shape: tuple, elementwise: bool, at: str) -> None:
    """Every state tensor of ``name`` shaped like it (an elementwise optimizer's; a whole-tensor
    one's factored moments are refused later, naming the optimizer: here only their common
    shape, if they have one), each per-parameter number one number (or shaped like it)."""
    for key, value in entry.items():
        if not isinstance(value, LazyTensor):
            continue
        got = tuple(value.spec.shape)
        if key in SCALAR_KEYS:
            if got != tuple(shape) and math.prod(got) > 1:
                raise CheckpointError(f"{at}: state {quote(key)} of {quote(name)} is {list(got)}, not one number; "
                                      "the optimizer dict is corrupt")
            continue
        if got != tuple(shape) and (elementwise or _shape_of(entry) is not None):
            raise CheckpointError(f"{at}: state {quote(key)} of {quote(name)} is {list(got)}, the parameter "
                                  f"is {list(shape)}; a state must be shaped like its parameter")


def _placement(state: OptimizerState, params: list[tuple[str, TensorSpec]], at: str, given: bool) -> dict:
    """Each id → the parameter it must be (see :func:`map_parameters`; the search is
    ``io.placement``'s, bounded by the ``order-search`` budget)."""
    groups = [list(g.params) for g in state.groups]
    shapes = {p: _shape_of(state.states.get(p, {})) for g in groups for p in g}
    total = sum(map(len, groups))
    if len(params) < total:
        raise CheckpointError(f"{at}: the optimizer lists {total} parameters, the state dict holds only "
                              f"{len(params)} tensors; load the checkpoint whose optimizer this is")
    try:
        found = place(groups, shapes, params, at)
    except SearchTooLarge as e:
        raise SearchTooLarge(f"{e}, or {ORDER_HOW}") from None
    where = "the order given" if given else "the state dict's order"
    if found.names is None:
        raise CheckpointError(f"{at}: the optimizer's parameters do not fit {where}: no placement of its "
                              f"{total} states gives each the shape of its parameter; {ORDER_HOW}")
    if found.second is not None:
        first, second = found.names, found.second
        pid = next(p for p in first if first[p] != second[p])
        raise CheckpointError(f"{at}: the shapes do not prove which parameter is which: the state of id "
                              f"{_shown(pid)} fits {quote(first[pid])} and {quote(second[pid])} alike (equal "
                              f"shapes), and an order assumption could swap them; {_how_to_settle(first, second)}")
    return found.names


def _how_to_settle(first: dict, second: dict) -> str:
    """What settles two placements: an order file where they place different tensors (a buffer
    taken for a parameter), names where they place the same tensors in other param groups — an
    order file orders parameters, not groups, so it cannot tell those apart."""
    if set(first.values()) != set(second.values()):
        return f"{ORDER_HOW}, or save the optimizer with param_names"
    return ("two param groups could exchange them, which no order file tells apart (it orders parameters, not "
            "groups): save the optimizer with param_names (torch.optim given model.named_parameters()), or write "
            "the model without its optimizer state")


def possible_parameters(state: OptimizerState, params: Sequence[tuple[str, TensorSpec]], path: str,
                        aliases: Mapping[str, str] | None = None) -> set[str]:
    """The parameters (names of ``params``) that any of ``state``'s ids could be, without
    proving which: the named ones where the optimizer names them, else every tensor some
    placement could give an id (``io.placement.possible_positions``; all of them where no
    placement fits, so that nothing is taken for a buffer on an unproven guess). A plan that
    touches none of them moves no state."""
    tied = aliases or {}
    if all(g.param_names is not None for g in state.groups):
        return {tied.get(n, n) for g in state.groups for n in g.param_names}
    if all(type(p) is str for p in state.ids()):
        return {tied.get(p, p) for p in state.ids()}
    groups = [list(g.params) for g in state.groups]
    shapes = {p: _shape_of(state.states.get(p, {})) for g in groups for p in g}
    params = list(params)
    at = f"{printable(path)}: optimizer state {quote(state.where)}"
    try:
        positions = possible_positions(groups, shapes, params, at)
    except SearchTooLarge as e:
        raise SearchTooLarge(f"{e}, or {ORDER_HOW}") from None
    if positions is None:
        return {n for n, _ in params}
    return {params[k][0] for k in positions}


def state_tensors(state: OptimizerState, mapping: ParamMap, aliases: Mapping[str, Sequence[str]]
                  ) -> dict[str, LazyTensor]:
    """The state tensors as table entries ``<parameter>::<key>``, under every name tied to the
    parameter (``aliases``: name → its tied names, itself included; one state, as the
    parameter is one)."""
    out = {}
    for pid, name in mapping.names.items():
        for key, value in state.states.get(pid, {}).items():
            if isinstance(value, LazyTensor):
                for alias in aliases.get(name, [name]):
                    out[f"{alias}{STATE_SEP}{key}"] = value
    return out


# keys of fusectl's record in a PyTorch file it wrote with an optimizer (a training dict's
# metadata record, a Trainer folder's optimizer file): strings, JSON lists of names
NAMES_KEY = "fusectl.param_names"  # the parameter of each optimizer id, in id order
ORIGINAL_KEY = "fusectl.original_param_order"  # the parameters in the order before any fusectl step
RECORD_KEYS = (NAMES_KEY, ORIGINAL_KEY)


def order_record(names: Sequence[str], original: Sequence[str] | None = None) -> dict[str, str]:
    """fusectl's record for an optimizer it writes: ``names`` the parameter of each id (in id
    order), ``original`` (when known) the parameter order before any fusectl step."""
    record = {NAMES_KEY: json.dumps(list(names))}
    if original is not None:
        record[ORIGINAL_KEY] = json.dumps(list(original))
    return record


def recorded_orders(record: Mapping[str, str], file: str) -> tuple[list[str] | None, list[str] | None]:
    """(the parameter of each id, the original parameter order) from fusectl's ``record`` in
    ``file``; None for each that is not recorded.

    :raises CheckpointError: a record that is not a JSON list of distinct names."""
    found = []
    for key in RECORD_KEYS:
        text = record.get(key)
        if text is None:
            found.append(None)
            continue
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, list) or not all(type(n) is str for n in value) or len(set(value)) != len(value):
            raise CheckpointError(f"{printable(file)}: fusectl's record {key!r} is not a list of distinct "
                                  f"names; the file was edited. Give the order with {option('param_order')}")
        found.append(value)
    return found[0], found[1]


def read_order(path: str) -> list[str]:
    """The parameter order in ``path``: a JSON list of names, ``[n for n, _ in model.named_parameters()]``.

    :raises CheckpointError: a file that cannot be read or is not a list of distinct names."""
    from .untrusted import read_json_file
    value = read_json_file(path, "the parameter order")
    if not isinstance(value, list) or not all(type(n) is str for n in value) or len(set(value)) != len(value):
        raise CheckpointError(f"{printable(path)}: the parameter order must be a JSON list of distinct names "
                              "([n for n, _ in model.named_parameters()])")
    return value


def training_tree(root: object, model_key: KeyPath | None, model: object, optimizer_key: KeyPath | None,
                  optimizer: object, others: Sequence[tuple[KeyPath, object]] = ()) -> object:
    """The training dict ``root`` (as read: dicts, lists, tuples, numbers, lazy tensors) with
    the entry at ``model_key`` replaced by ``model``, the one at ``optimizer_key`` by
    ``optimizer`` and each of ``others`` (key, value: the model's twins) by its value (key
    paths, ``io.key_path``; Lightning's ``("optimizer_states", 0)`` indexes the list); every
    other entry kept as it is, for ``torch_writer.write_torch_file``."""
    out = root
    for key, value in ((model_key, model), (optimizer_key, optimizer), *others):
        if key is not None and value is not None:
            out = replaced(out, key, value)
    return out


def written_optimizer(state: OptimizerState, raw: Mapping, groups: Sequence[Sequence[tuple]]) -> dict:
    """The optimizer dict of a converted training dict, in the form ``state`` was read in.

    :param raw: the optimizer entry as read (``state`` parsed it): its groups' own values and
        its other entries are kept.
    :param groups: per param group (the flattened form: per run), the output's parameters in
        order, each ``(name, source, unchanged, entry)``: its name in the output model, the
        id of its (first) part in the input, whether it is that part unchanged, and its state
        (moved tensors and numbers; empty: none).
    :returns: ``"ids"``: ``params`` renumbered 0..n-1 over the groups and ``state`` keyed by the
        new ids (what torch.optim writes; an input keyed by object ids comes out so too);
        ``"names"``: keyed by name — an unchanged parameter's as the input named it, a new one's
        its name in the output —, ``param_names`` (when present) the output's names;
        ``"flat"``: ``state.<name>.<key>`` for every state, then ``param_groups.<name>.<hyper>``
        for every parameter with its first part's hyperparameters as read.
    """
    keys = []
    number = 0
    for group in groups:
        row = []
        for name, source, unchanged, _ in group:
            if state.form == "ids":
                row.append(number)
                number += 1
            else:
                row.append(source if unchanged else name)
        keys.append(row)
    if state.form == "flat":
        hypers: dict[str, list] = {}
        for k, v in raw.items():
            if type(k) is str and k.startswith("param_groups."):
                name, _, hyper = k[len("param_groups."):].rpartition(".")
                hypers.setdefault(name, []).append((hyper, v))
        out: dict = {}
        for group, row in zip(groups, keys):
            for (_, _, _, entry), key in zip(group, row):
                out.update((f"state.{key}.{k}", v) for k, v in entry.items())
        for group, row in zip(groups, keys):
            for (_, source, _, _), key in zip(group, row):
                out.update((f"param_groups.{key}.{h}", v) for h, v in hypers[source])
        return out
    new_states = {key: entry for group, row in zip(groups, keys) for (*_, entry), key in zip(group, row) if entry}
    new_groups = []
    for g, group, row in zip(raw["param_groups"], groups, keys):
        d = dict(g)
        d["params"] = row
        if "param_names" in d:
            d["param_names"] = [name for name, *_ in group]
        new_groups.append(d)
    return {**raw, "state": new_states, "param_groups": new_groups}


def optimizer_tree(state: OptimizerState) -> dict:
    """``state`` as an optimizer ``state_dict()`` again (the tree :func:`parse_optimizer` reads)."""
    groups = []
    for g in state.groups:
        d = {**g.hyper, "params": list(g.params)}
        if g.param_names is not None:
            d["param_names"] = list(g.param_names)
        groups.append(d)
    return {"state": {p: dict(s) for p, s in state.states.items()}, "param_groups": groups, **state.rest}


# --- helpers ---------------------------------------------------------------------------------


def _shaped(key: str, value: object) -> bool:
    return isinstance(value, LazyTensor) and key not in SCALAR_KEYS


def _shape_of(entry: Mapping) -> tuple | None:
    """The shape every shaped state of one id has, or None (no shaped state, or they differ:
    a factored optimizer's row and column moments)."""
    shapes = {v.spec.shape for k, v in entry.items() if _shaped(k, v)}
    return next(iter(shapes)) if len(shapes) == 1 else None


def _is_id(p: object) -> bool:
    return type(p) is int or type(p) is str


def _plain(value: object, what: str, depth: int = 0):
    """A hyperparameter as JSON-able data (tuples become lists; a non-finite float is kept as a
    string, as JSON has none)."""
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        return value if math.isfinite(value) else repr(value)
    if type(value) in (list, tuple) and depth < 8:
        return [_plain(v, what, depth + 1) for v in value]
    if isinstance(value, LazyTensor) and not value.spec.shape:
        return f"tensor({value.spec.dtype})"
    if isinstance(value, dict) and depth < 8 and all(type(k) is str for k in value):
        return {k: _plain(v, what, depth + 1) for k, v in value.items()}
    raise CheckpointError(f"{what} is {_kind(value)}, not plain data (numbers, text, lists)")


def _kind(value: object) -> str:
    if isinstance(value, LazyTensor):
        return f"a tensor {value.spec}"
    name = type(value).__name__
    return {dict: "a dict", list: "a list", tuple: "a tuple", str: "text", type(None): "None"}.get(
        type(value), f"{'an' if name[0] in 'aeiou' else 'a'} {name}")


def _shown(p: object) -> str:
    return quote(p) if type(p) is str else json.dumps(p)


# a second copy of the model beside it, in the same dict, under a key training code gives it:
# timm's CheckpointSaver writes ``state_dict_ema`` (its ModelEma's state dict) and its loader
# also reads ``model_ema``; Lightning's WeightAveraging callback puts the average in
# ``state_dict`` and moves the trained model to ``current_model_state``
TWIN_KEYS = ("state_dict_ema", "model_ema", "ema_state_dict", "ema", "ema_model", "model_ema_state_dict",
             "current_model_state")
# keys of the model itself, which the twin of a model read from a twin key is (--key state_dict_ema)
MODEL_KEYS = ("state_dict", "model", "model_state_dict", "model_state")
# the prefix torch.optim.swa_utils.AveragedModel's state dict puts before the model's names
# (it holds the model as ``module``), beside its ``n_averaged`` counter
TWIN_PREFIXES = ("module.",)


def twin_keys(parent: Mapping, model_key: str) -> list[str]:
    """The keys of ``parent`` (the dict holding the model's state dict at ``model_key``, its
    last dotted part) that hold a twin of the model (:data:`TWIN_KEYS`; for a model read
    from one of those, the model's own keys as well), dicts only, in the dict's order.
    Whether a twin holds the model's tensors is :class:`Twin`'s to say."""
    names = set(TWIN_KEYS) | (set(MODEL_KEYS) if model_key in TWIN_KEYS else set())
    return [k for k, v in parent.items() if type(k) is str and k != model_key and k in names and
            isinstance(v, dict) and any(isinstance(t, LazyTensor) for t in v.values())]


def is_twin_of(key: KeyPath, others: Sequence[KeyPath]) -> bool:
    """Whether the key path ``key`` names a twin key beside one of ``others`` (the same parent,
    one a model key): a file with a model and its EMA reads the model by default."""
    if not key:
        return False
    parent, last = key[:-1], key[-1]
    if last not in TWIN_KEYS:
        return False
    for other in others:
        if not other:
            continue
        other_parent, other_last = other[:-1], other[-1]
        if other != key and other_parent == parent and (other_last not in TWIN_KEYS or
                                                        (last, other_last) == ("current_model_state", "state_dict")):
            return True
    return False


@dataclass(frozen=True)
class Twin:
    """A copy of the model beside it in a training dict (an EMA, an averaged model): ``path``
    its key path (``where`` as text), ``prefix`` what its names put before the model's (``"module."`` for an
    ``AveragedModel``; ``""``), ``tensors`` model name → its tensor (tied names share one),
    ``rest`` its other entries by their own keys (``n_averaged``, anything that is not one of
    the model's tensors), kept as they are, and ``order`` every key of the dict as read."""

    path: KeyPath
    prefix: str
    tensors: dict
    rest: dict
    order: tuple

    @property
    def where(self) -> str:
        """Its key path as dotted text (messages, reports)."""
        return key_text(self.path)

    @classmethod
    def read(cls, node: Mapping, path: KeyPath, model_names: set[str]) -> "Twin | None":
        """The twin at ``path`` (``node``, the dict there), its names matched to the model's
        (``model_names``: with every tied alias) with or without one of :data:`TWIN_PREFIXES`;
        None when it holds none of the model's tensors (a dict that is not a copy of the model)."""
        keys = [k for k, v in node.items() if type(k) is str and isinstance(v, LazyTensor)]
        prefix = ""
        for p in TWIN_PREFIXES:
            if sum(k.startswith(p) and k[len(p):] in model_names for k in keys) > \
                    sum(k in model_names for k in keys):
                prefix = p
        tensors, rest = {}, {}
        for k, v in node.items():
            name = k[len(prefix):] if type(k) is str and k.startswith(prefix) else None
            if isinstance(v, LazyTensor) and name in model_names:
                tensors[name] = v
            else:
                rest[k] = v
        if not tensors:
            return None
        return cls(path, prefix, tensors, rest, tuple(node))


class Training:
    """What a training dict holds beside the model's state dict: its whole tree (converted on
    first use: every tensor a lazy tensor, checked against its storage), the model's state dict
    at ``model_path``, the optimizer's state beside it (``optimizer_path``; None when there is
    none) — key paths of real keys (``io.key_path``), ``model_key`` and ``optimizer_key`` their
    text — and the model's twins (:meth:`twins`). A problem finding the optimizer (two of them)
    is kept in ``problem`` and raised when the optimizer is asked for, so the model alone reads
    as before."""

    def __init__(self, path: str, model_path: KeyPath | None, optimizer_path: KeyPath | None, convert,
                 problem: str | None = None):
        self.path, self.model_path, self.optimizer_path = path, model_path, optimizer_path
        self._convert, self._tree, self.problem = convert, None, problem
        self._optimizer: OptimizerState | None = None

    @property
    def model_key(self) -> str | None:
        """Where the model's state dict is, as dotted text (None: the model is not in the tree)."""
        return key_text(self.model_path) if self.model_path is not None else None

    @property
    def optimizer_key(self) -> str | None:
        """Where the optimizer's state is, as dotted text (None: there is none)."""
        return key_text(self.optimizer_path) if self.optimizer_path is not None else None

    def tree(self) -> object:
        """The training dict as dicts, lists, tuples, numbers and lazy tensors (CheckpointError
        for a tensor its storage does not hold)."""
        if self._tree is None:
            self._tree = self._convert()
        return self._tree

    def optimizer(self) -> OptimizerState | None:
        """The optimizer's state beside the model (None: none), parsed on first use."""
        if self.problem:
            raise CheckpointError(self.problem)
        if self.optimizer_path is None:
            return None
        if self._optimizer is None:
            node = node_at(self.tree(), self.optimizer_path)
            self._optimizer = parse_optimizer(node, self.optimizer_key, self.path)
        return self._optimizer

    def twins(self, model_names: set[str]) -> list[Twin]:
        """The copies of the model beside it (:func:`twin_keys`, :meth:`Twin.read`), in the
        dict's order; none for a model at the top of the file."""
        if not self.model_path:
            return []
        prefix, last = self.model_path[:-1], self.model_path[-1]
        parent = node_at(self.tree(), prefix)
        found = []
        for k in twin_keys(parent, last):
            twin = Twin.read(parent[k], (*prefix, k), model_names)
            if twin is not None:
                found.append(twin)
        return found


def find_optimizer(parent: Mapping, prefix: KeyPath) -> tuple[KeyPath | None, str | None]:
    """(the key path of the optimizer state in ``parent``, the dict at ``prefix`` that holds
    the model's state dict, or a problem): an entry named as training code names it
    (:data:`OPTIMIZER_KEYS`) holding ``state`` and ``param_groups`` or flattened keys (one
    with only one of the two, or a malformed key, too: reading it says what is wrong, rather
    than the optimizer being left behind), or Lightning's ``optimizer_states`` list of one."""
    def dotted(*keys) -> KeyPath:
        return (*prefix, *keys)
    found = []
    for k, v in parent.items():
        if type(k) is not str:
            continue
        if k in OPTIMIZER_KEYS and isinstance(v, dict) and ("state" in v or "param_groups" in v or _looks_flat(v)):
            found.append(dotted(k))  # a malformed one too: reading it says what is wrong
        elif k == LIGHTNING_KEY and isinstance(v, (list, tuple)) and v:
            if len(v) > 1:
                return None, (f"{quote(key_text(dotted(k)))} holds {len(v)} optimizers; fusectl moves the state of "
                              "one optimizer")
            found.append(dotted(k, 0))
    if len(found) > 1:
        return None, (f"holds two optimizer states, {quote(key_text(found[0]))} and {quote(key_text(found[1]))}; "
                      "fusectl moves one")
    return (found[0] if found else None), None


def without_optimizer(tree: object, path: KeyPath) -> object:
    """The training dict ``tree`` without its optimizer at ``path``: the entry there, or
    Lightning's ``optimizer_states`` with its ``lr_schedulers``, as Lightning's
    ``save_weights_only`` leaves them out (what ``--drop-optimizer`` writes)."""
    if len(path) >= 2 and path[-2] == LIGHTNING_KEY and type(path[-1]) is int:
        return without(tree, path[:-2], {LIGHTNING_KEY, "lr_schedulers"})
    return without(tree, path[:-1], {path[-1]})
