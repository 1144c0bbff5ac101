"""Domain exceptions. The library raises these; only ``cli.py`` turns them into exit codes."""

from __future__ import annotations


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
    """The output cannot be written (exists without --force, would overwrite an input)."""


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
