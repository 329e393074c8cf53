"""What a training graph holds, found from the graph alone.

Variables (resource and reference) with their reads, initializer, updates, gradient and optimizer
slots; the optimizer; global_step; the steps (what the user runs to train: one or several train
ops, each an op or a tensor) and the loss each one minimises; input placeholders. A graph with
no training step is still analysed (``train_op`` is None); passes that need one call
``require_train_op``.

A variable's gradient is where it is *born*: the tensor that ``tf.gradients`` produced, found by
walking back from the variable's update through everything outside a gradients scope
(clipping, loss-scale division, finite checks, the optimizer's own arithmetic). Reducing it
there means all that post-processing sees the cross-replica gradient, as on one device.
"""

from __future__ import annotations

import dataclasses
import functools
import re

from graphxform import input_pipeline, opdefs
from graphxform.errors import GraphxformError
from graphxform.ir import GraphIR, parse_tensor, paused_gc, tensor_name

VARIABLE_OPS = {"VarHandleOp", "VariableV2", "Variable"}
PLACEHOLDER_OPS = {"Placeholder", "PlaceholderWithDefault"}
# the collections whose values import_meta_graph reads as VariableDefs (tf.compat.v1.metrics
# keeps its totals and counts in metric_variables)
VARIABLE_DEF_COLLECTIONS = ("variables", "trainable_variables", "local_variables",
                            "model_variables", "moving_average_variables", "global_step",
                            "metric_variables")
APPLY_PREFIXES = ("ApplyGradientDescent", "Apply", "ResourceApply", "SparseApply",
                  "ResourceSparseApply")
RANDOM_OPS = {"RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
              "Multinomial", "RandomShuffle", "RandomGamma", "RandomPoisson", "RandomPoissonV2",
              "StatelessRandomUniform", "StatelessRandomNormal", "StatelessTruncatedNormal",
              "StatelessRandomUniformV2", "StatelessRandomNormalV2", "RandomShuffleQueueV2"}
# ops with seed and seed2 attrs that draw nothing: tf.nn.compute_accidental_hits (which
# sampled_softmax_loss runs by default beside its sampler), cuDNN RNN parameter conversions
SEEDED_DETERMINISTIC_OPS = {"ComputeAccidentalHits", "CudnnRNNParamsSize",
                            "CudnnRNNParamsToCanonical", "CudnnRNNParamsToCanonicalV2",
                            "CudnnRNNCanonicalToParams", "CudnnRNNCanonicalToParamsV2"}
GRADIENT_ARGS = ("grad", "delta", "indices")  # input args of Apply ops that carry the gradient
REPLICA_SCOPE = re.compile(r"^replica_\d+/")
# tf.gradients' scope, or that of tf.GradientTape.gradient in graph mode
GRADIENTS_SCOPE = re.compile(r"^(?:.*/)?(?:gradients|gradient_tape)(?:_\d+)?/")
TAPE_SCOPE = re.compile(r"gradient_tape(?:_\d+)?/$")
_INT_TYPES = {3, 9, 4, 6, 5, 17, 22, 23}  # int32 int64 uint8 int8 int16 uint16 uint32 uint64


def is_apply_op(op: str) -> bool:
    return op.startswith(APPLY_PREFIXES)


@functools.cache
def is_mutating_op(op: str) -> bool:
    """Ops that write a variable (as opposed to reading it or asking about it)."""
    if is_apply_op(op):
        return True
    if op.startswith(("Assign", "ResourceScatter", "Scatter")):
        return True
    return op in {"CountUpTo", "ResourceCountUpTo", "StridedSliceAssign",
                  "ResourceStridedSliceAssign"}


@dataclasses.dataclass
class Gradient:
    kind: str  # "dense" or "sparse"
    tensor: str | None = None  # dense
    values: str | None = None  # sparse
    indices: str | None = None
    # a tower average (graphxform/towers.py): the per-tower gradients ``tensor`` averages
    towers: tuple = ()

    @property
    def tensors(self) -> list[str]:
        return [self.tensor] if self.kind == "dense" else [self.values, self.indices]


@dataclasses.dataclass
class Application:
    """One optimizer's update of a variable: ``update`` (its Apply op, or its first op in
    the variable's update scope) applies ``gradient``."""
    update: str
    gradient: Gradient


@dataclasses.dataclass
class Variable:
    name: str
    kind: str  # "resource" or "ref"
    dtype: int
    shape: tuple
    trainable: bool
    role: str = "other"  # trainable | slot | optimizer_state | global_step | statistic | other
    initializer: str | None = None
    initial_value: str | None = None
    reads: list = dataclasses.field(default_factory=list)
    updates: list = dataclasses.field(default_factory=list)  # ops in the train step writing it
    gradient: Gradient | None = None
    # the update that applies ``gradient`` (the optimizer's Apply op, or its first op in the
    # variable's update scope), not any other writer: WGAN's weight clipping and PopArt's
    # rescaling assign the variable too, in the same step or another
    applied_by: str | None = None
    # every (update, gradient) an optimizer applies to it, the first being (applied_by,
    # gradient): one per optimizer, two for an actor-critic's shared trunk
    applications: list = dataclasses.field(default_factory=list)
    slots: dict = dataclasses.field(default_factory=dict)  # slot name -> variable name
    slot_of: str | None = None
    device: str = ""
    # not in the global collection, in local_variables (a metric's total, a loop's counter,
    # which local_variables_initializer starts) or, where the graph has collections, in none
    # (tf_keras metrics' total and count, which Keras starts): TF's default Saver leaves it out
    local: bool = False
    # a part of a variable the user partitioned (get_variable(partitioner=...)): (the whole
    # variable's name, the slice spec) its checkpoint entry has, as TF's Saver writes it
    saved_as: tuple | None = None
    # batch norm's moving mean or variance, found by name or by structure (graphxform/
    # moving_statistics.py: "name" or "structure"); None: not one
    moving_statistic: str | None = None

    @property
    def dtype_name(self) -> str:
        from tensorflow.core.framework import types_pb2
        return types_pb2.DataType.Name(self.dtype)[3:].lower()

    @property
    def nbytes(self) -> int:
        from tensorflow.python.framework import dtypes
        if any(d < 0 for d in self.shape):
            return 0
        count = 1
        for d in self.shape:
            count *= d
        return count * dtypes.as_dtype(self.dtype).size

    def applied_in(self, closure) -> bool:
        """Whether a step whose closure is ``closure`` applies a gradient to this variable."""
        return bool(self.gradients_applied_in(closure))

    @property
    def gradients(self) -> list:
        """Every gradient an optimizer applies to it, one per optimizer (see applications)."""
        return [a.gradient for a in self.applications] or (
            [self.gradient] if self.gradient is not None else [])

    def gradients_applied_in(self, closure) -> list:
        """The gradients a step whose closure is ``closure`` applies to this variable: those
        whose optimizer's update it runs (both, for a step that groups an actor's and a
        critic's optimizer over one trunk)."""
        if self.applications:
            return [a.gradient for a in self.applications if a.update in closure]
        return [self.gradient] if self.gradient is not None and self.applied_by in closure \
            else []


@dataclasses.dataclass
class Input:
    """A placeholder the user feeds.

    ``batched``: axis 0 is the global batch, which split-inputs divides across replicas. A
    leading ``None`` is batched. A fixed leading dimension is batched when every placeholder of
    rank >= 1 that the steps read has that same fixed leading dimension (the TF word2vec
    tutorial's ``[batch_size]`` and ``[batch_size, 1]``); then it is the global batch size.
    A fixed dimension beside a ``None`` one, or fixed ones that differ, cannot be told apart
    from a non-batch size (class weights, a vocabulary table), so such inputs are fed whole.

    ``optional``: a PlaceholderWithDefault, or one that no step reads (nor its loss), need not
    be fed.

    ``sparse``: the three placeholders ``tf.compat.v1.sparse_placeholder(name=N)`` makes
    (``N/indices`` [?, rank] int64, ``N/values`` [?], ``N/shape`` [rank] int64) hold one
    SparseTensor whose axis 0 is the batch; each names N here. They are not ``batched`` (their
    rows are entries, not examples): split-inputs cuts the SparseTensor by its rows."""
    name: str
    dtype: int
    shape: tuple | None  # None: unknown rank
    batched: bool
    has_default: bool = False
    read_by_step: bool = True
    sparse: str | None = None

    @property
    def batch_source(self) -> bool:
        """Each replica reads its own part of this input (its slice of the batch)."""
        return self.batched or self.sparse is not None

    @property
    def optional(self) -> bool:
        return self.has_default or not self.read_by_step

    @property
    def fixed_batch(self) -> int | None:
        """The global batch size a fixed batch dimension sets (None: any size)."""
        return self.shape[0] if self.batched and self.shape[0] > 0 else None


@dataclasses.dataclass
class Optimizer:
    kind: str
    scope: str
    hyperparameters: dict  # arg name -> tensor name


@dataclasses.dataclass
class Step:
    """One thing the user runs to train: ``name`` exactly as given to ``session.run`` (an op,
    or a tensor such as tf_slim's ``train_op/control_dependency:0``), ``op`` its node, and
    ``loss`` the tensor whose gradients it applies (None when not found)."""
    name: str
    op: str
    loss: str | None
    closure: set = dataclasses.field(default_factory=set, repr=False)
    # tower code (graphxform/towers.py): each tower's loss; ``loss`` is then None, as no
    # tensor of the graph is the loss of the whole batch
    towers: tuple = ()

    @property
    def is_tensor(self) -> bool:
        return ":" in self.name


@dataclasses.dataclass
class TrainingGraph:
    variables: dict
    inputs: list
    train_op: str | None
    loss: str | None
    losses: list  # every loss tensor the graph names (collection 'losses'), the main one first
    global_step: str | None
    optimizer: Optimizer | None
    saver_scope: str | None
    train_closure: set
    extra_updates: list  # update ops in the train step that are not the optimizer's
    noop_sinks: list  # NoOps nothing waits on: the train op, `init`, groups a user may run
    steps: list = dataclasses.field(default_factory=list)  # Step per train op, in run order
    # checkpoint key -> (variable or None, slice spec) the input's Saver writes; None: the
    # graph has no Saver of SaveV2 ops (TF's default Saver keys the global variables by name)
    saved: dict | None = None
    # the tf.data iterator or input queue the steps read (graphxform/input_pipeline.py)
    pipeline: object = None
    # the graph's Max and Min nodes: where graphxform/batch_extremes.py looks
    max_min_nodes: list = dataclasses.field(default_factory=list)

    def require_train_op(self, what: str = "this pass") -> str:
        if self.train_op is None:
            raise GraphxformError(f"{what} needs a training graph, but no train op was found "
                                  "(no 'train_op' collection; name one with --train-op)")
        return self.train_op

    @property
    def batch_sources(self) -> list[str]:
        """The nodes the global batch comes from: batched placeholders, and the input
        pipeline's reads that take a batch."""
        reads = self.pipeline.reads if self.pipeline else ()
        return ([i.name for i in self.inputs if i.batch_source]
                + [r.node for r in reads if r.batched])

    @property
    def sparse_inputs(self) -> dict:
        """SparseTensor name -> its (indices, values, shape) placeholders (see Input.sparse)."""
        return {name: tuple(p.name for p in parts)
                for name, parts in sparse_groups(self.inputs).items()}

    @property
    def trainable(self) -> list:
        return [v for v in self.variables.values() if v.trainable and v.gradient is not None]


def analyze(ir: GraphIR, train_op=None) -> TrainingGraph:
    """Analyse ``ir``; ``train_op`` (a name, a comma-separated list or a list of names, each an
    op or a tensor) overrides the 'train_op' collection."""
    with paused_gc():  # it keeps a record per variable and sets of the step's nodes
        return _analyze(ir, train_op)


def _analyze(ir: GraphIR, train_op) -> TrainingGraph:
    saver_scope = _saver_scope(ir)
    runs = {}
    step_names = find_steps(ir, train_op, runs)
    closures = {name: runs.get(parse_tensor(name)[0]) or ir.ancestors(parse_tensor(name)[0])
                for name in step_names}
    closure = set().union(*closures.values()) if closures else set()
    train_op = parse_tensor(step_names[0])[0] if step_names else None
    var_defs = _variable_defs(ir)
    variables, noops, placeholders, users, extremes = {}, [], [], {}, []
    for name, data in ir.node_items():  # the one sweep over all nodes
        op = data["op"]
        if op in ("Max", "Min"):
            extremes.append(name)
        elif op in VARIABLE_OPS:
            users[name] = ir.consumers(name, 0)
            variables[name] = _variable(ir, name, data, var_defs, users[name])
        elif op == "NoOp":
            noops.append(name)
        elif op in PLACEHOLDER_OPS:
            placeholders.append(name)
    writers = _find_writers(ir, users, variables, closure, saver_scope)
    optimizer = _link_optimizer(ir, variables, writers)
    global_step = _global_step(ir, variables)
    extra = []
    for var in variables.values():
        if var.role == "other" and var.updates:
            if var.name == global_step:
                var.role = "global_step"
            elif optimizer and all(u.startswith(optimizer.scope) for u in var.updates):
                var.role = "optimizer_state"
            else:
                var.role = "statistic"
            extra += var.updates if var.role != "optimizer_state" else []
        elif var.name == global_step:
            var.role = "global_step"
    if var_defs is None:  # bare GraphDef: trainable means updated by the optimizer
        for var in variables.values():
            var.trainable = var.gradient is not None
    from graphxform import moving_statistics
    moving_statistics.mark(ir, variables, closure)
    steps = [_step(ir, name, closures[name], variables) for name in step_names]
    losses = list(dict.fromkeys([s.loss for s in steps if s.loss] + _losses(ir)))
    sinks = [n for n in noops if not any(ir.successors(n))
             and not (saver_scope and n.startswith(saver_scope))]
    pipeline = input_pipeline.find(ir, closure)
    inputs = _inputs(ir, placeholders, saver_scope, steps, whole=pipeline.nodes)
    return TrainingGraph(variables=variables, inputs=inputs, train_op=train_op,
                         loss=losses[0] if losses else None, losses=losses,
                         global_step=global_step, optimizer=optimizer, saver_scope=saver_scope,
                         saved=_saved_by_saver(ir, saver_scope),
                         train_closure=closure, extra_updates=extra, noop_sinks=sinks,
                         steps=steps, pipeline=pipeline, max_min_nodes=extremes)


def find_steps(ir: GraphIR, given=None, runs: dict | None = None) -> list[str]:
    """The names the user runs to train, in run order. ``given``: names from --train-op (a list
    or a comma-separated string). By default every entry of the 'train_op' collection that no
    other entry runs (tf_slim's collection also lists the optimizer's own op, which its
    ``train_op/control_dependency`` runs). ``runs``: a dict to fill with {node: its
    ancestors} of the nodes whose ancestors it found (the steps' closures among them)."""
    if given:
        names = given.split(",") if isinstance(given, str) else list(given)
        names = [n.strip() for n in names if n.strip()]
        for name in names:
            if parse_tensor(name)[0] not in ir:
                raise GraphxformError(f"train op '{name}' is not a node of the graph")
        twice = next((name for k, name in enumerate(names) if name in names[:k]), None)
        if twice is not None:
            raise GraphxformError(
                f"train op '{twice}' is given twice: a training step runs each train op once, "
                "in the order given (run a critic several times per generator step in your own "
                "loop)")
        return names
    names = list(dict.fromkeys(n.lstrip("^") for n in _collection_values(ir, "train_op")))
    missing = [n for n in names if parse_tensor(n)[0] not in ir]
    if missing:
        raise GraphxformError(
            f"collection 'train_op' names '{missing[0]}', which is not a node of the graph (an "
            "op made inside a while loop body or a tf.function is not; import_meta_graph fails "
            "on this file too): give the op to run with --train-op")
    names = [_runner_of(ir, n) for n in names]
    nodes = [parse_tensor(n)[0] for n in names]
    runs = {} if runs is None else runs
    runs.update((node, ir.ancestors(node)) for node in dict.fromkeys(nodes))
    run_by_other = set()
    for node, ancestors in runs.items():
        run_by_other |= ancestors - {node}
    found, seen = [], set()
    for name, node in zip(names, nodes):
        if node not in run_by_other and node not in seen:
            seen.add(node)
            found.append(name)
    kept = list(found)
    for name in found:
        if _grouped_by_other(ir, name, [k for k in kept if k != name], runs):
            kept.remove(name)
    return kept


def _grouped_by_other(ir: GraphIR, name: str, others: list, runs: dict) -> bool:
    """Whether ``name`` is a NoOp that only groups what one of ``others`` runs anyway: in a
    transformed graph, the optimizer's merged op
    (``GradientDescent``, which the optimizer put in the collection itself) groups the
    replicas' copies, which the merged ``train = tf.group(minimize, ...)`` runs through theirs;
    running both would apply the gradients twice."""
    node = parse_tensor(name)[0]
    if ir.op(node) != "NoOp":
        return False
    grouped = {src for src, _ in ir.inputs(node)} | set(ir.control_inputs(node))
    return bool(grouped) and any(grouped <= runs[parse_tensor(other)[0]] for other in others)


def _runner_of(ir: GraphIR, name: str) -> str:
    """What the user runs to run ``name``: the one op that nothing consumes (but a dangling
    read) and that runs it (a tensor when it is an Identity), as with an EMA applied after the optimizer
    (``train_op = tf.group(ema.apply(...))`` under a control dependency on it), or the canned
    estimators' group of two optimizers; ``name`` itself when it is such a sink or when
    several sinks run it."""
    seen, stack, sinks = set(), [parse_tensor(name)[0]], []
    while stack and len(seen) < 10000:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        after = [n for n in ir.successors(node) if not _dangling_read(ir, n)]
        if not after:
            sinks.append(node)
        stack.extend(after)
    if len(sinks) != 1 or sinks[0] == parse_tensor(name)[0]:
        return name
    return tensor_name(sinks[0], 0) if ir.op(sinks[0]) == "Identity" else sinks[0]


def _dangling_read(ir: GraphIR, node: str) -> bool:
    """A read nothing uses, as a resource ``assign_add`` leaves behind."""
    return ir.op(node) == "ReadVariableOp" and not any(True for _ in ir.successors(node))


def _collection_values(ir: GraphIR, key: str) -> list[str]:
    if key not in ir.meta.collection_def:
        return []
    col = ir.meta.collection_def[key]
    return list(col.node_list.value) or [b.decode() for b in col.bytes_list.value]


def gradient_scope(name: str) -> str | None:
    """The gradients scope ``name`` lies in ('gradients/', 'gradients_1/', 'opt/gradients/',
    a GradientTape's 'gradient_tape/'), or None."""
    match = GRADIENTS_SCOPE.match(name)
    return match.group(0) if match else None


def _step(ir: GraphIR, name: str, closure: set, variables: dict) -> "Step":
    """The Step of train op ``name``; tower code's (graphxform/towers.py) lists its towers'
    losses instead of one loss."""
    towers = sorted({t for v in variables.values() for g in v.gradients_applied_in(closure)
                     for t in g.towers})
    if towers:
        losses = tuple(dict.fromkeys(loss for t in towers for loss in [
            scope_loss(ir, gradient_scope(parse_tensor(t)[0]))] if loss))
        return Step(name, parse_tensor(name)[0], None, closure, towers=losses)
    return Step(name, parse_tensor(name)[0], _step_loss(ir, name, closure, variables), closure)


def scope_loss(ir: GraphIR, scope: str) -> str | None:
    """The ``ys`` of the tf.gradients call of gradients scope ``scope``, or None."""
    seed = scope + "grad_ys_0"
    if seed not in ir:
        return None
    forward = set()
    for dst, _ in ir.consumers(seed):
        rest = dst[len(scope):]
        if "_grad/" in rest:
            op = rest.split("_grad/", 1)[0]
            prefix = scope[: -len(scope.split("/")[-2]) - 1] if scope.count("/") > 1 else ""
            # a replica's own op before merge-fetches' node of its original name
            order = (prefix + op, op) if REPLICA_SCOPE.match(prefix) else (op, prefix + op)
            for candidate in order:
                if candidate in ir:
                    forward.add(candidate)
                    break
    loss = _common_consumer(ir, sorted(forward)) if forward else None
    if loss:
        loss = _unscaled(ir, _climb_identities(ir, loss))
        merged = REPLICA_SCOPE.sub("", loss)  # a transformed graph: the merged fetch
        return tensor_name(merged if merged in ir else loss, 0)
    return None


def _step_loss(ir: GraphIR, step: str, closure: set, variables: dict) -> str | None:
    """The loss a step minimises: the ``ys`` of the tf.gradients call whose gradients its
    updates apply (``Variable.applied_by``; whatever else writes those variables, a weight
    clipping run as a step of its own, applies no gradient). tf.gradients starts from
    ``<scope>grad_ys_0`` (a Fill of ones), read by the gradient of the op that made ys;
    Identity-like ops pass the gradient through unnamed, so the walk climbs from that op
    through Identity/AddN consumers to the tensor the user named."""
    scopes = sorted({gradient_scope(parse_tensor(t)[0]) for v in variables.values()
                     for g in v.gradients_applied_in(closure) for t in g.tensors} - {None})
    if not scopes and step in ir and ir.op(parse_tensor(step)[0]) == "Identity":
        return tensor_name(*ir.input(parse_tensor(step)[0], 0))
    for scope in scopes:
        loss = scope_loss(ir, scope)
        if loss:
            return loss
    if scopes and all(TAPE_SCOPE.search(scope) for scope in scopes):
        seeded = [op for scope in scopes for op in _tape_seeded(ir, scope, closure)]
        loss = _common_consumer(ir, sorted(set(seeded))) if seeded else None
        if loss:
            return tensor_name(_unscaled(ir, _climb_identities(ir, loss)), 0)
        # else the loss is what the graph lists as one (tf.compat.v1.losses adds its losses
        # to the 'losses' collection)
        listed = [name for name in _losses(ir) if parse_tensor(name)[0] in ir]
        return listed[0] if len(listed) == 1 else None
    return None


def _tape_seeded(ir: GraphIR, scope: str, closure: set) -> list[str]:
    """The ops a GradientTape's ``tape.gradient(target)`` in ``scope`` differentiated first:
    it seeds the gradient with ones_like(target) (a Fill, OnesLike or Const of ones outside
    every gradients scope), and names the ops of each op's gradient after that op's name
    scope, ``<scope><op's scope>/...``. Only an op named as its scope is found so (the last op
    of a TF function that opened a name scope of its own, tf.nn.compute_average_loss's
    div_no_nan); a reduce_mean at the top level names its gradient after nothing."""
    found = []
    for name in closure:
        if not name.startswith(scope) or gradient_scope(name) != scope:
            continue
        if not any(gradient_scope(src) is None and _ones(ir, src) for src, _ in ir.inputs(name)):
            continue
        candidate = name[len(scope):].rpartition("/")[0]  # the op's name scope
        if candidate in ir and gradient_scope(candidate) is None:
            found.append(candidate)  # an op named as its scope (tf.math.divide_no_nan's)
    return found


def _ones(ir: GraphIR, node: str) -> bool:
    """Whether ``node`` is ones_like of something: a OnesLike, a Fill of 1, a Const of ones."""
    from graphxform.nodes import const_value
    op = ir.op(node)
    if op == "OnesLike":
        return True
    value = const_value(ir, ir.inputs(node)[1][0]) if op == "Fill" else \
        const_value(ir, node) if op == "Const" else None
    return value is not None and value.size > 0 and bool((value == 1).all())


def tape_gradients(variables: dict, closure: set) -> list[str]:
    """The variables (updated in ``closure``) whose gradients a GradientTape made."""
    return sorted(v.name for v in variables.values()
                  if any(TAPE_SCOPE.search(gradient_scope(parse_tensor(t)[0]) or "")
                         for g in v.gradients_applied_in(closure) for t in g.tensors))


def _common_consumer(ir: GraphIR, ops: list[str]) -> str | None:
    """The op that ``ops`` all feed, outside gradients scopes (itself when there is one):
    the ys that pass-through gradients (AddN, Identity) left unnamed."""
    if len(ops) == 1:
        return ops[0]
    reach = []
    for op in ops:
        seen, frontier = {op}, [op]
        for _ in range(4):
            frontier = [d for n in frontier for d, _ in ir.consumers(n) if not gradient_scope(d)
                        and d not in seen]
            seen.update(frontier)
        reach.append(seen)
    common = set.intersection(*reach)
    return min(common, key=len) if common else None


def _unscaled(ir: GraphIR, node: str) -> str:
    """Loss scaling differentiates ``loss * scale``: the user's loss is the factor that is
    neither a constant nor a variable's value. A product by a constant 1 is the loss itself
    (tf_keras's total_loss: a loss weight of 1 times the loss)."""
    if ir.op(node) != "Mul" or any(_is_one(ir, src) for src, _ in ir.inputs(node)):
        return node
    factors = [src for src, _ in ir.inputs(node)
               if ir.op(src) not in ("Const", "ReadVariableOp", *VARIABLE_OPS)
               and not (ir.op(src) == "Identity" and ir.op(ir.input(src, 0)[0]) in VARIABLE_OPS)]
    return factors[0] if len(factors) == 1 else node


def _is_one(ir: GraphIR, node: str) -> bool:
    from graphxform.nodes import const_value
    value = const_value(ir, node)
    return value is not None and value.size == 1 and value.reshape(-1)[0] == 1


def _climb_identities(ir: GraphIR, node: str) -> str:
    """From ``node`` up through Identity consumers that only rename it (no control inputs),
    while there is exactly one consumer outside gradients scopes (in a transformed graph, in
    the replica's own scope: merge-fetches' node of the original name reads it too)."""
    replica = REPLICA_SCOPE.match(node)
    for _ in range(8):
        users = {d for d, _ in ir.consumers(node) if not gradient_scope(d)
                 and (replica is None or d.startswith(replica.group(0)))}
        if len(users) != 1:
            break
        (user,) = users
        if ir.op(user) != "Identity" or ir.control_inputs(user):
            break
        node = user
    return node


def _saved_by_saver(ir: GraphIR, scope: str | None) -> dict | None:
    """{checkpoint key: [(variable, slice spec)]} the input's Saver writes: the tensor names of
    its SaveV2 ops under ``scope``, each tensor read back through Identity and ReadVariableOp
    to the variable whose value it is (None when it is not one); a partitioned variable's key
    has one entry per part. None without such a Saver."""
    if scope is None:
        return None
    found = {}
    for save in ir.nodes_of(("SaveV2",)):
        if not save.startswith(scope):
            continue
        inputs = ir.inputs(save)
        keys, specs = (_const_strings(ir, src) for src, _ in inputs[1:3])
        if keys is None or specs is None:
            return None
        for key, spec, (src, _) in zip(keys, specs, inputs[3:]):
            while ir.op(src) in ("Identity", "ReadVariableOp") and ir.inputs(src):
                src = ir.inputs(src)[0][0]
            found.setdefault(key, []).append((src if ir.op(src) in VARIABLE_OPS else None,
                                              spec))
    return found or None


def _const_strings(ir: GraphIR, node: str) -> list[str] | None:
    if ir.op(node) != "Const":
        return None
    return [value.decode() for value in ir.attrs(node)["value"].tensor.string_val]


def _saver_scope(ir: GraphIR) -> str | None:
    if ir.kind != "meta" or not ir.meta.HasField("saver_def"):
        return None
    node, _ = parse_tensor(ir.meta.saver_def.filename_tensor_name)
    return node.rsplit("/", 1)[0] + "/" if "/" in node else None


def _variable_defs(ir: GraphIR) -> dict | None:
    """Variable node name -> (VariableDef, trainable, local) from the collections (local: in
    local_variables and not in the global collection); None if none."""
    from tensorflow.core.framework import variable_pb2
    found, where = None, {}
    for key in ("variables", "trainable_variables", "local_variables", "model_variables"):
        if key not in ir.meta.collection_def:
            continue
        found = found or {}
        for raw in ir.meta.collection_def[key].bytes_list.value:
            vd = variable_pb2.VariableDef.FromString(raw)
            node = parse_tensor(vd.variable_name)[0]
            trainable = vd.trainable or key == "trainable_variables"
            if node in found:
                trainable = trainable or found[node][1]
            found[node] = (vd, trainable)
            where.setdefault(node, set()).add(key)
    if found is None:
        return None
    return {node: (vd, trainable, "local_variables" in where[node]
                   and "variables" not in where[node])
            for node, (vd, trainable) in found.items()}


def _variable(ir, name, data, var_defs, users) -> Variable:
    attr = data["attr"]
    shape = tuple(d.size for d in attr["shape"].shape.dim) if "shape" in attr else ()
    var = Variable(name=name, kind="resource" if data["op"] == "VarHandleOp" else "ref",
                   dtype=attr["dtype"].type, shape=shape, trainable=False, device=data["device"])
    if var_defs and name not in var_defs:
        var.local = True  # in no collection, as tf_keras metrics' total and count: see local
    elif var_defs:
        vd, var.trainable, var.local = var_defs[name]
        var.initializer = vd.initializer_name or None
        var.initial_value = vd.initial_value_name or None
        if vd.HasField("save_slice_info_def"):
            var.saved_as = _slice_key(vd.save_slice_info_def)
    read_op = "ReadVariableOp" if var.kind == "resource" else "Identity"
    var.reads = [c for c, _ in users if ir.op(c) == read_op]
    if var.initializer is None and f"{name}/Assign" in ir:
        var.initializer = f"{name}/Assign"
    if var.initializer and var.initial_value is None and var.initializer in ir:
        src, port = ir.input(var.initializer, 1)
        var.initial_value = tensor_name(src, port)
    return var


def _slice_key(info) -> tuple[str, str]:
    """(checkpoint key, slice spec) of a partitioned variable's part, from its SaveSliceInfoDef:
    the whole variable's name, and 'full shape offset,length:...' as TF's Saver writes it."""
    full = " ".join(str(d) for d in info.full_shape)
    spans = ":".join(f"{offset},{length}" for offset, length in zip(info.var_offset,
                                                                    info.var_shape))
    return info.full_name, f"{full} {spans}"


def consumers_through_switches(ir, users) -> list:
    """A variable's consumers, seeing through the Switch ops of legacy conds (an optimizer
    applied only when the gradients are finite reads the variable through one)."""
    found, stack = [], list(users)
    while stack:
        consumer, port = stack.pop()
        if ir.op(consumer) in ("Switch", "RefSwitch") and port == 0:
            stack.extend(ir.consumers(consumer))
        else:
            found.append((consumer, port))
    return found


def _find_writers(ir, users, variables, closure, saver_scope) -> dict:
    """Variable -> ops in the train step that write it (through its first variable input);
    ``users`` are each variable's consumers."""
    writers = {name: [] for name in variables}
    for name in variables:
        for consumer, port in consumers_through_switches(ir, users[name]):
            op = ir.op(consumer)
            if not is_mutating_op(op) or consumer not in closure:
                continue
            if saver_scope and consumer.startswith(saver_scope):
                continue
            writers[name].append((consumer, port))
    for name, found in writers.items():
        variables[name].updates = [c for c, _ in found]
    return writers


def _update_scope(op_name: str, var: str) -> str:
    marker = f"/update_{REPLICA_SCOPE.sub('', var)}/"
    index = op_name.find(marker)
    if index >= 0:
        return op_name[: index + len(marker)]
    return op_name.split("/", 1)[0] + "/"


def _link_optimizer(ir, variables, writers) -> Optimizer | None:
    """Link slots and gradients to variables; return the optimizer seen."""
    optimizer = fallback = None
    children = _children_by_name(variables)
    for name, found in writers.items():
        var = variables[name]
        applies = [(c, p) for c, p in found if is_apply_op(ir.op(c)) and p == 0]
        bare = REPLICA_SCOPE.sub("", name)  # a replica's copy is updated under its own name
        scoped = [(c, p) for c, p in found if f"/update_{bare}/" in c]
        if not applies and not scoped:
            if var.trainable and found:
                _link_own_optimizer(ir, var, found)
            continue
        var.trainable = True
        var.role = "trainable"
        # one update scope per optimizer that applies a gradient to the variable (an
        # actor-critic's shared trunk: the actor's and the critic's optimizers)
        scopes = {}
        for op_name, _ in applies or scoped:
            scopes.setdefault(_update_scope(op_name, name), op_name)
        for scope, first in scopes.items():
            gradient = _link_update(ir, var, scope, [c for c, _ in applies if c.startswith(scope)],
                                    variables, writers, children)
            if gradient is not None:
                var.applications.append(Application(first, gradient))
            if optimizer is None:
                optimizer = next((_optimizer_of(ir, c) for c, _ in applies
                                  if c.startswith(scope)), None)
            if fallback is None:
                fallback = Optimizer(_optimizer_kind(var), scope.split("/", 1)[0] + "/", {})
        first = var.applications[0] if var.applications else None
        var.applied_by = first.update if first else next(iter(scopes.values()))
        var.gradient = first.gradient if first else None
    return optimizer or fallback


def _link_update(ir, var, scope, applies, variables, writers, children) -> Gradient | None:
    """Link the slots that the update ops of ``scope`` (one optimizer's update of ``var``;
    ``applies`` its Apply ops) write, and return the gradient they apply."""
    name, bare = var.name, REPLICA_SCOPE.sub("", var.name)
    starts = []
    for op_name in applies:
        ports = opdefs.input_ports(ir, op_name)
        var_args = opdefs.resource_or_ref_inputs(ir, op_name)
        for slot_arg in var_args[1:]:
            _link_slot(variables, var, ir.input(op_name, ports[slot_arg][0])[0], slot_arg)
        starts += [(op_name, p) for arg in GRADIENT_ARGS for p in ports.get(arg, [])]
    for other in children.get(name, ()):  # slots written by scatter/assign ops in the scope
        if (other not in var.slots.values()
                and any(c.startswith(scope) for c, _ in writers[other])):
            _link_slot(variables, var, other, other[len(name) + 1:])
    # a sparse update with no Apply op (tf_keras' legacy optimizers) names its slots
    # '<optimizer>/<var>/<slot>'; an Apply op names its slots itself
    if not applies and scope.endswith(f"/update_{bare}/"):
        for other in _written_under(scope, writers):
            if other != name and other not in var.slots.values() and f"/{bare}/" in other:
                _link_slot(variables, var, other, other.rsplit(f"/{bare}/", 1)[1])
    apply_ops = set(applies)
    for owner in [name, *var.slots.values()]:
        for op_name, _ in writers[owner]:
            if op_name.startswith(scope) and op_name not in apply_ops:
                starts += [(op_name, p) for p in range(1, len(ir.inputs(op_name)))]
    return _trace_gradient(ir, starts)


def _optimizer_of(ir, apply: str) -> Optimizer:
    """The optimizer an Apply op runs: its kind, scope and hyperparameter tensors."""
    ports = opdefs.input_ports(ir, apply)
    var_args = opdefs.resource_or_ref_inputs(ir, apply)
    hyper = {arg: tensor_name(*ir.input(apply, ps[0])) for arg, ps in ports.items()
             if arg not in var_args and arg not in GRADIENT_ARGS}
    kind = re.sub(r"^(Resource)?(Sparse)?Apply", "", ir.op(apply))
    return Optimizer(kind, apply.split("/", 1)[0] + "/", hyper)


def _written_under(scope: str, writers: dict) -> list[str]:
    """The variables an op of ``scope`` writes: a sparse update's slots, which tf_keras' legacy
    optimizers scatter into (no Apply op names them) and name outside the variable's scope."""
    return sorted(owner for owner, found in writers.items()
                  if any(c.startswith(scope) for c, _ in found))


def _link_own_optimizer(ir, var, writes) -> None:
    """A trainable variable its own code assigns (BERT's AdamWeightDecayOptimizer: ``param.
    assign(param - lr * update)`` with slots from get_variable, no Apply op, no update scope):
    its gradient is born where the assigned value enters tf.gradients' scope, as for Apply.
    The write that applies it is the first whose value comes from a gradient."""
    def starts(ops):
        return [(op, p) for op in ops for p in range(1, len(ir.inputs(op)))]
    ops = list(dict.fromkeys(op for op, _ in writes))
    gradient = _trace_gradient(ir, starts(ops))
    if gradient is not None:
        var.role, var.gradient = "trainable", gradient
        var.applied_by = next((op for op in ops if len(ops) == 1
                               or _trace_gradient(ir, starts([op])) is not None), None)
        if var.applied_by:
            var.applications.append(Application(var.applied_by, gradient))


def _children_by_name(variables) -> dict:
    """Variable -> variables named under it ('w' -> ['w/Adam', 'w/Adam_1']): slot candidates."""
    children = {}
    for name in variables:
        parts = name.split("/")
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            if parent in variables:
                children.setdefault(parent, []).append(name)
    return children


def _optimizer_kind(var) -> str:
    names = sorted(var.slots)
    return names[0].split("_")[0] if names else "unknown"


def _link_slot(variables, var, slot, slot_name) -> None:
    if slot in variables and slot != var.name:
        var.slots[slot_name] = slot
        variables[slot].slot_of = var.name
        variables[slot].role = "slot"


def _trace_gradient(ir, starts) -> Gradient | None:
    from graphxform.towers import tower_average
    """Where a variable's gradient is born: walk back breadth-first from the update ops'
    gradient inputs through every node outside a gradients scope (the optimizer's arithmetic,
    clipping, loss-scale division, finite checks); the tensors where the walk enters a gradients
    scope are born gradients. The nearest float one is this variable's; an integer one beside it
    (same name scope) makes it sparse (IndexedSlices values and indices). Clipping by global
    norm reaches every variable's gradient, hence nearest first; an IdentityN of them all is
    followed from the output read only."""
    born, seen = [], set()
    frontier = [ir.input(op, port) for op, port in starts]
    depth = 0
    while frontier and depth < 64:
        nxt = []
        for src, port in frontier:
            if (src, port) in seen:
                continue
            seen.add((src, port))
            if gradient_scope(src):
                born.append((depth, src, port))
            elif tower_average(ir, src, port):  # tower code: the towers' gradients averaged
                born.append((depth, src, port))
            elif ir.op(src) == "IdentityN":  # output k is input k (tf_keras' Adam passes
                nxt.append(ir.input(src, port))  # every gradient through one)
            elif ir.op(src) == "ReadVariableOp":  # `m.assign(0.9 * m + g)`'s value: the
                nxt.extend(_written_before(ir, src))  # read after the write, of what it wrote
            elif ir.op(src) not in VARIABLE_OPS:
                nxt.extend(ir.inputs(src))
        frontier, depth = nxt, depth + 1
    floats = [(d, s, p) for d, s, p in born if opdefs.output_dtype(ir, s, p) not in _INT_TYPES]
    if not floats:
        return None
    _, src, port = min(floats, key=lambda t: t[0])
    towers = tower_average(ir, src, port)
    if towers:
        return Gradient("dense", tensor=tensor_name(src, port), towers=tuple(towers))
    scope = src.rsplit("/", 1)[0]
    ints = sorted((d, s, p) for d, s, p in born if s.rsplit("/", 1)[0] == scope
                  and opdefs.output_dtype(ir, s, p) in _INT_TYPES and _is_indices(ir, s))
    if ints:
        return Gradient("sparse", values=tensor_name(src, port),
                        indices=tensor_name(ints[0][1], ints[0][2]))
    return Gradient("dense", tensor=tensor_name(src, port))


_RESOURCE_WRITES = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"})


def _written_before(ir, read: str) -> list:
    """The values the writes a resource read waits on (control inputs) wrote to its variable:
    ``v.assign(x)`` returns such a read, whose value is x (or v plus or minus x)."""
    handle = ir.input(read, 0)
    return [ir.input(write, 1) for write in ir.control_inputs(read)
            if ir.op(write) in _RESOURCE_WRITES and ir.input(write, 0) == handle]


def _is_indices(ir, node) -> bool:
    """An IndexedSlices' indices, not its dense_shape (a constant or a Shape)."""
    return ir.op(node) not in ("Const", "Shape", "Cast")


def _global_step(ir, variables) -> str | None:
    from tensorflow.core.framework import variable_pb2
    if "global_step" in ir.meta.collection_def:
        raw = ir.meta.collection_def["global_step"].bytes_list.value
        if raw:
            return parse_tensor(variable_pb2.VariableDef.FromString(raw[0]).variable_name)[0]
    return "global_step" if "global_step" in variables else None


def _inputs(ir, placeholders, saver_scope, steps=(), whole=frozenset()) -> list[Input]:
    """The placeholders the user feeds, with the batch rule of ``Input``; those in ``whole``
    (an input pipeline's own: its file names) are fed whole."""
    read = _read_by_steps(ir, steps)
    found = []
    for name in placeholders:
        if saver_scope and name.startswith(saver_scope):
            continue
        attr = ir.node(name)["attr"]
        shape = None
        if "shape" in attr and not attr["shape"].shape.unknown_rank:
            shape = tuple(d.size for d in attr["shape"].shape.dim)
        found.append(Input(name, attr["dtype"].type, shape, batched=bool(shape) and shape[0] == -1,
                           has_default=ir.op(name) == "PlaceholderWithDefault",
                           read_by_step=read is None or name in read))
    _mark_sparse(ir, found)
    leading = {i.shape[0] for i in found
               if i.read_by_step and i.shape and i.name not in whole and not i.sparse}
    if len(leading) == 1 and min(leading) > 0:  # one fixed size shared by all: the batch
        for inp in found:
            inp.batched = inp.read_by_step and bool(inp.shape) and inp.shape[0] in leading
    for inp in found:
        inp.batched = inp.batched and inp.name not in whole and not inp.sparse
    return found


SPARSE_PARTS = ("indices", "values", "shape")  # sparse_placeholder's, in SparseTensor order
_SPARSE_KINDS = dict(zip(SPARSE_PARTS, ((9, 2), (None, 1), (9, 1))))  # (dtype, rank) of each


def sparse_groups(inputs) -> dict:
    """SparseTensor name -> its (indices, values, shape) Inputs, of the ``inputs`` that are
    parts of one (Input.sparse)."""
    found = {}
    for inp in inputs:
        if inp.sparse:
            found.setdefault(inp.sparse, {})[inp.name.rpartition("/")[2]] = inp
    return {name: tuple(parts[k] for k in SPARSE_PARTS) for name, parts in found.items()
            if len(parts) == len(SPARSE_PARTS)}


def _mark_sparse(ir, inputs: list) -> None:
    """Mark the placeholder triples tf.compat.v1.sparse_placeholder makes (see Input.sparse):
    ``N/indices``, ``N/values`` and ``N/shape``, plain Placeholders of the dtypes and ranks it
    gives them (the shape a PlaceholderWithDefault of the known dimensions where the shape
    given is partly known, ``[None, None]`` as tf.RaggedTensor.from_sparse needs), with the
    number of indices columns (when known) the shape's length."""
    groups = {}
    for inp in inputs:
        head, _, part = inp.name.rpartition("/")
        if head and part in _SPARSE_KINDS and (ir.op(inp.name) == "Placeholder" or (
                part == "shape" and ir.op(inp.name) == "PlaceholderWithDefault")):
            groups.setdefault(head, {})[part] = inp
    for name, parts in groups.items():
        if len(parts) != 3:
            continue
        if not all(p.shape is not None and len(p.shape) == _SPARSE_KINDS[k][1]
                   and _SPARSE_KINDS[k][0] in (None, p.dtype) for k, p in parts.items()):
            continue
        rank = {parts["indices"].shape[1], parts["shape"].shape[0]} - {-1}
        if len(rank) > 1 or parts["indices"].shape[0] != -1 or parts["values"].shape[0] != -1:
            continue
        for inp in parts.values():
            inp.sparse = name


def _read_by_steps(ir, steps) -> set | None:
    """Every node the steps (their ops and losses) depend on; None without steps (then every
    placeholder counts as read)."""
    if not steps:
        return None
    read = set().union(*(s.closure for s in steps))
    for step in steps:
        loss = parse_tensor(step.loss)[0] if step.loss else None
        if loss and loss in ir and loss not in read:
            read |= ir.ancestors(loss)
    return read


def _losses(ir) -> list[str]:
    if "losses" in ir.meta.collection_def:
        col = ir.meta.collection_def["losses"]
        names = list(col.node_list.value) or [b.decode() for b in col.bytes_list.value]
        if names:
            return [tensor_name(*parse_tensor(n)) for n in names]
    if "gradients/Shape" in ir and ir.inputs("gradients/Shape"):  # tf.gradients' Shape(loss)
        return [tensor_name(*ir.input("gradients/Shape", 0))]
    return ["loss:0"] if "loss" in ir else []
