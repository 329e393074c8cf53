import os
import pathlib

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
ALL_FIXTURES = ["mlp_sgd", "cnn_momentum", "cnn_bn_momentum", "embedding_adam", "legacy_ref",
                "rnn_while", "rnn_while_legacy", "mlp_saver"]


def fixture_path(name: str, ext: str = ".meta") -> str:
    return str(FIXTURES / (name + ext))


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
