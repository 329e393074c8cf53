"""The pipeline runs passes in order, verifies after each, times them, dumps snapshots, and
names the pass that failed."""

import dataclasses

import pytest
from conftest import fixture_path

from graphxform import Pass, PassResult, Pipeline, metagraph
from graphxform.errors import PassError


@dataclasses.dataclass
class AddIdentity(Pass):
    name = "add-identity"
    of: str = "loss"

    def run(self, ir, ctx):
        ir.add_node(f"{self.of}/copy", "Identity", [self.of], attr={"T": ir.node(self.of)["attr"]["T"]},
                    created_by=self.name)
        return PassResult(modified=True)


class Nothing(Pass):
    name = "nothing"

    def run(self, ir, ctx):
        return PassResult(modified=False)


@dataclasses.dataclass
class BreakPorts(Pass):
    name = "break-ports"

    def run(self, ir, ctx):
        ir.add_node("broken", "Identity", ["loss:5"], attr={"T": ir.node("loss")["attr"]["T"]})
        return PassResult(modified=True)


def test_runs_in_order_and_times(tmp_path):
    ir = metagraph.load(fixture_path("mlp_sgd"))
    pipeline = Pipeline([Nothing(), AddIdentity()], dump_dir=str(tmp_path))
    pipeline.run(ir)
    assert [(t.name, t.modified) for t in pipeline.timings] == [("nothing", False),
                                                                ("add-identity", True)]
    assert all(t.seconds >= 0 for t in pipeline.timings)
    assert ir.node("loss/copy")["created_by"] == "add-identity"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "00_input.dot", "00_input.pbtxt", "01_nothing.dot", "01_nothing.pbtxt",
        "02_add-identity.dot", "02_add-identity.pbtxt"]
    assert "loss/copy" in (tmp_path / "02_add-identity.pbtxt").read_text()
    assert str(pipeline) == "nothing,add-identity{of=loss}"


def test_verify_failure_names_the_pass_and_those_before():
    ir = metagraph.load(fixture_path("mlp_sgd"))
    with pytest.raises(PassError, match=r"pass break-ports \(after nothing\): .*loss:5"):
        Pipeline([Nothing(), BreakPorts()]).run(ir)


def test_no_verify_lets_it_through():
    ir = metagraph.load(fixture_path("mlp_sgd"))
    Pipeline([BreakPorts()], verify=False).run(ir)
    assert "broken" in ir


def test_an_output_past_protobufs_limit_is_refused_before_any_pass():
    import os

    from graphxform import strategies
    from graphxform.errors import GraphxformError
    path = fixture_path("mlp_sgd")
    replicas = 2**31 // os.path.getsize(path) + 1
    ir = metagraph.load(path)
    with pytest.raises(GraphxformError, match=rf"mlp_sgd.meta: the output would be about 2\.00 GiB "
                       rf"\({replicas} replicas of \d+\.\d\d KiB\), more than the 2\.00 GiB"):
        strategies.transform(ir, "allreduce", devices=[f"/device:CPU:{i}" for i in range(replicas)])
    assert not any(n.startswith("replica_") for n in ir.nodes())  # no pass ran


def test_apply_refuses_an_output_past_protobufs_limit_before_loading(run_cli, tmp_path):
    import os
    path = fixture_path("mlp_sgd")
    replicas = 2**31 // os.path.getsize(path) + 1
    code, out, err = run_cli("apply", "--replicas", replicas, path, "-o", tmp_path / "out.meta")
    assert code == 1 and not out
    assert len(err.strip().splitlines()) == 1
    assert "the output would be about 2.00 GiB" in err and "use fewer replicas" in err
    assert not list(tmp_path.iterdir())
