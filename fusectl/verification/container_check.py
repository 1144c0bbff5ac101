"""``verify`` of a training checkpoint's other entries: what fuse keeps unchanged must be so.

``fuse`` writes a training checkpoint whole and keeps everything beside the model's tensors,
the optimizer's state and the model's copies as it was (``training_output``,
``trainer_output``). ``verify`` holds the candidate to that:

- a training dict (``.pt``, ``.ckpt``): every entry of the reference's tree is the candidate's,
  value for value — numbers and text equal, dicts with the same keys in the same order, lists
  item by item, tensors bitwise (dtype, shape, bytes) —, the model's state dict and its copies
  with their entries that are not model tensors only (the tensors are compared as tensors,
  kinds ``tensor`` and ``twin``), the optimizer without its state (``optimizer_check``); each
  entry missing, added or different is a failed check of kind ``entry`` named by its key path
  (``lr_scheduler.last_epoch``);
- a Hugging Face Trainer folder: every file it carries unchanged (``scheduler.pt``,
  ``trainer_state.json``, ``rng_state*.pth``, ``training_args.bin``, tokenizer files;
  ``config.json`` where the plan edits none) byte for byte, each a check of kind ``file``.

A candidate that holds the model only (``.safetensors``, a model folder) has nothing to compare:
one passing check says the entries were not written. A Trainer folder against a training dict (either way round)
holds training state in two forms that cannot be held to "unchanged": one failing check. An optimizer dropped on purpose
(``--drop-optimizer``, and Lightning's ``lr_schedulers`` with it) is ``optimizer_check``'s to
report, not a missing entry.
"""

from __future__ import annotations

import math
import os

from ..io.checkpoint import Checkpoint
from ..errors import printable
from ..io.key_path import KeyPath, key_text, node_at, replaced
from ..io.optimizer_state import Training, without_optimizer
from ..io.formats.trainer_folder import TrainerOptimizer
from ..steps import Plan
from ..tensors import ByteRange, LazyTensor
from .byte_ranges import equal_pairs
from .report import Check

_SHOWN = 20  # differences named one by one; past them the comparison stops, one check says more differ


class _Elsewhere:
    """What stands in a tree for an entry another check compares (the optimizer's state)."""

    def __repr__(self) -> str:
        return "(compared elsewhere)"


_ELSEWHERE = _Elsewhere()


def container_checks(reference: Checkpoint, candidate: Checkpoint, plan: Plan) -> list[Check]:
    """The checks of the candidate's entries beside the model's tensors against the reference's
    (the module doc); none when neither is a training checkpoint."""
    ref, cand = reference.training, candidate.training
    if ref is None and cand is None:
        return []
    if isinstance(ref, TrainerOptimizer) or isinstance(cand, TrainerOptimizer):
        if isinstance(ref, TrainerOptimizer) and isinstance(cand, TrainerOptimizer):
            return _file_checks(reference, candidate, plan)
        if ref is not None and cand is not None:  # a Trainer folder against a training dict: unlike entries
            kinds = ["a Trainer folder" if isinstance(t, TrainerOptimizer) else "a training dict" for t in (ref, cand)]
            return [Check("entry", "beside the model", False,
                          detail=f"the reference is {kinds[0]}, the candidate {kinds[1]}: their other entries "
                                 "cannot be held to 'unchanged'; verify a checkpoint against one of its own kind")]
        return _one_side(ref, "the Trainer's files")
    if ref is None or cand is None:
        return _one_side(ref, "the training dict's entries beside the model")
    expected, found = _beside_model(ref, reference), _beside_model(cand, candidate)
    if ref.optimizer_path is not None and cand.optimizer_path is None:  # dropped on purpose: optimizer_check says so
        expected = without_optimizer(expected, ref.optimizer_path)
    differences: list[tuple[KeyPath, str]] = []
    _compare(expected, found, (), differences)
    if not differences:
        return [Check("entry", "beside the model", True, detail="every entry equal")]
    checks = [Check("entry", key_text(path) or "(the top level)", False, detail=detail)
              for path, detail in differences[:_SHOWN]]
    if len(differences) > _SHOWN:
        # _compare stops once past _SHOWN (no more tensors read): what it found past them is a floor
        checks.append(Check("entry", "more", False,
                            detail=f"at least {len(differences) - _SHOWN} more entries differ (the comparison "
                                   f"stops once more than {_SHOWN} are found)"))
    return checks


def _one_side(reference_training, what: str) -> list[Check]:
    if reference_training is not None:  # the candidate holds the model only: nothing written to compare
        return [Check("entry", "beside the model", True, detail=f"not compared: the candidate holds the model only, "
                                                                f"without {what}")]
    return [Check("entry", "beside the model", False, detail=f"the candidate holds {what}, the reference does not")]


def _beside_model(training: Training, checkpoint: Checkpoint) -> object:
    """The training tree without what other checks compare: the model's tensors (its state
    dict's other entries stay), its copies' tensors, the optimizer (a stand-in)."""
    tree = training.tree()
    if training.optimizer_path is not None:
        tree = replaced(tree, training.optimizer_path, _ELSEWHERE)
    model = set(checkpoint.table.entries)
    for twin in checkpoint.twins:
        tree = replaced(tree, twin.path, {k: v for k, v in twin.rest.items()})
    if training.model_path is not None:
        node = node_at(tree, training.model_path)
        tree = replaced(tree, training.model_path, type(node)(
            (k, v) for k, v in node.items() if not (isinstance(v, LazyTensor) and str(k) in model)))
    return tree


def _compare(a: object, b: object, path: KeyPath, out: list) -> None:
    """Where ``b`` differs from ``a``, each (key path, what differs) appended to ``out``."""
    if len(out) > _SHOWN:
        return
    if isinstance(a, LazyTensor) or isinstance(b, LazyTensor):
        if not (isinstance(a, LazyTensor) and isinstance(b, LazyTensor)):
            out.append((path, f"{_kind(a)} in the reference, {_kind(b)} in the candidate"))
        elif a.spec != b.spec:
            out.append((path, f"{a.spec} in the reference, {b.spec} in the candidate"))
        elif not _same_bytes(a, b):
            out.append((path, f"a {a.spec} tensor with other bytes"))
        return
    if type(a) is not type(b):
        out.append((path, f"{_kind(a)} in the reference, {_kind(b)} in the candidate"))
    elif isinstance(a, dict):
        missing = [k for k in a if k not in b]
        added = [k for k in b if k not in a]
        out.extend(((*path, k), "missing from the candidate") for k in missing)
        out.extend(((*path, k), "not in the reference") for k in added)
        common = [k for k in a if k in b]
        if not missing and not added and list(a) != list(b):
            out.append((path, "the same keys in another order"))
        for k in common:
            _compare(a[k], b[k], (*path, k), out)
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            out.append((path, f"{len(a)} items in the reference, {len(b)} in the candidate"))
            return
        for k, (x, y) in enumerate(zip(a, b)):
            _compare(x, y, (*path, k), out)
    elif not _same_value(a, b):
        out.append((path, f"{_shown(a)} in the reference, {_shown(b)} in the candidate"))


def _same_value(a: object, b: object) -> bool:
    if a is _ELSEWHERE or b is _ELSEWHERE:
        return a is b
    if type(a) is float and math.isnan(a):  # a NaN (an unset metric) is the same NaN
        return math.isnan(b)
    return a == b


def _same_bytes(a: LazyTensor, b: LazyTensor) -> bool:
    ranges = (a.byte_ranges(), b.byte_ranges())
    if None not in ranges:
        return equal_pairs([ranges])[0]
    return a.read().tobytes() == b.read().tobytes()


def _file_checks(reference: Checkpoint, candidate: Checkpoint, plan: Plan) -> list[Check]:
    """Each file the reference Trainer folder carries unchanged, byte for byte in the candidate."""
    edits_config = any(g.config is not None and g.config.file == "config.json" for g in plan.groups)
    theirs = {c.relative: c for c in candidate.companions}
    checks, pairs, names = [], [], []
    for mine in reference.companions:
        if mine.relative == "config.json" and edits_config:
            continue  # the rules edit it: its edits are the plan's
        other = theirs.pop(mine.relative, None)
        if other is None:
            checks.append(Check("file", mine.relative, False, detail="missing from the candidate"))
        elif mine.is_dir or other.is_dir:
            checks.append(Check("file", mine.relative, mine.is_dir == other.is_dir,
                                detail="a folder" if mine.is_dir == other.is_dir else "a folder on one side only"))
        else:
            size, other_size = os.path.getsize(mine.source), os.path.getsize(other.source)
            if size != other_size:
                checks.append(Check("file", mine.relative, False,
                                    detail=f"{size} bytes in the reference, {other_size} in the candidate"))
            else:
                pairs.append(((ByteRange(mine.source, 0, size),), (ByteRange(other.source, 0, size),)))
                names.append(mine.relative)
    for name, same in zip(names, equal_pairs(pairs)):
        checks.append(Check("file", name, same, detail="byte for byte" if same else "other bytes"))
    checks += [Check("file", name, False, detail="not in the reference") for name in theirs
               if not (name == "config.json" and edits_config)]
    return sorted(checks, key=lambda c: c.name)


def _kind(value: object) -> str:
    if isinstance(value, LazyTensor):
        return f"a {value.spec} tensor"
    return f"{'an' if type(value).__name__[0] in 'aeiou' else 'a'} {type(value).__name__}"


def _shown(value: object) -> str:
    text = printable(repr(value))
    return text if len(text) <= 60 else text[:60] + "..."
