"""Structural and TF-level verification."""

import pytest
from conftest import ALL_FIXTURES, fixture_path

from graphxform import metagraph, verify
from graphxform.errors import GraphxformError


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_fixtures_verify(name):
    ir = metagraph.load(fixture_path(name))
    assert verify.structural_errors(ir) == []  # legacy while loops: back edges allowed
    verify.check_imports(ir)


def test_missing_output_port_is_reported():
    ir = metagraph.load(fixture_path("mlp_sgd"))
    ir.set_input("loss", 0, "x:3")
    errors = verify.structural_errors(ir)
    assert any("x:3" in e and "1 output" in e for e in errors)


def test_cycle_outside_while_loop_is_reported():
    ir = metagraph.load(fixture_path("mlp_sgd"))
    ir.add_control_input("dense0/MatMul", "loss")
    assert any("cycle" in e for e in verify.structural_errors(ir))


def test_tf_import_check_reports_bad_attr():
    ir = metagraph.load(fixture_path("mlp_sgd"))
    from tensorflow.core.framework import attr_value_pb2, types_pb2
    ir.node("loss")["attr"]["T"].CopyFrom(attr_value_pb2.AttrValue(type=types_pb2.DT_INT32))
    with pytest.raises(GraphxformError, match="TensorFlow rejects the graph"):
        verify.check_imports(ir)


def test_changed_only_checks_a_fresh_graph_whole_then_what_changed():
    ir = metagraph.load(fixture_path("mlp_sgd"))
    verify.check_structure(ir, changed_only=True)  # every node of a fresh graph
    verify.check_structure(ir, changed_only=True)  # nothing changed since
    ir.add_node("broken", "Identity", ["loss:5"], attr={"T": ir.node("loss")["attr"]["T"]})
    with pytest.raises(GraphxformError, match="loss:5"):
        verify.check_structure(ir, changed_only=True)
    verify.check_structure(ir, changed_only=True)  # reported once; the full check still sees it
    with pytest.raises(GraphxformError, match="loss:5"):
        verify.check_structure(ir)


@pytest.mark.parametrize("where", ["start", "end"])
def test_changed_only_finds_a_cycle_through_a_rewired_node(where):
    ir = metagraph.load(fixture_path("mlp_sgd"))
    verify.check_structure(ir, changed_only=True)
    if where == "start":  # the search down from the rewired node covers most of the graph
        ir.add_control_input("dense0/MatMul", "loss")
    else:  # the search up from it does
        ir.add_control_input("loss", "loss")
    with pytest.raises(GraphxformError, match="cycle"):
        verify.check_structure(ir, changed_only=True)


def test_changed_only_allows_while_loop_back_edges():
    ir = metagraph.load(fixture_path("rnn_while_legacy"))
    verify.check_structure(ir, changed_only=True)
    merge = next(n for n in ir.nodes() if ir.op(n) == "Merge")
    ir.add_control_input(merge, ir.inputs(merge)[0][0])  # a second edge on the same pair
    verify.check_structure(ir, changed_only=True)
