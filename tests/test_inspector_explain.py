"""`apply --explain`: per variable, the decision taken and why, read from the output graph."""

from conftest import fixture_path

from graphxform import cluster, metagraph, strategies, training
from graphxform.inspector import explain

SPEC = {"ps": ["127.0.0.1:2222", "127.0.0.1:2223"],
        "worker": ["127.0.0.1:2224", "127.0.0.1:2225"]}


def decisions(name, strategy, **options):
    original, ir = metagraph.load(fixture_path(name)), metagraph.load(fixture_path(name))
    pipeline = strategies.transform(ir, strategy, **options)
    summary = {}
    for t in pipeline.timings:
        summary.update(t.summary)
    found = explain.explain(training.analyze(original), ir, strategy, 2, summary,
                            options.get("bucket_bytes"))
    return {d.variable: d for d in found}, ir


def test_allreduce_names_each_gradients_bucket():
    found, ir = decisions("embedding_adam", "allreduce", bucket_bytes=64,
                          devices=["/device:CPU:0", "/device:CPU:1"])
    kernel = found["dense0/kernel"]
    assert kernel.decision == "replicated x 2"
    assert kernel.combined_at.startswith("allreduce/bucket_") and kernel.bytes_per_step == 64
    assert ir.has_scope(kernel.combined_at + "/")
    assert found["dense0/bias"].combined_at != kernel.combined_at  # 64-byte buckets: apart
    embedding = found["embedding/weights"]
    assert embedding.combined_at == "allreduce/sparse_0" and "gathered" in embedding.why
    assert "slot of 'dense0/kernel'" in found["dense0/kernel/Adam"].why
    assert found["global_step"].decision == "shared (one copy)"
    assert "step counter" in found["global_step"].why


def test_ps_names_the_task_and_the_greedy_turn():
    found, ir = decisions("embedding_adam", "ps", cluster=cluster.Cluster(SPEC))
    embedding = found["embedding/weights"]
    task = ir.node("embedding/weights")["device"].split("/task:")[1][0]
    assert embedding.decision == f"shared on ps task {task}"
    assert embedding.combined_at == "embedding/weights/accumulator"
    assert "#1 by size" in embedding.why and f"placed on ps task {task}" in embedding.why
    assert embedding.bytes_per_step == 2 * 2 * embedding.nbytes


def test_partitioned_ps_says_which_variables_were_split():
    found, _ = decisions("embedding_adam", "partitioned-ps", cluster=cluster.Cluster(SPEC),
                         partition_min_bytes=200)
    assert found["embedding/weights"].decision.startswith("partitioned into 2 on ps task")
    assert found["embedding/weights"].combined_at == "embedding/weights/part_*/accumulator"
    assert found["dense0/bias"].why.startswith("kept whole")


def test_apply_explain_prints_the_table(run_cli, tmp_path):
    code, out, err = run_cli("apply", fixture_path("mlp_sgd"), "--replicas", 2, "-o",
                             tmp_path / "out.meta", "--explain")
    assert code == 0, err
    header = next(line for line in out.splitlines() if line.startswith("variable"))
    assert "decision" in header and "bytes/step" in header and "why" in header
    assert any(line.startswith("dense0/kernel ") and "replicated x 2" in line
               for line in out.splitlines())
