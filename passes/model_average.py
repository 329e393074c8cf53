"""model-average: TF's ModelAverageOptimizer on replicated graphs.

Runs after `replicate` without any gradient exchange (as `independent`): every replica trains
its own local copy of each trainable variable with the original optimizer. This pass adds, for
each trainable variable a step updates, a centre variable `model_average/centre/<var>` (the
value checkpoints hold under the original name) and, once per step, after the local updates:

- `local_step` (`model_average/local_step`) counts local steps;
- on every ``interval``-th local step (a *round*) the centre becomes the mean of the replicas'
  copies and every copy is set to the centre; on other steps both keep their values;
- the graph's own global_step increments only on rounds, so it counts averaging rounds.

Whether a step is a round is read from local_step before it moves (`SelectV2` on that flag, so
nothing runs conditionally and a skipped round leaves values bit for bit). Every local copy and
the centre start from replica 0's initial value. The step op waits on the averaging, so the
user's train op still does the whole step. One client runs every replica here (in-graph); the
mean is taken where the centre lives."""

from __future__ import annotations

import dataclasses

import numpy as np

from graphxform.errors import GraphxformError
from graphxform.nodes import Builder, replica_prefix
from graphxform.pipeline import Pass, PassResult

SCOPE = "model_average/"
CENTRE = SCOPE + "centre/"
LOCAL_STEP = SCOPE + "local_step"


def centre_name(variable: str) -> str:
    return CENTRE + variable


@dataclasses.dataclass
class ModelAverage(Pass):
    name = "model-average"
    interval: int = 1
    centre_device: str = "/device:CPU:0"

    def run(self, ir, ctx):
        from tensorflow.core.framework import types_pb2
        if self.interval < 1:
            raise GraphxformError(f"--interval must be at least 1 (got {self.interval})")
        if "replicate" not in ctx.state:
            raise GraphxformError("model-average runs after replicate (it averages the "
                                  "replicas' copies)")
        if ir.has_scope(SCOPE):
            raise GraphxformError(f"the graph already has nodes under {SCOPE}")
        tg = ctx.training
        replicas = len(ctx.devices)
        trained = sorted((v for v in tg.variables.values()
                          if v.trainable and v.updates and replica_prefix(0) + v.name in ir),
                         key=lambda v: v.name)
        if not trained:
            return PassResult(modified=False)
        build = Builder(ir, self.name)
        int64 = types_pb2.DT_INT64
        zero = build.const(LOCAL_STEP + "/zero", 0, np.int64, device=ctx.devices[0])
        counter = _new_variable(ir, build, LOCAL_STEP, "resource", int64, (), ctx.devices[0],
                                zero + ":0")
        reset = build.op(LOCAL_STEP + "/reset", "AssignVariableOp", [counter, zero],
                         device=ctx.devices[0], dtype=int64)
        before = build.op(LOCAL_STEP + "/before", "ReadVariableOp", [counter],
                          device=ctx.devices[0], dtype=int64)
        nxt = build.op(LOCAL_STEP + "/next", "AddV2",
                       [before, build.const(LOCAL_STEP + "/one", 1, np.int64)], T=int64)
        phase = build.op(SCOPE + "phase", "FloorMod",
                         [nxt, build.const(SCOPE + "interval", self.interval, np.int64)], T=int64)
        is_round = build.op(SCOPE + "is_round", "Equal",
                            [phase, build.const(SCOPE + "zero", 0, np.int64)], T=int64)
        centres = {}
        for var in trained:
            centres[var.name] = _new_variable(
                ir, build, centre_name(var.name), var.kind, var.dtype, var.shape,
                self.centre_device, _initial_tensor(ir, var))
        self._count_rounds(ir, build, tg, is_round)
        averaged = 0
        for k, step in enumerate(tg.steps):
            step_vars = [v for v in trained if set(v.updates) & step.closure]
            if not step_vars:
                continue
            waits = sorted({src for src, _ in ir.inputs(step.op)} | set(ir.control_inputs(step.op)))
            scope = f"{SCOPE}step_{k}/"
            tick = build.op(scope + "local_step_add", "AssignAddVariableOp",
                            [counter, build.const(scope + "one", 1, np.int64),
                             "^" + before] + ["^" + w for w in waits],
                            device=ctx.devices[0], dtype=int64)
            done = [tick]
            for var in step_vars:
                done += self._average(ir, build, scope, var, centres[var.name], replicas,
                                      is_round, ["^" + w for w in waits])
            finished = build.op(scope + "done", "NoOp", ["^" + d for d in done])
            ir.add_control_input(step.op, finished)
            averaged += len(step_vars)
        ctx.state[self.name] = {"centres": centres, "local_step": counter,
                                "on_restore": [reset], "interval": self.interval}
        return PassResult(modified=True, summary={"centres": len(centres),
                                                  "interval": self.interval,
                                                  "averaged_per_round": averaged})

    def _average(self, ir, build, scope, var, centre, replicas, is_round, waits) -> list[str]:
        """The mean of the replicas' copies into the centre and back, on rounds only."""
        base = scope + var.name
        reads = []
        for i in range(replicas):
            copy = replica_prefix(i) + var.name
            reads.append(_read(build, f"{base}/read_{i}", var, copy, waits))
        total = build.op(base + "/sum", "AddN", reads, device=self.centre_device, N=replicas,
                         T=var.dtype) if replicas > 1 else reads[0]
        scale = build.const(base + "/inverse_count", 1.0 / replicas, _numpy(var.dtype),
                            device=self.centre_device)
        mean = build.op(base + "/mean", "Mul", [total, scale], device=self.centre_device,
                        T=var.dtype)
        old_centre = _read(build, base + "/centre_before", var, centre, waits)
        new_centre = build.op(base + "/centre_after", "SelectV2", [is_round, mean, old_centre],
                              device=self.centre_device, T=var.dtype)
        writes = [_write(build, base + "/assign_centre", var, centre, new_centre)]
        for i in range(replicas):
            copy = replica_prefix(i) + var.name
            value = build.op(f"{base}/local_after_{i}", "SelectV2",
                             [is_round, new_centre, reads[i]],
                             device=ir.node(copy)["device"], T=var.dtype)
            writes.append(_write(build, f"{base}/assign_local_{i}", var, copy, value))
        return writes

    @staticmethod
    def _count_rounds(ir, build, tg, is_round) -> None:
        """global_step's increments add their amount on rounds and zero otherwise."""
        if not tg.global_step or tg.global_step not in ir:
            return
        for dst, port in list(ir.consumers(tg.global_step)):
            if port != 0 or ir.op(dst) not in ("AssignAdd", "AssignAddVariableOp"):
                continue
            amount = ir.inputs(dst)[1]
            dtype = tg.variables[tg.global_step].dtype
            zero = build.op(dst + "/model_average_zero", "ZerosLike", [f"{amount[0]}:{amount[1]}"],
                            device=ir.node(dst)["device"], T=dtype)
            counted = build.op(dst + "/model_average_on_round", "SelectV2",
                               [is_round, f"{amount[0]}:{amount[1]}", zero],
                               device=ir.node(dst)["device"], T=dtype)
            ir.set_input(dst, 1, counted)


def _initial_tensor(ir, var) -> str | None:
    """The tensor replica 0's initializer assigns (every replica's copy starts from it)."""
    init = replica_prefix(0) + var.initializer if var.initializer else None
    if not init or init not in ir:
        return None
    src, port = ir.input(init, 1)
    return f"{src}:{port}"


def _new_variable(ir, build, name, kind, dtype, shape, device, value):
    """A variable ``name`` initialised from tensor ``value``, listed in the 'variables'
    collection so global_variables_initializer covers it."""
    from tensorflow.core.framework import variable_pb2
    if value is None:
        raise GraphxformError(f"variable for '{name}' has no initial value to start from")
    if kind == "resource":
        handle = build.op(name, "VarHandleOp", device=device, dtype=dtype, shape=list(shape),
                          shared_name=name)
        assign = build.op(name + "/Assign", "AssignVariableOp", [handle, value], device=device,
                          dtype=dtype)
        snapshot = build.op(name + "/Read/ReadVariableOp", "ReadVariableOp", [handle],
                            device=device, dtype=dtype)
    else:
        handle = build.op(name, "VariableV2", device=device, dtype=dtype, shape=list(shape))
        assign = build.op(name + "/Assign", "Assign", [handle, value], device=device, T=dtype)
        snapshot = build.op(name + "/read", "Identity", [handle], device=device, T=dtype)
    vd = variable_pb2.VariableDef(variable_name=handle + ":0", initializer_name=assign,
                                  snapshot_name=snapshot + ":0", initial_value_name=value,
                                  is_resource=kind == "resource", trainable=False)
    ir.meta.collection_def["variables"].bytes_list.value.append(vd.SerializeToString())
    return handle


def _read(build, name, var, variable, waits) -> str:
    device = build.ir.node(variable)["device"]
    if var.kind == "resource":
        return build.op(name, "ReadVariableOp", [variable] + waits, device=device,
                        dtype=var.dtype)
    return build.op(name, "Identity", [variable] + waits, device=device, T=var.dtype)


def _write(build, name, var, variable, value) -> str:
    device = build.ir.node(variable)["device"]
    if var.kind == "resource":
        return build.op(name, "AssignVariableOp", [variable, value], device=device,
                        dtype=var.dtype)
    return build.op(name, "Assign", [variable, value], device=device, T=var.dtype)


def _numpy(dtype: int):
    from graphxform.nodes import numpy_dtype
    return numpy_dtype(dtype)

