"""Emit a GraphIR's nodes straight in protobuf's wire format.

Emitting is the one step every command pays on the full output graph, which after replication
is mostly copies. Building a NodeDef message per node and serializing the lot costs two passes
over every field; here each copy is written as bytes in one go: its name, op, inputs and device,
then the rest of its original (attrs, debug info) as bytes serialized once per original and
shared by all its copies. Fields come in canonical order (name, op, input, device, attr, ...),
but for the provenance attr, which follows the rest; the order of attr map entries is free in
protobuf (``SerializeToString`` fixes none either).

Field numbers used: NodeDef name=1 op=2 input=3 device=4 attr=5 (a map: entries key=1 value=2);
AttrValue list=1 s=2; AttrValue.ListValue s=2; GraphDef node=1.
"""

from __future__ import annotations

from graphxform.ir import BorrowedNode, GraphIR, parse_tensor

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


NAME, OP, INPUT, DEVICE, ATTR = b"\x0a", b"\x12", b"\x1a", b"\x22", b"\x2a"
GRAPH_NODE = b"\x0a"


def string_attr(key: str, value: bytes) -> bytes:
    """A NodeDef ``attr`` map entry (field 5): ``key`` -> AttrValue{s: value}."""
    return field(ATTR, field(b"\x0a", key.encode()) + field(b"\x12", field(b"\x12", value)))


class NodeEncoder:
    """Writes each node of ``ir`` as a GraphDef ``node`` field (tag, length, NodeDef bytes).

    A loaded or created node is its NodeDef serialized, after bringing the NodeDef up to date
    with the node data (op, device, and the input list of a node whose in-edges changed): the
    NodeDef is the IR's cache of the node, so this changes nothing the IR means. A copy that
    still borrows its original's NodeDef is written from a template of its original (see
    ``_template``): the replica's name prefix joined into the template's name and inputs (or,
    once the copy's inputs or op changed, those written from its edges), its device, the
    original's other fields, its ``_class`` and its provenance."""

    def __init__(self, ir: GraphIR, provenance_attr: str):
        self.ir = ir
        self.provenance_attr = provenance_attr
        self._marks = {"": b"", None: b""}  # created_by -> its provenance attr entry
        self._devices = {"": b""}  # device -> its field
        self._templates = {}  # (id(plan), prefix length) -> see _template
        self._runs = {}  # (id(mapping), prefix length) -> {control-input run: its pieces}

    def nodes(self) -> list[bytes]:
        """The node fields in graph order, ready to join."""
        ir, out = self.ir, []
        protos, dirty = ir._protos, ir._dirty
        templates, devices, marks = self._templates, self._devices, self._marks
        small = _VARINTS
        append = out.append
        for name, data in ir.g._node.items():
            proto = protos[name]
            if type(proto) is not BorrowedNode:
                body = self._own(name, proto, data, dirty)
            elif proto._proto is not None:
                body = self._own(name, proto._proto, data, dirty)
            else:
                plan, replica = proto._plan, proto._replica
                prefix = replica[3]
                template = templates.get((id(plan), len(prefix)))
                if template is None:
                    template = self._template(plan, replica)
                op, head, rest, colocation = template
                if head is None or name in dirty or data["op"] != op:
                    head = self._head_from_edges(name, data)
                else:
                    head = prefix.join(head)
                device = data["device"]
                device_field = devices.get(device)
                if device_field is None:
                    device_field = devices[device] = field(DEVICE, device.encode())
                mark = marks.get(data["created_by"])
                if mark is None:
                    mark = self._mark(data["created_by"])
                body = b"".join((head, device_field, rest,
                                 prefix.join(colocation) if colocation else b"", mark))
            size = len(body)
            append(GRAPH_NODE)
            append(small[size] if size < 128 else varint(size))
            append(body)
        return out

    def _template(self, plan, replica) -> tuple:
        mapping, prefix_length = replica[0], len(replica[3])
        runs = self._runs.setdefault((id(mapping), prefix_length), {})
        template = self._templates[(id(plan), prefix_length)] = _template(
            plan, mapping, prefix_length, runs)
        return template

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

    def _head_from_edges(self, name, data) -> bytes:
        """Name, op and inputs of a borrowed copy whose inputs or op changed since it was
        made: its inputs come from its edges."""
        parts = [field(NAME, name.encode()), field(OP, data["op"].encode())]
        parts.extend([field(INPUT, text.encode()) for text in self.ir.edge_inputs(name)])
        return b"".join(parts)

    def _mark(self, created_by) -> bytes:
        mark = self._marks.get(created_by)
        if mark is None:
            mark = self._marks[created_by] = string_attr(self.provenance_attr,
                                                         created_by.encode())
        return mark


def _rest(snapshot) -> bytes:
    """The snapshot's fields other than name, op, input and device (attrs, debug info)."""
    rest = type(snapshot)()
    rest.CopyFrom(snapshot)
    for name in ("name", "op", "device"):
        rest.ClearField(name)
    del rest.input[:]
    return rest.SerializeToString()


PREFIX = object()  # where a template takes the replica's name prefix


def _template(plan, mapping: dict, prefix_length: int, runs: dict) -> tuple:
    """What every copy of one original shares, for prefixes of one length: (op, head, rest,
    colocation). ``head`` (name, op, inputs) and ``colocation`` (the ``_class`` entry, None
    when it names no copied node) are the pieces between the places where the copy's name
    prefix goes, so a copy's bytes are ``prefix.join(pieces)``: every length field depends only
    on the prefix length. ``rest`` is the original's other fields. ``head`` is None when the
    copies have no input list of their own (the original was rewired before it was copied).
    ``runs`` caches the pieces of long runs of control inputs, which TF's control_dependencies
    gives many ops alike (ResNet-50's gradient ops wait on the same 106 batch-norm updates)."""
    def length(pieces) -> bytes:
        return varint(sum(prefix_length if p is PREFIX else len(p) for p in pieces))

    original, snapshot, texts, colocation, _ = plan
    class_pieces = None
    if colocation:
        items = []
        for item, node in colocation:
            value = [item] if node is None else [b"loc:@", PREFIX, node]
            items += [b"\x12", length(value), *value]
        listed = [b"\x0a", length(items), *items]
        entry = [field(b"\x0a", b"_class"), b"\x12", length(listed), *listed]
        class_pieces = _Holes.split([ATTR, length(entry), *entry])
    if texts is None:
        return snapshot.op, None, _rest(snapshot), class_pieces
    name = original.encode()
    head = _Holes()
    head.add(NAME + varint(prefix_length + len(name)))
    head.hole()
    head.add(name + field(OP, snapshot.op.encode()))
    controls = next((k for k, text in enumerate(texts) if text[0] == "^"), len(texts))
    for text in texts[:controls]:
        _add_input(head, text, mapping, prefix_length)
    if len(texts) - controls >= _RUN:
        key = tuple(texts[controls:])
        run = runs.get(key)
        if run is None:
            run = _Holes()
            for text in key:
                _add_input(run, text, mapping, prefix_length)
            run = runs[key] = run.segments()
        head.extend(run)
    else:
        for text in texts[controls:]:
            _add_input(head, text, mapping, prefix_length)
    return snapshot.op, head.segments(), _rest(snapshot), class_pieces


_RUN = 8  # control-input runs at least this long are cached


def _add_input(out: "_Holes", text: str, mapping: dict, prefix_length: int) -> None:
    """One input field; an input that is a copy too is prefix + its name (after any caret)."""
    caret = text[0] == "^"
    source = text[1:] if caret else parse_tensor(text)[0]
    encoded = text.encode()
    if source not in mapping:
        out.add(field(INPUT, encoded))
        return
    out.add(INPUT + varint(prefix_length + len(encoded)) + (b"^" if caret else b""))
    out.hole()
    out.add(encoded[1:] if caret else encoded)


class _Holes:
    """Bytes with holes where a prefix goes, built left to right: ``segments()`` are the bytes
    between the holes."""

    def __init__(self):
        self.done, self.current = [], []

    def add(self, data: bytes) -> None:
        self.current.append(data)

    def hole(self) -> None:
        self.done.append(b"".join(self.current))
        self.current = []

    def extend(self, segments: list[bytes]) -> None:
        """Append bytes given as their own segments (holes between them)."""
        self.current.append(segments[0])
        if len(segments) > 1:
            self.hole()
            self.done.extend(segments[1:-1])
            self.current = [segments[-1]]

    def segments(self) -> list[bytes]:
        return [*self.done, b"".join(self.current)]

    @classmethod
    def split(cls, pieces: list) -> list[bytes]:
        """[a, b, PREFIX, c, PREFIX, d] -> [a+b, c, d]."""
        holes = cls()
        for piece in pieces:
            if piece is PREFIX:
                holes.hole()
            else:
                holes.add(piece)
        return holes.segments()
