"""The analysis finds, by name, the variables, updates, gradients and slots of each fixture."""

import pytest
from conftest import fixture_path, graph_without_train_op

from graphxform import metagraph, training

MLP_VARS = ["dense0/kernel", "dense0/bias", "dense1/kernel", "dense1/bias"]


def analyze(name):
    return training.analyze(metagraph.load(fixture_path(name)))


def dense_grad(scope, op, port):
    return f"gradients/{scope}/{op}_grad/tuple/control_dependency{port}:0"


@pytest.mark.parametrize("name", ["mlp_sgd", "mlp_saver"])
def test_mlp_sgd(name):
    tg = analyze(name)
    assert tg.train_op == "GradientDescent"
    assert tg.loss == "loss:0"
    assert tg.global_step == "global_step"
    assert tg.optimizer.kind == "GradientDescent"
    assert set(tg.variables) == set(MLP_VARS) | {"global_step"}
    for var in MLP_VARS:
        v = tg.variables[var]
        assert v.trainable and v.role == "trainable" and v.slots == {}
        assert v.updates == [f"GradientDescent/update_{var}/ResourceApplyGradientDescent"]
    assert tg.variables["dense0/kernel"].gradient == training.Gradient(
        "dense", tensor=dense_grad("dense0", "MatMul", "_1"))
    assert tg.variables["dense1/bias"].gradient == training.Gradient(
        "dense", tensor=dense_grad("dense1", "add", "_1"))
    assert tg.variables["dense0/kernel"].shape == (8, 16)
    assert tg.variables["dense0/kernel"].nbytes == 8 * 16 * 4
    assert tg.variables["global_step"].role == "global_step"
    assert [(i.name, i.batched) for i in tg.inputs] == [("x", True), ("y", True)]


def test_saver_nodes_are_not_inputs_or_updates():
    tg = analyze("mlp_saver")
    assert tg.saver_scope == "save/"
    assert all(not u.startswith("save/") for v in tg.variables.values() for u in v.updates)


@pytest.mark.parametrize("name, apply_op", [("cnn_momentum", "ResourceApplyMomentum"),
                                            ("legacy_ref", "ApplyMomentum")])
def test_momentum_slots(name, apply_op):
    tg = analyze(name)
    trainable = {v.name for v in tg.variables.values() if v.role == "trainable"}
    expected = ({"conv0/kernel", "conv0/bias", "dense0/kernel", "dense0/bias"}
                if name == "cnn_momentum" else set(MLP_VARS))
    assert trainable == expected
    for var in expected:
        v = tg.variables[var]
        assert v.slots == {"accum": f"{var}/Momentum"}
        assert tg.variables[f"{var}/Momentum"].role == "slot"
        assert tg.variables[f"{var}/Momentum"].slot_of == var
        assert v.updates == [f"Momentum/update_{var}/{apply_op}"]
        assert v.gradient.kind == "dense"
    assert tg.optimizer.kind == "Momentum"
    assert set(tg.optimizer.hyperparameters) == {"lr", "momentum"}
    kinds = {v.kind for v in tg.variables.values()}
    assert kinds == ({"resource"} if name == "cnn_momentum" else {"ref"})


def test_conv_gradient_names():
    tg = analyze("cnn_momentum")
    assert tg.variables["conv0/kernel"].gradient.tensor == dense_grad("conv0", "Conv2D", "_1")
    assert tg.variables["conv0/bias"].gradient.tensor == dense_grad("conv0", "BiasAdd", "_1")


def test_batch_norm_statistics():
    tg = analyze("cnn_bn_momentum")
    for stat in ("bn0/moving_mean", "bn0/moving_variance"):
        v = tg.variables[stat]
        assert v.role == "statistic" and not v.trainable
    assert tg.variables["bn0/moving_mean"].updates == ["bn0/update_moving_mean"]
    assert tg.variables["bn0/moving_variance"].updates == ["bn0/update_moving_variance"]
    assert {"bn0/update_moving_mean", "bn0/update_moving_variance"} <= set(tg.extra_updates)
    assert tg.variables["bn0/gamma"].gradient.tensor == \
        "gradients/bn0/batchnorm/mul_grad/tuple/control_dependency_1:0"
    assert tg.variables["bn0/beta"].gradient.tensor == \
        "gradients/bn0/batchnorm/sub_grad/tuple/control_dependency:0"


def test_embedding_adam_sparse_path():
    tg = analyze("embedding_adam")
    emb = tg.variables["embedding/weights"]
    assert emb.gradient == training.Gradient(
        "sparse", values="gradients/embedding/embedding_lookup_grad/Reshape:0",
        indices="gradients/embedding/embedding_lookup_grad/Reshape_1:0")
    assert emb.slots == {"Adam": "embedding/weights/Adam", "Adam_1": "embedding/weights/Adam_1"}
    assert emb.updates == ["Adam/update_embedding/weights/AssignSubVariableOp"]
    assert set(tg.variables["embedding/weights/Adam"].updates) == {
        "Adam/update_embedding/weights/AssignVariableOp",
        "Adam/update_embedding/weights/ResourceScatterAdd"}
    kernel = tg.variables["dense0/kernel"]
    assert kernel.slots == {"m": "dense0/kernel/Adam", "v": "dense0/kernel/Adam_1"}
    assert kernel.updates == ["Adam/update_dense0/kernel/ResourceApplyAdam"]
    assert kernel.gradient.kind == "dense"
    for power in ("beta1_power", "beta2_power"):
        assert tg.variables[power].role == "optimizer_state"
    assert tg.optimizer.kind == "Adam"
    assert "beta1" in tg.optimizer.hyperparameters
    assert [(i.name, i.batched) for i in tg.inputs] == [("ids", True), ("y", True)]


@pytest.mark.parametrize("name", ["rnn_while", "rnn_while_legacy"])
def test_while_loop_gradients(name):
    tg = analyze(name)
    for var in ("rnn/kernel", "rnn/bias", "dense0/kernel", "dense0/bias"):
        assert tg.variables[var].gradient.kind == "dense", var
    if name == "rnn_while":
        assert tg.variables["rnn/kernel"].gradient.tensor == \
            "gradients/rnn/while_grad/tuple/control_dependency_2:0"
    else:
        assert tg.variables["rnn/kernel"].gradient.tensor == \
            "gradients/rnn/while/MatMul/ReadVariableOp/Enter_grad/b_acc_3:0"


def test_graph_without_training_step_is_inspectable():
    from graphxform.errors import GraphxformError
    ir = graph_without_train_op()
    tg = training.analyze(ir)
    assert tg.train_op is None and tg.variables == {}
    with pytest.raises(GraphxformError, match="no train op"):
        tg.require_train_op("allreduce")


def identity_n_step(x, y):
    """Gradients handed to the optimizer through one tf.identity_n, as tf_keras' legacy
    optimizers' get_updates hands them."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    from test_custom_training_code import dense
    loss = tf1.losses.sparse_softmax_cross_entropy(y, dense(dense(x, 8, "hidden", tf.nn.relu),
                                                            2, "logits"))
    variables = tf1.trainable_variables()
    grads = tf.identity_n(tf.gradients(loss, variables), name="passed")
    return tf1.train.AdamOptimizer(0.01).apply_gradients(zip(grads, variables))


def test_each_gradient_through_an_identity_n_is_its_own(run_cli, tmp_path):
    """Every variable's gradient used to be taken as the first one the IdentityN reads, so
    apply refused the graph (the others were never reduced)."""
    from conftest import export_classifier
    model = export_classifier(tmp_path / "m.meta", identity_n_step)
    tg = training.analyze(metagraph.load(model))
    born = {name: v.gradient.tensor for name, v in tg.variables.items() if v.trainable}
    assert born["hidden/kernel"].startswith("gradients/hidden/MatMul_grad/")
    assert len(set(born.values())) == 4
    code, out, err = run_cli("verify", "--replicas", 2, model, "--feeds", model + ".npz",
                             "--batch-size", 16)
    assert code == 0, err
    assert "PASS" in out


def keras_legacy_adam_embedding_step(x, y):
    """A tf_keras Embedding under tf_keras' legacy Adam in graph mode (``get_updates``): its
    sparse update scatters into slots named ``Adam/<var>/m`` and assigns the variable from
    them, with no Apply op."""
    import tensorflow as tf
    import tf_keras
    tf1 = tf.compat.v1
    # Keras's unseeded initializers draw from Python's random module, so the start would
    # depend on the tests run before; Adam's sign-like steps on rows whose gradients nearly
    # cancel turn rounding into differences up to 2e-5 from some starts
    tf_keras.utils.set_random_seed(0)
    ids = tf.cast(tf.abs(x[:, :4]) * 10, tf.int64) % 30
    embedding, dense = tf_keras.layers.Embedding(30, 4), tf_keras.layers.Dense(2)
    logits = dense(tf_keras.layers.Flatten()(embedding(ids)))
    loss = tf.reduce_mean(tf_keras.losses.sparse_categorical_crossentropy(y, logits,
                                                                          from_logits=True))
    tf1.add_to_collection(tf1.GraphKeys.LOSSES, loss)
    optimizer = tf_keras.optimizers.legacy.Adam(0.01)
    return tf.group(*optimizer.get_updates(loss, embedding.trainable_weights
                                           + dense.trainable_weights))


def test_a_keras_legacy_adam_sparse_update_finds_its_gradient_and_slots(run_cli, tmp_path):
    """The update reads only the slots, and the slots (outside the variable's name scope) were
    not linked, so the embedding's gradient was not found and allreduce refused the graph."""
    from conftest import export_classifier
    model = export_classifier(tmp_path / "m.meta", keras_legacy_adam_embedding_step)
    var = training.analyze(metagraph.load(model)).variables["embedding/embeddings"]
    assert var.gradient.kind == "sparse"
    assert var.gradient.values.startswith("Adam/gradients/gradients/embedding/embedding_lookup")
    assert var.slots == {"m": "Adam/embedding/embeddings/m", "v": "Adam/embedding/embeddings/v"}
    for replicas in (2, 4):
        code, out, err = run_cli("verify", "--replicas", replicas, model, "--feeds",
                                 model + ".npz", "--batch-size", 16, "--steps", 3)
        assert code == 0, out + err
        assert "PASS" in out
