"""GraphIR's mutation methods and its one-line-per-node printer."""

import pathlib

import pytest
from conftest import fixture_path

from graphxform import metagraph
from graphxform.errors import GraphxformError
from graphxform.ir import GraphIR

GOLDEN = pathlib.Path(__file__).parent / "golden"


def small_ir():
    from tensorflow.core.protobuf import meta_graph_pb2
    ir = GraphIR(meta_graph_pb2.MetaGraphDef())
    ir.add_node("a", "NoOp")
    ir.add_node("b", "Identity", [])
    ir.add_node("c", "IdentityN", [])
    ir.add_node("use", "AddV2", ["c:1", "c", "^a"])
    ir.add_node("other", "Identity", ["c:1", "^a"])
    return ir


def test_nodes_of_reads_its_index_in_graph_order_and_drops_it_when_nodes_change():
    ir = small_ir()
    swept = {ops: ir.nodes_of(ops) for ops in [("Identity",), ("Identity", "NoOp", "AddV2"),
                                               ("Const",), ()]}
    with ir.indexed_by_op():
        assert {ops: ir.nodes_of(ops) for ops in swept} == swept
        assert ir.op_types() == {"NoOp", "Identity", "IdentityN", "AddV2"}
        with ir.indexed_by_op():  # nested: the same index
            assert ir.nodes_of({"NoOp"}) == ["a"]
        assert ir.nodes_of({"NoOp"}) == ["a"]
        ir.add_node("d", "NoOp")
        assert ir.nodes_of({"NoOp"}) == ["a", "d"]
        ir.remove_node("other")
        assert ir.nodes_of({"Identity"}) == ["b"]
    assert ir.nodes_of({"NoOp"}) == ["a", "d"]


def test_inputs_and_consumers_keep_port_order():
    ir = small_ir()
    assert ir.inputs("use") == [("c", 1), ("c", 0)]
    assert ir.control_inputs("use") == ["a"]
    assert sorted(ir.consumers("c", 1)) == [("other", 0), ("use", 0)]
    assert ir.node_line("use") == "use = AddV2(c:1, c, ^a)"


def test_replace_all_uses_with_tensor_moves_one_port():
    ir = small_ir()
    assert ir.replace_all_uses_with("c:1", "b:0", where=lambda n: n == "use") == 1
    assert ir.inputs("use") == [("b", 0), ("c", 0)]
    assert ir.inputs("other") == [("c", 1)]


def test_replace_all_uses_with_node_moves_data_and_control():
    ir = small_ir()
    ir.replace_all_uses_with("a", "b")
    assert ir.control_inputs("use") == ["b"] and ir.control_inputs("other") == ["b"]
    ir.replace_all_uses_with("c", "b")
    assert ir.inputs("use") == [("b", 1), ("b", 0)]


def test_remove_node_safe_refuses_used_nodes():
    ir = small_ir()
    with pytest.raises(GraphxformError, match="still used by"):
        ir.remove_node("c")
    ir.remove_node("use")
    ir.remove_node("other")
    ir.remove_node("c")
    assert "c" not in ir


def test_add_node_refuses_duplicates_and_dangling_inputs():
    ir = small_ir()
    with pytest.raises(GraphxformError, match="already exists"):
        ir.add_node("a", "NoOp")
    with pytest.raises(GraphxformError, match="not in the graph"):
        ir.add_node("d", "Identity", ["nowhere"])


def test_copy_nodes_follows_internal_edges_and_colocation():
    ir = metagraph.load(fixture_path("mlp_sgd"))
    names = [n for n in ir.nodes() if n.startswith("dense0/")]
    mapping = ir.copy_nodes(names, "replica_1/", device="/device:CPU:1", created_by="test")
    read = mapping["dense0/kernel/Read/ReadVariableOp"]
    assert ir.inputs(read) == [("replica_1/dense0/kernel", 0)]
    assert ir.node(read)["device"] == "/device:CPU:1"
    assert ir.node(read)["created_by"] == "test"
    assert ir.node(read)["origin"] == "dense0/kernel/Read/ReadVariableOp"
    matmul = mapping["dense0/MatMul"]
    assert ir.inputs(matmul)[0] == ("x", 0)  # outside the copied set: the original
    colocated = [n for n in mapping.values() if "_class" in ir.node(n)["attr"]]
    for n in colocated:
        for item in ir.node(n)["attr"]["_class"].list.s:
            assert item.decode().startswith("loc:@replica_1/")
    from graphxform import verify
    verify.check_structure(ir)
    verify.check_imports(ir)


def test_printer_matches_golden(update_goldens):
    ir = metagraph.load(fixture_path("mlp_sgd"))
    text = str(ir)
    golden = GOLDEN / "mlp_sgd.txt"
    if update_goldens:
        golden.write_text(text)
    assert text == golden.read_text()
    assert len(text.splitlines()) == len(ir)


# ------------------------------------------------ clean nodes emit their NodeDef, dirty ones edges

def loaded_ir():
    """A loaded graph whose node 'n' lists its control inputs in an order the edges do not keep
    ('^c' before '^a'; 'a' is also a data input), so emit shows which list it wrote."""
    from tensorflow.core.protobuf import meta_graph_pb2
    meta = meta_graph_pb2.MetaGraphDef()
    for name, inputs in [("a", []), ("b", []), ("c", []), ("d", []),
                         ("n", ["a", "b:0", "^c", "^a"]), ("m", ["n", "^d"])]:
        node = meta.graph_def.node.add(name=name, op="NoOp" if not inputs else "Foo")
        node.input.extend(inputs)
    return metagraph.from_metagraph(meta)


def emitted_inputs(ir):
    return {nd.name: list(nd.input) for nd in metagraph.to_graphdef(ir).node}


def test_clean_node_emits_its_original_node_def():
    ir = loaded_ir()
    assert not ir.is_dirty("n")
    assert emitted_inputs(ir)["n"] == ["a", "b:0", "^c", "^a"]
    assert ir.edge_inputs("n") == ["a", "b:0", "^a", "^c"]


def test_dirty_node_is_emitted_from_its_edges():
    ir = loaded_ir()
    ir.add_control_input("n", "d")
    assert ir.is_dirty("n") and not ir.is_dirty("m")
    assert emitted_inputs(ir)["n"] == ["a", "b:0", "^a", "^c", "^d"]
    assert emitted_inputs(ir)["m"] == ["n", "^d"]


MUTATIONS = {
    "set_input": (lambda ir: ir.set_input("n", 1, "d"), ["n"]),
    "replace_all_uses_with node": (lambda ir: ir.replace_all_uses_with("a", "d"), ["n"]),
    "replace_all_uses_with tensor": (lambda ir: ir.replace_all_uses_with("b:0", "d:0"), ["n"]),
    "add_control_input": (lambda ir: ir.add_control_input("m", "a"), ["m"]),
    "remove_control_input": (lambda ir: ir.remove_control_input("m", "d"), ["m"]),
    "remove_node": (lambda ir: ir.remove_node("c", safe=False), ["n"]),
    "remove_nodes": (lambda ir: ir.remove_nodes(["c", "d"], safe=False), ["n", "m"]),
    "remove_dead": (lambda ir: (ir.remove_node("m"), ir.remove_dead(["n"], keep=lambda n: n == "a")),
                    []),
    # a new node's NodeDef holds its inputs as given, unless the edges must say (a node
    # feeding it twice): either way it is new, so unverified
    "add_node": (lambda ir: ir.add_node("new", "Foo", ["a", "b:0", "d:1", "^c"]), [], ["new"]),
    "add_node twice from one node": (lambda ir: ir.add_node("new", "Foo", ["a", "a:1", "^a"]),
                                     ["new"]),
}


@pytest.mark.parametrize("method", sorted(MUTATIONS))
def test_every_mutation_marks_what_it_changed(method):
    ir = loaded_ir()
    ir.take_unverified()
    change, touched, *new = MUTATIONS[method]
    change(ir)
    assert {n for n in ir.nodes() if ir.is_dirty(n)} == set(touched)
    assert ir.take_unverified() == set(new[0] if new else touched)
    assert ir.take_unverified() == set()
    for name, inputs in emitted_inputs(ir).items():  # every emitted list matches the edges
        if name != "n" or ir.is_dirty("n"):
            assert inputs == ir.edge_inputs(name), name


def test_copies_of_clean_nodes_are_clean_with_renamed_inputs():
    ir = loaded_ir()
    ir.add_control_input("m", "c")  # m is dirty: so is its copy
    ir.take_unverified()
    ir.copy_nodes(["b", "c", "n", "m"], "r/")
    assert not ir.is_dirty("r/n") and ir.is_dirty("r/m")
    assert ir.take_unverified() == set()  # copies of checked nodes are well formed
    out = emitted_inputs(ir)
    assert out["r/n"] == ["a", "r/b:0", "^r/c", "^a"]  # 'a' was not copied
    assert out["r/m"] == ir.edge_inputs("r/m") == ["r/n", "^d", "^r/c"]
    assert ir.consumers("a") == [("n", 0), ("r/n", 0)]


def test_edge_dicts_are_shared_so_networkx_cannot_change_them_in_place():
    ir = loaded_ir()
    assert ir.g._pred["n"]["c"] is ir.g._pred["m"]["d"]  # every control-only pair: one dict
    with pytest.raises(TypeError, match="GraphIR's methods"):
        ir.g.remove_edge("c", "n")
    with pytest.raises(TypeError, match="GraphIR's methods"):
        ir.g.edges["c", "n", -1]["control"] = False
    assert ir.control_inputs("n") == ["a", "c"]


def test_copy_nodes_many_equals_copy_nodes_per_prefix():
    one, many = loaded_ir(), loaded_ir()
    for ir in (one, many):
        ir.add_control_input("m", "c")
    for i in range(2):
        one.copy_nodes(["b", "c", "n", "m"], f"r{i}/", device=f"/cpu:{i}", created_by="t")
    many.copy_nodes_many(["b", "c", "n", "m"], ["r0/", "r1/"], devices=["/cpu:0", "/cpu:1"],
                         created_by="t")
    assert metagraph.to_metagraph(one) == metagraph.to_metagraph(many)
    with pytest.raises(GraphxformError, match="cannot copy to 'r0/n'"):
        many.copy_nodes_many(["n"], ["r2/", "r0/"])
    assert "r2/n" not in many


# ------------------------------------- copies borrow a frozen snapshot of the original NodeDef

def colocated_ir():
    """'v' and 'r' (colocated with v and with the uncopied 'w'), with an attr to mutate."""
    from tensorflow.core.protobuf import meta_graph_pb2
    meta = meta_graph_pb2.MetaGraphDef()
    meta.graph_def.node.add(name="w", op="NoOp")
    meta.graph_def.node.add(name="v", op="VarHandleOp").attr["dtype"].type = 1
    r = meta.graph_def.node.add(name="r", op="ReadVariableOp", input=["v", "^w"])
    r.attr["dtype"].type = 1
    r.attr["_class"].list.s.extend([b"loc:@v", b"loc:@w"])
    return metagraph.from_metagraph(meta)


def test_copy_attr_is_copy_on_write():
    from graphxform.ir import BorrowedNode
    ir = colocated_ir()
    before = ir.node("r")["attr"]  # handed out before the copy: still the original's own map
    mappings = ir.copy_nodes_many(["v", "r"], ["r0/", "r1/"], devices=["/cpu:0", "/cpu:1"])
    assert type(ir.node("r0/r")) is BorrowedNode
    ir.node("r0/r")["attr"]["dtype"].type = 2  # the copy's own map now
    before["dtype"].type = 3
    ir.node("r")["attr"]["dtype"].type = 3
    assert ir.node("r1/r")["attr"]["dtype"].type == 1
    assert ir.node("r0/r")["attr"]["dtype"].type == 2
    assert ir.node("r")["attr"]["dtype"].type == 3
    out = {nd.name: nd for nd in metagraph.to_graphdef(ir).node}
    assert [out[n].attr["dtype"].type for n in ("r", "r0/r", "r1/r")] == [3, 2, 1]
    for i, mapping in enumerate(mappings):
        nd = out[mapping["r"]]
        assert list(nd.input) == [f"r{i}/v", "^w"] and nd.device == f"/cpu:{i}"
        assert list(nd.attr["_class"].list.s) == [f"loc:@r{i}/v".encode(), b"loc:@w"]
    assert list(out["r"].attr["_class"].list.s) == [b"loc:@v", b"loc:@w"]


def test_borrowed_copy_emits_what_its_own_node_def_holds():
    lazy, eager = colocated_ir(), colocated_ir()
    for ir in (lazy, eager):
        ir.copy_nodes_many(["v", "r"], ["r0/", "r1/"], devices=["/cpu:0", "/cpu:1"])
    for name in ("r0/v", "r0/r", "r1/r"):
        data = eager.node(name)
        assert "attr" in data and data.get("attr") is data["attr"] is data.copy()["attr"]
        proto = eager.proto(name)
        assert proto.name == name and proto.attr is data["attr"]
    eager.node("r1/r")["device"] = "/cpu:7"  # device changes after materialising still emit
    lazy.node("r1/r")["device"] = "/cpu:7"
    assert metagraph.to_metagraph(lazy) == metagraph.to_metagraph(eager)
    again = metagraph.from_metagraph(metagraph.to_metagraph(lazy))
    assert metagraph.to_metagraph(again) == metagraph.to_metagraph(eager)


def test_borrowed_copies_emit_alike_with_any_prefix_length_rewiring_and_op_change():
    """Emit writes borrowed copies from per-original byte templates keyed by prefix length;
    what it writes must equal each copy's own NodeDef, whatever happened to the copy."""
    lazy, eager = colocated_ir(), colocated_ir()
    prefixes = ["r9/", "r10/", "replica_100/"]
    for ir in (lazy, eager):
        ir.copy_nodes_many(["v", "r"], prefixes, devices=["/cpu:0", "", "/cpu:2"],
                           created_by="t")
        ir.set_input("r10/r", 0, "v")  # a copy rewired after it was made
        ir.node("replica_100/r")["op"] = "Identity"  # and one whose op changed
    for name in [p + n for p in prefixes for n in ("v", "r")]:
        eager.proto(name)
    emitted = metagraph.to_metagraph(lazy)
    assert emitted == metagraph.to_metagraph(eager)
    out = {nd.name: nd for nd in emitted.graph_def.node}
    assert list(out["r10/r"].input) == ["v", "^w"]
    assert list(out["r9/r"].input) == ["r9/v", "^w"] and out["r9/r"].device == "/cpu:0"
    assert list(out["replica_100/r"].attr["_class"].list.s) == [b"loc:@replica_100/v", b"loc:@w"]
    assert out["replica_100/r"].op == "Identity"
    assert out["r9/v"].attr["_graphxform_pass"].s == b"t"


def test_reading_attrs_and_verifying_leave_copies_borrowing():
    from graphxform import verify
    ir = colocated_ir()
    ir.copy_nodes_many(["v", "r"], ["r0/", "r1/"])
    assert ir.attrs("r1/r")["dtype"].type == 1
    verify.check_structure(ir)
    assert all(ir.node(n)._proto is None for n in ("r0/v", "r0/r", "r1/v", "r1/r"))
    ir.node("r0/r")["attr"]["dtype"].type = 2  # its own NodeDef from here on
    assert ir.attrs("r0/r")["dtype"].type == 2 and ir.attrs("r1/r")["dtype"].type == 1


def test_remove_dead_removes_an_input_once_all_its_consumers_are_dead():
    from tensorflow.core.protobuf import meta_graph_pb2
    ir = GraphIR(meta_graph_pb2.MetaGraphDef())
    ir.add_node("kept", "Const")
    ir.add_node("shared", "Const")
    ir.add_node("used", "Const")
    ir.add_node("x", "AddV2", ["shared", "kept"])
    ir.add_node("y", "AddV2", ["shared", "used"])
    ir.add_node("z", "AddV2", ["x", "^y"])
    ir.add_node("user", "Identity", ["used"])
    assert ir.remove_dead(["x", "z", "y"], keep=lambda n: n == "kept") == 4
    assert sorted(ir.nodes()) == ["kept", "used", "user"]
    assert ir.consumers("used") == [("user", 0)]


@pytest.mark.parametrize("content, prefixes", [
    (b"\x7f\x1c\x1c", ["r0/", "r1/"]),  # holds the prefix stand-in of a 3-character prefix
    (b"\x1f\x1e\x1e\x1e\x1e\x1e", ["r0/", "r1/"]),  # holds the device stand-in of "/cpu:0"
    (b"plain", ["r\x7f/", "r1/"]),  # a prefix holding a stand-in's character
])
def test_copies_emit_alike_when_their_bytes_hold_the_block_stand_ins(content, prefixes):
    """Emit writes unchanged copies from a block with stand-ins where prefix and device go;
    where a tensor happens to hold a stand-in (or a prefix does), it must notice and write
    each copy on its own."""
    from tensorflow.core.framework import types_pb2
    from tensorflow.core.protobuf import meta_graph_pb2
    irs = []
    for _ in range(2):
        meta = meta_graph_pb2.MetaGraphDef()
        c = meta.graph_def.node.add(name="c", op="Const")
        c.attr["dtype"].type = types_pb2.DT_UINT8
        c.attr["value"].tensor.dtype = types_pb2.DT_UINT8
        c.attr["value"].tensor.tensor_shape.dim.add(size=len(content))
        c.attr["value"].tensor.tensor_content = content
        meta.graph_def.node.add(name="i", op="Identity", input=["c"]).attr["T"].type = 4
        ir = metagraph.from_metagraph(meta)
        ir.copy_nodes_many(["c", "i"], prefixes, devices=["/cpu:0", "/cpu:1"])
        irs.append(ir)
    lazy, eager = irs
    for name in [p + n for p in prefixes for n in ("c", "i")]:
        eager.proto(name)
    emitted = metagraph.to_metagraph(lazy)
    assert emitted == metagraph.to_metagraph(eager)
    out = {nd.name: nd for nd in emitted.graph_def.node}
    assert out[prefixes[1] + "c"].attr["value"].tensor.tensor_content == content
    assert list(out[prefixes[0] + "i"].input) == [prefixes[0] + "c"]
    assert out[prefixes[1] + "i"].device == "/cpu:1"


def test_copies_with_a_device_per_node_emit_their_own():
    ir = colocated_ir()
    ir.node("v")["device"] = "/cpu:5"
    ir.copy_nodes(["v", "r"], "r0/", device=lambda name: "/cpu:1" if name == "r" else None)
    out = {nd.name: nd for nd in metagraph.to_graphdef(ir).node}
    assert out["r0/r"].device == "/cpu:1" and out["r0/v"].device == "/cpu:5"


def test_a_node_waiting_on_many_is_linked_in_bulk_like_any_other():
    from tensorflow.core.protobuf import meta_graph_pb2
    meta = meta_graph_pb2.MetaGraphDef()
    for i in range(20):
        meta.graph_def.node.add(name=f"op{i}", op="NoOp")
    ir = metagraph.from_metagraph(meta)
    waits = [f"^op{i}" for i in range(20)]
    ir.add_node("all", "NoOp", waits)
    ir.add_node("twice", "NoOp", waits + ["^op3"])
    assert ir.control_inputs("all") == [f"op{i}" for i in range(20)]
    assert not ir.is_dirty("all") and ir.is_dirty("twice")
    assert ir.control_consumers("op7") == ["all", "twice"]
    assert emitted_inputs(ir)["all"] == waits == emitted_inputs(ir)["twice"]
    with pytest.raises(GraphxformError, match="'all2' has input 'nope'"):
        ir.add_node("all2", "NoOp", waits + ["^nope"])


def test_builder_ops_adds_nodes_like_one_op_call_each():
    """Builder.ops (GraphIR.add_nodes underneath) is the bulk form of Builder.op: the same
    nodes, edges, NodeDefs and provenance, and the same refusals."""
    from tensorflow.core.framework import types_pb2
    from graphxform.nodes import Builder
    rows = [("a0", ["c", "use:0"], "/cpu:0"), ("a1", ["c:1", "^a", "b"], ""),
            ("a2", ["b", "b"], "/cpu:1")]
    one, bulk = small_ir(), small_ir()
    for name, inputs, device in rows:
        Builder(one, "p").op(name, "IdentityN", inputs, device=device,
                             T=[types_pb2.DT_FLOAT, types_pb2.DT_FLOAT])
    names = Builder(bulk, "p").ops("IdentityN", rows, T=[types_pb2.DT_FLOAT, types_pb2.DT_FLOAT])
    assert names == ["a0", "a1", "a2"]
    assert metagraph.to_metagraph(bulk) == metagraph.to_metagraph(one)
    assert [bulk.node(n)["created_by"] for n in names] == ["p"] * 3
    assert bulk.inputs("a2") == [("b", 0), ("b", 0)] and bulk.control_inputs("a1") == ["a"]
    assert emitted_inputs(bulk)["a0"] == ["c", "use"]
    with pytest.raises(GraphxformError, match="'a0' already exists"):
        Builder(bulk, "p").ops("NoOp", [("a0", [], "")])
    with pytest.raises(GraphxformError, match="'x' has input 'nope'"):
        Builder(bulk, "p").ops("NoOp", [("x", ["^nope"], "")])


INPUT_LISTS = {
    "one plain": ["a"], "one port": ["c:1"], "one control": ["^a"],
    "plain then controls": ["a", "b", "^c", "^d"], "ports": ["a", "c:2", "b", "^d"],
    "a node twice": ["a", "a"], "data and control from one node": ["a", "^a"],
    "control before data": ["^a", "b"], "a control twice": ["^a", "^b", "^a", "^c"],
    "controls only": ["^a", "^b", "^c", "^d", "^e"],
    "more plain inputs than the table": [f"op{i}" for i in range(70)] + ["^a"],
}


@pytest.mark.parametrize("case", sorted(INPUT_LISTS))
def test_added_nodes_are_linked_as_the_loader_links_them(case):
    """add_node and add_nodes link a new node's inputs (in bulk where they are the usual
    kind) as the loader links a NodeDef's, and its NodeDef holds them unless the edges must
    say (a node feeding it twice, a control input before data)."""
    from tensorflow.core.framework import node_def_pb2
    from tensorflow.core.protobuf import meta_graph_pb2
    from graphxform.nodes import Builder
    inputs = INPUT_LISTS[case]

    def sources(*more):
        meta = meta_graph_pb2.MetaGraphDef()
        for name in ["a", "b", "c", "d", "e", *(f"op{i}" for i in range(70))]:
            meta.graph_def.node.add(name=name, op="NoOp")
        meta.graph_def.node.extend(more)
        return metagraph.from_metagraph(meta)

    loaded = sources(node_def_pb2.NodeDef(name="new", op="Foo", input=inputs))
    for add in (lambda ir: ir.add_node("new", "Foo", inputs),
                lambda ir: Builder(ir, "p").ops("NoOp", [("new", inputs, "")])):
        ir = sources()
        add(ir)
        assert ir.g._pred["new"] == loaded.g._pred["new"]
        assert all(ir.g._succ[src]["new"] == keys for src, keys in ir.g._pred["new"].items())
        dirty = case in ("a node twice", "data and control from one node",
                         "control before data", "a control twice")
        assert ir.is_dirty("new") == dirty
        assert emitted_inputs(ir)["new"] == ir.edge_inputs("new") == loaded.edge_inputs("new")


def test_add_nodes_links_a_row_to_an_earlier_row_not_a_later_one():
    from graphxform.nodes import Builder
    ir = small_ir()
    Builder(ir, "p").ops("NoOp", [("x", ["^a"], ""), ("y", ["^x", "^a"], "")])
    assert ir.control_inputs("y") == ["x", "a"] and ir.control_consumers("x") == ["y"]
    with pytest.raises(GraphxformError, match="'v' has input 'w'"):
        Builder(ir, "p").ops("NoOp", [("v", ["^w", "^a"], ""), ("w", [], "")])


def test_copies_emit_once_even_when_a_replica_is_not_together():
    """Emit writes a replica's copies as one run where its first copy is; if they were not
    together in graph order (nothing in the IR does that), each is still written once."""
    lazy, eager = colocated_ir(), colocated_ir()
    for ir in (lazy, eager):
        ir.copy_nodes_many(["v", "r"], ["r0/", "r1/"], devices=["/cpu:0", "/cpu:1"])
        ir.add_node("after", "NoOp", ["^r0/r"])
        moved = ir.g._node.pop("r0/v")  # r0/v now sits after r1's copies and "after"
        ir.g._node["r0/v"] = moved
    for name in ("r0/v", "r0/r", "r1/v", "r1/r"):
        eager.proto(name)
    emitted = metagraph.to_metagraph(lazy)
    names = [nd.name for nd in emitted.graph_def.node]
    assert sorted(names) == sorted(lazy.nodes()) and len(names) == len(set(names))
    assert {nd.name: nd for nd in emitted.graph_def.node} == {
        nd.name: nd for nd in metagraph.to_metagraph(eager).graph_def.node}


def test_copies_of_unchecked_nodes_are_checked_in_the_first_prefix_only():
    ir = loaded_ir()
    ir.take_unverified()
    ir.add_control_input("m", "c")  # m and what copies it are unchecked
    ir.copy_nodes_many(["b", "c", "n", "m"], ["r0/", "r1/"])
    assert ir.take_unverified() == {"m", "r0/m"}
