"""Prove that TensorFlow accepts an output graph while importing only part of it.

A full ``tf.import_graph_def`` of a replicated graph costs many times more than building it:
TF checks every copy of every node and Python wraps each op and tensor. Most of that repeats
itself. A copy that nothing changed since ``GraphIR.copy_nodes_many`` made it has the NodeDef
of the same call's copy of that original for the call's first prefix (its *representative*)
with another prefix and device; emit writes both from one block of bytes (graphxform/wire.py).
Call it a *twin* when its representative is unchanged too. What TF's importer checks of a node
(its op and attrs, the dtypes of its inputs, shape inference from its inputs' shapes and
constant values, any recorded ``_output_shapes``) then comes out the same for a twin and its
representative, as long as their inputs look the same to TF: the same node, a twin and its
representative, or two nodes to which TF gives the same dtype, shape, resource handle data and
constant value. So ``check``:

1. finds the twins (``find_twins``), and the nodes a pass made or rewired per replica that
   are alike a node it imports in the same sense (``join_alike``: same op and attrs, inputs
   that are the same node or twins of it), which are left out as twins are;
2. imports every other node with TF's C importer, without Python op wrappers; a node that reads
   a twin reads its representative instead. Leaves that nothing reads through data are left
   out too, where TF could say nothing of them but whether an Identity's T is its input's
   dtype (``find_leaves``: merge-fetches' Identity per name of the input graph): that is
   checked on what TF made of the input;
3. compares, for each node a twin reads that is not a twin itself (the *frontier*: a copy fed
   its replica's slice of the batch, a rewired gradient), what TF inferred for it and for its
   representative's counterpart; when anything differs, or has no counterpart, it imports the
   whole graph instead;
4. does what TF's Python importer adds to the C one: every device string parses; and, since
   twins are left out of the import, it checks itself that every ``loc:@`` colocation names
   a node of the graph;
5. does what ``tf.compat.v1.train.import_meta_graph`` adds: every name a collection holds
   resolves (a node list's ops and tensors, a variable collection's variables, their
   initializers and snapshots, a queue runner's ops).

So a graph TF would reject is rejected whichever replica holds the fault: a fault in a twin
is a fault in its representative, which is imported.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import re

from graphxform import wire
from graphxform.errors import GraphxformError, clip, tf_error_line
from graphxform.ir import CONTROL_KEYS, BorrowedNode, GraphIR, data_pairs, paused_gc


@dataclasses.dataclass
class Twins:
    of: dict = dataclasses.field(default_factory=dict)  # twin -> its representative
    # (node a twin reads that is not one, its representative's counterpart or None)
    frontier: list = dataclasses.field(default_factory=list)


# imported graphs left for the process's end (see check's ``keep_until_exit``)
_KEPT_UNTIL_EXIT: list = []


def check(ir: GraphIR, keep_until_exit: bool = False) -> dict:
    """Raise GraphxformError naming what TF rejects in the graph ``metagraph.to_bytes(ir)``
    writes. Returns what was done: nodes imported, twins left out, frontier pairs, and
    whether the whole graph was imported. ``keep_until_exit``: the caller is a command that
    ends without teardown right after writing its output, so TF's imported graph is never
    freed (freeing a 64k-node graph costs 0.2-0.3 s; its memory goes with the process)."""
    release = _KEPT_UNTIL_EXIT.append if keep_until_exit else _Imported.close
    with paused_gc():  # it reads and writes objects by the ten thousand, frees few
        _check_devices({data["device"] for data in ir.g._node.values()})
        _check_colocation(ir)
        _check_collections(ir)
        twins = find_twins(ir)
        leaves = find_leaves(ir, twins.of)
        join_alike(ir, twins, leaves)
        left_out = {**twins.of, **{leaf: src for leaf, (src, _, _) in leaves.items()}}
        whole = not left_out or any(rep is None for _, rep in twins.frontier)
        if not whole:
            read = sorted({(src, port) for src, port, dtype in leaves.values()
                           if dtype is not None})
            imported = _import(ir, _node_fields(ir, left_out),
                               [name for pair in twins.frontier for name in pair], read)
            whole = not _frontier_agrees(imported, len(twins.frontier))
            if not whole:
                _check_leaves(leaves, dict(zip(read, imported.outputs)))
            release(imported)
        if whole:
            release(_import(ir, _node_fields(ir, None), [], []))
    if not keep_until_exit:
        _give_back_freed_memory()
    return {"imported": len(ir) - (0 if whole else len(left_out)),
            "twins": 0 if whole else len(twins.of), "leaves": 0 if whole else len(leaves),
            "frontier": len(twins.frontier), "whole": whole}


def find_twins(ir: GraphIR) -> Twins:
    """The twins of the graph (see the module docstring) and their frontier.

    The replicas of one ``copy_nodes_many`` call share its first replica's plans, except
    where the later ones read the first's copies of first_only nodes: those plans are shared
    by the later replicas alone, and the first replica that has them represents the rest."""
    node_table, succ = ir.g._node, ir.g._succ
    changed = _changed_copies(ir)
    twins, firsts, seconds, unchanged, indices = Twins(), {}, {}, {}, {}
    for replica in ir.replicas():
        first = firsts.setdefault(id(replica.bases), replica)
        if id(first) not in indices:
            indices[id(first)] = {plan[0]: k for k, plan in enumerate(first.plans)}
        unchanged[id(replica)] = _unchanged(_present(node_table, replica),
                                            changed[id(replica)], indices[id(first)])
        second = seconds.setdefault(id(replica.plans), replica)
        if first is replica:
            continue
        mine, theirs = unchanged[id(replica)], unchanged[id(first)]
        alike = list(map(operator.and_, mine, theirs))
        otherwise = replica.planned_otherwise(first)
        for k in otherwise:  # represented by the first replica with these plans
            alike[k] = second is not replica and mine[k] and unchanged[id(second)][k]
        found = dict(zip(itertools.compress(replica.names, alike),
                         itertools.compress(first.names, alike)))
        found.update((replica.names[k], second.names[k]) for k in otherwise if alike[k])
        if not found:
            continue
        twins.of.update(found)
        reps = dict.fromkeys(otherwise, second)
        for k in itertools.compress(range(len(alike)), map(operator.not_, alike)):
            name = replica.names[k]
            if node_table.get(name) is replica.copies[k] is not None and _read_as_data(
                    succ[name], found):
                rep = reps.get(k, first)
                present = rep is not replica and node_table.get(rep.names[k]) is rep.copies[k]
                twins.frontier.append((name, rep.names[k] if present else None))
    return twins


def join_alike(ir: GraphIR, twins: Twins, leaves: dict) -> int:
    """Add to ``twins.of`` the nodes made or rewired per replica that TF sees as a node it
    imports: a pass's nodes per replica (all-reduce's buckets, drop-in-saver's assigns to
    each replica's variables) and copies rewired since made (an update that reads the reduced
    gradient). Such a node is *alike* a node R that stays imported when both have the same
    op, attrs and other NodeDef fields (``_same_fields``) and the same inputs as TF sees
    them, each at the same ports: the same node, or a twin or alike node and its
    representative. A node that reads no data is alike one with the same fields and control
    inputs (each replica's Const of one value). What TF's importer checks of the node then
    comes out as for R, by the module docstring's argument, so R is imported and stands for
    it; control inputs count too, so that what reads the node in the import waits on what the
    node waits on (no cycle the graph lacks). Nodes alike are found by one key per node
    (``_Alike.key``), a node's inputs decided before it. The frontier and what the leaves
    stand on (``find_leaves``) stay imported. Returns how many nodes were added."""
    alike = _Alike(ir, twins, leaves)
    alike.run()
    return len(alike.found)


class _Alike:
    """The search of ``join_alike``: every candidate decided once, its inputs first."""

    def __init__(self, ir: GraphIR, twins: Twins, leaves: dict):
        self.ir, self.of = ir, twins.of  # found nodes join twins.of as they are found
        self.kept = {name for pair in twins.frontier for name in pair if name is not None}
        self.kept.update(src for src, _, _ in leaves.values())
        self.leaves = leaves
        self.found = {}  # node -> the imported node it is alike
        self.by_key = {}  # key (see ``key``) -> the imported nodes with that key
        self.pending = set()  # candidates not decided yet

    def run(self) -> None:
        """Decide every candidate, the candidates it reads through data first (a cycle's
        are read undecided: as themselves)."""
        candidates = self.candidates()
        pending, pred, place = self.pending, self.ir.g._pred, self._place
        for name in candidates:
            if name not in pending:
                continue
            if pending.isdisjoint(pred[name]):  # most: reads no undecided candidate
                pending.discard(name)
                place(name)
                continue
            stack, opened = [name], set()
            while stack:
                top = stack[-1]
                if top not in pending:
                    stack.pop()
                    continue
                if top not in opened and not pending.isdisjoint(pred[top]):
                    opened.add(top)
                    stack.extend(src for src in pred[top]
                                 if src in pending and src not in opened)
                    continue
                stack.pop()
                pending.discard(top)
                place(top)

    def candidates(self) -> list[str]:
        """The passes' own nodes (not leaves) and the copies changed since made, which are
        no representatives of twins (those are unchanged), own nodes in graph order."""
        node_table, of, leaves = self.ir.g._node, self.of, self.leaves
        found = [name for name in self.ir._protos
                 if name not in of and name not in leaves
                 and type(node_table.get(name, BorrowedNode)) is not BorrowedNode]
        changed = set(self.ir._dirty)
        for replica in self.ir.replicas():
            changed.update(replica.mapping[orig] for orig in replica.touched)
        found += sorted(name for name in changed if type(node_table.get(name)) is BorrowedNode
                        and name not in of)
        self.pending = set(found)
        return found

    def _place(self, name: str) -> None:
        """``name`` is alike the first imported node with its key and fields, or imported."""
        key = self.key(name)
        others = self.by_key.get(key)
        if others is None:
            self.by_key[key] = [name]
            return
        if name not in self.kept:
            for other in others[:4]:  # more with one key and other fields: imported
                if _same_fields(self.ir, name, other):
                    self.found[name] = self.of[name] = other
                    return
        others.append(name)

    def key(self, name: str):
        """What TF sees ``name`` read: its op and, per input's key dict (which holds the
        ports, one dict shared by every pair of nodes joined alike; control inputs too, so
        that whatever reads the node in the import waits on what it waits on), the node as
        TF sees it; for a node that reads no data, its attrs too."""
        of_get = self.of.get
        op = self.ir.g._node[name]["op"]
        pred = self.ir.g._pred[name]
        read = frozenset([(of_get(src, src), id(keys)) for src, keys in pred.items()])
        if any(keys is not CONTROL_KEYS for keys in pred.values()):
            return op, read
        attr = _fields_of(self.ir, name).attr
        return op, read, tuple(sorted((key, value.SerializeToString(deterministic=True))
                                      for key, value in attr.items()))


# the NodeDef fields a node's emit writes of its own (the rest come from its NodeDef)
_WRITTEN_FIELDS = frozenset({"name", "op", "input", "device", "attr"})


def _same_fields(ir: GraphIR, name: str, other: str) -> bool:
    """Whether TF reads the same NodeDef fields but name, device and inputs for both nodes:
    op, attrs and any other field. A copy that borrows its original's NodeDef is read from
    the snapshot, which lacks a ``_class`` naming copied nodes: colocation is no concern of
    TF's importer here (its check is off; ``_check_colocation`` checks every node's)."""
    node_table = ir.g._node
    if node_table[name]["op"] != node_table[other]["op"]:
        return False
    mine, theirs = _fields_of(ir, name), _fields_of(ir, other)
    if mine is theirs:
        return True
    if not _same_attrs(mine.attr, theirs.attr):
        return False
    return all(getattr(mine, field) == getattr(theirs, field) for field in _other_fields()
               if mine.HasField(field) or theirs.HasField(field))  # reading one makes it


@functools.cache
def _other_fields() -> tuple[str, ...]:
    """The NodeDef fields besides those emit writes of each node's own (debug info, full
    type)."""
    from tensorflow.core.framework import node_def_pb2
    return tuple(field.name for field in node_def_pb2.NodeDef.DESCRIPTOR.fields
                 if field.name not in _WRITTEN_FIELDS)


def _same_attrs(mine, theirs) -> bool:
    """Whether two attr maps hold the same values (``==`` on the maps goes through Python's
    generic Mapping comparison, several times slower)."""
    if len(mine) != len(theirs):
        return False
    for key in mine:
        if key not in theirs or theirs[key] != mine[key]:
            return False
    return True


def _fields_of(ir: GraphIR, name: str):
    """The NodeDef that holds ``name``'s attrs and other fields: its own, or the snapshot a
    copy borrows."""
    data = ir.g._node[name]
    if type(data) is BorrowedNode:
        return data._proto if data._proto is not None else data._plan[1]
    return ir._protos[name]


# ops whose acceptance TF decides from their attrs and their data inputs' dtypes alone, with the
# attrs they may have (no "_output_shapes", which TF checks against the shapes it infers): an
# Identity's T must be its input's dtype; a NoOp reads no data
_LEAF_ATTRS = {"Identity": {"T", "_class"}, "NoOp": {"_class"}}
# a node name TF's importer accepts (stricter than TF: a name it fails is simply imported)
_PLAIN_NAME = re.compile(r"[A-Za-z0-9.][A-Za-z0-9_./-]*")


def find_leaves(ir: GraphIR, twins: dict) -> dict:
    """The leaves the import can leave out: nodes of their own (not copies) that no node reads
    through a data edge, each an Identity reading one tensor or a NoOp that only waits
    (merge-fetches serves every name of the input graph so, ten thousand of them). Given its
    input's dtype, TF's importer can say nothing else of such a node: its name is plain, its
    other inputs are control edges to nodes the structural checks have found, its device and
    colocation are checked with every node's. A NoOp counts only when nothing waits on it.
    Returns leaf -> (the node standing in for it, which its control consumers wait on instead:
    its input's representative (a NoOp: itself); the port it reads; the dtype its T names, or
    None)."""
    node_table, protos, pred, succ = ir.g._node, ir._protos, ir.g._pred, ir.g._succ
    leaves = {}
    for name, proto in protos.items():  # the nodes of their own
        data = node_table.get(name)
        if data is None or type(data) is BorrowedNode:
            continue
        allowed = _LEAF_ATTRS.get(data["op"])
        if allowed is None:
            continue
        attr = proto.attr
        if not allowed.issuperset(attr) or not _PLAIN_NAME.fullmatch(name):
            continue
        if data["op"] == "NoOp":
            if succ[name] or any(map(operator.is_not, pred[name].values(),
                                     itertools.repeat(CONTROL_KEYS))):
                continue  # waited on (it stands for its inputs), or reads data: imported
            leaves[name] = (name, -1, None)
            continue
        sources = [(src, keys) for src, keys in data_pairs(pred[name])
                   if keys is not CONTROL_KEYS]
        if (len(sources) == 1 and list(sources[0][1]) == [0] and "T" in attr
                and attr["T"].WhichOneof("value") == "type"
                and not _read_as_data(succ[name], node_table)):
            src = sources[0][0]
            leaves[name] = (twins.get(src, src), sources[0][1][0]["src_port"], attr["T"].type)
    return leaves


def _check_leaves(leaves: dict, dtypes: dict) -> None:
    """Each Identity leaf's T is the dtype TF gives its input (``dtypes``: (node, port) ->
    TF's dtype, a ref type for a ref variable's output, which an Identity takes as its base
    type), as TF's importer requires."""
    from tensorflow.python.framework import dtypes as tf_dtypes
    for name, (src, port, wanted) in sorted(leaves.items()):
        if wanted is None:
            continue
        found = dtypes[(src, port)]
        if (found - 100 if found > 100 else found) != wanted:
            raise GraphxformError(
                f"TensorFlow rejects the graph: node '{name}' (Identity) expects "
                f"{tf_dtypes.as_dtype(wanted).name} but reads {src}:{port}, which is "
                f"{tf_dtypes.as_dtype(found).name}")


def _unchanged(present: list, changed: set, index: dict) -> list[bool]:
    """Per original: whether a replica's copy of it is there and unchanged since made."""
    flags = list(present)
    for orig in changed:
        flags[index[orig]] = False
    return flags


def _present(node_table: dict, replica) -> list[bool]:
    """Per original: whether ``replica``'s copy of it was made and is still in the graph."""
    return list(map(operator.and_,
                    map(operator.is_, map(node_table.get, replica.names), replica.copies),
                    map(operator.is_not, replica.copies, itertools.repeat(None))))


def _changed_copies(ir: GraphIR) -> dict:
    """id(Replica) -> the originals whose copy changed in place or has in-edges of its own."""
    changed = {id(replica): set(replica.touched) for replica in ir.replicas()}
    node_table = ir.g._node
    for name in ir._dirty:
        data = node_table.get(name)
        if type(data) is BorrowedNode:
            changed[id(data._replica)].add(data._plan[0])
    return changed


def _read_as_data(consumers: dict, among: dict) -> bool:
    """Whether a node of ``among`` reads the node whose consumers are ``consumers`` through a
    data edge."""
    return any(dst in among and keys is not CONTROL_KEYS and any(key >= 0 for key in keys)
               for dst, keys in consumers.items())


def _node_fields(ir: GraphIR, left_out: dict | None) -> list:
    """The GraphDef node fields emit writes, without ``left_out`` (see wire.NodeEncoder)."""
    from graphxform.metagraph import PROVENANCE_ATTR
    return wire.NodeEncoder(ir, PROVENANCE_ATTR).nodes(left_out)


class _Imported:
    """A graph TF's C importer made, with the operations and the outputs' dtypes asked for."""

    def __init__(self, graph, operations: list, outputs: list):
        self.graph, self.operations, self.outputs = graph, operations, outputs

    def close(self) -> None:
        """Free the graph now: the op wrappers made for the frontier and the graph refer to
        each other, which the garbage collector (paused here) would free only later."""
        from tensorflow.python.framework import ops
        ops.dismantle_graph(self.graph)
        self.graph = self.operations = None


def _import(ir: GraphIR, nodes: list, wanted: list, read: list) -> _Imported:
    """Import the GraphDef of ``nodes`` (node fields) and ``ir``'s library and versions into a
    new graph with TF's C importer; raise naming what TF rejects. The result holds the
    operations named in ``wanted`` and the dtypes of the (node, port) outputs in ``read``."""
    from tensorflow.python.client import pywrap_tf_session as c_api
    from tensorflow.python.framework import ops
    from tensorflow.python.framework.errors_impl import OpError
    data = b"".join(nodes) + ir.meta.graph_def.SerializeToString()
    nodes.clear()  # TF keeps its own copy of the bytes: none of ours need stay
    graph = ops.Graph()
    options = c_api.TF_NewImportGraphDefOptions()
    buffer = c_api.TF_NewBufferFromString(data)
    del data
    try:
        c_api.TF_ImportGraphDefOptionsSetValidateColocationConstraints(options, False)
        for name in wanted:
            c_api.TF_ImportGraphDefOptionsAddReturnOperation(options, name)
        for name, port in read:
            c_api.TF_ImportGraphDefOptionsAddReturnOutput(options, name, port)
        results = c_api.TF_GraphImportGraphDefWithResults(graph, buffer, options)
        try:
            operations = c_api.TF_ImportGraphDefResultsReturnOperations(results)
            outputs = c_api.TF_ImportGraphDefResultsReturnOutputs(results)
        finally:
            c_api.TF_DeleteImportGraphDefResults(results)
    except OpError as e:
        raise GraphxformError(f"TensorFlow rejects the graph: {tf_error_line(e)}") from None
    finally:
        c_api.TF_DeleteBuffer(buffer)
        c_api.TF_DeleteImportGraphDefOptions(options)
    return _Imported(graph, operations, [int(c_api.TF_OperationOutputType(output))
                                         for output in outputs])


def _give_back_freed_memory() -> None:
    """Return to the system the heap the imported graph used. glibc keeps freed heap for
    later small allocations, but the large buffers emit makes next are mapped afresh, so
    without this the freed graph would still count in the command's peak memory."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _first_line(text: str) -> str:
    return (str(text).strip().splitlines() or [""])[0]


def _frontier_agrees(imported: _Imported, pairs: int) -> bool:
    """Whether each frontier node (even positions of ``imported.operations``) looks to TF as
    its counterpart (the odd ones) does: per output, dtype, shape, resource handle data and
    constant value."""
    operations = imported.operations
    return all(_outputs(imported.graph, operations[2 * k]) ==
               _outputs(imported.graph, operations[2 * k + 1]) for k in range(pairs))


def _outputs(graph, c_op) -> list:
    """What TF inferred for each output of ``c_op``, comparably."""
    from tensorflow.python.client import pywrap_tf_session as c_api
    from tensorflow.python.framework import c_api_util, ops
    op = ops.Operation._from_c_op(c_op=c_op, g=graph)
    found = []
    for port, tensor in enumerate(op.outputs):
        output = c_api_util.tf_output(c_op, port)
        try:
            value = c_api.TF_TryEvaluateConstant_wrapper(graph, output)
        except Exception:  # noqa: BLE001 - TF could not fold it: no constant to compare
            value = None
        found.append((int(c_api.TF_OperationOutputType(output)),
                      None if tensor.shape.rank is None else tensor.shape.as_list(),
                      c_api.GetHandleShapeAndType(graph, output), _comparable(value)))
    return found


def _comparable(value):
    """A folded constant as something ``==`` compares by value: an array of numbers by its
    bytes; strings (a scalar comes back as bytes, an array of them holds objects) as lists."""
    import numpy as np
    if value is None:
        return None
    if isinstance(value, np.ndarray) and value.dtype != object:
        return value.dtype.str, value.shape, value.tobytes()
    return "strings", np.shape(value), np.asarray(value, dtype=object).tolist()


def _check_devices(devices) -> None:
    """Every device string parses, as TF's Python importer requires."""
    from tensorflow.python.framework import device_spec
    for device in sorted(d for d in devices if d):
        try:
            device_spec.DeviceSpecV2.from_string(device)
        except (ValueError, TypeError) as e:
            raise GraphxformError(f"TensorFlow rejects the graph: device '{clip(device)}': "
                                  f"{clip(_first_line(e))}") from None


def _check_colocation(ir: GraphIR) -> None:
    """Every ``loc:@X`` in a ``_class`` attr names a node of the graph, as TF's importer
    requires (its own check would see only the nodes imported). A copy that nothing changed
    colocates with what its plan says: targets kept as they are, the same for every replica,
    and copied ones under the replica's prefix; those are checked a replica at a time."""
    node_table = ir.g._node
    for name, proto in ir._protos.items():
        if "_class" in proto.attr:
            _colocated(node_table, [name], _targets(proto.attr["_class"].list.s))
    by_plans = {}  # id(plans) -> (the originals with a _class by index, and their targets)
    by_plan = {}  # id(plan) -> its targets, or None without a _class
    for replica in ir.replicas():
        plans, names, copies = replica.plans, replica.names, replica.copies
        touched = replica.touched
        if id(plans) not in by_plans:
            by_plans[id(plans)] = _plans_targets(plans, by_plan)
        colocated, kept, copied = by_plans[id(plans)]
        present = [k for k in colocated
                   if copies[k] is not None and node_table.get(names[k]) is copies[k]]
        own = {k for k in present if plans[k][0] in touched and copies[k]._proto is not None}
        for k in own:  # changed in place, with its own NodeDef
            attr = copies[k]._proto.attr
            _colocated(node_table, [names[k]],
                       _targets(attr["_class"].list.s) if "_class" in attr else [])
        rest = [k for k in present if k not in own] if own else present
        _colocated(node_table, [names[k] for k in rest],
                   [target for k in rest for target in kept[k]])
        _colocated(node_table, [names[k] for k in rest],
                   [replica.prefix + node for k in rest for node in copied[k]])


def _check_collections(ir: GraphIR) -> None:
    """Every name a collection holds resolves as ``import_meta_graph`` resolves it: a node
    list's values are ops or existing output ports; a variable collection's VariableDefs name
    a variable op, and existing initializer, snapshot and initial value; a queue runner's
    names are ops. (TF's C importer, which ``check`` runs, never reads collections.)"""
    from tensorflow.core.framework import variable_pb2
    from tensorflow.core.protobuf import queue_runner_pb2

    from graphxform.training import VARIABLE_DEF_COLLECTIONS, VARIABLE_OPS
    node_table = ir.g._node
    outputs_of = _OutputCounts(ir)

    def resolve(key: str, name: str, variable: bool = False) -> None:
        node, _, port = name.partition(":")
        data = node_table.get(node)
        problem = None
        if data is None:
            problem = "no such node"
        elif variable and data["op"] not in VARIABLE_OPS:
            problem = f"its op is {data['op']}, not a variable op"
        elif port and (not port.isdigit() or int(port) >= (outputs_of(node) or 0)):
            problem = f"{data['op']} has no output {port}"
        if problem:
            raise GraphxformError(f"TensorFlow rejects the graph: collection '{clip(key)}' "
                                  f"names '{clip(name)}' ({problem}); import_meta_graph would "
                                  "fail")

    resolved = set()  # VariableDefs already resolved (trainable_variables repeats variables')
    for key, col in sorted(ir.meta.collection_def.items()):
        if col.HasField("node_list"):
            for value in col.node_list.value:
                resolve(key, value)
        elif key in VARIABLE_DEF_COLLECTIONS and col.HasField("bytes_list"):
            for raw in col.bytes_list.value:
                if raw in resolved:  # the same bytes resolve the same
                    continue
                resolved.add(raw)
                vd = variable_pb2.VariableDef.FromString(raw)
                resolve(key, vd.variable_name, variable=True)
                for name in (vd.initializer_name, vd.snapshot_name, vd.initial_value_name):
                    if name:
                        resolve(key, name)
        elif key == "queue_runners" and col.HasField("bytes_list"):
            for raw in col.bytes_list.value:
                runner = queue_runner_pb2.QueueRunnerDef.FromString(raw)
                for name in [runner.queue_name, *runner.enqueue_op_name,
                             runner.close_op_name, runner.cancel_op_name]:
                    if name:
                        resolve(key, name)


class _OutputCounts:
    """``opdefs.num_outputs(ir, node)``, read once per op type where the OpDef fixes the
    count (most ops), once per node where attrs decide it."""

    def __init__(self, ir: GraphIR):
        self.ir, self.by_op = ir, {}

    def __call__(self, node: str) -> int | None:
        from graphxform import opdefs
        op = self.ir.g._node[node]["op"]
        count = self.by_op.get(op, _PER_NODE)
        if count is _PER_NODE and op not in self.by_op:
            found = opdefs.op_def(self.ir, op)
            varies = found is None or any(arg.number_attr or arg.type_list_attr
                                          for arg in found.output_arg)
            count = self.by_op[op] = _PER_NODE if varies else len(found.output_arg)
        return opdefs.num_outputs(self.ir, node) if count is _PER_NODE else count


_PER_NODE = object()


def _plans_targets(plans: list, by_plan: dict) -> tuple[list, dict, dict]:
    """The indices of the plans whose copies have a ``_class``, and per index its targets
    kept as they are and its copied targets (see ``_plan_targets``); ``by_plan`` keeps what
    each plan gave (the plans lists of one call share most plans)."""
    colocated, kept, copied = [], {}, {}
    for k, plan in enumerate(plans):
        found = by_plan.get(id(plan), ())
        if found == ():
            has_class = plan[3] or "_class" in plan[1].attr
            found = by_plan[id(plan)] = _plan_targets(plan) if has_class else None
        if found is not None:
            colocated.append(k)
            kept[k], copied[k] = found
    return colocated, kept, copied


def _plan_targets(plan: tuple) -> tuple[list[str], list[str]]:
    """A copy plan's colocation targets: those every copy keeps, and the copied nodes whose
    copy in the same replica it colocates with."""
    snapshot, colocation = plan[1], plan[3] or []
    kept = _targets(snapshot.attr["_class"].list.s) if "_class" in snapshot.attr else []
    kept += _targets([item for item, node in colocation if node is None])
    return kept, [node.decode() for _, node in colocation if node is not None]


def _targets(items) -> list[str]:
    return [item[5:].decode(errors="replace") for item in items if item.startswith(b"loc:@")]


def _colocated(node_table: dict, holders: list[str], targets: list[str]) -> None:
    """Raise if a target (of one of ``holders``) is not a node of the graph."""
    missing = next(itertools.filterfalse(node_table.__contains__, targets), None)
    if missing is not None:
        raise GraphxformError(f"TensorFlow rejects the graph: {_holder(holders)} colocated "
                              f"with '{clip(missing)}', which is not in the graph")


def _holder(holders: list[str]) -> str:
    if len(holders) == 1:
        return f"node '{holders[0]}' is"
    return f"one of {len(holders)} nodes ('{holders[0]}', ...) is"
