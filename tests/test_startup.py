"""A command pays only for the imports it uses (issue 22): read from a fresh interpreter's
``python -X importtime``, by module name, never by time."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import FIXTURES

ROOT = FIXTURES.parent
ONNX = {"onnx", "onnxruntime", "onnx_ir"}


def _modules_imported(*args: str) -> set[str]:
    """The modules that fusectl imports in a fresh ``python -X importtime ARGS`` (it must exit 0):
    its own, and those it asks for, directly or through the standard library, but not what a
    third-party package imports for itself (numpy 1.26 imports hashlib, numpy 2 does not) nor
    what the interpreter imported before fusectl (a site hook may import zipfile)."""
    done = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    importer = _importers(done.stderr)
    return {name for name in importer if _asked_by_fusectl(name, importer)}


def _importers(importtime: str) -> dict[str, str | None]:
    """Each module of a ``-X importtime`` report → the module whose import imported it (None
    at the top). The report lists a module after those it imported, indented two spaces more."""
    importer: dict[str, str | None] = {}
    waiting: dict[int, list[str]] = {}  # depth → modules not yet given their importer
    for line in importtime.splitlines():
        if not line.startswith("import time:") or line.endswith("imported package"):
            continue
        field = line.rsplit("|", 1)[1]
        name = field.strip()
        depth = len(field) - len(field.lstrip(" "))
        for child in waiting.pop(depth + 2, []):
            importer[child] = name
        waiting.setdefault(depth, []).append(name)
        importer[name] = None
    return importer


def _asked_by_fusectl(name: str, importer: dict[str, str | None]) -> bool:
    """fusectl's own modules, and a module whose nearest importer outside the standard library
    is one of fusectl's."""
    if _is_fusectl(name):
        return True
    above = importer.get(name)
    while above is not None and above.partition(".")[0] in sys.stdlib_module_names:
        above = importer.get(above)
    return above is not None and _is_fusectl(above)


def _is_fusectl(name: str) -> bool:
    return name == "fusectl" or name.startswith("fusectl.")


@pytest.mark.parametrize("args", [("-m", "fusectl", "--version"), ("-m", "fusectl", "--help"),
                                  ("-m", "fusectl", "inspect", "--help"), ("-m", "fusectl", "fuse", "--help"),
                                  ("-c", "import fusectl; fusectl.__version__")], ids=" ".join)
def test_version_help_and_the_package_face_import_only_what_they_use(args):
    """The API (numpy, ml_dtypes, the readers) is imported when a command runs, not for
    --version, --help or ``import fusectl``."""
    imported = _modules_imported(*args)
    assert "fusectl" in imported
    heavy = {"numpy", "ml_dtypes", "fusectl.api", "fusectl.dtypes", *ONNX} & imported
    assert heavy == set()


# light commands on checkpoints without a bf16/fp8 tensor: neither onnx nor ml_dtypes
FLOAT32 = [
    ("rules", "list"),
    ("rules", "show", "llama-qkv"),
    ("inspect", "fixtures/tiny-llama-gqa"),
    ("inspect", "fixtures/tiny-llama-tied.io.npz"),
    ("inspect", "fixtures/tied-embeddings.pt"),
    ("plan", "fixtures/tiny-llama-gqa", "-r", "llama-qkv", "-r", "llama-gate-up"),
    ("inspect", "fixtures/tiny-llama-gqa-bin"),
    ("plan", "fixtures/tiny-llama-gqa-bin", "-r", "llama-qkv"),
]
# the same commands on bf16 and fp8 checkpoints read headers only: they need no ml_dtypes type either
LOW_PRECISION = [
    ("inspect", "fixtures/tiny-llama-gqa-bf16-sharded"),
    ("inspect", "fixtures/fp8-llama"),
    ("plan", "fixtures/tiny-llama-gqa-bf16-sharded", "-r", "llama-qkv"),
    ("plan", "fixtures/fp8-llama", "-r", "fp8-dequant"),
]


@pytest.mark.parametrize("command", FLOAT32 + LOW_PRECISION, ids=" ".join)
def test_light_commands_import_neither_onnx_nor_ml_dtypes(command):
    imported = _modules_imported("-m", "fusectl", *command)
    assert "fusectl.api" in imported  # the command ran
    assert (ONNX | {"ml_dtypes"}) & imported == set()


# what inspect of a safetensors checkpoint has no use for: the rule language, the planner and
# the op registry (every op module), other formats' readers, and the standard library's slow
# loaders (OpenSSL for hashlib, zipfile, traceback's tokenize)
NOT_FOR_INSPECT = {"fusectl.rules.schema", "fusectl.rules.presets", "fusectl.planner", "fusectl.ops.reparam",
                   "fusectl.io.formats.npz_file", "fusectl.io.formats.mxnet_params", "fusectl.io.formats.torch_file", "fusectl.io.formats.onnx_file",
                   "hashlib", "zipfile", "traceback"}


@pytest.mark.parametrize("checkpoint", ["fixtures/tiny-llama-gqa", "fixtures/tiny-llama-gqa-bf16-sharded",
                                        "fixtures/fp8-llama"])
def test_inspect_of_safetensors_loads_no_rule_machinery_and_no_other_reader(checkpoint):
    imported = _modules_imported("-m", "fusectl", "inspect", checkpoint)
    assert {"fusectl.api", "fusectl.io.formats.safetensors_file"} <= imported  # the command ran
    assert NOT_FOR_INSPECT & imported == set()


def test_the_op_registry_is_built_on_first_use():
    """``fusectl.ops`` alone holds the base class; ``OPS`` imports every op module when asked."""
    script = ("import sys, fusectl.ops as ops; before = 'fusectl.ops.layout' in sys.modules;"
              "registry = ops.OPS; print(before, 'fusectl.ops.layout' in sys.modules, 'concat' in registry,"
              " ops.OPS is registry)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True", "True", "True"]


def test_ml_dtypes_is_imported_when_a_bf16_tensor_is_read():
    """The other side of the boundary: reading bf16 data names ml_dtypes' type, which imports it."""
    script = ("import sys, fusectl; c = fusectl.open_checkpoint('fixtures/tiny-llama-gqa-bf16-sharded');"
              "before = 'ml_dtypes' in sys.modules;"
              "data = c.table['model.norm.weight'].read();"
              "print(before, 'ml_dtypes' in sys.modules, data.dtype)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True", "bfloat16"]


def test_an_import_is_charged_to_fusectl_only_through_fusectl():
    """The report's shape, as ``-X importtime`` prints it: children first, two spaces deeper."""
    report = "\n".join(f"import time:       1 |       1 | {line}" for line in [
        "zipfile",                # a site hook's, before fusectl
        "      hashlib",
        "    numpy.random",
        "  numpy",                # numpy's hashlib is numpy's
        "      random",
        "    tempfile",
        "  fusectl.io.atomic",    # random, through the standard library, is fusectl's
        "fusectl.cli",
    ])
    importer = _importers("import time: self [us] | cumulative | imported package\n" + report)
    assert importer["hashlib"] == "numpy.random" and importer["numpy"] == "fusectl.cli"
    assert importer["zipfile"] is None
    charged = {name for name in importer if _asked_by_fusectl(name, importer)}
    assert charged == {"fusectl.cli", "fusectl.io.atomic", "numpy", "tempfile", "random"}
