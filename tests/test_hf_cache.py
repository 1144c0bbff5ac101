"""A Hugging Face cache repository folder (``models--org--name``) or its ``snapshots/`` folder is
read as the snapshot ``refs/main`` names (issue 18, item 14); a hostile or broken ``refs/main``
is refused (exit 2) saying which snapshot folder to name instead.

The cache trees are built here as huggingface_hub writes them (file_download.py): blobs named
by their etag (sha256 for LFS files, the git blob sha1 for small ones), ``refs/main`` holding the
40-hex commit hash with no newline, and ``snapshots/<commit>/<file>`` relative links to
``../../blobs/<etag>``. Where huggingface_hub is installed, its own cache lookup
(``try_to_load_from_cache``, which reads refs/main, no network) must pick the same snapshot.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path

import pytest

from conftest import FIXTURES, load_checkpoint_raw, ok, refused, run_cli, time_limit
from fusectl.io.checkpoint import open_checkpoint

LLAMA = FIXTURES / "tiny-llama-gqa"
BERT = FIXTURES / "tiny-bert"  # another model: other names, so which snapshot was read shows
MAIN = "1f0e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c"
OLD = "0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d"
LFS_FILES = {"model.safetensors"}


def _etag(name: str, data: bytes) -> str:
    if name in LFS_FILES:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id


def add_snapshot(repo: Path, commit: str, source: Path = LLAMA) -> Path:
    """snapshots/<commit>/ of ``repo``: every file of ``source`` as a link into blobs/."""
    folder = repo / "snapshots" / commit
    folder.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for path in sorted(source.iterdir()):
        data = path.read_bytes()
        etag = _etag(path.name, data)
        (repo / "blobs" / etag).write_bytes(data)
        (folder / path.name).symlink_to(Path("..") / ".." / "blobs" / etag)
    return folder


def hf_cache(tmp_path: Path, ref: str | None = MAIN, commits=(MAIN,)) -> Path:
    """hub/models--org--tiny-llama with a snapshot per commit (tiny-llama-gqa's files; OLD holds
    tiny-bert's) and refs/main naming ``ref`` (None: no refs/main)."""
    repo = tmp_path / "hub" / "models--org--tiny-llama"
    (repo / "snapshots").mkdir(parents=True)
    for commit in commits:
        add_snapshot(repo, commit, BERT if commit == OLD else LLAMA)
    if ref is not None:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(ref)  # as huggingface_hub writes it: no newline
    return repo


def parameters(path) -> dict:
    return {p["name"]: p["shape"] for p in ok(run_cli("inspect", path, "--json")).json()["parameters"]}


def state(root: Path) -> dict[str, str]:
    """Every path under ``root`` → what it is: a link's target, a small file's sha256, a big
    file's size (a sparse 8 GiB refs/main is not read), a FIFO as such (opening it would block)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            info = os.lstat(path)
            if os.path.islink(path):
                found[path] = "-> " + os.readlink(path)
            elif stat.S_ISREG(info.st_mode):
                found[path] = (hashlib.sha256(Path(path).read_bytes()).hexdigest() if info.st_size < 1 << 20
                               else f"{info.st_size} bytes")
            else:
                found[path] = stat.filemode(info.st_mode)
    return found


def refuse(tmp_path: Path, path: Path, *needles: str, extra=()) -> str:
    """``fuse PATH`` is exit 2 naming each needle, writes nothing and leaves the cache as it was."""
    before = state(tmp_path / "hub")
    out = tmp_path / "out"
    with time_limit(20):
        result = run_cli("fuse", path, "-r", "llama-qkv", "-o", out, "--quiet", *extra)
    refused(result, *needles, unwritten=[out])
    assert state(tmp_path / "hub") == before
    return result.stderr


# ------------------------------------------------------------------------------ what is read


@pytest.mark.parametrize("named", ["repository", "snapshots"])
def test_a_cache_repository_is_read_at_the_snapshot_refs_main_names(tmp_path, named):
    repo = hf_cache(tmp_path, commits=(OLD, MAIN))
    path = repo if named == "repository" else repo / "snapshots"
    assert parameters(path) == parameters(LLAMA) != parameters(BERT)
    checkpoint = open_checkpoint(str(path))
    assert checkpoint.files == [str(repo / "snapshots" / MAIN / "model.safetensors")]
    assert checkpoint.config["num_attention_heads"] == 4  # config.json of the snapshot, through its link
    out = tmp_path / "out"
    ok(run_cli("fuse", path, "-r", "llama-qkv", "-o", out, "--quiet"))
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert (out / "config.json").read_bytes() == (LLAMA / "config.json").read_bytes()
    assert not (out / "config.json").is_symlink()
    reference = tmp_path / "reference"
    ok(run_cli("fuse", LLAMA, "-r", "llama-qkv", "-o", reference, "--quiet"))
    assert load_checkpoint_raw(out) == load_checkpoint_raw(reference)


def test_refs_main_with_a_newline_an_editor_added_is_read(tmp_path):
    repo = hf_cache(tmp_path)
    (repo / "refs" / "main").write_text(MAIN + "\n")
    assert parameters(repo) == parameters(LLAMA)


@pytest.mark.parametrize("named", ["repository", "snapshots"])
def test_without_refs_main_the_only_snapshot_is_read(tmp_path, named):
    repo = hf_cache(tmp_path, ref=None, commits=(OLD,))
    assert parameters(repo if named == "repository" else repo / "snapshots") == parameters(BERT)


@pytest.mark.parametrize("named", ["repository", "snapshots"])
def test_without_refs_main_two_snapshots_are_refused_naming_both(tmp_path, named):
    repo = hf_cache(tmp_path, ref=None, commits=(OLD, MAIN))
    message = refuse(tmp_path, repo if named == "repository" else repo / "snapshots",
                     f"{repo}: 2 snapshots and no refs/main", "name the snapshot folder to read",
                     str(repo / "snapshots" / OLD), str(repo / "snapshots" / MAIN))
    assert "holds no .safetensors" not in message


def test_a_repository_with_no_snapshot_says_the_download_did_not_finish(tmp_path):
    repo = hf_cache(tmp_path, ref=None, commits=())
    refuse(tmp_path, repo, f"{repo / 'snapshots'}: holds no snapshot folder", "download the model again")


def test_a_renamed_cache_repository_is_recognised_by_its_layout(tmp_path):
    repo = hf_cache(tmp_path)
    renamed = repo.parent / "my-llama"
    repo.rename(renamed)
    assert parameters(renamed) == parameters(LLAMA)  # named itself: links into its blobs/ are inside it


def test_a_model_folder_with_a_snapshots_subfolder_is_still_a_model_folder(tmp_path):
    src = tmp_path / "model"
    shutil.copytree(LLAMA, src)
    (src / "snapshots" / "epoch-1").mkdir(parents=True)
    (src / "refs").mkdir()
    assert parameters(src) == parameters(LLAMA)
    assert open_checkpoint(str(src)).files == [str(src / "model.safetensors")]


def test_the_trust_rule_still_holds_inside_the_snapshot(tmp_path):
    repo = hf_cache(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("HF_TOKEN=hf_xxx\n")
    (repo / "snapshots" / MAIN / "tokenizer.json").symlink_to(secret)
    refuse(tmp_path, repo, "tokenizer.json", str(secret), "--follow-symlinks")


def test_huggingface_hub_picks_the_same_snapshot(tmp_path):
    hub_lib = pytest.importorskip("huggingface_hub")
    repo = hf_cache(tmp_path, commits=(OLD, MAIN))
    report = hub_lib.scan_cache_dir(tmp_path / "hub")  # the tree is a cache huggingface_hub accepts
    assert not report.warnings
    (cached,) = report.repos
    assert {r.commit_hash: set(r.refs) for r in cached.revisions} == {OLD: set(), MAIN: {"main"}}
    found = hub_lib.try_to_load_from_cache("org/tiny-llama", "model.safetensors", cache_dir=str(tmp_path / "hub"))
    assert isinstance(found, str)
    assert open_checkpoint(str(repo)).files == [found]


# ------------------------------------------------------------------------------ hostile refs/main


def test_refs_main_linking_out_of_the_repository_is_refused(tmp_path):
    repo = hf_cache(tmp_path)
    elsewhere = tmp_path / "elsewhere-ref"
    elsewhere.write_text(MAIN)
    (repo / "refs" / "main").unlink()
    (repo / "refs" / "main").symlink_to(elsewhere)
    refuse(tmp_path, repo, "refs/main: a link to", str(elsewhere), "--follow-symlinks")
    assert parameters_allowed(repo) == parameters(LLAMA)


def parameters_allowed(path) -> dict:
    report = ok(run_cli("inspect", path, "--json", "--follow-symlinks")).json()
    return {p["name"]: p["shape"] for p in report["parameters"]}


@pytest.mark.parametrize("content, needle", [
    ("../../../../etc", "holds '../../../../etc', not a commit hash"),
    (f"../snapshots/{MAIN}", "not a commit hash"),
    (MAIN[:12], f"holds '{MAIN[:12]}', not a commit hash"),
    (MAIN.upper(), "not a commit hash"),
    ("", "holds '', not a commit hash"),
    ("main\x1b[31m", "not a commit hash"),
])
def test_refs_main_that_is_not_a_commit_hash_is_refused(tmp_path, content, needle):
    repo = hf_cache(tmp_path)
    (repo / "refs" / "main").write_text(content)
    message = refuse(tmp_path, repo, "refs/main", needle, "name the snapshot folder to read",
                     str(repo / "snapshots" / MAIN))
    assert "\x1b" not in message


def test_a_huge_refs_main_is_refused_without_being_read(tmp_path):
    repo = hf_cache(tmp_path)
    with open(repo / "refs" / "main", "wb") as f:
        f.truncate(8 << 30)  # sparse: 8 GiB that nothing may read
    refuse(tmp_path, repo, "refs/main: holds 8589934592 bytes, not a commit hash", str(repo / "snapshots" / MAIN))


def test_a_fifo_at_refs_main_is_refused_without_opening_it(tmp_path):
    repo = hf_cache(tmp_path)
    (repo / "refs" / "main").unlink()
    os.mkfifo(repo / "refs" / "main")
    refuse(tmp_path, repo, "refs/main: is a FIFO (named pipe), not a regular file",
           "name the snapshot folder to read")


def test_a_folder_at_refs_main_is_refused(tmp_path):
    repo = hf_cache(tmp_path)
    (repo / "refs" / "main").unlink()
    (repo / "refs" / "main").mkdir()
    refuse(tmp_path, repo, "refs/main: is a folder, not a regular file")


def test_refs_main_naming_a_missing_snapshot_is_refused_listing_the_others(tmp_path):
    repo = hf_cache(tmp_path, commits=(OLD,))
    refuse(tmp_path, repo, f"refs/main: names commit {MAIN}, but the cache holds no snapshot",
           "download the model again", str(repo / "snapshots" / OLD))


def test_a_snapshot_folder_linking_out_of_the_repository_is_refused(tmp_path):
    repo = hf_cache(tmp_path, commits=())
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(LLAMA, elsewhere)
    (repo / "snapshots" / MAIN).symlink_to(elsewhere, target_is_directory=True)
    refuse(tmp_path, repo, f"snapshots/{MAIN}: a link to", str(elsewhere), "--follow-symlinks")


def test_a_snapshots_folder_linking_out_of_the_repository_is_refused(tmp_path):
    repo = hf_cache(tmp_path, commits=())
    elsewhere = tmp_path / "elsewhere"
    add_snapshot(tmp_path / "elsewhere", MAIN)
    shutil.rmtree(repo / "snapshots")
    (repo / "snapshots").symlink_to(elsewhere / "snapshots", target_is_directory=True)
    refuse(tmp_path, repo, "snapshots: a link to", str(elsewhere / "snapshots"))
