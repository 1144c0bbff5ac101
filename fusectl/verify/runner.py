"""onnxruntime sessions on a chosen provider, and the inputs fed to them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ..errors import VerifyError

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


def _ort():
    import onnxruntime  # imported on use: checkpoint-only commands never need it

    return onnxruntime


def resolve_provider(choice: str) -> str:
    """``auto`` picks CUDA when onnxruntime has it, else CPU; ``cuda`` must really be there."""
    available = _ort().get_available_providers()
    if choice == "cpu":
        return CPU
    if choice == "cuda":
        if CUDA not in available:
            raise VerifyError(
                f"--provider cuda: this onnxruntime has no CUDA provider (it has {', '.join(available)}); "
                "install onnxruntime-gpu on a machine with an NVIDIA GPU, or use --provider cpu"
            )
        return CUDA
    return CUDA if CUDA in available else CPU


def session(model: str | bytes, provider: str, what: str):
    """An InferenceSession that really runs on ``provider`` (strict fp32: TF32 off on CUDA)."""
    ort = _ort()
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if provider == CUDA:
        # TF32 would hide a 1e-4 difference, so strict fp32 runs with it off
        providers = [(CUDA, {"use_tf32": "0"}), CPU]
    else:
        providers = [CPU]
    try:
        sess = ort.InferenceSession(model, options, providers=providers)
    except Exception as e:  # onnxruntime raises its own exception types for bad models
        raise VerifyError(f"{what}: onnxruntime cannot load it: {e}") from e
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


_NUMPY_OF_ORT = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int16)": np.int16,
    "tensor(int8)": np.int8, "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_,
    "tensor(uint16)": np.uint16, "tensor(uint32)": np.uint32, "tensor(uint64)": np.uint64,
}


def parse_input_shapes(items) -> dict[str, tuple[int, ...]]:
    """``--input NAME=2x8`` → {"NAME": (2, 8)}."""
    shapes = {}
    for item in items:
        name, sep, dims = item.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            shapes[name] = tuple(int(d) for d in dims.lower().split("x")) if dims else ()
        except ValueError:
            raise VerifyError(f"--input {item!r}: write NAME=D0xD1x... (for example input_ids=1x8)") from None
    return shapes


def make_inputs(sess, given: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]],
                seed: int, what: str) -> tuple[dict[str, np.ndarray], list[InputSpec]]:
    """Inputs for every graph input: from ``given``, else seeded random (float: N(0,1);
    integers: 0 or 1; dynamic dimensions from ``shapes``, else 1)."""
    rng = np.random.default_rng(seed)
    feeds, specs = {}, []
    for meta in sess.get_inputs():
        dtype = _NUMPY_OF_ORT.get(meta.type)
        if meta.name in given:
            value = np.asarray(given[meta.name])
            feeds[meta.name] = value
            specs.append(InputSpec(meta.name, value.dtype, value.shape, "file"))
            continue
        if dtype is None:
            raise VerifyError(f"{what}: input {meta.name!r} has type {meta.type}; pass it with --inputs FILE.npz")
        if meta.name in shapes:
            shape = shapes[meta.name]
            if len(shape) != len(meta.shape):
                raise VerifyError(f"--input {meta.name}: the graph's input has {len(meta.shape)} dimensions, not {len(shape)}")
        else:
            shape = tuple(d if isinstance(d, int) and d > 0 else 1 for d in meta.shape)
        if np.dtype(dtype).kind == "f":
            value = rng.standard_normal(shape).astype(dtype)
        elif np.dtype(dtype) == np.bool_:
            value = rng.integers(0, 2, shape).astype(np.bool_)
        else:
            value = rng.integers(0, 2, shape).astype(dtype)
        feeds[meta.name] = value
        specs.append(InputSpec(meta.name, np.dtype(dtype), shape, "random"))
    unknown_shapes = sorted(set(shapes) - {m.name for m in sess.get_inputs()})
    if unknown_shapes:
        raise VerifyError(f"--input {unknown_shapes[0]}: {what} has no such input")
    # an .npz may also hold expected outputs (as fixtures do): those are not fed
    known = {m.name for m in sess.get_inputs()} | {m.name for m in sess.get_outputs()}
    unknown = sorted(set(given) - known)
    if unknown:
        raise VerifyError(f"--inputs: {unknown} are neither inputs nor outputs of {what}")
    return feeds, specs


def run(sess, feeds: Mapping[str, np.ndarray], what: str) -> dict[str, np.ndarray]:
    try:
        names = [o.name for o in sess.get_outputs()]
        return dict(zip(names, sess.run(names, dict(feeds))))
    except Exception as e:
        raise VerifyError(f"{what}: onnxruntime failed to run it: {e}") from e
