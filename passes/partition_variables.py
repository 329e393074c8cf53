"""partition-variables: split variables along axis 0 into shards `<var>/part_<k>`, slots alike,
so one big variable (an embedding) spreads over several ps tasks.

Shards hold contiguous rows, as even as the rows allow (the first `rows % S` shards get one
more); a variable with fewer rows than partitions gets one shard per row, and one with a single
row (a 1x1 kernel) stays whole, as does one used where its handle cannot be split (a read inside
a legacy while loop or cond, through an Enter or a Switch): the summary names those and why.
What the rest of the graph sees stays the same:
- a read of the variable becomes the concatenation of the shards' reads;
- an embedding lookup (ResourceGather) becomes a partitioned lookup: ids are routed to the shard
  that holds their row, gathered there, and stitched back in order;
- the optimizer's update scope for the variable is copied once per shard, reading the shard and
  its slots' shards; the gradient it reads is split by rows (dense) or routed per shard with its
  indices made shard-local (sparse). When the update reads the born gradient itself, each
  replica splits it and each shard's part is aggregated on its own; when post-processing sits
  between (clipping by global norm, loss-scale division), the whole born gradient is aggregated
  (``whole_gradients`` in ``ctx.state``) and split after post-processing, once per step;
- checkpoints keep the full variable under its original name (`drop-in-saver` concatenates the
  shards to save and slices them to restore), recorded in ``ctx.state``.

The analysis in ``ctx.training`` is updated in place: shards replace the variables, so the
passes after this one place, share and aggregate shards like any other variable."""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from graphxform import opdefs
from graphxform.errors import GraphxformError
from graphxform.ir import parse_tensor, tensor_name
from graphxform.nodes import Builder
from graphxform.pipeline import Pass, PassResult
from graphxform.training import Gradient, Variable, _update_scope, gradient_scope

INT32 = 3


def shard_rows(rows: int, shards: int) -> list[int]:
    """Rows per shard: contiguous, the first ``rows % shards`` shards one row larger."""
    return [rows // shards + (1 if k < rows % shards else 0) for k in range(shards)]


@dataclasses.dataclass
class PartitionVariables(Pass):
    name = "partition-variables"
    partitions: int = 2
    min_bytes: int = 0  # variables smaller than this stay whole

    def run(self, ir, ctx):
        tg = ctx.training
        tg.require_train_op(self.name)
        if self.partitions < 1:
            raise GraphxformError(f"--partitions must be at least 1, not {self.partitions}")
        if self.partitions == 1:
            return PassResult(modified=False)
        build = Builder(ir, self.name)
        state = ctx.state.setdefault(self.name, {"shards": {}, "originals": {},
                                                 "update_nodes": set(), "whole_gradients": {},
                                                 "replaced": set()})
        chosen, kept_whole = [], {}
        names = _SortedNames(ir)
        for var in list(tg.trainable):
            if len(var.shape) < 1 or var.nbytes < self.min_bytes or var.shape[0] < 2:
                continue  # small, a scalar, or a single row (a 1x1 kernel): one shard is whole
            rows = shard_rows(var.shape[0], min(self.partitions, var.shape[0]))
            partition = _Partition(ir, build, tg, var, rows, state, names)
            why = partition.cannot_split()
            if why:
                kept_whole[var.name] = why
            else:
                chosen.append(partition)
        for partition in chosen:
            partition.run()
        summary = {"kept_whole": kept_whole} if kept_whole else {}
        if not chosen:
            return PassResult(modified=False, summary=summary)
        _update_variable_defs(ir, state)
        _drop_colocation(ir, set(state["shards"]) | state["replaced"])
        return PassResult(modified=True, summary={**summary, "partitioned": len(chosen),
                                                  "shards": sum(len(p.rows) for p in chosen)})


SPLITTABLE_USES = {"ReadVariableOp", "Identity", "ResourceGather", "VariableShape",
                   "VarIsInitializedOp"}


class _SortedNames:
    """The graph's node names, sorted once, so the nodes under a name scope are found without a
    sweep over all of them per variable."""

    def __init__(self, ir):
        self.sorted = sorted(ir.nodes())

    def under(self, scope: str) -> list[str]:
        start = bisect.bisect_left(self.sorted, scope)
        end = bisect.bisect_left(self.sorted, scope[:-1] + chr(ord(scope[-1]) + 1))
        return self.sorted[start:end]


class _Partition:
    """Everything that partitioning one trainable variable (and its slots) does."""

    def __init__(self, ir, build, tg, var, rows, state, names):
        self.ir, self.build, self.tg, self.var, self.rows, self.state = (
            ir, build, tg, var, rows, state)
        self.names = names  # _SortedNames of the graph before partitioning
        self.offsets = [int(x) for x in np.cumsum([0] + rows[:-1])]
        self.members = [var] + [tg.variables[s] for s in var.slots.values()]

    def cannot_split(self) -> str | None:
        """Why the variable stays whole, or None. Every use of it and its slots outside its
        update must be one `_rewrite_uses` can split (a read inside a while loop or a cond,
        through an Enter or a Switch of its handle, is not); its update must sit in an
        `update_<var>` scope and read one gradient (or values and indices), and one optimizer
        must train it (the update scope is copied per shard; a second optimizer's, an
        actor-critic's trunk, is not: such a variable stays whole, each gradient aggregated
        on its own)."""
        if len(self.var.applications) > 1:  # each optimizer's update reads it whole
            first, second = (a.update for a in self.var.applications[:2])
            return f"two optimizers train it ('{first}' and '{second}')"
        scope = self._update_scope()
        if f"/update_{self.var.name}/" not in scope:
            return f"its optimizer update is not in an 'update_{self.var.name}' scope"
        for member in self.members:
            for consumer, _ in self.ir.consumers(member.name):
                if consumer.startswith(scope) or consumer == member.initializer:
                    continue
                if self.ir.op(consumer) not in SPLITTABLE_USES:
                    return f"'{consumer}' ({self.ir.op(consumer)}) uses {member.name}"
        self.applied = self._applied_gradient()
        if self.applied is None:
            return "cannot tell which inputs of its update carry its gradient"
        return None

    def run(self):
        self.whole = self._aggregated_whole()
        shards = {m.name: self._make_shards(m) for m in self.members}
        for member in self.members:
            self._rewrite_uses(member, shards[member.name])
        grads = self._route_gradient()
        updates = self._copy_updates(shards, grads)
        for member in self.members:
            self._record(member, shards[member.name], updates, grads)
            self.ir.remove_dead([member.initializer, member.name], keep=lambda n: False)

    # ----------------------------------------------------------- shards
    def _make_shards(self, member) -> list[str]:
        ir, build = self.ir, self.build
        data = ir.node(member.name)
        shards = []
        for k, rows in enumerate(self.rows):
            name = f"{member.name}/part_{k}"
            shape = [rows, *member.shape[1:]]
            attrs = {"dtype": member.dtype, "shape": shape, "shared_name": name}
            shards.append(build.op(name, data["op"], device=data["device"], **attrs))
            begin = build.const(f"{name}/Initializer/begin", [self.offsets[k]] +
                                [0] * (len(shape) - 1), np.int32)
            size = build.const(f"{name}/Initializer/size", [rows] + [-1] * (len(shape) - 1),
                               np.int32)
            initial = build.op(f"{name}/Initializer/slice", "Slice",
                               [member.initial_value, begin, size], T=member.dtype, Index=INT32)
            if member.kind == "resource":
                build.op(f"{name}/Assign", "AssignVariableOp", [name, initial],
                         dtype=member.dtype)
                build.op(f"{name}/Read/ReadVariableOp", "ReadVariableOp", [name],
                         dtype=member.dtype)
            else:
                build.op(f"{name}/Assign", "Assign", [name, initial], T=member.dtype)
                build.op(f"{name}/read", "Identity", [name], T=member.dtype)
        if member.initializer in ir:  # `init` and friends now wait on every shard's assign
            for consumer in list(ir.control_consumers(member.initializer)):
                ir.remove_control_input(consumer, member.initializer)
                for shard in shards:
                    ir.add_control_input(consumer, f"{shard}/Assign")
        return shards

    # ----------------------------------------------------------- uses outside the update
    def _rewrite_uses(self, member, shards):
        ir, build = self.ir, self.build
        scope = self._update_scope()
        for consumer, port in list(ir.consumers(member.name)):
            if consumer.startswith(scope) or consumer == member.initializer:
                continue
            op = ir.op(consumer)
            if op in ("ReadVariableOp", "Identity") and port == 0:
                self._replace(consumer, self._concat(f"{consumer}/partitioned", shards, member,
                                                     ir.control_inputs(consumer)))
            elif op == "ResourceGather" and port == 0:
                self._replace(consumer, self._lookup(consumer, shards))
            elif op == "VariableShape":
                out = ir.node(consumer)["attr"]["out_type"].type
                self._replace(consumer, build.const(f"{consumer}/partitioned",
                                                    list(member.shape), _numpy(out)))
            elif op == "VarIsInitializedOp":
                checks = [build.op(f"{consumer}/part_{k}", "VarIsInitializedOp", [s])
                          for k, s in enumerate(shards)]
                axis = build.const(f"{consumer}/axis", 0, np.int32)
                stacked = build.op(f"{consumer}/stack", "Pack", checks, N=len(checks), T=10)
                self._replace(consumer, build.op(f"{consumer}/partitioned", "All",
                                                 [stacked, axis], Tidx=INT32))
            else:
                raise GraphxformError(f"cannot partition '{member.name}': '{consumer}' ({op}) "
                                      "uses it in a way graphxform cannot split")

    def _replace(self, old, new):
        self.ir.replace_all_uses_with(old, new)
        self.ir.remove_dead([old], keep=lambda n: False)
        self.state["replaced"].add(old)  # nodes colocated with it are no longer tied to it

    def _concat(self, name, shards, member, controls=()):
        """The whole value: the shards' reads concatenated. A read that waited on something
        (an ExponentialMovingAverage reads the weights after the update) gets shard reads that
        wait on the same."""
        if controls:
            deps = ["^" + c for c in controls]
            reads = [self.build.op(f"{name}/read_{k}", "ReadVariableOp", [s] + deps,
                                   dtype=member.dtype) if member.kind == "resource" else
                     self.build.op(f"{name}/read_{k}", "Identity", [s] + deps, T=member.dtype)
                     for k, s in enumerate(shards)]
        else:
            reads = [f"{s}/Read/ReadVariableOp" if member.kind == "resource" else f"{s}/read"
                     for s in shards]
        axis = self.build.const(name + "/axis", 0, np.int32)
        return self.build.op(name, "ConcatV2", reads + [axis], N=len(reads), T=member.dtype)

    def _shard_of(self, scope, indices, dtype):
        """For each index, the shard holding its row: how many shard offsets it reaches."""
        build = self.build
        bounds = build.const(scope + "/bounds", self.offsets[1:], _numpy(dtype))
        minus_one = build.const(scope + "/minus_one", -1, np.int32)
        column = build.op(scope + "/column", "ExpandDims", [indices, minus_one], T=dtype,
                          Tdim=INT32)
        reached = build.op(scope + "/reached", "GreaterEqual", [column, bounds], T=dtype)
        counts = build.op(scope + "/reached_int", "Cast", [reached], SrcT=10, DstT=INT32)
        return build.op(scope + "/shard", "Sum", [counts, minus_one], T=INT32, Tidx=INT32)

    def _local(self, scope, parts, k, dtype):
        offset = self.build.const(f"{scope}/offset_{k}", self.offsets[k], _numpy(dtype))
        return self.build.op(f"{scope}/local_{k}", "Sub", [f"{parts}:{k}", offset], T=dtype)

    def _lookup(self, gather, shards):
        """A partitioned embedding lookup with the same result as ``gather``."""
        ir, build = self.ir, self.build
        ids = tensor_name(*ir.input(gather, 1))
        attr = ir.node(gather)["attr"]
        dtype, index_type = attr["dtype"].type, attr["Tindices"].type
        self._live_gather_sizes(gather, ids, index_type)
        scope = f"{gather}/partitioned"
        flat_shape = build.const(scope + "/flat_shape", [-1], np.int32)
        flat = build.op(scope + "/flat_ids", "Reshape", [ids, flat_shape], T=index_type)
        shard = self._shard_of(scope, flat, index_type)
        n = len(shards)
        parts = build.op(scope + "/ids", "DynamicPartition", [flat, shard], num_partitions=n,
                         T=index_type)
        size = build.op(scope + "/size", "Size", [flat], T=index_type, out_type=INT32)
        zero = build.const(scope + "/zero", 0, np.int32)
        one = build.const(scope + "/one", 1, np.int32)
        positions = build.op(scope + "/positions", "Range", [zero, size, one], Tidx=INT32)
        where = build.op(scope + "/where", "DynamicPartition", [positions, shard],
                         num_partitions=n, T=INT32)
        gathered = [build.op(f"{scope}/gather_{k}", "ResourceGather",
                             [s, self._local(scope, parts, k, index_type)], dtype=dtype,
                             Tindices=index_type, validate_indices=True)
                    for k, s in enumerate(shards)]
        stitched = build.op(scope + "/stitch", "DynamicStitch",
                            [f"{where}:{k}" for k in range(n)] + gathered, N=n, T=dtype)
        ids_shape = build.op(scope + "/ids_shape", "Shape", [ids], T=index_type, out_type=INT32)
        rest = build.const(scope + "/row_shape", list(self.var.shape[1:]), np.int32)
        axis = build.const(scope + "/axis", 0, np.int32)
        shape = build.op(scope + "/shape", "ConcatV2", [ids_shape, rest, axis], N=2, T=INT32)
        return build.op(scope, "Reshape", [stitched, shape], T=dtype)

    def _live_gather_sizes(self, gather, ids, index_type):
        """The gather's gradient holds the ids' size as a constant when TF knew it (fixed-size
        ids); once the gather is gone nothing ties that constant to the ids, so it becomes
        Size(ids), right whatever size the ids get (a batch split over replicas)."""
        ir = self.ir
        suffix = f"{gather}_grad/Size"
        for name in [n for n in ir.nodes() if n.endswith(suffix) and ir.op(n) == "Const"
                     and gradient_scope(n)]:
            live = self.build.op(f"{name}/of_ids", "Size", [ids], T=index_type,
                                 out_type=ir.attrs(name)["dtype"].type)
            ir.replace_all_uses_with(name, live)
            ir.remove_node(name)

    # ----------------------------------------------------------- gradient and update
    def _update_scope(self) -> str:
        update = self.var.applied_by or (self.var.updates[0] if self.var.updates else None)
        return _update_scope(update, self.var.name) if update else "\0"

    def _applied_gradient(self) -> Gradient:
        """What the update reads of the gradient: the born gradient, or what post-processing
        (clipping, loss-scale division) made of it. Found among the update scope's inputs from
        outside it, as the tensors downstream of the born ones."""
        ir, grad, scope = self.ir, self.var.gradient, self._update_scope()
        self.scope_nodes = self.names.under(scope)
        downstream, stack = set(), [parse_tensor(t)[0] for t in grad.tensors]
        while stack:
            node = stack.pop()
            if node in downstream or node.startswith(scope):
                continue
            downstream.add(node)
            stack.extend(dst for dst, _ in ir.consumers(node))
        read = {}
        for node in self.scope_nodes:
            for src, port in ir.inputs(node):
                if src in downstream and not src.startswith(scope):
                    floating = opdefs.output_dtype(ir, src, port) == self.var.dtype
                    read.setdefault("values" if floating else "indices", set()).add(
                        tensor_name(src, port))
        values, indices = read.get("values", set()), read.get("indices", set())
        if grad.kind == "dense" and len(values) == 1 and not indices:
            return Gradient("dense", tensor=values.pop())
        if grad.kind == "sparse" and len(values) == 1 and len(indices) == 1:
            return Gradient("sparse", values=values.pop(), indices=indices.pop())
        return None

    def _aggregated_whole(self) -> bool:
        """Whether the born gradient is aggregated whole (and split after post-processing, once
        per step) rather than split per replica into shard gradients: when the update reads it
        post-processed, or something else reads it too (clipping by global norm)."""
        born = self.var.gradient
        if self.applied.tensors != born.tensors:
            return True
        scope = self._update_scope()
        return any(not dst.startswith(scope) and not gradient_scope(dst)
                   for t in born.tensors for dst, _ in self.ir.consumers(*parse_tensor(t)))

    def _route_gradient(self) -> list[dict]:
        """Per shard, {gradient tensor the update reads: the shard's part of it}."""
        build, grad, n = self.build, self.applied, len(self.rows)
        scope = f"{self.var.name}/part_gradients"
        if grad.kind == "dense":
            sizes = build.const(scope + "/rows", self.rows, np.int32)
            axis = build.const(scope + "/axis", 0, np.int32)
            split = build.op(scope + "/split", "SplitV", [grad.tensor, sizes, axis],
                             num_split=n, T=self.var.dtype, Tlen=INT32)
            return [{grad.tensor: f"{split}:{k}"} for k in range(n)]
        index_type = opdefs.output_dtype(self.ir, *parse_tensor(grad.indices))
        shard = self._shard_of(scope, grad.indices, index_type)
        values = build.op(scope + "/values", "DynamicPartition", [grad.values, shard],
                          num_partitions=n, T=self.var.dtype)
        indices = build.op(scope + "/indices", "DynamicPartition", [grad.indices, shard],
                           num_partitions=n, T=index_type)
        return [{grad.values: f"{values}:{k}",
                 grad.indices: self._local(scope, indices, k, index_type) + ":0"}
                for k in range(n)]

    def _copy_updates(self, shards, grads) -> list[dict]:
        """The update scope once per shard, reading that shard, its slots' shards and its part
        of the gradient. Returns {original node: copy} per shard."""
        ir = self.ir
        scope = self._update_scope()
        nodes = self.scope_nodes
        prefixes = [f"{self.var.name}/part_{k}/" for k in range(len(self.rows))]
        copies = ir.copy_nodes_many(nodes, prefixes, created_by=self.build.created_by)
        for k, mapping in enumerate(copies):
            renames = {m: shards[m][k] for m in shards}
            for original, copy in mapping.items():
                for port, (src, src_port) in enumerate(ir.inputs(copy)):
                    tensor = tensor_name(src, src_port)
                    if src in renames:
                        ir.set_input(copy, port, tensor_name(renames[src], src_port))
                    elif tensor in grads[k]:
                        ir.set_input(copy, port, grads[k][tensor])
                _recolocate(ir, copy, renames)
                ir.node(copy)["attr"].pop("_output_shapes", None)  # shapes are the shard's now
            self.state["update_nodes"].update(mapping.values())
        for node in nodes:  # what waited on the update waits on every shard's
            for consumer in list(ir.control_consumers(node)):
                if consumer.startswith(scope):
                    continue
                ir.remove_control_input(consumer, node)
                for mapping in copies:
                    ir.add_control_input(consumer, mapping[node])
            outside = [c for c, _ in ir.consumers(node) if not c.startswith(scope)]
            if outside:
                raise GraphxformError(f"cannot partition '{self.var.name}': '{outside[0]}' "
                                      f"reads '{node}' of its update")
        ir.remove_nodes(nodes)
        return copies

    def _record(self, member, shards, updates, grads):
        """Shards replace ``member`` in the analysis; the saver needs the original."""
        tg = self.tg
        del tg.variables[member.name]
        self.state["originals"][member.name] = member
        if member is self.var and self.whole:
            self.state["whole_gradients"][member.name] = member
        self.state["shards"][member.name] = list(zip(shards, self.offsets, self.rows))
        for k, shard in enumerate(shards):
            var = Variable(
                name=shard, kind=member.kind, dtype=member.dtype,
                shape=(self.rows[k], *member.shape[1:]), trainable=member.trainable,
                role=member.role, initializer=f"{shard}/Assign",
                initial_value=f"{shard}/Initializer/slice:0",
                reads=[f"{shard}/Read/ReadVariableOp" if member.kind == "resource"
                       else f"{shard}/read"],
                updates=[updates[k][u] for u in member.updates if u in updates[k]],
                applied_by=updates[k].get(member.applied_by), device=member.device)
            if member is self.var:
                g = self.applied
                if not self.whole:  # each shard's part is aggregated on its own
                    var.gradient = (Gradient("dense", tensor=grads[k][g.tensor])
                                    if g.kind == "dense" else
                                    Gradient("sparse", values=grads[k][g.values],
                                             indices=grads[k][g.indices]))
                var.slots = {slot: f"{name}/part_{k}" for slot, name in member.slots.items()}
            else:
                var.slot_of = f"{self.var.name}/part_{k}"
            tg.variables[shard] = var


def _recolocate(ir, name, renames) -> None:
    """`_class: loc:@var` on a copied update op names the shard instead."""
    attr = ir.node(name)["attr"]
    if "_class" not in attr:
        return
    values = [v.decode() for v in attr["_class"].list.s]
    fixed = ["loc:@" + renames.get(v[5:], v[5:]) if v.startswith("loc:@") else v for v in values]
    del attr["_class"].list.s[:]
    attr["_class"].list.s.extend(v.encode() for v in fixed)


def _drop_colocation(ir, gone) -> None:
    """Nodes colocated with a variable that is now shards, or with a read or lookup of it that
    became a concatenation or a partitioned lookup, are no longer tied to it."""
    for name in ir.nodes():
        attr = ir.node(name)["attr"]
        if "_class" not in attr:
            continue
        values = list(attr["_class"].list.s)
        kept = [v for v in values if not (v.startswith(b"loc:@") and v[5:].decode() in gone)]
        if len(kept) == len(values):
            continue
        if kept:
            del attr["_class"].list.s[:]
            attr["_class"].list.s.extend(kept)
        else:
            del attr["_class"]


def _numpy(dtype_enum):
    from graphxform.nodes import numpy_dtype
    return numpy_dtype(dtype_enum)


def _update_variable_defs(ir, state) -> None:
    """Variable collections list the shards in place of the variables they split."""
    from tensorflow.core.framework import variable_pb2
    from graphxform.training import VARIABLE_DEF_COLLECTIONS
    for key in VARIABLE_DEF_COLLECTIONS:
        if key not in ir.meta.collection_def:
            continue
        col = ir.meta.collection_def[key]
        out = []
        for raw in col.bytes_list.value:
            vd = variable_pb2.VariableDef.FromString(raw)
            name = parse_tensor(vd.variable_name)[0]
            if name not in state["shards"]:
                out.append(raw)
                continue
            original = state["originals"][name]
            for shard, _, _ in state["shards"][name]:
                read = (f"{shard}/Read/ReadVariableOp" if original.kind == "resource"
                        else f"{shard}/read")
                copy = variable_pb2.VariableDef()
                copy.CopyFrom(vd)
                copy.variable_name = f"{shard}:0"
                copy.initializer_name = f"{shard}/Assign"
                copy.snapshot_name = f"{read}:0"
                copy.initial_value_name = f"{shard}/Initializer/slice:0"
                copy.ClearField("save_slice_info_def")
                out.append(copy.SerializeToString())
        del col.bytes_list.value[:]
        col.bytes_list.value.extend(out)
