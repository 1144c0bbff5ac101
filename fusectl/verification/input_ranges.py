"""The values a random integer input of a graph may take, read from the graph itself.

An integer input that a Gather uses as indices (token ids into an embedding) is only checked
when its random values reach across the table: ids 0 and 1 alone leave every other row of a
fused embedding unexercised. So each integer input is followed through the ops that pass its
values on unchanged (Cast to another integer type, Unsqueeze, Reshape, ...) to the Gathers that
index with it; the smallest table size found, on the axis gathered, bounds it. An input that
feeds only arithmetic, comparisons or Where (an attention mask) keeps [0, 1]; so does one that
reaches an op whose valid values cannot be told (a shape, a count, a Gather of a table whose
size the graph does not declare): a value out of its range would make onnxruntime fail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from ..errors import printable, quote


@dataclass(frozen=True)
class IntegerRange:
    """Random values from ``low`` to ``high`` (both included), and why (``reason``)."""

    low: int
    high: int
    reason: str

    def to_json(self) -> list[int]:
        """``[low, high]``, as a report's ``range`` lists it."""
        return [self.low, self.high]


DEFAULT_REASON = "the default"
DEFAULT = IntegerRange(0, 1, DEFAULT_REASON)

# ops whose output holds the elements of this input (indices 0 only: a Reshape's shape, an
# Unsqueeze's axes or a Slice's starts are sizes, not values passed on)
_PASS_ON = frozenset({"Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Expand", "Transpose",
                      "Slice", "Tile", "Split", "Gather"})
# ops for which any value is valid (arithmetic, comparisons, Where, the shape of it): a larger
# value cannot make them fail; what they compute is not followed further
_ANY_VALUE = frozenset({
    "Add", "Sub", "Mul", "Div", "Mod", "Pow", "Neg", "Abs", "Sign", "Max", "Min", "Sum", "Mean", "Clip",
    "MatMul", "CumSum", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or",
    "Xor", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", "Where", "Shape", "Size", "NonZero",
    "ArgMax", "ArgMin", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceMean", "ReduceProd",
})
# of those, the ops whose other inputs are axes: the values count only as their data (input 0)
_DATA_ONLY = frozenset({"CumSum", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceMean", "ReduceProd"})


@dataclass(frozen=True)
class _Found:
    """What one graph tells about one input: the Gathers it indexes, the uses that forbid a range."""

    gathers: tuple[tuple[int, str, int, int], ...]  # (largest valid value, table name, size, cap)
    unknown: tuple[str, ...]  # op types whose valid values cannot be told


def integer_input_ranges(models: Sequence, names: Iterable[str]) -> dict[str, IntegerRange]:
    """For each input of ``names``, the range its random values take, from every graph of
    ``models`` (onnx-ir models that are fed the same inputs: the smallest bound wins).

    >>> import onnx, onnx.parser, onnx_ir as ir
    >>> text = '''<ir_version: 8, opset_import: ["" : 17]>
    ... g (int64[2] ids) => (float[2, 2] y) <float[5, 2] emb = {0., 1., 2., 3., 4., 5., 6., 7., 8., 9.}> {
    ...     y = Gather(emb, ids)
    ... }'''
    >>> integer_input_ranges([ir.from_proto(onnx.parser.parse_model(text))], ["ids"])
    {'ids': IntegerRange(low=0, high=4, reason="Gather of 'emb', 5 rows")}
    """
    ranges = {}
    for name in names:
        found = [f for f in (_follow(model, name) for model in models) if f is not None]
        unknown = sorted({printable(op) for f in found for op in f.unknown})
        gathers = sorted(g for f in found for g in f.gathers)
        if unknown:
            ranges[name] = IntegerRange(0, 1, f"{DEFAULT_REASON}: it feeds {', '.join(unknown)}, "
                                              "whose valid values verify cannot tell")
        elif not gathers:
            ranges[name] = IntegerRange(0, 1, f"{DEFAULT_REASON}: no Gather indexes with it")
        else:
            high, table, size, cap = gathers[0]  # the smallest
            reason = f"Gather of {quote(table)}, {size} rows"
            if cap < size - 1:
                reason += f"; {cap} is the largest value of the integer type on the way"
            ranges[name] = IntegerRange(0, high, reason)
    return ranges


def _follow(model, name: str) -> _Found | None:
    """Follow graph input ``name`` of ``model`` to every use of its values; None if no such input."""
    import onnx_ir as ir

    start = next((v for v in model.graph.inputs if v.name == name), None)
    if start is None or start.dtype is None or not start.dtype.is_integer():
        return None
    gathers, unknown = [], []
    todo, seen = [(start, start.dtype.max)], set()
    while todo:
        value, cap = todo.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        for node, index in value.uses():
            op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
            if op == "Gather" and index == 1:
                size = _gathered_size(node)
                if size is None:
                    unknown.append("a Gather of a table of unknown size")
                else:
                    gathers.append((min(size - 1, cap), node.inputs[0].name or "an unnamed tensor", size, cap))
            elif op == "Cast":
                target = _cast_target(ir, node)
                if target is None:
                    unknown.append(op)
                elif target.is_integer():
                    todo += [(out, min(cap, target.max)) for out in node.outputs]
                # cast to float or bool: arithmetic from here on
            elif op in _PASS_ON and index == 0:
                todo += [(out, cap) for out in node.outputs]
            elif op in _ANY_VALUE and (op not in _DATA_ONLY or index == 0):
                continue
            else:
                unknown.append(op)
    return _Found(tuple(gathers), tuple(sorted(set(unknown))))


def _cast_target(ir, node):
    """The type a Cast converts to, or None where the node does not say one."""
    try:
        return ir.DataType(node.attributes["to"].value)
    except (KeyError, ValueError, TypeError):
        return None


def _gathered_size(node) -> int | None:
    """The size of the axis a Gather indexes in its data, where the graph says it, else None."""
    data = node.inputs[0]
    if data is None:
        return None
    tensor = data.const_value
    producer = data.producer()
    if tensor is None and producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
        tensor = producer.attributes["value"].value
    shape = tensor.shape if tensor is not None else data.shape
    if shape is None:
        return None
    axis = node.attributes["axis"].value if "axis" in node.attributes else 0
    axis = axis + len(shape) if axis < 0 else axis
    if not 0 <= axis < len(shape):
        return None
    size = shape[axis]
    return size if isinstance(size, int) and size > 0 else None

