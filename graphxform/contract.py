"""The contract check: before `apply` writes a graph, prove from the graph that it trains like
the single-device one, or refuse naming the variable.

What is proven, on the transformed graph (DESIGN.md, the drop-in contract, item 8):
- every variable a step updates (trainable or not: global_step too) is written by as many ops
  per step as in the input (never twice: two replicas' updates landing on one shared copy);
- every one of those writes reads only values that are equal on every replica: computed from
  constants, variables, shared inputs and cross-replica results (collective all-reduce and
  all-gather, accumulator take_grad), never from a replica's own slice of the batch. A write
  that reads a replica-local value means the gradient was not reduced (or not found);
- every replica's copy of a variable starts equal: its initializer reads replica 0's initial
  value, or an initial value made of constants alone.

"Replica-local" is computed by one forward sweep from what differs between replicas: the slices
of the batch, unseeded random ops and input queues, through data edges, stopping at
cross-replica ops. A variable written from a local value is local too, and so are its reads;
the sweep repeats until nothing changes (batch-norm statistics, say, feed the next step).
"""

from __future__ import annotations

from graphxform.errors import GraphxformError
from graphxform.ir import GraphIR, parse_tensor
from graphxform.nodes import replica_prefix
from graphxform.training import (VARIABLE_OPS, TrainingGraph, consumers_through_switches,
                                 is_mutating_op)

CROSS_REPLICA_OPS = {"CollectiveReduceV2", "CollectiveReduce", "CollectiveGatherV2",
                     "CollectiveGather", "CollectiveBcastRecv", "CollectiveBcastRecvV2",
                     "NcclAllReduce", "AccumulatorTakeGradient",
                     "ResourceAccumulatorTakeGradient", "SparseAccumulatorTakeGradient"}
LOCAL_SOURCE_OPS = {"QueueDequeueV2", "QueueDequeueManyV2", "QueueDequeueUpToV2",
                    "IteratorGetNext"}
RANDOM_PREFIXES = ("Random", "TruncatedNormal", "Multinomial", "ParameterizedTruncatedNormal")
SPLIT_SCOPE = "split_inputs/"


class ContractError(GraphxformError):
    """The transformed graph would not train like the single-device one."""


def check(ir: GraphIR, tg: TrainingGraph, replicas: int, asynchronous: bool = False) -> dict:
    """Raise ContractError naming the first variable that breaks the contract; return a
    summary (variable copies proven). ``asynchronous`` (ps --async, documented as not
    drop-in): only the start is checked."""
    if not tg.steps or replicas < 1:
        return {"variables": 0}
    closure = _step_closure(ir, tg)
    local = replica_local(ir)
    checked = 0
    for var in sorted(tg.variables.values(), key=lambda v: v.name):
        if not var.updates:
            continue
        copies = _copies(ir, var.name, replicas)
        if not copies:
            continue  # partitioned: its shards are checked as the variables they are
        for copy in copies:
            if asynchronous:  # every worker applies its own gradient: documented, not drop-in
                continue
            writes = _writes(ir, copy, closure)
            if len(writes) > len(var.updates):
                raise ContractError(
                    f"variable '{var.name}': its copy '{copy}' is written {len(writes)} times "
                    f"per step ({', '.join(sorted(writes)[:3])}), the input graph writes it "
                    f"{len(var.updates)} time(s)")
            if not var.trainable:  # statistics may differ per replica: verify names them
                continue
            for write in writes:
                culprit = _local_input(ir, write, local)
                if culprit:
                    reason = ("its gradient was not found where tf.gradients produced it, so it "
                              "was not reduced" if var.gradient is None else
                              "it reads a value that differs between replicas")
                    raise ContractError(
                        f"variable '{var.name}': '{write}' updates it from '{culprit}', which "
                        f"each replica computes from its own slice of the batch ({reason}); "
                        "the replicas would train apart")
            checked += 1
    if not asynchronous:
        _check_shared_writes(ir, tg, closure, local)
    _check_start(ir, tg, replicas)
    return {"variables": checked}


def _check_shared_writes(ir: GraphIR, tg: TrainingGraph, closure: set, local: set) -> None:
    """A write that runs once per step, outside every replica (global_step's increment, a
    shared variable's update), must not read one replica's local value."""
    for name in sorted(closure):
        if name.startswith("replica_") or not is_mutating_op(ir.op(name)):
            continue
        culprit = _local_input(ir, name, local)
        if culprit:
            written = ", ".join(_written_variables(ir, name)) or name
            raise ContractError(
                f"variable '{written}': '{name}' runs once per step but reads '{culprit}', "
                "which replica 0 computes from its own slice of the batch; the other replicas' "
                "slices would be ignored")


def _step_closure(ir: GraphIR, tg: TrainingGraph) -> set:
    closure = set()
    for step in tg.steps:
        node = parse_tensor(step.name)[0]
        if node in ir:
            closure |= ir.ancestors(node)
    return closure


def _copies(ir: GraphIR, name: str, replicas: int) -> list[str]:
    """Each replica's copy of a variable, or its one shared copy (the original name also
    exists for a replicated variable: merge-fetches serves it from replica 0)."""
    copies = [replica_prefix(i) + name for i in range(replicas)
              if replica_prefix(i) + name in ir]
    return copies or ([name] if name in ir and ir.op(name) in VARIABLE_OPS else [])


def _writes(ir: GraphIR, variable: str, closure: set) -> set:
    """Ops of the step that write ``variable`` (through an input that is the variable)."""
    return {dst for dst, _ in consumers_through_switches(ir, ir.consumers(variable))
            if dst in closure and is_mutating_op(ir.op(dst))}


def _local_input(ir: GraphIR, write: str, local: set) -> str | None:
    for src, port in ir.inputs(write):
        if ir.op(src) not in VARIABLE_OPS and src in local:
            return f"{src}:{port}"
    return None


def replica_local(ir: GraphIR) -> set:
    """Nodes whose outputs may differ between replicas (see the module docstring)."""
    seeds = [n for n in ir.nodes() if (n.startswith(SPLIT_SCOPE) and ir.op(n) in ("Split",
                                                                                   "SplitV"))
             or ir.op(n) in LOCAL_SOURCE_OPS or _unseeded_random(ir, n)]
    local: set = set()
    stack = list(seeds)
    while stack:
        node = stack.pop()
        if node in local:
            continue
        local.add(node)
        for dst, _ in ir.consumers(node):
            if dst in local or ir.op(dst) in CROSS_REPLICA_OPS:
                continue
            if is_mutating_op(ir.op(dst)):
                for variable in _written_variables(ir, dst):
                    stack.extend(_reads(ir, variable))
            stack.append(dst)
    return local


def _written_variables(ir: GraphIR, write: str) -> list[str]:
    return [src for src, _ in ir.inputs(write) if ir.op(src) in VARIABLE_OPS]


def _reads(ir: GraphIR, variable: str) -> list[str]:
    """What reads a variable's value (not ops that only write it)."""
    return [dst for dst, _ in ir.consumers(variable) if not is_mutating_op(ir.op(dst))]


def _unseeded_random(ir: GraphIR, node: str) -> bool:
    op = ir.op(node)
    if not op.startswith(RANDOM_PREFIXES) or op.startswith("RandomShuffleQueue"):
        return False
    attrs = ir.attrs(node)
    return not (attrs["seed"].i if "seed" in attrs else 0) and not (
        attrs["seed2"].i if "seed2" in attrs else 0)


def _check_start(ir: GraphIR, tg: TrainingGraph, replicas: int) -> None:
    """Every replica's copy of a variable is initialised from replica 0's initial value, or
    from constants alone."""
    for var in sorted(tg.variables.values(), key=lambda v: v.name):
        if not var.initializer:
            continue
        first = replica_prefix(0) + var.initializer
        if first not in ir:
            continue
        start = ir.input(first, 1)
        for i in range(1, replicas):
            init = replica_prefix(i) + var.initializer
            if init not in ir:
                continue
            value = ir.input(init, 1)
            if value != start and not _constant(ir, value[0]):
                raise ContractError(
                    f"variable '{var.name}': replica {i} initialises it from '{value[0]}', "
                    f"not from replica 0's initial value '{start[0]}', so the replicas would "
                    "start apart")


def _constant(ir: GraphIR, node: str) -> bool:
    """Computed from Const ops alone, by stateless ops (equal wherever it runs)."""
    from graphxform import opdefs
    seen, stack = set(), [node]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        op = ir.op(name)
        if op == "Const":
            continue
        if op in VARIABLE_OPS or opdefs.is_stateful(ir, op) or not ir.inputs(name):
            return False
        stack.extend(src for src, _ in ir.inputs(name))
    return True
