"""insert-accumulators: one update per variable per step from every worker's gradient.

Each worker first averages its own replicas' gradients (dense: AddN / R; sparse: values and
indices concatenated, values / R). Then, on the variable's ps task, a ConditionalAccumulator (dense,
MEAN over the W workers) or a SparseConditionalAccumulator (SUM, then / W: TF's sparse MEAN divides
each row by how many workers touched it, which is not the batch mean) collects them; the update
ops read `take` of all W workers, so each variable is updated once per step.

The emitted graph runs two ways:
- one client (the drop-in contract): the original train op name runs every worker's part and the
  update in one `session.run`;
- one client per worker (between-graph, `graphxform run --cluster`): `ps_sync/<job>_<task>/step`
  runs that task's part. The chief's step also takes, updates and releases one token per other
  worker into `ps_sync/token_queue`; another worker's step ends by dequeuing a token, so no worker
  runs a step ahead (`staleness` K pre-fills K tokens each and lets the accumulators accept
  gradients up to K steps old).

With `asynchronous`, nothing is aggregated: every worker gets its own copy of the optimizer's
update region and applies its local mean gradient whenever it is ready.

What the runtime needs (step op per task, loss per worker, chief, chief_init) is written to the
graph as a graphxform.distributed.ClusterPlan."""

from __future__ import annotations

import dataclasses

import numpy as np

from graphxform import opdefs
from graphxform.errors import GraphxformError
from graphxform.ir import parse_tensor
from graphxform.nodes import Builder, replica_prefix
from graphxform.pipeline import Pass, PassResult

SYNC_SCOPE = "ps_sync/"
ASYNC_SCOPE = "ps_async/"
INT64 = 9  # DataType enum DT_INT64
INT32 = 3


@dataclasses.dataclass
class InsertAccumulators(Pass):
    name = "insert-accumulators"
    staleness: int = 0
    asynchronous: bool = False

    def run(self, ir, ctx):
        if self.staleness < 0:
            raise GraphxformError(f"--staleness must be 0 or more, not {self.staleness}")
        cross_edges = ctx.state.get("replicate", {}).get("cross_edges")
        if cross_edges is None or "share-variables" not in ctx.state:
            raise GraphxformError("insert-accumulators needs share-variables and replicate first")
        tg = ctx.training
        train_op = tg.require_train_op(self.name)
        if any(True for _ in ir.successors(train_op)):
            raise GraphxformError(f"train op '{train_op}' has consumers; run the last op of the "
                                  "step as the train op (--train-op)")
        workers = _Workers(ctx.devices, ctx.cluster)
        grads = _gradient_tensors(tg)
        for consumer, _, tensor in cross_edges:
            if tensor not in grads:
                raise GraphxformError(f"'{consumer}' runs once per step on a ps task but reads "
                                      f"'{tensor}', which every replica computes and which is not "
                                      "a gradient")
        build = _Build(ir, Builder(ir, self.name), workers, tg)
        if self.asynchronous:
            steps = self._asynchronous(ir, ctx, build, cross_edges, grads, train_op)
            chief_init = None
        else:
            steps, chief_init = self._synchronous(ir, build, cross_edges, grads, train_op)
        losses = build.worker_losses()
        _write_plan(ir, ctx, workers, steps, losses, chief_init, self)
        return PassResult(modified=True, summary={
            "workers": len(workers.tasks), "aggregated": len({grads[t][0] for _, _, t in
                                                              cross_edges})})

    def _synchronous(self, ir, build, cross_edges, grads, train_op):
        workers, tg = build.workers, build.tg
        accumulators = {}  # var name -> (handle, take outputs by gradient part)
        applies = {w: [] for w in range(len(workers.tasks))}
        for tensor in dict.fromkeys(t for _, _, t in cross_edges):
            var = tg.variables[grads[tensor][0]]
            if var.name not in accumulators:
                accumulators[var.name] = build.accumulator(var, applies)
        for consumer, port, tensor in cross_edges:
            var_name, part = grads[tensor]
            ir.set_input(consumer, port, accumulators[var_name][1][part])
        update = ir.copy_nodes([train_op], SYNC_SCOPE, created_by=build.created_by)[train_op]
        ir.remove_node(train_op)
        done = build.after_update(update, [a[0] for a in accumulators.values()], self.staleness)
        every_apply = [a for w in applies for a in applies[w]]
        build.op(train_op, "NoOp", ["^" + n for n in [done] + every_apply])
        release = build.release(done, workers.token_takers())
        steps = {}
        for w, task in enumerate(workers.tasks):
            own = ["^" + a for a in applies[w]]
            if w == workers.chief:
                steps[task] = build.op(build.scope(task) + "step", "NoOp",
                                       own + ["^" + (release or done)])
            else:
                token = build.op(build.scope(task) + "token", "QueueDequeueV2",
                                 [build.token_queue()] + own, component_types=[INT64],
                                 device=workers.device(w))
                steps[task] = build.op(build.scope(task) + "step", "NoOp", ["^" + token])
        if workers.chief is None:  # a chief job with no replicas of its own
            steps[workers.chief_task] = build.op(build.scope(workers.chief_task) + "step",
                                                 "NoOp", ["^" + (release or done)])
        chief_init = build.chief_init([a[0] for a in accumulators.values()], self.staleness,
                                      workers.token_takers())
        return steps, chief_init

    def _asynchronous(self, ir, ctx, build, cross_edges, grads, train_op):
        workers = build.workers
        region = ctx.state["share-variables"]["optimizer_region"]
        outside = [dst for n in region for dst in ir.successors(n) if dst not in region]
        if outside:
            raise GraphxformError(f"'{outside[0]}' waits on the optimizer's update; cannot give "
                                  "each worker its own update for --async")
        steps, copies = {}, []
        for w, task in enumerate(workers.tasks):
            mapping = ir.copy_nodes(region, f"{ASYNC_SCOPE}{task.replace(':', '_')}/",
                                    created_by=build.created_by)
            local = {}
            for consumer, port, tensor in cross_edges:
                var_name, part = grads[tensor]
                if (var_name, part) not in local:
                    local.update(build.local_gradient(w, ctx.training.variables[var_name]))
                ir.set_input(mapping[consumer], port, local[(var_name, part)])
            copies.append(mapping[train_op])
            steps[task] = build.op(build.scope(task) + "step", "NoOp", ["^" + mapping[train_op]])
        ir.remove_nodes(region)
        build.op(train_op, "NoOp", ["^" + c for c in copies])
        if workers.chief is None:
            steps[workers.chief_task] = build.op(build.scope(workers.chief_task) + "step", "NoOp")
        return steps


def _gradient_tensors(tg) -> dict:
    """Gradient tensor name -> (variable, part) where part is 'dense', 'values' or 'indices'."""
    found = {}
    for var in tg.trainable:
        g = var.gradient
        if g.kind == "dense":
            found[g.tensor] = (var.name, "dense")
        else:
            found[g.values] = (var.name, "values")
            found[g.indices] = (var.name, "indices")
    return found


class _Workers:
    """Replicas grouped by worker task, and which task is the chief."""

    def __init__(self, devices, cluster):
        import tensorflow as tf
        self.tasks, self.replicas, self.devices = [], {}, {}
        for k, device in enumerate(devices):
            spec = tf.DeviceSpec.from_string(device)
            task = f"{spec.job or 'localhost'}:{spec.task or 0}"
            if task not in self.replicas:
                self.tasks.append(task)
                self.replicas[task] = []
                self.devices[task] = device
            self.replicas[task].append(k)
        has_chief_job = cluster is not None and bool(cluster.tasks("chief"))
        self.chief_task = "chief:0" if has_chief_job else self.tasks[0]
        self.chief = None if has_chief_job else 0

    def device(self, w: int) -> str:
        return self.devices[self.tasks[w]]

    def token_takers(self) -> int:
        """Workers that wait for a token each step: all but a worker that is the chief."""
        return len(self.tasks) - (0 if self.chief is None else 1)


class _Build:
    """Node builders shared by the sync and async paths."""

    def __init__(self, ir, builder, workers, tg):
        self.ir, self.builder, self.workers, self.tg = ir, builder, workers, tg
        self.created_by = builder.created_by
        self._queue = None
        self._local_steps = {}

    def op(self, *args, **kwargs):
        return self.builder.op(*args, **kwargs)

    def const(self, *args, **kwargs):
        return self.builder.const(*args, **kwargs)

    @staticmethod
    def scope(task: str) -> str:
        return f"{SYNC_SCOPE}{task.replace(':', '_')}/"

    def _dtype(self, tensor):
        return opdefs.output_dtype(self.ir, *parse_tensor(tensor))

    def local_gradient(self, w, var) -> dict:
        """Worker w's mean gradient for ``var``: {(var, part): tensor}."""
        task = self.workers.tasks[w]
        device = self.workers.device(w)
        reps = self.workers.replicas[task]
        scope = f"{var.name}/local_mean/{task.replace(':', '_')}/"
        count = self.const(scope + "replicas", len(reps), np.dtype(_np(var.dtype)), device=device)
        g = var.gradient
        if g.kind == "dense":
            copies = [replica_prefix(k) + g.tensor for k in reps]
            total = copies[0] if len(copies) == 1 else self.op(
                scope + "sum", "AddN", copies, N=len(copies), T=var.dtype, device=device)
            mean = self.op(scope + "mean", "RealDiv", [total, count], T=var.dtype, device=device)
            return {(var.name, "dense"): mean + ":0"}
        out = {}
        for part in ("values", "indices"):
            copies = [replica_prefix(k) + getattr(g, part) for k in reps]
            if len(copies) == 1:
                out[part] = copies[0]
                continue
            axis = self.const(scope + f"{part}_axis", 0, np.int32, device=device)
            out[part] = self.op(scope + f"{part}_concat", "ConcatV2", copies + [axis],
                                N=len(copies), T=self._dtype(copies[0]), device=device) + ":0"
        values = self.op(scope + "mean", "RealDiv", [out["values"], count], T=var.dtype,
                         device=device)
        return {(var.name, "values"): values + ":0", (var.name, "indices"): out["indices"]}

    def local_step(self, w) -> str:
        """The global step worker w read at the start of its step (0 without a global_step)."""
        if w not in self._local_steps:
            scope = self.scope(self.workers.tasks[w])
            self._local_steps[w] = self._step_value(scope + "local_step", [],
                                                    self.workers.device(w))
        return self._local_steps[w]

    def _step_value(self, name, after, device=""):
        gs = self.tg.global_step
        if gs is None:
            return self.const(name, 0, np.int64, device=device)
        var = self.tg.variables[gs]
        deps = ["^" + a for a in after]
        if var.kind == "resource":
            read = self.op(name + "/read", "ReadVariableOp", [gs] + deps, dtype=var.dtype,
                           device=device)
        else:
            read = self.op(name + "/read", "Identity", [gs] + deps, T=var.dtype, device=device)
        if var.dtype == INT64:
            return read
        return self.op(name, "Cast", [read], SrcT=var.dtype, DstT=INT64, device=device)

    def accumulator(self, var, applies):
        """The accumulator of ``var``, one apply per worker; returns (handle, take by part)."""
        device = self.ir.node(var.name)["device"]
        scope = f"{var.name}/accumulator"
        n = len(self.workers.tasks)
        required = self.const(scope + "/workers", n, np.int32, device=device)
        sparse = var.gradient.kind == "sparse"
        handle = self.op(scope, "SparseConditionalAccumulator" if sparse else
                         "ConditionalAccumulator", dtype=var.dtype, shape=list(var.shape),
                         shared_name=scope, reduction_type="SUM" if sparse else "MEAN",
                         device=device)
        for w, task in enumerate(self.workers.tasks):
            local = self.local_gradient(w, var)
            name = f"{scope}/apply_{task.replace(':', '_')}"
            if not sparse:
                applies[w].append(self.op(name, "AccumulatorApplyGradient",
                                          [handle, self.local_step(w), local[(var.name, "dense")]],
                                          dtype=var.dtype, device=device))
                continue
            indices = local[(var.name, "indices")]
            if self._dtype(indices) != INT64:
                indices = self.op(f"{scope}/{task.replace(':', '_')}/indices_int64", "Cast",
                                  [indices], SrcT=self._dtype(indices), DstT=INT64,
                                  device=self.workers.device(w)) + ":0"
            shape = self.const(f"{scope}/{task.replace(':', '_')}/shape", list(var.shape),
                               np.int64, device=self.workers.device(w))
            applies[w].append(self.op(name, "SparseAccumulatorApplyGradient",
                                      [handle, self.local_step(w), indices,
                                       local[(var.name, "values")], shape],
                                      dtype=var.dtype, has_known_shape=True, device=device))
        if not sparse:
            take = self.op(scope + "/take", "AccumulatorTakeGradient", [handle, required],
                           dtype=var.dtype, device=device)
            return handle, {"dense": take + ":0"}
        take = self.op(scope + "/take", "SparseAccumulatorTakeGradient", [handle, required],
                       dtype=var.dtype, device=device)
        values = self.op(scope + "/mean", "RealDiv", [take + ":1", self.const(
            scope + "/workers_float", n, _np(var.dtype), device=device)], T=var.dtype,
            device=device)
        indices = take + ":0"
        wanted = self._dtype(replica_prefix(0) + var.gradient.indices)
        if wanted != INT64:
            indices = self.op(scope + "/indices", "Cast", [indices], SrcT=INT64, DstT=wanted,
                              device=device) + ":0"
        return handle, {"values": values + ":0", "indices": indices}

    def after_update(self, update, handles, staleness) -> str:
        """What must finish before a step is over: the update and, with staleness, moving every
        accumulator's step to new_global_step - K so older gradients are dropped."""
        if not staleness or self.tg.global_step is None:
            return update
        new_step = self._step_value(SYNC_SCOPE + "new_step", [update])
        oldest = self.op(SYNC_SCOPE + "oldest_step", "Maximum", [
            self.op(SYNC_SCOPE + "minus_staleness", "Sub", [
                new_step, self.const(SYNC_SCOPE + "staleness", staleness, np.int64)], T=INT64),
            self.const(SYNC_SCOPE + "zero", 0, np.int64)], T=INT64)
        sets = [self.op(f"{h}/set_global_step", "AccumulatorSetGlobalStep", [h, oldest],
                        device=self.ir.node(h)["device"]) for h in handles]
        return self.op(SYNC_SCOPE + "update_done", "NoOp", ["^" + update] + ["^" + s for s in sets])

    def token_queue(self) -> str:
        if self._queue is None:
            gs = self.tg.global_step
            device = self.ir.node(gs)["device"] if gs else self.ir.node(
                self.tg.trainable[0].name)["device"]
            self._queue = self.op(SYNC_SCOPE + "token_queue", "FIFOQueueV2",
                                  component_types=[INT64], shapes=[[]], capacity=-1,
                                  shared_name=SYNC_SCOPE + "token_queue", device=device)
        return self._queue

    def _enqueue(self, name, count, after) -> str:
        step = self._step_value(name + "/step", after)
        dims = self.const(name + "/count", [count], np.int32)
        tokens = self.op(name + "/tokens", "Fill", [dims, step], T=INT64, index_type=INT32)
        return self.op(name, "QueueEnqueueManyV2", [self.token_queue(), tokens],
                       Tcomponents=[INT64])

    def release(self, done, takers) -> str | None:
        """After the update, one token per waiting worker."""
        return self._enqueue(SYNC_SCOPE + "release", takers, [done]) if takers else None

    def chief_init(self, handles, staleness, takers) -> str | None:
        """Run once by the chief after initialising: K tokens per waiting worker and the
        accumulators' step set to global_step - K."""
        if not staleness:
            return None
        deps = []
        if takers:
            deps.append(self._enqueue(SYNC_SCOPE + "initial_tokens", staleness * takers, []))
        if self.tg.global_step is not None:
            start = self._step_value(SYNC_SCOPE + "start_step", [])
            oldest = self.op(SYNC_SCOPE + "start_oldest", "Maximum", [
                self.op(SYNC_SCOPE + "start_minus_staleness", "Sub", [
                    start, self.const(SYNC_SCOPE + "start_staleness", staleness, np.int64)],
                    T=INT64), self.const(SYNC_SCOPE + "start_zero", 0, np.int64)], T=INT64)
            deps += [self.op(f"{h}/start_global_step", "AccumulatorSetGlobalStep", [h, oldest],
                             device=self.ir.node(h)["device"]) for h in handles]
        return self.op(SYNC_SCOPE + "chief_init", "NoOp", ["^" + d for d in deps])

    def worker_losses(self) -> dict:
        """task -> the mean loss of that worker's replicas (what its step would report)."""
        loss = self.tg.loss
        if not loss:
            return {}
        node, port = parse_tensor(loss)
        out = {}
        for w, task in enumerate(self.workers.tasks):
            copies = [f"{replica_prefix(k)}{node}:{port}" for k in self.workers.replicas[task]]
            if not all(parse_tensor(c)[0] in self.ir for c in copies):
                return {}
            dtype = self._dtype(copies[0])
            device = self.workers.device(w)
            scope = self.scope(task) + "loss"
            stacked = self.op(scope + "/stack", "Pack", copies, N=len(copies), T=dtype,
                              device=device)
            axis = self.const(scope + "/axis", 0, np.int32, device=device)
            out[task] = self.op(scope, "Mean", [stacked, axis], T=dtype, device=device) + ":0"
        return out


def _np(dtype_enum):
    from graphxform.nodes import numpy_dtype
    return numpy_dtype(dtype_enum)


def _write_plan(ir, ctx, workers, steps, losses, chief_init, options) -> None:
    from graphxform.distributed import ClusterPlan
    ClusterPlan(cluster=ctx.cluster.as_dict() if ctx.cluster is not None else {}, steps=steps,
                losses=losses, chief=workers.chief_task, chief_init=chief_init,
                strategy=ctx.strategy or "ps", staleness=options.staleness,
                is_async=options.asynchronous).write_to(ir.meta)
