"""`apply --explain`: per variable, the decision the strategy took and why.

Decisions are read from the transformed graph, so they say what was done, not what was
meant: where the variable's copies are (each replica, one ps task, shards), where its gradient
is combined (which all-reduce bucket or gather, which accumulator), and the bytes that moves
per step. The reasons restate the rule that decided: buckets fill in the order gradients are
ready up to --bucket-bytes, a sparse gradient is gathered, variables go largest first to the
lightest ps task (graphxform/passes/place_variables.py), a variable smaller than
--partition-min-bytes (or a single row) stays whole.

Bytes per step: replicated strategies, what each replica contributes to the all-reduce (its
gradient); ps, what the workers push (gradients) and pull (values) together."""

from __future__ import annotations

import dataclasses
import re

from graphxform.inspector.scopes import fold_name
from graphxform.ir import GraphIR
from graphxform.nodes import replica_prefix
from graphxform.training import TrainingGraph

COMBINING_OPS = {"CollectiveReduceV2", "CollectiveGatherV2", "CollectiveReduce",
                 "CollectiveGather", "NcclAllReduce", "AccumulatorTakeGradient",
                 "SparseAccumulatorTakeGradient", "ResourceAccumulatorTakeGradient"}
_TASK = re.compile(r"/job:([^/]+)(?:/replica:\d+)?/task:(\d+)")
_PART = re.compile(r"/part_(\d+)$")
_PART_SCOPE = re.compile(r"/part_\d+/")


@dataclasses.dataclass
class Decision:
    variable: str
    shape: str
    nbytes: int
    decision: str
    combined_at: str
    bytes_per_step: int
    why: str


def explain(original: TrainingGraph, ir: GraphIR, strategy: str, replicas: int,
            summary: dict | None = None, bucket_bytes: int | None = None) -> list[Decision]:
    """One Decision per variable of the input graph (``original``: its analysis), from the
    transformed ``ir``. ``summary``: the passes' summaries merged (kept-whole reasons)."""
    summary = summary or {}
    workers = _workers(ir, replicas)
    combined = {var.name: _combining_points(ir, var) for var in original.trainable}
    buckets = {}  # point -> [(variable, its gradient's bytes)], a shared trunk's once per step
    for name, points in combined.items():
        for point in points:
            if point:
                buckets.setdefault(point, []).append((name, original.variables[name].nbytes))
    ps_tasks = len({_task(ir, n) for n in ir.nodes_of({"VarHandleOp", "VariableV2"})
                    if ir.node(n)["device"].startswith("/job:ps")})
    placement = _placement(original, ir, ps_tasks)
    out = []
    for var in sorted(original.variables.values(), key=lambda v: v.name):
        shards = sorted((n for n in _shards(ir, var.name)), key=_shard_index)
        copies = [replica_prefix(i) + var.name for i in range(replicas)
                  if replica_prefix(i) + var.name in ir]
        shape = "[" + ",".join(str(d) for d in var.shape) + "]"
        points = combined.get(var.name) or [None]
        point = ", ".join(dict.fromkeys(p for p in points if p)) or None
        if copies:
            decision = f"replicated x {len(copies)}"
        elif shards:
            tasks = sorted({_task(ir, s) for s in shards})
            decision = f"partitioned into {len(shards)} on {', '.join(tasks)}"
        elif var.name in ir:
            where = _task(ir, var.name)
            decision = f"shared on {where}" if where != "no device" else "shared (one copy)"
        else:
            decision = "not in the output"
        moved = _bytes_per_step(var, points, copies, shards, workers)
        why = _why(var, points, copies, shards, buckets, original, placement, summary,
                   bucket_bytes, strategy)
        out.append(Decision(var.name, shape, var.nbytes, decision, point or "-", moved, why))
    return out


def _combining_points(ir: GraphIR, var) -> list:
    """Where each gradient an optimizer applies to the variable is combined across replicas,
    in the order of ``var.applications``: one point, or one per optimizer for an
    actor-critic's shared trunk (each gradient reduced in the step that applies it)."""
    if len(var.applications) < 2:
        return [_combining_point(ir, var.name, var.updates)]
    return [_combining_point(ir, var.name, [a.update]) for a in var.applications]


def _combining_point(ir: GraphIR, name: str, updates) -> str | None:
    """Where the gradient one of ``updates`` applies is combined: the folded scope of the
    first combining op on the way back from it (replica 0's copy when replicated)."""
    for update in updates:
        for node in (replica_prefix(0) + update, update):
            if node in ir:
                found = _search_back(ir, node)
                if found:
                    return found
        for shard_update in _shard_updates(ir, name, update):
            found = _search_back(ir, shard_update)
            if found:
                return found
    return None


def _search_back(ir: GraphIR, start: str, limit: int = 2000) -> str | None:
    seen, frontier = {start}, [start]
    while frontier and len(seen) < limit:
        nxt = []
        for node in frontier:
            for src in ir.predecessors(node):  # control inputs too: a slot's scatter
                if src in seen:
                    continue
                seen.add(src)
                if ir.op(src) in COMBINING_OPS:
                    return _scope(ir, src)
                if ir.op(src) not in ("VarHandleOp", "VariableV2"):
                    nxt.append(src)
        frontier = nxt
    return None


def _scope(ir: GraphIR, node: str) -> str:
    """'allreduce/bucket_3/replica_0/reduce' -> 'allreduce/bucket_3';
    'w/accumulator/take' -> 'w/accumulator'."""
    folded = _PART_SCOPE.sub("/part_*/", fold_name(node)[0])
    parts = [p for p in folded.split("/")[:-1] if p != "replica_*"]
    return "/".join(parts) or folded


def _shards(ir: GraphIR, name: str) -> list[str]:
    found, k = [], 0
    while f"{name}/part_{k}" in ir:
        found.append(f"{name}/part_{k}")
        k += 1
    return found


def _shard_index(name: str) -> int:
    match = _PART.search(name)
    return int(match.group(1)) if match else 0


def _shard_updates(ir: GraphIR, name: str, update: str) -> list[str]:
    """A partitioned variable's update copied per shard: '<var>/part_k/<update>'."""
    return [f"{shard}/{update}" for shard in _shards(ir, name) if f"{shard}/{update}" in ir]


def _task(ir: GraphIR, node: str) -> str:
    device = ir.node(node)["device"]
    match = _TASK.search(device)
    return f"{match.group(1)} task {match.group(2)}" if match else (device or "no device")


def _workers(ir: GraphIR, replicas: int) -> int:
    tasks = set()
    for i in range(replicas):
        prefix = replica_prefix(i)
        for name in (prefix + "loss", prefix + "Mean"):
            if name in ir:
                match = _TASK.search(ir.node(name)["device"])
                tasks.add(match.group(0) if match else i)
                break
    return max(len(tasks), 1)


def _bytes_per_step(var, points, copies, shards, workers) -> int:
    if not var.trainable or var.gradient is None or not var.updates:
        return 0
    if copies:  # each gradient reduced: a shared trunk's two, one in each optimizer's step
        return var.nbytes * sum(1 for p in points if p)
    return 2 * workers * var.nbytes  # each worker pushes its gradient and pulls the value


def _placement(original: TrainingGraph, ir: GraphIR, tasks: int) -> dict:
    """What place-variables did, replayed on the units it placed (a variable or a shard, with
    its slots): {unit: (bytes, rank by size, task, that task's load at its turn)}."""
    sizes = {}
    for var in original.variables.values():
        owner = var.slot_of or var.name
        shards = _shards(ir, var.name)
        for k, node in enumerate(shards or ([var.name] if var.name in ir else [])):
            unit = f"{owner}/part_{k}" if shards else owner
            sizes[unit] = sizes.get(unit, 0) + _node_bytes(ir, node)
    load, found = [0] * max(tasks, 1), {}
    for rank, (unit, size) in enumerate(sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0]))):
        task = min(range(len(load)), key=lambda t: (load[t], t))
        found[unit] = (size, rank + 1, task, load[task])
        load[task] += size
    return found


def _node_bytes(ir: GraphIR, node: str) -> int:
    from tensorflow.python.framework import dtypes
    attrs = ir.attrs(node)
    if "shape" not in attrs or "dtype" not in attrs:
        return 0
    count = 1
    for d in attrs["shape"].shape.dim:
        count *= max(d.size, 0)
    return count * dtypes.as_dtype(attrs["dtype"].type).size


def _why(var, points, copies, shards, buckets, original, placement, summary, bucket_bytes,
         strategy) -> str:
    kept = (summary.get("kept_whole") or {}).get(var.name)
    point = next((p for p in points if p), None)
    if var.slot_of:
        return f"a slot of '{var.slot_of}': goes where its variable goes"
    if not var.trainable or var.gradient is None:
        if var.updates:
            what = {"global_step": "the step counter", "optimizer_state":
                    "the optimizer's own state"}.get(var.role, "a statistic (batch norm, "
                                                             "moving average)")
            return (f"not trained, {what}: " + (
                "each replica updates its own copy; replica 0's is saved" if copies
                else "one copy, updated once per step"))
        return "not updated by the step"
    if copies:
        if not point:
            return "replicas never exchange this gradient (each trains alone)"
        if len(points) < 2:
            return _reduced(var.gradient, point, buckets, bucket_bytes)
        each = "; ".join(
            f"{' and '.join(_steps_applying(original, a.update)) or a.update}'s: "
            + _reduced(a.gradient, p, buckets, bucket_bytes)
            for a, p in zip(var.applications, points))
        return (f"{len(points)} gradients, one per optimizer, each reduced in the step that "
                f"applies it: {each}")
    if shards:
        return (f"{var.nbytes} bytes split along axis 0 into {len(shards)} row ranges, each "
                "placed like a variable of its own (largest first onto the lightest ps task)")
    size, rank, task, load = placement.get(var.name, (var.nbytes, 0, 0, 0))
    why = (f"{size} bytes with its slots, #{rank} by size: placed on ps task {task}, the "
           f"lightest at its turn ({load} bytes there); the workers' gradients are averaged "
           f"in {point or 'its accumulator'}")
    if kept:
        why = f"kept whole ({kept}); " + why
    elif strategy == "partitioned-ps":
        why = "kept whole (smaller than --partition-min-bytes, or one row); " + why
    return why


def _reduced(gradient, point, buckets, bucket_bytes) -> str:
    """How one gradient is combined at ``point`` (its bucket's bytes count every gradient
    fused there, a shared trunk's once per step that reduces it there)."""
    if not point:
        return "replicas never exchange this gradient (each trains alone)"
    if gradient.kind == "sparse" and "sparse" in point:
        return "sparse gradient (IndexedSlices): every replica's rows gathered, not densified"
    peers = buckets.get(point, [])
    cap = f" (--bucket-bytes {bucket_bytes})" if bucket_bytes else ""
    return (f"dense gradient, fused with {len(peers) - 1} other(s) into {point}: "
            f"{sum(n for _, n in peers)} bytes{cap}, gradients in the order they are ready")


def _steps_applying(original: TrainingGraph, update: str) -> list[str]:
    return [s.name for s in original.steps if update in s.closure]


def text(decisions: list[Decision]) -> str:
    rows = [["variable", "shape", "bytes", "decision", "combined at", "bytes/step", "why"]]
    for d in decisions:
        rows.append([d.variable, d.shape, str(d.nbytes), d.decision, d.combined_at,
                     str(d.bytes_per_step), d.why])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1]
                     for r in rows)
