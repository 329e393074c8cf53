"""Emit a GraphIR's nodes straight in protobuf's wire format.

Emitting is the one step every command pays on the full output graph, which after replication
is mostly copies. Building and serializing a NodeDef message per copy costs as much as the
whole protobuf floor; here the copies that nothing changed since they were made are written a
replica at a time from one block of bytes per ``copy_nodes_many`` call: each original's copy
serialized once, with stand-ins (sentinels) where the replica's name prefix and device go,
which joining and one ``bytes.replace`` fill for each replica. Every other node is its NodeDef
serialized. The pass that created a node follows the node's other fields as an attr map entry;
protobuf takes fields in any order, and attr map entries have no order anyway.

Field numbers used: NodeDef name=1 input=3 device=4 attr=5 (a map: entries key=1 value=2);
AttrValue list=1 s=2; AttrValue.ListValue s=2; GraphDef node=1.
"""

from __future__ import annotations

import itertools
import operator

from graphxform.ir import BorrowedNode, GraphIR, colocation_items, parse_tensor, renamed_inputs

_VARINTS = [bytes([n]) for n in range(128)]


def varint(n: int) -> bytes:
    if n < 128:
        return _VARINTS[n]
    out = bytearray()
    while n > 127:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field(tag: bytes, payload: bytes) -> bytes:
    """One length-delimited field: its tag byte, the length, the payload."""
    return tag + varint(len(payload)) + payload


ATTR = b"\x2a"
GRAPH_NODE = b"\x0a"


def string_attr(key: str, value: bytes) -> bytes:
    """A NodeDef ``attr`` map entry (field 5): ``key`` -> AttrValue{s: value}."""
    return field(ATTR, field(b"\x0a", key.encode()) + field(b"\x12", field(b"\x12", value)))


def node_field(body: bytes, tail: bytes = b"") -> bytes:
    """A GraphDef ``node`` field holding the NodeDef bytes ``body + tail``."""
    size = len(body) + len(tail)
    return b"".join((GRAPH_NODE, _VARINTS[size] if size < 128 else varint(size), body, tail))


# Stand-ins for a replica's prefix and device in a block: UTF-8 strings (names and devices are
# proto3 strings) of ASCII control characters no node name or device holds. Each stand-in's
# first character occurs nowhere else in either, so no two occurrences can overlap and a count
# finds every place one occurs.
_PREFIX_FIRST, _PREFIX_REST = "\x7f", "\x1c"
_DEVICE_FIRST, _DEVICE_REST = "\x1f", "\x1e"
_STAND_IN_BYTES = frozenset(b"\x7f\x1c\x1f\x1e")


def _stand_in(first: str, rest: str, length: int) -> str:
    return first + rest * (length - 1) if length else ""


class NodeEncoder:
    """Writes each node of ``ir`` as a GraphDef ``node`` field (tag, length, NodeDef bytes).

    A loaded or created node is its NodeDef serialized, after bringing the NodeDef up to date
    with the node data (op, device, and the input list of a node whose in-edges changed): the
    NodeDef is the IR's cache of the node, so this changes nothing the IR means.

    Copies are written a replica at a time (see ``_replica``), at the place of the replica's
    first copy: a replica's copies sit together in graph order, since they were added together
    and nodes added later go to the end."""

    def __init__(self, ir: GraphIR, provenance_attr: str):
        self.ir = ir
        self.provenance_attr = provenance_attr
        self._marks = {"": b"", None: b""}  # created_by -> its provenance attr entry
        # Blocks hold only what never changes once copies are made (their plans, their
        # bases), so they serve every later emit of the IR (the TF import check, then save);
        # the IR keeps its Replicas, so the ids in the keys stay theirs.
        blocks, made = ir._emit_cache.setdefault(provenance_attr, ({}, {}))
        self._blocks = blocks  # (id(plans), prefix length, device length) -> see _block
        self._made = made  # (id(bases), prefix and device lengths, ...) -> see _parts

    def nodes(self, left_out: dict | None = None) -> list:
        """The node fields in graph order (bytes-like), ready to join.

        ``left_out`` (name -> name): write none of its nodes, and where a node reads one, have
        it read the node it maps to instead (the TF import check leaves out copies TF sees as
        their representatives: graphxform/import_check.py). A replica with copies left out,
        or whose copies read one, is written a copy at a time."""
        ir, out = self.ir, []
        node_table, protos, dirty, pred = ir.g._node, ir._protos, ir._dirty, ir.g._pred
        for name in dirty:  # copies whose in-edges changed are written on their own
            data = node_table.get(name)
            if type(data) is BorrowedNode:
                data._touched()
        gone = (left_out or {}).keys()
        small = _VARINTS
        append = out.append
        written = done = None  # the replica written last, and all written so far
        for name, data in node_table.items():
            if type(data) is BorrowedNode:
                if data._replica is not written:
                    written, done = data._replica, done or set()
                    if id(written) not in done:  # its copies are together unless moved
                        done.add(id(written))
                        self._replica(written, out, left_out)
                continue
            if not gone:
                body = self._own(name, protos[name], data, dirty)
            elif name in gone:
                continue
            elif gone.isdisjoint(pred[name]):
                body = self._own(name, protos[name], data, dirty)
            else:
                body = self._swapped(name, data, left_out)
            size = len(body)
            append(GRAPH_NODE)
            append(small[size] if size < 128 else varint(size))
            append(body)
        return out

    def _replica(self, replica, out: list, left_out: dict | None = None) -> None:
        """Append the node fields of every copy ``replica`` still has, in order: runs of
        copies that nothing changed since they were made as slices of the replica's block,
        the others (``replica.touched``) one by one. See ``nodes`` for ``left_out``."""
        node_table, names, copies = self.ir.g._node, replica.names, replica.copies
        gone = (left_out or {}).keys()
        if gone and not (gone.isdisjoint(replica.outside) and gone.isdisjoint(names)):
            kept = itertools.compress(range(len(names)),
                                      map(operator.not_, map(gone.__contains__, names)))
            for k in kept:
                name, copy = names[k], copies[k]
                if copy is not None and node_table.get(name) is copy:
                    out.append(node_field(self._swapped(name, copy, left_out)))
            return
        block = self._block(replica)
        if block is None:
            for name, copy in zip(names, copies):
                if copy is not None and node_table.get(name) is copy:
                    out.append(node_field(self._alone(name, copy, left_out)))
            return
        segments, starts, device_stand_in, index = block
        filled = replica.prefix.encode().join(segments)
        if device_stand_in:
            filled = filled.replace(device_stand_in, replica.device.encode())
        view, start = memoryview(filled), 0
        for k in sorted(map(index.__getitem__, replica.touched)):
            if starts[k] > starts[start]:
                out.append(view[starts[start]:starts[k]])
            if copies[k] is not None and node_table.get(names[k]) is copies[k]:
                out.append(node_field(self._alone(names[k], copies[k], left_out)))
            start = k + 1
        if starts[-1] > starts[start]:
            out.append(view[starts[start]:])

    def _alone(self, name, copy, left_out: dict | None) -> bytes:
        """A changed copy's NodeDef bytes, written on its own (reading no node left out)."""
        if left_out and not left_out.keys().isdisjoint(self.ir.g._pred[name]):
            return self._swapped(name, copy, left_out)
        return self._copy(name, copy)

    def _block(self, replica) -> tuple | None:
        """Every copy of ``replica`` as made, in order, as one bytes object with stand-ins of
        the same lengths where the prefix and the device go, so that filling them in keeps
        every offset: (the bytes split at the prefix stand-ins, where each copy starts, the
        device stand-in or b"", each original's index). Shared by every replica of one
        ``copy_nodes_many`` call with the same prefix and device lengths (all of them, up to
        ten replicas). None when the replica's prefix or device holds a stand-in's character,
        or the stand-ins occur in the bytes elsewhere too (a tensor may hold anything): then
        each copy is written on its own."""
        fixed = replica.device
        prefix = replica.prefix.encode()
        device = b"" if fixed is None else fixed.encode()
        if not prefix or not _STAND_IN_BYTES.isdisjoint(prefix + device):
            return None
        key = (id(replica.plans), len(prefix), len(device))
        if key in self._blocks:
            return self._blocks[key]
        prefix_stand_in = _stand_in(_PREFIX_FIRST, _PREFIX_REST, len(prefix))
        device_stand_in = _stand_in(_DEVICE_FIRST, _DEVICE_REST, len(device))
        parts, holes = self._parts(replica, prefix_stand_in, device_stand_in)
        starts = [0, *itertools.accumulate(map(len, parts))]
        template = b"".join(parts)
        segments = template.split(prefix_stand_in.encode())
        exact = len(segments) - 1 == sum(holes) and (
            not device or template.count(device_stand_in.encode()) == len(parts) - parts.count(b""))
        index = {plan[0]: k for k, plan in enumerate(replica.plans)}
        block = self._blocks[key] = ((segments, starts, device_stand_in.encode(), index)
                                     if exact else None)
        return block

    def _parts(self, replica, prefix_stand_in: str, device_stand_in: str) -> tuple:
        """Each original's copy in a block, with the stand-ins, and how many prefix stand-ins
        each holds. The replicas of one call that leave out sync-init's first_only nodes have
        plans of their own for the few originals that read those, and share the rest: their
        parts are the first block's, remade where the plans differ, and empty for the copies
        they do not make."""
        key = (id(replica.bases), len(prefix_stand_in), len(device_stand_in),
               replica.device is None)
        made = self._made.get(key)
        if made is None:
            redo = range(len(replica.plans))
            parts, holes = [None] * len(redo), [0] * len(redo)
        else:
            plans, parts, holes = made
            redo = [k for k, (mine, theirs, copy) in enumerate(zip(replica.plans, plans,
                                                                    replica.copies))
                    if mine is not theirs or copy is None]
            parts, holes = list(parts), list(holes)
        fixed, mapping, mark = replica.device, replica.mapping, self._mark
        whole = True  # every copy made: the parts may serve other replicas of the call
        for k in redo:
            if replica.copies[k] is None:  # not made for these replicas (see without)
                parts[k], holes[k], whole = b"", 0, False
                continue
            plan, base = replica.plans[k], replica.bases[k]
            body = copy_bytes(plan, prefix_stand_in,
                              base["device"] if fixed is None else device_stand_in, mapping)
            parts[k] = node_field(body, mark(base["created_by"]))
            holes[k] = _holes(plan, mapping)
        if made is None and whole:
            self._made[key] = (replica.plans, parts, holes)
        return parts, holes

    def _copy(self, name, copy) -> bytes:
        """One copy's NodeDef bytes, written on its own: its own NodeDef once it has one;
        otherwise one made for the moment, with its inputs from its edges once they changed."""
        if copy._proto is not None:
            return self._own(name, copy._proto, copy, self.ir._dirty)
        plan, dirty = copy._plan, name in self.ir._dirty
        if copy["op"] == plan[1].op and (plan[2] is not None or not dirty):
            replica = copy._replica
            inputs = self.ir.edge_inputs(name) if dirty else None
            return copy_bytes(plan, replica.prefix, dict.__getitem__(copy, "device"),
                              replica.mapping, inputs) + self._mark(copy["created_by"])
        proto = copy.fill(type(copy._plan[1])())
        proto.op = copy["op"]
        if name in self.ir._dirty:
            del proto.input[:]
            proto.input.extend(self.ir.edge_inputs(name))
        return proto.SerializeToString() + self._mark(copy["created_by"])

    def _own(self, name, proto, data, dirty) -> bytes:
        if proto.op != data["op"]:
            proto.op = data["op"]
        if proto.device != data["device"]:
            proto.device = data["device"]
        if name in dirty:
            del proto.input[:]
            proto.input.extend(self.ir.edge_inputs(name))
            dirty.discard(name)
        return proto.SerializeToString() + self._mark(data["created_by"])

    def _swapped(self, name, data, left_out: dict) -> bytes:
        """The NodeDef bytes of ``name`` with each input whose node is in ``left_out`` naming
        the node it maps to instead (a control input once)."""
        swapped, controls = [], set()
        for text in self._inputs(name, data):
            if text[0] == "^":
                text = "^" + left_out.get(text[1:], text[1:])
                if text in controls:
                    continue
                controls.add(text)
            else:
                node = parse_tensor(text)[0]
                if node in left_out:
                    text = left_out[node] + text[len(node):]
            swapped.append(text)
        mark = self._mark(data["created_by"])
        if type(data) is BorrowedNode and data._proto is None:
            plan = data._plan
            if data["op"] == plan[1].op and plan[2] is not None:  # the snapshot has no inputs
                replica = data._replica
                return copy_bytes(plan, replica.prefix, dict.__getitem__(data, "device"),
                                  replica.mapping, swapped) + mark
            proto = data.fill(type(plan[1])())  # a NodeDef for the moment
        else:
            proto = self._node_def(name, data)
        if proto.op != data["op"]:
            proto.op = data["op"]
        if proto.device != data["device"]:
            proto.device = data["device"]
        kept = list(proto.input)  # the NodeDef is the node's: lend it the swapped inputs
        del proto.input[:]
        proto.input.extend(swapped)
        try:
            return proto.SerializeToString() + mark
        finally:
            del proto.input[:]
            proto.input.extend(kept)

    def _inputs(self, name, data) -> list[str]:
        """``name``'s input list as emit writes it."""
        if name in self.ir._dirty:
            return self.ir.edge_inputs(name)
        if type(data) is BorrowedNode and data._proto is None:
            plan, replica = data._plan, data._replica
            texts = plan[2]
            return renamed_inputs(texts, plan[4], replica.mapping, replica.prefix) if texts else []
        return list(self._node_def(name, data).input)

    def _node_def(self, name, data):
        if type(data) is BorrowedNode:
            return data._proto
        return self.ir._protos[name]

    def _mark(self, created_by) -> bytes:
        mark = self._marks.get(created_by)
        if mark is None:
            mark = self._marks[created_by] = string_attr(self.provenance_attr,
                                                         created_by.encode())
        return mark


NAME, INPUT, DEVICE = b"\x0a", b"\x1a", b"\x22"


def copy_bytes(plan: tuple, prefix: str, device: str, copied, inputs=None) -> bytes:
    """The NodeDef bytes of the copy of ``plan``'s original named ``prefix + name`` on
    ``device`` (what ``copy_node_def`` makes, serialized), written around the snapshot's own
    bytes rather than by copying the snapshot into a new NodeDef: its name, the snapshot (op,
    attrs and the rest; it holds no name, device or clean input list), its inputs (renamed
    as ``copy_node_def`` does, or ``inputs`` as given), device and colocation. Protobuf takes
    fields in any order."""
    name, snapshot, texts, colocation, inputs_copied = plan
    small = _VARINTS
    head = (prefix + name).encode()
    out = [NAME, small[len(head)] if len(head) < 128 else varint(len(head)), head,
           snapshot.SerializeToString()]
    if inputs is None and texts:
        inputs = renamed_inputs(texts, inputs_copied, copied, prefix)
    if inputs:
        for raw in map(str.encode, inputs):
            out += (INPUT, small[len(raw)] if len(raw) < 128 else varint(len(raw)), raw)
    if device:
        out.append(field(DEVICE, device.encode()))
    if colocation:  # attr entry "_class" -> AttrValue{list: ListValue{s: items}}
        items = b"".join([field(b"\x12", item) for item in colocation_items(colocation, prefix)])
        out.append(field(ATTR, field(b"\x0a", b"_class") + field(b"\x12", field(b"\x0a", items))))
    return b"".join(out)


def _holes(plan: tuple, copied) -> int:
    """How many places a copy of ``plan``'s original puts its prefix: its name, its inputs that
    are copies too, its colocation targets that are."""
    _, _, texts, colocation, inputs_copied = plan
    count = 1 + (sum(1 for _, target in colocation if target is not None) if colocation else 0)
    if not texts:
        return count
    if inputs_copied:
        return count + len(texts)
    return count + sum(1 for text in texts
                       if (text[1:] if text[0] == "^" else parse_tensor(text)[0]) in copied)
