"""share-variables: one copy of each variable, its slots and its optimizer update, on the ps task
place-variables chose; every replica reads it.

Runs before `replicate` and tells it what to leave single. Replicated is the per-example work:
every node that depends on a batched input, except the optimizer's update region (its scope and
the train op), which runs once per step. Everything else stays shared under its original name:
variables and their initializers, reads, hyper-parameters, global_step. The update ops still read
gradients that every replica computes; `replicate` records those edges and `insert-accumulators`
turns each into an aggregation point."""

from __future__ import annotations

import dataclasses

import networkx as nx

from graphxform.errors import GraphxformError
from graphxform.passes.replicate import shared_nodes
from graphxform.pipeline import Pass, PassResult
from graphxform import opdefs
from graphxform.training import PLACEHOLDER_OPS, VARIABLE_OPS


@dataclasses.dataclass
class ShareVariables(Pass):
    name = "share-variables"

    def run(self, ir, ctx):
        tg = ctx.training
        train_op = tg.require_train_op(self.name)
        if tg.optimizer is None or not tg.trainable:
            raise GraphxformError("no optimizer update found: nothing to share on ps tasks")
        placement = ctx.state.get("place-variables", {}).get("devices", {})
        batched = [i.name for i in tg.inputs if i.batched]
        per_example = set()
        for name in batched:
            per_example |= nx.descendants(ir.g, name)
        shard_updates = ctx.state.get("partition-variables", {}).get("update_nodes", set())
        region = {n for n in per_example
                  if n.startswith(tg.optimizer.scope) or n in shard_updates} | {train_op}
        single = shared_nodes(ir, tg) | region
        snapshots = {r for v in tg.variables.values() for r in v.reads}
        replicated = {n for n in per_example - single if ir.op(n) not in PLACEHOLDER_OPS}
        added = _pull_in_helpers(ir, replicated, region, snapshots)
        while added:  # what consumes a pulled-in node is per-replica work too
            grown = {d for n in added for d in nx.descendants(ir.g, n)} - single - replicated
            grown = {n for n in grown if ir.op(n) not in PLACEHOLDER_OPS | VARIABLE_OPS}
            replicated |= grown
            added = _pull_in_helpers(ir, replicated, region, snapshots) | grown if grown else set()
        if not replicated:
            raise GraphxformError("nothing in the training step depends on a batched input; "
                                  "there is no per-replica work to distribute")
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
        ctx.state[self.name] = {"shared": shared, "optimizer_region": region}
        return PassResult(modified=placed > 0, summary={
            "shared_nodes": len(shared), "optimizer_region": len(region)})


def colocated_with(ir, name) -> list[str]:
    """The nodes a `_class: loc:@x` attr ties ``name`` to."""
    attr = ir.node(name)["attr"]
    if "_class" not in attr:
        return []
    return [v.decode()[5:] for v in attr["_class"].list.s if v.startswith(b"loc:@")]


def _pull_in_helpers(ir, replicated, region, snapshots) -> set:
    """Replicate stateless helpers that only replicated nodes use (constants, shape arithmetic),
    so each replica computes them locally, and anything colocated with a replicated node.
    Returns the nodes added."""
    def movable(n):  # a variable's own snapshot (`w/read`) stays with the variable
        return (n not in replicated and n not in region and n not in snapshots
                and ir.op(n) not in VARIABLE_OPS and ir.op(n) not in PLACEHOLDER_OPS
                and not opdefs.is_stateful(ir, ir.op(n)))

    stack = [src for n in replicated for src in ir.predecessors(n)]
    stack += [n for n in ir.nodes() if n not in replicated
              and any(t in replicated for t in colocated_with(ir, n))]
    added = set()
    while stack:
        n = stack.pop()
        if n not in ir or not movable(n):
            continue
        tied = colocated_with(ir, n)
        forced = any(t in replicated for t in tied)
        if not forced and (tied or not all(c in replicated for c in ir.successors(n))
                           or not any(True for _ in ir.successors(n))):
            continue
        replicated.add(n)
        added.add(n)
        stack.extend(ir.predecessors(n))
    return added
