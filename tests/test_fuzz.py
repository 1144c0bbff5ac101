"""Fuzz: malformed checkpoints, indexes, configs, provenances and rules files, from a seed.

Every case checks the bad-input contract: exit 0 or 2; on 2 an ``error:`` line that names the
file; never "internal error"; no hang (a per-case timeout); no output or temporary file left;
the input unchanged; and never laxer than the safetensors library (a file it rejects is not
read). The default run makes a few hundred cases; set ``FUSECTL_FUZZ_CASES`` (per family) and
``FUSECTL_FUZZ_SEED`` for a longer or another run. MXNet NDArray files are mutated byte by byte
(``4 * FUSECTL_FUZZ_CASES`` per fixture, five fixtures) and an exported net's ``-symbol.json``
node by node, each read with every tensor as the PyTorch files are. PyTorch files are mutated ``8 * FUSECTL_FUZZ_CASES``
times in all, spread over ten fixtures (480 files by default, 10,000 with ``FUSECTL_FUZZ_CASES=1250``),
and read in this process (as every command reads them), each within the time limit and without
raising the process's peak memory past 1 GiB.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import safetensors

from conftest import leftovers, run_cli, snapshot, time_limit
from fusectl.errors import FusectlError
from fusectl.io.formats.mxnet_params import read_mxnet
from fusectl.io.formats.torch_file import ALLOWED_GLOBALS, read_torch

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
CASES = int(os.environ.get("FUSECTL_FUZZ_CASES", "60"))
SEED = int(os.environ.get("FUSECTL_FUZZ_SEED", "0"))
TIMEOUT_S = 20
# Python refuses to convert integers of more than 4,300 digits to or from text, so a huge
# integer is written into the JSON text by replacing this marker
HUGE = "__huge_integer__"


DEEP = "__deep_{}__"  # and JSON nested that deep, which json.dumps itself cannot write


def dumps(doc) -> str:
    text = json.dumps(doc).replace(f'"{HUGE}"', "9" * 5000)
    for depth in (300, 3000, 100_000):
        text = text.replace(f'"{DEEP.format(depth)}"', "[" * depth + "1" + "]" * depth)
    return text


def fuzz_case(tmp_path: Path, family: str, case: int, fixture: str) -> tuple[random.Random, Path]:
    """The case's own random stream, and a copy of ``fixture`` under tmp_path/in to mutate."""
    src = tmp_path / "in"
    shutil.copytree(FIXTURES / fixture, src)
    return random.Random(f"{SEED}-{family}-{case}"), src


def check_contract(args, *, culprit: Path, inputs: Path, out: Path | None, rejected_by_library=False,
                   also_named: tuple[str, ...] = ()):
    """Run fusectl ARGS and check the contract; returns the result. An error must name the
    culprit file or its folder, or one of ``also_named`` (e.g. the rule a config value broke)."""
    before = snapshot(inputs)
    with time_limit(TIMEOUT_S):
        result = run_cli(*args)
    where = f"fusectl {' '.join(map(str, args))}\n{result.stderr}"
    assert result.exit_code in (0, 2), where
    assert "internal error" not in result.stderr and "Traceback" not in result.output, where
    assert "[escaped exception" not in result.stderr, where
    if result.exit_code == 2:
        first = result.stderr.splitlines()[0] if result.stderr else ""
        assert first.startswith("error: "), where
        named = {culprit.name, str(culprit), str(inputs), *also_named}
        assert any(n in result.stderr for n in named), f"the error does not name {culprit.name}: {where}"
        if out is not None:
            assert not out.exists(), where
    if rejected_by_library:
        assert result.exit_code == 2, f"safetensors rejects {culprit.name} but fusectl read it: {where}"
    if out is not None:
        assert leftovers(out.parent) == [], where
    assert snapshot(inputs) == before, f"the input changed: {where}"
    return result


# ------------------------------------------------------------------------- safetensors files


def _split(data: bytes):
    (n,) = struct.unpack("<Q", data[:8])
    return n, data[8 : 8 + n], data[8 + n :]


def _json_mutation(rng: random.Random, header: dict) -> dict:
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    entry = dict(header[name])
    choice = rng.randrange(14)
    if choice == 0:
        entry["dtype"] = rng.choice(["F33", "", "f32", ["F32"], 7, None, "BF16", "F8_E4M3", "I64", "U8"])
    elif choice == 1:
        entry["shape"] = rng.choice([[-1], [2**63], [10**30], "32", [1.5], [True], [], [0], [2**40, 2**40],
                                     [1] * 200, None, [[2]]])
    elif choice == 2:
        b, e = entry["data_offsets"]
        entry["data_offsets"] = rng.choice([[b, e + 1], [b - 1, e], [b + 1, e + 1], [e, b], [b, b],
                                            [b, 10**20], [-8, e], [b, e, e], "0", [float(b), e], [b, None]])
    elif choice == 3:
        entry["extra"] = 1
    elif choice == 4:
        del entry[rng.choice(list(entry))]
    elif choice == 5:
        header = dict(header)
        header["__metadata__"] = rng.choice([{"a": 1}, ["x"], "s", {"format": {"pt": 1}}, None, {}, {"fusectl": "{"}])
        return header
    elif choice == 6:
        header = dict(header)
        header[rng.choice(["\x00", "a" * 5000, "__metadata__.x", "", "\x1b[31mred"])] = entry
        return header
    elif choice == 7:
        header = dict(header)
        del header[name]  # leaves a gap in the data section
        return header
    elif choice == 8:
        other = rng.choice(names)
        entry["data_offsets"] = list(header[other]["data_offsets"])  # overlap another tensor
    elif choice == 9:
        return rng.choice([[], "x", 3, None, {"a": []}])
    elif choice == 10:
        header = dict(header)
        header[name] = DEEP.format(rng.choice([300, 3000, 100_000]))
        return header
    elif choice == 11:
        entry["shape"] = [rng.choice([10**20 - 1, 10**400 - 1, HUGE])]
    elif choice == 12:
        entry = rng.choice([[], "x", None, 1])
    else:
        entry["dtype"] = rng.choice(["F16", "F64", "I8", "BOOL"])
    header = dict(header)
    header[name] = entry
    return header


def _mutate_safetensors(rng: random.Random, data: bytes) -> bytes:
    n, raw, body = _split(data)
    kind = rng.randrange(9)
    if kind == 0:  # truncate anywhere
        return data[: rng.randrange(len(data))]
    if kind == 1:  # header length off by a little
        delta = rng.choice([-8, -3, -1, 1, 2, 7, 8, 2**40, -n])
        return struct.pack("<Q", max(0, n + delta) % 2**64) + data[8:]
    if kind == 2:  # flip bytes inside the header
        raw = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return struct.pack("<Q", n) + bytes(raw) + body
    if kind == 3:  # trailing bytes after the data
        return data + bytes(rng.randint(1, 64))
    if kind == 4:  # invalid UTF-8 or NUL in the header
        raw = bytearray(raw)
        raw[rng.randrange(len(raw))] = rng.choice([0x00, 0xFF, 0xC3])
        return struct.pack("<Q", n) + bytes(raw) + body
    if kind == 5:  # non-JSON literals
        text = raw.decode("utf-8", "replace").replace("[", "[NaN,", 1) if rng.random() < 0.5 else "Infinity"
        new = text.encode()
        return struct.pack("<Q", len(new)) + new + body
    header = json.loads(raw)
    new = dumps(_json_mutation(rng, header)).encode()
    if rng.random() < 0.3:
        new += b" " * rng.randrange(1, 16)  # padding the format allows
    return struct.pack("<Q", len(new)) + new + body


def _library_rejects(path: Path) -> bool:
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            for key in f.keys():
                f.get_slice(key)
    except Exception:
        return True
    return False


@pytest.mark.parametrize("case", range(CASES))
def test_fuzzed_safetensors_file(tmp_path, case):
    rng, src = fuzz_case(tmp_path, "file", case, "tiny-llama-gqa")
    weights = src / "model.safetensors"
    weights.write_bytes(_mutate_safetensors(rng, weights.read_bytes()))
    rejected = _library_rejects(weights)
    check_contract(["inspect", src, "--json"], culprit=weights, inputs=src, out=None, rejected_by_library=rejected)
    out = tmp_path / "out"
    # a valid file whose flipped byte renamed a tensor fails in the rule that needs it, naming both
    check_contract(["fuse", src, "-r", "llama-qkv", "-o", out, "--quiet"], culprit=weights, inputs=src,
                   out=out, rejected_by_library=rejected, also_named=("preset llama-qkv",))


# --------------------------------------------------------------------------------- indexes


def _mutate_index(rng: random.Random, index: dict) -> object:
    weight_map = dict(index["weight_map"])
    name = rng.choice(sorted(weight_map))
    choice = rng.randrange(10)
    if choice == 0:
        weight_map[name] = rng.choice(["missing.safetensors", "../model.safetensors", "/etc/passwd", "", 3, None,
                                       "model-00001-of-00003.safetensors/../x"])
    elif choice == 1:
        del weight_map[name]
    elif choice == 2:
        weight_map["ghost.weight"] = "model-00001-of-00003.safetensors"
    elif choice == 3:
        return {**index, "weight_map": rng.choice([[], "x", None, {}])}
    elif choice == 4:
        return {**index, "metadata": rng.choice([[], "x", {"fusectl": "{not json"}, {"fusectl": 3}])}
    elif choice == 5:
        return rng.choice([[], "x", 3, None])
    elif choice == 6:
        return {**index, "metadata": {"a": DEEP.format(rng.choice([300, 100_000]))}}
    elif choice == 7:
        return {**index, "metadata": {"total_size": HUGE}}
    elif choice == 8:
        other = rng.choice(sorted(set(weight_map.values())))
        weight_map[name] = other
    else:
        return {"weight_map": weight_map, "metadata": {"fusectl": json.dumps({"format_version": 1, "plan": "x"})}}
    return {**index, "weight_map": weight_map}


@pytest.mark.parametrize("case", range(CASES // 2))
def test_fuzzed_index(tmp_path, case):
    rng, src = fuzz_case(tmp_path, "index", case, "tiny-llama-gqa-bf16-sharded")
    index = src / "model.safetensors.index.json"
    mutated = _mutate_index(rng, json.loads(index.read_text()))
    text = dumps(mutated) if rng.random() < 0.9 else index.read_text()[: rng.randrange(50, 500)]
    index.write_text(text)
    out = tmp_path / "out"
    check_contract(["inspect", src], culprit=index, inputs=src, out=None)
    check_contract(["fuse", src, "-r", "llama-qkv", "-o", out, "--quiet"], culprit=index, inputs=src, out=out)


# --------------------------------------------------------------------------------- configs


@pytest.mark.parametrize("case", range(CASES // 2))
def test_fuzzed_config(tmp_path, case):
    rng, src = fuzz_case(tmp_path, "config", case, "tiny-llama-gqa")
    config = src / "config.json"
    doc = json.loads(config.read_text())
    key = rng.choice(["num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size",
                      "tie_word_embeddings", "architectures"])
    value = rng.choice([0, -4, "4", 4.0, None, [], {}, True, 2**70, HUGE, 3, 7, ["X"], [3]])
    if rng.random() < 0.15:
        value = DEEP.format(rng.choice([300, 100_000]))
    doc[key] = value
    text = dumps(doc) if rng.random() < 0.9 else rng.choice(["", "[", "NaN", '{"a": Infinity}', "\xff"])
    config.write_text(text)
    out = tmp_path / "out"
    # a value of the right type but the wrong size surfaces where the rule that uses it fails
    rule = ("preset llama-qkv",)
    check_contract(["plan", src, "-r", "llama-qkv"], culprit=config, inputs=src, out=None, also_named=rule)
    check_contract(["fuse", src, "-r", "llama-qkv", "-o", out, "--quiet"], culprit=config, inputs=src, out=out,
                   also_named=rule)


# ------------------------------------------------------------------------------ provenances


@pytest.fixture(scope="module")
def fused_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    out = root / "fused.safetensors"
    result = run_cli("fuse", FIXTURES / "tiny-llama-gqa", "-r", "llama-qkv", "-r", "llama-gate-up", "-o", out, "--quiet")
    assert result.exit_code == 0, result.stderr
    return out


def _mutate_provenance(rng: random.Random, doc: dict) -> object:
    doc = json.loads(json.dumps(doc))
    groups = doc["plan"]
    group = rng.choice(groups)
    step = rng.choice(group["steps"])
    choice = rng.randrange(14)
    if choice == 0:
        step["input_specs"] = rng.choice([[[]], [["F32"]], [["F99", [1]]], [["F32", [-1]]], "x", [[["F32"], [1]]]])
    elif choice == 1:
        step["params"] = {k: rng.choice(["0", None, [], 1e308, -1, 2**70, {"a": 1}]) for k in step["params"]}
    elif choice == 2:
        step["outputs"] = rng.choice([[], [""], ["a", "a"], [None], "x", ["__metadata__"]])
    elif choice == 3:
        step["op"] = rng.choice(["nope", "", None, ["drop"], "drop", "reshape", "refuse"])
    elif choice == 4:
        step["inputs"] = rng.choice([[], ["ghost"], [None], "x"])
    elif choice == 5:
        doc["format_version"] = rng.choice([2, "1", None, 1.0])
    elif choice == 6:
        doc["aliases"] = rng.choice([[], {"a": "b"}, {"model.norm.weight": "ghost"}, "x"])
    elif choice == 7:
        return rng.choice([[], "x", None, 3])
    elif choice == 8:
        doc["plan"] = rng.choice([{}, "x", [None], [{}]])
    elif choice == 9:
        step["params"] = dict(step["params"], chunks=10**9, groups=10**9, axis=10**9)
    elif choice == 10:
        step["output_specs"] = [["F32", [10**12, 10**12]]]
    elif choice == 11:
        group["untied"] = rng.choice([[["x"]], "x", [[None]]])
    elif choice == 12:
        step["input_specs"] = [["F32", [HUGE]]]
    else:
        del step[rng.choice(list(step))]
    return doc


@pytest.mark.parametrize("case", range(CASES))
def test_fuzzed_provenance(tmp_path, fused_file, case):
    rng = random.Random(f"{SEED}-provenance-{case}")
    data = fused_file.read_bytes()
    n, raw, body = _split(data)
    header = json.loads(raw)
    provenance = json.loads(header["__metadata__"]["fusectl"])
    mutated = _mutate_provenance(rng, provenance)
    text = dumps(mutated) if rng.random() < 0.9 else dumps(mutated)[: rng.randrange(1, 200)]
    header["__metadata__"]["fusectl"] = text
    new = json.dumps(header).encode()
    src = tmp_path / "in"
    src.mkdir()
    path = src / "fused.safetensors"
    path.write_bytes(struct.pack("<Q", len(new)) + new + body)
    check_contract(["inspect", path], culprit=path, inputs=src, out=None)
    out = tmp_path / "back.safetensors"
    check_contract(["unfuse", path, "-o", out, "--quiet"], culprit=path, inputs=src, out=out)


# ----------------------------------------------------------------------------- rules files

_OPS = ["rename", "drop", "concat", "split", "interleave", "deinterleave", "stack", "unstack", "transpose",
        "reshape", "reorder", "rope_permute", "weight_norm_fold", "weight_norm_unfold", "spectral_norm_fold",
        "bn_fold", "refuse", "nope", ""]
_PATTERNS = ["{p*}.layers.{i:int}.self_attn.q_proj.weight", "{p*}.layers.{i}.mlp.{x}_proj.weight",
             "model.norm.weight", "{a*}", "{a}", "{a*}.{b*}", "{a}{b}", "x.{", "{p*}.weight", "",
             "model.layers.{i:int}.self_attn.{x}_proj.weight", "\x00", "{i:int}.{i}", "lm_head.weight"]
_VALUES = [0, 1, -1, 2, 3, 4, 8, 10**9, 2**63, "heads", "config:num_attention_heads", "config:nope",
           "heads * heads", "1 // 0", "(" * 50, "-" * 1000 + "1", " * ".join(["heads"] * 3000), 1.5, True,
           [0, 1], [1, 0], [0, 3, 1, 2], [], "auto", "none", "hf", "meta", "conv", [32, 16, 16], [-1]]


def _toml(value) -> str:
    return json.dumps(value)  # JSON scalars and lists of them are valid TOML


def _random_rules(rng: random.Random) -> str:
    lines = ["version = 1"]
    if rng.random() < 0.5:
        lines.append("[vars]")
        lines.append('heads = "config:num_attention_heads"')
        for k in range(rng.randint(0, 4)):
            lines.append(f"v{k} = {_toml(rng.choice(_VALUES))}")
        if rng.random() < 0.2:  # each var the square of the one before
            lines.append("s0 = 2")
            lines.extend(f's{k} = "s{k - 1} * s{k - 1}"' for k in range(1, rng.choice([10, 22, 40])))
    for _ in range(rng.randint(0, 3)):
        lines.append("[[rule]]")
        lines.append(f"op = {_toml(rng.choice(_OPS))}")
        for key in rng.sample(["input", "inputs", "output", "outputs", "axis", "sizes", "groups", "chunks",
                               "order", "perm", "shape", "heads", "to", "over", "optional", "g", "v", "dim",
                               "weight", "mean", "var", "gamma", "beta", "output_weight", "output_bias",
                               "message", "name", "bogus"], rng.randint(1, 6)):
            if key in ("input", "output", "g", "v", "weight", "mean", "var", "gamma", "beta", "output_weight",
                       "output_bias"):
                value = rng.choice(_PATTERNS)
            elif key in ("inputs", "outputs"):
                value = rng.sample(_PATTERNS, rng.randint(0, 3))
            elif key == "optional":
                value = rng.choice([True, False, "yes"])
            elif key in ("message", "name"):
                value = rng.choice(["x", "\x1b[2J\x07", "é" * 3])
            else:
                value = rng.choice(_VALUES)
            lines.append(f"{key} = {_toml(value)}")
    text = "\n".join(lines) + "\n"
    if rng.random() < 0.1:
        text = text[: rng.randrange(len(text))]
    if rng.random() < 0.05:
        text += "a = " + "[" * 100_000 + "]" * 100_000 + "\n"
    return text


@pytest.mark.parametrize("case", range(CASES * 2))
def test_fuzzed_rules_file(tmp_path, case):
    rng, src = fuzz_case(tmp_path, "rules", case, "tiny-llama-gqa")
    rules = src / "rules.toml"
    rules.write_text(_random_rules(rng))
    check_contract(["plan", src / "model.safetensors", "-r", rules, "--config", src / "config.json"],
                   culprit=rules, inputs=src, out=None)
    out = tmp_path / "out.safetensors"
    result = check_contract(["fuse", src / "model.safetensors", "-r", rules, "--config", src / "config.json",
                             "-o", out, "--quiet"], culprit=rules, inputs=src, out=out)
    if result.exit_code == 0:  # a rules file that works is undone by its provenance, or says why not
        back = tmp_path / "back.safetensors"
        check_contract(["unfuse", out, "-o", back, "--quiet"], culprit=out, inputs=out, out=back,
                       also_named=(str(rules),))


# ------------------------------------------------------------------------------ PyTorch files

RSS_LIMIT_KB = 1 << 20  # no file may make a command use more than 1 GiB
_BYTE_MUTATED = ["tied.pt", "views-legacy.pt", "training-legacy.pt", "protocol4.pt", "deflated.pt", "big-endian.pt",
                 "legacy-protocol1.pt"]
_PICKLE_MUTATED = ["training.pt", "views.pt", "mixed.pt"]
TORCH_CASES = 8 * CASES // (len(_BYTE_MUTATED) + len(_PICKLE_MUTATED))  # per fixture


def _mutated(data: bytes, rng: random.Random) -> bytes:
    """``data`` with one to four random byte edits: overwrite, delete, insert or truncate."""
    mutated = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.random()
        at = rng.randrange(len(mutated))
        if kind < 0.5:
            mutated[at] = rng.randrange(256)
        elif kind < 0.7:
            del mutated[at:at + rng.randint(1, 8)]
        elif kind < 0.85:
            mutated[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        else:
            mutated = mutated[:at]
        if not mutated:
            mutated = bytearray(b"\x80")
    return bytes(mutated)


def torch_problem(path: Path, read=read_torch, named: Path | None = None) -> str | None:
    """Read a PyTorch file (or, with ``read``, another format's) and every tensor in it as the
    commands do; what broke the bad-input contract (an exception that is not a FusectlError, an
    error that does not name the file — or ``named``, a file read beside it —, no result within
    the time limit, the process's peak memory past RSS_LIMIT_KB), or None."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        with time_limit(TIMEOUT_S):
            contents = read(str(path))
            for tensor in contents.tensors.values():
                tensor.read()
    except FusectlError as e:
        if str(path) not in str(e) and (named is None or str(named) not in str(e)):
            return f"the error does not name the file: {e}"
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - a hang (pytest's Failed) or a bug: reported with the case
        return f"{type(e).__name__}: {str(e)[:300]}"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if peak > max(before, RSS_LIMIT_KB):
        return f"peak memory {peak // 1024} MiB"
    return None


def _check_all(cases) -> None:
    problems = []
    for label, path in cases:
        problem = torch_problem(path)
        if problem:
            problems.append(f"{label}: {problem}")
    assert not problems, f"{len(problems)} cases broke the contract:\n" + "\n".join(problems[:20])


@pytest.mark.parametrize("name", _BYTE_MUTATED)
def test_fuzzed_torch_file_bytes(tmp_path, name):
    rng = random.Random(f"{SEED}-torch-{name}")
    data = (FIXTURES / "torch" / name).read_bytes()
    path = tmp_path / "fuzz.pt"

    def cases():
        for case in range(TORCH_CASES):
            path.write_bytes(_mutated(data, rng))
            yield f"{name} mutation {case} (seed {SEED})", path

    _check_all(cases())


@pytest.mark.parametrize("name", _PICKLE_MUTATED)
def test_fuzzed_torch_pickle(tmp_path, name):
    # mutating data.pkl inside the zip would only fail its CRC: re-zip each mutation instead
    rng = random.Random(f"{SEED}-pickle-{name}")
    with zipfile.ZipFile(FIXTURES / "torch" / name) as zf:
        records = [(n, zf.read(n)) for n in zf.namelist()]
    pkl_name = next(n for n, _ in records if n.endswith("/data.pkl"))
    path = tmp_path / "fuzz.pt"

    def cases():
        for case in range(TORCH_CASES):
            mutated = _mutated(dict(records)[pkl_name], rng)
            with zipfile.ZipFile(path, "w") as zf:
                for record, data in records:
                    zf.writestr(record, mutated if record == pkl_name else data)
            yield f"{name} pickle mutation {case} (seed {SEED})", path

    _check_all(cases())


# ------------------------------------------------------------------ PyTorch pickles that amplify

_NAMES = sorted(ALLOWED_GLOBALS)


def _global(name: str) -> bytes:
    module, _, attribute = name.rpartition(".")
    return b"c" + module.encode() + b"\n" + attribute.encode() + b"\n"


_GET = b"j\x00\x00\x00\x00"  # the memoized object
_TENSOR = (_global("torch._utils._rebuild_tensor_v2") + b"((X\x07\x00\x00\x00storage" + _global("torch.FloatStorage")
           + b"X\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQK\x00{size}{stride}\x89"
           + _global("collections.OrderedDict") + b")RtR")


def _call(name: str, extra: bytes = b"") -> bytes:
    return _global(name) + b"(" + _GET + extra + b"tR"


# what a pickle can do many times with one memoized object: calls of the allowed globals that
# copy it, containers that hold it, items added to it, a tensor shaped by it
_USES = {
    "Size": _call("torch.Size"), "set": _call("builtins.set"), "frozenset": _call("__builtin__.frozenset"),
    "OrderedDict": _call("collections.OrderedDict"), "encode": _call("_codecs.encode", b"X\x06\x00\x00\x00latin1"),
    "list": b"(" + _GET * 100 + b"l", "tuple": b"(" + _GET * 100 + b"t", "dict value": b"}(K\x01" + _GET + b"u",
    "BUILD": _global("collections.OrderedDict") + b")R" + _GET + b"b", "APPENDS": _GET + b"(" + b"K\x01" * 1000 + b"e",
    "SETITEMS": _GET + b"(" + b"K\x01K\x02" * 500 + b"u", "ADDITEMS": _GET + b"(" + b"K\x01" * 1000 + b"\x90",
    "shape": _TENSOR.replace(b"{size}", _GET).replace(b"{stride}", _GET), "persistent id": _GET + b"Q",
    "arguments": _global("torch._utils._rebuild_tensor_v2") + _GET + b"R",
}
# what fits each kind of memoized object (the others are tried too, a fifth of the time)
_FITTING = {"ones": ["Size", "set", "frozenset", "list", "tuple", "APPENDS", "shape"],
            "numbers": ["Size", "set", "frozenset", "dict value", "APPENDS"],
            "text": ["encode", "list", "set"], "pairs": ["OrderedDict", "set", "frozenset", "BUILD", "APPENDS"],
            "dict": ["OrderedDict", "BUILD", "SETITEMS", "dict value"], "tuple": ["Size", "set", "frozenset", "tuple"],
            "set": ["frozenset", "ADDITEMS", "Size"], "bytes": ["list", "dict value", "tuple"]}


def _amplifying_pickle(rng: random.Random) -> bytes:
    """A state dict with one good tensor beside one large object that the pickle memoizes and
    then names again and again (a use of _USES, or two, repeated)."""
    n = rng.choice([10, 1000, 100_000, 400_000])
    kind = rng.choice(sorted(_FITTING))
    numbers = b"".join(b"J" + struct.pack("<i", k) for k in range(n))
    raw = ("a" * n + rng.choice(["", "é", "\U0001F600"])).encode()
    base = {"ones": b"(" + b"K\x01" * n + b"l", "numbers": b"(" + numbers + b"l",
            "text": b"X" + struct.pack("<I", len(raw)) + raw, "pairs": b"(" + b"(K\x01K\x02t" * (n // 4) + b"l",
            "dict": b"}(" + b"".join(numbers[k:k + 5] + b"N" for k in range(0, len(numbers), 10)) + b"u",
            "tuple": b"(" + b"K\x02" * n + b"t", "set": b"\x8f(" + numbers + b"\x90",
            "bytes": b"B" + struct.pack("<I", n) + bytes(n)}[kind]
    names = [rng.choice(_FITTING[kind] if rng.random() < 0.8 else sorted(_USES)) for _ in range(rng.choice([1, 2]))]
    uses = b"".join(_USES[name] for name in names) * rng.choice([1, 10, 100, 400])
    junk = base + b"r\x00\x00\x00\x000(" + uses + b"l"
    tensor = _TENSOR.replace(b"{size}", b"K\x04\x85").replace(b"{stride}", b"K\x01\x85")
    return b"\x80\x02}(X\x01\x00\x00\x00w" + tensor + b"X\x04\x00\x00\x00junk" + junk + b"u."


@pytest.mark.parametrize("case", range(CASES // 4))
def test_fuzzed_torch_amplification(tmp_path, case):
    rng = random.Random(f"{SEED}-amplify-{case}")
    path = tmp_path / "fuzz.pt"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", _amplifying_pickle(rng))
        zf.writestr("archive/data/0", struct.pack("<4f", 1, 2, 3, 4))
    problem = torch_problem(path)
    assert problem is None, f"amplification case {case} (seed {SEED}): {problem}"


# ------------------------------------------------------------------------------ MXNet files

_MXNET_MUTATED = ["raw/dtypes.nd", "raw/sparse.nd", "raw/v1.nd", "raw/numpy-shape.nd", "lstm/lstm-0000.params"]
MXNET_CASES = 4 * CASES


@pytest.mark.parametrize("name", _MXNET_MUTATED)
def test_fuzzed_mxnet_file_bytes(tmp_path, name):
    rng = random.Random(f"{SEED}-mxnet-{name}")
    data = (FIXTURES / "mxnet" / name).read_bytes()
    path = tmp_path / Path(name).name

    def cases():
        for case in range(MXNET_CASES):
            path.write_bytes(_mutated(data, rng))
            yield f"{name} mutation {case} (seed {SEED})", path

    problems = [f"{label}: {problem}" for label, p in cases() if (problem := torch_problem(p, read_mxnet))]
    assert not problems, f"{len(problems)} cases broke the contract:\n" + "\n".join(problems[:20])


def _symbol_mutation(rng: random.Random, doc: dict) -> dict:
    nodes = doc["nodes"]
    node = dict(rng.choice(nodes))
    choice = rng.randrange(9)
    if choice == 0:
        node["inputs"] = rng.choice([[[len(nodes) + 3, 0, 0]], [[-1, 0, 0]], "x", [[0]], [[0, 0, 0, 0]], [["0", 0, 0]],
                                     None, [[HUGE, 0, 0]], [[0, 0, 0]] * 2])
    elif choice == 1:
        node["attrs"] = rng.choice([{"mode": "lstm", "state_size": "x", "num_layers": "2"}, {"eps": 1}, [], None,
                                    {"fix_gamma": "maybe"}, {"projection_size": "-4"}, {"state_size": HUGE}])
    elif choice == 2:
        node["op"] = rng.choice(["RNN", "BatchNorm", "null", 3, None, "", "FullyConnected"])
    elif choice == 3:
        node["name"] = rng.choice([None, 7, "", "a" * 5000, "\x1b[31m", "arg:x"])
    elif choice == 4:
        return rng.choice([[], "x", None, {"nodes": {}}, {"nodes": DEEP.format(3000)}, {}])
    elif choice == 5:
        node = rng.choice([None, [], "x", 1])
    elif choice == 6:
        node["op"], node["attrs"] = "RNN", {"mode": rng.choice(["lstm", "gru", "x"]), "state_size": "4"}
    elif choice == 7:
        doc = dict(doc)
        doc["nodes"] = nodes + [{"op": "FullyConnected", "name": "extra_fwd", "inputs": [[1, 0, 0], [1, 0, 0]]}]
        return doc
    else:
        node["inputs"] = [[0, 0, 0]] + [[k, 0, 0] for k in range(1, min(len(nodes), 4))]
    doc = dict(doc)
    doc["nodes"] = [node if n is nodes[0] else n for n in nodes] if rng.random() < 0.3 else \
        [node if k == nodes.index(rng.choice(nodes)) else n for k, n in enumerate(nodes)]
    return doc


@pytest.mark.parametrize("case", range(CASES))
def test_fuzzed_mxnet_symbol(tmp_path, case):
    rng = random.Random(f"{SEED}-mxnet-symbol-{case}")
    folder = FIXTURES / "mxnet" / rng.choice(["tied", "lstm", "conv-bn"])
    stem = {"tied": "tied", "lstm": "lstm", "conv-bn": "bn-noscale"}[folder.name]
    params = Path(shutil.copy(folder / f"{stem}-0000.params", tmp_path / f"{stem}-0000.params"))
    symbol = tmp_path / f"{stem}-symbol.json"
    symbol.write_text(dumps(_symbol_mutation(rng, json.loads((folder / f"{stem}-symbol.json").read_text()))))
    problem = torch_problem(params, read_mxnet, named=symbol)
    assert problem is None, f"symbol case {case} (seed {SEED}): {problem}"


# ------------------------------------------------------------------ DeepSpeed ZeRO rank files

_ZERO_FILES = [("zero2", "zero_pp_rank_1_mp_rank_00_optim_states.pt"), ("zero2", "mp_rank_00_model_states.pt"),
               ("zero3", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
               ("zero3", "zero_pp_rank_1_mp_rank_00_model_states.pt")]


@pytest.mark.parametrize("name,file", _ZERO_FILES, ids=[f"{n}/{f}" for n, f in _ZERO_FILES])
def test_fuzzed_deepspeed_zero_file(tmp_path, name, file):
    # one rank's file of a ZeRO folder, its pickle mutated (re-zipped, so its CRC holds) or its
    # bytes: the folder reads, every weight and optimizer state with it, or is refused naming the file
    from fusectl.io.formats.deepspeed_zero import read_zero
    rng = random.Random(f"{SEED}-zero-{name}-{file}")
    folder = tmp_path / name
    shutil.copytree(FIXTURES / "distributed" / name, folder)
    path = folder / "global_step3" / file
    data = path.read_bytes()
    with zipfile.ZipFile(path) as zf:
        records = [(n, zf.read(n)) for n in zf.namelist()]
    pkl_name = next(n for n, _ in records if n.endswith("/data.pkl"))

    def read(_):
        contents = read_zero(str(folder))
        optimizer = contents.training.tree()["optimizer"]
        for entry in optimizer["state"].values():
            for value in entry.values():
                value.read()
        return contents

    problems = []
    for case in range(TORCH_CASES):
        if case % 2:
            path.write_bytes(_mutated(data, rng))
        else:
            with zipfile.ZipFile(path, "w") as zf:
                for record, value in records:
                    zf.writestr(record, _mutated(value, rng) if record == pkl_name else value)
        problem = torch_problem(path, read=read)
        if problem:
            problems.append(f"{name}/{file} mutation {case} (seed {SEED}): {problem}")
    assert not problems, f"{len(problems)} cases broke the contract:\n" + "\n".join(problems[:20])


def _tree_spots(node, found):
    """Every (container, key) of a tree of dicts and lists, depth first."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        found.append((node, key))
        _tree_spots(value, found)
    return found


def _odd_value(rng: random.Random, old):
    """What a corrupt or edited DeepSpeed file might hold instead of ``old``: another kind of
    value, a number out of range, a tensor cut short or made 0-d, a dict or list short of an item."""
    from fusectl.tensors import ByteRange, FileTensor, LazyTensor, TensorSpec
    choices = [None, -1, 0, 1, 7, 10**12, 3.5, "x", [], {}, [1, 2], (5,), ("a",), True]
    ranges = old.byte_ranges() if isinstance(old, LazyTensor) else None
    if ranges:
        size, n = old.spec.dtype.itemsize, max(0, old.spec.numel - rng.randint(0, 3))
        choices += [FileTensor(TensorSpec(old.spec.dtype, (n,)), ByteRange(ranges[0].path, ranges[0].offset, n * size)),
                    FileTensor(TensorSpec(old.spec.dtype, ()), ByteRange(ranges[0].path, ranges[0].offset, size))]
    if isinstance(old, dict) and old:
        choices.append({k: v for k, v in old.items() if k != rng.choice(list(old))})
    if isinstance(old, list) and old:
        choices += [old[:-1], old + old[-1:]]
    if isinstance(old, tuple):
        choices += [tuple(x + 1 if type(x) is int else x for x in old), old[:-1]]
    return rng.choice(choices)


_DEEPSPEED_FOLDERS = [("distributed", "zero2"), ("distributed", "zero3-tied"), ("deepspeed-padded", "zero2"),
                      ("deepspeed-padded", "zero3"), ("distributed", "zero2-universal"),
                      ("deepspeed-padded", "zero3-universal")]


@pytest.mark.parametrize("root,name", _DEEPSPEED_FOLDERS, ids=[f"{r}/{n}" for r, n in _DEEPSPEED_FOLDERS])
def test_fuzzed_deepspeed_trees(tmp_path, root, name):
    # a file of a ZeRO or universal folder read, a value or two of its tree replaced, written back:
    # the folder reads, every tensor with it, or is refused naming the file
    from fusectl.io.formats.deepspeed_universal import read_universal
    from fusectl.io.formats.deepspeed_zero import RECORDS, read_zero
    from fusectl.io.formats.torch_file import read_torch_tree
    from fusectl.io.formats.torch_writer import write_torch_file
    rng = random.Random(f"{SEED}-zero-tree-{root}-{name}")
    reader = read_universal if name.endswith("universal") else read_zero
    problems = []
    for case in range(TORCH_CASES):
        folder = tmp_path / str(case) / name
        shutil.copytree(FIXTURES / root / name, folder)
        path = rng.choice(sorted(folder.rglob("*.pt")))
        tree, record = read_torch_tree(str(path), records=RECORDS)
        for _ in range(rng.randint(1, 2)):
            spots = _tree_spots(tree, [])
            if spots:
                node, key = rng.choice(spots)
                node[key] = _odd_value(rng, node[key])
        try:
            write_torch_file(f"{path}.new", tree, metadata=record)
        except FusectlError:  # a tree torch cannot hold either
            continue
        os.replace(f"{path}.new", path)

        def read(_):
            contents = reader(str(folder))
            for entry in contents.training.tree()["optimizer"]["state"].values():
                for value in entry.values():
                    if not isinstance(value, (int, float)):
                        value.read()
            return contents

        problem = torch_problem(path, read=read)
        if problem:
            problems.append(f"{root}/{name} {path.relative_to(folder)} case {case} (seed {SEED}): {problem}")
    assert not problems, f"{len(problems)} cases broke the contract:\n" + "\n".join(problems[:20])


# ------------------------------------------------------------------ torch.distributed.checkpoint folders


def _record_spots(node, found):
    """Every (container, key) of a DCP ``.metadata`` tree: dicts, lists and each record's fields."""
    from fusectl.io.formats.torch_file import Record
    if isinstance(node, Record):
        if isinstance(node.state, dict):
            _record_spots(node.state, found)
        return found
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in list(items):
        found.append((node, key))
        _record_spots(value, found)
    return found


def _read_dcp_whole(folder: Path):
    """Read a folder many ranks wrote as the commands do: every tensor of the model and of the
    training tree."""
    from fusectl.io.registry import folder_format
    from fusectl.tensors import LazyTensor
    contents = folder_format(str(folder)).read(str(folder))
    stack = [contents.training.tree() if contents.training else contents.tensors]
    while stack:
        node = stack.pop()
        if isinstance(node, LazyTensor):
            node.read()
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return contents


@pytest.mark.parametrize("name, file", [("dcp", ".metadata"), ("dcp", "__1_0.distcp"), ("dcp-local", "__1.metadata"),
                                        ("dcp-safetensors", "shard-00002-model-00001-of-00001.safetensors")])
def test_fuzzed_dcp_file_bytes(tmp_path, name, file):
    # a DCP folder's index (.metadata, or a rank's own) or a rank's file (.distcp, or sharded
    # safetensors) with random byte edits: the folder reads, every tensor with it, or is refused
    # naming a file of the folder
    rng = random.Random(f"{SEED}-dcp-{file}")
    folder = tmp_path / name
    shutil.copytree(FIXTURES / "distributed" / name, folder)
    path = folder / file
    data = path.read_bytes()
    problems = []
    for case in range(TORCH_CASES):
        path.write_bytes(_mutated(data, rng))
        problem = torch_problem(path, read=lambda _: _read_dcp_whole(folder), named=folder)
        if problem:
            problems.append(f"{name}/{file} mutation {case} (seed {SEED}): {problem}")
    assert not problems, f"{len(problems)} cases broke the contract:\n" + "\n".join(problems[:20])


@pytest.mark.parametrize("name", ["dcp", "dcp-tied"])
def test_fuzzed_dcp_metadata_tree(tmp_path, name):
    # a DCP .metadata read, a field or two of its records replaced by another kind of value or a
    # number out of range, pickled back: the folder reads, every tensor with it, or is refused
    from fusectl.io.formats.dcp import RECORDS
    from fusectl.io.formats.torch_file import read_pickle
    from fusectl.io.formats.torch_writer import pickle_tree
    rng = random.Random(f"{SEED}-dcp-tree-{name}")
    problems = []
    for case in range(TORCH_CASES):
        folder = tmp_path / str(case) / name
        shutil.copytree(FIXTURES / "distributed" / name, folder)
        path = folder / ".metadata"
        tree = read_pickle(path.read_bytes(), str(path), RECORDS)
        for _ in range(rng.randint(1, 2)):
            node, key = rng.choice(_record_spots(tree, []))
            node[key] = _odd_value(rng, node[key])
        try:
            path.write_bytes(pickle_tree(tree, str(path)))
        except FusectlError:  # a tree a pickle of torch's cannot hold either
            continue
        problem = torch_problem(path, read=lambda _: _read_dcp_whole(folder), named=folder)
        if problem:
            problems.append(f"{name} case {case} (seed {SEED}): {problem}")
    assert not problems, f"{len(problems)} cases broke the contract:\n" + "\n".join(problems[:20])
