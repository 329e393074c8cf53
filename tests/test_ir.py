"""GraphIR's mutation methods and its one-line-per-node printer."""

import pathlib

import pytest
from conftest import fixture_path

from graphxform import metagraph
from graphxform.errors import GraphxformError
from graphxform.ir import GraphIR

GOLDEN = pathlib.Path(__file__).parent / "golden"


def small_ir():
    from tensorflow.core.protobuf import meta_graph_pb2
    ir = GraphIR(meta_graph_pb2.MetaGraphDef())
    ir.add_node("a", "NoOp")
    ir.add_node("b", "Identity", [])
    ir.add_node("c", "IdentityN", [])
    ir.add_node("use", "AddV2", ["c:1", "c", "^a"])
    ir.add_node("other", "Identity", ["c:1", "^a"])
    return ir


def test_inputs_and_consumers_keep_port_order():
    ir = small_ir()
    assert ir.inputs("use") == [("c", 1), ("c", 0)]
    assert ir.control_inputs("use") == ["a"]
    assert sorted(ir.consumers("c", 1)) == [("other", 0), ("use", 0)]
    assert ir.node_line("use") == "use = AddV2(c:1, c, ^a)"


def test_replace_all_uses_with_tensor_moves_one_port():
    ir = small_ir()
    assert ir.replace_all_uses_with("c:1", "b:0", where=lambda n: n == "use") == 1
    assert ir.inputs("use") == [("b", 0), ("c", 0)]
    assert ir.inputs("other") == [("c", 1)]


def test_replace_all_uses_with_node_moves_data_and_control():
    ir = small_ir()
    ir.replace_all_uses_with("a", "b")
    assert ir.control_inputs("use") == ["b"] and ir.control_inputs("other") == ["b"]
    ir.replace_all_uses_with("c", "b")
    assert ir.inputs("use") == [("b", 1), ("b", 0)]


def test_remove_node_safe_refuses_used_nodes():
    ir = small_ir()
    with pytest.raises(GraphxformError, match="still used by"):
        ir.remove_node("c")
    ir.remove_node("use")
    ir.remove_node("other")
    ir.remove_node("c")
    assert "c" not in ir


def test_add_node_refuses_duplicates_and_dangling_inputs():
    ir = small_ir()
    with pytest.raises(GraphxformError, match="already exists"):
        ir.add_node("a", "NoOp")
    with pytest.raises(GraphxformError, match="not in the graph"):
        ir.add_node("d", "Identity", ["nowhere"])


def test_copy_nodes_follows_internal_edges_and_colocation():
    ir = metagraph.load(fixture_path("mlp_sgd"))
    names = [n for n in ir.nodes() if n.startswith("dense0/")]
    mapping = ir.copy_nodes(names, "replica_1/", device="/device:CPU:1", created_by="test")
    read = mapping["dense0/kernel/Read/ReadVariableOp"]
    assert ir.inputs(read) == [("replica_1/dense0/kernel", 0)]
    assert ir.node(read)["device"] == "/device:CPU:1"
    assert ir.node(read)["created_by"] == "test"
    assert ir.node(read)["origin"] == "dense0/kernel/Read/ReadVariableOp"
    matmul = mapping["dense0/MatMul"]
    assert ir.inputs(matmul)[0] == ("x", 0)  # outside the copied set: the original
    colocated = [n for n in mapping.values() if "_class" in ir.node(n)["attr"]]
    for n in colocated:
        for item in ir.node(n)["attr"]["_class"].list.s:
            assert item.decode().startswith("loc:@replica_1/")
    from graphxform import verify
    verify.check_structure(ir)
    verify.check_imports(ir)


def test_printer_matches_golden(update_goldens):
    ir = metagraph.load(fixture_path("mlp_sgd"))
    text = str(ir)
    golden = GOLDEN / "mlp_sgd.txt"
    if update_goldens:
        golden.write_text(text)
    assert text == golden.read_text()
    assert len(text.splitlines()) == len(ir)
