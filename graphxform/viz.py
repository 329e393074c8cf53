"""DOT pictures of a GraphIR for people: name scopes collapsed to a readable depth, nodes
coloured by device (or by the pass that created them), optional focus on one scope."""

from __future__ import annotations

import collections
import os
import shutil
import subprocess

from graphxform import cleanup
from graphxform.errors import GraphxformError, clip
from graphxform.ir import CONTROL_KEY, GraphIR

PALETTE = ["#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69",
           "#fccde5", "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f"]


def _group(name: str, depth: int, scope: str) -> str:
    """The box a node is drawn in: its first ``depth`` scope levels below ``scope``."""
    rest = name[len(scope):]
    parts = rest.split("/")
    if len(parts) <= depth:
        return name
    return scope + "/".join(parts[:depth]) + "/"


def _quote(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def to_dot(ir: GraphIR, depth: int = 2, scope: str = "", color_by: str = "device") -> str:
    """DOT text. Boxes ending in '/' are collapsed scopes with their op count; edge labels count
    the tensors they stand for. With ``scope``, only nodes under it are drawn."""
    if scope and not scope.endswith("/") and scope not in ir:
        scope += "/"
    members = collections.defaultdict(list)
    for name in ir.nodes():
        if name.startswith(scope) or name == scope:
            members[_group(name, depth, scope if scope.endswith("/") else "")].append(name)
    if not members:
        raise GraphxformError(f"no node under scope '{scope}'")
    colours = {}
    lines = ["digraph graphxform {", "  rankdir=TB;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
             '  edge [color="#555555", fontsize=8];']
    box_of = {}
    for box, names in members.items():
        for name in names:
            box_of[name] = box
        key = _colour_key(ir, names, color_by)
        colour = colours.setdefault(key, PALETTE[len(colours) % len(PALETTE)])
        if box.endswith("/"):
            label = f"{box}\n{len(names)} ops"
            shape = ', shape=folder'
        else:
            label = f"{box}\n{ir.op(box)}"
            shape = ""
        tooltip = key or "no device"
        lines.append(f"  {_quote(box)} [label={_quote(label)}, fillcolor={_quote(colour)}, "
                     f"tooltip={_quote(tooltip)}{shape}];")
    counts = collections.Counter()
    data_links = set()
    for src, dst, key in ir.g.edges(keys=True):
        src_box, dst_box = box_of.get(src), box_of.get(dst)
        if src_box is None or dst_box is None or src_box == dst_box:
            continue
        counts[(src_box, dst_box)] += 1
        if key != CONTROL_KEY:
            data_links.add((src_box, dst_box))
    for (src_box, dst_box), count in sorted(counts.items()):
        style = [] if (src_box, dst_box) in data_links else ["style=dashed"]
        if count > 1:
            style.append(f'label="{count}"')
        attrs = f" [{', '.join(style)}]" if style else ""
        lines.append(f"  {_quote(src_box)} -> {_quote(dst_box)}{attrs};")
    lines.append("  subgraph cluster_legend { label=\"colour: " + color_by + "\"; fontsize=10;")
    for key, colour in colours.items():
        lines.append(f"    {_quote('legend ' + (key or '(none)'))} [label={_quote(key or '(none)')},"
                     f" fillcolor={_quote(colour)}];")
    lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _colour_key(ir: GraphIR, names: list[str], color_by: str) -> str:
    field = {"device": "device", "pass": "created_by"}.get(color_by)
    if field is None:
        raise GraphxformError(f"--color must be 'device' or 'pass', not '{color_by}'")
    values = collections.Counter(ir.node(n)[field] or "" for n in names)
    return values.most_common(1)[0][0]


def write(ir: GraphIR, path: str, **options) -> str | None:
    """Write DOT, or render SVG/PNG/PDF with Graphviz's ``dot``. Returns a note for the user when
    ``dot`` is missing (the .dot is written instead)."""
    from graphxform.metagraph import write_atomic
    dot = to_dot(ir, **options)
    stem, ext = os.path.splitext(path)
    fmt = ext.lstrip(".").lower()
    if fmt == "dot" or fmt == "gv":
        write_atomic(path, dot)
        return None
    if fmt not in ("svg", "png", "pdf"):
        raise GraphxformError(f"{path}: output must end in .dot, .svg, .png or .pdf")
    executable = shutil.which("dot")
    if executable is None:
        write_atomic(stem + ".dot", dot)
        return (f"Graphviz 'dot' is not installed, so {path} was not rendered; wrote "
                f"{stem}.dot instead (install it with: apt-get install graphviz)")
    write_atomic(path, render(executable, dot, fmt, path))
    return None


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
