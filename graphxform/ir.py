"""GraphIR: a TF graph as a networkx.MultiDiGraph, plus the rest of its MetaGraph.

Node key = node name. Node data: ``op``, ``device``, ``attr`` (the NodeDef's AttrValue map, kept
as protos), ``origin`` (name in the loaded graph, None for created nodes) and ``created_by`` (the
pass that made it, None for loaded nodes). A data edge carries ``src_port``/``dst_port``; a control
edge carries ``control=True``. Passes change the graph only through the methods below. Edge
attribute dicts are never changed in place (rewiring replaces edges), so copies share them.
"""

from __future__ import annotations

import gc
import itertools
from typing import Callable, Iterable, Iterator

import networkx as nx

from graphxform.errors import GraphxformError

CONTROL_KEY = -1  # edge key of a control edge; data edges are keyed by their dst_port


def parse_tensor(name: str) -> tuple[str, int]:
    """'a:1' -> ('a', 1); 'a' -> ('a', 0). Control inputs ('^a') are not tensors."""
    node, sep, port = name.rpartition(":")
    if sep and port.isdigit():
        return node, int(port)
    return name, 0


def tensor_name(node: str, port: int = 0) -> str:
    return f"{node}:{port}"


def _input_string(node: str, port: int) -> str:
    return node if port == 0 else f"{node}:{port}"


class GraphIR:
    """One graph plus the MetaGraph fields that travel with it.

    ``meta`` is the MetaGraphDef with ``graph_def.node`` emptied (versions, function library,
    collections, saver_def, signatures stay in it); ``kind`` is "meta" or "graph" (bare GraphDef).
    """

    def __init__(self, meta, kind: str = "meta", source: str | None = None):
        self.g = nx.MultiDiGraph()
        self.meta = meta
        self.kind = kind
        self.source = source
        self._protos = {}  # name -> NodeDef holding attr and rare fields; input/name/op/device unused

    # ---------------------------------------------------------------- reading
    def __contains__(self, name: str) -> bool:
        return name in self.g

    def __len__(self) -> int:
        return len(self.g)

    def nodes(self) -> Iterator[str]:
        return iter(self.g)

    def node(self, name: str) -> dict:
        try:
            return self.g._node[name]
        except KeyError:
            raise GraphxformError(f"no node named '{name}' in the graph") from None

    def op(self, name: str) -> str:
        return self.g._node[name]["op"]

    def inputs(self, name: str) -> list[tuple[str, int]]:
        """Data inputs as (src, src_port), in dst_port order."""
        found = []
        for src, edges in self.g._pred[name].items():
            for key, data in edges.items():
                if key != CONTROL_KEY:
                    found.append((key, src, data["src_port"]))
        found.sort()
        return [(src, port) for _, src, port in found]

    def input(self, name: str, dst_port: int) -> tuple[str, int]:
        for src, edges in self.g._pred[name].items():
            data = edges.get(dst_port)
            if data is not None:
                return src, data["src_port"]
        raise GraphxformError(f"node '{name}' has no input {dst_port}")

    def control_inputs(self, name: str) -> list[str]:
        return [src for src, edges in self.g._pred[name].items() if CONTROL_KEY in edges]

    def consumers(self, name: str, port: int | None = None) -> list[tuple[str, int]]:
        """Data consumers of node ``name`` (of its output ``port`` if given) as (dst, dst_port)."""
        found = []
        for dst, edges in self.g._succ[name].items():
            for key, data in edges.items():
                if key != CONTROL_KEY and (port is None or data["src_port"] == port):
                    found.append((dst, key))
        return found

    def control_consumers(self, name: str) -> list[str]:
        return [dst for dst, edges in self.g._succ[name].items() if CONTROL_KEY in edges]

    def successors(self, name: str) -> Iterable[str]:
        return self.g._succ[name].keys()

    def predecessors(self, name: str) -> Iterable[str]:
        return self.g._pred[name].keys()

    def proto(self, name: str):
        """The NodeDef that holds this node's attrs (its input/name/op/device fields are stale)."""
        return self._protos[name]

    # --------------------------------------------------------------- mutation
    def add_node(self, name: str, op: str, inputs: Iterable[str] = (), *, device: str = "",
                 attr: dict | None = None, created_by: str | None = None, proto=None,
                 origin: str | None = None) -> str:
        """Add a node; ``inputs`` are TF input strings ('a', 'a:1', '^a'); ``attr`` maps names to
        AttrValue protos (copied). Returns the name."""
        if name in self.g:
            raise GraphxformError(f"node '{name}' already exists")
        if proto is None:
            from tensorflow.core.framework import node_def_pb2
            proto = node_def_pb2.NodeDef()
        for key, value in (attr or {}).items():
            proto.attr[key].CopyFrom(value)
        self._protos[name] = proto
        self.g._node[name] = {"op": op, "device": device, "attr": proto.attr, "origin": origin,
                              "created_by": created_by}
        self.g._succ[name] = {}
        self.g._pred[name] = {}
        self._connect(name, inputs)
        return name

    def _connect(self, name: str, inputs: Iterable[str]) -> None:
        port = 0
        for text in inputs:
            if text.startswith("^"):
                self._add_edge(text[1:], name, CONTROL_KEY, {"control": True})
            else:
                src, src_port = parse_tensor(text)
                self._add_edge(src, name, port, {"src_port": src_port, "dst_port": port})
                port += 1

    def _add_edge(self, src: str, dst: str, key: int, edge: dict) -> None:
        """networkx's own add_edge costs several times this: one edge, straight into the
        adjacency dicts (the key dict is shared by _succ[src][dst] and _pred[dst][src])."""
        self._require(src, dst)
        keyed = self.g._pred[dst].get(src)
        if keyed is None:
            keyed = self.g._succ[src][dst] = self.g._pred[dst][src] = {}
        keyed[key] = edge

    def _require(self, src: str, dst: str) -> None:
        if src not in self.g:
            raise GraphxformError(f"node '{dst}' has input '{src}', which is not in the graph")

    def remove_node(self, name: str, safe: bool = True) -> None:
        """Remove a node; with ``safe`` refuse while anything still consumes it."""
        if safe and self.g._succ[name]:
            users = ", ".join(sorted(self.g._succ[name])[:3])
            raise GraphxformError(f"cannot remove '{name}': still used by {users}")
        self.g.remove_node(name)
        del self._protos[name]

    def remove_nodes(self, names: Iterable[str], safe: bool = True) -> None:
        """Remove a set of nodes at once; with ``safe`` refuse while a node outside the set
        still consumes one of them."""
        names = set(names)
        if safe:
            for name in names:
                outside = [dst for dst in self.g._succ[name] if dst not in names]
                if outside:
                    raise GraphxformError(f"cannot remove '{name}': still used by {outside[0]}")
        self.g.remove_nodes_from(names)
        for name in names:
            del self._protos[name]

    def remove_dead(self, roots: Iterable[str], keep: Callable[[str], bool]) -> int:
        """Remove ``roots`` and then their inputs, as long as nothing consumes them and
        ``keep(name)`` is False. Returns how many nodes went."""
        stack, removed = list(roots), 0
        while stack:
            name = stack.pop()
            if name not in self.g or self.g._succ[name] or keep(name):
                continue
            inputs = list(self.g._pred[name])
            self.remove_node(name)
            removed += 1
            stack.extend(inputs)
        return removed

    def set_input(self, dst: str, dst_port: int, tensor: str) -> None:
        """Point input ``dst_port`` of ``dst`` at ``tensor``."""
        src, _ = self.input(dst, dst_port)
        self.g.remove_edge(src, dst, key=dst_port)
        new_src, new_port = parse_tensor(tensor)
        self._add_edge(new_src, dst, dst_port, {"src_port": new_port, "dst_port": dst_port})

    def replace_all_uses_with(self, old: str, new: str,
                              where: Callable[[str], bool] | None = None) -> int:
        """Rewire consumers of ``old`` to ``new``; returns how many edges moved.

        Node names ('a' -> 'b') move every data consumer of each output port to the same port of
        ``new`` and every control consumer too. Tensor names ('a:1' -> 'b:0') move the data
        consumers of that one output. ``where(consumer)`` limits which consumers move.
        """
        whole_node = ":" not in old
        old_node, old_port = parse_tensor(old)
        new_node, new_port = parse_tensor(new)
        self._require(new_node, old_node)
        moves = []
        for dst, edges in self.g._succ[old_node].items():
            if where is not None and not where(dst):
                continue
            for key, data in edges.items():
                if key == CONTROL_KEY:
                    if whole_node:
                        moves.append((dst, key, None))
                elif whole_node:
                    moves.append((dst, key, data["src_port"]))
                elif data["src_port"] == old_port:
                    moves.append((dst, key, new_port))
        for dst, key, port in moves:
            self.g.remove_edge(old_node, dst, key=key)
            if key == CONTROL_KEY:
                self.add_control_input(dst, new_node)
            else:
                self._add_edge(new_node, dst, key, {"src_port": port, "dst_port": key})
        return len(moves)

    def add_control_input(self, node: str, src: str) -> None:
        self._add_edge(src, node, CONTROL_KEY, {"control": True})

    def remove_control_input(self, node: str, src: str) -> None:
        if self.g.has_edge(src, node, key=CONTROL_KEY):
            self.g.remove_edge(src, node, key=CONTROL_KEY)

    def copy_nodes(self, names: Iterable[str], prefix: str, *, device=None,
                   created_by: str | None = None) -> dict[str, str]:
        """Copy ``names`` as ``prefix + name``; edges among copied nodes follow the copies, inputs
        from outside keep pointing at the originals. ``device`` is a string or a function of the
        original name. Colocation attrs (``_class: loc:@x``) follow copies too. Returns
        {original: copy}."""
        names = list(names)
        mapping = {name: prefix + name for name in names}
        g = self.g
        node_data, succ, pred, protos = g._node, g._succ, g._pred, self._protos
        for new in mapping.values():
            if new in node_data:
                raise GraphxformError(f"cannot copy to '{new}': it already exists")
        collecting = gc.isenabled()
        gc.disable()  # like metagraph.from_metagraph: fill networkx's dicts directly, per edge
        try:
            for name in names:
                data = node_data[name]
                new = mapping[name]
                proto = type(protos[name])()
                proto.CopyFrom(protos[name])
                if "_class" in proto.attr:
                    _remap_colocation(proto.attr["_class"], mapping)
                dev = data["device"] if device is None else (
                    device(name) if callable(device) else device)
                protos[new] = proto
                node_data[new] = {"op": data["op"], "device": dev, "attr": proto.attr,
                                  "origin": data["origin"],
                                  "created_by": created_by or data["created_by"]}
                succ[new] = {}
                pred[new] = {}
            for name in names:
                new = mapping[name]
                new_pred = pred[new]
                for src, keyed in pred[name].items():
                    new_src = mapping.get(src, src)
                    copied = dict(keyed)  # edge attr dicts are never mutated: share them
                    new_pred[new_src] = copied
                    succ[new_src][new] = copied
        finally:
            if collecting:
                gc.enable()
        if hasattr(nx, "_clear_cache"):
            nx._clear_cache(g)
        return mapping

    # -------------------------------------------------------------- printing
    def node_line(self, name: str) -> str:
        data = self.g.nodes[name]
        args = [_input_string(src, port) for src, port in self.inputs(name)]
        args += ["^" + src for src in self.control_inputs(name)]
        attrs = " ".join(f"{key}={format_attr(data['attr'][key])}"
                         for key in sorted(data["attr"]) if not key.startswith("_output_shapes"))
        text = f"{name} = {data['op']}({', '.join(args)})"
        if data["device"]:
            text += f" @{data['device']}"
        if attrs:
            text += f" {{{attrs}}}"
        if data["created_by"]:
            text += f"  # {data['created_by']}"
        return text

    def __str__(self) -> str:
        """One line per node, in graph order: deterministic, for golden tests and diffs."""
        return "\n".join(self.node_line(name) for name in self.g) + "\n"

    def unique_name(self, base: str) -> str:
        if base not in self.g:
            return base
        for i in itertools.count(1):
            if f"{base}_{i}" not in self.g:
                return f"{base}_{i}"
        raise AssertionError  # unreachable


def _remap_colocation(attr_value, mapping: dict[str, str]) -> None:
    items = list(attr_value.list.s)
    changed = False
    for i, item in enumerate(items):
        text = item.decode()
        if text.startswith("loc:@") and text[5:] in mapping:
            items[i] = ("loc:@" + mapping[text[5:]]).encode()
            changed = True
    if changed:
        del attr_value.list.s[:]
        attr_value.list.s.extend(items)


def format_attr(value) -> str:
    """A short, stable text form of an AttrValue for the one-line printer."""
    kind = value.WhichOneof("value")
    if kind == "type":
        return _dtype_name(value.type)
    if kind == "shape":
        return _shape_text(value.shape)
    if kind == "s":
        return repr(value.s.decode(errors="replace"))
    if kind in ("i", "f", "b"):
        return str(getattr(value, kind))
    if kind == "tensor":
        t = value.tensor
        return f"<{_dtype_name(t.dtype)}{_shape_text(t.tensor_shape)}>"
    if kind == "func":
        return f"@{value.func.name}"
    if kind == "placeholder":
        return f"${value.placeholder}"
    if kind == "list":
        lst = value.list
        for field in ("s", "i", "f", "b", "type", "shape", "tensor", "func"):
            items = getattr(lst, field)
            if items:
                if field == "type":
                    parts = [_dtype_name(x) for x in items]
                elif field == "shape":
                    parts = [_shape_text(x) for x in items]
                elif field == "s":
                    parts = [repr(x.decode(errors="replace")) for x in items]
                elif field in ("tensor", "func"):
                    parts = [f"<{field}>" for _ in items]
                else:
                    parts = [str(x) for x in items]
                return "[" + ", ".join(parts) + "]"
        return "[]"
    return "?"


def _dtype_name(enum_value: int) -> str:
    from tensorflow.core.framework import types_pb2
    name = types_pb2.DataType.Name(enum_value)
    return name[3:].lower() if name.startswith("DT_") else name


def _shape_text(shape) -> str:
    if shape.unknown_rank:
        return "[*]"
    return "[" + ",".join("?" if d.size < 0 else str(d.size) for d in shape.dim) + "]"
