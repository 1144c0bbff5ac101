"""A rules file loaded for ``fuse``, with what provenance needs to bind it again.

``verify`` re-derives each recorded step from the rule that made it, so ``fuse`` records the
rules file's text (a preset's shipped text) and the config values its ``[vars]`` read; the
planner adds which ``[[rule]]`` each group came from (:class:`~fusectl.steps.RuleOrigin`).
"""

from __future__ import annotations

from typing import Iterator, Mapping

from ..steps import RuleOrigin
from .presets import rules_text_arg
from .schema import RuleSet, load_rules


class ConfigReads(Mapping):
    """A config mapping that remembers the values read from it (what a rules file's vars used)."""

    def __init__(self, config: Mapping[str, object]):
        self._config = config
        self.read: dict[str, object] = {}

    def __getitem__(self, key: str) -> object:
        value = self._config[key]
        self.read[key] = value
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._config)

    def __len__(self) -> int:
        return len(self._config)

    def __contains__(self, key: object) -> bool:
        return key in self._config


def load_recorded_rules(arg: str, config: Mapping[str, object] | None) -> tuple[RuleSet, RuleOrigin]:
    """``-r ARG`` loaded against ``config``, with the origin its groups record (``rule`` is
    filled in by the planner)."""
    text, source = rules_text_arg(arg)
    reads = ConfigReads(config) if config is not None else None
    ruleset = load_rules(text, source, reads)
    used = tuple(sorted(reads.read.items())) if reads is not None else ()
    return ruleset, RuleOrigin(text, 0, used)


def load_origin(origin: RuleOrigin, source: str) -> RuleSet:
    """The rules file an origin records, bound to the config values it recorded."""
    return load_rules(origin.text, source, dict(origin.config))
