"""worker-steps: what each task of an allreduce graph built for a cluster runs per step, written
into the graph as its ClusterPlan (graphxform/plan.py), and what every task needs so that a dead
or frozen peer fails a step instead of hanging it.

- Each task holding replicas (the chief job's task first, then the workers) gets
  `worker_steps/<job>_<task>/step`, a NoOp that runs its replicas' copies of the train op: their
  forward and backward passes, their part of every collective, their updates and their own
  global_step bumps (replicate mirrors global_step per replica, so no task reads a step counter
  another task moves). `worker_steps/<job>_<task>/loss` is the mean of its replicas' losses.
- The one-client view is untouched: the original train op still runs every replica of every
  task in one `session.run`.
- Every collective gets `timeout_seconds` (the runtime sets `--timeout` there when it imports
  the graph), so a member that died or froze fails the step on every other member.
- The plan names the collective group leader (the first task) and what each task's session may
  see: a worker only itself (collectives need no device of another task in its session), the
  chief every task (it initialises, restores and saves every replica's variables).
- The `global_step` collection names replica 0's copy alone, so `tf.train.get_global_step`
  finds one."""

from __future__ import annotations

import dataclasses

import numpy as np

from graphxform import opdefs
from graphxform.errors import GraphxformError
from graphxform.ir import parse_tensor
from graphxform.nodes import Builder, replica_prefix
from graphxform.pipeline import Pass, PassResult
from graphxform.plan import ClusterPlan

SCOPE = "worker_steps/"
COLLECTIVE_OPS = {"CollectiveReduceV2", "CollectiveGatherV2", "CollectiveBcastSendV2",
                  "CollectiveBcastRecvV2", "CollectiveAllToAllV2"}
DEFAULT_TIMEOUT_S = 120.0


def replica_tasks(cluster) -> list[tuple[str, int]]:
    """The tasks that hold replicas, in replica order: the chief job's task (a worker that also
    initialises and saves, as in MultiWorkerMirroredStrategy), then every worker."""
    if cluster.tasks("ps"):
        raise GraphxformError(f"{cluster.source}: strategy allreduce runs on workers only (a "
                              "'chief' job is allowed); the cluster has a 'ps' job (use "
                              "--strategy ps for parameter servers)")
    return training_tasks(cluster)


def training_tasks(cluster) -> list[tuple[str, int]]:
    """The chief job's task, then every worker: the tasks that train, in replica order."""
    return [(job, t) for job in ("chief", "worker") for t in range(len(cluster.tasks(job)))]


def replica_devices(cluster, replicas_per_worker: int = 1, device_type: str = "CPU") -> list:
    """One device per replica: /job:<job>/task:<t>/device:<type>:<r> for each task holding
    replicas."""
    return devices_of(replica_tasks(cluster), replicas_per_worker, device_type)


def devices_of(tasks, replicas_per_worker: int = 1, device_type: str = "CPU") -> list:
    """``replicas_per_worker`` devices on each (job, task) of ``tasks``, in order."""
    if replicas_per_worker < 1:
        raise GraphxformError(f"--replicas-per-worker must be at least 1, not "
                              f"{replicas_per_worker}")
    return [f"/job:{job}/task:{t}/device:{device_type}:{r}"
            for job, t in tasks for r in range(replicas_per_worker)]


@dataclasses.dataclass
class WorkerSteps(Pass):
    name = "worker-steps"
    timeout_s: float = DEFAULT_TIMEOUT_S

    def run(self, ir, ctx):
        if ctx.cluster is None:
            raise GraphxformError("worker-steps needs a cluster (apply --cluster F)")
        if self.timeout_s <= 0:
            raise GraphxformError(f"the collectives' timeout must be positive, not "
                                  f"{self.timeout_s}")
        tg = ctx.training
        tasks = tasks_of(ctx.devices)
        build = Builder(ir, self.name)
        steps, losses = {}, {}
        if len(tg.steps) == 1:  # several train ops run with one client only (plan_of says so)
            (step,) = tg.steps
            for task, replicas in tasks.items():
                steps[task] = self._step(ir, build, task, replicas, ctx.devices, step.op)
                if tg.loss:
                    losses[task] = _mean_loss(ir, build, task, replicas, ctx.devices, tg.loss)
        timed = set_collective_timeouts(ir, self.timeout_s)
        _one_global_step(ir)
        first = next(iter(tasks))
        job, index = first.split(":")
        ClusterPlan(cluster=ctx.cluster.as_dict(), steps=steps, losses=losses, chief=first,
                    strategy=ctx.strategy or "allreduce", train_ops=[s.name for s in tg.steps],
                    collective_leader=f"/job:{job}/replica:0/task:{index}",
                    device_filters={t: ([] if t == first else [_task_device(t)])
                                    for t in tasks}).write_to(ir.meta)
        return PassResult(modified=True, summary={
            "worker_tasks": len(tasks), "collectives_timed": timed,
            "collective_timeout_s": self.timeout_s,
            "replicas_per_worker": max(len(r) for r in tasks.values())})

    @staticmethod
    def _step(ir, build, task, replicas, devices, step_op) -> str:
        copies = [replica_prefix(k) + step_op for k in replicas]
        missing = [c for c in copies if c not in ir]
        if missing:
            raise GraphxformError(f"train op '{step_op}' has no copy '{missing[0]}': a task "
                                  "can run only its own replicas' steps")
        return build.op(_scope(task) + "step", "NoOp", ["^" + c for c in copies],
                        device=devices[replicas[0]])


def tasks_of(devices) -> dict:
    """'job:task' -> its replicas' indices, in replica order."""
    from tensorflow.python.framework.device_spec import DeviceSpecV2
    tasks = {}
    for k, device in enumerate(devices):
        spec = DeviceSpecV2.from_string(device)
        if spec.job is None:
            raise GraphxformError(f"device '{device}' names no job: worker-steps places "
                                  "replicas on a cluster's tasks")
        tasks.setdefault(f"{spec.job}:{spec.task or 0}", []).append(k)
    return tasks


def _task_device(task: str) -> str:
    job, index = task.split(":")
    return f"/job:{job}/task:{index}"


def _scope(task: str) -> str:
    return SCOPE + task.replace(":", "_") + "/"


def _mean_loss(ir, build, task, replicas, devices, loss) -> str:
    node, port = parse_tensor(loss)
    copies = [f"{replica_prefix(k)}{node}:{port}" for k in replicas]
    dtype = opdefs.output_dtype(ir, *parse_tensor(copies[0]))
    device = devices[replicas[0]]
    scope = _scope(task) + "loss"
    stacked = build.op(scope + "/stack", "Pack", copies, N=len(copies), T=dtype, device=device)
    axis = build.const(scope + "/axis", 0, np.int32, device=device)
    return build.op(scope, "Mean", [stacked, axis], T=dtype, device=device) + ":0"


def set_collective_timeouts(ir, seconds: float) -> int:
    """``timeout_seconds`` on every collective that has none; returns how many were set."""
    count = 0
    for name in ir.nodes_of(COLLECTIVE_OPS):
        attr = ir.node(name)["attr"]
        if attr["timeout_seconds"].f <= 0:
            attr["timeout_seconds"].f = float(seconds)
            count += 1
    return count


def _one_global_step(ir) -> None:
    """The `global_step` collection keeps replica 0's copy alone (replicate listed every
    replica's copy of the mirrored counter)."""
    from tensorflow.core.framework import variable_pb2
    col = ir.meta.collection_def.get("global_step")
    if col is None or len(col.bytes_list.value) < 2:
        return
    first = replica_prefix(0)
    kept = [raw for raw in col.bytes_list.value
            if variable_pb2.VariableDef.FromString(raw).variable_name.startswith(first)]
    if kept:
        del col.bytes_list.value[:]
        col.bytes_list.value.extend(kept[:1])
