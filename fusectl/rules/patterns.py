"""Name patterns: ``{x}`` one dot-free run, ``{x:int}`` digits, ``{x*}`` zero or more segments.

>>> p = Pattern.parse("{p*}.weight_ih_l{k:int}")
>>> p.match("enc.rnn.weight_ih_l0")
{'p': 'enc.rnn', 'k': '0'}
>>> p.match("weight_ih_l3")
{'p': '', 'k': '3'}
>>> p.format({"p": "", "k": "1"})
'weight_ih_l1'
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import RuleError

_TOKEN = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(:int|\*)?\}")
_SEGMENT = r"[^.]+"


@dataclass(frozen=True)
class Placeholder:
    name: str
    kind: str  # "seg", "int" or "multi"


@dataclass(frozen=True)
class Pattern:
    """A compiled name pattern; ``text`` is what the rules file wrote."""

    text: str
    parts: tuple[str | Placeholder, ...]

    @classmethod
    def parse(cls, text: str) -> "Pattern":
        if not isinstance(text, str) or not text:
            raise RuleError(f"pattern {text!r} must be a non-empty string")
        parts: list[str | Placeholder] = []
        pos = 0
        for m in _TOKEN.finditer(text):
            if m.start() > pos:
                parts.append(text[pos : m.start()])
            kind = {None: "seg", ":int": "int", "*": "multi"}[m.group(2)]
            parts.append(Placeholder(m.group(1), kind))
            pos = m.end()
        if pos < len(text):
            parts.append(text[pos:])
        stray = [p for p in parts if isinstance(p, str) and ("{" in p or "}" in p)]
        if stray:
            raise RuleError(
                f"pattern {text!r}: malformed placeholder in {stray[0]!r}; "
                "write {x}, {x:int} or {x*}"
            )
        pattern = cls(text, tuple(parts))
        pattern._check_unambiguous()
        return pattern

    @property
    def placeholders(self) -> tuple[Placeholder, ...]:
        return tuple(p for p in self.parts if isinstance(p, Placeholder))

    @property
    def names(self) -> frozenset[str]:
        return frozenset(p.name for p in self.placeholders)

    def _check_unambiguous(self) -> None:
        multi = [p for p in self.placeholders if p.kind == "multi"]
        if len(multi) > 1:
            raise RuleError(
                f"pattern {self.text!r} could bind two ways: it has more than one "
                "{x*} placeholder; keep one and spell the rest out"
            )
        seen: dict[str, str] = {}
        for i, part in enumerate(self.parts):
            if not isinstance(part, Placeholder):
                continue
            if part.name in seen and seen[part.name] != part.kind:
                raise RuleError(f"pattern {self.text!r}: {{{part.name}}} is used with two kinds")
            seen[part.name] = part.kind
            nxt = self.parts[i + 1] if i + 1 < len(self.parts) else None
            if isinstance(nxt, Placeholder):
                raise RuleError(
                    f"pattern {self.text!r} could bind two ways: "
                    f"{{{part.name}}} and {{{nxt.name}}} touch; put a literal between them"
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

    def regex(self, lazy: bool = False) -> re.Pattern:
        """Regex for this pattern (lazy quantifiers when ``lazy``, to detect two bindings)."""
        q = "?" if lazy else ""
        out: list[str] = []
        used: set[str] = set()
        parts = list(self.parts)
        i = 0
        while i < len(parts):
            part = parts[i]
            if isinstance(part, str):
                out.append(re.escape(part))
                i += 1
                continue
            if part.name in used:
                out.append(f"(?P={part.name})")
                i += 1
                continue
            used.add(part.name)
            if part.kind == "seg":
                out.append(f"(?P<{part.name}>[^.]+{q})")
            elif part.kind == "int":
                out.append(f"(?P<{part.name}>[0-9]+{q})")
            else:
                body = f"(?P<{part.name}>{_SEGMENT}(?:\\.{_SEGMENT})*{q})"
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

        Raises RuleError when the name can be bound two ways (greedy and lazy disagree).
        """
        greedy = self.regex().fullmatch(name)
        if greedy is None:
            return None
        lazy = self.regex(lazy=True).fullmatch(name)
        bound = self._binding(greedy)
        if lazy is not None and self._binding(lazy) != bound:
            raise RuleError(
                f"pattern {self.text!r} binds {name!r} two ways "
                f"({bound} and {self._binding(lazy)}); make the pattern more specific"
            )
        return bound

    def _binding(self, m: re.Match) -> dict[str, str]:
        return {p.name: m.group(p.name) or "" for p in self.placeholders}

    def format(self, binding: dict[str, str]) -> str:
        """The name this pattern makes under ``binding``; every placeholder must be bound."""
        out = ""
        parts = list(self.parts)
        for i, part in enumerate(parts):
            if isinstance(part, str):
                out += part
                continue
            value = binding[part.name]
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
