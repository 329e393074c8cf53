"""Collectives: every replica and task issues the same collectives, in the same order, with
the same group key, group size, instance key, dtype and shape. Otherwise the graph hangs on its
first step (a collective waits for peers that never come) or mixes up tensors.

A collective's *participant* is its device (or, unplaced, its replica scope). TensorFlow
matches the members of one collective by (group key, instance key), so that is how they are
matched here; their order on a participant is the order the graph forces (one collective an
ancestor of another), found for all collectives in one sweep over their ancestors. Two
participants that force two instances in opposite orders deadlock: each waits inside the
collective the other has not launched yet."""

from __future__ import annotations

import collections
import dataclasses
import re

from graphxform.inspector import shapes
from graphxform.inspector.findings import CheckResult
from graphxform.inspector.scopes import fold_name
from graphxform.ir import GraphIR

V2_OPS = {"CollectiveReduceV2", "CollectiveGatherV2", "CollectiveBcastSendV2",
          "CollectiveBcastRecvV2", "CollectiveReduceV3", "CollectiveAllToAllV2",
          "CollectiveAllToAllV3"}
V1_OPS = {"CollectiveReduce", "CollectiveGather", "CollectiveBcastSend", "CollectiveBcastRecv"}
COLLECTIVE_OPS = V2_OPS | V1_OPS
# inputs of the V2 ops after the tensor (BcastRecvV2 has no tensor input)
_V2_KEYS = {"CollectiveBcastRecvV2": (0, 1, 2)}
_REPLICA = re.compile(r"(?<![^/])replica_(\d+)(?=/)")


@dataclasses.dataclass
class Collective:
    node: str
    op: str
    participant: str
    group_key: str
    group_size: str
    instance_key: str
    dtype: int | None
    shape: list | None
    reduction: str  # merge_op/final_op of a reduce, '' otherwise

    def signature(self) -> tuple:
        return (self.op, self.group_size, self.dtype, self.reduction)


def find(ir: GraphIR) -> list[Collective]:
    found = []
    shape_of = shapes.Shapes(ir)
    for node in ir.nodes_of(COLLECTIVE_OPS):
        op, attrs = ir.op(node), ir.attrs(node)
        if op in V2_OPS:
            size_port, key_port, instance_port = _V2_KEYS.get(op, (1, 2, 3))
            inputs = ir.inputs(node)
            key = lambda p: shape_of.describe(*inputs[p]) if p < len(inputs) else "?"
            group_size, group_key, instance_key = key(size_port), key(key_port), key(
                instance_port)
            shape = shape_of.of(*inputs[0]) if op != "CollectiveBcastRecvV2" else None
        else:
            group_size, group_key, instance_key = (str(attrs[a].i) if a in attrs else "?" for a
                                                   in ("group_size", "group_key",
                                                       "instance_key"))
            shape = [d.size for d in attrs["shape"].shape.dim] if "shape" in attrs else None
        reduction = "/".join(attrs[a].s.decode() for a in ("merge_op", "final_op") if a in attrs)
        found.append(Collective(node, op, participant(ir, node), group_key, group_size,
                                instance_key, attrs["T"].type if "T" in attrs else None,
                                shape, reduction))
    return found


def participant(ir: GraphIR, node: str) -> str:
    device = ir.node(node)["device"]
    if device:
        return device
    match = _REPLICA.search(node)
    return f"replica {match.group(1)}" if match else "(unplaced)"


def check(ir: GraphIR) -> CheckResult:
    result = CheckResult("collectives")
    found = find(ir)
    if not found:
        result.ran = False
        result.summary = "none (nothing to match)"
        return result
    by_group = collections.defaultdict(list)
    for c in found:
        by_group[c.group_key].append(c)
    before = _order(ir, found)
    for group_key, members in sorted(by_group.items()):
        _check_group(result, group_key, members, before)
    _check_names(result, found)
    participants = {c.participant for c in found}
    per = collections.Counter(c.participant for c in found)
    result.summary = (f"{len(found)} collectives on {len(participants)} participants "
                      f"({min(per.values())}-{max(per.values())} each) in "
                      f"{len(by_group)} group(s)")
    if not result.findings:
        result.summary += ": same keys, dtypes, shapes and order everywhere"
    return result


def _check_group(result: CheckResult, group_key: str, members: list, before) -> None:
    participants = sorted({c.participant for c in members})
    sizes = {c.group_size for c in members}
    for size in sizes:
        if size.isdigit() and int(size) != len(participants):
            nodes = [c.node for c in members if c.group_size == size]
            result.error(f"group {group_key}: group_size {size}, but {len(participants)} "
                         f"participant(s) issue collectives in it ({', '.join(participants)}): "
                         "the collective waits for members that never come", nodes[:8])
    by_instance = collections.defaultdict(list)
    for c in members:
        by_instance[c.instance_key].append(c)
    for instance, issued in sorted(by_instance.items()):
        have = collections.Counter(c.participant for c in issued)
        missing = [p for p in participants if p not in have]
        if missing:
            result.error(f"group {group_key}, instance {instance}: issued by "
                         f"{len(have)} of {len(participants)} participants, not by "
                         f"{', '.join(missing)}: the others wait for it forever",
                         [c.node for c in issued])
        twice = [p for p, n in have.items() if n > 1]
        if twice:
            result.error(f"group {group_key}, instance {instance}: issued more than once by "
                         f"{', '.join(twice)} (instance keys must be unique per participant)",
                         [c.node for c in issued if c.participant in twice])
        for field, label in (("signature", "op, group size, dtype or reduction"),
                             ("shape", "shape")):
            values = {}
            for c in issued:
                value = c.signature() if field == "signature" else c.shape
                if value is not None and (field != "shape" or all(d >= 0 for d in value)):
                    values.setdefault(str(value), []).append(c)
            if len(values) > 1:
                said = "; ".join(f"{v} on {', '.join(sorted(x.participant for x in cs))}"
                                 for v, cs in sorted(values.items()))
                result.error(f"group {group_key}, instance {instance}: the participants "
                             f"disagree on {label}: {said}", [c.node for c in issued])
    _check_order(result, group_key, members, before)


def _check_order(result: CheckResult, group_key: str, members: list, before) -> None:
    """Two instances forced in opposite orders on two participants: deadlock."""
    by_participant = collections.defaultdict(dict)
    for c in members:
        by_participant[c.participant].setdefault(c.instance_key, c)
    order = {}  # (instance a, instance b) -> (participant, a's node, b's node) with a before b
    reported = set()
    for p, mine in sorted(by_participant.items()):
        keys = sorted(mine)
        for i, a in enumerate(keys):
            for b in keys[i + 1:]:
                if before(mine[a].node, mine[b].node):
                    pair, first = (a, b), (mine[a], mine[b])
                elif before(mine[b].node, mine[a].node):
                    pair, first = (b, a), (mine[b], mine[a])
                else:
                    continue
                flipped = (pair[1], pair[0])
                if flipped in order and frozenset(pair) not in reported:
                    reported.add(frozenset(pair))
                    other, x, y = order[flipped]
                    result.error(
                        f"group {group_key}: {p} runs instance {pair[0]} before {pair[1]}, "
                        f"but {other} runs {pair[1]} before {pair[0]}: each waits in the "
                        "collective the other has not launched (deadlock)",
                        [first[0].node, first[1].node, x, y])
                order.setdefault(pair, (p, first[0].node, first[1].node))


def _check_names(result: CheckResult, found: list) -> None:
    """The copies of one collective (names equal once replicas fold) carry the same keys."""
    by_name = collections.defaultdict(list)
    for c in found:
        folded, replica = fold_name(c.node)
        if replica is not None:
            by_name[folded].append(c)
    for folded, copies in sorted(by_name.items()):
        for field in ("instance_key", "group_key"):
            values = collections.defaultdict(list)
            for c in copies:
                values[getattr(c, field)].append(c.node)
            if len(values) > 1:
                said = "; ".join(f"{v} on {', '.join(sorted(nodes))}"
                                 for v, nodes in sorted(values.items()))
                result.error(f"{folded}: its copies have different {field.replace('_', ' ')}s "
                             f"({said})", [c.node for c in copies])


def _order(ir: GraphIR, found: list):
    """A function ``before(a, b)``: collective a is an ancestor of collective b. Every node
    on a path from one collective to another is downstream of the first, so the walk keeps to
    the collectives and what runs after them (the optimizer's updates, not the forward and
    backward passes): one sweep over their ancestors there, each node's set of collective
    ancestors a bitset (an edge into a node still being visited closes a loop and is
    skipped)."""
    per = collections.Counter(c.participant for c in found)
    if max(per.values()) < 2:  # nothing to order: one collective per participant
        return lambda a, b: False
    bit = {c.node: 1 << k for k, c in enumerate(found)}
    pred = ir.g._pred
    below = ir.descendants(bit)
    above: dict[str, int] = {}
    for c in found:
        if c.node in above:
            continue
        stack = [(c.node, iter(pred[c.node]))]
        visiting = {c.node}
        while stack:
            node, pending = stack[-1]
            for src in pending:
                if src in below and src not in above and src not in visiting:
                    visiting.add(src)
                    stack.append((src, iter(pred[src])))
                    break
            else:
                stack.pop()
                visiting.discard(node)
                mask = 0
                for src in pred[node]:
                    mask |= above.get(src, 0) | bit.get(src, 0)
                above[node] = mask
    return lambda a, b: bool(above.get(b, 0) & bit[a])
