"""graphxform cost: bytes per step measured on the emitted graph, checked by hand.

Expected figures come from the fixtures' variable shapes written out below, never from
graphxform.cost itself."""

import json

import pytest

from conftest import fixture_path
from graphxform import cluster, cost, metagraph, strategies

SPEC = {"ps": ["127.0.0.1:2222", "127.0.0.1:2223"],
        "worker": ["127.0.0.1:2224", "127.0.0.1:2225"]}
F32 = 4
# mlp_sgd's trainable variables (graphxform inspect): float32 shapes, all gradients dense
MLP = {"dense0/kernel": 8 * 16 * F32, "dense0/bias": 16 * F32,
       "dense1/kernel": 16 * 3 * F32, "dense1/bias": 3 * F32}
MLP_TOTAL = 512 + 64 + 192 + 12
assert sum(MLP.values()) == MLP_TOTAL == 780


def measure(name, strategy, batch_size, **options):
    original = metagraph.load(fixture_path(name))
    ir = metagraph.load(fixture_path(name))
    if strategy in ("allreduce", "independent"):
        strategies.transform(ir, strategy, **options)
    else:
        strategies.transform(ir, strategy, cluster=cluster.Cluster(SPEC), **options)
    return ir, cost.measure(original, ir, batch_size=batch_size, strategy=strategy)


def moved(report, *, src=None, dst=None, variables=None):
    """Bytes of the measured transfers matching the filters."""
    return sum(t.nbytes for t in report.transfers
               if (src is None or t.src == src) and (dst is None or t.dst == dst)
               and (variables is None or t.variable in variables))


def ps_task(ir, var):
    device = ir.node(var)["device"]  # where place-variables put it: /job:ps/task:K/...
    return "ps:" + device.split("/task:")[1].split("/")[0]


@pytest.fixture(scope="module")
def mlp_ps():
    return measure("mlp_sgd", "ps", 16)


def test_ps_tasks_receive_each_workers_gradient_and_send_each_worker_the_variables(mlp_ps):
    ir, report = mlp_ps
    placed = {}
    for var, nbytes in MLP.items():
        placed.setdefault(ps_task(ir, var), {})[var] = nbytes
    assert set(placed) == {"ps:0", "ps:1"}  # both ps tasks hold something
    for task, held in placed.items():
        expected = 2 * sum(held.values())  # W = 2 workers, one gradient (and one read) each
        assert moved(report, dst=task, variables=MLP) == expected
        assert moved(report, src=task, variables=MLP) == expected
        assert report.endpoints[task].minimum_received == expected


def test_ps_workers_receive_each_variable_once_and_send_each_gradient_once(mlp_ps):
    _, report = mlp_ps
    for worker in ("worker:0", "worker:1"):
        for var, nbytes in MLP.items():
            assert moved(report, dst=worker, variables={var}) == nbytes
            assert moved(report, src=worker, variables={var}) == nbytes
        assert report.endpoints[worker].minimum_sent == MLP_TOTAL
        assert report.endpoints[worker].minimum_received == MLP_TOTAL
    for var, nbytes in MLP.items():
        assert report.variables[var].moved == report.variables[var].minimum == 2 * 2 * nbytes


def test_ps_client_splits_the_batch_for_the_other_worker(mlp_ps):
    """Unplaced split ops run on the chief (worker:0): worker:1 gets its half of x (float [8,8])
    and y (int64 [8]) from it, besides the variables, and sends back its loss (a float)."""
    _, report = mlp_ps
    half = 16 // 2
    assert report.client == "worker:0"
    assert report.endpoints["worker:1"].received == MLP_TOTAL + half * 8 * F32 + half * 8
    assert moved(report, src="worker:1", dst="worker:0") == F32


@pytest.mark.parametrize("replicas", [2, 4])
def test_allreduce_ring_moves_2_n_minus_1_over_n_of_the_dense_bytes(replicas):
    devices = [f"/device:CPU:{i}" for i in range(replicas)]
    _, report = measure("mlp_sgd", "allreduce", 16, devices=devices)
    per_device = 2 * (replicas - 1) / replicas * MLP_TOTAL
    assert sorted(report.endpoints) == devices
    for device in devices:
        e = report.endpoints[device]
        assert e.sent == e.received == pytest.approx(per_device)
        assert e.minimum_sent == pytest.approx(per_device)
    for var, nbytes in MLP.items():
        assert report.variables[var].moved == pytest.approx(
            replicas * 2 * (replicas - 1) / replicas * nbytes)
    assert not [t for t in report.transfers if t.kind == "edge"]  # no cross-task edges


def test_independent_moves_nothing_and_its_minimum_is_nothing():
    devices = [f"/device:CPU:{i}" for i in range(4)]
    _, report = measure("mlp_sgd", "independent", 16, devices=devices)
    assert report.model == "independent"
    assert not [t for t in report.transfers if t.kind != "edge"]  # no collectives
    for var in MLP:
        assert report.variables[var].moved == report.variables[var].minimum == 0


def test_ids_from_a_sparse_input_are_counted_at_one_per_example():
    """wide_deep (feature columns): the 'tags' ids come from a SparseTensor input, whose count
    per step only the data fixes. Counted at one id per example (said in a note): each of the
    2 replicas gathers its 16 examples' rows (float32: 1 wide, 4 in the embedding) and int64
    indices, and receives the other replica's: (N-1)/N x N x its own = its own, per replica."""
    devices = ["/device:CPU:0", "/device:CPU:1"]
    original = metagraph.load(fixture_path("recipes/wide_deep"))
    ir = metagraph.load(fixture_path("recipes/wide_deep"))
    strategies.transform(ir, "allreduce", devices=devices)
    report = cost.measure(original, ir, batch_size=32, strategy="allreduce")
    per_replica = 16
    for var, row_floats in (("linear/linear_model/tags/weights", 1),
                            ("dnn/input_layer/tags_embedding/embedding_weights", 4)):
        expected = 2 * per_replica * (row_floats * F32 + 8)
        assert report.variables[var].moved == pytest.approx(expected)
        assert report.variables[var].minimum == pytest.approx(expected)
    assert any("one id per example" in note for note in report.notes)


def test_partitioned_ps_spreads_the_same_totals_over_shards():
    _, report = measure("mlp_sgd", "partitioned-ps", 16)
    for var, nbytes in MLP.items():
        assert report.variables[var].moved == 2 * 2 * nbytes
    assert moved(report, dst="ps:0", variables=MLP) + moved(
        report, dst="ps:1", variables=MLP) == 2 * MLP_TOTAL


def test_sparse_gradient_is_an_upper_bound_of_one_row_per_id():
    """embedding_adam: ids int64 [batch, 4], embedding rows of 8 floats. Each worker reads the
    rows of its 8 examples' 32 ids and sends one gradient row and one int64 index per id."""
    _, report = measure("embedding_adam", "ps", 16)
    ids_per_worker = 8 * 4
    for worker in ("worker:0", "worker:1"):
        assert moved(report, dst=worker, variables={"embedding/weights"}) == \
            ids_per_worker * 8 * F32
        assert moved(report, src=worker, variables={"embedding/weights"}) == \
            ids_per_worker * (8 * F32 + 8)
    assert report.variables["embedding/weights"].upper_bound
    assert any("upper bound" in note for note in report.notes)


def test_hybrid_minimum_is_the_ring_for_dense_variables_and_the_ps_for_the_embedding():
    """embedding_adam on 2 workers: dense0 ([8,2] and [2] floats) all-reduced over 2 devices,
    each sending and receiving 2(2-1)/2 of it; the embedding's 32 ids per worker at the ps
    minimum (each worker sends one row and one int64 index per id and reads one row per id)."""
    _, report = measure("embedding_adam", "hybrid", 16)
    assert report.model == "hybrid"
    for var, nbytes in {"dense0/kernel": 8 * 2 * F32, "dense0/bias": 2 * F32}.items():
        assert report.variables[var].moved == report.variables[var].minimum == 2 * nbytes
    ids_per_worker = 8 * 4
    gradient, read = ids_per_worker * (8 * F32 + 8), ids_per_worker * 8 * F32
    assert report.variables["embedding/weights"].minimum == 2 * (gradient + read)
    for worker in ("worker:0", "worker:1"):
        assert report.endpoints[worker].minimum_sent == gradient
        assert report.endpoints[worker].minimum_received == read


def test_cli_table_and_json(run_cli, tmp_path):
    spec = tmp_path / "cluster.json"
    spec.write_text(json.dumps(SPEC))
    code, out, err = run_cli("cost", fixture_path("mlp_sgd"), "--strategy", "ps", "--cluster",
                             spec, "--batch-size", 16)
    assert code == 0, err
    assert "min received" in out and "dense0/kernel" in out and "chief task worker:0" in out
    code, out, err = run_cli("cost", fixture_path("mlp_sgd"), "--replicas", 2, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["batch_size"] == 32 and doc["minimum_model"] == "allreduce"
    assert {t["name"]: t["ratio"] for t in doc["tasks"]} == {"/device:CPU:0": 1.0,
                                                             "/device:CPU:1": 1.0}


@pytest.mark.parametrize("args, message", [
    (["--strategy", "nope", "--replicas", 2], "unknown strategy 'nope'"),
    (["--strategy", "ps"], "no cluster"),
    (["--replicas", 3, "--batch-size", 16], "does not split evenly over 3 replicas"),
    (["--replicas", 2, "--batch-size", 0], "--batch-size must be a positive"),
])
def test_bad_input_is_a_one_line_error(run_cli, monkeypatch, args, message):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    code, out, err = run_cli("cost", fixture_path("mlp_sgd"), *args)
    assert code != 0 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and not out
