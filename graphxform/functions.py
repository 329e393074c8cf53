"""What runs inside the functions a training step calls.

Control flow v2 (``tf.while_loop``, ``tf.cond``) and a ``tf.function`` called from the graph
keep their bodies in the function library, out of reach of the passes, which rewrite graph
nodes only. Two things there break the contract silently, so the contract and `verify` look:

- a variable update inside a body (an optimizer applied in a loop, a running count moved in
  a cond) from what each replica computes from its own slice: each replica would write its
  own copy from its own slice, and the replicas would move apart (``called_nodes``; the
  contract refuses it where the call reads a value that differs between replicas);
- a random op inside a body (dropout under ``tf.cond(is_training, ...)``): each replica draws
  for its own slice and ``--consistent-random`` cannot reach it (``random_in_function``;
  verify names it, the consistent-random pass refuses); a training-mode batch norm there
  (``batch_norm_in_function``) is out of ``--sync-batch-norm``'s reach the same way.

A third, for graphxform.batch_mixing: a while loop that reads the batch one example per
iteration from a TensorList and carries a value from one example to the next
(``carried_from_list``), unless that value only adds up a term of each example
(``sums_each_element``: the sum of per-example losses a loop over the examples computes).

A legacy while loop (control flow v1: ``tf.while_loop``, ``dynamic_rnn``, ``map_fn`` under
``disable_control_flow_v2``) keeps its body in the graph, in a frame from its Enter ops to its
Exit ops (``legacy_loop_frames``); a random op there draws afresh at every iteration.

A call's inputs are its function's arguments in order (``If``, ``Case``: after the branch
selector), so a write to an argument is a write to the graph node that feeds it; nested calls
map their arguments the same way.
"""

from __future__ import annotations

import dataclasses

from graphxform.errors import GraphxformError
from graphxform.training import RANDOM_OPS

CALL_OPS = {"While": ("cond", "body"), "StatelessWhile": ("cond", "body"),
            "If": ("then_branch", "else_branch"), "StatelessIf": ("then_branch", "else_branch"),
            "Case": ("branches",), "StatelessCase": ("branches",),
            "PartitionedCall": ("f",), "StatefulPartitionedCall": ("f",)}
_SELECTOR_FIRST = {"If", "StatelessIf", "Case", "StatelessCase"}
WHILE_OPS = frozenset({"While", "StatelessWhile"})
# what reads an element of a TensorList (TensorListPopBack's second output is the element)
_LIST_READS = frozenset({"TensorListGetItem", "TensorListGather", "TensorListPopBack"})
_MAX_DEPTH = 20  # a recursive library: nothing real nests this deep


def random_in_function(ir, closure: set) -> list[tuple[str, str]]:
    """(call, op type) for each random op inside the functions the calls in ``closure`` run."""
    return _in_functions(ir, closure, lambda node: node.op in RANDOM_OPS)


def _in_functions(ir, closure: set, wanted) -> list[tuple[str, str]]:
    """(call, op type) for each node inside the functions the calls in ``closure`` run for
    which ``wanted(NodeDef)`` holds."""
    return sorted({(call, node.op) for call, _, node, _ in called_nodes(ir, closure)
                   if wanted(node)})


def out_of_reach(option: str, ir, prefix: str, found: list, does: str, where: str,
                 fixes: str = "") -> GraphxformError:
    """The one-line refusal of a pass an option runs when what it rewrites is inside a
    function (``found``: random_in_function's or batch_norm_in_function's, over replica
    ``prefix``'s copies): the pass rewrites graph nodes only."""
    call, op = found[0]
    return GraphxformError(
        f"{option}: '{call[len(prefix):]}' ({ir.op(call)}) {does} ({op}) inside its function "
        f"({where}), which the pass cannot reach; {fixes}build the graph with control flow "
        "v1 (tf.compat.v1.disable_control_flow_v2()), or drop the option")


def batch_norm_in_function(ir, closure: set) -> list[tuple[str, str]]:
    """(call, op type) for each training-mode batch norm (a FusedBatchNorm with
    ``is_training``) inside the functions the calls in ``closure`` run: tf_keras's and
    tf.compat.v1.layers' batch norm given a training flag that is a tensor (a placeholder, the
    learning phase) branch into one with control flow v2."""
    return _in_functions(ir, closure, lambda node: node.op.startswith("FusedBatchNorm")
                         and "Grad" not in node.op and node.attr["is_training"].b)


def legacy_loop_frames(ir) -> list[set]:
    """The nodes of each legacy while loop, by frame: what its Enter ops reach before its Exit
    ops (a nested loop's nodes belong to the loops around it too)."""
    frames = {}
    for enter in ir.nodes_of(("Enter", "RefEnter")):
        members = frames.setdefault(ir.attrs(enter)["frame_name"].s, set())
        stack = [enter]
        while stack:
            node = stack.pop()
            if node in members:
                continue
            members.add(node)
            if ir.op(node) not in ("Exit", "RefExit"):
                stack.extend(ir.successors(node))
    return list(frames.values())


def called_nodes(ir, closure: set):
    """(call node, function name, NodeDef, source) for each node of each function a call in
    ``closure`` runs, nested calls' too; ``source(input text)`` is the graph node that feeds
    the argument an input names (None: not an argument, or not known)."""
    library = {f.signature.name: f for f in ir.meta.graph_def.library.function}
    if not library:
        return
    calls = [n for n in ir.nodes_of(set(CALL_OPS) | set(library)) if n in closure]
    for call in sorted(calls):
        op = ir.op(call)
        sources = [src for src, _ in ir.inputs(call)]
        if op in _SELECTOR_FIRST:
            sources = sources[1:]
        for function in _called(ir.attrs(call), op, library):
            for function_name, node, source in _nodes(library, function, sources, 0):
                yield call, function_name, node, source


def call_bodies(ir, call: str) -> list[tuple]:
    """(FunctionDef, {argument name: the graph tensor (src, port) that feeds it}) for each
    function ``call`` runs (not the calls inside them)."""
    library = {f.signature.name: f for f in ir.meta.graph_def.library.function}
    op = ir.op(call)
    sources = ir.inputs(call)[1:] if op in _SELECTOR_FIRST else ir.inputs(call)
    found = []
    for name in _called(ir.attrs(call), op, library):
        args = library[name].signature.input_arg
        found.append((library[name], {arg.name: source for arg, source in zip(args, sources)}))
    return found


def carried_from_list(ir, loop: str, arg: int) -> dict[int, str]:
    """The loop variables of the while loop ``loop`` whose next value its body computes from
    an element it reads out of its ``arg``-th loop variable, a TensorList, other than a list
    its body writes (an accumulator of per-iteration results, as tf.map_fn and the gradient's
    stacks keep): position -> name; none when the body is not in the library. The loop
    variables are the body's arguments and results, in order."""
    body = _function(ir, loop, "body")
    if body is None or arg >= len(body.signature.input_arg):
        return {}
    users, ops = {}, {}
    for node in body.node_def:
        ops[node.name] = node.op
        for text in node.input:
            if not text.startswith("^"):
                users.setdefault(text.split(":", 1)[0], []).append(node)
    handles, stack = set(), [body.signature.input_arg[arg].name]
    while stack:  # the list, and Identities of it
        name = stack.pop()
        handles.add(name)
        stack += [n.name for n in users.get(name, ()) if n.op == "Identity"
                  and n.name not in handles]
    reached = {n.name for h in handles for n in users.get(h, ())
               if n.op in _LIST_READS and n.input[0].split(":", 1)[0] == h}
    stack = list(reached)
    while stack:
        for node in users.get(stack.pop(), ()):
            if node.name not in reached:
                reached.add(node.name)
                stack.append(node.name)
    return {k: result.name for k, result in enumerate(body.signature.output_arg)
            if (source := body.ret[result.name].split(":", 1)[0]) in reached
            and not ops[source].startswith("TensorList")}


def sums_each_element(ir, loop: str, var: int, lists: set, free: set, counter: int) -> bool:
    """Whether loop variable ``var`` of the while loop ``loop`` only adds up one term per
    iteration: its next value is itself plus a term computed from the elements at position
    ``counter`` (a loop variable starting at 0 and stepping by 1, which the caller has shown
    to run to the lists' length) of the loop variables ``lists`` (TensorLists the body only
    reads), and from loop variables in ``free`` that the body passes on unchanged; no other
    loop variable, no call. Then it ends as the sum over the elements of a term of each."""
    body = _function(ir, loop, "body")
    if body is None:
        return False
    args = [arg.name for arg in body.signature.input_arg]
    results = [body.ret[arg.name].split(":", 1)[0] for arg in body.signature.output_arg]
    nodes = {node.name: node for node in body.node_def}
    total = nodes.get(results[var])
    if (total is None or total.op not in ("Add", "AddV2") or len(total.input) != 2
            or any(results[k] != args[k] for k in lists)):
        return False
    names = [text.split(":", 1)[0] for text in total.input]
    if args[var] not in names:
        return False
    term = names[1 - names.index(args[var])]
    unchanged = {args[k] for k in free if results[k] == args[k]}
    seen, stack = {term}, [term]
    while stack:
        name = stack.pop()
        if name in args:
            if name not in unchanged:
                return False  # another loop variable, or a whole list, enters the term
            continue
        node = nodes.get(name)
        if node is None or node.op in CALL_OPS or node.op.startswith("TensorList") and (
                node.op != "TensorListGetItem"):
            return False
        inputs = [text.split(":", 1)[0] for text in node.input if not text.startswith("^")]
        if node.op == "TensorListGetItem":
            if (inputs[0] not in {args[k] for k in lists} or inputs[1] != args[counter]
                    or nodes.get(inputs[2]) is None or nodes[inputs[2]].op != "Const"):
                return False
            continue
        for src in inputs:
            if src not in seen:
                seen.add(src)
                stack.append(src)
    return True


def counts_to(ir, loop: str, counter: int, bound: int) -> bool:
    """Whether loop variable ``counter`` of the while loop ``loop`` starts at 0 (a Const),
    steps by 1, and is all its condition tests, against loop variable ``bound``
    (``counter < bound``)."""
    body, cond = _function(ir, loop, "body"), _function(ir, loop, "cond")
    if body is None or cond is None:
        return False
    start = ir.inputs(loop)[counter][0]
    if ir.op(start) != "Const" or _scalar(ir.attrs(start)["value"].tensor) != 0:
        return False
    arg = body.signature.input_arg[counter].name
    nodes = {node.name: node for node in body.node_def}
    step = nodes.get(body.ret[body.signature.output_arg[counter].name].split(":", 1)[0])
    if step is None or step.op not in ("Add", "AddV2"):
        return False
    names = [text.split(":", 1)[0] for text in step.input]
    one = [nodes.get(n) for n in names if n != arg]
    if names.count(arg) != 1 or len(one) != 1 or one[0] is None or one[0].op != "Const" \
            or _scalar(one[0].attr["value"].tensor) != 1:
        return False
    tested = {node.name: node for node in cond.node_def}
    less = tested.get(cond.ret[cond.signature.output_arg[0].name].split(":", 1)[0])
    cond_args = [a.name for a in cond.signature.input_arg]
    return (less is not None and less.op == "Less"
            and [text.split(":", 1)[0] for text in less.input]
            == [cond_args[counter], cond_args[bound]])


@dataclasses.dataclass(frozen=True)
class BodyGraph:
    """A called function's body as a graph of its own: its arguments are placeholders."""
    ir: object  # GraphIR
    args: list  # placeholder names, in argument order
    outputs: list  # tensor names, in result order


def body_graph(ir, call: str, key: str) -> BodyGraph | None:
    """The function attr ``key`` of ``call`` names, as a graph with the shapes TF infers
    (function_def_to_graph); None when it is not in the library or TF cannot build it (a call
    inside it to another function)."""
    from tensorflow.core.protobuf import meta_graph_pb2

    from graphxform import tf_import
    from graphxform.metagraph import from_metagraph
    body = _function(ir, call, key)
    if body is None:
        return None
    # building a graph makes TF's global default graph; the whole package must be imported
    # first, or its import later (verify's session) refuses to switch to eager behaviour
    tf_import.full()
    from tensorflow.python.framework import function_def_to_graph
    try:
        graph = function_def_to_graph.function_def_to_graph(body)
    except Exception:  # noqa: BLE001  TF's importer raises many kinds; then nothing is known
        return None
    meta = meta_graph_pb2.MetaGraphDef()
    meta.graph_def.CopyFrom(graph.as_graph_def(add_shapes=True))
    return BodyGraph(from_metagraph(meta), [t.op.name for t in graph.inputs],
                     [t.name for t in graph.outputs])


def reads_argument(ir, loop: str, arg: int) -> bool:
    """Whether the body of the while loop ``loop`` reads its ``arg``-th argument other than
    to pass it on to the next iteration."""
    body = _function(ir, loop, "body")
    if body is None or arg >= len(body.signature.input_arg):
        return False
    name = body.signature.input_arg[arg].name
    return any(text.split(":", 1)[0] == name for node in body.node_def for text in node.input)


def _scalar(tensor):
    """The one integer a scalar Const TensorProto holds, or None."""
    values = list(tensor.int_val) or list(tensor.int64_val)
    return values[0] if len(values) == 1 and not tensor.tensor_shape.dim else None


def _function(ir, call: str, key: str):
    """The FunctionDef attr ``key`` of ``call`` names, or None when it is not in the
    library."""
    attrs = ir.attrs(call)
    if key not in attrs:
        return None
    name = attrs[key].func.name
    return next((f for f in ir.meta.graph_def.library.function if f.signature.name == name),
                None)


def _called(attrs, op: str, library: dict) -> list[str]:
    """The functions a call op runs."""
    if op in library:
        return [op]
    names = []
    for key in CALL_OPS.get(op, ()):
        if key not in attrs:
            continue
        value = attrs[key]
        names += [f.name for f in value.list.func] if key == "branches" else [value.func.name]
    return [name for name in names if name in library]


def _nodes(library: dict, name: str, sources: list, depth: int):
    """(function, NodeDef, source) for the nodes of function ``name`` and of the calls inside
    it, its arguments fed by ``sources``."""
    if depth > _MAX_DEPTH:
        return
    function = library[name]
    args = {arg.name: k for k, arg in enumerate(function.signature.input_arg)}

    def source(text):
        k = args.get(text.lstrip("^").split(":", 1)[0])
        return sources[k] if k is not None and k < len(sources) else None

    for node in function.node_def:
        yield name, node, source
        inner = [source(text) for text in node.input if not text.startswith("^")]
        if node.op in _SELECTOR_FIRST:
            inner = inner[1:]
        for called in _called(node.attr, node.op, library):
            yield from _nodes(library, called, inner, depth + 1)
