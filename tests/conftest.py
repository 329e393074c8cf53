import os
import pathlib

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
ALL_FIXTURES = ["mlp_sgd", "cnn_momentum", "cnn_bn_momentum", "embedding_adam", "legacy_ref",
                "rnn_while", "rnn_while_legacy", "mlp_saver"]


def fixture_path(name: str, ext: str = ".meta") -> str:
    return str(FIXTURES / (name + ext))


def mlp_single_device(steps: int, directory, batch: int):
    """The mlp_sgd original on one device: its start checkpoint (saved under ``directory``),
    its losses over ``steps`` steps of its fixture's feeds and its variables after them."""
    from graphxform import metagraph, training
    from graphxform.runtime import Feeds, Runner
    original = metagraph.load(fixture_path("mlp_sgd"))
    feeds = Feeds(training.analyze(original).inputs, fixture_path("mlp_sgd", ".npz"), batch)
    with Runner(original) as run:
        run.initialize()
        start = run.save(str(pathlib.Path(directory) / "start"))
        losses = [run.step(feeds.batch(k)).loss for k in range(steps)]
        return start, losses, run.variable_values()


def dense(x, units, name):
    """A dense layer as tf.compat.v1 code writes it: ``name/kernel`` and ``name/bias``."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    with tf1.variable_scope(name):
        w = tf1.get_variable("kernel", [x.shape[-1], units])
        b = tf1.get_variable("bias", [units], initializer=tf1.zeros_initializer())
        return tf.matmul(x, w) + b


def export_classifier(path, build, batch=None) -> str:
    """Write ``path`` (.meta) and ``path``.npz for a step ``build(x, y)`` returns, where x is a
    [batch, 8] float placeholder and y an int64 [batch] label placeholder; the pool's labels
    follow a fixed rule of x (learnable). Returns the .meta path."""
    import numpy as np
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(1)
        x = tf1.placeholder(tf.float32, [batch, 8], name="x")
        y = tf1.placeholder(tf.int64, [batch], name="y")
        tf1.add_to_collection("train_op", build(x, y))
        tf1.train.export_meta_graph(str(path), graph=graph)
    rng = np.random.RandomState(0)
    xs = rng.randn(64, 8).astype(np.float32)
    np.savez(str(path) + ".npz", x=xs, y=(xs[:, 0] > 0).astype(np.int64))
    return str(path)


def pytest_addoption(parser):
    parser.addoption("--update-goldens", action="store_true",
                     help="Rewrite tests/golden/*.txt from the current printer output.")


@pytest.fixture
def update_goldens(request):
    return request.config.getoption("--update-goldens")


@pytest.fixture
def run_cli(capsys):
    """Run the CLI in-process; returns (exit code, stdout, stderr)."""
    from graphxform import cli

    def run(*args):
        code = 0
        try:
            cli.main([str(a) for a in args])
        except SystemExit as e:
            code = e.code or 0
        out, err = capsys.readouterr()
        return code, out, err
    return run


def graph_without_train_op():
    """A GraphIR of an inference-only graph: a placeholder and one op, no training step."""
    import tensorflow as tf

    from graphxform.metagraph import from_metagraph
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        tf.identity(x * 2.0, name="y")
    return from_metagraph(tf.compat.v1.train.export_meta_graph(graph_def=g.as_graph_def(),
                                                               graph=g))
