"""all-reduce: average each gradient across replicas with TF collective ops, where it is born.

A gradient is reduced at the tensor tf.gradients produced (``Variable.gradient``), before any
post-processing (clipping by global norm, loss-scale division, finite checks, summaries), so
that everything after it sees the cross-replica gradient as the single-device graph does.

Dense gradients are flattened (vectors are flat already) and fused into buckets of at most
`bucket_bytes` (one CollectiveReduceV2 per bucket per replica, then split back), so a model
needs few collectives. Each step (train op) has its own buckets, since steps run in separate
session calls; a step's buckets run in a fixed order on every replica (each waits on the
previous one) so launches never interleave differently across devices.

Sparse gradients (IndexedSlices) are gathered, never densified unless `sparse_as_dense`: their
row counts differ between replicas (each slice of the batch holds other ids), and a collective
gather needs equal shapes, so each replica first gathers every replica's row count, pads its
rows to the largest, gathers, and keeps only the real rows: the concatenation, in replica order,
of every replica's rows, scaled by 1/N (a mean loss over equal slices). TF fixes a collective
instance's shape at its first run, so each padded length gets an instance key of its own.

The reduced tensors are recorded for `rewire-consumers`, which points every consumer of the
local gradient outside a gradients scope at them.

Across worker tasks (devices `/job:worker/task:w/...`) every replica of every worker joins the
same collective group: nothing changes but where the members run (`worker-steps` then gives
every collective its timeout and writes what each task runs). With
`hierarchical`, a dense bucket is first averaged inside each worker on its first replica's
device (an AddN and a division by R: in-process copies, no network), then averaged across
workers by one collective per bucket with one member per worker (group size W: each worker's
link carries 2(W-1)/W of the bucket instead of 2(N-1)/N for N = W x R; equal slices make the
mean of the workers' means the mean of all), and read by the worker's other replicas from that
device (the broadcast inside the worker). Sparse gathers stay in the flat group."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from graphxform import opdefs
from graphxform.errors import ContractError
from graphxform.ir import parse_tensor
from graphxform.nodes import Builder, numpy_dtype, replica_prefix
from graphxform.pipeline import Pass, PassResult

SCOPE = "allreduce/"
DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024
GROUP_KEY = 1
CROSS_WORKER_GROUP_KEY = 2  # --hierarchical: one member per worker
# A sparse gradient's gathers are keyed SPARSE_KEYS + stride * (2j + part) + padded length
# (rows per replica < SPARSE_KEY_STRIDE), apart from the dense buckets' small keys.
SPARSE_KEYS = 1 << 24
SPARSE_KEY_STRIDE = 1 << 20
INT32 = 3  # DataType enum DT_INT32


@dataclasses.dataclass
class DenseGrad:
    var: str
    tensor: str  # original name of the gradient tensor
    shape: tuple
    dtype: int
    nbytes: int
    sparse: object = None  # the training.Gradient when a sparse gradient is densified
    # what the nodes made for it are named after: ``var``, or ``var_k`` for the variable's
    # k-th gradient (the second optimizer's of an actor-critic's trunk)
    label: str = ""


@dataclasses.dataclass
class AllReduce(Pass):
    name = "all-reduce"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    sparse_as_dense: bool = False
    hierarchical: bool = False

    def run(self, ir, ctx):
        tg = ctx.training
        if len(ctx.devices) < 2:
            return PassResult(modified=False)
        if self.sparse_as_dense:
            _require_densifiable(ir, tg)
        collectives = Collectives(ir, self.name, ctx.devices, self.hierarchical)
        buckets, sparse, dense_bytes = 0, 0, 0
        for step_dense, step_sparse in gradients_by_step(tg, self.sparse_as_dense, ir):
            previous = [None] * len(ctx.devices)
            for bucket in self._buckets(reversed(step_dense)):  # last layers' are ready first
                previous = collectives.reduce_bucket(buckets, bucket, previous)
                buckets += 1
            for var, grad in step_sparse:
                previous = collectives.gather(sparse, var, grad, previous)
                sparse += 1
            dense_bytes += sum(g.nbytes for g in step_dense)
        if not buckets and not sparse:
            return PassResult(modified=False)
        ctx.state[self.name] = {"rewires": collectives.rewires}
        summary = {"buckets": buckets, "sparse_gathers": sparse,
                   "collectives_per_replica": buckets + 3 * sparse,
                   "dense_bytes_reduced": dense_bytes}
        if collectives.hierarchical:
            summary["hierarchical_workers"] = len(collectives.workers)
        return PassResult(modified=True, summary=summary)

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


# sparse updates that leave a row whose gradient is zero as it was (Adagrad adds zero to its
# sum of squares and moves the row by zero), so a densified gradient changes nothing there
_ZERO_ROWS_KEPT = frozenset({"SparseApplyAdagrad", "ResourceSparseApplyAdagrad",
                             "SparseApplyAdagradV2", "ResourceSparseApplyAdagradV2"})


def _require_densifiable(ir, tg) -> None:
    """A sparse gradient is densified only where its optimizer moves a row with a zero
    gradient as it moves a row it is not given: SGD's scatter, TF1's Adam (which decays every
    row's moments itself), Adagrad. Momentum, RMSProp, Ftrl, Adadelta and the proximal and
    dual-averaging updates touch only the rows a sparse gradient holds; given zeros for the
    others, they keep moving or shrinking them, which one device never does."""
    for var in tg.trainable:
        if all(g.kind != "sparse" for g in var.gradients):
            continue
        for update in var.updates:
            op = ir.op(replica_prefix(0) + update) if replica_prefix(0) + update in ir else ""
            if "SparseApply" in op and op not in _ZERO_ROWS_KEPT:
                raise ContractError(
                    f"--sparse-as-dense: variable '{var.name}' is updated by '{update}' ({op}), "
                    "which moves only the rows its sparse gradient holds; densified, its "
                    "update would move every other row too (a momentum or a moving average "
                    "keeps going on a zero gradient): leave its gradient sparse (drop the "
                    "option; hybrid: keep the variable on the ps side), or train it with SGD, "
                    "Adagrad or Adam")


def gradients_by_step(tg, sparse_as_dense: bool = False, ir=None) -> list[tuple[list, list]]:
    """Each step's (dense DenseGrads, sparse (variable, Gradient) pairs), every born gradient
    once (in the first step whose updates apply it), each of a variable's gradients (one per
    optimizer that trains it: an actor-critic's trunk gets the actor's and the critic's);
    sparse ones as dense with ``sparse_as_dense``. Given the (replicated) ``ir``, a step whose
    gradients are computed after some of its own updates ran (``with
    tf.control_dependencies([train_q]): opt_pi.minimize(...)``, as actor-critic code chains
    its critic's and actor's steps) comes as one entry per stage (``gradient_stages``), so
    that no bucket or chain of collectives makes a later stage's gradients wait on each
    other's updates (a cycle)."""
    seen, out = set(), []
    for step in tg.steps or [None]:
        found = []
        for var in tg.trainable:
            grads = var.gradients if step is None else var.gradients_applied_in(step.closure)
            for grad in grads:
                if tuple(grad.tensors) not in seen:
                    seen.add(tuple(grad.tensors))
                    found.append((var, grad))
        for stage in (gradient_stages(ir, found) if ir is not None else [found]):
            dense, sparse = [], []
            for var, grad in stage:
                k = var.gradients.index(grad)
                if grad.kind == "dense" or sparse_as_dense:
                    dense.append(DenseGrad(var.name, grad.tensor if grad.kind == "dense" else
                                           None, var.shape, var.dtype, var.nbytes or 1,
                                           None if grad.kind == "dense" else grad,
                                           f"{var.name}_{k}" if k else var.name))
                else:
                    sparse.append((var, grad))
            out.append((dense, sparse))
    return out


def gradient_stages(ir, gradients: list) -> list[list]:
    """``gradients`` ((variable, Gradient) pairs, in order) in stages: stage k holds those
    computed after no update of a variable in stage k or later, i.e. every gradient of a stage
    may be reduced before any update of that stage runs. One stage unless a step chains its
    optimizers."""
    prefix = replica_prefix(0)

    def named(node):
        return prefix + node if prefix + node in ir else node

    stages, remaining = [], list(gradients)
    while remaining:
        updates = [named(u) for var, _ in remaining for u in var.updates if named(u) in ir]
        after = ir.descendants(updates) if updates else set()
        is_ready = [not any(named(parse_tensor(t)[0]) in after for t in grad.tensors)
                    for _, grad in remaining]
        if not any(is_ready):
            var, grad = remaining[0]
            nodes = {named(parse_tensor(t)[0]) for t in grad.tensors}
            first = next(((v, u) for v, _ in remaining for u in v.updates
                          if named(u) in ir and nodes & ir.descendants([named(u)])),
                         (var, var.updates[0] if var.updates else "?"))
            whose = f"its own update '{first[1]}'" if first[0] is var else \
                f"'{first[1]}', an update of variable '{first[0].name}',"
            raise ContractError(
                f"variable '{var.name}': its gradient is computed after {whose} runs, so no "
                "reduction of it across replicas can come before "
                "that update; compute the gradients before any update of a variable they "
                "train")
        stages.append(list(itertools.compress(remaining, is_ready)))
        remaining = [pair for pair, ready in zip(remaining, is_ready) if not ready]
    return stages


class Collectives:
    """The nodes of one all-reduce pass run: keys, buckets, gathers, and the rewires they
    leave for rewire-consumers."""

    def __init__(self, ir, created_by, devices, hierarchical: bool = False):
        self.ir = ir
        self.build = Builder(ir, created_by)
        self.devices = devices
        self.n = len(devices)
        self.next_instance = 1
        self.rewires = []  # (replica, local tensor in that replica, reduced tensor)
        self.workers = replicas_by_task(devices)
        # one worker, or one replica per worker: the flat ring is already the hierarchy
        self.hierarchical = hierarchical and 1 < len(self.workers) < self.n
        self._keys = [self._group_consts(i) for i in range(self.n)]
        self._cross_keys = {}

    def _group_consts(self, i, size_value=None, key_value=GROUP_KEY, name="group"):
        scope = f"{SCOPE}{replica_prefix(i)}"
        device = self.devices[i]
        size = self.build.const(scope + f"{name}_size", size_value or self.n, np.int32,
                                device=device)
        key = self.build.const(scope + f"{name}_key", key_value, np.int32, device=device)
        return size, key

    def _cross_worker_keys(self, leader):
        """Group size and key of the cross-worker group on a worker's first replica."""
        if leader not in self._cross_keys:
            self._cross_keys[leader] = self._group_consts(
                leader, len(self.workers), CROSS_WORKER_GROUP_KEY, "cross_worker_group")
        return self._cross_keys[leader]

    def _instance_key(self, scope, i):
        return self.build.const(scope + "instance_key", self.next_instance, np.int32,
                                device=self.devices[i])

    def _replica_grad(self, ir, i, g: DenseGrad, scope):
        """The gradient of ``g`` in replica i as a dense tensor (densifying IndexedSlices)."""
        prefix = replica_prefix(i)
        if g.sparse is None:
            return prefix + g.tensor
        rows = self.build.const(scope + f"rows_{g.label.replace('/', '_')}", g.shape[0], np.int32,
                                device=self.devices[i])
        values, indices = prefix + g.sparse.values, prefix + g.sparse.indices
        return self.build.op(scope + f"densify_{g.label.replace('/', '_')}", "UnsortedSegmentSum",
                             [values, indices, rows], device=self.devices[i], T=g.dtype,
                             Tindices=opdefs.output_dtype(ir, *parse_tensor(indices)))

    def _joined(self, b, bucket, i):
        """Replica i's gradients of ``bucket`` as one flat tensor."""
        ir, build = self.ir, self.build
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
        if len(flats) == 1:
            return flats[0]
        axis = build.const(scope + "axis", 0, np.int32, device=device)
        return build.op(scope + "concat", "ConcatV2", flats + [axis], device=device,
                        N=len(flats), T=bucket[0].dtype)

    def _reduce_flat(self, b, bucket, previous):
        """One collective over every replica: replica i's mean of the bucket, per replica."""
        out = []
        for i in range(self.n):
            scope = f"{SCOPE}bucket_{b}/{replica_prefix(i)}"
            size, key = self._keys[i]
            inputs = [self._joined(b, bucket, i), size, key, self._instance_key(scope, i)]
            if previous[i]:
                inputs.append("^" + previous[i])
            out.append(self.build.op(scope + "reduce", "CollectiveReduceV2", inputs,
                                     device=self.devices[i], T=bucket[0].dtype,
                                     merge_op="Add", final_op="Div"))
        return out, out

    def _reduce_hierarchical(self, b, bucket, previous):
        """Mean inside each worker, one collective across workers, read by the worker's
        replicas. Returns (the mean each replica reads, each replica's last op in order)."""
        build, dtype = self.build, bucket[0].dtype
        means, last = [None] * self.n, [None] * self.n
        for replicas in self.workers.values():
            leader = replicas[0]
            device = self.devices[leader]
            scope = f"{SCOPE}bucket_{b}/{replica_prefix(leader)}"
            joined = [self._joined(b, bucket, i) for i in replicas]
            local = joined[0]
            if len(joined) > 1:
                total = build.op(scope + "local_sum", "AddN", joined, device=device,
                                 N=len(joined), T=dtype)
                count = build.const(scope + "local_replicas", len(joined), numpy_dtype(dtype),
                                    device=device)
                local = build.op(scope + "local_mean", "RealDiv", [total, count], device=device,
                                 T=dtype)
            size, key = self._cross_worker_keys(leader)
            inputs = [local, size, key, self._instance_key(scope, leader)]
            inputs += ["^" + previous[i] for i in replicas if previous[i]]
            mean = build.op(scope + "reduce", "CollectiveReduceV2", inputs, device=device,
                            T=dtype, merge_op="Add", final_op="Div")
            for i in replicas:
                if i == leader:
                    means[i] = last[i] = mean
                    continue
                means[i] = last[i] = build.op(
                    f"{SCOPE}bucket_{b}/{replica_prefix(i)}broadcast", "Identity", [mean],
                    device=self.devices[i], T=dtype)
        return means, last

    def reduce_bucket(self, b, bucket, previous):
        build = self.build
        sizes = [int(np.prod(g.shape)) for g in bucket]  # the same on every replica
        reduce = self._reduce_hierarchical if self.hierarchical else self._reduce_flat
        means, out = reduce(b, bucket, previous)
        for i in range(self.n):
            device = self.devices[i]
            scope = f"{SCOPE}bucket_{b}/{replica_prefix(i)}"
            dtype = bucket[0].dtype
            reduced = means[i]
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
        all_rows = self.build.const(scope + f"rows_index_{g.label.replace('/', '_')}", rows,
                                    numpy_dtype(indices_dtype), device=self.devices[i])
        self.rewires.append((i, prefix + g.sparse.values, reduced))
        self.rewires.append((i, prefix + g.sparse.indices, f"{all_rows}:0"))

    def gather(self, j, var, grad, previous):
        """All replicas' rows of a sparse gradient, in replica order, scaled by 1/N. Row counts
        differ between replicas, so: gather the counts, pad to the largest, gather, keep the
        real rows. Returns the last collective of each replica (the next one waits on it)."""
        ir, build = self.ir, self.build
        count_key = self.next_instance
        self.next_instance += 1
        values_key, indices_key = (SPARSE_KEYS + (2 * j + k) * SPARSE_KEY_STRIDE for k in (0, 1))
        last = []
        for i in range(self.n):
            device, prefix = self.devices[i], replica_prefix(i)
            scope = f"{SCOPE}sparse_{j}/{prefix}"
            size, key = self._keys[i]
            values, indices = prefix + grad.values, prefix + grad.indices
            values_dtype = opdefs.output_dtype(ir, *parse_tensor(values))
            indices_dtype = opdefs.output_dtype(ir, *parse_tensor(indices))

            def op(name, op_type, inputs, **attrs):
                return build.op(scope + name, op_type, inputs, device=device, **attrs)

            made = {}

            def const(name, value, dtype=np.int32):
                if name not in made:
                    made[name] = build.const(scope + name, value, dtype, device=device)
                return made[name]

            wait = ["^" + previous[i]] if previous[i] else []
            rows = op("rows", "Shape", [indices], T=indices_dtype, out_type=INT32)
            counts = op("counts", "CollectiveGatherV2",
                        [rows, size, key, const("counts_instance_key", count_key)] + wait,
                        T=INT32)
            longest = op("longest", "Max", [counts, const("axis", [0])], T=INT32, Tidx=INT32)
            missing = op("missing", "Sub", [longest, rows], T=INT32)
            padded = {}
            for part, tensor, dtype, instance in (("values", values, values_dtype, values_key),
                                                  ("indices", indices, indices_dtype,
                                                   indices_key)):
                # paddings [[0, missing], [0, 0], ...]: missing rows at the end of axis 0
                rank = op(f"{part}_rank", "Rank", [tensor], T=dtype)
                axes = op(f"{part}_axes", "Range", [const("zero", 0), rank, const("one", 1)],
                          Tidx=INT32)
                first = op(f"{part}_first_axis", "Cast", [op(
                    f"{part}_is_first", "Equal", [axes, const("zero", 0)], T=INT32)],
                    SrcT=10, DstT=INT32)
                after = op(f"{part}_after", "Mul", [first, missing], T=INT32)
                before = op(f"{part}_before", "ZerosLike", [after], T=INT32)
                paddings = op(f"{part}_paddings", "Pack", [before, after], N=2, T=INT32, axis=1)
                padded[part] = op(f"{part}_padded", "Pad", [tensor, paddings], T=dtype,
                                  Tpaddings=INT32)
                # TF keeps the shape of a collective instance from its first run: one
                # instance per padded length, keyed by it
                instance_key = op(f"{part}_instance_key", "AddV2",
                                  [const(f"{part}_key_base", instance), longest], T=INT32)
                gathered = op(f"{part}_gathered", "CollectiveGatherV2",
                              [padded[part], size, key, instance_key, "^" + counts], T=dtype)
                padded[part] = gathered
            # position p of the gathered rows came from replica p // longest, row p % longest
            positions = op("positions", "Range", [const("zero", 0), op(
                "total", "Mul", [longest, size], T=INT32), const("one", 1)], Tidx=INT32)
            owner = op("owner", "FloorDiv", [positions, longest], T=INT32)
            offset = op("offset", "FloorMod", [positions, longest], T=INT32)
            owner_rows = op("owner_rows", "GatherV2", [counts, owner, const("axis0", 0)],
                            Tparams=INT32, Tindices=INT32, Taxis=INT32, batch_dims=0)
            real = op("real", "Less", [offset, owner_rows], T=INT32)
            keep = op("keep", "Where", [real], T=10)  # DT_BOOL
            keep = op("keep_rows", "Reshape", [keep, const("flat", [-1])], T=9, Tshape=INT32)
            kept = {}
            for part, dtype in (("values", values_dtype), ("indices", indices_dtype)):
                kept[part] = op(f"{part}_kept", "GatherV2", [padded[part], keep,
                                                             const("axis0", 0)],
                                Tparams=dtype, Tindices=9, Taxis=INT32, batch_dims=0)
            scale = build.const(scope + "replicas", self.n, numpy_dtype(values_dtype),
                                device=device)
            mean = op("mean", "RealDiv", [kept["values"], scale], T=values_dtype)
            self.rewires.append((i, values, f"{mean}:0"))
            self.rewires.append((i, indices, f"{kept['indices']}:0"))
            last.append(padded["indices"])
        return last


def replicas_by_task(devices) -> dict:
    """Replica indices grouped by the task their device names ("/job:worker/task:1"; "" for
    local devices), in device order."""
    groups = {}
    for i, device in enumerate(devices):
        task = device.split("/device:")[0] if "/job:" in device else ""
        groups.setdefault(task, []).append(i)
    return groups
