"""Presets: rules files shipped inside the package, resolved by name."""

from __future__ import annotations

import os
import tomllib
from importlib import resources
from typing import Mapping

from ..errors import RuleError
from .schema import RuleSet, load_rules


def preset_names() -> list[str]:
    """The names of the shipped presets, sorted (``fusectl rules list``).

    >>> "llama-qkv" in preset_names()
    True
    """
    folder = resources.files(__package__) / "presets"
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


def preset_text(name: str) -> str:
    """The TOML text of preset ``name``; RuleError listing the presets when there is none of that name."""
    if name not in preset_names():
        raise RuleError(
            f"{name!r} is neither a rules file nor a preset; presets are {', '.join(preset_names())}"
        )
    return (resources.files(__package__) / "presets" / f"{name}.toml").read_text()


def preset_description(name: str) -> str:
    """The one-line ``description`` of a preset."""
    return tomllib.loads(preset_text(name)).get("description", "")


def rules_text_arg(arg: str) -> tuple[str, str]:
    """``-r ARG``'s text and the source messages name: an existing path is read as a rules
    file, anything else is a preset name (source ``preset NAME``)."""
    if os.path.exists(arg):
        try:
            with open(arg) as f:
                return f.read(), arg
        except (OSError, UnicodeDecodeError) as e:
            raise RuleError(f"{arg}: cannot read rules file ({e})") from e
    return preset_text(arg), f"preset {arg}"


def load_rules_arg(arg: str, config: Mapping[str, object] | None = None) -> RuleSet:
    """``-r ARG``: an existing path is read as a rules file, anything else is a preset name."""
    return load_rules(*rules_text_arg(arg), config)
