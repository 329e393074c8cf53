"""sync-init: replicas > 0 start from replica 0's initial values.

Runs before `replicate` and tells it what replicas > 0 read from replica 0. Each replica's
initializer assigns replica 0's initial-value tensor, which TF computes once per run, so random
initializers give every replica the same start. What only computes initial values (the
initial-value subgraphs) is therefore needed in replica 0 alone: `replicate` copies it for
replica 0 only, rather than copying it for every replica and leaving the copies dead."""

from __future__ import annotations

import dataclasses

from graphxform.errors import GraphxformError
from graphxform.ir import BorrowedNode, parse_tensor
from graphxform.passes.replicate import kept_single
from graphxform.pipeline import Pass, PassResult

# ops of legacy while loops and conds: copies of these belong to their replica's frame
CONTROL_FLOW_OPS = {"Enter", "RefEnter", "Exit", "RefExit", "NextIteration", "RefNextIteration",
                    "Merge", "RefMerge", "Switch", "RefSwitch", "LoopCond", "ControlTrigger"}


@dataclasses.dataclass
class SyncInit(Pass):
    name = "sync-init"

    def run(self, ir, ctx):
        if "replicate" in ctx.state:
            raise GraphxformError("sync-init must run before replicate (it tells replicate "
                                  "what replicas > 0 take from replica 0)")
        tg = ctx.training
        shared = kept_single(ir, ctx)
        synced = [var for var in tg.variables.values()
                  if var.name not in shared and var.initializer and var.initial_value
                  and var.initializer in ir]
        if len(ctx.devices) < 2 or not synced:
            return PassResult(modified=False)
        reads = {var.initializer: ir.input(var.initializer, 1) for var in synced}
        first_only = _initial_value_subgraphs(ir, reads, shared)
        # replicate makes replicas > 0 read replica 0's copies of first_only; an initializer
        # that reads anything else, or not its VariableDef's initial value, is pointed there
        redirect = [(var.initializer, var.initial_value) for var in synced
                    if reads[var.initializer][0] not in first_only
                    or parse_tensor(var.initial_value) != reads[var.initializer]]
        ctx.state[self.name] = {
            "first_only": first_only, "redirect": redirect,
            "initial_values": {parse_tensor(var.initial_value)[0] for var in synced}}
        others = len(ctx.devices) - 1
        return PassResult(modified=False, summary={"synced": len(synced) * others,
                                                   "not_copied": len(first_only) * others})


def _initial_value_subgraphs(ir, reads: dict, shared: set) -> set:
    """The nodes that only compute what initializers read at input 1 (``reads``): every
    consumer is one of them or reads them only through such an input. Shared nodes, legacy
    control flow and what other nodes colocate with stay out (their copies are each
    replica's own)."""
    allowed = {(init, src) for init, (src, _) in reads.items()}
    node_table, succ, pred = ir.g._node, ir.g._succ, ir.g._pred
    colocations = _colocations(ir)
    excluded = set(shared)
    while True:
        found, stack = set(), [src for src, _ in reads.values()]
        while stack:
            name = stack.pop()
            if (name in found or name in excluded
                    or node_table[name]["op"] in CONTROL_FLOW_OPS):
                continue
            if all(dst in found or ((dst, name) in allowed and set(keys) == {1})
                   for dst, keys in succ[name].items()):
                found.add(name)
                stack.extend(pred[name])
        colocated = _colocated_with(found, colocations)
        if not colocated:
            return found
        excluded |= colocated


def _colocations(ir) -> list[tuple[str, object]]:
    """(node, its ``_class`` items) for every node that has them, read once for every round
    of ``_initial_value_subgraphs`` (a node's attr map is its data's ``attr``, or
    ``ir.attrs`` for a copy that borrows its original's)."""
    found, attrs_of = [], ir.attrs
    for name, data in ir.node_items():
        attrs = attrs_of(name) if type(data) is BorrowedNode else data["attr"]
        if "_class" in attrs:
            found.append((name, attrs["_class"].list.s))
    return found


def _colocated_with(nodes: set, colocations: list) -> set:
    """The nodes of ``nodes`` that a node outside them colocates with (``loc:@name``), found
    by comparing each node's items with the items naming ``nodes`` as bytes."""
    items = {b"loc:@" + name.encode(): name for name in nodes}
    targets = set()
    for name, listed in colocations:
        if name not in nodes and not items.keys().isdisjoint(listed):
            targets.update(items[item] for item in listed if item in items)
    return targets
