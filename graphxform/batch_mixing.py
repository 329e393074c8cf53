"""Where a step's loss mixes the examples of its batch, which splitting the batch would change.

Each replica computes the loss on its own slice of the global batch, and the averaged gradients
are one device's only when the loss is a mean (or sum) of per-example terms: every example's
term computed from that example alone. A loss that pairs examples (in-batch negatives, a
batch-hard triplet loss), ranks them (hard-example mining, a sort), reorders or picks them
(mixup's shuffled partner, ``x[0]``, a gather_nd of a partner's rows; BERT's gather of
``positions + tf.range(batch) * seq_length`` picks each example's own), splits or groups
them by position (``tf.split`` of the batch, a reshape into groups), repeats each as often
as the batch has examples (``tf.tile`` for pairwise distances), runs a recurrence over them
(a while loop, legacy or control flow v2, that reads one example per iteration and carries a
value to the next), or
normalises them by a statistic of the batch computes something else on a slice, and nothing in
the averaged gradients says so. So does one that lines its examples up with the rows of a
tensor whose number of rows the graph fixes while the batch's size is free
(``tf.range(BATCH_SIZE)`` stacked beside the actions of a DQN): it runs with that batch only.
Batch norm is the one documented exception (``--sync-batch-norm``; `verify` names it): a
FusedBatchNorm, and ``tf.nn.moments``' Means
(``moments/mean``, ``moments/variance``) of an activation over all its axes but the
features, which sync-batch-norm knows; moments of data or of per-example losses (advantage
normalisation) are statistics of the batch like any other.

This follows the single-device graph forward from its batch (the batched placeholders and
input-pipeline reads) to each step's loss, along data edges, through while loops over time
steps (graphxform/loop_mixing.py), giving every tensor a state (graphxform/batch_states.py):

- ``None``: holds nothing from the batch (constants, variables, what is computed from them);
- ``SIZE``: depends on the batch's size only (``tf.shape(x)[0]``, ``tf.size(x)``); a
  ``Shape`` (k) is a shape vector whose entry k is the batch's size (``tf.shape(x)``), or a
  count the batch's values decide: the length of tf.where's rows, of tf.unique's values (see
  ``_value_sized``);
- an int k: per-example, the batch on axis k;
- ``AGGREGATE``: a sum or mean over the batch (batch-norm statistics are ``NORM``), or
  affine in such sums and means;
- a ``Curved``: a non-linear function of sums or means over the batch (``square(mean)``, a
  variance beside the mean): mixing where it reaches the loss or meets an example, except as
  the denominator of a sum (a guarded weighted mean);
- a ``Ratio``: a count of the batch's elements over a total of its values (Keras weights a
  masked loss by size(mask) / sum(mask)): read as holding nothing of the batch where it weights
  examples and is divided on the loss's way from its terms, since global-denominators makes it
  the whole batch's ratio there (and the contract refuses it where no pass does); a Curved
  anywhere else, and mixing where one divided elsewhere (``x * size(m) / sum(m)`` fed to the
  model) meets the examples: each replica would take its own slice's;
- per-example values over a total of the batch's data, or a function of its totals, in a
  division on the loss's way from its terms (``replica_values.loss_divisions``: tkipf/gcn's
  ``mask / tf.reduce_mean(mask)`` weighting each example's loss): per-example, of the
  dividend's degree, since global-denominators divides them by the whole batch's total in
  every replica, each example's value one device's (the contract refuses what it cannot);
- a ``Stacked`` (graphxform/sampled_logits.py): the examples' rows ahead of batch-free rows,
  as nce_loss and sampled_softmax_loss look up the true and the sampled classes together;
- ``UNKNOWN``: no rule here says (ops without a rule, a loop graphxform/loop_mixing.py cannot
  settle, a function it cannot build): not followed;
- a ``Mixed``: examples met here, first at ``node``, for ``reason``; whatever reads it is
  mixed too.

Beside its state, a batch-derived tensor has a degree in the batch's size (the last section:
the gradient of a mean loss is each example's over the size, so per-example values of degree
-1 that meet the examples themselves, as FGSM's x + eps * dL/dx, mix), and rows that hold one
value in every example (``ones_like``) are counted: their sum over the batch is a size.

Only definite mixing is reported: an op the rules do not know leaves its output unknown, not
mixed. Ranks come from the ``_output_shapes`` that `export_meta_graph` records."""

from __future__ import annotations

import functools

from graphxform import functions, loop_mixing, opdefs, replica_values, sampled_logits
from graphxform.batch_states import (AGGREGATE, NORM, SIZE, UNKNOWN, Curved, Mixed, Ratio, Shape,
                                     port_state as _port)
from graphxform.functions import WHILE_OPS
from graphxform.ir import parse_tensor
from graphxform.replica_values import (BATCH_NORM_OPS, CROSS_ENTROPY_OPS, ELEMENTWISE_UNARY_OPS,
                                       LIKE_OPS, LINEAR_UNARY_OPS)
from graphxform.selections import UNSUMMED_COUNTS, VALUE_SIZED_OPS, value_sized_family
from graphxform.training import RANDOM_OPS

_MOMENTS = ("moments/mean", "moments/variance")  # tf.nn.moments: sync-batch-norm's
_INTEGER_DTYPES = (3, 9)  # int32, int64: lengths, counts
_FLOAT_DTYPES = (1, 2, 14, 19)  # float, double, bfloat16, half: what a collective reduces


_FAKE_QUANT_OPS = frozenset({"FakeQuantWithMinMaxVars", "FakeQuantWithMinMaxVarsPerChannel",
                             "FakeQuantWithMinMaxArgs"})
# tf.random.Generator's draws: (resource, algorithm, shape, parameters...)
_STATEFUL_DRAWS = frozenset({"StatefulStandardNormalV2", "StatefulUniform", "StatefulUniformInt",
                             "StatefulUniformFullInt", "StatefulTruncatedNormal",
                             "StatefulRandomBinomial"})

PASS_OPS = frozenset({*LINEAR_UNARY_OPS, "Cast", *ELEMENTWISE_UNARY_OPS, *LIKE_OPS, "Print",
                      "PrintV2", "DebugIdentity"})
# the broadcasting ops, v1 Select (whose rank-1 condition picks rows) and the activations'
# gradients, which broadcast as their forward ops do
ELEMENTWISE_OPS = frozenset({
    *replica_values.ELEMENTWISE_OPS, "Select", "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad",
    "SoftplusGrad", "SoftsignGrad", "SigmoidGrad", "TanhGrad", "SqrtGrad", "RsqrtGrad",
    "ReciprocalGrad", "LeakyReluGrad"})
PER_EXAMPLE_OPS = frozenset({*replica_values.PER_EXAMPLE_OPS, *BATCH_NORM_OPS,
                             *CROSS_ENTROPY_OPS, "InTopK", "InTopKV2"})
REDUCE_OPS = frozenset(replica_values.REDUCE_OPS)


def mixing_in(ir, loss: str, sources, shapes=(), indices=()) -> Mixed | None:
    """The first place the examples meet on the way to ``loss`` (a tensor name) from the batch
    ``sources`` (nodes every output of which holds the batch on axis 0), or None. ``shapes``:
    placeholders that hold a shape whose entry 0 is the batch's size (a sparse_placeholder's
    dense shape, which tf.shape of the SparseTensor reads); ``indices``: a sparse_placeholder's
    indices, whose column 0 numbers the example each entry belongs to."""
    flow, found = _loss_flow(ir, loss, sources, shapes, indices)
    if isinstance(found, Curved):
        return found.mixed()
    if found == NORM:
        source = _norm_source(flow, parse_tensor(loss)[0])
        return Curved(source, ir.op(source), "takes statistics of the batch (tf.nn.moments) "
                      "that the loss is made of, other than by normalising its examples with "
                      "them as batch norm does").mixed()
    return found if isinstance(found, Mixed) else None


def loss_state(ir, loss: str, sources, shapes=(), indices=()):
    """The state (graphxform/batch_states.py) the flow gives ``loss`` (arguments as
    ``mixing_in``'s): AGGREGATE where it is shown a sum or mean of per-example terms, UNKNOWN
    where no rule here says."""
    return _loss_flow(ir, loss, sources, shapes, indices)[1]


def _loss_flow(ir, loss: str, sources, shapes, indices) -> tuple:
    """The settled flow from the batch to ``loss``, and the loss's state."""
    node, port = parse_tensor(loss)
    divisions = set(replica_values.loss_divisions(ir, (node, port)))

    def flow():
        made = _Flow(ir, set(sources) - set(shapes), {name: (Shape(0), 1) for name in shapes})
        made.sparse_indices = set(indices)
        made.loss_divisions = divisions
        return made
    flow = _settled(flow, node)
    return flow, _port(flow.states[node], port)


def tower_flow(ir, loss: str, sources, splits) -> tuple | None:
    """Where a tower's ``loss`` (graphxform/towers.py) mixes the examples of its part of the
    batch: (node, what it does), or None. The parts the tower ``splits`` make are its batch;
    besides what ``mixing_in`` reports, batch norm's statistics and the part's integer extremes
    (which sync-batch-norm and global-extremes would make the whole batch's, not the part's)
    mix them too."""
    node, port = parse_tensor(loss)
    flow = _settled(lambda: _Flow(ir, set(sources), towers=set(splits)), node)
    states = flow.states
    found = _port(states[node], port)
    if isinstance(found, Curved):
        found = found.mixed()
    if isinstance(found, Mixed):
        return found.node, found.reason
    for name, state in states.items():
        if NORM in (state if isinstance(state, list) else [state]):
            return _norm_source(flow, name), ("takes statistics of the tower's part of the "
                                              "batch (batch norm in training mode)")
        op = ir.op(name)
        if op in ("Max", "Min") and state is None and type(
                _port(states.get(ir.input(name, 0)[0]), ir.input(name, 0)[1])) is int:
            return name, f"takes the {op} over the tower's part of the batch"
    if found != AGGREGATE:
        return node, "is not shown a sum or mean of per-example terms"
    if flow.degree(node, port) == 1:  # averaged twice (towers, then replicas): 1/N of it
        return node, ("is a sum over the tower's part, not a mean: the towers' gradients and "
                      "then the replicas' are averaged, so it would train with 1/N of one "
                      "device's gradient")
    return None


def _settled(make_flow, node: str) -> "_Flow":
    """A flow ``make_flow()`` makes, run to ``node`` with its legacy loops settled: rerun with
    each loop Merge forced to the join of what enters it and what its back edge brought, until
    none brings another (graphxform/loop_mixing.py); a Merge that will not settle is unknown."""
    forced = {}
    for _ in range(loop_mixing.MAX_ROUNDS):
        flow = make_flow()
        flow.forced = dict(forced)
        flow.run(node)
        if not flow.unsettled:
            return flow
        forced.update(flow.forced)
        forced.update(flow.unsettled)
    unsettled = flow.unsettled
    flow = make_flow()
    flow.forced = {**forced, **dict.fromkeys(unsettled, (UNKNOWN, None))}
    flow.run(node)
    return flow


class _Flow:
    def __init__(self, ir, sources: set, seeds: dict | None = None, towers=frozenset()):
        self.ir, self.sources = ir, sources
        self.towers = towers  # tower code's splits of the batch (tower_flow)
        self.seeds = seeds or {}  # a function body's arguments: name -> (state, degree)
        self.states = {}
        self.degrees = {}  # node -> its degree in the batch's size (or a list, one per port)
        self.filled = set()  # per-example nodes whose rows hold no example's values (ones)
        self.called = {}  # call node -> its outputs' degrees, from its function's body
        self.consts = {}  # node -> its integer values (replica_values.const_ints)
        self.port_ints = {}  # (node, port) -> values worked out from shapes (broadcasting)
        self.sparse_indices = set()  # sparse_placeholders' indices (mixing_in)
        self.loss_divisions = set()  # divisions on the loss's way from its terms (mixing_in)
        self.selected = set()  # per-example nodes holding the rows a mask of the batch keeps
        self.lengths = {}  # (node, port) -> the count its length is, where the batch's values
        # decide it (_value_sized), carried through ops that keep the length (_carry_length)
        self.inputs_of = {}  # node -> ir.inputs(node), which working out its state reads thrice
        self.worked_ranks = {}  # (node, port) -> its rank where no shape is recorded
        # (_rank_beside_shapeless)
        # legacy while loops (graphxform/loop_mixing.py): each loop Merge's (state, degree),
        # given by an earlier round of _settled or else assumed from what enters the loop;
        # ``unsettled``: the Merges whose back edge brought another, with the joined one
        self.forced, self.unsettled = {}, {}

    def inputs(self, name: str) -> list:
        """``ir.inputs(name)``, read once per node (the list is shared: never change it)."""
        found = self.inputs_of.get(name)
        if found is None:
            found = self.inputs_of[name] = self.ir.inputs(name)
        return found

    def run(self, target: str) -> dict:
        """States of ``target`` and its data ancestors, each worked out after its inputs; a
        legacy loop's body, reached round its back edges, after the loop (see _settled)."""
        checked = set()
        self._walk([target])
        while True:
            merge = next((m for m in self.forced if m in self.states and m not in checked), None)
            if merge is None:
                return self.states
            checked.add(merge)
            back = loop_mixing.back_inputs(self.ir, self.inputs(merge))
            self._walk([src for src, _ in back])
            state, degree = self.forced[merge]
            for src, port in back:
                came = _port(self.states[src], port)
                joined = (loop_mixing.join(state, came),
                          loop_mixing.join_degree(state, degree, came, self.degree(src, port)))
                if joined != (state, degree):
                    self.unsettled[merge] = joined

    def _walk(self, stack: list) -> None:
        states = self.states
        expanded = set()
        while stack:
            name = stack[-1]
            if name in states:
                stack.pop()
            elif name in expanded or name in self.sources or name in self.seeds:
                stack.pop()
                states[name] = self._scaled(name, self._state(name))
                if type(states[name]) is int and any(
                        src in self.selected for src, _ in self.inputs(name)):
                    self.selected.add(name)  # a selection's rows, carried on
                elif self.lengths and type(states[name]) is not int:
                    _carry_length(self, name)
            else:
                expanded.add(name)
                inputs = self.inputs(name)
                if loop_mixing.is_loop_merge(self.ir, name):
                    inputs = loop_mixing.entry_inputs(self.ir, inputs)  # the body comes after
                stack.extend(src for src, _ in inputs if src not in states and src not in expanded)

    def _state(self, name: str):
        if name in self.sources:
            return 0
        if name in self.seeds:
            return self.seeds[name][0]
        ir = self.ir
        op = ir.op(name)
        inputs = self.inputs(name)
        if loop_mixing.is_loop_merge(ir, name):
            return self._loop_merge(name, inputs)
        found = [_port(self.states.get(src, UNKNOWN), port) for src, port in inputs]
        if any(isinstance(s, sampled_logits.Stacked) for s in found):
            return sampled_logits.state_of(self, name, op, inputs, found)
        if op in _SHAPE_RULES:
            return _SHAPE_RULES[op](self, name, found)
        if op in VALUE_SIZED_OPS and any(s is not None for s in found):
            _value_sized(self, name, op, found)  # before mixing: a mixed mask's count is mixed
        if found and found[0] == UNKNOWN and inputs[0] in self.lengths:
            counted = _over_counted_rows(_Node(self, name, op, inputs, found),
                                         self.lengths[inputs[0]])
            if counted is not None:
                return counted
        mixed = next((s for s in found if isinstance(s, Mixed)), None)
        if mixed is not None:
            return mixed
        if op in ("Switch", "RefSwitch") and len(found) == 2 and found[1] is None:
            return found[0]  # a legacy cond's branch, on an unchanging predicate
        if op in ("Merge", "RefMerge") and not loop_mixing.is_loop_merge(ir, name):
            joined = functools.reduce(loop_mixing.join, found)  # a legacy cond (see _joined)
            if joined != UNKNOWN:
                return [joined, None]
        if op == "IdentityN":
            return found
        if op in loop_mixing.LOOP_PASS_OPS:
            return found[0]
        if op in _CALLS and any(s is not None for s in found):
            return _call(self, name, op, inputs, found)
        if op in ("NextIteration", "Enter", "Exit", "Merge", "Switch", *_CALLS):
            return UNKNOWN if any(s is not None for s in found) else None
        if all(s is None for s in found):
            return None
        if self.over_whole_batch(name, found):
            found = [found[0], None]  # the whole batch's total (global-denominators)
        ratio = next((s for s in found if isinstance(s, Ratio)), None)
        if ratio is not None:
            found = _through_ratio(self, name, op, inputs, found)
            if not isinstance(found, list):
                return found
            if all(s is None for s in found):
                return ratio
        curved = _curved(_Node(self, name, op, inputs, found))
        if curved is not None:
            return curved
        if op in _SIZE_RULES and all(s is None or s == SIZE or isinstance(s, Shape)
                                     for s in found):
            return _SIZE_RULES[op](_Node(self, name, op, inputs, found))
        rule = _RULES.get(op)
        if rule is None:
            rule = (_pass if op in PASS_OPS else _elementwise if op in ELEMENTWISE_OPS else
                    _per_example if op in PER_EXAMPLE_OPS else _reduce if op in REDUCE_OPS else
                    None)
        if rule is None:
            # an op no rule covers (a matrix inverse) of statistics of the batch alone: not
            # shown linear in them
            if AGGREGATE in found and all(s in (None, SIZE, AGGREGATE) for s in found):
                return Curved(name, op, f"applies {op}, which no rule here shows linear, to a "
                              "sum or mean over the batch")
            return UNKNOWN
        return rule(_Node(self, name, op, inputs, found))

    def _loop_merge(self, name: str, inputs: list):
        """A loop variable: the state it was forced to, or that of what enters the loop."""
        if name not in self.forced:
            entries = loop_mixing.entry_inputs(self.ir, inputs)
            state = _port(self.states.get(entries[0][0], UNKNOWN), entries[0][1])
            degree = self.degree(*entries[0])
            for src, port in entries[1:]:
                state = loop_mixing.join(state, _port(self.states.get(src, UNKNOWN), port))
                degree = degree if self.degree(src, port) == degree else None
            self.forced[name] = (state, degree)
        return self.forced[name][0]

    def over_whole_batch(self, name: str, states: list) -> bool:
        """Whether ``name`` divides per-example values by a float total of the batch (or a
        function of its totals) with no rows of the batch, on the loss's way from its terms:
        what global-denominators makes the whole batch's total in every replica (the contract
        finds the same divisions, graphxform.contract.batch_denominators, and refuses those
        no pass made global), so each example's quotient is one device's."""
        if name not in self.loss_divisions or len(states) != 2 or type(states[0]) is not int \
                or not (states[1] == AGGREGATE or isinstance(states[1], Curved)):
            return False
        divisor = self.ir.inputs(name)[1]
        dims = opdefs.recorded_dims(self.ir, *divisor)
        return opdefs.output_dtype(self.ir, *divisor) in _FLOAT_DTYPES and dims is not None \
            and dims[:1] != [-1]

    def _scaled(self, name: str, state):
        """``state``, or a Mixed where the batch's size enters per-example values in a way no
        slice reproduces; records the node's degree in the batch's size (section below)."""
        if state is None or name in self.sources:
            self.degrees[name] = 0
            return state
        if name in self.seeds or name in self.called or name in self.forced:
            self.degrees[name] = (self.seeds[name][1] if name in self.seeds else
                                  self.called[name] if name in self.called else
                                  self.forced[name][1])
            return state
        if state == UNKNOWN or isinstance(state, (Mixed, Curved)):
            return state
        inputs = self.inputs(name)
        n = _Node(self, name, self.ir.op(name), inputs,
                  [_port(self.states.get(src, UNKNOWN), port) for src, port in inputs])
        degree = _degree(n, state, [self.degree(src, port) for src, port in inputs])
        if isinstance(degree, Mixed):
            return degree
        self.degrees[name] = degree
        filled = [src in self.filled for (src, _), s in zip(inputs, n.states) if type(s) is int]
        if type(state) is int and (n.op in LIKE_OPS or (all(filled) if filled else
                                                         n.op in _FILLS)):
            self.filled.add(name)
        elif state == AGGREGATE and n.op in ("Sum", "Mean") and inputs[0][0] in self.filled \
                and inputs[0][0] not in self.selected:
            return SIZE  # the count of rows of a constant (tf.compat.v1.losses' num_present)
        return state

    def degree(self, src: str, port: int):
        """The degree of output ``port`` of ``src`` in the batch's size, or None (unknown)."""
        if _port(self.states.get(src, UNKNOWN), port) is None:
            return 0
        return _port(self.degrees.get(src), port)

    def dims(self, src: str, port: int):
        """The dimensions (-1: unknown) of output ``port`` of ``src`` that the graph records
        (``_output_shapes``, or a placeholder's shape), or None."""
        attrs = self.ir.attrs(src)
        shapes = attrs.get("_output_shapes")
        if shapes is not None and port < len(shapes.list.shape):
            shape = shapes.list.shape[port]
        elif "shape" in attrs and self.ir.op(src) in ("Placeholder", "PlaceholderWithDefault"):
            shape = attrs["shape"].shape
        else:
            return None
        return None if shape.unknown_rank else [d.size for d in shape.dim]

    def rank(self, src: str, port: int):
        dims = self.dims(src, port)
        return self.worked_ranks.get((src, port)) if dims is None else len(dims)

    def ints(self, src: str, port: int = 0):
        found = self.port_ints.get((src, port))
        return found if found is not None else replica_values.const_ints(self.ir, src,
                                                                         self.consts)


class _Node:
    """What a rule sees: the node's inputs' states, their ranks, attrs and Const inputs."""

    def __init__(self, flow: _Flow, name: str, op: str, inputs: list, states: list):
        self.flow, self.name, self.op, self.inputs, self.states = flow, name, op, inputs, states

    def rank(self, k: int):
        return self.flow.rank(*self.inputs[k]) if k < len(self.inputs) else None

    def out_rank(self, port: int = 0):
        return self.flow.rank(self.name, port)

    def ints(self, k: int):
        return self.flow.ints(*self.inputs[k]) if k < len(self.inputs) else None

    def attr(self, key: str):
        return self.flow.ir.attrs(self.name).get(key)

    def flag(self, key: str) -> bool:
        value = self.attr(key)
        return bool(value.b) if value is not None else False

    def mixed(self, reason: str) -> Mixed:
        return Mixed(self.name, self.op, reason)

    def fixed_rows(self, at: list) -> Mixed | None:
        """Mixed where a batch-free operand lines its rows up with the examples in a number
        the graph fixes while the batch's size is free (``tf.range(16)`` stacked beside
        actions fed as ``[None]``): the graph runs with a batch of that size only, and each
        replica's slice would meet all of those rows. ``at``: (operand, its axis facing the
        examples) pairs; an operand of one row there broadcasts and is not counted. (With a
        fixed batch, split-inputs rewrites what TF folded from it, and TF's import check
        rejects what it could not.)"""
        flow = self.flow
        for k, state in enumerate(self.states):
            if type(state) is int:
                dims = flow.dims(*self.inputs[k])
                if dims is None or state >= len(dims) or dims[state] != -1:
                    return None
        for k, axis in at:
            dims = flow.dims(*self.inputs[k])
            if self.states[k] is None and dims is not None and 0 <= axis < len(dims) \
                    and dims[axis] > 1:
                rows, source = dims[axis], self.inputs[k][0]
                return Mixed(self.name, self.op, f"lines each example up with a row of "
                             f"'{source}', whose {rows} rows the graph fixes while the batch's "
                             f"size is free: it runs with a batch of {rows} only",
                             f"each replica's slice would meet all {rows} rows: build "
                             f"'{source}' from the batch's size (tf.range(tf.shape(x)[0]) "
                             f"rather than tf.range({rows})), or train on one device")
        return None

    def axis(self, value: int, rank):
        return value if value >= 0 else None if rank is None else value + rank


def _rows(states) -> list:
    return [s for s in states if type(s) is int]


def _statistic(states):
    """The first batch statistic among ``states`` that is not batch norm's, else NORM if one
    is, else None."""
    if AGGREGATE in states:
        return AGGREGATE
    return NORM if NORM in states else None


# ------------------------------------------------- non-linear functions of statistics
# Averaging gradients across replicas is exact for a loss that is linear in the batch's sums
# and means (a mean of per-example terms plus what does not read the batch). These ops are
# not linear in an operand that is such a sum or mean; what no list here names keeps the
# rules below (unknown ops stay unknown, never mixed).
_NONLINEAR_OPS = frozenset({
    *ELEMENTWISE_UNARY_OPS, "Maximum", "Minimum", "ClipByValue", "Pow", "SquaredDifference",
    "Xlogy", "Xdivy", "Xlog1py", "Atan2", "FloorDiv", "FloorMod", "Mod", "TruncateDiv",
    "TruncateMod", "Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual",
    "Max", "Min", "Prod", "EuclideanNorm", "All", "Any", "L2Loss", "Softmax", "LogSoftmax",
    "Sigmoid", "Softplus", "TopKV2", "TopK", "ArgMax", "ArgMin", "Cumprod", *_FAKE_QUANT_OPS})
# linear in each operand alone: a product of two statistics is not
_BILINEAR_OPS = frozenset({"Mul", "MulNoNan", "MatMul", "BatchMatMul", "BatchMatMulV2",
                           "BatchMatMulV3", "Einsum"})
_DIVISIONS = frozenset({"RealDiv", "Div", "DivNoNan", "TrueDiv"})


def _curved(n: _Node):
    """The state of a node that applies a non-linear function to a sum or mean over the batch
    or reads one that does (see Curved), or None when the other rules decide. A ratio of a
    batch sum to such a function of sums (sum(w * l) / max(sum(w), 1)) is a sum:
    global-denominators makes every replica divide by the whole batch's denominator."""
    states = n.states
    curved = next((s for s in states if isinstance(s, Curved)), None)
    if any(type(s) is int for s in states):
        if curved is not None:
            return n.mixed("combines each example with a non-linear function of a sum or mean "
                           f"over the batch, made at '{curved.node}' ({curved.op})")
        return None
    if curved is not None:
        if n.op in _DIVISIONS and len(states) == 2 and states[0] == AGGREGATE and \
                states[1] is curved:
            return AGGREGATE
        return curved
    if AGGREGATE not in states:
        return None
    if NORM in states:  # batch norm's statistics beside the batch's sum: not batch norm
        source = _norm_source(n.flow, n.inputs[states.index(NORM)][0])
        return Curved(source, n.flow.ir.op(source), "takes statistics of the batch "
                      "(tf.nn.moments) that the loss adds to a sum or mean over it, outside any "
                      "normalisation of its examples")
    statistics = [s == AGGREGATE for s in states]
    if n.op in _NONLINEAR_OPS:
        return Curved(n.name, n.op)
    if n.op in _BILINEAR_OPS and sum(statistics[:2]) > 1:
        return Curved(n.name, n.op)
    if n.op in _DIVISIONS and len(states) == 2 and statistics == [False, True]:
        # 1 / sum; over a numerator no rule here knows (a sum after a loop, most likely: a
        # masked mean), unknown: global-denominators' case if it is a sum
        return UNKNOWN if states[0] == UNKNOWN else Ratio(n.name) if states[0] == SIZE else \
            Curved(n.name, n.op)
    return None


def _through_ratio(flow: _Flow, name: str, op: str, inputs: list, states: list):
    """``states`` with each Ratio read as holding nothing of the batch where it is the whole
    batch's ratio (divided on the loss's way from its terms, where global-denominators makes
    its total the whole batch's for every reader) and ``op`` carries it the way the contract's
    search for denominators follows a loss's terms (graphxform.contract.batch_denominators):
    added, multiplied, as a dividend, summed, or reshaped and cast as a weight. Elsewhere a
    Curved, so what no pass makes global is never taken for linear; a Mixed where a ratio
    that stays each replica's own slice's meets the examples (scales the model's input)."""
    from graphxform.replica_values import LOSS_TERM_OPS, WEIGHT_OPS
    at = [k for k, s in enumerate(states) if isinstance(s, Ratio)]
    source = inputs[at[0]][0]
    own = next((states[k].node for k in at if states[k].node not in flow.loss_divisions), None)
    what = "a count of the batch over a total of its values" + (
        f" ('{own}')" if own != source else "")
    if own is not None and any(type(s) is int for s in states):
        return Mixed(name, op, f"combines each example with '{source}', {what} off the "
                     "loss's way from its terms, which each replica would compute over its "
                     "own slice, not the whole batch")
    if own is not None:
        return Curved(name, op, f"applies {op} to '{source}', {what} off the loss's way from "
                      "its terms, which each replica would compute over its own slice")
    if op in LOSS_TERM_OPS or (at == [0] and (op in _DIVISIONS or op in WEIGHT_OPS
                                              or op in ("Sum", "Mean"))):
        return [None if isinstance(s, Ratio) else s for s in states]
    return Curved(name, op, f"applies {op} to '{source}', a count of the batch over a total of "
                  "its values, other than as a weight of its examples")


def _norm_source(flow: _Flow, name: str) -> str:
    """The op that took the batch norm statistics ``name`` holds (tf.nn.moments' Mean, a
    FusedBatchNorm): back through inputs that hold them too."""
    while True:
        found = next((src for src, port in flow.ir.inputs(name)
                      if _port(flow.states.get(src), port) == NORM), None)
        if found is None:
            return name
        name = found


# --------------------------------------------------------------------- rules
# Each takes a _Node whose inputs are neither mixed nor all free of the batch.

def _pass(n: _Node):
    return n.states[0]


def _rank_beside_shapeless(n: _Node):
    """The rank of a broadcast whose only operands of unknown rank hold nothing of the batch:
    a keep_prob or temperature placeholder built without a shape
    (``tf.compat.v1.placeholder(tf.float32, name="dropout_keep_prob")``, fed a scalar), read
    as adding no axes, so the batch stays where its operands hold it. Left unknown, the
    flow lost the batch at every dropout of such a keep_prob, and the in-batch negatives or
    batch statistics after it were never seen (apply exited 0); fed a tensor of higher rank,
    which no such recipe does, the batch would move, and a refusal could be false."""
    ranks = [n.rank(k) for k in range(len(n.states))]
    if any(rank is None and state is not None for rank, state in zip(ranks, n.states)):
        return None
    known = [rank for rank in ranks if rank is not None]
    if not known:
        return None
    n.flow.worked_ranks[(n.name, 0)] = max(known)
    return max(known)


def _elementwise(n: _Node):
    """Broadcasting ops: rows meet rows only on one axis, and never a batch statistic."""
    out = n.out_rank()
    if out is None:
        out = _rank_beside_shapeless(n)
    axes = set()
    for k, state in enumerate(n.states):
        if type(state) is int:
            rank = n.rank(k)
            if out is None or rank is None:
                return UNKNOWN
            row_condition = n.op == "Select" and k == 0 and rank == 1  # v1: picks whole rows
            axes.add(state if row_condition else state + out - rank)
    if len(axes) > 1:
        return n.mixed("pairs examples with each other: its operands hold the batch on "
                       "different axes (as x[:, None] - x[None, :] does)")
    if UNKNOWN in n.states:
        return UNKNOWN
    stat = _statistic(n.states)
    if axes:
        if stat == AGGREGATE:
            return n.mixed("combines each example with a sum or mean over the batch (a "
                           "statistic of the batch that is not batch norm's)")
        axis = axes.pop()
        fixed = n.fixed_rows([(k, axis - out + n.rank(k)) for k, s in enumerate(n.states)
                              if s is None and n.rank(k) is not None])
        return fixed or axis
    return stat or SIZE


def _per_example(n: _Node):
    """Convolutions, pools, batch norm, per-example losses: axis 0 of the data input. A cross
    entropy of logits summed over the batch (one example whose rows an input's unknown axis 0
    holds: ``reduce_sum(matmul(x, w), 0)``) is non-linear in that sum: a replica's is not its
    share of one device's."""
    if n.op in CROSS_ENTROPY_OPS and (n.states[0] == AGGREGATE or isinstance(n.states[0], Curved)):
        return n.states[0] if isinstance(n.states[0], Curved) else Curved(n.name, n.op)
    if n.states[0] != 0 or any(s not in (None, SIZE, 0) for s in n.states[1:]):
        return UNKNOWN
    if n.op.startswith("FusedBatchNorm"):
        return [0, NORM, NORM, NORM, NORM, NORM]
    return 0


def _reduce(n: _Node):
    state, rank = n.states[0], n.rank(0)
    if n.states[1] not in (None,):
        return UNKNOWN
    if type(state) is not int:
        return state
    axes = _reduction_axes(n, rank)
    if axes is None:
        return UNKNOWN
    if axes == "all" or state in axes:
        if n.op in ("Sum", "Mean"):
            return NORM if _batch_norm_moments(n, axes, rank) else AGGREGATE
        if n.op in ("Max", "Min") and n.attr("T") is not None and \
                n.attr("T").type in _INTEGER_DTYPES:
            return None  # the batch's longest sequence: global-extremes makes it the whole
            # batch's in every replica (where it shapes the loss; ps refuses it there)
        return n.mixed(f"takes the {n.op} over the batch: each replica would take its own "
                       "slice's")
    return state if n.flag("keep_dims") else state - sum(a < state for a in axes)


def _batch_norm_moments(n: _Node, axes, rank) -> bool:
    """Whether ``n`` is tf.nn.moments' mean or variance as batch norm takes them: of an
    activation the model's variables compute, over every axis but its features (kept). Moments
    of data (rewards, regression targets) or of per-example losses standardise the examples by
    the batch, which mixes them: advantage normalisation is no batch norm."""
    if not n.name.endswith(_MOMENTS) or rank is None or rank < 2 or axes == "all" \
            or rank - 1 in axes:
        return False
    from graphxform.training import VARIABLE_OPS
    ir = n.flow.ir
    return any(ir.op(src) in VARIABLE_OPS for src in ir.value_sources(n.inputs[0][0]))


def _reduction_axes(n: _Node, rank):
    """The reduced axes (a list), "all", or None when unknown."""
    values = n.ints(1)
    ir = n.flow.ir
    if values is None:
        src = n.inputs[1][0]
        if ir.op(src) == "Range" and len(ir.inputs(src)) == 3:
            limit = ir.inputs(src)[1][0]
            if ir.op(limit) == "Rank" and ir.inputs(limit)[0] == n.inputs[0]:
                return "all"
        return None
    axes = [n.axis(v, rank) for v in values]
    return None if None in axes else axes


def _arg_reduce(n: _Node):
    state, rank = n.states[0], n.rank(0)
    if type(state) is not int:
        return UNKNOWN if state == UNKNOWN else state
    values = n.ints(1)
    axis = n.axis(values[0], rank) if values and len(values) == 1 else None
    if axis is None:
        return UNKNOWN
    if axis == state:
        return n.mixed(f"takes the {n.op} over the batch axis")
    return state - (axis < state)


def _matmul(n: _Node):
    """Rows of a (or columns of b) stay rows; the batch on both sides either sums over it
    (contracted) or pairs every example with every other (an outer product)."""
    a, b = n.states[0], n.states[1]
    if UNKNOWN in (a, b):
        return UNKNOWN
    free_a, free_b = (1 if n.flag("transpose_a") else 0), (0 if n.flag("transpose_b") else 1)
    stat = _statistic([a, b])
    if type(a) is int and type(b) is int:
        if a == free_a and b == free_b:
            return n.mixed("pairs every example with every other (a product of two batch "
                           "tensors over a feature axis, as in-batch negatives compute)")
        if a != free_a and b != free_b:
            return AGGREGATE  # a sum over the batch
        return UNKNOWN
    rows = a if type(a) is int else b
    if type(rows) is not int:
        return stat or SIZE
    if stat == AGGREGATE:
        return n.mixed("multiplies examples by a sum or mean over the batch")
    if type(a) is int:
        return 0 if a == free_a else _contracted(n, 1)
    return 1 if b == free_b else _contracted(n, 0)


def _contracted(n: _Node, other: int) -> Mixed:
    """A product whose batch axis meets a batch-free operand's axis (input ``other``) and is
    summed away: each output adds up examples weighted by that operand, one weight per example
    (a GCN's fixed adjacency times the node features, where the nodes are the batch). A slice
    cannot meet a matrix sized for the whole batch."""
    return Mixed(n.name, n.op, f"sums over the examples of its batch weighted by "
                 f"'{n.inputs[other][0]}', one weight per example (message passing over one "
                 "whole graph, its adjacency times the node features, with the graph's nodes "
                 "as the batch)", "each replica's slice of the nodes would meet the adjacency "
                 "of the whole graph: give each example its own graph (a padded adjacency per "
                 "example, batched matmul), or train on one device")


def _sparse_dense_matmul(n: _Node):
    """SparseTensorDenseMatMul(a_indices, a_values, a_shape, b): a batch-free sparse matrix
    times b as MatMul's rule says; a sparse input's rows (its entries' examples) times a
    batch-free b stay the examples."""
    a, b = n.states[:3], n.states[3]
    adjoint_a, adjoint_b = n.flag("adjoint_a"), n.flag("adjoint_b")
    if all(s is None for s in a) and type(b) is int:
        return 1 if b == (0 if adjoint_b else 1) else _contracted(n, 0)
    if b is None and a[0] == 0 and a[1] in (0, None) and a[2] in (None, Shape(0)) and \
            n.inputs[0][0] in n.flow.sparse_indices:
        return 0 if not adjoint_a else _contracted(n, 3)
    if a[0] == 0 and n.inputs[0][0] in n.flow.sparse_indices and type(b) is int and \
            b == (1 if adjoint_b else 0):
        # a sparse input's columns meet the examples (Kipf's GCN feeds its adjacency so)
        return _contracted(n, 0)
    return UNKNOWN


def _batch_matmul(n: _Node):
    """BatchMatMul: the batch on the same leading axis of both (or one) operands stays there;
    on the matrix axes it behaves as in MatMul."""
    a, b = n.states[0], n.states[1]
    ra, rb, out = n.rank(0), n.rank(1), n.out_rank()
    if out is None and None not in (ra, rb) and min(ra, rb) >= 2:  # no shape recorded
        out = n.flow.worked_ranks[(n.name, 0)] = max(ra, rb)  # (tf.matmul of a rank worked out)
    if UNKNOWN in (a, b) or None in (ra, rb, out) or _statistic([a, b]) == AGGREGATE:
        return UNKNOWN
    aligned = [s + out - r for s, r in ((a, ra), (b, rb)) if type(s) is int]
    if any(x >= out - 2 for x in aligned):
        adj_a = n.flag("adj_x") or n.flag("adj_a")
        adj_b = n.flag("adj_y") or n.flag("adj_b")
        if all(type(s) is int for s in (a, b)):
            free_a = out - 1 if adj_a else out - 2
            free_b = out - 2 if adj_b else out - 1
            if a + out - ra == free_a and b + out - rb == free_b:
                return n.mixed("pairs every example with every other (a product of two batch "
                               "tensors over a feature axis)")
        return UNKNOWN
    if len(set(aligned)) != 1:
        return n.mixed("pairs examples with each other: its operands hold the batch on "
                       "different axes")
    return aligned[0]


def _einsum(n: _Node):
    """Einsum: the batch's letter in each operand's subscripts; two letters both left in the
    output pair examples ("ik,jk->ij"), one summed away adds them up."""
    equation = n.attr("equation")
    text = equation.s.decode() if equation is not None else ""
    if "->" not in text or "." in text or UNKNOWN in n.states:
        return UNKNOWN
    terms, out = text.replace(" ", "").split("->")
    terms = terms.split(",")
    letters = set()
    for k, state in enumerate(n.states):
        if type(state) is int:
            if k >= len(terms) or state >= len(terms[k]):
                return UNKNOWN
            letters.add(terms[k][state])
    if not letters:
        return _statistic(n.states) or SIZE
    if _statistic(n.states) == AGGREGATE:
        return n.mixed("multiplies examples by a sum or mean over the batch")
    if len(letters) > 1:
        return n.mixed("pairs examples with each other (the batch under different subscripts: "
                       f"'{text}')")
    (letter,) = letters
    return out.index(letter) if letter in out else AGGREGATE


def _roll(n: _Node):
    """Roll(input, shift, axis): rolling along the batch moves examples into others' places."""
    state, rank = n.states[0], n.rank(0)
    if type(state) is not int or any(s is not None for s in n.states[1:]):
        return UNKNOWN
    values = n.ints(2)
    axes = [n.axis(v, rank) for v in values] if values is not None else [None]
    if None in axes:
        return UNKNOWN
    return n.mixed("rolls the examples of the batch into each other's places") \
        if state in axes else state


def _last_axis(n: _Node):
    """Softmax, TopK, sort: over the last axis; over the batch when that is its axis."""
    state, rank = n.states[0], n.rank(0)
    if type(state) is not int:
        return state
    if rank is None:
        return UNKNOWN
    if state == rank - 1:
        what = ("ranks the examples of the batch (tf.nn.top_k or tf.sort over the batch axis)"
                if n.op.startswith("TopK") else f"normalises over the batch axis ({n.op})")
        return n.mixed(what)
    return state


def _along_axis(what: str):
    """Ops that work along one Const axis (input 1): over the batch, they mix it."""
    def rule(n: _Node):
        state, rank = n.states[0], n.rank(0)
        if type(state) is not int:
            return state if state != UNKNOWN else UNKNOWN
        values = n.ints(1)
        if values is None:
            return UNKNOWN
        if n.op == "Reverse":  # a bool per axis
            values = [k for k, flag in enumerate(values) if flag]
        axes = [n.axis(v, rank) for v in values]
        if None in axes:
            return UNKNOWN
        return n.mixed(what) if state in axes else state
    return rule


def _shuffle(n: _Node):
    if type(n.states[0]) is int and n.states[0] == 0:
        return n.mixed("shuffles the examples of the batch")
    return UNKNOWN


def _broadcast_to(n: _Node):
    value, out, rank = n.states[0], n.out_rank(), n.rank(0)
    if type(value) is int:
        return UNKNOWN if out is None or rank is None else value + out - rank
    return UNKNOWN


def _tile(n: _Node):
    """Keeps the batch where the batch's axis is tiled once; repeating the examples as many
    times as the batch has (the rows of a pairwise distance matrix) meets each with every
    other."""
    state = n.states[0]
    if type(state) is not int:
        return UNKNOWN
    if n.states[1] == SIZE or isinstance(n.states[1], Shape):
        return n.mixed("repeats the examples as many times as the batch has (tf.tile by "
                       "tf.shape(x)[0], the rows of a pairwise matrix): it meets every example "
                       "with every other")
    multiples = n.ints(1)
    if multiples is None and n.states[1] is None:  # tf.tile(q[:, None], [1, tf.shape(h)[1], 1])
        return state if _entry(n, 1, state) == 1 else UNKNOWN
    return state if multiples and state < len(multiples) and multiples[state] == 1 else UNKNOWN


def _reshape(n: _Node):
    """Keeps the batch on axis 0 when both shapes lead with the same dimension (unknown, -1,
    or the batch's fixed size), or the new one merges the leading dimensions into axis 0
    (each example's rows stay together, in order). A reshape to the shape it had keeps the
    batch where it is (tf.tensordot reshapes a transposed batch so): the shapes are equal and
    known but for one dimension, or the new one has the batch's size where the batch is and,
    but for a matrix (where the count of elements fixes the other dimension), the other
    dimensions it had."""
    state = n.states[0]
    if type(state) is not int:
        return state if n.states[1] in (None, SIZE) or isinstance(n.states[1], Shape) \
            else UNKNOWN
    before, after = n.flow.dims(*n.inputs[0]), n.flow.dims(n.name, 0)
    if not before or not after:
        return UNKNOWN
    if before == after and before.count(-1) <= 1:
        return state
    others = before[:state] + before[state + 1:]
    if (n.states[1] == Shape(state) and len(after) == len(before) and -1 not in others
            and (len(before) == 2 or after[:state] + after[state + 1:] == others)):
        return state
    if state != 0:
        return UNKNOWN
    if before[0] == after[0]:
        return 0
    if before[0] == -1 and len(after) > len(before) and after[0] > 1 and -1 in after[1:]:
        return n.mixed(f"groups the examples of the batch by position (a reshape of its axis "
                       f"into [{after[0]}, -1, ...], as a minibatch-stddev layer does): a "
                       "replica's slice makes other groups")
    merged = 1
    for dim in before:
        merged *= dim
        if merged == after[0] and dim > 0:
            return 0
        if merged <= 0:
            break
    return UNKNOWN


def _expand_dims(n: _Node):
    state = n.states[0]
    if type(state) is not int:
        return state
    values, rank = n.ints(1), n.rank(0)
    if not values or rank is None:
        return UNKNOWN
    axis = n.axis(values[0], rank + 1)
    return state + 1 if axis <= state else state


def _squeeze(n: _Node):
    state = n.states[0]
    if type(state) is not int:
        return state
    dims = list(n.attr("squeeze_dims").list.i) if n.attr("squeeze_dims") is not None else []
    rank = n.rank(0)
    axes = [n.axis(d, rank) for d in dims]
    if not dims or None in axes or state in axes:
        return UNKNOWN
    return state - sum(a < state for a in axes)


def _transpose(n: _Node):
    state = n.states[0]
    if type(state) is not int:
        return state
    perm = n.ints(1)
    return perm.index(state) if perm and state in perm else UNKNOWN


def _concat(n: _Node):
    rows = set(n.states[:-1])
    if len(rows) == 1 and type(next(iter(rows))) is int:
        return rows.pop()  # along the batch (batches joined) or beside it
    batch = _rows(rows)
    if len(batch) == 1 and rows == {batch[0], None}:  # batch-free parts beside the examples
        axis = n.ints(len(n.states) - 1)
        if axis and n.axis(axis[0], n.rank(0)) not in (None, batch[0]):
            parts = range(len(n.states) - 1)
            if _same_row_for_each(n, parts, batch[0]):
                return batch[0]
            return n.fixed_rows([(k, batch[0]) for k in parts]) or UNKNOWN
        if axis:  # the examples' rows ahead of batch-free ones (nce_loss's lookup)
            return sampled_logits.concat_state(n.inputs[:-1], n.states[:-1],
                                             n.axis(axis[0], n.rank(0))) or UNKNOWN
    return UNKNOWN


def _same_row_for_each(n: _Node, parts, axis: int) -> bool:
    """Whether, in a graph whose batch is fixed, every batch-free part of ``parts`` has as
    many rows (along ``axis``) as the examples and the same value in each: a zero state of
    the fixed batch's shape beside each example (the PTB tutorial's LSTM, unrolled, its first
    state ``tf.zeros([batch_size, hidden])``). Each example meets the same row, and
    split-inputs gives each replica as many such rows as its slice has examples."""
    from graphxform.nodes import const_value
    flow, sizes = n.flow, set()
    for k in parts:
        dims = flow.dims(*n.inputs[k])
        if dims is None or axis >= len(dims) or dims[axis] < 0:
            return False
        sizes.add(dims[axis])
        if n.states[k] is not None:
            continue
        src = n.inputs[k][0]
        if flow.ir.op(src) == "Fill":
            continue  # of one scalar value
        value = const_value(flow.ir, src)
        if value is None or value.size == 0 or not (value == value.flat[0]).all():
            return False
    return len(sizes) == 1


def _pack(n: _Node):
    rows = set(n.states)
    batch = _rows(rows)
    if len(batch) == 1 and rows == {batch[0], None}:  # equal shapes: the rows line up
        return n.fixed_rows([(k, batch[0]) for k in range(len(n.states))]) or UNKNOWN
    if len(rows) != 1 or type(next(iter(rows))) is not int:
        return UNKNOWN
    state = rows.pop()
    rank = n.rank(0)
    value = n.attr("axis")
    axis = n.axis(value.i if value is not None else 0, None if rank is None else rank + 1)
    if axis is None:
        return UNKNOWN
    return state + 1 if axis <= state else state


def _unpack_or_split(value_at: int, axis_from: str):
    def rule(n: _Node):
        state, rank = n.states[value_at], n.rank(value_at)
        if type(state) is not int or any(s is not None for k, s in enumerate(n.states)
                                         if k != value_at):
            return UNKNOWN
        if axis_from == "attr":
            value = n.attr("axis")
            axis = n.axis(value.i if value is not None else 0, rank)
            if axis is None or axis == state:
                return UNKNOWN
            return state - (axis < state)
        values = n.ints(0 if n.op == "Split" else 2)
        axis = n.axis(values[0], rank) if values else None
        if axis == state and (n.name in n.flow.towers or _one_part(n)):
            return state  # each part is its tower's batch (tower_flow)
        if axis == state:
            return n.mixed("splits the batch into parts by position (tf.split along the "
                           "batch axis): on a replica's slice each part holds other examples, "
                           "so what pairs or weighs the parts pairs others")
        return state if axis is not None else UNKNOWN
    return rule


def _one_part(n: _Node) -> bool:
    """A split into one part (``tf.split(x, 1)``, tower code on one tower): the whole."""
    count = n.attr("num_split")
    return count is not None and count.i == 1


_BY_POSITION = ("picks examples of the batch by their position (a slice along the batch "
                "axis)")


def _computed_bounds(n: _Node, batch_axis: int):
    """A slice whose bounds are computed rather than constant: the batch's state where the
    bounds along its axis are begin 0 and an end (Slice: a size) that is the batch's size,
    tf.shape(x)[0] (x[:tf.shape(x)[0]]), or where a Slice's size is, whatever its begin (TF
    then needs begin 0: ``tf.image.random_crop(x, [tf.shape(x)[0], h, w, c])``'s offset);
    Mixed where they are other values known without the batch's values (x[:tf.shape(x)[0] //
    2], a fed count); unknown otherwise."""
    if any(s not in (None, SIZE) and not isinstance(s, Shape) for s in n.states[1:]):
        return UNKNOWN
    bit = 1 << batch_axis
    masked = {key: n.attr(key) is not None and bool(n.attr(key).i & bit)
              for key in ("begin_mask", "end_mask")}  # a StridedSlice's: from the start, to the end
    begin = 0 if masked["begin_mask"] else _entry(n, 1, batch_axis)
    end = _entry(n, 2, batch_axis)
    if n.op == "Slice" and isinstance(end, tuple) and _is_batch_size(n.flow, *end):
        return n.states[0]  # a size of the whole axis leaves begin 0 (tf.image.random_crop)
    if begin == 0 and (masked["end_mask"] or isinstance(end, tuple)
                       and _is_batch_size(n.flow, *end)):
        return n.states[0]
    return n.mixed(_BY_POSITION)


def _entry(n: _Node, k: int, at: int):
    """Entry ``at`` of the 1-D input ``k``: its value when constant, the (node, port) it
    packs there, or None when neither is known."""
    values = n.ints(k)
    if values is not None:
        return values[at] if at < len(values) else None
    src, _ = n.inputs[k]
    if n.flow.ir.op(src) == "Pack" and at < len(n.flow.ir.inputs(src)):
        entry = n.flow.ir.inputs(src)[at]
        found = n.flow.ints(entry[0])
        return found[0] if found is not None and len(found) == 1 else entry
    return None


def _slice(n: _Node):
    state = n.states[0]
    if type(state) is not int:
        return UNKNOWN
    if any(s is not None for s in n.states[1:]):
        return _computed_bounds(n, state)
    begin, size = n.ints(1), n.ints(2)
    if begin is None and size is not None and state < len(size) and size[state] != -1:
        return _sized_slice(n, state, size[state])
    if begin is None or size is None or state >= len(begin):
        return UNKNOWN
    if begin[state] == 0 and size[state] == -1:
        return state
    return _sized_slice(n, state, size[state])


def _sized_slice(n: _Node, state: int, size: int):
    """A Slice of a constant size along the batch axis (from a begin that may be computed: the
    offset ``tf.image.random_crop`` draws): the whole fixed batch keeps each example (TF then
    needs begin 0; split-inputs rebatches the size); fewer rows pick examples by position,
    whatever the begin."""
    dims = n.flow.dims(*n.inputs[0])
    if dims is None or state >= len(dims) or dims[state] < 0:
        return UNKNOWN if n.ints(1) is None else n.mixed(_BY_POSITION)
    return state if size == dims[state] else n.mixed(_BY_POSITION)


def _strided_slice(n: _Node):
    """Walks the slice spec: a new axis adds an output axis, a shrunk one removes an input
    axis, an ellipsis stands for the axes the spec leaves out."""
    state = n.states[0]
    if type(state) is not int:
        return UNKNOWN
    begin, end, strides = n.ints(1), n.ints(2), n.ints(3)
    if any(s is not None for s in n.states[1:]) and strides is not None and _plain(n):
        return _computed_bounds(n, state)  # no masks: spec entry k is axis k
    if any(s is not None for s in n.states[1:]):
        return UNKNOWN
    length = _spec_length(n, begin, end, strides)
    if length is None:
        return UNKNOWN
    masks = {key: (n.attr(key).i if n.attr(key) is not None else 0) for key in (
        "begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")}
    rank = n.rank(0)
    in_axis = out_axis = 0
    for k in range(length):
        bit = 1 << k
        if masks["ellipsis_mask"] & bit:
            if rank is None:
                return UNKNOWN
            covered = rank - sum(1 for j in range(k + 1, len(begin))
                                 if not masks["new_axis_mask"] & (1 << j))
            if in_axis <= state < in_axis + covered:
                return out_axis + state - in_axis
            in_axis += covered
            out_axis += covered
        elif masks["new_axis_mask"] & bit:
            out_axis += 1
        else:
            if in_axis == state:
                whole = ((masks["begin_mask"] & bit or _entry(n, 1, k) == 0)
                         and masks["end_mask"] & bit and _entry(n, 3, k) == 1
                         and not masks["shrink_axis_mask"] & bit)
                if whole:
                    return out_axis
                if begin is None or end is None or strides is None:
                    return UNKNOWN  # a bound the graph computes: which examples is not known
                return n.mixed("picks examples of the batch by their position (x[0], x[:n] "
                               "or a stride along the batch axis)")
            in_axis += 1
            out_axis += 0 if masks["shrink_axis_mask"] & bit else 1
    return out_axis + state - in_axis  # past the spec: kept whole


def _spec_length(n: _Node, begin, end, strides) -> int | None:
    """How many entries a strided slice's spec has: known from its constant begin, end and
    strides, or where the graph computes some of them (``x[:, t]`` in a loop over time
    steps), from the recorded length of those vectors. The walk over the spec then reads the
    batch axis's entries alone, which may still be constant (begin 0, stride 1, or masked)."""
    known = [len(v) for v in (begin, end, strides) if v is not None]
    for k in (1, 2, 3):
        dims = n.flow.dims(*n.inputs[k])
        if dims and len(dims) == 1 and dims[0] >= 0:
            known.append(dims[0])
    return known[0] if known and len(set(known)) == 1 else None


def _plain(n: _Node) -> bool:
    """A strided slice without masks but begin's and end's (spec entry k is axis k), its
    strides all 1."""
    masks = [n.attr(key) for key in ("ellipsis_mask", "new_axis_mask", "shrink_axis_mask")]
    return all(m is None or m.i == 0 for m in masks) and set(n.ints(3)) == {1}


def _gather_within_examples(n: _Node, batch_dims: int):
    """tf.gather(params, indices, batch_dims=k): each example picks among its own rows by
    its own indices (the last output of each sequence, ``gather(outputs, lengths - 1,
    batch_dims=1)``), where both hold the batch on axis 0 and the gather's axis is past it."""
    values = n.ints(2) if n.op == "GatherV2" else [batch_dims]
    axis = n.axis(values[0], n.rank(0)) if values else None
    if n.states[0] == 0 and n.states[1] == 0 and axis is not None and axis >= batch_dims >= 1:
        return 0
    return UNKNOWN


def _gather(n: _Node):
    params, indices = n.states[0], n.states[1]
    batch_dims = n.attr("batch_dims")
    if batch_dims is not None and batch_dims.i:
        return _gather_within_examples(n, batch_dims.i)
    unique = _rows_of_unique(n.flow, *n.inputs[0])
    if unique is not None and n.inputs[1] == (unique, 1) and (
            n.op != "GatherV2" or n.ints(2) == [0]):
        # table[unique(ids)][idx] is table[ids] (embedding_lookup_sparse with weights)
        ids = n.flow.ir.input(unique, 0)
        return _port(n.flow.states.get(ids[0], UNKNOWN), ids[1])
    rp, ri = n.rank(0), n.rank(1)
    if n.op == "GatherV2":
        values = n.ints(2)
        axis = n.axis(values[0], rp) if values else None
    else:
        axis = 0
    if axis is None:
        return UNKNOWN
    if params is None and type(indices) is int:
        return axis + indices
    if params == AGGREGATE and type(indices) is int:
        return n.mixed("gives each example a sum or mean over the batch picked by its own index "
                       "(per-class centroids or counts of the batch, "
                       "tf.math.unsorted_segment_mean, gathered back by label)")
    if type(params) is int:
        if params == axis == 0 and _picked_by_mask(n):
            n.flow.selected.add(n.name)
            return 0  # tf.boolean_mask: the rows a per-example mask keeps, in order
        if params == axis == 0 and type(indices) is int and _within_examples(n):
            return indices  # each example's own rows, example after example
        if params == axis:
            return n.mixed("picks or reorders the examples of the batch by index (a gather "
                           "along the batch axis)")
        if type(indices) is int:
            return n.mixed("looks every example's index up in every example (a gather along "
                           "another axis by per-example indices makes [batch, batch, ...]; "
                           "batch_dims=1 pairs each example with its own)")
        if indices is None and ri is not None:
            return params if params < axis else params + ri - 1
    return UNKNOWN


_ROW_KEEPING = ("Identity", "Cast", "Reshape", "ExpandDims")


def _through(ir, src: str, port: int) -> tuple:
    """Back from ``src:port`` through ops that keep each row's values (casts, reshapes)."""
    while ir.op(src) in _ROW_KEEPING and port == 0:
        src, port = ir.input(src, 0)
    return src, port


def _within_examples(n: _Node) -> bool:
    """Whether a gather along the batch axis picks, for each example, rows of that example
    alone: the params are a reshape merging each example's ``rows`` leading rows into axis 0
    ([batch, rows, ...] to [batch * rows, ...]) and the indices are
    ``tf.range(batch) * rows + offsets`` with per-example offsets (google-research/bert's
    gather_indexes, the last output of a padded RNN: ``range(batch) * max_length + length -
    1``). A replica's range numbers its own examples, so it picks the same rows of the same
    examples as one device. (Offsets outside [0, rows) would reach into a neighbour, one device
    and a replica alike, except at a slice's edge, where the index is out of range.)"""
    ir, flow = n.flow.ir, n.flow
    reshape, port = n.inputs[0]
    while ir.op(reshape) == "Identity" and port == 0:
        reshape, port = ir.input(reshape, 0)
    if ir.op(reshape) != "Reshape" or port != 0:
        return False
    examples = ir.input(reshape, 0)
    before, after = flow.dims(*examples), flow.dims(reshape, 0)
    if _port(flow.states.get(examples[0]), examples[1]) != 0 or not before or not after:
        return False
    merged = len(before) - len(after)  # the axes after the batch's that join it
    if merged < 1 or after[1:] != before[merged + 1:]:
        return False
    total = _sum_operands(ir, *_through(ir, *n.inputs[1]))
    if total is None:
        return False
    for k, (src, port) in enumerate(total):
        offsets = total[1 - k]
        if _port(flow.states.get(offsets[0]), offsets[1]) == 0 and \
                _example_numbers(flow, examples, before[1:merged + 1], *_through(ir, src, port)) \
                and not _numbers_examples(flow, *offsets):
            return True
    return False


def _sum_operands(ir, src: str, port: int):
    """The two operands of an Add, or None."""
    if ir.op(src) not in ("Add", "AddV2") or port != 0:
        return None
    return list(ir.inputs(src))


def _example_numbers(flow: _Flow, examples: tuple, rows: list, src: str, port: int) -> bool:
    """Whether ``src:port`` is ``tf.range(batch) * rows``: each example's number times the
    count of rows it has in ``examples`` (``rows``: their dims; a constant equal to their
    product, or ``tf.shape(examples)[1]`` for one axis)."""
    ir = flow.ir
    if ir.op(src) != "Mul" or port != 0:
        return False
    for k in (0, 1):
        first = _through(ir, *ir.input(src, k))
        stride = ir.input(src, 1 - k)
        if _counts_examples(flow, *first) and _is_count(flow, examples, rows, *stride):
            return True
    return False


def _counts_examples(flow: _Flow, src: str, port: int) -> bool:
    """``tf.range(0, tf.shape(x)[0], 1)``: each example's position in the batch."""
    ir = flow.ir
    if ir.op(src) != "Range" or port != 0 or len(ir.inputs(src)) != 3:
        return False
    start, limit, delta = ir.inputs(src)
    return flow.ints(*_through(ir, *start)) == [0] and \
        flow.ints(*_through(ir, *delta)) == [1] and \
        _is_batch_size(flow, *_through(ir, *limit))


def _is_count(flow: _Flow, examples: tuple, rows: list, src: str, port: int) -> bool:
    ir = flow.ir
    src, port = _through(ir, src, port)
    values = flow.ints(src, port)
    if values is not None:
        product = 1
        for dim in rows:
            product *= dim
        return len(values) == 1 and -1 not in rows and values[0] == product
    from graphxform.nodes import shape_entry
    entry = shape_entry(ir, src, port, flow.ints) if len(rows) == 1 else None
    if entry is None or entry[1] != 1:
        return False
    shape = _through(ir, entry[0], 0)
    return ir.op(shape[0]) == "Shape" and ir.input(shape[0], 0) == examples


def _numbers_examples(flow: _Flow, src: str, port: int) -> bool:
    """Whether a batch position (a Range over the batch's size) reaches ``src:port``."""
    ir, seen, stack = flow.ir, set(), [src]
    while stack:
        name = stack.pop()
        if name in seen or _port(flow.states.get(name), 0) is None or name in flow.sources:
            continue
        seen.add(name)
        if ir.op(name) == "Range":
            return True
        stack.extend(s for s, _ in ir.inputs(name))
    return False


def _picked_by_mask(n: _Node) -> bool:
    """Whether a gather's indices are where a per-example mask holds, in order, as
    tf.boolean_mask takes them (squeeze(where(mask))): each row it keeps is still one
    example's. (A mean over them divides by how many the mask keeps: graphxform/selections.py
    refuses that.)"""
    from graphxform.selections import mask_of
    mask = mask_of(n.flow.ir, n.inputs[1][0])
    return mask is not None and type(_port(n.flow.states.get(mask[0], UNKNOWN), mask[1])) is int


def _one_hot(n: _Node):
    state = n.states[0]
    if type(state) is not int or any(s is not None for s in n.states[1:]):
        return UNKNOWN
    value = n.attr("axis")
    axis = value.i if value is not None else -1
    return state if axis == -1 or axis > state else state + 1


def _candidate_sampler(n: _Node):
    """A sampler of a fixed distribution (nce_loss's and sampled_softmax_loss's log-uniform
    one) draws its candidates without reading the true classes' values: its candidates and
    their expected counts are free of the batch, the true classes' expected counts hold a row
    per example of them. (A learned sampler counts the classes it is given: the contract
    refuses it; whether the copies draw what one device draws is a matter of seeds,
    graphxform.replica_values.)"""
    true = n.states[0]
    return [None, true if type(true) is int else UNKNOWN, None]


def _where(n: _Node):
    """tf.where(mask) of a mask with the batch on axis 0 (feature columns' to_sparse_input):
    the coordinates of its true entries, whose column 0 numbers the example each belongs to,
    as a sparse_placeholder's indices do (the rules for sparse inputs follow them so; each
    replica numbers its own slice's rows from 0, as split-inputs does a sparse input's)."""
    if len(n.states) != 1 or n.states[0] != 0:
        return UNKNOWN
    n.flow.sparse_indices.add(n.name)
    n.flow.selected.add(n.name)  # as many rows as the mask is true: a mean over them is not
    return 0  # a mean of per-example terms (graphxform/selections.py)


def _sparse_reshape(n: _Node):
    """SparseReshape(indices, shape, new_shape) of entries whose column 0 numbers their
    examples, to a shape that keeps the batch's size first ([batch, -1]): row-major order
    keeps each entry in its example's row."""
    if not _entry_rows(n.flow, *n.inputs[0]) or n.states[0] != 0 or \
            not _entry_is_batch_size(n, 2):
        return UNKNOWN
    n.flow.sparse_indices.add(n.name)
    return [0, Shape(0)]


def _entry_is_batch_size(n: _Node, k: int) -> bool:
    """Whether entry 0 of the shape vector input ``k`` is the batch's size: its state, before
    any casts (which keep only that it is made of sizes), is Shape(0)."""
    ir = n.flow.ir
    src, port = n.inputs[k]
    while ir.op(src) in ("Cast", "Identity") and port == 0:
        src, port = ir.input(src, 0)
    return _port(n.flow.states.get(src), port) == Shape(0)


def _entry_rows(flow: _Flow, src: str, port: int) -> bool:
    """Whether ``src:port`` holds a SparseTensor's indices whose column 0 numbers the example
    of each entry (``flow.sparse_indices``), or some of their rows (safe_embedding_lookup_sparse
    gathers the rows whose ids are valid)."""
    ir = flow.ir
    while port == 0 and ir.op(src) in ("Identity", "GatherV2", "Gather"):
        if ir.op(src) == "GatherV2" and flow.ints(*ir.input(src, 2)) != [0]:
            return False
        src, port = ir.input(src, 0)
    return port == 0 and src in flow.sparse_indices


def _sparse_fill_empty_rows(n: _Node):
    """SparseFillEmptyRows(indices, values, dense_shape, default): adds an entry with the
    default to each example that has none; column 0 still numbers the examples, and each
    example's indicator is its own. (The reverse map, positions among the input's entries,
    serves the gradient only.)"""
    indices, values, shape, default = n.states
    if not _entry_rows(n.flow, *n.inputs[0]) or indices != 0 or \
            not _entry_is_batch_size(n, 2) or values not in (0, None) or default is not None:
        return UNKNOWN
    n.flow.sparse_indices.add(n.name)
    return [0, 0, 0, UNKNOWN]


def _l2_loss(n: _Node):
    return AGGREGATE if type(n.states[0]) is int else n.states[0]


def _example_of_entry(flow: _Flow, src: str, port: int) -> bool:
    """Whether tensor ``src:port`` is ``sp.indices[:, 0]`` of a sparse_placeholder ``sp``
    (through casts): the example each entry of the SparseTensor belongs to. Segments by it are the
    examples themselves (tf.nn.embedding_lookup_sparse's segment_ids), and split-inputs
    renumbers each replica's rows from 0, so a segment sum by it is per example, not a sum over
    the batch."""
    ir = flow.ir
    while ir.op(src) in ("Cast", "Identity") and port == 0:
        src, port = ir.input(src, 0)
    if ir.op(src) != "StridedSlice" or port != 0 or \
            ir.input(src, 0)[0] not in flow.sparse_indices:
        return False
    begin, end, strides = (flow.ints(*ir.input(src, k)) for k in (1, 2, 3))
    attrs = ir.attrs(src)
    masks = {key: attrs[key].i if key in attrs else 0 for key in (
        "begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")}
    return (begin is not None and end is not None and strides is not None
            and len(begin) == 2 and list(strides) == [1, 1] and begin[1] == 0
            and masks["shrink_axis_mask"] == 2 and masks["ellipsis_mask"] == 0
            and masks["new_axis_mask"] == 0 and (masks["begin_mask"] & 1 or begin[0] == 0)
            and masks["end_mask"] & 1)


def _by_example(n: _Node, data: int = 0, ids: int = 1) -> bool:
    """A segment op over a sparse input's entries whose segments are their examples."""
    return n.states[data] == 0 and _example_of_entry(n.flow, *n.inputs[ids])


def _segment_sum(n: _Node):
    data, ids = n.states[0], n.states[1]
    if _by_example(n):
        return 0  # each example's entries combined (embedding_lookup_sparse with weights)
    if data == 0 and ids == 0:
        return AGGREGATE  # sums (means) of the batch's examples per segment
    return UNKNOWN


def _sparse_segment(n: _Node):
    """SparseSegmentSum/Mean/SqrtN(data, indices, segment_ids): data's rows picked per entry,
    combined per segment. tf.nn.embedding_lookup_sparse without weights looks the distinct ids
    up (``Unique`` of the entries' ids; ``indices`` is where each entry's id is among them) and
    combines each example's: per example where the segments are the entries' examples and the
    looked-up rows hold nothing but a batch-free table's rows."""
    if not _example_of_entry(n.flow, *n.inputs[2]):
        return UNKNOWN
    if n.states[0] is None:
        return 0
    unique = _rows_of_unique(n.flow, *n.inputs[0])
    return 0 if unique is not None and n.inputs[1] == (unique, 1) else UNKNOWN


def _rows_of_unique(flow: _Flow, src: str, port: int) -> str | None:
    """The ``Unique`` node U where tensor ``src:port`` is a batch-free table's rows at the
    distinct ids U found (``embedding_lookup(params, unique(ids))``, through identities), else
    None. Gathered back by U's second output, they are each id's row, in the ids' order."""
    ir = flow.ir
    while ir.op(src) in ("Identity", "Cast") and port == 0:
        src, port = ir.input(src, 0)
    if ir.op(src) not in ("Gather", "GatherV2", "ResourceGather") or port != 0:
        return None
    table, (unique, unique_port) = ir.input(src, 0), ir.input(src, 1)
    if _port(flow.states.get(table[0], UNKNOWN), table[1]) is not None or \
            ir.op(unique) != "Unique" or unique_port != 0:
        return None
    if ir.op(src) == "GatherV2" and flow.ints(*ir.input(src, 2)) != [0]:
        return None
    return unique


def _segment_extreme(n: _Node):
    """tf.math.unsorted_segment_max and the like over the batch: a Max over the examples of
    each segment, which no average of the slices' gives."""
    if _by_example(n):
        return 0
    if n.states[0] == 0 and n.states[1] == 0:
        return n.mixed(f"takes the {n.op} of the examples of the batch per segment: each "
                       "replica would take its own slice's")
    return UNKNOWN


def _bincount(n: _Node):
    """Counts (or weight sums) of the batch's values per bin: a sum over the batch, however
    many bins (tf.math.bincount's are the batch's largest value plus one)."""
    if n.states[0] == 0 and n.states[-1] in (None, SIZE, 0):
        return AGGREGATE
    return UNKNOWN


def _unique_with_counts(n: _Node):
    """tf.unique_with_counts of the batch's ids: the distinct ids (not followed), each
    example's position among them, and how often each occurs in the batch (a count)."""
    if n.states[0] == 0:
        return [UNKNOWN, 0, AGGREGATE]
    return UNKNOWN


def _by_position(what: str, tensor_at: int, indices_at: int):
    """An op that reads or writes a batch tensor at constant positions picks examples by
    position (``x[0]`` through tf.gather_nd, tf.tensor_scatter_nd_update)."""
    def rule(n: _Node):
        batch_dims = n.attr("batch_dims")
        if (n.states[tensor_at] == 0 and n.states[indices_at] is None
                and not (batch_dims is not None and batch_dims.i)):
            return n.mixed(f"{what} the examples of the batch at fixed positions")
        return UNKNOWN
    return rule


def _gather_nd(n: _Node):
    """tf.gather_nd(x, indices) with the batch on x's axis 0: an index's first entry picks
    the example. Indices stacked from ``tf.range(batch)`` and per-example positions (the last
    output of each padded sequence, ``stack([range(batch), length - 1], 1)``) pick each
    example's own rows; other per-example indices pick other examples (a partner's, the
    first's), which a replica's slice numbers otherwise."""
    params, indices = n.states[0], n.states[1]
    batch_dims = n.attr("batch_dims")
    if params != 0 or (batch_dims is not None and batch_dims.i):
        return UNKNOWN
    if indices is None:
        return n.mixed("picks the examples of the batch at fixed positions")
    if type(indices) is not int:
        return UNKNOWN
    if _first_entry_numbers_examples(n.flow, *n.inputs[1]) or (
            indices == 0 and _through(n.flow.ir, *n.inputs[1])[0] in n.flow.sparse_indices):
        return indices  # (tf.where's coordinates start with their example's number)
    return n.mixed("picks examples of the batch by computed index (tf.gather_nd whose indices "
                   "do not start with each example's own number, tf.range(tf.shape(x)[0]))")


def _first_entry_numbers_examples(flow: _Flow, src: str, port: int) -> bool:
    """Whether the last axis of the indices ``src:port`` starts with each example's number:
    ``tf.stack([tf.range(batch), ...], axis=-1)`` (or a concat of it), the range maybe
    expanded or tiled along the axes after the batch's."""
    ir = flow.ir
    src, port = _through(ir, src, port)
    op, rank = ir.op(src), flow.rank(src, port)
    if op == "Pack" and rank is not None:
        axis = ir.attrs(src).get("axis")
        axis = axis.i if axis is not None else 0
        if axis not in (-1, rank - 1):
            return False
    elif op == "ConcatV2":
        axis = flow.ints(*ir.inputs(src)[-1])
        if not axis or rank is None or axis[0] not in (-1, rank - 1):
            return False
    else:
        return False
    first, port = _through(ir, *ir.input(src, 0))
    while (ir.op(first) in ("Tile", "BroadcastTo") or _adds_axes(flow, first)) and port == 0:
        first, port = _through(ir, *ir.input(first, 0))
    return _counts_examples(flow, first, port)


def _adds_axes(flow: _Flow, src: str) -> bool:
    """Whether ``src`` is a strided slice that keeps every axis whole and only inserts new ones
    after the first (``tf.range(batch)[:, None]``, as Dopamine stacks it beside the actions):
    each row keeps its values and its place."""
    ir = flow.ir
    if ir.op(src) != "StridedSlice":
        return False
    begin, end, strides = (flow.ints(*ir.input(src, k)) for k in (1, 2, 3))
    if begin is None or end is None or strides is None:
        return False
    masks = {key: (ir.attrs(src)[key].i if key in ir.attrs(src) else 0) for key in (
        "begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")}
    if masks["ellipsis_mask"] or masks["shrink_axis_mask"] or masks["new_axis_mask"] & 1:
        return False
    return all(masks["new_axis_mask"] & (1 << k) or (
        (masks["begin_mask"] & (1 << k) or begin[k] == 0) and masks["end_mask"] & (1 << k)
        and strides[k] == 1) for k in range(len(begin)))


def _scatter_nd(n: _Node):
    """tf.scatter_nd of the batch's rows to indices computed from the batch: sums per index,
    as UnsortedSegmentSum."""
    if n.states[0] == 0 and n.states[1] == 0 and n.states[2] in (None, SIZE):
        return AGGREGATE
    return UNKNOWN


def _dynamic_partition(n: _Node):
    """tf.dynamic_partition of the batch: each part holds the examples of one group, as many
    as the slice has, so what follows (a mean over a part, pairs across parts) is computed on
    other groups of examples than one device's, as a gather along the batch axis is."""
    if n.states[0] == 0:
        return n.mixed("splits the examples of the batch into groups (tf.dynamic_partition), "
                       "each as large as the slice makes it")
    return UNKNOWN


def _non_max_suppression(n: _Node):
    """The count of boxes non-max suppression keeps that V4 and V5 return beside the indices
    (valid_outputs): what ``_value_sized`` says their length is."""
    count = _row_count(n.flow, n.name, n.op, n.states)
    return [*([UNKNOWN] * (1 if n.op.endswith("V4") else 2)), count or UNKNOWN]


def _pad(n: _Node):
    state = n.states[0]
    if type(state) is not int or any(s is not None for s in n.states[1:]):
        return UNKNOWN
    paddings = n.ints(1)
    if paddings and len(paddings) > 2 * state + 1 and paddings[2 * state:2 * state + 2] == [0, 0]:
        return state
    return UNKNOWN


def _ctc_loss(n: _Node):
    """CTCLoss reads time-major logits [time, batch, classes] (and each example's length) and
    returns one loss per example beside the logits' gradient. Logits whose axis 0 is the split
    axis are time-major data split along time: each replica would see a slice of every
    example's time steps beside its own examples' labels."""
    if n.states[0] == 0:
        return n.mixed("reads time-major logits [time, batch, classes], but axis 0, time, is "
                       "where the batch is split: each replica would see a slice of every "
                       "example's time steps (feed the data batch-major, or pass "
                       "time_major=False)")
    if n.states[0] == 1:
        return [0, 1]
    return UNKNOWN


# TensorArray ops that unstack a tensor along axis 0, one element per loop iteration: the
# index of that value among their inputs
_UNSTACK_INTO_LOOP = {"TensorArrayScatterV3": 2, "TensorArrayScatterV2": 2,
                      "TensorArrayScatter": 2, "TensorArrayUnpack": 1}
_ARRAY_WRITES = ("TensorArrayWrite", "TensorArrayScatter", "TensorArrayUnpack",
                 "TensorArraySplit")


def _unstack_into_loop(n: _Node):
    """A legacy while loop reading the batch one example per iteration (dynamic_rnn with
    time_major=True fed batch-major data, a tf.scan over the batch) mixes the examples when it
    carries a value from one iteration to the next that the examples computed; one that only
    writes each example's result (tf.map_fn) keeps them apart. Unknown otherwise."""
    value_at = _UNSTACK_INTO_LOOP[n.op]
    if n.states[value_at] != 0:  # time steps, or what else the batch is not the axis of
        return loop_mixing.array_state(n.op, n.states)
    return _carried(n, _carried_from_reads(n.flow.ir, n.inputs[0][0]))


def _while_loop(n: _Node):
    """``_unstack_into_loop`` for a control-flow-v2 loop (While, StatelessWhile): its body
    reads the batch one example per iteration from loop variables that are TensorLists of it
    (graphxform.functions.carried_from_list says what it carries). A loop that only adds up a
    term of each example, once each (a sum of per-example losses), does not mix them: those
    outputs are sums over the batch. Unknown otherwise: the loop's outputs are not
    followed."""
    ir = n.flow.ir
    lists = set()
    for k, (src, _) in enumerate(n.inputs):
        if ir.op(src) == "TensorListFromTensor" and _port(
                n.flow.states.get(ir.input(src, 0)[0]), ir.input(src, 0)[1]) == 0:
            lists.add(k)
    statistic = next((k for k, state in enumerate(n.states) if state == AGGREGATE
                      and functions.reads_argument(ir, n.name, k)), None)
    if lists and statistic is not None:
        return n.mixed(f"reads the batch one example per iteration beside a sum or mean over "
                       f"the batch ('{n.inputs[statistic][0]}'), as tf.map_fn over the examples "
                       "reading the batch's mean does")
    carried = {}
    for k in sorted(lists):
        carried.update(functions.carried_from_list(ir, n.name, k))
    if not carried:
        return UNKNOWN if lists else loop_mixing.while_states(n)
    if not _sums_each_example(n, lists, carried):
        return _carried(n, carried[min(carried)])
    return [AGGREGATE if k in carried else UNKNOWN for k in range(len(n.inputs))]


def _sums_each_example(n: _Node, lists: set, carried: dict) -> bool:
    """Whether every loop variable in ``carried`` adds up a term of each example: a counter
    runs from 0 to the batch's size (``tf.shape(x)[0]``), reading the examples at it, and the
    rest of what the terms read is free of the batch."""
    ir = n.flow.ir
    free = {k for k, state in enumerate(n.states) if state is None}
    bounds = [k for k, (src, port) in enumerate(n.inputs) if _is_batch_size(n.flow, src, port)]
    counters = [c for c in free for b in bounds if functions.counts_to(ir, n.name, c, b)]
    return any(all(functions.sums_each_element(ir, n.name, v, lists, free, c) for v in carried)
               for c in counters)


def _is_batch_size(flow: _Flow, src: str, port: int) -> bool:
    """Whether ``src:port`` is tf.shape(x)[0] of a tensor x with the batch on axis 0."""
    from graphxform.nodes import shape_entry
    ir = flow.ir
    entry = shape_entry(ir, src, port, flow.ints)
    if entry is None or entry[1] != 0 or ir.op(entry[0]) != "Shape":
        return False
    return _port(flow.states.get(ir.input(entry[0], 0)[0]), ir.input(entry[0], 0)[1]) == 0


_CALLS = ("If", "StatelessIf", "PartitionedCall", "StatefulPartitionedCall")


def _call(flow: _Flow, name: str, op: str, inputs: list, found: list):
    """A tf.function call or a control-flow-v2 cond: the flow runs on through the called body
    (``functions.body_graph``), its arguments in the states of the call's inputs; a cond's
    outputs are what both branches agree on, and a cond on a statistic of the batch is the
    branch each slice's own statistic picks. Unknown where the body cannot be built."""
    if op in ("If", "StatelessIf"):
        if found[0] not in (None, SIZE):
            if found[0] != AGGREGATE and not isinstance(found[0], Curved):
                return UNKNOWN
            if any(type(s) is int for s in found[1:]):
                made = (f", made at '{found[0].node}' ({found[0].op})"
                        if isinstance(found[0], Curved) else "")
                return Mixed(name, op, "picks the branch its examples take by a function of a "
                             f"sum or mean over the batch{made}: each replica would pick by "
                             "its own slice's")
            return (found[0] if isinstance(found[0], Curved) else
                    Curved(name, op, "branches on a sum or mean over the batch"))
        inputs, found, keys = inputs[1:], found[1:], ("then_branch", "else_branch")
    else:
        keys = ("f",)
    degrees = [flow.degree(src, port) for src, port in inputs]
    branches = []
    for key in keys:
        body = functions.body_graph(flow.ir, name, key)
        if body is None or len(body.args) != len(found):
            return UNKNOWN
        inner = _Flow(body.ir, set(), dict(zip(body.args, zip(found, degrees))))
        states, outs = [], []
        for tensor in body.outputs:
            node, port = tensor.rsplit(":", 1)
            inner.run(node)
            states.append(_port(inner.states[node], int(port)))
            outs.append(inner.degree(node, int(port)))
        branches.append((states, outs))
    # per output, its (state, degree) in each branch
    outputs = [list(output) for output in zip(*(zip(*branch) for branch in branches))]
    flow.called[name] = [_joined_degree(output) for output in outputs]
    return [_joined([state for state, _ in output], name, op) for output in outputs]


def _joined(states: list, call: str, op: str):
    """One output of a call from its branches' (one for a function): the first mixing found,
    renamed to the call, else the join of theirs (graphxform/loop_mixing.py): a cond on a
    predicate free of the batch takes one branch on every replica as on one device, and
    whichever it takes holds at most what the join says (tf_keras' batch norm in a cond on
    the learning phase: the batch's statistics, or the moving ones)."""
    for state in states:
        if isinstance(state, Mixed):
            return Mixed(call, op, f"runs '{state.node}' ({state.op}), which {state.reason}")
        if isinstance(state, Curved):
            return Curved(call, op, f"runs '{state.node}' ({state.op}), which {state.reason}")
    return functools.reduce(loop_mixing.join, states)


def _joined_degree(branches: list):
    """The degree of a cond's output from its branches' (state, degree) pairs."""
    (state, degree), *others = branches
    for other, other_degree in others:
        degree = loop_mixing.join_degree(state, degree, other, other_degree)
        state = loop_mixing.join(state, other)
    return degree


def _carried(n: _Node, carried: str | None):
    """Mixed when a loop reading the batch one example per iteration carries ``carried``."""
    if carried is None:
        return UNKNOWN
    return n.mixed(f"unstacks the batch axis into a while loop that carries '{carried}' from "
                   "one example to the next (a time-major RNN or a scan run over the "
                   "examples)")


def _carried_from_reads(ir, array: str) -> str | None:
    """A loop variable (its NextIteration) computed from a read of the TensorArray ``array``
    that is no TensorArray's flow, or None."""
    handles, stack = set(), [array]
    while stack:  # the array's handle, passed into loops by Enter and Identity
        node = stack.pop()
        if node in handles:
            continue
        handles.add(node)
        stack.extend(dst for dst, port in ir.consumers(node, 0)
                     if ir.op(dst) in ("Enter", "Identity", "RefEnter"))
    reads = [dst for h in handles for dst, port in ir.consumers(h, 0)
             if port == 0 and ir.op(dst).startswith("TensorArrayRead")]
    seen, stack = set(reads), list(reads)
    while stack:
        node = stack.pop()
        for dst, _ in ir.consumers(node):
            if dst in seen or ir.op(dst) in ("Exit", "RefExit"):
                continue
            if ir.op(dst) in ("NextIteration", "RefNextIteration"):
                if not ir.op(ir.input(dst, 0)[0]).startswith(_ARRAY_WRITES):
                    return dst
            seen.add(dst)
            stack.append(dst)
    return None


def _fake_quant(n: _Node):
    """Fake quantisation (quantization-aware training) between bounds that hold nothing of the
    batch (variables a moving average of the batch's range updates apart, read before it):
    elementwise, the same for every example. Bounds taken from the batch itself are a
    statistic of it, not shown linear: unknown."""
    return n.states[0] if all(s is None for s in n.states[1:]) else UNKNOWN


def _rng_read(n: _Node):
    """A tf.random.Generator's state, read before it skips past this step's draws: the
    skip may be the batch's size, what is read holds nothing of this step's batch (that
    every replica's draws are one device's is graphxform/passes/consistent_random.py's)."""
    return None


def _draw_per_row(n: _Node):
    """tf.random.categorical: one draw per row of logits that are the examples' own."""
    return 0 if n.states[0] == 0 and all(s is None for s in n.states[1:]) else UNKNOWN


def _stateful_draw(n: _Node):
    """A tf.random.Generator draw (resource, algorithm, shape, parameters) in a shape that
    holds the batch's size, of parameters that hold nothing of the batch: a row per
    example."""
    shape = n.states[2] if len(n.states) > 2 else None
    if isinstance(shape, Shape) and all(s is None for k, s in enumerate(n.states) if k != 2):
        return _rows_in(n, shape)
    return UNKNOWN


_RULES = {
    "MatMul": _matmul, "SparseTensorDenseMatMul": _sparse_dense_matmul,
    "BatchMatMul": _batch_matmul, "BatchMatMulV2": _batch_matmul,
    "BatchMatMulV3": _batch_matmul, "Softmax": _last_axis, "LogSoftmax": _last_axis,
    "TopKV2": _last_axis, "TopK": _last_axis, "ArgMax": _arg_reduce, "ArgMin": _arg_reduce,
    "ReverseV2": _along_axis("reverses the order of the examples of the batch"),
    "Reverse": _along_axis("reverses the order of the examples of the batch"),
    "Cumsum": _along_axis("accumulates over the examples of the batch (a cumulative sum)"),
    "Cumprod": _along_axis("accumulates over the examples of the batch (a cumulative "
                           "product)"),
    "CumulativeLogsumexp": _along_axis("accumulates over the examples of the batch"),
    "Einsum": _einsum, "Roll": _roll, "RandomShuffle": _shuffle, "BroadcastTo": _broadcast_to, "Tile": _tile,
    "Reshape": _reshape, "ExpandDims": _expand_dims, "Squeeze": _squeeze,
    "Transpose": _transpose, "ConcatV2": _concat, "Pack": _pack,
    "Unpack": _unpack_or_split(0, "attr"), "Split": _unpack_or_split(1, "input"),
    "SplitV": _unpack_or_split(0, "input"), "Slice": _slice, "StridedSlice": _strided_slice,
    "Gather": _gather, "GatherV2": _gather, "ResourceGather": _gather, "OneHot": _one_hot,
    "L2Loss": _l2_loss, "UnsortedSegmentSum": _segment_sum, "SegmentSum": _segment_sum,
    "DynamicPartition": _dynamic_partition, "ScatterNd": _scatter_nd,
    "NonMaxSuppressionV4": _non_max_suppression, "NonMaxSuppressionV5": _non_max_suppression,
    **dict.fromkeys(("SparseSegmentSum", "SparseSegmentMean", "SparseSegmentSqrtN",
                     "SparseSegmentSumWithNumSegments", "SparseSegmentMeanWithNumSegments",
                     "SparseSegmentSqrtNWithNumSegments"), _sparse_segment),
    "SegmentMean": _segment_sum, "Bincount": _bincount, "DenseBincount": _bincount,
    "UniqueWithCounts": _unique_with_counts, "UniqueWithCountsV2": _unique_with_counts,
    **dict.fromkeys(("SegmentMax", "SegmentMin", "SegmentProd", "UnsortedSegmentMax",
                     "UnsortedSegmentMin", "UnsortedSegmentProd"), _segment_extreme),
    "GatherNd": _gather_nd, "ResourceGatherNd": _by_position("picks", 0, 1),
    **dict.fromkeys(("TensorScatterUpdate", "TensorScatterAdd", "TensorScatterSub",
                     "TensorScatterMax", "TensorScatterMin"), _by_position("overwrites", 0, 1)),
    **dict.fromkeys(("LogUniformCandidateSampler", "UniformCandidateSampler",
                     "FixedUnigramCandidateSampler", "AllCandidateSampler"), _candidate_sampler),
    "Where": _where, "SparseReshape": _sparse_reshape,
    "SparseFillEmptyRows": _sparse_fill_empty_rows,
    "Pad": _pad, "PadV2": _pad, "MirrorPad": _pad, "CTCLoss": _ctc_loss, "CTCLossV2": _ctc_loss,
    **dict.fromkeys(loop_mixing.ARRAY_OPS, lambda n: loop_mixing.array_state(n.op, n.states)),
    **dict.fromkeys(_UNSTACK_INTO_LOOP, _unstack_into_loop),
    **dict.fromkeys(WHILE_OPS, _while_loop),
    **dict.fromkeys(_FAKE_QUANT_OPS, _fake_quant),
    "SparseToDense": lambda n: sampled_logits.accidental_hits(n.flow, n.name, n.inputs,
                                                              n.states),
    "RngReadAndSkip": _rng_read, "Multinomial": _draw_per_row,
    "StatelessMultinomial": _draw_per_row,
}


# ------------------------------------------------------- shapes and sizes
# What is computed from the batch's size alone. Entry k of a shape vector is the batch's size
# only where the batch is on axis k, so tf.shape(x)[1] (a sequence length) is not.

def _shape_of(state, selected: bool = False):
    """What Shape of a tensor in ``state`` says of the batch (``selected``: its rows are those
    a mask of the batch keeps, as many as the mask's sum)."""
    if type(state) is int:
        return Shape(state, AGGREGATE if selected and state == 0 else SIZE)
    return None if state in (None, AGGREGATE, NORM, SIZE) or isinstance(state, Curved) \
        else UNKNOWN


def _shape_rule(flow, name: str, found: list):
    op = flow.ir.op(name)
    if op == "Rank":
        return None
    shapes = [Shape(0, flow.lengths[(src, port)]) if (src, port) in flow.lengths else
              _shape_of(state, src in flow.selected)
              for (src, port), state in zip(flow.ir.inputs(name), found)]
    if op == "Size":
        return shapes[0].count if isinstance(shapes[0], Shape) else shapes[0]
    if op == "ShapeN":
        return shapes
    return shapes[0] if shapes else None


def _value_sized(flow, name: str, op: str, found: list) -> None:
    """Record in ``flow.lengths`` the count that the length of each output of ``name`` is, an
    op whose outputs' length its inputs' values decide (selections.VALUE_SIZED_OPS): where a
    per-example mask is true (tf.where, tf.boolean_mask), the examples in a partition or the
    entries tf.setdiff1d keeps of per-example values: a sum over the batch of each example's
    0 or 1 (AGGREGATE); the distinct values the batch holds (tf.unique), what non-max
    suppression keeps, and what any of them finds in a statistic of the batch: a Curved (the
    slices' counts do not add up to the batch's); the Mixed its values are. Unknown: none."""
    count = _row_count(flow, name, op, found)
    if count is None:
        return
    if op.startswith("NonMaxSuppression"):
        padded = flow.ir.attrs(name).get("pad_to_max_output_size")
        ports = () if padded is not None and padded.b else (0, 1) if op.endswith("V5") else (0,)
    elif op == "DynamicPartition":
        ports = range(flow.ir.attrs(name)["num_partitions"].i)
    else:
        ports = _SIZED_PORTS.get(op, (0,))
    for port in ports:
        flow.lengths[(name, port)] = count


# the outputs whose length their inputs' values decide (tf.unique's idx keeps its input's)
_SIZED_PORTS = {"UniqueWithCounts": (0, 2), "UniqueWithCountsV2": (0, 2), "ListDiff": (0, 1)}
# for each, the inputs whose values decide it, and whether the count is each example's 0 or 1
# summed where those are per-example (the other inputs batch-free)
_DECIDED_BY = {"Where": ((0,), True), "DynamicPartition": ((1,), True),
               "ListDiff": ((0, 1), True), "NonMaxSuppression": ((0, 1), False)}


def _row_count(flow, name: str, op: str, found: list):
    """The count ``_value_sized`` records for ``name``, or None where it is not known."""
    family = value_sized_family(op)
    deciding, summed = _DECIDED_BY.get(family, ((0,), False))
    states = [found[k] for k in deciding if k < len(found)]
    mixed = next((s for s in states if isinstance(s, Mixed)), None)
    curved = next((s for s in states if isinstance(s, Curved)), None)
    if mixed is not None or curved is not None:
        return mixed or curved
    if any(s in (AGGREGATE, NORM) or isinstance(s, Ratio) for s in states):
        return Curved(name, op, f"counts what {op} finds in a sum or mean over the batch")
    rows = [s for s in states if type(s) is int]
    if not rows or any(s is not None and type(s) is not int for s in states):
        return None  # free of the batch, or unknown
    if summed and (family != "ListDiff" or states[1] is None):
        return AGGREGATE
    what, api, why = UNSUMMED_COUNTS[family]
    return Curved(name, op, f"counts {what} ({api}), which the slices' counts do not add up to "
                  f"({why})")


def _over_counted_rows(n: _Node, count):
    """What ones_like of (or a reduction along axis 0 over) values no rule follows says, where
    ``count`` is their length (``_value_sized``): rows in that count's shape, or a function of
    a count the slices' do not add up to (the distinct values of the batch, summed); None
    where the rules decide."""
    if n.op in LIKE_OPS:
        return _rows_in(n, Shape(0, count))
    if n.op in REDUCE_OPS and count not in (SIZE, AGGREGATE):
        axes = _reduction_axes(n, n.rank(0))
        return count if axes == "all" or (axes is not None and 0 in axes) else None
    return None


# ops whose output has the length of their (first) input: where a count carries on
_LENGTH_KEPT = frozenset({*PASS_OPS, *ELEMENTWISE_OPS, "Squeeze", "Reshape", "ExpandDims"})


def _carry_length(flow, name: str) -> None:
    """``flow.lengths`` for ``name`` where it keeps the length of an input recorded there (a
    cast of tf.unique's values, the indices tf.boolean_mask squeezes out of tf.where, a table's
    rows at them), its axis 0 left unknown by the graph as theirs is."""
    ir = flow.ir
    op = ir.op(name)
    inputs = ir.inputs(name)
    if op in _GATHER_OPS:
        inputs = inputs[1:2]  # the rows are the indices'
    elif op not in _LENGTH_KEPT:
        return
    count = next((flow.lengths[t] for t in inputs if t in flow.lengths), None)
    dims = flow.dims(name, 0)
    if count is not None and dims and dims[0] == -1:
        flow.lengths[(name, 0)] = count


_GATHER_OPS = frozenset({"Gather", "GatherV2", "ResourceGather"})


def _broadcast_gradient_args(flow, name: str, found: list):
    """The axes a broadcasting op's gradient sums each operand's gradient over (TF's
    BroadcastGradientArgs of their shapes: a Sub's or Mul's gradient, as in MAML's
    ``w - a * g``), worked out from the operands' recorded dimensions so that the Sum reading
    them is followed. Unknown dimensions on both sides are taken as equal (the batch's size
    facing itself); one facing a known 1 is broadcast. Their values do not depend on the
    batch's: batch-free."""
    ir, shapes = flow.ir, []
    for src, port in ir.inputs(name)[:2]:
        dims = flow.dims(*ir.input(src, 0)) if ir.op(src) == "Shape" else flow.ints(src, port)
        if dims is None:
            return [None, None]
        shapes.append(list(dims))
    rank = max(len(shapes[0]), len(shapes[1]))
    a, b = ([1] * (rank - len(dims)) + dims for dims in shapes)
    summed = ([], [])
    for axis, (x, y) in enumerate(zip(a, b)):
        if x == y:
            continue
        if x == 1 or y == 1:
            summed[0 if x == 1 else 1].append(axis)
        elif -1 not in (x, y):
            return [None, None]  # TF would refuse these shapes
    flow.port_ints[(name, 0)], flow.port_ints[(name, 1)] = summed
    return [None, None]


_SHAPE_RULES = {**dict.fromkeys(("Shape", "ShapeN", "Size", "Rank", "VariableShape"),
                                _shape_rule),
                "BroadcastGradientArgs": _broadcast_gradient_args}


def _picked(n: _Node, picked: list | None, scalar: bool):
    """Entries ``picked`` of a shape vector whose batch entry is n.states[0].batch_at."""
    at = n.states[0].batch_at
    count = n.states[0].count
    if picked is None:
        return count
    if at not in picked:
        return None
    return count if scalar else Shape(picked.index(at), count)


def _size_strided_slice(n: _Node):
    state = n.states[0]
    if not isinstance(state, Shape):
        return SIZE if state == SIZE else None
    begin, end, strides = n.ints(1), n.ints(2), n.ints(3)
    value = n.attr("shrink_axis_mask")
    shrink = value.i & 1 if value is not None else 0
    if not begin or not end or not strides or len(begin) != 1 or strides[0] != 1:
        return SIZE
    if shrink:
        return _picked(n, [begin[0]], True)
    start = 0 if n.attr("begin_mask") is not None and n.attr("begin_mask").i & 1 else begin[0]
    stop = None if n.attr("end_mask") is not None and n.attr("end_mask").i & 1 else end[0]
    if start < 0 or (stop is not None and stop < 0):
        return SIZE
    at = state.batch_at
    if at < start or (stop is not None and at >= stop):
        return None
    return Shape(at - start, state.count)


def _size_gather(n: _Node):
    state = n.states[0]
    if not isinstance(state, Shape):
        return SIZE if state == SIZE else None
    picked = n.ints(1)
    return _picked(n, picked, n.rank(1) == 0)


def _size_slice(n: _Node):
    state = n.states[0]
    if not isinstance(state, Shape):
        return SIZE if state == SIZE else None
    begin, size = n.ints(1), n.ints(2)
    if not begin or not size or len(begin) != 1:
        return SIZE
    stop = None if size[0] == -1 else begin[0] + size[0]
    at = state.batch_at
    if at < begin[0] or (stop is not None and at >= stop):
        return None
    return Shape(at - begin[0], state.count)


def _size_pack(n: _Node):
    """[tf.shape(x)[0], d]: a shape vector with the batch's size at its position."""
    at = [k for k, s in enumerate(n.states) if s == SIZE]
    if any(isinstance(s, Shape) for s in n.states):
        return SIZE
    return Shape(at[0]) if len(at) == 1 else SIZE


def _size_concat(n: _Node):
    first = n.states[0]
    if isinstance(first, Shape) and all(s is None for s in n.states[1:]):
        return first
    return SIZE


def _size_filled(n: _Node):
    """Fill, zeros and random draws of a shape holding the batch's size: a row per example;
    Range up to it: one position per example."""
    shape = n.states[1] if n.op == "Range" else n.states[0]
    if n.op == "Range":
        done = shape == SIZE and n.states[0] is None and all(s is None for s in n.states[2:])
        return 0 if done else UNKNOWN
    if isinstance(shape, Shape):
        return _rows_in(n, shape)
    return 0 if shape == SIZE and n.rank(0) == 1 else UNKNOWN


def _rows_in(n: _Node, shape: Shape):
    """The state of rows of a value made in ``shape``: per-example on its batch axis, those a
    mask keeps as a selection's (their sum is no size); where the batch's values decide the
    length otherwise (tf.unique's), a function of that count."""
    if shape.count == AGGREGATE:
        n.flow.selected.add(n.name)
    elif shape.count != SIZE:
        return shape.count
    return shape.batch_at


def _size_broadcast(n: _Node):
    """A scalar broadcast to a shape holding the batch's size: a row per example (tf.gradients
    seeds a mean's gradient so, with 1/size in every row)."""
    value, shape = n.states[0], n.states[1]
    if value in (None, SIZE) and isinstance(shape, Shape):
        return _rows_in(n, shape)
    return UNKNOWN


def _size_tile(n: _Node):
    value, multiples = n.states[0], n.states[1]
    if value in (None, SIZE) and isinstance(multiples, Shape):
        return _rows_in(n, multiples)
    return SIZE if multiples is None else UNKNOWN


def _size_value(n: _Node):
    """Arithmetic, casts and reductions of sizes: still a size (a count of selected rows in
    them: a sum over the batch; a count the batch's values decide otherwise: that count)."""
    counts = [s.count for s in n.states if isinstance(s, Shape) and s.count != SIZE]
    return next((c for c in counts if c != AGGREGATE), AGGREGATE) if counts else SIZE


_SIZE_RULES = {
    "StridedSlice": _size_strided_slice, "Slice": _size_slice, "Gather": _size_gather, "GatherV2": _size_gather,
    "Pack": _size_pack, "ConcatV2": _size_concat, "Fill": _size_filled,
    "Range": _size_filled, "BroadcastTo": _size_broadcast, "Tile": _size_tile,
    **dict.fromkeys(RANDOM_OPS - {"RandomShuffle"}, _size_filled),
    **dict.fromkeys(_STATEFUL_DRAWS, _stateful_draw),
    **dict.fromkeys(PASS_OPS | ELEMENTWISE_OPS | REDUCE_OPS | {"Maximum", "Minimum"},
                    _size_value),
}


# ------------------------------------------------------- degrees in the batch's size
# A replica's slice has 1/N of the batch, so a per-example value that scales with the batch's
# size is another value there: the gradient of a mean loss is every example's gradient over
# the size (degree -1), and FGSM's x + eps * dL/dx adds it to the examples themselves. Each
# batch-derived tensor gets its degree d (it scales as size**d; a shape vector holding the size
# has 1), or None when no rule here knows. Sums over the batch add one, a mean none, so a loss
# that is a mean of per-example terms has degree 0 (a sum: 1). Examples stay apart only while
# per-example values of degree d != 0 flow through ops that scale along (products, quotients,
# sign, l2 normalisation); where one meets a value of another degree (a sum) or an op that
# does not scale (tanh, a softmax, a cross entropy), every slice computes something else.

_FILLS = frozenset({"Fill", "BroadcastTo", "Tile"})  # rows of one value, in a shape of the batch's
_UNARY_DEGREE = {  # op -> the multiple of its input's degree that its output has
    **dict.fromkeys(LINEAR_UNARY_OPS, 1), **dict.fromkeys(
        ("Cast", "Print", "DebugIdentity", "Abs", "Relu", "LeakyRelu", "ZerosLike"), 1),
    "Square": 2, "Sqrt": 0.5, "Rsqrt": -0.5, "Reciprocal": -1, "Inv": -1,
    **dict.fromkeys(("Sign", "OnesLike", "IsFinite", "IsNan", "IsInf", "LogicalNot", "ArgMax",
                     "ArgMin", "Equal", "NotEqual", "Less", "LessEqual", "Greater",
                     "GreaterEqual", "InTopK", "InTopKV2"), 0),
}
_PRODUCTS = frozenset({"Mul", "MulNoNan", "MatMul", "BatchMatMul", "BatchMatMulV2",
                       "BatchMatMulV3", "Einsum", "Conv2D", "Conv3D", "DepthwiseConv2dNative"})
_QUOTIENTS = frozenset({"RealDiv", "Div", "DivNoNan", "FloorDiv", "TruncateDiv"})
_CLAMPS = frozenset({"Maximum", "Minimum", "ClipByValue"})  # a constant bound: an eps guard
_SUMS = frozenset({"Add", "AddV2", "Sub", "AddN", "BiasAdd", "BiasAddV1", "Merge", "RefMerge",
                   "SquaredDifference"})
# ops whose output is its input's values moved about (or reduced along a feature axis), and
# which of their inputs hold those values; the rest are shapes, axes and indices
_VALUES_AT = {
    **dict.fromkeys(("Reshape", "Transpose", "ExpandDims", "Squeeze", "Tile", "BroadcastTo",
                     "Pad", "PadV2", "MirrorPad", "Reverse", "ReverseV2", "Roll", "Slice",
                     "StridedSlice", "Gather", "GatherV2", "ResourceGather", "Switch",
                     "RefSwitch", "Unpack", "SplitV", "MaxPool", "AvgPool", "MaxPool3D",
                     "AvgPool3D", "MaxPoolV2", "TopK", "TopKV2", "Sum", "Mean", "Max", "Min",
                     "EuclideanNorm", "Cumsum"), (0,)),
    "Split": (1,), "Select": (1, 2), "SelectV2": (1, 2),
}
_SUMS_OVER_BATCH = {"Sum": 1, "Mean": 0, "SegmentSum": 1, "UnsortedSegmentSum": 1}
# activation gradients: linear in the incoming gradient (this input), the other one fixed
_GRADIENT_AT = {**dict.fromkeys(("ReluGrad", "Relu6Grad", "LeakyReluGrad", "EluGrad", "SeluGrad",
                                 "SoftplusGrad", "SoftsignGrad"), 0),
                **dict.fromkeys(("TanhGrad", "SigmoidGrad", "SqrtGrad", "RsqrtGrad",
                                 "ReciprocalGrad"), 1)}


def _degree(n: _Node, state, degrees: list):
    """The degree of ``n``'s output in the batch's size (None: unknown), or a Mixed."""
    op = n.op
    if op in ("Shape", "ShapeN", "Size"):
        return 1
    if op in _STATEFUL_DRAWS or op == "SparseToDense" and state == 0:
        return 0  # drawn, or a mask of weights: not computed from the size its shape holds
    if op in ("Merge", "RefMerge") and isinstance(state, list):  # a legacy cond's
        return [_joined_degree(list(zip(n.states, degrees))), 0]
    if op == "IdentityN":
        return degrees
    if op in loop_mixing.LOOP_PASS_OPS:
        return degrees[0]
    if op in loop_mixing.ARRAY_OPS:
        return loop_mixing.array_degree(op, n.states, degrees)
    if op == "Range":
        return None  # positions in the batch, not values of its examples
    if isinstance(state, Shape):  # [size, d], or a shape's entries from the batch's on
        return degrees[n.states.index(SIZE)] if op == "Pack" else \
            degrees[0] if op == "ConcatV2" else 1
    if isinstance(n.states[0] if n.states else None, Shape):
        return _shape_degree(n, state, degrees)
    if op == "Fill":  # rows of a value, in a shape held as a size
        return degrees[1]
    if op in _UNARY_DEGREE:
        return _times(degrees[0], _UNARY_DEGREE[op])
    if op in _GRADIENT_AT:
        at = _GRADIENT_AT[op]
        return degrees[at] if degrees[1 - at] == 0 else None
    if op in _PRODUCTS:
        total = _total(degrees)
        batch_summed = state in (AGGREGATE, NORM) and op != "Mul" and \
            all(type(s) is int for s in n.states[:2])  # a contraction over the batch
        return total + 1 if total is not None and batch_summed else total
    if op in _QUOTIENTS:
        if n.flow.over_whole_batch(n.name, n.states):
            return degrees[0]  # over the whole batch's total, which no slice changes
        a, b = degrees[0], degrees[1]
        return None if a is None or b is None else a - b
    if op == "L2Loss":
        return None if degrees[0] is None else 2 * degrees[0] + 1
    if op in _CLAMPS:
        kept = [d for d, s in zip(degrees, n.states) if s is not None]
        return _same(n, kept, [s for s in n.states if s is not None])
    if op in _SUMS or op in ("ConcatV2", "Concat", "Pack"):
        at = range(len(degrees) - 1) if op == "ConcatV2" else \
            range(1, len(degrees)) if op == "Concat" else range(len(degrees))
        degree = _same(n, [degrees[k] for k in at], [n.states[k] for k in at])
        if op == "SquaredDifference" and type(degree) is not Mixed:
            return _times(degree, 2)
        return degree
    if op in _VALUES_AT or op in _SUMS_OVER_BATCH:
        at = _VALUES_AT.get(op, (0,))
        degree = _same(n, [degrees[k] for k in at], [n.states[k] for k in at])
        if op in _SUMS_OVER_BATCH and state in (AGGREGATE, NORM) and type(n.states[0]) is int:
            return None if degree is None else degree + _SUMS_OVER_BATCH[op]
        return degree
    if all(d == 0 for d in degrees):
        return 0
    if op == "Prod" and n.flow.dims(*n.inputs[0]) in ([], [1]):
        return degrees[0]  # of one entry (tf.gradients' count of the examples a mean took)
    if op in ("Prod", "Cumprod", "Pow"):
        return None  # they scale, by a power this does not work out
    scaled = next((s for s, d in zip(n.states, degrees) if type(s) is int and d), None)
    if scaled is not None and op not in RANDOM_OPS:
        return n.mixed("applies an op that does not scale to per-example values that do: "
                       "they scale with the batch's size (as the gradient of a mean loss "
                       "does, each example's over the size)")
    return None


def _shape_degree(n: _Node, state, degrees):
    """What is computed from a shape vector holding the size (degree 1): a pick of the size,
    its product, rows of a value in that shape."""
    if type(state) is int:  # rows of a shape's size: Fill, a random draw, BroadcastTo
        value = {"Fill": 1, "BroadcastTo": 0, "Tile": 0}.get(n.op)
        return 0 if value is None else degrees[value]
    if n.op == "Prod":
        return 1
    if n.op in ("Gather", "GatherV2", "StridedSlice", "Slice"):
        if _picks_the_batch(n):
            return 1
    if n.op in ("Cast", "Identity", "Reshape", "Squeeze"):
        return degrees[0]
    return None


def _picks_the_batch(n: _Node) -> bool:
    """A pick of one entry from a shape vector that has only the batch's size (a rank-1
    tensor's, as tf.gradients' mean picks with indices it computes), or a known pick of it."""
    vector = n.flow.dims(*n.inputs[0])
    out = n.flow.dims(n.name, 0)
    if vector == [1] and out in ([], [1]):
        return True
    if n.op in ("Gather", "GatherV2"):  # one entry, or several that include the size (the
        picked = n.ints(1)  # dimensions a mean's gradient multiplies up)
        return picked is not None and n.states[0].batch_at in picked
    begin = n.ints(1)
    return (n.op == "StridedSlice" and begin is not None and len(begin) == 1
            and begin[0] == n.states[0].batch_at and out == [])


def _times(degree, factor):
    return None if degree is None else degree * factor


def _total(degrees):
    return None if None in degrees else sum(degrees)


def _same(n: _Node, degrees: list, states: list):
    """The one degree of values that are added, joined or moved together; a Mixed where a
    per-example value meets one of another degree."""
    if not degrees or None in degrees:
        return None
    if len(set(degrees)) == 1:
        return degrees[0]
    if any(type(s) is int for s in states):
        return n.mixed("adds per-example values that scale with the batch's size to values "
                       "that do not, or scale otherwise (as FGSM's x + eps * dL/dx adds the "
                       "gradient of a mean loss, each example's over the size, to the "
                       "examples)")
    if min(degrees) < 0:
        return n.mixed("adds a total that scales with the inverse of the batch's size (made "
                       "from the gradient of a mean loss, as double backprop's penalty on "
                       "dL/dx is) to totals that scale otherwise: on a replica's slice of 1/N "
                       "of the batch it weighs N times more")
    return None
