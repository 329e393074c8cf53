"""The batch's extremes a step's loss is shaped by: an integer Max (or Min) over the examples,
as ``tf.sequence_mask(lengths)`` takes the batch's longest sequence when given no ``maxlen``.

One device pads to the longest sequence of the whole batch; a replica, from its slice alone,
pads to its slice's. Where that width reaches the loss, the loss changes: ``reduce_mean(ce *
mask)`` divides by batch x width, and ``tf.boolean_mask(losses, mask)`` needs the mask as wide
as the losses. passes/global_extremes.py makes such an extreme the whole batch's in every
replica (the replicas' Max of their own); the contract refuses what is left.

An extreme that reaches the loss only through a loop (dynamic_rnn's min and max sequence
lengths, which say when to stop computing and start copying state through) changes no value
and is left alone, as is one computed from the model's variables (its gradient would be
wrong: the all-reduced value has none)."""

from __future__ import annotations

from graphxform import replica_values
from graphxform.functions import WHILE_OPS
from graphxform.ir import parse_tensor
from graphxform.nodes import replica_prefix
from graphxform.replica_spread import CROSS_REPLICA_OPS, combines_every_replica
from graphxform.training import VARIABLE_OPS

# where a value enters a loop's frame (what the loop does with it changes no value here), or
# becomes every replica's
_STOPS = frozenset({"Enter", "RefEnter", *WHILE_OPS, *CROSS_REPLICA_OPS})


def batch_extremes(ir, tg, step) -> tuple[list[str], list[str]]:
    """Replica 0's Max and Min nodes over the examples of its slice whose value reaches the
    loss of ``step`` (one of the graphxform.training.TrainingGraph ``tg``'s steps) other than
    through a loop: (those computed from the data alone, those computed from the model's
    variables)."""
    first = replica_prefix(0)
    node, _ = parse_tensor(step.loss) if step.loss else (None, 0)
    nodes = ir.g._node
    if node is None or first + node not in nodes:
        return [], []
    candidates = sorted(first + n for n in tg.max_min_nodes
                        if n in step.closure and first + n in nodes)
    if not candidates:
        return [], []
    values = replica_values.classify(
        ir, first, copies=sorted({a for n in candidates for a in ir.ancestors(n)
                                  if a.startswith(first)}))
    from_data, learnt = [], []
    for name in candidates:
        if values.of(name, 0) in replica_values.EXTREMES and _reaches(ir, name, first + node):
            reads_variables = any(ir.op(n) in VARIABLE_OPS for n in ir.value_sources(name))
            (learnt if reads_variables else from_data).append(name)
    return from_data, learnt


def _reaches(ir, source: str, target: str) -> bool:
    """Whether ``source``'s value flows into ``target`` along data edges that enter no loop
    and pass no cross-replica op or combination of every replica's copy (whose value is
    every replica's already)."""
    seen, stack = {source}, [source]
    while stack:
        name = stack.pop()
        if name == target:
            return True
        for dst, _ in ir.consumers(name):
            if dst not in seen and ir.op(dst) not in _STOPS and \
                    not combines_every_replica(ir, dst):
                seen.add(dst)
                stack.append(dst)
    return False
