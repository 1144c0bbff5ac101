"""Initializers two graphs hold alike, mapped once and handed to both onnxruntime sessions.

``verify A.onnx B.onnx`` of a graph against its fused export runs two sessions whose weights are
mostly the same bytes under the same names (MXNet's ``simple_bind`` shares parameter memory by
name for the same reason). An initializer is shared when both main graphs hold it under one name,
with one dtype and one shape, in external data, and its bytes are equal (compared in full, file
range against file range: never a hash, never a guess). The reference's bytes are then mapped
read-only and given to both sessions (onnxruntime's ``SessionOptions.add_initializer``): the
page cache holds them once and neither session makes its own copy.

Nothing else is shared: an initializer inside the model file (onnxruntime parses the whole file
for each session anyway, so a copy of its bytes would not lower the peak), one that differs in a
single byte, dtype or dimension, one whose name a subgraph of either model also defines (a name
onnxruntime would override there too), a dtype numpy cannot hand over as is (bfloat16, fp8,
4-bit), one whose offset does not align to its element size, and an empty one.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field

import numpy as np

from ..errors import CheckpointError
from ..io.formats.onnx_file import load_model
from ..tensors import ByteRange
from .byte_ranges import RangeComparer

# the element types an OrtValue takes straight from a numpy array
_SHAREABLE = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.float16, np.int64, np.int32, np.int16,
                                             np.int8, np.uint8, np.uint16, np.uint32, np.uint64, np.bool_))


@dataclass
class SharedInitializers:
    """Read-only views of the reference's external data, by initializer name, for both sessions.

    The views keep their file mappings open: keep this object for as long as the sessions run.

    >>> SharedInitializers().to_json()
    {'count': 0, 'bytes': 0}
    """

    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """The bytes loaded once instead of twice."""
        return sum(a.nbytes for a in self.arrays.values())

    def to_json(self) -> dict:
        """``{"count": initializers shared, "bytes": their bytes}`` (the report's ``shared_initializers``)."""
        return {"count": len(self.arrays), "bytes": self.nbytes}


@dataclass(frozen=True)
class _External:
    """A main-graph initializer stored in external data: its numpy dtype, shape and file range."""

    dtype: np.dtype
    shape: tuple[int, ...]
    where: ByteRange


def _externals(path: str) -> tuple[dict[str, _External], set[str]]:
    """The main graph's initializers in external data, and every name a subgraph defines (its
    initializers and node outputs, Constants included: onnxruntime makes those initializers too)."""
    import onnx_ir as ir

    model = load_model(path)  # every location checked: inside the model's folder, bytes there
    externals: dict[str, _External] = {}
    for name, value in model.graph.initializers.items():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor):
            try:
                dtype = np.dtype(tensor.dtype.numpy())
            except (TypeError, ValueError):  # a type numpy has no dtype for: not shared
                continue
            shape = tuple(int(d) for d in tensor.shape)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            externals[name] = _External(dtype, shape, ByteRange(str(tensor.path), int(tensor.offset or 0), nbytes))
    inner: set[str] = set()
    for graph in model.graphs():
        if graph is not model.graph:
            inner.update(graph.initializers)
            inner.update(v.name for node in graph for v in node.outputs if v.name)
    return externals, inner


def _shareable(a: _External, b: _External) -> bool:
    """Same dtype and shape, a dtype numpy hands over as is, aligned, not empty."""
    return (a.dtype == b.dtype and a.shape == b.shape and a.dtype in _SHAREABLE and a.where.length > 0
            and a.where.offset % a.dtype.itemsize == 0)


def find_shared(reference: str, candidate: str) -> SharedInitializers:
    """The initializers ``reference`` and ``candidate`` hold alike (see the module's docstring),
    as read-only views of the reference's external data files.

    A model onnx-ir cannot read shares nothing (onnxruntime may still run it). Raises
    CheckpointError when a data file shrinks while it is read.
    """
    try:
        (ref, ref_inner), (cand, cand_inner) = _externals(reference), _externals(candidate)
    except CheckpointError:
        return SharedInitializers()
    names = [n for n in ref if n in cand and n not in ref_inner | cand_inner and _shareable(ref[n], cand[n])]
    comparer = RangeComparer()
    try:
        equal = [n for n in names if comparer.equal([ref[n].where], [cand[n].where])]
    finally:
        comparer.close()
    maps: dict[str, mmap.mmap] = {}
    arrays = {}
    for name in equal:
        where = ref[name].where
        if where.path not in maps:
            with open(where.path, "rb") as f:
                maps[where.path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        mapped = maps[where.path]
        if where.offset + where.length > len(mapped):  # changed since it was compared
            raise CheckpointError(f"{where.path}: shorter than the {where.offset + where.length} bytes "
                                  "it held a moment ago; the file changed while verify was reading it")
        count = where.length // ref[name].dtype.itemsize
        arrays[name] = np.frombuffer(mapped, ref[name].dtype, count, where.offset).reshape(ref[name].shape)
    return SharedInitializers(arrays)

