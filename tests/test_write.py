"""Writing the output (write.py): where --max-shard-size does not apply."""

from __future__ import annotations

from conftest import LLAMA


def test_max_shard_size_with_a_file_output_is_refused(cli, area, copy_fixture):
    src = copy_fixture(LLAMA)
    out = area / "out" / "x.safetensors"
    result = cli("fuse", src, "-r", "llama-qkv", "-o", out, "--max-shard-size", "1KB")
    assert result.exit_code == 2 and "--max-shard-size" in result.stderr
    assert not out.exists()
