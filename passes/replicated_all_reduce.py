"""replicated-all-reduce: tf_cnn_benchmarks' replicated mode, gradients reduced as an all-reduce
spec says (graphxform.allreduce_spec).

Each step's dense gradients are first grouped as the options ask:
- `gradient_repacking` N: every gradient flattened and concatenated, then cut into N packs of
  nearly equal length (a pack may hold parts of several gradients);
- otherwise `agg_small_grads_max_bytes` B: runs of consecutive gradients of at most B bytes
  each are concatenated, at most `agg_small_grads_max_group` to a group;
- every other gradient is reduced on its own.
Each group is then reduced by the spec's algorithm for its size, in `#shards` pieces:
- `collective`: CollectiveReduceV2 (mean) on every replica;
- `pscpu` / `psgpu`: the replicas' tensors added on the first CPU (GPU) device, divided by N,
  and read back by every replica;
- `xring`: a ring over the replicas' devices: chunk k of the tensor is summed hop by hop along
  the ring from replica k+1 round to replica k, then every replica reads the N sums;
- `nccl`: NcclAllReduce (GPU replicas only; the spec check refuses it on CPUs).
Every replica ends with bit-identical means. Sparse gradients are gathered as in `all-reduce`.
The reduced tensors are recorded under the `all-reduce` state key, so `rewire-consumers` points
every consumer of a local gradient at them."""

from __future__ import annotations

import dataclasses

import numpy as np

from graphxform import allreduce_spec
from graphxform.nodes import Builder, numpy_dtype, replica_prefix
from graphxform.passes.all_reduce import Collectives, gradients_by_step
from graphxform.pipeline import Pass, PassResult

SCOPE = "replicated/"
INT32 = 3
SPEC_KEYS = 1 << 21  # collective instance keys of this pass (all-reduce's sparse ones: 1 << 24)


@dataclasses.dataclass
class ReplicatedAllReduce(Pass):
    name = "replicated-all-reduce"
    spec: str = "collective"
    gradient_repacking: int = 0
    agg_small_grads_max_bytes: int = 0
    agg_small_grads_max_group: int = 10

    def run(self, ir, ctx):
        spec = allreduce_spec.parse(self.spec)
        spec.require_devices(ctx.devices)
        if len(ctx.devices) < 2:
            return PassResult(modified=False)
        reducer = _Reducer(ir, Builder(ir, self.name), ctx.devices)
        sparse_gatherer = Collectives(ir, self.name, ctx.devices)
        groups = sparse = 0
        by_algorithm = {}
        for dense, step_sparse in gradients_by_step(ctx.training, ir=ir):
            for group in self._groups(dense):
                part = spec.part_for(group.nbytes)
                reducer.reduce_group(groups, group, part)
                by_algorithm[part.text] = by_algorithm.get(part.text, 0) + 1
                groups += 1
            previous = [None] * len(ctx.devices)
            for var, grad in step_sparse:
                previous = sparse_gatherer.gather(sparse, var, grad, previous)
                sparse += 1
        if not groups and not sparse:
            return PassResult(modified=False)
        ctx.state["all-reduce"] = {"rewires": reducer.rewires + sparse_gatherer.rewires}
        return PassResult(modified=True, summary={"groups": groups, "sparse_gathers": sparse,
                                                  "algorithms": by_algorithm})

    def _groups(self, grads) -> list["_Group"]:
        grads = list(grads)
        if not grads:
            return []
        if self.gradient_repacking > 0:
            return _repack(grads, self.gradient_repacking)
        groups, run = [], []
        for g in grads:
            small = 0 < g.nbytes <= self.agg_small_grads_max_bytes and (
                not run or run[0].dtype == g.dtype)
            if small and len(run) < self.agg_small_grads_max_group:
                run.append(g)
                continue
            if run:
                groups.append(_Group.of(run))
            run = [g] if 0 < g.nbytes <= self.agg_small_grads_max_bytes else []
            if not run:
                groups.append(_Group.of([g]))
        if run:
            groups.append(_Group.of(run))
        return groups


@dataclasses.dataclass
class _Group:
    """Gradients reduced as one flat tensor: ``pieces`` are (gradient, start, length) of the
    flat concatenation of ``grads`` that this group covers."""
    grads: list
    pieces: list
    dtype: int

    @property
    def length(self) -> int:
        return sum(n for _, _, n in self.pieces)

    @property
    def nbytes(self) -> int:
        return self.length * np.dtype(numpy_dtype(self.dtype)).itemsize

    @classmethod
    def of(cls, grads):
        return cls(grads, [(g, 0, _size(g)) for g in grads], grads[0].dtype)


def _size(grad) -> int:
    return int(np.prod(grad.shape)) if grad.shape else 1


def _repack(grads, packs: int) -> list[_Group]:
    """All gradients (of one dtype at a time) cut into ``packs`` packs of nearly equal length."""
    groups = []
    for dtype in dict.fromkeys(g.dtype for g in grads):
        same = [g for g in grads if g.dtype == dtype]
        total = sum(_size(g) for g in same)
        bounds = [round(total * k / packs) for k in range(packs + 1)]
        flat, offset = [], 0
        for g in same:
            flat.append((g, offset))
            offset += _size(g)
        for lo, hi in zip(bounds, bounds[1:]):
            if hi <= lo:
                continue
            pieces = []
            for g, start in flat:
                a, b = max(lo, start), min(hi, start + _size(g))
                if a < b:
                    pieces.append((g, a - start, b - a))
            groups.append(_Group([p[0] for p in pieces], pieces, dtype))
    return groups


class _Reducer:
    """Builds each group's flat tensor per replica, reduces it, and splits the mean back into
    the gradients (or their parts), recording the rewires."""

    def __init__(self, ir, build, devices):
        self.ir, self.build, self.devices = ir, build, devices
        self.n = len(devices)
        self.next_key = SPEC_KEYS
        self.rewires = []
        self._parts = {}  # (replica, gradient) -> [(start, length, reduced tensor of that part)]
        self._done = set()

    def reduce_group(self, index, group, part) -> None:
        scope = f"{SCOPE}group_{index}/"
        flats = [self._flat(scope, i, group) for i in range(self.n)]
        shards = min(part.shards, group.length)
        if shards > 1:
            sizes = _split_sizes(group.length, shards)
            pieces = [self._split(scope + f"{replica_prefix(i)}shards", i, flats[i], sizes,
                                  group.dtype) for i in range(self.n)]
            reduced = [self._reduce(scope + f"shard_{k}/", [p[k] for p in pieces], part,
                                    group.dtype, sizes[k]) for k in range(shards)]
            means = [self._concat(scope + f"{replica_prefix(i)}joined", i,
                                  [r[i] for r in reduced], group.dtype) for i in range(self.n)]
        else:
            means = self._reduce(scope, flats, part, group.dtype, group.length)
        for i, mean in enumerate(means):
            self._unpack(scope + replica_prefix(i), i, mean, group)
        self._finish(group)

    def _op(self, name, op_type, inputs, i=None, device=None, **attrs):
        device = device if device is not None else self.devices[i]
        return self.build.op(name, op_type, inputs, device=device, **attrs)

    def _const(self, name, value, dtype, i):
        return self.build.const(name, value, dtype, device=self.devices[i])

    def _flat(self, scope, i, group) -> str:
        prefix = replica_prefix(i)
        scope = scope + prefix
        parts = []
        for k, (g, start, length) in enumerate(group.pieces):
            tensor = prefix + g.tensor
            if len(g.shape) != 1:
                tensor = self._op(scope + f"flat_{k}", "Reshape", [tensor, self._const(
                    scope + f"flat_shape_{k}", [-1], np.int32, i)], i, T=g.dtype, Tshape=INT32)
            if length != _size(g):
                tensor = self._op(scope + f"part_{k}", "Slice", [tensor, self._const(
                    scope + f"part_begin_{k}", [start], np.int32, i), self._const(
                    scope + f"part_size_{k}", [length], np.int32, i)], i, T=g.dtype,
                    Index=INT32)
            parts.append(tensor)
        return parts[0] if len(parts) == 1 else self._concat(scope + "concat", i, parts,
                                                             group.dtype)

    def _concat(self, name, i, parts, dtype) -> str:
        return self._op(name, "ConcatV2", parts + [self._const(name + "_axis", 0, np.int32, i)],
                        i, N=len(parts), T=dtype, Tidx=INT32)

    def _split(self, name, i, tensor, sizes, dtype) -> list[str]:
        node = self._op(name, "SplitV", [tensor, self._const(name + "_sizes", sizes, np.int32,
                                                             i),
                                         self._const(name + "_axis", 0, np.int32, i)],
                        i, num_split=len(sizes), T=dtype, Tlen=INT32)
        return [f"{node}:{k}" for k in range(len(sizes))]

    def _reduce(self, scope, tensors, part, dtype, length) -> list[str]:
        algorithm = part.algorithm
        if algorithm == "collective":
            return self._collective(scope, tensors, dtype)
        if algorithm in ("pscpu", "psgpu"):
            return self._parameter_server(scope, tensors, dtype, gpu=algorithm == "psgpu")
        if algorithm == "xring":
            return self._ring(scope, tensors, dtype, length)
        return self._nccl(scope, tensors, dtype)

    def _collective(self, scope, tensors, dtype) -> list[str]:
        key, self.next_key = self.next_key, self.next_key + 1
        out = []
        for i, tensor in enumerate(tensors):
            s = scope + replica_prefix(i)
            out.append(self._op(s + "reduce", "CollectiveReduceV2", [
                tensor, self._const(s + "group_size", self.n, np.int32, i),
                self._const(s + "group_key", 2, np.int32, i),
                self._const(s + "instance_key", key, np.int32, i)], i, T=dtype,
                merge_op="Add", final_op="Div"))
        return out

    def _parameter_server(self, scope, tensors, dtype, gpu: bool) -> list[str]:
        kind = "GPU" if gpu else "CPU"
        host = next((d for d in self.devices if kind in d.upper()), "/device:CPU:0")
        total = self._op(scope + "sum", "AddN", [t if ":" in t else t + ":0" for t in tensors],
                         device=host, N=self.n, T=dtype)
        count = self.build.const(scope + "replicas", self.n, numpy_dtype(dtype), device=host)
        mean = self._op(scope + "mean", "RealDiv", [total, count], device=host, T=dtype)
        return [self._op(scope + replica_prefix(i) + "mean", "Identity", [mean], i, T=dtype)
                for i in range(self.n)]

    def _ring(self, scope, tensors, dtype, length) -> list[str]:
        n = self.n
        sizes = _split_sizes(length, n)
        chunks = [self._split(scope + f"{replica_prefix(i)}chunks", i, t, sizes, dtype)
                  for i, t in enumerate(tensors)]
        sums = []
        for k in range(n):  # chunk k starts at replica k+1 and ends, summed, at replica k
            hop = (k + 1) % n
            partial = chunks[hop][k]
            for step in range(1, n):
                here = (k + 1 + step) % n
                partial = self._op(scope + f"chunk_{k}/hop_{step}", "AddV2",
                                   [partial, chunks[here][k]], here, T=dtype)
            count = self._const(scope + f"chunk_{k}/replicas", n, numpy_dtype(dtype), k)
            sums.append(self._op(scope + f"chunk_{k}/mean", "RealDiv", [partial, count], k,
                                 T=dtype))
        out = []
        for i in range(n):
            local = [self._op(scope + f"{replica_prefix(i)}chunk_{k}", "Identity", [sums[k]], i,
                              T=dtype) for k in range(n)]
            out.append(self._concat(scope + f"{replica_prefix(i)}mean", i, local, dtype))
        return out

    def _nccl(self, scope, tensors, dtype) -> list[str]:
        shared = scope.rstrip("/").replace("/", "_")
        summed = [self._op(scope + replica_prefix(i) + "sum", "NcclAllReduce", [t], i,
                           reduction="sum", T=dtype, num_devices=self.n, shared_name=shared)
                  for i, t in enumerate(tensors)]
        return [self._op(scope + replica_prefix(i) + "mean", "RealDiv", [
            summed[i], self._const(scope + replica_prefix(i) + "replicas", self.n,
                                   numpy_dtype(dtype), i)], i, T=dtype) for i in range(self.n)]

    def _unpack(self, scope, i, mean, group) -> None:
        """The group's mean split back into its pieces, in replica ``i``."""
        lengths = [n for _, _, n in group.pieces]
        parts = [mean if ":" in mean else mean + ":0"] if len(lengths) == 1 else self._split(
            scope + "unpack", i, mean, lengths, group.dtype)
        for (g, start, length), piece in zip(group.pieces, parts):
            self._parts.setdefault((i, g.tensor), []).append((start, length, piece))

    def _finish(self, group) -> None:
        """Each gradient whose parts are all reduced (repacking may spread one over several
        groups) gets its reduced tensor: the parts joined in order and reshaped."""
        for i in range(self.n):
            for g in group.grads:
                parts = self._parts.get((i, g.tensor), [])
                if (i, g.tensor) in self._done or sum(n for _, n, _ in parts) != _size(g):
                    continue
                self._done.add((i, g.tensor))
                scope = f"{SCOPE}grads/{replica_prefix(i)}{g.label}/"
                pieces = [piece for _, _, piece in sorted(parts)]
                flat = pieces[0] if len(pieces) == 1 else self._concat(
                    scope + "joined", i, pieces, g.dtype)
                if len(g.shape) != 1:
                    flat = self._op(scope + "shaped", "Reshape", [flat, self._const(
                        scope + "shape", list(g.shape), np.int32, i)], i, T=g.dtype,
                        Tshape=INT32)
                self.rewires.append((i, replica_prefix(i) + g.tensor,
                                     flat if ":" in flat else flat + ":0"))


def _split_sizes(length: int, parts: int) -> list[int]:
    base, extra = divmod(length, parts)
    return [base + (1 if k < extra else 0) for k in range(parts)]
