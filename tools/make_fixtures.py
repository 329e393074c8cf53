"""Build the small TF1-style training graphs used as test fixtures.

Each fixture is written as ``<name>.meta`` (binary MetaGraphDef, devices
cleared) plus ``<name>.npz`` (a deterministic pool of 64 feed rows keyed by
placeholder node name).  Every graph follows the same conventions: root-level
placeholders with a leading batch dimension, variables from ``get_variable``,
a scalar mean ``loss`` in the LOSSES collection, a global step, and the
optimizer's ``minimize`` op in the TRAIN_OP collection.

Usage: python tools/make_fixtures.py [--out tests/fixtures] [--check]
"""

import argparse
import os
import sys

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf.control_flow_pb2 import WhileContextDef

v1 = tf.compat.v1
POOL = 64  # feed rows per placeholder
CHECK_ROWS = 16
CHECK_STEPS = 3


# ---------------------------------------------------------------- helpers

def _var(name, shape, init=None, trainable=True):
    init = init or v1.glorot_uniform_initializer()
    return v1.get_variable(name, shape, initializer=init, trainable=trainable)


def _dense(x, scope, n_in, n_out, act=None):
    with v1.variable_scope(scope):
        kernel = _var("kernel", [n_in, n_out])
        bias = _var("bias", [n_out], v1.zeros_initializer())
        out = tf.matmul(x, kernel) + bias
        return act(out) if act else out


def _conv(x, scope, n_in, n_out, bias=True):
    with v1.variable_scope(scope):
        kernel = _var("kernel", [3, 3, n_in, n_out])
        out = tf.nn.conv2d(x, kernel, strides=1, padding="SAME")
        if bias:
            out = tf.nn.bias_add(out, _var("bias", [n_out], v1.zeros_initializer()))
        return out


def _finish(logits, y, optimizer):
    """Add loss, global step and train op following the fixture conventions."""
    xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
    loss = tf.identity(tf.reduce_mean(xent), name="loss")
    v1.add_to_collection(v1.GraphKeys.LOSSES, loss)
    global_step = v1.train.get_or_create_global_step()
    with tf.control_dependencies(v1.get_collection(v1.GraphKeys.UPDATE_OPS)):
        train_op = optimizer.minimize(loss, global_step=global_step)
    # v1 optimizers already register their train op; keep the collection unique.
    if train_op not in v1.get_collection(v1.GraphKeys.TRAIN_OP):
        v1.add_to_collection(v1.GraphKeys.TRAIN_OP, train_op)


def _inputs(x_shape, n_classes, rng):
    """Placeholders x, y and a feed pool whose labels follow a fixed linear rule."""
    x = v1.placeholder(tf.float32, [None] + x_shape, name="x")
    y = v1.placeholder(tf.int64, [None], name="y")
    xs = rng.standard_normal([POOL] + x_shape).astype(np.float32)
    w = rng.standard_normal([int(np.prod(x_shape)), n_classes])
    ys = np.argmax(xs.reshape(POOL, -1) @ w, axis=1).astype(np.int64)
    return x, y, {"x": xs, "y": ys}


def _rnn(x):
    """Tiny tanh RNN over the 5 time steps of x, unrolled with while_loop."""
    with v1.variable_scope("rnn"):
        kernel = _var("kernel", [4 + 8, 8])
        bias = _var("bias", [8], v1.zeros_initializer())

        def body(t, h):
            xh = tf.concat([x[:, t, :], h], 1)
            return t + 1, tf.tanh(tf.matmul(xh, kernel) + bias)

        h0 = tf.zeros(tf.stack([tf.shape(x)[0], 8]))
        _, h = v1.while_loop(lambda t, h: t < 5, body, [tf.constant(0), h0])
        return h


# --------------------------------------------------------------- fixtures

def mlp_sgd(rng):
    """Baseline: two dense layers, plain SGD, resource variables."""
    x, y, feeds = _inputs([8], 3, rng)
    logits = _dense(_dense(x, "dense0", 8, 16, tf.nn.relu), "dense1", 16, 3)
    _finish(logits, y, v1.train.GradientDescentOptimizer(0.1))
    return feeds


def cnn_momentum(rng):
    """4-D input, conv gradients and an optimizer with one slot (Momentum)."""
    x, y, feeds = _inputs([8, 8, 1], 4, rng)
    h = tf.nn.relu(_conv(x, "conv0", 1, 4))
    logits = _dense(tf.reshape(h, [-1, 256]), "dense0", 256, 4)
    _finish(logits, y, v1.train.MomentumOptimizer(0.05, 0.9))
    return feeds


def cnn_bn_momentum(rng):
    """Batch statistics plus non-trainable moving averages updated via UPDATE_OPS.

    The conv has no bias: bn0/beta plays that role.
    """
    x, y, feeds = _inputs([8, 8, 1], 4, rng)
    h = _conv(x, "conv0", 1, 4, bias=False)
    with v1.variable_scope("bn0"):
        gamma = _var("gamma", [4], v1.ones_initializer())
        beta = _var("beta", [4], v1.zeros_initializer())
        moving_mean = _var("moving_mean", [4], v1.zeros_initializer(), False)
        moving_var = _var("moving_variance", [4], v1.ones_initializer(), False)
        mean, var = tf.nn.moments(h, axes=[0, 1, 2])
        for moving, batch, name in ((moving_mean, mean, "update_moving_mean"),
                                    (moving_var, var, "update_moving_variance")):
            update = moving.assign_sub((moving - batch) * 0.1, name=name,
                                       read_value=False)
            v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, update)
        h = tf.nn.batch_normalization(h, mean, var, beta, gamma, 1e-3)
    logits = _dense(tf.reshape(tf.nn.relu(h), [-1, 256]), "dense0", 256, 4)
    _finish(logits, y, v1.train.MomentumOptimizer(0.05, 0.9))
    return feeds


def embedding_adam(rng):
    """Sparse (IndexedSlices) gradient into an embedding, Adam's scatter updates."""
    ids = v1.placeholder(tf.int64, [None, 4], name="ids")
    y = v1.placeholder(tf.int64, [None], name="y")
    ids_pool = rng.integers(0, 50, size=[POOL, 4]).astype(np.int64)
    token_score = rng.standard_normal(50)
    labels = (token_score[ids_pool].sum(axis=1) > 0).astype(np.int64)
    with v1.variable_scope("embedding"):
        table = _var("weights", [50, 8], v1.random_normal_initializer(0.0, 0.1))
        emb = tf.reduce_mean(tf.nn.embedding_lookup(table, ids), axis=1)
    _finish(_dense(emb, "dense0", 8, 2), y, v1.train.AdamOptimizer(0.01))
    return {"ids": ids_pool, "y": labels}


def legacy_ref(rng):
    """Reference variables (VariableV2) everywhere, incl. global_step: ApplyMomentum."""
    with v1.variable_scope(v1.get_variable_scope(), use_resource=False):
        x, y, feeds = _inputs([8], 3, rng)
        logits = _dense(_dense(x, "dense0", 8, 16, tf.nn.relu), "dense1", 16, 3)
        _finish(logits, y, v1.train.MomentumOptimizer(0.1, 0.9))
    return feeds


def rnn_while(rng):
    """Functional While op (control flow v2) with a function library."""
    x, y, feeds = _inputs([5, 4], 2, rng)
    _finish(_dense(_rnn(x), "dense0", 8, 2), y,
            v1.train.GradientDescentOptimizer(0.1))
    return feeds


def rnn_while_legacy(rng):
    """Same RNN with legacy control flow: Enter/Exit/Merge/Switch/NextIteration."""
    was_v2 = v1.control_flow_v2_enabled()
    v1.disable_control_flow_v2()
    try:
        return rnn_while(rng)
    finally:
        if was_v2:
            v1.enable_control_flow_v2()


def mlp_saver(rng):
    """mlp_sgd plus a Saver, exported with its saver_def (save/... nodes)."""
    feeds = mlp_sgd(rng)
    return feeds, v1.train.Saver().as_saver_def()


FIXTURES = [mlp_sgd, cnn_momentum, cnn_bn_momentum, embedding_adam,
            legacy_ref, rnn_while, rnn_while_legacy, mlp_saver]


# ------------------------------------------------------------ build/check

def _replace(path, write):
    """Write a file atomically: write(tmp_path) then os.replace."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _meta_bytes(graph, saver_def):
    """Serialized MetaGraphDef, byte-stable across runs.

    Legacy while contexts hold a map filled in object-id order, so each one is
    re-serialized with sorted keys.
    """
    meta = v1.train.export_meta_graph(graph=graph, clear_devices=True,
                                      saver_def=saver_def)
    if "while_context" in meta.collection_def:
        contexts = meta.collection_def["while_context"].bytes_list.value
        for i, raw in enumerate(contexts):
            contexts[i] = WhileContextDef.FromString(raw).SerializeToString(
                deterministic=True)
    return meta.SerializeToString(deterministic=True)


def _save_bytes(tmp, data):
    with open(tmp, "wb") as f:
        f.write(data)


def _save_npz(tmp, feeds):
    with open(tmp, "wb") as f:
        np.savez(f, **feeds)


def build(builder, out_dir):
    """Build one fixture; a builder returns its feeds, or (feeds, saver_def)."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(0)
        result = builder(np.random.default_rng(0))
        feeds, saver_def = result if isinstance(result, tuple) else (result, None)
        meta = _meta_bytes(graph, saver_def)
    base = os.path.join(out_dir, builder.__name__)
    _replace(base + ".meta", lambda tmp: _save_bytes(tmp, meta))
    _replace(base + ".npz", lambda tmp: _save_npz(tmp, feeds))


def check(name, out_dir):
    """Import the fixture, train a few steps and check structural expectations."""
    base = os.path.join(out_dir, name)
    feeds = np.load(base + ".npz")
    meta = v1.MetaGraphDef()
    with open(base + ".meta", "rb") as f:
        meta.ParseFromString(f.read())
    with tf.Graph().as_default():
        v1.train.import_meta_graph(meta)
        train_op = v1.get_collection(v1.GraphKeys.TRAIN_OP)[0]
        loss = v1.get_collection(v1.GraphKeys.LOSSES)[0]
        step = v1.train.get_global_step()
        feed = {k + ":0": feeds[k][:CHECK_ROWS] for k in feeds.files}
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            before = sess.run(loss, feed)
            for _ in range(CHECK_STEPS):
                sess.run(train_op, feed)
            after, steps = sess.run([loss, step], feed)
    ops = {n.op for n in meta.graph_def.node}
    problems = []
    if not (np.isfinite(before) and np.isfinite(after)):
        problems.append("non-finite loss")
    if after >= before:
        problems.append("loss did not decrease")
    if steps != CHECK_STEPS:
        problems.append(f"global_step is {steps}")
    if name == "rnn_while" and not (ops & {"While", "StatelessWhile"}
                                    and meta.graph_def.library.function
                                    and "Enter" not in ops):
        problems.append("no functional While / function library")
    if name == "rnn_while_legacy" and not ({"Enter", "Exit"} <= ops
                                           and "While" not in ops):
        problems.append("no legacy Enter/Exit loop")
    if name == "legacy_ref" and ("VarHandleOp" in ops or "VariableV2" not in ops):
        problems.append("not pure reference variables")
    if name == "mlp_saver" and not meta.saver_def.save_tensor_name:
        problems.append("no saver_def")
    size = os.path.getsize(base + ".meta")
    print(f"{name:18s} loss {before:.4f} -> {after:.4f}  step {steps}  "
          f"{size} bytes  {'OK' if not problems else 'FAIL: ' + ', '.join(problems)}")
    return not problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join("tests", "fixtures"))
    parser.add_argument("--check", action="store_true",
                        help="after writing, train each fixture a few steps")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for builder in FIXTURES:
        build(builder, args.out)
        print("wrote", os.path.join(args.out, builder.__name__) + ".{meta,npz}")
    if args.check:
        ok = [check(b.__name__, args.out) for b in FIXTURES]
        return 0 if all(ok) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
