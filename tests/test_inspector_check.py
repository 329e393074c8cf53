"""`graphxform check`: passes on every strategy's output for every fixture, and catches
deliberately broken graphs (edited as a person would edit the file), naming the right nodes."""

import glob
import json
import os

import numpy as np
import pytest
from conftest import FIXTURES, fixture_path

from graphxform import cluster, metagraph, strategies
from graphxform.inspector import check
from graphxform.inspector.findings import CheckResult

SPEC = {"ps": ["127.0.0.1:2222", "127.0.0.1:2223"],
        "worker": ["127.0.0.1:2224", "127.0.0.1:2225"]}
ALL = sorted(os.path.splitext(os.path.relpath(p, FIXTURES))[0]
             for p in glob.glob(str(FIXTURES / "*.meta")) + glob.glob(str(FIXTURES / "recipes" /
                                                                         "*.meta")))
WORKERS = {"worker": ["127.0.0.1:2224", "127.0.0.1:2225"]}
TWO = ["/device:CPU:0", "/device:CPU:1"]
STRATEGIES = {  # label: (strategy, options)
    "allreduce": ("allreduce", {"devices": TWO}),
    "allreduce-cluster": ("allreduce", {"cluster": WORKERS, "hierarchical": True}),
    "replicated": ("replicated", {"devices": TWO, "all_reduce_spec": "pscpu"}),
    "independent": ("independent", {"devices": TWO}),
    "model-average": ("model-average", {"devices": TWO}),
    "ps": ("ps", {"cluster": SPEC}),
    "partitioned-ps": ("partitioned-ps", {"cluster": SPEC}),
    "hybrid": ("hybrid", {"cluster": SPEC, "devices": cluster.Cluster(SPEC).worker_devices(2)}),
}


def transformed(name, label="allreduce", **options):
    ir = metagraph.load(fixture_path(name))
    strategy, defaults = STRATEGIES[label]
    options = {**defaults, **options}
    if "cluster" in options:
        options["cluster"] = cluster.Cluster(options["cluster"])
    strategies.transform(ir, strategy, **options)
    return ir


def outputs():
    """(fixture, strategy) for every output a strategy writes."""
    return [(name, label) for name in ALL for label in STRATEGIES]


@pytest.mark.parametrize("name, strategy", outputs())
def test_check_passes_on_every_strategy_output(name, strategy):
    report = check.run(transformed(name, strategy))
    assert report.ok, report.text()
    statuses = {r.name: r.status for r in report.results}
    if strategy in ("ps", "partitioned-ps"):
        # add_check_numerics_ops groups every replica's checks, and a gradient waits on the
        # group: worker 0's step runs worker 1's forward pass again (said, not refused);
        # tf.compat.v1.metrics.mean counts the loss's values with one op that waits on the
        # loss, kept single beside its shared count, so it waits on every replica's loss;
        # the tagger's weighted loss divides by every replica's count of its weights, each
        # shaped by that replica's losses (tf.compat.v1.losses broadcasts the weights)
        twice = name in ("recipes/summaries_check_numerics", "recipes/metrics_mlp",
                         "recipes/dynamic_rnn_tagger")
        assert statuses["accumulators"] == ("warning" if twice else "ok")
        assert statuses["collectives"] == "-"
    elif strategy == "hybrid":
        assert statuses["accumulators"] == "ok" and statuses["collectives"] in ("ok", "-")
    else:
        assert statuses["accumulators"] == "-"
    if strategy.startswith("allreduce"):
        assert statuses["collectives"] == "ok"
    if strategy == "independent":  # not drop-in, said so, not refused
        assert any("never exchange gradients" in f.message for f in report.findings)


# ------------------------------------------------------------------ broken graphs
@pytest.fixture(scope="module")
def buckets(tmp_path_factory):
    """mlp_sgd under allreduce on 2 replicas, one gradient per bucket (4 collectives each)."""
    path = tmp_path_factory.mktemp("check") / "mlp.allreduce.meta"
    metagraph.save(transformed("mlp_sgd", bucket_bytes=1), str(path))
    return str(path)


@pytest.fixture(scope="module")
def ps_graph(tmp_path_factory):
    path = tmp_path_factory.mktemp("check") / "mlp.ps.meta"
    metagraph.save(transformed("mlp_sgd", "ps"), str(path))
    return str(path)


@pytest.fixture(scope="module")
def hybrid_graph(tmp_path_factory):
    """embedding_adam under hybrid: 2 workers x 2 replicas, the embedding on the ps."""
    path = tmp_path_factory.mktemp("check") / "embedding.hybrid.meta"
    metagraph.save(transformed("embedding_adam", "hybrid"), str(path))
    return str(path)


def edited(source, tmp_path, edit):
    """``source`` with its NodeDefs changed by ``edit(nodes_by_name, graph_def)``, as a person
    editing the file would change it."""
    meta, _ = metagraph.read_metagraph(source)
    nodes = {n.name: n for n in meta.graph_def.node}
    edit(nodes, meta.graph_def)
    out = tmp_path / "broken.meta"
    out.write_bytes(meta.SerializeToString())
    return str(out)


def run_check(run_cli, path):
    code, out, err = run_cli("check", path, "--json")
    report = json.loads(out)
    return code, report, [f for f in report["findings"] if f["level"] == "error"]


def errors_naming(errors, *nodes):
    return [e for e in errors if set(nodes) <= set(e["nodes"])]


def const(node, value):
    from tensorflow.python.framework import tensor_util
    node.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(
        np.asarray(value, dtype=tensor_util.MakeNdarray(node.attr["value"].tensor).dtype)))


def test_fresh_output_passes(run_cli, buckets, ps_graph):
    for path in (buckets, ps_graph):
        code, report, errors = run_check(run_cli, path)
        assert code == 0 and report["ok"] and not errors
    code, out, _ = run_cli("check", buckets)
    assert code == 0 and "collectives   ok" in out and "0 error(s)" in out


def test_collective_missing_on_one_replica(run_cli, buckets, tmp_path):
    gone = "allreduce/bucket_1/replica_1/reduce"

    def drop(nodes, graph):
        kept = nodes[gone].input[0]  # its consumers read the replica's own gradient instead
        for node in graph.node:
            node.input[:] = [kept if i == gone else "^" + kept.split(":")[0] if i == "^" + gone
                             else i for i in node.input]
        graph.node.remove(nodes[gone])

    code, report, errors = run_check(run_cli, edited(buckets, tmp_path, drop))
    assert code == 1
    missing = errors_naming(errors, "allreduce/bucket_1/replica_0/reduce")
    assert missing and "not by /device:CPU:1" in missing[0]["message"]
    assert missing[0]["check"] == "collectives"
    # and replica 1's variable now updates from its own gradient
    assert any(e["check"] == "updates" and "replica_1/" in " ".join(e["nodes"]) for e in errors)


def test_instance_keys_swapped_between_two_replicas(run_cli, buckets, tmp_path):
    first, second = ("allreduce/bucket_0/replica_1/instance_key",
                     "allreduce/bucket_1/replica_1/instance_key")

    def swap(nodes, graph):
        a = nodes[first].attr["value"].tensor
        b = nodes[second].attr["value"].tensor
        a_copy = type(a)()
        a_copy.CopyFrom(a)
        a.CopyFrom(b)
        b.CopyFrom(a_copy)

    code, report, errors = run_check(run_cli, edited(buckets, tmp_path, swap))
    assert code == 1
    swapped = ["allreduce/bucket_0/replica_1/reduce", "allreduce/bucket_1/replica_1/reduce"]
    deadlock = [e for e in errors if "deadlock" in e["message"]]
    assert deadlock and set(swapped) <= set(deadlock[0]["nodes"])
    assert errors_naming(errors, "allreduce/bucket_0/replica_0/reduce",
                         "allreduce/bucket_0/replica_1/reduce")  # their keys differ


def test_variable_updated_twice(run_cli, buckets, tmp_path):
    apply = "replica_1/GradientDescent/update_dense0/kernel/ResourceApplyGradientDescent"
    again = apply + "_again"

    def duplicate(nodes, graph):
        copy = graph.node.add()
        copy.CopyFrom(nodes[apply])
        copy.name = again
        nodes["replica_1/GradientDescent/update"].input.append("^" + again)

    code, report, errors = run_check(run_cli, edited(buckets, tmp_path, duplicate))
    assert code == 1
    twice = errors_naming(errors, "replica_1/dense0/kernel", apply, again)
    assert twice and "2 optimizer applies" in twice[0]["message"]


def test_summed_loss(run_cli, buckets, tmp_path):
    def summed(nodes, graph):
        assert nodes["loss"].op == "Mean"  # merge-fetches' mean over the replicas
        nodes["loss"].op = "Sum"

    code, report, errors = run_check(run_cli, edited(buckets, tmp_path, summed))
    assert code == 1
    found = errors_naming(errors, "loss", "replica_0/loss")
    assert found and found[0]["check"] == "losses" and "sum" in found[0]["message"]


def test_gradients_summed_not_averaged(run_cli, buckets, tmp_path):
    reduce = "allreduce/bucket_0/replica_0/reduce"

    def summed(nodes, graph):
        nodes[reduce].attr["final_op"].s = b"Id"

    code, report, errors = run_check(run_cli, edited(buckets, tmp_path, summed))
    assert code == 1 and errors_naming(errors, reduce)


def test_accumulator_expecting_the_wrong_count(run_cli, ps_graph, tmp_path):
    workers = "dense0/kernel/accumulator/workers"

    def three(nodes, graph):
        const(nodes[workers], 3)

    code, report, errors = run_check(run_cli, edited(ps_graph, tmp_path, three))
    assert code == 1
    found = errors_naming(errors, "dense0/kernel/accumulator", "dense0/kernel/accumulator/take")
    assert found and "waits for 3 gradients" in found[0]["message"]
    assert "2 worker(s)" in found[0]["message"]


def test_worker_step_without_its_token(run_cli, ps_graph, tmp_path):
    def no_token(nodes, graph):
        step = nodes["ps_sync/worker_1/step"]
        step.input[:] = [i for i in step.input if "token" not in i]

    code, report, errors = run_check(run_cli, edited(ps_graph, tmp_path, no_token))
    assert code == 1 and errors_naming(errors, "ps_sync/worker_1/step")


def test_hybrid_barrier_short_of_a_worker(run_cli, hybrid_graph, tmp_path):
    def no_done(nodes, graph):
        end = nodes["hybrid_sync/worker_1/end"]
        end.input[:] = [i for i in end.input if "done" not in i]

    code, report, errors = run_check(run_cli, edited(hybrid_graph, tmp_path, no_done))
    found = errors_naming(errors, "hybrid_sync/all_done")
    assert code == 1 and found and "takes 2 token(s)" in found[0]["message"]
    assert "put 1: it would wait forever" in found[0]["message"]


def test_task_step_running_another_tasks_replica(run_cli, hybrid_graph, tmp_path):
    def reach_over(nodes, graph):
        nodes["ps_sync/worker_0/step"].input.append("^replica_2/Adam/update_dense0/kernel/"
                                                    "ResourceApplyAdam")

    code, report, errors = run_check(run_cli, edited(hybrid_graph, tmp_path, reach_over))
    found = errors_naming(errors, "ps_sync/worker_0/step")
    assert code == 1 and found and "of worker:1's replica" in found[0]["message"]
    assert "the group would meet twice" in found[0]["message"]


def test_stateful_ops_are_listed(run_cli, tmp_path):
    path = tmp_path / "bn.meta"
    metagraph.save(transformed("recipes/keras_cnn_bn_dropout"), str(path))
    code, report, _ = run_check(run_cli, path)
    assert code == 0
    infos = [f["message"] for f in report["findings"] if f["check"] == "stateful"]
    assert any(m.startswith("1 random ops") for m in infos)
    assert any("statistics" in m and "each replica keeps its own copy" in m for m in infos)
    assert any(m.startswith("1 counters") for m in infos)


def test_apply_runs_the_checks_before_writing(run_cli, tmp_path, monkeypatch):
    out = tmp_path / "out.meta"
    code, text, err = run_cli("apply", fixture_path("mlp_sgd"), "--replicas", 2, "-o", out)
    assert code == 0, err
    assert "check: ok (collectives, losses)" in text
    from graphxform.inspector import collectives

    def broken(ir):
        result = CheckResult("collectives")
        result.error("made up for the test", ["allreduce/bucket_0/replica_1/reduce"])
        return result

    monkeypatch.setattr(collectives, "check", broken)
    out.unlink()
    code, _, err = run_cli("apply", fixture_path("mlp_sgd"), "--replicas", 2, "-o", out)
    assert code == 1 and "made up for the test" in err and err.count("\n") == 1
    assert not out.exists()
