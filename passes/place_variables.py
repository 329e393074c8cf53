"""place-variables: spread variables over the ps tasks, greedily by bytes.

Largest first, each onto the task holding the fewest bytes so far (LPT scheduling), so no task
ends up with more than its fair share plus the largest single variable. A variable's slots go
with it: the optimizer updates them together."""

from __future__ import annotations

import dataclasses

from graphxform.errors import GraphxformError
from graphxform.pipeline import Pass, PassResult


def balance(sizes: dict, tasks: int) -> dict:
    """{name: bytes} -> {name: task index}, greedy largest-first onto the lightest task."""
    if tasks < 1:
        raise GraphxformError("the ps job has no tasks to place variables on")
    load = [0] * tasks
    placement = {}
    for name, size in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        task = min(range(tasks), key=lambda t: (load[t], t))
        placement[name] = task
        load[task] += size
    return placement


def ps_device(task: int) -> str:
    return f"/job:ps/task:{task}/device:CPU:0"


@dataclasses.dataclass
class PlaceVariables(Pass):
    name = "place-variables"
    ps_tasks: int = 1

    def run(self, ir, ctx):
        variables = ctx.training.variables
        groups = {}  # primary variable -> its slots and itself
        for var in variables.values():
            owner = var.slot_of or var.name
            groups.setdefault(owner, []).append(var.name)
        sizes = {owner: sum(variables[v].nbytes for v in members)
                 for owner, members in groups.items()}
        placement = balance(sizes, self.ps_tasks)
        devices = {}
        for owner, task in placement.items():
            for member in groups[owner]:
                devices[member] = ir.node(member)["device"] = ps_device(task)
        ctx.state[self.name] = {"placement": placement, "bytes": sizes, "devices": devices}
        return PassResult(modified=bool(placement), summary={"ps_tasks": self.ps_tasks})
