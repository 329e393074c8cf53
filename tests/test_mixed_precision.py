"""Mixed precision as the public recipes write it: NVIDIA's TF1 float32-master-weights getter
with a static loss scale, and tf_keras' mixed_float16 policy with a LossScaleOptimizer.

A float16 backward pass would carry N times one device's gradients in each replica, so a loss
scale near float16's top would overflow in a replica only (graphxform/gradient_scale.py):
passes/half_precision.py seeds each replica's backward pass with 1/N and multiplies each
gradient by N where it is born in float32, so every replica computes one device's per-example
gradients; where it cannot (tf_keras' LossScaleOptimizer applies its gradients inside a cond's
function, where they cannot be found), the step is refused. bfloat16 has float32's range: it
is transformed as it is. verify says how much either's rounding alone moves the result."""

import pytest
from conftest import export_classifier as _export


def master_weights_getter(dtype, loss_scale):
    """The NVIDIA mixed-precision training guide's TF1 recipe: variables stored in float32,
    cast to ``dtype`` by a custom getter; the loss scaled before tf.gradients, the gradients
    unscaled after."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    def float32_storage(getter, name, shape=None, dtype=None, initializer=None,
                        regularizer=None, trainable=True, *args, **kwargs):
        variable = getter(name, shape, dtype=tf.float32 if trainable else dtype,
                       initializer=initializer, regularizer=regularizer, trainable=trainable,
                       *args, **kwargs)
        return tf.cast(variable, dtype) if trainable and dtype != tf.float32 else variable

    def build(x, y):
        with tf1.variable_scope("fp32_vars", custom_getter=float32_storage):
            w1 = tf1.get_variable("w1", [8, 32], dtype,
                                  initializer=tf1.glorot_uniform_initializer(seed=1))
            w2 = tf1.get_variable("w2", [32, 2], dtype,
                                  initializer=tf1.glorot_uniform_initializer(seed=2))
            logits = tf.matmul(tf.nn.relu(tf.matmul(tf.cast(x, dtype), w1)), w2)
        loss = tf1.losses.sparse_softmax_cross_entropy(y, tf.cast(logits, tf.float32))
        optimizer = tf1.train.MomentumOptimizer(0.1, 0.9)
        grads = optimizer.compute_gradients(loss * loss_scale)
        return optimizer.apply_gradients([(g / loss_scale, v) for g, v in grads])
    return build


def keras_mixed_float16(x, y):
    """tf_keras' mixed-precision guide in a TF1 graph: the mixed_float16 policy, the output
    layer in float32, a LossScaleOptimizer (dynamic scale)."""
    import tensorflow as tf
    import tf_keras
    tf_keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        h = tf_keras.layers.Dense(32, activation="relu")(x)
        logits = tf_keras.layers.Dense(2, dtype="float32")(h)
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                         logits=logits))
    optimizer = tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.legacy.SGD(0.1))
    return tf.group(*optimizer.get_updates(loss, tf.compat.v1.trainable_variables()))


def _where(strategy, tmp_path) -> list:
    if strategy not in ("ps", "hybrid"):
        return ["--replicas", 2]
    cluster = tmp_path / "cluster.json"
    cluster.write_text('{"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]}')
    return ["--cluster", cluster]


@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_a_float16_backward_pass_trains_like_one_device(run_cli, tmp_path, strategy):
    """NVIDIA's recipe with a static loss scale of 30000: one device's gradients stay inside
    float16's range; each of 4 replicas' would be 4 times larger. Carried at one device's
    scale, they train like one device within float16's rounding, which verify names."""
    import tensorflow as tf
    model = _export(tmp_path / "m.meta", master_weights_getter(tf.float16, 30000.0))
    where = ["--replicas", 4] if strategy == "allreduce" else _where(strategy, tmp_path)
    code, out, err = run_cli("verify", "--strategy", strategy, *where, model, "--feeds",
                             model + ".npz", "--rtol", "1e-2")
    assert code == 0, out + err
    assert "PASS" in out and "computes in float16" in out and "--rtol 1e-2" in out


def test_float16_seeds_and_gradients_are_one_devices(tmp_path):
    """Each replica's seed holds 1/N and each gradient it applies is N times its float32 op."""
    import tensorflow as tf
    from graphxform import metagraph, strategies
    from graphxform.nodes import const_value
    model = _export(tmp_path / "m.meta", master_weights_getter(tf.float16, 7000.0))
    ir = metagraph.load(model)
    strategies.transform(ir, "allreduce", devices=[f"/device:CPU:{i}" for i in range(4)])
    for i in range(4):
        fill = ir.inputs(f"replica_{i}/gradients/grad_ys_0")[1][0]
        assert const_value(ir, fill) == 0.25
        muls = [n for n in ir.nodes() if n.startswith(f"replica_{i}/gradients/")
                and ir.node(n).get("created_by") == "half-precision" and ir.op(n) == "Mul"]
        assert len(muls) == 2, muls  # w1's and w2's


def test_a_float16_gradient_of_a_float16_variable_is_refused(run_cli, tmp_path):
    """Pure float16 training (variables stored in float16): a gradient born in float16 cannot
    be multiplied by N there without the overflow this avoids."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    def build(x, y):
        w = tf1.get_variable("w", [8, 2], tf.float16,
                             initializer=tf1.glorot_uniform_initializer(seed=1))
        logits = tf.cast(tf.matmul(tf.cast(x, tf.float16), w), tf.float32)
        loss = tf1.losses.sparse_softmax_cross_entropy(y, logits)
        return tf1.train.GradientDescentOptimizer(0.1).minimize(loss * 128.0)
    model = _export(tmp_path / "m.meta", build)
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")
    assert code == 1, err
    assert "computes in float16" in err and "is born in float16" in err
    assert len(err.strip().splitlines()) == 1


def test_keras_mixed_float16_with_a_loss_scale_optimizer_is_refused(run_cli, tmp_path):
    model = _export(tmp_path / "m.meta", keras_mixed_float16)
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")
    assert code == 1 and "computes in float16" in err, err


def test_a_bfloat16_backward_pass_trains_within_its_rounding(run_cli, tmp_path):
    """bfloat16 cannot overflow where float32 does not; its sums over each replica's slice
    round differently from one device's, which verify names, and within that the transformed
    graph trains like the original."""
    import tensorflow as tf
    model = _export(tmp_path / "m.meta", master_weights_getter(tf.bfloat16, 1024.0))
    code, out, err = run_cli("verify", "--replicas", 2, model, "--feeds", model + ".npz",
                             "--rtol", "2e-2")
    assert code == 0, out + err
    assert "PASS" in out and "computes in bfloat16" in out and "--rtol 1e-2" in out
