"""hybrid (Parallax): dense-gradient variables all-reduced per replica, sparse-gradient ones on
the ps tasks behind sparse accumulators. The corpus's exact recipes and the embedding fixture,
transformed for 2 ps + 2 workers (and 1 worker x 2 replicas), match the single-device graph
for 3 steps within 1e-5; the borderline options decide as documented."""

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import pytest  # noqa: E402
from conftest import fixture_path  # noqa: E402
from recipe_loop import load_manifest, recipe_meta  # noqa: E402

from graphxform import cluster, equivalence, metagraph, strategies, training  # noqa: E402
from graphxform.errors import GraphxformError  # noqa: E402
from graphxform.passes.hybrid import decide  # noqa: E402
from graphxform.plan import ClusterPlan  # noqa: E402

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


def test_per_task_runs_are_refused_in_one_line():
    ir, _ = transform(EMBEDDING)
    with pytest.raises(GraphxformError, match="hybrid graph: it runs with one client only"):
        ClusterPlan.from_ir(ir).require_per_task()


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
