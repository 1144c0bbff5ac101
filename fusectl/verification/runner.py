"""onnxruntime sessions on a chosen provider, and the inputs fed to them."""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ..errors import VerifyError, option, option_name, printable
from .input_ranges import DEFAULT, IntegerRange

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"

# onnxruntime's log severities: 0 verbose ... 3 error, 4 fatal
_ORT_SILENT = 4
MESSAGE_CHARS = 500
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-_]")


def _ort():
    import onnxruntime  # imported on use: checkpoint-only commands never need it

    # onnxruntime writes its own coloured, multi-line log records straight to file descriptor 2;
    # verify reports every failure itself, as one ``error:`` line, so the default logger (used
    # before and between sessions) stays silent; sessions and runs are silenced one by one below
    onnxruntime.set_default_logger_severity(_ORT_SILENT)
    return onnxruntime


def one_line(error: BaseException | str, limit: int = MESSAGE_CHARS) -> str:
    """An exception's text as one printable line: ANSI colours gone, lines joined by "; ", at
    most ``limit`` characters (onnxruntime's messages can span many lines and kilobytes).

    >>> one_line("\\x1b[1;31mfirst\\x1b[m\\n  second\\n")
    'first; second'
    """
    text = _ANSI.sub("", str(error))
    text = "; ".join(part.strip() for part in text.splitlines() if part.strip())
    text = printable(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_seed(seed: int) -> int:
    """``seed`` if numpy can seed with it: a whole number >= 0 (numpy refuses negative seeds, and
    mapping them onto others would give two seeds the same inputs)."""
    try:
        value = operator.index(seed)
    except TypeError:
        raise VerifyError(f"{option_name('seed')} {seed!r}: give a whole number >= 0") from None
    if value < 0:
        raise VerifyError(f"{option_name('seed')} {value}: give a whole number >= 0 (numpy seeds are not negative)")
    return value


def resolve_provider(choice: str) -> str:
    """``auto`` picks CUDA when onnxruntime has it, else CPU; ``cuda`` must really be there."""
    available = _ort().get_available_providers()
    if choice == "cpu":
        return CPU
    if choice == "cuda":
        if CUDA not in available:
            raise VerifyError(
                f"{option('provider', 'cuda')}: this onnxruntime has no CUDA provider (it has {', '.join(available)}); "
                f"install onnxruntime-gpu on a machine with an NVIDIA GPU, or use {option('provider', 'cpu')}"
            )
        return CUDA
    return CUDA if CUDA in available else CPU


def ort_values(arrays: Mapping[str, np.ndarray]) -> dict:
    """An OrtValue over each array's own memory, by name (no copy on CPU): what
    :func:`session` takes as ``initializers``. Keep the arrays for as long as the sessions run."""
    ort = _ort()
    return {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in arrays.items()}


def session(model: str | bytes, provider: str, what: str, initializers: Mapping[str, object] | None = None,
            *, external_folder: str | None = None):
    """An InferenceSession that really runs on ``provider`` (strict fp32: TF32 off on CUDA).

    ``initializers`` (OrtValues by name, :func:`ort_values`) replace the model's own tensors of
    those names, so that two sessions can run on one copy; pre-packing is then off, since a
    kernel's packed copy of a shared weight would be one more copy in each session.
    ``external_folder``: where the external data of a ``model`` given as bytes lies (the folder
    of the file it was read from).
    """
    ort = _ort()
    options = ort.SessionOptions()
    options.log_severity_level = _ORT_SILENT
    try:
        for name, value in (initializers or {}).items():
            options.add_initializer(name, value)
    except Exception as e:  # onnxruntime raises its own exception types
        raise VerifyError(f"{printable(what)}: onnxruntime refused a shared initializer: {one_line(e)}") from e
    if initializers:
        options.add_session_config_entry("session.disable_prepacking", "1")
    if external_folder is not None:
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", external_folder)
    if provider == CUDA:
        # TF32 would hide a 1e-4 difference, so strict fp32 runs with it off
        providers = [(CUDA, {"use_tf32": "0"}), CPU]
    else:
        providers = [CPU]
    try:
        sess = ort.InferenceSession(model, options, providers=providers)
    except Exception as e:  # onnxruntime raises its own exception types for bad models
        raise VerifyError(f"{printable(what)}: onnxruntime cannot load it: {one_line(e)}") from e
    if not sess.get_outputs():
        raise VerifyError(f"{printable(what)}: the graph has no outputs, so there is nothing to compare; "
                          "give verify models that declare their outputs")
    if sess.get_providers()[0] != provider:
        raise VerifyError(
            f"{what}: onnxruntime fell back to {sess.get_providers()[0]} instead of {provider}; "
            "check the CUDA and cuDNN libraries onnxruntime-gpu needs"
        )
    return sess


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    source: str  # "file", "random"
    range: IntegerRange | None = None  # the values of a random integer input (not bool)


_NUMPY_OF_ORT = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int16)": np.int16,
    "tensor(int8)": np.int8, "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_,
    "tensor(uint16)": np.uint16, "tensor(uint32)": np.uint32, "tensor(uint64)": np.uint64,
}


BATCH_DEFAULT = 2
LENGTH_DEFAULT = 16
MAX_RANDOM_ELEMENTS = 2**28  # 1 GiB of float32 per random input: a check, not a benchmark


def declared_shapes(sess) -> dict[str, tuple]:
    """The graph's inputs as onnxruntime reports them: each axis a size, a dim_param name or None."""
    def axis(d):
        if isinstance(d, int):
            return d if d > 0 else None
        return d or None
    return {m.name: tuple(axis(d) for d in (m.shape or ())) for m in sess.get_inputs()}


def _shape_text(shape) -> str:
    return "x".join(str(d) for d in shape)


def resolve_shapes(
    declared: Mapping[str, tuple],
    *,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    dims: Mapping[str, int] | None = None,
    given: Mapping[str, tuple[int, ...]] | None = None,
    hints: Mapping[str, tuple] | None = None,
    what: str = "the model",
) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """Sizes for every input axis: (shapes of the inputs to make, value of each named dimension).

    ``declared`` maps input name to its axes (an int, a dim_param name, or None for an unnamed
    dynamic axis); ``dims`` are the ``--dim`` sizes, ``shapes`` the ``--input`` shapes, ``given``
    the shapes of the ``--inputs`` arrays (inputs that are not made) and ``hints`` the other
    model's inputs. Where a named dimension's size comes from, and which source wins, is
    :class:`DimensionSizes`. Raises VerifyError for an ``--input`` or ``--dim`` the model does not
    have, an input given both ways, a shape of the wrong rank or fixed size, and options that
    disagree.

    >>> resolve_shapes({"ids": ("batch", "seq"), "mask": ("batch", "seq")}, shapes={"ids": (3, 8)})
    ({'ids': (3, 8), 'mask': (3, 8)}, {'batch': 3, 'seq': 8})
    """
    return DimensionSizes(declared, shapes=shapes, dims=dims, given=given, hints=hints, what=what).resolve()


class DimensionSizes:
    """The size of each named dimension of a model's inputs, from the sources that may give one.

    A named dimension (an ONNX dim_param) takes the first size these sources give it, asked in
    this order, one method each:

    1. :meth:`from_dim_options`: ``--dim NAME=SIZE``;
    2. :meth:`from_input_options`: the size an ``--input NAME=D0xD1...`` shape has on it;
    3. :meth:`from_inputs_arrays`: the size an ``--inputs`` array has on it;
    4. :meth:`from_other_model`: a fixed size the other model's input has on the same axis;
    5. :meth:`from_defaults`: 2 when it is the first axis of every input that uses it (a batch),
       16 otherwise.

    A later source that gives a different size is an error when either of the two is an option
    (1, 2), naming both; arrays that disagree among themselves, and an other model that disagrees
    with what the user gave, are left to onnxruntime, which names the clash. An unnamed dynamic
    axis (:meth:`shape_of`) takes the other model's size, else 2 on axis 0 and 16 elsewhere.

    >>> sizes = DimensionSizes({"ids": ("batch", "seq")}, dims={"seq": 8}, hints={"ids": (4, None)})
    >>> sizes.resolve()
    ({'ids': (4, 8)}, {'batch': 4, 'seq': 8})
    >>> sizes.values["batch"]
    (4, 'the other model', False)
    """

    def __init__(self, declared: Mapping[str, tuple], *, shapes: Mapping[str, tuple[int, ...]] | None = None,
                 dims: Mapping[str, int] | None = None, given: Mapping[str, tuple[int, ...]] | None = None,
                 hints: Mapping[str, tuple] | None = None, what: str = "the model"):
        self.declared, self.what = declared, what
        self.shapes, self.dims, self.given, self.hints = shapes or {}, dims or {}, given or {}, hints or {}
        self.uses: dict[str, list[int]] = {}  # dim name -> the axes it appears on
        for axes in declared.values():
            for i, d in enumerate(axes):
                if isinstance(d, str):
                    self.uses.setdefault(d, []).append(i)
        # dim name -> (size, who set it, whether an option set it)
        self.values: dict[str, tuple[int, str, bool]] = {}

    def resolve(self) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
        """The shape of each input to make (not those of ``given``) and the size of each named
        dimension, the sources asked in their order of precedence."""
        self.check_names()
        self.from_dim_options()
        self.from_input_options()
        self.from_inputs_arrays()
        self.from_other_model()
        self.from_defaults()
        shapes = {name: self.shape_of(name) for name in self.declared if name not in self.given}
        return shapes, {name: self.values[name][0] for name in self.uses}

    def check_names(self) -> None:
        """Every ``--input`` and ``--dim`` names what the model has, and no input is given twice."""
        what, declared, uses = self.what, self.declared, self.uses
        unknown = [n for n in self.shapes if n not in declared]
        if unknown:
            raise VerifyError(f"{option_name('shapes')} {printable(unknown[0])}: {what} has no input named '{printable(unknown[0])}'; "
                              f"its inputs are {', '.join(map(printable, declared)) or 'none'}")
        for name in self.dims:
            if name not in uses:
                have = ", ".join(map(printable, uses)) if uses else f"none (set whole shapes with {option('shapes')})"
                raise VerifyError(f"{option_name('dims')} {printable(name)}: {what} has no dynamic dimension named "
                                  f"'{printable(name)}'; its named dimensions are {have}")
        both = [n for n in self.shapes if n in self.given]
        if both:
            raise VerifyError(f"{option_name('shapes')} {printable(both[0])}: {option_name('inputs')} already gives this input; give it one way")

    def bind(self, name: str, value: int, source: str, from_option: bool) -> None:
        """Dimension ``name`` is ``value`` by ``source``, unless a source before it set it."""
        if name not in self.values:
            self.values[name] = (value, source, from_option)
            return
        old_value, old_source, old_from_option = self.values[name]
        # arrays of one .npz that disagree among themselves are left to onnxruntime, as before
        if old_value != value and (from_option or old_from_option):
            raise VerifyError(f"{printable(source)} sets dimension '{printable(name)}' to {value}, but "
                              f"{printable(old_source)} sets it to {old_value}; "
                              "give one size per named dimension")

    def from_dim_options(self) -> None:
        """1. ``--dim NAME=SIZE``."""
        for name, value in self.dims.items():
            self.bind(name, value, f"{option_name('dims')} {name}={value}", from_option=True)

    def from_input_options(self) -> None:
        """2. ``--input NAME=D0xD1...``: checked against the input's rank and fixed sizes."""
        for name, axes in self.declared.items():
            if name in self.shapes:
                shape = self.shapes[name]
                source = f"{option_name('shapes')} {name}={_shape_text(shape)}"
                _check_axes(printable(source), name, axes, shape, self.what, "give {d} there", "")
                for d, v in zip(axes, shape):
                    if isinstance(d, str):
                        self.bind(d, v, source, from_option=True)

    def from_inputs_arrays(self) -> None:
        """3. The arrays of ``--inputs`` (one of another rank is left to :func:`_check_given`)."""
        for name, axes in self.declared.items():
            if name in self.given and len(self.given[name]) == len(axes):
                for d, v in zip(axes, self.given[name]):
                    if isinstance(d, str):
                        self.bind(d, v, f"{option_name('inputs')} array {name}", from_option=False)

    def from_other_model(self) -> None:
        """4. A fixed size of the other model's input on the same axis (of an input of the same rank)."""
        for name, axes in self.declared.items():
            hint = self.hints.get(name, ())
            for d, h in zip(axes, hint if len(hint) == len(axes) else ()):
                if isinstance(d, str) and isinstance(h, int):
                    if d not in self.values:  # what the user gave wins; onnxruntime then names the clash
                        self.values[d] = (h, "the other model", False)

    def from_defaults(self) -> None:
        """5. 2 for a dimension that is the first axis of every input that uses it, else 16."""
        for name, axes in self.uses.items():
            if name not in self.values:
                self.values[name] = (BATCH_DEFAULT if all(i == 0 for i in axes) else LENGTH_DEFAULT, "default", False)

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The shape to make input ``name`` with: its ``--input`` shape, else axis by axis its fixed
        size, its named dimension's size, or (unnamed) the other model's size, else a default."""
        if name in self.shapes:
            return tuple(self.shapes[name])
        axes = self.declared[name]
        hint = self.hints.get(name, ())
        shape = []
        for i, d in enumerate(axes):
            if isinstance(d, int):
                shape.append(d)
            elif isinstance(d, str):
                shape.append(self.values[d][0])
            elif i < len(hint) and isinstance(hint[i], int) and len(hint) == len(axes):
                shape.append(hint[i])
            else:
                shape.append(BATCH_DEFAULT if i == 0 else LENGTH_DEFAULT)
        return tuple(shape)


def declared_arrays(given: Mapping[str, np.ndarray]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """(shape, dtype) of each array of ``given``, from ``given.declared`` where it tells them
    without reading data (an ``--inputs`` file), else from the arrays."""
    declared = getattr(given, "declared", None)
    if declared is not None:
        return dict(declared)
    return {k: (tuple(np.shape(v)), np.asarray(v).dtype) for k, v in given.items()}


def _check_given(sess, given: Mapping[str, tuple[tuple[int, ...], np.dtype]], what: str) -> None:
    """Each given array fits its input's rank, fixed axes and element type (before it is read)."""
    declared = declared_shapes(sess)
    for meta in sess.get_inputs():
        if meta.name not in given:
            continue
        shape, dtype = given[meta.name]
        axes = declared[meta.name]
        where = f"{option_name('inputs')} array {printable(meta.name)} ({dtype}{list(shape)})"
        # onnxruntime reports an input of unknown rank as [], like a scalar: left to onnxruntime
        if axes:
            _check_axes(where, meta.name, axes, shape, what, "save it with {d} there",
                        "; save it with the model's shape")
        expected = _NUMPY_OF_ORT.get(meta.type)
        if expected is not None and np.dtype(dtype) != np.dtype(expected):
            raise VerifyError(f"{where}: {printable(what)}'s input {printable(meta.name)} is {meta.type}; "
                              f"save it as {np.dtype(expected)}")


def random_integer_inputs(sess, given: Mapping[str, np.ndarray]) -> list[str]:
    """The inputs of ``sess`` that :func:`make_inputs` makes as random integers (not bool)."""
    fed = set(given)  # by name only: looking an array up in an --inputs file would decompress it
    return [m.name for m in sess.get_inputs() if m.name not in fed
            and np.dtype(_NUMPY_OF_ORT.get(m.type, np.float32)).kind in "iu"]


def make_inputs(sess, given: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]],
                dims: Mapping[str, int], seed: int, what: str, hints: Mapping[str, tuple] | None = None,
                ranges: Mapping[str, IntegerRange] | None = None,
                ) -> tuple[dict[str, np.ndarray], list[InputSpec], dict[str, int]]:
    """Inputs for every graph input: from ``given``, else seeded random with the shapes of
    :func:`resolve_shapes`: floats N(0,1), bools False or True, integers uniform in their range
    of ``ranges`` (see :mod:`fusectl.verification.input_ranges`), else in [0, 1]. Also returns the
    named dims."""
    for meta in sess.get_inputs():
        if not meta.type.startswith("tensor("):
            raise VerifyError(f"{printable(what)}: input {printable(meta.name)} has type {meta.type}; verify "
                              f"feeds tensors only (seeded random, or arrays from {option_name('inputs')}), so it cannot run "
                              "this model")
    declared = declared_shapes(sess)
    # an .npz may also hold expected outputs (as fixtures do): those are not fed, nor read
    known = set(declared) | {m.name for m in sess.get_outputs()}
    unknown = sorted(set(given) - known)
    if unknown:
        raise VerifyError(f"{option_name('inputs')}: {unknown} are neither inputs nor outputs of {what}")
    given_specs = {k: v for k, v in declared_arrays(given).items() if k in declared}
    _check_given(sess, given_specs, what)
    random_shapes, named = resolve_shapes(declared, shapes=shapes, dims=dims,
                                          given={k: shape for k, (shape, _) in given_specs.items()},
                                          hints=hints, what=what)
    rng = np.random.default_rng(check_seed(seed))
    # every input is checked before any array is read or made
    for meta in sess.get_inputs():
        if meta.name in given_specs:
            continue
        if _NUMPY_OF_ORT.get(meta.type) is None:
            raise VerifyError(f"{what}: input {printable(meta.name)} has type {meta.type}; pass it with {option('inputs', 'FILE.npz')}")
        shape = random_shapes[meta.name]
        if math.prod(shape) > MAX_RANDOM_ELEMENTS:
            raise VerifyError(f"input {printable(meta.name)} of shape {list(shape)} would hold {math.prod(shape)} "
                              f"elements, over the {MAX_RANDOM_ELEMENTS} allowed for a random input; "
                              f"give smaller {option_name('shapes')}/{option_name('dims')} sizes or pass arrays with {option_name('inputs')}")
    feeds, specs = {}, []
    for meta in sess.get_inputs():
        if meta.name in given_specs:
            value = np.asarray(given[meta.name])
            feeds[meta.name] = value
            specs.append(InputSpec(meta.name, value.dtype, value.shape, "file"))
            continue
        dtype = _NUMPY_OF_ORT[meta.type]
        shape = random_shapes[meta.name]
        values = None
        if np.dtype(dtype).kind == "f":
            value = rng.standard_normal(shape).astype(dtype)
        elif np.dtype(dtype) == np.bool_:
            value = rng.integers(0, 2, shape).astype(np.bool_)
        else:
            values = (ranges or {}).get(meta.name, DEFAULT)
            value = rng.integers(values.low, values.high, shape, endpoint=True).astype(dtype)
        feeds[meta.name] = value
        specs.append(InputSpec(meta.name, np.dtype(dtype), shape, "random", values))
    return feeds, specs, named


def run(sess, feeds: Mapping[str, np.ndarray], what: str, *, shrink: bool = False) -> dict[str, np.ndarray | list]:
    """Every output of ``sess`` by name (a tensor as an array, a sequence as a list of arrays).

    ``shrink``: the session's CPU arena gives back what it no longer uses when the run ends, for
    a session kept alive while another runs (its intermediate buffers are then not held twice)."""
    options = _ort().RunOptions()
    options.log_severity_level = _ORT_SILENT
    if shrink:
        options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    try:
        names = [o.name for o in sess.get_outputs()]
        return dict(zip(names, sess.run(names, dict(feeds), options)))
    except Exception as e:  # onnxruntime raises its own exception types for failed kernels
        raise VerifyError(f"{printable(what)}: onnxruntime failed to run it: {one_line(e)}") from e


def _check_axes(where: str, name: str, axes, shape, what: str, fix: str, rank_fix: str) -> None:
    """VerifyError unless ``shape`` has the input's rank and its fixed sizes; ``fix`` says what
    to do about a size (``{d}``: the size the model fixes), ``rank_fix`` about the rank."""
    if len(shape) != len(axes):
        noun = "dimension" if len(axes) == 1 else "dimensions"
        raise VerifyError(f"{where}: {printable(what)}'s input {printable(name)} has {len(axes)} "
                          f"{noun}, not {len(shape)}{rank_fix}")
    for i, (d, v) in enumerate(zip(axes, shape)):
        if isinstance(d, int) and d != v:
            raise VerifyError(f"{where}: axis {i} of {printable(name)} is fixed at {d} in "
                              f"{printable(what)}; {fix.format(d=d)}")
