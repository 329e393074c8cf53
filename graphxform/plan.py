"""The plan a cluster graph carries (collection ``graphxform_cluster``): what each task runs per
step and the TF configuration it needs. Passes write it, the runtime (graphxform/runtime/) reads
it; this module only holds and checks the data and runs nothing, so passes can import it."""

from __future__ import annotations

import dataclasses
import json

from graphxform.cluster import Cluster
from graphxform.errors import GraphxformError

CLUSTER_COLLECTION = "graphxform_cluster"


@dataclasses.dataclass
class ClusterPlan:
    """What a cluster graph was built for and how each task runs its part of a step.

    ``steps`` maps "job:task" to the op that task runs once per step, ``losses`` maps
    "job:task" to the mean loss of that task's replicas, ``chief`` is "chief:0" or
    "worker:0", ``chief_init`` is an op the chief runs once after initialising (or None).
    ``train_ops`` are the original train ops (each kept under its name for one client); a graph
    with several has no per-task ``steps`` yet and runs only with one client.

    What a task's server and session need, derived from the graph when it was built:
    ``collective_leader`` ("/job:worker/replica:0/task:0") when the step runs collectives
    across tasks; ``device_filters`` maps "job:task" to the devices its session may see (a
    task not listed sees every task, as the chief does). ``one_client_only`` says why the
    graph cannot run one process per task, when it cannot."""

    cluster: dict
    steps: dict
    losses: dict
    chief: str = "worker:0"
    chief_init: str | None = None
    strategy: str = "ps"
    staleness: int = 0
    is_async: bool = False
    train_ops: list = dataclasses.field(default_factory=list)
    collective_leader: str | None = None
    device_filters: dict = dataclasses.field(default_factory=dict)
    one_client_only: str | None = None

    # ------------------------------------------------------------ (de)serialise
    def to_json(self) -> str:
        data = {"strategy": self.strategy, "cluster": self.cluster, "chief": self.chief,
                "steps": self.steps, "losses": self.losses, "chief_init": self.chief_init,
                "staleness": self.staleness, "async": self.is_async,
                "train_ops": self.train_ops}
        if self.collective_leader:
            data["collective_leader"] = self.collective_leader
        if self.device_filters:
            data["device_filters"] = self.device_filters
        if self.one_client_only:
            data["one_client_only"] = self.one_client_only
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text, source: str = "graph") -> "ClusterPlan":
        where = f"{source}: collection '{CLUSTER_COLLECTION}'"
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise GraphxformError(f"{where} is not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise GraphxformError(f"{where} is not a JSON object")
        train_ops = data.get("train_ops") or []
        if not isinstance(train_ops, list) or not all(isinstance(t, str) for t in train_ops):
            raise GraphxformError(f"{where}: 'train_ops' is not a list of names")
        for key in ("cluster", "steps"):
            empty_ok = key == "steps" and (len(train_ops) > 1  # several: one client only
                                           or bool(data.get("one_client_only")))
            if not isinstance(data.get(key), dict) or not (data[key] or empty_ok):
                raise GraphxformError(f"{where} has no '{key}'")
        Cluster(data["cluster"], source=where)  # the same checks as a cluster file
        filters = data.get("device_filters") or {}
        if not isinstance(filters, dict) or not all(
                isinstance(v, list) and all(isinstance(d, str) for d in v)
                for v in filters.values()):
            raise GraphxformError(f"{where}: 'device_filters' is not a map of device lists")
        plan = cls(cluster={j: list(t) for j, t in data["cluster"].items()},
                   steps=dict(data["steps"]), losses=dict(data.get("losses") or {}),
                   chief=data.get("chief") or "worker:0", chief_init=data.get("chief_init"),
                   strategy=data.get("strategy", "ps"), staleness=int(data.get("staleness", 0)),
                   is_async=bool(data.get("async", False)), train_ops=list(train_ops),
                   collective_leader=data.get("collective_leader") or None,
                   device_filters={k: list(v) for k, v in filters.items()},
                   one_client_only=data.get("one_client_only") or None)
        if plan.steps and plan.chief not in plan.steps:
            raise GraphxformError(f"{where}: the chief '{plan.chief}' has no step op")
        return plan

    @classmethod
    def from_meta(cls, meta, source: str = "graph") -> "ClusterPlan | None":
        """The plan in a MetaGraphDef, or None when it has none (not a cluster graph)."""
        if CLUSTER_COLLECTION not in meta.collection_def:
            return None
        values = meta.collection_def[CLUSTER_COLLECTION].bytes_list.value
        if len(values) != 1:
            raise GraphxformError(f"{source}: collection '{CLUSTER_COLLECTION}' should hold "
                                  f"one JSON string, not {len(values)}")
        return cls.from_json(values[0], source)

    @classmethod
    def from_ir(cls, ir) -> "ClusterPlan | None":
        return cls.from_meta(ir.meta, ir.source or "graph")

    def write_to(self, meta) -> None:
        """Store this plan in a MetaGraphDef (replacing any plan there)."""
        col = meta.collection_def[CLUSTER_COLLECTION]
        col.Clear()
        col.bytes_list.value.append(self.to_json().encode())

    # ------------------------------------------------------------ questions
    def job_sizes(self) -> dict:
        return {job: len(tasks) for job, tasks in self.cluster.items()}

    def require_per_task(self, source: str = "the graph") -> None:
        """One process per task runs one train op; refuse a graph with several (before any
        process starts, rather than hang)."""
        if self.one_client_only:
            raise GraphxformError(f"{source} runs with one client only (`graphxform verify`, or "
                                  f"one session on its chief): {self.one_client_only}")
        if len(self.train_ops) > 1:
            raise GraphxformError(
                f"{source} has {len(self.train_ops)} train ops ({', '.join(self.train_ops)}); "
                "running it one process per task is not supported yet: run it with one client "
                "(`graphxform verify`, or import_meta_graph and session.run each train op in "
                "turn against a server of the cluster)")

    def is_chief(self, job: str, task: int) -> bool:
        return f"{job}:{task}" == self.chief

    def step_of(self, job: str, task: int) -> str:
        key = f"{job}:{task}"
        if key not in self.steps:
            raise GraphxformError(f"{job} {task} has no part in the training step (tasks that "
                                  f"run steps: {', '.join(sorted(self.steps))}); ps tasks only "
                                  "`graphxform serve`")
        return self.steps[key]

    def filters_of(self, job: str, task: int) -> list[str]:
        """The devices task ``job:task``'s session sees: what the plan says; for a plan that
        says nothing (a ps graph written before plans carried filters), the ps jobs and
        itself for a worker, everything for the chief."""
        key = f"{job}:{task}"
        if self.device_filters:
            return list(self.device_filters.get(key, []))
        if self.is_chief(job, task):
            return []
        return ["/job:ps", f"/job:{job}/task:{task}"]

    def check_cluster(self, cluster: Cluster) -> None:
        """The graph's devices name jobs and task indices: a cluster must have the same ones."""
        ours = self.job_sizes()
        theirs = {job: len(tasks) for job, tasks in cluster.jobs.items()}
        if ours != theirs:
            describe = lambda sizes: ", ".join(f"{n} {j}" for j, n in sorted(sizes.items()))
            raise GraphxformError(f"{cluster.source}: the cluster has {describe(theirs)} tasks "
                                  f"but the graph was built for {describe(ours)}")
