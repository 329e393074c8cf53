"""Tower code run on one device (TF1's multi-GPU CIFAR-10 tutorial): ``tf.split`` of the batch
into T equal parts, one tower per part (shared variables), each tower's loss a mean over its
part, ``opt.compute_gradients`` per tower, and the towers' gradients averaged
(``tf.reduce_mean`` of the stacked or expanded-and-concatenated gradients, or ``tf.add_n``)
before one ``apply_gradients``.

Split across N replicas, each replica splits its slice of B/N rows into T parts of B/(NT). The
average of the towers' gradients is then the mean over the slice of every example's gradient,
and the all-reduce's mean over the replicas the mean over the batch, exactly as on one device,
provided that (checked here, else refused):

- the towers compute the same function of their parts (the same ops on the same variables:
  ``tower_hash`` is equal for every tower), so it does not matter which tower an example is in;
- each tower keeps its examples apart until its loss takes their mean: batch norm's statistics
  in training mode, a maximum over the part or any other mixing would see other rows in a
  replica's tower than in the original's (graphxform/batch_mixing.py, run on each tower's loss
  with the parts as the batch, plus batch norm and the batch's extremes, which it allows);
- each part is read by one tower, and the towers' gradients are averaged (or summed) with equal
  weights.

The towers' gradients are reduced after they are averaged (``training.Gradient.towers`` holds
the born ones). A fed batch whose slices do not divide by T is refused before it runs
(``uneven_feed``); one read from an input pipeline fails in the tower's split, which
``uneven_towers`` says in one line. A fixed batch is refused at apply time (split-inputs): TF
folded the part's size into the towers' constants (a mean's divisor), which a replica's part
does not have.

A tower's own values (its loss, its logits) are another matter: the single device's tower t
holds rows [tB/T, (t+1)B/T), replica r's tower t part t of replica r's slice. The batch is N*T
pieces; piece k is tower k % T of replica k // T, and the single device's part t is pieces
[tN, (t+1)N). ``layout`` finds, for each value a tower computes from its part alone, the node of
every other tower that computes the same function of its own part (``tower_hash``), which
merge-fetches serves the single device's value from (passes/merge_fetches.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import re

from graphxform.errors import ContractError
from graphxform.ir import parse_tensor, tensor_name

_PASS_THROUGH = ("Identity", "ExpandDims")


def tower_average(ir, node: str, port: int) -> list[str] | None:
    """The per-tower gradients (tensor names, each born in its own gradients scope) whose
    equal-weight average or sum ``node:port`` is, or None: ``reduce_mean(concat([expand_dims(g,
    0) ...], 0), 0)``, ``reduce_mean(stack(grads), 0)`` (or reduce_sum), ``add_n(grads)``."""
    from graphxform.training import gradient_scope
    op = ir.op(node)
    if port != 0 or gradient_scope(node):  # tf.gradients' own sums are no towers'
        return None
    if op in ("Mean", "Sum"):
        from graphxform.nodes import const_value
        axes = const_value(ir, ir.input(node, 1)[0])
        stacked = ir.input(node, 0)[0]
        if axes is None or axes.reshape(-1).tolist() != [0]:
            return None
        if ir.op(stacked) == "ConcatV2":
            inputs = ir.inputs(stacked)
            axis = const_value(ir, inputs[-1][0])
            if axis is None or int(axis) != 0 or not all(
                    ir.op(src) == "ExpandDims" for src, _ in inputs[:-1]):
                return None
            parts = [ir.input(src, 0) for src, _ in inputs[:-1]]
        elif ir.op(stacked) == "Pack":
            attr = ir.attrs(stacked).get("axis")
            if attr is not None and attr.i != 0:
                return None
            parts = ir.inputs(stacked)
        else:
            return None
    elif op == "AddN":
        parts = ir.inputs(node)
    else:
        return None
    born = []
    for src, p in parts:
        while ir.op(src) == "Identity" and not gradient_scope(src):
            src, p = ir.input(src, 0)
        born.append((src, p))
    scopes = [gradient_scope(src) for src, _ in born]
    if len(born) < 2 or None in scopes or len(set(scopes)) != len(scopes):
        return None
    return [tensor_name(src, p) for src, p in born]


def check(ir, tg, step) -> set:
    """The tower splits of ``step`` (Split nodes of the batch into its towers' parts) once the
    conditions in the module's docstring hold for every variable whose gradient is a tower
    average; refuses (ContractError) otherwise. Empty for a step without towers."""
    from graphxform.batch_mixing import tower_flow
    averaged = [v for v in tg.trainable if v.gradient.towers and set(v.updates) & step.closure]
    if not averaged:
        return set()
    sources = set(tg.batch_sources)
    scopes, splits, memo = None, set(), {"parts": {}, "hashes": {}}
    for var in averaged:
        towers = _towers(ir, var, sources, memo)
        found = sorted(towers)
        if scopes is None:
            scopes = found
        elif found != scopes:
            raise ContractError(
                f"step '{step.name}' averages the gradients of variable '{var.name}' over "
                f"other towers ({', '.join(found)}) than those of '{averaged[0].name}' "
                f"({', '.join(scopes)}): a replica's towers would weigh examples otherwise")
        for _, (split, _) in towers.items():
            splits |= split
    counts = {int(ir.attrs(s)["num_split"].i) for s in splits}
    if len(counts) != 1 or counts.pop() != len(scopes):
        raise ContractError(
            f"step '{step.name}' averages the gradients of {len(scopes)} towers, but splits "
            f"the batch ({', '.join(sorted(splits))}) into another number of parts: only "
            "equal parts, one per tower, train the same on a replica's slice")
    losses = _tower_losses(ir, averaged[0])
    for loss in losses:
        problem = tower_flow(ir, loss, sources, splits)
        if problem is not None:
            raise ContractError(
                f"step '{step.name}' trains towers on parts of the batch (tf.split at "
                f"'{sorted(splits)[0]}'), and the tower's loss '{loss}' would not train the "
                f"same on a replica's slice: '{problem[0]}' ({ir.op(problem[0])}) "
                f"{problem[1]}: make each tower's loss a mean of per-example terms, or train "
                "on one device")
    return splits


def _towers(ir, var, sources, memo: dict) -> dict:
    """Gradients scope -> (the splits its tower reads, the part index) for ``var``'s tower
    average; refuses towers that read several parts, share one, or differ."""
    from graphxform.training import gradient_scope
    towers, hashes = {}, {}
    for tensor in var.gradient.towers:
        node, port = parse_tensor(tensor)
        parts = _parts_read(ir, node, sources, memo["parts"])
        indices = {k for _, k in parts}
        if len(indices) != 1:
            read = ", ".join(sorted(f"{s}:{k}" for s, k in parts)) or "no part of the batch"
            raise ContractError(
                f"variable '{var.name}': its gradients are averaged over towers, but the one "
                f"at '{tensor}' reads {read}, not one part of a tf.split of the batch: "
                "only towers that each read their own part train the same on a replica's "
                "slice")
        towers[gradient_scope(node)] = ({s for s, _ in parts}, indices.pop())
        hashes[tensor] = tower_hash(ir, node, port, sources, memo["hashes"])
    if len({k for _, k in towers.values()}) != len(towers):
        raise ContractError(
            f"variable '{var.name}': two of the towers its gradient averages read the same "
            "part of the batch")
    if len(set(hashes.values())) != 1:
        first, other = next(iter(hashes)), next(t for t in hashes
                                                  if hashes[t] != next(iter(hashes.values())))
        raise ContractError(
            f"variable '{var.name}': its gradients are averaged over towers that compute "
            f"differently ('{first}' and '{other}': other ops, variables, constants or random "
            "seeds): on a replica's slice each tower holds other examples, which would be "
            "weighed otherwise")
    return towers


def _parts_read(ir, node: str, sources, memo: dict, whole: bool = False) -> frozenset:
    """(split, index) of each output of a Split of a batch source along axis 0 that ``node``'s
    value reads (through data inputs; ``memo`` is shared between calls). ``whole``: a batch
    source read other than through such a split counts too, as (source, None)."""
    def inputs_of(name):
        return [] if _is_batch_split(ir, name, sources) else ir.inputs(name)

    def parts(name, inputs):
        found = set()
        for src, p in inputs:
            if _is_batch_split(ir, src, sources):
                found.add((src, p))
            elif whole and src in sources:
                found.add((src, None))
            else:
                found |= memo.get(src, set())
        return frozenset(found)
    return _bottom_up(node, memo, inputs_of, parts)


def _bottom_up(node: str, memo: dict, inputs_of, value_of):
    """``memo[node]``, filling ``memo`` with ``value_of(name, inputs_of(name))`` for ``node``
    and what it reads, every input before its reader; iterative, as graphs run deeper than
    Python's recursion, and a loop's back edge is left out of ``memo`` when its reader is."""
    stack, expanded = [node], set()
    while stack:
        name = stack[-1]
        if name in memo:
            stack.pop()
            continue
        inputs = inputs_of(name)
        missing = [src for src, _ in inputs if src not in memo]
        if missing and name not in expanded:  # expanded: a loop's back edge
            expanded.add(name)
            stack.extend(missing)
            continue
        stack.pop()
        memo[name] = value_of(name, inputs)
    return memo[node]


def _is_batch_split(ir, name: str, sources) -> bool:
    from graphxform.nodes import const_value
    if ir.op(name) != "Split" or ir.input(name, 1)[0] not in sources:
        return False
    axis = const_value(ir, ir.input(name, 0)[0])
    return axis is not None and int(axis) == 0


def tower_hash(ir, node: str, port: int, sources, memo: dict) -> str:
    """A hash of how ``node:port`` is computed: ops and their attrs (not names, nor the
    ``_``-attrs TF adds), inputs in order, variables and placeholders by name, a part of the
    batch by its split but not its index; so two towers hash alike when they compute the same
    function of their own parts."""
    def leaf(name):
        return _is_batch_split(ir, name, sources) or ir.op(name) in (
            "Placeholder", "PlaceholderWithDefault", "VarHandleOp", "VariableV2", "Variable")

    def digest_of(name, inputs):
        digest = hashlib.sha1(ir.op(name).encode())
        if leaf(name) and not _is_batch_split(ir, name, sources):
            digest.update(name.encode())
        elif leaf(name):
            digest.update(ir.input(name, 1)[0].encode())
        for key, value in sorted(ir.attrs(name).items()):
            if not key.startswith("_"):
                digest.update(key.encode() + value.SerializeToString(deterministic=True))
        for src, p in inputs:
            part = "part" if _is_batch_split(ir, src, sources) else p  # not which part
            digest.update(f"{memo.get(src, 'loop')}:{part}".encode())
        return digest.hexdigest()
    _bottom_up(node, memo, lambda name: [] if leaf(name) else ir.inputs(name), digest_of)
    return f"{memo[node]}:{port}"


def _tower_losses(ir, var) -> list[str]:
    """Each tower's loss: the ``ys`` of the tf.gradients call its gradient comes from."""
    from graphxform.training import gradient_scope, scope_loss
    losses = []
    for tensor in var.gradient.towers:
        loss = scope_loss(ir, gradient_scope(parse_tensor(tensor)[0]))
        if loss is None:
            raise ContractError(
                f"variable '{var.name}': its gradients are averaged over towers, and the loss "
                f"that '{tensor}' differentiates was not found")
        losses.append(loss)
    return losses


@dataclasses.dataclass
class Layout:
    """Where the input graph's tower values are: ``count`` towers, the ``splits`` of the batch
    into their parts, ``part``: node -> the index of the one part it reads (and no other batch
    data; not the insides of tf.gradients, scaled by the part's size), ``digest``: node -> its
    ``tower_hash``, ``peers``: (part index, digest) -> a node computing that from that part."""
    count: int
    splits: frozenset
    reads: dict  # split -> the batch tensor it splits
    part: dict
    digest: dict
    peers: dict

    def pieces(self, name: str, port: int, replicas: int) -> list | None:
        """(replica, node, port) of each piece of what ``name:port`` holds on one device, in
        batch order (see the module's docstring); None when it is no tower value, or a tower
        lacks its counterpart."""
        towers = self.count
        if name in self.splits:
            return [(k // towers, name, k % towers)
                    for k in range(port * replicas, (port + 1) * replicas)]
        part = self.part.get(name)
        if part is None:
            return None
        found = []
        for k in range(part * replicas, (part + 1) * replicas):
            peer = self.peers.get((k % towers, self.digest[name]))
            if peer is None:
                return None
            found.append((k // towers, peer, port))
        return found


def layout(ir, tg) -> Layout | None:
    """The Layout of the input graph's towers, or None when it has none (or steps that split
    the batch into different numbers of towers, or towers ``check`` refuses)."""
    from graphxform.training import gradient_scope
    splits = set()
    if not tg.batch_sources:
        return None
    try:
        for step in tg.steps:
            splits |= check(ir, tg, step)
    except ContractError:
        return None
    counts = {int(ir.attrs(s)["num_split"].i) for s in splits}
    if len(counts) != 1:
        return None
    sources = set(tg.batch_sources)
    reads, hashes = {}, {}
    part, digest, peers = {}, {}, {}
    for name in ir.nodes():
        if gradient_scope(name) or name in splits:
            continue
        read = _parts_read(ir, name, sources, reads, whole=True)
        indices = {k for _, k in read}
        if len(indices) != 1 or not {s for s, _ in read} <= splits:
            continue
        part[name] = indices.pop()
        digest[name] = tower_hash(ir, name, 0, sources, hashes).rsplit(":", 1)[0]
        peers.setdefault((part[name], digest[name]), name)
    reads = {split: tensor_name(*ir.input(split, 1)) for split in splits}
    return Layout(counts.pop(), frozenset(splits), reads, part, digest, peers)


def replica_splits(ir) -> list[tuple[str, str, int]]:
    """(original split, input, towers) of each tower split in a transformed graph: replica 0's
    Split along axis 0 of its slice of a batch (split-inputs' Split of input ``input``)."""
    from graphxform.nodes import const_value
    found = []
    for name in ir.nodes_of({"Split"}):
        if not name.startswith("replica_0/"):
            continue
        src = ir.input(name, 1)[0]
        axis = const_value(ir, ir.input(name, 0)[0])
        if (src.startswith("split_inputs/") and ir.op(src) == "Split"
                and axis is not None and int(axis) == 0):
            found.append((name[len("replica_0/"):], ir.input(src, 1)[0],
                          int(ir.attrs(name)["num_split"].i)))
    return found


_UNEVEN = re.compile(r"node (replica_(\d+)/[^\s:}]+).*?Number of ways to split should evenly "
                     r"divide the split dimension, but got split_dim 0 \(size = (\d+)\) and "
                     r"num_split (\d+)", re.S)


def uneven_towers(error_text: str) -> str | None:
    """One line for a run that failed in a replica's tower split (its slice of the batch does
    not divide into the towers); None when it failed elsewhere."""
    found = _UNEVEN.search(error_text)
    if found is None:
        return None
    node, replica, size, towers = found.groups()
    original = node.split("/", 1)[1]
    return (f"replica {replica}'s slice of the batch has {size} rows, which tf.split "
            f"'{original}' cannot divide into its {towers} towers: the global batch must divide "
            f"by the replicas times {towers}")
