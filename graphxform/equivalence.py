"""Train the original and the transformed graph from the same checkpoint on the same feeds and
compare: per-variable largest relative difference, per-step loss and fetches, and whether every
replica of a variable still holds the same value."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile

import numpy as np

from graphxform import distributed, training
from graphxform.distributed import ClusterPlan
from graphxform.ir import GraphIR
from graphxform.nodes import replica_prefix
from graphxform.runtime import Feeds, Runner, cpus_by_job


@dataclasses.dataclass
class Difference:
    name: str
    relative: float
    replica_spread: float = 0.0  # largest relative gap between replica copies


@dataclasses.dataclass
class Report:
    steps: int
    rtol: float
    variables: list  # Difference per variable
    fetches: list  # Difference per fetched tensor (over all steps)
    losses: list  # (original, transformed) per step
    reasons: list  # why the graphs cannot match, when they cannot

    @property
    def worst(self) -> float:
        return max([d.relative for d in self.variables + self.fetches] +
                   [d.replica_spread for d in self.variables] + [0.0])

    @property
    def ok(self) -> bool:
        return self.worst <= self.rtol


def relative_difference(a, b) -> float:
    """max|a - b| / max|a|: relative to the tensor's scale, so zeros do not blow it up."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf")
    if a.size == 0:
        return 0.0
    scale = max(float(np.max(np.abs(a))), 1e-12)
    return float(np.max(np.abs(a - b))) / scale


def mismatch_reasons(ir: GraphIR, tg: training.TrainingGraph) -> list[str]:
    """Why a synchronous replicated graph cannot match the single-device one step for step."""
    reasons = []
    stats = sorted(v.name for v in tg.variables.values() if v.role == "statistic")
    if stats:
        reasons.append("per-batch statistics (batch norm): each replica computes them on its "
                       f"own slice of the batch ({', '.join(stats[:3])})")
    random_ops = training.random_ops_in_step(ir, tg)
    if random_ops:
        reasons.append("random ops run in every step (dropout, sampling), and replicas draw "
                       f"different numbers ({', '.join(random_ops[:3])})")
    return reasons


def compare(original: GraphIR, transformed: GraphIR, feeds_path: str | None = None,
            steps: int = 5, batch_size: int | None = None, fetches=(), rtol: float = 1e-5,
            train_op: str | None = None) -> Report:
    tg = training.analyze(original, train_op=train_op)
    feeds = Feeds(tg.inputs, feeds_path, batch_size)
    with tempfile.TemporaryDirectory(prefix="graphxform-verify-") as tmp:
        with Runner(original, train_op=train_op, fetches=fetches) as run:
            run.initialize()
            start = run.save(os.path.join(tmp, "start"))
            before = [run.step(feeds.batch(k)) for k in range(steps)]
            expected = run.variable_values()
        with _transformed_runner(transformed, fetches) as run:
            run.restore(start)
            after = [run.step(feeds.batch(k)) for k in range(steps)]
            got = run.variable_values()
    _join_shards(got, expected)
    variables = []
    for name in sorted(expected):
        copies = [got[name]] if name in got else [
            got[replica_prefix(i) + name] for i in range(len(got))
            if replica_prefix(i) + name in got]
        if not copies:
            variables.append(Difference(name, float("inf")))
            continue
        spread = max(relative_difference(copies[0], c) for c in copies)
        variables.append(Difference(name, relative_difference(expected[name], copies[0]), spread))
    fetched = [Difference(name, max(relative_difference(b.fetches[name], a.fetches[name])
                                    for b, a in zip(before, after))) for name in fetches]
    losses = [(b.loss, a.loss) for b, a in zip(before, after)]
    if tg.loss:
        fetched.insert(0, Difference(tg.loss, max(
            [relative_difference(b, a) for b, a in losses] + [0.0])))
    reasons = mismatch_reasons(original, tg)
    plan = ClusterPlan.from_ir(transformed)
    if plan is not None and plan.is_async:
        reasons.append("--async: each worker applies its own gradient when it is ready, so "
                       "updates interleave in no fixed order")
    return Report(steps, rtol, variables, fetched, losses, reasons)


def _join_shards(got: dict, expected: dict) -> None:
    """A variable partition-variables split into `<name>/part_<k>` is compared whole."""
    for name in expected:
        if name not in got and f"{name}/part_0" in got:
            parts = []
            while f"{name}/part_{len(parts)}" in got:
                parts.append(got.pop(f"{name}/part_{len(parts)}"))
            if parts:
                got[name] = np.concatenate(parts, axis=0)


@contextlib.contextmanager
def _transformed_runner(transformed: GraphIR, fetches):
    """A Runner for the transformed graph; a cluster graph gets its cluster's servers started
    in this process on fresh 127.0.0.1 ports and a session on its chief."""
    plan = ClusterPlan.from_ir(transformed)
    if plan is None:
        with Runner(transformed, fetches=fetches) as run:
            yield run
        return
    cluster = distributed.local_cluster(plan.job_sizes())
    job, task = plan.chief.split(":")
    with distributed.InProcessCluster(cluster, cpus=cpus_by_job(transformed)) as servers:
        config = distributed.session_config(job, int(task), chief=True)
        with Runner(transformed, fetches=fetches, target=servers.target(job, int(task)),
                    config=config) as run:
            yield run


def format_report(report: Report) -> str:
    lines = [f"{'variable':40} {'max rel diff':>13} {'replica spread':>15}"]
    for d in sorted(report.variables, key=lambda d: -d.relative):
        lines.append(f"{d.name:40} {d.relative:13.2e} {d.replica_spread:15.2e}")
    for d in report.fetches:
        lines.append(f"{'fetch ' + d.name:40} {d.relative:13.2e}")
    lines.append("step  loss (original)  loss (transformed)")
    for k, (a, b) in enumerate(report.losses, start=1):
        if a is not None:
            lines.append(f"{k:4}  {a:15.7f}  {b:18.7f}")
    verdict = "PASS" if report.ok else "FAIL"
    lines.append(f"{verdict}: largest relative difference {report.worst:.2e} after "
                 f"{report.steps} steps (tolerance {report.rtol:.0e})")
    for reason in report.reasons:
        lines.append(f"cannot match exactly: {reason}")
    return "\n".join(lines)
