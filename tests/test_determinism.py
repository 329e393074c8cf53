"""The same input and options give the same output graph in every run. Python salts its string
hashes per process, so a pass that walks a set of names (the control inputs it adds, the
accumulators it makes) or serializes a proto map without fixing its order would write another
graph each time: two processes with different hash seeds must agree."""

import os
import subprocess
import sys

import pytest

from conftest import fixture_path

CLUSTER = '{"worker": ["127.0.0.1:2001", "127.0.0.1:2002"], "ps": ["127.0.0.1:2003"]}'

# what the emitted graph is, with proto maps (attrs, control-flow contexts' values) in key order
DIGEST = """
import hashlib, sys
from tensorflow.core.protobuf import meta_graph_pb2
meta = meta_graph_pb2.MetaGraphDef.FromString(open(sys.argv[1], "rb").read())
print(hashlib.sha256(meta.SerializeToString(deterministic=True)).hexdigest())
"""


def _apply(tmp_path, seed: str, meta: str, args: list) -> str:
    out = tmp_path / f"out{seed}.meta"
    env = {**os.environ, "PYTHONHASHSEED": seed}
    subprocess.run([sys.executable, "-m", "graphxform", "apply", meta, "-o", str(out),
                    *args], env=env, check=True, timeout=300, capture_output=True)
    digest = subprocess.run([sys.executable, "-c", DIGEST, str(out)], env=env, check=True,
                            timeout=120, capture_output=True, text=True)
    return digest.stdout.strip()


@pytest.mark.parametrize("meta, args", [
    # replicate copies tf.cond's contexts (a proto map of external values) per replica
    ("recipes/ema_weights", ["--strategy", "allreduce", "--replicas", "2"]),
    # insert-accumulators makes one accumulator per variable, and the step waits on each
    ("mlp_sgd", ["--strategy", "ps", "--cluster", "CLUSTER_FILE"]),
])
def test_two_processes_write_the_same_graph(tmp_path, meta, args):
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(CLUSTER)
    args = [str(cluster_file) if a == "CLUSTER_FILE" else a for a in args]
    first, second = (_apply(tmp_path, seed, fixture_path(meta), args) for seed in ("1", "2"))
    assert first == second
