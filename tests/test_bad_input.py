"""Every failure a clean one (issue 13): bad input on any command is one line on stderr, the right
exit code, no traceback, no "internal error", and nothing left behind; signals and kills leave
no temp file and no child process."""

import os
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import fixture_path
from graphxform import cleanup, metagraph
from graphxform.runtime import launch

MODEL = fixture_path("mlp_sgd")


def one_line_error(code, err, expect_code=1):
    assert code == expect_code, err
    assert err.count("\n") == 1 and err.startswith("graphxform: error: "), err
    assert "Traceback" not in err and "internal error" not in err, err
    return err.strip()


def build_model(path, make_graph):
    """Export a small training graph that ``make_graph(tf1)`` builds; returns its path."""
    import tensorflow as tf
    graph = tf.Graph()
    with graph.as_default():
        loss = make_graph(tf.compat.v1)
        step = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        tf.compat.v1.add_to_collection("train_op", step)
        tf.compat.v1.train.export_meta_graph(str(path), graph=graph)
    return str(path)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


def age(path, seconds=3600):
    then = time.time() - seconds
    os.utime(path, (then, then))


# ---------------------------------------------------------------- the matrix
@pytest.fixture(scope="module")
def bad_models(tmp_path_factory):
    where = tmp_path_factory.mktemp("bad")
    files = {"missing.meta": None, "empty.meta": b"", "blank.meta": b"  \n",
             "garbage.meta": bytes(range(256)) * 16, "garbage.pbtxt": b"node { name: ]]\n",
             "npz.meta": open(fixture_path("mlp_sgd", ".npz"), "rb").read()}
    for name, data in files.items():
        if data is not None:
            (where / name).write_bytes(data)
    (where / "dir.meta").mkdir()
    os.mkfifo(where / "fifo.meta")
    return [str(where / name) for name in [*files, "dir.meta", "fifo.meta"]] + ["/dev/zero"]


COMMANDS = [["inspect"], ["viz", "-o", "{tmp}/out.dot"], ["apply", "--replicas", "2", "-o",
            "{tmp}/out.meta"], ["run", "--steps", "1"], ["cost", "--replicas", "2"],
            ["verify", "--replicas", "2", "--steps", "1"], ["launch", "--steps", "1"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_every_command_refuses_bad_model_files_in_one_line(command, bad_models, run_cli,
                                                           tmp_path):
    for model in bad_models:
        args = [command[0], model] + [a.format(tmp=tmp_path) for a in command[1:]]
        code, out, err = run_cli(*args)
        line = one_line_error(code, err, 2 if model.endswith("dir.meta") else 1)
        assert os.path.basename(model) in line, (args, line)
    assert list(tmp_path.iterdir()) == []


def test_missing_model_with_an_existing_output(run_cli, tmp_path):
    out = tmp_path / "out.meta"
    out.write_bytes(b"from an earlier run")
    for command in (["apply", "--replicas", 2], ["viz"]):
        code, _, err = run_cli(command[0], tmp_path / "missing.meta", *command[1:], "-o", out)
        assert one_line_error(code, err).endswith("missing.meta: no such file")
    assert out.read_bytes() == b"from an earlier run"


def test_dev_zero_and_pipes_are_refused_before_reading(run_cli):
    code, _, err = run_cli("inspect", "/dev/zero")
    assert one_line_error(code, err).endswith("/dev/zero: not a regular file (a model is a "
                                              ".meta, .pb or .pbtxt file)")


def test_input_larger_than_protobuf_is_refused_by_size(run_cli, tmp_path):
    huge = tmp_path / "huge.meta"
    with open(huge, "wb") as f:
        f.truncate(2**31 + 2**20)  # sparse: nothing is written or read
    started = time.monotonic()
    code, _, err = run_cli("inspect", huge)
    assert one_line_error(code, err) == (f"graphxform: error: {huge}: 2.0 GiB is larger than "
                                         "the 2.0 GiB protobuf can hold")
    assert time.monotonic() - started < 5


def test_text_format_errors_quote_at_most_a_few_hundred_characters(run_cli, tmp_path):
    model = tmp_path / "long.pbtxt"
    model.write_text("graph_def { node { name: " + "x" * 1_000_000 + " } }\n")
    code, _, err = run_cli("inspect", model)
    line = one_line_error(code, err)
    assert str(model) in line and "not a text MetaGraphDef or GraphDef" in line
    assert len(line) < 400 and "chars]" in line


def test_bad_cluster_files_and_tf_configs(run_cli, tmp_path, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(bytes(range(128, 256)))
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    ports = tmp_path / "ports.json"
    ports.write_text('{"ps": ["127.0.0.1:99999"], "worker": ["127.0.0.1:2222"]}')
    shared = tmp_path / "shared.json"
    shared.write_text('{"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2222"]}')
    for path, reason in ((garbage, "not a JSON text file (not UTF-8)"),
                         ("/dev/zero", "not a regular file (a cluster is a JSON file)"),
                         (fifo, "not a regular file (a cluster is a JSON file)"),
                         (ports, "task address '127.0.0.1:99999' has no port in 1-65535"),
                         (shared, "two tasks share the address 127.0.0.1:2222")):
        code, _, err = run_cli("apply", MODEL, "--strategy", "ps", "--cluster", path)
        line = one_line_error(code, err)
        assert line.startswith(f"graphxform: error: {path}: ") and line.endswith(reason)
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"ps": ["127.0.0.1:2222"], "worker": '
                       '["127.0.0.1:2223"]}, "task": 5}')
    code, _, err = run_cli("serve")
    assert one_line_error(code, err).endswith("TF_CONFIG: task 5 is not {type, index}")


# ---------------------------------------------------------------- options
@pytest.mark.parametrize("args, message", [
    (["apply", MODEL, "--foo"], "no such option '--foo' (try 'graphxform apply --help')"),
    (["apply", MODEL, "--replicas", "abc"], "invalid value for '--replicas': 'abc' is not a "
     "valid integer (try 'graphxform apply --help')"),
    (["apply", MODEL, "--strategy", "partitioned-ps", "--partitions", "0"],
     "invalid value for '--partitions': 0 is not in the range x>=1"),
    (["cost", MODEL, "--strategy", "partitioned-ps", "--partitions", "0"],
     "invalid value for '--partitions': 0 is not in the range x>=1"),
    (["verify", MODEL, "--replicas", "2", "--rtol", "-1"], "'--rtol': -1.0 is not in the range"),
    (["inspect"], "missing argument 'MODEL' (try 'graphxform inspect --help')"),
    (["nosuch"], "no such command 'nosuch' (try 'graphxform --help')"),
])
def test_usage_errors_are_one_line(run_cli, args, message):
    code, out, err = run_cli(*args)
    assert message in one_line_error(code, err, expect_code=2) and not out


@pytest.mark.parametrize("args, message", [
    (["--staleness", "2"], "--staleness is an option of --strategy ps and partitioned-ps, not "
     "of allreduce"),
    (["--async"], "--async is an option of --strategy ps and partitioned-ps, not of allreduce"),
    (["--strategy", "model-average", "--partitions", "2"],
     "--partitions is an option of --strategy partitioned-ps and hybrid, not of "
     "model-average"),
    (["--partition-min-bytes", "8"], "--partition-min-bytes is an option of --strategy "
     "partitioned-ps and hybrid, not of allreduce"),
    (["--replicas-per-worker", "2"], "--replicas-per-worker places replicas on a cluster's "
     "workers"),
    (["--strategy", "replicated", "--worker-device", "GPU"], "--worker-device places replicas "
     "on a cluster's workers"),
])
def test_an_option_the_strategy_would_ignore_is_refused(run_cli, tmp_path, args, message):
    out = tmp_path / "out.meta"
    code, _, err = run_cli("apply", MODEL, "--replicas", 2, "-o", out, *args)
    assert message in one_line_error(code, err)
    assert not out.exists()


def test_dump_dir_that_cannot_be_made(run_cli, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    out = tmp_path / "out.meta"
    for dump_dir, reason in ((blocker / "sub", "Not a directory"),
                             ("/proc/graphxform-dumps", "No such file or directory")):
        code, _, err = run_cli("apply", MODEL, "--replicas", 2, "-o", out, "--dump-dir",
                               dump_dir)
        assert one_line_error(code, err).endswith(f"--dump-dir {dump_dir}: cannot create: "
                                                  f"{reason}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_cost_with_unknown_inner_dimensions(run_cli, tmp_path):
    def graph(tf1):
        import tensorflow as tf
        x = tf1.placeholder(tf.float32, [None, None], name="x")
        w = tf1.get_variable("w", [4, 1])
        return tf.reduce_mean(tf.matmul(x, w), name="loss")
    model = build_model(tmp_path / "open.meta", graph)
    code, out, err = run_cli("cost", model, "--replicas", 2)
    assert code == 0 and not err, err
    assert "/device:CPU:1" in out


# ---------------------------------------------------------------- TF's errors, in one line
def test_runtime_failure_names_node_and_reason(run_cli, tmp_path):
    def graph(tf1):
        import tensorflow as tf
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        w = tf1.get_variable("w", [4, 1])
        return tf.debugging.check_numerics(tf.reduce_mean(tf.matmul(x, w)) / 0.0,
                                           "loss blew up", name="loss")
    model = build_model(tmp_path / "inf.meta", graph)
    code, out, err = run_cli("run", model, "--steps", 1)
    assert one_line_error(code, err) == ("graphxform: error: TensorFlow failed at node loss: "
                                         "loss blew up : Tensor had Inf values")


class FakeTFError(Exception):
    def __init__(self, message):
        super().__init__(message)
        self.message = message


@pytest.mark.parametrize("message, line", [
    ("Graph execution error:\n\nDetected at node 'save/RestoreV2' defined at (most recent call "
     "last):\n    File \"x.py\", line 7, in <module>\nNode: 'save/RestoreV2'\n=====\n"
     "DATA_LOSS: From /job:worker/replica:0/task:0:\nUnable to open table file g: not an "
     "sstable\n\t [[{{node save/RestoreV2}}]]\nRecent warning and error logs:\n  W0000 ...",
     "node save/RestoreV2: Unable to open table file g: not an sstable"),
    ("Graph execution error:\n\nNode: 'r/g'\n2 root error(s) found.\n  (0) INVALID_ARGUMENT: "
     "Incompatible shapes: [8,1] vs. [4,1]\n\t [[{{node r/g}}]]\n  (1) INVALID_ARGUMENT: "
     "Incompatible shapes\n0 successful operations.\n0 derived errors ignored.",
     "node r/g: Incompatible shapes: [8,1] vs. [4,1]"),
    ("Graph execution error:\n\nassertion failed: [x > 0]\n\t [[{{function_node f}}{{node "
     "Assert}}]]", "node Assert: assertion failed: [x > 0]"),
    ("Graph execution error:", "FakeTFError"),
    ("x" * 5000, "x" * 267 + " ...[4600 chars]... " + "x" * 133),
], ids=["remote restore", "root errors", "in a function", "nothing said", "long"])
def test_tf_errors_become_one_line_naming_the_node(message, line):
    from graphxform.errors import tf_error_line
    assert tf_error_line(FakeTFError(message)) == line


def test_checkpoint_failures_say_what_tf_said(run_cli, tmp_path):
    ckpt = tmp_path / "ckpt"
    code, out, err = run_cli("run", MODEL, "--steps", 1, "--save", ckpt / "model")
    assert code == 0 and not err, err
    code, out, err = run_cli("run", MODEL, "--steps", 1, "--restore", ckpt)  # a directory
    assert code == 0 and not err, err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_cli("run", MODEL, "--steps", 1, "--restore", empty)
    assert one_line_error(code, err).endswith(f"{empty}: no checkpoint in this directory")
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"not a checkpoint")
    code, _, err = run_cli("run", MODEL, "--steps", 1, "--restore", garbage)
    line = one_line_error(code, err)
    assert "node save/RestoreV2: Unable to open table file" in line and "sstable" in line
    code, _, err = run_cli("run", MODEL, "--steps", 1, "--save", "/proc/graphxform/model")
    assert "cannot save checkpoint" in one_line_error(code, err)
    code, _, err = run_cli("run", MODEL, "--steps", 1, "--save", "/proc/model")
    line = one_line_error(code, err)
    assert "node save/SaveV2: /proc/model.data-00000-of-00001.tempstate" in line


def test_fetching_an_op_and_no_progress_bar_off_a_terminal(run_cli):
    code, out, err = run_cli("run", MODEL, "--steps", 2, "--fetch", "global_step")
    assert code == 0 and err == ""
    assert out.splitlines()[-1].startswith("step 2  loss ")


# ---------------------------------------------------------------- modes and leftovers
@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_outputs_honour_the_umask(run_cli, tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        out = tmp_path / "out.meta"
        code, _, err = run_cli("apply", MODEL, "--replicas", 2, "-o", out)
        assert code == 0, err
        assert stat.S_IMODE(os.stat(out).st_mode) == mode
        code, _, err = run_cli("viz", MODEL, "-o", out.with_suffix(".dot"))
        assert code == 0, err
        os.chmod(out, 0o640)  # an existing file keeps its mode, as open(path, "w") does
        code, _, err = run_cli("apply", MODEL, "--replicas", 2, "-o", out)
        assert code == 0 and stat.S_IMODE(os.stat(out).st_mode) == 0o640
        assert stat.S_IMODE(os.stat(out.with_suffix(".dot")).st_mode) == mode
    finally:
        os.umask(previous)


def test_outputs_go_through_symlinks_and_into_pipes_in_place(run_cli, tmp_path):
    real = tmp_path / "real.meta"
    real.write_bytes(b"old")
    link = tmp_path / "link.meta"
    link.symlink_to(real)
    code, _, err = run_cli("apply", MODEL, "--replicas", 2, "-o", link)
    assert code == 0, err
    assert link.is_symlink() and metagraph.load(str(real)).kind == "meta"
    pipe = tmp_path / "out.fifo"  # like -o /dev/null: never replaced by a regular file
    os.mkfifo(pipe)
    reader = subprocess.Popen(["cat", str(pipe)], stdout=subprocess.PIPE)
    try:
        code, _, err = run_cli("apply", MODEL, "--replicas", 2, "-o", pipe)
        received, _ = reader.communicate(timeout=30)
    finally:
        reader.kill()
        reader.wait(timeout=10)
    assert code == 0, err
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode) and received == real.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.meta", "out.fifo", "real.meta"]


@pytest.mark.parametrize("sig, message", [
    (signal.SIGTERM, "graphxform: stopped by SIGTERM"), (signal.SIGHUP, "graphxform: stopped by "
     "SIGHUP"), (signal.SIGINT, "graphxform: interrupted")], ids=["TERM", "HUP", "INT"])
def test_a_signal_while_writing_leaves_no_temp_file(run_cli, tmp_path, monkeypatch, sig,
                                                    message):
    real_fchmod = os.fchmod

    def fchmod_then_signal(fd, mode):  # the temp file exists; the signal arrives now
        real_fchmod(fd, mode)
        os.kill(os.getpid(), sig)
    monkeypatch.setattr(os, "fchmod", fchmod_then_signal)
    code, out, err = run_cli("apply", MODEL, "--replicas", 2, "-o", tmp_path / "out.meta")
    assert code == 128 + sig and err == message + "\n"
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers put back


def test_stale_temp_files_of_dead_runs_are_swept(run_cli, tmp_path):
    host = socket.gethostname()
    dead = tmp_path / f".graphxform-{dead_pid()}-{host}-abc123.tmp"
    alive = tmp_path / f".graphxform-{os.getpid()}-{host}-def456.tmp"  # still being written
    fresh = tmp_path / f".graphxform-{dead_pid()}-{host}-ghi789.tmp"  # touched a moment ago
    other_host = tmp_path / f".graphxform-{dead_pid()}-elsewhere.example-jkl012.tmp"
    foreign = tmp_path / ".graphxform-notours.tmp"
    for path in (dead, alive, fresh, other_host, foreign):
        path.write_text("partial")
        if path is not fresh:
            age(path)
    code, _, err = run_cli("viz", MODEL, "-o", tmp_path / "out.dot")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (alive, fresh, other_host, foreign)) + ["out.dot"]


def test_stale_checkpoint_temps_are_swept_on_save(run_cli, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    stale = [ckpt / "model-7.data-00000-of-00001.tempstate123456789",
             ckpt / "model-7.index.tempstate987654321",
             ckpt / ("checkpoint.tmp" + "0123456789abcdef" * 2)]
    fresh = ckpt / "model-8.index.tempstate55555"  # a save in progress
    mine = ckpt / "notes.txt"
    for path in stale + [fresh, mine]:
        path.write_text("x")
        if path is not fresh:
            age(path)
    code, _, err = run_cli("run", MODEL, "--steps", 1, "--save", ckpt / "model")
    assert code == 0, err
    left = {p.name for p in ckpt.iterdir()}
    assert not left & {p.name for p in stale} and {fresh.name, mine.name} <= left


def test_stale_launch_dirs_are_swept_only_when_their_launcher_is_gone(tmp_path):
    host = socket.gethostname()
    dead = tmp_path / f"graphxform-launch-{dead_pid()}-{host}-abc123"
    alive = tmp_path / f"graphxform-launch-{os.getpid()}-{host}-def456"
    old_style = tmp_path / "graphxform-launch-k2j3h4"
    for path in (dead, alive, old_style):
        path.mkdir()
        (path / "cluster.json").write_text("{}")
    assert cleanup.sweep_launch_dirs(str(tmp_path)) == [str(dead)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, old_style.name])
    # the name a launcher gives its dir (Launch._start) is one the sweep can read
    made = tempfile.mkdtemp(prefix=cleanup.LAUNCH_PREFIX + cleanup.owner_tag(), dir=tmp_path)
    os.rename(made, made.replace(f"-{os.getpid()}-", f"-{dead_pid()}-"))
    assert len(cleanup.sweep_launch_dirs(str(tmp_path))) == 1


# ---------------------------------------------------------------- children die with us
def test_launch_teardown_returns_only_when_every_child_is_gone(monkeypatch):
    monkeypatch.setattr(launch, "GRACE_S", 0.3)
    stubborn = [sys.executable, "-c", "import signal, time; "
                "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
                "time.sleep(30)"]
    runner = launch.Launch.__new__(launch.Launch)
    runner.children = [launch.Child("ps", i, f"127.0.0.1:{i + 1}", stubborn, dict(os.environ))
                       for i in range(2)]
    runner.tmp, runner.warn = None, print
    for child in runner.children:  # SIGTERM is ignored from here on
        assert child.proc.stdout.readline() == "ready\n"
    started = time.monotonic()
    runner._teardown()
    assert time.monotonic() - started < 10
    for child in runner.children:
        assert child.proc.returncode == -signal.SIGKILL
        with pytest.raises(ProcessLookupError):
            os.killpg(child.pid, 0)


# dot is started with child_preexec; launch's children arm themselves (exit_with_parent)
CHILDREN = {"not ours": '["sleep", "60"], preexec_fn=cleanup.child_preexec()',
            "ours": '[sys.executable, "-c", "import os, time; from graphxform import cleanup; '
                    'cleanup.die_with_parent(parent=os.getppid()); time.sleep(60)"]'}


@pytest.mark.parametrize("child", CHILDREN.values(), ids=list(CHILDREN))
def test_a_child_dies_with_its_parent_even_on_sigkill(tmp_path, child):
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", f"""
import os, subprocess, sys, time
from graphxform import cleanup
child = subprocess.Popen({child})
time.sleep(0.5)  # armed by now
open({str(pid_file)!r}, "w").write(str(child.pid))
time.sleep(60)
"""])
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.05)
        child = int(pid_file.read_text())
        parent.kill()
        parent.wait(timeout=10)
        assert wait_gone(child, 10), f"pid {child} outlived its parent"
    finally:
        parent.kill()
        parent.wait(timeout=10)


def wait_gone(pid: int, timeout: float) -> bool:
    """Whether ``pid`` is gone (or a zombie waiting for init) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def fake_dot(tmp_path, monkeypatch):
    """A `dot` on PATH that says its pid and hangs, like Graphviz on a huge graph."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "dot"
    script.write_text('#!/bin/sh\necho $$ > "$FAKE_DOT_PID"\nexec sleep 60\n')
    script.chmod(0o755)
    pid_file = tmp_path / "dot.pid"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DOT_PID", str(pid_file))
    return pid_file


def test_dot_failing_is_one_line(run_cli, tmp_path, fake_dot):
    (tmp_path / "bin" / "dot").write_text('#!/bin/sh\ncat >/dev/null\nfor i in 1 2 3; do '
                                          'echo "Error: line $i of many" >&2; done\nexit 3\n')
    code, _, err = run_cli("viz", MODEL, "-o", tmp_path / "out.svg")
    line = one_line_error(code, err)
    assert line.startswith(f"graphxform: error: dot failed to render {tmp_path}/out.svg: Error:")
    assert not (tmp_path / "out.svg").exists()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_viz_killed_takes_dot_with_it(tmp_path, fake_dot, sig):
    out = tmp_path / "out.svg"
    viz = subprocess.Popen([sys.executable, "-m", "graphxform.cli", "viz", MODEL, "-o", out],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    try:
        deadline = time.monotonic() + 60
        while not (fake_dot.exists() and fake_dot.read_text().strip()):
            assert time.monotonic() < deadline and viz.poll() is None
            time.sleep(0.05)
        dot = int(fake_dot.read_text())
        viz.send_signal(sig)
        _, err = viz.communicate(timeout=30)
        assert viz.returncode == (128 + sig if sig == signal.SIGTERM else -sig)
        if sig == signal.SIGTERM:
            assert err == "graphxform: stopped by SIGTERM\n"
        assert wait_gone(dot, 10), f"dot (pid {dot}) outlived viz"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "dot.pid"]
    finally:
        viz.kill()
        viz.wait(timeout=10)


@pytest.mark.slow
def test_launch_reports_the_chiefs_checkpoint_failure_once(run_cli, tmp_path):
    ps_model = tmp_path / "model.ps.meta"
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text('{"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223"]}')
    code, _, err = run_cli("apply", MODEL, "--strategy", "ps", "--cluster", cluster_file, "-o",
                           ps_model)
    assert code == 0, err
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"not a checkpoint")
    code, out, err = run_cli("launch", ps_model, "--steps", 1, "--timeout", 30, "--restore",
                             garbage)
    line = one_line_error(code, err)
    assert line.startswith("graphxform: error: worker 0 (127.0.0.1:") and (
        f"stopped: exit code 1: cannot restore checkpoint {garbage}: node save/RestoreV2: "
        "Unable to open table file" in line)
    for pid in map(int, re.findall(r"pid (\d+)", out)):
        assert wait_gone(pid, 10), f"pid {pid} left behind"


def test_a_signal_turned_into_another_exception_still_stops_the_command(run_cli, monkeypatch):
    """SIGTERM landing while TensorFlow builds a failed run's exception (a collective timing
    out) reaches us as pybind11's RuntimeError ("MISMATCH ... REPLACED BY Terminated"): it was
    reported as an internal error."""
    import os
    import signal
    import time

    from graphxform import cleanup, cli

    def core(quiet=True):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except cleanup.Terminated:
            raise RuntimeError("pybind11::error_already_set: MISMATCH of original and "
                               "normalized active exception types") from None
    monkeypatch.setattr(cli.tf_import, "core", core)
    code, _, err = run_cli("inspect", "model.meta")
    assert code == 128 + signal.SIGTERM
    assert err.strip() == "graphxform: stopped by SIGTERM"
