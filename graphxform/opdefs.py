"""TF's op registry, asked about what the IR needs: output arity, input arg names, statefulness.

Ops defined as functions in the graph's library count too (their signature is their OpDef).
"""

from __future__ import annotations

import functools

from graphxform.errors import GraphxformError


@functools.lru_cache(maxsize=None)
def registered(op_type: str):
    """The OpDef registered for ``op_type``, or None."""
    from tensorflow.python.framework import op_def_registry
    return op_def_registry.get(op_type)


def op_def(ir, op_type: str):
    found = registered(op_type)
    if found is not None:
        return found
    for function in ir.meta.graph_def.library.function:
        if function.signature.name == op_type:
            return function.signature
    return None


def _arg_count(arg, attrs, op_def_) -> int:
    if arg.number_attr:
        return _attr(attrs, op_def_, arg.number_attr).i
    if arg.type_list_attr:
        return len(_attr(attrs, op_def_, arg.type_list_attr).list.type)
    return 1


def _attr(attrs, op_def_, name):
    if name in attrs:
        return attrs[name]
    for attr in op_def_.attr:
        if attr.name == name and attr.HasField("default_value"):
            return attr.default_value
    raise GraphxformError(f"op {op_def_.name} needs attr '{name}'")


def num_outputs(ir, name: str) -> int | None:
    """How many outputs node ``name`` has (None when its op is unknown)."""
    data = ir.node(name)
    found = op_def(ir, data["op"])
    if found is None:
        return None
    attrs = ir.attrs(name)
    return sum(_arg_count(arg, attrs, found) for arg in found.output_arg)


def input_ports(ir, name: str) -> dict[str, list[int]]:
    """Input arg name -> the dst ports it covers, e.g. {'var': [0], 'grad': [9]}."""
    data = ir.node(name)
    found = op_def(ir, data["op"])
    if found is None:
        raise GraphxformError(f"node '{name}': unknown op {data['op']}")
    ports, start, attrs = {}, 0, ir.attrs(name)
    for arg in found.input_arg:
        count = _arg_count(arg, attrs, found)
        ports[arg.name] = list(range(start, start + count))
        start += count
    return ports


def resource_or_ref_inputs(ir, name: str) -> list[str]:
    """Names of input args that carry a variable (DT_RESOURCE or a ref), in order."""
    from tensorflow.core.framework import types_pb2
    found = op_def(ir, ir.op(name))
    if found is None:
        return []
    return [arg.name for arg in found.input_arg
            if arg.type == types_pb2.DT_RESOURCE or arg.is_ref]


def is_stateful(ir, op_type: str) -> bool:
    found = op_def(ir, op_type)
    return bool(found is not None and getattr(found, "is_stateful", False))


def output_dtype(ir, name: str, port: int) -> int | None:
    """The DataType enum of output ``port`` of ``name``, or None when it cannot be told."""
    data = ir.node(name)
    found = op_def(ir, data["op"])
    if found is None:
        return None
    attrs = ir.attrs(name)
    index = 0
    for arg in found.output_arg:
        count = _arg_count(arg, attrs, found)
        if port < index + count:
            if arg.type:
                return arg.type
            if arg.type_attr:
                return _attr(attrs, found, arg.type_attr).type
            if arg.type_list_attr:
                return _attr(attrs, found, arg.type_list_attr).list.type[port - index]
            return None
        index += count
    return None


def recorded_dims(ir, name: str, port: int) -> list[int] | None:
    """The dimensions (-1: unknown) export_meta_graph recorded for output ``port`` of
    ``name`` in ``_output_shapes``; None when it recorded none or an unknown rank."""
    shapes = ir.attrs(name).get("_output_shapes")
    if shapes is None or port >= len(shapes.list.shape):
        return None
    shape = shapes.list.shape[port]
    return None if shape.unknown_rank else [d.size for d in shape.dim]
