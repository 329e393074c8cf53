"""Bytes moved per training step, measured on the emitted graph, next to the textbook minimum.

We do not restate formulas: we walk the transformed graph the way TF's distributed runtime will
run it, so a pass that sends more than it should shows up as a ratio above 1.

- Where a node runs: its device, except that an op reading a resource (ReadVariableOp,
  ResourceGather, an optimizer update) runs with the resource, and a `_class` colocation wins
  over an empty device, as in TF's placer. An unplaced node runs on the client: the chief task.
  (Checked against the partition graphs TF builds for a ps graph on an in-process cluster.)
- A tensor crosses when producer and consumer run on different tasks; TF's graph partitioner
  makes one send/recv per (tensor, destination task), so each pair is counted once. Constants
  are not counted (TF copies them to their consumers), nor control edges (no payload).
- Sizes are static shapes from importing the emitted GraphDef into a tf.Graph with the batch
  dimension of the inputs set from the global batch.
- Collectives (allreduce) move data without edges: a ring all-reduce of B bytes over N devices
  sends and receives 2(N-1)/N x B per device, an all-gather (N-1)/N of the gathered bytes.
- Only what one training step runs counts: ancestors of the train op and the loss (a
  checkpoint's reads do not).
- Across worker tasks (allreduce on a cluster) what matters is each task's network link. TF
  runs a CPU collective as a ring over its members sorted by task and device, each member
  sending its share to the next: only the hops from one task to the next cross a link. The
  links table shows that for the graph (flat: one ring of every replica, so each link carries
  2(N-1)/N of the gradients for N = W x R; --hierarchical: one member per worker, 2(W-1)/W)
  next to the textbook minimum of a ring over the W workers, 2(W-1)/W of the gradient bytes.
"""

from __future__ import annotations

import dataclasses
import re


from graphxform import training
from graphxform.errors import GraphxformError
from graphxform.ir import GraphIR, parse_tensor
from graphxform.passes.model_average import CENTRE, SCOPE as MODEL_AVERAGE, centre_name

DT_RESOURCE = 20
# ops TF's placer does not pull onto their resource inputs' device (they forward, not read)
RESOURCE_COLOCATION_EXEMPT = {"IdentityN", "PartitionedCall", "StatefulPartitionedCall", "While",
                              "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase"}
COLLECTIVE_REDUCE = "CollectiveReduceV2"
COLLECTIVE_GATHER = "CollectiveGatherV2"
OTHER = "other"
_REPLICA = re.compile(r"^replica_\d+/")
_TASK = re.compile(r"/job:([^/]+)(?:/replica:\d+)?(?:/task:(\d+))?")
_GRADIENT_SCOPES = ("/accumulator", "/local_mean")


@dataclasses.dataclass
class Transfer:
    """One tensor sent from one endpoint to another per step."""
    tensor: str
    src: str
    dst: str
    nbytes: float
    variable: str  # original variable name, or "other"
    kind: str = "edge"  # "edge", "all-reduce" or "all-gather" (src = dst = the device)
    upper_bound: bool = False


@dataclasses.dataclass
class Endpoint:
    """A task (or a device for collectives) with its measured and minimum bytes per step."""
    name: str
    sent: float = 0.0
    received: float = 0.0
    minimum_sent: float = 0.0
    minimum_received: float = 0.0


@dataclasses.dataclass
class VariableCost:
    name: str
    moved: float = 0.0
    minimum: float = 0.0
    upper_bound: bool = False


@dataclasses.dataclass
class CostReport:
    strategy: str
    batch_size: int
    replicas: int
    model: str  # "ps" or "allreduce": which textbook minimum applies
    client: str
    endpoints: dict
    variables: dict
    transfers: list
    notes: list
    links: list = dataclasses.field(default_factory=list)  # LinkCost per variant measured
    link_minimum: float = 0.0  # per worker link, each way: 2(W-1)/W x the gradient bytes
    per: str = "training step"  # what the bytes are counted over (model-average: a round)

    def to_dict(self) -> dict:
        doc = {
            "strategy": self.strategy, "per": self.per, "batch_size": self.batch_size,
            "replicas": self.replicas,
            "minimum_model": self.model, "client": self.client,
            "tasks": [dict(dataclasses.asdict(e), ratio=_ratio(e.sent + e.received,
                                                               e.minimum_sent + e.minimum_received))
                      for e in self.endpoints.values()],
            "variables": [dict(dataclasses.asdict(v), ratio=_ratio(v.moved, v.minimum))
                          for v in self.variables.values()],
            "transfers": [dataclasses.asdict(t) for t in self.transfers],
            "notes": list(self.notes)}
        if self.links:
            doc["links"] = [{"variant": link.variant, "tasks": [
                {"task": task, "sent": sent, "received": received,
                 "ratio": _ratio(sent + received, 2 * self.link_minimum)}
                for task, (sent, received) in link.tasks.items()]} for link in self.links]
            doc["link_minimum_each_way"] = self.link_minimum
        return doc


@dataclasses.dataclass
class LinkCost:
    """Bytes a variant's collectives move over each worker task's network link per step."""
    variant: str  # "flat" or "hierarchical"
    tasks: dict  # task -> (sent, received)


def check_request(strategy: str, batch_size) -> None:
    """Refuse what cannot be costed before transforming anything (one-line errors)."""
    from graphxform import strategies
    if strategy not in strategies.STRATEGIES:
        raise GraphxformError(f"unknown strategy '{strategy}' (known: "
                              f"{', '.join(strategies.STRATEGIES)})")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise GraphxformError(f"--batch-size must be a positive number of examples, not "
                              f"{batch_size}")


def measure(original: GraphIR, ir: GraphIR, batch_size: int = 32, strategy: str = "",
            train_op: str | None = None) -> CostReport:
    """Bytes each task/device sends and receives per step in ``ir`` (``original`` transformed),
    per variable, with the textbook minimum for the strategy that made it."""
    tg = training.analyze(original, train_op=train_op)
    replicas = count_replicas(ir)
    if batch_size < 1 or batch_size % replicas:
        raise GraphxformError(f"--batch-size {batch_size} does not split evenly over {replicas} "
                              "replicas")
    notes = []
    batched = [i for i in tg.inputs if i.batched]
    shapes = static_shapes(ir, batched, batch_size)
    client = client_task(ir)
    runs = step_runs(ir, tg)
    step = set().union(*(nodes for nodes, _ in runs))
    owners = VariableNames(tg, ir)
    sparse_rows, guessed = rows_touched(tg, original, batched, batch_size)
    if guessed:
        notes.append(f"{len(guessed)} sparse variable(s) take ids from a sparse input, whose "
                     "count per step the graph does not fix: counted at one id per example "
                     "(an estimate, not a bound): " + ", ".join(guessed[:3]))
    transfers = []
    for nodes, _ in runs:  # each train op's run moves its own bytes, shared ancestors too
        transfers += edge_transfers(ir, nodes, shapes, client, owners, sparse_rows)
        transfers += collective_transfers(ir, nodes, shapes, owners, sparse_rows, tg)
    model = "allreduce" if any(t.kind != "edge" for t in transfers) else "ps"
    if model == "allreduce" and any(_is_accumulator(ir, n) for n in step):
        model, minimum = "hybrid", _summed(runs, lambda counts: hybrid_minimum(
            ir, step, tg, sparse_rows, client, owners, counts))
        notes.append("hybrid: the all-reduced variables' minimum is the ring's (per device), the "
                     "ps side's the parameter servers' (per task)")
    elif model == "allreduce":
        minimum = _summed(runs, lambda counts: allreduce_minimum(ir, step, tg, sparse_rows,
                                                                 counts=counts))
    else:
        minimum = _summed(runs, lambda counts: ps_minimum(ir, tg, sparse_rows, client, owners,
                                                          counts=counts))
    if strategy == "independent":  # no exchange by design: anything moved is overhead
        model, minimum = "independent", {"endpoints": {}, "variables": {
            var.name: (0.0, False) for var in tg.trainable}}
        notes.append("independent: replicas never exchange gradients or variables, so the "
                     "minimum is nothing and anything moved is overhead")
    per = "training step"
    if len(runs) > 1:
        per += f" ({', '.join(s.name for s in tg.steps)} run once each)"
        shared = [v.name for v in tg.trainable if len(v.gradients) > 1]
        if shared:
            notes.append(f"{len(shared)} variable(s) get a gradient from each of several train "
                         "ops, each reduced in the step that applies it, and counted there: "
                         + ", ".join(shared[:3]))
    if ir.has_scope(MODEL_AVERAGE):
        model, minimum = "model-average", model_average_minimum(ir, tg, client)
        interval = _model_average_interval(ir)
        per = f"averaging round ({interval} local step{'s' if interval > 1 else ''})"
        for t in _per_step_only(ir, transfers):
            t.nbytes *= interval
        notes.append("model-average: counted per averaging round: what a local step moves "
                     f"(its inputs) x{interval}, a round's copies and centres once (on a "
                     "cluster only rounds touch the ps tasks; on one machine the copies are read "
                     "into the mean every step and a round flag selects what is kept)")
    endpoints, variables = _tally(transfers, minimum, tg)
    links, link_minimum = [], 0.0
    if model == "allreduce" and len(worker_tasks(ir, client)) > 1:
        links = [_added([link_transfers(ir, nodes, shapes, client) for nodes, _ in runs])]
        link_minimum = ring_minimum(tg, sparse_rows, len(worker_tasks(ir, client)),
                                    _total_counts(runs))
    handles = {t for t in shapes.unknown_crossing if _is_resource(ir, t)}
    unknown = shapes.unknown_crossing - handles
    if handles:
        notes.append(f"{len(handles)} variable handle(s) passed to another task (into a loop or "
                     "function): the reads inside, possibly one per iteration, are not counted: "
                     + ", ".join(sorted(handles)[:3]))
    if unknown:
        notes.append(f"{len(unknown)} crossing tensor(s) of unknown static size not counted: "
                     + ", ".join(sorted(unknown)[:3]))
    if any(t.upper_bound for t in transfers):
        notes.append("sparse gradients and gathered rows are counted at one row per id fed "
                     "(duplicate ids included): an upper bound on the rows a step touches; a "
                     "partitioned variable's ids are spread over its shards by their rows")
    notes.append(f"unplaced nodes run on the client, the chief task {client}; constants and "
                 "control edges are not counted")
    return CostReport(strategy=strategy or model, batch_size=batch_size, replicas=replicas,
                      model=model, client=client, endpoints=endpoints, variables=variables,
                      transfers=transfers, notes=notes, links=links, link_minimum=link_minimum,
                      per=per)


# ------------------------------------------------------------------ the graph as TF will run it

def _is_resource(ir, tensor: str) -> bool:
    from graphxform import opdefs
    return opdefs.output_dtype(ir, *parse_tensor(tensor)) == DT_RESOURCE


def count_replicas(ir: GraphIR) -> int:
    """Replica copies (`replica_{i}/...`) in the graph; 1 for an untransformed one."""
    found = {m.group(0) for n in ir.nodes() if (m := _REPLICA.match(n))}
    return max(1, len(found))


def client_task(ir: GraphIR) -> str:
    """Where unplaced nodes run: the chief (the one client of the drop-in contract)."""
    from graphxform.plan import ClusterPlan
    plan = ClusterPlan.from_ir(ir)
    return plan.chief if plan is not None and plan.chief else "localhost:0"


def task_of(device: str, client: str) -> str:
    """'/job:ps/task:1/device:CPU:0' -> 'ps:1'; a device naming no job is in the client."""
    match = _TASK.search(device or "")
    if not match:
        return client
    return f"{match.group(1)}:{match.group(2) or 0}"


def step_runs(ir: GraphIR, tg) -> list:
    """Per train op the user runs: (the nodes running it runs, its ancestors and its loss's;
    {variable: how many of its gradients it applies}). An actor-critic's trunk gets one
    gradient from each of two train ops, each reduced in the step that applies it; a graph
    of one train op (or named by --train-op alone) is one run over every trainable variable."""
    if len(tg.steps) < 2:
        return [(step_nodes(ir, tg), None)]
    runs = []
    for step in tg.steps:
        roots = [n for n in (step.op, parse_tensor(step.loss)[0] if step.loss else None)
                 if n and n in ir]
        nodes = set().union(*(ir.ancestors(r) | {r} for r in roots))
        runs.append((nodes, {v.name: len(v.gradients_applied_in(step.closure))
                             for v in tg.trainable}))
    return runs


def _total_counts(runs) -> dict | None:
    if any(counts is None for _, counts in runs):
        return None
    total = {}
    for _, counts in runs:
        for name, k in counts.items():
            total[name] = total.get(name, 0) + k
    return total


def _summed(runs, minimum_of) -> dict:
    """The textbook minimum of every run (``minimum_of(counts)``), added up."""
    out = {"endpoints": {}, "variables": {}}
    for _, counts in runs:
        found = minimum_of(counts)
        for name, (sent, received) in found["endpoints"].items():
            had = out["endpoints"].get(name, (0.0, 0.0))
            out["endpoints"][name] = (had[0] + sent, had[1] + received)
        for name, (nbytes, bound) in found["variables"].items():
            had = out["variables"].get(name, (0.0, False))
            out["variables"][name] = (had[0] + nbytes, had[1] or bound)
    return out


def step_nodes(ir: GraphIR, tg) -> set:
    """Nodes one training step runs: ancestors of the train op and of the loss."""
    roots = [n for n in (tg.train_op, parse_tensor(tg.loss)[0] if tg.loss else None)
             if n and n in ir]
    if not roots:
        raise GraphxformError("cannot cost a graph with no train op or loss to run "
                              "(name one with --train-op)")
    found = set()
    for root in roots:
        found |= ir.ancestors(root)
    return found


class Placement:
    """The device each node runs on, with TF's colocation rules for resources and `_class`."""

    def __init__(self, ir: GraphIR):
        self.ir = ir
        self._device = {}

    def _anchor(self, name: str) -> str | None:
        """The node this one must run with: the producer of a resource or ref-variable input,
        else (when unplaced) its `_class` colocation target."""
        from graphxform import opdefs
        ir = self.ir
        variable_ports = self._variable_ports(name)
        for port, (src, src_port) in enumerate(ir.inputs(name)):
            if ir.op(name) in RESOURCE_COLOCATION_EXEMPT:
                break
            if port in variable_ports or opdefs.output_dtype(ir, src, src_port) == DT_RESOURCE:
                return src
        attr = ir.node(name)["attr"].get("_class")
        if attr is not None and not ir.node(name)["device"]:
            for spec in attr.list.s:
                target = spec.decode().removeprefix("loc:@")
                if target != name and target in ir:
                    return target
        return None

    def _variable_ports(self, name: str) -> set:
        from graphxform import opdefs
        try:
            ports = opdefs.input_ports(self.ir, name)
        except GraphxformError:
            return set()
        return {p for arg in opdefs.resource_or_ref_inputs(self.ir, name)
                for p in ports.get(arg, [])}

    def device(self, name: str) -> str:
        chain = []
        while name not in self._device:
            chain.append(name)
            anchor = self._anchor(name)
            if anchor is None or anchor in chain:
                self._device[name] = self.ir.node(name)["device"]
                break
            name = anchor
        for n in chain:
            self._device[n] = self._device[name]
        return self._device[chain[0]] if chain else self._device[name]


class Shapes:
    """Static shapes and dtypes of every tensor, from TF's shape inference on the emitted graph
    with each batched input fed ``batch_size`` examples."""

    def __init__(self, tensors: dict):
        self.tensors = tensors  # name -> (dims list or None, dtype size or None)
        self.unknown_crossing = set()

    def nbytes(self, tensor: str) -> int | None:
        dims, size = self.tensors.get(tensor, (None, None))
        if dims is None or size is None or any(d is None for d in dims):
            return None
        count = 1
        for d in dims:
            count *= d
        return count * size

    def dims(self, tensor: str):
        return self.tensors.get(tensor, (None, None))[0]


def static_shapes(ir: GraphIR, batched, batch_size: int) -> Shapes:
    import tensorflow as tf

    from graphxform.metagraph import to_graphdef
    graph_def = to_graphdef(ir)
    for node in graph_def.node:  # placement is ours to decide, not the importer's
        node.device = ""
    graph = tf.Graph()
    with graph.as_default():
        feeds = {}
        for inp in batched:
            if inp.name in ir:
                feeds[f"{inp.name}:0"] = tf.compat.v1.placeholder(
                    tf.dtypes.as_dtype(inp.dtype),
                    [batch_size, *(d if d >= 0 else None for d in inp.shape[1:])],
                    name=f"graphxform_cost_feed/{inp.name}")
        try:
            tf.graph_util.import_graph_def(graph_def, input_map=feeds, name="")
        except (ValueError, tf.errors.OpError) as e:
            first = str(e).strip().splitlines()[0]
            raise GraphxformError(f"cannot infer tensor sizes at batch {batch_size}: "
                                  f"{first}") from None
    tensors = {}
    for op in graph.get_operations():
        if op.name.startswith("graphxform_cost_feed/"):
            continue
        for out in op.outputs:
            dims = out.shape.as_list() if out.shape.rank is not None else None
            tensors[out.name] = (dims, _dtype_size(out.dtype))
    for feed, tensor in feeds.items():
        tensors[feed] = (tensor.shape.as_list(), _dtype_size(tensor.dtype))
    return Shapes(tensors)


def _dtype_size(dtype) -> int | None:
    """Bytes per element; None where a size is not fixed (strings, handles, variants)."""
    import tensorflow as tf
    base = dtype.base_dtype
    return None if base in (tf.string, tf.resource, tf.variant) else base.size


class VariableNames:
    """Maps graph nodes back to the original variable they carry: a variable, a replica's copy,
    a shard (`<var>/part_k`), or a node of its gradient's path to its accumulator."""

    def __init__(self, tg, ir: GraphIR):
        self.names = set(tg.variables)
        self.slot_of = {v.name: v.slot_of for v in tg.variables.values() if v.slot_of}
        self.ir = ir
        self._shards = None

    def shards(self, name: str) -> list:
        """The variable nodes holding ``name`` outside any replica (itself, or its shards)."""
        if self._shards is None:
            self._shards = {}
            for node in self.ir.nodes():
                if self.ir.op(node) in training.VARIABLE_OPS and not _REPLICA.match(node):
                    self._shards.setdefault(self.original(node), []).append(node)
        return self._shards.get(name, [])

    def primary(self, name: str) -> str:
        return self.slot_of.get(name, name)

    def original(self, node: str) -> str | None:
        """Longest original variable name that is ``node`` or a scope above it (a
        model-average centre is its variable)."""
        node = _REPLICA.sub("", node).removeprefix(CENTRE)
        while node:
            if node in self.names:
                return node
            node = node.rpartition("/")[0]
        return None

    def gradient_scope_of(self, node: str) -> str | None:
        """The variable node X when ``node`` is under `X/accumulator` or `X/local_mean`."""
        node = _REPLICA.sub("", node)
        for marker in _GRADIENT_SCOPES:
            start = node.find(marker)
            while start >= 0:
                end = start + len(marker)
                if (end == len(node) or node[end] == "/") and self.original(node[:start]):
                    return node[:start]
                start = node.find(marker, start + 1)
        return None

    def variable_read_by(self, node: str) -> str | None:
        """The variable node ``node`` reads (ReadVariableOp, a gather, a ref Identity)."""
        for src, _ in self.ir.inputs(node):
            if self.ir.op(src) in training.VARIABLE_OPS and not _is_accumulator(self.ir, src):
                return src
        return None

    def read_of(self, node: str) -> str | None:
        found = self.variable_read_by(node)
        return self.original(found) if found else None

    def of_transfer(self, src: str, dst: str) -> str:
        """A read of a variable or its gradient on the way to its accumulator; else other."""
        if self.ir.op(src) in training.VARIABLE_OPS:
            return self.original(src) or OTHER
        found = (self.variable_read_by(src) or self.gradient_scope_of(src)
                 or self.gradient_scope_of(dst))
        return self.original(found) if found else OTHER

    def related(self, src: str, dst: str) -> str | None:
        """The variable node a transfer serves, counting the ids sent to a gather."""
        return (self.variable_read_by(src) or self.gradient_scope_of(src)
                or self.gradient_scope_of(dst) or self.variable_read_by(dst))


def _is_accumulator(ir, name) -> bool:
    return "Accumulator" in ir.op(name)


# ------------------------------------------------------------------ measured

def edge_transfers(ir, step, shapes, client, owners, sparse_rows) -> list:
    """Data edges between tasks, one per (tensor, destination task)."""
    place = Placement(ir)
    workers = len(worker_tasks(ir, client)) or 1
    seen = {}
    for dst in step:
        dst_task = task_of(place.device(dst), client)
        for src, port in ir.inputs(dst):
            if src not in step or ir.op(src) == "Const":
                continue
            src_task = task_of(place.device(src), client)
            tensor = f"{src}:{port}"
            if src_task == dst_task or (tensor, dst_task) in seen:
                continue
            variable = owners.of_transfer(src, dst)
            nbytes = shapes.nbytes(tensor)
            bound = variable in sparse_rows
            if nbytes is None:
                nbytes = _sparse_bound(ir, tensor, owners.related(src, dst), shapes, owners,
                                       sparse_rows, workers)
                bound = True
            if nbytes is None:
                shapes.unknown_crossing.add(tensor)
                continue
            seen[(tensor, dst_task)] = Transfer(tensor, src_task, dst_task, nbytes, variable,
                                                upper_bound=bound)
    return sorted(seen.values(), key=lambda t: (t.src, t.dst, t.tensor))


def _sparse_bound(ir, tensor, var_node, shapes, owners, sparse_rows, workers) -> int | None:
    """Bytes of a data-dependent tensor serving a sparse variable: one row per id a worker is
    fed, spread over a partitioned variable's shards by their share of its rows."""
    name = owners.original(var_node) if var_node else None
    dims, size = shapes.tensors.get(tensor, (None, None))
    if name not in sparse_rows or not dims or size is None or dims[0] is not None or \
            any(d is None for d in dims[1:]):
        return None
    rows = sparse_rows[name][0] / workers * _shard_fraction(ir, var_node, owners)
    count = 1
    for d in dims[1:]:
        count *= d
    return rows * count * size


def _shard_fraction(ir, var_node, owners) -> float:
    """The share of its variable's rows that ``var_node`` (a shard, or the whole) holds."""
    name = owners.original(var_node)
    if var_node == name or _REPLICA.match(var_node):
        return 1.0
    shards = owners.shards(name)
    total = sum(_variable_bytes(ir, n) for n in shards)
    return _variable_bytes(ir, var_node) / total if total else 1.0


def worker_tasks(ir, client) -> list:
    """Tasks that run replicas (the W of the ps minimum); a replica's read placed with its
    variable on a ps task (an embedding's gather) does not make that task a worker."""
    tasks = {task_of(ir.node(n)["device"], client) for n in ir.nodes()
             if _REPLICA.match(n) and ir.node(n)["device"]}
    return sorted(t for t in tasks if not t.startswith("ps:"))


def collective_transfers(ir, step, shapes, owners, sparse_rows=None, tg=None) -> list:
    """What each device's collectives send and receive per step (sent = received in a ring).
    A gather of a sparse gradient whose row count only the data fixes is counted at the rows
    ``sparse_rows`` gives its variable for the global batch, an equal share per replica."""
    out = []
    for node in sorted(step):
        op = ir.op(node)
        if op not in (COLLECTIVE_REDUCE, COLLECTIVE_GATHER):
            continue
        device = ir.node(node)["device"]
        n = _group_size(ir, node)
        local = shapes.nbytes(f"{ir.inputs(node)[0][0]}:{ir.inputs(node)[0][1]}") or 0
        if op == COLLECTIVE_REDUCE:
            moved = 2 * (n - 1) / n * local
            for variable, share in _bucket_shares(ir, node, shapes, owners).items():
                out.append(Transfer(f"{node}:0", device, device, moved * share, variable,
                                    kind="all-reduce"))
        else:
            variable = _gathered_variable(ir, node, owners)
            if not local and variable in (sparse_rows or {}):
                local = _rows_share_bytes(shapes, "%s:%d" % ir.inputs(node)[0],
                                          sparse_rows[variable][0] / n,
                                          tg.variables[variable].shape)
            out.append(Transfer(f"{node}:0", device, device, (n - 1) / n * (n * local),
                                variable, kind="all-gather", upper_bound=True))
    return out


def _rows_share_bytes(shapes, tensor: str, rows: float, variable_shape) -> float:
    """Bytes of ``rows`` rows of ``tensor``, a gathered sparse gradient's values (rows of the
    variable: a padded slice's inner dimensions are the variable's) or indices (one each)."""
    dims, size = shapes.tensors.get(tensor, (None, None))
    if not dims or size is None:
        return 0
    inner = dims[1:]
    if any(d is None for d in inner):
        inner = list(variable_shape or [])[1:]
        if len(inner) != len(dims) - 1 or any(d is None for d in inner):
            return 0
    count = rows
    for d in inner:
        count *= d
    return count * size


def _group_size(ir, node) -> int:
    from tensorflow.python.framework import tensor_util
    src, _ = ir.inputs(node)[1]
    if ir.op(src) != "Const":
        raise GraphxformError(f"collective '{node}' has a group size that is not a constant")
    return int(tensor_util.MakeNdarray(ir.node(src)["attr"]["value"].tensor))


def _bucket_shares(ir, reduce, shapes, owners) -> dict:
    """Variable -> its fraction of an all-reduce bucket, following each piece of the reduced
    tensor to the update that consumes it (a hierarchical reduce's other replicas read
    copies of it)."""
    pieces = []
    for consumer, _ in ir.consumers(reduce, 0):
        if ir.op(consumer) == "Identity":  # the broadcast to another replica of the worker
            continue
        if ir.op(consumer) == "SplitV":
            pieces += [(f"{consumer}:{k}", c) for k in range(ir.node(consumer)["attr"][
                "num_split"].i) for c, _ in ir.consumers(consumer, k)]
        else:
            pieces.append((f"{reduce}:0", consumer))
    shares, total = {}, 0
    for tensor, consumer in pieces:
        size = shapes.nbytes(tensor) or 0
        variable = _updated_variable(ir, consumer, owners) or OTHER
        shares[variable] = shares.get(variable, 0) + size
        total += size
    return {v: s / total for v, s in shares.items()} if total else {OTHER: 1.0}


def _updated_variable(ir, node, owners, depth: int = 4) -> str | None:
    """The variable whose update ``node`` (or a consumer a few hops on) feeds."""
    frontier = [node]
    for _ in range(depth):
        following = []
        for n in frontier:
            found = owners.read_of(n)
            if found:  # an update may write a slot first (sparse Adam): name its variable
                return owners.primary(found)
            following += [c for c, _ in ir.consumers(n)]
        frontier = following
    return None


def _gathered_variable(ir, node, owners) -> str:
    for consumer, _ in ir.consumers(node, 0):
        found = _updated_variable(ir, consumer, owners)
        if found:
            return found
    return OTHER


def link_transfers(ir, step, shapes, client) -> LinkCost:
    """Each task's link bytes for the collectives of one step, modelled as TF's rings: the
    members of one collective (its copies on every replica) sorted by task and device, each
    sending to the next what collective_transfers counts per member."""
    groups = {}
    for node in step:
        if ir.op(node) in (COLLECTIVE_REDUCE, COLLECTIVE_GATHER):
            groups.setdefault(_REPLICA_PART.sub(r"\1", node), []).append(node)
    tasks, hierarchical = {}, False
    replicas = count_replicas(ir)
    for members in groups.values():
        members.sort(key=lambda n: _ring_key(ir.node(n)["device"]))
        n = len(members)
        hierarchical |= ir.op(members[0]) == COLLECTIVE_REDUCE and 1 < n < replicas
        for k, member in enumerate(members):
            successor = members[(k + 1) % n]
            src = task_of(ir.node(member)["device"], client)
            dst = task_of(ir.node(successor)["device"], client)
            if n < 2 or src == dst:
                continue
            local = shapes.nbytes(f"{ir.inputs(member)[0][0]}:{ir.inputs(member)[0][1]}") or 0
            moved = (2 * (n - 1) / n * local if ir.op(member) == COLLECTIVE_REDUCE
                     else (n - 1) * local)
            tasks[src] = (tasks.get(src, (0.0, 0.0))[0] + moved, tasks.get(src, (0.0, 0.0))[1])
            tasks[dst] = (tasks.get(dst, (0.0, 0.0))[0], tasks.get(dst, (0.0, 0.0))[1] + moved)
    return LinkCost("hierarchical" if hierarchical else "flat",
                    dict(sorted(tasks.items(), key=lambda kv: _endpoint_key(kv[0]))))


def _added(links: list) -> LinkCost:
    """The links of several runs (one per train op) as one step's."""
    tasks = {}
    for link in links:
        for task, (sent, received) in link.tasks.items():
            had = tasks.get(task, (0.0, 0.0))
            tasks[task] = (had[0] + sent, had[1] + received)
    variant = "hierarchical" if any(k.variant == "hierarchical" for k in links) else "flat"
    return LinkCost(variant, dict(sorted(tasks.items(), key=lambda kv: _endpoint_key(kv[0]))))


_REPLICA_PART = re.compile(r"(^|/)replica_\d+/")


def _ring_key(device: str):
    match = re.search(r"/job:([^/]+)(?:/replica:\d+)?/task:(\d+).*:(\d+)$", device or "")
    return (match.group(1), int(match.group(2)), int(match.group(3))) if match else ("", 0, 0)


def ring_minimum(tg, sparse_rows, workers: int, counts=None) -> float:
    """What each worker's link must carry each way in a ring over the W workers: 2(W-1)/W of
    the dense gradient bytes, (W-1)/W of the rows a sparse gradient gathers."""
    needs = _needs(tg, sparse_rows, 1, counts=counts)
    return sum((1 if name in sparse_rows else 2) * (workers - 1) / workers * need.grad
               for name, need in needs.items())


# ------------------------------------------------------------------ textbook minimum

@dataclasses.dataclass
class _Need:
    """Per replica group (worker or device): gradient bytes sent and variable bytes read."""
    grad: float
    read: float
    upper_bound: bool = False


def rows_touched(tg, original, batched, batch_size) -> tuple[dict, list]:
    """Sparse variable -> (rows its gradient has for the global batch, bytes per index): one
    row per id fed (the original graph's static shape), an upper bound on the distinct rows a
    step touches; and the variables whose ids come from a sparse input (feature columns), whose
    count the graph does not fix: those are counted at one id per example."""
    sparse = [v for v in tg.trainable if v.gradient.kind == "sparse"]
    if not sparse:
        return {}, []
    shapes = static_shapes(original, batched, batch_size)
    found, guessed = {}, []
    for var in sparse:
        dims = shapes.dims(var.gradient.values)
        rows = dims[0] if dims else None
        if rows is None:
            rows = batch_size
            guessed.append(var.name)
        found[var.name] = (rows, shapes.tensors.get(var.gradient.indices, (None, None))[1] or 4)
    return found, guessed


def _needs(tg, sparse_rows, parts: int, only=None, counts=None) -> dict:
    """Variable -> bytes one of ``parts`` equal shares of the batch needs: a dense variable
    whole; a sparse one only the rows its ids touch (an upper bound). ``only``: these
    variables' names alone. ``counts``: how many gradients of each variable the step applies
    (None: one of each); a variable it applies none of needs nothing, one it applies two of
    (a shared trunk's, from two optimizers grouped) sends both."""
    needs = {}
    for var in tg.trainable:
        if only is not None and var.name not in only:
            continue
        k = 1 if counts is None else counts.get(var.name, 0)
        if not k:
            continue
        if var.name not in sparse_rows:
            needs[var.name] = _Need(k * var.nbytes, var.nbytes)
            continue
        row_bytes = var.nbytes // var.shape[0] if var.shape and var.shape[0] > 0 else 0
        rows, index_bytes = sparse_rows[var.name]
        needs[var.name] = _Need(k * rows / parts * (row_bytes + index_bytes),
                                rows / parts * row_bytes, True)
    return needs


def ps_minimum(ir, tg, sparse_rows, client, owners, only=None, counts=None) -> dict:
    """Each worker sends each gradient once (its replicas summed) and receives each variable it
    reads once; each ps task receives W gradients and sends W copies of its variables."""
    workers = worker_tasks(ir, client)
    w = len(workers) or 1
    needs = _needs(tg, sparse_rows, w, only, counts)
    minimum = {"endpoints": {}, "variables": {}}
    place = Placement(ir)
    for task in workers:
        minimum["endpoints"][task] = (sum(n.grad for n in needs.values()),
                                      sum(n.read for n in needs.values()))
    for name, need in needs.items():
        minimum["variables"][name] = (w * (need.grad + need.read), need.upper_bound)
        for node in owners.shards(name):
            task = task_of(place.device(node), client)
            fraction = _shard_fraction(ir, node, owners)
            sent, received = minimum["endpoints"].get(task, (0.0, 0.0))
            minimum["endpoints"][task] = (sent + w * need.read * fraction,
                                          received + w * need.grad * fraction)
    return minimum


def _variable_bytes(ir, node) -> int:
    from tensorflow.python.framework import dtypes
    attr = ir.node(node)["attr"]
    count = 1
    for d in attr["shape"].shape.dim:
        count *= max(d.size, 0)
    return count * dtypes.as_dtype(attr["dtype"].type).size


def allreduce_minimum(ir, step, tg, sparse_rows, only=None, counts=None) -> dict:
    """Ring all-reduce: 2(N-1)/N x the dense gradient bytes per device; a sparse gradient is
    all-gathered: (N-1)/N of the rows the whole batch touches."""
    devices = sorted({ir.node(n)["device"] for n in step
                      if ir.op(n) in (COLLECTIVE_REDUCE, COLLECTIVE_GATHER)})
    n = len(devices) or 1
    needs = _needs(tg, sparse_rows, 1, only, counts)
    per_device = {name: (1 if name in sparse_rows else 2) * (n - 1) / n * need.grad
                  for name, need in needs.items()}
    total = sum(per_device.values())
    return {"endpoints": {d: (total, total) for d in devices},
            "variables": {name: (n * b, needs[name].upper_bound)
                          for name, b in per_device.items()}}


def hybrid_minimum(ir, step, tg, sparse_rows, client, owners, counts=None) -> dict:
    """The all-reduced variables (those with replica copies) at the ring's minimum, the others
    at the parameter servers'."""
    reduced = {v.name for v in tg.trainable if f"replica_0/{v.name}" in ir}
    shared = {v.name for v in tg.trainable} - reduced
    minimum = allreduce_minimum(ir, step, tg, sparse_rows, only=reduced, counts=counts)
    ps_side = ps_minimum(ir, tg, sparse_rows, client, owners, only=shared, counts=counts)
    minimum["variables"].update(ps_side["variables"])
    for name, (sent, received) in ps_side["endpoints"].items():
        had_sent, had_received = minimum["endpoints"].get(name, (0.0, 0.0))
        minimum["endpoints"][name] = (had_sent + sent, had_received + received)
    return minimum


def model_average_minimum(ir, tg, client: str) -> dict:
    """Per round, each task holding replicas sends its copy of every trained variable (its
    replicas' mean) to the centre's task and receives the centre back: the variable's bytes
    each way, unless the centre is in its own task."""
    endpoints, variables = {}, {}
    tasks = {task_of(ir.node(n)["device"], client) for n in ir.nodes()
             if _REPLICA.match(n) and ir.op(n) in training.VARIABLE_OPS}
    for var in tg.trainable:
        if centre_name(var.name) not in ir:
            continue
        home = task_of(ir.node(centre_name(var.name))["device"], client)
        away = sorted(tasks - {home})
        for task in away + [home] * len(away):
            sent, received = endpoints.get(task, (0.0, 0.0))
            endpoints[task] = (sent + var.nbytes, received + var.nbytes)
        variables[var.name] = (2.0 * var.nbytes * len(away), False)
    return {"endpoints": endpoints, "variables": variables}


def _model_average_interval(ir) -> int:
    return max(int(ir.node(MODEL_AVERAGE + "interval")["attr"]["value"].tensor.int64_val[0]), 1)


def _per_step_only(ir, transfers) -> list:
    """The transfers every local step makes: those whose tensor is not made by a round
    (everything after a model-average Switch's true output, up to its Merge)."""
    pivots = [dst for switch in ir.nodes_of({"Switch"}) if switch.startswith(MODEL_AVERAGE)
              for dst, _ in ir.consumers(switch, 1)]
    rounds, stack = set(), pivots
    while stack:
        node = stack.pop()
        if node not in rounds and ir.op(node) != "Merge":
            rounds.add(node)
            stack.extend(ir.successors(node))
    return [t for t in transfers if parse_tensor(t.tensor)[0] not in rounds]


# ------------------------------------------------------------------ report

def _tally(transfers, minimum, tg):
    endpoints = {name: Endpoint(name, minimum_sent=s, minimum_received=r)
                 for name, (s, r) in minimum["endpoints"].items()}
    variables = {name: VariableCost(name, minimum=m, upper_bound=ub)
                 for name, (m, ub) in minimum["variables"].items()}
    for t in transfers:
        for name in (t.src, t.dst):
            endpoints.setdefault(name, Endpoint(name))
        endpoints[t.src].sent += t.nbytes
        endpoints[t.dst].received += t.nbytes
        cost = variables.setdefault(t.variable, VariableCost(t.variable))
        cost.moved += t.nbytes
        cost.upper_bound = cost.upper_bound or t.upper_bound
    order = {name: k for k, name in enumerate(tg.variables)}
    ordered = dict(sorted(variables.items(), key=lambda kv: (kv[0] == OTHER,
                                                             order.get(kv[0], len(order)))))
    return dict(sorted(endpoints.items(), key=lambda kv: _endpoint_key(kv[0]))), ordered


def _endpoint_key(name: str):
    job, _, index = name.rpartition(":")
    order = {"chief": 0, "worker": 1, "ps": 2}
    return (order.get(job, 3), job, int(index) if index.isdigit() else 0, name)


def _ratio(measured: float, minimum: float):
    return round(measured / minimum, 3) if minimum else None


def human_bytes(n: float) -> str:
    if n < 10 * 1024:  # a bucket's share of its bytes is a float: 128.0000001 is 128 B
        return f"{n:,.0f} B" if abs(n - round(n)) < 1e-6 else f"{n:,.1f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 10 * 1024 or unit == "GiB":
            return f"{n:,.1f} {unit}"
    return f"{n} B"


def format_text(report: CostReport) -> str:
    """The per-task and per-variable tables a person reads."""
    doc = report.to_dict()
    what = "device" if report.model == "allreduce" else "task"
    lines = [f"{report.strategy}: bytes per {report.per}, global batch {report.batch_size} "
             f"({report.replicas} replicas); minimum = textbook {report.model}", ""]
    rows = [[what, "sent", "received", "min sent", "min received", "ratio"]]
    for e in doc["tasks"]:
        rows.append([e["name"], human_bytes(e["sent"]), human_bytes(e["received"]),
                     human_bytes(e["minimum_sent"]), human_bytes(e["minimum_received"]),
                     _ratio_text(e["ratio"])])
    lines += _table(rows)
    lines.append("")
    rows = [["variable", "moved", "minimum", "ratio"]]
    for v in doc["variables"]:
        rows.append([v["name"] + (" (upper bound)" if v["upper_bound"] else ""),
                     human_bytes(v["moved"]), human_bytes(v["minimum"]) if v["name"] != OTHER
                     else "-", _ratio_text(v["ratio"])])
    lines += _table(rows)
    lines.append("")
    if report.links:
        lines += _links_table(report)
        lines.append("")
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)


def _links_table(report: CostReport) -> list:
    """Each worker's network link: every variant measured, next to the ring's minimum."""
    variants = [link.variant for link in report.links]
    lines = [f"network link of each worker task per step ({' and '.join(variants)}); minimum "
             "= a ring over the workers, 2(W-1)/W of the gradient bytes each way"]
    rows = [["task"] + [f"{v} {d}" for v in variants for d in ("sent", "received")] +
            ["min each way"] + [f"{v} ratio" for v in variants]]
    tasks = sorted({t for link in report.links for t in link.tasks}, key=_endpoint_key)
    for task in tasks:
        cells = [task]
        for link in report.links:
            sent, received = link.tasks.get(task, (0.0, 0.0))
            cells += [human_bytes(sent), human_bytes(received)]
        cells.append(human_bytes(report.link_minimum))
        for link in report.links:
            sent, received = link.tasks.get(task, (0.0, 0.0))
            cells.append(_ratio_text(_ratio(sent + received, 2 * report.link_minimum)))
        rows.append(cells)
    return lines + _table(rows)


def _ratio_text(ratio) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _table(rows) -> list:
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        out.append("  ".join(cells).rstrip())
    return out
