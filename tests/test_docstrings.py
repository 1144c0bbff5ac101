"""Docstrings where people look: every op class in a rules file's words, every public function's
parameters.

An op class's docstring names its ``op = "<kind>"``, each rule key it reads (its fields, its
input and output keys), runs a doctested example, and holds a ``Rule::`` snippet that loads as a
rule of that op: a new op without one fails here.
"""

from __future__ import annotations

import dataclasses
import doctest
import inspect
import re
import sys

import pytest

import fusectl
from fusectl.ops import OPS
from fusectl.rules.schema import load_rules

# op fields the loader derives from the rule's shape (never written in a rules file)
DERIVED_FIELDS = {"parts", "has_bias", "facts"}  # rules.schema._DERIVED: never written in a rule
# the vars a snippet may use, as a preset would define them from config.json
SNIPPET_VARS = "[vars]\nheads = 4\nkv_heads = 2\n"
SNIPPET = re.compile(r"^Rule::\n\n((?:    .*\n|\n)+)", re.M)



def _doc(op_cls) -> str:
    return inspect.getdoc(op_cls) if op_cls.__doc__ else ""


def _rule_keys(op_cls) -> set[str]:
    """The keys a rule of this op may write besides name, op, optional and over."""
    fields = {f.name for f in dataclasses.fields(op_cls)} - DERIVED_FIELDS
    if op_cls.named_inputs:
        return fields | set(op_cls.named_inputs) | set(op_cls.named_outputs)
    io = {op_cls.inputs_field} | ({op_cls.outputs_field} if op_cls.outputs_field else set())
    return fields | io


def _snippet(doc: str) -> str:
    match = SNIPPET.search(doc + "\n")
    assert match, "no 'Rule::' block with an indented [[rule]] snippet"
    return "\n".join(line[4:] for line in match.group(1).splitlines())


OP_CLASSES = sorted(OPS.values(), key=lambda c: c.kind)


@pytest.mark.parametrize("op_cls", OP_CLASSES, ids=lambda c: c.kind)
def test_op_docstring_names_its_kind_and_rule_keys(op_cls):
    doc = _doc(op_cls)
    assert f'``op = "{op_cls.kind}"``' in doc, f"{op_cls.__name__}'s docstring must name op = \"{op_cls.kind}\""
    missing = sorted(k for k in _rule_keys(op_cls) if f"``{k}``" not in doc)
    assert not missing, f"{op_cls.__name__}'s docstring does not name the rule keys {missing}"
    assert "Inverse:" in doc, f"{op_cls.__name__}'s docstring must say what undoes it (or that nothing does)"


@pytest.mark.parametrize("op_cls", OP_CLASSES, ids=lambda c: c.kind)
def test_op_docstring_example_runs(op_cls):
    module = sys.modules[op_cls.__module__]
    tests = [t for t in doctest.DocTestFinder(recurse=False).find(op_cls, op_cls.__name__, module=module,
                                                                   globs=vars(module))
             if t.examples]
    assert tests, f"{op_cls.__name__}'s docstring has no >>> example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    assert runner.failures == 0, f"{op_cls.__name__}'s docstring example fails (run pytest --doctest-modules fusectl/ops)"


@pytest.mark.parametrize("op_cls", OP_CLASSES, ids=lambda c: c.kind)
def test_op_docstring_rule_snippet_loads_as_that_op(op_cls):
    snippet = _snippet(_doc(op_cls))
    assert snippet.lstrip().startswith("[[rule]]")
    ruleset = load_rules("version = 1\n" + SNIPPET_VARS + snippet, f"{op_cls.__name__} docstring", {})
    assert [type(r.op) for r in ruleset.rules] == [op_cls]


def _public_functions():
    return [(name, getattr(fusectl, name)) for name in sorted(fusectl.__all__)
            if inspect.isfunction(getattr(fusectl, name))]


def test_the_package_face_has_functions_to_check():
    names = {name for name, _ in _public_functions()}
    assert {"fuse", "unfuse", "plan", "verify", "open_checkpoint"} <= names


@pytest.mark.parametrize("name,function", [pytest.param(name, f, id=name) for name, f in _public_functions()])
def test_public_function_documents_each_parameter(name, function):
    doc = inspect.getdoc(function) or ""
    assert doc, f"fusectl.{name} has no docstring"
    missing = [p for p in inspect.signature(function).parameters if not re.search(rf"\b{re.escape(p)}\b", doc)]
    assert not missing, f"fusectl.{name}'s docstring does not mention its parameters {missing}"
