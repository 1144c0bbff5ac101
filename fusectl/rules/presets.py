"""Presets: rules files shipped inside the package, resolved by name."""

from __future__ import annotations

import difflib
import os
import tomllib
from importlib import resources
from typing import Mapping

from ..errors import RuleError, quote
from .schema import RuleSet, load_rules


def preset_names() -> list[str]:
    """The names of the shipped presets, sorted (``fusectl rules list``).

    >>> "llama-qkv" in preset_names()
    True
    """
    folder = resources.files(__package__) / "presets"
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


def preset_text(name: str) -> str:
    """The TOML text of preset ``name``; RuleError suggesting the closest names when there is
    none of that name."""
    names = preset_names()
    if name not in names:
        raise RuleError(f"{quote(name)} is neither a rules file nor a preset; {_nearest_presets(name, names)}")
    return (resources.files(__package__) / "presets" / f"{name}.toml").read_text()


def _nearest_presets(name: str, names: list[str]) -> str:
    """What to say for an unknown preset: the closest few names, not all of them.

    >>> print(_nearest_presets("llama-qvk", ["bert-qkv", "llama-qkv", "lstm-to-onnx"]))
    did you mean 'llama-qkv'? (`fusectl rules list` names all 3 presets)
    """
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    every = f"`fusectl rules list` names all {len(names)} presets"
    if not close:
        return f"no preset has a similar name ({every})"
    quoted = [quote(n) for n in close]
    either = " or ".join([", ".join(quoted[:-1]), quoted[-1]] if len(quoted) > 1 else quoted)
    return f"did you mean {either}? ({every})"


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
