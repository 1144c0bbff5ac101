"""A Hugging Face Trainer checkpoint folder (``checkpoint-N/``): the model's weights beside the
files the Trainer writes to resume training.

``Trainer._save_checkpoint`` writes, beside the model (``model.safetensors``, its shards, or
``pytorch_model.bin``) and its ``config.json``: ``optimizer.pt`` (``optimizer.state_dict()``,
torch.save; ``optimizer.bin`` where accelerate saved it), ``scheduler.pt``, ``scaler.pt``,
``rng_state.pth`` (``rng_state_<rank>.pth`` with several processes), ``trainer_state.json``
and ``training_args.bin``. None of them is a weight file of the model: a folder read as a
checkpoint never picks one of them as its weights (:data:`TRAINER_FILES`), and a folder output
copies them byte for byte (``training_args.bin`` is a pickle of arbitrary classes: it is never
unpickled, only copied).

The optimizer file is read as the optimizer state (:class:`TrainerOptimizer`) through the same
allow-list reader as every PyTorch file (``torch_file.read_torch_tree``). A folder fusectl
wrote keeps, in that file's fusectl record (which torch.load ignores), the parameter behind each
of its ids and the order of the parameters before fusectl's first step
(``optimizer_state.order_record``), so the folder's optimizer is mapped, and unfused into the original
order, without being told the order again.

>>> is_trainer_file("rng_state_3.pth"), is_trainer_file("model.safetensors")
(True, False)
"""

from __future__ import annotations

import os
import re
from typing import Callable

from ...errors import CheckpointError, printable
from ..optimizer_state import Training, parse_optimizer

OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")  # the first present is the optimizer read
TRAINER_STATE = "trainer_state.json"  # the Trainer's step, epoch, logs: JSON, a companion
TRAINER_FILES = frozenset({*OPTIMIZER_FILES, "scheduler.pt", "scaler.pt", "training_args.bin"})
_RNG_STATE = re.compile(r"rng_state(_[0-9]+)?\.pth")


def is_trainer_file(name: str) -> bool:
    """Whether ``name`` (a file name at the top of a folder) is one the Trainer writes beside the
    model's weights: never a weight file of the model, whatever its suffix."""
    return name in TRAINER_FILES or bool(_RNG_STATE.fullmatch(name))


def is_training_state(name: str) -> bool:
    """Whether ``name`` (relative to a Trainer checkpoint) is the Trainer's state of the run —
    its own files and ``trainer_state.json`` — rather than the model's."""
    return is_trainer_file(name) or name == TRAINER_STATE


class TrainerOptimizer(Training):
    """The optimizer state of a Trainer folder: its optimizer file as a :class:`Training` whose
    tree is the optimizer's ``state_dict()`` itself (``model_path`` None: the model is the
    folder's weights; ``optimizer_path`` the root of the tree, ``optimizer_key`` the file's name,
    as messages and ``inspect`` show where the state is). ``file`` is the file's path; ``record``
    fusectl's record in it, read with the tree."""

    def __init__(self, folder: str, file: str):
        self.file = file
        self._record: dict[str, str] | None = None
        super().__init__(folder, None, (), self._read)

    @property
    def optimizer_key(self) -> str:
        """The optimizer file's name (where the state is, in messages and ``inspect``)."""
        return os.path.basename(self.file)

    def _read(self) -> object:
        from .torch_file import read_torch_tree  # PyTorch's reader: only when the optimizer is asked for
        tree, self._record = read_torch_tree(self.file)
        return tree

    def optimizer(self):
        """The optimizer's state, parsed on first use (the whole file is the state dict)."""
        if self._optimizer is None:
            self._optimizer = parse_optimizer(self.tree(), self.optimizer_key, self.path)
        return self._optimizer

    @property
    def record(self) -> dict[str, str]:
        """fusectl's record in the optimizer file (empty for a file torch.save wrote)."""
        self.tree()
        return self._record or {}


def trainer_optimizer(folder: str, check_link: Callable[[str], None] | None = None) -> TrainerOptimizer | None:
    """The optimizer of the Trainer folder ``folder`` (its ``optimizer.pt``, else
    ``optimizer.bin``), or None when it holds none; a link is checked by ``check_link``."""
    for name in OPTIMIZER_FILES:
        path = os.path.join(folder, name)
        if os.path.lexists(path):
            if check_link is not None:
                check_link(path)
            if not os.path.isfile(path):
                raise CheckpointError(f"{printable(path)}: not a regular file; a Trainer's optimizer state is "
                                      "the file torch.save(optimizer.state_dict(), ...) writes")
            return TrainerOptimizer(folder, path)
    return None
