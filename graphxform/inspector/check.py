"""`graphxform check`: static checks of a transformed graph before anyone runs it.

Each check reads the graph alone (its names, collections and plan; no input graph, nothing
run), so it works on any transformed graph, a hand-edited one included, and `apply` runs the
same checks before writing. Findings name nodes; errors make `check` exit 1 and `apply` refuse.

- collectives: the same collectives, order, keys, dtypes and shapes on every participant;
- updates: trainable variables updated once per step from cross-replica values, replicas start
  equal, no replica reads a copy that stopped updating;
- accumulators: ``num_required`` equals the workers feeding each one, every worker's step ends
  with its token and runs its own replicas only, hybrid's barrier gets one token per worker
  (parameter servers, hybrid);
- losses: averaged, not summed, across replicas where each replica's loss is a mean;
- stateful: batch-norm statistics, counters, random ops and queues, with how each replica
  treats them (information only).
"""

from __future__ import annotations

import dataclasses
import os
import time

from graphxform.errors import GraphxformError
from graphxform.inspector import accumulators, collectives, losses, stateful, updates
from graphxform.inspector.findings import ERROR, WARNING
from graphxform.ir import GraphIR

CHECKS = ("collectives", "updates", "accumulators", "losses", "stateful")


class CheckError(GraphxformError):
    """`apply` refuses a graph the checks find errors in."""


@dataclasses.dataclass
class Report:
    model: str
    nodes: int
    replicas: int
    results: list
    seconds: float = 0.0

    @property
    def findings(self) -> list:
        return [f for r in self.results for f in r.findings]

    @property
    def errors(self) -> list:
        return [f for f in self.findings if f.level == ERROR]

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict:
        return {"model": self.model, "nodes": self.nodes, "replicas": self.replicas,
                "ok": self.ok, "errors": len(self.errors),
                "warnings": sum(f.level == WARNING for f in self.findings),
                "checks": {r.name: {"status": r.status, "summary": r.summary}
                           for r in self.results},
                "findings": [dataclasses.asdict(f) for f in self.findings]}

    def text(self) -> str:
        lines = [f"check {self.model}: {self.nodes} nodes, {self.replicas or 'no'} replicas"]
        for r in self.results:
            lines.append(f"  {r.name:13} {r.status:7} {r.summary}")
        for r in self.results:
            for f in r.findings:
                lines.append(f"{r.name}: {f.text()}")
        warnings = sum(f.level == WARNING for f in self.findings)
        lines.append(f"{len(self.errors)} error(s), {warnings} warning(s)" +
                     ("" if self.ok else ": this graph should not be run as it is"))
        return "\n".join(lines)


def run(ir: GraphIR, train_op=None, skip=(), asynchronous: bool | None = None,
        input_analysis=None, replicas: int | None = None, closures: list | None = None) -> Report:
    """Every check on ``ir`` but those in ``skip``. `apply` hands over the input's analysis
    (``input_analysis``, with ``replicas`` and the steps' ``closures`` the contract used) and
    skips `updates`, which contract.check has just proven from it; `check` reads everything
    from the graph alone."""
    start = time.perf_counter()
    if input_analysis is not None:
        view = updates.view_from_input(ir, input_analysis, replicas or updates.replica_count(ir),
                                       closures)
    else:
        try:
            view = updates.view(ir, train_op=train_op)
        except GraphxformError:  # no training step to analyse: the other checks still run
            view = None
    if asynchronous is None:
        asynchronous = bool((accumulators.plan_of(ir) or {}).get("async"))
    runs = {
        "collectives": lambda: collectives.check(ir),
        "updates": lambda: updates.check(ir, view, asynchronous=asynchronous),
        "accumulators": lambda: accumulators.check(ir),
        "losses": lambda: losses.check(ir, view),
        "stateful": lambda: stateful.check(ir, view),
    }
    with ir.indexed_by_op():
        results = [runs[name]() for name in CHECKS if name not in skip]
    count = view.replicas if view is not None else updates.replica_count(ir)
    return Report(os.path.basename(ir.source or "graph"), len(ir), count, results,
                  time.perf_counter() - start)


def require_ok(report: Report) -> None:
    """Refuse (for `apply`) a graph with errors, naming the first and counting the rest."""
    if report.ok:
        return
    first = report.errors[0]
    more = len(report.errors) - 1
    raise CheckError(f"the transformed graph fails `check` ({first.check}): {first.message}" +
                     (f" (and {more} more error(s): `apply --dump-dir D` keeps the last stage "
                      "for `graphxform check D/NN_<pass>.pbtxt`)" if more else ""))
