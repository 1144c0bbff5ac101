"""Every tensor an ONNX model holds, checked before onnx-ir or onnxruntime reads any of it.

A model file is untrusted: its TensorProtos may claim negative or absurd dims, hold fewer
values than their dims need (onnx-ir fills a tensor without data with zeros), keep values in a
field their dtype does not use, or point their external data at names no file has, offsets
that are not numbers, or bytes past a file's end. :func:`check_tensor_protos` walks the parsed
(not yet loaded) model — initializers, sparse initializers, node attributes, subgraphs and
functions — and refuses the first such tensor with a CheckpointError naming the model and the
tensor; what it accepts has dims that are whole numbers, embedded data of exactly their size
and external data inside the model's folder that holds exactly their bytes.
"""

from __future__ import annotations

import math
import os
import re
import stat

from ...errors import CheckpointError, printable, quote
from ..untrusted import is_generated
from ...limits import check_limit

# ONNX keeps sizes, offsets and lengths in int64
_INT64_MAX = 2**63 - 1
_BYTE_COUNT = re.compile(r"[0-9]{1,19}")
# the field TensorProto keeps a dtype's values in when not in raw_data (the ONNX spec's table),
# by dtype name; every other dtype keeps them in int32_data
_VALUE_FIELDS = {"FLOAT": "float_data", "COMPLEX64": "float_data", "DOUBLE": "double_data",
                 "COMPLEX128": "double_data", "INT64": "int64_data", "UINT32": "uint64_data",
                 "UINT64": "uint64_data", "STRING": "string_data"}
# the keys of an external tensor's ``external_data`` (the ones onnxruntime reads)
_EXTERNAL_KEYS = {"location", "offset", "length", "checksum"}
_ALL_VALUE_FIELDS = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")


def tensor_protos(model):
    """(label, TensorProto) for every tensor of a ModelProto, wherever the model keeps it; the
    label names it for a message (``tensor 'w'``, or the node holding an unnamed one)."""
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        for node in function.node:
            yield from _node_tensors(node)


def _graph_tensors(graph):
    for tensor in graph.initializer:
        yield _label(tensor), tensor
    for sparse in graph.sparse_initializer:
        yield from _sparse_tensors(sparse)
    for node in graph.node:
        yield from _node_tensors(node)


def _node_tensors(node):
    owner = f"node {quote(node.name or node.op_type)}"
    for attr in node.attribute:
        place = f"attribute {quote(attr.name)} of {owner}"
        if attr.HasField("t"):
            yield _label(attr.t, place), attr.t
        for tensor in attr.tensors:
            yield _label(tensor, place), tensor
        if attr.HasField("sparse_tensor"):
            yield from _sparse_tensors(attr.sparse_tensor, place)
        for sparse in attr.sparse_tensors:
            yield from _sparse_tensors(sparse, place)
        if attr.HasField("g"):
            yield from _graph_tensors(attr.g)
        for graph in attr.graphs:
            yield from _graph_tensors(graph)


def _sparse_tensors(sparse, place: str = ""):
    values = _label(sparse.values, place)
    yield values, sparse.values
    yield f"the indices of sparse {values}", sparse.indices


def _label(tensor, place: str = "") -> str:
    if tensor.name:
        return f"tensor {quote(tensor.name)}"
    return f"the tensor of {place}" if place else "an unnamed tensor"


def check_tensor_protos(path: str, model) -> list[str]:
    """Check every tensor of the ModelProto ``model`` read from ``path`` (external data not
    loaded); return the external data files they read, resolved, in first-use order.

    CheckpointError naming the model and the tensor for: a negative dimension, more dims than
    the ``dims`` budget, a size past 2**63 bytes, embedded values that are not exactly what the
    dims need, and external data whose location is not a regular file inside the model's folder
    (links resolved), whose offset or length is not a whole number, or whose bytes are not
    exactly the tensor's or run past the file's end.
    """
    from onnx import TensorProto

    folder = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    files: dict[str, None] = {}  # an ordered set
    for label, tensor in tensor_protos(model):
        where = f"{printable(path)}: {label}"
        nbytes = _checked_size(where, tensor)
        if tensor.data_location == TensorProto.EXTERNAL:
            entries = {entry.key: entry.value for entry in tensor.external_data}
            unknown = sorted(set(entries) - _EXTERNAL_KEYS)
            if unknown:  # onnxruntime refuses the model ("model format error"), onnx-ir warns
                raise CheckpointError(f"{where}: its external data has the key {quote(unknown[0])}, which ONNX "
                                      f"does not define (only {', '.join(sorted(_EXTERNAL_KEYS))}); the model is "
                                      "corrupt: re-export it")
            target = check_location(path, folder, label, entries.get("location", ""),
                                    entries.get("offset", "0"), entries.get("length"),
                                    nbytes, f"shape {list(tensor.dims)} of {_dtype_name(tensor)}")
            files[target] = None
        else:
            _check_embedded(where, tensor, nbytes)
    return list(files)


def _dtype_name(tensor) -> str | None:
    from onnx import TensorProto

    try:
        return TensorProto.DataType.Name(tensor.data_type)
    except ValueError:
        return None  # not an ONNX dtype: onnx-ir refuses the model when it loads it


def _checked_size(where: str, tensor) -> int | None:
    """The bytes the tensor's dims need (None for strings and unknown dtypes); CheckpointError
    for dims that are negative, too many, or too large to be stored."""
    dims = list(tensor.dims)
    if len(dims) > 8:  # a message shows a few dims, the count of the rest
        shown = f"[{', '.join(map(str, dims[:8]))}, … ({len(dims)} dims)]"
    else:
        shown = str(dims)
    check_limit("dims", len(dims), where)
    if any(d < 0 for d in dims):
        raise CheckpointError(f"{where}: shape {shown} has a negative dimension; dims must be whole numbers "
                              "(the model is corrupt: re-export it)")
    name = _dtype_name(tensor)
    bits = _bitwidth(where, name)
    # numpy refuses an array whose nonzero dims multiply past its address space, even when
    # another dim is 0: each is counted
    size = (bits or 8) * math.prod(max(d, 1) for d in dims)
    if size > 8 * _INT64_MAX:
        raise CheckpointError(f"{where}: shape {shown} of {name} is too large to be stored (past 2**63 bytes); "
                              "the model is corrupt")
    if bits is None:
        return None
    return (bits * math.prod(dims) + 7) // 8


def _bitwidth(where: str, name: str | None) -> int | None:
    """The bits of one element of the ONNX dtype ``name`` (None for strings and unknown dtypes);
    CheckpointError for a dtype the installed onnx knows and onnx-ir does not (onnx 1.23 added
    INT2, which onnx-ir 0.1 cannot read)."""
    import onnx_ir as ir

    if name is None or name in ("STRING", "UNDEFINED"):
        return None
    try:
        return ir.DataType[name].bitwidth
    except KeyError:
        raise CheckpointError(f"{where}: its dtype {name} is one onnx-ir {ir.__version__} does not know; "
                              "upgrade onnx-ir (pip install -U onnx-ir) to read it") from None


def _check_embedded(where: str, tensor, nbytes: int | None) -> None:
    """The values stored inside the model must be exactly what the dims need, in the one field
    the dtype uses (onnx-ir would fill a tensor without values with zeros, and asserts on a
    field its dtype does not use)."""
    name = _dtype_name(tensor)
    if name is None or name == "UNDEFINED":
        return
    numel = math.prod(tensor.dims)
    if tensor.HasField("raw_data"):
        if nbytes is not None:
            held = len(tensor.raw_data)  # a copy (protobuf has no view), freed at once
            if held != nbytes:
                raise CheckpointError(f"{where}: holds {held} bytes of data, but shape {list(tensor.dims)} of "
                                      f"{name} needs {nbytes}; the model is corrupt")
        return
    field = _VALUE_FIELDS.get(name, "int32_data")
    used = [f for f in _ALL_VALUE_FIELDS if f != field and len(getattr(tensor, f))]
    if used:
        raise CheckpointError(f"{where}: keeps its values in {used[0]}, which ONNX does not use for {name} "
                              f"(it uses {field} or raw_data); the model is corrupt")
    held = len(getattr(tensor, field))
    bits = _bitwidth(where, name)
    if name.startswith("COMPLEX"):
        need = 2 * numel  # real and imaginary parts
    elif field == "int32_data" and bits in (2, 4):
        need = -(-numel * bits // 8)  # 2- and 4-bit values are packed, a byte's worth per entry
    else:
        need = numel
    if held != need:
        raise CheckpointError(f"{where}: holds {held} values in {field}, but shape {list(tensor.dims)} of {name} "
                              f"needs {need}; the model is corrupt")


def check_location(path: str, folder: str, label: str, location: str, offset_text: str,
                   length_text: str | None, nbytes: int | None, shape: str = "its shape") -> str:
    """The resolved file of one external tensor; CheckpointError unless it is a regular file
    inside the model's ``folder`` that holds the tensor's ``nbytes`` (when known; ``shape``
    says what needs them) at ``offset``, and ``length``, when given, is that many."""
    where = f"{printable(path)}: {label} keeps its data in {quote(location)}"
    if not location:
        raise CheckpointError(f"{printable(path)}: {label} is marked external but names "
                              "no location; re-export the model")
    if "\0" in location:
        raise CheckpointError(f"{where}, a name with a NUL byte, which no file can have; the model is "
                              "corrupt: re-export it")
    if os.path.isabs(location) or os.path.splitdrive(location)[0]:
        raise CheckpointError(f"{where}, an absolute path; external data must lie in the model's folder "
                              f"{printable(folder)}: move it there and give a relative location")
    target = os.path.realpath(os.path.join(folder, location))
    if not target.startswith(folder + os.sep):
        raise CheckpointError(f"{where}, outside the model's folder {printable(folder)}; external data must "
                              "lie in that folder (links resolved): move it there and fix the location")
    try:
        info = os.stat(target)
    except OSError:
        raise CheckpointError(f"{where}, which does not exist; put the file beside the model") from None
    if not stat.S_ISREG(info.st_mode) or is_generated(target):
        raise CheckpointError(f"{where}, which is not a regular file; external data must be a plain file")
    texts = [offset_text] + ([length_text] if length_text is not None else [])
    if not all(_BYTE_COUNT.fullmatch(t) and int(t) <= _INT64_MAX for t in texts):
        raise CheckpointError(f"{where} with offset {_short(offset_text)} and length {_short(length_text or '')}, "
                              "not whole numbers from 0 to 2**63-1; re-export the model")
    offset = int(offset_text)
    if length_text is not None and nbytes is not None and int(length_text) != nbytes:
        raise CheckpointError(f"{where} with length {int(length_text)}, but {shape} needs {nbytes} bytes; "
                              "the model is corrupt")
    length = int(length_text) if length_text is not None else nbytes
    if length is None:
        length = max(info.st_size - offset, 0)
    if offset + length > info.st_size:
        raise CheckpointError(f"{where} at bytes {offset}..{offset + length}, past the file's end "
                              f"({info.st_size} bytes); the file is truncated or not this model's")
    return target


def _short(text: str) -> str:
    return quote(text if len(text) <= 40 else text[:37] + "...")
