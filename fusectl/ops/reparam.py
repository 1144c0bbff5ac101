"""Reparametrization ops: weight_norm, spectral_norm and BatchNorm folding, as PyTorch computes them.

Numeric ops compute in float32 (float64 for float64 inputs) and cast back to the stored dtype.
Invalid data (a zero norm, σ ≤ 0, var + eps ≤ 0) is a ComputeError naming the tensor, never
a NaN written to disk.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Sequence

import numpy as np

from ..errors import ComputeError, PlanError
from ..tensors import TensorSpec
from .base import Op, normalize_axis


def compute_dtype_of(dtype: np.dtype) -> np.dtype:
    """float64 for float64 data, float32 for everything else (fp16, bf16, fp8 included)."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _as_compute(array: np.ndarray) -> np.ndarray:
    return np.asarray(array).astype(compute_dtype_of(array.dtype), copy=False)


def _check_float(specs: Sequence[TensorSpec], names: Sequence[str], kind: str) -> None:
    for spec, name in zip(specs, names):
        if not spec.dtype.is_float:
            raise PlanError(f"{name!r} is {spec.dtype}; {kind} needs floating-point tensors")


def norm_except(v: np.ndarray, dim: int | None) -> np.ndarray:
    """L2 norm over every axis but ``dim`` (kept as size-1 axes); the whole tensor when None."""
    if dim is None:
        return np.asarray(np.sqrt(np.sum(v * v)))
    axes = tuple(a for a in range(v.ndim) if a != dim)
    return np.sqrt(np.sum(v * v, axis=axes, keepdims=True))


def weight_norm_in_onnx(b, g, v, v_shape: Sequence[int], dim: int | None):
    """w = g · v / ‖v‖ as ONNX nodes (builder ``b``, see ``onnx_forms``), the norm over every
    axis but ``dim`` (the whole tensor when None)."""
    axes = [a for a in range(len(v_shape)) if a != dim] if dim is not None else list(range(len(v_shape)))
    norm = b.one("Sqrt", [b.one("ReduceSumSquare", [v, b.ints(axes)], keepdims=1 if dim is not None else 0)])
    return b.one("Mul", [v, b.one("Div", [g, norm])])


def weight_norm_dim(g_shape: Sequence[int], v_shape: Sequence[int], g_name: str, v_name: str) -> int | None:
    """``dim = "auto"``: the one axis where g is not 1; None (whole tensor) for 0-d or all-ones g."""
    if len(g_shape) == 0:
        return None
    if len(g_shape) != len(v_shape):
        raise PlanError(
            f"{g_name!r} has shape {list(g_shape)} but {v_name!r} has {list(v_shape)}; "
            "g must have v's rank (size-1 axes but one) or be 0-d"
        )
    axes = [a for a, d in enumerate(g_shape) if d != 1]
    if not axes:
        return None
    if len(axes) > 1:
        raise PlanError(f"{g_name!r} has shape {list(g_shape)}: more than one axis is not 1, so it is not a weight_norm g")
    return axes[0]


def _parse_dim(dim: int | str, where: str) -> int | str | None:
    if dim == "none":
        return None
    if dim == "auto" or type(dim) is int:
        return dim
    raise PlanError(f"{where}: dim = {dim!r}; use an integer, \"auto\" or \"none\"")


@dataclasses.dataclass(frozen=True)
class WeightNormFold(Op):
    """w = g · v / ‖v‖, the norm over every axis but ``dim`` (PyTorch ``_weight_norm``).

    Rule keys: ``op = "weight_norm_fold"``, ``g``, ``v``, ``output``, ``dim`` (default ``"auto"``:
    the one axis where g is not 1, the whole tensor for a 0-d or all-ones g; an integer; or
    ``"none"``, PyTorch's ``dim=None``, the whole tensor). The output has v's shape and dtype,
    computed in float32 (float64 for float64). Refuses tensors that are not floating point, a g
    whose shape does not fit v and ``dim``, and, when the step runs, a slice of v with zero norm (a
    ComputeError, never a NaN written). Inverse: ``weight_norm_unfold`` with the dim the step used
    (``"auto"`` resolved from g's shape); from the rule alone only with an explicit ``dim``.

    >>> g, v = np.array([[10.0], [2.0]]), np.array([[3.0, 4.0], [0.0, 2.0]])
    >>> WeightNormFold().apply([g, v])[0].tolist()
    [[6.0, 8.0], [0.0, 2.0]]

    Rule::

        [[rule]]
        op     = "weight_norm_fold"
        g      = "{m*}.weight_g"
        v      = "{m*}.weight_v"
        output = "{m*}.weight"
    """

    kind: ClassVar[str] = "weight_norm_fold"
    probed: ClassVar[bool] = True
    exact: ClassVar[bool] = False
    graph_foldable: ClassVar[bool] = True
    named_inputs: ClassVar[tuple[str, ...]] = ("g", "v")
    named_outputs: ClassVar[tuple[str, ...]] = ("output",)
    dim: int | str = "auto"

    def fold_in_graph(self, rewriter, step, values):
        rewriter.replace_subgraph(step, values)

    def _dim(self, g: Sequence[int], v: Sequence[int], names) -> int | None:
        dim = _parse_dim(self.dim, "weight_norm_fold")
        auto = weight_norm_dim(g, v, names[0], names[1])
        if dim == "auto":
            return auto
        dim = None if dim is None else normalize_axis(dim, len(v), names[1], "dim")
        expected = () if dim is None else tuple(d if a == dim else 1 for a, d in enumerate(v))
        if tuple(g) != expected and not (dim is not None and auto == dim):
            raise PlanError(f"{names[0]!r} has shape {list(g)}; with dim {self.dim} g must be {list(expected)}")
        return dim

    def infer(self, specs, names):
        g, v = specs
        _check_float(specs, names, "weight_norm_fold")
        dim = self._dim(g.shape, v.shape, names)
        if dim is not None and g.shape[dim] != v.shape[dim]:
            raise PlanError(f"{names[0]!r} has {g.shape[dim]} entries along dim {dim}, {names[1]!r} has {v.shape[dim]}")
        return [v]

    def apply(self, arrays):
        g, v = arrays
        dim = self._dim(g.shape, v.shape, ("g", "v"))
        gc, vc = _as_compute(g), _as_compute(v)
        norm = norm_except(vc, dim)
        if not np.all(norm > 0):
            raise ComputeError("a slice of v has zero norm; weight_norm would divide by zero")
        return [np.asarray(vc * (gc / norm)).astype(v.dtype)]

    def inverse(self, specs):
        if specs is None:
            if self.dim == "auto":
                raise PlanError("weight_norm_fold with dim = \"auto\" cannot be undone from the rule alone; set dim or unfuse with the provenance")
            return WeightNormUnfold(dim=self.dim)
        dim = self._dim(specs[0].shape, specs[1].shape, ("g", "v"))
        return WeightNormUnfold(dim="none" if dim is None else dim)

    def probe(self, p, before, after, input_specs, output_specs):
        """A readout of g · v / ‖v‖ computed in ONNX beside one of the folded weight."""
        w_shape = output_specs[0].shape
        g, v = (p.param(p.ref, a) for a in before)
        dim = weight_norm_dim(input_specs[0].shape, w_shape, "g", "v")
        p.readouts(0, weight_norm_in_onnx(p.ref, g, v, w_shape, dim), p.param(p.cand, after[0]), w_shape)


@dataclasses.dataclass(frozen=True)
class WeightNormUnfold(Op):
    """g = ‖w‖ over every axis but ``dim``, v = w (what ``weight_norm`` does when applied).

    Rule keys: ``op = "weight_norm_unfold"``, ``input``, ``g``, ``v`` (the two outputs), ``dim``
    (default 0; an integer or ``"none"`` for the whole tensor, never ``"auto"``). g keeps every
    axis but ``dim`` as size 1 (0-d for ``"none"``), in the weight's dtype; v is the weight.
    Refuses tensors that are not floating point, ``dim = "auto"`` and a dim out of range.
    Inverse: ``weight_norm_fold`` with the same ``dim``.

    >>> g, v = WeightNormUnfold(dim=0).apply([np.array([[3.0, 4.0], [0.0, 2.0]])])
    >>> g.tolist(), v.tolist()
    ([[5.0], [2.0]], [[3.0, 4.0], [0.0, 2.0]])

    Rule::

        [[rule]]
        op    = "weight_norm_unfold"
        input = "{m*}.weight"
        g     = "{m*}.weight_g"
        v     = "{m*}.weight_v"
    """

    kind: ClassVar[str] = "weight_norm_unfold"
    probed: ClassVar[bool] = True
    exact: ClassVar[bool] = False
    named_inputs: ClassVar[tuple[str, ...]] = ("input",)
    named_outputs: ClassVar[tuple[str, ...]] = ("g", "v")
    dim: int | str = 0

    def _dim(self, shape: Sequence[int], name: str) -> int | None:
        dim = _parse_dim(self.dim, "weight_norm_unfold")
        if dim == "auto":
            raise PlanError("weight_norm_unfold needs dim (an integer or \"none\"), not \"auto\"")
        return None if dim is None else normalize_axis(dim, len(shape), name, "dim")

    def output_count(self, specs):
        return 2

    def infer(self, specs, names):
        (w,) = specs
        _check_float(specs, names, "weight_norm_unfold")
        dim = self._dim(w.shape, names[0])
        g_shape = () if dim is None else tuple(d if a == dim else 1 for a, d in enumerate(w.shape))
        return [TensorSpec(w.dtype, g_shape), w]

    def apply(self, arrays):
        (w,) = arrays
        dim = self._dim(w.shape, "w")
        return [norm_except(_as_compute(w), dim).astype(w.dtype), w]

    def inverse(self, specs):
        return WeightNormFold(dim=self.dim)

    def probe(self, p, before, after, input_specs, output_specs):
        """A readout of the weight beside one of g · v / ‖v‖ computed in ONNX from the outputs."""
        w_shape = input_specs[0].shape
        g, v = (p.param(p.cand, a) for a in after)
        dim = weight_norm_dim(output_specs[0].shape, w_shape, "g", "v")
        p.readouts(0, p.param(p.ref, before[0]), weight_norm_in_onnx(p.cand, g, v, w_shape, dim), w_shape)


def spectral_matrix(w: np.ndarray, dim: int) -> np.ndarray:
    """W with axis ``dim`` moved first, reshaped to (W.shape[dim], -1)."""
    return np.moveaxis(w, dim, 0).reshape(w.shape[dim], -1)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return float(abs(a @ b) / (na * nb)) if na > 0 and nb > 0 else 0.0


# dim = "auto" between axes 0 and 1: the pair must align (|cos|) at least this well under
# the chosen axis, and no better than DECIDE_OTHER under the other
DECIDE_ALIGNED = 0.95
DECIDE_OTHER = 0.8


@dataclasses.dataclass(frozen=True)
class SpectralNormFold(Op):
    """w = W / σ with σ = u · (M v): eval-mode spectral_norm, no power iteration.

    M is W with axis ``dim`` moved first, reshaped to ``(W.shape[dim], -1)``; u and v are used as
    stored (no renormalisation). Rule keys: ``op = "spectral_norm_fold"``, ``weight`` (W, e.g.
    ``weight_orig``), ``u``, ``v``, ``output``, ``dim`` (default ``"auto"``: among axes 0 and 1 the
    one whose length is len(u); when both fit, the one under which (u, v) is a power-iteration
    pair; 1 for ConvTranspose, 0 otherwise). The output has W's shape and dtype, computed in
    float32 (float64 for float64). Refuses tensors that are not floating point, u or v that are not
    vectors or fit no axis, and, when the step runs, σ that is not positive and finite or an
    ``"auto"`` that neither axis decides (ComputeErrors asking for ``dim``). Inverse: none
    (one-way).

    >>> w = np.array([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    >>> SpectralNormFold().apply([w, np.array([1.0, 0.0]), np.array([1.0, 0.0, 0.0])])[0].tolist()
    [[1.0, 0.0, 0.0], [0.0, 0.5, 0.0]]

    Rule::

        [[rule]]
        op     = "spectral_norm_fold"
        weight = "{m*}.weight_orig"
        u      = "{m*}.weight_u"
        v      = "{m*}.weight_v"
        output = "{m*}.weight"
    """

    kind: ClassVar[str] = "spectral_norm_fold"
    probed: ClassVar[bool] = True
    exact: ClassVar[bool] = False
    graph_foldable: ClassVar[bool] = True
    named_inputs: ClassVar[tuple[str, ...]] = ("weight", "u", "v")
    named_outputs: ClassVar[tuple[str, ...]] = ("output",)
    dim: int | str = "auto"

    def fold_in_graph(self, rewriter, step, values):
        rewriter.replace_subgraph(step, values)

    def candidate_dims(self, w: Sequence[int], u: Sequence[int], v: Sequence[int], names) -> list[int]:
        """The axes ``dim`` may be for W of shape ``w`` and vectors of lengths ``u``, ``v``: the
        rule's dim, or for ``"auto"`` those of axes 0 and 1 where len(u) is the axis' length and len(v)
        the rest; PlanError naming the tensor when none fits."""
        if len(u) != 1 or len(v) != 1:
            raise PlanError(f"{names[1]!r} and {names[2]!r} must be vectors (shapes {list(u)}, {list(v)})")
        numel = int(np.prod(w))
        if self.dim != "auto":
            dim = _parse_dim(self.dim, "spectral_norm_fold")
            if dim is None or not -len(w) <= dim < len(w):
                raise PlanError(f"{names[0]!r} has {len(w)} dimensions; dim {self.dim} is invalid")
            dims = [normalize_axis(dim, len(w), names[0], "dim")]
        else:
            dims = [d for d in (0, 1) if d < len(w)]
        fits = [d for d in dims if w[d] == u[0] and w[d] and numel // w[d] == v[0]]
        if not fits:
            raise PlanError(
                f"{names[0]!r} has shape {list(w)}, but u has {u[0]} and v {v[0]} entries: "
                f"no {'axis 0 or 1' if self.dim == 'auto' else f'dim {self.dim}'} fits"
            )
        return fits

    def infer(self, specs, names):
        _check_float(specs, names, "spectral_norm_fold")
        self.candidate_dims(specs[0].shape, specs[1].shape, specs[2].shape, names)
        return [specs[0]]

    def apply(self, arrays):
        w, u, v = arrays
        wc, uc, vc = (_as_compute(a) for a in arrays)
        dims = self.candidate_dims(w.shape, u.shape, v.shape, ("weight", "u", "v"))
        if len(dims) > 1:
            dims = self._consistent(wc, uc, vc, dims)
        sigma = uc @ (spectral_matrix(wc, dims[0]) @ vc)
        if not np.isfinite(sigma) or sigma <= 0:
            raise ComputeError(f"σ = u·(M v) is {float(sigma)}; spectral_norm needs a positive finite σ")
        return [np.asarray(wc / sigma).astype(w.dtype)]

    def probe(self, p, before, after, input_specs, output_specs):
        """A readout of W / σ computed in ONNX beside one of the folded weight."""
        w_shape = output_specs[0].shape
        w, u, v = (p.param(p.ref, a) for a in before)
        dims = self.candidate_dims(w_shape, input_specs[1].shape, input_specs[2].shape, ("w", "u", "v"))
        dim = dims[0] if len(dims) == 1 else self._consistent(*(_f32(a) for a in before), dims)[0]
        perm = [dim] + [a for a in range(len(w_shape)) if a != dim]
        m = p.ref.one("Reshape", [p.ref.one("Transpose", [w], perm=perm), p.ref.ints([w_shape[dim], -1])])
        sigma = p.ref.one("ReduceSum", [p.ref.one("Mul", [u, p.ref.one("MatMul", [m, v])])], keepdims=0)
        p.readouts(0, p.ref.one("Div", [w, sigma]), p.param(p.cand, after[0]), w_shape)

    @staticmethod
    def _consistent(w, u, v, dims) -> list[int]:
        """Among axes that both fit, the one where (u, v) is a power-iteration pair."""
        scores = {}
        for d in dims:
            m = spectral_matrix(w.astype(np.float64), d)
            scores[d] = max(_cosine(u.astype(np.float64), m @ v), _cosine(v.astype(np.float64), m.T @ u))
        best = max(scores, key=scores.get)
        others = [scores[d] for d in dims if d != best]
        # after training, the last optimizer step leaves (u, v) slightly off the pair
        # (cosine ≈ 0.998 seen with PyTorch), while the wrong axis scores far lower
        if scores[best] < DECIDE_ALIGNED or any(s > DECIDE_OTHER for s in others):
            raise ComputeError(
                f"axes {dims} both fit u and v and neither decides (alignment {scores}); "
                "set dim in the rule (1 for ConvTranspose, 0 otherwise)"
            )
        return [best]


# the MXNet operators a BatchNorm can be folded into, by the bn_fold layer each one is
_FOLDABLE_LAYERS = {"Convolution": ("conv", "auto"), "FullyConnected": ("linear", "conv", "auto"),
                    "Deconvolution": ("conv_transpose",)}


def _variable(name: str) -> str:
    """A params file's name as the symbol's variable: MXNet's ``arg:``/``aux:`` prefix dropped."""
    return name[4:] if name.startswith(("arg:", "aux:")) else name


@dataclasses.dataclass(frozen=True)
class NormFacts:
    """One BatchNorm node of an MXNet ``-symbol.json`` as a fold needs it: its ``gamma``
    variable, ``eps``, ``fix_gamma`` and ``axis``, and the operator whose output it normalizes
    (``layer_op``, ``layer_node``) with that operator's weight variable (None: it reads no
    variable, or the BatchNorm follows something that is no layer)."""

    node: str
    gamma: str
    eps: float
    fix_gamma: bool
    axis: int
    layer_node: str | None = None
    layer_op: str | None = None
    layer_weight: str | None = None


@dataclasses.dataclass(frozen=True)
class BatchNormFacts:
    """What an MXNet checkpoint says of its BatchNorms: ``params`` (the file), ``symbol`` (the
    ``-symbol.json`` beside it, None for a file without one: a ``save_parameters`` file) and
    its BatchNorm nodes. :meth:`resolve` turns a rule's ``bn_fold`` into one binding's.

    >>> facts = BatchNormFacts("m-0000.params", "m-symbol.json",
    ...                        (NormFacts("bn0_fwd", "bn0_gamma", 2e-5, True, 1, "conv0_fwd", "Convolution", "conv0_weight"),))
    >>> op = facts.resolve(BnFold(), ["arg:conv0_weight", None, "arg:bn0_gamma", "arg:bn0_beta", "aux:m", "aux:v"])
    >>> op.fix_gamma, op.eps, op.facts
    (True, 2e-05, None)
    """

    params: str
    symbol: str | None
    norms: tuple[NormFacts, ...] = ()

    def resolve(self, op: "BnFold", names: Sequence[str | None]) -> "BnFold":
        """``op`` for the binding ``names`` (weight, bias, gamma, beta, mean, var; None for an
        absent bias): fix_gamma and eps from the symbol, or as the rule writes them where
        there is none; PlanError when the file cannot say and the rule does not, or when the
        rule contradicts the graph."""
        weight, gamma = names[0], names[2]
        plain = dataclasses.replace(op, facts=None)
        if self.symbol is None:
            if op.fix_gamma in (None, "symbol"):
                raise PlanError(
                    f"{self.params} has no -symbol.json beside it (a save_parameters file), so nothing says "
                    f"whether MXNet uses {gamma!r}: write fix_gamma = true in the rule (gamma taken as 1: Gluon's "
                    "BatchNorm(scale=False), MXNet's default) or false (BatchNorm(scale=True)), with the layer's "
                    "eps (Gluon's default 1e-5) — presets gluon-bn-fold-scale and gluon-bn-fold-no-scale — or "
                    "export the net (HybridBlock.export) and fold PREFIX-0000.params with gluon-bn-fold")
            return plain
        norm = next((n for n in self.norms if n.gamma == _variable(gamma)), None)
        if norm is None:
            raise PlanError(f"no BatchNorm node of {self.symbol} reads {gamma!r} as its gamma; the rule binds "
                            "something else, or the symbol is not this file's")
        where = f"{self.symbol}: BatchNorm {norm.node!r}"
        if norm.layer_weight is None or norm.layer_op not in _FOLDABLE_LAYERS:
            raise PlanError(f"{where} normalizes the output of {norm.layer_node!r} ({norm.layer_op}), no "
                            f"Convolution, FullyConnected or Deconvolution reading a weight: it cannot be folded "
                            f"into {weight!r}")
        if norm.layer_weight != _variable(weight):
            raise PlanError(f"{where} normalizes the output of {norm.layer_node!r}, whose weight is "
                            f"{norm.layer_weight!r}, not {weight!r}: the names pair the wrong layers; fold it with a "
                            "rule naming that weight")
        if op.layer not in _FOLDABLE_LAYERS[norm.layer_op]:
            raise PlanError(f"{where} follows a {norm.layer_op}; a bn_fold with layer = {op.layer!r} would fold "
                            f"it wrongly (use layer = {_FOLDABLE_LAYERS[norm.layer_op][0]!r})")
        if norm.axis != 1:
            raise PlanError(f"{where} normalizes axis {norm.axis}; bn_fold folds the channels of axis 1 (NCHW) only")
        if op.fix_gamma in (None, "symbol"):
            if op.eps != BnFold.eps and not math.isclose(op.eps, norm.eps, rel_tol=1e-6):
                raise PlanError(f"the rule writes eps = {op.eps} but {where} has eps {norm.eps}; MXNet computes with "
                                "the symbol's: leave eps out of the rule")
            return dataclasses.replace(plain, eps=norm.eps, fix_gamma=norm.fix_gamma)
        if op.fix_gamma != norm.fix_gamma or not math.isclose(op.eps, norm.eps, rel_tol=1e-6):
            raise PlanError(f"the rule writes fix_gamma = {str(op.fix_gamma).lower()}, eps = {op.eps} but {where} has "
                            f"fix_gamma {str(norm.fix_gamma).lower()}, eps {norm.eps}; MXNet computes with the symbol's: write "
                            "fix_gamma = \"symbol\" (and no eps), or use preset gluon-bn-fold")
        return plain


@dataclasses.dataclass(frozen=True)
class BnFold(Op):
    """Fold BatchNorm into the preceding conv / linear / conv_transpose layer.

    s = gamma / sqrt(var + eps); a conv's or linear's weight is scaled per output channel (axis 0),
    a ConvTranspose's per output channel of each group (axis 1); b' = (b − mean) · s + beta, a
    missing bias being zeros. Computed in float32 (float64 for float64), cast back.

    Rule keys: ``op = "bn_fold"``; inputs ``weight``, ``bias`` (optional), ``gamma``, ``beta``,
    ``mean``, ``var`` (a BatchNorm's ``weight``, ``bias``, ``running_mean``, ``running_var``);
    outputs ``output_weight``, ``output_bias``; ``eps`` (default 1e-5), ``layer`` (default
    ``"conv"``; ``"linear"``, ``"conv_transpose"`` or ``"auto"``), ``groups`` (default 1, for
    conv_transpose). Only ``mean`` and ``var`` find a rule's bindings, so a layer without a
    BatchNorm after it is left alone. Refuses tensors that are not floating point, an unknown
    layer, a weight of the wrong rank, statistics whose length is not the layer's output channels,
    and, when the step runs, var + eps that is not positive. Inverse: none (one-way).

    ``fix_gamma``: ``false`` uses the file's gamma (PyTorch, Gluon's ``BatchNorm(scale=True)``);
    ``true`` takes gamma as 1 whatever the file holds (MXNet's ``fix_gamma``, the operator's
    default and Gluon's ``scale=False``: the file keeps a gamma MXNet ignores); ``"symbol"``
    reads ``fix_gamma`` and ``eps`` of the BatchNorm node that reads ``gamma`` from the MXNet
    ``-symbol.json`` beside the file (refused without one). Left out, it is ``false`` for a
    checkpoint that is no MXNet file, ``"symbol"`` for an MXNet export, and refused for an MXNet
    file without a symbol (a ``save_parameters`` file does not say). With a symbol, every
    binding is checked against the graph (:class:`BatchNormFacts`): the BatchNorm must read the
    output of the layer whose weight the rule names, and a ``fix_gamma`` or ``eps`` written in
    the rule must be the symbol's.

    ``layer = "auto"`` reads the layer from the weight's rank: 2 is a linear (out, in), 3 or
    more a conv (out, in/groups, k...). A ConvTranspose weight (in, out/groups, k...) has the
    same rank as a Conv's, and when in and out channels are equal nothing in the shapes tells
    them apart, so a ConvTranspose must still say ``layer = "conv_transpose"``. A rule's step
    records the layer it resolved to.

    >>> op = BnFold(layer="linear", eps=1.0)
    >>> w, b = op.apply([np.array([[1.0, 2.0]]), np.array([3.0]), np.array([4.0]), np.array([0.5]),
    ...                  np.array([1.0]), np.array([3.0])])
    >>> w.tolist(), b.tolist()
    ([[2.0, 4.0]], [4.5])

    Rule::

        [[rule]]
        op            = "bn_fold"
        weight        = "{p*}.conv1.weight"
        gamma         = "{p*}.bn1.weight"
        beta          = "{p*}.bn1.bias"
        mean          = "{p*}.bn1.running_mean"
        var           = "{p*}.bn1.running_var"
        output_weight = "{p*}.conv1.weight"
        output_bias   = "{p*}.conv1.bias"
    """

    kind: ClassVar[str] = "bn_fold"
    probed: ClassVar[bool] = True
    exact: ClassVar[bool] = False
    graph_foldable: ClassVar[bool] = True
    named_inputs: ClassVar[tuple[str, ...]] = ("weight", "bias", "gamma", "beta", "mean", "var")
    named_outputs: ClassVar[tuple[str, ...]] = ("output_weight", "output_bias")
    optional_inputs: ClassVar[frozenset[int]] = frozenset({1})
    binding_inputs: ClassVar[tuple[str, ...]] = ("mean", "var")
    layers: ClassVar[tuple[str, ...]] = ("auto", "conv", "linear", "conv_transpose")
    eps: float = 1e-5
    layer: str = "conv"
    groups: int = 1
    has_bias: bool = True
    fix_gamma: bool | str | None = None  # None: not written (see the class docstring)
    facts: BatchNormFacts | None = None  # what the checkpoint says of its BatchNorms (MXNet)

    def fold_in_graph(self, rewriter, step, values):
        rewriter.fold_batchnorm(step, values)

    def params(self) -> dict:
        """The parameters a plan and a provenance record: ``facts`` never (a step's op has
        resolved them), ``fix_gamma`` once written or resolved."""
        params = super().params()
        del params["facts"]
        if self.fix_gamma is None:
            del params["fix_gamma"]
        return params

    def for_names(self, names: Sequence[str | None]) -> "BnFold":
        """The op for one binding (``names``: the inputs in role order, None for an absent
        bias): ``fix_gamma`` and ``eps`` resolved from the checkpoint's :attr:`facts`."""
        if self.facts is not None:
            return self.facts.resolve(self, names)
        if self.fix_gamma == "symbol":
            raise PlanError(f"fix_gamma = \"symbol\" reads MXNet's -symbol.json, and {names[2]!r} is no MXNet "
                            "file's; write fix_gamma = true (gamma taken as 1) or false (gamma used)")
        return self

    def _fixed_gamma(self) -> bool:
        if self.fix_gamma not in (None, True, False):
            raise PlanError(f"bn_fold: fix_gamma = {self.fix_gamma!r} is unresolved; use true, false or \"symbol\" "
                            "on an MXNet export")
        return self.fix_gamma is True

    def for_present(self, present):
        """``present`` holds each input's TensorSpec (or a truthy flag), None/False when absent;
        given the weight's spec, ``layer = "auto"`` is resolved so the step names its layer."""
        op = dataclasses.replace(self, has_bias=bool(present[1]))
        weight = present[0]
        if self.layer == "auto" and isinstance(weight, TensorSpec):
            layer = _layer_from_rank(len(weight.shape))
            if layer is not None:
                op = dataclasses.replace(op, layer=layer)
        return op

    def input_roles(self):
        return tuple(r for r in self.named_inputs if r != "bias" or self.has_bias)

    def _split(self, items):
        items = list(items)
        if not self.has_bias:
            items.insert(1, None)
        return items

    def _channels(self, w: Sequence[int], name: str) -> int:
        if self.layer not in self.layers:
            raise PlanError(f"bn_fold: layer = {self.layer!r}; use \"auto\", \"conv\", \"linear\" or \"conv_transpose\"")
        layer = self.layer
        if layer == "auto":
            layer = _layer_from_rank(len(w))
            if layer is None:
                raise PlanError(f"{name!r} has shape {list(w)}; layer = \"auto\" needs a linear weight "
                                "(out, in) or a conv weight (out, in, k...)")
        if layer == "linear" and len(w) != 2:
            raise PlanError(f"{name!r} has shape {list(w)}; a linear weight is (out, in)")
        if len(w) < 2:
            raise PlanError(f"{name!r} has shape {list(w)}; a conv weight has at least 2 dimensions")
        if layer == "conv_transpose":
            if self.groups <= 0 or w[0] % self.groups:
                raise PlanError(f"{name!r}: {w[0]} input channels do not split into {self.groups} groups")
            return w[1] * self.groups
        return w[0]

    def infer(self, specs, names):
        specs, names = self._split(specs), self._split(names)
        present = [(s, n) for s, n in zip(specs, names) if s is not None]
        _check_float([s for s, _ in present], [n for _, n in present], "bn_fold")
        self._fixed_gamma()
        # whoever gave eps (the rule, an MXNet symbol, a provenance): an infinite one zeroes the layer
        if type(self.eps) not in (int, float) or not (math.isfinite(self.eps) and self.eps >= 0):
            raise PlanError(f"bn_fold: eps = {self.eps!r}; BatchNorm's eps is a finite number ≥ 0 (PyTorch's "
                            "default 1e-5)")
        w = specs[0]
        channels = self._channels(w.shape, names[0])
        for spec, name in zip(specs[1:], names[1:]):
            if spec is not None and spec.shape != (channels,):
                hint = ""
                if self.layer == "conv" and len(w.shape) >= 3 and spec.shape == (w.shape[1],):
                    hint = (f"; if {names[0]!r} is a ConvTranspose (its output channels are axis 1), "
                            "write a bn_fold rule with layer = \"conv_transpose\"")
                raise PlanError(f"{name!r} has shape {list(spec.shape)}; {names[0]!r} has {channels} output "
                                f"channels as a {self.layer} weight{hint}")
        bias_dtype = specs[1].dtype if specs[1] is not None else w.dtype
        return [w, TensorSpec(bias_dtype, (channels,))]

    def apply(self, arrays):
        w, b, gamma, beta, mean, var = self._split(arrays)
        ct = compute_dtype_of(w.dtype)
        wc = w.astype(ct)
        if self._fixed_gamma():  # MXNet's fix_gamma: what the file holds is not what it computes with
            gamma = np.ones_like(gamma)
        gamma, beta, mean, var = (a.astype(ct) for a in (gamma, beta, mean, var))
        bc = b.astype(ct) if b is not None else np.zeros_like(mean)
        denominator = var + ct.type(self.eps)
        if not np.all(denominator > 0):
            raise ComputeError(f"var + eps is not positive for {int(np.sum(~(denominator > 0)))} channel(s)")
        scale = gamma / np.sqrt(denominator)
        folded = (wc * self._per_element(scale, w.shape)).astype(w.dtype)
        bias = (bc - mean) * scale + beta
        self._check_no_channel_vanished(w, gamma, folded)
        return [folded, bias.astype(b.dtype if b is not None else w.dtype)]

    def _output_channel(self, shape: Sequence[int]) -> np.ndarray:
        """The output channel of each (axis 0, axis 1) position of a weight of ``shape``: its
        row for a conv or linear, for a ConvTranspose (i // (Cin/groups)) · (Cout/groups) + j."""
        if self.layer == "conv_transpose":
            cin_g, cout_g = shape[0] // self.groups, shape[1]
            i, j = np.meshgrid(np.arange(shape[0]), np.arange(cout_g), indexing="ij")
            return (i // cin_g) * cout_g + j
        return np.broadcast_to(np.arange(shape[0])[:, None], (shape[0], shape[1]))

    def _per_element(self, per_channel: np.ndarray, shape: Sequence[int]) -> np.ndarray:
        """``per_channel`` (one value per output channel) laid out to broadcast over a weight of ``shape``."""
        per = per_channel[self._output_channel(shape)]
        return per.reshape(per.shape + (1,) * (len(shape) - 2))

    def _check_no_channel_vanished(self, w: np.ndarray, gamma: np.ndarray, folded: np.ndarray) -> None:
        """ComputeError when the fold turns an output channel whose weights and gamma are not
        zero into all zeros: its scale gamma / sqrt(var + eps) underflowed the stored dtype (a
        huge eps or variance), which would silently make the layer a constant."""
        channels = self._output_channel(w.shape).reshape(-1)
        axes = tuple(range(2, w.ndim))
        had = np.zeros(gamma.shape, bool)
        kept = np.zeros(gamma.shape, bool)
        np.logical_or.at(had, channels, np.any(w != 0, axis=axes).reshape(-1))
        np.logical_or.at(kept, channels, np.any(folded != 0, axis=axes).reshape(-1))
        vanished = had & (gamma != 0) & ~kept
        if np.any(vanished):
            raise ComputeError(f"{int(np.sum(vanished))} output channel(s) (first: {int(np.argmax(vanished))}) become "
                               f"all zeros: gamma / sqrt(var + eps) underflows {folded.dtype} (eps = {self.eps}); "
                               "check eps and the running variance")

    def probe(self, p, before, after, input_specs, output_specs):
        """The layer followed by ONNX's BatchNormalization beside the folded layer alone, on a
        random input ``x`` of the layer's shape."""
        w, bias, gamma, beta, mean, var = self._split(before)
        if self._fixed_gamma():
            gamma = np.ones_like(gamma)
        w_shape = input_specs[0].shape
        if self.layer == "linear":
            x_shape = [2, w_shape[1]]
            layer, attrs = "Gemm", {"transB": 1}
        elif self.layer == "conv":
            x_shape = [1, w_shape[1]] + [k + 2 for k in w_shape[2:]]
            layer, attrs = "Conv", {}
        else:
            x_shape = [1, w_shape[0]] + [3] * (len(w_shape) - 2)
            layer, attrs = "ConvTranspose", {"group": self.groups}
        x = p.input("x", x_shape)
        ref, cand = p.ref, p.cand
        y = ref.one(layer, [x, p.param(ref, w)] + ([p.param(ref, bias)] if bias is not None else []), **attrs)
        y = ref.one("BatchNormalization", [y] + [p.param(ref, a) for a in (gamma, beta, mean, var)],
                    epsilon=self.eps)
        folded_w, folded_b = after
        p.output("y", y, cand.one(layer, [x, p.param(cand, folded_w), p.param(cand, folded_b)], **attrs))


def _f32(array: np.ndarray) -> np.ndarray:
    return np.asarray(array).astype(np.float32)


def _layer_from_rank(rank: int) -> str | None:
    """bn_fold's ``layer = "auto"``: 2 dimensions are a linear layer, 3 or more a conv."""
    return "linear" if rank == 2 else "conv" if rank >= 3 else None


REPARAM_OPS: tuple[type[Op], ...] = (WeightNormFold, WeightNormUnfold, SpectralNormFold, BnFold)
