"""model-average: TF's ModelAverageOptimizer on replicated graphs.

Runs after `replicate` without any gradient exchange (as `independent`): every replica trains
its own local copy of each trainable variable with the original optimizer. This pass adds, for
each trainable variable a step updates, a centre variable `model_average/centre/<var>` (the
value checkpoints hold under the original name) and, once per step, after the local updates:

- `local_step` (`model_average/local_step`) counts local steps;
- on every ``interval``-th local step (a *round*) the centre becomes the mean of the replicas'
  copies and every copy is set to the centre; on other steps both keep their values;
- the graph's own global_step increments only on rounds, so it counts averaging rounds.

Whether a step is a round is read from local_step before it moves (`SelectV2` on that flag, so
nothing runs conditionally and a skipped round leaves values bit for bit). Every local copy and
the centre start from replica 0's initial value. The step op waits on the averaging, so the
user's train op still does the whole step. Without a cluster one client runs every replica
(in-graph) and the mean is taken where the centre lives.

On a cluster (ps and worker jobs; after `worker-steps`, which writes each task's step) this is
TF's ModelAverageOptimizer across processes, on the parameter-server machinery of
`insert-accumulators`:

- each centre lives on a ps task (balanced by bytes, as `place-variables`), with a
  ConditionalAccumulator (MEAN) beside it; every worker task has its own local_step
  (`model_average/<job>_<task>/local_step`) and its replicas their own copy of global_step
  (replicate mirrors it), which moves on rounds only;
- a worker's step is its replicas' local steps, then, on a round only (a Switch on its
  local_step: nothing of the round runs otherwise, so nothing crosses the network between
  rounds), the mean of its replicas' copies into each accumulator; the chief takes every
  mean, assigns the centres and releases one token per other worker into the token queue, the
  others take a token, and every worker copies the centres into its replicas' copies;
- the original train op runs every worker's step in one `session.run` (one client: the
  drop-in way), the plan's per-task steps one task's (`launch`, `run --cluster`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from graphxform.errors import GraphxformError
from graphxform.nodes import Builder, replica_prefix
from graphxform.passes.insert_accumulators import NEVER_STALE
from graphxform.pipeline import Pass, PassResult

SCOPE = "model_average/"
INT32, INT64, BOOL = 3, 9, 10  # DataType enums
CENTRE = SCOPE + "centre/"
LOCAL_STEP = SCOPE + "local_step"


def centre_name(variable: str) -> str:
    return CENTRE + variable


def worker_devices(cluster, replicas_per_worker: int = 1, device_type: str = "CPU") -> list:
    """One device per replica on the tasks that train: the chief job's task (a worker that also
    assigns the centres and saves, as ModelAverageOptimizer's chief), then every worker. The
    centres need a ps job."""
    if not cluster.tasks("ps"):
        raise GraphxformError(f"{cluster.source}: strategy model-average on a cluster keeps its "
                              "centre variables on ps tasks; the cluster has no 'ps' job")
    from graphxform.passes.worker_steps import devices_of, training_tasks
    return devices_of(training_tasks(cluster), replicas_per_worker, device_type)


@dataclasses.dataclass
class ModelAverage(Pass):
    name = "model-average"
    interval: int = 1
    centre_device: str = "/device:CPU:0"

    def run(self, ir, ctx):
        if self.interval < 1:
            raise GraphxformError(f"--interval must be at least 1 (got {self.interval})")
        if "replicate" not in ctx.state:
            raise GraphxformError("model-average runs after replicate (it averages the "
                                  "replicas' copies)")
        if ir.has_scope(SCOPE):
            raise GraphxformError(f"the graph already has nodes under {SCOPE}")
        tg = ctx.training
        replicas = len(ctx.devices)
        trained = sorted((v for v in tg.variables.values()
                          if v.trainable and v.updates and replica_prefix(0) + v.name in ir),
                         key=lambda v: v.name)
        if not trained:
            return PassResult(modified=False)
        build = Builder(ir, self.name)
        if ctx.cluster is not None:
            return self._on_cluster(ir, ctx, build, trained)
        zero = build.const(LOCAL_STEP + "/zero", 0, np.int64, device=ctx.devices[0])
        counter = _new_variable(ir, build, LOCAL_STEP, "resource", INT64, (), ctx.devices[0],
                                zero + ":0")
        reset = build.op(LOCAL_STEP + "/reset", "AssignVariableOp", [counter, zero],
                         device=ctx.devices[0], dtype=INT64)
        before = build.op(LOCAL_STEP + "/before", "ReadVariableOp", [counter],
                          device=ctx.devices[0], dtype=INT64)
        interval = build.const(SCOPE + "interval", self.interval, np.int64)
        is_round = _is_round(build, SCOPE, before, interval)
        centres = {}
        for var in trained:
            centres[var.name] = _new_variable(
                ir, build, centre_name(var.name), var.kind, var.dtype, var.shape,
                self.centre_device, _initial_tensor(ir, var))
        if tg.global_step and tg.global_step in ir:
            _count_rounds(ir, build, tg.global_step, tg.variables[tg.global_step].dtype, is_round)
        averaged = 0
        for k, step in enumerate(tg.steps):
            step_vars = [v for v in trained if set(v.updates) & step.closure]
            if not step_vars:
                continue
            waits = sorted({src for src, _ in ir.inputs(step.op)} | set(ir.control_inputs(step.op)))
            scope = f"{SCOPE}step_{k}/"
            tick = build.op(scope + "local_step_add", "AssignAddVariableOp",
                            [counter, build.const(scope + "one", 1, np.int64),
                             "^" + before] + ["^" + w for w in waits],
                            device=ctx.devices[0], dtype=INT64)
            done = [tick]
            for var in step_vars:
                done += self._average(ir, build, scope, var, centres[var.name], replicas,
                                      is_round, ["^" + w for w in waits])
            finished = build.op(scope + "done", "NoOp", ["^" + d for d in done])
            ir.add_control_input(step.op, finished)
            averaged += len(step_vars)
        ctx.state[self.name] = {"centres": centres, "on_restore": [reset],
                                "interval": self.interval}
        return PassResult(modified=True, summary={"centres": len(centres),
                                                  "interval": self.interval,
                                                  "averaged_per_round": averaged})

    def _average(self, ir, build, scope, var, centre, replicas, is_round, waits) -> list[str]:
        """The mean of the replicas' copies into the centre and back, on rounds only."""
        base = scope + var.name
        reads = []
        for i in range(replicas):
            copy = replica_prefix(i) + var.name
            reads.append(_read(build, f"{base}/read_{i}", var, copy, waits))
        total = build.op(base + "/sum", "AddN", reads, device=self.centre_device, N=replicas,
                         T=var.dtype) if replicas > 1 else reads[0]
        scale = build.const(base + "/inverse_count", 1.0 / replicas, _numpy(var.dtype),
                            device=self.centre_device)
        mean = build.op(base + "/mean", "Mul", [total, scale], device=self.centre_device,
                        T=var.dtype)
        old_centre = _read(build, base + "/centre_before", var, centre, waits)
        new_centre = build.op(base + "/centre_after", "SelectV2", [is_round, mean, old_centre],
                              device=self.centre_device, T=var.dtype)
        writes = [_write(build, base + "/assign_centre", var, centre, new_centre)]
        for i in range(replicas):
            copy = replica_prefix(i) + var.name
            value = build.op(f"{base}/local_after_{i}", "SelectV2",
                             [is_round, new_centre, reads[i]],
                             device=ir.node(copy)["device"], T=var.dtype)
            writes.append(_write(build, f"{base}/assign_local_{i}", var, copy, value))
        return writes

    def _on_cluster(self, ir, ctx, build, trained) -> PassResult:
        """Rounds across worker processes through the ps tasks (the module docstring)."""
        from graphxform.passes.place_variables import balance, ps_device
        from graphxform.passes.worker_steps import tasks_of
        from graphxform.plan import ClusterPlan
        tg = ctx.training
        plan = ClusterPlan.from_ir(ir)
        if plan is None:
            raise GraphxformError("model-average on a cluster runs after worker-steps (it adds "
                                  "its rounds to each task's step)")
        if len(tg.steps) != 1:
            raise GraphxformError(
                "model-average on a cluster averages after the one train op each worker runs "
                f"(after worker-steps); this graph has {len(tg.steps)} "
                f"({', '.join(s.name for s in tg.steps)}): use it without --cluster")
        ps_tasks = len(ctx.cluster.tasks("ps"))
        if not ps_tasks:
            raise GraphxformError(f"{ctx.cluster.source}: model-average keeps its centre "
                                  "variables on ps tasks; the cluster has no 'ps' job")
        tasks = tasks_of(ctx.devices)
        placement = balance({v.name: v.nbytes for v in trained}, ps_tasks)
        centres, accumulators = {}, {}
        for var in trained:
            device = ps_device(placement[var.name])
            centres[var.name] = _new_variable(ir, build, centre_name(var.name), var.kind,
                                              var.dtype, var.shape, device,
                                              _initial_tensor(ir, var))
            accumulators[var.name] = build.op(
                var.name + "/accumulator", "ConditionalAccumulator", dtype=var.dtype,
                shape=list(var.shape), shared_name=var.name + "/accumulator",
                reduction_type="MEAN", device=device)
        rounds = _Rounds(ir, build, self.interval, trained, centres, accumulators,
                         len(tasks), ps_device(0))
        resets = []
        for task, replicas in tasks.items():
            merge, tick, reset = rounds.task(task, replicas, ctx.devices, tg, task == plan.chief)
            for node in (merge, tick):
                ir.add_control_input(plan.steps[task], node)
            ir.add_control_input(tg.steps[0].op, plan.steps[task])  # one client: every task
            resets.append(reset)
        plan.device_filters = {t: [] if t == plan.chief else ["/job:ps", _task_device(t)]
                               for t in plan.steps}
        plan.collective_leader = None  # nothing is all-reduced: the workers meet on the ps
        plan.write_to(ir.meta)
        ctx.state[self.name] = {"centres": centres, "on_restore": resets,
                                "interval": self.interval}
        return PassResult(modified=True, summary={
            "centres": len(centres), "interval": self.interval, "workers": len(tasks),
            "ps_tasks": ps_tasks})


class _Rounds:
    """The nodes of one worker task's step on a cluster: local steps, then a round that runs
    only when its local_step says so."""

    def __init__(self, ir, build, interval, trained, centres, accumulators, workers, queue_device):
        self.ir, self.build = ir, build
        self.trained, self.centres, self.accumulators = trained, centres, accumulators
        self.workers = workers
        self.interval_const = build.const(SCOPE + "interval", interval, np.int64)
        self.never_stale = build.const(SCOPE + "never_stale", NEVER_STALE, np.int64)
        self.required = {name: build.const(name + "/accumulator/workers", workers, np.int32,
                                           device=build.ir.node(acc)["device"])
                         for name, acc in accumulators.items()}
        self.queue = build.op(SCOPE + "token_queue", "FIFOQueueV2", component_types=[INT64],
                              shapes=[[]], capacity=-1, shared_name=SCOPE + "token_queue",
                              device=queue_device) if workers > 1 else None

    def task(self, task, replicas, devices, tg, chief) -> tuple[str, str, str]:
        """Task ``task``'s round; returns (its Merge, its local_step tick, its counter's reset
        for restores)."""
        build = self.build
        scope = f"{SCOPE}{task.replace(':', '_')}/"
        device = devices[replicas[0]]
        zero = build.const(scope + "local_step/zero", 0, np.int64, device=device)
        counter = _new_variable(self.ir, build, scope + "local_step", "resource", INT64, (),
                                device, zero + ":0")
        reset = build.op(scope + "local_step/reset", "AssignVariableOp", [counter, zero],
                         device=device, dtype=INT64)
        before = build.op(scope + "local_step/before", "ReadVariableOp", [counter],
                          device=device, dtype=INT64)
        is_round = _is_round(build, scope, before, self.interval_const, device)
        if tg.global_step:  # each replica's own copy of global_step counts rounds
            for k in replicas:
                copy = replica_prefix(k) + tg.global_step
                if copy in self.ir:
                    _count_rounds(self.ir, build, copy, tg.variables[tg.global_step].dtype,
                                  is_round)
        local = build.op(scope + "local_steps", "NoOp",
                         ["^" + replica_prefix(k) + tg.steps[0].op for k in replicas],
                         device=device)
        tick = build.op(scope + "local_step/add", "AssignAddVariableOp",
                        [counter, scope + "local_step/one", "^" + before, "^" + local],
                        device=device, dtype=INT64)
        switch = build.op(scope + "switch", "Switch", [is_round, is_round], device=device,
                          T=BOOL)
        skip = build.op(scope + "skip", "Identity", [switch + ":0"], device=device, T=BOOL)
        start = build.op(scope + "round", "Identity", [switch + ":1", "^" + local],
                         device=device, T=BOOL)
        applies = [self._apply(task, var, replicas, devices, device, start)
                   for var in self.trained]
        done = self._chief(applies) if chief else build.op(
            scope + "token", "QueueDequeueV2", [self.queue] + ["^" + a for a in applies],
            component_types=[INT64], device=device)
        back = []
        for var in self.trained:
            centre = self.centres[var.name]
            value = _read(build, f"{scope}round/{var.name}/centre", var, centre, ["^" + done])
            back += [_write(build, f"{scope}round/{var.name}/assign_{k}", var,
                            replica_prefix(k) + var.name, value) for k in replicas]
        finished = build.op(scope + "round/done", "Identity",
                            [start] + ["^" + b for b in back], device=device, T=BOOL)
        merge = build.op(scope + "merge", "Merge", [skip, finished], device=device, T=BOOL, N=2)
        return merge, tick, reset

    def _apply(self, task, var, replicas, devices, device, start) -> str:
        """This task's mean of its replicas' copies into the variable's accumulator."""
        build = self.build
        scope = f"{var.name}/local_mean/{task.replace(':', '_')}/"
        reads = [_read(build, f"{scope}read_{k}", var, replica_prefix(k) + var.name,
                       ["^" + start]) for k in replicas]
        mean = reads[0]
        if len(reads) > 1:
            total = build.op(scope + "sum", "AddN", reads, N=len(reads), T=var.dtype,
                             device=device)
            mean = build.op(scope + "mean", "Mul", [total, build.const(
                scope + "inverse_count", 1.0 / len(reads), _numpy(var.dtype), device=device)],
                T=var.dtype, device=device)
        accumulator = self.accumulators[var.name]
        return build.op(f"{var.name}/accumulator/apply_{task.replace(':', '_')}",
                        "AccumulatorApplyGradient", [accumulator, self.never_stale, mean],
                        dtype=var.dtype, device=self.ir.node(accumulator)["device"])

    def _chief(self, own_applies) -> str:
        """The chief's part of a round: every worker's mean into the centres, then a token for
        each other worker."""
        build = self.build
        assigns = []
        for var, apply in zip(self.trained, own_applies):
            accumulator = self.accumulators[var.name]
            device = self.ir.node(accumulator)["device"]
            take = build.op(var.name + "/accumulator/take", "AccumulatorTakeGradient",
                            [accumulator, self.required[var.name], "^" + apply],
                            dtype=var.dtype, device=device)
            assigns.append(_write(build, centre_name(var.name) + "/assign_mean", var,
                                  self.centres[var.name], take))
        if self.queue is None:
            return build.op(SCOPE + "centres_assigned", "NoOp", ["^" + a for a in assigns])
        device = self.ir.node(self.queue)["device"]
        tokens = build.op(SCOPE + "release/tokens", "Fill", [
            build.const(SCOPE + "release/count", [self.workers - 1], np.int32),
            build.const(SCOPE + "release/value", 0, np.int64)], T=INT64, index_type=INT32,
            device=device)
        return build.op(SCOPE + "release", "QueueEnqueueManyV2",
                        [self.queue, tokens] + ["^" + a for a in assigns],
                        Tcomponents=[INT64], device=device)


def _is_round(build, scope, before, interval, device="") -> str:
    """Whether the local step that starts now (local_step read before it) ends a round."""
    nxt = build.op(scope + "local_step/next", "AddV2",
                   [before, build.const(scope + "local_step/one", 1, np.int64)], T=INT64,
                   device=device)
    phase = build.op(scope + "phase", "FloorMod", [nxt, interval], T=INT64, device=device)
    return build.op(scope + "is_round", "Equal",
                    [phase, build.const(scope + "zero", 0, np.int64)], T=INT64, device=device)


def _count_rounds(ir, build, variable, dtype, is_round) -> None:
    """``variable``'s increments (global_step's) add their amount on rounds and zero
    otherwise."""
    for dst, port in list(ir.consumers(variable)):
        if port != 0 or ir.op(dst) not in ("AssignAdd", "AssignAddVariableOp"):
            continue
        amount = "{}:{}".format(*ir.inputs(dst)[1])
        device = ir.node(dst)["device"]
        zero = build.op(dst + "/model_average_zero", "ZerosLike", [amount], device=device,
                        T=dtype)
        counted = build.op(dst + "/model_average_on_round", "SelectV2",
                           [is_round, amount, zero], device=device, T=dtype)
        ir.set_input(dst, 1, counted)


def _task_device(task: str) -> str:
    job, index = task.split(":")
    return f"/job:{job}/task:{index}"


def _initial_tensor(ir, var) -> str | None:
    """The tensor replica 0's initializer assigns (every replica's copy starts from it)."""
    init = replica_prefix(0) + var.initializer if var.initializer else None
    if not init or init not in ir:
        return None
    src, port = ir.input(init, 1)
    return f"{src}:{port}"


def _new_variable(ir, build, name, kind, dtype, shape, device, value):
    """A variable ``name`` initialised from tensor ``value``, listed in the 'variables'
    collection so global_variables_initializer covers it."""
    from tensorflow.core.framework import variable_pb2
    if value is None:
        raise GraphxformError(f"variable for '{name}' has no initial value to start from")
    if kind == "resource":
        handle = build.op(name, "VarHandleOp", device=device, dtype=dtype, shape=list(shape),
                          shared_name=name)
        assign = build.op(name + "/Assign", "AssignVariableOp", [handle, value], device=device,
                          dtype=dtype)
        snapshot = build.op(name + "/Read/ReadVariableOp", "ReadVariableOp", [handle],
                            device=device, dtype=dtype)
    else:
        handle = build.op(name, "VariableV2", device=device, dtype=dtype, shape=list(shape))
        assign = build.op(name + "/Assign", "Assign", [handle, value], device=device, T=dtype)
        snapshot = build.op(name + "/read", "Identity", [handle], device=device, T=dtype)
    vd = variable_pb2.VariableDef(variable_name=handle + ":0", initializer_name=assign,
                                  snapshot_name=snapshot + ":0", initial_value_name=value,
                                  is_resource=kind == "resource", trainable=False)
    ir.meta.collection_def["variables"].bytes_list.value.append(vd.SerializeToString())
    return handle


def _read(build, name, var, variable, waits) -> str:
    device = build.ir.node(variable)["device"]
    if var.kind == "resource":
        return build.op(name, "ReadVariableOp", [variable] + waits, device=device,
                        dtype=var.dtype)
    return build.op(name, "Identity", [variable] + waits, device=device, T=var.dtype)


def _write(build, name, var, variable, value) -> str:
    device = build.ir.node(variable)["device"]
    if var.kind == "resource":
        return build.op(name, "AssignVariableOp", [variable, value], device=device,
                        dtype=var.dtype)
    return build.op(name, "Assign", [variable, value], device=device, T=var.dtype)


def _numpy(dtype: int):
    from graphxform.nodes import numpy_dtype
    return numpy_dtype(dtype)

