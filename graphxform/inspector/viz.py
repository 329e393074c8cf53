"""Pictures of a graph for people: DOT text, rendered by Graphviz to SVG/PNG/PDF, or the HTML
page (graphxform/inspector/html.py); always the collapsed picture of scopes.py (replicas
folded, at most about 150 boxes unless ``depth`` says otherwise, bundled edges), coloured by
device, replica or the pass that made each node."""

from __future__ import annotations

import math
import os
import shutil
import subprocess

from graphxform import cleanup
from graphxform.errors import GraphxformError, clip
from graphxform.inspector import scopes
from graphxform.ir import GraphIR

PALETTE = ["#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69",
           "#fccde5", "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f"]
LEGEND_ENTRIES = 12
FORMATS = ("dot", "svg", "png", "pdf", "html")
# bound dot's network simplex and crossing minimisation, so no picture takes minutes
LAYOUT_LIMITS = "nslimit=20, nslimit1=20, mclimit=1"


def _quote(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def to_dot(ir: GraphIR, depth: int | None = None, scope: str = "", color_by: str = "device",
           boxes: int = scopes.DEFAULT_BOXES, fold: bool = True) -> str:
    """DOT text of the collapsed picture of ``ir`` (see scopes.collapsed)."""
    pic = scopes.collapsed(ir, boxes=boxes, depth=depth, scope=scope, fold=fold)
    keys = scopes.leaf_keys(pic.folded, color_by)
    title = f"{os.path.basename(ir.source or 'graph')}: {len(ir)} nodes; colour: {color_by}"
    return picture_dot(pic, keys, title)


def picture_dot(pic: scopes.Picture, keys: list[str], title: str,
                colours: dict | None = None) -> str:
    """DOT text of a Picture, each box filled with the colour of the key most of its leaves
    have (``colours`` fixes some key -> colour; the rest come from the palette)."""
    colours = dict(colours or {})
    per_box = scopes.box_keys(pic, keys)
    order = sorted({key for key, _ in per_box}, key=lambda k: (k not in colours, k))
    for key in order:
        if key not in colours:
            colours[key] = PALETTE[(len(colours)) % len(PALETTE)]
    lines = ["digraph graphxform {",
             f'  graph [rankdir=TB, fontname="Helvetica", fontsize=11, labelloc=t, '
             f'ranksep=0.3, nodesep=0.2, label={_quote(title)}, {LAYOUT_LIMITS}];',
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
             '  edge [color="#555555", fontsize=8, arrowsize=0.6];']
    for i, box in enumerate(pic.boxes):
        key, counts = per_box[i]
        label = box_label(box)
        if i in pic.hubs:
            label += f"\n(edges to {pic.hubs[i]} boxes not drawn)"
        attrs = [f"label={_quote(label)}", f"fillcolor={_quote(colours[key])}",
                 f"tooltip={_quote(_tooltip(box, counts))}"]
        if box.kind != scopes.OP:
            attrs.append("shape=folder" if box.kind == scopes.SCOPE else "shape=tab")
        if box.replicas > 1:
            attrs.append("peripheries=2")
        line = f"b{i} [{', '.join(attrs)}];"
        lines.append(("  subgraph cluster_hubs { label=\"many edges\"; style=dashed; "
                      f"{line} }}") if i in pic.hubs else "  " + line)
    for (src, dst), (data, control) in sorted(pic.drawn_edges().items()):
        count = data + control
        attrs = [] if data else ["style=dashed"]
        if count > 1:
            attrs += [f'label="{count}"', f"penwidth={min(1 + math.log2(count) / 2, 4):.1f}"]
        lines.append(f"  b{src} -> b{dst}" + (f" [{', '.join(attrs)}]" if attrs else "") + ";")
    lines += _legend(order, colours)
    lines.append("}")
    return "\n".join(lines) + "\n"


def box_label(box: scopes.Box) -> str:
    if box.kind == scopes.OP:
        text = f"{box.label}\n{box.op}"
    else:
        text = f"{box.label}\n{box.ops} op{'s' if box.ops != 1 else ''}"
    if box.replicas > 1:
        text += f"  x {box.replicas}"
    return text


def _tooltip(box: scopes.Box, counts) -> str:
    parts = [box.path or "(graph)"]
    total = sum(counts.values()) or 1
    parts += [f"{key}: {100 * n / total:.0f}%" for key, n in counts.most_common(4)]
    return "\n".join(parts)


def _legend(order: list[str], colours: dict) -> list[str]:
    shown = order[:LEGEND_ENTRIES]
    lines = ['  subgraph cluster_legend { label="legend"; fontsize=10; style=dashed;']
    for k, key in enumerate(shown):
        lines.append(f"    legend{k} [label={_quote(key or '(none)')}, "
                     f"fillcolor={_quote(colours[key])}, shape=box];")
    if len(order) > len(shown):
        lines.append(f'    legend_more [label="{len(order) - len(shown)} more", shape=plaintext,'
                     ' style=""];')
    lines.append("  }")
    return lines


def output_format(path: str, fmt: str | None = None) -> str:
    """The format asked for: ``fmt`` or the file's extension."""
    chosen = (fmt or os.path.splitext(path)[1].lstrip(".")).lower()
    chosen = "dot" if chosen == "gv" else chosen
    if chosen not in FORMATS:
        raise GraphxformError(f"{path}: output must end in .dot, .svg, .png, .pdf or .html "
                              "(or give --format)")
    return chosen


def write(ir: GraphIR, path: str, fmt: str | None = None, **options) -> str | None:
    """Write DOT, HTML, or render SVG/PNG/PDF with Graphviz's ``dot``. Returns a note for the
    user when ``dot`` is missing (the .dot is written instead)."""
    from graphxform.metagraph import write_atomic
    chosen = output_format(path, fmt)
    if chosen == "html":
        from graphxform.inspector import html
        write_atomic(path, html.page(ir, **options))
        return None
    return write_dot(to_dot(ir, **options), path, chosen)


def write_dot(dot: str, path: str, fmt: str) -> str | None:
    """Write ``dot`` as it is or rendered to ``fmt``; a note when Graphviz is missing."""
    from graphxform.metagraph import write_atomic
    if fmt == "dot":
        write_atomic(path, dot)
        return None
    executable = shutil.which("dot")
    if executable is None:
        stem = os.path.splitext(path)[0]
        write_atomic(stem + ".dot", dot)
        return (f"Graphviz 'dot' is not installed, so {path} was not rendered; wrote "
                f"{stem}.dot instead (install it with: apt-get install graphviz)")
    write_atomic(path, render(executable, dot, fmt, path))
    return None


def dump(ir: GraphIR, stem: str) -> None:
    """What `apply --dump-dir` writes beside each stage's .pbtxt: ``stem.dot``, the default
    picture (the pipeline is handed this function)."""
    from graphxform.metagraph import write_atomic
    write_atomic(stem + ".dot", to_dot(ir))


def render(executable: str, dot: str, fmt: str, path: str) -> bytes:
    """Run ``dot -T<fmt>``; it dies with this process however that ends (a signal unwinds to
    the ``finally`` below; on SIGKILL the kernel kills it, see cleanup.child_preexec)."""
    proc = subprocess.Popen([executable, f"-T{fmt}"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=cleanup.child_preexec())
    try:
        out, err = proc.communicate(dot.encode())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        said = err.decode(errors="replace").strip() or f"exit code {proc.returncode}"
        raise GraphxformError(f"dot failed to render {path}: {clip(said)}")
    return out
