"""tests/README.md is the map from each module of fusectl/ to the tests that test it; these
tests keep it true: every module has its line, every test file a line names exists, and every
test file is named somewhere in the map (so none is hard to find)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAP = ROOT / "tests" / "README.md"
LINE = re.compile(r"^- `(fusectl/[^`]+\.py)` → (.+)$")
TEST_FILE = re.compile(r"`(test_\w+\.py)`")


def _lines() -> dict[str, str]:
    """Module path → the rest of its line, for every module line of the map."""
    found: dict[str, str] = {}
    for line in MAP.read_text().splitlines():
        match = LINE.match(line)
        if match:
            assert match[1] not in found, f"{match[1]} has two lines in tests/README.md"
            found[match[1]] = match[2]
    return found


def test_every_module_has_a_line_in_the_map():
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "fusectl").rglob("*.py")}
    lines = _lines()
    assert sorted(modules - set(lines)) == [], "modules missing from tests/README.md"
    assert sorted(set(lines) - modules) == [], "tests/README.md names modules that do not exist"


def test_every_module_line_names_at_least_one_test_file():
    empty = [module for module, rest in _lines().items() if not TEST_FILE.search(rest)]
    assert empty == []


def test_every_test_file_the_map_names_exists():
    named = set(TEST_FILE.findall(MAP.read_text()))
    assert named, "the map names no test file"
    assert sorted(n for n in named if not (ROOT / "tests" / n).is_file()) == []


def test_every_test_file_is_named_in_the_map():
    named = set(TEST_FILE.findall(MAP.read_text()))
    files = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    assert sorted(files - named) == [], "test files tests/README.md does not name"
