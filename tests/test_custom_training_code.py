"""Training code the passes cannot see into, as public recipes write it: a custom gradient
(``tf.custom_gradient``, ``gradient_override_map``) and an optimizer applied inside a
``tf.while_loop`` body (control flow v2 keeps it in the function library). What can be
proven is transformed and trains like one device; the rest is refused in one line naming the
op, with no output written."""

import pytest
from conftest import export_classifier as _export


def dense(x, units, name, activation=None):
    """A dense layer from tf.compat.v1 variables (tf.compat.v1.layers needs legacy Keras)."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    with tf1.variable_scope(name):
        w = tf1.get_variable("kernel", [x.shape[-1], units])
        b = tf1.get_variable("bias", [units], initializer=tf1.zeros_initializer())
        out = tf.matmul(x, w) + b
        return activation(out) if activation else out


def custom_gradient_model(gradient):
    """A hidden layer whose gradient ``gradient(dy)`` replaces the identity's."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    def build(x, y):
        @tf.custom_gradient
        def through(t):
            return tf.identity(t), gradient
        h = through(dense(x, 16, "hidden", tf.nn.relu))
        loss = tf1.losses.sparse_softmax_cross_entropy(y, dense(h, 2, "logits"))
        step = tf1.train.get_or_create_global_step()
        return tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, global_step=step)
    return build


def test_a_linear_custom_gradient_trains_like_one_device(run_cli, tmp_path):
    import tensorflow as tf
    # gradient reversal, as domain-adversarial training writes it, at half strength
    model = _export(tmp_path / "m.meta", custom_gradient_model(lambda dy: tf.negative(dy) * 0.5))
    code, out, err = run_cli("verify", "--replicas", 2, model, "--feeds", model + ".npz",
                             "--batch-size", 16)
    assert code == 0, err
    assert "PASS" in out


def test_a_custom_gradient_that_clips_its_input_is_refused(run_cli, tmp_path):
    import tensorflow as tf
    model = _export(tmp_path / "m.meta",
                    custom_gradient_model(lambda dy: tf.clip_by_value(dy, -0.01, 0.01)))
    out = tmp_path / "out.meta"
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", out)
    assert code == 1
    assert len(err.strip().splitlines()) == 1
    assert "'IdentityN' has a custom gradient" in err and "not linear" in err
    assert not out.exists()


def test_a_nonlinear_gradient_override_is_refused(run_cli, tmp_path):
    import tensorflow as tf
    tf1 = tf.compat.v1

    @tf.RegisterGradient("GraphxformTestSignGradient")
    def _sign(op, dy):  # signSGD-style: only the gradient's sign goes back
        return tf.sign(dy)

    def build(x, y):
        graph = tf1.get_default_graph()
        with graph.gradient_override_map({"Identity": "GraphxformTestSignGradient"}):
            h = tf.identity(dense(x, 16, "hidden", tf.nn.relu), name="signed")
        loss = tf1.losses.sparse_softmax_cross_entropy(y, dense(h, 2, "logits"))
        return tf1.train.GradientDescentOptimizer(0.1).minimize(loss)

    model = _export(tmp_path / "m.meta", build)
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")
    assert code == 1
    assert "'signed' has a custom gradient whose 'gradients/signed_grad/Sign' (Sign)" in err


def loop_model(collection_too):
    """Two SGD steps per run inside a tf.while_loop body (control flow v2); the optimizer adds
    its op, made inside the body, to the 'train_op' collection unless removed."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    def build(x, y):
        w = tf1.get_variable("w", [8, 2])
        optimizer = tf1.train.GradientDescentOptimizer(0.1)

        def body(i):
            logits = tf.matmul(x, w)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=logits))
            with tf.control_dependencies([optimizer.minimize(loss)]):
                return i + 1

        loop = tf1.while_loop(lambda i: i < 2, body, [tf.constant(0)])
        if not collection_too:
            tf1.get_collection_ref("train_op").clear()
        return loop
    return build


def test_training_inside_a_while_loop_is_refused(run_cli, tmp_path):
    model = _export(tmp_path / "m.meta", loop_model(collection_too=False))
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")
    assert code == 1
    assert len(err.strip().splitlines()) == 1
    assert "'while' (While) runs function" in err and "updates 'w' (ResourceApply" in err
    assert not (tmp_path / "out.meta").exists()


def test_a_train_op_collection_naming_an_op_inside_the_loop_is_a_clear_error(run_cli,
                                                                              tmp_path):
    model = _export(tmp_path / "m.meta", loop_model(collection_too=True))
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")
    assert code == 1
    assert "collection 'train_op' names 'GradientDescent', which is not a node" in err


@pytest.mark.parametrize("strategy", ["ps", "model-average"])
def test_other_strategies_keep_the_same_guard(run_cli, tmp_path, strategy):
    """ps averages gradients like allreduce; model-average trains each replica on its own and
    averages the variables, which a loop body does not defeat."""
    import tensorflow as tf
    model = _export(tmp_path / "m.meta",
                    custom_gradient_model(lambda dy: tf.clip_by_value(dy, -0.01, 0.01)))
    args = ["apply", "--strategy", strategy, model, "-o", tmp_path / "out.meta"]
    if strategy == "ps":
        cluster = tmp_path / "cluster.json"
        cluster.write_text('{"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]}')
        args += ["--cluster", cluster]
    else:
        args += ["--replicas", 2]
    code, _, err = run_cli(*args)
    if strategy == "ps":
        assert code == 1 and "not linear" in err
    else:
        assert code == 0, err


def dropout_under_cond(legacy_control_flow):
    """Dropout only while training, as ``tf.compat.v1.layers.dropout(training=is_training)``
    writes it: a tf.cond on a placeholder_with_default (control flow v2 keeps the random op
    in the cond's branch function; v1 keeps it in the graph)."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    def build(x, y):
        if legacy_control_flow:
            tf1.disable_control_flow_v2()
        try:
            training = tf1.placeholder_with_default(True, [], name="is_training")
            h = dense(x, 32, "hidden", tf.nn.relu)
            h = tf.cond(training, lambda: tf.nn.dropout(h, rate=0.5, seed=3), lambda: h,
                        name="dropout")
            loss = tf1.losses.sparse_softmax_cross_entropy(y, dense(h, 2, "logits"))
        finally:
            if legacy_control_flow:
                tf1.enable_control_flow_v2()
        return tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    return build


def _fails_and_option_refused(run_cli, tmp_path, build, option) -> tuple[str, str]:
    """(verify's output, apply's error) for the graph ``build`` makes: verify fails on 2
    replicas, and apply with ``option`` refuses in one line and writes nothing."""
    model = _export(tmp_path / "m.meta", build)
    code, out, _ = run_cli("verify", "--replicas", 2, model, "--feeds", model + ".npz",
                           "--batch-size", 16)
    assert code == 1 and "FAIL" in out
    code, _, err = run_cli("apply", "--replicas", 2, option, model, "-o", tmp_path / "out.meta")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out.meta").exists()
    return out, err


def test_dropout_inside_a_cond_function_is_named_and_consistent_random_refused(run_cli,
                                                                               tmp_path):
    out, err = _fails_and_option_refused(run_cli, tmp_path,
                                         dropout_under_cond(legacy_control_flow=False),
                                         "--consistent-random")
    assert "random ops inside the functions the step calls" in out
    assert "dropout (RandomUniform)" in out and "amplifies rounding" not in out
    assert "'dropout' (If) draws random numbers (RandomUniform) inside its function" in err


def test_dropout_inside_a_legacy_cond_is_made_consistent(run_cli, tmp_path):
    model = _export(tmp_path / "m.meta", dropout_under_cond(legacy_control_flow=True))
    code, out, err = run_cli("verify", "--replicas", 2, "--consistent-random", model,
                             "--feeds", model + ".npz", "--batch-size", 16)
    assert code == 0, err
    assert "PASS" in out


def flips_in_a_legacy_map_fn(x, y):
    """A random augmentation per example, tf.map_fn under control flow v1 (TF1 scripts run on
    TF2 with disable_v2_behavior): the draw is inside the loop, afresh at every iteration."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    tf1.disable_control_flow_v2()
    try:
        flipped = tf.map_fn(lambda row: tf1.where(tf1.random_uniform([], seed=5) < 0.5,
                                                  row, -row), x)
    finally:
        tf1.enable_control_flow_v2()
    loss = tf1.losses.sparse_softmax_cross_entropy(y, dense(flipped, 2, "logits"))
    return tf1.train.GradientDescentOptimizer(0.1).minimize(loss)


def actions_sampled_per_example(x, y):
    """REINFORCE's action sampled from each example's logits by tf.random.categorical."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    logits = dense(x, 2, "policy")
    action = tf.stop_gradient(tf.random.categorical(logits, 1, seed=9)[:, 0])
    reward = tf.cast(tf.equal(action, y), tf.float32)
    loss = tf.reduce_mean(reward * tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=action, logits=logits))
    return tf1.train.GradientDescentOptimizer(0.1).minimize(loss)


@pytest.mark.parametrize("build, op", [(flips_in_a_legacy_map_fn, "RandomUniform"),
                                       (actions_sampled_per_example, "Multinomial")])
def test_draws_consistent_random_cannot_reach_are_named_and_refused(run_cli, tmp_path, build,
                                                                     op):
    """--consistent-random exited 0 on both: it hoisted a loop's draw out of its frame (TF
    then refused the graph) or left it alone (each replica replayed replica 0's draws), and
    did nothing for the categorical draw; verify blamed float rounding for the first and
    recommended the option already given for the second."""
    out, err = _fails_and_option_refused(run_cli, tmp_path, build, "--consistent-random")
    assert "--consistent-random cannot reach them" in out and f"/{op})" in out
    assert "amplifies rounding" not in out
    assert f"({op}) draws" in err and "drop the option" in err


def quantiles_drawn_quantile_major(x, y):
    """Dopamine's implicit quantile network: N quantiles per example drawn as one
    [N * batch, 1] tensor, row n * batch + i for example i, then reshaped to [N, batch]."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    tf1.set_random_seed(3)
    quantiles = 4
    batch = tf.shape(x)[0]
    taus = tf1.random_uniform(tf.stack([quantiles * batch, 1]), seed=1)
    h = tf.tile(dense(x, 4, "torso", tf.nn.relu), [quantiles, 1])
    q = tf.reshape(dense(h * tf.cos(taus * 3.14159), 1, "out"), [quantiles, batch])
    loss = tf.reduce_mean(tf.square(q - tf.cast(y, tf.float32)[None, :]) *
                          tf.reshape(taus, [quantiles, batch]))
    return tf1.train.GradientDescentOptimizer(0.1).minimize(loss)


def test_a_draw_whose_rows_are_not_the_examples_is_refused_by_consistent_random(run_cli,
                                                                                 tmp_path):
    """The pass gave each replica a block of the draw's rows as if row k were example k's:
    apply exited 0 and verify failed by 3.3e-01, with no reason (found by a helper's probe)."""
    model = _export(tmp_path / "m.meta", quantiles_drawn_quantile_major)
    code, _, err = run_cli("apply", "--replicas", 2, "--consistent-random", model,
                           "-o", tmp_path / "out.meta")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "'random_uniform/RandomUniform' (RandomUniform) draws a shape whose first entry" in err
    assert "drop the option" in err


def batch_norm_under_a_training_flag(x, y):
    """Batch norm as tf.compat.v1.layers and tf_keras build it for a training flag that is a
    tensor: a tf.cond (control flow v2) between the training-mode fused batch norm and the
    inference one."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    training = tf1.placeholder_with_default(True, [], name="is_training")
    h = tf.reshape(dense(x, 4, "hidden"), [-1, 1, 1, 4])
    scale = tf1.get_variable("bn/gamma", [4], initializer=tf1.ones_initializer())
    offset = tf1.get_variable("bn/beta", [4], initializer=tf1.zeros_initializer())
    normed = tf.cond(training,
                     lambda: tf1.nn.fused_batch_norm(h, scale, offset, is_training=True)[0],
                     lambda: tf1.nn.fused_batch_norm(h, scale, offset, tf.zeros([4]),
                                                     tf.ones([4]), is_training=False)[0],
                     name="bn")
    loss = tf1.losses.sparse_softmax_cross_entropy(y, dense(tf.reshape(normed, [-1, 4]), 2,
                                                            "logits"))
    return tf1.train.GradientDescentOptimizer(0.1).minimize(loss)


def test_batch_norm_inside_a_cond_function_is_named_and_sync_refused(run_cli, tmp_path):
    """--sync-batch-norm printed 'nothing to synchronise' and exited 0 (verify then failed by
    3.8e-01 and recommended the option given)."""
    out, err = _fails_and_option_refused(run_cli, tmp_path, batch_norm_under_a_training_flag,
                                         "--sync-batch-norm")
    assert "batch norm in training mode inside the functions the step calls" in out
    assert "bn (FusedBatchNormV3)" in out and "--sync-batch-norm (--strategy allreduce) uses" \
        not in out
    assert "'bn' (If) runs a training-mode batch norm (FusedBatchNormV3)" in err


def accumulated_over_runs(x, y):
    """Gradient accumulation as TF1 answers write it: variables zeroed by one op, each
    micro-batch's gradients added into them by another (run once per micro-batch), and a
    train op that applies them; the train op reads no batch."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    loss = tf1.losses.sparse_softmax_cross_entropy(y, dense(dense(x, 8, "hidden", tf.nn.relu),
                                                            2, "logits"))
    optimizer = tf1.train.MomentumOptimizer(0.1, 0.9)
    pairs = optimizer.compute_gradients(loss)
    kept = [tf1.get_variable(v.op.name + "_sum", v.shape, trainable=False,
                             initializer=tf1.zeros_initializer()) for _, v in pairs]
    tf.group(*[k.assign(tf.zeros_like(k)) for k in kept], name="zero")
    tf.group(*[k.assign_add(g) for k, (g, _) in zip(kept, pairs)], name="accumulate")
    return optimizer.apply_gradients([(k / 4.0, v) for k, (_, v) in zip(kept, pairs)])


def test_gradients_accumulated_over_runs_are_refused(run_cli, tmp_path):
    """apply exited 0: 'accumulate' runs outside the train op, so no gradient was reduced and
    both replicas added their slice's mean into the shared sums (twice the gradient)."""
    model = _export(tmp_path / "m.meta", accumulated_over_runs)
    out = tmp_path / "out.meta"
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", out)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "variable 'hidden/bias_sum'" in err and "stores the gradient" in err
    assert "outside the train op" in err
    assert not out.exists()


def accumulated_by_a_train_op(x, y):
    """The same recipe with the accumulation a train op of its own: the user runs
    'accumulate' on each micro-batch, then the train op that applies the sums."""
    import tensorflow as tf
    apply = accumulated_over_runs(x, y)
    tf.compat.v1.add_to_collection("train_op", tf.compat.v1.get_default_graph()
                                   .get_operation_by_name("accumulate"))
    return apply


@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_gradients_accumulated_by_another_train_op_are_refused(run_cli, tmp_path, strategy):
    """allreduce refused it for a gradient it could not find and ps with a pass error about
    nothing to aggregate: both now name the accumulation."""
    model = _export(tmp_path / "m.meta", accumulated_by_a_train_op)
    cluster = tmp_path / "cluster.json"
    cluster.write_text('{"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2224", '
                       '"127.0.0.1:2225"]}')
    where = ["--replicas", 2] if strategy == "allreduce" else ["--cluster", cluster]
    out = tmp_path / "out.meta"
    code, _, err = run_cli("apply", "--strategy", strategy, *where, model, "-o", out)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "variable 'hidden/bias_sum'" in err and "stores the gradient" in err
    assert "outside the train op that applies it ('Momentum'" in err
    assert not out.exists()


def accumulated_in_a_loop(x, y):
    """In-graph gradient accumulation: a while loop (control flow v2) over two micro-batches
    adds up their tf.gradients, and the sum is applied after it."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    w = tf1.get_variable("w", [8, 2])
    xs, ys = tf.reshape(x, [2, -1, 8]), tf.reshape(y, [2, -1])

    def body(i, total):
        logits = tf.matmul(tf.gather(xs, i), w)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.gather(ys, i), logits=logits))
        return i + 1, total + tf.gradients(loss, w)[0]

    _, total = tf1.while_loop(lambda i, _: i < 2, body, [tf.constant(0), tf.zeros_like(w)])
    return tf1.train.GradientDescentOptimizer(0.1).apply_gradients([(total / 2.0, w)])


def test_gradients_accumulated_in_a_loop_are_refused_naming_the_loop(run_cli, tmp_path):
    model = _export(tmp_path / "m.meta", accumulated_in_a_loop)
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "variable 'w'" in err and "comes out of the while loop 'while'" in err
    assert "take the gradient outside it" in err


def sync_replicas(x, y):
    """A graph already distributed by hand: tf.compat.v1.train.SyncReplicasOptimizer."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    loss = tf1.losses.sparse_softmax_cross_entropy(y, dense(x, 2, "logits"))
    optimizer = tf1.train.SyncReplicasOptimizer(tf1.train.GradientDescentOptimizer(0.1),
                                                replicas_to_aggregate=1, total_num_replicas=1)
    return optimizer.minimize(loss, global_step=tf1.train.get_or_create_global_step())


def test_a_graph_distributed_by_hand_is_refused(run_cli, tmp_path):
    """It used to be refused for its token queue, read as an input pipeline with num_epochs."""
    model = _export(tmp_path / "m.meta", sync_replicas)
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "already combines gradients across workers" in err
    assert "(ResourceConditionalAccumulator)" in err


def momentum_by_hand(x, y):
    """Heavy-ball momentum as LARS-style code writes it with resource variables:
    ``m_new = m.assign(0.9 * m + g); w.assign_sub(lr * m_new)``. The assign returns a read of
    ``m`` that waits on the write, so the gradient's trace ended at ``m`` and the update was
    refused as 'not found where tf.gradients produced it' (ps: 'no gradient ... found')."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    w = tf1.get_variable("w", [8, 2])
    loss = tf1.losses.sparse_softmax_cross_entropy(y, tf.matmul(x, w))
    m = tf1.get_variable("w/momentum", [8, 2], initializer=tf1.zeros_initializer(),
                         trainable=False)
    grad, = tf.gradients(loss, [w])
    m_new = m.assign(0.9 * m + grad)
    with tf.control_dependencies([w.assign_sub(0.1 * m_new)]):
        return tf1.train.get_or_create_global_step().assign_add(1)


@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_an_update_from_the_value_an_assign_returns_trains_like_one_device(run_cli, tmp_path,
                                                                            strategy):
    model = _export(tmp_path / "m.meta", momentum_by_hand)
    where = ["--replicas", 2]
    if strategy == "ps":
        (tmp_path / "c.json").write_text('{"ps": ["127.0.0.1:2222"], "worker": '
                                         '["127.0.0.1:2224", "127.0.0.1:2225"]}')
        where = ["--cluster", tmp_path / "c.json"]
    code, out, err = run_cli("verify", "--strategy", strategy, *where, model, "--feeds",
                             model + ".npz", "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err
