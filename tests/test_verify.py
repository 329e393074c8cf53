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
