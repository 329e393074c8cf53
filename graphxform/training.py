"""What a training graph holds, found from the graph alone.

Variables (resource and reference) with their reads, initializer, updates, gradient and optimizer
slots; the optimizer; global_step; the train op; the loss; input placeholders. A graph with no
training step is still analysed (``train_op`` is None); passes that need one call
``require_train_op``.
"""

from __future__ import annotations

import dataclasses
import re

from graphxform import opdefs
from graphxform.errors import GraphxformError
from graphxform.ir import GraphIR, parse_tensor, tensor_name

VARIABLE_OPS = {"VarHandleOp", "VariableV2", "Variable"}
PLACEHOLDER_OPS = {"Placeholder", "PlaceholderWithDefault"}
APPLY_PREFIXES = ("ApplyGradientDescent", "Apply", "ResourceApply", "SparseApply",
                  "ResourceSparseApply")
RANDOM_OPS = {"RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
              "Multinomial", "RandomShuffle", "RandomGamma", "RandomPoisson", "RandomPoissonV2",
              "StatelessRandomUniform", "StatelessRandomNormal", "StatelessTruncatedNormal",
              "StatelessRandomUniformV2", "StatelessRandomNormalV2", "RandomShuffleQueueV2"}
GRADIENT_ARGS = ("grad", "delta", "indices")  # input args of Apply ops that carry the gradient
GRADIENTS_SCOPE = re.compile(r"^(?:.*/)?gradients(?:_\d+)?/")
_INT_TYPES = {3, 9, 4, 6, 5, 17, 22, 23}  # int32 int64 uint8 int8 int16 uint16 uint32 uint64


def is_apply_op(op: str) -> bool:
    return op.startswith(APPLY_PREFIXES)


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

    @property
    def tensors(self) -> list[str]:
        return [self.tensor] if self.kind == "dense" else [self.values, self.indices]


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
    slots: dict = dataclasses.field(default_factory=dict)  # slot name -> variable name
    slot_of: str | None = None
    device: str = ""

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


@dataclasses.dataclass
class Input:
    name: str
    dtype: int
    shape: tuple | None  # None: unknown rank
    batched: bool


@dataclasses.dataclass
class Optimizer:
    kind: str
    scope: str
    hyperparameters: dict  # arg name -> tensor name


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

    def require_train_op(self, what: str = "this pass") -> str:
        if self.train_op is None:
            raise GraphxformError(f"{what} needs a training graph, but no train op was found "
                                  "(no 'train_op' collection; name one with --train-op)")
        return self.train_op

    @property
    def trainable(self) -> list:
        return [v for v in self.variables.values() if v.trainable and v.gradient is not None]


def analyze(ir: GraphIR, train_op: str | None = None) -> TrainingGraph:
    """Analyse ``ir``; ``train_op`` overrides the 'train_op' collection."""
    saver_scope = _saver_scope(ir)
    train_op = train_op or _collection_node(ir, "train_op")
    if train_op is not None and train_op not in ir:
        raise GraphxformError(f"train op '{train_op}' is not a node of the graph")
    closure = ir.ancestors(train_op) if train_op else set()
    var_defs = _variable_defs(ir)
    variables, noops, placeholders, users = {}, [], [], {}
    for name, data in ir.node_items():  # the one sweep over all nodes
        op = data["op"]
        if op in VARIABLE_OPS:
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
    losses = _losses(ir)
    sinks = [n for n in noops if not any(ir.successors(n))
             and not (saver_scope and n.startswith(saver_scope))]
    inputs = _inputs(ir, placeholders, saver_scope)
    return TrainingGraph(variables=variables, inputs=inputs, train_op=train_op,
                         loss=losses[0] if losses else None, losses=losses,
                         global_step=global_step, optimizer=optimizer, saver_scope=saver_scope,
                         train_closure=closure, extra_updates=extra, noop_sinks=sinks)


def _saver_scope(ir: GraphIR) -> str | None:
    if ir.kind != "meta" or not ir.meta.HasField("saver_def"):
        return None
    node, _ = parse_tensor(ir.meta.saver_def.filename_tensor_name)
    return node.rsplit("/", 1)[0] + "/" if "/" in node else None


def _collection_node(ir: GraphIR, key: str) -> str | None:
    if key not in ir.meta.collection_def:
        return None
    col = ir.meta.collection_def[key]
    names = list(col.node_list.value) or [b.decode() for b in col.bytes_list.value]
    if not names:
        return None
    return parse_tensor(names[0])[0]


def _variable_defs(ir: GraphIR) -> dict | None:
    """Variable node name -> (VariableDef, trainable) from the collections; None if none."""
    from tensorflow.core.framework import variable_pb2
    found = None
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
    return found


def _variable(ir, name, data, var_defs, users) -> Variable:
    attr = data["attr"]
    shape = tuple(d.size for d in attr["shape"].shape.dim) if "shape" in attr else ()
    var = Variable(name=name, kind="resource" if data["op"] == "VarHandleOp" else "ref",
                   dtype=attr["dtype"].type, shape=shape, trainable=False, device=data["device"])
    if var_defs and name in var_defs:
        vd, var.trainable = var_defs[name]
        var.initializer = vd.initializer_name or None
        var.initial_value = vd.initial_value_name or None
    read_op = "ReadVariableOp" if var.kind == "resource" else "Identity"
    var.reads = [c for c, _ in users if ir.op(c) == read_op]
    if var.initializer is None and f"{name}/Assign" in ir:
        var.initializer = f"{name}/Assign"
    if var.initializer and var.initial_value is None and var.initializer in ir:
        src, port = ir.input(var.initializer, 1)
        var.initial_value = tensor_name(src, port)
    return var


def _find_writers(ir, users, variables, closure, saver_scope) -> dict:
    """Variable -> ops in the train step that write it (through its first variable input);
    ``users`` are each variable's consumers."""
    writers = {name: [] for name in variables}
    for name in variables:
        for consumer, port in users[name]:
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
    marker = f"/update_{var}/"
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
        scoped = [(c, p) for c, p in found if f"/update_{name}/" in c]
        if not applies and not scoped:
            continue
        var.trainable = True
        var.role = "trainable"
        scope = _update_scope((applies or scoped)[0][0], name)
        starts = []
        for op_name, _ in applies:
            ports = opdefs.input_ports(ir, op_name)
            var_args = opdefs.resource_or_ref_inputs(ir, op_name)
            for slot_arg in var_args[1:]:
                _link_slot(variables, var, ir.input(op_name, ports[slot_arg][0])[0], slot_arg)
            starts += [(op_name, p) for arg in GRADIENT_ARGS for p in ports.get(arg, [])]
            if optimizer is None:
                hyper = {arg: tensor_name(*ir.input(op_name, ps[0])) for arg, ps in ports.items()
                         if arg not in var_args and arg not in GRADIENT_ARGS}
                kind = re.sub(r"^(Resource)?(Sparse)?Apply", "", ir.op(op_name))
                optimizer = Optimizer(kind, op_name.split("/", 1)[0] + "/", hyper)
        for other in children.get(name, ()):  # slots written by scatter/assign ops in the scope
            if (other not in var.slots.values()
                    and any(c.startswith(scope) for c, _ in writers[other])):
                _link_slot(variables, var, other, other[len(name) + 1:])
        apply_ops = {c for c, _ in applies}
        for owner in [name, *var.slots.values()]:
            for op_name, _ in writers[owner]:
                if op_name.startswith(scope) and op_name not in apply_ops:
                    starts += [(op_name, p) for p in range(1, len(ir.inputs(op_name)))]
        var.gradient = _trace_gradient(ir, scope, starts)
        if fallback is None:
            fallback = Optimizer(_optimizer_kind(var), scope.split("/", 1)[0] + "/", {})
    return optimizer or fallback


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


def _trace_gradient(ir, scope, starts) -> Gradient | None:
    """Walk back from the update ops' inputs through the optimizer's update scope; the tensors
    where the walk leaves the scope under a gradients scope are the raw gradient."""
    boundary = []
    seen = set()
    stack = [ir.input(op, port) for op, port in starts]
    while stack:
        src, port = stack.pop()
        if (src, port) in seen:
            continue
        seen.add((src, port))
        if src.startswith(scope):
            stack.extend(ir.inputs(src))
        elif ir.op(src) not in VARIABLE_OPS:
            boundary.append((src, port))
    grads = [t for t in boundary if GRADIENTS_SCOPE.match(t[0])] or [
        t for t in boundary if ir.op(t[0]) not in ("Const", "ReadVariableOp", "Identity")]
    if not grads:
        return None
    ints = [t for t in grads if opdefs.output_dtype(ir, *t) in _INT_TYPES]
    floats = [t for t in grads if t not in ints]
    if ints and floats:
        return Gradient("sparse", values=tensor_name(*floats[0]), indices=tensor_name(*ints[0]))
    if floats:
        return Gradient("dense", tensor=tensor_name(*floats[0]))
    return None


def _global_step(ir, variables) -> str | None:
    from tensorflow.core.framework import variable_pb2
    if "global_step" in ir.meta.collection_def:
        raw = ir.meta.collection_def["global_step"].bytes_list.value
        if raw:
            return parse_tensor(variable_pb2.VariableDef.FromString(raw[0]).variable_name)[0]
    return "global_step" if "global_step" in variables else None


def _inputs(ir, placeholders, saver_scope) -> list[Input]:
    found = []
    for name in placeholders:
        data = ir.node(name)
        if saver_scope and name.startswith(saver_scope):
            continue
        attr = data["attr"]
        shape = None
        if "shape" in attr and not attr["shape"].shape.unknown_rank:
            shape = tuple(d.size for d in attr["shape"].shape.dim)
        dtype = attr["dtype"].type
        found.append(Input(name, dtype, shape, batched=bool(shape) and shape[0] == -1))
    return found


def _losses(ir) -> list[str]:
    if "losses" in ir.meta.collection_def:
        col = ir.meta.collection_def["losses"]
        names = list(col.node_list.value) or [b.decode() for b in col.bytes_list.value]
        if names:
            return [tensor_name(*parse_tensor(n)) for n in names]
    if "gradients/Shape" in ir and ir.inputs("gradients/Shape"):  # tf.gradients' Shape(loss)
        return [tensor_name(*ir.input("gradients/Shape", 0))]
    return ["loss:0"] if "loss" in ir else []


def random_ops_in_step(ir: GraphIR, tg: TrainingGraph) -> list[str]:
    """Random ops that run in every training step (so replicas cannot match a single device)."""
    return sorted(n for n in tg.train_closure if ir.op(n) in RANDOM_OPS)
