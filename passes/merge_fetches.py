"""merge-fetches: every name the user could fetch or run in the input exists again, giving what
the single-device graph gives for the whole global batch.

`replicate` copied each node of the step as `replica_{i}/<name>` and removed the original. Here
each such original gets one node under its name that reads the copies, chosen by the class
graphxform/replica_values.py finds for its output (its docstring has the rules), and a loss
(or a tensor step, which returns its loss) unless shown a sum as the mean of its copies:

- identical: Identity of replica 0's copy;
- batch: ConcatV2 of the copies along axis 0, in replica order;
- mean: Pack of the copies, then Mean over them;
- sum (and count): AddN of the copies;
- max, min: Pack of the copies, then Max (Min) over them;
- unknown, or a class its dtype cannot be merged in: the copy's op run again on the original
  names of its inputs, when each of those is served right (a metric's value, total / count of
  two running totals served as sums: see _recompute); else Identity of replica 0's copy, and
  the name is listed in the summary's `unmerged`.

Tower code run on one device (graphxform/towers.py) keeps its towers' values apart: the
single device's tower t holds another part of the batch than any replica's tower t. A value a
tower computes from its part alone is served from the pieces of the batch that part is made of
(``towers.Layout.pieces``: copies of the towers that compute the same, on the replicas that hold
them), merged by its class with each piece as the batch: a tower's mean loss is the mean of the
pieces', its logits their concatenation; what combines towers (the sum of their losses) is then
recomputed from them. A tower value of no known class stays replica 0's, listed in `unmerged`.

A node with several outputs is an IdentityN of its outputs, each merged as above under
``merge_fetches/<name>/output_<k>`` (listed if one is served from replica 0 unknown). A node without outputs (NoOp, AssignVariableOp, ...) is a NoOp that waits on every
replica's copy. An Identity or IdentityN of a node whose running has effects (a train op such as
tf_slim's `train_op/control_dependency`, anything after a variable write, a queue op or a
collective) also waits on the other replicas' copies, so running it runs every replica; pure
values do not, which keeps the graph small. Every step of the training graph counts as having
effects. The `mean` and `concat` options (the strategies' `fetch_mean`, `fetch_concat`) override
the class of the tensors they name. Collections that listed the copies list the original name
again."""

from __future__ import annotations

import collections
import dataclasses
import functools

import numpy as np

from graphxform import opdefs, replica_values, training
from graphxform.errors import GraphxformError
from graphxform.ir import CONTROL_KEY, data_pairs, parse_tensor
from graphxform.nodes import Builder, replica_prefix
from graphxform.pipeline import Pass, PassResult
from graphxform.replica_values import (BATCHED, COUNT, EXTREMES, IDENTICAL, MAX, MEAN, MIN, SUM,
                                       UNKNOWN)
from graphxform.training import gradient_scope

SPLIT_SCOPE = "split_inputs/"  # passes/split_inputs.py's scope: the slices of the batch

SCOPE = "merge_fetches/"
_FLOATS = frozenset({1, 2, 8, 14, 18, 19})  # float double complex64 bfloat16 complex128 half
_NUMBERS = _FLOATS | {3, 9, 4, 6, 5, 17, 22, 23}  # and the integer types
_REDUCE_OP = {MEAN: "Mean", MAX: "Max", MIN: "Min"}  # over the stacked copies
_REALS = _NUMBERS - {8, 18}  # not complex
_NOT_CONCATENABLE = frozenset({20, 21})  # resource, variant
_IDENTICAL, _UNKNOWN = (IDENTICAL,), (UNKNOWN,)
# legacy control flow's ops: their values belong to a frame, not to their inputs alone
_NOT_RECOMPUTED = frozenset({"Enter", "Exit", "Merge", "Switch", "NextIteration", "LoopCond",
                             "RefEnter", "RefExit", "RefMerge", "RefSwitch", "RefNextIteration",
                             "ControlTrigger"})
# stateful only in reading a variable: run again on a shared variable, after the original's
# control inputs, they read what one device reads there (replica_values' raced_variables)
_READS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd"})
_PLUMBING_OPS = frozenset({"ReadVariableOp", "VarIsInitializedOp", "IsVariableInitialized",
                           "Shape", "ShapeN", "Size", "Rank"})


@dataclasses.dataclass
class MergeFetches(Pass):
    name = "merge-fetches"
    mean: tuple = ()
    concat: tuple = ()

    def run(self, ir, ctx):
        prefixes = [replica_prefix(i) for i in range(len(ctx.devices))]
        first = prefixes[0]
        copies = replica_values.replica_copies(ir, first)
        forced = {**_slice_constants(ir, copies, ctx.training, len(prefixes)),
                  **self._overrides(ir, first)}
        originals = _originals(ir, first, copies, ctx.training.train_closure)
        if not originals:
            return PassResult(modified=False)
        tg = ctx.training
        only_first = ctx.state.get("sync-init", {}).get("first_only", set())
        single = {first + name for name in only_first}
        step = {first + name for name in tg.train_closure}
        values = replica_values.classify(ir, first, forced=forced,
                                         gradients=_gradient_losses(ir, first, tg),
                                         copies=copies, single=single, step=step,
                                         races=True)
        towers = _tower_values(ir, ctx.state.get("towers"), first, forced, copies, single,
                               step, self._overrides(ir, first))
        steps = {parse_tensor(step.name)[0] for step in tg.steps}
        tensor_steps = [step.name for step in tg.steps if step.is_tensor]
        _losses_as_means(values, _copies_of(ir, first, [*tg.losses, *tensor_steps]), forced)
        merge = _Merge(ir, Builder(ir, self.name), prefixes, values, towers)
        for name in originals:
            merge.node(name, effect=name in steps or first + name in values.effects,
                       only_first=name in only_first)
        merge.flush()
        recomputed = _recompute(ir, merge.build, first, merge.unmerged)
        if recomputed:
            merge.unmerged = [name for name in merge.unmerged if name not in recomputed]
            merge.counts["replica_0"] -= len(recomputed)
            merge.counts["recomputed"] = len(recomputed)
        # what nothing reads first, the tensors users fetch (a metric's value, a summary),
        # and gradients' insides, a variable's reads, checks and shapes last
        merge.unmerged.sort(key=lambda name: (
            ir.op(first + name) in _PLUMBING_OPS or gradient_scope(name) is not None,
            _read_in_replica(ir, first + name, first)))
        _restore_collection_names(ir, set(originals))
        return PassResult(modified=True, summary={"merged": dict(merge.counts),
                                                  "unmerged": merge.unmerged})

    def _overrides(self, ir, first: str) -> dict:
        """{(replica 0's copy, port): class} for the tensors the user named."""
        forced = {}
        for tensors, kind in ((self.mean, MEAN), (self.concat, replica_values.BATCH)):
            for tensor in tensors:
                node, port = parse_tensor(tensor)
                if node in ir:
                    continue  # shared: it keeps its single value
                if first + node not in ir:
                    raise GraphxformError(f"cannot merge fetch '{tensor}': no such node in the "
                                          "graph")
                if opdefs.num_outputs(ir, first + node) != 1:
                    raise GraphxformError(f"cannot merge fetch '{tensor}': only nodes with one "
                                          "output can be merged")
                forced[(first + node, port)] = kind
        return forced


def _tower_values(ir, layout, first: str, forced: dict, copies: list, single: set, step: set,
                  overrides: dict):
    """(layout, classes, names not served so) for serving tower values, or None without
    towers: replica 0's copies classified with each part of a tower split as the batch, so
    that a class says how a tower's value relates to its piece (a mean over it, its rows).
    The user's overrides name tensors served as they say, not from towers."""
    if layout is None or not any(first + split in ir for split in layout.splits):
        return None
    parts = {(first + split, k): replica_values.BATCH
             for split in layout.splits for k in range(layout.count)}
    values = replica_values.classify(ir, first, forced={**forced, **parts}, copies=copies,
                                     single=single, step=step)
    return layout, values, {node[len(first):] for node, _ in overrides}


def _recompute(ir, build, first: str, unmerged: list) -> set:
    """Of the names ``unmerged`` (in graph order), those whose op can be run again on the
    merged values of its inputs: a deterministic op whose every input is served right (or is
    one instance every replica shares) computes from them what it computes on one device. So
    a metric's value, ``total / count`` of two running totals served as their sums, is the
    single-device value, not replica 0's. Each becomes that op (replica 0's copy's op and
    attrs) reading the original names; its control inputs wait on the original names of the
    copy's. A variable read is run again too: of a variable every replica shares and writes
    (ps keeps a metric's total and count once, and every replica adds to it), its copies read
    after their own replica's writes only, the one read waiting on every replica's writes
    reads what one device reads. Not the insides of tf.gradients, fetched by nobody and
    thousands on a large model (6,126 of the 24-layer transformer's 6,702): they stay
    listed. Returns the names recomputed."""
    inexact, done = set(unmerged), set()
    for name in unmerged:
        copy = first + name
        op = ir.op(copy)
        if (op in _NOT_RECOMPUTED or gradient_scope(name) is not None or not ir.inputs(copy)
                or (opdefs.is_stateful(ir, op) and op not in _READS)
                or replica_values.REBATCHED_ATTR in ir.attrs(copy)):
            continue
        inputs = [_whole_input(ir, src, port) or _served(ir, first, src, inexact)
                  for src, port in ir.inputs(copy)]
        waits = [_served(ir, first, src, ()) for src in ir.control_inputs(copy)]
        if None in inputs or None in waits:
            continue
        ports = [port for _, port in ir.inputs(copy)]
        build.replace_like(name, copy, [src if ":" in src else f"{src}:{port}"
                                        for src, port in zip(inputs, ports)]
                           + ["^" + src for src in waits], device=ir.node(name)["device"])
        inexact.discard(name)
        done.add(name)
    return done


def _read_in_replica(ir, node: str, first: str) -> bool:
    """Whether a node named ``first`` + something reads an output of ``node`` (what
    ``ir.consumers`` lists, without listing them)."""
    return any(dst.startswith(first) and (len(keys) > 1 or CONTROL_KEY not in keys)
               for dst, keys in data_pairs(ir.g._succ[node]))


def _whole_input(ir, src: str, port: int) -> str | None:
    """The whole batch, as ``node:port``, where ``src:port`` is replica 0's part of split-inputs'
    Split of an input (a placeholder's rows): one device read the input itself, so an op run
    again reads it whole (the variance of a fed tensor, PPO's explained variance of the
    returns). Else None."""
    if port != 0 or ir.op(src) != "Split" or ir.node(src).get("created_by") != "split-inputs":
        return None
    whole, whole_port = ir.input(src, 1)
    return f"{whole}:{whole_port}"


def _served(ir, first: str, src: str, inexact) -> str | None:
    """The node that serves what ``src`` (an input of replica 0's copy) holds on one device:
    its original name, when that is served right (not in ``inexact``), or ``src`` itself when
    every replica shares it (no replica owns it and no pass made it); else None."""
    if src.startswith(first):
        original = src[len(first):]
        return original if original in ir and original not in inexact else None
    shared = replica_values.REPLICA_COMPONENT.search(src) is None
    if shared and not ir.node(src).get("created_by"):
        return src
    return None


def _originals(ir, first: str, copies: list, step: set) -> list[str]:
    """The input's nodes that exist only as replica copies (of ``copies``), in graph order: a
    copy names its original (``origin``), or, when a pass rewrote it under the same name (a
    random op consistent-random redraws), the name is one of the input's step (``step``)."""
    node_table, start = ir.g._node, len(first)
    return [name[start:] for name in copies if name[start:] not in node_table
            and (node_table[name]["origin"] == name[start:] or name[start:] in step)]


def _slice_constants(ir, copies: list, tg, replicas: int) -> dict:
    """{(constant, 0): unknown} for replica 0's constants that may hold the slice's size.

    With a fixed batch dimension TF folded the global batch into constants (shapes, sizes, a
    mean's divisor, zeros of the batch's shape), and split-inputs makes each replica's say the
    slice's size: they are neither identical to the single-device value nor a known merge.
    Every numeric constant with a multiple of the slice's size among its values or as its
    leading dimension counts (a few innocent ones are only served as unknown), but those
    split-inputs rewrote, which say what they hold. A vector is read at its entry 0 only, where
    a shape or a slice's bounds hold the batch's axis: ``x[:, t]``'s bounds ``[0, t]`` are
    innocent whatever t is."""
    sizes = {i.fixed_batch for i in tg.inputs if i.fixed_batch}
    if not sizes or replicas < 2:
        return {}
    from tensorflow.python.framework import tensor_util
    size = min(sizes) // replicas
    found = {}
    from_batch = functools.cache(lambda: ir.data_descendants(
        [n for n in ir.nodes_of({"Split", "SparseSplit"}) if n.startswith(SPLIT_SCOPE)]))
    node_table = ir.g._node
    for name in copies:
        if node_table[name]["op"] != "Const":
            continue
        if replica_values.REBATCHED_ATTR in ir.attrs(name):
            continue  # split-inputs says what it holds
        tensor = ir.attrs(name)["value"].tensor
        dims = [d.size for d in tensor.tensor_shape.dim]
        if tensor.dtype not in _REALS:
            continue
        values = tensor_util.MakeNdarray(tensor).reshape(-1)[:1]
        if ((dims and dims[0] == size) or (
                values.size and values[0] >= size and values[0] % size == 0)) \
                and _meets_the_batch(ir, name, from_batch):
            found[(name, 0)] = replica_values.UNKNOWN
    return found


def _meets_the_batch(ir, name: str, from_batch) -> bool:
    """Whether what ``name`` computes reaches, through data edges, a node computed from the
    batch other than a variable's write: a value that never does is the same on every replica
    as on one device (a learning-rate schedule's ``decay_steps``, convolutional.py's ``batch *
    BATCH_SIZE``), whatever multiple of the slice's size it happens to be."""
    seen, stack = {name}, [name]
    while stack:
        node = stack.pop()
        for dst, _ in ir.consumers(node):
            if dst in seen:
                continue
            seen.add(dst)
            if training.is_mutating_op(ir.op(dst)):
                continue  # a variable written with the single-device value
            if dst in from_batch():
                return True
            stack.append(dst)
    return False


def _losses_as_means(values, losses: set, forced: dict) -> None:
    """A loss (or a step that is a tensor, which returns its loss) is served as the mean of the
    copies unless it is shown to be a sum or identical: that is what the averaged gradients
    train, also where it is not the batch's mean (batch norm, dropout). What is computed from
    it keeps its own class, and the user's overrides stay."""
    for node, port in losses - forced.keys():
        found = values.classes.get(node, (replica_values.UNKNOWN,))
        kind = found[port] if port < len(found) else found[-1]
        if kind not in (SUM, IDENTICAL) and len(found) == 1 and port == 0:
            values.classes[node] = (MEAN,)


def _copies_of(ir, first: str, tensors) -> set:
    """(replica 0's copy, port) of each tensor that was replicated."""
    found = set()
    for tensor in tensors:
        node, port = parse_tensor(tensor)
        if first + node in ir and node not in ir:
            found.add((first + node, port))
    return found


def _gradient_losses(ir, first: str, tg) -> dict:
    """{(copy of a born dense gradient, port): (copy of the loss it differentiates, port)}."""
    found = {}
    for step in tg.steps:
        if not step.loss:
            continue
        loss = _copies_of(ir, first, [step.loss])
        if not loss:
            continue
        for var in tg.trainable:
            dense = [g.tensor for g in var.gradients_applied_in(step.closure)
                     if g.kind == "dense"]
            for gradient in _copies_of(ir, first, dense):
                found[gradient] = next(iter(loss))
    return found


class _Merge:
    """Collects the merged nodes by op and attrs, then adds each group with one bulk call."""

    def __init__(self, ir, build: Builder, prefixes: list, values, towers=None):
        self.ir, self.build, self.prefixes, self.values = ir, build, prefixes, values
        self.towers = towers  # _tower_values
        self.groups = {}  # (op, attr values) -> (op, attrs, rows), in the order first seen
        self.stacks = {}  # the same for the Packs that Means read (added first)
        self.counts = collections.Counter()
        self.unmerged = []
        self._axis = None
        self._signatures = {}  # op type -> output dtypes (ints or attr names), or how to ask

    def node(self, name: str, effect: bool, only_first: bool) -> None:
        """The node ``name`` serving its copies; ``effect``: running it must run every
        replica's copy; ``only_first``: replica 0 alone has a copy."""
        first = self.prefixes[0] + name
        dtypes = self._output_types(first)
        if not dtypes:  # no outputs, or an op nobody can type
            self._add(self.groups, "NoOp", {}, name,
                      ["^" + c for c in self._copies(name, only_first)])
            self._served(name, "no_outputs" if dtypes == [] else None)
            return
        if self.towers is not None and not only_first and self._tower(name, dtypes, effect):
            return
        values = _IDENTICAL if only_first else self.values.classes.get(first, _UNKNOWN)
        copies = None
        if len(dtypes) == 1 and values[0] != IDENTICAL:
            copies = self._copies(name, only_first)
            if len(copies) > 1 and self._merged(name, copies, values[0], dtypes[0]):
                return
        inputs = [first]
        if effect:
            inputs += ["^" + c for c in (copies or self._copies(name, only_first))[1:]]
        if len(dtypes) == 1:
            self._identity(name, dtypes[0], inputs)
            identical = values[0] == IDENTICAL or copies == [first]
        else:
            outputs, identical = self._outputs(name, only_first, values, dtypes)
            self._add(self.groups, "IdentityN", {"T": tuple(dtypes)}, name,
                      outputs + inputs[1:])
        self._served(name, "identical" if identical else None)

    def _identity(self, name: str, dtype: int, inputs: list) -> None:
        """``_add`` of an Identity (most of the nodes served), without its generic steps."""
        group = self.groups.get(("Identity", dtype))
        if group is None:
            group = self.groups["Identity", dtype] = ("Identity", {"T": dtype}, [])
        group[2].append((name, inputs, ""))

    def _tower(self, name: str, dtypes: list, effect: bool) -> bool:
        """Serve ``name`` from the pieces of the batch its tower's part is made of, merged by
        its class as a tower computes it (_tower_values); False when it is no tower value,
        or none of its outputs can be so served."""
        layout, values, overridden = self.towers
        replicas = len(self.prefixes)
        if name in overridden or layout.pieces(name, 0, replicas) is None:
            return False
        first = self.prefixes[0] + name
        read = {self.prefixes[r] + node for r, node, _ in layout.pieces(name, 0, replicas)}
        # running a node with effects runs every replica's copy, also those no piece is of
        waits = ["^" + c for c in self._copies(name, False) if c not in read] if effect else []
        outputs, right = [], True
        for port, dtype in enumerate(dtypes):
            kind = values.of(first, port)
            tensors = [f"{self.prefixes[r]}{node}:{p}"
                       for r, node, p in layout.pieces(name, port, replicas)]
            merged = name if len(dtypes) == 1 else f"{SCOPE}{name}/output_{port}"
            if kind not in (IDENTICAL, UNKNOWN) and self._merged(
                    merged, tensors, kind, dtype, count=False, waits=waits):
                outputs.append(merged)
            elif len(dtypes) == 1:
                return False
            else:  # the other outputs are still served right
                outputs.append(f"{first}:{port}")
                right = right and kind == IDENTICAL
        if len(dtypes) > 1:
            self._add(self.groups, "IdentityN", {"T": tuple(dtypes)}, name, outputs + waits)
        self._served(name, "towers" if right else None)
        return True

    def _outputs(self, name: str, only_first: bool, values: tuple, dtypes: list):
        """The inputs of the IdentityN serving a node with several outputs (tf.split,
        tf.unstack, a batch norm's): each output merged as its class asks, under
        ``merge_fetches/<name>/output_<k>``, or replica 0's; and whether each is right."""
        first = self.prefixes[0] + name
        copies = self._copies(name, only_first)
        outputs, right = [], True
        for k, dtype in enumerate(dtypes):
            kind = values[min(k, len(values) - 1)]  # a short tuple repeats its last
            merged = f"{SCOPE}{name}/output_{k}"
            if kind == IDENTICAL or len(copies) == 1:
                outputs.append(f"{first}:{k}")
            elif self._merged(merged, [f"{c}:{k}" for c in copies], kind, dtype, count=False):
                outputs.append(merged)
            else:
                outputs.append(f"{first}:{k}")
                right = False
        return outputs, right

    def _copies(self, name: str, only_first: bool) -> list[str]:
        """Every replica's copy of ``name`` (those that exist, should a pass have removed one);
        replica 0's alone for what only it has (sync-init's initial values)."""
        if only_first:
            return [self.prefixes[0] + name]
        copies = [p + name for p in self.prefixes]
        if copies[-1] in self.ir.g._node:
            return copies
        return [c for c in copies if c in self.ir.g._node]

    def _output_types(self, name: str) -> list | None:
        """The dtype of each output of ``name``; None when its op is unknown or an output's
        type cannot be told. Ops whose outputs are fixed by their OpDef are read once."""
        op = self.ir.g._node[name]["op"]
        signature = self._signatures.get(op)
        if type(signature) is tuple and len(signature) == 1:  # the usual: one output
            dtype = signature[0]
            if type(dtype) is int:
                return [dtype]
            found = self.ir.attrs(name).get(dtype)
            return None if found is None else [found.type]
        if signature is None:
            found = opdefs.op_def(self.ir, op)
            fixed = found is not None and not any(a.number_attr or a.type_list_attr
                                                  for a in found.output_arg)
            signature = self._signatures[op] = (
                tuple(a.type or a.type_attr for a in found.output_arg) if fixed else
                "unknown" if found is None else "per node")
        if signature == "unknown":
            return None
        if signature == "per node":
            count = opdefs.num_outputs(self.ir, name)
            dtypes = [opdefs.output_dtype(self.ir, name, k) for k in range(count)]
            return None if None in dtypes else dtypes
        attrs = self.ir.attrs(name)
        dtypes = [t if type(t) is int else attrs[t].type if t in attrs else None
                  for t in signature]
        return None if None in dtypes else dtypes

    def _merged(self, name: str, copies: list, kind: str, dtype: int,
                count: bool = True, waits=()) -> bool:
        """Add ``name``: the ConcatV2, Mean, AddN, Max or Min of the tensors ``copies`` that
        ``kind`` asks for; False when it asks for none (or the dtype allows none). ``count``:
        count ``name`` as served (not an output of a node served whole). ``waits``: control
        inputs it also gets."""
        waits = list(waits)
        if kind in BATCHED and dtype not in _NOT_CONCATENABLE:
            self._add(self.groups, "ConcatV2", {"N": len(copies), "T": dtype}, name,
                      copies + [self.axis()] + waits)
            how = "batch"
        elif kind == MEAN and dtype in _FLOATS or kind in EXTREMES and dtype in _NUMBERS:
            stack = name + "/stack" if name.startswith(SCOPE) else SCOPE + name + "/stack"
            self._add(self.stacks, "Pack", {"N": len(copies), "T": dtype}, stack, copies)
            self._add(self.groups, _REDUCE_OP[kind], {"T": dtype}, name,
                      [stack, self.axis()] + waits)
            how = kind
        elif kind in (SUM, COUNT) and dtype in _NUMBERS:
            self._add(self.groups, "AddN", {"N": len(copies), "T": dtype}, name,
                      copies + waits)
            how = "sum"
        else:
            return False
        if count:
            self._served(name, how)
        return True

    def _served(self, name: str, how: str | None) -> None:
        """Count how ``name`` is served; None: from replica 0 without knowing it is right."""
        if how is None:
            how = "replica_0"
            self.unmerged.append(name)
        counts = self.counts
        counts[how] = counts.get(how, 0) + 1

    def axis(self) -> str:
        if self._axis is None:
            self._axis = self.build.const(self.ir.unique_name(SCOPE + "axis"), 0, np.int32)
        return self._axis

    @staticmethod
    def _add(groups: dict, op: str, attrs: dict, name: str, inputs: list) -> None:
        key = (op, *attrs.values())  # each op's attrs are always given in the same order
        group = groups.get(key)
        if group is None:
            group = groups[key] = (op, attrs, [])
        group[2].append((name, inputs, ""))

    def flush(self) -> None:
        for table in (self.stacks, self.groups):
            for op, attrs, rows in table.values():
                self.build.ops(op, rows, **{k: list(v) if isinstance(v, tuple) else v
                                            for k, v in attrs.items()})


def _restore_collection_names(ir, merged) -> None:
    """Collections that listed replica copies of a merged node list the original name again."""
    for col in ir.meta.collection_def.values():
        if not col.HasField("node_list"):
            continue
        out = []
        for value in col.node_list.value:
            bare = value.lstrip("^")
            head = bare.split("/", 1)
            if (bare.startswith("replica_") and len(head) == 2
                    and parse_tensor(head[1])[0] in merged):
                out.append(("^" if value.startswith("^") else "") + head[1])
            else:
                out.append(value)
        del col.node_list.value[:]
        col.node_list.value.extend(dict.fromkeys(out))
