"""order-races (passes/order_races.py): what the original step runs in no order gets one order,
the same in every replica, so that the replicas' copies of a variable cannot part."""

import numpy as np
import pytest
import tensorflow as tf
from conftest import export_classifier
from test_fetch_races import dqn

from graphxform import cluster, contract, metagraph, strategies, training
from graphxform.errors import ContractError
from graphxform.runtime.local import Feeds, Runner

tf1 = tf.compat.v1
CLIP = 0.01
CRITIC = ("D_W1", "D_b1", "D_W2", "D_b2")
PS_SPEC = {"ps": ["127.0.0.1:27011"], "worker": ["127.0.0.1:27012", "127.0.0.1:27013"]}


def wgan_critic(x, y, counted=False):
    """wiseodd/generative-models' WGAN critic step (tf.Variable weights, RMSProp on -D_loss,
    clipping as a list of assigns), with the clipping grouped into the train op; ``counted``:
    the optimizer bumps global_step."""
    def xavier_init(size):
        return tf1.random_normal(shape=size, stddev=1. / tf.sqrt(size[0] / 2.))
    D_W1 = tf1.Variable(xavier_init([8, 128]), name="D_W1")
    D_b1 = tf1.Variable(tf.zeros(shape=[128]), name="D_b1")
    D_W2 = tf1.Variable(xavier_init([128, 1]), name="D_W2")
    D_b2 = tf1.Variable(tf.zeros(shape=[1]), name="D_b2")
    theta_D = [D_W1, D_W2, D_b1, D_b2]

    def discriminator(h):
        return tf.matmul(tf.nn.relu(tf.matmul(h, D_W1) + D_b1), D_W2) + D_b2
    fake = tf.reverse(x, [1]) * 0.5 + tf.cast(tf.expand_dims(y, 1), tf.float32)
    D_loss = tf.reduce_mean(discriminator(x)) - tf.reduce_mean(discriminator(fake))
    D_solver = tf1.train.RMSPropOptimizer(learning_rate=1e-2).minimize(
        -D_loss, var_list=theta_D,
        global_step=tf1.train.get_or_create_global_step() if counted else None)
    clip_D = [p.assign(tf.clip_by_value(p, -CLIP, CLIP)) for p in theta_D]
    return tf.group(D_solver, *clip_D, name="train")


def transformed(tmp_path, build, strategy="allreduce", **options):
    model = export_classifier(tmp_path / "m.meta", build)
    ir = metagraph.load(model)
    if strategy in ("ps", "hybrid"):
        options["cluster"] = cluster.Cluster(PS_SPEC)
    else:
        options.setdefault("devices", ["/device:CPU:0", "/device:CPU:1"])
    pipeline = strategies.transform(ir, strategy, **options)
    return model, ir, pipeline


def writes_of(ir, variable, op, prefix=""):
    return sorted(dst for dst, _ in ir.consumers(prefix + variable) if ir.op(dst) == op)


def clip_read(ir, variable, prefix="", step="train"):
    """The read of ``variable`` its clipping assigns from, in the clipping ``step`` runs (a
    copy: the original clipping, run alone, runs no step)."""
    runs = ir.ancestors(step)
    (assign,) = [a for a in writes_of(ir, variable, "AssignVariableOp", prefix)
                 if "clip_by_value" in ir.input(a, 1)[0] and a in runs]
    (read,) = [r for r, _ in ir.consumers(prefix + variable) if ir.op(r) == "ReadVariableOp"
               and "clip_by_value" in r and r in runs]
    assert read in ir.ancestors(assign)
    return read, assign


@pytest.mark.parametrize("strategy", ["allreduce", "replicated", "model-average", "hybrid"])
def test_every_replica_clips_after_the_step(tmp_path, strategy):
    """Each replica's clipping reads its copy after RMSProp's apply of it: before, nothing
    ordered them and each replica's executor picked its own order."""
    _, ir, pipeline = transformed(tmp_path, wgan_critic, strategy)
    assert pipeline.timings[0].name == "order-races" and pipeline.timings[0].modified
    for prefix in ("replica_0/", "replica_1/"):
        for var in CRITIC:
            read, assign = clip_read(ir, var, prefix)
            (apply,) = writes_of(ir, var, "ResourceApplyRMSProp", prefix)
            assert apply in ir.ancestors(read), (prefix, var)
            # the forward pass reads the weights before the update, and so before the clipping
            forward = [r for r, _ in ir.consumers(prefix + var) if ir.op(r) == "ReadVariableOp"
                       and r.removeprefix(prefix).startswith(("MatMul", "add"))]
            assert forward and all(r in ir.ancestors(assign) for r in forward)


def clip_ops(ir):
    """The input's clipping ops, ``p.assign(tf.clip_by_value(p, ...))``, by name."""
    return sorted(a for a in ir.nodes_of(["AssignVariableOp"])
                  if ir.input(a, 1)[0].startswith("clip_by_value"))


@pytest.mark.parametrize("strategy", ["allreduce", "replicated", "model-average", "hybrid",
                                      "ps"])
def test_the_clipping_run_alone_waits_on_no_step(tmp_path, strategy):
    """The order holds inside the step only: the clipping's own names (served by
    merge-fetches) run no optimizer update and need no batch; the step runs ordered copies."""
    model, ir, pipeline = transformed(tmp_path, lambda x, y: wgan_critic(x, y, counted=True),
                                      strategy)
    clips = clip_ops(metagraph.load(model))
    assert len(clips) == len(CRITIC)
    for clip in clips:
        runs = {ir.op(n) for n in ir.ancestors(clip)}
        assert "ResourceApplyRMSProp" not in runs and "Placeholder" not in runs, (clip, runs)
        assert "AssignAddVariableOp" not in runs  # global_step's increment
    assert pipeline.timings[0].summary["copied"] > 0


def test_the_clipping_run_alone_only_clips(tmp_path):
    """WGAN code may run the clipping on its own (clipping the initial weights once before
    training). The order put on the clipping itself made it wait on RMSProp's update, so
    running it alone also stepped every replica: slots and weights moved (given a batch)."""
    model, ir, _ = transformed(tmp_path, lambda x, y: wgan_critic(x, y, counted=True))
    original = metagraph.load(model)
    clips = clip_ops(original)
    feeds = Feeds(training.analyze(original).inputs, model + ".npz", 16)
    with Runner(original) as run:
        run.initialize()
        start = run.save(str(tmp_path / "start"))
        run.session.run([run.graph.get_operation_by_name(c) for c in clips])
        expected = run.variable_values()
    assert expected["global_step"] == 0 and np.abs(expected["D_W1"]).max() <= CLIP
    with Runner(ir) as run:
        run.restore(start)
        run.session.run([run.graph.get_operation_by_name(c) for c in clips], feeds.batch(0))
        got = run.variable_values()
        assert got["global_step"] == 0
        for i in range(2):
            for name, value in expected.items():
                if name != "global_step":
                    assert np.array_equal(got[f"replica_{i}/{name}"], value), (i, name)
        run.step(feeds.batch(0))  # the step still clips after its update, on every replica
        values = run.variable_values()
        assert values["global_step"] == 1
        for var in CRITIC:
            assert np.array_equal(values[f"replica_0/{var}"], values[f"replica_1/{var}"])
            assert np.abs(values[f"replica_0/{var}"]).max() <= CLIP
            assert not np.array_equal(values[f"replica_0/{var}/RMSProp"],
                                      expected[f"{var}/RMSProp"])


def test_ps_clips_its_one_copy_after_the_step(tmp_path):
    """ps keeps one copy, clipped and stepped once per step by one run: already one of the
    original's orders, and given the same one as the replicated strategies."""
    _, ir, _ = transformed(tmp_path, wgan_critic, "ps")
    for var in CRITIC:
        read, _ = clip_read(ir, var)
        (apply,) = writes_of(ir, var, "ResourceApplyRMSProp")
        assert apply in ir.ancestors(read)


def test_wgan_replicas_stay_equal_and_clipped(tmp_path):
    """Trained under allreduce, every replica's copy of every critic weight is equal to the
    others' and inside the clipping range after every step (the clipping ran last); before,
    replicas parted after a few steps, one clipped, another stepped past the range."""
    model, ir, _ = transformed(tmp_path, wgan_critic, devices=[f"/device:CPU:{i}"
                                                             for i in range(4)])
    feeds = Feeds(training.analyze(ir).inputs, model + ".npz", 32)
    with Runner(ir) as run:
        run.initialize()
        for k in range(10):
            run.step(feeds.batch(k))
            values = run.variable_values()
            for var in CRITIC:
                copies = [values[f"replica_{i}/{var}"] for i in range(4)]
                assert all(np.array_equal(c, copies[0]) for c in copies), (k, var)
                assert np.abs(copies[0]).max() <= CLIP, (k, var)


def test_a_soft_update_reads_the_stepped_network_in_every_replica(tmp_path):
    """A DQN's soft update grouped beside its step: the target network's reads for the loss
    come before the soft update writes it, and the soft update reads the Q-network after its
    update, in every replica."""
    _, ir, _ = transformed(tmp_path, dqn(soft_update_in_step=True))
    for prefix in ("replica_0/", "replica_1/"):
        (apply,) = writes_of(ir, "q/out/kernel", "ResourceApplyGradientDescent", prefix)
        runs = ir.ancestors("train_and_update")  # the step's copy of the soft update
        (soft,) = [w for w in writes_of(ir, "target/out/kernel", "AssignVariableOp", prefix)
                   if "AssignVariableOp" in w and w in runs]
        reads = [dst for dst, _ in ir.consumers(prefix + "q/out/kernel")
                 if ir.op(dst) == "ReadVariableOp" and dst in ir.value_sources(soft)]
        assert reads and all(apply in ir.ancestors(r) for r in reads)


def test_the_contract_refuses_a_replica_that_lost_the_order(tmp_path):
    _, ir, _ = transformed(tmp_path, wgan_critic)
    read, _ = clip_read(ir, "D_W1", "replica_1/")
    (apply,) = writes_of(ir, "D_W1", "ResourceApplyRMSProp", "replica_1/")
    ir.remove_control_input(read, apply)
    tg = training.analyze(metagraph.load(str(tmp_path / "m.meta")))
    contract.check(ir, tg, 2, ordered=[])  # the variables' own proof does not see it
    with pytest.raises(ContractError, match="no longer runs after 'replica_1/RMSProp/update_D_W1"):
        contract.check(ir, tg, 2, ordered=_ordered(tmp_path))


def test_the_contract_refuses_a_step_that_runs_the_unordered_original(tmp_path):
    """The step runs ordered copies of the clipping; a step that runs the originals again (in
    no order with its update) is refused, though the originals keep no order to lose."""
    _, ir, _ = transformed(tmp_path, wgan_critic)
    for src in list(ir.control_inputs("replica_1/train")):
        if src.startswith("replica_1/order_races/"):
            ir.remove_control_input("replica_1/train", src)
            ir.add_control_input("replica_1/train", src.replace("order_races/", ""))
    tg = training.analyze(metagraph.load(str(tmp_path / "m.meta")))
    with pytest.raises(ContractError, match="the step no longer runs 'replica_1/order_races/"):
        contract.check(ir, tg, 2, ordered=_ordered(tmp_path))


def _ordered(tmp_path):
    from graphxform.pipeline import PassContext
    from graphxform.passes.order_races import OrderRaces
    ir = metagraph.load(str(tmp_path / "m.meta"))
    ctx = PassContext(training=training.analyze(ir), devices=["/device:CPU:0"])
    OrderRaces().run(ir, ctx)
    return ctx.state["order-races"]["ordered"]


def test_verify_says_the_transformed_graph_runs_one_order(run_cli, tmp_path):
    model = export_classifier(tmp_path / "m.meta", wgan_critic)
    code, out, _ = run_cli("verify", model, "--strategy", "allreduce", "--replicas", "2",
                           "--feeds", model + ".npz", "--batch-size", "16", "--steps", "2")
    assert "writes 'D_W1' with" in out  # the original races: it may legitimately differ
    assert "one order, the same on every replica" in out
    spreads = [line.split()[-1] for line in out.splitlines() if line.startswith("D_")]
    assert spreads and all(float(s) == 0 for s in spreads)  # the replicas never part


def clipped_after_a_conditional_step(x, y):
    """A step applied only when its gradients are finite (a legacy tf.cond, as loss scaling
    writes it), with the clipping grouped beside it: the clipping cannot wait on an update
    that may not run."""
    tf1.disable_control_flow_v2()
    try:
        w = tf1.get_variable("w", [8, 2], use_resource=True)
        loss = tf1.losses.sparse_softmax_cross_entropy(y, tf.matmul(x, w))
        opt = tf1.train.GradientDescentOptimizer(0.1)
        grads = opt.compute_gradients(loss)
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g, _ in grads])
        step = tf1.cond(finite, lambda: tf.group(opt.apply_gradients(grads)), tf.no_op)
        return tf.group(step, w.assign(tf.clip_by_value(w, -0.5, 0.5)))
    finally:
        tf1.enable_control_flow_v2()


def test_a_pair_it_cannot_order_is_refused_in_one_line(run_cli, tmp_path):
    model = export_classifier(tmp_path / "m.meta", clipped_after_a_conditional_step)
    code, out, err = run_cli("apply", "--strategy", "allreduce", "--replicas", "2", model,
                             "-o", tmp_path / "out.meta")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "'cond/GradientDescent/update_w/ResourceApplyGradientDescent'" in err
    assert "runs in a tf.cond branch" in err and "Traceback" not in err
    # ps keeps the one copy, which one run steps and clips as the original does
    ir = metagraph.load(model)
    strategies.transform(ir, "ps", cluster=cluster.Cluster(PS_SPEC))


def two_optimizers_on_one_weight(x, y):
    """Two optimizers grouped into one step, both training ``w``: their updates of it run in
    no order, and either one, run alone, must not run the other."""
    w = tf1.get_variable("w", [8, 2], use_resource=True)
    loss = tf1.losses.sparse_softmax_cross_entropy(y, tf.matmul(x, w))
    fit = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    decay = tf1.train.GradientDescentOptimizer(0.1).minimize(1e-3 * tf.reduce_sum(w * w))
    return tf.group(fit, decay)


def test_an_order_that_would_tie_an_update_to_the_other_is_refused(run_cli, tmp_path):
    """Ordering the two updates in the step would make one wait on the other wherever it
    runs (the fit's update on the decay's: run alone, it would run both); a copy of an
    optimizer's update or a gradient for the step alone is not made."""
    model = export_classifier(tmp_path / "m.meta", two_optimizers_on_one_weight)
    code, _, err = run_cli("apply", "--strategy", "allreduce", "--replicas", "2", model,
                           "-o", tmp_path / "out.meta")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    # both are the optimizers' updates: the later made waits on the earlier
    assert ("'GradientDescent_1' computes or applies a gradient and would wait on "
            "'GradientDescent/update_w/ResourceApplyGradientDescent' wherever it runs, alone too"
            in err), err


def wgan_clip_fetched(x, y):
    """wiseodd/generative-models' WGAN as written: critic and generator steps (RMSProp's
    minimize puts both in the train_op collection), and the clipping outside both, fetched
    beside the critic's step: ``sess.run([D_solver, D_loss, clip_D])``."""
    def xavier_init(size):
        return tf1.random_normal(shape=size, stddev=1. / tf.sqrt(size[0] / 2.))
    D_W1 = tf1.Variable(xavier_init([8, 16]))
    D_b1 = tf1.Variable(tf.zeros(shape=[16]))
    D_W2 = tf1.Variable(xavier_init([16, 1]))
    D_b2 = tf1.Variable(tf.zeros(shape=[1]))
    theta_D = [D_W1, D_W2, D_b1, D_b2]
    G_W1 = tf1.Variable(xavier_init([4, 8]))
    G_b1 = tf1.Variable(tf.zeros(shape=[8]))
    theta_G = [G_W1, G_b1]

    def discriminator(h):
        return tf.matmul(tf.nn.relu(tf.matmul(h, D_W1) + D_b1), D_W2) + D_b2
    G_sample = tf.nn.sigmoid(tf.matmul(x[:, :4], G_W1) + G_b1)
    D_loss = tf.reduce_mean(discriminator(x)) - tf.reduce_mean(discriminator(G_sample))
    G_loss = -tf.reduce_mean(discriminator(G_sample))
    D_solver = tf1.train.RMSPropOptimizer(learning_rate=1e-2).minimize(-D_loss,
                                                                        var_list=theta_D)
    tf1.train.RMSPropOptimizer(learning_rate=1e-2).minimize(G_loss, var_list=theta_G)
    clip_D = [p.assign(tf.clip_by_value(p, -CLIP, CLIP)) for p in theta_D]
    assert [tf1.get_default_graph().as_graph_element(c).name for c in clip_D] == CLIP_FETCHES
    return D_solver


CLIP_FETCHES = [f"ReadVariableOp{s}:0" for s in ("", "_1", "_2", "_3")]  # clip_D's values


@pytest.mark.parametrize("strategy, warned", [("allreduce", True), ("replicated", True),
                                              ("ps", False), ("model-average", False)])
def test_a_clipping_fetched_beside_the_step_is_named_in_a_warning(run_cli, tmp_path,
                                                                   strategy, warned):
    """The clipping runs in no step, so nothing can order it (run alone it would run a step);
    fetched with the step, each replica orders the two its own way. apply says so, naming
    it; ps keeps one copy (one order), model-average's replicas train apart by design."""
    model = export_classifier(tmp_path / "m.meta", wgan_clip_fetched)
    where = (["--cluster", _cluster_file(tmp_path)] if strategy == "ps"
             else ["--replicas", "2"])
    code, _, err = run_cli("apply", "--strategy", strategy, *where, model,
                           "-o", tmp_path / "out.meta")
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("graphxform: warning:")]
    assert bool(warnings) == warned, err
    if warned:
        assert "'AssignVariableOp', 'AssignVariableOp_1', 'AssignVariableOp_2' and 1 more" in err
        assert "'RMSProp/update_Variable/ResourceApplyRMSProp' and 'AssignVariableOp'" in err
        assert "step 'RMSProp' uses" in warnings[0] and "session.run of their own" in err
    code, _, err = run_cli("inspect", model)
    assert code == 0 and "'AssignVariableOp'" in err and "step 'RMSProp' uses" in err


def test_the_clipping_grouped_into_the_step_is_no_warning(run_cli, tmp_path):
    model = export_classifier(tmp_path / "m.meta", wgan_critic)
    code, _, err = run_cli("apply", "--strategy", "allreduce", "--replicas", "2", model,
                           "-o", tmp_path / "out.meta")
    assert code == 0 and "warning" not in err, err


def test_verify_reads_a_clipping_fetched_beside_the_step_after_it(run_cli, tmp_path):
    """verify fetches the clipping after the steps, on both graphs (beside the step, the
    original runs the two in TF's order of the moment and each replica in its own): the
    values compare, and the replicas never part."""
    model = export_classifier(tmp_path / "m.meta", wgan_clip_fetched)
    fetches = [a for f in CLIP_FETCHES for a in ("--fetch", f)]
    code, out, _ = run_cli("verify", model, "--strategy", "allreduce", "--replicas", "2",
                           "--feeds", model + ".npz", "--batch-size", "16", "--steps", "3",
                           *fetches)
    assert code == 0 and "PASS" in out, out
    assert f"note: --fetch {CLIP_FETCHES[0]} runs 'AssignVariableOp', a write no step runs" in out
    assert "both graphs fetch it in a session.run of its own" in out
    assert not any(f"'{f}' reads" in out for f in CLIP_FETCHES)  # no longer a race
    spreads = [line.split()[-1] for line in out.splitlines() if line.startswith("Variable")]
    assert spreads and all(float(s) == 0 for s in spreads)


def test_run_fetches_the_clipping_after_the_step(run_cli, tmp_path):
    model = export_classifier(tmp_path / "m.meta", wgan_clip_fetched)
    feeds = Feeds(training.analyze(metagraph.load(model)).inputs, model + ".npz", 16)
    with Runner(metagraph.load(model), fetches=[CLIP_FETCHES[0], "sub:0"]) as run:
        assert list(run.apart) == [CLIP_FETCHES[0]]  # the loss stays beside the step
        run.initialize()
        result = run.step(feeds.batch(0))
        assert list(result.fetches) == [CLIP_FETCHES[0], "sub:0"]
        clipped = run.variable_values()["Variable"]
        assert np.abs(clipped).max() <= CLIP  # clipped after both steps' updates
        assert np.array_equal(result.fetches[CLIP_FETCHES[0]], clipped)
    code, out, err = run_cli("run", model, "--feeds", model + ".npz", "--batch-size", "16",
                             "--steps", "1", "--fetch", CLIP_FETCHES[0])
    assert code == 0 and f"note: --fetch {CLIP_FETCHES[0]} runs 'AssignVariableOp'" in err


def _cluster_file(tmp_path):
    import json
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(PS_SPEC))
    return str(path)
