"""The one exception type users see: its message is the whole one-line error. Also the helpers
that keep a message one short line whatever it quotes (a 1 GB token in a text proto, TF's
multi-line runtime errors)."""

from __future__ import annotations

import re

QUOTE_LIMIT = 200  # characters of user data (or of TF's words) an error quotes at most


class GraphxformError(Exception):
    """A problem with the user's input or options; the CLI prints it as one line."""


class PassError(GraphxformError):
    """A pass failed; the message names the pass and the passes that ran before it."""


class ContractError(GraphxformError):
    """The transformed graph would not train like the single-device one (graphxform.contract;
    a pass that finds it says so in the same words, not as a pass failing)."""


def clip(text: str, limit: int = QUOTE_LIMIT) -> str:
    """``text`` on one line and at most about ``limit`` characters: the head (where) and the
    tail (what went wrong) of a long quote survive, the middle is counted, not shown."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    tail = limit // 3
    head = limit - tail
    return f"{text[:head]} ...[{len(text) - head - tail} chars]... {text[-tail:]}"


# Lines of a TF error that say nothing about what failed.
_TF_NOISE = re.compile(r"^(Graph execution error:|Detected at node|File \"|=+$|\[\[|"
                       r"\d+ root error\(s\) found|\d+ successful operations|"
                       r"\d+ derived errors ignored|From /job:\S*:$)")
_TF_STATUS = re.compile(r"^(?:\(\d+\)\s+)?(?:[A-Z][A-Z_]+:\s+)?")  # "(0) INVALID_ARGUMENT: "
_TF_NODE_LINE = re.compile(r"^Node: '([^']*)'")
_TF_NODE_TAG = re.compile(r"\{\{node ([^}]+)\}\}")


def tf_error_line(error) -> str:
    """One line for a TensorFlow error: what TF said and, where it names one, the node
    (``node save/RestoreV2: Unable to open table file ...``). TF's runtime errors start with
    "Graph execution error:" and a stack of where the node was built; the reason follows the
    ``Node: '...'`` line."""
    text = getattr(error, "message", None) or str(error)
    lines = [_TF_STATUS.sub("", line.strip()) for line in text.splitlines()]
    node = None
    for index, line in enumerate(lines):  # the reason follows the last of them
        match = _TF_NODE_LINE.match(line)
        if match:
            node, reason_from = match.group(1), index + 1
    if node is not None:
        lines = lines[reason_from:]
    reason = next((line for line in lines if line and not _TF_NOISE.match(line)), "")
    if node is None:
        op = getattr(error, "op", None)
        node = getattr(op, "name", None)
    if node is None:
        tags = _TF_NODE_TAG.findall(text)
        node = tags[0] if tags else None
    reason = clip(reason or type(error).__name__, 2 * QUOTE_LIMIT)
    return f"node {node}: {reason}" if node else reason
