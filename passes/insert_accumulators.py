"""insert-accumulators: one update per variable per step from every worker's gradient.

Every born gradient the update region reads (share-variables' ``Aggregate``) is first averaged
over each worker's own replicas (dense: AddN / R; sparse: values and indices concatenated, values
/ R). Then, on the ps task of its variable, a ConditionalAccumulator (dense, MEAN over the W
workers) or a SparseConditionalAccumulator (SUM, then / W: TF's sparse MEAN divides each row by
how many workers touched it, which is not the batch mean; slices with any number of rows add up
exactly) collects them. The region reads `take` of all W workers, so gradient post-processing and
the optimizer run once per step on the cross-worker gradient, as on one device. A variable two
optimizers train (an actor-critic's shared trunk) has one accumulator per gradient
(`<var>/gradient_<k>/accumulator` for the second), taken by the update that applies it, in the
step that runs it.

Each step op S (a train op the user runs) keeps its name. What S did moves to `ps_sync/<S>`
(the update, without any replica's work); S becomes the one-client entry point: it runs every
worker's gradients into the accumulators and then the update, and a tensor step (tf_slim's
`train_op/control_dependency`) gives the mean of its replicas' values (the loss). A control
consumer of S (the read a resource `assign_add` leaves behind) waits on the new S.

The emitted graph runs two ways:
- one client (the drop-in contract): each original step name runs every worker's part and the
  update in one `session.run`; several steps (a GAN's d_train and g_train) run in turn;
- one client per task (`graphxform run --cluster`; a graph with one step only):
  `ps_sync/<job>_<task>/step` runs that task's part. The chief's step also takes, updates and
  releases one token per other worker into `ps_sync/token_queue`; another worker's step ends by
  dequeuing a token, so no worker runs a step ahead (`staleness` K pre-fills K tokens each and
  lets the accumulators accept gradients up to K steps old, counted by global_step).

With `asynchronous`, nothing is aggregated: every worker gets its own copy of the update region
and applies its local mean gradient whenever it is ready.

What the runtime needs (step op per task, loss per worker, chief, chief_init, the train ops) is
written to the graph as a graphxform.plan.ClusterPlan."""

from __future__ import annotations

import dataclasses

import numpy as np

from graphxform import opdefs
from graphxform.errors import ContractError, GraphxformError
from graphxform.ir import colocation_targets, parse_tensor, tensor_name
from graphxform.nodes import Builder, replica_prefix
from graphxform.pipeline import Pass, PassResult
from graphxform.training import REPLICA_SCOPE, is_mutating_op

SYNC_SCOPE = "ps_sync/"
ASYNC_SCOPE = "ps_async/"
INT64 = 9  # DataType enum DT_INT64
INT32 = 3
HANDLE_FORWARDING = {"Enter", "RefEnter", "Identity", "RefIdentity"}
FLOAT_TYPES = {1, 2, 14, 19}  # float32 float64 bfloat16 float16
NEVER_STALE = np.iinfo(np.int64).max  # a local step no accumulator step ever passes


@dataclasses.dataclass
class _Step:
    """A step op after `detach`: ``entry`` (its original name, what one client runs), ``core``
    (what it did, with no replica's work) and its control inputs that are replica copies."""
    entry: str
    core: str
    replica_controls: list


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
        tg.require_train_op(self.name)
        points = _points(ctx.state["share-variables"]["aggregates"])
        step_ops = [s.op for s in tg.steps]
        combined = [] if self.asynchronous else _combine_statistics(
            ir, Builder(ir, self.name), cross_edges, points, set(step_ops), len(ctx.devices))
        cross_edges = [e for e in cross_edges if e not in combined]
        by_step = _check_cross_edges(cross_edges, points, set(step_ops))
        if self.staleness and (tg.global_step is None or len(step_ops) > 1):
            raise GraphxformError("--staleness counts steps by global_step: it needs a graph "
                                  "with one train op and a global_step")
        workers = _Workers(ctx.devices, ctx.cluster)
        build = _Build(ir, Builder(ir, self.name), workers, tg, self.staleness)
        statistics = _statistics_from_first_replica(ir, tg, workers.count)
        _tie_replica_reads(ir, tg)
        steps = [build.detach(op, by_step.get(op, [])) for op in step_ops]
        grad_edges = [e for e in cross_edges if e[0] not in by_step]
        if self.asynchronous:
            region = ctx.state["share-variables"]["optimizer_region"]
            plan_steps = self._asynchronous(ir, build, grad_edges, points, steps, region)
            chief_init = one_client_only = None
        else:
            plan_steps, chief_init, one_client_only = self._synchronous(
                ir, build, grad_edges, points, steps)
            if combined and not one_client_only:
                one_client_only = (
                    f"'{combined[0][0]}' runs once per step and reads '{combined[0][2]}' of "
                    "every replica combined, which one process per task cannot compute")
        _recolocate_shared(ir, build.takes)
        losses = build.worker_losses() if plan_steps else {}
        _write_plan(ir, ctx, workers, plan_steps, losses, chief_init, self,
                    [s.name for s in tg.steps], one_client_only)
        return PassResult(modified=True, summary={
            "workers": len(workers.tasks), "steps": len(steps), "statistics": statistics,
            "aggregated": len({points[t][0].name for _, _, t in grad_edges})})

    def _synchronous(self, ir, build, grad_edges, points, steps):
        _refuse_norms_of_sparse_rows(ir, grad_edges, points)
        workers = build.workers
        accumulators = {}  # aggregate name -> _Accumulator
        for consumer, port, tensor in grad_edges:
            agg, part = points[tensor]
            if agg.name not in accumulators:
                accumulators[agg.name] = build.accumulator(agg)
            ir.set_input(consumer, port, accumulators[agg.name].takes[part])
        for step in steps:  # one client: the step runs every worker's applies it needs
            for acc in _taken_by(ir, step.core, accumulators.values()):
                for apply in acc.applies:
                    ir.add_control_input(step.entry, apply)
        handles = [a.handle for a in accumulators.values()]
        if len(steps) != 1:  # per-task plans run one step; `plan_of` refuses these graphs
            return {}, None, None
        staged = _staged_apply(ir, accumulators.values())
        if staged:
            if self.staleness:
                raise GraphxformError(
                    f"--staleness: '{staged}' sends a gradient computed after an update of "
                    "the same step (a step that chains its optimizers); a stale gradient "
                    "cannot wait on this step's update: drop --staleness")
            return {}, None, (
                f"'{staged}' sends a gradient computed after an update of the same step (the "
                "step chains its optimizers), and one process per task would run that update "
                "once per worker")
        (step,) = steps
        done = build.after_update(step.core, handles, self.staleness)
        release = build.release(done, workers.token_takers())
        plan = {}
        for w, task in enumerate(workers.tasks):
            own = ["^" + a.applies[w] for a in accumulators.values()]
            own += ["^" + c for c in build.own_controls(step, w)]
            if w == workers.chief:
                plan[task] = build.op(build.scope(task) + "step", "NoOp",
                                      own + ["^" + (release or done)])
            else:
                token = build.op(build.scope(task) + "token", "QueueDequeueV2",
                                 [build.token_queue()] + own, component_types=[INT64],
                                 device=workers.device(w))
                plan[task] = build.op(build.scope(task) + "step", "NoOp", ["^" + token])
        if workers.chief is None:  # a chief job with no replicas of its own
            plan[workers.chief_task] = build.op(build.scope(workers.chief_task) + "step",
                                                "NoOp", ["^" + (release or done)])
        chief_init = build.chief_init(handles, self.staleness, workers.token_takers())
        return plan, chief_init, None

    def _asynchronous(self, ir, build, grad_edges, points, steps, region):
        workers = build.workers
        entries = {s.entry for s in steps}
        region = (set(region) - entries) | {s.core for s in steps}
        outside = sorted(dst for n in region for dst in ir.successors(n)
                         if dst not in region and dst not in entries)
        if outside:
            raise GraphxformError(f"'{outside[0]}' waits on the optimizer's update; cannot give "
                                  "each worker its own update for --async")
        copies = {s.entry: [] for s in steps}
        named = {n: [] for n in sorted(_collected(ir) & region)}  # kept: see `entry`
        plan = {}
        for w, task in enumerate(workers.tasks):
            mapping = ir.copy_nodes(region, f"{ASYNC_SCOPE}{task.replace(':', '_')}/",
                                    created_by=build.created_by)
            for name, found in named.items():
                found.append(mapping[name])
            local = {}
            for consumer, port, tensor in grad_edges:
                agg, part = points[tensor]
                if (agg.name, part) not in local:
                    local.update(build.local_gradient(w, agg))
                ir.set_input(mapping[consumer], port, local[(agg.name, part)])
            for step in steps:
                copies[step.entry].append(mapping[step.core])
            if len(steps) == 1:
                own = ["^" + c for c in build.own_controls(steps[0], w)]
                plan[task] = build.op(build.scope(task) + "step", "NoOp",
                                      ["^" + mapping[steps[0].core]] + own)
        for step in steps:  # the entry reads the first worker's copy and waits on all
            first, *rest = copies[step.entry]
            ir.replace_all_uses_with(step.core, first, where=lambda n, e=step.entry: n == e)
            for copy in rest:
                ir.add_control_input(step.entry, copy)
        ir.remove_nodes(region)
        for name, (first, *rest) in named.items():
            build.entry(name, first, rest)  # a name the user runs
        if plan and workers.chief is None:
            plan[workers.chief_task] = build.op(build.scope(workers.chief_task) + "step", "NoOp")
        return plan


def _taken_by(ir, core, accumulators) -> list:
    """The accumulators whose take a step runs: those upstream of its ``core``, and those
    upstream of what those accumulators' applies read. A take does not depend on the applies
    it waits for, so a step that chains its optimizers (the actor's loss under
    ``control_dependencies([critic_train])``, the actor's minimize outside it) reaches the
    critic's takes only through the actor's applies; leaving the critic's applies out of the
    step left its takes waiting forever."""
    accumulators = list(accumulators)
    chosen, upstream = [], ir.ancestors(core)
    while True:
        found = [a for a in accumulators if a not in chosen and a.take in upstream]
        if not found:
            return chosen
        chosen += found
        upstream |= ir.ancestors_of([apply for a in found for apply in a.applies])


def _staged_apply(ir, accumulators) -> str | None:
    """An accumulator apply that runs after some accumulator's take (a step whose later
    optimizer's gradients wait on an earlier optimizer's update, as actor-critic code chains
    them): one client runs it in one `session.run`, but each worker's own step would run the
    update between them too. The first such apply, or None."""
    accumulators = list(accumulators)
    after = ir.descendants([a.take for a in accumulators]) if accumulators else set()
    return next((apply for a in accumulators for apply in a.applies if apply in after), None)


def _own_scope(update: str) -> str:
    """The scope of a statistic's update and its arithmetic: a moving average's (``avg/`` of
    ``avg/AssignMovingAvg/AssignSubVariableOp``, its decay beside it), else the update's."""
    head, found, _ = update.partition("/AssignMovingAvg")
    return (head if found else update.rsplit("/", 1)[0]) + "/"


def _statistics_from_first_replica(ir, tg, replicas) -> int:
    """A shared variable the step updates outside the optimizer from each replica's slice
    (batch norm's moving mean and variance) is updated once per step, from replica 0's slice,
    as allreduce keeps and saves replica 0's copy; the other replicas' updates go, and a read of
    the variable that waited on one of them waits on replica 0's instead. An update whose
    output something reads stays (the contract check then names the variable). What
    goes with an update is its own scope's arithmetic: a loss it averages (CIFAR-10's moving
    averages of the losses) stays in every replica, so fetching it still merges them all.
    Returns how many updates went."""
    removed = 0
    for var in tg.variables.values():
        if var.role != "statistic" or var.name not in ir:
            continue
        for update in var.updates:
            for k in range(1, replicas):
                copy = replica_prefix(k) + update
                if copy not in ir or ir.consumers(copy):
                    continue
                kept = replica_prefix(0) + update
                for consumer in list(ir.control_consumers(copy)):
                    ir.remove_control_input(consumer, copy)
                    if kept in ir and any(src == var.name for src, _ in ir.inputs(consumer)):
                        ir.add_control_input(consumer, kept)  # a read after the update (the
                        # advantage's baseline) waits on it; what merely ran after it does not
                scope = replica_prefix(k) + _own_scope(update)
                removed += ir.remove_dead([copy], keep=lambda n, s=scope: not n.startswith(s)
                                          and n != copy) > 0
    if removed:
        _drop_missing_from_collections(ir)
    return removed


def _recolocate_shared(ir, takes) -> int:
    """A once-per-step node colocated with a node every replica now has a copy of (TF puts
    clip_by_global_norm's L2Loss with the gradient it reads) is colocated with the take of that
    gradient's accumulator, on the variable's ps task, or with nothing. Returns how many nodes
    changed."""
    changed = 0
    for name in ir.nodes():
        attrs = ir.attrs(name) if not REPLICA_SCOPE.match(name) else {}
        if "_class" not in attrs:
            continue
        items = colocation_targets(attrs["_class"])
        if all(target is None or target in ir for _, target in items):
            continue
        kept = [item if target is None or target in ir else
                f"loc:@{takes[target]}".encode() if target in takes else None
                for item, target in items]
        attr = ir.node(name)["attr"]
        del attr["_class"].list.s[:]
        attr["_class"].list.s.extend(dict.fromkeys(k for k in kept if k))
        if not attr["_class"].list.s:
            del attr["_class"]
        changed += 1
    return changed


def _collected(ir) -> set:
    """The nodes the collections name (TF1's ``minimize`` adds its apply op to `train_op`
    besides the group of it the user adds): what a user reloading the graph can run by name."""
    found = set()
    for col in ir.meta.collection_def.values():
        if col.HasField("node_list"):
            found.update(parse_tensor(v.lstrip("^"))[0] for v in col.node_list.value)
    return found


def _drop_missing_from_collections(ir) -> None:
    """Collections (`update_ops`) stop naming the updates that went, and legacy conds' contexts
    the tensors of the updates inside them (batch norm on a training flag that is a tensor,
    with control flow v1): import_meta_graph looks up every tensor a context names."""
    for key, col in ir.meta.collection_def.items():
        if col.HasField("node_list"):
            kept = [v for v in col.node_list.value if parse_tensor(v.lstrip("^"))[0] in ir]
            if len(kept) != len(col.node_list.value):
                del col.node_list.value[:]
                col.node_list.value.extend(kept)
        elif key in ("cond_context", "while_context") and col.HasField("bytes_list"):
            _drop_missing_from_contexts(ir, key, col)


def _drop_missing_from_contexts(ir, key, col) -> None:
    from tensorflow.core.protobuf import control_flow_pb2
    cls = (control_flow_pb2.WhileContextDef if key == "while_context"
           else control_flow_pb2.CondContextDef)
    exists = lambda name: parse_tensor(name.lstrip("^"))[0] in ir  # noqa: E731
    pruned = []
    for raw in col.bytes_list.value:
        context = cls.FromString(raw)
        _prune_values(context, exists)
        pruned.append(context.SerializeToString(deterministic=True))
    del col.bytes_list.value[:]
    col.bytes_list.value.extend(pruned)


def _prune_values(message, exists) -> None:
    """Drop from every ValuesDef in ``message`` (nested contexts' too) the tensors that are
    gone."""
    for field, value in message.ListFields():
        if field.type != field.TYPE_MESSAGE or field.message_type.GetOptions().map_entry:
            continue
        for item in (value if _repeated(field) else [value]):
            if item.DESCRIPTOR.name != "ValuesDef":
                _prune_values(item, exists)
                continue
            kept = [v for v in item.values if exists(v)]
            del item.values[:]
            item.values.extend(kept)
            for name in [k for k, v in item.external_values.items()
                         if not (exists(k) and exists(v))]:
                del item.external_values[name]


def _repeated(field) -> bool:
    if hasattr(field, "is_repeated"):  # protobuf >= 5.28; `label` is gone in 7
        return field.is_repeated
    return field.label == field.LABEL_REPEATED


def _tie_replica_reads(ir, tg) -> int:
    """A replica's op that takes a shared variable's handle (a gather from an embedding, a read
    inside a legacy while loop behind an Enter) runs on the variable's ps task, where TF puts
    any op that takes a resource; nodes colocated with it (a gradient's Shape of the gathered
    rows, a loop's gradient stacks) go there too instead of keeping the replica's device and
    clashing with it. Returns how many nodes moved."""
    tied = {}
    for var in tg.variables.values():
        if var.name not in ir:
            continue
        device = ir.node(var.name)["device"]
        stack = [dst for dst, _ in ir.consumers(var.name) if REPLICA_SCOPE.match(dst)]
        while stack:
            node = stack.pop()
            if node in tied:
                continue
            tied[node] = device
            if ir.op(node) in HANDLE_FORWARDING:
                stack += [dst for dst, _ in ir.consumers(node)]
    if not tied:
        return 0
    for name in ir.nodes():
        attrs = ir.attrs(name) if REPLICA_SCOPE.match(name) else {}
        if "_class" in attrs:
            for _, target in colocation_targets(attrs["_class"]):
                if target in tied:
                    tied[name] = tied[target]
    for name, device in tied.items():
        ir.node(name)["device"] = device
    return len(tied)


def _points(aggregates) -> dict:
    """Gradient tensor -> (Aggregate, part) where part is 'dense', 'values' or 'indices'."""
    found = {}
    for agg in aggregates:
        g = agg.gradient
        if g.kind == "dense":
            found[g.tensor] = (agg, "dense")
        else:
            found[g.values] = (agg, "values")
            found[g.indices] = (agg, "indices")
    return found


# what makes a norm of a tensor's rows (clip_by_global_norm's L2Loss, clip_by_norm's Square)
_NORM_OPS = frozenset({"L2Loss", "Square", "Pow", "Sqrt", "Norm", "EuclideanNorm",
                       "SquaredDifference", "Abs"})
_COALESCING_OPS = frozenset({"UnsortedSegmentSum"})  # rows summed per id (the optimizer's dedup)


def _refuse_norms_of_sparse_rows(ir, grad_edges, points) -> None:
    """A sparse accumulator sums the rows of one id, so the update region reads a sparse
    gradient coalesced, where one device's IndexedSlices holds a row per lookup (an id looked
    up twice, two rows). The optimizer sums duplicates itself first, and scaling every row
    (clip_by_global_norm's factor, loss-scale division) commutes with summing them, but a norm
    of the rows does not: tf.clip_by_global_norm or tf.clip_by_norm of such a gradient would
    clip by another norm. Refuse, naming the gradient and the op. The walk ends where the rows
    are written (a ref variable's ScatterAdd, which the registry does not call stateful) or
    summed per id (the optimizer's dedup, an UnsortedSegmentSum over unique ids: Adam's norm
    of its moments after that is one device's)."""
    for consumer, _, tensor in grad_edges:
        agg, part = points[tensor]
        if part != "values":
            continue
        seen, stack = set(), [consumer]
        while stack and len(seen) < 10000:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            op = ir.op(node)
            if op in _NORM_OPS:
                raise ContractError(
                    f"variable '{agg.variable}': its sparse gradient's rows ('{tensor}') reach "
                    f"'{node}' ({op}), a norm of them (tf.clip_by_global_norm, "
                    "tf.clip_by_norm); the ps strategies sum the rows of one id across "
                    "workers before the update reads them, while one device's gradient holds "
                    "a row per lookup, so the norm would differ: use --strategy allreduce, "
                    "which gathers the rows as they are, or clip the dense gradients only")
            if not (opdefs.is_stateful(ir, op) or is_mutating_op(op) or op in _COALESCING_OPS):
                stack.extend(dst for dst, _ in ir.consumers(node))


# how one device's value of a statistic follows from the replicas' copies (cross_replica)
_COMBINED = {"mean": ("Add", "Div"), "sum": ("Add", "Id"), "count": ("Add", "Id"),
             "max": ("Max", "Id"), "min": ("Min", "Id")}


def _combine_statistics(ir, build, cross_edges, points, step_ops, replicas: int) -> list:
    """A once-per-step node that is no step op and reads what each replica computes, not a
    gradient (a moving average of the loss, or of a mean of the model's activations, updated
    after the optimizer's step): where replica 0's copy is a mean, sum, count, max or min over
    its slice, or rows of the batch (replica_values), it reads every replica's copies
    combined instead (averaged, summed, their extreme, concatenated in replica order), which
    is one device's value. Returns the edges so rewired; the rest are _check_cross_edges'."""
    from graphxform import replica_values
    from graphxform.passes.cross_replica import combine_copies
    from graphxform.training import gradient_scope
    first = replica_prefix(0)
    wanted = [e for e in cross_edges if e[0] not in step_ops and e[2] not in points
              and gradient_scope(parse_tensor(e[2])[0]) is None]
    if not wanted:
        return []
    copies = set()
    for _, _, tensor in wanted:
        copies.update(n for n in ir.ancestors(first + parse_tensor(tensor)[0])
                      if n.startswith(first))
        copies.add(first + parse_tensor(tensor)[0])
    values = replica_values.classify(ir, first, copies=sorted(copies))
    done, made = [], {}
    for consumer, port, tensor in wanted:
        node, out = parse_tensor(tensor)
        kind = values.of(first + node, out)
        if kind not in _COMBINED and kind not in replica_values.BATCHED:
            continue
        if tensor not in made:
            device = ir.node(consumer)["device"] or ir.node(first + node)["device"]
            scope = f"{SYNC_SCOPE}combined/{node}_{out}/"
            if kind in _COMBINED:
                merge, final = _COMBINED[kind]
                made[tensor] = combine_copies(ir, build, replicas, tensor, scope, device,
                                              merge=merge, final=final)
            else:
                axis = build.const(scope + "axis", 0, np.int32, device=device)
                made[tensor] = build.op(
                    scope + "batch", "ConcatV2",
                    [tensor_name(replica_prefix(i) + node, out) for i in range(replicas)]
                    + [axis], device=device, N=replicas, Tidx=INT32,
                    T=opdefs.output_dtype(ir, first + node, out)) + ":0"
        ir.set_input(consumer, port, made[tensor])
        done.append((consumer, port, tensor))
    return done


def _check_cross_edges(cross_edges, points, step_ops) -> dict:
    """Every once-per-step node that reads what each replica computes must read a born gradient
    (aggregated here) or be a step op (which gets the replicas' mean). Returns the step ops'
    edges by step."""
    by_step = {}
    for consumer, port, tensor in cross_edges:
        if consumer in step_ops:
            by_step.setdefault(consumer, []).append((consumer, port, tensor))
        elif tensor not in points:
            raise ContractError(
                f"'{consumer}' runs once per step, after the gradients are aggregated on the "
                f"ps tasks, but reads '{tensor}', which each replica computes from its own "
                "slice and which is not a gradient (an update after the optimizer's that "
                "reads the loss; under hybrid, tf.clip_by_global_norm over all-reduced and "
                "ps-side gradients at once): it would read one replica's; use --strategy "
                "allreduce")
    return by_step


class _Workers:
    """Replicas grouped by worker task, and which task is the chief."""

    def __init__(self, devices, cluster):
        from tensorflow.python.framework.device_spec import DeviceSpecV2
        self.tasks, self.replicas, self.devices = [], {}, {}
        for k, device in enumerate(devices):
            spec = DeviceSpecV2.from_string(device)
            task = f"{spec.job or 'localhost'}:{spec.task or 0}"
            if task not in self.replicas:
                self.tasks.append(task)
                self.replicas[task] = []
                self.devices[task] = device
            self.replicas[task].append(k)
        self.count = len(devices)
        has_chief_job = cluster is not None and bool(cluster.tasks("chief"))
        self.chief_task = "chief:0" if has_chief_job else self.tasks[0]
        self.chief = None if has_chief_job else 0

    def device(self, w: int) -> str:
        return self.devices[self.tasks[w]]

    def token_takers(self) -> int:
        """Workers that wait for a token each step: all but a worker that is the chief."""
        return len(self.tasks) - (0 if self.chief is None else 1)


@dataclasses.dataclass
class _Accumulator:
    handle: str
    take: str  # the take node
    takes: dict  # gradient part -> tensor the region reads
    applies: list  # per worker


class _Build:
    """Node builders shared by the sync and async paths."""

    def __init__(self, ir, builder, workers, tg, staleness=0):
        self.ir, self.builder, self.workers, self.tg = ir, builder, workers, tg
        self.staleness = staleness
        self.created_by = builder.created_by
        self._queue = None
        self._local_steps = {}
        self.takes = {}  # born gradient node -> the take of its accumulator

    def op(self, *args, **kwargs):
        return self.builder.op(*args, **kwargs)

    def const(self, *args, **kwargs):
        return self.builder.const(*args, **kwargs)

    @staticmethod
    def scope(task: str) -> str:
        return f"{SYNC_SCOPE}{task.replace(':', '_')}/"

    def _dtype(self, tensor):
        return opdefs.output_dtype(self.ir, *parse_tensor(tensor))

    # ------------------------------------------------------------------ steps
    def detach(self, step_op, merged_edges) -> _Step:
        """Move what ``step_op`` does to `ps_sync/<step_op>` (its core) and rebuild the step
        under its own name as the one-client entry point (see the module docstring)."""
        ir = self.ir
        controls = [c for c in ir.control_inputs(step_op) if REPLICA_SCOPE.match(c)]
        if merged_edges:
            core, make_entry = self._detach_tensor_step(step_op, merged_edges, controls)
        else:
            core = ir.copy_nodes([step_op], SYNC_SCOPE, created_by=self.created_by)[step_op]
            for control in controls:
                ir.remove_control_input(core, control)
            make_entry = self._entry_reading(step_op, core, controls)
        ir.replace_all_uses_with(step_op, core)  # its consumers wait on the rebuilt step
        ir.remove_node(step_op)
        entry = make_entry()
        ir.replace_all_uses_with(core, entry, where=lambda n: n != entry)
        return _Step(entry, core, controls)

    def _detach_tensor_step(self, step_op, merged_edges, controls):
        """A step that gives a value computed by the replicas (tf_slim's Identity of the loss
        with the update as control input): the core waits on what is not per replica; the
        entry is the Identity of the replicas' mean."""
        ir = self.ir
        tensor = merged_edges[0][2]
        if ir.op(step_op) != "Identity" or len(ir.inputs(step_op)) != 1:
            raise GraphxformError(f"train op '{step_op}' ({ir.op(step_op)}) reads '{tensor}', "
                                  "which every replica computes; only an Identity of it (a "
                                  "loss with the update as control input) can be merged")
        waits = [s for s, _ in ir.inputs(step_op) + [(c, 0) for c in ir.control_inputs(step_op)]
                 if not REPLICA_SCOPE.match(s)]
        core = self.op(SYNC_SCOPE + step_op, "NoOp", ["^" + w for w in waits])
        value, dtype = self.replica_mean(SYNC_SCOPE + step_op + "/replica_mean", tensor)
        return core, lambda: self.op(step_op, "Identity", [value, "^" + core] +
                                     ["^" + c for c in controls], T=dtype)

    def _entry_reading(self, step_op, core, controls):
        """The entry for a step whose work all moved to ``core``."""
        return lambda: self.entry(step_op, core, controls)

    def entry(self, name, first, waits):
        """``name`` again, once ``first`` does its work: a NoOp that runs it and ``waits``,
        or the Identity of its output 0 when it has outputs (a reference `assign_add` of
        global_step), waiting on ``waits``."""
        deps = ["^" + c for c in waits]
        dtype = self._dtype(first) if opdefs.num_outputs(self.ir, first) else None
        if dtype is None:
            return self.op(name, "NoOp", ["^" + first] + deps)
        dtype = dtype - 100 if dtype > 100 else dtype  # a ref output reads as its value
        return self.op(name, "Identity", [first + ":0"] + deps, T=dtype)

    def replica_mean(self, name, tensor):
        """The mean over every replica of ``tensor`` (a float value each replica computes):
        for a mean over equal slices of the batch, the mean over the whole batch."""
        node, port = parse_tensor(tensor)
        copies = [f"{replica_prefix(k)}{node}:{port}" for k in range(self.workers.count)]
        dtype = self._dtype(copies[0])
        if dtype not in FLOAT_TYPES:
            raise GraphxformError(f"cannot merge '{tensor}' over replicas: not a float tensor")
        stacked = self.op(name + "/stack", "Pack", copies, N=len(copies), T=dtype)
        axis = self.const(name + "/axis", 0, np.int32)
        return self.op(name, "Mean", [stacked, axis], T=dtype) + ":0", dtype

    def own_controls(self, step: _Step, w: int) -> list:
        """The step's control inputs that are worker w's replicas' copies."""
        mine = {replica_prefix(k) for k in self.workers.replicas[self.workers.tasks[w]]}
        return [c for c in step.replica_controls if REPLICA_SCOPE.match(c).group(0) in mine]

    # ------------------------------------------------------------------ gradients
    def local_gradient(self, w, agg) -> dict:
        """Worker w's mean gradient for ``agg``: {(agg name, part): tensor}."""
        task = self.workers.tasks[w]
        device = self.workers.device(w)
        reps = self.workers.replicas[task]
        scope = f"{agg.name}/local_mean/{task.replace(':', '_')}/"
        count = self.const(scope + "replicas", len(reps), np.dtype(_np(agg.dtype)), device=device)
        g = agg.gradient
        if g.kind == "dense":
            copies = [replica_prefix(k) + g.tensor for k in reps]
            total = copies[0] if len(copies) == 1 else self.op(
                scope + "sum", "AddN", copies, N=len(copies), T=agg.dtype, device=device)
            mean = self.op(scope + "mean", "RealDiv", [total, count], T=agg.dtype, device=device)
            return {(agg.name, "dense"): mean + ":0"}
        out = {}
        for part in ("values", "indices"):  # replicas' slices may hold different row counts
            copies = [replica_prefix(k) + getattr(g, part) for k in reps]
            if len(copies) == 1:
                out[part] = copies[0]
                continue
            axis = self.const(scope + f"{part}_axis", 0, np.int32, device=device)
            out[part] = self.op(scope + f"{part}_concat", "ConcatV2", copies + [axis],
                                N=len(copies), T=self._dtype(copies[0]), device=device) + ":0"
        values = self.op(scope + "mean", "RealDiv", [out["values"], count], T=agg.dtype,
                         device=device)
        return {(agg.name, "values"): values + ":0", (agg.name, "indices"): out["indices"]}

    def local_step(self, w) -> str:
        """The step worker w's gradients count as: with staleness, the global step it read at
        the start of its step; without, one no accumulator ever finds stale (tokens already
        keep every worker in its step, and a graph may have no global_step, or several steps
        that do not all move it)."""
        if w not in self._local_steps:
            scope = self.scope(self.workers.tasks[w])
            device = self.workers.device(w)
            if self.staleness:
                self._local_steps[w] = self._step_value(scope + "local_step", [], device)
            else:
                self._local_steps[w] = self.const(scope + "local_step", NEVER_STALE, np.int64,
                                                  device=device)
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

    def accumulator(self, agg) -> _Accumulator:
        """The accumulator of ``agg`` on its variable's ps task, with one apply per worker."""
        device = self.ir.node(agg.anchor)["device"]
        scope = f"{agg.name}/accumulator"
        n = len(self.workers.tasks)
        required = self.const(scope + "/workers", n, np.int32, device=device)
        sparse = agg.gradient.kind == "sparse"
        handle = self.op(scope, "SparseConditionalAccumulator" if sparse else
                         "ConditionalAccumulator", dtype=agg.dtype, shape=list(agg.shape),
                         shared_name=scope, reduction_type="SUM" if sparse else "MEAN",
                         device=device)
        applies = []
        for w, task in enumerate(self.workers.tasks):
            local = self.local_gradient(w, agg)
            name = f"{scope}/apply_{task.replace(':', '_')}"
            if not sparse:
                applies.append(self.op(name, "AccumulatorApplyGradient",
                                       [handle, self.local_step(w), local[(agg.name, "dense")]],
                                       dtype=agg.dtype, device=device))
                continue
            indices = local[(agg.name, "indices")]
            if self._dtype(indices) != INT64:
                indices = self.op(f"{scope}/{task.replace(':', '_')}/indices_int64", "Cast",
                                  [indices], SrcT=self._dtype(indices), DstT=INT64,
                                  device=self.workers.device(w)) + ":0"
            shape = self.const(f"{scope}/{task.replace(':', '_')}/shape", list(agg.shape),
                               np.int64, device=self.workers.device(w))
            applies.append(self.op(name, "SparseAccumulatorApplyGradient",
                                   [handle, self.local_step(w), indices,
                                    local[(agg.name, "values")], shape],
                                   dtype=agg.dtype, has_known_shape=True, device=device))
        take = self.op(scope + "/take", "SparseAccumulatorTakeGradient" if sparse else
                       "AccumulatorTakeGradient", [handle, required], dtype=agg.dtype,
                       device=device)
        self.takes.update((parse_tensor(t)[0], take) for t in agg.gradient.tensors)
        if not sparse:
            return _Accumulator(handle, take, {"dense": take + ":0"}, applies)
        values = self.op(scope + "/mean", "RealDiv", [take + ":1", self.const(
            scope + "/workers_float", n, _np(agg.dtype), device=device)], T=agg.dtype,
            device=device)
        indices = take + ":0"
        wanted = self._dtype(replica_prefix(0) + agg.gradient.indices)
        if wanted != INT64:
            indices = self.op(scope + "/indices", "Cast", [indices], SrcT=INT64, DstT=wanted,
                              device=device) + ":0"
        return _Accumulator(handle, take, {"values": values + ":0", "indices": indices}, applies)

    # ------------------------------------------------------------------ per-task sync
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
                self.tg.trainable[0].name)["device"] if self.tg.trainable else ""
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


def _write_plan(ir, ctx, workers, steps, losses, chief_init, options, train_ops,
                one_client_only=None) -> None:
    from graphxform.plan import ClusterPlan
    ClusterPlan(cluster=ctx.cluster.as_dict() if ctx.cluster is not None else {}, steps=steps,
                losses=losses, chief=workers.chief_task, chief_init=chief_init,
                strategy=ctx.strategy or "ps", staleness=options.staleness,
                is_async=options.asynchronous, train_ops=list(train_ops),
                one_client_only=one_client_only).write_to(ir.meta)
