"""The package's layers: every module imports on its own, and no import runs back up the layers.

An import may point only DOWN this list (a module may import its own level):

1. errors, limits, dtypes, tensors, progress, version, tolerance, _protocols, background
2. table, ties, config_edit
3. ops/*
4. steps
5. rules/*, io/*, executor, followers/*; acyclic among themselves, io never imports onnx, and
   followers never import io (io detects the followers of the checkpoint it opens); io may use
   the rule language (name patterns, parallel layouts), rules never read files
6. planner, write, checkpoint_map, twins, key_order, mxnet_facts (rules given what an MXNet
   checkpoint's symbol says: it reads io so that rules never do)
7. onnx/*, verification/* (verification may import onnx, never the reverse)
8. api, inspection, reports, training_output, trainer_output
9. cli, __init__, __main__

Imports are read with ``ast``: at module level and inside functions and classes alike, so a
lazy import that runs back up is found too. A module the table does not place fails the test:
put it in :data:`LAYERS`.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fusectl"

# dotted names below fusectl ("" is fusectl/__init__.py); a package's __init__ sits at its
# package's level, so "io" and "io.*" both name level 5
LAYERS: dict[int, tuple[str, ...]] = {
    1: ("errors", "limits", "dtypes", "tensors", "progress", "version", "tolerance", "_protocols", "background"),
    2: ("table", "ties", "config_edit"),
    3: ("ops", "ops.*"),
    4: ("steps",),
    5: ("rules", "rules.*", "io", "io.*", "executor", "followers", "followers.*"),
    6: ("planner", "write", "checkpoint_map", "twins", "key_order", "mxnet_facts"),
    7: ("onnx", "onnx.*", "verification", "verification.*"),
    8: ("api", "inspection", "reports", "training_output", "trainer_output"),
    9: ("cli", "", "__main__"),
}

# imports the layers allow by level that are still forbidden
FORBIDDEN: tuple[tuple[str, str, str], ...] = (
    ("io*", "onnx*", "io must not read ONNX through onnx/ (io is level 5, onnx 7)"),
    ("onnx*", "verification*", "verification may import onnx, never the reverse"),
    ("followers*", "io*", "io detects the followers of the checkpoint it opens; followers never read files"),
    ("rules*", "io*", "io may use the rule language (name patterns, parallel layouts); rules never read files"),
)

def modules() -> dict[str, Path]:
    """Every module of the package: dotted name below fusectl → its file."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = modules()


def level_of(name: str) -> int | None:
    for level, patterns in LAYERS.items():
        if any(name == p or (p and fnmatch.fnmatchcase(name, p)) for p in patterns):
            return level
    return None


def resolve(name: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The fusectl modules (dotted below fusectl) that one import statement names."""
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
        out = []
        for target in targets:
            if target == "fusectl" or target.startswith("fusectl."):
                out.append(target[len("fusectl."):] if target != "fusectl" else "")
        return out
    if node.level:
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        if name == "":
            package = []
        base = package[: len(package) - (node.level - 1)]
        module = ".".join(base + (node.module.split(".") if node.module else []))
    elif node.module == "fusectl" or (node.module or "").startswith("fusectl."):
        module = node.module[len("fusectl."):] if node.module != "fusectl" else ""
    else:
        return []
    out = []
    for alias in node.names:
        sub = f"{module}.{alias.name}" if module else alias.name
        out.append(sub if sub in MODULES else module)
    return out


def imports() -> list[tuple[str, str, int]]:
    """(importer, imported, line) for every import of a fusectl module anywhere in the package."""
    found = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in resolve(name, path, node):
                    if target != name:
                        found.append((name, target, node.lineno))
    return found


IMPORTS = imports()


def show(name: str) -> str:
    return f"fusectl.{name}" if name else "fusectl"


def violations() -> list[tuple[str, str, str]]:
    """(importer, imported, why) for each import that breaks the layers."""
    bad = []
    for importer, imported, line in IMPORTS:
        low, high = level_of(importer), level_of(imported)
        if low is None or high is None:
            continue  # test_every_module_has_a_layer names it
        if high > low:
            bad.append((importer, imported, f"line {line}: level {low} imports level {high}"))
        for src, dst, why in FORBIDDEN:
            if fnmatch.fnmatchcase(importer, src) and fnmatch.fnmatchcase(imported, dst):
                bad.append((importer, imported, f"line {line}: {why}"))
    return bad


def test_the_walk_finds_the_package():
    """Guards the other tests against passing on an empty walk."""
    assert {"", "errors", "cli", "api", "planner", "io.checkpoint", "verification.report"} <= set(MODULES)
    assert len(MODULES) > 40
    assert any(i == "cli" and t == "api" for i, t, _ in IMPORTS)


def test_every_module_has_a_layer():
    unplaced = sorted(show(m) for m in MODULES if level_of(m) is None)
    assert unplaced == [], f"place these in LAYERS: {unplaced}"


def test_no_import_runs_back_up_the_layers():
    found = violations()
    assert found == [], "\n".join(f"{show(i)} imports {show(t)} ({why})" for i, t, why in found)


def test_level_five_is_acyclic():
    """rules, io, executor and the followers may import each other, but not in a circle."""
    groups = {m: m.split(".")[0] for m in MODULES if level_of(m) == 5}
    edges: dict[str, set[str]] = {}
    for importer, imported, _ in IMPORTS:
        if importer in groups and imported in groups and groups[importer] != groups[imported]:
            edges.setdefault(groups[importer], set()).add(groups[imported])

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in edges.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    circles = sorted(g for g in edges if reaches(g, g, {g}))
    assert circles == [], f"level 5 groups in an import circle: {circles} (edges {edges})"


def test_the_checker_catches_an_import_up_and_a_forbidden_one():
    """A test that cannot fail is a defect: the checker itself sees the arrows it must refuse."""
    def check(importer: str, text: str) -> list[str]:
        node = ast.parse(text).body[0]
        targets = resolve(importer, MODULES.get(importer, PACKAGE / "x.py"), node)
        low = level_of(importer)
        return [t for t in targets if level_of(t) > low or any(
            fnmatch.fnmatchcase(importer, s) and fnmatch.fnmatchcase(t, d) for s, d, _ in FORBIDDEN)]

    assert check("io.provenance", "from fusectl import __version__") == [""]
    assert check("io.provenance", "from .. import api") == ["api"]
    assert check("onnx.namemap", "from ..verification.compare import default_tolerance") == ["verification.compare"]
    assert check("io.checkpoint", "from ..onnx import passes") == ["onnx.passes"]
    assert check("planner", "from .steps import Plan") == []
    assert check("verification.report", "import fusectl.onnx.graph") == []


@pytest.fixture(scope="module")
def import_results():
    """Each module imported in one child interpreter, with every fusectl module forgotten before
    the next: each import runs as if it were the first (an import circle shows). ``__main__``
    runs the CLI and ends its process (``cli.run``), so it runs on its own, as ``--version``."""
    script = (
        "import importlib, json, sys, traceback\n"
        "names = json.loads(sys.argv[1])\n"
        "out = {}\n"
        "for name in names:\n"
        "    for key in [k for k in sys.modules if k == 'fusectl' or k.startswith('fusectl.')]:\n"
        "        del sys.modules[key]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "        out[name] = None\n"
        "    except BaseException:\n"
        "        out[name] = traceback.format_exc(limit=3)\n"
        "print(json.dumps(out))\n"
    )
    names = [show(m) for m in MODULES if show(m) != "fusectl.__main__"]
    done = subprocess.run([sys.executable, "-c", script, json.dumps(names)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    main = subprocess.run([sys.executable, "-m", "fusectl", "--version"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    ok = main.returncode == 0 and main.stdout.startswith("fusectl, version ") and main.stderr == ""
    results["fusectl.__main__"] = None if ok else f"exit {main.returncode}: {main.stdout}{main.stderr[-2000:]}"
    return results


@pytest.mark.parametrize("module", sorted(show(m) for m in MODULES))
def test_every_module_imports_on_its_own(import_results, module):
    assert import_results[module] is None, import_results[module]


def test_import_fusectl_verification_report_in_a_fresh_interpreter():
    """The public functions fusectl.verify and fusectl.plan once shadowed their modules."""
    done = subprocess.run([sys.executable, "-c", "import fusectl.verification.report, fusectl.steps, fusectl;"
                           "assert callable(fusectl.verify) and callable(fusectl.plan)"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
