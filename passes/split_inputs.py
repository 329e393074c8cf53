"""split-inputs: the original placeholders stay the entry point; replica i gets the i-th even
slice of the global batch along axis 0. So does each batch an input pipeline in the graph
reads (a tf.data iterator's, an input queue's: graphxform/input_pipeline.py).

Inputs with a fixed batch dimension (``training.Input``'s rule) are split too; a fixed size that
does not divide by the number of replicas is refused here, naming the input. TensorFlow folded
that size into constants when it built the graph (``tf.shape``, ``tf.size``, the gradients of
Reshape, Tile and Mean), so in each replica those say the slice's size instead (see
``rebatch_constants``), and what the replicas compute from them loses its recorded
``_output_shapes`` (TensorFlow refuses a graph whose recorded shapes contradict its own). Under
ps, where what reads no batch stays single, such constants that shared ops read too get a copy
per replica (``rebatch_shared``), and a shared draw of one value per example is split like an
input (``split_shared_draws``). Any
other global batch that does not divide fails at run time in the node
`split_inputs/<input>/split`, which `graphxform run` turns into a one-line error."""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from graphxform import opdefs, replica_values, training
from graphxform.errors import GraphxformError
from graphxform.nodes import Builder, const_value, replica_prefix, tensor_proto
from graphxform.pipeline import Pass, PassResult

SCOPE = "split_inputs/"
FOLDED_SHAPE = re.compile(r"^(Shape|shape_as_tensor|Const)(_\d+)?$")  # tf.shape, Tile multiples
FOLDED_SIZE = re.compile(r"^Size(_\d+)?$")  # tf.size
REPLICA_HEAD = re.compile(r"^replica_\d+/")
# what computes a shape from shapes (random_crop's shape - size + 1)
SHAPE_ARITHMETIC = {"Identity", "Add", "AddV2", "Sub", "Mul", "FloorDiv", "Maximum", "Minimum",
                    "Pack", "ConcatV2", "StridedSlice", "Cast", "Prod"}


@dataclasses.dataclass
class SplitInputs(Pass):
    name = "split-inputs"

    def run(self, ir, ctx):
        build = Builder(ir, self.name)
        replicas = len(ctx.devices)
        split, splits, fixed = [], [], []
        towers = ctx.state.get("towers")
        for tensor, scope, dtype, batch in _batches(ir, ctx.training):
            name = tensor[:-2] if tensor.endswith(":0") else tensor
            if batch and batch % replicas:
                raise GraphxformError(f"input '{name}' has a fixed batch of {batch}, which "
                                      f"does not divide evenly across {replicas} replicas")
            if batch and towers:
                _refuse_fixed_towers(towers, tensor, name, batch, replicas)
            axis = build.const(scope + "axis", 0, np.int32)
            node = build.op(scope + "split", "Split", [axis, tensor], num_split=replicas,
                            T=dtype)
            for i in range(replicas):
                prefix = replica_prefix(i)
                ir.replace_all_uses_with(tensor, f"{node}:{i}",
                                         where=lambda n, p=prefix: n.startswith(p))
            split.append(name)
            splits.append(node)
            fixed += [batch] if batch else []
        sparse = _split_sparse(ir, build, ctx.training, replicas)
        split += list(sparse)
        _uncolocate(ir, split, replicas)
        rebatched, states = [], []
        if fixed:
            lengths = batch_lengths(ir, splits, fixed)
            rebatched = rebatch_constants(ir, build, splits, lengths, replicas)
            rebatched += rebatch_shared(ir, splits, lengths, replicas)
            rebatched += split_shared_draws(ir, build, splits, lengths, replicas)
            states = split_filled_batches(ir, build, rebatched, lengths, replicas)
            splits += [f"{SCOPE}{name}/split" for name in states]
        if fixed or sparse:
            _forget_recorded_shapes(ir, splits + rebatched + list(sparse.values()))
        summary = {"inputs": split, "rebatched_constants": len(rebatched)}
        if states:
            summary["filled_batches"] = states
        return PassResult(modified=bool(split), summary=summary)


def _refuse_fixed_towers(towers, tensor: str, name: str, batch: int, replicas: int) -> None:
    """Tower code (graphxform/towers.py) on a fixed batch: TF folded the size of a tower's
    part (batch / towers) into the towers' constants (a mean's gradient divides by it), which
    nothing here rewrites to a replica's part; refused, as is a slice that does not divide
    into the towers."""
    split = next((s for s, read in sorted(towers.reads.items())
                  if read in (tensor, tensor[:-2])), None)
    if split is None:
        return
    count, slice_ = towers.count, batch // replicas
    if slice_ % count:
        raise GraphxformError(
            f"input '{name}' has a fixed batch of {batch}: each of {replicas} replicas gets "
            f"{slice_} rows, which tf.split '{split}' cannot divide into its {count} towers; "
            f"give a batch that divides by {replicas * count}, or an unknown batch dimension")
    raise GraphxformError(
        f"input '{name}' has a fixed batch of {batch}, which tf.split '{split}' divides into "
        f"{count} towers of {batch // count} rows: TensorFlow folded that size into the "
        f"towers' constants (a mean's gradient divides by it), but a replica's tower holds "
        f"{slice_ // count}; give '{name}' an unknown batch dimension (shape [None, ...])")


def _batches(ir, tg):
    """(tensor, split scope, dtype, fixed batch size or None) of every batch the replicas
    read: the batched placeholders, and the batched outputs of the input pipeline's reads
    (graphxform/input_pipeline.py), which replicate kept single."""
    for inp in tg.inputs:
        if inp.batched and ir.consumers(inp.name):
            yield f"{inp.name}:0", f"{SCOPE}{inp.name}/", inp.dtype, inp.fixed_batch
    for read in (tg.pipeline.reads if tg.pipeline else ()):
        for port in read.batched:
            if ir.consumers(read.node, port):
                yield (f"{read.node}:{port}", f"{SCOPE}{read.node}/output_{port}/",
                       opdefs.output_dtype(ir, read.node, port), read.fixed_batch)


def _uncolocate(ir, inputs: list, replicas: int) -> None:
    """The copies colocated with an input they now read a slice of (``_class: loc:@x``: TF1's
    map_fn puts the TensorArray its input is scattered into beside that input, as does
    ``colocate_with(x)``) lose that colocation and keep their own device: a replica's copy on
    another task than the one the input is fed on cannot be colocated with it (TF refused the
    ps and hybrid outputs: "Cannot colocate nodes ... incompatible tasks")."""
    items = {b"loc:@" + name.encode() for name in inputs}
    first = replica_prefix(0)
    colocated = [name[len(first):] for name in replica_values.replica_copies(ir, first)
                 if "_class" in ir.attrs(name)
                 and not items.isdisjoint(ir.attrs(name)["_class"].list.s)]
    for original in colocated:
        for i in range(replicas):
            copy = replica_prefix(i) + original
            if copy not in ir:
                continue
            attr = ir.node(copy)["attr"]  # the copy's own NodeDef from here on
            kept = [item for item in attr["_class"].list.s if item not in items]
            del attr["_class"].list.s[:]
            if kept:
                attr["_class"].list.s.extend(kept)
            else:
                del attr["_class"]


def _split_sparse(ir, build, tg, replicas: int) -> dict:
    """Cut each SparseTensor fed through placeholders (training.Input.sparse) by its rows with
    one SparseSplit: replica i reads the entries of its slice of the batch, rows numbered from
    0, and a dense shape whose axis 0 is the slice's size. SparseSplit would make uneven parts
    of a batch that does not divide; an Assert it waits on refuses that batch at run time, as
    the dense Split does. Returns {SparseTensor name: its SparseSplit}."""
    made = {}
    for name, (indices, values, shape) in sorted(tg.sparse_inputs.items()):
        if not any(ir.consumers(part) for part in (indices, values, shape)):
            continue
        scope = f"{SCOPE}{name}/"
        rows = build.op(scope + "rows", "StridedSlice",
                        [shape, build.const(scope + "begin", [0], np.int64),
                         build.const(scope + "end", [1], np.int64),
                         build.const(scope + "strides", [1], np.int64)],
                        T=9, Index=9, shrink_axis_mask=1)
        left = build.op(scope + "left_over", "FloorMod",
                        [rows, build.const(scope + "replicas", replicas, np.int64)], T=9)
        even = build.op(scope + "even", "Equal",
                        [left, build.const(scope + "zero", 0, np.int64)], T=9)
        check = build.op(scope + "divides", "Assert",
                         [even, build.const(scope + "message", (
                             f"the batch for sparse input {name} does not divide evenly "
                             f"across {replicas} replicas; rows:").encode()), rows],
                         T=[7, 9], summarize=1)  # string, int64
        node = build.op(scope + "split", "SparseSplit",
                        [build.const(scope + "axis", 0, np.int64), indices, values, shape,
                         "^" + check],
                        num_split=replicas, T=ir.attrs(values)["dtype"].type)
        for i in range(replicas):
            prefix = replica_prefix(i)
            for k, part in enumerate((indices, values, shape)):
                ir.replace_all_uses_with(f"{part}:0", f"{node}:{k * replicas + i}",
                                         where=lambda n, p=prefix: n.startswith(p))
        made[name] = node
    return made


_SPLIT_NODE = re.compile(r"split_inputs/(.+?)(?:/output_(\d+))?/split\b")
_SPARSE_CHECK = re.compile(r"split_inputs/(.+?)/divides\b")
_FAILED_NODE = re.compile(r"\{\{node ([^}]+)\}\}|Detected at node '([^']+)'|Node: '([^']+)'")


def uneven_batch(error_text: str) -> str | None:
    """One line for a run that failed in a split of this pass (a batch that does not divide
    across the replicas); None when it failed elsewhere. Where TF names the failing node, only
    that name is read: the rest of its text may mention a split that feeds it."""
    failed = [next(filter(None, found)) for found in _FAILED_NODE.findall(error_text)]
    if failed:
        error_text = " ".join(failed)
    sparse = _SPARSE_CHECK.search(error_text)
    if sparse:
        return (f"the batch for sparse input '{sparse.group(1)}' does not divide evenly across "
                "replicas")
    match = _SPLIT_NODE.search(error_text)
    if not match:
        return None
    if match.group(2) is None:
        return f"the batch for input '{match.group(1)}' does not divide evenly across replicas"
    return (f"the batch that '{match.group(1)}' read (output {match.group(2)}) does not divide "
            "evenly across replicas (a dataset's last, smaller batch? batch it with "
            "drop_remainder=True)")


def batch_lengths(ir, splits: list[str], fixed: list[int]) -> set[int]:
    """The global lengths TF folded along the batch axis: each fixed batch an input or a read
    has, and the length of each concat along axis 0 of tensors of such lengths computed from
    the batch (two batches of one iterator, or two views of one batch, ``tf.concat([x1, x2],
    0)``: a tf.compat.v1 loss over them counts 32 rows where each replica holds 16). Each
    replica holds 1/N of every one of them."""
    lengths = set(fixed)
    from_batch = ir.data_descendants(splits)
    concats = [n for n in ir.nodes_of({"ConcatV2"}) if n in from_batch
               and n.startswith(replica_prefix(0))]
    grown = True
    while grown:
        grown = False
        for name in concats:
            *parts, axis = ir.inputs(name)
            dims = opdefs.recorded_dims(ir, name, 0)
            if (not dims or dims[0] in lengths or const_value(ir, axis[0]) != 0
                    or not all(src in from_batch and (_recorded_shape(ir, src, port) or
                                                      [None])[0] in lengths
                               for src, port in parts)):
                continue
            lengths.add(dims[0])
            grown = True
    return lengths


def rebatch_constants(ir, build, splits: list[str], lengths: set[int],
                      replicas: int) -> list[str]:
    """In every replica, the constants TF folded from a fixed global batch (any of
    ``lengths``, see batch_lengths) say the slice's size. A gradient's constant that is the
    static shape (or size) of an input of its forward op computed from the batch becomes a
    live Shape (Size) of the replica's tensor. Of the
    rest: integer shapes whose leading entry is the batch (``Shape``, ``shape_as_tensor``, a
    Sum or Mean gradient's Tile multiples, a Reshape of the batch to it, a random draw of one value
    per example, the size of a Slice that keeps the batch's whole axis), ``Size`` scalars that are a
    multiple of it, a Mean gradient's divisor where that Mean averages over axis 0, and filled
    tensors (``zeros_like`` of a batch) whose leading dimension is the batch. Each rewritten
    constant says what it now holds in ``replica_values.REBATCHED_ATTR`` (the batch's shape, a
    count, a batch of one value), so that the graph's readers classify it as what it stands
    for, not as a constant (a loss's divisor is then a count, and the loss a mean). Returns the
    nodes now computed differently."""
    from_batch = ir.data_descendants(splits)
    changed = []
    for name in ir.nodes_of({"Const"}):
        if not name.startswith("replica_"):
            continue
        value = const_value(ir, name)
        live = _live_shape(ir, name, value, from_batch)
        if live is not None:
            changed.append(_make_live(ir, build, name, *live))
            continue
        if _live_shape(ir, name, value, from_batch, of_batch=False) is not None:
            continue  # the shape of a weight as wide as the batch is long
        new = _rebatched(ir, name, value, lengths, replicas, from_batch)
        if new is not None:
            attrs = ir.node(name)["attr"]
            attrs["value"].tensor.CopyFrom(tensor_proto(new[0]))
            attrs[replica_values.REBATCHED_ATTR].s = new[1].encode()
            changed.append(name)
    return changed


def rebatch_shared(ir, splits: list[str], lengths: set, replicas: int) -> list[str]:
    """Constants that stay single (ps shares what a shared op reads too: random_crop's shape
    check reads its folded shape and size) that the rules of rebatch_constants rebatch, and
    the shape arithmetic computed from them alone, get a copy per replica, ``replica_<i>/
    <name>``, for that replica's readers: the slice's values, as allreduce's copies hold;
    the shared readers keep the global ones. Returns the copies."""
    from_batch = ir.data_descendants(splits)
    folded = {}
    for name in ir.nodes_of({"Const"}):
        if not REPLICA_HEAD.match(name) and not name.startswith(SCOPE):
            new = _rebatched(ir, name, const_value(ir, name), lengths, replicas, from_batch)
            if new is not None:
                folded[name] = new
    if not folded:
        return []
    derived = {n for n in ir.data_descendants(folded) - set(folded)
               if not REPLICA_HEAD.match(n) and ir.op(n) in SHAPE_ARITHMETIC}
    arithmetic = set(folded) | derived
    readers = [n for n in ir.nodes() if REPLICA_HEAD.match(n)
               and any(src in arithmetic for src, _ in ir.inputs(n))]
    needed, stack = set(), [src for n in readers for src, _ in ir.inputs(n) if src in arithmetic]
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        if node in derived and any(src not in arithmetic and src in from_batch
                                   for src, _ in ir.inputs(node)):
            continue  # it reads the batch itself: not the shared shape arithmetic
        needed.add(node)
        stack += [src for src, _ in ir.inputs(node) if src in arithmetic]
    copies = []
    for i in range(replicas):
        prefix = replica_prefix(i)
        mine = [n for n in readers if n.startswith(prefix)]
        if not mine:
            continue
        mapping = ir.copy_nodes(sorted(n for n in needed if prefix + n not in ir), prefix,
                                device=ir.node(mine[0])["device"], created_by="split-inputs")
        for name, copy in mapping.items():
            if name in folded:
                attrs = ir.node(copy)["attr"]
                attrs["value"].tensor.CopyFrom(tensor_proto(folded[name][0]))
                attrs[replica_values.REBATCHED_ATTR].s = folded[name][1].encode()
        for reader in mine:
            for port, (src, src_port) in enumerate(ir.inputs(reader)):
                if src in mapping:
                    ir.set_input(reader, port, f"{mapping[src]}:{src_port}")
        copies += mapping.values()
    return copies


def split_shared_draws(ir, build, splits: list[str], lengths: set, replicas: int) -> list:
    """A random draw of one value per example of a fixed batch that stays single (ps shares
    ops that read no batch: WGAN-GP's ``tf.random_uniform([BATCH_SIZE, 1])``,
    random_flip_left_right's coin per image and what it computes from it) is split like an
    input where replicas read it or what is computed from it alone: replica i reads the rows
    of its slice, which is what one device draws for them. Returns the splits."""
    from graphxform.passes.consistent_random import SHAPED_RANDOM_OPS
    from_batch = ir.data_descendants(splits)
    found = []
    for name in ir.nodes_of(SHAPED_RANDOM_OPS):
        shape = const_value(ir, ir.input(name, 0)[0])  # a shape TF folded, or computed
        shape = list(shape) if shape is not None and shape.ndim == 1 else \
            _recorded_shape(ir, name, 0)
        if (REPLICA_HEAD.match(name) or not shape or shape[0] not in lengths
                or not _meets_the_batch(ir, name, from_batch)):
            continue
        shared, stack = set(), [name]
        while stack:  # the draw and the shared ops computed from it
            node = stack.pop()
            if node not in shared:
                shared.add(node)
                stack += [dst for dst, _ in ir.consumers(node) if not REPLICA_HEAD.match(dst)]
        for node in sorted(shared):
            ports = {p for dst, p in ir.consumers(node) if REPLICA_HEAD.match(dst)}
            for port in sorted(ports):
                dims = _recorded_shape(ir, node, port) if node != name else shape
                if not dims or dims[0] not in lengths:
                    continue
                found.append(_split_for_replicas(ir, build, node, port, replicas))
    return found


def _split_for_replicas(ir, build, node: str, port: int, replicas: int) -> str:
    """A Split of ``node:port`` along axis 0 beside it; replica i's readers read part i."""
    device = ir.node(node)["device"]
    scope = f"{SCOPE}{node}/{port}/" if port else f"{SCOPE}{node}/"
    split = build.op(scope + "split", "Split",
                     [build.const(scope + "axis", 0, np.int32, device=device), f"{node}:{port}"],
                     device=device, num_split=replicas, T=opdefs.output_dtype(ir, node, port))
    for i in range(replicas):
        ir.replace_all_uses_with(f"{node}:{port}", f"{split}:{i}",
                                 where=lambda n, p=replica_prefix(i): n.startswith(p))
    return split


def split_filled_batches(ir, build, rebatched: list, lengths: set[int],
                         replicas: int) -> list:
    """A batch filled with one value outside any gradient (an RNN's zero state:
    ``cell.zero_state(batch_size)``, ``tf.zeros([batch_size, units])``) becomes an input
    like a placeholder: one node under its original name fills the global batch, and each
    replica reads its slice of it. The PTB and char-rnn tutorials fetch that tensor, then feed
    each step's final state back into it, which a replica's own filled slice would ignore.
    A filled batch is a Const rebatch_constants made ``batch_fill``, or a Fill of a constant
    value whose shape is constants, one of them rebatched to the slice's shape. Returns the
    original names."""
    fills = [name for name in ir.nodes_of({"Fill"}) if name.startswith("replica_0/")]
    found = []
    for name in [n for n in rebatched if n.startswith("replica_0/")] + fills:
        original = name[len("replica_0/"):]
        if training.gradient_scope(original) or original in ir:
            continue
        if ir.control_inputs(name) or any(ir.control_inputs(src) for src, _ in ir.inputs(name)):
            continue  # inside a loop's or cond's frame (its constants wait on the frame)
        shape, value = _filled(ir, name)
        if shape is None or not shape or shape[0] * replicas not in lengths:
            continue
        batch = shape[0] * replicas
        dtype = opdefs.output_dtype(ir, name, 0)
        scope = f"{SCOPE}{original}/"
        build.op(original, "Fill", [build.const(scope + "dims", [batch, *shape[1:]], np.int32),
                                    build.const(scope + "value", value)],
                 T=dtype)
        split = build.op(scope + "split", "Split", [build.const(scope + "axis", 0, np.int32),
                                                    original], num_split=replicas, T=dtype)
        for i in range(replicas):
            copy = replica_prefix(i) + original
            if copy in ir:
                build.replace(copy, "Identity", [f"{split}:{i}"], device=ir.node(copy)["device"],
                              T=dtype)
                ir.node(copy)["attr"][replica_values.REBATCHED_ATTR].s = \
                    replica_values.BATCH.encode()
        found.append(original)
    return found


def _filled(ir, name: str):
    """(shape, the one value) of the filled batch ``name`` (see split_filled_batches); (None,
    None) when it is not one."""
    if ir.op(name) == "Const":
        value = const_value(ir, name)
        mark = ir.attrs(name).get(replica_values.REBATCHED_ATTR)
        if value is None or not value.size or mark is None or \
                mark.s != replica_values.BATCH_FILL.encode():
            return None, None
        return list(value.shape), value.flat[0]
    dims, fill = (src for src, _ in ir.inputs(name)[:2])
    value = const_value(ir, fill)
    if value is None or value.ndim:
        return None, None
    if ir.op(dims) == "Const":
        parts = [dims]
    elif ir.op(dims) == "ConcatV2" and all(ir.op(src) == "Const" for src, _ in ir.inputs(dims)):
        parts = [src for src, _ in ir.inputs(dims)[:-1]]
    else:
        return None, None
    if not any(replica_values.REBATCHED_ATTR in ir.attrs(part) for part in parts):
        return None, None
    shape = np.concatenate([np.reshape(const_value(ir, part), -1) for part in parts])
    return [int(d) for d in shape], value


def _live_shape(ir, name: str, value, from_batch: set, of_batch: bool = True):
    """("Shape" or "Size", tensor) when ``name``, in a gradient scope, equals the recorded
    static shape (size) of an input of its forward op that is computed from the batch (with
    ``of_batch=False``: that is not, such as a bias added to a batch)."""
    forward = _forward_op(ir, name)
    if forward is None or value is None or value.dtype.kind not in "iu" or value.ndim > 1:
        return None
    for port, (src, src_port) in enumerate(ir.inputs(forward)):
        shape = _recorded_shape(ir, src, src_port)
        if (src in from_batch) != of_batch or shape is None:
            continue
        if value.ndim == 1 and value.tolist() == shape:
            return "Shape", src, src_port
        if value.ndim == 0 and int(value) == int(np.prod(shape)) and shape:
            return "Size", src, src_port
    return None


def _make_live(ir, build, name: str, op: str, src: str, port: int) -> str:
    """The constant ``name`` becomes a live Shape/Size of the replica's tensor, under its own
    name (so the original name still has a copy to serve it from)."""
    dtype = ir.attrs(name)["dtype"].type
    waits = ["^" + waits_on for waits_on in ir.control_inputs(name)]
    return build.replace(name, op, [f"{src}:{port}", *waits], device=ir.node(name)["device"],
                         T=opdefs.output_dtype(ir, src, port), out_type=dtype)


def _forward_op(ir, name: str) -> str | None:
    """The forward op whose gradient ``name`` belongs to (``gradients/<op>_grad/...``)."""
    scope = training.gradient_scope(name)
    if not scope or "_grad/" not in name[len(scope):]:
        return None
    op = name[len(scope):].split("_grad/", 1)[0]
    outer = scope[: scope.rstrip("/").rfind("/") + 1]  # what encloses the gradients scope
    replica = REPLICA_HEAD.match(name)  # an optimizer's scope may enclose tf.gradients' scope
    for forward in (outer + op, (replica.group(0) if replica else "") + op):
        if forward in ir:
            return forward
    return None


def _recorded_shape(ir, node: str, port: int) -> list | None:
    """The static shape TF recorded for a tensor of the input graph (a slice of an input:
    the placeholder's, the global batch, which is what TF folded)."""
    if node.startswith(SCOPE) and ir.op(node) == "Split":  # a placeholder's or an iterator's
        source, port = ir.input(node, 1)
        return _static_shape(ir, source, port, ("shape", "output_shapes"))
    return _static_shape(ir, node, port, ("_output_shapes",))


def _static_shape(ir, node: str, port: int, keys) -> list | None:
    """The fully known shape the first of attrs ``keys`` gives output ``port`` (a shape, or a
    list of one per output), else None."""
    attrs = ir.attrs(node)
    key = next((k for k in keys if k in attrs), None)
    if key is None:
        return None
    value = attrs[key]
    if value.HasField("shape"):
        shape = value.shape
    elif port < len(value.list.shape):
        shape = value.list.shape[port]
    else:
        return None
    dims = [d.size for d in shape.dim]
    return None if shape.unknown_rank or any(d < 0 for d in dims) else dims


def _rebatched(ir, name: str, value, lengths: set, replicas: int, from_batch: set):
    """(``value`` as the slice would have it, its class in graphxform.replica_values), or None
    when it is not folded from the batch (one of ``lengths``)."""
    if value is None or value.dtype.kind not in "iufb":
        return None
    if (value.ndim >= 1 and value.shape[0] in lengths and value.shape[0] > 1
            and (value == value.flat[0]).all() and not _initial_value(ir, name)):
        return (np.full((value.shape[0] // replicas,) + value.shape[1:], value.flat[0],
                        value.dtype), replica_values.BATCH_FILL)
    leaf = name.rsplit("/", 1)[-1]
    multiple = bool(value.ndim == 0 and value and any(value % n == 0 for n in lengths))
    if value.dtype.kind in "iu":
        if value.ndim == 1 and value.size and value[0] in lengths and (
                FOLDED_SHAPE.match(leaf) or _reshapes_the_batch(ir, name, from_batch)
                or _fills_a_batch(ir, name) or _draws_for_the_batch(ir, name, from_batch)
                or _slices_the_batch(ir, name, value, from_batch)
                or _tiles_a_reduced_batch(ir, name, value, from_batch)):
            return (np.concatenate([[value[0] // replicas], value[1:]]).astype(value.dtype),
                    replica_values.BATCH_SHAPE)
        if multiple and FOLDED_SIZE.match(leaf):
            return np.asarray(value // replicas, dtype=value.dtype), replica_values.COUNT
        return None
    if multiple and _mean_over_batch(ir, name):
        return np.asarray(value / replicas, dtype=value.dtype), replica_values.COUNT
    return None


def _initial_value(ir, name: str) -> bool:
    """Whether ``name`` sets a variable (a bias initialised to zeros as wide as the batch
    is long): under a variable's ``Initializer`` scope, or written into one."""
    return "/Initializer/" in name or any(training.is_mutating_op(ir.op(dst))
                                          for dst, _ in ir.consumers(name))


def _reshapes_the_batch(ir, name: str, from_batch: set) -> bool:
    """Whether ``name`` is the target shape of a Reshape of a tensor computed from the batch
    (the user's own ``tf.reshape(x, [batch_size, -1])``)."""
    return any(ir.op(dst) == "Reshape" and port == 1 and ir.input(dst, 0)[0] in from_batch
               for dst, port in ir.consumers(name))


def _slices_the_batch(ir, name: str, value, from_batch: set) -> bool:
    """Whether ``name`` is the size of a Slice of a tensor computed from the batch that keeps
    the whole batch axis (``tf.image.random_crop(x, [batch, h, w, c])``: its offset along
    axis 0 is then 0, so each replica keeps its own slice's rows)."""
    for dst, port in ir.consumers(name):
        if ir.op(dst) != "Slice" or port != 2:
            continue
        src, src_port = ir.input(dst, 0)
        shape = _recorded_shape(ir, src, src_port)
        if src in from_batch and shape and len(shape) == value.size and shape[0] == value[0]:
            return True
    return False


def _tiles_a_reduced_batch(ir, name: str, value, from_batch: set) -> bool:
    """Whether ``name`` is the Tile multiples of the gradient of a Sum or Mean over axis 0 of
    a tensor computed from the batch (``tf.reduce_sum(losses, axis=[0])``, the PTB model's
    sequence loss): TF folded the batch's static shape divided by the kept one, so its leading
    entry is the batch's length."""
    forward = _forward_op(ir, name)
    if forward is None or ir.op(forward) not in {"Sum", "Mean"}:
        return False
    src, src_port = ir.input(forward, 0)
    shape = _recorded_shape(ir, src, src_port)
    return (src in from_batch and shape is not None and len(shape) == value.size
            and shape[0] == value[0]
            and any(ir.op(dst) == "Tile" and port == 1 for dst, port in ir.consumers(name)))


def _fills_a_batch(ir, name: str) -> bool:
    """Whether ``name`` is the shape a Fill fills, or its leading part (``tf.zeros(
    tf.concat([[batch_size], [units]], 0))``, an RNN cell's zero state)."""
    for dst, port in ir.consumers(name):
        if ir.op(dst) == "ConcatV2" and port == 0:
            if any(ir.op(user) == "Fill" and p == 0 for user, p in ir.consumers(dst)):
                return True
        elif ir.op(dst) == "Fill" and port == 0:
            return True
    return False


def _draws_for_the_batch(ir, name: str, from_batch: set) -> bool:
    """Whether ``name`` is the shape a random op draws (port 0), and the draw meets the batch
    within a few ops: one value per example (WGAN-GP's ``tf.random_uniform([BATCH_SIZE, 1])``
    interpolating between real and fake examples). A draw that never meets the batch (noise
    for a generator) keeps its size: every replica draws it alike."""
    return any(port == 0 and ir.op(dst) in training.RANDOM_OPS
               and _meets_the_batch(ir, dst, from_batch) for dst, port in ir.consumers(name))


def _meets_the_batch(ir, draw: str, from_batch: set) -> bool:
    """Whether what ``draw`` draws meets the batch within a few ops."""
    frontier, seen = [draw], {draw}
    for _ in range(6):
        frontier = [user for node in frontier for user, _ in ir.consumers(node)
                    if user not in seen]
        seen.update(frontier)
        if any(src in from_batch for node in frontier for src, _ in ir.inputs(node)):
            return True
    return False


def _mean_over_batch(ir, name: str) -> bool:
    """Whether ``name`` lies in the gradient of a Mean whose axes include 0."""
    forward = _forward_op(ir, name)
    if forward is None or ir.op(forward) != "Mean":
        return False
    axes = const_value(ir, ir.input(forward, 1)[0])
    return axes is not None and 0 in axes.reshape(-1).tolist()




def _forget_recorded_shapes(ir, starts) -> None:
    """Drop ``_output_shapes`` from ``starts`` and everything computed from them."""
    for node in ir.data_descendants(starts):
        if "_output_shapes" in ir.attrs(node):
            ir.node(node)["attr"].pop("_output_shapes", None)
