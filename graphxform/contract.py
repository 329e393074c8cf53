"""The contract check: before `apply` writes a graph, prove from the graph that it trains like
the single-device one, or refuse naming the variable.

What is proven, on the transformed graph (DESIGN.md, the drop-in contract, item 8):
- every variable a step updates (trainable or not: global_step too) is written by as many ops
  per step as in the input (never twice: two replicas' updates landing on one shared copy);
- every one of those writes reads only values that are equal on every replica: computed from
  constants, variables, shared inputs and cross-replica results (collective all-reduce and
  all-gather, accumulator take_grad), never from a replica's own slice of the batch. A write
  that reads a replica-local value means the gradient was not reduced (or not found);
- every replica's copy of a variable starts equal: its initializer reads replica 0's initial
  value, or an initial value made of constants alone.

What differs between replicas, and which replicas' slices reach a value, is
graphxform.replica_spread's analysis: a reduction may be a collective, or ops outside every
replica that combine all replicas' values (tf_cnn_benchmarks' pscpu and xring).
"""

from __future__ import annotations

import functools
import operator
import re

from graphxform import opdefs
from graphxform.errors import ContractError
from graphxform.fetch_races import runs_before
from graphxform.functions import WHILE_OPS, called_nodes, random_in_function
from graphxform.ir import CONTROL_KEY, GraphIR, data_pairs, parse_tensor, paused_gc, tensor_name
from graphxform.nodes import replica_prefix
from graphxform.replica_spread import (CROSS_REPLICA_OPS, SPLIT_SCOPE, ReplicaSpread,
                                       combines_every_replica)
from graphxform.training import (REPLICA_SCOPE, VARIABLE_OPS, TrainingGraph, is_apply_op,
                                 consumers_through_switches, gradient_scope, is_mutating_op,
                                 tape_gradients)



def check_input(ir: GraphIR, tg: TrainingGraph) -> None:
    """What is refused on the input graph, before any pass, when the batch will be split: a
    step whose loss mixes the examples of its batch (graphxform/batch_mixing.py says why), or
    reads state the step updates from the batch, or applies gradients another op stored."""
    with paused_gc():  # its walks keep states and sets of thousands of nodes
        _check_input(ir, tg)


def _check_input(ir: GraphIR, tg: TrainingGraph) -> None:
    from graphxform import towers
    from graphxform.batch_mixing import mixing_in
    sources = tg.batch_sources
    _check_batch_axis(tg)
    _check_sparse_lookalikes(ir, tg)
    _check_batch_state_feeds_losses(ir, tg)
    _check_learned_samplers(ir, tg)
    _check_gradients_kept_between_runs(ir, tg)
    _check_distributed_already(ir, tg)
    _check_selected_means(ir, tg)
    shapes = [parts[2] for parts in tg.sparse_inputs.values()]  # dense shapes: [size, ...]
    indices = [parts[0] for parts in tg.sparse_inputs.values()]
    for step in tg.steps:
        if sources:
            towers.check(ir, tg, step)
        for loss in step_losses(ir, step) if sources else ():
            found = mixing_in(ir, loss, sources, shapes, indices)
            if found is None:
                continue
            raise ContractError(
                f"step '{step.name}' minimises '{loss}', which mixes the examples of its "
                f"batch: '{found.node}' ({found.op}) {found.reason}; {found.advice}")


def _check_selected_means(ir: GraphIR, tg: TrainingGraph) -> None:
    """A loss that averages over the elements a mask of the batch selects
    (graphxform/selections.py): each replica would divide by its own slice's count."""
    sources = set(tg.batch_sources)
    if not sources:
        return
    from graphxform.selections import RowSelections
    selections = RowSelections(ir, sources)
    for step in tg.steps:
        for loss in ([step.loss] if step.loss else []) + list(step.towers):
            _check_selected_mean(ir, step, loss, selections, exact=loss == step.loss)


def _check_selected_mean(ir: GraphIR, step, loss: str, selections, exact: bool) -> None:
    """Refuse an average over a selection unless global-denominators makes its count the whole
    batch's (``exact``: it does so for a step's loss, not for towers' losses): a division by
    the count of the selection itself, or a Mean over all its axes (graphxform/selections.py);
    that pass refuses what it then finds is not a mask of the examples."""
    from graphxform.selections import averaged_selection, loss_means, selection_counted
    terms = loss_means(ir, loss)
    for mean, counted in terms + _means_off_the_terms(ir, loss, {m for m, _ in terms}):
        selection = selections.of(counted)
        if selection is None or exact and (mean, counted) in terms and (
                averaged_selection(ir, mean) if ir.op(mean) == "Mean" else
                selection_counted(ir, ir.inputs(mean)[1][0])) is not None:
            continue
        raise ContractError(
            f"step '{step.name}' minimises '{loss}', which averages ('{mean}') over "
            f"the elements that '{selection}' ({ir.op(selection)}) picks with a mask of "
            "the batch (tf.boolean_mask, or a gather of tf.where's indices) in a way whose "
            "count graphxform cannot make the whole batch's (each replica would divide by its "
            "own slice's count); the exact forms are tf.reduce_mean over every axis of the "
            "selection (its other dimensions known), its sum over tf.size(sel), "
            "tf.shape(sel)[0] or the mask's sum (tf.reduce_sum(tf.cast(m, tf.float32))), or "
            "train on one device")


def _means_off_the_terms(ir: GraphIR, loss: str, terms: set) -> list:
    """The Means over axis 0 (or axes not known) the loss reads other than as a sum or
    multiple of them (``terms``), as (Mean, its input): a mean over a selection's rows
    sliced or summed over its columns, which no pass makes the whole batch's."""
    from graphxform.nodes import const_value
    found, node_table = [], ir.g._node
    for node in ir.ancestors(parse_tensor(loss)[0]):
        if node_table[node]["op"] != "Mean" or node in terms or gradient_scope(node):
            continue
        axes = const_value(ir, ir.input(node, 1)[0])
        if axes is None or 0 in axes.reshape(-1).tolist() or (axes < 0).any():
            found.append((node, ir.input(node, 0)[0]))
    return found


def _check_batch_axis(tg: TrainingGraph) -> None:
    """The batch is split on axis 0 of inputs whose axis 0 is unknown. An input the step reads
    whole whose unknown dimension is another axis most likely holds the batch there (a
    time-major sequence [time, batch, ...] for dynamic_rnn(time_major=True) or ctc_loss's
    default): every replica would read all of it beside its slice of the others, and train on
    examples paired with other examples' labels, or fail at run time. Refuse."""
    if not tg.batch_sources:
        return
    for inp in tg.inputs:
        if (inp.batch_source or not inp.read_by_step or not inp.shape
                or -1 not in inp.shape[1:]):
            continue
        axis = inp.shape.index(-1)
        shape = "[" + ", ".join("?" if d < 0 else str(d) for d in inp.shape) + "]"
        batched = next(i.name for i in tg.inputs if i.batch_source)
        raise ContractError(
            f"input '{inp.name}' has shape {shape}: its unknown dimension is axis {axis}, not "
            f"axis 0, so it may hold the batch there (time-major data), but only axis 0 is "
            f"split across replicas (as for '{batched}'): each replica would read all of "
            f"'{inp.name}' beside its slice of the others; feed it batch-major (axis 0 the "
            "batch, transposed in the graph)")


def _check_sparse_lookalikes(ir: GraphIR, tg: TrainingGraph) -> None:
    """A SparseTensor built from plain placeholders (``tf.SparseTensor(indices, values,
    dense_shape)``) rather than by ``tf.compat.v1.sparse_placeholder``: indices [?, rank] int64
    and values [?] look batched, so their rows (the entries, not the examples) would be split
    across replicas, pairing entries with other examples' labels. Refuse an int64 [?, rank]
    input that is read as a SparseTensor's indices (by a sparse op, or its column 0 as the
    segment ids embedding_lookup_sparse sums entries by), or that comes with a [?] input and
    an int64 [rank] input no step splits (values and dense shape), unless it is a
    sparse_placeholder's."""
    if not tg.batch_sources:
        return
    plain = [i for i in tg.inputs if not i.sparse and i.shape is not None]
    for indices in plain:
        if not (indices.batched and indices.dtype == 9 and len(indices.shape) == 2
                and indices.shape[1] != 1):
            continue
        rank = indices.shape[1]
        described = f"'{indices.name}' (int64 [?, {'?' if rank < 0 else rank}])"
        why = ("rows are entries, not examples, and splitting them across replicas would pair "
               "entries with other examples' labels; build the SparseTensor with "
               "tf.compat.v1.sparse_placeholder, which graphxform splits by examples")
        reader = _sparse_indices_reader(ir, indices.name)
        if reader is not None:
            raise ContractError(
                f"input {described} is read as a SparseTensor's indices (by '{reader}', "
                f"{ir.op(reader)}) fed by a plain placeholder: its {why}")
        shape = next((i for i in plain if i.dtype == 9 and not i.batch_source
                      and len(i.shape) == 1 and i.shape[0] > 1
                      and rank in (-1, i.shape[0])), None)
        values = next((i for i in plain if i.batched and len(i.shape) == 1
                       and i is not indices), None)
        if shape is not None and values is not None:
            raise ContractError(
                f"inputs {described}, '{values.name}' ([?]) and '{shape.name}' (int64 "
                f"[{shape.shape[0]}]) look like a SparseTensor's indices, values and dense "
                f"shape fed by plain placeholders: their {why}")


# ops that read a SparseTensor's indices as their first input, and CTC's labels (the second)
_SPARSE_INDICES_AT = {"SparseTensorDenseMatMul": 0, "SparseToDense": 0, "SparseReorder": 0,
                      "SparseReshape": 0, "SparseFillEmptyRows": 0, "SparseTensorDenseAdd": 0,
                      "SparseSoftmax": 0, "SparseReduceSum": 0, "SparseReduceMax": 0,
                      "SparseReduceSumSparse": 0, "SparseReduceMaxSparse": 0, "SparseAdd": 0,
                      "SparseSlice": 0, "SparseConcat": 0, "SerializeSparse": 0,
                      "SparseDenseCwiseMul": 0, "SparseDenseCwiseAdd": 0,
                      "SparseDenseCwiseDiv": 0, "CTCLoss": 1, "CTCLossV2": 1}
_SEGMENT_IDS_AT = {"SparseSegmentSum": 2, "SparseSegmentMean": 2, "SparseSegmentSqrtN": 2,
                   "SparseSegmentSumWithNumSegments": 2, "SparseSegmentMeanWithNumSegments": 2,
                   "SparseSegmentSqrtNWithNumSegments": 2}


def _sparse_indices_reader(ir: GraphIR, name: str) -> str | None:
    """A node reading ``name`` (through Identities) as a SparseTensor's indices, or a column of
    it as sparse segment ids; None when there is none."""
    nodes, stack = [], [name]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack += [dst for dst, _ in ir.consumers(node) if ir.op(dst) == "Identity"]
    for node in nodes:
        for dst, port in ir.consumers(node):
            if _SPARSE_INDICES_AT.get(ir.op(dst)) == port:
                return dst
            if ir.op(dst) == "StridedSlice" and port == 0:
                for user, at in ir.consumers(dst):
                    if _SEGMENT_IDS_AT.get(ir.op(user)) == at:
                        return user
    return None


def _check_batch_state_feeds_losses(ir: GraphIR, tg: TrainingGraph) -> None:
    """A non-trainable variable the step updates from the batch (not batch norm's moving
    statistics nor a metric's totals) is kept per replica, each copy moved by its own slice.
    Where a loss reads it (center loss's class centres, a memory bank), every later step's
    averaged gradient is computed from state one device never had: refuse. (A variable only
    assigned, or added to, is left to the check of the transformed graph: global-state keeps
    it equal on every replica where what is written is a sum, mean or extreme of the batch.)"""
    from graphxform.equivalence import fed_from_inputs
    from graphxform.passes.global_state import WRITES, state_variables
    kept = {v.name: v for v in state_variables(tg)
            if not all(ir.op(u) in WRITES for u in v.updates)}
    if not kept:
        return
    fed = fed_from_inputs(ir, tg)
    kept = {name: v for name, v in kept.items() if any(u in fed for u in v.updates)}
    if not kept:
        return
    for step in tg.steps:
        if not step.loss:
            continue
        read = kept.keys() & ir.value_sources(parse_tensor(step.loss)[0])
        if read:
            name = min(read)
            raise ContractError(
                f"step '{step.name}' minimises '{step.loss}', which reads variable '{name}', "
                f"and the step updates '{name}' from the batch ('{min(kept[name].updates)}'): "
                "each replica would keep its own copy, moved by its own slice, so later steps' "
                "losses read state one device never has; train on one device (or use "
                "--strategy model-average, which trains replicas apart by design)")


# candidate samplers whose kernel learns its distribution from the true classes it is given
# (tf.random.learned_unigram_candidate_sampler): state inside the op, in no variable
LEARNED_SAMPLERS = ("LearnedUnigramCandidateSampler", "ThreadUnsafeUnigramCandidateSampler")


def _check_learned_samplers(ir: GraphIR, tg: TrainingGraph) -> None:
    """A learned unigram sampler counts the true classes of every batch it is run on, inside
    its kernel, and draws the next step's candidates from those counts. Each replica's copy
    would count its own slice's classes only, so from the second step on it draws candidates
    one device never draws (word2vec's sampled softmax trained apart: apply exited 0, verify
    FAILed by 1.0). Refuse where the true classes come from the batch."""
    found = sorted(n for step in tg.steps for n in step.closure
                   if ir.op(n) in LEARNED_SAMPLERS)
    if not found:
        return
    from graphxform.equivalence import fed_from_inputs
    fed = fed_from_inputs(ir, tg)
    for name in found:
        if ir.inputs(name) and ir.inputs(name)[0][0] in fed:
            raise ContractError(
                f"'{name}' ({ir.op(name)}) learns its sampling distribution from the true "
                "classes of each batch it sees, inside the op: each replica's copy would learn "
                "from its own slice and draw candidates one device never draws; sample from "
                "a fixed distribution (tf.random.fixed_unigram_candidate_sampler with the "
                "classes' counts, log_uniform_candidate_sampler), or train on one device")


def _check_gradients_kept_between_runs(ir: GraphIR, tg: TrainingGraph) -> None:
    """Gradient accumulation across session.run calls, the TF1 recipe: an op outside the train
    op adds each micro-batch's gradients into variables (``acc.assign_add(grad)``, run once per
    micro-batch, alone or as a train op of its own run in turn), and the train op applies those
    variables. Only the gradients a train op applies are all-reduced, so each replica would add
    its own slice's gradient (into a shared variable: N slices' means, N times the gradient),
    and apply exited 0. Refuse, naming the variable and the op that writes it."""
    for step in tg.steps:
        for var in sorted(tg.variables.values(), key=lambda v: v.name):
            if var.trainable or not any(read in step.closure for read in var.reads):
                continue
            for write, port in ir.consumers(var.name):
                if port != 0 or write in step.closure or not is_mutating_op(ir.op(write)):
                    continue
                gradient = _first_ancestor(ir, [src for src, _ in ir.inputs(write)[1:]],
                                           gradient_scope)
                if gradient is not None:
                    raise ContractError(
                        f"variable '{var.name}': '{write}' stores the gradient '{gradient}' in "
                        f"it outside the train op that applies it ('{step.name}'; gradient "
                        "accumulation over several session.run calls); only the gradients a "
                        "train op applies are reduced across replicas, so each replica would "
                        "add its own slice's: accumulate inside the train op, or let the "
                        "replicas' global batch replace the micro-batches")


def _check_distributed_already(ir: GraphIR, tg: TrainingGraph) -> None:
    """A step that already combines gradients across workers (tf.compat.v1.train.
    SyncReplicasOptimizer's accumulators and token queue, collective ops) was distributed by
    hand; splitting it again is not what its code says. The passes read it as something else
    (its queue as an input pipeline), so refuse here, naming the op. (What graphxform made, in
    a graph it transformed, replicate refuses with its own reason.)"""
    aggregating = {op for op in ir.op_types() if _AGGREGATING.search(op)}
    if not aggregating:
        return
    for step in tg.steps:
        found = sorted(n for n in step.closure if ir.op(n) in aggregating
                       and not ir.node(n).get("created_by"))
        if found:
            raise ContractError(
                f"step '{step.name}' already combines gradients across workers: '{found[0]}' "
                f"({ir.op(found[0])}), as tf.compat.v1.train.SyncReplicasOptimizer or "
                "collective ops build; graphxform distributes a single-device graph: export it "
                "with the plain optimizer")


def _first_ancestor(ir: GraphIR, starts: list, wanted) -> str | None:
    """The first of ``starts`` and their data ancestors for which ``wanted(node)`` holds, not
    looking past variables; None when there is none."""
    seen, stack = set(starts), list(starts)
    while stack:
        node = stack.pop()
        if wanted(node):
            return node
        if ir.op(node) in VARIABLE_OPS:
            continue
        for src, _ in ir.inputs(node):
            if src not in seen:
                seen.add(src)
                stack.append(src)
    return None


def check(ir: GraphIR, tg: TrainingGraph, replicas: int, asynchronous: bool = False,
          closures: list | None = None, ordered=()) -> dict:
    """Raise ContractError naming the first variable that breaks the contract; return a
    summary (variable copies proven). ``asynchronous`` (ps --async, documented as not
    drop-in): only the start is checked. ``closures``: ``step_closures(ir, tg)``, when the
    caller has them already. ``ordered``: the (before, after) pairs order-races ordered in
    the input, which every replica must still run in that order."""
    if not tg.steps or replicas < 1:
        return {"variables": 0}
    closure = _union(closures if closures is not None else step_closures(ir, tg))
    _check_ordered(ir, ordered, replicas, closure)
    if replicas > 1 and not asynchronous:
        _check_losses_are_means(ir, tg, replicas)
        _check_custom_gradients(ir, tg, replicas)
    proven_statistics = _synced_moving_statistics(ir, tg)
    function_writes = (_function_writes(ir, tg, closure, proven_statistics)
                       if replicas > 1 and not asynchronous else [])
    checked, proven = 0, []  # proven: (variable, write) whose inputs must be equal everywhere
    from graphxform.passes.global_state import state_variables
    state = {v.name for v in state_variables(tg)} | proven_statistics
    step_writes = StepWrites(ir, closure)
    for var in sorted(tg.variables.values(), key=lambda v: v.name):
        if not var.updates:
            continue
        copies = _copies(ir, var.name, replicas)
        if not copies:
            continue  # partitioned: its shards are checked as the variables they are
        for copy in copies:
            if asynchronous:  # every worker applies its own gradient: documented, not drop-in
                continue
            writes = step_writes.of(copy)
            if len(writes) > len(var.updates):
                raise ContractError(
                    f"variable '{var.name}': its copy '{copy}' is written {len(writes)} times "
                    f"per step ({', '.join(sorted(writes)[:3])}), the input graph writes it "
                    f"{len(var.updates)} time(s)")
            if not var.trainable and var.name not in state:  # batch norm's moving
                continue  # statistics may differ per replica (verify names them)
            proven += [(var, write) for write in sorted(writes)]
            checked += 1
    shared = [] if asynchronous else step_writes.outside_replicas()
    # what the writes read, but the variables they write (which _check_write and
    # _check_shared_writes pass over; a function's call is asked about every input)
    asked = step_writes.values_read([write for _, write in proven] + shared)
    asked.update(src for call, *_ in function_writes for src, _ in ir.inputs(call))
    spread = ReplicaSpread(ir, replicas, step=closure, asked=asked)
    _check_function_writes(ir, function_writes, spread)
    _check_writes(ir, proven, spread)
    kept = {var.name for var in tg.variables.values() if var.moving_statistic
            and not var.trainable and var.name not in state}
    _check_shared_writes(ir, shared, spread, kept)
    _check_start(ir, tg, replicas)
    return {"variables": checked}


def _synced_moving_statistics(ir: GraphIR, tg: TrainingGraph) -> set:
    """The moving statistics found by structure (the TF1 helper's exponential moving averages
    of tf.nn.moments: graphxform/moving_statistics.py) where sync-batch-norm made those moments
    the global batch's: their writes then read one device's values, which is proven like any
    state's. (Those found by name stay each replica's, as README says: not every layer's
    statistics are within that pass's reach.)"""
    from graphxform.moving_statistics import BY_STRUCTURE
    found = {v.name for v in tg.variables.values() if v.moving_statistic == BY_STRUCTURE}
    return found if found and ir.has_scope("sync_batch_norm/") else set()


def _check_ordered(ir: GraphIR, ordered, replicas: int, closure: set) -> None:
    """The input's step read or wrote a variable in no order with a write of it, and
    order-races gave the pair one order (passes/order_races.py), the later one often a copy
    only the step runs: every replica's step (``closure``: what the steps run) still runs that
    pair (or the one shared pair) in it, or the replicas' copies of the variable could part."""
    for before, after in ordered:
        for i in range(replicas):
            first, then = (_copy_in(ir, name, i) for name in (before, after))
            if first is None or then is None:
                continue  # a later pass replaced one: its own proof covers what replaced it
            if then not in closure:
                raise ContractError(
                    f"the step no longer runs '{then}', which order-races ordered after "
                    f"'{first}': the input's step runs '{after}' and '{before}' in no order, "
                    "and each replica picking its own would let their copies of what they "
                    "read and write part")
            if not runs_before(ir, first, then):
                raise ContractError(
                    f"'{then}' no longer runs after '{first}': the input's step runs "
                    f"'{after}' and '{before}' in no order, and each replica picking its own "
                    "would let their copies of what they read and write part")


def _copy_in(ir: GraphIR, name: str, replica: int) -> str | None:
    """Replica ``replica``'s copy of input node ``name``, its one shared copy, or None. A node
    a pass made under the name is neither: merge-fetches' stand-in for a replica's update
    insert-accumulators dropped (ps updates batch norm's moving statistics from replica 0's
    slice alone), which orders nothing."""
    copy = replica_prefix(replica) + name
    if copy in ir:
        return copy
    return name if name in ir and ir.node(name).get("origin") == name else None


def _check_writes(ir: GraphIR, proven: list, spread: ReplicaSpread) -> None:
    """_check_write for each (variable, write) of ``proven``, for those only that read (or
    wait on) a node other than a variable that differs between replicas or that only some
    replicas' slices reach: the others pass it, and most writes are such."""
    nodes, pred = ir.g._node, ir.g._pred
    everything = spread.all
    refused = {name for name in spread.differs.union(
        name for name, mask in spread.coverage.items() if mask not in (0, everything))
        if nodes[name]["op"] not in VARIABLE_OPS}
    for var, write in proven:
        if not refused.isdisjoint(pred[write]):
            _check_write(ir, var, write, spread)


def _check_write(ir: GraphIR, var, write: str, spread: ReplicaSpread) -> None:
    """A write of trainable ``var``'s copy reads nothing that differs between replicas, and
    nothing that only some replicas' slices reach."""
    for src, port in ir.inputs(write):
        if ir.op(src) in VARIABLE_OPS:
            continue
        if not var.trainable and (src in spread.differs or not spread.covers_all(src)):
            raise ContractError(
                f"variable '{var.name}' (not trained; the step moves it from the batch): "
                f"'{write}' writes it from '{src}:{port}', which each replica computes from "
                "its own slice, so each replica's copy would move apart from one device's "
                "and the checkpoint would save replica 0's (allreduce, replicated and hybrid "
                "combine across replicas a value that is a sum, count, mean, max or min over "
                "the batch, not a scatter of the examples' rows): keep that state out of the "
                "train op, or train on one device")
        if src in spread.differs:
            drawn = spread.unseeded_source(src)
            if drawn is not None:
                name = REPLICA_SCOPE.sub("", drawn)
                raise ContractError(
                    f"variable '{var.name}': '{write}' updates it from '{src}:{port}', which "
                    f"reads the unseeded random op '{name}' ({ir.op(drawn)}, seed = seed2 = 0): "
                    "every replica draws different numbers, so the replicas would train apart; "
                    "set a graph seed (tf.compat.v1.set_random_seed) or the op's own, and each "
                    "replica draws what one device draws (--consistent-random, for a draw "
                    "shaped like the batch)")
            loop = (_first_ancestor(ir, [src], lambda n: ir.op(n) in WHILE_OPS)
                    if var.gradient is None else None)
            loop = loop and REPLICA_SCOPE.sub("", loop, count=1)
            reason = ("it reads a value that differs between replicas" if var.gradient else
                      f"its gradient comes out of the while loop '{loop}', tf.gradients inside "
                      "its body as in-graph gradient accumulation writes it, where it cannot be "
                      "reduced: sum the micro-batches' losses in the loop and take the gradient "
                      "outside it, or let the replicas' global batch replace the micro-batches"
                      if loop else "its gradient was not found where tf.gradients produced it, "
                      "so it was not reduced")
            raise ContractError(
                f"variable '{var.name}': '{write}' updates it from '{src}:{port}', which each "
                f"replica computes from its own slice of the batch ({reason}); the replicas "
                "would train apart")
        if not spread.covers_all(src):
            raise ContractError(
                f"variable '{var.name}': '{write}' updates it from '{src}:{port}', which only "
                f"replicas {spread.replicas_of(src)}'s slices of the batch reach; the others' "
                "data would be ignored")


class StepWrites:
    """The ops a step runs that write a variable, found once for every variable: ``of(v)`` is
    ``_writes(ir, v, closure)``, without reading each copy's consumers (a step of eight
    replicas has tens of thousands of variable copies, and a few thousand writes).

    It walks back from each write instead: ``_writes`` follows a variable's data consumers,
    and a Switch's consumers when the Switch reads the variable as its input 0, to the
    mutating ops of ``closure``; so a write W is among ``of(v)`` exactly when v is a data
    input of W, or the input 0 of a Switch that is (and so on through Switches)."""

    def __init__(self, ir: GraphIR, closure: set):
        self.written = sorted(write for op in ir.op_types() if is_mutating_op(op)
                              for write in ir.nodes_of([op]) if write in closure)
        nodes, pred = ir.g._node, ir.g._pred
        self._by_variable: dict = {}
        self._reads: dict = {}  # write -> the nodes but variables it reads through data edges
        for write in self.written:
            reads = self._reads[write] = []
            for src, keyed in data_pairs(pred[write]):
                if len(keyed) == 1 and CONTROL_KEY in keyed:
                    continue
                op = nodes[src]["op"]
                if op in VARIABLE_OPS:
                    self._add(src, write)
                    continue
                reads.append(src)
                if op in _SWITCH_OPS:
                    self._add_through_switch(ir, src, write)

    def of(self, variable: str) -> set:
        """The step's ops that write ``variable`` (a variable node) through an input that is
        the variable; not to be changed."""
        return self._by_variable.get(variable, _NONE)

    def outside_replicas(self) -> list[str]:
        """The step's writes outside every replica (global_step's increment, a shared
        variable's update): each runs once per step."""
        return [write for write in self.written if not write.startswith("replica_")]

    def values_read(self, writes) -> set:
        """What ``writes`` (of the step's) read through data inputs, but variables."""
        return set().union(*map(self._reads.__getitem__, writes))

    def _add(self, variable: str, write: str) -> None:
        found = self._by_variable.get(variable)
        if found is None:
            self._by_variable[variable] = {write}
        else:
            found.add(write)

    def _add_through_switch(self, ir: GraphIR, switch: str, write: str) -> None:
        """``write`` reads ``switch``: it writes the variables the chain of Switches above it
        reads as their input 0 too."""
        nodes, pred = ir.g._node, ir.g._pred
        seen, stack = {switch}, [switch]
        while stack:
            for src, keyed in pred[stack.pop()].items():
                if 0 in keyed and src not in seen:
                    seen.add(src)
                    op = nodes[src]["op"]
                    if op in VARIABLE_OPS:
                        self._add(src, write)
                    elif op in _SWITCH_OPS:
                        stack.append(src)


_SWITCH_OPS = frozenset({"Switch", "RefSwitch"})
_NONE = frozenset()


def _check_shared_writes(ir: GraphIR, shared: list, spread: ReplicaSpread,
                         statistics: set = frozenset()) -> None:
    """A write that runs once per step, outside every replica, must not read one replica's
    own value. Except where it writes only batch norm's moving ``statistics`` from what
    replica 0's slice alone reaches: ps keeps those from replica 0's slice (insert-accumulators
    drops the others' updates; verify names batch norm), and a statistic computed from
    another one read after replica 0's update is replica 0's too (renorm's moving_variance,
    tf_keras assigns it from moving_stddev, reading only variables, so it is not replicated)."""
    for name in shared:
        written = _written_variables(ir, name)
        from_first = bool(written) and set(written) <= statistics
        for src, port in ir.inputs(name):
            if ir.op(src) in VARIABLE_OPS:
                continue
            if from_first and src not in spread.differs and spread.replicas_of(src) in ([], [0]):
                continue
            if src in spread.differs or not spread.covers_all(src):
                written = ", ".join(_written_variables(ir, name)) or name
                raise ContractError(
                    f"variable '{written}': '{name}' runs once per step but reads "
                    f"'{src}:{port}', which only replicas {spread.replicas_of(src)}'s slices of "
                    "the batch reach; the other replicas' data would be ignored")


def _check_losses_are_means(ir: GraphIR, tg: TrainingGraph, replicas: int) -> None:
    """Gradients are averaged across replicas, which is right for a loss that is a mean over
    the batch. A loss shown to be a sum over it would train with 1/N of its gradient unless its
    gradients were scaled by N (passes/summed_losses.py): else refuse.
    (A loss whose kind the rules cannot show is taken to be a mean, as losses almost always
    are; graphxform.replica_values has the rules.)"""
    from graphxform.passes.summed_losses import seed_of
    for step in tg.steps:
        if not step.loss:
            taped = tape_gradients(tg.variables, step.closure)
            if taped:
                raise ContractError(
                    f"step '{step.name}' applies gradients a tf.GradientTape made (of "
                    f"'{taped[0]}'), of a loss that cannot be found, so averaging them across "
                    "replicas cannot be shown right (it is for a mean over the batch): list "
                    "the loss with tf.compat.v1.add_to_collection('losses', loss)")
            continue
        taped = tape_gradients(tg.variables, step.closure)
        if taped and seed_of(ir, tg, step) is None:
            raise ContractError(
                f"step '{step.name}' applies gradients a tf.GradientTape made (of "
                f"'{taped[0]}'), and the tape's target cannot be shown to be the loss "
                f"'{step.loss}' (the one the graph lists in 'losses'), so how to combine the "
                "replicas' gradients cannot be shown right (averaging is for a mean over the "
                "batch, summing for a sum): take the tape's gradient of the listed loss itself")
        applied = applied_losses(ir, tg, step)
        for loss in step_losses(ir, step):
            _check_loss_is_a_mean(ir, tg, step, loss, replicas, loss in applied)
        _check_given_seeds(ir, step)  # a summed loss's were refused above, with it


def _check_given_seeds(ir: GraphIR, step) -> None:
    """grad_ys the user gave to a tf.gradients call of ``step`` scales every gradient it
    bears: it must be the same on every replica and the batch's value (a constant, a loss
    scale variable), or each example's own rows for ys of one value per example. A statistic
    of the batch (``1 / tf.reduce_max(...)``, a mean of a fed weight) would be each replica's
    slice's, whatever the loss is: the averaged gradients are then not one device's."""
    from graphxform.passes.summed_losses import given_seed, given_seed_sums
    prefix = replica_prefix(0)
    for scope in _seeded_scopes(step):
        seed = scope + _SEED
        if given_seed_sums(ir, step, seed):
            continue
        given = given_seed(ir, prefix + seed)[0]
        raise ContractError(
            f"step '{step.name}' differentiates with grad_ys '{given[len(prefix):]}' (of "
            f"'{scope}'), a statistic of the batch: each replica would seed its gradients "
            "with its own slice's, so the combined gradients are not one device's: give "
            "grad_ys a constant (or each example's own rows for a per-example ys), or "
            "fold that statistic into the loss itself")


def _check_loss_is_a_mean(ir: GraphIR, tg: TrainingGraph, step, loss: str,
                          replicas: int, applied: bool = True) -> None:
    """One loss ``step`` minimises (see _check_losses_are_means); ``applied``: the updates
    apply its gradients, so ys of one value per example is a sum over the batch (not a
    gradient penalty's derivative of the examples' values by their own inputs)."""
    from graphxform import replica_values
    from graphxform.passes import half_precision
    from graphxform.passes.summed_losses import seeds_scaled
    prefix = replica_prefix(0)
    node, port = parse_tensor(loss)
    copy = prefix + node
    if copy not in ir:
        return
    copies = [n for n in ir.ancestors(copy) if n.startswith(prefix)]
    values = replica_values.classify(ir, prefix, copies=copies)
    kind = values.of(copy, port)
    if (replica_values.differentiated(kind) if applied else kind) == replica_values.SUM:
        if seeds_scaled(ir, tg, step, replicas) or half_precision.holds(
                ir, tg, step, replicas):  # passes/summed_losses.py, half_precision.py:
            _check_batch_extremes(ir, tg, step)  # the replicas' gradients sum
            return
        constant = _constant_denominator(ir, copy)
        what = ("one value per example, whose sum over the batch tf.gradients differentiates"
                if kind != replica_values.SUM else "a sum over the batch" if constant is None
                else f"a sum over the batch divided by a constant ({constant}, as "
                "tf.nn.compute_average_loss divides by global_batch_size)")
        raise ContractError(
            f"step '{step.name}' minimises '{loss}', {what}, and its gradients do not "
            "all start from one seed shown to be this loss's (one tf.gradients call, or one "
            "tf.GradientTape's gradient of this loss; not several losses at once, grad_ys "
            "other than a constant or a batch tensor of each example's own rows, a tape's "
            "target not shown to be this loss), which graphxform scales to sum the "
            "replicas' gradients; averaged, this step would train with 1/N of its "
            "gradient: use tf.reduce_mean over the batch, or tf.gradients of the loss")
    summed = _summed_term(ir, values, (copy, port))
    if summed is not None:
        inner = _summing_op(ir, values, summed)
        what = (f" (a multiple of '{inner[len(prefix):]}', {ir.op(inner)})"
                if inner != summed else f" ({ir.op(summed)})")
        raise ContractError(
            f"step '{step.name}' minimises '{loss}', which adds "
            f"'{summed[len(prefix):]}', a sum over the batch, to terms that are not (a "
            "mean over it, as a Keras add_loss of a reduce_sum adds to the model's loss, "
            "or a penalty the batch does not change, such as weight decay): a replica's "
            "copy is then neither its slice's share of the batch's loss nor its slice's "
            "mean, and neither averaging nor summing the replicas' gradients gives one "
            "device's (that term's gradients would need summing, the rest's averaging): "
            f"make that term{what} a mean over the batch, dividing it by the batch size (e.g. "
            "tf.nn.l2_loss(rows) / tf.cast(tf.shape(ids)[0], tf.float32) for a penalty "
            "on the embedding rows the batch looks up), or take its tf.reduce_mean")
    ratio = _ratio_of_sums(ir, values, copy) or next(
        iter(batch_denominators(ir, (copy, port), lambda: values)), None)
    if ratio is not None:
        ratio = parse_tensor(ratio)[0]
        raise ContractError(
            f"step '{step.name}' minimises '{loss}', which divides by "
            f"'{ratio[len(prefix):]}', a sum over the batch (of weights or a mask: "
            "tf.compat.v1.losses with weights divides by their nonzero count): each "
            "replica would divide by its own slice's, so the averaged gradients are not "
            "one device's (global-denominators divides by the replicas' mean total "
            "instead where it can: a total that reads no variable, in a synchronous "
            "strategy); divide by the batch size instead")
    _check_batch_extremes(ir, tg, step)
    learnt = next(iter(batch_denominators(ir, (copy, port), lambda: values,
                                          reading_variables=True)), None)
    if learnt is not None:
        raise ContractError(
            f"step '{step.name}' minimises '{loss}', which divides by "
            f"'{parse_tensor(learnt)[0][len(prefix):]}', a statistic of the batch computed "
            "from the model's variables: each replica would divide by its own slice's, so "
            "the averaged gradients are not one device's, and no all-reduce of it can "
            "stand in (it reads the variables being trained); divide by a constant or by "
            "a total of the data alone")


def step_losses(ir: GraphIR, step) -> list[str]:
    """Every loss ``step`` minimises: its loss, then those of its other tf.gradients calls (a
    train op grouping an actor's and a critic's optimizer minimises two), each checked as the
    loss is."""
    from graphxform.training import scope_loss
    if not step.loss:
        return []
    first = replica_prefix(0)  # in a transformed graph, replica 0's call
    others = [scope_loss(ir, first + scope if first + scope + _SEED in ir else scope)
              for scope in _seeded_scopes(step)]
    return list(dict.fromkeys([step.loss] + [loss for loss in others if loss]))


_SEED = "grad_ys_0"  # the seed tf.gradients makes for its first ys, in its scope


def _seeded_scopes(step) -> list[str]:
    """The gradients scopes (sorted) whose seed ``<scope>grad_ys_0`` ``step`` runs: its
    tf.gradients calls. Only the names ending so are read: such a name's gradient_scope is
    all before the suffix exactly when that is a gradients scope (the suffix has no '/')."""
    cut = len(_SEED)
    return sorted(name[:-cut] for name in filter(operator.methodcaller("endswith", _SEED),
                                                 step.closure)
                  if gradient_scope(name) == name[:-cut])


def applied_losses(ir: GraphIR, tg: TrainingGraph, step) -> set:
    """The losses of the tf.gradients calls whose gradients ``step``'s updates apply (of
    step_losses, those it trains the variables by)."""
    from graphxform.training import scope_loss
    scopes = {gradient_scope(parse_tensor(t)[0]) for v in tg.variables.values()
              for g in v.gradients_applied_in(step.closure) for t in g.tensors} - {None}
    first = replica_prefix(0)
    return {step.loss} | {scope_loss(ir, first + scope if first + scope + "grad_ys_0" in ir
                                     else scope) for scope in scopes}


def _check_batch_extremes(ir: GraphIR, tg: TrainingGraph, step) -> None:
    """A loss shaped by the batch's longest sequence (graphxform/batch_extremes.py) must read
    the whole batch's: global-extremes makes it so in the synchronous strategies."""
    from graphxform.batch_extremes import batch_extremes
    prefix = replica_prefix(0)
    from_data, from_variables = batch_extremes(ir, tg, step)
    if from_data:
        found = from_data[0]
        raise ContractError(
            f"step '{step.name}' minimises '{step.loss}', which is shaped by "
            f"'{found[len(prefix):]}' ({ir.op(found)}), the batch's {_EXTREME[ir.op(found)]} "
            "value of its examples (as tf.sequence_mask takes the longest length when given no "
            "maxlen): each replica would take its own slice's, so its loss is not its share of "
            "one device's (global-extremes takes the whole batch's in every synchronous "
            "strategy, where it can find it); give it a fixed bound (tf.sequence_mask's "
            "maxlen)")
    if from_variables:
        found = from_variables[0]
        raise ContractError(
            f"step '{step.name}' minimises '{step.loss}', which is shaped by "
            f"'{found[len(prefix):]}' ({ir.op(found)}), the batch's {_EXTREME[ir.op(found)]} "
            "value of something computed from the model's variables: each replica would take "
            "its own slice's, and no all-reduce can stand in for it (its gradient would be "
            "wrong); give it a fixed bound")


_EXTREME = {"Max": "largest", "Min": "smallest"}

_AGGREGATING = re.compile(r"ConditionalAccumulator|AccumulatorApplyGradient|^Collective|^Nccl")
_FLOATS = frozenset({1, 2, 14, 19})  # float double bfloat16 half: what a collective reduces


def batch_denominators(ir: GraphIR, loss: tuple, classes,
                       reading_variables: bool = False) -> list[str]:
    """The denominators the value of ``loss`` (node, port) divides by that are totals of the
    batch's values (a weighted mean, a masked mean) and depend on no variable, and that are not
    the replicas' mean already (a cross-replica op): each replica would divide by its own
    slice's. passes/global_denominators.py replaces them by that mean; the rest is refused.
    ``classes()``: replica_values' classes of replica 0's copies (asked for only when a
    division's divisor reads the batch); a per-example divisor (each sequence's length) is no
    total and stays the slice's own. ``reading_variables``: those
    that do depend on a variable instead (a mean of the model's own outputs under
    stop_gradient), which no pass can make global."""
    from graphxform.replica_values import BATCHED, loss_divisions
    from graphxform.selections import of_the_batch
    found = []
    sources = None  # the batch's splits, found when a division asks
    for node in loss_divisions(ir, loss):
        bottom = ir.inputs(node)[1]
        if sources is None:
            sources = {n for n in ir.nodes_of({"Split"}) if n.startswith(SPLIT_SCOPE)}
        # short of cross-replica ops and the ps strategies' combinations, whose value
        # is every replica's (global-denominators' totals)
        reads = ir.value_sources(bottom[0], stop_at=CROSS_REPLICA_OPS,
                                 stop=lambda n: combines_every_replica(ir, n))
        if (ir.op(bottom[0]) not in CROSS_REPLICA_OPS
                and opdefs.output_dtype(ir, *bottom) in _FLOATS
                and (of_the_batch(ir, reads, sources)
                     or _sized_by_the_batch(ir, reads, sources) is not None)
                and any(ir.op(n) in VARIABLE_OPS for n in reads) == reading_variables
                and classes().of(*bottom) not in BATCHED
                and not _rows_of_the_batch(ir, *bottom)):
            found.append(tensor_name(*bottom))
    return found


def _sized_by_the_batch(ir: GraphIR, reads: set, sources: set, skip=lambda n: False):
    """The op whose output's length ``reads`` (a divisor's value sources) hold the shape or
    size of, where the batch's values decide that length (rows tf.boolean_mask selects, then
    tf.compat.v1.losses' count of their losses; tf.unique of the labels; tf.where's rows), or
    None: unlike a count of examples, that count differs between equal slices."""
    from graphxform.ir import SHAPE_ONLY_OPS
    from graphxform.selections import selected_rows
    for n in reads:
        if ir.op(n) in SHAPE_ONLY_OPS and ir.inputs(n):
            found = selected_rows(ir, ir.inputs(n)[0][0], sources, any_size=True)
            if found is not None and not skip(found):
                return found
    return None


def counted_by_values(ir: GraphIR, tensor: str, skip=lambda n: False):
    """The op whose output's length the denominator ``tensor`` (a node in the transformed
    graph) counts, where the batch's values decide it (``_sized_by_the_batch``) and ``skip``
    does not hold for it, or None: for a refusal to name."""
    sources = {n for n in ir.nodes_of({"Split"}) if n.startswith(SPLIT_SCOPE)}
    reads = ir.value_sources(tensor, stop_at=CROSS_REPLICA_OPS,
                             stop=lambda n: combines_every_replica(ir, n))
    return _sized_by_the_batch(ir, reads, sources, skip)


def _rows_of_the_batch(ir: GraphIR, node: str, port: int) -> bool:
    """Whether export_meta_graph recorded ``node:port`` with a leading dimension of unknown
    size, as it records one value per example (a total over the batch is a scalar): a divisor
    the rules could not class (read from a loop, or shaped by the batch's longest length)."""
    dims = opdefs.recorded_dims(ir, node, port)
    return bool(dims) and dims[0] < 0 and not reduces_the_batch_axis(ir, node)


# what a divisor computes from a total by constants alone (an epsilon added, a cast)
_BY_CONSTANTS = frozenset({"Add", "AddV2", "Maximum", "Cast", "Identity", "Mul"})


def reduces_the_batch_axis(ir: GraphIR, node: str) -> bool:
    """Whether ``node`` is (through constants added or multiplied, casts) a Sum or Mean over
    constant axes that include 0, the batch's, of a tensor of rank 2 or more: a total over
    the batch per timestep (seq2seq's sum of the mask over the batch, as wide as the batch's
    longest length), not one value per example, though its leading size is unknown."""
    from graphxform.nodes import const_value
    for _ in range(8):
        op, inputs = ir.op(node), ir.inputs(node)
        if op in ("Sum", "Mean") and len(inputs) == 2:
            axes = const_value(ir, inputs[1][0])
            dims = opdefs.recorded_dims(ir, *inputs[0])
            return axes is not None and 0 in axes.reshape(-1).tolist() and \
                dims is not None and len(dims) >= 2 and _axis_0_unmoved(ir, inputs[0][0])
        if op not in _BY_CONSTANTS or not inputs:
            return False
        varying = [src for src, _ in inputs if const_value(ir, src) is None]
        if len(varying) != 1:
            return False
        node = varying[0]
    return False


def _axis_0_unmoved(ir: GraphIR, node: str, limit: int = 64) -> bool:
    """Whether no Transpose on ``node``'s elementwise way back moved another axis to axis 0.
    The rules above take axis 0 for the batch's, as it is where the batch comes in; a
    time-major loss (``tf.transpose(per_example)``, [time, batch]) summed over axis 0 is a sum
    over time per example, which taken for a total of the batch would make each replica
    divide by the whole batch's total. Follows the axis through Transposes (dynamic_rnn's
    pair cancels) and elementwise ops, up to the first op of another kind."""
    from graphxform.nodes import const_value
    from graphxform.replica_values import ELEMENTWISE_OPS, ELEMENTWISE_UNARY_OPS, \
        LINEAR_UNARY_OPS
    through = set(ELEMENTWISE_OPS) | set(ELEMENTWISE_UNARY_OPS) | set(LINEAR_UNARY_OPS) | \
        {"Cast"}
    stack, seen = [(node, 0)], set()
    while stack and len(seen) < limit:
        name, axis = stack.pop()
        if (name, axis) in seen:
            continue
        seen.add((name, axis))
        op, inputs = ir.op(name), ir.inputs(name)
        if op in ("Transpose", "ConjugateTranspose") and len(inputs) == 2:
            perm = const_value(ir, inputs[1][0])
            if perm is None:
                return False
            perm = perm.reshape(-1).tolist()
            if axis >= len(perm):
                return False
            stack.append((inputs[0][0], perm[axis]))
        elif op in through:
            stack += [(src, axis) for src, _ in inputs if const_value(ir, src) is None]
        elif axis != 0:
            return False
    return all(axis == 0 for _, axis in stack)  # what the limit left unread


def _constant_denominator(ir: GraphIR, node: str):
    """The constant ``node`` divides by (a division whose divisor is a Const), or None."""
    from graphxform.nodes import const_value
    from graphxform.replica_values import DIVIDE_OPS
    inputs = ir.inputs(node)
    if ir.op(node) not in DIVIDE_OPS or len(inputs) != 2:
        return None
    divisor = inputs[1][0]
    while ir.op(divisor) in ("Cast", "Identity") and ir.inputs(divisor):
        divisor = ir.inputs(divisor)[0][0]
    value = const_value(ir, divisor)
    return None if value is None or value.size != 1 else value.reshape(-1)[0].item()


def _check_custom_gradients(ir: GraphIR, tg: TrainingGraph, replicas: int) -> None:
    """A custom gradient in a step's backward pass must be linear in the gradient it is given,
    and a backward pass that computes in float16 must carry one device's gradients
    (graphxform/gradient_scale.py and passes/half_precision.py say why)."""
    from graphxform.gradient_scale import half_precision_gradient, nonlinear_custom_gradient
    from graphxform.passes import half_precision
    prefix = replica_prefix(0)
    node_table = ir.g._node

    def name_of(name):
        return prefix + name if prefix + name in node_table else name

    for step in tg.steps:
        half = half_precision_gradient(ir, step.closure, name_of)
        if half is not None and not half_precision.holds(ir, tg, step, replicas):
            why = (half_precision.obstacle(ir, tg, step, replicas) or
                   "its gradients were not carried at one device's scale")
            raise ContractError(
                f"step '{step.name}': its backward pass computes in float16 ('{half}', "
                f"{ir.op(name_of(half))}), and {why}: so each replica's gradients would be N "
                "times one device's (its loss is the mean of its own slice), and a loss scale "
                "that keeps one device inside float16's range (65504) can overflow in a "
                "replica (graphxform seeds each replica's backward pass with 1/N and multiplies "
                "each gradient by N where it is born in float32): compute the gradients in "
                "bfloat16 or float32, or train on one device")
        found = nonlinear_custom_gradient(ir, step.closure, name_of)
        if found is not None:
            forward, op = found
            raise ContractError(
                f"step '{step.name}': '{forward}' has a custom gradient whose '{op}' "
                f"({ir.op(name_of(op))}) is not linear in the gradient it is given; each "
                "replica's incoming gradient is N times one device's (its loss is the mean of "
                "its own slice), so this gradient would compute something else: make it linear "
                "in its incoming gradient, or train on one device")


def _function_writes(ir: GraphIR, tg: TrainingGraph, closure: set,
                     statistics=frozenset()) -> list[tuple]:
    """(call, function, writing op type, written node, trains) for each call in ``closure``
    whose functions apply an optimizer update or write a variable the contract keeps equal (a
    trainable one, or one the step keeps: saved, not batch norm's moving statistics but
    ``statistics``, those sync-batch-norm keeps equal), the first such write of each call."""
    from graphxform.passes.global_state import kept_equal
    found = {}
    for call, function, node, source in called_nodes(ir, closure):
        if call in found or not is_mutating_op(node.op) or not node.input:
            continue
        target = source(node.input[0])
        var = tg.variables.get(REPLICA_SCOPE.sub("", target, count=1)) if target else None
        trains = is_apply_op(node.op) or (var is not None and var.trainable)
        if trains or (var is not None and (kept_equal(var) or var.name in statistics)):
            found[call] = (call, function, node.op, target or node.input[0], trains)
    return list(found.values())


def _check_function_writes(ir: GraphIR, writes: list, spread: ReplicaSpread) -> None:
    """A write inside a function (a while loop or cond body with control flow v2, a
    tf.function) is not rewritten by any pass, so it keeps each replica equal only where the
    call reads nothing that differs between replicas (a Lookahead sync of the weights in a
    tf.cond, an update applied in a cond from the all-reduced gradients) and draws no random
    numbers; else each replica writes its own slice's (graphxform/functions.py says why)."""
    for call, function, op, target, trains in writes:
        differs = [src for src, _ in ir.inputs(call)  # a split's output: a replica's slice
                   if src in spread.differs or not spread.covers_all(src)
                   or src.startswith(SPLIT_SCOPE)]
        if not differs and not random_in_function(ir, {call}):
            continue
        name, target = (REPLICA_SCOPE.sub("", n, count=1) for n in (call, target))
        what = ("so each replica would apply its own slice's gradient and the replicas would "
                "train apart; apply the optimizer outside the loop or function" if trains else
                "so each replica's copy would move apart from one device's and the "
                "checkpoint would save replica 0's; update it outside the loop or function "
                "(a tf.compat.v1 cond: tf.compat.v1.disable_control_flow_v2())")
        raise ContractError(
            f"'{name}' ({ir.op(call)}) runs function '{function}', which updates "
            f"'{target}' ({op}) inside it from values each replica computes from its own "
            f"slice: updates inside a function (a while loop or cond body with control flow "
            f"v2, a tf.function) are not distributed, {what}")


def _summing_op(ir: GraphIR, values, term: str) -> str:
    """The op that makes ``term`` (a _summed_term) a sum over the batch, past multiples of
    it by identical values (``0.01 * tf.nn.l2_loss(rows)``: the L2Loss), to name it."""
    from graphxform.replica_values import IDENTICAL, SUM
    while ir.op(term) in ("Mul", "RealDiv", "Div", "Identity", "Cast", "Neg"):
        found = [src for src, port in ir.inputs(term) if values.of(src, port) != IDENTICAL]
        if len(found) != 1 or values.of(found[0], 0) != SUM:
            break
        term = found[0]
    return term


def _summed_term(ir: GraphIR, values, loss: tuple) -> str | None:
    """A term of ``loss`` (node, port) that is a sum over the batch, reached through
    additions and multiples by identical values from a loss whose class the rules left
    unknown (a mean plus a sum is neither) and reading a variable (so it has a gradient), or
    None. Only what the loss's class did not settle
    is searched, so a sum turned into a mean (divided by a count) is not one."""
    from graphxform.replica_values import IDENTICAL, LOSS_TERM_OPS, SUM, UNKNOWN
    seen, stack = {loss}, [loss]
    while stack:
        node, port = stack.pop()
        kind = values.of(node, port)
        if kind == SUM and (node, port) != loss:
            if any(ir.op(n) in VARIABLE_OPS for n in ir.value_sources(node)):
                return node
            continue  # of the data alone: no gradient to scale
        op = ir.op(node)
        if kind != UNKNOWN or op not in LOSS_TERM_OPS:
            continue
        inputs = ir.inputs(node)
        if op == "Mul" and not any(values.of(*i) == IDENTICAL for i in inputs):
            continue  # a product of two batch values: no term of the sum
        for found in inputs:
            if found not in seen and values.of(*found) != IDENTICAL:
                seen.add(found)
                stack.append(found)
    return None


def _ratio_of_sums(ir: GraphIR, values, loss: str) -> str | None:
    """The denominator of a division the loss's value is made of whose numerator and
    denominator are both sums over the batch (a weighted mean: sum(w * l) / sum(w)), or None.
    The mean of the replicas' ratios is not the ratio of the sums unless every slice's
    denominator is the same, which the graph cannot show. Only what the loss's class did not
    settle is searched (a known mean or sum reads no such ratio)."""
    from graphxform.replica_values import DIVIDE_OPS, SUM, UNKNOWN
    seen, stack = {loss}, [loss]
    while stack:
        node = stack.pop()
        inputs = ir.inputs(node)
        if ir.op(node) in DIVIDE_OPS and len(inputs) == 2 and \
                values.of(*inputs[1]) == SUM and values.of(*inputs[0]) in (SUM, UNKNOWN):
            return inputs[1][0]  # a numerator not shown to be a sum (read from a loop) is one
        for src, port in inputs:
            if src not in seen and values.of(src, port) == UNKNOWN:
                seen.add(src)
                stack.append(src)
    return None


def step_closures(ir: GraphIR, tg: TrainingGraph) -> list[tuple[str, set]]:
    """(step, every node it runs) for each of the input's training steps found in ``ir``."""
    return [(step.name, ir.ancestors(parse_tensor(step.name)[0])) for step in tg.steps
            if parse_tensor(step.name)[0] in ir]


def _union(closures: list) -> set:
    if len(closures) == 1:
        return closures[0][1]
    return set().union(*(closure for _, closure in closures))


def _copies(ir: GraphIR, name: str, replicas: int) -> list[str]:
    """Each replica's copy of a variable, or its one shared copy (the original name also
    exists for a replicated variable: merge-fetches serves it from replica 0)."""
    node_table = ir.g._node
    copies = [copy for copy in [prefix + name for prefix in _prefixes(replicas)]
              if copy in node_table]
    return copies or ([name] if name in ir and ir.op(name) in VARIABLE_OPS else [])


@functools.lru_cache(maxsize=8)
def _prefixes(replicas: int) -> tuple[str, ...]:
    return tuple(replica_prefix(i) for i in range(replicas))


def _writes(ir: GraphIR, variable: str, closure: set) -> set:
    """Ops of the step that write ``variable`` (through an input that is the variable)."""
    return {dst for dst, _ in consumers_through_switches(ir, ir.consumers(variable))
            if dst in closure and is_mutating_op(ir.op(dst))}


def _written_variables(ir: GraphIR, write: str) -> list[str]:
    return [src for src, _ in ir.inputs(write) if ir.op(src) in VARIABLE_OPS]


def replica_local(ir: GraphIR, replicas: int = 1) -> set:
    """Nodes whose values may differ between replicas (graphxform.replica_spread)."""
    return ReplicaSpread(ir, max(replicas, 1)).differs


def _check_start(ir: GraphIR, tg: TrainingGraph, replicas: int) -> None:
    """Every replica's copy of a variable is initialised from replica 0's initial value, or
    from constants alone."""
    pred, prefixes = ir.g._pred, _prefixes(max(replicas, 1))
    for var in sorted(tg.variables.values(), key=lambda v: v.name):
        if not var.initializer:
            continue
        first = prefixes[0] + var.initializer
        if first not in pred:
            continue
        start = _through_identities(ir, ir.input(first, 1))
        for i in range(1, replicas):
            init = prefixes[i] + var.initializer
            if init not in pred:
                continue
            value = _assigned(pred[init]) or ir.input(init, 1)  # (which names what is missing)
            if value == start:  # start is past any Identity already
                continue
            if _through_identities(ir, value) != start and not _constant(ir, value[0]):
                raise ContractError(
                    f"variable '{var.name}': replica {i} initialises it from '{value[0]}', "
                    f"not from replica 0's initial value '{start[0]}', so the replicas would "
                    "start apart")


def _assigned(in_edges: dict) -> tuple | None:
    """(src, port) of the edge into input 1 (an Assign's value) among a node's in-edges, or
    None: GraphIR.input(name, 1) without the call."""
    for src, keyed in in_edges.items():
        edge = keyed.get(1)
        if edge is not None:
            return src, edge["src_port"]
    return None


def _through_identities(ir: GraphIR, tensor: tuple) -> tuple:
    """The tensor ``tensor`` passes on unchanged through Identity ops (a checkpoint's
    restored value that init_from_checkpoint's initializer reads through one)."""
    node, port = tensor
    while ir.op(node) in ("Identity", "Snapshot"):
        node, port = ir.input(node, 0)
    return node, port


def _constant(ir: GraphIR, node: str) -> bool:
    """Computed from Const ops alone, by stateless ops (equal wherever it runs)."""
    from graphxform import opdefs
    seen, stack = set(), [node]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        op = ir.op(name)
        if op == "Const":
            continue
        if op in VARIABLE_OPS or opdefs.is_stateful(ir, op) or not ir.inputs(name):
            return False
        stack.extend(src for src, _ in ir.inputs(name))
    return True


def check_model_average(ir: GraphIR, tg: TrainingGraph, replicas: int,
                        closures: list | None = None) -> dict:
    """model-average's own invariant, in place of the per-step one (its local copies differ
    between rounds by design): every trainable variable a step updates has a centre
    (`model_average/centre/<var>`) that starts from replica 0's initial value and is written
    once per step from values every replica's copy reaches, and every replica's copy is
    written back from the centre's new value. That the copies start equal is ``check``'s."""
    from graphxform.passes.model_average import centre_name
    closure = _union(closures if closures is not None else step_closures(ir, tg))
    step_writes = StepWrites(ir, closure)
    checked = 0
    for var in sorted(tg.variables.values(), key=lambda v: v.name):
        if not (var.trainable and var.updates) or replica_prefix(0) + var.name not in ir:
            continue
        centre = centre_name(var.name)
        if centre not in ir:
            raise ContractError(f"variable '{var.name}': no centre '{centre}', so the workers' "
                                "copies would never be averaged")
        writes = step_writes.of(centre)
        if len(writes) != 1:
            raise ContractError(f"variable '{var.name}': its centre is written {len(writes)} "
                                "times per step, not once")
        (write,) = writes
        _check_centre_start(ir, var, centre)
        reached = _variables_read(ir, ir.input(write, 1)[0])
        missing = [i for i in range(replicas) if replica_prefix(i) + var.name not in reached]
        if missing:
            raise ContractError(f"variable '{var.name}': its centre is averaged without "
                                f"replicas {missing}'s copies")
        for i in range(replicas):
            copy = replica_prefix(i) + var.name
            if not any(centre in _variables_read(ir, ir.input(w, 1)[0])
                       for w in step_writes.of(copy)):
                raise ContractError(f"variable '{var.name}': replica {i}'s copy is never set "
                                    "from the centre, so it would train apart for good")
        checked += 1
    return {"variables": checked}


def _check_centre_start(ir: GraphIR, var, centre: str) -> None:
    """The centre's initializer assigns what replica 0's copy starts from."""
    first = replica_prefix(0) + (var.initializer or "")
    start = ir.input(first, 1) if first in ir else None
    inits = [dst for dst, port in ir.consumers(centre)
             if port == 0 and dst.endswith("/Assign")]
    if start is None or not any(ir.input(init, 1) == start for init in inits):
        raise ContractError(f"variable '{var.name}': its centre does not start from replica "
                            "0's initial value, so before the first round it would differ from "
                            "the local copies")


def _variables_read(ir: GraphIR, node: str) -> set:
    """The variables whose values reach ``node`` through data edges (not through writes), and
    through an accumulator from what is applied to it (model-average on a cluster)."""
    found, seen, stack = set(), set(), [node]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        op = ir.op(name)
        if op in VARIABLE_OPS:
            found.add(name)
        elif op == "AccumulatorTakeGradient":
            stack.extend(ir.input(dst, 2)[0] for dst, _ in ir.consumers(ir.input(name, 0)[0])
                         if ir.op(dst) == "AccumulatorApplyGradient")
        elif not is_mutating_op(op):
            stack.extend(src for src, _ in ir.inputs(name))
    return found
