"""Cluster files, TF_CONFIG, and greedy variable placement."""

import json

import pytest

from graphxform import cluster
from graphxform.errors import GraphxformError
from graphxform.passes.place_variables import balance

SPEC = {"ps": ["127.0.0.1:2222", "127.0.0.1:2223"],
        "worker": ["127.0.0.1:2224", "127.0.0.1:2225"]}


def test_cluster_file_and_tf_config(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(SPEC))
    spec, task = cluster.load_cluster(str(path))
    assert spec.as_dict() == SPEC and task == {}
    assert spec.worker_devices(2) == [
        "/job:worker/task:0/device:CPU:0", "/job:worker/task:0/device:CPU:1",
        "/job:worker/task:1/device:CPU:0", "/job:worker/task:1/device:CPU:1"]
    env = {"TF_CONFIG": json.dumps({"cluster": SPEC, "task": {"type": "worker", "index": 1}})}
    spec, task = cluster.load_cluster(None, env)
    assert spec.require("worker", 1) == "127.0.0.1:2225" and task["index"] == 1


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ('{"ps": [], "worker": ["127.0.0.1:1"]}', "job 'ps' has no tasks"),
    ('{"ps": ["127.0.0.1:1"]}', "no 'worker'"),
    ('{"worker": ["nohostport"]}', "not host:port"),
    ("[]", "JSON object of jobs"),
])
def test_bad_cluster_files(tmp_path, content, message):
    path = tmp_path / "c.json"
    path.write_text(content)
    with pytest.raises(GraphxformError, match=message) as info:
        cluster.load_cluster(str(path))
    assert "c.json" in str(info.value)


def test_tf_config_naming_a_missing_task():
    env = {"TF_CONFIG": json.dumps({"cluster": SPEC, "task": {"type": "worker", "index": 5}})}
    with pytest.raises(GraphxformError, match="TF_CONFIG: job 'worker' has no task 5"):
        cluster.load_cluster(None, env)
    with pytest.raises(GraphxformError, match="set TF_CONFIG"):
        cluster.load_cluster(None, {})


def test_balance_keeps_every_task_within_fair_share_plus_largest():
    sizes = {"embedding": 4_000_000, "a": 1_000_000, "b": 900_000, "c": 800_000,
             "d": 10_000, "e": 5_000, "f": 4}
    for tasks in (1, 2, 3, 4):
        placement = balance(sizes, tasks)
        load = [0] * tasks
        for name, task in placement.items():
            load[task] += sizes[name]
        assert max(load) <= sum(sizes.values()) / tasks + max(sizes.values())
    assert balance(sizes, 2)["embedding"] != balance(sizes, 2)["a"]
    with pytest.raises(GraphxformError, match="no tasks"):
        balance(sizes, 0)
