"""share-variables: one copy of each variable, its slots and its optimizer update, on the ps task
place-variables chose; every replica reads it.

Runs before `replicate` and tells it what to leave single. Per step, the *update region* is
everything in the step's closure downstream of a born gradient (the tensor tf.gradients produced):
gradient post-processing (clipping by global norm, loss-scale division, finite checks), the
optimizer, what waits on the update (an ExponentialMovingAverage of the weights), and the step op
itself. It runs once per step, on the aggregated gradients, so post-processing sees the
cross-worker gradient as on one device; the parts tied to a variable run on its ps task, the rest
in the client (the chief). Replicated is the per-example work: every other node that depends on a
batched input. Everything else stays shared under its original name: variables and their
initializers, reads, hyper-parameters, global_step.

The region still reads the born gradients that every replica computes; `replicate` records those
edges and `insert-accumulators` turns each into an aggregation point (``Aggregate``)."""

from __future__ import annotations

import dataclasses

from graphxform.errors import GraphxformError
from graphxform.passes.replicate import shared_nodes
from graphxform.pipeline import Pass, PassResult
from graphxform import opdefs
from graphxform.functions import legacy_loop_frames
from graphxform.ir import parse_tensor
from graphxform.training import PLACEHOLDER_OPS, VARIABLE_OPS, Gradient, gradient_scope

# Ops whose state lives for one run of the step: a TensorArray (tf.scan's, a dynamic_rnn's) and a
# legacy gradient loop's stack. Replicas that shared one would write into the same array (TF
# refused it besides: each worker's writes are colocated with the array), so each replica whose
# work uses one owns a copy, however few its inputs are per example (tf.scan's size is a
# constant).
PER_RUN_STATE_OPS = frozenset({"TensorArrayV3", "TensorArrayV2", "TensorArray", "StackV2",
                               "Stack"})


@dataclasses.dataclass
class Aggregate:
    """A gradient every replica computes and the update region reads once per step.

    ``name`` names its accumulator (``<name>/accumulator``): the variable, or a partitioned
    variable whose whole gradient is aggregated before post-processing, or, for the second
    optimizer of a variable two train (an actor-critic's shared trunk), ``<variable>/
    gradient_<k>``, so each gradient has its own accumulator and shared_name; ``anchor`` is
    the variable node whose ps task holds the accumulator; ``variable`` the variable."""
    name: str
    gradient: Gradient
    dtype: int
    shape: tuple
    anchor: str
    variable: str = ""

    def __post_init__(self):
        self.variable = self.variable or self.name


def aggregates(ctx) -> list[Aggregate]:
    """Every gradient to aggregate: each trainable variable's born gradient (a shard's part of
    it, when partition-variables split it before aggregation), one per optimizer that applies
    one to it (Variable.gradients: each is taken by the update that applies it, in the step
    that runs it), and the whole born gradient of a partitioned variable whose update reads it
    post-processed."""
    tg = ctx.training
    found = [Aggregate(v.name if k == 0 else f"{v.name}/gradient_{k}", g, v.dtype, v.shape,
                       v.name, v.name)
             for v in tg.trainable for k, g in enumerate(v.gradients)]
    partitioned = ctx.state.get("partition-variables", {})
    for name, original in partitioned.get("whole_gradients", {}).items():
        first_shard = partitioned["shards"][name][0][0]
        found.append(Aggregate(name, original.gradient, original.dtype, original.shape,
                               first_shard))
    return found


def update_region(ir, step_ops, born_nodes, data_dependent=frozenset()) -> set:
    """Per step, the nodes of its closure that depend on a born gradient (through data or
    control edges, outside gradients scopes), and the step op itself.

    A step may chain its optimizers (actor-critic code builds the actor's loss under
    ``tf.control_dependencies([train_q])``): the later loss's forward pass waits on the first
    update, but it is per-replica work of a later stage, not part of the update. So the walk
    skips what a born gradient depends on and that reads the batch (``data_dependent``) other
    than through a born gradient; that stage's own update is reached from its gradients."""
    later_stages = (ir.ancestors_of(born_nodes) & set(data_dependent)) - ir.data_descendants(
        born_nodes)
    region = set()
    for step in step_ops:
        closure = ir.ancestors(step)
        frontier = [n for n in born_nodes if n in closure]
        seen = set(frontier)
        while frontier:
            for dst in ir.successors(frontier.pop()):
                if (dst in closure and dst not in seen and not gradient_scope(dst)
                        and dst not in later_stages):
                    seen.add(dst)
                    region.add(dst)
                    frontier.append(dst)
        region.add(step)
    return region


@dataclasses.dataclass
class ShareVariables(Pass):
    name = "share-variables"

    def run(self, ir, ctx):
        tg = ctx.training
        tg.require_train_op(self.name)
        points = aggregates(ctx)
        if not points:
            raise GraphxformError("no gradient of a trainable variable found: nothing to "
                                  "aggregate on ps tasks")
        placement = ctx.state.get("place-variables", {}).get("devices", {})
        batched = tg.batch_sources
        per_example = _descendants(ir, batched)
        born = {parse_tensor(t)[0] for p in points for t in p.gradient.tensors}
        data_dependent = ir.data_descendants(batched)
        region = update_region(ir, [s.op for s in tg.steps], born, data_dependent)
        _pull_in_control_only(ir, region, per_example, data_dependent)
        _pull_in_waiting(ir, region, per_example, data_dependent)
        single = shared_nodes(ir, tg) | region
        snapshots = {r for v in tg.variables.values() for r in v.reads}
        replicated = {n for n in per_example - single if ir.op(n) not in PLACEHOLDER_OPS}
        frames = legacy_loop_frames(ir)
        added = (_pull_in_helpers(ir, replicated, region, snapshots)
                 | _whole_loops(ir, frames, replicated, region))
        while added:  # what consumes a pulled-in node is per-replica work too
            grown = _descendants(ir, added) - single - replicated
            grown = {n for n in grown if ir.op(n) not in PLACEHOLDER_OPS | VARIABLE_OPS}
            replicated |= grown
            added = (_pull_in_helpers(ir, replicated, region, snapshots)
                     | _whole_loops(ir, frames, replicated, region) | grown) if grown else set()
        if not replicated:
            raise GraphxformError("nothing in the training step depends on a batched input; "
                                  "there is no per-replica work to distribute")
        _reads_after_writes(ir, tg, placement)
        shared = set(ir.nodes()) - replicated
        placed = 0
        for var in tg.variables.values():
            device = placement.get(var.name)
            if not device:
                continue
            for node in [var.initializer, *var.updates]:  # they run where the variable lives
                if node and node in shared:
                    ir.node(node)["device"] = device
                    placed += 1
        ctx.state[self.name] = {"shared": shared, "optimizer_region": region,
                                "aggregates": points}
        return PassResult(modified=placed > 0, summary={
            "shared_nodes": len(shared), "update_region": len(region)})


def _descendants(ir, sources) -> set:
    """What depends on any of ``sources`` through data or control edges (one sweep for all,
    not one per source)."""
    seen, stack = set(), list(sources)
    while stack:
        for dst in ir.successors(stack.pop()):
            if dst not in seen:
                seen.add(dst)
                stack.append(dst)
    return seen


def _pull_in_control_only(ir, region, per_example, data_dependent) -> None:
    """Inputs of the region that are per-example only because they wait on per-example work
    (built under a control dependency on it: Adam's read of beta1_power under
    `control_dependencies(model.updates)`) carry no replica's data: they run once, with the
    region that reads them."""
    stack = list(region)
    while stack:
        for src in ir.predecessors(stack.pop()):
            if (src in region or src not in per_example or src in data_dependent
                    or gradient_scope(src)):
                continue
            region.add(src)
            stack.append(src)


def _reads_after_writes(ir, tg, placement) -> None:
    """A ref variable's snapshot (``w/read``) is one Identity beside the variable, run as soon
    as the variable is. On one device a reader that runs after a write of the variable in the
    step (PopArt's ``w.assign(w * sigma / new_sigma)`` before the forward pass, under
    control_dependencies; SAC's polyak update of the target network under
    control_dependencies([train_value_op])) still sees the written value: the snapshot aliases
    the variable's buffer. A worker, or the chief running the once-per-step part, gets a copy,
    sent when the snapshot ran, maybe before the write (verify failed by 4e-01 and 9e-02).
    Such a reader reads a snapshot of its own, beside the variable, that waits on those
    writes."""
    for var in tg.variables.values():
        if var.kind != "ref" or not var.updates:
            continue
        reads = [r for r in var.reads if r in ir and ir.op(r) == "Identity"]
        readers = {(c, p) for r in reads for c, p in ir.consumers(r)}
        after = {write: ir.descendants([write]) for write in var.updates} if readers else {}
        made = {}
        for reader, port in sorted(readers):
            waits = tuple(w for w, later in after.items() if reader in later)
            if not waits:
                continue
            read = ir.input(reader, port)[0]
            if (read, waits) not in made:
                made[read, waits] = ir.add_node(
                    ir.unique_name(f"{read}_after_write"), "Identity",
                    [var.name, *("^" + w for w in waits)],
                    device=placement.get(var.name, ir.node(read)["device"]),
                    attr=dict(ir.attrs(read)), created_by="share-variables")
            ir.set_input(reader, port, made[read, waits])


def _whole_loops(ir, frames, replicated, region) -> set:
    """A legacy while loop runs in one frame: when part of it is per replica (its data), all of
    it is (the trip counter, the reads of weights inside it), or the replicas' loops would share
    nodes of a frame none of them is in. Returns the nodes added."""
    added = set()
    for members in frames:
        if members & replicated:
            added |= {n for n in members - replicated - region
                      if ir.op(n) not in VARIABLE_OPS | PLACEHOLDER_OPS}
    replicated |= added
    return added


def _pull_in_waiting(ir, region, per_example, data_dependent) -> None:
    """What waits on the region outside every step and carries no replica's data (the read a
    resource `assign_add` leaves behind) runs once too, after the region, not once per
    replica."""
    stack = list(region)
    while stack:
        for dst in ir.successors(stack.pop()):
            if (dst in region or dst not in per_example or dst in data_dependent
                    or gradient_scope(dst)):
                continue
            region.add(dst)
            stack.append(dst)


def colocated_with(ir, name) -> list[str]:
    """The nodes a `_class: loc:@x` attr ties ``name`` to."""
    attr = ir.node(name)["attr"]
    if "_class" not in attr:
        return []
    return [v.decode()[5:] for v in attr["_class"].list.s if v.startswith(b"loc:@")]


def _pull_in_helpers(ir, replicated, region, snapshots) -> set:
    """Replicate stateless helpers that only replicated nodes use (constants, shape arithmetic),
    so each replica computes them locally, anything but a variable colocated with a
    replicated node, and per-run state (``PER_RUN_STATE_OPS``) a replicated node uses. Returns
    the nodes added."""
    def movable(n):  # a variable's own snapshot (`w/read`) stays with the variable
        return (n not in replicated and n not in region and n not in snapshots
                and ir.op(n) not in VARIABLE_OPS and ir.op(n) not in PLACEHOLDER_OPS)

    stack = [src for n in replicated for src in ir.predecessors(n)]
    stack += [n for n in ir.nodes() if n not in replicated
              and any(t in replicated for t in colocated_with(ir, n))]
    added = set()
    while stack:
        n = stack.pop()
        if n not in ir or not movable(n):
            continue
        tied = colocated_with(ir, n)
        forced = (any(t in replicated for t in tied)  # a loop's gradient stack, say: per replica
                  or (ir.op(n) in PER_RUN_STATE_OPS
                      and any(c in replicated for c in ir.successors(n))))
        if not forced and (tied or opdefs.is_stateful(ir, ir.op(n))
                           or not all(c in replicated for c in ir.successors(n))
                           or not any(True for _ in ir.successors(n))):
            continue
        replicated.add(n)
        added.add(n)
        stack.extend(ir.predecessors(n))
    return added
