"""Variable updates: every trainable variable is updated exactly once per step from a
cross-replica gradient, every replica starts from the same values, and no replica reads a copy
that no longer updates.

`apply` proves the contract given the input graph's analysis (graphxform/contract.py). Here
there is no input graph: what the input was is read back from the transformed graph's own
names and collections. Its variables are analysed as they are (``training.analyze``); the copies
``replica_<i>/w`` of one variable are the original ``w`` (a shared ``w`` is its own one copy);
each copy's writes are counted per step. Then contract.check runs on that view for what it
proves (writes read only values equal on every replica, replicas start equal, once-per-step
writes read no single replica's value), and the counting checks here say what it cannot know
without the input: a copy written twice in one step (two optimizer applies, or the same write
from several replicas), copies of one variable written different numbers of times, a copy some
replica reads while another copy is the one that updates."""

from __future__ import annotations

import collections
import dataclasses
import re

from graphxform import contract, moving_statistics, training
from graphxform.errors import GraphxformError
from graphxform.inspector.findings import CheckResult
from graphxform.inspector.scopes import fold_name
from graphxform.ir import GraphIR, parse_tensor

_LEADING_REPLICA = re.compile(r"^replica_(\d+)/")
_QUOTED = re.compile(r"'([^']+)'")
MODEL_AVERAGE_CENTRES = "model_average/centre/"  # graphxform.passes.model_average's centres


@dataclasses.dataclass
class View:
    """The input graph's variables and steps as the transformed graph holds them: per original
    variable its copies (``replica_<i>/w``, or ``w`` when shared), and per step the nodes it
    runs in the transformed graph."""
    replicas: int
    copies: dict  # original variable -> its copies
    input_view: training.TrainingGraph  # original names: what contract.check takes as input
    closures: list  # (step name, nodes the step runs), in the transformed graph


def replica_count(ir: GraphIR) -> int:
    """How many replicas the graph's names have (0: none)."""
    found = set()
    for name in ir.nodes():
        if name.startswith("replica_"):
            match = _LEADING_REPLICA.match(name)
            if match:
                found.add(int(match.group(1)))
    return max(found) + 1 if found else 0


def original(name: str) -> str:
    return _LEADING_REPLICA.sub("", name, count=1)


def view(ir: GraphIR, train_op=None) -> View:
    """The view read from the transformed graph alone: its own analysis, copies grouped by
    their original name, each original's role worked out again (an optimizer's scope is
    ``replica_0/Momentum`` here, not ``Momentum``)."""
    analysis = training.analyze(ir, train_op=train_op)
    copies = collections.defaultdict(list)
    for name in analysis.variables:
        copies[original(name)].append(name)
    optimizer_scopes = {_optimizer_scope(original(u)) for v in analysis.variables.values()
                        for u in v.updates if training.is_apply_op(ir.op(u))}
    variables = {}
    for name, names in copies.items():
        members = [analysis.variables[n] for n in names]
        first = next((v for v in members if v.name.startswith("replica_0/")), members[0])
        most = max(len(v.updates) for v in members)
        var = dataclasses.replace(
            first, name=name, updates=[""] * most,
            trainable=any(v.trainable for v in members),
            gradient=next((v.gradient for v in members if v.gradient), None),
            initializer=original(first.initializer) if first.initializer else None,
            slot_of=original(first.slot_of) if first.slot_of else None)
        var.role = _role(var, first, analysis, optimizer_scopes)
        # replica 0's copies sit in the scope the output's analysis takes for the optimizer's
        var.moving_statistic = next((v.moving_statistic for v in members if v.moving_statistic),
                                    None)
        if var.moving_statistic is None and var.role == "statistic" and \
                moving_statistics.NAMED.search(name):
            var.moving_statistic = moving_statistics.BY_NAME
        variables[name] = var
    input_view = dataclasses.replace(analysis, variables=variables)
    closures = [(step.name, _runs(ir, step, analysis.saver_scope)) for step in analysis.steps]
    input_view.variables = {name: var for name, var in variables.items()
                            if not name.startswith(MODEL_AVERAGE_CENTRES)}
    return View(replica_count(ir), dict(copies), input_view, closures)


def _runs(ir: GraphIR, step, saver_scope) -> set:
    """What running a step runs: its closure, grown to the sinks that wait on it (the user's
    `train_op` group runs the optimizer's op and, after it, an EMA or a model average; the
    transformed graph's collection may name the optimizer's op alone)."""
    node = parse_tensor(step.name)[0]
    seen, stack, sinks = {node}, [node], []
    while stack and len(seen) < 100000:
        current = stack.pop()
        after = [n for n in ir.successors(current) if not _dangling_read(ir, n)]
        if not after and current != node:
            sinks.append(current)
        for n in after:
            if n not in seen:
                seen.add(n)
                stack.append(n)
    closure = set(step.closure)
    for sink in sinks:
        if ir.op(sink) == "NoOp" and not (saver_scope and sink.startswith(saver_scope)):
            closure |= ir.ancestors(sink)
    return closure


def _dangling_read(ir: GraphIR, node: str) -> bool:
    return ir.op(node) == "ReadVariableOp" and not any(True for _ in ir.successors(node))


def _role(var, first, analysis, optimizer_scopes) -> str:
    if var.trainable and var.updates:
        return "trainable"
    if var.slot_of:
        return "slot"
    if first.name == analysis.global_step or var.name == "global_step":
        return "global_step"
    if not first.updates:
        return first.role
    if all(original(u).startswith(tuple(optimizer_scopes)) for u in first.updates):
        return "optimizer_state"
    return "statistic"


def _optimizer_scope(apply: str) -> str:
    """'Momentum/update_w/ResourceApplyMomentum' -> 'Momentum/' (partitioned: the shard's
    'w/part_0/Momentum/')."""
    if "/update_" in apply:
        return apply.split("/update_", 1)[0] + "/"
    return apply.split("/", 1)[0] + "/"


def view_from_input(ir: GraphIR, tg: training.TrainingGraph, replicas: int,
                    closures: list | None = None) -> View:
    """The view when the input's own analysis is at hand (`apply`): no second analysis.
    ``closures``: ``contract.step_closures(ir, tg)``, when the caller has them already."""
    copies = {name: contract._copies(ir, name, replicas) for name in tg.variables}
    if closures is None:
        closures = contract.step_closures(ir, tg)
    return View(replicas, {k: v for k, v in copies.items() if v}, tg, closures)


def check(ir: GraphIR, found: View | None = None, asynchronous: bool = False) -> CheckResult:
    result = CheckResult("updates")
    if found is None:
        try:
            found = view(ir)
        except GraphxformError as e:
            result.ran = False
            result.summary = f"not analysed: {e}"
            return result
    closures = found.closures
    if not closures:
        result.ran = False
        result.summary = "no training step (no train op)"
        return result
    trainable = sorted(name for name, var in found.input_view.variables.items()
                       if var.trainable and var.updates)
    for name in sorted(found.copies):
        _count_writes(ir, result, name, found.copies[name], closures, asynchronous)
    _stale_copies(ir, result, found, closures)
    _contract(ir, result, found, asynchronous)
    copies = sum(len(found.copies[n]) for n in trainable)
    result.summary = (f"{len(trainable)} trainable variables ({copies} copies, "
                      f"{found.replicas or 1} replica(s)) over {len(closures)} step(s)")
    if not result.findings:
        result.summary += (": each updated once per step from values equal on every replica; "
                           "replicas start equal")
    return result


def _count_writes(ir, result, name, copies, closures, asynchronous) -> None:
    """Per step: an optimizer applies once to a copy, no write is repeated by several
    replicas; over the steps: every copy of a variable is written as often as the others."""
    totals = {}
    for copy in copies:
        total = 0
        for step, closure in closures:
            writes = sorted(contract._writes(ir, copy, closure))
            total += len(writes)
            applies = [w for w in writes if training.is_apply_op(ir.op(w))]
            if len(applies) > 1 and not asynchronous:
                result.error(f"variable '{name}': its copy '{copy}' is updated by "
                             f"{len(applies)} optimizer applies in one step ({step})",
                             [copy] + applies)
            by_fold = collections.defaultdict(list)
            for write in writes:
                by_fold[fold_name(write)[0]].append(write)
            for folded, same in by_fold.items():
                if len(same) > 1 and not asynchronous:
                    result.error(f"variable '{name}': '{copy}' is written by {len(same)} "
                                 f"replicas' copies of '{folded}' in one step ({step}): only "
                                 "the last one counts", [copy] + same)
        totals[copy] = total
    if len(set(totals.values())) > 1:
        common = collections.Counter(totals.values()).most_common(1)[0][0]
        odd = sorted(c for c, n in totals.items() if n != common)
        said = ", ".join(f"'{c}' {totals[c]}" for c in odd)
        result.error(f"variable '{name}': its copies are written {common} time(s) per step, "
                     f"but {said}: the replicas would train apart", odd)


def _stale_copies(ir, result, found: View, closures) -> None:
    """A copy read in a step while another copy of the variable is the one that updates."""
    closure = set().union(*(c for _, c in closures))
    for name, copies in sorted(found.copies.items()):
        written = [c for c in copies if contract._writes(ir, c, closure)]
        if not written or len(written) == len(copies):
            continue
        for copy in sorted(set(copies) - set(written)):
            readers = sorted(dst for dst, _ in ir.consumers(copy) if dst in closure
                             and not training.is_mutating_op(ir.op(dst)))
            if readers:
                result.error(f"variable '{name}': the step reads '{copy}', which no step "
                             f"updates (the copy that updates is '{written[0]}'): that replica "
                             "trains on its initial values", [copy] + readers[:5])


def _contract(ir, result, found: View, asynchronous) -> None:
    """What contract.check proves, on the view: a failure is an error naming the nodes its
    message quotes (a warning when no replica exchanges anything: each trains alone)."""
    replicas = max(found.replicas, 1)
    try:
        if ir.has_scope(MODEL_AVERAGE_CENTRES):  # averaged every K steps: its own invariant
            contract.check(ir, found.input_view, replicas, asynchronous=True)
            contract.check_model_average(ir, found.input_view, replicas)
        else:
            contract.check(ir, found.input_view, replicas, asynchronous=asynchronous)
    except contract.ContractError as e:
        nodes = [parse_tensor(q)[0] for q in _QUOTED.findall(str(e))]
        nodes = [n for n in nodes if n in ir]
        if _exchanges_nothing(ir, found):
            result.warning(f"replicas never exchange gradients, so each trains on its own "
                           f"slice and they drift apart (not drop-in): {e}", nodes)
        else:
            result.error(str(e), nodes)


def _exchanges_nothing(ir, found: View) -> bool:
    """No op combines replicas and every trainable variable has a copy per replica: the graph
    of the `independent` strategy."""
    from graphxform.replica_spread import CROSS_REPLICA_OPS
    if ir.nodes_of(CROSS_REPLICA_OPS):
        return False
    return all(_LEADING_REPLICA.match(copy) for name, var in found.input_view.variables.items()
               if var.trainable for copy in found.copies[name])
