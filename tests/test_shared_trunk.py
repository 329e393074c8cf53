"""One variable trained by two optimizers, as actor-critic code writes it: a shared trunk, an
actor head and a critic head, ``actor_opt.minimize(actor_loss)`` and
``critic_opt.minimize(critic_loss)`` each over the trunk and its own head (two train ops, or
both grouped in one). The trunk gets two gradients per step; every strategy reduces each, in
the step that applies it (the parameter-server ones aggregate each in its own accumulator), and
trains like one device. Grouped in one train op, the two updates of the trunk run in no order:
allreduce and replicated refuse them (each replica would pick its own order:
passes/order_races.py); ps keeps one copy of the trunk, which one run updates in one order."""

import pytest
from conftest import export_classifier as _export
from test_custom_training_code import dense


def actor_critic(grouped=False):
    """Two train ops (``grouped``: one, tf.group of both optimizers' steps)."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    def build(x, y):
        h = dense(x, 16, "trunk", tf.nn.relu)
        logits = dense(h, 2, "actor")
        value = tf.squeeze(dense(h, 1, "critic"), 1)
        actor_loss = tf1.losses.sparse_softmax_cross_entropy(y, logits)
        critic_loss = tf.reduce_mean(tf.square(tf.cast(y, tf.float32) - value))
        owned = lambda *scopes: [v for v in tf1.trainable_variables()  # noqa: E731
                                 if v.op.name.split("/")[0] in scopes]
        step = tf1.train.get_or_create_global_step()
        actor = tf1.train.MomentumOptimizer(0.1, 0.9).minimize(
            actor_loss, var_list=owned("trunk", "actor"), global_step=step, name="actor_train")
        critic = tf1.train.AdamOptimizer(0.01).minimize(
            critic_loss, var_list=owned("trunk", "critic"), name="critic_train")
        if grouped:
            return tf.group(actor, critic, name="train")
        tf1.add_to_collection("train_op", actor)
        return critic
    return build


def test_the_analysis_records_both_optimizers_updates(tmp_path):
    from graphxform import metagraph, training
    tg = training.analyze(metagraph.load(_export(tmp_path / "m.meta", actor_critic())))
    assert [s.name for s in tg.steps] == ["actor_train", "critic_train"]
    kernel = tg.variables["trunk/kernel"]
    updates = sorted(a.update for a in kernel.applications)
    assert updates == ["actor_train/update_trunk/kernel/ResourceApplyMomentum",
                       "critic_train/update_trunk/kernel/ResourceApplyAdam"]
    assert len({a.gradient.tensor for a in kernel.applications}) == 2
    assert (kernel.applied_by, kernel.gradient) == (kernel.applications[0].update,
                                                     kernel.applications[0].gradient)
    assert [a.update for a in tg.variables["actor/kernel"].applications] == [
        "actor_train/update_actor/kernel/ResourceApplyMomentum"]


@pytest.mark.parametrize("strategy", ["allreduce", "replicated"])
def test_a_trunk_two_optimizers_train_trains_like_one_device(run_cli, tmp_path, strategy):
    """Both gradients of the trunk are reduced, each in the step that applies it (refused
    before: only one was, and the contract caught the other)."""
    model = _export(tmp_path / "m.meta", actor_critic(False))
    code, out, err = run_cli("verify", "--strategy", strategy, "--replicas", 2, model,
                             "--feeds", model + ".npz", "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err


def test_two_optimizers_grouped_in_one_train_op_are_refused(run_cli, tmp_path):
    """Grouped into one train op, the two updates of the trunk run in no order, and each
    replica would pick its own (passes/order_races.py); an edge would make one optimizer's
    update, run alone, run the other's too: refused naming both."""
    model = _export(tmp_path / "m.meta", actor_critic(True))
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "in no order" in err and "ResourceApplyMomentum" in err and \
        "ResourceApplyAdam" in err and "computes or applies a gradient" in err


def embedding_actor_critic(dense_critic=False):
    """actor_critic over a shared embedding (sparse gradients from both losses; with
    ``dense_critic``, the critic reads rows of it by a matmul, a dense gradient): hybrid keeps
    it on the ps side (all-reduce would densify the actor's Momentum gradient)."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    def build(x, y):
        ids = tf.math.floormod(tf.cast(tf.abs(x[:, :3]) * 10, tf.int64), 40)
        emb = tf1.get_variable("emb", [40, 6])
        h = tf.reduce_sum(tf.gather(emb, ids), 1)
        logits = dense(h, 2, "actor")
        value = tf.squeeze(dense(tf.matmul(x[:, :5], emb[:5]) if dense_critic else h, 1,
                                 "critic"), 1)
        actor_loss = tf1.losses.sparse_softmax_cross_entropy(y, logits)
        critic_loss = tf.reduce_mean(tf.square(tf.cast(y, tf.float32) - value))
        owned = lambda *scopes: [v for v in tf1.trainable_variables()  # noqa: E731
                                 if v.op.name.split("/")[0] in scopes]
        actor = tf1.train.MomentumOptimizer(0.1, 0.9).minimize(
            actor_loss, var_list=owned("emb", "actor"),
            global_step=tf1.train.get_or_create_global_step(), name="actor_train")
        tf1.add_to_collection("train_op", actor)
        return tf1.train.AdagradOptimizer(0.1).minimize(
            critic_loss, var_list=owned("emb", "critic"), name="critic_train")
    return build


def chained_through_the_trunk():
    """The critic's step, then the actor's forward pass under a control dependency on it, so
    the actor reads the trunk the critic just updated; one train op, the actor's."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    def build(x, y):
        with tf1.variable_scope("", reuse=tf1.AUTO_REUSE):
            value = tf.squeeze(dense(dense(x, 16, "trunk", tf.nn.relu), 1, "critic"), 1)
            critic = tf1.train.AdamOptimizer(0.01).minimize(
                tf.reduce_mean(tf.square(tf.cast(y, tf.float32) - value)), name="critic_train")
            with tf.control_dependencies([critic]):
                logits = dense(dense(x, 16, "trunk", tf.nn.relu), 2, "actor")
                actor_loss = tf1.losses.sparse_softmax_cross_entropy(y, logits)
        return tf1.train.MomentumOptimizer(0.1, 0.9).minimize(
            actor_loss, var_list=[v for v in tf1.trainable_variables()
                                  if not v.op.name.startswith("critic")], name="actor_train")
    return build


@pytest.fixture
def cluster_file(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text('{"ps": ["127.0.0.1:28001", "127.0.0.1:28004"], "worker": '
                    '["127.0.0.1:28002", "127.0.0.1:28003"]}')
    return path


@pytest.mark.parametrize("strategy, builder", [
    ("ps", actor_critic), ("partitioned-ps", actor_critic), ("hybrid", actor_critic),
    ("ps", embedding_actor_critic), ("hybrid", embedding_actor_critic),
    ("hybrid", lambda: embedding_actor_critic(dense_critic=True)),
    ("ps", lambda: actor_critic(grouped=True)), ("ps", chained_through_the_trunk)],
    ids=["ps", "partitioned-ps", "hybrid", "ps-embedding", "hybrid-embedding",
         "hybrid-sparse-and-dense", "ps-grouped", "ps-chained"])
def test_a_trunk_two_optimizers_train_trains_like_one_device_on_parameter_servers(
        run_cli, tmp_path, cluster_file, strategy, builder):
    """Each gradient of the trunk has its own accumulator, taken by the update that applies
    it (refused before: the ps strategies aggregated one gradient per variable). Chained, the
    step runs the critic's accumulators' applies too, reached through the actor's only."""
    model = _export(tmp_path / "m.meta", builder())
    code, out, err = run_cli("verify", "--strategy", strategy, "--cluster", cluster_file, model,
                             "--feeds", model + ".npz", "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err


def test_each_gradient_of_the_trunk_has_its_own_accumulator(tmp_path, cluster_file):
    import json
    from graphxform import cluster, metagraph, strategies
    ir = metagraph.load(_export(tmp_path / "m.meta", actor_critic()))
    spec = cluster.Cluster(json.loads(cluster_file.read_text()))
    pipeline = strategies.transform(ir, "partitioned-ps", cluster=spec)
    accumulators = {n: ir.attrs(n)["shared_name"].s.decode() for n in ir.nodes()
                    if ir.op(n) == "ConditionalAccumulator" and n.startswith("trunk/kernel")}
    assert accumulators == {"trunk/kernel/accumulator": "trunk/kernel/accumulator",
                            "trunk/kernel/gradient_1/accumulator":
                            "trunk/kernel/gradient_1/accumulator"}
    steps = set()
    for acc in accumulators:  # each taken by one optimizer's update, run by that step
        (update,) = {c for c, _ in ir.consumers(acc + "/take")}
        step = update.split("/")[0]
        assert update == f"{step}/update_trunk/kernel/" + {
            "actor_train": "ResourceApplyMomentum", "critic_train": "ResourceApplyAdam"}[step]
        assert {f"{acc}/apply_worker_0", f"{acc}/apply_worker_1"} <= set(
            ir.control_inputs(step))
        steps.add(step)
    assert steps == {"actor_train", "critic_train"}
    kept = next(t.summary for t in pipeline.timings if t.name == "partition-variables")
    assert kept["kept_whole"]["trunk/kernel"].startswith("two optimizers train it")
    assert "update_trunk/kernel/ResourceApplyMomentum" in kept["kept_whole"]["trunk/kernel"]
    assert "actor/kernel" not in kept["kept_whole"]


def test_async_gives_each_worker_its_own_update_of_each_optimizer(tmp_path, cluster_file):
    """--async: every worker applies its mean gradient of each optimizer itself (before, the
    actor's update of the trunk ran once per replica, the critic's once per worker)."""
    import json
    from graphxform import cluster, metagraph, strategies
    ir = metagraph.load(_export(tmp_path / "m.meta", actor_critic()))
    strategies.transform(ir, "ps", cluster=cluster.Cluster(json.loads(
        cluster_file.read_text())), asynchronous=True)
    applies = sorted(n for n in ir.nodes() if n.endswith("update_trunk/kernel/"
                                                         "ResourceApplyMomentum")
                     or n.endswith("update_trunk/kernel/ResourceApplyAdam"))
    assert applies == [f"ps_async/worker_{w}/{step}/update_trunk/kernel/{op}"
                       for w in (0, 1) for step, op in (("actor_train", "ResourceApplyMomentum"),
                                                        ("critic_train", "ResourceApplyAdam"))]


@pytest.mark.parametrize("shared", [True, False], ids=["shared_trunk", "disjoint"])
def test_a_summed_second_loss_of_one_train_op_is_refused(run_cli, tmp_path, shared):
    """One train op grouping two optimizers minimises two losses: the second (a sum over the
    batch, here the critic's) is checked as the first is. Before, only the first was, and
    the averaged gradient of the sum trained at 1/N (apply exited 0, verify failed)."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    def build(x, y):
        h = dense(x, 16, "trunk", tf.nn.relu)
        logits = dense(h, 2, "actor")
        value = tf.squeeze(dense(h if shared else tf.stop_gradient(h), 1, "critic"), 1)
        actor_loss = tf1.losses.sparse_softmax_cross_entropy(y, logits)
        critic_loss = tf.reduce_sum(tf.square(tf.cast(y, tf.float32) - value), name="critic_sum")
        owned = [v for v in tf1.trainable_variables() if v.op.name.startswith("critic")]
        actor = tf1.train.MomentumOptimizer(0.1, 0.9).minimize(
            actor_loss, var_list=[v for v in tf1.trainable_variables() if v not in owned])
        critic = tf1.train.GradientDescentOptimizer(0.01).minimize(
            critic_loss, var_list=owned + ([v for v in tf1.trainable_variables()
                                            if v.op.name.startswith("trunk")] if shared else []))
        return tf.group(actor, critic, name="train")
    model = _export(tmp_path / "m.meta", build)
    out = tmp_path / "out.meta"
    code, _, err = run_cli("apply", "--strategy", "allreduce", "--replicas", 2, model, "-o", out)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    # grouped over a shared trunk, the two updates of it are refused first (in no order)
    assert ("step 'train' minimises 'critic_sum:0', a sum over the batch" in err
            or shared and "in no order" in err), err
    assert not out.exists()


# ---------------------------------------------------------------- what the inspector shows

ACTOR = "actor_train/update_trunk/kernel/ResourceApplyMomentum"
CRITIC = "critic_train/update_trunk/kernel/ResourceApplyAdam"


def test_inspect_shows_both_gradients_of_the_trunk_each_with_its_update_and_step(
        run_cli, tmp_path):
    """inspect's table of where gradients are born, and its JSON, list the trunk's two
    gradients (before: the first alone, against both steps)."""
    import json
    model = _export(tmp_path / "m.meta", actor_critic())
    code, out, _ = run_cli("inspect", model)
    assert code == 0
    rows = [line.split() for line in out.split("where each gradient is born")[1].splitlines()
            if line.startswith("trunk/kernel ")]
    assert sorted((r[1], r[2].split("/")[0], r[3]) for r in rows) == [
        ("actor_train", "gradients", ACTOR), ("critic_train", "gradients_1", CRITIC)]
    code, out, _ = run_cli("inspect", "--json", model)
    kernel = next(v for v in json.loads(out)["variables"] if v["name"] == "trunk/kernel")
    assert sorted((g["update"], tuple(g["steps"])) for g in kernel["gradients"]) == [
        (ACTOR, ("actor_train",)), (CRITIC, ("critic_train",))]
    assert kernel["gradient"] in [{k: g[k] for k in kernel["gradient"]}
                                  for g in kernel["gradients"]]


def test_explain_shows_both_reductions_of_the_trunk(tmp_path):
    """--explain: the trunk's gradients are reduced in two buckets, one per step; its bytes
    per step count both, and each bucket's bytes count the trunk's gradient it holds (before:
    one bucket, the variable's bytes once, and the other bucket short of the trunk)."""
    from graphxform import metagraph, strategies, training
    from graphxform.inspector import explain
    model = _export(tmp_path / "m.meta", actor_critic())
    original, ir = metagraph.load(model), metagraph.load(model)
    strategies.transform(ir, "allreduce", devices=["/device:CPU:0", "/device:CPU:1"])
    found = {d.variable: d for d in explain.explain(training.analyze(original), ir,
                                                     "allreduce", 2)}
    kernel, actor = found["trunk/kernel"], found["actor/kernel"]
    assert len(set(kernel.combined_at.split(", "))) == 2, kernel
    assert actor.combined_at in kernel.combined_at.split(", ")
    assert kernel.bytes_per_step == 2 * kernel.nbytes
    assert "actor_train's: dense gradient" in kernel.why and "critic_train's" in kernel.why
    # the actor's bucket: actor/kernel, actor/bias and the trunk's actor gradients
    assert "fused with 3 other(s)" in actor.why and "712 bytes" in actor.why, actor.why


def test_cost_counts_both_gradients_of_the_trunk_each_in_its_step(run_cli, tmp_path):
    """cost runs each train op once: the trunk's two gradients are reduced (and owed by the
    minimum) once each, the critic's head in the critic's step (before: the actor's step
    alone was measured, and the minimum was every variable once)."""
    import json
    model = _export(tmp_path / "m.meta", actor_critic())
    code, out, err = run_cli("cost", "--replicas", 2, "--json", model)
    assert code == 0, err
    doc = json.loads(out)
    variables = {v["name"]: v for v in doc["variables"]}
    ring = 2 * (2 - 1) / 2
    assert variables["trunk/kernel"]["minimum"] == 2 * 2 * ring * 512
    assert variables["critic/kernel"]["minimum"] == 2 * ring * 64
    assert all(v["ratio"] == 1.0 for v in doc["variables"]), doc["variables"]
    assert all(t["ratio"] == 1.0 for t in doc["tasks"]), doc["tasks"]
    assert "actor_train, critic_train run once each" in doc["per"]
