"""How tf.nn.nce_loss and tf.nn.sampled_softmax_loss carry the batch to their logits.

Both build their logits in ``_compute_sampled_logits``, which does two things no general rule
of graphxform/batch_mixing.py follows.

One lookup for the true and the sampled classes. It looks up the weights of both in one
embedding_lookup of ``concat([labels_flat, sampled], 0)``, then slices the result at
``tf.shape(labels_flat)[0]``: the rows before that row are the examples' (one per true label, in
example order), the rows from it on the sampled classes', which hold nothing of the batch. On a
replica's slice the same holds with its own labels: the first part is its examples' rows, the
second the same sampled rows (the sampler's draw does not depend on the batch). So:

- a concat along axis 0 of a per-example tensor (the batch on axis 0) followed by batch-free
  tensors is ``Stacked(head)``, ``head`` the per-example tensor;
- a gather of batch-free params by Stacked indices keeps it (its rows follow the indices);
- a Slice of it from row 0 for exactly ``tf.shape(head)[0]`` rows gives back the examples'
  rows (per-example, the batch on axis 0), and one from that row to the end the batch-free
  rows (None);
- anything else made of a Stacked is unknown: nothing here shows that it keeps the two parts
  apart, and a cut anywhere else would put examples' rows beside sampled ones.

Accidental hits (sampled_softmax_loss's default ``remove_accidental_hits=True``). It masks each
sampled class that is one of an example's own true classes: ``compute_accidental_hits(labels,
sampled)`` lists the hits as (row of labels, column of sampled, weight), and a SparseToDense of
those into ``[tf.shape(labels)[0], num_sampled]`` adds the weights to the sampled logits. Entry
(i, j) depends on example i's labels and the batch-free sample alone, and a replica numbers its
own slice's rows from 0, so the mask is per-example: ``accidental_hits``.
"""

from __future__ import annotations

import dataclasses
import re

from graphxform.batch_states import UNKNOWN, Mixed

_ROWS = "rows"  # an entry that is tf.shape(head)[0]
_FOLDED_SHAPE = re.compile(r"^Shape(_\d+)?$")  # tf.shape, folded where shapes are fixed
_KEEPING = frozenset({"Identity", "StopGradient", "Snapshot"})
_GATHERS = frozenset({"Gather", "GatherV2", "ResourceGather"})


@dataclasses.dataclass(frozen=True)
class Stacked:
    """Rows along axis 0: ``head``'s (a (node, port) holding the batch on axis 0), then rows
    that hold nothing of the batch."""
    head: tuple


def concat_state(inputs: list, states: list, axis):
    """The state of a ConcatV2 (``inputs``/``states`` without its axis input) along ``axis``
    that stacks a per-example tensor ahead of batch-free ones, else None."""
    if axis == 0 and len(states) > 1 and states[0] == 0 and \
            all(s is None for s in states[1:]):
        return Stacked(inputs[0])
    return None


def state_of(flow, name: str, op: str, inputs: list, states: list):
    """The state of ``name``, an ``op`` one of whose inputs (in ``states``) is Stacked."""
    mixed = next((s for s in states if isinstance(s, Mixed)), None)
    if mixed is not None:
        return mixed
    first = states[0]
    if op in _KEEPING and isinstance(first, Stacked):
        return first
    if op in _GATHERS and first is None and len(states) > 1 and isinstance(states[1], Stacked):
        batch_dims = flow.ir.attrs(name).get("batch_dims")
        if (batch_dims is None or batch_dims.i == 0) and (
                op != "GatherV2" or flow.ints(*inputs[2]) == [0]):
            return states[1]
        return UNKNOWN
    if op == "Slice" and isinstance(first, Stacked):
        head = first.head
        begin, size = (_first_entry(flow, *inputs[k], head) for k in (1, 2))
        if begin == 0 and size == _ROWS:
            return 0
        if begin == _ROWS and size == -1:
            return None
    return UNKNOWN


def _first_entry(flow, src: str, port: int, head: tuple):
    """Entry 0 of the 1-D tensor ``src:port``: ``_ROWS`` when it is head's number of rows
    (``_is_shape_of`` the whole vector, for a head of rank 1, or a Pack whose first entry is
    entry 0 of one), else its value when constant, else None. The other entries of a Pack must
    hold nothing of the batch: a column bound that is a batch's size would differ between a
    replica's slice and the whole batch."""
    ir = flow.ir
    dims = flow.dims(*head)
    if port == 0 and dims is not None and len(dims) == 1 and _is_shape_of(flow, src, head):
        return _ROWS
    if ir.op(src) == "Pack" and port == 0:
        entries = ir.inputs(src)
        if any(flow.states.get(entry) is not None for entry, _ in entries[1:]):
            return None
        from graphxform.nodes import shape_entry  # it imports TensorFlow's protos
        src, port = entries[0]
        entry = shape_entry(ir, src, port, flow.ints)
        if entry is not None and entry[1] == 0 and _is_shape_of(flow, entry[0], head):
            return _ROWS
    values = flow.ints(src, port)
    return values[0] if values else None


def _is_shape_of(flow, src: str, head: tuple) -> bool:
    """Whether ``src`` (output 0) is tf.shape(head): a Shape of it, or, where head's shape is
    fixed, the Const TensorFlow folded tf.shape(head) into (named as tf.shape names it, holding
    head's shape), which split-inputs rewrites to a replica's slice in every replica."""
    ir = flow.ir
    if ir.op(src) == "Shape":
        return ir.input(src, 0) == head
    if ir.op(src) != "Const" or not _FOLDED_SHAPE.match(src.rsplit("/", 1)[-1]):
        return False
    dims = flow.dims(*head)
    return dims is not None and -1 not in dims and flow.ints(src, 0) == dims


def accidental_hits(flow, name: str, inputs: list, states: list):
    """The state of ``name``, a SparseToDense: per-example (0) where it is the mask
    sampled_softmax_loss makes of ``compute_accidental_hits(labels, sampled)`` (see the module
    docstring), labels holding the batch on axis 0 and the sample none of it, in a shape whose
    entry 0 is the batch's size; unknown otherwise."""
    from graphxform.batch_states import Shape, port_state
    ir = flow.ir
    if len(inputs) != 4 or states[1] != Shape(0) or states[3] is not None:
        return UNKNOWN
    indices = inputs[0][0]
    if ir.op(indices) != "ConcatV2" or len(ir.inputs(indices)) != 3:
        return UNKNOWN
    rows, columns, axis = ir.inputs(indices)
    if flow.ints(*axis) not in ([1], [-1]):
        return UNKNOWN
    hits = _column(flow, *rows)
    if hits is None or ir.op(hits[0]) != "ComputeAccidentalHits" or hits[1] != 0:
        return UNKNOWN
    hits = hits[0]
    if _column(flow, *columns) != (hits, 1) or _uncast(ir, *inputs[2]) != (hits, 2):
        return UNKNOWN
    (labels, labels_port), (sampled, sampled_port) = ir.inputs(hits)[:2]
    if port_state(flow.states.get(labels, UNKNOWN), labels_port) != 0 or \
            port_state(flow.states.get(sampled, UNKNOWN), sampled_port) is not None:
        return UNKNOWN
    return 0


def _column(flow, src: str, port: int):
    """The vector ``src:port`` reshapes into one column (``reshape(cast(v), [-1, 1])``), as
    (node, port), or None."""
    ir = flow.ir
    if ir.op(src) != "Reshape" or port != 0 or flow.ints(*ir.input(src, 1)) != [-1, 1]:
        return None
    return _uncast(ir, *ir.input(src, 0))


def _uncast(ir, src: str, port: int) -> tuple:
    while ir.op(src) == "Cast" and port == 0:
        src, port = ir.input(src, 0)
    return src, port
