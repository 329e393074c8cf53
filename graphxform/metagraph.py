"""Read and write MetaGraphDef / GraphDef files (binary and text) <-> GraphIR, losslessly.

The file's extension says what is expected: ``.meta`` a binary MetaGraphDef, ``.pb`` a binary
GraphDef, ``.pbtxt``/``.txt`` either one in text form. A file holding the other kind is an error.
"""

from __future__ import annotations

import operator
import os
import stat
import tempfile

import networkx as nx

from google.protobuf import message, text_format

from graphxform import cleanup, wire
from graphxform.errors import GraphxformError, clip
from graphxform.ir import (CONTROL_EDGE, CONTROL_KEY, CONTROL_KEYS, GraphIR,
                           data_keys, join_edge, parse_tensor, paused_gc)

TEXT_SUFFIXES = (".pbtxt", ".txt")
# The largest message protobuf can parse (and serialize): 2 GiB less one byte.
PROTOBUF_LIMIT = 2**31 - 1
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
    data = read_model_bytes(path)
    lower = path.lower()
    if lower.endswith(TEXT_SUFFIXES):
        meta, bare = _parse_text(path, data, meta_graph_pb2, graph_pb2)
        _check_nodes(path, meta.graph_def)
    else:
        expect_graph = lower.endswith(".pb")
        meta, bare = _parse_binary(path, data, expect_graph, meta_graph_pb2, graph_pb2)
    return meta, "graph" if bare else "meta"


def read_model_bytes(path: str) -> bytes:
    """The bytes of a model file, refusing up front what cannot be one: not a regular file
    (a directory, /dev/zero, a pipe), empty, or larger than protobuf can hold."""
    try:
        st = os.stat(path)  # before opening: opening a pipe would wait for a writer
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError
        if not stat.S_ISREG(st.st_mode):
            raise GraphxformError(f"{path}: not a regular file (a model is a .meta, .pb or "
                                  ".pbtxt file)")
        if st.st_size > PROTOBUF_LIMIT:
            raise GraphxformError(f"{path}: {_size(st.st_size)} is larger than the "
                                  f"{_size(PROTOBUF_LIMIT + 1)} protobuf can hold")
        with open(path, "rb") as f:
            data = f.read(PROTOBUF_LIMIT + 1)  # a file may grow, or lie about its size (/proc)
    except FileNotFoundError:
        raise GraphxformError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise GraphxformError(f"{path}: is a directory, not a model file") from None
    except OSError as e:
        raise GraphxformError(f"{path}: cannot read: {e.strerror}") from None
    if len(data) > PROTOBUF_LIMIT:
        raise GraphxformError(f"{path}: larger than the {_size(PROTOBUF_LIMIT + 1)} protobuf "
                              "can hold")
    if not data or data.isspace():
        raise GraphxformError(f"{path}: empty file")
    return data


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


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
            raise GraphxformError(f"{path}: not a text MetaGraphDef or GraphDef "
                                  f"({clip(meta_error)})") from None
    meta = meta_graph_pb2.MetaGraphDef()
    meta.graph_def.CopyFrom(graph)
    return meta, True


def _parse_binary(path, data, expect_graph, meta_graph_pb2, graph_pb2):
    """Parse as the kind the extension promises; only on failure parse as the other kind, to
    say what the file really holds."""
    def as_meta():
        meta = _try_parse(meta_graph_pb2.MetaGraphDef, data)
        ok = (meta is not None and len(meta.graph_def.node) > 0
              and _nodes_ok(meta.graph_def, sample=True))
        return meta if ok else None

    def as_graph():
        graph = _try_parse(graph_pb2.GraphDef, data)
        ok = graph is not None and len(graph.node) > 0 and _nodes_ok(graph, sample=True)
        return graph if ok else None

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


def _nodes_ok(graph_def, sample: bool = False) -> bool:
    """Whether the nodes have names and ops; with ``sample``, the first few and the last
    (enough to tell a GraphDef from a MetaGraphDef parsed as the other; from_metagraph checks
    every node as it reads it)."""
    nodes = graph_def.node
    if sample and len(nodes) > 17:
        nodes = [*nodes[:16], nodes[-1]]
    return all(node.name and node.op for node in nodes)


def _check_nodes(path, graph_def) -> None:
    if not _nodes_ok(graph_def):
        raise GraphxformError(f"{path}: a node has no name or op (corrupt file)")


def from_metagraph(meta, kind: str = "meta", source: str | None = None) -> GraphIR:
    """Build a GraphIR; ``meta`` is consumed (its nodes move into the IR, which keeps each
    NodeDef whole, inputs included, so emitting an untouched node is one copy).

    This is the hot path of every command, so it fills networkx's adjacency dicts directly
    (the layout MultiDiGraph.add_edge makes: one key dict shared by _succ[u][v] and _pred[v][u])
    with the garbage collector paused: per-edge add_edge calls cost several times the parse."""
    nodes = list(meta.graph_def.node)
    ir = GraphIR(meta, kind=kind, source=source)
    with paused_gc():
        names = _add_loaded(ir, nodes, source)
        succ, pred = ir.g._succ, ir.g._pred
        for nd, dst in zip(nodes, names):
            texts = nd.input
            if texts:
                _link_inputs(texts, dst, succ, pred, source)
    if hasattr(nx, "_clear_cache"):
        nx._clear_cache(ir.g)
    ir._unverified = set(names)
    del meta.graph_def.node[:]
    return ir


def _add_loaded(ir: GraphIR, nodes: list, source) -> list[str]:
    """The loaded NodeDefs as nodes of ``ir`` (no edges yet); returns their names. Each field
    is read once: reading one from a NodeDef makes a new Python object every time."""
    protos, node_table, succ, pred = ir._protos, ir.g._node, ir.g._succ, ir.g._pred
    names = []
    for nd in nodes:
        name, op = nd.name, nd.op
        if not name or not op:
            raise GraphxformError(f"{source or 'graph'}: a node has no name or op (corrupt file)")
        if name in protos:
            raise GraphxformError(f"{source or 'graph'}: duplicate node name '{name}'")
        protos[name] = nd
        attr = nd.attr
        created_by = None
        if PROVENANCE_ATTR in attr:  # written by an earlier graphxform run
            created_by = attr[PROVENANCE_ATTR].s.decode()
            del attr[PROVENANCE_ATTR]
        node_table[name] = {"op": op, "device": nd.device, "attr": attr, "origin": name,
                            "created_by": created_by}
        succ[name], pred[name] = {}, {}
        names.append(name)
    return names


def _link_inputs(texts, dst: str, succ: dict, pred: dict, source) -> None:
    """The edges of one NodeDef input list. Data inputs come first; the control inputs after
    them (ResNet-50's gradient ops wait on 106 batch-norm updates each) are linked in bulk,
    all sharing one key dict."""
    texts = list(texts)
    port = 0
    dst_pred = pred[dst]
    for text in texts:
        if text[0] == "^":
            break
        if ":" not in text and text in succ and text not in dst_pred:  # most: 'x', new pair
            succ[text][dst] = dst_pred[text] = data_keys(port, 0)
            port += 1
            continue
        src, src_port = (text, 0) if ":" not in text else parse_tensor(text)
        edge = None
        if src_port == 0 and text[-2:] == ":0":  # written 'x:0'; kept so emit gives it back
            edge = {"src_port": 0, "dst_port": port, "spelled_port": True}
        _link(succ, pred, src, dst, port, src_port, edge, source, text)
        port += 1
    else:
        return
    rest = texts[port:]
    controls = dict.fromkeys(map(_after_caret, rest), CONTROL_KEYS)
    if len(set(map(_first_char, rest))) > 1 or not dst_pred.keys().isdisjoint(controls):
        _link_rest(rest, dst, succ, pred, port, source)  # unusual order, or data and control
        return
    dst_pred.update(controls)
    try:
        for src in controls:
            succ[src][dst] = CONTROL_KEYS
    except KeyError as missing:
        _dangling(source, dst, "^" + missing.args[0])


def _link_rest(texts, dst, succ, pred, port, source) -> None:
    for text in texts:
        if text[0] == "^":
            _link(succ, pred, text[1:], dst, CONTROL_KEY, 0, CONTROL_EDGE, source, text)
        else:
            src, src_port = parse_tensor(text)
            _link(succ, pred, src, dst, port, src_port, None, source, text)
            port += 1


_after_caret = operator.itemgetter(slice(1, None))
_first_char = operator.itemgetter(0)


def _link(succ, pred, src, dst, key, src_port, edge, source, text) -> None:
    if src not in succ:
        _dangling(source, dst, text)
    if edge is None and key != CONTROL_KEY and src not in pred[dst]:
        succ[src][dst] = pred[dst][src] = data_keys(key, src_port)
    else:
        join_edge(succ, pred, src, dst, key, edge or {"src_port": src_port, "dst_port": key})


def _dangling(source, dst, text):
    raise GraphxformError(f"{source or 'graph'}: node '{dst}' has input '{text}', which is not in "
                          "the graph")


def to_bytes(ir: GraphIR, graph_only: bool = False) -> bytes:
    """The binary MetaGraphDef of ``ir`` (with ``graph_only``, its GraphDef), written straight
    in protobuf's wire format (see graphxform/wire.py): the one pass over the output graph that
    emitting costs. Fields come in canonical order: meta_info_def, graph_def (nodes first),
    then the rest of the MetaGraphDef as loaded."""
    return b"".join(to_parts(ir, graph_only))


def to_parts(ir: GraphIR, graph_only: bool = False) -> list[bytes]:
    """``to_bytes`` in pieces whose concatenation it is: `save` writes them one after another,
    so the whole output never sits in memory twice (the pieces, and their join)."""
    with paused_gc():
        nodes = wire.NodeEncoder(ir, PROVENANCE_ATTR).nodes()
    rest = type(ir.meta)()
    rest.CopyFrom(ir.meta)
    graph_rest = rest.graph_def.SerializeToString()
    if graph_only:
        return [*nodes, graph_rest]
    head = b""
    if rest.HasField("meta_info_def"):
        head = wire.field(b"\x0a", rest.meta_info_def.SerializeToString())
    rest.ClearField("meta_info_def")
    rest.ClearField("graph_def")
    graph_bytes = sum(map(len, nodes)) + len(graph_rest)
    return [head, b"\x12", wire.varint(graph_bytes), *nodes, graph_rest,
            rest.SerializeToString()]


def to_metagraph(ir: GraphIR):
    """A fresh MetaGraphDef of ``ir`` (parsed from ``to_bytes``)."""
    meta_graph_pb2, _ = _protos()
    return meta_graph_pb2.MetaGraphDef.FromString(to_bytes(ir))


def to_graphdef(ir: GraphIR):
    _, graph_pb2 = _protos()
    return graph_pb2.GraphDef.FromString(to_bytes(ir, graph_only=True))


def serialize(ir: GraphIR, path: str) -> list[bytes]:
    """What to write for ``path``'s format, in pieces to write one after another."""
    lower = path.lower()
    if lower.endswith(TEXT_SUFFIXES):
        proto = to_graphdef(ir) if ir.kind == "graph" else to_metagraph(ir)
        return [text_format.MessageToString(proto).encode()]
    return to_parts(ir, graph_only=lower.endswith(".pb"))


def save(ir: GraphIR, path: str) -> None:
    """Write atomically (temp file + rename); never over the input file."""
    check_output_path(path, ir.source)
    write_atomic(path, serialize(ir, path))


def check_output_path(path: str, source: str | None) -> None:
    if source and _same_file(path, source):
        raise GraphxformError(f"{path}: output would overwrite the input; choose another -o")
    if _special_file(path):  # written in place
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise GraphxformError(f"{path}: output directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise GraphxformError(f"{path}: output directory {parent} is not writable")


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # either is missing (or unreadable): not one file
        return False


def write_atomic(path: str, data: bytes | str | list[bytes]) -> None:
    """Write to a temp file beside ``path`` and rename it into place: no partial file on error
    or signal (see graphxform/cleanup.py, which also sweeps the temp files of runs that died),
    and the mode ``open(path, "w")`` would give. Like ``open``, it writes through a symlink,
    and into a device or pipe (``-o /dev/null``) in place rather than replacing it. ``data``
    may be a list of byte strings, written in turn."""
    if _special_file(path):
        _write_in_place(path, data)
        return
    target = os.path.realpath(path) if os.path.islink(path) else path
    parent = os.path.dirname(os.path.abspath(target))
    cleanup.sweep_output_temps(parent)
    mode = cleanup.mode_for_new_file(target)
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=cleanup.TEMP_PREFIX + cleanup.owner_tag(),
                                   suffix=cleanup.TEMP_SUFFIX)
    except OSError as e:
        raise GraphxformError(f"{path}: cannot write: {e.strerror}") from None
    try:
        with os.fdopen(fd, "w" if isinstance(data, str) else "wb") as f:
            os.fchmod(f.fileno(), mode)
            _write_to(f, data)
        os.replace(tmp, target)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise GraphxformError(f"{path}: cannot write: {e.strerror}") from None
        raise


def _special_file(path: str) -> bool:
    """Whether ``path`` exists and is neither a regular file nor a directory (a device, a pipe,
    /dev/stdout): there is nothing to rename over it."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def _write_to(f, data: bytes | str | list[bytes]) -> None:
    if isinstance(data, list):
        f.writelines(data)
    else:
        f.write(data)


def _write_in_place(path: str, data: bytes | str | list[bytes]) -> None:
    try:
        with open(path, "w" if isinstance(data, str) else "wb") as f:
            _write_to(f, data)
    except OSError as e:
        raise GraphxformError(f"{path}: cannot write: {e.strerror}") from None
