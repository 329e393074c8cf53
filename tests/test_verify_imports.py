"""The TF-level check (verify.check_imports, which `apply` runs by default) imports only part
of a replicated graph: these tests break the output on purpose, in replica 0, in another
replica and in a node shared by all, and expect every break rejected."""

import numpy as np
import pytest
from conftest import fixture_path

from graphxform import import_check, metagraph, strategies, verify
from graphxform.errors import GraphxformError

REPLICAS = 3


@pytest.fixture
def transformed():
    ir = metagraph.load(fixture_path("mlp_sgd"))
    strategies.transform(ir, "allreduce", devices=[f"/device:CPU:{i}" for i in range(REPLICAS)])
    return ir


def set_attr_int(ir, name, key):
    """A wrong attr type: ``key`` (a type attr) set to an int."""
    from tensorflow.core.framework import attr_value_pb2
    ir.node(name)["attr"][key].CopyFrom(attr_value_pb2.AttrValue(i=1))


def set_const(ir, name, values):
    import tensorflow as tf
    value = ir.node(name)["attr"]["value"]
    dtype = tf.dtypes.as_dtype(value.tensor.dtype).as_numpy_dtype
    value.tensor.CopyFrom(tf.make_tensor_proto(np.array(values, dtype=dtype)))


def in_replica(k):
    """What each break does to replica ``k``: its first layer's Relu, and for the shape
    contradiction, the shape a gradient Reshape reshapes a scalar to. In replicas > 0 that
    Reshape is left out of the import (it is replica 0's twin); the Const it reads is not."""
    p = f"replica_{k}/"
    return {
        "wrong attr type": lambda ir: set_attr_int(ir, p + "dense0/Relu", "T"),
        "dtype mismatch": lambda ir: ir.set_input(p + "dense0/Relu", 0, "y"),
        "missing output port": lambda ir: ir.set_input(p + "dense0/Relu", 0,
                                                       p + "dense0/add:3"),
        "shape contradiction": lambda ir: set_const(
            ir, p + "gradients/Mean_grad/Reshape/shape", [2]),
    }


SHARED = {  # the split of the batch across replicas: one node, read by every replica
    "wrong attr type": lambda ir: set_attr_int(ir, "split_inputs/x/split", "T"),
    "dtype mismatch": lambda ir: ir.set_input("split_inputs/x/split", 1, "y"),
    "missing output port": lambda ir: ir.set_input("split_inputs/x/split", 1, "x:4"),
    "shape contradiction": lambda ir: set_const(ir, "split_inputs/x/axis", 7),
}

WHERE = {"replica 0": in_replica(0), "another replica": in_replica(2), "shared": SHARED}
BREAKS = sorted(SHARED)


def test_an_intact_output_is_accepted_importing_one_replica(transformed):
    info = verify.check_imports(transformed)
    assert not info["whole"]
    assert info["twins"] > 0 and info["leaves"] > 0
    assert info["imported"] + info["twins"] + info["leaves"] == len(transformed)
    replica_2 = [n for n in transformed.nodes() if n.startswith("replica_2/")]
    assert sum(1 for n in replica_2 if n in import_check.find_twins(transformed).of) > \
        len(replica_2) / 2


@pytest.mark.parametrize("where", sorted(WHERE))
@pytest.mark.parametrize("broken", BREAKS)
def test_a_broken_output_is_rejected(transformed, where, broken):
    WHERE[where][broken](transformed)
    with pytest.raises(GraphxformError, match="TensorFlow rejects the graph"):
        verify.check_imports(transformed)



def set_attr(ir, name, key, **value):
    from tensorflow.core.framework import attr_value_pb2
    ir.node(name)["attr"][key].CopyFrom(attr_value_pb2.AttrValue(**value))


LEAF = "dense0/MatMul/ReadVariableOp"  # merge-fetches' Identity of replica 0's read: a leaf
LEAF_BREAKS = {
    "wrong attr type": lambda ir: set_attr_int(ir, LEAF, "T"),
    "dtype mismatch": lambda ir: set_attr(ir, LEAF, "T", type=3),
    "missing output port": lambda ir: ir.set_input(LEAF, 0, "replica_0/" + LEAF + ":2"),
    "output shapes unlike its input's": lambda ir: ir.node(LEAF)["attr"]["_output_shapes"]
    .list.shape.add().dim.add(size=5),
}


@pytest.mark.parametrize("broken", sorted(LEAF_BREAKS))
def test_a_broken_leaf_left_out_of_the_import_is_rejected(transformed, broken):
    """The Identity nodes that serve a name and that nothing reads are left out of the import
    (import_check.find_leaves); what TF would reject in one is rejected still."""
    assert LEAF in import_check.find_leaves(transformed, import_check.find_twins(transformed).of)
    LEAF_BREAKS[broken](transformed)
    with pytest.raises(GraphxformError, match="TensorFlow rejects the graph"):
        verify.check_imports(transformed)

def test_a_twin_fed_a_different_value_is_imported_with_the_whole_graph(transformed):
    """replica_2's Fill of the loss gradient is unchanged (a twin of replica_0's), but the
    value it reads now differs: TF could infer it differently, so the whole graph is imported
    (and accepted: the graph is valid)."""
    set_const(transformed, "replica_2/gradients/grad_ys_0/Const", 2.0)
    info = verify.check_imports(transformed)
    assert info["whole"] and info["twins"] == 0


def test_a_changed_node_equal_to_its_representative_keeps_the_twins(transformed):
    set_const(transformed, "replica_2/gradients/Mean_grad/Reshape/shape", [1])
    info = verify.check_imports(transformed)
    assert not info["whole"] and info["frontier"] > 0


def test_a_cycle_through_a_twin_is_rejected(transformed):
    """replica_2's MatMul waits on the Relu it feeds; the Relu stays a twin (left out of the
    import, read as replica_0's), so the import alone would not see the cycle."""
    transformed.add_control_input("replica_2/dense0/MatMul", "replica_2/dense0/Relu")
    with pytest.raises(GraphxformError, match="TensorFlow rejects the graph: cycle"):
        verify.check_imports(transformed)


PER_REPLICA = "allreduce/bucket_0/replica_2/"  # all-reduce's nodes of replica 2
REWIRED = "replica_2/GradientDescent/update_dense0/kernel/ResourceApplyGradientDescent"


def test_what_a_pass_makes_or_rewires_per_replica_is_left_out_as_alike(transformed):
    """all-reduce's nodes of replica 2, and replica 2's update now reading its reduced
    gradient, are alike replica 0's (import_check.join_alike): left out of the import."""
    twins = import_check.find_twins(transformed)
    leaves = import_check.find_leaves(transformed, twins.of)
    assert REWIRED not in twins.of
    assert import_check.join_alike(transformed, twins, leaves) > 0
    assert twins.of[PER_REPLICA + "reduce"] == "allreduce/bucket_0/replica_0/reduce"
    assert twins.of[REWIRED] == REWIRED.replace("replica_2/", "replica_0/")
    info = verify.check_imports(transformed)
    assert not info["whole"]
    assert info["imported"] + info["twins"] + info["leaves"] == len(transformed)


ALIKE_BREAKS = {
    "wrong attr type": lambda ir: set_attr_int(ir, PER_REPLICA + "grad_1", "T"),
    "dtype mismatch": lambda ir: ir.set_input(PER_REPLICA + "grad_1", 0, PER_REPLICA + "sizes"),
    "shape contradiction": lambda ir: set_const(ir, PER_REPLICA + "shape_1", [999, 7]),
    "rewired update reads another dtype": lambda ir: ir.set_input(REWIRED, 2,
                                                                  PER_REPLICA + "sizes"),
    "cycle": lambda ir: ir.add_control_input(PER_REPLICA + "concat", PER_REPLICA + "grad_1"),
}


@pytest.mark.parametrize("broken", sorted(ALIKE_BREAKS))
def test_a_broken_node_a_pass_made_per_replica_is_rejected(transformed, broken):
    """What a pass made for replica 2 (or rewired there) is left out of the import where it
    is alike replica 0's; broken, it is no longer alike (or a node it reads is not), and TF
    rejects it."""
    ALIKE_BREAKS[broken](transformed)
    with pytest.raises(GraphxformError, match="TensorFlow rejects the graph"):
        verify.check_imports(transformed)


def test_colocation_with_a_missing_node_is_rejected(transformed):
    value = transformed.node("split_inputs/x/split")["attr"]["_class"]
    value.list.s.append(b"loc:@nowhere")
    with pytest.raises(GraphxformError, match="colocated with 'nowhere'"):
        verify.check_imports(transformed)


def test_a_malformed_device_is_rejected(transformed):
    transformed.node("replica_1/dense0/Relu")["device"] = "/job:worker/garbage:1"
    with pytest.raises(GraphxformError, match="device '/job:worker/garbage:1'"):
        verify.check_imports(transformed)


@pytest.mark.parametrize("strategy", ["allreduce", "ps", "partitioned-ps"])
@pytest.mark.parametrize("name", ["mlp_sgd", "cnn_bn_momentum", "embedding_adam", "legacy_ref",
                                  "rnn_while_legacy"])
def test_fixtures_transformed_are_accepted_leaving_twins_out(name, strategy):
    """Every strategy's output is accepted, and most of the copies beyond the first replica
    are left out of the import (partitioned-ps rewires the originals before replicating,
    so their copies carry stale NodeDef inputs until emit writes them from the edges)."""
    from graphxform import cluster
    ir = metagraph.load(fixture_path(name))
    if strategy == "allreduce":
        devices = [f"/device:CPU:{i}" for i in range(REPLICAS)]
        strategies.transform(ir, strategy, devices=devices)
    else:
        spec = {"ps": ["127.0.0.1:1", "127.0.0.1:2"],
                "worker": [f"127.0.0.1:{3 + i}" for i in range(REPLICAS)]}
        strategies.transform(ir, strategy, cluster=cluster.Cluster(spec))
    info = verify.check_imports(ir)
    assert not info["whole"] and info["twins"] > 0


def test_apply_rejects_a_broken_output_by_default(run_cli, tmp_path, monkeypatch):
    """A pass that breaks another replica's copy in a way only TensorFlow sees: `apply` with
    its default checks refuses to write the output."""
    from graphxform.passes.drop_in_saver import DropInSaver
    run = DropInSaver.run

    def run_then_break(self, ir, ctx):
        result = run(self, ir, ctx)
        set_attr_int(ir, "replica_2/dense0/Relu", "T")
        return result

    monkeypatch.setattr(DropInSaver, "run", run_then_break)
    out = tmp_path / "out.meta"
    code, _, err = run_cli("apply", "--replicas", REPLICAS, fixture_path("mlp_sgd"), "-o", out)
    assert code == 1 and "TensorFlow rejects the graph" in err and "replica_2/dense0/Relu" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def _variable_def(name):
    from tensorflow.core.framework import variable_pb2
    return variable_pb2.VariableDef(variable_name=name + ":0", initializer_name=name + "/Assign",
                                    snapshot_name=name + "/Read/ReadVariableOp:0")


@pytest.mark.parametrize("collection, value, problem", [
    ("metric_variables", "dense0/kernel", "its op is Identity, not a variable op"),
    ("local_variables", "nowhere", "no such node"),
    ("summaries", "dense0/Relu:3", "has no output 3"),
    ("summaries", "nowhere:0", "no such node"),
])
def test_a_collection_import_meta_graph_cannot_resolve_is_rejected(transformed, collection,
                                                                  value, problem):
    """import_meta_graph resolves every name a collection holds (TF's C importer reads none):
    a variable collection naming what merge-fetches serves (an Identity), or a missing node
    or output port, fails there, so the TF check rejects it."""
    col = transformed.meta.collection_def[collection]
    if collection.endswith("variables"):
        col.bytes_list.value.append(_variable_def(value).SerializeToString())
    else:
        col.node_list.value.append(value)
    with pytest.raises(GraphxformError, match=f"collection '{collection}' names .*{problem}"):
        verify.check_imports(transformed)


def test_collections_of_a_transformed_metrics_recipe_import():
    """tf.compat.v1.metrics keeps its totals in metric_variables: replicate renames them there
    too, so import_meta_graph of the output builds every variable object."""
    import tensorflow as tf
    from recipe_loop import recipe_meta
    ir = metagraph.load(recipe_meta("metrics_mlp"))
    strategies.transform(ir, "allreduce", devices=["/device:CPU:0", "/device:CPU:1"])
    verify.check_imports(ir)
    with tf.Graph().as_default():
        tf.compat.v1.train.import_meta_graph(metagraph.to_metagraph(ir))
        names = {v.op.name for v in tf.compat.v1.get_collection("metric_variables")}
    assert names == {f"replica_{i}/{m}/{v}" for i in range(2)
                     for m in ("accuracy", "mean_loss") for v in ("total", "count")}


@pytest.mark.parametrize("name", ["mlp_sgd", "cnn_bn_momentum", "embedding_adam"])
def test_the_passes_leave_the_copies_twins(name):
    """Only what the transformation changed in a replica is imported one by one: reading a
    copy's attrs through its node data (``data["attr"]``) makes it its own NodeDef, and every
    other replica's copy of it then joins the TF check's frontier (merge-fetches once did so
    for every constant of replica 0, and the check of the transformer took 1.7x as long)."""
    ir = metagraph.load(fixture_path(name))
    strategies.transform(ir, "allreduce", devices=[f"/device:CPU:{i}" for i in range(REPLICAS)])
    twins = import_check.find_twins(ir)
    consts = [a for a, _ in twins.frontier if ir.op(a) == "Const"]
    assert not consts, consts[:5]
