"""hybrid (Parallax): dense-gradient variables replicated and all-reduced, sparse-gradient ones
(embeddings) kept in one copy on the ps tasks behind sparse accumulators.

`choose-placement` decides each trainable variable's side first and records why (the decisions
are its summary, so apply prints them). `partition-variables` then splits the large ones of the
ps side into shards along axis 0 (`PartitionPsSide`); the shards take their variable's place on
that side. The ps passes and all-reduce then run through `OnSide`, which shows them a view of
the training graph holding only their side's variables: the ps passes place, share and
aggregate the ps side (shards like any variable), all-reduce reduces the rest.
`unshare-replicated` then hands the all-reduced variables (with their slots, initializers and
reads) back to `replicate`, which share-variables would otherwise have kept single like every
other variable.
`hybrid-worker-steps` last makes each worker task's step run its own replicas only, so the graph
also runs one process per task."""

from __future__ import annotations

import dataclasses

import numpy as np

from graphxform.errors import GraphxformError
from graphxform.nodes import Builder, replica_prefix
from graphxform.passes.partition_variables import PartitionVariables
from graphxform.passes.worker_steps import DEFAULT_TIMEOUT_S, set_collective_timeouts, tasks_of
from graphxform.pipeline import Pass, PassResult
from graphxform.training import REPLICA_SCOPE, gradient_scope

STATE = "choose-placement"
SIDES = ("allreduce", "ps")
SCOPE = "hybrid_sync/"
BARRIER_DEVICE = "/job:ps/task:0/device:CPU:0"
END_GROUP_KEY = 3  # all-reduce's groups are 1 and 2
END_INSTANCE_KEY = (1 << 24) - 1  # below all-reduce's sparse keys, above its buckets'
FLOAT = 1  # DataType enum DT_FLOAT
INT64 = 9  # DataType enum DT_INT64
# below this a ps-side variable stays whole: a smaller one is no load worth spreading, and its
# shards would cost a partitioned lookup and routed gradients every step (the size of
# min_max_variable_partitioner's default slice in TF)
PARTITION_MIN_BYTES = 256 << 10


def decide(trainable, sparse_as_dense_below: int = 0, overrides=None) -> dict:
    """{variable: (side, reason)}: an override wins; a sparse gradient goes to the ps unless
    the variable is smaller than ``sparse_as_dense_below`` bytes; a dense one is all-reduced
    (a variable two optimizers train, one with a sparse gradient, goes to the ps, which
    aggregates a dense gradient too; all-reduce would densify the sparse one)."""
    overrides = dict(overrides or {})
    known = {v.name for v in trainable}
    for name, side in overrides.items():
        if name not in known:
            raise GraphxformError(f"--placement-file names '{name}', which is no trainable "
                                  "variable with a gradient")
        if side not in SIDES:
            raise GraphxformError(f"--placement-file: '{name}' -> '{side}' (expected one of "
                                  f"{', '.join(SIDES)})")
    decisions = {}
    for var in trainable:
        if var.name in overrides:
            decisions[var.name] = (overrides[var.name], "placement file")
        elif all(g.kind != "sparse" for g in var.gradients):  # every optimizer's
            decisions[var.name] = ("allreduce", "dense gradient")
        elif var.nbytes < sparse_as_dense_below:
            decisions[var.name] = ("allreduce", f"sparse gradient, {var.nbytes} B < "
                                                f"--sparse-as-dense-below {sparse_as_dense_below}")
        else:
            decisions[var.name] = ("ps", "sparse gradient")
    return decisions


@dataclasses.dataclass
class ChoosePlacement(Pass):
    name = STATE
    sparse_as_dense_below: int = 0
    overrides: dict = dataclasses.field(default_factory=dict)

    def run(self, ir, ctx):
        decisions = decide(ctx.training.trainable, self.sparse_as_dense_below, self.overrides)
        ctx.state[self.name] = {side: {n for n, (s, _) in decisions.items() if s == side}
                                for side in SIDES}
        ctx.state[self.name]["decisions"] = decisions
        return PassResult(modified=False, summary={
            name: f"{side} ({why})" for name, (side, why) in sorted(decisions.items())})


class _SideView:
    """The training graph as one side sees it: its trainable variables only, and (``hide``)
    without the other side's variables and their slots."""

    def __init__(self, tg, keep: set, hide: set):
        self._tg, self._keep, self._hide = tg, keep, hide

    def __getattr__(self, attr):
        return getattr(self._tg, attr)

    @property
    def trainable(self) -> list:
        return [v for v in self._tg.trainable if v.name in self._keep]

    @property
    def variables(self) -> dict:
        """With nothing hidden, the analysis's own dict, so that a pass replacing variables
        (partition-variables) changes the analysis."""
        if not self._hide:
            return self._tg.variables
        return {n: v for n, v in self._tg.variables.items()
                if n not in self._hide and (v.slot_of or n) not in self._hide}


@dataclasses.dataclass
class PartitionPsSide(Pass):
    """partition-variables on the ps side's trainable variables only: each of at least
    ``min_bytes`` is split along axis 0 into ``partitions`` shards (as many as its rows when
    fewer); the shards replace it on the ps side. The summary says, per ps-side variable, how
    many shards it became or why it stayed whole."""
    name = "partition-variables"
    partitions: int = 2
    min_bytes: int = PARTITION_MIN_BYTES

    def run(self, ir, ctx):
        chosen = ctx.state[STATE]
        ps_side = sorted(chosen["ps"])
        if not ps_side:
            return PassResult(modified=False)
        full = ctx.training
        result = OnSide(PartitionVariables(partitions=self.partitions, min_bytes=self.min_bytes),
                        side="ps").run(ir, ctx)
        shards = ctx.state.get("partition-variables", {}).get("shards", {})
        split, kept = {}, dict(result.summary.get("kept_whole", {}))
        for name in ps_side:
            if name in shards:
                chosen["ps"].discard(name)
                chosen["ps"].update(shard for shard, _, _ in shards[name])
                split[name] = len(shards[name])
            elif name not in kept:
                kept[name] = self._why_whole(full.variables[name])
        summary = {"partitioned_into": split, "kept_whole": kept}
        if split:
            summary["shards"] = sum(split.values())
        return PassResult(modified=result.modified, summary=summary)

    def _why_whole(self, var) -> str:
        if self.partitions == 1:
            return "--partitions 1, or a single ps task"
        if len(var.shape) < 1 or var.shape[0] < 2:
            return "a scalar or a single row"
        return f"{var.nbytes} B < --partition-min-bytes {self.min_bytes}"


@dataclasses.dataclass
class OnSide(Pass):
    """Runs ``inner`` on ``side``'s variables only (nothing to do when the side has none)."""
    inner: Pass = None
    side: str = "ps"
    hide_other: bool = False

    @property
    def name(self):
        return self.inner.name

    def run(self, ir, ctx):
        chosen = ctx.state[STATE]
        keep = chosen[self.side]
        if not keep:
            return PassResult(modified=False, summary={"variables": 0})
        other = chosen["ps" if self.side == "allreduce" else "allreduce"]
        full = ctx.training
        ctx.training = _SideView(full, keep, other if self.hide_other else set())
        try:
            return self.inner.run(ir, ctx)
        finally:
            ctx.training = full


@dataclasses.dataclass
class UnshareReplicated(Pass):
    """What share-variables kept single but belongs to an all-reduced variable goes back to
    `replicate`: the variable, its slots, and what reads them by data edges outside the step's
    per-example work (initializers, snapshots). Refuses when that reaches the ps side's
    update (clipping by a global norm over both sides' gradients)."""
    name = "unshare-replicated"

    def run(self, ir, ctx):
        sharing = ctx.state.get("share-variables")
        chosen = ctx.state[STATE]
        if sharing is None or not chosen["allreduce"]:
            return PassResult(modified=False)
        tg = ctx.training
        owners = chosen["allreduce"]
        roots = [n for n, v in tg.variables.items() if (v.slot_of or n) in owners and n in ir]
        shared = sharing["shared"]
        moved = _data_closure(ir, roots, shared)
        moved |= _only_feeding(ir, moved, shared - set(tg.variables))
        ps_side = {n for n, v in tg.variables.items() if (v.slot_of or n) in chosen["ps"]}
        ps_side |= {u for n in ps_side for u in tg.variables[n].updates}
        clash = sorted(moved & ps_side)
        if clash:
            raise GraphxformError(f"hybrid: '{clash[0]}' (ps side) depends on an all-reduced "
                                  "variable's value in the update; put both on one side with "
                                  "--placement-file, or use --strategy allreduce or ps")
        shared -= moved
        sharing["optimizer_region"] -= moved
        return PassResult(modified=bool(moved), summary={"unshared_nodes": len(moved)})


def _only_feeding(ir, targets: set, within: set) -> set:
    """Nodes of ``within`` whose every consumer is in ``targets`` or among them (an
    initial value and its inputs), so that each replica builds its own: sync-init points
    replicas > 0 at replica 0's copy."""
    found = set()
    stack = [src for n in targets for src in ir.predecessors(n)]
    while stack:
        node = stack.pop()
        if node in found or node in targets or node not in within:
            continue
        if all(dst in targets or dst in found for dst in ir.successors(node)):
            found.add(node)
            stack.extend(ir.predecessors(node))
    return found


def _data_closure(ir, roots, within: set) -> set:
    """``roots`` and what reads them through data edges, staying inside ``within``."""
    seen = {r for r in roots if r in within}
    stack = list(seen)
    while stack:
        for dst, _ in ir.consumers(stack.pop()):
            if dst in within and dst not in seen:
                seen.add(dst)
                stack.append(dst)
    return seen


@dataclasses.dataclass
class HybridWorkerSteps(Pass):
    """Each worker task's part of the step, for one process per task (`launch`, `run
    --cluster`): insert-accumulators wrote the ps side's per-task steps and token queue; this
    adds the all-reduced side.

    The once-per-step update region waits on every replica's all-reduced update (Adam's
    beta-power assigns and global_step's increment run after them), so the chief's step would
    run the other workers' replicas too. Those control edges go through a barrier instead:
    worker w's `hybrid_sync/<w>/done` enqueues one token once its replicas' updates ran, and the
    region waits on `hybrid_sync/all_done`, which dequeues one per worker. Each task's step
    runs its own `done`; the original train op (one client) runs all of them.

    Per task, every worker's run of step k holds collectives, so TF gives them all the same
    step id (from the group leader), and they all have partitions on the ps tasks: the first
    run to finish cleans that step id up on the ps, aborting what another run has not yet
    received from there (its token). So each task's step ends in `hybrid_sync/<w>/end`, a
    collective of one scalar over the workers, once the rest of its step is done: no run
    finishes before every run has had all it needs from the ps. The plan also names the
    collective group leader and each task's device filters, and every collective gets a
    timeout."""
    name = "hybrid-worker-steps"
    timeout_s: float = DEFAULT_TIMEOUT_S

    def run(self, ir, ctx):
        from graphxform.plan import ClusterPlan
        chosen = ctx.state[STATE]
        if ctx.cluster is None or not chosen["allreduce"] or len(ctx.devices) < 2:
            return PassResult(modified=False)
        tasks = tasks_of(ctx.devices)
        first = next(iter(tasks))
        leader = "/job:{}/replica:0/task:{}".format(*first.split(":"))
        plan = ClusterPlan.from_ir(ir)
        if plan is None:  # nothing on the ps side: no accumulators, no tokens
            plan = ClusterPlan(
                cluster=ctx.cluster.as_dict(), chief=first, losses={},
                steps={first: ctx.training.steps[0].op} if ctx.training.steps else {},
                strategy=ctx.strategy, train_ops=[s.name for s in ctx.training.steps],
                one_client_only="every variable is all-reduced (none on the ps side); for one "
                                "process per task use --strategy allreduce --cluster F")
        elif plan.steps and len(tasks) > 1:
            build = Builder(ir, self.name)
            _barrier(ir, build, plan, tasks, ctx.training.steps[0].op)
            _end_together(ir, build, plan, tasks, ctx.devices)
            plan.device_filters = {t: [] if t == plan.chief else
                                   ["/job:ps", "/job:" + t.replace(":", "/task:")]
                                   for t in plan.steps}
        plan.collective_leader = leader
        plan.write_to(ir.meta)
        timed = set_collective_timeouts(ir, self.timeout_s)
        return PassResult(modified=True, summary={"collective_leader": leader,
                                                  "collectives_timed": timed})


def _barrier(ir, build, plan, tasks, entry) -> None:
    """Route the control edges from replicas into the chief's once-per-step region through
    the done/all_done barrier (see HybridWorkerSteps), then prove that each task's step runs
    its own replicas only."""
    prefix_task = {replica_prefix(k): t for t, ks in tasks.items() for k in ks}
    steps = set(plan.steps.values())
    cut = {t: [] for t in tasks}  # task -> its replicas' nodes the region waited on
    waiting = []
    for node in sorted(ir.ancestors(plan.steps[plan.chief]) - steps):
        if REPLICA_SCOPE.match(node):
            continue
        sources = [s for s in ir.control_inputs(node) if REPLICA_SCOPE.match(s)]
        if sources and gradient_scope(node):
            # tf.gradients' gating of a gradient no replica's data reaches (the 0.1 of
            # ``loss + 0.1 * l2_loss(w)``), kept single: it only orders the backward pass,
            # and through the barrier every replica's gradient would wait on every update
            # (a deadlock)
            for src in sources:
                ir.remove_control_input(node, src)
            continue
        if sources:
            waiting.append((node, sources))
            for src in sources:
                cut[prefix_task[REPLICA_SCOPE.match(src).group(0)]].append(src)
    if waiting:
        queue = build.op(SCOPE + "done_queue", "FIFOQueueV2", component_types=[INT64],
                         shapes=[[]], capacity=-1, shared_name=SCOPE + "done_queue",
                         device=BARRIER_DEVICE)
        token = build.const(SCOPE + "token", [0], np.int64, device=BARRIER_DEVICE)
        count = build.const(SCOPE + "workers", len(tasks), np.int32, device=BARRIER_DEVICE)
        all_done = build.op(SCOPE + "all_done", "QueueDequeueManyV2", [queue, count],
                            component_types=[INT64], device=BARRIER_DEVICE)
        for node, sources in waiting:
            for src in sources:
                ir.remove_control_input(node, src)
            ir.add_control_input(node, all_done)
        for task, sources in cut.items():
            done = build.op(f"{SCOPE}{task.replace(':', '_')}/done", "QueueEnqueueManyV2",
                            [queue, token] + ["^" + s for s in dict.fromkeys(sources)],
                            Tcomponents=[INT64], device=BARRIER_DEVICE)
            ir.add_control_input(entry, done)
            ir.add_control_input(plan.steps[task], done)
    for task, step in plan.steps.items():
        mine = {replica_prefix(k) for k in tasks.get(task, ())}
        other = sorted(n for n in ir.ancestors(step)
                       if REPLICA_SCOPE.match(n) and REPLICA_SCOPE.match(n).group(0) not in mine)
        if other:
            raise GraphxformError(f"hybrid: {task.replace(':', ' ')}'s step would also run "
                                  f"'{other[0]}', another task's replica; run this graph with "
                                  "one client, or use --strategy allreduce or ps")


def _end_together(ir, build, plan, tasks, devices) -> None:
    """Each task's step waits on a scalar collective over the tasks that runs once the rest of
    its step is done (see HybridWorkerSteps)."""
    for task, replicas in tasks.items():
        step, device = plan.steps[task], devices[replicas[0]]
        scope = f"{SCOPE}{task.replace(':', '_')}/end"
        inputs = [build.const(scope + "/value", 0.0, np.float32, device=device),
                  build.const(scope + "/group_size", len(tasks), np.int32, device=device),
                  build.const(scope + "/group_key", END_GROUP_KEY, np.int32, device=device),
                  build.const(scope + "/instance_key", END_INSTANCE_KEY, np.int32,
                              device=device)]
        waits = ir.control_inputs(step)
        for src in waits:
            ir.remove_control_input(step, src)
        end = build.op(scope, "CollectiveReduceV2", inputs + ["^" + w for w in waits],
                       device=device, T=FLOAT, merge_op="Add", final_op="Div")
        ir.add_control_input(step, end)
