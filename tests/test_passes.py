"""Each allreduce pass on its own: a case where it changes the graph, one where it has nothing
to do (modified=False), one it must refuse."""

import numpy as np
import pytest
from conftest import fixture_path, graph_without_train_op

from graphxform import metagraph, training
from graphxform.errors import GraphxformError, PassError
from graphxform.passes.all_reduce import AllReduce
from graphxform.passes.replicate import Replicate
from graphxform.passes.rewire_consumers import RewireConsumers
from graphxform.passes.split_inputs import SplitInputs
from graphxform.passes.strip_saver import StripSaver
from graphxform.passes.sync_init import SyncInit
from graphxform.pipeline import PassContext, Pipeline

TWO = ["/device:CPU:0", "/device:CPU:1"]


def context(ir, devices=TWO):
    return PassContext(training=training.analyze(ir), devices=devices)


def run(name_or_ir, passes, devices=TWO):
    ir = metagraph.load(fixture_path(name_or_ir)) if isinstance(name_or_ir, str) else name_or_ir
    pipeline = Pipeline(passes)
    pipeline.run(ir, context(ir, devices))
    return ir, {t.name: t for t in pipeline.timings}


def counter_graph():
    """A train op that only bumps global_step: nothing to reduce."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        tf1.placeholder(tf.float32, [4, 3], name="x")  # static batch: not split
        step = tf1.train.get_or_create_global_step()
        tf1.add_to_collection("train_op", tf1.assign_add(step, 1, name="bump"))
    return metagraph.from_metagraph(tf1.train.export_meta_graph(graph_def=g.as_graph_def(),
                                                                graph=g))


def test_strip_saver():
    ir, t = run("mlp_saver", [StripSaver()])
    assert t["strip-saver"].modified
    assert not any(n.startswith("save/") for n in ir.nodes())
    assert not ir.meta.HasField("saver_def")
    _, t = run("mlp_sgd", [StripSaver()])
    assert not t["strip-saver"].modified


def test_replicate_copies_all_but_shared_nodes():
    ir, t = run("mlp_sgd", [Replicate()])
    assert "dense0/kernel" not in ir and "replica_1/dense0/kernel" in ir
    assert ir.node("replica_1/dense0/MatMul")["device"] == "/device:CPU:1"
    assert {"x", "y", "global_step", "GradientDescent"} <= set(ir.nodes())
    # the once-per-step increment waits (through its constant) on every replica's update
    assert set(ir.control_inputs("GradientDescent/Const")) == {"replica_0/GradientDescent/update",
                                                         "replica_1/GradientDescent/update"}
    assert ir.node("replica_0/loss")["created_by"] == "replicate"


def test_replicate_gives_each_legacy_loop_its_own_frame():
    ir, _ = run("rnn_while_legacy", [Replicate()])
    frames = {ir.node(n)["attr"]["frame_name"].s.decode() for n in ir.nodes()
              if ir.op(n) == "Enter"}
    assert all(f.startswith("replica_") for f in frames)
    assert any(f.startswith("replica_1/") for f in frames)


def test_split_inputs():
    ir, t = run("mlp_sgd", [Replicate(), SplitInputs()])
    assert t["split-inputs"].summary["inputs"] == ["x", "y"]
    assert ir.inputs("replica_1/dense0/MatMul")[0] == ("split_inputs/x/split", 1)
    ir, t = run(counter_graph(), [Replicate(), SplitInputs()])
    assert not t["split-inputs"].modified


def test_all_reduce_and_rewire():
    ir, t = run("mlp_sgd", [Replicate(), SplitInputs(), AllReduce(), RewireConsumers()])
    apply = "replica_1/GradientDescent/update_dense0/kernel/ResourceApplyGradientDescent"
    src, _ = ir.inputs(apply)[2]
    assert src.startswith("allreduce/bucket_0/replica_1/")
    bias = "replica_1/GradientDescent/update_dense0/bias/ResourceApplyGradientDescent"
    assert ir.inputs(bias)[2][0] == "allreduce/bucket_0/replica_1/split"  # a vector: no reshapes
    assert t["rewire-consumers"].summary["edges"] == 8
    ir, t = run(counter_graph(), [Replicate(), AllReduce(), RewireConsumers()])
    assert not t["all-reduce"].modified and not t["rewire-consumers"].modified


def test_sync_init():
    ir, t = run("mlp_sgd", [SyncInit(), Replicate()])
    assert t["sync-init"].summary["synced"] == 4
    assert ir.inputs("replica_1/dense0/kernel/Assign")[1] == (
        "replica_0/dense0/kernel/Initializer/random_uniform", 0)
    assert ("replica_1/dense0/kernel/Assign", 1) in ir.consumers(
        "replica_0/dense0/kernel/Initializer/random_uniform")
    assert not ir.has_scope("replica_1/dense0/kernel/Initializer/")  # never copied
    assert ir.has_scope("replica_1/dense0/kernel/")
    _, t = run("mlp_sgd", [SyncInit(), Replicate()], devices=["/device:CPU:0"])
    assert not t["sync-init"].modified and "synced" not in t["sync-init"].summary
    with pytest.raises(PassError, match="sync-init must run before replicate"):
        run("mlp_sgd", [Replicate(), SyncInit()])


def test_sync_init_copies_what_a_training_op_colocates_with():
    ir = metagraph.load(fixture_path("mlp_sgd"))
    value = "dense0/kernel/Initializer/random_uniform"
    ir.proto("dense0/MatMul").attr["_class"].list.s.append(b"loc:@" + value.encode())
    ir, _ = run(ir, [SyncInit(), Replicate()])
    assert "replica_1/" + value in ir  # colocation needs it in every replica
    assert ir.inputs("replica_1/dense0/kernel/Assign")[1] == ("replica_0/" + value, 0)
    assert not ir.has_scope("replica_1/dense0/bias/Initializer/")


def test_sync_init_points_at_an_initial_value_that_is_used_elsewhere_too():
    """An initial value the training step reads as well stays in every replica; replicas > 0
    still initialise from replica 0's."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        start = tf1.random_uniform([3, 1], name="start")
        w = tf1.Variable(start, name="w")
        loss = tf.reduce_mean(tf.matmul(x, w) + tf.reduce_sum(start), name="loss")
        step = tf1.train.get_or_create_global_step()
        tf1.add_to_collection("train_op", tf1.train.GradientDescentOptimizer(0.1).minimize(
            loss, global_step=step))
        ir = metagraph.from_metagraph(tf1.train.export_meta_graph())
    ir, t = run(ir, [SyncInit(), Replicate()])
    assert t["sync-init"].summary["synced"] == 1
    assert ir.inputs("replica_1/w/Assign")[1] == ("replica_0/start/RandomUniform", 0)
    assert "replica_1/start/RandomUniform" in ir  # the step of replica 1 reads its own


def test_replicate_refuses_without_train_op_and_names_the_pass():
    ir = graph_without_train_op()
    with pytest.raises(PassError, match="pass replicate .*no train op"):
        run(ir, [StripSaver(), Replicate()])
    assert issubclass(PassError, GraphxformError)


@pytest.mark.parametrize("value, dtype", [
    (3, np.int32), ([-1], np.int32), ([2, 3, 4], np.int32), (0.5, np.float32), (2.0, np.float64),
    (np.arange(5), np.int64), (7, np.int64), (True, None), ([[1, 2], [3, 4]], np.float16),
    (np.arange(3), np.uint8), (1, np.uint8), ([], np.int32), (["a", "b"], np.object_)])
def test_const_tensors_are_what_tensorflow_makes(value, dtype):
    from tensorflow.python.framework import tensor_util

    from graphxform.nodes import tensor_proto
    array = np.asarray(value, dtype=dtype)
    assert tensor_proto(array) == tensor_util.make_tensor_proto(array)


def test_builder_nodes_from_one_template_are_independent_and_complete():
    from tensorflow.core.protobuf import meta_graph_pb2

    from graphxform.ir import GraphIR
    from graphxform.nodes import Builder
    ir = GraphIR(meta_graph_pb2.MetaGraphDef())
    build = Builder(ir, "test")
    x = build.const("x", [1.0, 2.0], np.float32)
    again = build.const("again", [1.0, 2.0], np.float32, device="/cpu:0")
    other = build.const("other", [1.0, 2.0], np.float64)  # same values, another dtype
    a = build.op("a", "Identity", [x], T=1)
    b = build.op("b", "Identity", [again], device="/cpu:0", T=1)
    assert ir.proto(again).attr["value"] == ir.proto(x).attr["value"]
    assert ir.node(again)["device"] == "/cpu:0" and ir.proto(again).device == "/cpu:0"
    assert ir.proto(other).attr["dtype"].type == 2
    assert ir.proto(b).name == "b" and ir.inputs(b) == [("again", 0)]
    ir.node(a)["attr"]["T"].type = 2  # one node's attrs are its own
    assert ir.proto(b).attr["T"].type == 1
    assert build.op("c", "Identity", [x], T=1) and ir.proto("c").attr["T"].type == 1
    assert list(ir.proto(b).attr) == list(ir.proto("c").attr)
    zero = build.op("z", "LeakyRelu", [x], alpha=0.0, T=1)
    minus = build.op("m", "LeakyRelu", [x], alpha=-0.0, T=1)  # 0.0 == -0.0: not one template
    assert str(ir.proto(zero).attr["alpha"].f) == "0.0"
    assert str(ir.proto(minus).attr["alpha"].f) == "-0.0"
    with pytest.raises(GraphxformError, match="node 'd': op Identity needs attr 'T'"):
        build.op("d", "Identity", [x])
    with pytest.raises(GraphxformError, match="node 'e': op Identity needs attr 'T'"):
        build.op("e", "Identity", [x])
