"""How the command starts and ends: graphxform.tf_import (TensorFlow's core alone, the whole
API on demand) and cli.console_main (no teardown, yet every error still said).

Each case runs in a fresh interpreter: the stand-in only exists before `tensorflow` is
imported, which this test process did long ago."""

import os
import subprocess
import sys

from tests.conftest import fixture_path

TIMEOUT_S = 120


def _python(code: str) -> list[str]:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_USE_LEGACY_KERAS="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_apply_and_inspect_never_import_the_api(tmp_path):
    """What makes `apply` start 2 s sooner: it needs protobufs, the op registry and the C
    importer, not tensorflow/__init__.py."""
    out = tmp_path / "out.meta"
    printed = _python(
        "import sys\n"
        "from graphxform import cli\n"
        f"assert cli._main(['apply', '--replicas', '2', {fixture_path('mlp_sgd')!r}, "
        f"'-o', {str(out)!r}], False) == 0\n"
        f"assert cli._main(['inspect', {str(out)!r}], False) == 0\n"
        "print(type(sys.modules['tensorflow']).__name__)\n")
    assert printed[-1] == "_StandIn"
    assert out.exists()


def test_the_api_arrives_on_first_use():
    """An attribute read and an import of an API module both give the real package, once,
    with the core modules loaded before it reused (same objects)."""
    printed = _python(
        "import sys\n"
        "from graphxform import tf_import\n"
        "tf_import.core()\n"
        "from tensorflow.python.framework import ops\n"
        "import tensorflow as tf\n"
        "print(type(tf).__name__)\n"
        "import tensorflow.compat.v1 as tf1\n"
        "real = sys.modules['tensorflow']\n"
        "print(type(real).__name__, real.compat.v1 is tf1, tf.compat.v1 is tf1)\n"
        "tf1.disable_eager_execution()\n"
        "g = tf1.Graph()\n"
        "print(isinstance(g, ops.Graph))\n"
        "with g.as_default():\n"
        "    x = tf1.placeholder(tf1.float32, [2])\n"
        "    y = tf1.reduce_sum(x * 3.0)\n"
        "    with tf1.Session() as s:\n"
        "        print(s.run(y, {x: [1.0, 2.0]}))\n"
        "import tf_keras, tf_slim\n"
        "print(tf_keras.layers.Dense.__name__)\n")
    assert printed == ["_StandIn", "module", "True", "True", "True", "9.0", "Dense"]


def test_the_console_command_exits_with_the_commands_code(tmp_path):
    """console_main ends the process without the interpreter's teardown: the exit code and
    every line written must survive that."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    bad = subprocess.run([sys.executable, "-m", "graphxform", "inspect",
                          str(tmp_path / "missing.meta")], capture_output=True, text=True,
                         timeout=TIMEOUT_S, env=env)
    assert bad.returncode != 0
    assert bad.stderr.count("\n") == 1 and "missing.meta" in bad.stderr
    good = subprocess.run([sys.executable, "-m", "graphxform", "inspect",
                           fixture_path("mlp_sgd")], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env)
    assert good.returncode == 0, good.stderr
    assert good.stdout.strip()


def test_a_full_standard_output_is_a_one_line_error():
    """`graphxform inspect M > /dev/full`: the write fails when the output is flushed; the
    command says so and exits 1 (ending without teardown must not swallow it)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "graphxform", "inspect",
                               fixture_path("mlp_sgd")], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=TIMEOUT_S, env=env)
    assert done.returncode == 1
    assert done.stderr == ("graphxform: error: cannot write to standard output: No space left "
                           "on device\n")


def test_no_tensorflow_is_a_one_line_error():
    printed = _python(
        "import importlib.util\n"
        "real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: None if n == 'tensorflow' else real(n, *a)\n"
        "import contextlib, io\n"
        "from graphxform import cli\n"
        "err = io.StringIO()\n"
        "with contextlib.redirect_stderr(err):\n"
        f"    code = cli._main(['inspect', {fixture_path('mlp_sgd')!r}], False)\n"
        "print(code, err.getvalue().startswith('graphxform: error: TensorFlow is not "
        "installed'), err.getvalue().count(chr(10)))\n")
    assert printed == ["1", "True", "1"]


def _cond_in_the_step(x, y):
    """A control-flow-v2 cond on the way to the loss (as tf_keras's layers branch on the
    learning phase): the contract reads its branches as graphs before verify's session."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    w = tf1.get_variable("w", [8, 2])
    h = tf.cond(tf.reduce_sum(w) < 1e6, lambda: tf.nn.relu(x), lambda: x)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=tf.matmul(h, w)))
    return tf1.train.GradientDescentOptimizer(0.1).minimize(loss)


def test_verify_runs_a_graph_whose_step_calls_a_function(tmp_path):
    """Reading a function body builds a graph, which TensorFlow's package must be imported
    for first: run from a shell, verify then failed to import it for its session ('internal
    error: ValueError: tf.enable_eager_execution must be called at program startup'). Under
    pytest the old code happened to pass; this keeps the path run in a fresh process."""
    from conftest import export_classifier
    model = export_classifier(tmp_path / "m.meta", _cond_in_the_step)
    done = subprocess.run([sys.executable, "-m", "graphxform", "verify", "--replicas", "2",
                           model, "--feeds", model + ".npz", "--batch-size", "16", "--steps",
                           "2"], capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "PASS" in done.stdout, done.stdout
