"""Build large TF1-style training graphs for benchmarks and export them as MetaGraphs.

These are not committed: each builder writes ``<out_dir>/<name>.meta`` on first use and returns
the cached file afterwards. Building happens in a fresh Python subprocess, so the caller never
imports tf_keras, Keras' global name counters and learning phase start clean, and every build of
the same model gives the same node names.

Conventions (the same as tools/make_fixtures.py): root-level placeholders with a leading batch
dimension, resource variables, a scalar mean ``loss`` in the LOSSES collection, a global step and
the optimizer's ``minimize`` op in the TRAIN_OP ("train_op") collection; devices cleared.

- ``resnet50(out_dir)``: tf_keras ResNet50 (weights=None) on ``x`` [None,224,224,3] float32,
  labels ``y`` int64 [None], training-mode batch norm with its moving-average updates as control
  dependencies of the train op, MomentumOptimizer(0.1, 0.9).
- ``transformer(out_dir)``: a 24-layer post-LN transformer encoder from plain tf.compat.v1 ops on
  token ids ``ids`` int64 [None, seq], mean-pooled, dense to 2 classes, AdamOptimizer.
- ``densenet121(out_dir)``: tf_keras DenseNet121 (weights=None), built like ``resnet50``: the
  large graph of the memory benchmark (its 120 batch-norm updates wait on every gradient op).

Usage: python tools/models.py OUT_DIR [--model resnet50|transformer|all] [--force]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

# Bump when a builder changes, so cached files from an older builder are not reused.
BUILD_VERSION = 1


# ------------------------------------------------------------------ public API

def resnet50(out_dir: str | None = None, batch: int | None = None, force: bool = False) -> str:
    """Path of the ResNet-50 training MetaGraph in ``out_dir`` (built on first use)."""
    name = "resnet50" + (f"-b{batch}" if batch else "")
    return _cached(out_dir, name, {"model": "resnet50", "batch": batch}, force)


def transformer(out_dir: str | None = None, layers: int = 24, d_model: int = 256, heads: int = 4,
                seq: int = 64, vocab: int = 1000, force: bool = False) -> str:
    """Path of the transformer-encoder training MetaGraph in ``out_dir`` (built on first use)."""
    if d_model % heads:
        raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
    name = f"transformer-L{layers}-d{d_model}-h{heads}-s{seq}-v{vocab}"
    spec = {"model": "transformer", "layers": layers, "d_model": d_model, "heads": heads,
            "seq": seq, "vocab": vocab}
    return _cached(out_dir, name, spec, force)


def densenet121(out_dir: str | None = None, force: bool = False) -> str:
    """Path of the DenseNet-121 training MetaGraph in ``out_dir`` (built on first use)."""
    return _cached(out_dir, "densenet121", {"model": "densenet121"}, force)


MODELS = {"resnet50": resnet50, "transformer": transformer, "densenet121": densenet121}


def _cached(out_dir, name, spec, force) -> str:
    out_dir = out_dir or os.path.join(tempfile.gettempdir(), "graphxform-models")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.v{BUILD_VERSION}.meta")
    if force or not os.path.exists(path):
        _build_in_subprocess(spec, path)
    return path


def _build_in_subprocess(spec: dict, path: str) -> None:
    args = [sys.executable, os.path.abspath(__file__), "--_build", repr(spec), path]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    proc = subprocess.run(args, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(path):
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
        raise RuntimeError(f"building {spec['model']} failed (exit {proc.returncode}):\n{tail}")


# ------------------------------------------------------- builders (subprocess)

def _finish(g, loss, optimizer, extra_updates=()):
    """LOSSES, global step, train op (after ``extra_updates`` and UPDATE_OPS) in TRAIN_OP."""
    import tensorflow as tf
    v1 = tf.compat.v1
    v1.add_to_collection(v1.GraphKeys.LOSSES, loss)
    global_step = v1.train.get_or_create_global_step()
    updates = list(extra_updates)
    for op in v1.get_collection(v1.GraphKeys.UPDATE_OPS):
        if op not in updates:
            updates.append(op)
    with tf.control_dependencies(updates):
        train_op = optimizer.minimize(loss, global_step=global_step)
    if train_op not in v1.get_collection(v1.GraphKeys.TRAIN_OP):
        v1.add_to_collection(v1.GraphKeys.TRAIN_OP, train_op)
    return train_op


def _xent_loss(logits, y):
    import tensorflow as tf
    xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
    return tf.identity(tf.reduce_mean(xent), name="loss")


def _build_resnet50(batch=None):
    return _build_keras_application("ResNet50", batch)


def _build_densenet121():
    return _build_keras_application("DenseNet121")


def _build_keras_application(name: str, batch=None):
    """A tf_keras.applications model (weights=None) trained with Momentum(0.1, 0.9)."""
    import warnings

    import tensorflow as tf
    import tf_keras  # Keras 2: builds TF1 graph ops (tf.keras is Keras 3 and does not)
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [batch, 224, 224, 3], name="x")
        y = v1.placeholder(tf.int64, [batch], name="y")
        # Training mode: without it every BatchNormalization becomes an If on the
        # keras_learning_phase placeholder (functional control flow in the library).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with tf_keras.backend.learning_phase_scope(1):
                model = getattr(tf_keras.applications, name)(weights=None, input_tensor=x,
                                                             classifier_activation=None)
        loss = _xent_loss(model.output, y)
        # The moving mean/variance updates: keras does not put them in UPDATE_OPS.
        _finish(g, loss, v1.train.MomentumOptimizer(0.1, 0.9), extra_updates=model.updates)
    return g


def _layer_norm(h, scope, d, eps=1e-6):
    import tensorflow as tf
    v1 = tf.compat.v1
    with v1.variable_scope(scope):
        gamma = v1.get_variable("gamma", [d], initializer=v1.ones_initializer(), use_resource=True)
        beta = v1.get_variable("beta", [d], initializer=v1.zeros_initializer(), use_resource=True)
        mean, var = tf.nn.moments(h, axes=[-1], keepdims=True)
        return (h - mean) * tf.math.rsqrt(var + eps) * gamma + beta


def _proj(h, scope, n_in, n_out, act=None):
    """Dense layer on [batch, seq, n_in] -> [batch, seq, n_out]."""
    import tensorflow as tf
    v1 = tf.compat.v1
    with v1.variable_scope(scope):
        kernel = v1.get_variable("kernel", [n_in, n_out], use_resource=True,
                                 initializer=v1.glorot_uniform_initializer())
        bias = v1.get_variable("bias", [n_out], use_resource=True,
                               initializer=v1.zeros_initializer())
        out = tf.tensordot(h, kernel, axes=[[2], [0]]) + bias
        return act(out) if act else out


def _build_transformer(layers=24, d_model=256, heads=4, seq=64, vocab=1000):
    import tensorflow as tf
    v1 = tf.compat.v1
    dh = d_model // heads
    g = tf.Graph()
    with g.as_default():
        ids = v1.placeholder(tf.int64, [None, seq], name="ids")
        y = v1.placeholder(tf.int64, [None], name="y")
        with v1.variable_scope("embedding"):
            table = v1.get_variable("tokens", [vocab, d_model], use_resource=True,
                                    initializer=v1.random_normal_initializer(0.0, 0.02))
            pos = v1.get_variable("positions", [seq, d_model], use_resource=True,
                                  initializer=v1.random_normal_initializer(0.0, 0.02))
            h = tf.nn.embedding_lookup(table, ids) + pos

        def split_heads(t):  # [b, s, d] -> [b, heads, s, dh]
            return tf.transpose(tf.reshape(t, [-1, seq, heads, dh]), [0, 2, 1, 3])

        for i in range(layers):
            with v1.variable_scope(f"layer_{i}"):
                with v1.variable_scope("attention"):
                    q = split_heads(_proj(h, "query", d_model, d_model))
                    k = split_heads(_proj(h, "key", d_model, d_model))
                    v = split_heads(_proj(h, "value", d_model, d_model))
                    scores = tf.matmul(q, k, transpose_b=True) * (1.0 / dh ** 0.5)
                    ctx = tf.matmul(tf.nn.softmax(scores), v)
                    ctx = tf.reshape(tf.transpose(ctx, [0, 2, 1, 3]), [-1, seq, d_model])
                    att = _proj(ctx, "output", d_model, d_model)
                h = _layer_norm(h + att, "ln_attention", d_model)
                with v1.variable_scope("ffn"):
                    f = _proj(h, "dense_in", d_model, 4 * d_model, tf.nn.relu)
                    f = _proj(f, "dense_out", 4 * d_model, d_model)
                h = _layer_norm(h + f, "ln_ffn", d_model)
        pooled = tf.reduce_mean(h, axis=1)
        with v1.variable_scope("classifier"):
            w = v1.get_variable("kernel", [d_model, 2], use_resource=True,
                                initializer=v1.glorot_uniform_initializer())
            b = v1.get_variable("bias", [2], use_resource=True,
                                initializer=v1.zeros_initializer())
            logits = tf.matmul(pooled, w) + b
        loss = _xent_loss(logits, y)
        _finish(g, loss, v1.train.AdamOptimizer(1e-4))
    return g


def _export(g, path: str) -> None:
    """export_meta_graph to a temp file beside ``path``, then rename (no half-written cache)."""
    import tensorflow as tf
    parent = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=".models-", suffix=".meta")
    os.close(fd)
    try:
        with g.as_default():  # export_meta_graph refuses to run eagerly
            tf.compat.v1.train.export_meta_graph(filename=tmp, graph=g, clear_devices=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build_one(spec: dict, path: str) -> None:
    spec = dict(spec)
    model = spec.pop("model")
    builder = {"resnet50": _build_resnet50, "transformer": _build_transformer,
               "densenet121": _build_densenet121}[model]
    g = builder(**spec)
    _export(g, path)


# ------------------------------------------------------------------------ main

def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_build"]:  # internal: the subprocess side of _build_in_subprocess
        import ast
        _build_one(ast.literal_eval(argv[1]), argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory to build (or find) the .meta files in")
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = parser.parse_args(argv)
    from tensorflow.core.protobuf import meta_graph_pb2
    names = list(MODELS) if args.model == "all" else [args.model]
    for name in names:
        t0 = time.perf_counter()
        path = MODELS[name](args.out_dir, force=args.force)
        took = time.perf_counter() - t0
        with open(path, "rb") as f:
            meta = meta_graph_pb2.MetaGraphDef.FromString(f.read())
        n_vars = len(meta.collection_def["variables"].bytes_list.value)
        n_funcs = len(meta.graph_def.library.function)
        print(f"{name:12s} {len(meta.graph_def.node):6d} nodes  {n_vars:4d} variables  "
              f"{n_funcs} library functions  {os.path.getsize(path) / 2**20:7.2f} MiB  "
              f"{took:6.1f} s  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
