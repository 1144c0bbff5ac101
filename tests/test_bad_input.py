"""Bad input: exit 2, ``error:`` naming the culprit, no traceback, no output, input untouched.

The contract is checked in full by ``conftest.assert_refused`` / ``conftest.refuse_case``: exit
code, message, no traceback, no output path, no temporary or half-renamed file beside it, and
every input byte unchanged. Each bad-input test sits with the module that refuses the input:

- a broken safetensors file or shard        → test_safetensors_file.py   (io/formats/safetensors_file.py)
- no checkpoint, a broken sharded index     → test_checkpoint.py         (io/checkpoint.py)
- a broken npz                              → test_npz_file.py           (io/formats/npz_file.py)
- a torch/pickle file                       → test_torch_reader.py, test_hostile_readers.py,
                                              test_pickle_amplification.py
- a rules file that does not parse          → test_schema.py, test_hostile_rules.py
- a rule that binds badly, output collision → test_planner.py
- a shape that does not fit an op           → test_ops_layout.py
- a config variable missing or lying        → test_variables.py
- a preset that does not exist              → test_presets.py
- unfuse without / with a broken provenance → test_provenance.py, test_rules_inverse.py
- an output that exists, is the input, ...  → test_atomic.py, test_output_faults.py
- --max-shard-size with a file output       → test_write.py
- verify's inputs, graphs and reports       → test_verify_hostile.py, test_verify_edges.py,
                                              test_onnx_hostile_external.py

What stays here is the CLI's own part of the contract: every command refuses alike, an option
value it cannot parse, and ``--debug``.
"""

from __future__ import annotations

import pytest

from conftest import LLAMA, refuse_case, snapshot


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
