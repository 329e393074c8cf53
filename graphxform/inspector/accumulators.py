"""Parameter-server steps: every accumulator's ``take_grad`` waits for exactly as many
gradients as workers apply to it per step, and every worker's step ends with its token.

A take that waits for more gradients than arrive hangs the chief's step; one that waits for
fewer updates before every worker has reported, so the step averages whichever arrived first.
A worker whose step takes no token can run ahead of the update; one whose step does not apply
its own gradient leaves the chief's take waiting. A task's step that runs another task's
replica runs that work twice (an error when it holds collectives). hybrid's barrier: a
dequeue of N tokens in the chief's step needs the tasks' steps to enqueue N per step, else the
chief hangs or updates early. What each task runs is the plan the graph carries (collection
``graphxform_cluster``), read here as plain JSON."""

from __future__ import annotations

import collections
import json
import re

from graphxform.inspector.findings import CheckResult
from graphxform.inspector.shapes import const_value
from graphxform.ir import GraphIR

ACCUMULATOR_OPS = {"ConditionalAccumulator", "SparseConditionalAccumulator",
                   "ResourceConditionalAccumulator"}
APPLY_OPS = {"AccumulatorApplyGradient", "SparseAccumulatorApplyGradient",
             "ResourceAccumulatorApplyGradient"}
TAKE_OPS = {"AccumulatorTakeGradient", "SparseAccumulatorTakeGradient",
            "ResourceAccumulatorTakeGradient"}
DEQUEUE_OPS = {"QueueDequeueV2", "QueueDequeue", "QueueDequeueManyV2", "QueueDequeueUpToV2"}
ENQUEUE_OPS = {"QueueEnqueueV2", "QueueEnqueueManyV2", "QueueEnqueue", "QueueEnqueueMany"}
PLAN_COLLECTION = "graphxform_cluster"
PS_STRATEGIES = {"ps", "partitioned-ps", "hybrid", "model-average"}  # workers sync by tokens
_TASK = re.compile(r"/job:([^/]+)(?:/replica:\d+)?/task:(\d+)")
_APPLY_NAME = re.compile(r"apply_([A-Za-z]+)_(\d+)$")
_REPLICA = re.compile(r"^replica_\d+/")


def plan_of(ir: GraphIR) -> dict | None:
    """The cluster plan the graph carries, as its JSON object (None: not a cluster graph)."""
    if PLAN_COLLECTION not in ir.meta.collection_def:
        return None
    values = ir.meta.collection_def[PLAN_COLLECTION].bytes_list.value
    try:
        plan = json.loads(values[0]) if len(values) == 1 else None
    except (ValueError, UnicodeDecodeError):
        plan = None
    return plan if isinstance(plan, dict) else {}


def worker_of(ir: GraphIR, apply: str) -> str:
    """The task whose gradient an apply carries: its gradient input's device, else its name."""
    gradient_port = 3 if ir.op(apply).startswith("Sparse") else 2
    inputs = ir.inputs(apply)
    if gradient_port < len(inputs):
        match = _TASK.search(ir.node(inputs[gradient_port][0])["device"])
        if match:
            return f"{match.group(1)}:{match.group(2)}"
    match = _APPLY_NAME.search(apply)
    return f"{match.group(1)}:{match.group(2)}" if match else apply


def check(ir: GraphIR) -> CheckResult:
    result = CheckResult("accumulators")
    plan = plan_of(ir)
    accumulators = ir.nodes_of(ACCUMULATOR_OPS)
    parameter_servers = plan is not None and plan.get("strategy", "ps") in PS_STRATEGIES
    if not accumulators and not parameter_servers:
        result.ran = False
        result.summary = "none (not a parameter-server graph)"
        return result
    expected = collections.Counter()
    for acc in accumulators:
        _check_accumulator(ir, result, acc, expected)
    steps = _check_steps(ir, result, plan, accumulators) if parameter_servers else 0
    counts = ", ".join(f"{n} expecting {k}" for k, n in sorted(expected.items()))
    result.summary = (f"{len(accumulators)} accumulators ({counts or 'none'}); "
                      f"{steps} task step(s) checked")
    if plan and plan.get("async"):
        result.summary += "; --async: no accumulators, no tokens"
    return result


def _check_accumulator(ir, result, acc, expected) -> None:
    users = [dst for dst, _ in ir.consumers(acc)]
    applies = [u for u in users if ir.op(u) in APPLY_OPS]
    takes = [u for u in users if ir.op(u) in TAKE_OPS]
    by_worker = collections.defaultdict(list)
    for apply in applies:
        by_worker[worker_of(ir, apply)].append(apply)
    for worker, same in sorted(by_worker.items()):
        if len(same) > 1:
            result.error(f"accumulator '{acc}': {worker} applies {len(same)} gradients per step "
                         "(one per worker expected): its gradient would count twice",
                         [acc] + same)
    if not takes:
        result.error(f"accumulator '{acc}': nothing takes its gradient", [acc] + applies)
    for take in takes:
        source = ir.inputs(take)[1][0] if len(ir.inputs(take)) > 1 else None
        required = const_value(ir, source) if source else None
        if required is None:
            result.warning(f"accumulator '{acc}': '{take}' waits for a number of gradients "
                           "that is not a constant, so it cannot be checked", [take])
            continue
        required = int(required)
        expected[required] += 1
        feeding = len(by_worker)
        if required != feeding:
            what = ("the chief's step would wait forever" if required > feeding else
                    "the update would run before every worker has reported")
            result.error(f"accumulator '{acc}': '{take}' waits for {required} gradients "
                         f"('{source}'), but {feeding} worker(s) apply to it "
                         f"({', '.join(sorted(by_worker)) or 'none'}): {what}",
                         [acc, take, source] + applies)


def _check_steps(ir, result, plan, accumulators) -> int:
    """Each worker's step runs its own applies and replicas only, and ends with a token from the
    queue the chief's step releases one token per waiting worker into; the chief's barriers
    get what they wait for."""
    steps = plan.get("steps") or {}
    chief = plan.get("chief")
    if plan.get("async") or not steps or plan.get("one_client_only"):
        return 0
    applies_of = collections.defaultdict(dict)  # worker -> accumulator -> applies
    for acc in accumulators:
        for dst, _ in ir.consumers(acc):
            if ir.op(dst) in APPLY_OPS:
                applies_of[worker_of(ir, dst)].setdefault(acc, []).append(dst)
    absent = sorted(t for t, step in steps.items() if step not in ir)
    for task in absent:
        result.error(f"{task}'s step '{steps[task]}' (in the graph's plan) is not in the graph")
    upstreams = {t: ir.ancestors(step) for t, step in steps.items() if t not in absent}
    released = _released(ir, upstreams[chief]) if chief in upstreams else {}
    takers = 0
    for task, upstream in sorted(upstreams.items()):
        step = steps[task]
        job = task.split(":")[0]
        if job != "chief":
            missing = [acc for acc in accumulators
                       if not set(applies_of[task].get(acc, ())) & upstream]
            if missing:
                result.error(f"{task}'s step '{step}' never applies its gradient to "
                             f"{len(missing)} accumulator(s): their takes would wait forever",
                             [step] + missing[:5])
        if task == chief:
            continue
        takers += 1
        tokens = [n for n in upstream if _is_token_read(ir, n)]
        if not tokens:
            result.error(f"{task}'s step '{step}' takes no token: it can start its next step "
                         "before the update of this one", [step])
        elif released and not any(ir.inputs(t)[0][0] in released for t in tokens):
            result.error(f"{task}'s step '{step}' takes its token from a queue the chief's step "
                         "never fills", [step] + tokens)
    count = sum(released.values()) if released else 0
    if released and count != takers:
        result.error(f"the chief's step releases {count} token(s) per step, but {takers} "
                     "worker(s) wait for one", [steps[chief]])
    _check_own_replicas(ir, result, steps, upstreams)
    _check_barriers(ir, result, chief, upstreams)
    return len(steps)


def _check_own_replicas(ir, result, steps, upstreams) -> None:
    """A task's step runs no replica placed on another task: an error when that replica runs
    collectives (they would meet members twice), else a warning (its work runs twice)."""
    home = {}  # replica prefix -> the worker task its nodes run on (ps-placed reads aside)
    for name in ir.nodes():
        prefix = _REPLICA.match(name)
        if prefix and prefix.group(0) not in home:
            found = _task_of(ir.node(name)["device"])
            if found and not found.startswith("ps:"):
                home[prefix.group(0)] = found
    for task, upstream in sorted(upstreams.items()):
        collectives = sorted(n for n in upstream if ir.op(n).startswith("Collective")
                             and _task_of(ir.node(n)["device"]) not in (None, task))
        if collectives:
            result.error(f"{task}'s step '{steps[task]}' runs '{collectives[0]}', a collective "
                         f"of {_task_of(ir.node(collectives[0])['device'])}'s replica: that "
                         "task runs it too, so the group would meet twice",
                         [steps[task], collectives[0]])
            continue
        other = sorted(n for n in upstream if _REPLICA.match(n)
                       and home.get(_REPLICA.match(n).group(0), task) != task)
        if other:
            owner = home[_REPLICA.match(other[0]).group(0)]
            result.warning(f"{task}'s step '{steps[task]}' also runs {len(other)} node(s) of "
                           f"{owner}'s replicas ('{other[0]}'): that work runs twice per step",
                           [steps[task], other[0]])


def _task_of(device: str) -> str | None:
    match = _TASK.search(device or "")
    return f"{match.group(1)}:{match.group(2)}" if match else None


def _check_barriers(ir, result, chief, upstreams) -> None:
    """Every dequeue of N tokens in the chief's step is fed N per step by the tasks' steps."""
    for node in upstreams.get(chief, ()):
        if ir.op(node) != "QueueDequeueManyV2" or not _is_token_read(ir, node):
            continue
        queue, wanted = ir.inputs(node)[0][0], const_value(ir, ir.inputs(node)[1][0])
        fed = sum(_enqueued(ir, upstream).get(queue, 0) for upstream in upstreams.values())
        if wanted is not None and int(wanted) != fed:
            what = "would wait forever" if int(wanted) > fed else "would not wait for every task"
            result.error(f"'{node}' in the chief's step takes {int(wanted)} token(s) from "
                         f"'{queue}' per step, but the tasks' steps put {fed}: it {what}",
                         [node, queue])


def _released(ir, upstream) -> dict:
    """queue -> tokens the chief's step (``upstream``: what it runs) puts into it per step for
    the others (a queue it also dequeues from is a barrier it waits on, not tokens it
    releases)."""
    found = _enqueued(ir, upstream)
    for node in upstream:
        if _is_token_read(ir, node):
            found.pop(ir.inputs(node)[0][0], None)
    return found


def _enqueued(ir, upstream) -> collections.Counter:
    """queue -> tokens a step (``upstream``: what it runs) puts into it per step (known
    constants only)."""
    found = collections.Counter()
    for node in upstream:
        if ir.op(node) not in ENQUEUE_OPS or not _is_token_queue(ir, ir.inputs(node)[0][0]):
            continue
        queue = ir.inputs(node)[0][0]
        tokens = ir.inputs(node)[1][0] if len(ir.inputs(node)) > 1 else None
        many = ir.op(node).startswith("QueueEnqueueMany")
        found[queue] += _rows(ir, tokens) if many and tokens else 1
    return found


def _is_token_queue(ir, queue) -> bool:
    """Whether ``queue`` holds tokens: graphxform's passes made it (ps' and model-average's
    token queues, hybrid's barrier). The graph's own queues are its input pipeline
    (``tf.compat.v1.train.batch``, ``shuffle_batch``: filled by queue runners, not by steps)."""
    return bool(ir.node(queue)["created_by"])


def _is_token_read(ir, node) -> bool:
    return ir.op(node) in DEQUEUE_OPS and _is_token_queue(ir, ir.inputs(node)[0][0])


def _rows(ir, tokens) -> int:
    """How many tokens an EnqueueMany of ``tokens`` puts: a Fill's count or a constant's rows
    (0 when unknown)."""
    if ir.op(tokens) == "Fill":
        value = const_value(ir, ir.inputs(tokens)[0][0])
        return int(value.reshape(-1)[0]) if value is not None else 0
    value = const_value(ir, tokens)
    return int(value.shape[0]) if value is not None and value.ndim else 0
