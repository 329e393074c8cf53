"""Strategy model-average (TF's ModelAverageOptimizer): rounds average the replicas' copies
into centre variables, --interval 1 with SGD is synchronous data parallelism, checkpoints hold
the centres under the original names, and the contract proves the strategy's own invariant."""

import numpy as np
import pytest
import tensorflow as tf
from conftest import fixture_path

from graphxform import contract, equivalence, metagraph, strategies, training
from graphxform.errors import GraphxformError
from graphxform.passes.model_average import LOCAL_STEP, centre_name

v1 = tf.compat.v1
DEVICES = ["/device:CPU:0", "/device:CPU:1"]
TRAINED = ["dense0/bias", "dense0/kernel", "dense1/bias", "dense1/kernel"]


def averaged(interval, model="mlp_sgd", replicas=2):
    ir = metagraph.load(fixture_path(model))
    strategies.transform(ir, "model-average", devices=DEVICES[:replicas] if replicas <= 2 else
                         [f"/device:CPU:{i}" for i in range(replicas)], interval=interval)
    return ir


def session_of(ir):
    """A session on the emitted graph (as a user's import_meta_graph gives), initialised."""
    graph = tf.Graph()
    with graph.as_default():
        v1.train.import_meta_graph(metagraph.to_metagraph(ir))
    config = v1.ConfigProto(device_count={"CPU": 4}, allow_soft_placement=True)
    session = v1.Session(graph=graph, config=config)
    with graph.as_default():
        session.run(v1.global_variables_initializer())
    return session


def feeds(k, batch=16):
    data = np.load(fixture_path("mlp_sgd", ".npz"))
    return {f"{name}:0": data[name][k * batch:(k + 1) * batch] for name in data.files}


def copies(session, var, replicas=2):
    """Every replica's copy of ``var`` now (reads made after the last step)."""
    graph = session.graph
    with graph.as_default():
        return [session.run(v1.raw_ops.ReadVariableOp(
            resource=graph.get_tensor_by_name(f"replica_{i}/{var}:0"), dtype=tf.float32))
                for i in range(replicas)]


def centre(session, var):
    graph = session.graph
    with graph.as_default():
        return session.run(v1.raw_ops.ReadVariableOp(
            resource=graph.get_tensor_by_name(centre_name(var) + ":0"), dtype=tf.float32))


def test_a_round_averages_every_copy_into_the_centre_and_back():
    interval = 3
    session = session_of(averaged(interval))
    start = {var: centre(session, var) for var in TRAINED}
    for var in TRAINED:  # before the first step every local copy equals the centre
        for copy in copies(session, var):
            np.testing.assert_array_equal(copy, start[var])
    for k in range(interval - 1):
        session.run("GradientDescent", feeds(k))
    for var in TRAINED:
        np.testing.assert_array_equal(centre(session, var), start[var])  # no round yet
    assert not np.array_equal(*copies(session, "dense1/kernel"))  # the copies train apart
    pre = [f"model_average/step_0/{var}/read_{i}:0" for var in TRAINED for i in range(2)]
    values = session.run(pre + ["GradientDescent"], feeds(interval - 1))[:-1]
    for j, var in enumerate(TRAINED):
        mean = (values[2 * j] + values[2 * j + 1]) / 2
        np.testing.assert_allclose(centre(session, var), mean, rtol=1e-6, atol=1e-7)
        for copy in copies(session, var):
            np.testing.assert_array_equal(copy, centre(session, var))
    with session.graph.as_default():
        local = session.run(v1.raw_ops.ReadVariableOp(
            resource=session.graph.get_tensor_by_name(LOCAL_STEP + ":0"), dtype=tf.int64))
        rounds = session.run(v1.raw_ops.ReadVariableOp(
            resource=session.graph.get_tensor_by_name("global_step:0"), dtype=tf.int64))
    assert (local, rounds) == (interval, 1)  # global_step counts averaging rounds
    session.close()


def test_interval_1_with_sgd_matches_one_device():
    original = metagraph.load(fixture_path("mlp_sgd"))
    report = equivalence.compare(original, averaged(1), fixture_path("mlp_sgd", ".npz"),
                                 steps=3, batch_size=16, rtol=1e-5)
    assert report.ok, equivalence.format_report(report)


def test_checkpoints_hold_the_centres_under_the_original_names(tmp_path):
    ir = averaged(2)
    session = session_of(ir)
    for k in range(2):
        session.run("GradientDescent", feeds(k))
    expected = {var: centre(session, var) for var in TRAINED}
    prefix = str(tmp_path / "averaged")
    saver_def = ir.meta.saver_def
    session.run(saver_def.save_tensor_name, {saver_def.filename_tensor_name: prefix})
    session.close()
    graph = tf.Graph()  # the single-device graph restores it
    with graph.as_default():
        saver = v1.train.import_meta_graph(fixture_path("mlp_sgd"))
        with v1.Session(graph=graph) as single:
            saver.restore(single, prefix)
            for var in TRAINED:
                got = single.run(graph.get_tensor_by_name(var + "/Read/ReadVariableOp:0"))
                np.testing.assert_array_equal(got, expected[var])
            single_prefix = saver.save(single, str(tmp_path / "single"))
    session = session_of(averaged(2))  # and the reverse sets the centre and every copy
    session.run(saver_def.restore_op_name, {saver_def.filename_tensor_name: single_prefix})
    for var in TRAINED:
        for value in copies(session, var) + [centre(session, var)]:
            np.testing.assert_array_equal(value, expected[var])
    session.close()


def test_contract_refuses_a_centre_that_misses_a_replica():
    ir = averaged(2)
    mean = "model_average/step_0/dense0/bias/sum"
    ir.set_input(mean, 1, "model_average/step_0/dense0/bias/read_0")  # replica 0 twice
    tg = training.analyze(metagraph.load(fixture_path("mlp_sgd")))
    with pytest.raises(contract.ContractError, match=r"dense0/bias.*without replicas \[1\]"):
        contract.check_model_average(ir, tg, 2)


def test_interval_below_one_is_refused():
    with pytest.raises(GraphxformError, match="--interval must be at least 1"):
        averaged(0)


def test_cli_apply_and_verify(run_cli, tmp_path):
    out = str(tmp_path / "mlp.model-average.meta")
    code, text, _ = run_cli("apply", fixture_path("mlp_sgd"), "--strategy", "model-average",
                            "--replicas", 2, "--interval", 2, "-o", out)
    assert code == 0, text
    code, text, _ = run_cli("verify", fixture_path("mlp_sgd"), "--strategy", "model-average",
                            "--replicas", 2, "--feeds", fixture_path("mlp_sgd", ".npz"),
                            "--steps", 3, "--interval", 1)
    assert code == 0, text
    code, text, err = run_cli("apply", fixture_path("mlp_sgd"), "--strategy", "allreduce",
                              "--replicas", 2, "--interval", 2, "-o", out)
    assert code != 0 and "--interval is an option of --strategy model-average" in text + err


def test_cost_names_the_strategy_and_its_minimum(run_cli):
    code, text, err = run_cli("cost", fixture_path("mlp_sgd"), "--strategy", "model-average",
                              "--replicas", 2)
    assert code == 0, text + err
    assert text.startswith("model-average:") and "minimum is a round's copies" in text
