"""batch_mixing's rules for while loops that keep each example's values apart.

An RNN over time (dynamic_rnn, a Keras RNN layer, tf.scan over axis 1) is a while loop whose
every iteration reads one time step of the whole batch, ``x[t]`` of shape [batch, ...], and
carries a hidden state of one row per example. No example meets another in it: a replica's
slice of the batch gives each of its examples the values one device gives it. The rules here
show that, so the flow goes on through the loop to the loss (a loop it cannot follow leaves its
outputs unknown, and the contract refuses a loss of unknown state).

A loop is followed by a fixed point. Each loop variable starts in the state of its initial
value; the body is worked out from those states, and where what the body passes to the next
iteration is in another state, the variable takes the join of the two (``join``: a value free
of the batch joined with per-example rows is per-example rows) and the body is worked out
again. Legacy loops (Enter, Merge, Switch, NextIteration, Exit in the graph itself) are settled
by batch_mixing's flow, which restarts with the joined states of the Merges it found wrong;
control-flow-v2 loops (While, a body function) by ``while_states``. The loop's predicate must
be free of the batch: a loop run as many times as the batch has examples, or as a statistic of
the batch says, reads them by position (batch_mixing's own rules see to those).

TensorArrays (legacy) and TensorLists (v2) hold a loop's per-time-step values. An array's
"flow" tensor (a list's handle) stands for the array here: its state is that of one element.
Scattering or unstacking [time, batch, ...] makes elements of [batch, ...] (the batch one axis
lower); a read gives an element; gathering or stacking the elements puts the batch one axis
higher. An array over the batch's own axis (one example per element) is batch_mixing's
``_unstack_into_loop`` and ``_while_loop``: this module leaves it unknown."""

from __future__ import annotations

from graphxform.batch_states import (AGGREGATE, NORM, SIZE, UNKNOWN, Curved, Mixed, Shape,
                                     port_state)

# legacy loop plumbing that hands its data input on unchanged
LOOP_PASS_OPS = frozenset({"Enter", "RefEnter", "Exit", "RefExit", "NextIteration",
                           "RefNextIteration", "LoopCond"})
BACK_EDGE_OPS = frozenset({"NextIteration", "RefNextIteration"})
MERGE_OPS = frozenset({"Merge", "RefMerge"})
MAX_ROUNDS = 4  # a variable's state only rises (free, rows, unknown): a few rounds settle
_OVER_NONE = (SIZE, AGGREGATE, NORM)  # what a value free of the batch joins up to


def join(a, b):
    """The state of a loop variable that is ``a`` on one iteration and ``b`` on another: the
    same state, or per-example rows (or a size, a statistic, batch norm's statistics) where
    the other is free of the batch; unknown otherwise. Also the state of a cond's output, one
    branch ``a``, the other ``b`` (graphxform/batch_mixing.py's _joined)."""
    if a == b:
        return a
    for state in (a, b):  # what the body mixes, the loop mixes
        if isinstance(state, (Mixed, Curved)):
            return state
    if a is None and (type(b) is int or b in _OVER_NONE or isinstance(b, Shape)):
        return b
    if b is None and (type(a) is int or a in _OVER_NONE or isinstance(a, Shape)):
        return a
    return UNKNOWN


def join_degree(a, a_degree, b, b_degree):
    """The degree in the batch's size of ``join(a, b)``: that of the one that is not free of
    the batch, or their common one (None: unknown)."""
    if a is None:
        return b_degree
    if b is None or a_degree == b_degree:
        return a_degree
    return None


def is_loop_merge(ir, name: str) -> bool:
    """Whether ``name`` is a legacy while loop's Merge (one input comes round the back edge)."""
    return ir.op(name) in MERGE_OPS and any(
        ir.op(src) in BACK_EDGE_OPS for src, _ in ir.inputs(name))


def entry_inputs(ir, inputs: list) -> list:
    """A loop Merge's inputs that enter the loop (the others come round its back edge)."""
    return [(src, port) for src, port in inputs if ir.op(src) not in BACK_EDGE_OPS]


def back_inputs(ir, inputs: list) -> list:
    return [(src, port) for src, port in inputs if ir.op(src) in BACK_EDGE_OPS]


# ------------------------------------------------------------- arrays and lists
# op -> (position of the value written, of the flow or list, of the positions that pick
# elements (a position read from the batch picks examples: unknown), what it does)
_ARRAY_OPS = {
    **dict.fromkeys(("TensorArrayScatterV3", "TensorArrayScatterV2", "TensorArrayScatter"),
                    (2, 3, 1, "unstack")),
    "TensorArrayUnpack": (1, 2, None, "unstack"),
    **dict.fromkeys(("TensorArraySplitV3", "TensorArraySplitV2", "TensorArraySplit"),
                    (1, 3, 2, "split")),
    **dict.fromkeys(("TensorArrayWriteV3", "TensorArrayWriteV2", "TensorArrayWrite"),
                    (2, 3, 1, "write")),
    **dict.fromkeys(("TensorArrayReadV3", "TensorArrayReadV2", "TensorArrayRead"),
                    (None, 2, 1, "read")),
    **dict.fromkeys(("TensorArrayGatherV3", "TensorArrayGatherV2", "TensorArrayGather"),
                    (None, 2, 1, "stack")),
    "TensorArrayPack": (None, 1, None, "stack"),
    **dict.fromkeys(("TensorArrayConcatV3", "TensorArrayConcatV2", "TensorArrayConcat"),
                    (None, 1, None, "concat")),
    **dict.fromkeys(("TensorArraySizeV3", "TensorArraySizeV2", "TensorArraySize"),
                    (None, 1, None, "size")),
    "TensorListFromTensor": (0, None, None, "unstack"),
    "TensorListSetItem": (2, 0, 1, "write"),
    "TensorListPushBack": (1, 0, None, "write"),
    "TensorListGetItem": (None, 0, 1, "read"),
    "TensorListStack": (None, 0, None, "stack"),
    "TensorListGather": (None, 0, 1, "stack"),
    "TensorListLength": (None, 0, None, "size"),
    "TensorListElementShape": (None, 0, None, "shape"),
}
# arrays and lists made empty: free of the batch whatever their element shape says, as long
# as their length is (one element per example is batch_mixing's case)
_EMPTY_ARRAY_OPS = {"TensorArrayV3": 0, "TensorArrayV2": 0, "TensorArray": 0,
                    "TensorListReserve": 1, "EmptyTensorList": 1}
ARRAY_OPS = frozenset({*_ARRAY_OPS, *_EMPTY_ARRAY_OPS})


def array_state(op: str, states: list):
    """The state of an array op's output (a list where ports differ), from its inputs'."""
    if op in _EMPTY_ARRAY_OPS:
        length = states[_EMPTY_ARRAY_OPS[op]] if len(states) > _EMPTY_ARRAY_OPS[op] else None
        return [None, None] if op.startswith("TensorArray") and length is None else \
            None if length is None else UNKNOWN
    value_at, flow_at, at, does = _ARRAY_OPS[op]
    if at is not None and at < len(states) and states[at] is not None:
        return UNKNOWN  # elements picked by the batch's values
    flow = states[flow_at] if flow_at is not None else None
    value = states[value_at] if value_at is not None else None
    if does == "unstack":
        element = value - 1 if type(value) is int and value >= 1 else \
            None if value is None else UNKNOWN
        return join(flow, element)
    if does == "split":
        return join(flow, value if type(value) is int and value >= 1 or value is None
                    else UNKNOWN)
    if does == "write":
        return join(flow, value)
    if does == "read":
        return flow
    if does == "stack":
        return flow + 1 if type(flow) is int else flow if flow in (None, AGGREGATE) else UNKNOWN
    if does == "concat":
        return [flow if type(flow) is int and flow >= 1 or flow is None else UNKNOWN, None]
    if does == "shape":
        return Shape(flow) if type(flow) is int else None if flow is None else UNKNOWN
    return None  # size


def array_degree(op: str, states: list, degrees: list):
    """The degree in the batch's size of an array op's output: its element's, where the
    value written and the array's elements so far agree on it (None: unknown)."""
    if op in _EMPTY_ARRAY_OPS:
        return 0
    value_at, flow_at, _, does = _ARRAY_OPS[op]
    if does in ("size", "shape"):
        return 0 if does == "size" or states[flow_at] is None else 1
    kept = {degrees[k] for k in (value_at, flow_at)
            if k is not None and k < len(states) and states[k] is not None}
    return kept.pop() if len(kept) == 1 else 0 if not kept else None


# ------------------------------------------------------------- control-flow-v2 loops

def while_states(n) -> list | str:
    """The states of a While's outputs, one per loop variable, settled over its body (see the
    module's docstring; a variable the body makes unknown is unknown, and so is what the body
    computes from it next round), or UNKNOWN where the body cannot be built, does not settle,
    or its predicate reads the batch. Records the outputs' degrees in the flow's ``called``."""
    from graphxform import functions
    flow, ir = n.flow, n.flow.ir
    body = functions.body_graph(ir, n.name, "body")
    cond = functions.body_graph(ir, n.name, "cond")
    if body is None or cond is None or len(body.args) != len(n.states) or \
            len(body.outputs) != len(n.states) or len(cond.args) != len(n.states):
        return UNKNOWN
    states = list(n.states)
    degrees = [flow.degree(src, port) for src, port in n.inputs]
    for _ in range(MAX_ROUNDS):
        inner = type(flow)(body.ir, set(), dict(zip(body.args, zip(states, degrees))))
        outs, out_degrees = _outputs(inner, body.outputs)
        joined = [join(a, b) for a, b in zip(states, outs)]
        mixed = next((s for s in joined if isinstance(s, (Mixed, Curved))), None)
        if mixed is not None:
            mixed = mixed.mixed() if isinstance(mixed, Curved) else mixed
            return Mixed(n.name, n.op, f"runs '{mixed.node}' ({mixed.op}) in its body, which "
                         f"{mixed.reason}")
        settled_degrees = [join_degree(s, a, o, b)
                           for s, a, o, b in zip(states, degrees, outs, out_degrees)]
        if joined == states and settled_degrees == degrees:
            break
        states, degrees = joined, settled_degrees
    else:
        return UNKNOWN
    predicate = type(flow)(cond.ir, set(), dict(zip(cond.args, zip(states, degrees))))
    if _outputs(predicate, cond.outputs)[0] != [None]:
        return UNKNOWN
    flow.called[n.name] = degrees
    return states


def _outputs(flow, tensors: list) -> tuple[list, list]:
    states, degrees = [], []
    for tensor in tensors:
        node, port = tensor.rsplit(":", 1)
        flow.run(node)
        states.append(port_state(flow.states[node], int(port)))
        degrees.append(flow.degree(node, int(port)))
    return states, degrees

