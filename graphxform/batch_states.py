"""The states batch_mixing gives tensors (see graphxform/batch_mixing.py), in a module of their
own so that the rules for loops (graphxform/loop_mixing.py) read the same vocabulary."""

from __future__ import annotations

import dataclasses

SIZE, AGGREGATE, NORM, UNKNOWN = "size", "aggregate", "norm", "unknown"


@dataclasses.dataclass(frozen=True)
class Shape:
    """A shape vector whose entry ``batch_at`` counts the rows: the batch's size (SIZE), or,
    for rows a mask of the batch selects (tf.boolean_mask, tf.where), how many it selects, a
    sum over the batch (``count`` AGGREGATE); for a length the batch's values decide otherwise
    (tf.unique's distinct values), a Curved (or the Mixed its values are)."""
    batch_at: int
    count: object = "size"


@dataclasses.dataclass(frozen=True)
class Ratio:
    """A count of the batch's elements over a total of its values, divided at ``node`` (Keras
    rescales a masked loss's weights by size(mask) / sum(mask)): the whole batch's ratio in
    every replica where global-denominators makes the total global, that is where ``node`` is
    a division on the loss's way from its terms (the contract refuses it there where no pass
    does); each replica's own slice's anywhere else (see _through_ratio)."""
    node: str


@dataclasses.dataclass(frozen=True)
class Mixed:
    node: str
    op: str
    reason: str
    # what it means for the replicas, and what to do instead
    advice: str = ("each replica would compute it on its own slice alone, which is not the "
                   "loss one device computes (batch norm is the one exception this tool makes, "
                   "see --sync-batch-norm): make the loss a mean of per-example terms, or train "
                   "on one device")


@dataclasses.dataclass(frozen=True)
class Curved:
    """A non-linear function of a sum or mean over the batch, first applied at ``node``: the
    average of the replicas' values is not the whole batch's, and neither is its gradient. A
    loss made of one mixes its examples; a denominator made of one is global-denominators'."""
    node: str
    op: str
    reason: str = "applies a non-linear function to a sum or mean over the batch"

    def mixed(self) -> Mixed:
        return Mixed(self.node, self.op,
                     f"{self.reason}: the average of the replicas' values of it is not its "
                     "value on the whole batch, and neither is the average of their gradients")


def port_state(state, port: int):
    """The state of output ``port`` of a node whose state is ``state`` (a list per port, or one
    state for every port)."""
    return state[port] if isinstance(state, list) else state
