"""Open any supported checkpoint into a ParamTable (headers only) with its ties and provenance.

Which file is read, and how, is the format registry's (:mod:`fusectl.io.registry`): every
format's reader returns one :class:`~fusectl.io.contents.Contents`, which this module turns into
a :class:`Checkpoint` (ties, provenance, config, companions) without knowing the format."""

from __future__ import annotations

import errno
import functools
import os
from dataclasses import dataclass, field, replace
from typing import Callable

from ..errors import CheckpointError, offers, option, option_name, printable
from ..followers import Followers, Source, detect
from ..followers.optimizer import refuse_separator
from ..table import ParamTable
from ..ties import aliases_from_config, aliases_from_metadata, apply_aliases, merge_aliases
from .registry import WEIGHT_SUFFIXES, folder_format, format_of, pick_in_folder, takes_key  # noqa: F401 (takes_key: for the CLI)
from .optimizer_state import OptimizerState, ParamMap, Training, Twin, map_parameters, \
    possible_parameters, read_order, recorded_orders, state_tensors
from .hf_cache import cache_repository, pick_snapshot, snapshot_repository
from .provenance import METADATA_KEY, Provenance
from .formats.trainer_folder import OPTIMIZER_FILES, TrainerOptimizer, is_trainer_file, trainer_optimizer
from .sniff import DEEPSPEED_SCRIPTS
from .untrusted import check_regular_file, load_json, read_json_bytes, read_json_file


@dataclass(frozen=True)
class Companion:
    """A file (or an empty folder) of an input folder that is not a weight file this checkpoint
    reads: a folder output copies it, bytes unchanged, to the same relative path."""

    source: str
    relative: str
    is_dir: bool = False
    content: bytes | None = None  # written instead of the source's bytes (an edited config.json)
    # writes the file at the path it is given instead of a copy (a Trainer's optimizer.pt rewritten)
    write: Callable[[str], None] | None = None


@dataclass
class Checkpoint:
    """A checkpoint opened lazily: its table, where it came from, and what travels with it."""

    path: str
    format: str  # "safetensors", "safetensors-sharded", "npz", "pytorch", "pytorch-sharded", "onnx"
    files: list[str]
    table: ParamTable
    metadata: dict[str, str] = field(default_factory=dict)
    provenance: Provenance | None = None
    config: dict | None = None
    config_path: str | None = None
    companions: list[Companion] = field(default_factory=list)
    # a PyTorch file: the dotted key of the state dict read (None: the top level), and the
    # entries of it that are not tensors (ignored)
    state_dict_key: str | None = None
    ignored: list[str] = field(default_factory=list)
    # a training dict's other parts (optimizer_state.Training; None: not a training dict; a
    # Trainer folder's optimizer file: trainer_folder.TrainerOptimizer), the file giving the
    # optimizer's parameter order (--param-order), and whether to take that order from the
    # model's code instead (--param-order-from-model; model_order.py)
    training: Training | None = None
    param_order: str | None = None
    param_order_from_model: bool = False
    # the names the input lists, in its order (a state dict's, a safetensors header's); empty:
    # the table's order (``input_order``)
    key_order: list[str] = field(default_factory=list)
    # a checkpoint many ranks wrote: how (Contents.distributed: world size, ZeRO stage); None otherwise
    distributed: dict | None = None

    def input_order(self) -> list[str]:
        """The input's names in the order it lists them (``fusectl.key_order``): a state dict's
        keys, tied names in their places; a safetensors header's; an index's shards in turn. A
        tie from elsewhere (save_model metadata, a config) is not listed."""
        return self.key_order or list(self.table.entries)

    @functools.cached_property
    def followers(self) -> Followers:
        """The tensors riding on this checkpoint's weights (``fusectl.followers``: scales, a LoRA
        adapter's factors, an optimizer's state), detected once, when first asked for;
        ``adapter_config.json`` is read and parsed then, and never again for this checkpoint.
        An optimizer whose state cannot be read rides on nothing here: asking for
        :meth:`training_table` says why. Its mapping to the parameters is proven only when a
        plan moves its state (a plan of the model alone never needs it)."""
        try:
            state = self.optimizer
        except CheckpointError:
            state = None
        optimizer = (state, lambda: self.optimizer_mapped[1]) if state is not None else None
        return detect(Source(self.table, self.config, adapter_config(self),
                             self.provenance.plan if self.provenance else None, optimizer))

    @functools.cached_property
    def optimizer(self) -> OptimizerState | None:
        """The optimizer state beside the model in a training dict (None: none); CheckpointError
        for a malformed one."""
        return self.training.optimizer() if self.training is not None else None

    @functools.cached_property
    def optimizer_mapped(self) -> tuple[OptimizerState, ParamMap] | None:
        """The optimizer state and which parameter each of its ids is (``map_parameters``:
        proven by names or shapes, in the state dict's order or ``param_order``'s); None
        without an optimizer; CheckpointError when the mapping is not proven."""
        state = self.optimizer
        if state is None:
            return None
        names, params = self._parameters()
        by_id = self._recorded_names()
        if by_id is not None and self.param_order is None and not self.param_order_from_model:
            if len(by_id) != len(state.ids()):
                raise CheckpointError(f"{printable(self._record_file())}: fusectl's record names {len(by_id)} "
                                      f"parameters, the optimizer holds {len(state.ids())}; the file was replaced. "
                                      f"Give the order with {option('param_order')}")
            at = {p: i for i, p in enumerate(state.ids())}
            named = replace(state, groups=tuple(replace(g, param_names=tuple(by_id[at[p]] for p in g.params))
                                                for g in state.groups))
            mapping = map_parameters(named, params, self.path, aliases=names)
            return state, replace(mapping, source=f"fusectl's record in {os.path.basename(self._record_file())}")
        order, source = self.given_order
        try:
            return state, map_parameters(state, params, self.path, order, source, aliases=names)
        except CheckpointError as e:
            if order is None and isinstance(self.training, TrainerOptimizer) and offers("param_order_from_model"):
                raise type(e)(f"{e} (a Trainer folder's weights do not keep the order where they are "
                              f"safetensors; with torch and transformers installed, "
                              f"{option('param_order_from_model')} "
                              "takes it from the model's code)") from None
            raise

    def _parameters(self) -> tuple[dict[str, str], list]:
        """(every name → its unique name, the unique parameters as (name, spec) in the state
        dict's order, a tied group once under its first member)."""
        names = self.table.unique_names()
        seen, params = set(), []
        for name in self.table.entries:
            tensor = self.table.entries[name]
            if id(tensor) not in seen:
                seen.add(id(tensor))
                params.append((names[name], tensor.spec))
        return names, params

    def possible_parameters(self) -> set[str]:
        """The unique names the optimizer could hold state for, without proving which is which
        (``optimizer_state.possible_parameters``; every parameter where that cannot be told): a
        plan that touches none of them moves no state. Empty without an optimizer."""
        state = self.optimizer
        if state is None:
            return set()
        names, params = self._parameters()
        by_id = self._recorded_names()
        if by_id is not None and self.param_order is None and not self.param_order_from_model:
            return {names.get(n, n) for n in by_id}
        order, _ = self.given_order
        if order is not None:
            specs = dict(params)
            params = [(n, specs[n]) for n in order if n in specs]
        return possible_parameters(state, params, self.path, aliases=names)

    @functools.cached_property
    def given_order(self) -> tuple[list[str] | None, str | None]:
        """(the parameters in the order the optimizer was given them, where that order came from):
        ``param_order``'s file, or the model's code for ``param_order_from_model``; (None, None)
        when neither is asked for (the state dict's order is the order then)."""
        if self.param_order is not None:
            return read_order(self.param_order), self.param_order
        if self.param_order_from_model:
            from .model_order import order_from_model
            if self.config is None:
                raise CheckpointError(f"{printable(self.path)}: no config.json to build the model from for "
                                      f"{option('param_order_from_model')}; give {option('config')} or "
                                      f"{option('param_order')}")
            where = self.config_path or self.path
            held = [t.spec.shape for t in self.table.entries.values()]
            return order_from_model(self.config, where, held), f"{where} (the model's code)"
        return None, None

    def _record_file(self) -> str:
        """The file holding fusectl's record of the optimizer: a Trainer folder's optimizer
        file, else the training dict itself."""
        return self.training.file if isinstance(self.training, TrainerOptimizer) else self.path

    def _recorded_names(self) -> list[str] | None:
        """The parameter of each optimizer id, from fusectl's record in the file it wrote (a
        Trainer folder's optimizer file, a training dict's metadata; None: not recorded)."""
        if self.training is None:
            return None
        record = self.training.record if isinstance(self.training, TrainerOptimizer) else self.metadata
        return recorded_orders(record, self._record_file())[0]

    def recorded_original_order(self) -> list[str] | None:
        """The optimizer's parameter order before fusectl's first step as fusectl recorded it (a
        Trainer folder's optimizer file, a training dict's metadata); None where it is not
        recorded (no optimizer, or a file saved again by its trainer)."""
        if self.training is None or self.training.optimizer_path is None:
            return None
        record = self.training.record if isinstance(self.training, TrainerOptimizer) else self.metadata
        return recorded_orders(record, self._record_file())[1]

    def original_order(self) -> list[str] | None:
        """The optimizer's parameter order before fusectl's first step: recorded by fusectl,
        else the order the optimizer was given (``given_order``; its ids' order where neither is
        known). None without an optimizer."""
        if self.training is None or self.training.optimizer_path is None:
            return None
        recorded = self.recorded_original_order()
        if recorded is not None:
            return recorded
        order, _ = self.given_order
        if order is not None:
            return order
        state, mapping = self.optimizer_mapped
        return [mapping.names[p] for p in state.ids() if p in mapping.names]

    @functools.cached_property
    def twins(self) -> list[Twin]:
        """The copies of the model a training dict holds beside it (an EMA, an averaged model:
        ``optimizer_state.Twin``), each matched to the model's names; empty for other
        checkpoints. A twin takes the model's plan (``fusectl.twins``)."""
        if self.training is None or not self.training.model_key:
            return []
        return self.training.twins(set(self.table.entries))

    def training_table(self) -> ParamTable:
        """A copy of :attr:`table` with the optimizer's state tensors beside their parameters
        (``<name>::<key>``, tied where the parameter is), for a plan that moves them; the table
        itself when there is no optimizer. CheckpointError when the state cannot be read or mapped."""
        mapped = self.optimizer_mapped
        table = self.table.copy()
        if mapped is None:
            return table
        state, mapping = mapped
        aliases = {}
        for members in table.groups().values():
            for m in members:
                aliases[m] = members
        refuse_separator(table.entries, printable(self.path), CheckpointError)
        entries = state_tensors(state, mapping, {table.unique_name(n): aliases[n] for n in mapping.names.values()})
        table.add(entries)
        table.stored |= set(entries)
        return table

    def input_paths(self) -> list[str]:
        """Every path this checkpoint reads from: an output may not overwrite any of them."""
        config = [self.config_path] if self.config_path else []
        optimizer = [self.training.file] if isinstance(self.training, TrainerOptimizer) else []
        return [self.path, *self.files, *(c.source for c in self.companions), *config, *optimizer]


def open_checkpoint(path: str, config_path: str | None = None, allow_outside_links: bool = False,
                    key: str | None = None, param_order: str | None = None,
                    param_order_from_model: bool = False) -> Checkpoint:
    """Read headers of a safetensors file, sharded index, Hugging Face folder, npz archive,
    PyTorch file (``torch.save``, told by its content under any name: ``.pt``, ``.pth.tar``, none;
    ``key`` selects the state dict of a training dict, dotted for nesting) or an ONNX model's
    initializers. A Hugging Face cache repository folder (``…/models--ORG--NAME``, or its
    ``snapshots/``) is read as the snapshot ``refs/main`` names, or its only snapshot.

    ``config.json`` beside the checkpoint (or ``config_path``) supplies ``config:`` variables;
    without one, what the format's reader found (an MXNet export's RNN sizes), if anything.
    Inside an input folder, fusectl follows a symbolic link only where it resolves inside
    that folder, or, for a Hugging Face cache snapshot (``…/models--ORG--NAME/snapshots/REV``),
    inside the repository's cache folder where the blobs live; ``allow_outside_links`` lifts
    this (``--follow-symlinks``). A file named directly (``path`` or ``config_path``) may be
    a link. Only regular files are ever read, never FIFOs, devices or /proc files.
    ``param_order`` is a JSON file listing the parameters in the order the optimizer of a
    training dict was given them (read when the optimizer is first mapped);
    ``param_order_from_model`` takes that order from the model's code instead (transformers on
    the meta device, ``model_order.py``).

    A folder that holds the Trainer's files beside the model's weights (a Hugging Face Trainer
    ``checkpoint-N/``, ``trainer_folder.py``) is read as the model, with its ``optimizer.pt``
    as the optimizer state; the Trainer's other files are companions (copied byte for byte by
    a folder output, never unpickled).
    """
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or directory")
    companions: list[Companion] = []
    whole = folder_format(path) if os.path.isdir(path) else None
    if whole is not None:  # a folder many ranks wrote: read as one checkpoint by its format's reader
        target, fmt, folder = path, whole, path
        boundary = LinkBoundary.around(folder, allow_outside_links)
        trainer = None
    elif os.path.isdir(path):
        folder = _model_folder(path, allow_outside_links)
        boundary = LinkBoundary.around(folder, allow_outside_links, named=path)
        target, fmt = pick_in_folder(folder, exclude=is_trainer_file)
        boundary.check(target)
        companions = list_companions(folder, boundary)
        # a PEFT adapter's Trainer folder: its optimizer holds the adapter's state, not mapped yet
        adapter = os.path.lexists(os.path.join(folder, "adapter_config.json"))
        trainer = None if adapter else trainer_optimizer(folder, boundary.check)
    else:
        target, fmt = path, format_of(path)
        folder = os.path.dirname(os.path.abspath(path))
        boundary = LinkBoundary.around(folder, allow_outside_links)
        trainer = None

    if key is not None and not fmt.takes_key:
        raise CheckpointError(f"{target}: {option_name('key')} selects a state dict inside a PyTorch file (torch.save's, "
                              "under any name); this checkpoint is not one, so leave it out")
    contents = fmt.read(target, key=key, check_link=boundary.check)
    if whole is not None:  # the folder's other files travel with it (its config.json), not DeepSpeed's scripts
        read = {os.path.realpath(f) for f in contents.files}
        companions = [c for c in list_companions(folder, boundary)
                      if os.sep not in c.relative and not c.is_dir and os.path.realpath(c.source) not in read
                      and c.relative not in DEEPSPEED_SCRIPTS]
    stored, metadata, provenance_text = contents.tensors, contents.metadata, contents.provenance_text

    table = ParamTable.from_stored(stored)
    if provenance_text is not None and not isinstance(provenance_text, str):
        raise CheckpointError(f"{target}: the {METADATA_KEY!r} metadata entry must be a string (fusectl's "
                              "provenance); the metadata was edited or corrupted")
    provenance = Provenance.loads(provenance_text, target) if provenance_text else None
    if config_path is None:
        beside = os.path.join(folder, "config.json")
        if os.path.lexists(beside):
            boundary.check(beside)
            config_path = beside
    # without a config.json, the sizes the checkpoint's own files hold (an MXNet export's RNN)
    config = _read_config(config_path) if config_path else (dict(contents.config) if contents.config else None)
    aliases = merge_aliases([
        (f"{target} (shared storage)", contents.aliases),
        (f"{target} (fusectl provenance)", provenance.aliases if provenance else {}),
        (f"{target} (save_model metadata)", aliases_from_metadata(metadata, stored)),
        (f"{config_path} (tie_word_embeddings)", aliases_from_config(config, stored)),
    ])
    apply_aliases(table, aliases, target)
    passthrough = {
        k: v for k, v in metadata.items() if k != METADATA_KEY and k not in aliases
    }
    training = contents.training if contents.training is not None else trainer
    listed = contents.order if contents.order is not None else [*stored, *contents.aliases]
    return Checkpoint(path, contents.variant or fmt.name, list(contents.files), table, passthrough, provenance,
                      config, config_path, companions, contents.state_dict_key, list(contents.ignored), training,
                      param_order, param_order_from_model, key_order=[n for n in listed if n in table],
                      distributed=dict(contents.distributed) if contents.distributed is not None else None)


@dataclass(frozen=True)
class LinkBoundary:
    """Where the links of an input folder may lead (SPEC §6, trust boundary).

    A downloaded folder decides what its links name: ``tokenizer.json -> /etc/passwd`` would
    otherwise be read, and copied into an output that may be shared. So a path read from
    the folder must resolve inside one of ``roots``: the folder itself (and the folder the user
    named, a cache repository whose snapshot is read), and for a Hugging Face cache snapshot the
    repository's cache folder (``models--org--name/``), unless ``allow_outside``
    (``--follow-symlinks``).

    >>> b = LinkBoundary.around("/hub/models--org--m/snapshots/abc", False)
    >>> b.roots[-1]
    '/hub/models--org--m'
    """

    folder: str
    roots: tuple[str, ...]
    allow_outside: bool = False

    @classmethod
    def around(cls, folder: str, allow_outside: bool, named: str | None = None) -> "LinkBoundary":
        """The boundary of ``folder``, read for the folder the user ``named`` (by default itself)."""
        real = os.path.realpath(folder)
        roots = [real, os.path.realpath(named or folder)]
        for candidate in (os.path.abspath(folder), real):
            repository = snapshot_repository(candidate)
            if repository:
                roots.append(os.path.realpath(repository))
        return cls(folder, tuple(dict.fromkeys(roots)), allow_outside)

    def admits(self, real: str) -> bool:
        """Whether the resolved path ``real`` lies inside a root."""
        return self.allow_outside or any(
            real == root or real.startswith(root if root.endswith(os.sep) else root + os.sep) for root in self.roots
        )

    def check(self, path: str, real: str | None = None) -> None:
        """CheckpointError naming the link when ``path`` (a path inside the folder) resolves outside."""
        if self.allow_outside:
            return
        real = real if real is not None else os.path.realpath(path)
        if self.admits(real):
            return
        link = path
        while not os.path.islink(link) and os.path.dirname(link) not in (link, self.folder):
            link = os.path.dirname(link)
        target = os.readlink(link) if os.path.islink(link) else real
        raise CheckpointError(
            f"{printable(link)}: a link to {printable(target)} (that is {printable(real)}), outside the input "
            f"folder {printable(self.folder)}; fusectl follows links only inside the folder (or inside a Hugging "
            "Face cache repository) — copy the file into the folder, or allow links that leave it "
            f"({option('follow_symlinks')})"
        )


def list_companions(folder: str, boundary: LinkBoundary | None = None) -> list[Companion]:
    """Everything in ``folder`` but its top-level weight files, in path order.

    Subfolders are taken whole, weight files included: they hold other modules
    (sentence-transformers' ``1_Pooling/config.json``, ``2_Dense/model.safetensors``), not this
    checkpoint's tensors. Top-level weight files are left out: the output's own weights
    replace them, and a stale copy in the old layout would contradict them; so is a Trainer's
    optimizer file (its state is in the old layout too), but not the Trainer's other files
    (``scheduler.pt``, ``rng_state.pth``, ``training_args.bin``: kept byte for byte). Version-control
    folders (``.git``: a clone's ``.git/lfs`` holds the old weights again) are left out. A link
    is followed only within ``boundary`` (by default the folder itself); a linked folder is
    copied as a folder, except a link back up the tree (a cycle), which is skipped; anything
    but regular files and folders is refused.
    """
    boundary = boundary or LinkBoundary.around(folder, False)
    found: list[Companion] = []

    def walk(directory: str, relative: str, real: str, ancestors: frozenset[str]) -> None:
        if real in ancestors:  # a link back up the tree: walking it would never end
            return
        ancestors = ancestors | {real}
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as e:
            raise CheckpointError(f"{printable(directory)}: cannot list it ({e.strerror})") from e
        top = relative == ""
        subfolders = []
        files = 0
        for entry in entries:
            name = os.path.join(relative, entry.name)
            linked = entry.is_symlink()
            if linked and _loops(entry.path):
                raise CheckpointError(f"{printable(entry.path)}: a symbolic link that leads back to itself; "
                                      "remove it or point it at a file")
            if entry.name in VCS_FOLDERS and entry.is_dir():
                continue
            if entry.is_dir():  # follows a link: a linked folder is walked as a folder
                target = os.path.realpath(entry.path) if linked else os.path.join(real, entry.name)
                if linked:
                    boundary.check(entry.path, target)
                subfolders.append((entry.path, name, target))
                continue
            files += 1
            if top and entry.name.endswith(WEIGHT_SUFFIXES) and \
                    (entry.name in OPTIMIZER_FILES or not is_trainer_file(entry.name)):
                continue
            if linked:
                boundary.check(entry.path)
                check_regular_file(entry.path)
            elif not entry.is_file(follow_symlinks=False):
                check_regular_file(entry.path)
            found.append(Companion(entry.path, name))
        if not top and not files and not subfolders:
            found.append(Companion(directory, relative, is_dir=True))
        for path, name, target in subfolders:
            walk(path, name, target, ancestors)

    walk(folder, "", boundary.roots[0], frozenset())
    return found


# folders of version-control tools, never part of a model's files
VCS_FOLDERS = frozenset({".git", ".hg", ".svn"})


def _loops(path: str) -> bool:
    try:
        os.stat(path)
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


def adapter_config(checkpoint: Checkpoint) -> tuple[str, str, dict] | None:
    """(path, text, parsed object) of a PEFT adapter folder's ``adapter_config.json`` (parsed
    within the JSON budgets); None for other checkpoints."""
    found = next((c for c in checkpoint.companions if c.relative == "adapter_config.json" and not c.is_dir), None)
    if found is None:
        return None
    text = read_config_text(found.source)
    raw = load_json(text, found.source, "the adapter config")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{found.source}: the adapter config must be a JSON object")
    return found.source, text, raw


def read_config_text(path: str) -> str:
    """The text of a config.json (as read for ``config:`` variables), for [config] edits."""
    try:
        return read_json_bytes(path, "the config").decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: the config is not UTF-8 ({e.reason})") from None


def _read_config(path: str) -> dict:
    config = read_json_file(path, "the config")
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: config must be a JSON object")
    return config


def _model_folder(path: str, allow_outside_links: bool) -> str:
    """The folder whose files are the checkpoint: ``path``, or, for a Hugging Face cache
    repository folder (or its ``snapshots/``) that holds no weight file itself, the snapshot it
    stands for (hf_cache.py)."""
    repository = cache_repository(path)
    if repository is None or any(n.endswith(WEIGHT_SUFFIXES) for n in os.listdir(path)):
        return path
    return pick_snapshot(repository, LinkBoundary.around(repository, allow_outside_links).check)
