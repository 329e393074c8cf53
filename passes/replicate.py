"""replicate: copy the training step once per replica as `replica_{i}/...` on its device.

Each replica gets its own copy of every variable and slot. Shared by all replicas, under their
original names: the input placeholders and the input pipeline the step reads, a tf.data
iterator or an input queue (split-inputs slices their batches), and global_step with the ops
that only serve it (its initializer, reads and the once-per-step increment), plus whatever
`share-variables` chose to keep single. A shared op that waited on a replicated op now waits on
every replica's copy. A shared op that reads a replicated tensor (an update op reading a
gradient, after share-variables) reads replica 0's copy; the edge is recorded as a
`cross_edge` for `insert-accumulators`, which must aggregate it. Without share-variables such an
edge is right only when the value is equal on every replica by the end of the pipeline (an
increment of global_step that only runs when the all-reduced gradients are finite): the
contract check proves that or refuses.

With ``mirror_global_step`` (allreduce across worker tasks) global_step is copied per replica
like any variable: each replica bumps its own copy once per step, as MultiWorkerMirroredStrategy
mirrors it, so no task reads a global_step another task moves (a learning-rate schedule on
worker 1 would otherwise race the chief's increment)."""

from __future__ import annotations

import dataclasses

from graphxform import opdefs
from graphxform.errors import GraphxformError
from graphxform.ir import tensor_name
from graphxform.nodes import replica_prefix
from graphxform.pipeline import Pass, PassResult
from graphxform.training import (PLACEHOLDER_OPS, RANDOM_OPS, VARIABLE_DEF_COLLECTIONS,
                                 VARIABLE_OPS)

CONTEXT_COLLECTIONS = ("while_context", "cond_context")
GLOBAL_DEFAULT = "global_default/"
_FRAME_OPS = frozenset({"Enter", "RefEnter", "Exit", "RefExit", "Switch", "RefSwitch", "Merge",
                        "RefMerge", "NextIteration", "RefNextIteration", "LoopCond"})


def shared_nodes(ir, tg, with_global_step: bool = True) -> set:
    """Nodes that stay single: placeholders, the input pipeline the steps read
    (graphxform/input_pipeline.py), global_step and what only serves it."""
    shared = set(ir.nodes_of(PLACEHOLDER_OPS))
    if tg.pipeline:
        shared |= tg.pipeline.nodes
    if tg.global_step and with_global_step:
        shared.add(tg.global_step)
        users = list(ir.consumers(tg.global_step))
        while users:  # through the Switch of a legacy cond (an increment only when finite)
            dst, port = users.pop()
            shared.add(dst)
            if ir.op(dst) in ("Switch", "RefSwitch") and port == 0:
                users.extend(ir.consumers(dst))
        stack = [src for n in list(shared) for src, _ in ir.inputs(n)]
        while stack:  # stateless inputs used only by shared nodes (initial value, increment)
            node = stack.pop()
            if node in shared or ir.op(node) not in ("Const", "Fill", "Identity", "Cast"):
                continue
            if all(dst in shared for dst in ir.successors(node)):
                shared.add(node)
                stack.extend(src for src, _ in ir.inputs(node))
    return shared


def kept_single(ir, ctx, mirror_global_step: bool = False) -> set:
    """What replicate leaves single: ``shared_nodes`` and what share-variables chose."""
    sharing = ctx.state.get("share-variables")
    return (shared_nodes(ir, ctx.training, not mirror_global_step)
            | (sharing["shared"] if sharing else set()))


@dataclasses.dataclass
class Replicate(Pass):
    name = "replicate"
    mirror_global_step: bool = False

    def run(self, ir, ctx):
        tg = ctx.training
        tg.require_train_op(self.name)
        require_single_device(ir)
        if tg.pipeline:
            tg.pipeline.require_single()
        defaults = _global_defaults(ir, tg, self.name)
        shared = kept_single(ir, ctx, self.mirror_global_step) | defaults
        sync = ctx.state.get("sync-init", {"first_only": set(), "redirect": [],
                                           "initial_values": set()})
        copied = [n for n in ir.nodes() if n not in shared]
        enters = [n for n in ir.nodes_of(("Enter", "RefEnter")) if n not in shared]
        prefixes = [replica_prefix(i) for i in range(len(ctx.devices))]
        replicas = ir.copy_nodes_many(copied, prefixes, devices=ctx.devices, created_by=self.name,
                                      first_only=sync["first_only"], originals_go=True)
        for initializer, initial_value in sync["redirect"]:
            for prefix in prefixes[1:]:
                ir.set_input(prefix + initializer, 1, prefixes[0] + initial_value)
        for prefix, mapping in zip(prefixes, replicas):
            _rename_frames(ir, [mapping[n] for n in enters], prefix)
        cross_edges = []
        for name in sorted(shared):  # shared ops that waited on a replicated op wait on all copies
            for src in list(ir.control_inputs(name)):
                if src not in shared:
                    ir.remove_control_input(name, src)
                    for mapping in replicas:
                        ir.add_control_input(name, mapping[src])
            for port, (src, src_port) in enumerate(ir.inputs(name)):
                if src in shared:
                    continue
                ir.set_input(name, port, tensor_name(replicas[0][src], src_port))
                cross_edges.append((name, port, tensor_name(src, src_port)))
        _uncolocate_functions(ir, copied)
        ir.remove_nodes(copied)
        _update_collections(ir, shared, len(ctx.devices), sync["first_only"],
                            sync["initial_values"])
        ctx.state[self.name] = {"shared": shared, "cross_edges": cross_edges}
        return PassResult(modified=True, summary={"replicas": len(ctx.devices),
                                                  "nodes_per_replica": len(copied)})


def require_single_device(ir) -> None:
    """Refuse a graph graphxform already transformed: its replicas are not a batch to split
    (what the input checks would read in them, a split of the batch, is this tool's)."""
    if ir.has_scope("replica_0/"):
        raise GraphxformError("the graph is already transformed (it has nodes under "
                              "replica_0/); start from the single-device graph")


def _global_defaults(ir, tg, created_by: str) -> set:
    """A PlaceholderWithDefault stays single like every placeholder, so its default must be
    what one device computes: from the whole batch. Where the default is computed from the
    batch (WGAN-GP's ``placeholder_with_default(tf.fill([tf.shape(x)[0], 1], 0.5), ...)``),
    its computation is copied as ``global_default/<name>``, reading the placeholders
    themselves, and the placeholder reads that copy; the replicas' copies would give one
    replica's slice (which split-inputs would then split again). A default that reads no batch
    is equal on every replica and stays as it is (replica 0's copy). Returns the copies."""
    sources = set(tg.batch_sources)
    defaults = ir.nodes_of(("PlaceholderWithDefault",))
    if not sources or not defaults:
        return set()
    single = set(ir.nodes_of(PLACEHOLDER_OPS)) | (tg.pipeline.nodes if tg.pipeline else set())
    made = set()
    for name in sorted(defaults):
        region, reaches, stack = set(), False, [src for src, _ in ir.inputs(name)]
        while stack:
            node = stack.pop()
            if node in region:
                continue
            if node in single:
                reaches = reaches or node in sources
                continue
            op = ir.op(node)
            if op in VARIABLE_OPS or (opdefs.is_stateful(ir, op) and op not in RANDOM_OPS):
                continue  # equal on every replica, or not ours to copy: replica 0's is read
            if op in _FRAME_OPS:
                raise GraphxformError(
                    f"'{name}': its default is computed from the batch inside a while loop or "
                    f"cond ('{node}'), which cannot be recomputed from the whole batch; feed it, "
                    "or compute the default outside the loop")
            region.add(node)
            stack.extend(src for src, _ in ir.inputs(node))
        if not reaches:
            continue
        prefix = ir.unique_scope(GLOBAL_DEFAULT.rstrip("/"))
        mapping = ir.copy_nodes(sorted(region), prefix, created_by=created_by)
        src, port = ir.inputs(name)[0]
        ir.set_input(name, 0, tensor_name(mapping[src], port))
        made.update(mapping.values())
    return made


def _uncolocate_functions(ir, copied: list) -> None:
    """Function bodies are one for every replica, so a body node colocated with a node the
    replicas each copy (control flow v2's gradient loop, which tf.gradients colocates with the
    forward ``rnn/while``) would be pinned beside replica 0's: on a cluster, TF refused the
    other workers' gradient loops ("Cannot colocate nodes ... incompatible tasks"). Such body
    nodes lose that colocation and run where their call runs. So do those colocated with a
    name the graph does not have (tf_keras' batch norm update in a ``tf.cond`` branch names
    ``AssignMovingAvg/<variable>``, its captured variable's name in the branch): TF takes it
    for one group across every call, which ties every replica's update to one task."""
    library = ir.meta.graph_def.library.function
    if not library:
        return
    replicated = {b"loc:@" + name.encode() for name in copied}
    for function in library:
        for node in function.node_def:
            if "_class" not in node.attr:
                continue
            items = node.attr["_class"].list.s
            kept = [item for item in items if item not in replicated
                    and item.decode(errors="replace").removeprefix("loc:@") in ir]
            if len(kept) == len(items):
                continue
            del items[:]
            if kept:
                items.extend(kept)
            else:
                del node.attr["_class"]


def _rename_frames(ir, enters, prefix) -> None:
    """Legacy while loops: each replica's loop needs its own frame name."""
    for name in enters:
        frame = ir.node(name)["attr"]["frame_name"]
        frame.s = (prefix + frame.s.decode()).encode()


def replica_names(value: str, shared: set, replicas: int, first_only=()) -> list[str]:
    """A node or tensor name (maybe '^name') as it is called in each replica (replica 0's
    alone for what only replica 0 has: see sync-init)."""
    bare = value.lstrip("^")
    node = bare.split(":", 1)[0]
    if node in shared:
        return [value]
    caret = "^" if value.startswith("^") else ""
    if node in first_only:
        return [caret + replica_prefix(0) + bare]
    return [caret + replica_prefix(i) + bare for i in range(replicas)]


def _update_collections(ir, shared, replicas, first_only, initial_values) -> None:
    """Collections name every replica's copies; VariableDefs of replicas > 0 name replica 0's
    initial value when sync-init chose it (``initial_values``: their nodes)."""
    from tensorflow.core.framework import variable_pb2
    for key, col in ir.meta.collection_def.items():
        if key in VARIABLE_DEF_COLLECTIONS:
            out = []
            for raw in col.bytes_list.value:
                vd = variable_pb2.VariableDef.FromString(raw)
                if vd.variable_name.split(":")[0] in shared:
                    out.append(raw)
                    continue
                synced = vd.initial_value_name.split(":")[0] in initial_values
                for i in range(replicas):
                    out.append(_prefixed_variable_def(
                        vd, replica_prefix(i), replica_prefix(0) if synced else None))
            del col.bytes_list.value[:]
            col.bytes_list.value.extend(out)
        elif key in CONTEXT_COLLECTIONS:
            _copy_contexts(col, key, shared, replicas)
        elif col.HasField("node_list"):
            names = [r for v in col.node_list.value
                     for r in replica_names(v, shared, replicas, first_only)]
            del col.node_list.value[:]
            col.node_list.value.extend(names)


def _prefixed_variable_def(vd, prefix: str, initial_value_prefix: str | None) -> bytes:
    """A VariableDef with every name in it prefixed (its initial value's with
    ``initial_value_prefix`` if given). Its four node names are set directly (the generic walk
    costs more than the rest of the collections together on large graphs); anything else that
    holds a name (save_slice_info_def) goes through the generic walk."""
    copy = type(vd)()
    copy.CopyFrom(vd)
    for field in _VARIABLE_DEF_NAMES:
        value = getattr(vd, field)
        if value:
            own = initial_value_prefix if field == "initial_value_name" else None
            setattr(copy, field, (own or prefix) + value)
    if copy.HasField("save_slice_info_def"):
        _prefix_strings(copy.save_slice_info_def, lambda s: prefix + s if s else s)
    return copy.SerializeToString()


_VARIABLE_DEF_NAMES = ("variable_name", "initial_value_name", "initializer_name", "snapshot_name")


def _copy_contexts(col, key, shared, replicas) -> None:
    from tensorflow.core.protobuf import control_flow_pb2
    cls = (control_flow_pb2.WhileContextDef if key == "while_context"
           else control_flow_pb2.CondContextDef)
    out = []
    for raw in col.bytes_list.value:
        for i in range(replicas):
            ctx_def = cls.FromString(raw)
            prefix = replica_prefix(i)
            _prefix_strings(ctx_def, lambda s: s if not s or s.lstrip("^").split(":")[0] in shared
                            else prefix + s)
            out.append(ctx_def.SerializeToString(deterministic=True))
    del col.bytes_list.value[:]
    col.bytes_list.value.extend(out)


def _prefix_strings(message, rename) -> None:
    """Apply ``rename`` to every string field (names of nodes, tensors, contexts) recursively."""
    for field, value in message.ListFields():
        if field.type == field.TYPE_STRING:
            if _repeated(field):
                renamed = [rename(v) for v in value]
                del value[:]
                value.extend(renamed)
            else:
                setattr(message, field.name, rename(value))
        elif field.type == field.TYPE_MESSAGE:
            if field.message_type.GetOptions().map_entry:
                items = {rename(k): rename(v) for k, v in value.items()}
                value.clear()
                value.update(items)
            elif _repeated(field):
                for item in value:
                    _prefix_strings(item, rename)
            else:
                _prefix_strings(value, rename)


def _repeated(field) -> bool:
    if hasattr(field, "is_repeated"):  # protobuf >= 5.28; `label` is gone in 7
        return field.is_repeated
    return field.label == field.LABEL_REPEATED
