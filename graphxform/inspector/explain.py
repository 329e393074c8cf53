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
    combined = {var.name: _combining_point(ir, var, replicas) for var in original.trainable}
    buckets = {}
    for name, point in combined.items():
        if point:
            buckets.setdefault(point, []).append(name)
    ps_tasks = len({_task(ir, n) for n in ir.nodes_of({"VarHandleOp", "VariableV2"})
                    if ir.node(n)["device"].startswith("/job:ps")})
    placement = _placement(original, ir, ps_tasks)
    out = []
    for var in sorted(original.variables.values(), key=lambda v: v.name):
        shards = sorted((n for n in _shards(ir, var.name)), key=_shard_index)
        copies = [replica_prefix(i) + var.name for i in range(replicas)
                  if replica_prefix(i) + var.name in ir]
        shape = "[" + ",".join(str(d) for d in var.shape) + "]"
        point = combined.get(var.name)
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
        moved = _bytes_per_step(var, point, copies, shards, workers)
        why = _why(var, point, copies, shards, buckets, original, placement, summary,
                   bucket_bytes, strategy)
        out.append(Decision(var.name, shape, var.nbytes, decision, point or "-", moved, why))
    return out


def _combining_point(ir: GraphIR, var, replicas: int) -> str | None:
    """Where the variable's gradient is combined across replicas: the folded scope of the
    first combining op on the way back from its update (replica 0's copy when replicated)."""
    for update in var.updates:
        for name in (replica_prefix(0) + update, update):
            if name in ir:
                found = _search_back(ir, name)
                if found:
                    return found
        for shard_update in _shard_updates(ir, var.name, update):
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


def _bytes_per_step(var, point, copies, shards, workers) -> int:
    if not var.trainable or var.gradient is None or not var.updates:
        return 0
    if copies:
        return var.nbytes if point else 0
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


def _why(var, point, copies, shards, buckets, original, placement, summary, bucket_bytes,
         strategy) -> str:
    kept = (summary.get("kept_whole") or {}).get(var.name)
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
        if var.gradient.kind == "sparse" and "sparse" in point:
            return ("sparse gradient (IndexedSlices): every replica's rows gathered, "
                    "not densified")
        peers = buckets.get(point, [])
        cap = f" (--bucket-bytes {bucket_bytes})" if bucket_bytes else ""
        total = sum(original.variables[p].nbytes for p in peers)
        return (f"dense gradient, fused with {len(peers) - 1} other(s) into {point}: "
                f"{total} bytes{cap}, gradients in the order they are ready")
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


def text(decisions: list[Decision]) -> str:
    rows = [["variable", "shape", "bytes", "decision", "combined at", "bytes/step", "why"]]
    for d in decisions:
        rows.append([d.variable, d.shape, str(d.nbytes), d.decision, d.combined_at,
                     str(d.bytes_per_step), d.why])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1]
                     for r in rows)
