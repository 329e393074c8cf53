"""hybrid (Parallax): dense-gradient variables all-reduced per replica, sparse-gradient ones on
the ps tasks behind sparse accumulators. The corpus's exact recipes and the embedding fixture,
transformed for 2 ps + 2 workers (and 1 worker x 2 replicas), match the single-device graph
for 3 steps within 1e-5 with one client; wide & deep launched one process per task (1 ps, 2
workers x 2 replicas on 127.0.0.1) matches it too; the borderline options decide as
documented."""

import os
import re

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import pytest  # noqa: E402
from conftest import fixture_path  # noqa: E402
from recipe_loop import load_manifest, recipe_meta  # noqa: E402

from test_multiworker import STARTED, assert_close, gone, port_free  # noqa: E402

from graphxform import cluster, equivalence, metagraph, strategies, training  # noqa: E402
from graphxform.errors import GraphxformError  # noqa: E402
from graphxform.passes.hybrid import decide  # noqa: E402
from graphxform.plan import ClusterPlan  # noqa: E402
from graphxform.runtime import servers  # noqa: E402
from graphxform.runtime.local import Feeds, Runner  # noqa: E402

SPEC = {"ps": ["127.0.0.1:2222", "127.0.0.1:2223"],
        "worker": ["127.0.0.1:2224", "127.0.0.1:2225"]}
ONE_WORKER = {"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2224"]}
MANIFEST = load_manifest()
EXACT = sorted(name for name, entry in MANIFEST.items() if entry["exact"])
EMBEDDING = os.path.join(os.path.dirname(__file__), "fixtures", "embedding_adam.meta")


def transform(meta, spec=SPEC, devices=None, train_op=None, **options):
    ir = metagraph.load(meta)
    pipeline = strategies.transform(ir, "hybrid", cluster=cluster.Cluster(spec),
                                    devices=devices, train_op=train_op, **options)
    return ir, pipeline


def assert_matches(meta, entry=None, **kwargs):
    entry = entry or {}
    ir, _ = transform(meta, train_op=entry.get("train_ops"), **kwargs)
    report = equivalence.compare(metagraph.load(meta), ir, meta.replace(".meta", ".npz"),
                                 steps=3, batch_size=entry.get("batch_size", 8), rtol=1e-5,
                                 train_op=entry.get("train_ops"))
    assert report.ok, equivalence.format_report(report)
    return ir


def decisions(pipeline):
    return next(t for t in pipeline.timings if t.name == "choose-placement").summary


@pytest.mark.parametrize("name", EXACT)
def test_exact_recipe_matches_single_device(name):
    assert_matches(recipe_meta(name), MANIFEST[name])


def test_embedding_on_ps_dense_all_reduced_one_worker_two_replicas():
    devices = ["/job:worker/task:0/device:CPU:0", "/job:worker/task:0/device:CPU:1"]
    ir = assert_matches(EMBEDDING, spec=ONE_WORKER, devices=devices)
    assert "embedding/weights" in ir and "replica_0/embedding/weights" not in ir
    assert ir.node("embedding/weights")["device"].startswith("/job:ps/")
    assert "replica_1/dense0/kernel" in ir  # the original name stays as a fetchable view


def test_decisions_are_reported_and_overridable():
    _, pipeline = transform(EMBEDDING)
    said = decisions(pipeline)
    assert said["embedding/weights"] == "ps (sparse gradient)"
    assert said["dense0/kernel"] == "allreduce (dense gradient)"
    ir, pipeline = transform(EMBEDDING, sparse_as_dense_below=1 << 30)
    assert decisions(pipeline)["embedding/weights"].startswith("allreduce (sparse gradient")
    assert "replica_1/embedding/weights" in ir
    _, pipeline = transform(EMBEDDING, placement={"dense0/kernel": "ps"})
    assert decisions(pipeline)["dense0/kernel"] == "ps (placement file)"


def test_bad_placement_file_entries_are_refused():
    tg = training.analyze(metagraph.load(EMBEDDING))
    with pytest.raises(GraphxformError, match="no trainable variable"):
        decide(tg.trainable, overrides={"nope": "ps"})
    with pytest.raises(GraphxformError, match="expected one of"):
        decide(tg.trainable, overrides={"dense0/kernel": "gpu"})


def test_each_task_runs_its_own_replicas_and_a_barrier_orders_the_update():
    ir, _ = transform(EMBEDDING, devices=cluster.Cluster(SPEC).worker_devices(2))
    plan = ClusterPlan.from_ir(ir)
    assert plan.collective_leader == "/job:worker/replica:0/task:0"
    assert plan.device_filters == {"worker:0": [], "worker:1": ["/job:ps", "/job:worker/task:1"]}
    for task, mine in (("worker:0", {"replica_0", "replica_1"}),
                       ("worker:1", {"replica_2", "replica_3"})):
        ran = {n.split("/")[0] for n in ir.ancestors(plan.steps[task]) if n.startswith("replica_")}
        assert ran == mine
        # the step ends in a collective over the tasks, once the rest of it is done
        scope = f"hybrid_sync/{task.replace(':', '_')}/"
        assert ir.control_inputs(plan.steps[task]) == [scope + "end"]
        assert ir.op(scope + "end") == "CollectiveReduceV2"
        assert scope + "done" in ir.control_inputs(scope + "end")
    # Adam's beta powers move once all replicas' dense updates ran: through the barrier
    assert "hybrid_sync/all_done" in ir.control_inputs("Adam/update")
    assert not [c for c in ir.control_inputs("Adam/update") if c.startswith("replica_")]
    assert {"hybrid_sync/worker_0/done", "hybrid_sync/worker_1/done"} <= set(
        ir.control_inputs("Adam"))  # one client still runs every replica


def test_per_task_runs_are_refused_in_one_line_when_nothing_is_on_the_ps():
    ir, _ = transform(EMBEDDING, placement={"embedding/weights": "allreduce"})
    with pytest.raises(GraphxformError, match="runs with one client only.*every variable is "
                                              "all-reduced"):
        ClusterPlan.from_ir(ir).require_per_task()


@pytest.mark.slow
def test_launched_per_task_trains_like_one_device(run_cli, tmp_path):
    """wide & deep (FTRL and Adagrad on embeddings, dense layers) for 1 ps + 2 workers x 2
    replicas, one process per task: each step's mean loss over workers and the chief's
    checkpoint match the single-device graph."""
    meta, entry, steps = recipe_meta("wide_deep"), MANIFEST["wide_deep"], 3
    feeds = meta.replace(".meta", ".npz")
    original = metagraph.load(meta)
    source = Feeds(training.analyze(original).inputs, feeds, entry["batch_size"])
    with Runner(original) as run:
        run.initialize()
        start = run.save(str(tmp_path / "start"))
        losses = [run.step(source.batch(k)).loss for k in range(steps)]
        values = run.variable_values()
    spec = servers.local_cluster({"ps": 1, "worker": 2})
    ir, _ = transform(meta, spec=spec.as_dict(), devices=spec.worker_devices(2))
    out_meta = str(tmp_path / "wide_deep.hybrid.meta")
    metagraph.save(ir, out_meta)
    save = tmp_path / "ckpt" / "model"
    code, out, err = run_cli("launch", out_meta, "--steps", steps, "--feeds", feeds,
                             "--batch-size", entry["batch_size"], "--restore", start,
                             "--save", save, "--timeout", 60)
    assert code == 0, out + err
    assert_close([float(x) for x in re.findall(r"^step \d+  loss (\S+)$", out, re.M)], losses)
    with Runner(metagraph.load(meta)) as run:
        run.restore(f"{save}-{steps}")
        for name, value in run.variable_values().items():
            assert_close(value, values[name])
    for _, _, port, pid in STARTED.findall(out):
        assert gone(int(pid)), f"pid {pid} left behind"
        assert port_free(int(port)), f"port {port} still bound"


def test_cli_apply_prints_each_decision_and_verify_passes(run_cli, tmp_path):
    spec = tmp_path / "cluster.json"
    spec.write_text('{"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223"]}')
    placement = tmp_path / "placement.json"
    placement.write_text('{"dense0/bias": "ps"}')
    code, out, err = run_cli("apply", fixture_path("embedding_adam"), "--strategy", "hybrid",
                             "--cluster", spec, "--placement-file", placement,
                             "-o", tmp_path / "out.meta")
    assert code == 0, err
    assert "embedding/weights: ps (sparse gradient)" in out
    assert "dense0/kernel: allreduce (dense gradient)" in out
    assert "dense0/bias: ps" in out
    code, out, err = run_cli("verify", fixture_path("embedding_adam"), "--strategy", "hybrid",
                             "--cluster", spec, "--feeds", fixture_path("embedding_adam", ".npz"),
                             "--steps", 3)
    assert code == 0 and "PASS" in out, out + err


def test_cli_hybrid_options_refused_elsewhere(run_cli, tmp_path):
    code, _, err = run_cli("apply", fixture_path("mlp_sgd"), "--replicas", 2,
                           "--sparse-as-dense-below", 100, "-o", tmp_path / "out.meta")
    assert code != 0
