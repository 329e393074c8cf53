"""Custom gradients that would see a replica's incoming gradient at another scale.

Each replica minimises the mean loss of its own slice, so every gradient flowing back through
a replica is N times the one device's at the same example (the loss divides by B/N, not B);
averaging the variables' gradients across the N replicas undoes the factor. That is exact
only while everything between the loss and the variables is linear in the incoming gradient,
which TensorFlow's own gradient functions are. A custom gradient (``tf.custom_gradient``, or
``gradient_override_map`` onto a registered function) may not be: one that clips the
incoming gradient clips at N times the threshold and trains something else, silently.

``nonlinear_custom_gradient`` finds, in a step's backward pass, the first op of a custom
gradient function that is computed from the incoming gradient by an op not known to be
linear in it; the contract refuses such a step.

Float16 arithmetic is linear only inside its range. A float16 backward pass (mixed precision
with loss scaling: NVIDIA's float32-master-weights getter, tf_keras' mixed_float16 with a
LossScaleOptimizer) carries every per-example gradient at N times one device's, so a loss
scale chosen near the top of float16's range (65504) overflows in a replica where one device
did not: infinite gradients, skipped steps and, with a dynamic scale, another schedule.
``half_precision_gradient`` finds such a backward op; the contract refuses the step. bfloat16
has float32's range and is not refused.
"""

from __future__ import annotations

from graphxform.training import REPLICA_SCOPE, gradient_scope

# ops whose output is linear in any one input the incoming gradient reaches (or, for shapes
# and fills, does not depend on its values)
LINEAR_OPS = frozenset({
    "Identity", "IdentityN", "Snapshot", "StopGradient", "PreventGradient", "CheckNumerics",
    "Neg", "Mul", "MulNoNan", "RealDiv", "Div", "DivNoNan", "Add", "AddV2", "AddN", "Sub",
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "Reshape",
    "Transpose", "ExpandDims", "Squeeze", "Sum", "Mean", "Tile", "BroadcastTo", "Concat",
    "ConcatV2", "Pack", "Unpack", "Split", "SplitV", "Slice", "StridedSlice", "Pad", "PadV2",
    "MirrorPad", "Reverse", "ReverseV2", "Cumsum", "Select", "SelectV2", "Cast", "Gather",
    "GatherV2", "GatherNd", "ScatterNd", "UnsortedSegmentSum", "SegmentSum", "Conj", "Real",
    "Imag", "Shape", "ShapeN", "Size", "Rank", "ZerosLike", "OnesLike", "Fill",
    "Conv2DBackpropInput", "Conv2DBackpropFilter", "BiasAddGrad", "ReluGrad", "Relu6Grad",
    "EluGrad", "SeluGrad", "LeakyReluGrad", "TanhGrad", "SigmoidGrad", "SoftplusGrad",
    "NoOp",
})
OVERRIDE_ATTR = "_gradient_op_type"  # set by tf.custom_gradient and gradient_override_map
HALF = 19  # DataType enum DT_HALF (float16)


def nonlinear_custom_gradient(ir, closure, name_of=lambda name: name) -> tuple | None:
    """(forward op, gradient op) for the first op of a custom gradient in ``closure`` (the
    step's nodes, input names) that applies an op not in LINEAR_OPS to the incoming gradient,
    or None. ``name_of`` maps an input name to its node in ``ir`` (replica 0's copy)."""
    node_table, attrs = ir.g._node, ir.attrs
    custom = sorted(name for name, node in zip(closure, map(name_of, closure))
                    if node in node_table and OVERRIDE_ATTR in attrs(node)
                    and gradient_scope(name) is None)
    if not custom:
        return None
    groups = _gradient_groups(closure)
    for forward in custom:
        for scope in sorted(groups.get(forward, {})):
            found = _first_nonlinear(ir, groups[forward][scope], name_of)
            if found is not None:
                return forward, found
    return None


def half_precision_gradient(ir, closure, name_of=lambda name: name) -> str | None:
    """The first node (by name) of a gradients scope in ``closure`` whose output is float16,
    or None. ``name_of`` as for ``nonlinear_custom_gradient``."""
    from graphxform.opdefs import output_dtype
    node_table = ir.g._node
    for name in sorted(n for n in closure if gradient_scope(n) is not None):
        node = name_of(name)
        if node in node_table and output_dtype(ir, node, 0) == HALF:
            return name
    return None


def _gradient_groups(closure) -> dict:
    """forward op name -> {gradients scope: the nodes of its gradient function there}:
    tf.gradients names them ``<scope><forward op>_grad/...``."""
    groups = {}
    for name in closure:
        scope = gradient_scope(name)
        if scope is None:
            continue
        rest = name[len(scope):]
        cut = rest.rfind("_grad/")
        if cut > 0:
            groups.setdefault(rest[:cut], {}).setdefault(scope, set()).add(name)
    return groups


def _first_nonlinear(ir, group: set, name_of) -> str | None:
    """The first node of ``group`` (sorted by name) that the incoming gradient reaches and
    whose op is not linear; the gradient enters from gradients-scope nodes outside the
    group."""
    reached = {}

    def reaches(name):
        if name not in reached:
            reached[name] = False  # a cycle (a while loop's back edge) reaches nothing more
            reached[name] = any(
                (src in group and reaches(src)) or
                (src not in group and gradient_scope(src) is not None)
                for src in (REPLICA_SCOPE.sub("", s, count=1)
                            for s, _ in ir.inputs(name_of(name))))
        return reached[name]

    for name in sorted(group):
        if name_of(name) in ir and reaches(name) and ir.op(name_of(name)) not in LINEAR_OPS:
            return name
    return None
