"""Edits of the output's ``config.json`` that a rules file's ``[config]`` asks for.

``fp8-dequant`` removes ``quantization_config``: the weights it writes are plain bf16, and a
loader that still saw the section would quantize them again. An edit records the text it
replaced, so ``unfuse`` writes the original ``config.json`` back byte for byte.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .errors import PlanError, option_name


@dataclass(frozen=True)
class ConfigEdit:
    """Keys to set (values as JSON text) and dotted key paths to remove; ``before`` is the
    config text the edit replaced (filled when a plan is bound to a checkpoint), and an inverse
    edit is ``restore``: write that text back.

    >>> edit = ConfigEdit(sets=(("torch_dtype", '"bfloat16"'),), removes=("quantization_config.fmt",))
    >>> print(edit.apply('{"quantization_config": {"fmt": "e4m3", "quant_method": "fp8"}}', "config.json"))
    {
      "quantization_config": {
        "quant_method": "fp8"
      },
      "torch_dtype": "bfloat16"
    }
    <BLANKLINE>
    """

    sets: tuple[tuple[str, str], ...] = ()
    removes: tuple[str, ...] = ()
    before: str | None = None
    restore: str | None = None
    file: str = "config.json"  # adapter_config.json for a LoRA adapter's

    def apply(self, text: str, where: str) -> str:
        """The config text after this edit."""
        if self.restore is not None:
            return self.restore
        try:
            config = json.loads(text)
        except ValueError as e:
            raise PlanError(f"{where}: not valid JSON ({e}); [config] edits need a readable config.json") from e
        if not isinstance(config, dict):
            raise PlanError(f"{where}: must be a JSON object for [config] edits")
        for path in self.removes:
            *parents, leaf = path.split(".")
            node = config
            for key in parents:
                node = node.get(key) if isinstance(node, dict) else None
            if isinstance(node, dict):
                node.pop(leaf, None)
        for key, value in self.sets:
            config[key] = json.loads(value)
        return json.dumps(config, indent=2, ensure_ascii=True) + "\n"

    def inverse(self) -> "ConfigEdit":
        """The edit that writes back the text this one replaced; PlanError when ``before`` is
        unknown (an edit from a rules file not yet bound to a checkpoint: unfuse with the provenance).

        >>> ConfigEdit(removes=("quantization_config",), before='{"a": 1}').inverse().apply("{}", "config.json")
        '{"a": 1}'
        """
        if self.before is None:
            raise PlanError("a [config] edit cannot be undone from the rules file alone (the values it removed "
                            f"are not in it); unfuse with the provenance instead of {option_name('rules')}")
        return ConfigEdit(restore=self.before, file=self.file)

    def describe(self) -> str:
        """One line for plans and reports: ``config.json: set k = v, remove p``.

        >>> ConfigEdit(removes=("quantization_config",)).describe()
        'config.json: remove quantization_config'
        """
        if self.restore is not None:
            return f"{self.file}: restore the original"
        parts = [f"set {k} = {v}" for k, v in self.sets] + [f"remove {p}" for p in self.removes]
        return f"{self.file}: " + ", ".join(parts)

    def to_json(self) -> dict:
        """The edit as provenance stores it: ``set`` (values decoded), ``remove``, and
        ``before`` / ``restore`` / ``file`` where they are not the defaults; ``from_json`` reads it back."""
        out: dict = {}
        if self.sets:
            out["set"] = {k: json.loads(v) for k, v in self.sets}
        if self.removes:
            out["remove"] = list(self.removes)
        if self.before is not None:
            out["before"] = self.before
        if self.restore is not None:
            out["restore"] = self.restore
        if self.file != "config.json":
            out["file"] = self.file
        return out

    @classmethod
    def from_json(cls, raw: object, where: str) -> "ConfigEdit":
        """The edit a provenance recorded (``to_json``'s form); PlanError naming ``where`` when
        ``raw`` is not one.

        >>> ConfigEdit.from_json({"remove": ["quantization_config"]}, "provenance").removes
        ('quantization_config',)
        """
        if not isinstance(raw, dict) or set(raw) - {"set", "remove", "before", "restore", "file"}:
            raise PlanError(f"{where}: a config edit is an object with set, remove, before, restore or file")
        if raw.get("file", "config.json") not in ("config.json", "adapter_config.json"):
            raise PlanError(f"{where}: a config edit's file is config.json or adapter_config.json")
        sets, removes = raw.get("set", {}), raw.get("remove", [])
        before, restore = raw.get("before"), raw.get("restore")
        if (not isinstance(sets, dict) or not isinstance(removes, list)
                or not all(isinstance(p, str) and p for p in removes)
                or not all(v is None or isinstance(v, str) for v in (before, restore))):
            raise PlanError(f"{where}: a config edit's set is an object, remove a list of key paths, "
                            "before and restore texts")
        return cls(tuple((k, json.dumps(v)) for k, v in sets.items()), tuple(removes), before, restore,
                   raw.get("file", "config.json"))


def resolve_edits(edits: list[ConfigEdit], text: str, where: str) -> tuple[list[ConfigEdit], str]:
    """Each edit with the text it replaces filled in, and the text after them all."""
    resolved = []
    for edit in edits:
        if edit.restore is None and edit.before is None:
            edit = ConfigEdit(edit.sets, edit.removes, text, file=edit.file)
        resolved.append(edit)
        text = edit.apply(text, where)
    return resolved, text
