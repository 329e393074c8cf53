"""One self-contained HTML page to explore a graph: it opens from disk with no server and no
network (its script and style ship in ``static/`` and are inlined).

How it stays responsive on ~100k nodes: Python folds the replicas and builds the scope tree
(graphxform/inspector/scopes.py) and writes only that as JSON: per tree entry its parent, label
and size; per leaf (a folded node) its op, pass, colour keys and folded inputs. The page lays out
only the boxes on screen, in JavaScript (static/inspector.js: a layered layout, longest-path
layers and barycentric ordering), so opening a box costs one sweep over the leaves to bundle
edges plus the layout of at most a few hundred boxes, whatever the graph's size. No picture is
pre-rendered.

The page starts from the same boxes as `viz` (``choose_open``); ``#open=PATH,PATH&select=PATH
&color=pass`` in the URL opens more, selects one and picks the colouring (the screenshot test
uses it).
"""

from __future__ import annotations

import html as html_escape
import json
import os
from importlib import resources

from graphxform.inspector import scopes
from graphxform.ir import GraphIR

KINDS = {scopes.SCOPE: 0, scopes.GROUP: 1, scopes.OP: 2}


def page(ir: GraphIR, depth: int | None = None, scope: str = "", color_by: str = "device",
         boxes: int = scopes.DEFAULT_BOXES, fold: bool = True, title: str | None = None,
         leaf_status: dict | None = None, folded: scopes.FoldedGraph | None = None) -> str:
    """The page's HTML. ``leaf_status`` (from graphxform.inspector.diff) adds a `diff`
    colouring; ``folded`` reuses a FoldedGraph already built for ``ir``."""
    folded = folded or scopes.FoldedGraph(ir, fold=fold)
    tree = scopes.build_tree(folded, scopes.saver_scope(ir))
    root = tree.find(scope)
    opened = scopes.choose_open(tree, root, boxes, depth)
    title = title or f"{os.path.basename(ir.source or 'graph')}: {len(ir)} nodes"
    doc = document(folded, tree, opened, root, title, leaf_status)
    if color_by not in doc["keys"]:
        scopes.leaf_keys(folded, color_by)  # says which colourings there are
    doc["colorBy"] = color_by
    return render(doc, title)


def document(folded: scopes.FoldedGraph, tree: scopes.ScopeTree, opened: set, root: int,
             title: str, leaf_status: dict | None = None) -> dict:
    """The JSON the page reads (see static/inspector.js for how each field is used)."""
    tables = {"op": {}, "pass": {}}
    index = lambda table, value: tables[table].setdefault(value, len(tables[table]))
    keys, key_names = {}, {}
    for color_by in scopes.COLOR_BY:
        keys[color_by], key_names[color_by] = _indexed(scopes.leaf_keys(folded, color_by))
    if leaf_status is not None:
        keys["diff"], key_names["diff"] = _indexed(
            [leaf_status.get(k, "unchanged") for k in range(len(folded))])
    devices, device_index = [], {}
    member_devices = []
    for leaf in range(len(folded)):
        if len(folded.members[leaf]) > 1:
            member_devices.append([device_index.setdefault(d, len(device_index))
                                   for d in folded.devices(leaf)])
        else:
            member_devices.append(None)
    devices = list(device_index)
    origins = {}
    for leaf, members in enumerate(folded.members):
        original = _origin(folded, leaf)
        if original != folded.names[leaf] and folded.passes[leaf] != "replicate":
            origins[leaf] = original
    return {
        "title": title, "nodes": sum(len(m) for m in folded.members),
        "replicas": folded.replica_count, "root": root, "hubDegree": scopes.HUB_DEGREE,
        "tree": {"parent": tree.parent, "label": tree.label,
                 "kind": [KINDS[k] for k in tree.kind], "size": tree.size, "leaf": tree.leaf},
        "leaves": {"op": [index("op", op) for op in folded.ops],
                   "pass": [index("pass", p or "") for p in folded.passes],
                   "inputs": [[x for pair in inputs for x in pair] for inputs in folded.inputs],
                   "members": [len(m) for m in folded.members],
                   "replicas": [sorted(r) for r in folded.replicas],
                   "memberDevices": member_devices, "entry": tree.entry_of_leaf,
                   "origin": origins},
        "tables": {"op": list(tables["op"]), "pass": list(tables["pass"]), "device": devices},
        "keys": keys, "keyNames": key_names,
        "open": sorted(k for k in opened if k != root),
    }


def _origin(folded: scopes.FoldedGraph, leaf: int) -> str | None:
    """The leaf's name in the input graph (None: a pass made it); an in-memory IR knows it."""
    first = folded.members[leaf][0]
    data = folded.data(first)
    if data["origin"] and data["origin"] != first:
        return scopes.fold_name(data["origin"])[0]
    return scopes.original_name(folded.names[leaf], data["created_by"])


def _indexed(values: list[str]) -> tuple[list[int], list[str]]:
    names: dict[str, int] = {}
    return [names.setdefault(v, len(names)) for v in values], list(names)


def _static(name: str) -> str:
    return resources.files("graphxform.inspector").joinpath("static", name).read_text()


def render(doc: dict, title: str) -> str:
    """The page: style, the JSON (made safe inside <script>) and the script, inline."""
    data = json.dumps(doc, separators=(",", ":")).replace("<", "\\u003c")  # '<' is in strings
    return (f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{html_escape.escape(title)}</title>\n<style>\n{_static('inspector.css')}"
            f"</style>\n</head>\n<body>\n{_static('inspector.html')}"
            f"<script type=\"application/json\" id=\"graph-data\">{data}</script>\n"
            f"<script>\n{_static('inspector.js')}</script>\n</body>\n</html>\n")
