"""Build the NodeDefs passes add: attrs are given as Python values and typed from the op's
OpDef, missing attrs get the OpDef's defaults, so emitted nodes look like TF's own."""

from __future__ import annotations

import functools

import numpy as np
from tensorflow.core.framework import attr_value_pb2, node_def_pb2, tensor_shape_pb2

from graphxform import opdefs
from graphxform.errors import GraphxformError
from graphxform.ir import GraphIR


def replica_prefix(index: int) -> str:
    return f"replica_{index}/"


def _shape_proto(shape) -> tensor_shape_pb2.TensorShapeProto:
    if shape is None:
        return tensor_shape_pb2.TensorShapeProto(unknown_rank=True)
    return tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=-1 if d is None else int(d))
             for d in shape])


def attr_value(kind: str, value) -> attr_value_pb2.AttrValue:
    """An AttrValue of the OpDef attr type ``kind`` ('type', 'int', 'list(type)', ...)."""
    av = attr_value_pb2.AttrValue()
    if kind == "type":
        av.type = int(value)
    elif kind == "int":
        av.i = int(value)
    elif kind == "float":
        av.f = float(value)
    elif kind == "bool":
        av.b = bool(value)
    elif kind == "string":
        av.s = value.encode() if isinstance(value, str) else value
    elif kind == "shape":
        av.shape.CopyFrom(_shape_proto(value))
    elif kind == "tensor":
        av.tensor.CopyFrom(value)
    elif kind == "list(type)":
        av.list.type.extend(int(v) for v in value)
    elif kind == "list(string)":
        av.list.s.extend(v.encode() if isinstance(v, str) else v for v in value)
    elif kind == "list(int)":
        av.list.i.extend(int(v) for v in value)
    elif kind == "list(shape)":
        av.list.shape.extend(_shape_proto(v) for v in value)
    else:
        raise GraphxformError(f"cannot build attr of kind {kind}")
    return av


@functools.lru_cache(maxsize=None)
def _op_attrs(op_type: str) -> tuple[dict, dict, list]:
    """(attr name -> kind, attr name -> default AttrValue, attrs without default) of an op:
    read from its OpDef once, not once per node a pass adds."""
    op_def = opdefs.registered(op_type)
    if op_def is None:
        raise GraphxformError(f"unknown op type {op_type}")
    kinds = {a.name: a.type for a in op_def.attr}
    defaults = {a.name: a.default_value for a in op_def.attr if a.HasField("default_value")}
    return kinds, defaults, [name for name in kinds if name not in defaults]


_SCALAR_FIELDS = {"int32": "int_val", "int64": "int64_val", "float32": "float_val",
                  "float64": "double_val", "bool": "bool_val"}


def const_value(ir: GraphIR, name: str):
    """The numpy value of the Const ``name``; None when it is another op."""
    if ir.op(name) != "Const":
        return None
    from tensorflow.python.framework import tensor_util
    return tensor_util.MakeNdarray(ir.attrs(name)["value"].tensor)


def shape_entry(ir: GraphIR, src: str, port: int, ints) -> tuple[str, int] | None:
    """``src:port`` as entry k of a vector x (``tf.shape(t)[k]``: a StridedSlice from k to
    k + 1 with stride 1 that shrinks the axis away): (x's node, k), else None. ``ints(node,
    port)`` gives a constant's integer values (None for what is not constant)."""
    if ir.op(src) != "StridedSlice" or port != 0:
        return None
    shrink = ir.attrs(src).get("shrink_axis_mask")
    if shrink is None or shrink.i != 1:
        return None
    (vector, _), begin, end, strides = ir.inputs(src)
    begin, end, strides = (ints(*entry) for entry in (begin, end, strides))
    if begin is None or len(begin) != 1 or end != [begin[0] + 1] or strides != [1]:
        return None
    return vector, begin[0]


def tensor_proto(array: np.ndarray):
    """What tensor_util.make_tensor_proto makes of a numeric array (one value: the typed field;
    otherwise the raw bytes), without its generic checks, which cost most of a Const."""
    from tensorflow.core.framework import tensor_pb2
    from tensorflow.python.framework import dtypes, tensor_util
    field = _SCALAR_FIELDS.get(array.dtype.name)
    if array.dtype.kind not in "biuf" or (array.size == 1 and field is None):
        return tensor_util.make_tensor_proto(array)
    proto = tensor_pb2.TensorProto(dtype=dtypes.as_dtype(array.dtype).as_datatype_enum)
    proto.tensor_shape.dim.extend(tensor_shape_pb2.TensorShapeProto.Dim(size=d)
                                  for d in array.shape)
    if array.size == 1:
        getattr(proto, field).append(array.item())
    else:
        proto.tensor_content = array.tobytes()
    return proto


class Builder:
    """Adds nodes to ``ir`` on behalf of one pass (recorded as their ``created_by``).

    A pass adds thousands of nodes that differ only in name, inputs and device (a Reshape per
    gradient per replica, an Assign per variable per replica), so the NodeDef of each distinct
    (op type, attrs) and of each distinct Const value is built once, as a template, and every
    node is one copy of it."""

    def __init__(self, ir: GraphIR, created_by: str):
        self.ir = ir
        self.created_by = created_by
        self._templates = {}  # (op type, attrs made hashable) -> NodeDef with op and attrs
        self._consts = {}  # (dtype, shape, bytes) of a numeric Const's value -> its NodeDef

    def op(self, name: str, op_type: str, inputs=(), *, device: str = "", **attrs) -> str:
        return self._add(name, self._find(name, op_type, attrs), inputs, device)

    def ops(self, op_type: str, rows: list[tuple], **attrs) -> list[str]:
        """``op`` for many nodes of one op type and attrs: ``rows`` of (name, inputs, device)."""
        if not rows:
            return []
        template = self._find(rows[0][0], op_type, attrs)
        return self.ir.add_nodes(template, rows, created_by=self.created_by)

    def _find(self, name: str, op_type: str, attrs: dict):
        """The template NodeDef for ``op_type`` with ``attrs`` (made for node ``name``)."""
        try:
            key = (op_type, tuple([(k, _hashable(v)) for k, v in attrs.items()]))
            template = self._templates.get(key)
        except TypeError:  # an unhashable value (a TensorProto, an array): no template
            key = template = None
        if template is None:
            template = self._template(name, op_type, attrs)
            if key is not None:
                self._templates[key] = template
        return template

    def const(self, name: str, value, dtype=None, *, device: str = "") -> str:
        array = np.asarray(value, dtype=dtype)
        if array.dtype.kind not in "biuf":  # strings: bytes of object arrays are pointers
            return self._const(name, array, device)
        key = (array.dtype.str, array.shape, array.tobytes())
        template = self._consts.get(key)
        if template is None:
            proto = tensor_proto(array)
            template = self._consts[key] = self._template(
                name, "Const", {"dtype": proto.dtype, "value": proto})
        return self._add(name, template, (), device)

    def _const(self, name: str, array: np.ndarray, device: str) -> str:
        proto = tensor_proto(array)
        return self.op(name, "Const", device=device, dtype=proto.dtype, value=proto)

    def _template(self, name: str, op_type: str, attrs: dict):
        """A NodeDef holding ``op_type`` and its attrs: those given, typed from the OpDef, then
        the OpDef's defaults for the rest."""
        kinds, defaults, required = _op_attrs(op_type)
        template = node_def_pb2.NodeDef(op=op_type)
        for key, value in attrs.items():
            if key not in kinds:
                raise GraphxformError(f"op {op_type} has no attr '{key}'")
            template.attr[key].CopyFrom(attr_value(kinds[key], value))
        for key in required:
            if key not in attrs:
                raise GraphxformError(f"node '{name}': op {op_type} needs attr '{key}'")
        for key in kinds:  # in OpDef order
            if key not in attrs:
                template.attr[key].CopyFrom(defaults[key])
        return template

    def replace(self, name: str, op_type: str, inputs, *, device: str = "", **attrs) -> str:
        """A new node that takes the place of ``name``: same name, and every consumer (data,
        port by port, and control) reads it instead. Passes that rewrite an op into several
        keep its name this way, so fetches and later passes still find it."""
        return self._replace(name, lambda: self.op(name, op_type, inputs, device=device,
                                                   **attrs))

    def replace_like(self, name: str, like: str, inputs, *, device: str = "") -> str:
        """``replace`` by a node with the op type and attrs of node ``like``."""
        return self._replace(name, lambda: self.ir.add_node(
            name, self.ir.op(like), inputs, device=device, attr=dict(self.ir.attrs(like)),
            created_by=self.created_by))

    def _replace(self, name: str, add) -> str:
        origin = self.ir.node(name).get("origin")
        if not self.ir.g._succ[name]:  # nothing reads it: no consumers to move
            self.ir.remove_node(name)
            add()
            self.ir.node(name)["origin"] = origin
            return name
        stand_in = self.ir.unique_name(name + "/replaced")
        self.op(stand_in, "NoOp")
        self.ir.replace_all_uses_with(name, stand_in)
        self.ir.remove_node(name)
        add()
        self.ir.node(name)["origin"] = origin  # still the copy of the same original
        self.ir.replace_all_uses_with(stand_in, name)
        self.ir.remove_node(stand_in)
        return name

    def _add(self, name: str, template, inputs, device: str) -> str:
        return self.ir.add_nodes(template, [(name, inputs, device)], created_by=self.created_by)[0]


def _hashable(value):
    """``value`` as a template key: lists become tuples; a float keeps its sign and NaN-ness
    (0.0 == -0.0 would otherwise share a template)."""
    kind = type(value)
    if kind is int or kind is str:
        return value
    if isinstance(value, (list, tuple)):
        return tuple([_hashable(v) for v in value])
    if isinstance(value, (float, np.floating)):
        return float, float(value).hex()
    return value


def numpy_dtype(enum_value: int):
    from tensorflow.python.framework import dtypes
    return dtypes.as_dtype(enum_value).as_numpy_dtype
