"""Bad input: exit 2, ``error:`` naming the culprit, no traceback, no output, input untouched.

Every case runs ``fuse`` (the command that writes) unless stated, and checks the full contract
with ``assert_refused``: exit code, message, no traceback, no output path, no temporary or
half-renamed file beside it, and every input byte unchanged.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from conftest import leftovers, load_checkpoint_raw, ok, snapshot, write_rules, write_safetensors

LLAMA = "tiny-llama-gqa"
BF16 = "tiny-llama-gqa-bf16-sharded"


@pytest.fixture
def area(tmp_path):
    """``in/`` for inputs, ``out/`` as the output's folder."""
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    return tmp_path


def assert_refused(result, out: Path, before: dict, inputs_root: Path, *needles: str):
    text = result.output
    assert result.exit_code == 2, f"exit {result.exit_code}\n{text}"
    assert result.stderr.startswith("error:"), result.stderr
    assert "Traceback" not in text
    assert "internal error" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in result.stderr, f"{needle!r} not named in: {result.stderr}"
    assert not os.path.lexists(out), f"{out} was written"
    assert leftovers(out.parent) == [], leftovers(out.parent)
    assert snapshot(inputs_root) == before, "the input changed"


def refuse_case(cli, area, ckpt: Path, *args, needles=(), out_name="result"):
    out = area / "out" / out_name
    before = snapshot(area / "in")
    result = cli("fuse", ckpt, *args, "-o", out)
    assert_refused(result, out, before, area / "in", *needles)
    return result


def llama_tensors(copy_fixture):
    import safetensors.numpy

    src = copy_fixture(LLAMA, "llama-src")
    return safetensors.numpy.load_file(str(src / "model.safetensors"))


# ------------------------------------------------------------------------- corrupt safetensors


def test_truncated_file(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    model = src / "model.safetensors"
    data = model.read_bytes()
    model.write_bytes(data[: len(data) - 1000])
    refuse_case(cli, area, src, "-r", "llama-qkv", needles=["model.safetensors", "truncated"])


def test_header_length_past_end(cli, area):
    path = area / "in" / "m.safetensors"
    path.write_bytes(struct.pack("<Q", 10**6) + b'{"a":1}')
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.safetensors"])


def test_absurd_header_length(cli, area):
    path = area / "in" / "m.safetensors"
    path.write_bytes(struct.pack("<Q", 2**63) + b"x" * 64)
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.safetensors"])


def test_non_json_header(cli, area):
    path = area / "in" / "m.safetensors"
    header = b"this is not json at all!"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.safetensors", "JSON"])


def test_non_utf8_header(cli, area):
    path = area / "in" / "m.safetensors"
    header = b"\xff\xfe\xfd\xfc\xfb\xfa\xf9\xf8"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.safetensors"])


def test_header_not_an_object(cli, area):
    path = area / "in" / "m.safetensors"
    header = b"[1, 2, 3]"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.safetensors"])


def _raw_file(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_offsets_outside_the_file(cli, area):
    path = _raw_file(area / "in" / "m.safetensors",
                     {"w.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]},
                      "x.weight": {"dtype": "F32", "shape": [4], "data_offsets": [64, 80]}},
                     b"\0" * 64)
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.safetensors", "x.weight"])


def test_offsets_not_matching_shape(cli, area):
    path = _raw_file(area / "in" / "m.safetensors",
                     {"w.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 32]}},
                     b"\0" * 64)
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.safetensors", "w.weight"])


def test_overlapping_tensors(cli, area):
    path = _raw_file(area / "in" / "m.safetensors",
                     {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                      "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}},
                     b"\0" * 24)
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.safetensors"])


def test_unknown_dtype(cli, area):
    path = _raw_file(area / "in" / "m.safetensors",
                     {"w.weight": {"dtype": "Q4_K", "shape": [4], "data_offsets": [0, 16]}},
                     b"\0" * 16)
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.safetensors", "w.weight", "Q4_K"])


def test_bad_shape_entry(cli, area):
    path = _raw_file(area / "in" / "m.safetensors",
                     {"w.weight": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}},
                     b"\0" * 16)
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["w.weight"])


def test_empty_file(cli, area):
    path = area / "in" / "m.safetensors"
    path.write_bytes(b"")
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.safetensors"])


@pytest.mark.parametrize("command", ["inspect", "plan"])
def test_corrupt_file_on_read_only_commands(cli, area, command):
    path = area / "in" / "m.safetensors"
    path.write_bytes(b"\x01\x02\x03")
    before = snapshot(area / "in")
    args = [command, path] + (["-r", "llama-qkv"] if command == "plan" else [])
    result = cli(*args)
    assert result.exit_code == 2
    assert result.stderr.startswith("error:") and "m.safetensors" in result.stderr
    assert "Traceback" not in result.output
    assert snapshot(area / "in") == before


def test_not_a_checkpoint_format(cli, area):
    path = area / "in" / "weights.txt"
    path.write_text("hello")
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["weights.txt"])


def test_missing_input(cli, area):
    refuse_case(cli, area, area / "in" / "nope", "-r", "llama-qkv", needles=["nope"])


def test_corrupt_npz(cli, area):
    path = area / "in" / "m.npz"
    path.write_bytes(b"PK\x03\x04 not really a zip")
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.npz"])


def test_npz_with_pickled_objects_is_refused(cli, area):
    path = area / "in" / "m.npz"
    np.savez(path, obj=np.array([{"a": 1}], dtype=object))
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.npz"])


# ------------------------------------------------------------------------------------- sharded


def test_index_names_missing_shard(cli, area, copy_fixture):
    src = copy_fixture(BF16)
    os.remove(src / "model-00002-of-00003.safetensors")
    refuse_case(cli, area, src, "-r", "llama-qkv", needles=["model-00002-of-00003.safetensors"])


def test_index_not_json(cli, area, copy_fixture):
    src = copy_fixture(BF16)
    (src / "model.safetensors.index.json").write_text("{ not json")
    refuse_case(cli, area, src, "-r", "llama-qkv", needles=["model.safetensors.index.json"])


def test_index_points_tensor_to_wrong_shard(cli, area, copy_fixture):
    src = copy_fixture(BF16)
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name, shard = next((n, s) for n, s in index["weight_map"].items() if s.startswith("model-00001"))
    index["weight_map"][name] = "model-00003-of-00003.safetensors"
    index_path.write_text(json.dumps(index))
    refuse_case(cli, area, src, "-r", "llama-qkv", needles=[name])


def test_corrupt_shard(cli, area, copy_fixture):
    src = copy_fixture(BF16)
    shard = src / "model-00002-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:20] = b"#corrupt!###"  # break the JSON header
    shard.write_bytes(bytes(data))
    refuse_case(cli, area, src, "-r", "llama-qkv", needles=["model-00002-of-00003.safetensors"])


def test_truncated_shard(cli, area, copy_fixture):
    src = copy_fixture(BF16)
    shard = src / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    refuse_case(cli, area, src, "-r", "llama-qkv", needles=["model-00003-of-00003.safetensors"])


# ---------------------------------------------------------------------------------- rules files


def test_rules_file_not_toml(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    rules = write_rules(area / "in" / "bad.toml", "version = 1\n[[rule]\nop = 'rename'\n")
    refuse_case(cli, area, src, "-r", rules, needles=["bad.toml", "TOML"])


def test_unknown_rule_key(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    rules = write_rules(area / "in" / "typo.toml", """
version = 1
[[rule]]
name = "attn-qkv"
op = "concat"
inputs = ["model.layers.{i:int}.self_attn.q_proj.weight", "model.layers.{i:int}.self_attn.k_proj.weight"]
output = "model.layers.{i:int}.self_attn.qk_proj.weight"
axes = 0
""")
    refuse_case(cli, area, src, "-r", rules, needles=["typo.toml", "attn-qkv", "axes"])


def test_unknown_top_level_key(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    rules = write_rules(area / "in" / "top.toml", """
version = 1
variables = { a = 1 }
[[rule]]
op = "drop"
input = "lm_head.weight"
""")
    refuse_case(cli, area, src, "-r", rules, needles=["top.toml", "variables"])


def test_unknown_ties_key(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    rules = write_rules(area / "in" / "ties.toml", """
version = 1
[ties]
group = [["a", "b"]]
""")
    refuse_case(cli, area, src, "-r", rules, needles=["ties.toml", "group"])


def test_unknown_op(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    rules = write_rules(area / "in" / "op.toml", """
version = 1
[[rule]]
name = "mystery"
op = "fuse_everything"
input = "lm_head.weight"
output = "x"
""")
    refuse_case(cli, area, src, "-r", rules, needles=["op.toml", "mystery", "fuse_everything"])


def test_missing_version(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    rules = write_rules(area / "in" / "nov.toml", """
[[rule]]
op = "drop"
input = "lm_head.weight"
""")
    refuse_case(cli, area, src, "-r", rules, needles=["nov.toml", "version"])


def test_missing_tensor_in_binding(cli, area, copy_fixture):
    tensors = llama_tensors(copy_fixture)
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    ckpt_dir = area / "in" / "partial"
    ckpt_dir.mkdir()
    shutil.copy2(area / "in" / "llama-src" / "config.json", ckpt_dir / "config.json")
    write_safetensors(ckpt_dir / "model.safetensors", tensors, {"format": "pt"})
    refuse_case(cli, area, ckpt_dir, "-r", "llama-qkv",
                needles=["attn-qkv", "model.layers.1.self_attn.v_proj.weight"])


def test_rule_matching_nothing(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    refuse_case(cli, area, src, "-r", "mixtral-experts", needles=["stack-experts"])


def test_shape_mismatch_in_concat(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    rules = write_rules(area / "in" / "shape.toml", """
version = 1
[[rule]]
name = "bad-concat"
op = "concat"
inputs = ["model.layers.{i:int}.self_attn.q_proj.weight", "model.layers.{i:int}.mlp.down_proj.weight"]
output = "model.layers.{i:int}.nonsense.weight"
axis = 0
""")
    refuse_case(cli, area, src, "-r", rules, needles=["bad-concat", "down_proj"])


def test_sizes_that_do_not_match_config(cli, area, copy_fixture):
    """llama-qkv's GQA sizes come from config.json; a config that lies is caught at plan time."""
    src = copy_fixture(LLAMA)
    config = json.loads((src / "config.json").read_text())
    config["num_key_value_heads"] = 4
    (src / "config.json").write_text(json.dumps(config))
    refuse_case(cli, area, src, "-r", "llama-qkv", needles=["attn-qkv"])


def test_missing_config_variable(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    os.remove(src / "config.json")
    refuse_case(cli, area, src, "-r", "llama-qkv", needles=["num_attention_heads"])


def test_preset_that_does_not_exist(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    refuse_case(cli, area, src, "-r", "llama-qkv-typo", needles=["llama-qkv-typo"])


def test_output_name_collision(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    rules = write_rules(area / "in" / "clash.toml", """
version = 1
[[rule]]
name = "clash"
op = "rename"
input = "lm_head.weight"
output = "model.embed_tokens.weight"
""")
    refuse_case(cli, area, src, "-r", rules, needles=["clash", "model.embed_tokens.weight"])


# ----------------------------------------------------------------------------------- unfuse


def test_unfuse_without_provenance(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    out = area / "out" / "restored"
    before = snapshot(area / "in")
    result = cli("unfuse", src, "-o", out)
    assert_refused(result, out, before, area / "in", "provenance", "-r")


def test_unfuse_rules_that_do_not_fit(cli, area, copy_fixture):
    """Inverting llama-qkv needs qkv_proj, which an unfused checkpoint lacks."""
    src = copy_fixture(LLAMA)
    out = area / "out" / "restored"
    before = snapshot(area / "in")
    result = cli("unfuse", src, "-r", "llama-qkv", "-o", out)
    assert_refused(result, out, before, area / "in", "qkv_proj")


def test_unfuse_with_corrupt_provenance(cli, area, copy_fixture):
    copy_fixture(LLAMA)
    tensors = llama_tensors(copy_fixture)
    path = write_safetensors(area / "in" / "p.safetensors", tensors, {"format": "pt", "fusectl": "{broken"})
    out = area / "out" / "restored"
    before = snapshot(area / "in")
    result = cli("unfuse", path, "-o", out)
    assert_refused(result, out, before, area / "in", "p.safetensors", "provenance")


# ------------------------------------------------------------------------------- outputs


def test_existing_output_without_force(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    out = area / "out" / "fused.safetensors"
    out.write_bytes(b"precious")
    before_in = snapshot(area / "in")
    result = cli("fuse", src, "-r", "llama-qkv", "-o", out)
    assert result.exit_code == 2
    assert result.stderr.startswith("error:")
    assert "fused.safetensors" in result.stderr and "--force" in result.stderr
    assert out.read_bytes() == b"precious"
    assert leftovers(out.parent) == []
    assert snapshot(area / "in") == before_in


def test_existing_output_with_force_is_replaced(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    out = area / "out" / "fused.safetensors"
    out.write_bytes(b"precious")
    ok(cli("fuse", src, "-r", "llama-qkv", "-o", out, "--force"))
    assert "model.layers.0.self_attn.qkv_proj.weight" in load_checkpoint_raw(out)
    assert leftovers(out.parent) == []


def test_existing_folder_output_with_force_is_replaced(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    out = area / "out" / "fused"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    ok(cli("fuse", src, "-r", "llama-qkv", "-o", out, "--force"))
    assert not (out / "stale.txt").exists()
    assert (out / "model.safetensors").exists()
    assert leftovers(out.parent) == []


def test_failed_run_with_force_keeps_old_output(cli, area, copy_fixture):
    """A failing run with --force leaves the previous output exactly as it was."""
    src = copy_fixture(LLAMA)
    out = area / "out" / "fused"
    ok(cli("fuse", src, "-r", "llama-qkv", "-o", out))
    old = snapshot(area / "out")
    rules = write_rules(area / "in" / "shape.toml", """
version = 1
[[rule]]
name = "bad-concat"
op = "concat"
inputs = ["model.layers.{i:int}.self_attn.q_proj.weight", "model.layers.{i:int}.mlp.down_proj.weight"]
output = "model.layers.{i:int}.nonsense.weight"
""")
    result = cli("fuse", src, "-r", rules, "-o", out, "--force")
    assert result.exit_code == 2 and result.stderr.startswith("error:")
    assert snapshot(area / "out") == old


def test_write_failure_with_force_keeps_old_output(cli, area, copy_fixture, monkeypatch):
    """A failure in the middle of writing (disk full) leaves the old output and no temp file."""
    import fusectl.io.safetensors_file as st

    src = copy_fixture(LLAMA)
    out = area / "out" / "fused"
    ok(cli("fuse", src, "-r", "llama-qkv", "-o", out))
    old = snapshot(area / "out")
    before_in = snapshot(area / "in")

    real_write_all = st.write_all
    calls = {"n": 0}

    def failing_write_all(fd, data):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write_all(fd, data)

    def failing_copy(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(st, "write_all", failing_write_all)
    monkeypatch.setattr(st, "copy_ranges", failing_copy)
    result = cli("fuse", src, "-r", "llama-qkv", "-r", "llama-gate-up", "-o", out, "--force")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error:")
    assert "Traceback" not in result.output
    assert snapshot(area / "out") == old
    assert leftovers(area / "out") == []
    assert snapshot(area / "in") == before_in


def test_write_failure_without_existing_output_leaves_nothing(cli, area, copy_fixture, monkeypatch):
    import fusectl.io.safetensors_file as st

    src = copy_fixture(BF16)

    def failing_copy(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(st, "copy_ranges", failing_copy)
    out = area / "out" / "fused"
    before = snapshot(area / "in")
    result = cli("fuse", src, "-r", "llama-qkv", "-o", out, "--max-shard-size", "20KB")
    assert_refused(result, out, before, area / "in")
    assert os.listdir(area / "out") == []


def test_output_equal_to_input_file(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    model = src / "model.safetensors"
    before = snapshot(area / "in")
    for extra in ([], ["--force"]):
        result = cli("fuse", model, "-r", "llama-qkv", "-o", model, *extra,
                     "--config", src / "config.json")
        assert result.exit_code == 2, result.output
        assert result.stderr.startswith("error:")
        assert "model.safetensors" in result.stderr
        assert snapshot(area / "in") == before
        assert leftovers(src) == []


def test_output_equal_to_input_folder(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    before = snapshot(area / "in")
    result = cli("fuse", src, "-r", "llama-qkv", "-o", src, "--force")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error:")
    assert snapshot(area / "in") == before
    assert leftovers(area / "in") == []


def test_output_folder_containing_input_shard(cli, area, copy_fixture):
    """-o naming the sharded input's folder (spelled differently) is still the input."""
    src = copy_fixture(BF16)
    before = snapshot(area / "in")
    result = cli("fuse", src / "model.safetensors.index.json", "-r", "llama-qkv",
                 "-o", str(src) + "/", "--force")
    assert result.exit_code == 2, result.output
    assert snapshot(area / "in") == before


def test_output_parent_missing(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    out = area / "out" / "no" / "such" / "dir" / "x.safetensors"
    before = snapshot(area / "in")
    result = cli("fuse", src, "-r", "llama-qkv", "-o", out)
    assert result.exit_code == 2
    assert result.stderr.startswith("error:")
    assert not out.exists()
    assert snapshot(area / "in") == before


def test_bad_max_shard_size(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    refuse_case(cli, area, src, "-r", "llama-qkv", "--max-shard-size", "lots", needles=["lots"])


def test_debug_shows_traceback(cli, area):
    path = area / "in" / "m.safetensors"
    path.write_bytes(b"")
    result = cli("--debug", "inspect", path)
    assert result.exit_code == 2
    assert "Traceback" in result.output
    assert "error:" in result.stderr


def test_output_is_the_input_through_a_symlink(cli, area, copy_fixture):
    """-o naming the input's real path while CKPT is a symlink to it: still the input."""
    src = copy_fixture(LLAMA)
    link = area / "in" / "link"
    link.symlink_to(src, target_is_directory=True)
    before = snapshot(src)
    result = cli("fuse", link, "-r", "llama-qkv", "-o", src, "--force")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error:")
    assert snapshot(src) == before, "the input was overwritten"
    assert leftovers(area / "in") == []


def test_output_symlink_pointing_at_the_input(cli, area, copy_fixture):
    """-o is a symlink to the input file: refuse rather than risk replacing what it names."""
    src = copy_fixture(LLAMA)
    model = src / "model.safetensors"
    link = area / "out" / "alias.safetensors"
    link.symlink_to(model)
    before = snapshot(src)
    result = cli("fuse", src, "-r", "llama-qkv", "-o", link, "--force")
    # whatever the outcome, the input's bytes must be intact
    assert snapshot(src) == before
    assert "Traceback" not in result.output


# ------------------------------------------------------------- found in review


def _zip_npz(path, members: dict[str, bytes]):
    import zipfile
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _npy(array: np.ndarray) -> bytes:
    import io
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def test_truncated_npz_member_is_refused(cli, area):
    full = _npy(np.arange(8, dtype=np.float32))
    src = _zip_npz(area / "in" / "short.npz", {"a.npy": full[:-16]})
    before = snapshot(area / "in")
    result = cli("inspect", src)
    assert result.exit_code == 2 and "a" in result.stderr and "truncated" in result.stderr
    assert snapshot(area / "in") == before


def test_malformed_fusectl_npz_members_are_errors(cli, area):
    good = _npy(np.zeros(3, np.uint8))
    cases = {
        "meta.npz": {"a.npy": good, "__fusectl_metadata__.npy": _npy(np.frombuffer(b"not json", np.uint8))},
        "dtypes.npz": {"a.npy": good, "__fusectl_dtypes__.npy": _npy(np.frombuffer(b'{"zz": "F32"}', np.uint8))},
        "size.npz": {"a.npy": good, "__fusectl_dtypes__.npy": _npy(np.frombuffer(b'{"a": "BF16"}', np.uint8))},
    }
    for name, members in cases.items():
        result = cli("inspect", _zip_npz(area / "in" / name, members))
        assert result.exit_code == 2, (name, result.output)
        assert result.stderr.startswith("error:") and "internal error" not in result.stderr, name


def test_output_inside_the_input_folder_is_refused(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    before = snapshot(area / "in")
    # the folder itself is the input; and a file input's config.json is an input too
    for ckpt, out in ((src, src / "fused.safetensors"), (src / "model.safetensors", src / "config.json")):
        result = cli("fuse", ckpt, "-r", "llama-qkv", "-o", out, "--force")
        assert result.exit_code == 2, result.output
        assert "input" in result.stderr
    assert snapshot(area / "in") == before


def test_edited_provenance_is_refused(cli, area, tmp_path):
    src = write_safetensors(area / "in" / "m.safetensors", {"w": np.arange(9, dtype=np.float32).reshape(3, 3)})
    rules = write_rules(tmp_path / "r.toml", 'version = 1\n[[rule]]\nop = "reshape"\ninput = "w"\noutput = "flat"\nshape = [-1]\n')
    fused = area / "in" / "f.safetensors"
    ok(cli("fuse", src, "-r", rules, "-o", fused))
    raw = fused.read_bytes()
    tampered = area / "in" / "t.safetensors"
    # the record says the reshape made F32[9]; claim F32[4] (same header length: one digit each)
    tampered.write_bytes(raw.replace(b'[\\"F32\\",[9]]', b'[\\"F32\\",[4]]', 1))
    assert tampered.read_bytes() != raw
    out = area / "out" / "u.safetensors"
    result = cli("unfuse", tampered, "-o", out)
    assert result.exit_code == 2, result.output
    assert not out.exists()


def test_duplicate_names_in_a_safetensors_header_are_refused(cli, area):
    header = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}'
    header += b" " * (-len(header) % 8)
    path = area / "in" / "dup.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x01\x02")
    result = cli("inspect", path)
    assert result.exit_code == 2 and "'a' twice" in result.stderr


def test_max_shard_size_with_a_file_output_is_refused(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    out = area / "out" / "x.safetensors"
    result = cli("fuse", src, "-r", "llama-qkv", "-o", out, "--max-shard-size", "1KB")
    assert result.exit_code == 2 and "--max-shard-size" in result.stderr
    assert not out.exists()
