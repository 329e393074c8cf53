"""Human and JSON reports of a training graph (`graphxform inspect`)."""

from __future__ import annotations

import collections

from graphxform.ir import GraphIR
from graphxform.training import TrainingGraph


def _dtype(enum_value: int) -> str:
    from tensorflow.core.framework import types_pb2
    return types_pb2.DataType.Name(enum_value)[3:].lower()


def _steps_of(tg: TrainingGraph, var) -> list[str]:
    return [s.name for s in tg.steps if set(var.updates) & s.closure]


def _gradient(grad) -> dict:
    return {"kind": grad.kind, **({"tensor": grad.tensor} if grad.kind == "dense" else
                                  {"values": grad.values, "indices": grad.indices}),
            "reduced_at": grad.tensor if grad.kind == "dense" else grad.values}


def _applications(tg: TrainingGraph, var) -> list[dict]:
    """Every gradient an optimizer applies to ``var``, with its update and the steps that run
    it: two for an actor-critic's shared trunk (each reduced in its own step), else one."""
    if not var.applications:
        return [] if var.gradient is None else [
            dict(_gradient(var.gradient), update=var.applied_by, steps=_steps_of(tg, var))]
    return [dict(_gradient(a.gradient), update=a.update,
                 steps=[s.name for s in tg.steps if a.update in s.closure])
            for a in var.applications]


def inspect_document(ir: GraphIR, tg: TrainingGraph) -> dict:
    variables = []
    for var in tg.variables.values():
        grad = var.gradient
        variables.append({
            "name": var.name, "kind": var.kind, "shape": list(var.shape),
            "dtype": var.dtype_name, "bytes": var.nbytes, "device": var.device,
            "trainable": var.trainable, "role": var.role,
            "updates": [{"op": u, "type": ir.op(u)} for u in var.updates],
            "gradient": None if grad is None else _gradient(grad),  # the first of "gradients"
            "gradients": _applications(tg, var),
            "steps": _steps_of(tg, var),
            "slots": dict(var.slots), "slot_of": var.slot_of,
            "initializer": var.initializer,
        })
    ops = collections.Counter(ir.op(n) for n in ir.nodes())
    opt = tg.optimizer
    return {
        "model": ir.source, "nodes": len(ir),
        "train_op": tg.train_op, "loss": tg.loss, "global_step": tg.global_step,
        "steps": [{"name": s.name, "op": s.op, "loss": s.loss,
                   "variables": sorted(v.name for v in tg.trainable
                                       if set(v.updates) & s.closure)} for s in tg.steps],
        "optimizer": None if opt is None else {"kind": opt.kind, "scope": opt.scope,
                                               "hyperparameters": opt.hyperparameters},
        "inputs": [{"name": i.name, "dtype": _dtype(i.dtype),
                    "shape": None if i.shape is None else list(i.shape), "batched": i.batched}
                   for i in tg.inputs],
        "variables": variables,
        "extra_updates": tg.extra_updates,
        "op_types": dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))),
        "totals": {
            "variables": len(variables),
            "trainable": sum(v["trainable"] for v in variables),
            "bytes": sum(v["bytes"] for v in variables),
            "trainable_bytes": sum(v["bytes"] for v in variables if v["trainable"]),
        },
    }


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def inspect_text(doc: dict) -> str:
    lines = [f"{doc['model']}: {doc['nodes']} nodes"]
    opt = doc["optimizer"]
    lines.append(f"train op: {doc['train_op'] or '(none: not a training graph)'}   "
                 f"loss: {doc['loss'] or '-'}   global_step: {doc['global_step'] or '-'}   "
                 f"optimizer: {opt['kind'] if opt else '-'}")
    for step in doc["steps"]:
        loss = step["loss"] or "(not found: name it with --fetch)"
        lines.append(f"step: {step['name']}   loss: {loss}   "
                     f"updates {len(step['variables'])} trainable variable(s)")
    lines.append("")
    rows = [["variable", "shape", "dtype", "bytes", "device", "trainable", "role", "update",
             "gradient", "slots"]]
    for v in doc["variables"]:
        updates = ",".join(sorted({u["type"] for u in v["updates"]})) or "-"
        kinds = [g["kind"] for g in v["gradients"]]
        rows.append([v["name"], "[" + ",".join(map(str, v["shape"])) + "]", v["dtype"],
                     _human_bytes(v["bytes"]), v["device"] or "-", "yes" if v["trainable"] else
                     "no", v["role"], updates, ",".join(kinds) or "-",
                     ",".join(v["slots"].values()) or "-"])
    lines += _table(rows)
    reduced = [v for v in doc["variables"] if v["gradients"]]
    if reduced:  # one row per gradient: a trunk two optimizers train has two, in two steps
        lines.append("")
        lines.append("where each gradient is born (and reduced across replicas):")
        lines += _table([["variable", "step", "gradient", "applied by"]] + [
            [v["name"], ",".join(g["steps"]) or "-", g["reduced_at"] +
             (f" (indices {g['indices']})" if g["kind"] == "sparse" else ""),
             g["update"] or "-"] for v in reduced for g in v["gradients"]])
    lines.append("")
    lines.append("inputs:")
    for i in doc["inputs"]:
        shape = "?" if i["shape"] is None else "[" + ",".join(
            "?" if d < 0 else str(d) for d in i["shape"]) + "]"
        lines.append(f"  {i['name']}  {i['dtype']}{shape}" + ("  (batch)" if i["batched"] else ""))
    top = list(doc["op_types"].items())
    lines.append("")
    lines.append("op types: " + ", ".join(f"{op} {n}" for op, n in top[:12]) +
                 (f", ... ({len(top)} types)" if len(top) > 12 else ""))
    t = doc["totals"]
    lines.append(f"totals: {t['variables']} variables ({t['trainable']} trainable), "
                 f"{_human_bytes(t['bytes'])} ({_human_bytes(t['trainable_bytes'])} trainable)")
    return "\n".join(lines)
