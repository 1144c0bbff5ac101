"""The npz reader (io/formats/npz_file.py): a broken archive, pickled objects, a truncated member and
malformed fusectl members are refused naming the file."""

from __future__ import annotations

import numpy as np

from conftest import refuse_case, snapshot


def test_corrupt_npz(cli, area):
    path = area / "in" / "m.npz"
    path.write_bytes(b"PK\x03\x04 not really a zip")
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.npz"])


def test_npz_with_pickled_objects_is_refused(cli, area):
    path = area / "in" / "m.npz"
    np.savez(path, obj=np.array([{"a": 1}], dtype=object))
    refuse_case(cli, area, path, "-r", "llama-qkv", needles=["m.npz"])


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
