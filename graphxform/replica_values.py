"""How each replica's copy of a node relates to what the single-device graph computes for the
whole global batch: the classification merge-fetches serves original names by.

Every replica runs the same step from equal variables on its own even slice of the global batch
(split-inputs cuts it in replica order). Each output tensor of replica 0's copy gets a class:

- ``identical``: equal on every replica and to the single-device value. Constants, variables and
  their reads (replicas hold equal variables), what every replica shares (a node without a
  ``replica_<i>`` path component runs once) or what replica 0 alone has (sync-init's initial
  values), cross-replica results that give the batch's value (an all-reduce averaging the
  replicas' means, as of born gradients; accumulator ``take_grad``), the value an update op
  returns, a seeded random draw of an identical shape, and anything a deterministic
  op computes from these alone. Served: replica 0's. What a pass made in a replica's scope
  (``allreduce/bucket_0/replica_0/...``) follows the same rules as the copies; a constant
  there that differs from another replica's counterpart is unknown. A variable that the step
  writes with a value that differs between replicas (batch-norm statistics of the slice, an
  update from a local gradient) drifts apart: it and its reads are unknown (the sweep runs
  again with them so), unless it is a running total: it starts at zero and every write adds
  the slice's sum or count (a metric's total and count), which makes it and its reads
  ``sum``, or the slice's mean, ``mean``.
- ``same``: equal on every replica, but not shown to be the single-device value: a collective
  that does not average means, sum sums or gather batch slices (the gradient sums synchronised
  batch norm exchanges), a shared node that combines the replicas' values (the ps
  strategies' AddN of every replica's copy is classed as the collective it stands in for),
  and what is computed from these. Served: replica 0's, and named as not merged. Writing it keeps a
  variable equal on every replica.
- ``batch``: axis 0 is the replica's slice of the batch (the split inputs, and per-example work
  on them: elementwise ops with identical operands of no higher rank, MatMul by an identical
  matrix, an Einsum keeping the batch's letter first (``bi,ij->bj``), convolutions,
  reshapes that keep a leading -1, reductions and slices that leave axis 0 alone, gathers
  of identical rows by batch ids). Served: the replicas concatenated on axis 0.
- ``batch_fill``: a batch tensor whose rows do not depend on the data (``ones_like``, ``Fill``
  or ``Tile`` of identical values to a batch shape). Served like batch; its sum over the batch
  is a count.
- ``mean``: the single-device value is the average of the replicas'. A mean over axes that
  include axis 0 of a batch tensor (or all axes), a sum divided by a count (how
  tf.compat.v1.losses and tf_keras losses take their mean), and affine combinations of means
  with identical values (``total_loss = mean + regularization``). Served: the average.
- ``sum``: the single-device value is the sum of the replicas' (``reduce_sum`` over axis 0 of a
  batch tensor, ``L2Loss`` of one, a MatMul or Einsum contracting batch tensors over the batch, an
  ``UnsortedSegmentSum`` of its examples by their own segment ids, sums and identical
  multiples of these). Served: the sum.
- ``count``: how many examples or elements the slice has (``Size`` of a batch tensor, its
  ``Shape[0]``, the sum of a batch_fill of ones): equal on every replica, served summed.
- ``max``, ``min``: the single-device value is the largest (smallest) of the replicas': a Max
  (Min) over axis 0 of a batch tensor, as ``tf.sequence_mask`` takes the batch's longest
  length, and casts of it. Served: the Max (Min) of the replicas'.
- ``batch_shape``: the ``Shape`` of a batch tensor: its first element is a count, the rest are
  identical. It has no merge of its own (served as unknown), but slicing it gives those.
- ``unknown``: nothing above can be shown: batch norm in training mode (statistics of the slice
  differ from the batch's), unseeded random draws of a fixed shape, what legacy
  loops carry, the insides of ``tf.gradients`` (scaled by the slice's size), ops without a rule
  here. Served: replica 0's value, and named as not merged.

One rule comes from the training step rather than from an op: the gradient ``tf.gradients``
bore for a variable has its loss's class (a gradient is linear in its loss; a loss of one value
per example is summed: ``differentiated``), so losses are classified first. (merge-fetches
then serves a loss that is not shown to be a mean, as under batch norm, as the mean anyway:
that is what the averaged gradients train.) User overrides (the
strategies' ``fetch_mean`` and ``fetch_concat``) take precedence over everything.

A constant split-inputs rewrote from the global batch to the slice (a shape, size or divisor TF
folded from a fixed batch), a node a pass made with no single-device counterpart, and the
Identity consistent-random makes of a draw (the replica's rows of the global draw), have the
class their ``REBATCHED_ATTR`` names. Only static facts are
read: op types, attrs, the values of Const inputs (axes, shapes,
permutations) and ranks carried forward from placeholders, variables and constants; what a rule
cannot see (an unknown rank beside a negative axis, axes that are not constants) makes the
result unknown. Classes flow in one sweep over replica 0's copies and the shared and pass-made
nodes they read, each visited after its inputs (depth first along the graph's adjacency, so a
graph in the usual order costs one look at each edge); the back edges of legacy while loops are
not waited for, so what a loop carries is unknown. Ranks are only worked out where a rule asks.

Beside the classes, ``effects`` names the copies whose running does more than compute a value:
their ancestors (data or control) include a variable write, a queue or accumulator op, or a
collective (which waits for every replica). Fetching such a node must run every replica's copy.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import numpy as np

from graphxform import opdefs
from graphxform.ir import CONTROL_KEY, data_pairs
from graphxform.training import RANDOM_OPS, VARIABLE_OPS, is_mutating_op

IDENTICAL, SAME, BATCH, BATCH_FILL, MEAN, SUM, COUNT, BATCH_SHAPE, UNKNOWN = (
    "identical", "same", "batch", "batch_fill", "mean", "sum", "count", "batch_shape", "unknown")
MAX, MIN = "max", "min"
BATCHED = frozenset({BATCH, BATCH_FILL})
EXTREMES = frozenset({MAX, MIN})
_EXTREME_OF = {"Max": MAX, "Min": MIN}
# on a constant split-inputs rewrote from the global batch's value to the slice's (a folded
# shape, size or mean divisor): the class it stands for (batch_shape, count, batch_fill); on
# global-denominators' number of replicas: same (the single-device graph has none)
REBATCHED_ATTR = "_graphxform_batch_class"
_MARKED_OPS = ("Const", "Identity")  # what split-inputs and consistent-random mark so
LINEAR = frozenset({MEAN, SUM, COUNT})  # merged by averaging or summing; linear ops keep them

# a replica's node: a replica_<i> component
REPLICA_COMPONENT = re.compile(r"(?:^|/)(replica_\d+/)")
_BACK_EDGE_OPS = frozenset({"NextIteration", "RefNextIteration"})
_EFFECT_PREFIXES = ("Queue", "Collective", "Accumulator", "SparseAccumulator",
                    "ResourceAccumulator", "Nccl", "Barrier")
_CROSS_REPLICA = frozenset({"CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3",
                            "CollectiveGather", "CollectiveGatherV2", "CollectiveBcastRecv",
                            "CollectiveBcastRecvV2", "CollectiveAllToAllV2",
                            "CollectiveAllToAllV3", "NcclAllReduce", "AccumulatorTakeGradient",
                            "SparseAccumulatorTakeGradient", "ResourceAccumulatorTakeGradient"})
# stateful ops whose outputs are still a function of their (identical) inputs
_STATEFUL_PURE = frozenset(VARIABLE_OPS | {
    "ReadVariableOp", "VarIsInitializedOp", "IsVariableInitialized", "VariableShape",
    "ResourceGather", "ResourceGatherNd", "Placeholder", "PlaceholderWithDefault"})
# ops whose output can be known although an input is unknown
_PAST_UNKNOWN = _CROSS_REPLICA | {"Rank", "Assign", "AssignAdd", "AssignSub", "IdentityN"}
_FLOAT_TYPES = frozenset({1, 2, 8, 14, 18, 19})  # float double complex64 bfloat16 complex128 half
_ALL = "all"  # reduction axes covering every dimension (rank unknown)


def differentiated(kind: str) -> str:
    """The class of what tf.gradients (and so ``minimize``) differentiates for ys of class
    ``kind``: the sum of ys's elements, so ys of one value per example (an unreduced cross
    entropy, DDPG's actions seeded with the critic's action gradients) is a sum over the
    batch, whose replicas' gradients must be summed, not averaged."""
    return SUM if kind in BATCHED else kind


@dataclasses.dataclass
class ReplicaValues:
    """The result: ``classes`` maps each node of the sweep to its classes per output (a tuple
    shorter than the node's outputs repeats its last class); ``effects`` the nodes whose
    running has effects beyond their value."""
    classes: dict
    effects: set

    def of(self, node: str, port: int = 0) -> str:
        found = self.classes.get(node)
        if found is None:
            return UNKNOWN
        return found[port] if port < len(found) else found[-1]


def classify(ir, prefix: str = "replica_0/", forced=None, gradients=None, copies=None,
             single=frozenset(), step=None, settled=frozenset(),
             races: bool = False) -> ReplicaValues:
    """Classify every node named ``prefix`` + something (``copies``, if the caller has them),
    and what they read.

    ``forced``: {(node, port): class} set whatever the rules say (user overrides).
    ``gradients``: {(node, port): (loss node, loss port)}: a born gradient has its loss's class.
    ``single``: copies no other replica has (sync-init's initial values, which every replica
    reads): one instance, identical like a shared node.
    ``step``: the copies a training step runs, whose variable writes can make replicas drift
    apart; a write outside it does only where it writes what the batch makes (a tf_keras
    metric's update, run by fetching its value), not an initializer (sync-init's to make
    equal) nor a restore. None: every write.
    ``settled``: variables (replica 0's copies) the caller keeps equal on every replica
    whatever their writes read (global-state reduces what is written): identical.
    ``races``: what reads a shared variable the replicas' copies all write is unknown (see
    _Sweep.raced_variables): for serving fetches of the finished graph. The passes before it
    leave this off: their writes are still every replica's (ps keeps replica 0's statistics'
    updates alone later), and global-state must see what those writes read as identical.
    """
    if copies is None:
        copies = replica_copies(ir, prefix)
    forced = dict(forced or {})
    forced.update(((variable, 0), IDENTICAL) for variable in settled)
    raced, op_flags = set(), {}  # op_flags: what each op type is, for every sweep
    while True:
        sweep = _Sweep(ir, prefix, forced, dict(gradients or {}), single, raced, op_flags)
        values = sweep.run(copies)
        # their reads differ (or add up to the single-device value): classify again so. A
        # variable's class changes at most twice (to a running total's, then to unknown,
        # which stays), and ``raced`` only grows, which ends the loop
        found = sweep.raced_variables(step) - raced if races else set()
        raced |= found
        more = {}
        for variable, kind in sweep.drifting_variables(step).items():
            if variable in settled:
                continue
            was = forced.get((variable, 0))
            if was != kind and was != UNKNOWN:
                more[(variable, 0)] = kind if was is None else UNKNOWN
        if not more and not found:
            return values
        forced.update(more)


def replica_copies(ir, prefix: str) -> list[str]:
    """The nodes named ``prefix`` + something, in graph order (one sweep at C speed)."""
    names = list(ir.g._node)
    return list(itertools.compress(names, map(str.startswith, names, itertools.repeat(prefix))))


_ADDS = frozenset({"AssignAdd", "AssignAddVariableOp", "AssignSub", "AssignSubVariableOp"})
_SETS = frozenset({"Assign", "AssignVariableOp"})


def _zeros(ir, node: str, depth: int = 0) -> bool:
    """Whether ``node`` is zeros whatever runs: a Const of zeros, a Fill with zero, ZerosLike,
    or an Identity of one."""
    op = ir.op(node)
    if op == "ZerosLike":
        return True
    if op in ("Identity", "Fill") and depth < 8:
        return _zeros(ir, ir.input(node, 1 if op == "Fill" else 0)[0], depth + 1)
    from graphxform.nodes import const_value
    try:
        value = const_value(ir, node)
    except (TypeError, ValueError):  # a string constant
        return False
    return value is not None and not value.any()


_I, _S, _U = (IDENTICAL,), (SAME,), (UNKNOWN,)  # shared: ``is`` tells the common cases fast
_NO_RANK = (None,)
_LAZY = object()  # ranks not worked out yet


class _Sweep:
    """One pass over replica 0's copies and the shared and pass-made nodes they read, each
    visited after its inputs."""

    def __init__(self, ir, prefix, forced, gradients, single=frozenset(), raced=frozenset(),
                 op_flags=None):
        self.ir = ir
        self.prefix = prefix
        self.single = single
        self.raced = raced  # shared variables the replicas' copies write (raced_variables)
        self.nodes, self.pred = ir.g._node, ir.g._pred
        self.forced, self.gradients = forced, gradients
        self.overridden = {}  # node -> ports a step rule or an override names
        for node, port in [*forced, *gradients]:
            self.overridden.setdefault(node, set()).add(port)
        self.classes, self.ranks, self.effects = {}, {}, set()
        self.foreign = set()  # other replicas' copies met on the way: unknown, effectful
        self._consts = {}
        self._op_flags = {} if op_flags is None else op_flags  # op -> see op_flags
        self._depth = 0  # of the ranks being worked out on demand
        self.writes = []  # replica 0's ops that write a variable

    def run(self, copies: list) -> ReplicaValues:
        """Visit every copy after its inputs (depth first from each, in graph order, so the
        usual order costs one look at each input); losses go first, so that a gradient can
        take its loss's class."""
        losses = [node for node, _ in self.gradients.values()]
        classes, pred = self.classes, self.pred
        for name in itertools.chain(losses, copies):
            if name in classes:
                continue
            if pred[name].keys() <= classes.keys():  # the usual order: its inputs are done
                self._visit(name)
            else:
                self._visit_after_inputs(name)
        return ReplicaValues(self.classes, self.effects)

    def _visit_after_inputs(self, start: str) -> None:
        """Visit ``start`` and, first, its unvisited inputs, depth first. Loop back edges,
        copies of other replicas and inputs on a cycle are not waited for: they read as
        unknown."""
        classes, pred, foreign = self.classes, self.pred, self.foreign
        stack, on_path = [start], set()  # on_path: expanded, waiting for their inputs
        while stack:
            name = stack[-1]
            if name in classes:
                stack.pop()
            elif name in on_path:  # its inputs are done
                stack.pop()
                on_path.discard(name)
                self._visit(name)
            else:
                on_path.add(name)
                stack.extend(src for src in pred[name]
                             if src not in classes and src not in on_path
                             and src not in foreign and self._followed(src))

    def _followed(self, src: str) -> bool:
        """Whether the sweep waits for ``src``: not for a loop's back edge, nor for another
        replica's node (remembered as foreign)."""
        if self._owner(src) is False:
            self.foreign.add(src)
            return False
        return self.nodes[src]["op"] not in _BACK_EDGE_OPS

    def _owner(self, name: str):
        """True for this replica's nodes (its copies, and what passes made in its scope, such
        as ``allreduce/bucket_0/replica_0/...``), False for another replica's, None for a node
        every replica shares."""
        if name.startswith(self.prefix):
            return True
        found = REPLICA_COMPONENT.search(name)
        return None if found is None else found.group(1) == self.prefix

    # ------------------------------------------------------------------ visit
    def _visit(self, name: str) -> None:
        """Classify ``name`` from its inputs' classes. Identical inputs of a deterministic op
        and unknown inputs of most ops decide without a rule; ranks are worked out when a rule
        first asks for one (most identical tensors never meet a batch tensor)."""
        data = self.nodes[name]
        op = data["op"]
        preds = self.pred[name]
        effect, pure = self._op_flags.get(op) or self.op_flags(op)
        if (effect or not self.effects.isdisjoint(preds)
                or self.foreign and not self.foreign.isdisjoint(preds)):
            self.effects.add(name)
        classes = self.classes
        self.ranks[name] = _LAZY
        identical, unknown, same = True, False, True  # same: every input identical or same
        for src, keys in data_pairs(preds):  # without most control-only pairs, by identity
            if len(keys) == 1 and CONTROL_KEY in keys:
                continue
            found = classes.get(src)
            if found is not _I:
                identical = False
                if found is None or found is _U:
                    unknown, same = True, False
                elif found is not _S:
                    same = False
        if (not name.startswith(self.prefix) and self._owner(name) is None) \
                or name in self.single:  # (replica 0's copies: owned, the usual case)
            classes[name] = (_U if name in self.raced else self._combined(name, op)
                             or _shared_classes(data, op, identical))
            return
        if op in _MARKED_OPS:
            attrs = self.ir.attrs(name)  # not data["attr"]: that makes a copy its own NodeDef
            if REBATCHED_ATTR in attrs and name not in self.overridden:
                mark = (attrs[REBATCHED_ATTR].s.decode(),)  # the shared tuples, which the
                # shortcuts above tell by identity (global-denominators' count is ``same``)
                classes[name] = next((c for c in (_I, _S, _U) if c == mark), mark)
                return
            if op == "Const" and not name.startswith(self.prefix):
                classes[name] = self._made_constant(name)
                return
        if effect and is_mutating_op(op):
            self.writes.append(name)
        if name not in self.overridden:
            if identical and pure:
                classes[name] = _I
                return
            if unknown and op not in _PAST_UNKNOWN:
                classes[name] = _U
                return
            if same and pure and op not in _CROSS_REPLICA:
                classes[name] = _S
                return
        found, self.ranks[name] = RULES.get(op, _default)(self._node(name, op))
        if name in self.overridden:
            found = self._adjusted(name, found)
        classes[name] = _I if found == _I else _U if found == _U else _S if found == _S else found

    def _combined(self, name: str, op: str):
        """A shared node that combines every replica's copy of one tensor (the ps strategies'
        stand-in for an all-reduce, passes/cross_replica.combine_copies) is classed as the
        collective (_cross_replica): identical (of the copy's rank) where it is the whole
        batch's value, an AddN of sums or counts, that AddN over the number of replicas of
        means, the largest of maxima (the smallest of minima); else the same on every replica
        (a mean of sums is no single-device value). None for any other node."""
        from graphxform.nodes import const_value
        ir, inputs = self.ir, self.ir.inputs(name)
        if op in DIVIDE_OPS and len(inputs) == 2:  # their AddN over the number of replicas
            total, count = inputs[0][0], const_value(ir, inputs[1][0])
            if ir.op(total) != "AddN" or count is None or count.size != 1 or \
                    count.reshape(-1)[0] != len(ir.inputs(total)):
                return None
            combining, kinds = total, (MEAN, IDENTICAL)
        else:
            combining = name
            kinds = {"AddN": (SUM, COUNT), "Maximum": (MAX,), "Minimum": (MIN,)}.get(op)
        copy = self._combined_copy(combining) if kinds else None
        if copy is None:
            return None
        self.ranks[name] = (self.rank_of(*copy),)
        return _I if self.class_of(*copy) in kinds else _S

    def _combined_copy(self, name: str):
        """This replica's copy (node, port) of the tensor ``name`` combines every replica's
        copy of (replica_spread.combines_every_replica), or None."""
        from graphxform.replica_spread import combines_every_replica
        if not combines_every_replica(self.ir, name):
            return None
        src, port = self.ir.inputs(name)[-1]  # replica_<k>/X: a copy (a chain's last link)
        return self.prefix + src.split("/", 1)[1], port

    def _made_constant(self, name: str) -> tuple:
        """A constant a pass made in this replica's scope: identical when another replica's
        counterpart holds the same value (a shape, a group size), else unknown (a replica's own
        offset); identical when no other replica has one."""
        head = REPLICA_COMPONENT.search(name)
        other_prefix = "replica_1/" if self.prefix != "replica_1/" else "replica_0/"
        other = name[:head.start(1)] + other_prefix + name[head.end(1):]
        if other not in self.nodes:
            return _I
        same = self.ir.attrs(other).get("value") == self.ir.attrs(name).get("value")
        return _I if same else _U

    def _node(self, name: str, op: str) -> "_Node":
        inputs = []
        for src, keys in self.pred[name].items():
            for key, edge in keys.items():
                if key != CONTROL_KEY:
                    inputs.append((key, src, edge["src_port"]))
        inputs.sort()
        return _Node(self, name, op, [(src, port) for _, src, port in inputs])

    def _rank_now(self, name: str) -> tuple:
        """The ranks of ``name``'s outputs, from its rule (its inputs' first, recursively; a
        node on a cycle or too deep reads as unknown rank)."""
        self.ranks[name] = _NO_RANK
        if self._depth > 64:
            return _NO_RANK
        self._depth += 1
        try:
            _, ranks = RULES.get(self.nodes[name]["op"], _default)(
                self._node(name, self.nodes[name]["op"]))
        finally:
            self._depth -= 1
        self.ranks[name] = ranks
        return ranks

    def _adjusted(self, name: str, classes: tuple) -> tuple:
        """``classes`` with the gradient rule and then the user's overrides applied per port."""
        ports = self.overridden[name]
        out = list(classes) + [classes[-1]] * (max(ports) + 1 - len(classes))
        for port in ports:
            key = (name, port)
            if key in self.gradients:
                kind = differentiated(self.class_of(*self.gradients[key]))
                out[port] = kind if kind in (MEAN, SUM, IDENTICAL) else UNKNOWN
            if key in self.forced:
                out[port] = self.forced[key]
        return tuple(out)

    def drifting_variables(self, step=None) -> dict:
        """Replica 0's variables that a write (see classify's ``step``) moves by something that
        differs between replicas (batch-norm statistics from the slice, an update from a local
        gradient): their copies drift apart, so what reads them is not identical. Each maps to
        its class: a running total's ``sum`` or ``mean`` (see _running_total), else unknown."""
        found = set()
        for name in self.writes:
            node = self._node(name, self.nodes[name]["op"])
            if not node.inputs or all(c in (IDENTICAL, SAME) for c in node.cls):
                continue
            if step is not None and name not in step and all(
                    c in (IDENTICAL, SAME, UNKNOWN) for c in node.cls):
                continue  # outside the step, of nothing the batch is known to make
            variable = node.inputs[0][0]
            if (variable.startswith(self.prefix)
                    and self.nodes[variable]["op"] in VARIABLE_OPS):
                found.add(variable)
        return {variable: self._running_total(variable) for variable in sorted(found)}

    def raced_variables(self, step=None) -> set:
        """Shared variables (one instance, as ps keeps every variable) that replica 0's copies
        write with a value the batch makes, or add to (a tf_keras metric's total and count),
        as another replica's copies do: every replica writes the one instance in no order with
        the others, so a replica's read of it gives the value after some replicas' writes, not
        the single-device value. What reads it is unknown; merge-fetches runs such a read again
        after every replica's writes (passes/merge_fetches.py's _recompute). A set of an
        identical value is no race, nor a write replica 0 alone keeps (ps's batch-norm
        statistics); an addition is, even of an identical value (a tf_keras Mean metric of
        the loss counts one per call)."""
        found = set()
        other = "replica_1/" if self.prefix != "replica_1/" else "replica_0/"
        for name in self.writes:
            if (not name.startswith(self.prefix)
                    or other + name[len(self.prefix):] not in self.nodes):
                continue  # replica 0's alone
            node = self._node(name, self.nodes[name]["op"])
            if not node.inputs:
                continue
            variable = node.inputs[0][0]
            if (self._owner(variable) is not None or variable in self.single
                    or self.nodes[variable]["op"] not in VARIABLE_OPS):
                continue
            values = node.cls[1:]
            if node.op in _SETS and (all(c in (IDENTICAL, SAME) for c in values) or (
                    step is not None and name not in step
                    and all(c in (IDENTICAL, SAME, UNKNOWN) for c in values))):
                continue  # outside the step, of nothing the batch is known to make
            found.add(variable)  # an addition races even of an identical value (a count)
        return found

    def _running_total(self, variable: str) -> str:
        """``sum`` when ``variable`` holds a running total of the batch: every write adds (or
        subtracts) a sum or count over the replica's slice, or sets zeros (its initializer, a
        reset), as a metric's total and count are kept (tf.compat.v1.metrics, tf_keras
        metrics). Every replica's copy starts at zero and adds its own slice's part, so the
        copies add up to what the single-device variable holds. ``mean`` when every addition
        is a mean over the slice (tf.compat.v1.metrics.mean of the loss): the copies average
        to it. Else unknown."""
        added = set()
        for dst, port in self.ir.consumers(variable):
            op = self.nodes[dst]["op"]
            if port != 0 or not is_mutating_op(op):
                continue
            value = self.ir.input(dst, 1) if len(self.ir.inputs(dst)) > 1 else None
            if value is None:
                return UNKNOWN
            if op in _ADDS:
                kind = self.class_of(*value)
                added.add(SUM if kind == COUNT else kind)
            elif op not in _SETS or not _zeros(self.ir, value[0]):
                return UNKNOWN
        return added.pop() if added in ({SUM}, {MEAN}) else UNKNOWN

    def op_flags(self, op: str) -> tuple[bool, bool]:
        """(running it has an effect, its outputs follow from its inputs) for an op type."""
        found = self._op_flags.get(op)
        if found is None:
            effect = is_mutating_op(op) or op.startswith(_EFFECT_PREFIXES)
            pure = (op in _STATEFUL_PURE or is_mutating_op(op)
                    or not opdefs.is_stateful(self.ir, op))
            found = self._op_flags[op] = (effect, pure)
        return found

    # ------------------------------------------------------------ reading
    def class_of(self, src: str, port: int) -> str:
        found = self.classes.get(src)
        if found is None:
            return UNKNOWN
        return found[port] if port < len(found) else found[-1]

    def rank_of(self, src: str, port: int):
        found = self.ranks.get(src)
        if found is _LAZY:
            found = self._rank_now(src)
        if not found:
            return None
        return found[port] if port < len(found) else found[-1]

    def vector_length(self, src: str, port: int, depth: int = 0):
        """How many entries the 1-D int tensor ``src:port`` has, from Consts, Shapes (the rank
        of what they measure) and the ops that build shape vectors from them; else None."""
        op, ir = self.nodes[src]["op"], self.ir
        if op == "Const":
            values = self.const_ints(src)
            return None if values is None else len(values)
        if op in ("Shape", "ShapeN"):
            return self.rank_of(*ir.input(src, port if op == "ShapeN" else 0))
        if op == "Pack":
            return len(ir.inputs(src))
        if op in ("Reshape", "Slice", "Gather", "GatherV2"):  # to [k], of size [k], k picked
            at = {"Reshape": 1, "Slice": 2}.get(op, 1)
            size = self.const_ints(ir.input(src, at)[0])
            if op in ("Gather", "GatherV2"):
                return len(size) if size is not None and self.rank_of(*ir.input(src, 1)) == 1 \
                    else None
            return size[0] if size and len(size) == 1 and size[0] >= 0 else None
        if op in ("ConcatV2", "Identity", "Cast") and depth < 8:
            parts = ir.inputs(src)[:-1] if op == "ConcatV2" else ir.inputs(src)[:1]
            lengths = [self.vector_length(part, at, depth + 1) for part, at in parts]
            return None if not lengths or None in lengths else sum(lengths)
        return None

    def const_ints(self, src: str):
        return const_ints(self.ir, src, self._consts)


def const_ints(ir, src: str, cache: dict, depth: int = 0):
    """The integer values of ``src`` as a list when they follow from Consts alone (a Const, and
    Identity, Pack, ConcatV2, Range, Add, Sub, Mul and FloorMod of such, as TF builds ``rank -
    1``, ``[-1, d]``, tf.tensordot's permutations or a mean's gradient's ``(axes + rank) %
    rank``); else None. ``cache``: node -> values."""
    if src in cache:
        return cache[src]
    value = None
    op = ir.g._node[src]["op"]
    if op == "Const":
        tensor = ir.attrs(src)["value"].tensor
        if tensor.dtype in (3, 9):  # int32, int64
            value = _int_values(tensor)
    elif op in _FOLDED and depth < 16:
        value = _fold(op, [const_ints(ir, part, cache, depth + 1) for part, _ in ir.inputs(src)])
    cache[src] = value
    return value


_FOLDED = frozenset({"Identity", "Pack", "ConcatV2", "Range", "Add", "AddV2", "Sub", "Mul",
                     "FloorMod"})


def _int_values(tensor) -> list[int]:
    """The values of an int32 or int64 TensorProto, flattened, as tensor_util.MakeNdarray reads
    them (the typed field padded with its last value, or zeros; or the raw bytes), read
    straight from the proto: a graph has thousands of such Consts (shapes, axes). What the
    shortcut does not cover (a count the values do not fit) goes through MakeNdarray."""
    count = 1
    for dim in tensor.tensor_shape.dim:
        count *= dim.size
    if count >= 0:
        content = tensor.tensor_content
        if content:
            if len(content) == count * (4 if tensor.dtype == 3 else 8):
                return np.frombuffer(content, np.int32 if tensor.dtype == 3 else np.int64).tolist()
        else:
            values = tensor.int_val if tensor.dtype == 3 else tensor.int64_val
            if len(values) == count:
                return list(values)
            if not values:
                return [0] * count
            if len(values) < count:
                return [*values, *[values[-1]] * (count - len(values))]
    from tensorflow.python.framework import tensor_util
    return [int(v) for v in tensor_util.MakeNdarray(tensor).reshape(-1)]


def _fold(op: str, parts: list):
    """``op`` applied to integer lists (None when a part is unknown)."""
    if op == "ConcatV2":
        parts = parts[:-1]
    if not parts or any(p is None for p in parts):
        return None
    if op == "Identity":
        return parts[0]
    if op in ("Pack", "ConcatV2"):
        return [v for p in parts for v in p]
    if op == "Range":
        if all(len(p) == 1 for p in parts) and parts[2][0] != 0:
            return list(range(parts[0][0], parts[1][0], parts[2][0]))
        return None
    a, b = parts
    if len(a) != len(b) and 1 not in (len(a), len(b)):
        return None
    width = max(len(a), len(b))
    a, b = (a * width if len(a) == 1 else a), (b * width if len(b) == 1 else b)
    if op == "FloorMod" and 0 in b:
        return None
    combine = {"Sub": lambda x, y: x - y, "Mul": lambda x, y: x * y,
               "FloorMod": lambda x, y: x % y}.get(op, lambda x, y: x + y)
    return [combine(x, y) for x, y in zip(a, b)]


def _shared_classes(data: dict, op: str, inputs_identical: bool) -> tuple:
    """A node every replica shares runs once, so it is the same for all: identical when its
    inputs are (or it is one of the input's slices split-inputs cuts: batch); one that combines
    replicas' values (an AddN on one device) is not shown to be the single-device value."""
    if op == "Split" and data.get("created_by") == "split-inputs":
        return (BATCH,)
    return _I if inputs_identical else _S


class _Node:
    """What a rule sees of one node: its inputs' classes and ranks, attrs and Const inputs."""

    __slots__ = ("sweep", "name", "op", "inputs", "cls", "_rank")

    def __init__(self, sweep: _Sweep, name: str, op: str, inputs: list):
        self.sweep, self.name, self.op, self.inputs = sweep, name, op, inputs
        self.cls = [sweep.class_of(src, port) for src, port in inputs]
        self._rank = None

    @property
    def rank(self) -> list:
        """The inputs' ranks (None where unknown), worked out on first use."""
        if self._rank is None:
            self._rank = [self.sweep.rank_of(src, port) for src, port in self.inputs]
        return self._rank

    def attr(self, key: str):
        return self.sweep.ir.attrs(self.name).get(key)

    def ints(self, k: int):
        """The integer values of Const input ``k`` (a list), or None."""
        if k >= len(self.inputs) or (k < 0 and -k > len(self.inputs)):
            return None
        return self.sweep.const_ints(self.inputs[k][0])

    def axis(self, k: int, rank):
        """Const input ``k`` as one axis, made non-negative with ``rank`` (None if unknown)."""
        values = self.ints(k)
        if not values or len(values) != 1:
            return None
        return _non_negative(values[0], rank)

    def shape_length(self, k: int):
        """How many entries the 1-D shape vector at input ``k`` has: the rank it makes."""
        if k >= len(self.inputs):
            return None
        return self.sweep.vector_length(*self.inputs[k])

    def others_identical(self, *kept: int) -> bool:
        """Whether every input but those at ``kept`` is identical."""
        return all(c == IDENTICAL for k, c in enumerate(self.cls) if k not in kept)


def _non_negative(axis: int, rank):
    if axis >= 0:
        return axis
    return None if rank is None else axis + rank


# --------------------------------------------------------------------- rules
# Each rule takes a _Node and returns (classes per output, ranks per output); a tuple shorter
# than the outputs repeats its last entry.

def _default(n: _Node):
    """Unknown ops: identical from identical inputs when deterministic, otherwise unknown; the
    rank export_meta_graph recorded (tf.sequence_mask's Range is a vector that broadcasts
    against each example's length)."""
    pure = n.sweep.op_flags(n.op)[1]
    identical = pure and all(c == IDENTICAL for c in n.cls)
    return (IDENTICAL if identical else UNKNOWN,), _recorded_ranks(n)


def _recorded_ranks(n: _Node) -> tuple:
    """The rank of each output in ``_output_shapes`` (None where unknown)."""
    shapes = n.attr("_output_shapes")
    ports = range(len(shapes.list.shape)) if shapes is not None else ()
    dims = [opdefs.recorded_dims(n.sweep.ir, n.name, port) for port in ports]
    return tuple(None if d is None else len(d) for d in dims) or (None,)


def _source(n: _Node):
    """Placeholders, variables and constants: identical; their rank from their shape attr."""
    attr = n.attr("value") if n.op == "Const" else n.attr("shape")
    if attr is None:
        return (IDENTICAL,), (None,)
    shape = attr.tensor.tensor_shape if n.op == "Const" else attr.shape
    return (IDENTICAL,), (None if shape.unknown_rank else len(shape.dim),)


def _read(n: _Node):
    """A variable read: identical, or a running total's sum or mean; its rank is the
    variable's (carried by the handle)."""
    kind = n.cls[0] if n.cls and n.cls[0] in (IDENTICAL, SUM, MEAN) else UNKNOWN
    return (kind,), (n.rank[0] if n.rank else None,)


def _identity_n(n: _Node):
    """IdentityN: each output is its input (sync-batch-norm's rewritten batch norm keeps its
    ports so)."""
    return tuple(n.cls) or (UNKNOWN,), tuple(n.rank) or (None,)


def _linear_unary(n: _Node):
    """Ops that pass their input's value through (or negate it): every class survives (a
    negated largest value is the smallest)."""
    c = n.cls[0] if n.others_identical(0) else UNKNOWN
    if n.op == "Neg" and c in EXTREMES:
        c = MIN if c == MAX else MAX
    return (c,), (n.rank[0],)


def _cast(n: _Node):
    c = n.cls[0]
    if c in (MEAN, SUM) and n.attr("DstT").type not in _FLOAT_TYPES:
        c = UNKNOWN  # rounding a mean or sum is not the rounded merge
    return (c,), (n.rank[0],)


def _elementwise_unary(n: _Node):
    """A function of each element: per-example structure survives, averages and sums do not."""
    c = n.cls[0]
    return (c if c in BATCHED or c == IDENTICAL else UNKNOWN,), (n.rank[0],)


def _like(n: _Node):
    """zeros_like / ones_like: rows that do not depend on the data."""
    c = n.cls[0]
    kind = BATCH_FILL if c in BATCHED else UNKNOWN if c == UNKNOWN else IDENTICAL
    return (kind,), (n.rank[0],)


def _last_axis(n: _Node):
    """Softmax and the like work on the last axis: per-example when that is not axis 0."""
    c, rank = n.cls[0], n.rank[0]
    if c == IDENTICAL:
        return (IDENTICAL,), (rank,)
    return (c if c in BATCHED and rank is not None and rank >= 2 else UNKNOWN,), (rank,)


def _broadcast(classes, ranks) -> str:
    """Identical and batch operands of a broadcasting op: batch when every batch operand has
    the same known rank and no identical operand has more dimensions (which would move the
    batch axis off axis 0)."""
    batch_ranks = {r for c, r in zip(classes, ranks) if c in BATCHED}
    if not batch_ranks:
        return IDENTICAL
    if len(batch_ranks) != 1 or None in batch_ranks:
        return UNKNOWN
    (top,) = batch_ranks
    if any(c == IDENTICAL and (r is None or r > top) for c, r in zip(classes, ranks)):
        return UNKNOWN
    return BATCH if BATCH in classes else BATCH_FILL


_ADDITIVE = frozenset({"Add", "AddV2", "Sub", "AddN"})
_MULTIPLY = frozenset({"Mul", "MulNoNan"})
DIVIDE_OPS = frozenset({"RealDiv", "Div", "DivNoNan", "TrueDiv"})
# how a loss's value passes on from its terms to what the user minimises
LOSS_TERM_OPS = frozenset({"Identity", "AddV2", "Add", "Sub", "Mul", "AddN", "Neg"})
# how a per-example weight reaches the losses it multiplies (from its input 0): Keras squeezes,
# expands and casts its sample weights
WEIGHT_OPS = frozenset({"Reshape", "ExpandDims", "Squeeze", "Cast", "StopGradient",
                        "BroadcastTo", "Tile"})


def loss_divisions(ir, loss: tuple):
    """The divisions on the way of ``loss`` (node, port) from its terms: through the terms
    (LOSS_TERM_OPS), the reductions that sum or average them, a weight's way (WEIGHT_OPS) and
    a division's dividend. Their divisors are the ones a loss divides by (a weighted mean's
    total, a mask over its mean): graphxform.contract.batch_denominators looks here, and
    global-denominators makes those of the batch's data the whole batch's."""
    seen, stack = set(), [loss]
    while stack:
        node, port = stack.pop()
        if (node, port) in seen:
            continue
        seen.add((node, port))
        op = ir.op(node)
        inputs = ir.inputs(node)
        if op in DIVIDE_OPS and len(inputs) == 2:
            yield node
            stack.append(inputs[0])
        elif op in LOSS_TERM_OPS:
            stack.extend(inputs)
        elif op in ("Sum", "Mean") or op in WEIGHT_OPS:  # of per-class ratios
            stack.append(inputs[0])  # (tf.math.unsorted_segment_mean), or a weight's way


_EXTREME_OPS = {"Maximum": MAX, "Minimum": MIN}


def _linear_combination(op: str, classes) -> str:
    """Means, sums and counts through +, -, * and / by identical values (and sum / count);
    maxima (minima) through Maximum (Minimum) with identical values or each other."""
    others = [c for c in classes if c != IDENTICAL]
    kinds = set(others)
    if op in _ADDITIVE:
        if kinds == {MEAN}:
            return MEAN  # mean(m_i + c) = mean(m_i) + c
        if kinds <= {SUM, COUNT} and len(others) == len(classes):
            return COUNT if kinds == {COUNT} else SUM
    elif op in _MULTIPLY:
        if len(others) == 1 and others[0] in LINEAR:
            return others[0]
    elif op in _EXTREME_OPS:  # max(c, max_r m_r) = max_r max(c, m_r): a running maximum
        if kinds == {_EXTREME_OPS[op]}:
            return _EXTREME_OPS[op]
    elif op in DIVIDE_OPS and len(classes) == 2:
        top, bottom = classes
        if bottom == IDENTICAL and top in LINEAR:
            return top
        if bottom == COUNT and top == SUM:
            return MEAN  # every slice has the same count
        if bottom == COUNT and top == COUNT:
            return IDENTICAL
    return UNKNOWN


def _elementwise(n: _Node):
    """Broadcasting elementwise ops (binary, AddN, SelectV2)."""
    known = [r for r in n.rank if r is not None]
    rank = max(known) if len(known) == len(n.rank) and known else None
    if set(n.cls) <= {IDENTICAL, BATCH, BATCH_FILL}:
        return (_broadcast(n.cls, n.rank),), (rank,)
    return (_linear_combination(n.op, n.cls),), (rank,)


def _select(n: _Node):
    """Select (v1) takes a per-row condition vector; otherwise it broadcasts."""
    cond, rest = n.cls[0], n.cls[1:]
    if cond in BATCHED and n.rank[0] == 1 and all(c in BATCHED for c in rest):
        return (BATCH,), (n.rank[1],)
    return _elementwise(n)


def _axes(n: _Node, rank):
    """The reduction axes at input 1, non-negative: a list, _ALL, or None when unknown."""
    src, _ = n.inputs[1]
    sweep = n.sweep
    values = sweep.const_ints(src)
    if values is None:
        if sweep.nodes[src]["op"] == "Range":  # range(0, rank(x), 1) for a reduction over all
            parts = sweep.ir.inputs(src)
            limit = parts[1][0] if len(parts) == 3 else None
            if (limit and sweep.nodes[limit]["op"] == "Rank"
                    and sweep.ir.input(limit, 0) == n.inputs[0]
                    and sweep.const_ints(parts[0][0]) == [0]
                    and sweep.const_ints(parts[2][0]) == [1]):
                return _ALL if rank is None else list(range(rank))
        return None
    axes = [_non_negative(a, rank) for a in values]
    return None if None in axes else sorted(set(axes))


def _reduce(n: _Node):
    """Sum, Mean, Max, ... over Const axes."""
    c, rank = n.cls[0], n.rank[0]
    axes = _axes(n, rank)
    keep = bool(n.attr("keep_dims").b) if n.attr("keep_dims") is not None else False
    out_rank = rank if keep else (0 if axes == _ALL else None if axes is None or rank is None
                                  else rank - len(axes))
    if n.cls[1] != IDENTICAL:
        return (UNKNOWN,), (out_rank,)
    if c == IDENTICAL:
        return (IDENTICAL,), (out_rank,)
    if c in LINEAR:
        return (c if n.op in ("Sum", "Mean") else UNKNOWN,), (out_rank,)
    if c in EXTREMES:
        return (c if _EXTREME_OF.get(n.op) == c else UNKNOWN,), (out_rank,)
    if c == BATCH_SHAPE and n.op == "Prod" and (axes == _ALL or axes == [0]):
        return (COUNT,), (out_rank,)  # the number of elements
    if c not in BATCHED or axes is None:
        return (UNKNOWN,), (out_rank,)
    if axes != _ALL and 0 not in axes:
        return (c,), (out_rank,)
    if n.op == "Mean":
        return (MEAN if c == BATCH else IDENTICAL,), (out_rank,)
    if n.op == "Sum":
        return (SUM if c == BATCH else COUNT,), (out_rank,)
    if c == BATCH_FILL and n.op in ("Max", "Min", "All", "Any"):
        return (IDENTICAL,), (out_rank,)
    if c == BATCH and n.op in _EXTREME_OF:
        return (_EXTREME_OF[n.op],), (out_rank,)
    return (UNKNOWN,), (out_rank,)


def _matmul(n: _Node):
    a, b = n.cls[0], n.cls[1]
    ta = bool(n.attr("transpose_a").b) if n.attr("transpose_a") is not None else False
    tb = bool(n.attr("transpose_b").b) if n.attr("transpose_b") is not None else False
    if a == IDENTICAL and b == IDENTICAL:
        kind = IDENTICAL
    elif a in BATCHED and b == IDENTICAL and not ta:
        kind = a  # row k of the product is row k of a times b
    elif a in BATCHED and b in BATCHED and ta and not tb:
        kind = SUM  # a^T b adds one term per example
    elif {a, b} in ({MEAN, IDENTICAL}, {SUM, IDENTICAL}):
        kind = a if b == IDENTICAL else b
    else:
        kind = UNKNOWN
    return (kind,), (2,)


def _batch_matmul(n: _Node):
    """Batched matmul: axis 0 of a batch operand stays axis 0 when the other operand has no
    more dimensions and neither is a plain matrix."""
    (a, b), (ra, rb) = n.cls[:2], n.rank[:2]
    rank = max(ra, rb) if ra is not None and rb is not None else None
    if a == IDENTICAL and b == IDENTICAL:
        return (IDENTICAL,), (rank,)
    if rank is None or rank < 3:
        return (UNKNOWN,), (rank,)
    if (a in BATCHED and (b in BATCHED and ra == rb or b == IDENTICAL and rb <= ra and ra >= 3)
            or b in BATCHED and a == IDENTICAL and ra < rb):
        return (BATCH,), (rank,)
    return (UNKNOWN,), (rank,)


def _einsum(n: _Node):
    """Einsum: where every batch operand has the same letter first (its axis 0), no other
    subscript of any operand uses it, and the output keeps it first, row k of the output is
    computed from the operands' rows k alone (``bi,ij->bj``, ``btd,dv->btv``, like MatMul by
    an identical matrix): batch. Summed away instead (``bi,bj->ij``, ``b,b->``), it adds one
    term per example: sum. A mean or sum times identical operands stays one. Anything else
    (the letter moved or repeated, ellipses) is unknown."""
    equation = n.attr("equation")
    text = equation.s.decode().replace(" ", "") if equation is not None else ""
    out_rank = len(text.split("->")[1]) if "->" in text and "." not in text else None
    if all(c == IDENTICAL for c in n.cls):
        return (IDENTICAL,), (out_rank,)
    if out_rank is None:
        return (UNKNOWN,), (None,)
    terms, out = text.split("->")
    terms = terms.split(",")
    if len(terms) != len(n.cls) or any(c not in BATCHED | {IDENTICAL} for c in n.cls):
        others = [c for c in n.cls if c != IDENTICAL]
        kind = others[0] if len(others) == 1 and others[0] in (MEAN, SUM) else UNKNOWN
        return (kind,), (out_rank,)
    letters = {terms[k][:1] for k, c in enumerate(n.cls) if c in BATCHED}
    letter = letters.pop() if len(letters) == 1 else ""
    if not letter or any(term.count(letter) != (n.cls[k] in BATCHED)
                         for k, term in enumerate(terms)):
        return (UNKNOWN,), (out_rank,)
    if out[:1] == letter:
        fill = all(c in (BATCH_FILL, IDENTICAL) for c in n.cls)
        return (BATCH_FILL if fill else BATCH,), (out_rank,)
    return (SUM if letter not in out else UNKNOWN,), (out_rank,)


def _per_example(n: _Node):
    """Convolutions, pools and the like: axis 0 of the data input is the batch in every data
    format; the other inputs (filters, sizes) must be identical."""
    c = n.cls[0]
    if not n.others_identical(0):
        return (UNKNOWN,), (n.rank[0],)
    return (BATCH if c in BATCHED else IDENTICAL if c == IDENTICAL else UNKNOWN,), (n.rank[0],)


def _batch_norm(n: _Node):
    """FusedBatchNorm: with batch statistics (training) the output depends on the slice."""
    rank = n.rank[0]
    if all(c == IDENTICAL for c in n.cls):
        return (IDENTICAL,), (rank, 1)
    training = n.attr("is_training")
    if n.cls[0] not in BATCHED or not n.others_identical(0):
        return (UNKNOWN,), (rank, 1)
    if training is not None and not training.b:
        return (BATCH, IDENTICAL), (rank, 1)
    # the slice's statistics normalise it; the batch mean (over N, H, W) averages to the
    # batch's, the (Bessel-corrected) variance does not
    return (UNKNOWN, MEAN, UNKNOWN), (rank, 1)


def _cross_entropy(n: _Node):
    """(Sparse)SoftmaxCrossEntropyWithLogits: a loss per example and its backprop."""
    rank = n.rank[0]
    ranks = (rank - 1 if rank is not None else None, rank)
    if all(c == IDENTICAL for c in n.cls):
        return (IDENTICAL,), ranks
    if all(c in BATCHED for c in n.cls):
        return (BATCH,), ranks
    return (UNKNOWN,), ranks


def _shape(n: _Node):
    """Shape of a batch tensor is a batch_shape; of a replica-independent one, identical."""
    kinds = tuple(BATCH_SHAPE if c in BATCHED else UNKNOWN if c == UNKNOWN else IDENTICAL
                  for c in n.cls)
    return kinds or (IDENTICAL,), (1,)


def _size(n: _Node):
    c = n.cls[0]
    return (COUNT if c in BATCHED else UNKNOWN if c == UNKNOWN else IDENTICAL,), (0,)


def _rank(n: _Node):
    return (IDENTICAL,), (0,)


def _fill(n: _Node):
    """Fill(dims, value) and BroadcastTo(value, shape): a batch_fill when the shape is a
    batch tensor's (or the batch's size)."""
    shape_at, value_at = (0, 1) if n.op == "Fill" else (1, 0)
    shape, value = n.cls[shape_at], n.cls[value_at]
    rank = n.shape_length(shape_at)
    if shape == IDENTICAL and value == IDENTICAL:
        return (IDENTICAL,), (rank,)
    if shape in (BATCH_SHAPE, COUNT) and value == IDENTICAL:
        return (BATCH_FILL,), (rank,)  # a count as the shape: tf.ones([batch_size])
    if shape == BATCH_SHAPE and value in BATCHED and n.op == "BroadcastTo":
        return (value,), (rank,)
    return (UNKNOWN,), (rank,)


def _tile(n: _Node):
    c, multiples = n.cls[0], n.cls[1]
    rank = n.rank[0]
    if c == IDENTICAL and multiples == IDENTICAL:
        return (IDENTICAL,), (rank,)
    if c == IDENTICAL and multiples == BATCH_SHAPE:
        return (BATCH_FILL,), (rank,)  # an identical value repeated once per example
    values = n.ints(1)
    if c in BATCHED and values and values[0] == 1:
        return (c,), (rank,)
    return (UNKNOWN,), (rank,)


def _reshape(n: _Node):
    c, shape = n.cls[0], n.cls[1]
    rank = n.shape_length(1)
    if shape == IDENTICAL and (c == IDENTICAL or c in LINEAR):
        return (c,), (rank,)
    if c in BATCHED and shape in (BATCH_SHAPE, COUNT):
        return (c,), (rank,)
    if c in BATCHED and shape == IDENTICAL and _leads_with_minus_one(n.sweep, n.inputs[1][0]):
        return (c,), (rank,)  # a leading -1 keeps the examples in order along axis 0
    return (UNKNOWN,), (rank,)


def _leads_with_minus_one(sweep: _Sweep, src: str) -> bool:
    """Whether the shape vector ``src`` is [-1, ...] with no other literal -1: a Const, or a
    ConcatV2 / Pack whose first piece is (as ``tf.reshape(x, [-1, tf.shape(x)[1]])`` and
    ``softmax_cross_entropy_with_logits``' flattening build it)."""
    values = sweep.const_ints(src)
    if values is not None:
        return bool(values) and values[0] == -1 and -1 not in values[1:]
    op = sweep.nodes[src]["op"]
    if op not in ("ConcatV2", "Pack"):
        return False
    pieces = [sweep.const_ints(piece) for piece, _ in sweep.ir.inputs(src)]
    if op == "ConcatV2":
        pieces = pieces[:-1]
    first = pieces[0] if pieces else None
    return (bool(first) and first[0] == -1 and -1 not in first[1:]
            and not any(p is not None and -1 in p for p in pieces[1:]))


def _expand_dims(n: _Node):
    c, rank = n.cls[0], n.rank[0]
    out_rank = None if rank is None else rank + 1
    if c in BATCHED:
        axis = n.axis(1, out_rank)
        return (c if axis is not None and axis != 0 else UNKNOWN,), (out_rank,)
    return (c if c == IDENTICAL or c in LINEAR else UNKNOWN,), (out_rank,)


def _squeeze(n: _Node):
    """Squeeze: a squeeze of axis 0 loses the batch; squeezing every size-1 axis keeps it
    unless a slice has one example, which then fails loudly in the concatenation."""
    c, rank = n.cls[0], n.rank[0]
    dims = list(n.attr("squeeze_dims").list.i) if n.attr("squeeze_dims") is not None else []
    resolved = [_non_negative(d, rank) for d in dims]
    out_rank = rank - len(dims) if dims and rank is not None else None
    if c in BATCHED:
        return (c if None not in resolved and 0 not in resolved else UNKNOWN,), (out_rank,)
    return (c if c == IDENTICAL or c in LINEAR else UNKNOWN,), (out_rank,)


def _transpose(n: _Node):
    c, rank = n.cls[0], n.rank[0]
    if c in BATCHED:
        perm = n.ints(1)
        return (c if perm and perm[0] == 0 else UNKNOWN,), (rank,)
    return (c if (c == IDENTICAL or c in LINEAR) and n.cls[1] == IDENTICAL else UNKNOWN,), (rank,)


def _join(classes, axis) -> str:
    """Concatenating or stacking tensors of ``classes`` along ``axis`` (None: unknown)."""
    kinds = set(classes)
    if kinds == {IDENTICAL}:
        return IDENTICAL
    if kinds <= BATCHED:
        return (BATCH if BATCH in kinds else BATCH_FILL) if axis not in (None, 0) else UNKNOWN
    if kinds <= {MEAN, IDENTICAL} and MEAN in kinds:
        return MEAN
    if kinds <= {SUM, COUNT}:
        return COUNT if kinds == {COUNT} else SUM
    return UNKNOWN


def _concat(n: _Node):
    values, ranks = n.cls[:-1], n.rank[:-1]
    rank = next((r for r in ranks if r is not None), None)
    if n.cls[-1] != IDENTICAL:
        return (UNKNOWN,), (rank,)
    axis = n.axis(len(n.inputs) - 1, rank)
    if (axis == 0 and rank == 1 and values and values[0] == BATCH_SHAPE
            and all(c == IDENTICAL for c in values[1:])):
        return (BATCH_SHAPE,), (rank,)  # a batch tensor's shape with identical dims appended
    return (_join(values, axis),), (rank,)


def _pack(n: _Node):
    rank = n.rank[0]
    out_rank = None if rank is None else rank + 1
    axis_attr = n.attr("axis")
    axis = _non_negative(axis_attr.i if axis_attr is not None else 0, out_rank)
    if (axis == 0 and n.cls and n.cls[0] == COUNT and rank == 0
            and all(c == IDENTICAL for c in n.cls[1:])):
        return (BATCH_SHAPE,), (1,)  # [tf.shape(x)[0], d, ...]: a batch tensor's shape
    return (_join(n.cls, axis),), (out_rank,)


def _unpack(n: _Node):
    c, rank = n.cls[0], n.rank[0]
    out_rank = None if rank is None else rank - 1
    axis_attr = n.attr("axis")
    axis = _non_negative(axis_attr.i if axis_attr is not None else 0, rank)
    if c in BATCHED:
        return (c if axis not in (None, 0) else UNKNOWN,), (out_rank,)
    return (c if c == IDENTICAL or c in LINEAR else UNKNOWN,), (out_rank,)


def _split(n: _Node):
    """Split(axis, value) and SplitV(value, sizes, axis)."""
    value_at, axis_at = (1, 0) if n.op == "Split" else (0, 2)
    c, rank = n.cls[value_at], n.rank[value_at]
    if not n.others_identical(value_at):
        return (UNKNOWN,), (rank,)
    if c in BATCHED:
        axis = n.axis(axis_at, rank)
        return (c if axis not in (None, 0) else UNKNOWN,), (rank,)
    return (c if c == IDENTICAL or c in LINEAR else UNKNOWN,), (rank,)


def _pad(n: _Node):
    """Padding that leaves axis 0 alone (an image's sides: ResNet's stem) keeps the examples in
    order; any padding of an identical value is identical."""
    c, rank = n.cls[0], n.rank[0]
    if not n.others_identical(0):
        return (UNKNOWN,), (rank,)
    if c == IDENTICAL:
        return (IDENTICAL,), (rank,)
    paddings = n.ints(1)  # [[before, after] per axis], flattened
    if c in BATCHED and paddings and paddings[:2] == [0, 0]:
        return (c,), (rank,)
    return (UNKNOWN,), (rank,)


def _slice(n: _Node):
    c = n.cls[0]
    rank = n.rank[0] if n.rank[0] is not None else n.shape_length(2)  # as many as sizes
    if not n.others_identical(0):
        return (UNKNOWN,), (rank,)
    if c == IDENTICAL or c in LINEAR:
        return (c,), (rank,)
    begin, size = n.ints(1), n.ints(2)  # size may be computed (rank - 1) when begin is 0
    if c in BATCHED and begin and size and begin[0] == 0 and size[0] == -1:
        return (c,), (rank,)
    if c == BATCH_SHAPE and begin and begin[0] >= 1:
        return (IDENTICAL,), (rank,)  # tf.shape(x)[1:]
    if c == BATCH_SHAPE and begin == [0] and size == [1]:
        return (COUNT,), (rank,)  # [batch size]
    if c == BATCH_SHAPE and begin == [0] and (size is None or size[0] != 0):
        return (BATCH_SHAPE,), (rank,)  # the leading dims, the batch's first
    return (UNKNOWN,), (rank,)


def _mask(n: _Node, key: str) -> int:
    value = n.attr(key)
    return value.i if value is not None else 0


def _strided_slice(n: _Node):
    c, rank = n.cls[0], n.rank[0]
    shrink, new_axis = _mask(n, "shrink_axis_mask"), _mask(n, "new_axis_mask")
    ellipsis = _mask(n, "ellipsis_mask")
    out_rank = None if rank is None else rank - bin(shrink).count("1") + bin(new_axis).count("1")
    if not n.others_identical(0):
        return (UNKNOWN,), (out_rank,)
    if c == IDENTICAL or c in LINEAR:
        return (c,), (out_rank,)
    begin, end, strides = n.ints(1), n.ints(2), n.ints(3)
    if not begin or not end or not strides or new_axis & 1:
        return (UNKNOWN,), (out_rank,)
    if c in BATCHED:
        if ellipsis & 1:  # x[..., k]: the ellipsis keeps axis 0 when it covers a dimension
            keeps = rank is not None and rank >= len(begin)
            return (c if keeps else UNKNOWN,), (out_rank,)
        whole = (_mask(n, "begin_mask") & 1 or begin[0] == 0) and _mask(n, "end_mask") & 1
        return (c if whole and strides[0] == 1 and not shrink & 1 else UNKNOWN,), (out_rank,)
    if c == BATCH_SHAPE and not ellipsis & 1 and strides[0] == 1:
        starts_at = 0 if _mask(n, "begin_mask") & 1 else begin[0]
        if starts_at < 0:  # from the end (tf.shape(x)[-1], as tf_keras's losses take it)
            starts_at = _non_negative(starts_at, n.shape_length(0))
            if starts_at is None or starts_at < 0:
                return (UNKNOWN,), (out_rank,)
        if shrink & 1 and starts_at == 0:
            return (COUNT,), (out_rank,)  # tf.shape(x)[0]
        if starts_at >= 1:
            return (IDENTICAL,), (out_rank,)  # tf.shape(x)[1:]
    return (UNKNOWN,), (out_rank,)


def _gather(n: _Node):
    """Gather, GatherV2 and ResourceGather: rows of identical params picked by batch ids are
    batch rows; a gather along another axis keeps a batch params' axis 0; with batch_dims
    (each example's own picks from its own row, `tf.gather(q_values, actions, batch_dims=1)`
    in DQN's loss) batch params and batch indices make batch rows."""
    params, indices = n.cls[0], n.cls[1]
    rp, ri = n.rank[0], n.rank[1]
    batch_dims = n.attr("batch_dims")
    batch_dims = batch_dims.i if batch_dims is not None else 0
    rank = rp + ri - 1 - batch_dims if rp is not None and ri is not None else None
    if not n.others_identical(0, 1):
        return (UNKNOWN,), (rank,)
    if batch_dims:
        axis = n.axis(2, rp)
        if batch_dims > 0 and axis is not None and axis >= batch_dims and \
                params in BATCHED and indices in BATCHED:
            return (BATCH,), (rank,)
        return (UNKNOWN,), (rank,)
    if params == IDENTICAL and indices == IDENTICAL:
        return (IDENTICAL,), (rank,)
    axis = n.axis(2, rp) if n.op == "GatherV2" else 0
    if axis == 0:
        if params == IDENTICAL and indices in BATCHED:
            return (indices,), (rank,)
        if params == BATCH_SHAPE and indices == IDENTICAL:
            picked = n.ints(1)
            if picked and all(p >= 1 for p in picked):
                return (IDENTICAL,), (rank,)
            if picked == [0] and ri == 0:
                return (COUNT,), (rank,)
            if picked and picked[0] == 0 and 0 not in picked[1:] and ri == 1:
                return (BATCH_SHAPE,), (rank,)  # tf.tensordot's free dims, the batch's first
    elif axis is not None and params in BATCHED and indices == IDENTICAL:
        return (params,), (rank,)
    return (UNKNOWN,), (rank,)


def _one_hot(n: _Node):
    c, rank = n.cls[0], n.rank[0]
    out_rank = None if rank is None else rank + 1
    axis = n.attr("axis").i if n.attr("axis") is not None else -1
    if not n.others_identical(0):
        return (UNKNOWN,), (out_rank,)
    if c == IDENTICAL:
        return (IDENTICAL,), (out_rank,)
    return (BATCH if c in BATCHED and axis != 0 else UNKNOWN,), (out_rank,)


def _arg_reduce(n: _Node):
    c, rank = n.cls[0], n.rank[0]
    out_rank = None if rank is None else rank - 1
    if c == IDENTICAL and n.cls[1] == IDENTICAL:
        return (IDENTICAL,), (out_rank,)
    axis = n.axis(1, rank)
    return (c if c in BATCHED and axis not in (None, 0) else UNKNOWN,), (out_rank,)


def _in_top_k(n: _Node):
    if all(c == IDENTICAL for c in n.cls):
        return (IDENTICAL,), (1,)
    ok = n.cls[0] in BATCHED and n.cls[1] in BATCHED and n.others_identical(0, 1)
    return (BATCH if ok else UNKNOWN,), (1,)


def _l2_loss(n: _Node):
    c = n.cls[0]
    return (SUM if c == BATCH else IDENTICAL if c == IDENTICAL else UNKNOWN,), (0,)


def _segment_sum(n: _Node):
    """UnsortedSegmentSum of the slice's examples by their own segment ids into a fixed number
    of segments (tf.math.unsorted_segment_mean's sums and counts): a sum per segment."""
    data, ids = n.cls[0], n.cls[1]
    rank, id_rank = n.rank[0], n.rank[1]
    out_rank = None if rank is None or id_rank is None else rank - id_rank + 1
    if data == IDENTICAL and ids == IDENTICAL:
        return (IDENTICAL,), (out_rank,)
    if data in BATCHED and ids in BATCHED and n.cls[2] == IDENTICAL:
        return (SUM,), (out_rank,)  # of ones too: how many of the slice's examples each has
    return (UNKNOWN,), (out_rank,)


def _random(n: _Node):
    """A seeded draw of an identical shape draws what the single device draws (the copy keeps
    the op's seeds); an unseeded one differs (per run). A draw shaped like the slice (dropout's
    mask, epsilon-greedy's coin per example) holds a row per example of the slice: the copies
    concatenated are a draw for the whole batch (not one device's, but for consistent-random,
    whose rows are marked so)."""
    seeded = any(n.attr(key) is not None and n.attr(key).i for key in ("seed", "seed2"))
    shape = n.cls[0] if n.cls else UNKNOWN
    kind = (IDENTICAL if seeded and shape == IDENTICAL else BATCH if shape == BATCH_SHAPE
            else UNKNOWN)
    return (kind,), (n.shape_length(0),)


def _candidate_sampler(n: _Node):
    """A seeded candidate sampler of a fixed distribution (nce_loss's and sampled_softmax_loss's
    log-uniform one, word2vec's fixed unigram one) draws its candidates without reading the
    true classes' values, as many whatever the batch: every copy draws what the single device
    draws (its sampled candidates and their expected counts are identical), and the true
    classes' expected counts hold a row per example of them. A learned sampler (its kernel
    counts the true classes it is given) has no rule here: the contract refuses it."""
    seeded = n.op == "AllCandidateSampler" or any(
        n.attr(key) is not None and n.attr(key).i for key in ("seed", "seed2"))
    if not seeded:
        return (UNKNOWN,), (1, 2, 1)
    true = n.cls[0] if n.cls else UNKNOWN
    rows = IDENTICAL if true == IDENTICAL else BATCH if true in BATCHED else UNKNOWN
    return (IDENTICAL, rows, IDENTICAL), (1, 2, 1)


def _cross_replica(n: _Node):
    """A collective gives every replica the same result; it is the single-device value when it
    averages means (the all-reduce of born gradients), sums sums, or gathers batch slices."""
    c, rank = (n.cls[0] if n.cls else UNKNOWN), (n.rank[0] if n.inputs else None)
    attr = n.attr("final_op")
    final = attr.s.decode() if attr is not None else None
    if n.op.startswith("CollectiveReduce"):
        merge = n.attr("merge_op").s.decode()
        exact = (final == "Div" and c in (MEAN, IDENTICAL)
                 or final == "Id" and merge == "Add" and c in (SUM, COUNT)
                 or final == "Id" and c in EXTREMES and _EXTREME_OF.get(merge) == c)
    elif n.op.startswith("CollectiveGather"):
        exact = c in BATCHED
    else:  # an accumulator's take_grad averages every worker's born gradients
        exact = "TakeGradient" in n.op
    return (IDENTICAL if exact else SAME,), (rank,)


def _update(n: _Node):
    """Assign and the like return the variable's value after the write: identical while the
    variable is (a write of a value that is not makes it drift, see ``drifting_variables``)."""
    kind = IDENTICAL if n.cls and n.cls[0] == IDENTICAL else UNKNOWN
    return (kind,), (n.rank[1] if len(n.rank) > 1 else None,)


def _switch(n: _Node):
    """A legacy cond's Switch forwards its data to one branch: both outputs keep its class
    when the predicate is identical (every replica takes the same branch)."""
    c = n.cls[0] if n.others_identical(0) else UNKNOWN
    return (c,), (n.rank[0],)


def _merge(n: _Node):
    """A cond's Merge forwards whichever branch ran: its class when both agree (a loop's
    Merge also reads a back edge, unvisited, hence unknown); the branch index is identical."""
    kinds = set(n.cls)
    known = {r for r in n.rank}
    return ((kinds.pop() if len(kinds) == 1 else UNKNOWN), IDENTICAL), (
        known.pop() if len(known) == 1 else None, 0)


def _exit(n: _Node):
    """Exit moves a value out of a loop's frame unchanged. (Enter's output lives in the frame,
    where no merge outside it can read it: unknown, the default.)"""
    return (n.cls[0],), (n.rank[0],)


# op groups that graphxform/batch_mixing.py also reads
LINEAR_UNARY_OPS = ("Identity", "Snapshot", "StopGradient", "PreventGradient", "CheckNumerics",
                    "Neg", "EnsureShape", "RefIdentity")
ELEMENTWISE_UNARY_OPS = (
    "Abs", "Relu", "Relu6", "Elu", "Selu", "Sigmoid", "Tanh", "Exp", "Expm1", "Log", "Log1p",
    "Sqrt", "Rsqrt", "Square", "Reciprocal", "Inv", "Floor", "Ceil", "Round", "Rint",
    "Sign", "Softplus", "Softsign", "LeakyRelu", "IsFinite", "IsNan", "IsInf", "LogicalNot",
    "Erf", "Erfc", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Lgamma",
    "Digamma", "Invert", "Gelu")
LIKE_OPS = ("ZerosLike", "OnesLike")
ELEMENTWISE_OPS = (
    "Add", "AddV2", "Sub", "Mul", "MulNoNan", "RealDiv", "Div", "DivNoNan", "TruncateDiv",
    "FloorDiv", "FloorMod", "Mod", "TruncateMod", "Maximum", "Minimum", "Pow",
    "SquaredDifference", "Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual",
    "LogicalAnd", "LogicalOr", "Atan2", "BiasAdd", "BiasAddV1", "Xdivy", "Xlogy", "Xlog1py",
    "ApproximateEqual", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "AddN", "SelectV2",
    "ClipByValue")
REDUCE_OPS = ("Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "EuclideanNorm")
PER_EXAMPLE_OPS = ("Conv2D", "Conv3D", "DepthwiseConv2dNative", "MaxPool", "AvgPool",
                   "MaxPool3D", "AvgPool3D", "MaxPoolV2", "LRN", "Conv1D")
BATCH_NORM_OPS = ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")
CROSS_ENTROPY_OPS = ("SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits")


def _table(groups: dict) -> dict:
    return {op: rule for rule, ops in groups.items() for op in ops}


RULES = _table({
    _source: ("Const", "HostConst", "Placeholder", "PlaceholderWithDefault", "VarHandleOp",
              "VariableV2", "Variable"),
    _read: ("ReadVariableOp",),
    _identity_n: ("IdentityN",),
    _linear_unary: LINEAR_UNARY_OPS,
    _cast: ("Cast",),
    _elementwise_unary: ELEMENTWISE_UNARY_OPS,
    _like: LIKE_OPS,
    _last_axis: ("Softmax", "LogSoftmax"),
    _elementwise: ELEMENTWISE_OPS,
    _select: ("Select",),
    _reduce: REDUCE_OPS,
    _matmul: ("MatMul",),
    _batch_matmul: ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"),
    _einsum: ("Einsum",),
    _per_example: PER_EXAMPLE_OPS,
    _batch_norm: BATCH_NORM_OPS,
    _cross_entropy: CROSS_ENTROPY_OPS,
    _shape: ("Shape", "ShapeN"),
    _size: ("Size",),
    _rank: ("Rank",),
    _fill: ("Fill", "BroadcastTo"),
    _tile: ("Tile",),
    _reshape: ("Reshape",),
    _expand_dims: ("ExpandDims",),
    _squeeze: ("Squeeze",),
    _transpose: ("Transpose",),
    _concat: ("ConcatV2",),
    _pack: ("Pack",),
    _unpack: ("Unpack",),
    _split: ("Split", "SplitV"),
    _slice: ("Slice",),
    _pad: ("Pad", "PadV2", "MirrorPad"),
    _strided_slice: ("StridedSlice",),
    _gather: ("Gather", "GatherV2", "ResourceGather"),
    _one_hot: ("OneHot",),
    _arg_reduce: ("ArgMax", "ArgMin"),
    _in_top_k: ("InTopK", "InTopKV2"),
    _l2_loss: ("L2Loss",),
    _segment_sum: ("UnsortedSegmentSum",),
    _random: tuple(sorted(op for op in RANDOM_OPS if not op.startswith("Stateless")
                          and op not in ("RandomShuffle", "RandomShuffleQueueV2",
                                         "Multinomial", "RandomGamma", "RandomPoisson",
                                         "RandomPoissonV2"))),
    _candidate_sampler: ("LogUniformCandidateSampler", "UniformCandidateSampler",
                         "FixedUnigramCandidateSampler", "AllCandidateSampler"),
    _cross_replica: tuple(sorted(_CROSS_REPLICA)),
    _update: ("Assign", "AssignAdd", "AssignSub"),
    _switch: ("Switch", "RefSwitch"),
    _merge: ("Merge", "RefMerge"),
    _exit: ("Exit", "RefExit"),
})
