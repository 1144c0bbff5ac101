"""Open any supported checkpoint into a ParamTable (headers only) with its ties and provenance."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from ..errors import CheckpointError, quote
from ..table import ParamTable
from ..tensors import LazyTensor
from ..ties import aliases_from_config, aliases_from_metadata, apply_aliases, merge_aliases
from .npz_file import read_npz
from .provenance import METADATA_KEY, Provenance
from .safetensors_file import read_header

INDEX_SUFFIX = ".safetensors.index.json"
# files that hold weights; everything else in a Hugging Face folder travels with the output
WEIGHT_SUFFIXES = (".safetensors", INDEX_SUFFIX, ".bin", ".pt", ".pth", ".npz", ".onnx", ".onnx_data", ".msgpack", ".h5")


@dataclass(frozen=True)
class Companion:
    """A file (or an empty folder) of an input folder that is not a weight file this checkpoint
    reads: a folder output copies it, bytes unchanged, to the same relative path."""

    source: str
    relative: str
    is_dir: bool = False


@dataclass
class Checkpoint:
    """A checkpoint opened lazily: its table, where it came from, and what travels with it."""

    path: str
    format: str  # "safetensors", "safetensors-sharded", "npz"
    files: list[str]
    table: ParamTable
    metadata: dict[str, str] = field(default_factory=dict)
    provenance: Provenance | None = None
    config: dict | None = None
    config_path: str | None = None
    companions: list[Companion] = field(default_factory=list)

    def input_paths(self) -> list[str]:
        """Every path this checkpoint reads from: an output may not overwrite any of them."""
        config = [self.config_path] if self.config_path else []
        return [self.path, *self.files, *(c.source for c in self.companions), *config]


def open_checkpoint(path: str, config_path: str | None = None) -> Checkpoint:
    """Read headers of a safetensors file, sharded index, Hugging Face folder or npz archive.

    ``config.json`` beside the checkpoint (or ``config_path``) supplies ``config:`` variables.
    """
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or directory")
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    companions: list[Companion] = []
    if os.path.isdir(path):
        target = _pick_in_folder(path)
        companions = list_companions(path)
    else:
        target = path

    if target.endswith(INDEX_SUFFIX):
        stored, metadata, files, index_meta = _read_sharded(target)
        fmt = "safetensors-sharded"
        provenance_text = index_meta.get(METADATA_KEY)
    elif target.endswith(".safetensors"):
        stored, metadata = read_header(target)
        files, fmt = [target], "safetensors"
        provenance_text = metadata.get(METADATA_KEY)
    elif target.endswith(".npz"):
        stored, metadata = read_npz(target)
        files, fmt = [target], "npz"
        provenance_text = metadata.get(METADATA_KEY)
    else:
        raise CheckpointError(
            f"{target}: unsupported checkpoint format; fusectl reads .safetensors, "
            f"*{INDEX_SUFFIX}, Hugging Face folders and .npz"
        )

    table = ParamTable.from_stored(stored)
    provenance = Provenance.loads(provenance_text, target) if provenance_text else None
    config_path = config_path or _existing(os.path.join(folder, "config.json"))
    config = _read_config(config_path) if config_path else None
    aliases = merge_aliases([
        (f"{target} (fusectl provenance)", provenance.aliases if provenance else {}),
        (f"{target} (save_model metadata)", aliases_from_metadata(metadata, stored)),
        (f"{config_path} (tie_word_embeddings)", aliases_from_config(config, stored)),
    ])
    apply_aliases(table, aliases, target)
    passthrough = {
        k: v for k, v in metadata.items() if k != METADATA_KEY and k not in aliases
    }
    return Checkpoint(path, fmt, files, table, passthrough, provenance, config, config_path, companions)


def list_companions(folder: str) -> list[Companion]:
    """Everything in ``folder`` but its top-level weight files, in path order.

    Subfolders are taken whole, weight files included: they hold other modules
    (sentence-transformers' ``1_Pooling/config.json``, ``2_Dense/model.safetensors``), not this
    checkpoint's tensors. Top-level weight files are left out: the output's own weights
    replace them, and a stale copy in the old layout would contradict them.
    """
    found: list[Companion] = []
    seen_dirs: set[str] = set()
    for root, dirs, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen_dirs:  # a link back up the tree: do not walk it twice
            dirs.clear()
            continue
        seen_dirs.add(real)
        dirs.sort()
        relative_root = os.path.relpath(root, folder)
        top = relative_root == "."
        for name in sorted(files):
            if top and name.endswith(WEIGHT_SUFFIXES):
                continue
            relative = name if top else os.path.join(relative_root, name)
            found.append(Companion(os.path.join(root, name), relative))
        if not top and not files and not dirs:
            found.append(Companion(root, relative_root, is_dir=True))
    return found


def _existing(path: str) -> str | None:
    return path if os.path.isfile(path) else None


def _read_json(path: str, what: str):
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what}: {e.strerror}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({e}); the file is corrupt") from e


def _read_config(path: str) -> dict:
    config = _read_json(path, "config")
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: config must be a JSON object")
    return config


def _pick_in_folder(folder: str) -> str:
    names = sorted(os.listdir(folder))
    indexes = [n for n in names if n.endswith(INDEX_SUFFIX)]
    if len(indexes) == 1:
        return os.path.join(folder, indexes[0])
    singles = [n for n in names if n.endswith(".safetensors")]
    if not indexes and len(singles) == 1:
        return os.path.join(folder, singles[0])
    npz = [n for n in names if n.endswith(".npz")]
    if not indexes and not singles and len(npz) == 1:
        return os.path.join(folder, npz[0])
    found = indexes or singles or npz
    if found:
        raise CheckpointError(
            f"{folder}: holds {', '.join(found)}; name the one to read instead of the folder"
        )
    raise CheckpointError(f"{folder}: holds no .safetensors, {INDEX_SUFFIX} or .npz file")


def _read_sharded(index_path: str):
    index = _read_json(index_path, "the index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: no 'weight_map' object mapping tensor names to shard files")
    index_meta = index.get("metadata") or {}
    if not isinstance(index_meta, dict):
        raise CheckpointError(f"{index_path}: 'metadata' must be an object")
    folder = os.path.dirname(index_path)
    stored: dict[str, LazyTensor] = {}
    metadata: dict[str, str] = {}
    files = []
    for shard in sorted(set(weight_map.values())):
        shard_path = os.path.join(folder, shard)
        if os.path.basename(shard) != shard or not os.path.isfile(shard_path):
            raise CheckpointError(f"{index_path}: shard {quote(shard)} is missing beside the index")
        tensors, shard_meta = read_header(shard_path)
        files.append(shard_path)
        for name, tensor in tensors.items():
            if name in stored:
                raise CheckpointError(f"{shard_path}: tensor {quote(name)} is also stored in another shard")
            stored[name] = tensor
        metadata.update(shard_meta)
    for name, shard in weight_map.items():
        if name not in stored or stored[name].location.path != os.path.join(folder, shard):
            raise CheckpointError(
                f"{index_path}: the index puts {quote(name)} in {quote(shard)}, which does not hold it"
            )
    return stored, metadata, files, index_meta
