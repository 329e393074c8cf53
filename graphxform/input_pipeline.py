"""Input pipelines inside the graph: a tf.data iterator's `IteratorGetNext`, or a TF1 input
queue's batch dequeue (`tf.compat.v1.train.batch`, `shuffle_batch`), read by the training step.

Such a read takes the next batch each time the step runs. Copied once per replica, as the rest
of the step is, every replica would take a batch of its own: the same batch R times over (a
seeded or unshuffled pipeline: R times the work to train on one batch) or R different batches
(an unseeded shuffle: R batches per step, which is not what one device trains on). So the
pipeline stays single, like a placeholder: replicate keeps it, each step reads one batch as the
single-device step does, and split-inputs hands replica i the i-th slice of each batched
output.

The pipeline is the reads and everything they depend on, plus what uses their queues and
iterators without reading the step's batch (enqueue and close ops that queue runners run,
`MakeIterator` of an initializable iterator, queue sizes), and what those depend on; and the
graph's dataset ops with theirs (a one-shot iterator builds its dataset in a function, and
the graph keeps an unused copy of it)."""

from __future__ import annotations

import dataclasses
import re

from graphxform.errors import GraphxformError

# reads that take a batch: every output's axis 0 is the batch (iterators: see _batched_ports)
BATCH_READ_OPS = {"IteratorGetNext", "IteratorGetNextSync", "QueueDequeueManyV2",
                  "QueueDequeueUpToV2", "QueueDequeueMany", "QueueDequeueUpTo"}
# reads of one element: every replica reads the element whole
ELEMENT_READ_OPS = {"QueueDequeueV2", "QueueDequeue"}
READ_OPS = BATCH_READ_OPS | ELEMENT_READ_OPS
# ops that use a queue or iterator for the pipeline's own running, not the step's batch
_USER_PREFIXES = ("QueueEnqueue", "QueueClose", "QueueSize", "QueueIsClosed", "MakeIterator",
                  "IteratorToStringHandle", "DeserializeIterator")
_DATASET_OP = re.compile(r"Dataset(V\d+)?$")
_VARIABLE_OPS = {"VarHandleOp", "VariableV2", "Variable"}


@dataclasses.dataclass
class Read:
    """One read of the pipeline by the step: ``node``, the output ports that hold a batch
    (split across replicas) and the batch size when the graph fixes it."""
    node: str
    op: str
    batched: list
    fixed_batch: int | None = None


@dataclasses.dataclass
class InputPipeline:
    reads: list  # Read, in graph order
    nodes: set  # the pipeline: kept single by replicate
    variables: list = dataclasses.field(default_factory=list)  # it holds (epoch counters)

    def __bool__(self) -> bool:
        return bool(self.reads)

    def require_single(self) -> None:
        """Refuse a pipeline that cannot be kept single: one holding a variable (an epoch
        counter, as num_epochs makes), whose initializer and reads replicate would copy."""
        if self.variables:
            raise GraphxformError(
                f"variable '{self.variables[0]}' (num_epochs' counter) is in the input "
                "pipeline, which replicas share: not supported yet; drop num_epochs")


def find(ir, step_closure: set) -> InputPipeline:
    """The input pipeline the training step reads (empty when it reads none). In a graph
    graphxform wrote, the queues its passes made (workers' tokens) are not input."""
    node_table = ir.g._node
    reads = [n for n in step_closure if node_table[n]["op"] in READ_OPS
             and not node_table[n]["created_by"]]  # not the token queues of ps, model-average
    if not reads:
        return InputPipeline([], set())
    order = {name: k for k, name in enumerate(ir.g)}
    reads.sort(key=order.__getitem__)
    datasets = [n for n, data in ir.node_items() if _DATASET_OP.search(data["op"])]
    nodes = _pipeline_nodes(ir, reads + datasets)
    held = sorted(n for n in nodes if node_table[n]["op"] in _VARIABLE_OPS)
    return InputPipeline([_read(ir, name) for name in reads], nodes, held)


def _pipeline_nodes(ir, reads: list) -> set:
    """The reads (and dataset ops), their ancestors, and the users of queues and iterators among them (with
    their ancestors), to a fixed point."""
    pred, succ, node_table = ir.g._pred, ir.g._succ, ir.g._node
    found, stack = set(), list(reads)
    while stack:
        name = stack.pop()
        if name in found:
            continue
        found.add(name)
        stack.extend(pred[name])
        for user in succ[name]:
            if user not in found and node_table[user]["op"].startswith(_USER_PREFIXES):
                stack.append(user)
    return found


def _read(ir, name: str) -> Read:
    op = ir.g._node[name]["op"]
    count = _output_count(ir, name)
    if op in ELEMENT_READ_OPS:
        return Read(name, op, [])
    if op.startswith("Iterator"):
        ports, fixed = _batched_ports(_iterator_shapes(ir, name))
        return Read(name, op, ports, fixed)
    fixed = None
    if op.startswith("QueueDequeueMany"):  # n elements exactly: the batch size, if constant
        fixed = _const_int(ir, ir.input(name, 1)[0])
    return Read(name, op, list(range(count)), fixed)


def _output_count(ir, name: str) -> int:
    attrs = ir.attrs(name)
    for key in ("output_types", "component_types"):
        if key in attrs:
            return len(attrs[key].list.type)
    return 0


def _iterator_shapes(ir, name: str) -> list:
    """Each output's shape as a list of dims (-1 unknown), or None for an unknown rank."""
    attrs = ir.attrs(name)
    shapes = attrs["output_shapes"].list.shape if "output_shapes" in attrs else []
    found = [None if s.unknown_rank else [d.size for d in s.dim] for s in shapes]
    return found + [None] * (_output_count(ir, name) - len(found))


def _batched_ports(shapes: list) -> tuple[list, int | None]:
    """The ports of a batch, by ``training.Input``'s rule: a leading unknown dimension is the
    batch; fixed leading dimensions are, when every output of rank >= 1 has the same one
    (a dataset batched with drop_remainder), which is then the batch size. Scalars and
    unknown ranks are read whole by every replica."""
    ranked = [(port, shape) for port, shape in enumerate(shapes) if shape]
    leading = {shape[0] for _, shape in ranked}
    if len(leading) == 1 and min(leading) > 0:
        return [port for port, _ in ranked], min(leading)
    return [port for port, shape in ranked if shape[0] < 0], None


# iterators a MakeIterator initializes (one-shot and string-handle iterators have none)
_INITIALIZABLE_ITERATOR_OPS = {"IteratorV2", "Iterator"}


@dataclasses.dataclass
class IteratorInit:
    """The initializer (``MakeIterator``) of an iterator the steps read, which a TF1 loop runs
    once before the first step (``sess.run(it.initializer)``), and the placeholders it reads
    (the TF guide's dataset built ``from_tensor_slices`` of placeholders), fed whole."""
    op: str
    iterator: str
    placeholders: list  # must be fed
    defaults: list = dataclasses.field(default_factory=list)  # PlaceholderWithDefault: may be


def iterator_initializers(ir, pipeline: InputPipeline) -> list:
    """The initializers of the initializable (and reinitializable) iterators the steps read,
    in graph order. An iterator with several (``from_structure``'s training and validation
    ``make_initializer``) is refused: which one the training loop runs is not in the graph."""
    node_table = ir.g._node
    iterators = []
    for read in (pipeline.reads if pipeline else ()):
        inputs = ir.inputs(read.node) if read.op.startswith("Iterator") else []
        if inputs and node_table[inputs[0][0]]["op"] in _INITIALIZABLE_ITERATOR_OPS:
            iterators.append(inputs[0][0])
    found = []
    for iterator in dict.fromkeys(iterators):
        inits = sorted({user for user, _ in ir.consumers(iterator)
                        if node_table[user]["op"] == "MakeIterator"})
        if len(inits) > 1:
            raise GraphxformError(
                f"iterator '{iterator}' has {len(inits)} initializers ("
                f"{', '.join(repr(i) for i in inits)}): graphxform cannot tell which one the "
                "training loop runs before the first step; export the training graph with "
                "the training dataset's initializer only")
        for init in inits:
            upstream = sorted(ir.ancestors(init))
            found.append(IteratorInit(
                init, iterator,
                [n for n in upstream if node_table[n]["op"] == "Placeholder"],
                [n for n in upstream if node_table[n]["op"] == "PlaceholderWithDefault"]))
    return found


def _const_int(ir, name: str) -> int | None:
    from graphxform.nodes import const_value  # TF's protos: not at import (training's)
    value = const_value(ir, name)
    return int(value) if value is not None and value.ndim == 0 else None


_QUEUE_OP = re.compile(r"(FIFO|PaddingFIFO|RandomShuffle|Priority)Queue(V2)?$")


def queue_runners(ir) -> dict:
    """queue node -> the enqueue ops its QueueRunners run, one per thread (the graph's
    ``queue_runners`` collection, as ``tf.compat.v1.train.start_queue_runners`` reads it)."""
    collection = ir.meta.collection_def.get("queue_runners")
    if collection is None or not collection.HasField("bytes_list"):
        return {}
    from tensorflow.core.protobuf import queue_runner_pb2  # TF's protos: not at import
    found = {}
    for raw in collection.bytes_list.value:
        runner = queue_runner_pb2.QueueRunnerDef.FromString(raw)
        queue = runner.queue_name.split(":")[0]
        found.setdefault(queue, []).extend(n.split(":")[0] for n in runner.enqueue_op_name)
    return found


def require_filled(ir, analysis) -> None:
    """Refuse to run a graph whose steps read a queue nothing would fill (unfilled_queue)."""
    why = unfilled_queue(ir, analysis.pipeline, analysis.train_closure)
    if why:
        raise GraphxformError(f"cannot run the graph: {why}")


def unfilled_queue(ir, pipeline: InputPipeline, step_closure: set) -> str | None:
    """Why a queue the steps read would never be filled when graphxform runs them (None when
    each is): graphxform feeds the steps' placeholders and starts the graph's queue runners,
    nothing else. A queue filled only by an enqueue the user's own loop runs with a feed dict
    (``q.enqueue_many([x_ph, y_ph])``), or by a runner whose enqueue needs a placeholder fed,
    stays empty, and the step's dequeue would wait for ever. Queues that fill a queue (a
    ``shuffle_batch`` over a ``string_input_producer``) are followed."""
    runners = queue_runners(ir)
    node_table = ir.g._node
    seen = set()
    stack = [(r.node, None) for r in pipeline.reads] if pipeline else []
    while stack:
        read, via = stack.pop()
        inputs = ir.inputs(read)
        queue = inputs[0][0] if inputs else None
        if queue is None or queue in seen or not _QUEUE_OP.search(node_table[queue]["op"]):
            continue  # an iterator (its dataset fills it), or a queue already followed
        seen.add(queue)
        where = f"queue '{queue}' (read by '{read}'{via or ''})"
        enqueues = runners.get(queue, [])
        if not enqueues:
            if any(user in step_closure for user, _ in ir.consumers(queue)
                   if node_table[user]["op"].startswith("QueueEnqueue")):
                continue  # the step fills it itself, from what graphxform feeds
            fed = sorted(user for user, _ in ir.consumers(queue)
                         if node_table[user]["op"].startswith("QueueEnqueue"))
            by = (f"is filled only by '{fed[0]}', which a training loop runs with a feed "
                  "dict," if fed else "is filled by nothing:")
            return (f"{where} {by} not by a queue runner; graphxform feeds the step's inputs "
                    "and starts the graph's queue runners only, so the step would wait for "
                    "ever (read the input through placeholders or tf.data, or fill the queue "
                    "with a tf.compat.v1.train.QueueRunner)")
        for enqueue in dict.fromkeys(enqueues):
            upstream = ir.ancestors(enqueue)
            placeholders = sorted(n for n in upstream if node_table[n]["op"] == "Placeholder")
            if placeholders:
                return (f"{where}: its queue runner runs '{enqueue}', which needs placeholder "
                        f"'{placeholders[0]}' fed, and a queue runner's thread feeds nothing, "
                        "so the step would wait for ever (fill the queue from tensors, not "
                        "placeholders, or read the input through placeholders or tf.data)")
            stack += [(n, f", filled from it by '{enqueue}'") for n in upstream
                      if node_table[n]["op"] in READ_OPS]
    return None
