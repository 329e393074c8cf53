"""sync-batch-norm: every training-mode batch norm normalises with the statistics of the whole
global batch, and its gradient uses the global sums, so replicas train like one device.

Each replica's FusedBatchNorm (V1/V2/V3, `is_training`) is rewritten into plain ops around
two all-reduces (sum) across the replicas, in a numerically stable two-pass form:
  1. per channel, the replica's sum of x and its element count -> global mean;
  2. the replica's sum of (x - mean)^2 -> global (biased) variance;
  y = (x - mean) * rsqrt(var + eps) * scale + offset.
Its outputs keep their ports: the batch mean, and the variance with Bessel's correction
n/(n-1) over the global count, as TF's kernel gives the moving averages (mixed with the
running values when `exponential_avg_factor` != 1).

The matching FusedBatchNormGrad becomes, with xhat = (x - mean) * rstd and sums over the
replica's own elements, all-reduced (sum) in one collective:
  dx = scale * rstd * (dy - sum_all(dy) / n - xhat * sum_all(dy * xhat) / n)
  dscale = sum(dy * xhat), doffset = sum(dy)  (local: all-reduce averages them with the
  other gradients, as for any variable).
Each replica's loss is a mean over its slice, so its dy is R times the single-device one on
those rows; the formulas above then give R times the single-device dx, which the all-reduce
mean of the weight gradients divides back. A batch norm that several train ops' tf.gradients
run through (a GAN's discriminator, in d_train and g_train) has a gradient in each: every one
is rewritten, with collectives of its own. Both rewritten ops keep their names (an IdentityN
of the new outputs), so the rest of the graph is untouched.

The `moments` + `batch_normalization` form (tf.nn.moments, and tf_keras's non-fused batch
norm) needs no formula of its own: its two Means over the batch (`moments/mean`, then
`moments/variance` of the squared distance to that mean, which is so already two-pass) become
global means: the replica's Sum and element count, all-reduced, divided. Their gradients
(`<gradients>/<mean>_grad`: the upstream gradient broadcast, divided by the count) then
broadcast the upstream gradient summed over all replicas and divide by the global count,
which is the same R-times scaling as above."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from graphxform import opdefs, replica_values
from graphxform.errors import GraphxformError
from graphxform.functions import batch_norm_in_function, out_of_reach
from graphxform.nodes import Builder, replica_prefix
from graphxform.pipeline import Pass, PassResult

SCOPE = "sync_batch_norm/"
FUSED = {"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"}
FUSED_GRAD = {"FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3"}
INSTANCE_KEYS = 1 << 22  # apart from all-reduce's keys (1, 2, ... and 1 << 24 on)
GROUP_KEY = 1
INT32, FLOAT = 3, 1


@dataclasses.dataclass
class SyncBatchNorm(Pass):
    name = "sync-batch-norm"

    def run(self, ir, ctx):
        prefix = replica_prefix(0)
        inside = batch_norm_in_function(ir, {prefix + n for n in ctx.training.train_closure})
        if inside:
            raise out_of_reach("--sync-batch-norm", ir, prefix, inside,
                               "runs a training-mode batch norm",
                               "a tf.cond with control flow v2, as Keras and "
                               "tf.compat.v1.layers branch on a training flag that is a tensor",
                               "pass training=True as a Python bool, ")
        layers = _training_batch_norms(ir)
        moments = _moment_means(ir)
        if not layers and not moments:
            return PassResult(modified=False, summary={"batch_norms_synchronised": 0})
        grads = _gradients_of(ir, layers)
        build = Builder(ir, self.name)
        replicas = len(ctx.devices)
        keys = itertools.count(INSTANCE_KEYS)  # one per collective: each runs on its own
        for mean, scopes in moments:
            forward_key = next(keys)
            backward_keys = [next(keys) for _ in scopes]
            for i in range(replicas):
                prefix = replica_prefix(i)
                count = _rewrite_mean(ir, build, prefix + mean, ctx.devices[i], replicas,
                                      forward_key)
                for scope, key in zip(scopes, backward_keys):
                    _rewrite_mean_gradient(ir, build, prefix + scope, ctx.devices[i],
                                           replicas, key, count)
        for layer in layers:
            forward_keys = (next(keys), next(keys))
            backward_keys = [next(keys) for _ in grads[layer]]
            for i in range(replicas):
                node = replica_prefix(i) + layer
                if node not in ir:
                    continue
                stats = _rewrite_forward(ir, build, node, ctx.devices[i], replicas, forward_keys)
                for grad, key in zip(grads[layer], backward_keys):
                    if replica_prefix(i) + grad in ir:
                        _rewrite_gradient(ir, build, replica_prefix(i) + grad,
                                          ctx.devices[i], replicas, key, stats)
        return PassResult(modified=True, summary={
            "batch_norms_synchronised": len(layers) + len(moments) // 2,
            "collectives_per_replica": 2 * len(layers) + sum(map(len, grads.values()))
            + len(moments) + sum(len(scopes) for _, scopes in moments)})


def _is_training_attr(attrs) -> bool:
    return "is_training" not in attrs or attrs["is_training"].b


def _training_batch_norms(ir) -> list[str]:
    """Original names of the training-mode fused batch norms that replica 0 runs."""
    prefix = replica_prefix(0)
    return sorted(n[len(prefix):] for n in ir.nodes_of(FUSED)
                  if n.startswith(prefix) and _is_training_attr(ir.attrs(n)))


def _gradients_of(ir, layers) -> dict:
    """Batch norm -> its FusedBatchNormGrads (original names), which read the forward's reserve
    outputs: one per tf.gradients call through it (a GAN's d_train and g_train both run
    through the discriminator's), each synchronised, or that step would use local sums."""
    prefix = replica_prefix(0)
    return {layer: sorted({dst[len(prefix):] for dst, port in ir.consumers(prefix + layer)
                           if port >= 3 and ir.op(dst) in FUSED_GRAD})
            for layer in layers}


def _moment_means(ir) -> list[tuple[str, list[str]]]:
    """(Mean, its gradients' scopes) of every tf.nn.moments in replica 0 that averages over the
    batch (axis 0 among its reduction indices), original names: a scope per tf.gradients call
    through it (several train ops), every one synchronised."""
    from graphxform.training import gradient_scope
    prefix = replica_prefix(0)
    scopes = {gradient_scope(n[len(prefix):]) for n in ir.nodes_of({"RealDiv"})
              if n.startswith(prefix)} - {None}
    found = []
    for node in sorted(ir.nodes_of({"Mean"})):
        name = node[len(prefix):]
        if not node.startswith(prefix) or not name.endswith(("moments/mean",
                                                             "moments/variance")):
            continue
        if 0 not in _const_ints(ir, ir.input(node, 1)[0]):
            continue
        grads = [scope + name + "_grad/" for scope in sorted(scopes)
                 if prefix + scope + name + "_grad/truediv" in ir]
        found.append((name, grads))
    return found


def _const_ints(ir, node) -> list[int]:
    from tensorflow.python.framework import tensor_util
    if ir.op(node) != "Const":
        return []
    return [int(v) for v in np.ravel(tensor_util.MakeNdarray(ir.attrs(node)["value"].tensor))]


def _rewrite_mean(ir, build, node, device, replicas, key) -> str:
    """The Mean ``node`` over the batch becomes the global mean; returns the global count.

    The sums and the count travel stacked ([2, <sum's shape>], the count filled out to that
    shape), so that the global sum, the count and the mean are unstacked from the collective's
    result alone: no shape is taken from the replica's own tensors, and the contract sees them
    equal on every replica (an exponential moving average of the synced moments, the TF1
    batch-norm helper's, is then one device's)."""
    attrs = ir.attrs(node)
    dtype = attrs["T"].type
    ops = _Ops(build, SCOPE + node + "/", device)
    tensor, axes = ["{}:{}".format(*ir.input(node, k)) for k in (0, 1)]
    keep = attrs["keep_dims"].b if "keep_dims" in attrs else False
    local_sum = ops("local_sum", "Sum", [tensor, axes], T=dtype, Tidx=attrs["Tidx"].type,
                    keep_dims=keep)
    count = ops("local_count", "Cast", [ops("count_int", "FloorDiv", [
        ops("size", "Size", [tensor], T=dtype, out_type=INT32),
        ops("out_size", "Size", [local_sum], T=dtype, out_type=INT32)], T=INT32)],
        SrcT=INT32, DstT=dtype)
    counts = ops("local_counts", "Fill", [ops("sum_shape", "Shape", [local_sum], T=dtype,
                                              out_type=INT32), count], T=dtype,
                 index_type=INT32)
    packed = ops("sums", "Pack", [local_sum, counts], N=2, T=dtype, axis=0)
    total = _all_reduce_sum(ops, "all_sums", packed, replicas, key, dtype)
    parts = ops("unstack_sums", "Unpack", [total], num=2, T=dtype, axis=0)
    global_count = ops("global_count", "GatherV2", [
        ops("flat_counts", "Reshape", [f"{parts}:1", ops.const("flat_shape", [-1], np.int32)],
            T=dtype, Tshape=INT32),
        ops.const("first", 0, np.int32), ops.const("axis0", 0, np.int32)],
        Tparams=dtype, Tindices=INT32, Taxis=INT32, batch_dims=0)
    mean = ops("mean", "RealDiv", [f"{parts}:0", global_count], T=dtype)
    build.replace(node, "Identity", [mean], device=device, T=dtype)
    _mark_whole_batch(ir, node)
    return global_count


def _rewrite_mean_gradient(ir, build, scope, device, replicas, key, count) -> None:
    """In the Mean's gradient ``scope``: broadcast the upstream gradient summed over replicas,
    and divide by the global count."""
    broadcast, divide = scope + "BroadcastTo", scope + "truediv"
    if broadcast not in ir or ir.input(divide, 0)[0] != broadcast:
        raise GraphxformError(f"--sync-batch-norm: the gradient of '{scope[:-6]}' is not the "
                              "broadcast-and-divide graphxform knows how to synchronise")
    dtype = ir.attrs(divide)["T"].type
    ops = _Ops(build, SCOPE + scope, device)
    upstream = "{}:{}".format(*ir.input(broadcast, 0))
    ir.set_input(broadcast, 0, _all_reduce_sum(ops, "all_upstream", upstream, replicas, key,
                                               dtype) + ":0")
    ir.set_input(divide, 1, count + ":0")


class _Ops:
    """Builder calls for one replica's rewrite: its scope and device on every node."""

    def __init__(self, build, scope, device):
        self.build, self.scope, self.device = build, scope, device

    def __call__(self, name, op_type, inputs, **attrs):
        return self.build.op(self.scope + name, op_type, inputs, device=self.device, **attrs)

    def const(self, name, value, dtype):
        return self.build.const(self.scope + name, value, dtype, device=self.device)

    def whole_batch(self, name, tensor, dtype):
        """An Identity of ``tensor``, a statistic of the whole global batch, marked as the value
        one device computes (replica_values reads a collective's result as merely the same on
        every replica), so that what the batch norm normalises is per-example again, and
        fetching it gives every replica's rows."""
        node = self(name, "Identity", [tensor], T=dtype)
        _mark_whole_batch(self.build.ir, node)
        return node


def _mark_whole_batch(ir, node: str) -> None:
    ir.node(node)["attr"][replica_values.REBATCHED_ATTR].s = replica_values.IDENTICAL.encode()


def _channel_layout(ir, node):
    """(axes summed over, shape a per-channel vector broadcasts as) for the data format."""
    attrs = ir.attrs(node)
    fmt = attrs["data_format"].s.decode() if "data_format" in attrs else "NHWC"
    if fmt in ("NHWC", "NDHWC"):
        rank = len(fmt)
        return list(range(rank - 1)), None
    if fmt in ("NCHW", "NCDHW"):
        rank = len(fmt)
        return [0] + list(range(2, rank)), [1, -1] + [1] * (rank - 2)
    raise GraphxformError(f"--sync-batch-norm: '{node}' has data format {fmt}")


def _all_reduce_sum(ops, name, tensor, replicas, key, dtype):
    size = ops.const(name + "_group_size", replicas, np.int32)
    group = ops.const(name + "_group_key", GROUP_KEY, np.int32)
    instance = ops.const(name + "_instance_key", key, np.int32)
    return ops(name, "CollectiveReduceV2", [tensor, size, group, instance], T=dtype,
               merge_op="Add", final_op="Id")


def _rewrite_forward(ir, build, node, device, replicas, keys) -> dict:
    """Replace the fused batch norm ``node`` with its global-statistics form; returns the
    tensors its gradient needs."""
    attrs = ir.attrs(node)
    x_type, u_type = attrs["T"].type, attrs["U"].type if "U" in attrs else FLOAT
    eps = attrs["epsilon"].f if "epsilon" in attrs else 1e-4
    factor = attrs["exponential_avg_factor"].f if "exponential_avg_factor" in attrs else 1.0
    x, scale, offset, running_mean, running_var = [f"{s}:{p}" for s, p in ir.inputs(node)[:5]]
    axes, vector_shape = _channel_layout(ir, node)
    ops = _Ops(build, SCOPE + node + "/", device)
    u_dtype = np.float32 if u_type == FLOAT else np.float64
    if x_type != u_type:
        x = ops("x", "Cast", [x], SrcT=x_type, DstT=u_type)
    axes_c = ops.const("axes", axes, np.int32)
    local_sum = ops("local_sum", "Sum", [x, axes_c], T=u_type, Tidx=INT32)
    size = ops("size", "Size", [x], T=u_type, out_type=INT32)
    channels = ops("channels", "Size", [local_sum], T=u_type, out_type=INT32)
    count = ops("local_count", "Cast", [ops("count_int", "FloorDiv", [size, channels],
                                            T=INT32)], SrcT=INT32, DstT=u_type)
    count_v = ops("local_count_vector", "Reshape", [count, ops.const("one_shape", [1],
                                                                      np.int32)],
                  T=u_type, Tshape=INT32)
    packed = ops("sums", "ConcatV2", [local_sum, count_v, ops.const("axis0", 0, np.int32)],
                 N=2, T=u_type, Tidx=INT32)
    total = _all_reduce_sum(ops, "all_sums", packed, replicas, keys[0], u_type)
    parts = ops("split_sums", "SplitV", [total, ops.const("split_sizes", [-1, 1], np.int32),
                                         ops.const("axis0_split", 0, np.int32)],
                num_split=2, T=u_type, Tlen=INT32)  # sizes from constants: equal everywhere
    global_count = ops("global_count", "Reshape", [f"{parts}:1", ops.const("scalar", [],
                                                                         np.int32)],
                       T=u_type, Tshape=INT32)
    mean = ops.whole_batch("global_mean", ops("mean", "RealDiv", [f"{parts}:0", global_count],
                                              T=u_type), u_type)
    bmean = mean if vector_shape is None else ops(
        "mean_b", "Reshape", [mean, ops.const("vector_shape", vector_shape, np.int32)],
        T=u_type, Tshape=INT32)
    centered = ops("centered", "Sub", [x, bmean], T=u_type)
    squares = ops("local_squares", "Sum", [ops("squared", "Square", [centered], T=u_type),
                                            axes_c], T=u_type, Tidx=INT32)
    total_squares = _all_reduce_sum(ops, "all_squares", squares, replicas, keys[1], u_type)
    variance = ops.whole_batch("global_variance", ops("variance", "RealDiv", [
        total_squares, global_count], T=u_type), u_type)
    rstd = ops("rstd", "Rsqrt", [ops("variance_eps", "AddV2", [
        variance, ops.const("epsilon", eps, u_dtype)], T=u_type)], T=u_type)
    brstd = rstd if vector_shape is None else ops(
        "rstd_b", "Reshape", [rstd, ops.const("vector_shape_2", vector_shape, np.int32)],
        T=u_type, Tshape=INT32)
    bscale = scale if vector_shape is None else ops(
        "scale_b", "Reshape", [scale, ops.const("vector_shape_3", vector_shape, np.int32)],
        T=u_type, Tshape=INT32)
    boffset = offset if vector_shape is None else ops(
        "offset_b", "Reshape", [offset, ops.const("vector_shape_4", vector_shape, np.int32)],
        T=u_type, Tshape=INT32)
    xhat = ops("xhat", "Mul", [centered, brstd], T=u_type)
    y = ops("y", "AddV2", [ops("scaled", "Mul", [xhat, bscale], T=u_type), boffset], T=u_type)
    if x_type != u_type:
        y = ops("y_cast", "Cast", [y], SrcT=u_type, DstT=x_type)
    one = ops.const("one_f", 1.0, u_dtype)
    bessel = ops("bessel", "RealDiv", [global_count, ops("count_less_one", "Maximum", [
        ops("count_minus_one", "Sub", [global_count, one], T=u_type), one], T=u_type)],
        T=u_type)
    unbiased = ops.whole_batch("global_unbiased_variance", ops(
        "unbiased_variance", "Mul", [variance, bessel], T=u_type), u_type)
    out_mean, out_var = mean, unbiased
    if factor != 1.0:
        keep = ops.const("keep", 1.0 - factor, u_dtype)
        take = ops.const("take", factor, u_dtype)
        out_mean = ops("running_mean", "AddV2", [
            ops("old_mean", "Mul", [running_mean, keep], T=u_type),
            ops("new_mean", "Mul", [mean, take], T=u_type)], T=u_type)
        out_var = ops("running_variance", "AddV2", [
            ops("old_variance", "Mul", [running_var, keep], T=u_type),
            ops("new_variance", "Mul", [unbiased, take], T=u_type)], T=u_type)
    outputs = [y, out_mean, out_var, mean, variance, mean][: opdefs.num_outputs(ir, node)]
    types = [x_type] + [u_type] * (len(outputs) - 1)
    build.replace(node, "IdentityN", [f"{t}:0" if ":" not in t else t for t in outputs],
                  device=device, T=types)
    return {"xhat": xhat, "rstd": brstd, "scale": bscale, "count": global_count,
            "axes": axes_c, "u_type": u_type, "x_type": x_type, "vector_shape": vector_shape}


def _rewrite_gradient(ir, build, node, device, replicas, key, stats) -> None:
    """Replace FusedBatchNormGrad ``node`` with the global-sums form (module docstring)."""
    u_type, x_type = stats["u_type"], stats["x_type"]
    ops = _Ops(build, SCOPE + node + "/", device)
    dy = "{}:{}".format(*ir.input(node, 0))
    if x_type != u_type:
        dy = ops("dy", "Cast", [dy], SrcT=x_type, DstT=u_type)
    axes = stats["axes"]
    local_dy = ops("local_dy", "Sum", [dy, axes], T=u_type, Tidx=INT32)
    local_dy_xhat = ops("local_dy_xhat", "Sum", [ops("dy_xhat", "Mul", [dy, stats["xhat"]],
                                                      T=u_type), axes], T=u_type, Tidx=INT32)
    packed = ops("sums", "ConcatV2", [local_dy, local_dy_xhat,
                                      ops.const("axis0", 0, np.int32)], N=2, T=u_type,
                 Tidx=INT32)
    total = _all_reduce_sum(ops, "all_sums", packed, replicas, key, u_type)
    parts = ops("split_sums", "Split", [ops.const("axis0_split", 0, np.int32), total],
                num_split=2, T=u_type)
    mean_dy = ops("mean_dy", "RealDiv", [f"{parts}:0", stats["count"]], T=u_type)
    mean_dy_xhat = ops("mean_dy_xhat", "RealDiv", [f"{parts}:1", stats["count"]], T=u_type)
    shape = stats["vector_shape"]
    if shape is not None:
        mean_dy = ops("mean_dy_b", "Reshape", [mean_dy, ops.const("vector_shape", shape,
                                                                   np.int32)],
                      T=u_type, Tshape=INT32)
        mean_dy_xhat = ops("mean_dy_xhat_b", "Reshape", [
            mean_dy_xhat, ops.const("vector_shape_2", shape, np.int32)], T=u_type,
            Tshape=INT32)
    inner = ops("inner", "Sub", [ops("dy_centered", "Sub", [dy, mean_dy], T=u_type),
                                 ops("xhat_term", "Mul", [stats["xhat"], mean_dy_xhat],
                                     T=u_type)], T=u_type)
    dx = ops("dx", "Mul", [inner, ops("scale_rstd", "Mul", [stats["scale"], stats["rstd"]],
                                      T=u_type)], T=u_type)
    if x_type != u_type:
        dx = ops("dx_cast", "Cast", [dx], SrcT=u_type, DstT=x_type)
    empty = ops.const("reserve", np.zeros([0], np.float32 if u_type == FLOAT else np.float64),
                      None)
    outputs = [dx, local_dy_xhat, local_dy, empty, empty][: opdefs.num_outputs(ir, node)]
    types = [x_type] + [u_type] * (len(outputs) - 1)
    build.replace(node, "IdentityN", [t if ":" in t else f"{t}:0" for t in outputs],
                  device=device, T=types)
