"""all-reduce: average each gradient across replicas with TF collective ops.

Dense gradients are flattened (vectors are flat already) and fused into buckets of at most
`bucket_bytes` (one CollectiveReduceV2 per bucket per replica, then split back), so a model
needs few collectives; buckets run in a fixed order on every replica (each waits on the
previous one) so launches never interleave differently across devices. Sparse gradients
(IndexedSlices) are gathered with CollectiveGatherV2 and scaled by 1/N, never densified,
unless `sparse_as_dense`.

The reduced tensors are recorded for `rewire-consumers`, which points the optimizer at them."""

from __future__ import annotations

import dataclasses

import numpy as np

from graphxform import opdefs
from graphxform.ir import parse_tensor
from graphxform.nodes import Builder, numpy_dtype, replica_prefix
from graphxform.pipeline import Pass, PassResult

SCOPE = "allreduce/"
DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024
GROUP_KEY = 1
INT32 = 3  # DataType enum DT_INT32


@dataclasses.dataclass
class DenseGrad:
    var: str
    tensor: str  # original name of the gradient tensor
    shape: tuple
    dtype: int
    nbytes: int
    sparse: object = None  # the training.Gradient when a sparse gradient is densified


@dataclasses.dataclass
class AllReduce(Pass):
    name = "all-reduce"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    sparse_as_dense: bool = False

    def run(self, ir, ctx):
        tg = ctx.training
        dense, sparse = [], []
        for var in tg.trainable:
            grad = var.gradient
            if grad.kind == "dense" or self.sparse_as_dense:
                dense.append(DenseGrad(var.name, grad.tensor if grad.kind == "dense" else None,
                                       var.shape, var.dtype, var.nbytes or 1,
                                       None if grad.kind == "dense" else grad))
            else:
                sparse.append((var, grad))
        if not dense and not sparse:
            return PassResult(modified=False)
        buckets = self._buckets(reversed(dense))  # last layers' gradients are ready first
        collectives = _Collectives(ir, self.name, ctx.devices)
        previous = [None] * len(ctx.devices)
        for b, bucket in enumerate(buckets):
            previous = collectives.reduce_bucket(b, bucket, previous)
        for j, (var, grad) in enumerate(sparse):
            collectives.gather(j, var, grad)
        ctx.state[self.name] = {"rewires": collectives.rewires,
                               "scope": tg.optimizer.scope if tg.optimizer else ""}
        return PassResult(modified=True, summary={
            "buckets": len(buckets), "sparse_gathers": len(sparse),
            "collectives_per_replica": len(buckets) + 2 * len(sparse),
            "dense_bytes_reduced": sum(g.nbytes for g in dense)})

    def _buckets(self, grads):
        buckets, current, size = [], [], 0
        for g in grads:
            if current and (size + g.nbytes > self.bucket_bytes or g.dtype != current[0].dtype):
                buckets.append(current)
                current, size = [], 0
            current.append(g)
            size += g.nbytes
        if current:
            buckets.append(current)
        return buckets


class _Collectives:
    """The nodes of one all-reduce pass run: keys, buckets, gathers, and the rewires they
    leave for rewire-consumers."""

    def __init__(self, ir, created_by, devices):
        self.ir = ir
        self.build = Builder(ir, created_by)
        self.devices = devices
        self.n = len(devices)
        self.next_instance = 1
        self.rewires = []  # (replica, local tensor in that replica, reduced tensor)
        self._keys = [self._group_consts(i) for i in range(self.n)]

    def _group_consts(self, i):
        scope = f"{SCOPE}{replica_prefix(i)}"
        device = self.devices[i]
        size = self.build.const(scope + "group_size", self.n, np.int32, device=device)
        key = self.build.const(scope + "group_key", GROUP_KEY, np.int32, device=device)
        return size, key

    def _instance_key(self, scope, i):
        return self.build.const(scope + "instance_key", self.next_instance, np.int32,
                                device=self.devices[i])

    def _replica_grad(self, ir, i, g: DenseGrad, scope):
        """The gradient of ``g`` in replica i as a dense tensor (densifying IndexedSlices)."""
        prefix = replica_prefix(i)
        if g.sparse is None:
            return prefix + g.tensor
        rows = self.build.const(scope + f"rows_{g.var.replace('/', '_')}", g.shape[0], np.int32,
                                device=self.devices[i])
        values, indices = prefix + g.sparse.values, prefix + g.sparse.indices
        return self.build.op(scope + f"densify_{g.var.replace('/', '_')}", "UnsortedSegmentSum",
                             [values, indices, rows], device=self.devices[i], T=g.dtype,
                             Tindices=opdefs.output_dtype(ir, *parse_tensor(indices)))

    def reduce_bucket(self, b, bucket, previous):
        ir, build, out = self.ir, self.build, []
        sizes = [int(np.prod(g.shape)) for g in bucket]  # the same on every replica
        for i in range(self.n):
            device = self.devices[i]
            scope = f"{SCOPE}bucket_{b}/{replica_prefix(i)}"
            flat_shape = None
            flats = []
            for k, g in enumerate(bucket):
                grad = self._replica_grad(ir, i, g, scope)
                if len(g.shape) != 1:  # a vector is flat already
                    flat_shape = flat_shape or build.const(scope + "flat_shape", [-1], np.int32,
                                                           device=device)
                    grad = build.op(scope + f"flat_{k}", "Reshape", [grad, flat_shape],
                                    device=device, T=g.dtype)
                flats.append(grad)
            dtype = bucket[0].dtype
            if len(flats) > 1:
                axis = build.const(scope + "axis", 0, np.int32, device=device)
                joined = build.op(scope + "concat", "ConcatV2", flats + [axis], device=device,
                                  N=len(flats), T=dtype)
            else:
                joined = flats[0]
            size, key = self._keys[i]
            reduce_inputs = [joined, size, key, self._instance_key(scope, i)]
            if previous[i]:
                reduce_inputs.append("^" + previous[i])
            reduced = build.op(scope + "reduce", "CollectiveReduceV2", reduce_inputs,
                               device=device, T=dtype, merge_op="Add", final_op="Div")
            out.append(reduced)
            if len(bucket) > 1:
                split_sizes = build.const(scope + "sizes", sizes, np.int32, device=device)
                axis0 = build.const(scope + "split_axis", 0, np.int32, device=device)
                parts = build.op(scope + "split", "SplitV", [reduced, split_sizes, axis0],
                                 device=device, num_split=len(bucket), T=dtype, Tlen=INT32)
                pieces = [f"{parts}:{k}" for k in range(len(bucket))]
            else:
                pieces = [f"{reduced}:0"]
            for k, g in enumerate(bucket):
                if len(g.shape) == 1:  # its piece has its shape
                    self._record(i, g, pieces[k], scope)
                    continue
                shape = build.const(scope + f"shape_{k}", list(g.shape), np.int32, device=device)
                grad = build.op(scope + f"grad_{k}", "Reshape", [pieces[k], shape],
                                device=device, T=g.dtype)
                self._record(i, g, f"{grad}:0", scope)
        self.next_instance += 1
        return out

    def _record(self, i, g: DenseGrad, reduced, scope):
        prefix = replica_prefix(i)
        if g.sparse is None:
            self.rewires.append((i, prefix + g.tensor, reduced))
            return
        rows = np.arange(g.shape[0])
        indices_dtype = opdefs.output_dtype(self.ir, *parse_tensor(prefix + g.sparse.indices))
        all_rows = self.build.const(scope + f"rows_index_{g.var.replace('/', '_')}", rows,
                                    numpy_dtype(indices_dtype), device=self.devices[i])
        self.rewires.append((i, prefix + g.sparse.values, reduced))
        self.rewires.append((i, prefix + g.sparse.indices, f"{all_rows}:0"))

    def gather(self, j, var, grad):
        ir, build = self.ir, self.build
        values_key, indices_key = self.next_instance, self.next_instance + 1
        self.next_instance += 2
        for i in range(self.n):
            device, prefix = self.devices[i], replica_prefix(i)
            scope = f"{SCOPE}sparse_{j}/{prefix}"
            size, key = self._keys[i]
            gathered = {}
            for part, instance in (("values", values_key), ("indices", indices_key)):
                tensor = prefix + getattr(grad, part)
                dtype = opdefs.output_dtype(ir, *parse_tensor(tensor))
                ikey = build.const(scope + f"{part}_instance_key", instance, np.int32,
                                   device=device)
                gathered[part] = build.op(scope + part, "CollectiveGatherV2",
                                          [tensor, size, key, ikey], device=device, T=dtype)
            scale = build.const(scope + "replicas", self.n, numpy_dtype(var.dtype), device=device)
            mean = build.op(scope + "mean", "RealDiv", [gathered["values"], scale],
                            device=device, T=var.dtype)
            self.rewires.append((i, prefix + grad.values, f"{mean}:0"))
            self.rewires.append((i, prefix + grad.indices, f"{gathered['indices']}:0"))
