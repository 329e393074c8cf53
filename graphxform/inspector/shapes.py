"""Static values and shapes of the few tensors the checks compare (a collective's keys and
input), read from the graph without running or importing it into TensorFlow: a Const's value,
a recorded ``_output_shapes``, and the ops passes put in front of collectives (Reshape to -1,
ConcatV2, SplitV, Pack, Identity). Anything else is unknown (None), and the checks then compare
what they can: an unknown shape never makes a finding.

A value that is not constant (a sparse gather's instance key is a base plus the padded
length) is described by an expression over folded names (``AddV2(16777216, replica_*/...)``),
so replicas can still be compared with each other."""

from __future__ import annotations

import math

from graphxform.inspector.scopes import fold_name
from graphxform.ir import GraphIR
from graphxform.replica_spread import SPLIT_SCOPE

_PASS_THROUGH = {"Identity", "StopGradient", "Snapshot", "PreventGradient", "EnsureShape",
                 "CheckNumerics"}
_ELEMENTWISE = {"Cast", "Neg", "RealDiv", "Mul", "Div", "AddV2", "Add", "Sub", "DivNoNan",
                "Relu", "Sqrt", "Rsqrt", "Square"}
_EXPRESSION_DEPTH = 6


def const_value(ir: GraphIR, node: str, decoded: dict | None = None):
    """The numpy value of a Const (through Identity), else None. ``decoded``: values already
    made, by the TensorProto's bytes (the replicas' copies of one Const hold the same), which
    the caller does not change."""
    for _ in range(8):
        op = ir.op(node)
        if op == "Const":
            tensor = ir.attrs(node)["value"].tensor
            if decoded is None:
                return _ndarray(tensor)
            key = tensor.SerializeToString()
            value = decoded.get(key)
            if value is None:
                value = decoded[key] = _ndarray(tensor)
                value.flags.writeable = False  # shared by every Const holding these bytes
            return value
        if op not in _PASS_THROUGH or not ir.inputs(node):
            return None
        node = ir.inputs(node)[0][0]
    return None


def _ndarray(tensor):
    from tensorflow.python.framework import tensor_util
    return tensor_util.MakeNdarray(tensor)


_SLICE_PARTS = {"Split": ("",), "SplitV": ("",),
                "SparseSplit": ("indices of the ", "values of the ", "shape of the ")}


def describe(ir: GraphIR, node: str, port: int = 0, depth: int = 0,
             decoded: dict | None = None) -> str:
    """A constant as its value ('3'); anything else as an expression over folded names.
    ``decoded`` as for const_value."""
    value = const_value(ir, node, decoded)
    if value is not None:
        return str(value.tolist())
    if node.startswith(SPLIT_SCOPE) and ir.op(node) in _SLICE_PARTS:
        # each replica reads its own output of split-inputs' split: its slice of the batch
        parts = _SLICE_PARTS[ir.op(node)]
        return f"{node}:{parts[port // max(ir.attrs(node)['num_split'].i, 1)]}slice"
    if depth >= _EXPRESSION_DEPTH or not ir.inputs(node):
        return fold_name(node)[0] + (f":{port}" if port else "")
    args = ", ".join(describe(ir, src, p, depth + 1, decoded) for src, p in ir.inputs(node))
    return f"{ir.op(node)}({args})"


class Shapes:
    """Static shapes, memoised: ``of(node, port)`` -> list of ints (-1 unknown), or None."""

    def __init__(self, ir: GraphIR):
        self.ir = ir
        self.memo: dict = {}
        self._decoded: dict = {}  # TensorProto bytes -> its value (const_value's ``decoded``)

    def _const(self, node: str):
        return const_value(self.ir, node, self._decoded)

    def describe(self, node: str, port: int = 0) -> str:
        """``describe``, decoding each TensorProto once."""
        return describe(self.ir, node, port, decoded=self._decoded)

    def of(self, node: str, port: int = 0, depth: int = 0):
        key = (node, port)
        if key not in self.memo:
            self.memo[key] = None if depth > 40 else self._infer(node, port, depth)
        return self.memo[key]

    def _recorded(self, node: str, port: int):
        attrs = self.ir.attrs(node)
        if "_output_shapes" not in attrs:
            return None
        shapes = attrs["_output_shapes"].list.shape
        if port >= len(shapes) or shapes[port].unknown_rank:
            return None
        return [d.size for d in shapes[port].dim]

    def _infer(self, node: str, port: int, depth: int):
        ir, op = self.ir, self.ir.op(node)
        recorded = self._recorded(node, port)
        if recorded is not None and all(d >= 0 for d in recorded):
            return recorded
        inputs = ir.inputs(node)
        shape = lambda k: self.of(inputs[k][0], inputs[k][1], depth + 1) if k < len(
            inputs) else None
        if op == "Const":
            return list(self._const(node).shape)
        if op in _PASS_THROUGH or op in _ELEMENTWISE:
            known = [s for s in (shape(k) for k in range(len(inputs))) if s]
            return max(known, key=len) if known else recorded
        if op == "Reshape":
            return self._reshape(shape(0), self._const(inputs[1][0]))
        if op == "ConcatV2":
            return self._concat([shape(k) for k in range(len(inputs) - 1)],
                                self._const(inputs[-1][0]))
        if op == "SplitV":
            sizes, axis = self._const(inputs[1][0]), self._const(inputs[2][0])
            whole = shape(0)
            if sizes is None or axis is None or whole is None:
                return recorded
            out = list(whole)
            out[int(axis)] = int(sizes.reshape(-1)[port])
            return out
        if op == "Pack":
            first = shape(0)
            return None if first is None else [len(inputs)] + first
        return recorded

    @staticmethod
    def _reshape(source, target):
        if target is None:
            return None
        target = [int(d) for d in target.reshape(-1)]
        if -1 in target:
            if source is None or any(d < 0 for d in source):
                return None
            known = math.prod(d for d in target if d != -1) or 1
            target[target.index(-1)] = math.prod(source) // known
        return target

    @staticmethod
    def _concat(parts, axis):
        if axis is None or any(p is None for p in parts) or not parts:
            return None
        axis = int(axis)
        out = list(parts[0])
        out[axis] = sum(p[axis] for p in parts)
        return out
