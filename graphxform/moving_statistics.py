"""Batch norm's moving statistics: the variables a training step moves towards the batch's mean
and variance, which each replica keeps for itself (saved from replica 0, named by `verify`)
unless ``--sync-batch-norm`` makes every replica's batch the global one (README).

tf.compat.v1.layers, tf_keras and tf_slim name them (``moving_mean``, ``moving_variance``,
batch renormalization's ``moving_stddev``, ``renorm_mean``, ``renorm_stddev``): found by name.
The classic TF1 helper names them after its tensors
(``moments/Squeeze/ExponentialMovingAverage``)::

    mean, var = tf.nn.moments(x, [0, 1, 2], name='moments')
    ema_op = ema.apply([mean, var])                    # under tf.cond(phase_train, ...), or not
    y = tf.nn.batch_normalization(x, mean, var, beta, gamma, eps)

so it is found by structure. A variable is one when
- every write of it, in the graph or in a function the step calls (a control flow v2 cond), is
  an exponential moving average, ``v.assign_sub((v - s) * (1 - decay))`` with a decay that
  reads nothing of the batch;
- ``s`` is tf.nn.moments' mean or variance (``moments/mean``, ``moments/variance``: the Means
  sync-batch-norm synchronises and graphxform.batch_mixing takes for batch norm's) over the
  batch (axis 0) of a tensor ``x``;
- the normalisation reads ``x`` and ``s``: a node the statistic reaches within a few ops is one
  ``x`` reaches within two (tf.nn.batch_normalization's ``x * rsqrt(var + eps) * gamma +
  (beta - mean * ...)``);
- whatever else in the step reads the variable feeds that normalisation (the inference branch
  of the tf.cond), so no loss reads it otherwise.
An average of another statistic (a loss's running average) or one something else reads stays
state the step moves from the batch: global-state keeps it equal or the contract refuses it.
"""

from __future__ import annotations

import re

from graphxform.nodes import const_value

# batch norm's moving statistics as tf.compat.v1.layers, tf_keras and tf_slim name them, and
# batch renormalization's (renorm=True: moving_stddev, renorm_mean, renorm_stddev)
NAMED = re.compile(r"moving_(mean|variance|stddev)|renorm_(mean|stddev)")
BY_NAME, BY_STRUCTURE = "name", "structure"
MOMENTS = ("moments/mean", "moments/variance")  # tf.nn.moments' Means, as sync-batch-norm's
_EMA_WRITES = frozenset({"AssignSub", "AssignSubVariableOp"})
_HANDLE_HOPS = frozenset({"Identity", "Switch", "RefSwitch"})
_STATISTIC_HOPS = frozenset({"Identity", "Switch", "RefSwitch", "Squeeze", "Reshape"})
_BATCH_OPS = frozenset({"Placeholder", "PlaceholderWithDefault", "IteratorGetNext",
                        "QueueDequeueV2", "QueueDequeueManyV2", "QueueDequeueUpToV2"})
_REACH = 10  # ops from a statistic to the normalisation (through a cond's Switch and Merge)


def mark(ir, variables: dict, closure: set) -> None:
    """Set ``moving_statistic`` (BY_NAME, BY_STRUCTURE or None) on each of ``variables`` (the
    step runs ``closure``)."""
    calls = None
    for var in variables.values():
        if var.trainable or var.local or var.role not in ("statistic", "other"):
            continue
        if NAMED.search(var.name):
            var.moving_statistic = BY_NAME
            continue
        if calls is None:
            calls = _calls(ir, closure)
        if _by_structure(ir, var, closure, calls):
            var.moving_statistic = BY_STRUCTURE


def _calls(ir, closure: set) -> list:
    """(call, its bodies) for the calls the step runs that read a function's arguments."""
    from graphxform.functions import CALL_OPS, call_bodies
    library = {f.signature.name for f in ir.meta.graph_def.library.function}
    if not library:
        return []
    found = []
    for call in sorted(ir.nodes_of(set(CALL_OPS) | library)):
        if call in closure:
            found.append((call, [_Body(f, args) for f, args in call_bodies(ir, call)]))
    return found


class _Body:
    """A function body: its nodes by name, and each argument's graph tensor (src, port)."""

    def __init__(self, function, args: dict):
        self.nodes = {n.name: n for n in function.node_def}
        self.args = args


def _op(ir, ref):
    body, name, _ = ref
    if body is None:
        return ir.op(name)
    node = body.nodes.get(name)
    return node.op if node is not None else None


def _inputs(ir, ref) -> list:
    """The data inputs of ``ref`` ((body or None, name, port)): a body's arguments as the
    graph tensors that feed them."""
    body, name, _ = ref
    if body is None:
        return [(None, src, port) for src, port in ir.inputs(name)]
    found = []
    for text in body.nodes[name].input:
        if text.startswith("^"):
            continue
        head, *rest = text.split(":")
        if head in body.args:
            found.append((None, *body.args[head]))
        else:
            found.append((body, head, int(rest[-1]) if rest else 0))
    return found


def _through(ir, ref, hops):
    while _op(ir, ref) in hops:
        ref = _inputs(ir, ref)[0]
    return ref


def _by_structure(ir, var, closure: set, calls: list) -> bool:
    writes = [(None, w, 0) for w in var.updates]
    readers = set()  # calls and graph nodes that read the variable other than its writes
    for call, bodies in calls:
        if not any(_through(ir, (None, src, port), _HANDLE_HOPS)[1] == var.name
                   for src, port in ir.inputs(call)):
            continue
        readers.add(call)
        for body in bodies:
            found = _body_writes(ir, body, var.name)
            if found is None:
                return False
            writes += found
    if not writes:
        return False
    norm, ema_reads = set(), set()
    for write in writes:
        found = _ema_of_moments(ir, write, var.name)
        if found is None:
            return False
        nodes, read = found
        norm |= nodes
        ema_reads.add(read)
    readers |= _graph_readers(ir, var.name, closure) - ema_reads - set(var.updates)
    return all(_reach(ir, reader) & norm for reader in readers)


def _body_writes(ir, body: _Body, var: str) -> list | None:
    """The writes of ``var`` in ``body``; None where something else there takes its handle
    (a nested call, a write of another kind: not followed)."""
    handles = {arg for arg, (src, port) in body.args.items()
               if _through(ir, (None, src, port), _HANDLE_HOPS)[1] == var}
    found = []
    for node in body.nodes.values():
        if not any(t.split(":")[0] in handles for t in node.input if not t.startswith("^")):
            continue
        if node.op in _EMA_WRITES:
            found.append((body, node.name, 0))
        elif node.op not in ("ReadVariableOp", "Identity"):
            return None
    return found


def _graph_readers(ir, var: str, closure: set) -> set:
    """The nodes the step runs that read ``var`` (through Identities and legacy conds'
    Switches), its writes among them."""
    found, stack = set(), [var]
    while stack:
        for dst, _ in ir.consumers(stack.pop()):
            if ir.op(dst) in _HANDLE_HOPS:
                stack.append(dst)
            elif dst in closure:
                found.add(dst)
    return found


def _ema_of_moments(ir, write, var: str):
    """(the normalisation's nodes, the read of ``var`` the average takes) where ``write`` is
    ``var.assign_sub((var - s) * (1 - decay))`` of tf.nn.moments' ``s`` over the batch of a
    tensor a normalisation also reads; None otherwise."""
    if _op(ir, write) not in _EMA_WRITES:
        return None
    handle, value = _inputs(ir, write)[:2]
    if _through(ir, handle, _HANDLE_HOPS)[1] != var or _op(ir, value) != "Mul":
        return None
    a, b = _inputs(ir, value)
    for difference, decay in ((a, b), (b, a)):
        if _op(ir, difference) != "Sub" or not _free_of_batch(ir, decay):
            continue
        read, statistic = _inputs(ir, difference)
        source = _inputs(ir, read)[0] if _op(ir, read) == "ReadVariableOp" else read
        if _through(ir, source, _HANDLE_HOPS)[1] != var:
            continue
        mean = _through(ir, statistic, _STATISTIC_HOPS)
        norm = _normalisation(ir, mean[1]) if mean[0] is None else set()
        if norm:
            return norm, read[1] if read[0] is None else None
    return None


def _free_of_batch(ir, ref) -> bool:
    """Whether the value of ``ref`` reads no input of the batch (a decay: constants, or
    num_updates' global step)."""
    stack, seen = [ref], set()
    while stack:
        ref = stack.pop()
        if ref[:2] in seen:
            continue
        seen.add(ref[:2])
        if ref[0] is None:
            if any(ir.op(n) in _BATCH_OPS for n in ir.value_sources(ref[1])):
                return False
        elif _op(ir, ref) is None:
            return False
        else:
            stack += _inputs(ir, ref)
    return True


def _normalisation(ir, mean: str) -> set:
    """The nodes where tf.nn.moments' ``mean`` (its mean or variance, over the batch) meets the
    tensor it is taken of: empty when ``mean`` is no such Mean or nothing normalises."""
    if ir.op(mean) != "Mean" or not mean.endswith(MOMENTS):
        return set()
    axes = const_value(ir, ir.input(mean, 1)[0])
    if axes is None or 0 not in axes.reshape(-1).tolist():
        return set()
    x, own = ir.input(mean, 0), {mean}
    if mean.endswith("moments/variance"):
        if ir.op(x[0]) != "SquaredDifference":
            return set()
        stop = ir.input(x[0], 1)[0]
        first = ir.input(stop, 0)[0] if ir.op(stop) == "StopGradient" else None
        if first is None or ir.op(first) != "Mean" or not first.endswith(MOMENTS[0]):
            return set()
        own |= {x[0], stop, first}
        x = ir.input(x[0], 0)
        if ir.input(first, 0) != x:
            return set()
    readers = {dst for dst, _ in ir.consumers(*x)} - own
    near = readers | {d for r in readers for d, _ in ir.consumers(r)}
    return _reach(ir, mean) & near


def _reach(ir, start: str) -> set:
    """What ``start``'s value reaches within _REACH ops (not through gradients, nor past a
    variable's write)."""
    from graphxform.training import gradient_scope, is_mutating_op
    seen, frontier = set(), [start]
    for _ in range(_REACH):
        nxt = []
        for node in frontier:
            for dst, _ in ir.consumers(node):
                if dst in seen or gradient_scope(dst):
                    continue
                seen.add(dst)
                if not is_mutating_op(ir.op(dst)):
                    nxt.append(dst)
        frontier = nxt
    return seen
