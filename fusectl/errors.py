"""Domain exceptions, and how their messages name options.

The library raises these; only ``cli.py`` turns them into exit codes. A message that says what
to do names an option with :func:`option`, which speaks the caller's language: the command
line's flags inside :func:`cli_vocabulary` (``--untie``), the API's keyword arguments elsewhere
(``untie=True``)."""

from __future__ import annotations

import contextlib
import contextvars
import json
from typing import Iterable, Iterator


class FusectlError(Exception):
    """Base class of every error fusectl reports to a user (exit code 2 on the CLI)."""


class CheckpointError(FusectlError):
    """A checkpoint file is missing, corrupt, or not in a format fusectl reads."""


class RuleError(FusectlError):
    """A rules file is malformed: unknown key or op, bad pattern, bad variable."""


class PlanError(FusectlError):
    """Rules do not fit the checkpoint: missing tensor, shape or dtype mismatch, one-way step."""


class TieError(PlanError):
    """A plan would silently break a tie between parameters, or tie sources disagree."""


class OutputError(FusectlError):
    """The output cannot be written (exists and may not be replaced, would overwrite an input)."""


class VerifyError(FusectlError):
    """Verification cannot run (bad model, unavailable provider, mismatched inputs); not a difference."""


class ComputeError(FusectlError):
    """A step's data is invalid for its op (found while executing, e.g. a zero norm)."""


class InternalError(RuntimeError):
    """An invariant of fusectl's own code broke (a writer fed out of order): a bug, never bad
    input. Not a FusectlError, so the CLI reports it with exit code 70."""


def printable(name: str) -> str:
    """``name`` with control characters escaped, for plain-text output.

    >>> print(printable("evil" + chr(7) + "name"))
    evil\\x07name
    """
    if name.isprintable():  # the common case, at C speed (inspect prints every name)
        return name
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in name)


def quote(name: str) -> str:
    """A name read from a file, quoted and escaped for an error message.

    >>> print(quote("a" + chr(27) + "[31mb"))
    'a\\x1b[31mb'
    """
    return "'" + printable(name).replace("'", "\\'") + "'"


# How a message names an option: the command line's flag or the API's keyword argument.
# One row per option: its API name (the keyword argument), its flag, and whether it is an
# on/off switch (``--untie`` / ``untie=True``), a value (``--config FILE`` / ``config="FILE"``)
# or a repeatable value (``-r RULES`` / ``rules=["RULES"]``).
_FLAG, _VALUE, _REPEATED = "flag", "value", "repeated"
OPTIONS: dict[str, tuple[str, str, str]] = {
    # api name: (flag, kind, placeholder)
    "rules": ("-r", _REPEATED, "RULES"),
    "untie": ("--untie", _FLAG, ""),
    "untie_training": ("--untie-training", _FLAG, ""),
    "drop_optimizer": ("--drop-optimizer", _FLAG, ""),
    "detect_ties": ("--detect-ties", _FLAG, ""),
    "write_ties_once": ("--write-ties-once", _FLAG, ""),
    "follow_symlinks": ("--follow-symlinks", _FLAG, ""),
    "force": ("--force", _FLAG, ""),
    "config": ("--config", _VALUE, "FILE"),
    "key": ("--key", _VALUE, "KEY"),
    "param_order": ("--param-order", _VALUE, "FILE"),
    "param_order_out": ("--param-order-out", _VALUE, "FILE"),
    "param_order_from_model": ("--param-order-from-model", _FLAG, ""),
    "max_shard_size": ("--max-shard-size", _VALUE, "SIZE"),
    "to": ("--to", _VALUE, "FORMAT"),
    "tp": ("--tp", _VALUE, "N"),
    "pp": ("--pp", _VALUE, "M"),
    "ep": ("--ep", _VALUE, "E"),
    "ckpt_format": ("--ckpt-format", _VALUE, "FORMAT"),
    "out": ("-o", _VALUE, "OUT"),
    "graph": ("--graph", _VALUE, "GRAPH"),
    "provider": ("--provider", _VALUE, "PROVIDER"),
    "atol": ("--atol", _VALUE, "TOLERANCE"),
    "rtol": ("--rtol", _VALUE, "TOLERANCE"),
    "shapes": ("--input", _REPEATED, "NAME=D0xD1..."),
    "dims": ("--dim", _REPEATED, "NAME=SIZE"),
    "inputs": ("--inputs", _VALUE, "FILE"),
    "seed": ("--seed", _VALUE, "N"),
    "report": ("--report", _VALUE, "FILE"),
    "junit": ("--junit", _VALUE, "FILE"),
    "html": ("--html", _VALUE, "FILE"),
}

_CLI, _API = "cli", "api"
_vocabulary: contextvars.ContextVar[str] = contextvars.ContextVar("fusectl_vocabulary", default=_API)


@contextlib.contextmanager
def cli_vocabulary() -> Iterator[None]:
    """Within this block, :func:`option` names options as the command line spells them (the
    CLI runs every command inside it); outside, as the API's keyword arguments."""
    token = _vocabulary.set(_CLI)
    try:
        yield
    finally:
        _vocabulary.reset(token)


# the options of the command running (API names), inside :func:`offering`; None: any (the API)
_offered: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar("fusectl_offered", default=None)


@contextlib.contextmanager
def offering(names: Iterable[str]) -> Iterator[None]:
    """Within this block the caller has only the options ``names`` (API names): the CLI runs each
    command inside it with the command's own, so a message offers only advice it can follow."""
    token = _offered.set(frozenset(names))
    try:
        yield
    finally:
        _offered.reset(token)


def offers(name: str) -> bool:
    """Whether the caller can pass option ``name``: the running command has it (inside
    :func:`offering`), or anything goes (outside, as for the API).

    >>> offers("param_order_from_model")
    True
    >>> with offering({"param_order"}):
    ...     offers("param_order_from_model")
    False
    """
    OPTIONS[name]  # an unknown name is a bug here, not later
    offered = _offered.get()
    return offered is None or name in offered


def option(name: str, value: object = None) -> str:
    """Option ``name`` (the API's keyword argument) as the current caller writes it, to tell
    them what to do: the command line's flag inside :func:`cli_vocabulary`, else the keyword.

    >>> option("untie"), option("rules", "fp8-dequant"), option("config")
    ('untie=True', 'rules=["fp8-dequant"]', 'config=...')
    >>> with cli_vocabulary():
    ...     option("untie"), option("rules", "fp8-dequant"), option("config")
    ('--untie', '-r fp8-dequant', '--config FILE')
    """
    flag, kind, placeholder = OPTIONS[name]
    if _vocabulary.get() == _CLI:
        if kind == _FLAG:
            return flag
        return f"{flag} {placeholder if value is None else printable(str(value))}"
    if kind == _FLAG:
        return f"{name}=True"
    if value is None:
        return f"{name}=[...]" if kind == _REPEATED else f"{name}=..."
    shown = json.dumps(value, ensure_ascii=False) if isinstance(value, str) else repr(value)
    return f"{name}=[{printable(shown)}]" if kind == _REPEATED else f"{name}={printable(shown)}"


def option_name(name: str) -> str:
    """Option ``name`` without a value, as the current caller spells it: ``--untie`` / ``untie``
    (for a message that names the option, not one way to set it).

    >>> option_name("max_shard_size")
    'max_shard_size'
    >>> with cli_vocabulary():
    ...     option_name("max_shard_size")
    '--max-shard-size'
    """
    OPTIONS[name]  # an unknown name is a bug here, not later
    return OPTIONS[name][0] if _vocabulary.get() == _CLI else name


def speaking_cli() -> bool:
    """Whether messages now speak the command line's language (inside :func:`cli_vocabulary`),
    for the rare message that names a whole command rather than an option."""
    return _vocabulary.get() == _CLI
