"""Name patterns: ``{x}`` one dot-free run, ``{x:int}`` digits, ``{x*}`` zero or more segments,
``{n+1}`` / ``{n-1}`` a whole number ``n`` shifted by a small offset.

>>> p = Pattern.parse("{p*}.weight_ih_l{k:int}")
>>> p.match("enc.rnn.weight_ih_l0")
{'p': 'enc.rnn', 'k': '0'}
>>> p.match("weight_ih_l3")
{'p': '', 'k': '3'}
>>> p.format({"p": "", "k": "1"})
'weight_ih_l1'

An offset binds the index it is shifted from, so a BatchNorm at ``cnn.5`` names the layer at
``cnn.4``; the text must be canonical digits and the index must not go below 0:

>>> bn = Pattern.parse("{p*}.{n+1}.running_mean")
>>> bn.match("cnn.5.running_mean")
{'p': 'cnn', 'n': '4'}
>>> Pattern.parse("{p*}.{n:int}.weight").format({"p": "cnn", "n": "4"})
'cnn.4.weight'
>>> bn.match("cnn.0.running_mean") is None, bn.match("cnn.05.running_mean") is None
(True, True)
>>> Pattern.parse("blocks.{i:int}.to.{i+1}").match("blocks.2.to.4") is None
True
"""

from __future__ import annotations

import decimal
import functools
import re
from dataclasses import dataclass

from ..errors import PlanError, RuleError

_TOKEN = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(:int|\*)?(?:([+-])([0-9]+))?\}")
_SEGMENT = r"[^.]+"
_DIGITS = re.compile(r"[0-9]+")
_CANONICAL = r"0|[1-9][0-9]*"
MAX_OFFSET = 999


@dataclass(frozen=True)
class Placeholder:
    """One ``{...}`` of a pattern: its ``name``, ``kind`` (``"seg"`` for ``{x}``, ``"int"`` for
    ``{x:int}``, ``"multi"`` for ``{x*}``) and ``offset`` (``{n+1}``: 1)."""

    name: str
    kind: str  # "seg", "int" or "multi"
    offset: int = 0  # {n+1}: kind "int", offset 1

    @property
    def label(self) -> str:
        """How the pattern writes it, without braces: ``n``, ``n+1``, ``n-2``."""
        return f"{self.name}{self.offset:+d}" if self.offset else self.name

    @property
    def written(self) -> str:
        """The placeholder as a rules file writes it: ``{x}``, ``{x:int}``, ``{x*}``, ``{n+1}``."""
        if self.offset:
            return "{" + self.label + "}"
        return "{" + self.name + {"seg": "", "int": ":int", "multi": "*"}[self.kind] + "}"


def shift_index(digits: str, delta: int) -> str | None:
    """``digits`` + ``delta`` as canonical digits; None when the result is negative.

    Decimal arithmetic, so an index of any length (names are budgeted, not int()-limited) works.

    >>> shift_index("9", 1), shift_index("007", -7), shift_index("0", -1)
    ('10', '0', None)
    """
    with decimal.localcontext() as ctx:
        ctx.prec = len(digits) + 8
        value = decimal.Decimal(digits) + delta
    return str(value) if value >= 0 else None


@dataclass(frozen=True)
class Pattern:
    """A compiled name pattern; ``text`` is what the rules file wrote."""

    text: str
    parts: tuple[str | Placeholder, ...]

    @classmethod
    def parse(cls, text: str) -> "Pattern":
        """Compile a pattern as a rules file writes it; RuleError for a malformed placeholder or a
        pattern that could bind two ways.

        >>> Pattern.parse("{p*}.layers.{i:int}.weight").names == {"p", "i"}
        True
        """
        if not isinstance(text, str) or not text:
            raise RuleError(f"pattern {text!r} must be a non-empty string")
        parts: list[str | Placeholder] = []
        pos = 0
        for m in _TOKEN.finditer(text):
            if m.start() > pos:
                parts.append(text[pos : m.start()])
            parts.append(_placeholder(text, m))
            pos = m.end()
        if pos < len(text):
            parts.append(text[pos:])
        stray = [p for p in parts if isinstance(p, str) and ("{" in p or "}" in p)]
        if stray:
            raise RuleError(
                f"pattern {text!r}: malformed placeholder in {stray[0]!r}; "
                "write {x}, {x:int}, {x*}, or {n+1} / {n-1} for a shifted index"
            )
        pattern = cls(text, tuple(parts))
        pattern._check_unambiguous()
        return pattern

    @property
    def placeholders(self) -> tuple[Placeholder, ...]:
        """The pattern's placeholders, in the order it writes them."""
        return tuple(p for p in self.parts if isinstance(p, Placeholder))

    @property
    def names(self) -> frozenset[str]:
        """The names its placeholders bind."""
        return frozenset(p.name for p in self.placeholders)

    def _check_unambiguous(self) -> None:
        multi = [p for p in self.placeholders if p.kind == "multi"]
        if len(multi) > 1:
            raise RuleError(
                f"pattern {self.text!r} could bind two ways: it has more than one "
                "{x*} placeholder; keep one and spell the rest out"
            )
        seen: dict[str, Placeholder] = {}
        for i, part in enumerate(self.parts):
            if not isinstance(part, Placeholder):
                continue
            if part.name in seen and seen[part.name].kind != part.kind:
                other = seen[part.name]
                shifted = part if part.offset else other if other.offset else None
                if shifted is not None:
                    plain = other if shifted is part else part
                    raise RuleError(
                        f"pattern {self.text!r}: {shifted.written} shifts a whole number, but "
                        f"{plain.written} binds {part.name!r} as {_KIND_WORDS[plain.kind]}; "
                        f"write {{{part.name}:int}}"
                    )
                raise RuleError(f"pattern {self.text!r}: {{{part.name}}} is used with two kinds")
            seen.setdefault(part.name, part)
            nxt = self.parts[i + 1] if i + 1 < len(self.parts) else None
            if isinstance(nxt, Placeholder):
                raise RuleError(
                    f"pattern {self.text!r} could bind two ways: "
                    f"{part.written} and {nxt.written} touch; put a literal between them"
                )
            if part.kind == "multi":
                before = self.parts[i - 1] if i else None
                if (before is not None and not before.endswith(".")) or (
                    nxt is not None and not nxt.startswith(".")
                ):
                    raise RuleError(
                        f"pattern {self.text!r}: {{{part.name}*}} must stand for whole "
                        "segments, between dots or at either end"
                    )
        for segment in self._segments():
            free = [p for p in segment if isinstance(p, Placeholder) and p.kind == "seg"]
            if len(free) > 1:
                raise RuleError(
                    f"pattern {self.text!r} could bind two ways: {{{free[0].name}}} and "
                    f"{{{free[1].name}}} share one segment; make one of them {{x:int}} "
                    "or split the name differently"
                )

    def _segments(self) -> list[list[str | Placeholder]]:
        segments: list[list[str | Placeholder]] = [[]]
        for part in self.parts:
            if isinstance(part, Placeholder):
                segments[-1].append(part)
                continue
            pieces = part.split(".")
            for k, piece in enumerate(pieces):
                if k:
                    segments.append([])
                if piece:
                    segments[-1].append(piece)
        return segments

    def _groups(self) -> dict[tuple[str, int], str]:
        """Regex group per distinct (name, offset): ``{n:int}`` and ``{n+1}`` match different
        text, so each gets its own group and the match checks that they agree."""
        groups: dict[tuple[str, int], str] = {}
        for p in self.placeholders:
            groups.setdefault((p.name, p.offset), f"g{len(groups)}")
        return groups

    @functools.lru_cache(maxsize=4096)  # built once per pattern: a rule binds it to every name
    def regex(self, lazy: bool = False) -> re.Pattern:
        """Regex for this pattern (lazy quantifiers when ``lazy``, to detect two bindings)."""
        q = "?" if lazy else ""
        out: list[str] = []
        groups = self._groups()
        used: set[str] = set()
        parts = list(self.parts)
        i = 0
        while i < len(parts):
            part = parts[i]
            if isinstance(part, str):
                out.append(re.escape(part))
                i += 1
                continue
            group = groups[(part.name, part.offset)]
            if group in used:
                out.append(f"(?P={group})")
                i += 1
                continue
            used.add(group)
            if part.offset:  # canonical digits only: "05" is no index, so {n+1} refuses it
                out.append(f"(?P<{group}>{_CANONICAL}{q})")
            elif part.kind == "seg":
                out.append(f"(?P<{group}>[^.]+{q})")
            elif part.kind == "int":
                out.append(f"(?P<{group}>[0-9]+{q})")
            else:
                body = f"(?P<{group}>{_SEGMENT}(?:\\.{_SEGMENT})*{q})"
                nxt = parts[i + 1] if i + 1 < len(parts) else None
                if isinstance(nxt, str):  # "{p*}.rest": the dot goes with the segments
                    out.append(f"(?:{body}\\.){'?' if not lazy else '??'}")
                    parts[i + 1] = nxt[1:]
                elif out and out[-1].endswith(r"\."):  # "head.{p*}"
                    out[-1] = out[-1][:-2]
                    out.append(f"(?:\\.{body}){'?' if not lazy else '??'}")
                else:  # the whole pattern
                    out.append(f"{body}?")
            i += 1
        return re.compile("".join(out))

    def match(self, name: str) -> dict[str, str] | None:
        """Bind this pattern to ``name``; None when it does not match.

        A shifted placeholder binds the index it is shifted from (``{n+1}`` on ``"5"`` binds
        ``n = "4"``); None when that index would be negative or disagrees with ``{n:int}``.
        Raises RuleError when the name can be bound two ways (greedy and lazy disagree).
        """
        greedy = self.regex().fullmatch(name)
        if greedy is None:
            return None
        lazy = self.regex(lazy=True).fullmatch(name)
        raw = self._texts(greedy)
        if lazy is not None and self._texts(lazy) != raw:
            raise RuleError(
                f"pattern {self.text!r} binds {name!r} two ways "
                f"({raw} and {self._texts(lazy)}); make the pattern more specific"
            )
        return self._binding(raw)

    def _texts(self, m: re.Match) -> dict[str, str]:
        """The text each placeholder matched, keyed by its label (``n``, ``n+1``)."""
        groups = self._groups()
        return {p.label: m.group(groups[(p.name, p.offset)]) or "" for p in self.placeholders}

    def _binding(self, texts: dict[str, str]) -> dict[str, str] | None:
        shifted: dict[str, str] = {}
        for p in self.placeholders:
            if p.offset:
                index = shift_index(texts[p.label], -p.offset)
                if index is None or shifted.setdefault(p.name, index) != index:
                    return None
        binding: dict[str, str] = {}
        for p in self.placeholders:
            if p.name in binding:
                continue
            if p.name in shifted and p.name in texts:  # {n:int} and {n+1} must agree
                if (texts[p.name].lstrip("0") or "0") != shifted[p.name]:
                    return None
            binding[p.name] = texts[p.name] if p.name in texts else shifted[p.name]
        return binding

    def format(self, binding: dict[str, str]) -> str:
        """The name this pattern makes under ``binding``; every placeholder must be bound.

        PlanError when a shifted index would be negative (``{n-1}`` with n = 0).
        """
        out = ""
        parts = list(self.parts)
        for i, part in enumerate(parts):
            if isinstance(part, str):
                out += part
                continue
            value = binding[part.name]
            if part.offset:
                if not _DIGITS.fullmatch(value):
                    raise RuleError(
                        f"pattern {self.text!r}: {part.written} shifts a whole number, "
                        f"but {part.name!r} is {value!r}"
                    )
                shifted = shift_index(value, part.offset)
                if shifted is None:
                    raise PlanError(
                        f"pattern {self.text!r}: {part.written} with {part.name} = {value} is "
                        f"{int(value) + part.offset}; no name has a negative index"
                    )
                value = shifted
            if part.kind == "multi" and value == "":
                if i + 1 < len(parts) and isinstance(parts[i + 1], str):
                    parts[i + 1] = parts[i + 1][1:]
                elif out.endswith("."):
                    out = out[:-1]
                continue
            out += value
        return out

    def __str__(self) -> str:
        return self.text


_KIND_WORDS = {"seg": "text", "int": "a whole number", "multi": "segments"}


def _placeholder(text: str, m: re.Match) -> Placeholder:
    """One ``{...}`` token; offsets only on whole numbers, as ``{n+K}`` with 1 <= K <= 999."""
    name, suffix, sign, digits = m.groups()
    if sign is None:
        return Placeholder(name, {None: "seg", ":int": "int", "*": "multi"}[suffix])
    token = m.group(0)
    if suffix == "*":
        raise RuleError(
            f"pattern {text!r}: {token} shifts {{{name}*}}, which stands for segments; "
            f"an offset applies only to a whole number, as {{{name}{sign}{digits}}} next to {{{name}:int}}"
        )
    if suffix == ":int":
        raise RuleError(f"pattern {text!r}: write {{{name}{sign}{digits}}}, not {token}; "
                        "an offset already makes it a whole number")
    if not (len(digits) <= 3 and (digits == "0" or not digits.startswith("0"))) or int(digits) == 0:
        hint = f"write {{{name}:int}}" if digits.strip("0") == "" else f"use an offset from 1 to {MAX_OFFSET}"
        raise RuleError(f"pattern {text!r}: {token} has offset {digits!r}; {hint}")
    return Placeholder(name, "int", int(digits) if sign == "+" else -int(digits))
