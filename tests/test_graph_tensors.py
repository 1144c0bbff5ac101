"""Every tensor an ONNX graph holds as data (onnx/graph_tensors.py): initializers and numeric
Constants of the main graph and of If/Loop bodies at any depth, each keyed uniquely (a reused
name suffixed #2), with where it lies, its dtype, shape and data; strings, references and
initializers without data are not weights and are left out."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from fusectl.onnx.graph_tensors import MAIN_GRAPH, graph_tensors, tensor_views


def constant(name: str, **attrs) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=f"make_{name}", **attrs)


def branch(name: str, out: str, weight: np.ndarray) -> onnx.GraphProto:
    """A branch holding initializer ``w`` (the same name in each) and a Constant ``c``."""
    return helper.make_graph(
        [constant("c", value=numpy_helper.from_array(np.array([7.0], np.float32))),
         helper.make_node("Add", ["w", "c"], [out])],
        name, [], [helper.make_tensor_value_info(out, TensorProto.FLOAT, [2])],
        initializer=[numpy_helper.from_array(weight, "w")])


def model_with_branches() -> ir.Model:
    nodes = [
        constant("k_value", value=numpy_helper.from_array(np.arange(6, dtype=np.float16).reshape(2, 3))),
        constant("k_float", value_float=1.5),
        constant("k_floats", value_floats=[1.0, 2.0]),
        constant("k_int", value_int=3),
        constant("k_ints", value_ints=[4, 5, 6]),
        constant("k_string", value=helper.make_tensor("s", TensorProto.STRING, [1], [b"hi"])),
        constant("k_strings", value_strings=[b"a"]),
        helper.make_node("If", ["cond"], ["y"], name="/If",
                         then_branch=branch("then", "t_out", np.ones(2, np.float32)),
                         else_branch=branch("else", "e_out", np.zeros(2, np.float32))),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                              initializer=[numpy_helper.from_array(np.arange(4, dtype=np.int64), "w"),
                                           numpy_helper.from_array(np.eye(2, dtype=np.float32), "c")])
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def by_key(model: ir.Model) -> dict:
    return {t.key: t for t in graph_tensors(model)}


def test_the_main_graphs_initializers_come_first_under_their_own_names():
    tensors = graph_tensors(model_with_branches())
    assert [t.key for t in tensors[:2]] == ["w", "c"]
    w = tensors[0]
    assert (w.kind, w.where, w.dtype, w.shape, w.size) == ("initializer", MAIN_GRAPH, "int64", (4,), 4)
    assert w.read().tolist() == [0, 1, 2, 3]


def test_numeric_constants_are_found_in_the_dtype_of_their_attribute():
    tensors = by_key(model_with_branches())
    assert tensors["k_value"].dtype == "float16" and tensors["k_value"].shape == (2, 3)
    np.testing.assert_array_equal(tensors["k_value"].read(), np.arange(6, dtype=np.float16).reshape(2, 3))
    assert (tensors["k_float"].dtype, tensors["k_float"].shape, tensors["k_float"].read().tolist()) == \
        ("float32", (), 1.5)
    assert tensors["k_floats"].read().dtype == np.float32 and tensors["k_floats"].size == 2
    assert tensors["k_int"].dtype == "int64" and tensors["k_int"].read().tolist() == 3
    assert tensors["k_ints"].read().tolist() == [4, 5, 6] and tensors["k_ints"].size == 3
    assert all(tensors[k].kind == "Constant" for k in ("k_value", "k_float", "k_ints"))


def test_string_constants_are_not_weights():
    keys = set(by_key(model_with_branches()))
    assert "k_string" not in keys and "k_strings" not in keys


def test_subgraph_tensors_are_found_with_where_they_lie_and_reused_names_suffixed():
    tensors = graph_tensors(model_with_branches())
    sub = [t for t in tensors if t.where != MAIN_GRAPH]
    # depth first, in the node's attribute order (onnx.helper sorts them: else_branch first)
    assert [(t.key, t.kind, t.where) for t in sub] == [
        ("w#2", "initializer", "If '/If' else_branch"),
        ("c#2", "Constant", "If '/If' else_branch"),
        ("w#3", "initializer", "If '/If' then_branch"),
        ("c#3", "Constant", "If '/If' then_branch"),
    ]
    assert sub[0].read().tolist() == [0.0, 0.0] and sub[2].read().tolist() == [1.0, 1.0]
    assert sub[0].value.name == "w"  # the key is unique, the value keeps its own name
    assert sub[0].graph is not sub[2].graph
    assert sub[1].describe() == "Constant 'c#2' float32[1] (If '/If' else_branch)"
    assert sub[2].to_json() == {"name": "w#3", "where": "If '/If' then_branch", "kind": "initializer",
                                "dtype": "float32", "shape": [2]}


def test_nested_subgraphs_name_the_whole_path():
    inner = helper.make_node("If", ["cond"], ["deep"], name="inner",
                             then_branch=branch("t", "a", np.ones(2, np.float32)),
                             else_branch=branch("e", "b", np.ones(2, np.float32)))
    outer_then = helper.make_graph([inner], "outer_then", [],
                                   [helper.make_tensor_value_info("deep", TensorProto.FLOAT, [2])])
    outer = helper.make_node("If", ["cond"], ["y"], name="outer", then_branch=outer_then,
                             else_branch=branch("oe", "z", np.ones(2, np.float32)))
    graph = helper.make_graph([outer], "g", [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    wheres = [t.where for t in graph_tensors(model)]
    assert wheres == ["If 'outer' else_branch"] * 2 + ["If 'outer' then_branch > If 'inner' else_branch"] * 2 \
        + ["If 'outer' then_branch > If 'inner' then_branch"] * 2


def test_a_graphs_attribute_is_walked_body_by_body():
    bodies = [ir.from_proto(branch(f"b{k}", "o", np.full(2, k, np.float32))) for k in range(2)]
    model = ir.from_proto(helper.make_model(
        helper.make_graph([], "g", [], []), opset_imports=[helper.make_opsetid("", 17)]))
    node = ir.Node("custom.domain", "Multi", [], attributes=[ir.AttrGraphs("bodies", bodies)], name="m",
                   num_outputs=1)
    model.graph.append(node)
    tensors = graph_tensors(model)
    assert [(t.key, t.where) for t in tensors if t.kind == "initializer"] == [
        ("w", "Multi 'm' bodies[0]"), ("w#2", "Multi 'm' bodies[1]")]
    assert [t.read().tolist() for t in tensors if t.kind == "initializer"] == [[0.0, 0.0], [1.0, 1.0]]


def test_an_initializer_without_data_and_constants_of_other_domains_are_left_out():
    model = ir.from_proto(helper.make_model(helper.make_graph(
        [helper.make_node("Constant", [], ["other"], domain="com.example", value_float=1.0)],
        "g", [], []), opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]))
    value = ir.Value(name="default_only", const_value=ir.tensor(np.zeros(2, np.float32), name="default_only"))
    model.graph.register_initializer(value)
    value.const_value = None  # a graph input's declared default, its data not given
    assert graph_tensors(model) == []


def test_an_attribute_reference_is_not_a_weight():
    model = ir.from_proto(helper.make_model(helper.make_graph([], "g", [], []),
                                            opset_imports=[helper.make_opsetid("", 17)]))
    node = ir.Node("", "Constant", [], attributes=[ir.RefAttr("value", "outer_value", ir.AttributeType.TENSOR)],
                   num_outputs=1)
    node.outputs[0].name = "ref"
    model.graph.append(node)
    assert graph_tensors(model) == []


def test_an_unnamed_constant_output_is_keyed_constant():
    model = ir.from_proto(helper.make_model(helper.make_graph([], "g", [], []),
                                            opset_imports=[helper.make_opsetid("", 17)]))
    for _ in range(2):
        node = ir.Node("", "Constant", [], attributes=[ir.AttrFloat32("value_float", 2.0)], num_outputs=1)
        model.graph.append(node)
        node.outputs[0].name = None
    assert [t.key for t in graph_tensors(model)] == ["Constant", "Constant#2"]


def test_tensor_views_gives_readers_and_specs_by_key():
    tensors = graph_tensors(model_with_branches())
    readers, specs = tensor_views(tensors)
    assert list(readers) == [t.key for t in tensors] == list(specs)
    assert specs["w"] == ("int64", (4,)) and specs["w#2"] == ("float32", (2,))
    assert readers["k_ints"]().tolist() == [4, 5, 6]
