"""Structural and TF-level verification."""

import pytest
from conftest import ALL_FIXTURES, fixture_path

from graphxform import metagraph, verify
from graphxform.errors import GraphxformError


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_fixtures_verify(name):
    ir = metagraph.load(fixture_path(name))
    assert verify.structural_errors(ir) == []  # legacy while loops: back edges allowed
    verify.check_imports(ir)


def test_missing_output_port_is_reported():
    ir = metagraph.load(fixture_path("mlp_sgd"))
    ir.set_input("loss", 0, "x:3")
    errors = verify.structural_errors(ir)
    assert any("x:3" in e and "1 output" in e for e in errors)


def attr_values(**values):
    from tensorflow.core.framework import attr_value_pb2
    return {key: attr_value_pb2.AttrValue(**value) for key, value in values.items()}


def test_a_read_past_the_outputs_its_attrs_give_is_reported():
    """Split's outputs are as many as its num_split says: read per node, not per op."""
    ir = metagraph.load(fixture_path("mlp_sgd"))
    ir.add_node("split", "Split", ["Const", "dense0/Relu"],
                attr=attr_values(num_split={"i": 2}, T={"type": 1}))
    ir.add_node("second", "Identity", ["split:1"], attr=attr_values(T={"type": 1}))
    assert verify.structural_errors(ir) == []
    ir.add_node("third", "Identity", ["split:2"], attr=attr_values(T={"type": 1}))
    assert verify.structural_errors(ir) == [
        "node 'third' reads split:2, but split (Split) has 2 output(s)"]


def test_a_data_input_from_an_op_without_outputs_is_reported():
    ir = metagraph.load(fixture_path("mlp_sgd"))
    ir.add_node("nothing", "NoOp")
    ir.add_node("reads_nothing", "Identity", ["nothing"], attr=attr_values(T={"type": 1}))
    assert verify.structural_errors(ir) == [
        "node 'reads_nothing' reads nothing:0, but nothing (NoOp) has 0 output(s)"]


def test_ports_left_with_a_gap_are_reported():
    ir = metagraph.load(fixture_path("mlp_sgd"))
    ir.add_node("shape", "Shape", ["dense0/MatMul"], attr=attr_values(T={"type": 1}))
    ir.add_node("sum", "AddV2", ["shape", "shape"], attr=attr_values(T={"type": 3}))
    assert verify.structural_errors(ir) == []  # one pair, two data edges
    ir.add_node("also", "AddV2", ["dense0/Relu", "dense1/add"], attr=attr_values(T={"type": 1}))
    ir.remove_node("dense0/Relu", safe=False)
    errors = verify.structural_errors(ir)
    assert "node 'also' has data inputs at ports [1] (not dense)" in errors


def test_a_read_of_an_unknown_op_is_reported_once():
    ir = metagraph.load(fixture_path("mlp_sgd"))
    ir.add_node("mystery", "NoSuchOp")
    for k in range(2):
        ir.add_node(f"reader{k}", "Identity", ["mystery:3"], attr=attr_values(T={"type": 1}))
    assert verify.structural_errors(ir) == ["unknown op type NoSuchOp"]


def test_cycle_outside_while_loop_is_reported():
    ir = metagraph.load(fixture_path("mlp_sgd"))
    ir.add_control_input("dense0/MatMul", "loss")
    assert any("cycle" in e for e in verify.structural_errors(ir))


def test_tf_import_check_reports_bad_attr():
    ir = metagraph.load(fixture_path("mlp_sgd"))
    from tensorflow.core.framework import attr_value_pb2, types_pb2
    ir.node("loss")["attr"]["T"].CopyFrom(attr_value_pb2.AttrValue(type=types_pb2.DT_INT32))
    with pytest.raises(GraphxformError, match="TensorFlow rejects the graph"):
        verify.check_imports(ir)


def test_changed_only_checks_a_fresh_graph_whole_then_what_changed():
    ir = metagraph.load(fixture_path("mlp_sgd"))
    verify.check_structure(ir, changed_only=True)  # every node of a fresh graph
    verify.check_structure(ir, changed_only=True)  # nothing changed since
    ir.add_node("broken", "Identity", ["loss:5"], attr={"T": ir.node("loss")["attr"]["T"]})
    with pytest.raises(GraphxformError, match="loss:5"):
        verify.check_structure(ir, changed_only=True)
    verify.check_structure(ir, changed_only=True)  # reported once; the full check still sees it
    with pytest.raises(GraphxformError, match="loss:5"):
        verify.check_structure(ir)


@pytest.mark.parametrize("where", ["start", "end"])
def test_changed_only_finds_a_cycle_through_a_rewired_node(where):
    ir = metagraph.load(fixture_path("mlp_sgd"))
    verify.check_structure(ir, changed_only=True)
    if where == "start":  # the search down from the rewired node covers most of the graph
        ir.add_control_input("dense0/MatMul", "loss")
    else:  # the search up from it does
        ir.add_control_input("loss", "loss")
    with pytest.raises(GraphxformError, match="cycle"):
        verify.check_structure(ir, changed_only=True)


def test_changed_only_allows_while_loop_back_edges():
    ir = metagraph.load(fixture_path("rnn_while_legacy"))
    verify.check_structure(ir, changed_only=True)
    merge = next(n for n in ir.nodes() if ir.op(n) == "Merge")
    ir.add_control_input(merge, ir.inputs(merge)[0][0])  # a second edge on the same pair
    verify.check_structure(ir, changed_only=True)


# --- verify that means it (graphxform/equivalence.py): scaled tolerance, losses, reasons ---

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from recipe_loop import load_manifest, recipe_meta  # noqa: E402

from graphxform import equivalence, training  # noqa: E402

tf1 = tf.compat.v1
WEIGHTS = np.random.default_rng(0).uniform(-0.5, 0.5, (8, 8))


def scaled(expected, got, initial=None):
    """Each variable's scaled difference, next to weights of ordinary size."""
    expected, got = {"w": WEIGHTS, **expected}, {"w": WEIGHTS, **got}
    floor = equivalence.scale_floor(expected, expected)
    return {d.name: d.scaled for d in equivalence.compare_variables(expected, got,
                                                                    initial or {}, floor)}


def test_float_noise_on_a_near_zero_variable_passes():
    bias = np.full(16, 1e-9)  # an attention key bias: gradient mathematically zero
    assert scaled({"b": bias}, {"b": bias + np.linspace(-1e-9, 1e-9, 16)})["b"] <= 1e-5


def test_a_real_error_on_a_zero_variable_fails():
    assert scaled({"b": np.zeros(16)}, {"b": np.full(16, 1e-3)})["b"] > 1e-5


def test_ordinary_variables_are_compared_relative_to_themselves():
    value = np.full(4, 3.0)
    assert scaled({"v": value}, {"v": value * (1 + 1e-6)})["v"] == pytest.approx(1e-6)
    assert scaled({"v": value}, {"v": value * 1.001})["v"] == pytest.approx(1e-3)
    shrunk = scaled({"v": np.full(4, 1e-6)}, {"v": np.full(4, 2e-6)}, {"v": np.full(4, 2.0)})
    assert shrunk["v"] == pytest.approx(5e-7)  # scaled by its initial size
    assert scaled({"v": value}, {"v": value * np.nan})["v"] == float("inf")


def test_report_without_a_loss_says_so_in_one_line():
    report = equivalence.Report(steps=2, rtol=1e-5, variables=[], fetches=[],
                                step_losses={"bump": [(None, None), (None, None)]}, reasons=[])
    text = equivalence.format_report(report)
    assert "loss: none found for bump (compare a tensor with --fetch NAME)" in text
    assert "step  loss" not in text
    assert text.splitlines()[0].startswith("scaled difference = max|original - transformed|")


def analyzed(build):
    """The IR and analysis of a graph with one step that minimises ``build(x)``."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4, 4, 2], name="x")
        loss = tf.reduce_mean(build(x))
        tf1.add_to_collection("train_op", tf1.train.GradientDescentOptimizer(0.1).minimize(loss))
        ir = metagraph.from_metagraph(tf1.train.export_meta_graph(graph=g))
    return ir, training.analyze(ir)


def reasons_for(build):
    return " ".join(equivalence.mismatch_reasons(*analyzed(build)))


def scale_and_offset():
    return (tf1.get_variable("scale", [2], initializer=tf1.ones_initializer()),
            tf1.get_variable("offset", [2], initializer=tf1.zeros_initializer()))


def fused_batch_norm(x, training_mode=True):
    scale, offset = scale_and_offset()
    if training_mode:
        return tf1.nn.fused_batch_norm(x, scale, offset, is_training=True)[0]
    return tf1.nn.fused_batch_norm(x, scale, offset, mean=tf.zeros([2]),
                                   variance=tf.ones([2]), is_training=False)[0]


def moments_batch_norm(x, axes=(0, 1, 2)):
    scale, offset = scale_and_offset()
    mean, variance = tf.nn.moments(x, list(axes), keepdims=True)
    return tf.nn.batch_normalization(x, mean, variance, offset, scale, 1e-3)


def layer_norm(x):
    import tf_keras
    return tf_keras.layers.LayerNormalization()(x)


def test_batch_norm_in_training_mode_is_named_with_its_option():
    text = reasons_for(fused_batch_norm)
    assert "batch norm in training mode" in text and "FusedBatchNorm" in text
    assert "--sync-batch-norm" in text
    assert "moments" in reasons_for(moments_batch_norm) and "--sync-batch-norm" in \
        reasons_for(moments_batch_norm)


@pytest.mark.parametrize("build", [
    lambda x: fused_batch_norm(x, training_mode=False),
    lambda x: moments_batch_norm(x, axes=(3,)),  # over features: mixes no examples
    layer_norm,  # tf_keras runs it as a fused batch norm over a [1, N, D, 1] reshape
], ids=["inference-mode", "moments-over-features", "keras-layer-norm"])
def test_statistics_that_mix_no_examples_are_not_a_reason(build):
    assert reasons_for(build) == ""


def dropout(x):
    w = tf1.get_variable("w", [2], initializer=tf1.ones_initializer())
    return tf1.nn.dropout(x * w, rate=0.5)


def test_seeded_dropout_is_named_with_its_option():
    def seeded(x):
        tf1.set_random_seed(7)
        return dropout(x)
    text = reasons_for(seeded)
    assert "each replica draws its own numbers for its slice" in text
    assert "--consistent-random" in text and "cannot match even on one device" not in text


def test_unseeded_dropout_cannot_match_even_on_one_device():
    text = reasons_for(dropout)
    assert "seed=seed2=0" in text and "cannot match even on one device" in text
    assert "RandomUniform" in text and "--consistent-random" in text


def sampled_softmax(x, seed):
    """sampled_softmax_loss as its docs call it: remove_accidental_hits=True by default, so a
    ComputeAccidentalHits (seed attrs, but deterministic) beside the candidate sampler."""
    if seed:
        tf1.set_random_seed(seed)
    h = tf.reshape(x, [-1, 32])
    w = tf1.get_variable("softmax_w", [20, 32])
    b = tf1.get_variable("softmax_b", [20], initializer=tf1.zeros_initializer())
    labels = tf.reshape(tf.cast(tf.abs(h[:, :1]) * 10, tf.int64) % 20, [-1, 1])
    return tf.nn.sampled_softmax_loss(w, b, labels, h, num_sampled=5, num_classes=20)


def test_accidental_hits_are_not_named_as_a_random_op():
    # ComputeAccidentalHits was named as an unseeded random op beside the sampler, and, seeded,
    # as a random op drawing per example (verify said "may not match" on a graph that matches)
    text = reasons_for(lambda x: sampled_softmax(x, seed=0))
    assert "seed=seed2=0" in text and "LogUniformCandidateSampler" in text
    assert "ComputeAccidentalHits" not in text
    assert reasons_for(lambda x: sampled_softmax(x, seed=7)) == ""


@pytest.mark.parametrize("name", sorted(load_manifest()))
def test_every_corpus_graph_names_what_keeps_it_from_matching(name):
    entry = load_manifest()[name]
    ir = metagraph.load(recipe_meta(name))
    reasons = equivalence.mismatch_reasons(ir, training.analyze(ir))
    text = " ".join(reasons)
    assert ("--sync-batch-norm" in text) == ("bn" in entry["has"]), text
    assert ("--consistent-random" in text) == ("dropout" in entry["has"]), text
    assert ("metrics' totals" in text) == ("metrics" in entry["has"]), text
    assert len(reasons) == sum(tag in entry["has"] for tag in ("bn", "dropout", "metrics"))


def test_changed_only_checks_copies_of_unchecked_nodes_in_one_replica_and_changed_copies():
    from tensorflow.core.framework import attr_value_pb2
    ir = metagraph.load(fixture_path("mlp_sgd"))
    verify.check_structure(ir, changed_only=True)
    ir.add_control_input("dense0/MatMul", "x")  # unchecked, like its copies
    names = [n for n in ir.nodes() if n.startswith("dense0/")]
    ir.copy_nodes_many(names, ["r0/", "r1/", "r2/"])
    ir.node("r2/dense0/Relu")["attr"]["T"].CopyFrom(attr_value_pb2.AttrValue(type=1))
    changes = ir.take_changes()
    assert changes.nodes == {"dense0/MatMul", "r0/dense0/MatMul", "r2/dense0/Relu"}
    assert changes.linked_to == {"dense0/MatMul"}  # copying links nothing into older nodes


def test_changed_only_finds_a_cycle_closed_in_a_later_replica():
    ir = metagraph.load(fixture_path("mlp_sgd"))
    verify.check_structure(ir, changed_only=True)
    names = [n for n in ir.nodes() if n.startswith("dense0/")]
    ir.copy_nodes_many(names, ["r0/", "r1/", "r2/"])
    ir.add_control_input("r2/dense0/MatMul", "r2/dense0/Relu")
    with pytest.raises(GraphxformError, match="cycle.*r2/dense0"):
        verify.check_structure(ir, changed_only=True)


def test_changed_only_skips_the_cycle_search_when_edges_only_went():
    ir = metagraph.load(fixture_path("mlp_sgd"))
    verify.check_structure(ir, changed_only=True)
    control = next(n for n in ir.nodes() if ir.control_inputs(n))
    ir.remove_control_input(control, ir.control_inputs(control)[0])
    changes = ir.take_changes()
    assert changes.nodes == {control} and not changes.linked_to and not changes.linked_from


def test_a_failing_verify_measures_how_much_rounding_the_original_amplifies(monkeypatch):
    """On a FAIL, verify runs the original again with each batch's examples reversed (only the
    order of float sums changes) and, when that alone moves the variables past the tolerance
    (ResNet-50 at a batch of 4 moves by ~1, as much as it differs from the transformed graph),
    says so. A well-conditioned graph moves by rounding only, and the FAIL stands alone."""
    from graphxform import strategies
    original = metagraph.load(fixture_path("mlp_sgd"))
    broken = metagraph.load(fixture_path("mlp_sgd"))  # replicas that never exchange gradients
    strategies.transform(broken, "independent", devices=["/device:CPU:0", "/device:CPU:1"])
    seen = []
    real = equivalence._reordered_noise
    monkeypatch.setattr(equivalence, "_reordered_noise",
                        lambda *a: seen.append(real(*a)) or seen[-1])
    report = equivalence.compare(original, broken, fixture_path("mlp_sgd", ".npz"), steps=3,
                                 batch_size=16)
    assert not report.ok and len(seen) == 1 and seen[0] < 1e-5
    assert not any("reverse order" in r for r in report.reasons)
    monkeypatch.setattr(equivalence, "_reordered_noise", lambda *a: 0.5)
    report = equivalence.compare(original, broken, fixture_path("mlp_sgd", ".npz"), steps=3,
                                 batch_size=16)
    assert any("moves by up to 5.00e-01 (scaled) when each batch's examples come in reverse "
               "order" in r for r in report.reasons)


def test_a_fetch_that_holds_no_numbers_is_refused_in_one_line(run_cli, tmp_path):
    """verify --fetch on a merged summary printed 'internal error: ValueError: could not
    convert string to float'; on a variable's handle it compared the handles."""
    import tensorflow as tf
    from conftest import export_classifier
    from test_custom_training_code import dense
    tf1 = tf.compat.v1

    def build(x, y):
        loss = tf1.losses.sparse_softmax_cross_entropy(y, dense(x, 2, "logits"))
        tf1.summary.scalar("loss", loss)
        tf1.summary.merge_all()
        return tf1.train.GradientDescentOptimizer(0.1).minimize(
            loss, global_step=tf1.train.get_or_create_global_step())

    model = export_classifier(tmp_path / "m.meta", build)
    for fetch, kind in (("Merge/MergeSummary:0", "string"), ("global_step:0", "resource")):
        code, _, err = run_cli("verify", "--replicas", 2, model, "--feeds", model + ".npz",
                               "--batch-size", 16, "--fetch", fetch)
        assert code == 1 and len(err.strip().splitlines()) == 1, err
        assert f"cannot compare fetch '{fetch}': it is {kind}, not numbers" in err
