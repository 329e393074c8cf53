"""Read and write MetaGraphDef / GraphDef files (binary and text) <-> GraphIR, losslessly.

The file's extension says what is expected: ``.meta`` a binary MetaGraphDef, ``.pb`` a binary
GraphDef, ``.pbtxt``/``.txt`` either one in text form. A file holding the other kind is an error.
"""

from __future__ import annotations

import gc
import os
import tempfile

import networkx as nx

from google.protobuf import message, text_format

from graphxform.errors import GraphxformError
from graphxform.ir import GraphIR, parse_tensor

TEXT_SUFFIXES = (".pbtxt", ".txt")
# The pass that created a node travels in the file as an internal attr (TF ignores attrs that
# start with "_"), so `viz --color pass` works on emitted graphs.
PROVENANCE_ATTR = "_graphxform_pass"


def _protos():
    from tensorflow.core.framework import graph_pb2
    from tensorflow.core.protobuf import meta_graph_pb2
    return meta_graph_pb2, graph_pb2


def load(path: str) -> GraphIR:
    """Load a model file into a GraphIR."""
    meta, kind = read_metagraph(path)
    return from_metagraph(meta, kind=kind, source=path)


def read_metagraph(path: str):
    """Parse ``path`` into (MetaGraphDef, kind); a bare GraphDef is wrapped, kind "graph"."""
    meta_graph_pb2, graph_pb2 = _protos()
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise GraphxformError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise GraphxformError(f"{path}: is a directory, not a model file") from None
    except OSError as e:
        raise GraphxformError(f"{path}: cannot read: {e.strerror}") from None
    if not data.strip():
        raise GraphxformError(f"{path}: empty file")
    lower = path.lower()
    if lower.endswith(TEXT_SUFFIXES):
        meta, bare = _parse_text(path, data, meta_graph_pb2, graph_pb2)
        _check_nodes(path, meta.graph_def)
    else:
        expect_graph = lower.endswith(".pb")
        meta, bare = _parse_binary(path, data, expect_graph, meta_graph_pb2, graph_pb2)
    return meta, "graph" if bare else "meta"


def _parse_text(path, data, meta_graph_pb2, graph_pb2):
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise GraphxformError(f"{path}: not a text protobuf (use .meta or .pb for binary files)") from None
    meta = meta_graph_pb2.MetaGraphDef()
    try:
        text_format.Parse(text, meta)
        return meta, False
    except text_format.ParseError as meta_error:
        graph = graph_pb2.GraphDef()
        try:
            text_format.Parse(text, graph)
        except text_format.ParseError:
            raise GraphxformError(f"{path}: not a text MetaGraphDef or GraphDef ({meta_error})") from None
    meta = meta_graph_pb2.MetaGraphDef()
    meta.graph_def.CopyFrom(graph)
    return meta, True


def _parse_binary(path, data, expect_graph, meta_graph_pb2, graph_pb2):
    """Parse as the kind the extension promises; only on failure parse as the other kind, to
    say what the file really holds."""
    def as_meta():
        meta = _try_parse(meta_graph_pb2.MetaGraphDef, data)
        ok = meta is not None and len(meta.graph_def.node) > 0 and _nodes_ok(meta.graph_def)
        return meta if ok else None

    def as_graph():
        graph = _try_parse(graph_pb2.GraphDef, data)
        return graph if graph is not None and len(graph.node) > 0 and _nodes_ok(graph) else None

    if expect_graph:
        graph = as_graph()
        if graph is not None and as_meta() is None:
            wrapped = meta_graph_pb2.MetaGraphDef()
            wrapped.graph_def.CopyFrom(graph)
            return wrapped, True
        if graph is None and as_meta() is not None:
            raise GraphxformError(f"{path}: holds a MetaGraphDef, but .pb means a bare GraphDef "
                                  "(rename it to .meta)")
    else:
        meta = as_meta()
        if meta is not None:
            return meta, False
        if as_graph() is not None:
            raise GraphxformError(f"{path}: holds a bare GraphDef, but a MetaGraphDef (.meta) is "
                                  "expected (rename it to .pb)")
    what = "GraphDef" if expect_graph else "MetaGraphDef"
    raise GraphxformError(f"{path}: not a valid binary {what} (corrupt or truncated file)")


def _try_parse(cls, data):
    try:
        return cls.FromString(data)
    except (message.DecodeError, ValueError, RuntimeError):
        return None


def _nodes_ok(graph_def) -> bool:
    return all(node.name and node.op for node in graph_def.node)


def _check_nodes(path, graph_def) -> None:
    if not _nodes_ok(graph_def):
        raise GraphxformError(f"{path}: a node has no name or op (corrupt file)")


def from_metagraph(meta, kind: str = "meta", source: str | None = None) -> GraphIR:
    """Build a GraphIR; ``meta`` is consumed (its node list moves into the IR).

    This is the hot path of every command, so it fills networkx's adjacency dicts directly
    (the layout MultiDiGraph.add_edge makes: one key dict shared by _succ[u][v] and _pred[v][u])
    with the garbage collector paused: per-edge add_edge calls cost several times the parse."""
    nodes = list(meta.graph_def.node)
    ir = GraphIR(meta, kind=kind, source=source)
    g = ir.g
    protos, node_data, succ, pred = ir._protos, g._node, g._succ, g._pred
    collecting = gc.isenabled()
    gc.disable()
    try:
        for nd in nodes:
            name = nd.name
            if name in protos:
                raise GraphxformError(f"{source or 'graph'}: duplicate node name '{name}'")
            protos[name] = nd
            created_by = None
            if PROVENANCE_ATTR in nd.attr:  # written by an earlier graphxform run
                created_by = nd.attr[PROVENANCE_ATTR].s.decode()
                del nd.attr[PROVENANCE_ATTR]
            node_data[name] = {"op": nd.op, "device": nd.device, "attr": nd.attr,
                               "origin": name, "created_by": created_by}
            succ[name] = {}
            pred[name] = {}
        for nd in nodes:
            dst = nd.name
            dst_pred = pred[dst]
            port = 0
            for text in nd.input:
                if text[0] == "^":
                    src = text[1:]
                    key, edge = -1, {"control": True}
                else:
                    src, src_port = (text, 0) if ":" not in text else parse_tensor(text)
                    key, edge = port, {"src_port": src_port, "dst_port": port}
                    if src_port == 0 and text[-2:] == ":0":
                        edge["spelled_port"] = True  # written 'x:0'; kept so emit gives it back
                    port += 1
                keyed = dst_pred.get(src)
                if keyed is None:
                    src_succ = succ.get(src)
                    if src_succ is None:
                        _dangling(source, dst, text)
                    keyed = src_succ[dst] = dst_pred[src] = {}
                keyed[key] = edge
            del nd.input[:]
    finally:
        if collecting:
            gc.enable()
    if hasattr(nx, "_clear_cache"):
        nx._clear_cache(g)
    del meta.graph_def.node[:]
    return ir


def _dangling(source, dst, text):
    raise GraphxformError(f"{source or 'graph'}: node '{dst}' has input '{text}', which is not in "
                          "the graph")


def to_metagraph(ir: GraphIR):
    """Emit a fresh MetaGraphDef (the IR is left untouched)."""
    meta_graph_pb2, _ = _protos()
    meta = meta_graph_pb2.MetaGraphDef()
    meta.CopyFrom(ir.meta)
    out_nodes = meta.graph_def.node
    g = ir.g
    pred = g._pred
    protos = ir._protos
    for name, data in g.nodes(data=True):
        nd = out_nodes.add()
        nd.CopyFrom(protos[name])
        nd.name = name
        nd.op = data["op"]
        nd.device = data["device"]
        if data["created_by"]:
            nd.attr[PROVENANCE_ATTR].s = data["created_by"].encode()
        data_inputs = []
        controls = []
        for src, keyed in pred[name].items():
            for key, edge in keyed.items():
                if key == -1:
                    controls.append("^" + src)
                else:
                    p = edge["src_port"]
                    plain = p == 0 and "spelled_port" not in edge
                    data_inputs.append((key, src if plain else f"{src}:{p}"))
        if data_inputs:
            if len(data_inputs) > 1:
                data_inputs.sort()
            nd.input.extend([text for _, text in data_inputs])
        if controls:
            nd.input.extend(controls)
    return meta


def to_graphdef(ir: GraphIR):
    return to_metagraph(ir).graph_def


def serialize(ir: GraphIR, path: str) -> bytes:
    """The bytes to write for ``path``'s format."""
    meta = to_metagraph(ir)
    lower = path.lower()
    if lower.endswith(TEXT_SUFFIXES):
        proto = meta.graph_def if ir.kind == "graph" else meta
        return text_format.MessageToString(proto).encode()
    if lower.endswith(".pb"):
        return meta.graph_def.SerializeToString()
    return meta.SerializeToString()


def save(ir: GraphIR, path: str) -> None:
    """Write atomically (temp file + rename); never over the input file."""
    check_output_path(path, ir.source)
    write_atomic(path, serialize(ir, path))


def check_output_path(path: str, source: str | None) -> None:
    if source and os.path.exists(path) and os.path.samefile(path, source):
        raise GraphxformError(f"{path}: output would overwrite the input; choose another -o")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise GraphxformError(f"{path}: output directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise GraphxformError(f"{path}: output directory {parent} is not writable")


def write_atomic(path: str, data: bytes | str) -> None:
    """Write to a temp file beside ``path`` and rename it into place; no partial file on error."""
    parent = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=".graphxform-", suffix=".tmp")
    except OSError as e:
        raise GraphxformError(f"{path}: cannot write: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise GraphxformError(f"{path}: cannot write: {e.strerror}") from None
        raise
