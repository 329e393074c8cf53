"""The collapsed picture (graphxform/inspector/scopes.py), `viz` to DOT/SVG/HTML and TensorBoard
event files: replicas folded, at most about 150 boxes, edges bundled."""

import os
import re
import shutil
import sys
import time

import pytest
from conftest import ALL_FIXTURES, fixture_path

from graphxform import metagraph, strategies
from graphxform.inspector import scopes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_dot = pytest.mark.skipif(shutil.which("dot") is None and not os.environ.get("CI"),
                               reason="needs Graphviz's dot (CI installs it)")


def allreduce(name, replicas=2):
    ir = metagraph.load(fixture_path(name))
    strategies.transform(ir, "allreduce", devices=[f"/device:CPU:{i}" for i in range(replicas)])
    return ir


def test_fold_name():
    assert scopes.fold_name("replica_3/dense/MatMul") == ("replica_*/dense/MatMul", 3)
    assert scopes.fold_name("allreduce/bucket_0/replica_1/reduce") == (
        "allreduce/bucket_0/replica_*/reduce", 1)
    assert scopes.fold_name("not_replica_1/x") == ("not_replica_1/x", None)
    assert scopes.fold_name("dense/kernel") == ("dense/kernel", None)


def test_device_pattern():
    assert scopes.device_pattern(["/device:CPU:0", "/device:CPU:1"]) == "/device:CPU:*"
    assert scopes.device_pattern(["/job:worker/task:0/device:CPU:0",
                                  "/job:worker/task:1/device:CPU:0"]) == \
        "/job:worker/task:*/device:CPU:0"
    assert scopes.device_pattern([""]) == "(no device)"


def test_replicas_fold_into_one_leaf_with_every_copy():
    ir = allreduce("mlp_sgd", replicas=4)
    folded = scopes.FoldedGraph(ir)
    leaf = folded.names.index("replica_*/dense0/MatMul")
    assert sorted(folded.members[leaf]) == [f"replica_{i}/dense0/MatMul" for i in range(4)]
    assert folded.replicas[leaf] == {0, 1, 2, 3} and folded.replica_count == 4
    inputs = {folded.names[src] for src, _ in folded.inputs[leaf]}
    assert "replica_*/dense0/MatMul/ReadVariableOp" in inputs
    assert len(folded) < len(ir) / 2
    unfolded = scopes.FoldedGraph(ir, fold=False)
    assert len(unfolded) == len(ir)


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_every_fixture_fits_the_box_budget(name):
    ir = allreduce(name)
    pic = scopes.collapsed(ir, boxes=40)
    assert 1 < len(pic.boxes) <= 40
    assert all(b >= 0 for b in pic.box_of_leaf)  # every leaf is drawn somewhere
    for (src, dst), (data, control) in pic.edges.items():
        assert src != dst and data + control >= 1


def test_saver_gradients_and_optimizer_open_last():
    ir = metagraph.load(fixture_path("cnn_bn_momentum"))
    folded = scopes.FoldedGraph(ir)
    tree = scopes.build_tree(folded, scopes.saver_scope(ir))
    gradients = tree.find("gradients")
    assert tree.fold_first[gradients] and tree.fold_first[tree.find("Momentum")]
    budget = len(tree.children[0]) + len(tree.children[tree.find("conv0")]) - 1
    opened = scopes.choose_open(tree, boxes=budget)
    assert gradients not in opened  # it is the largest scope, yet stays closed
    assert tree.find("conv0") in opened


def tree_of(names):
    """The scope tree of made-up leaf names (no graph needed)."""
    folded = scopes.FoldedGraph(metagraph.load(fixture_path("mlp_sgd")))
    folded.names, folded.members = names, [[n] for n in names]
    folded.passes, folded.ops = [None] * len(names), ["NoOp"] * len(names)
    return scopes.build_tree(folded)


def test_crowded_scopes_get_name_prefix_groups():
    layers = [f"net/conv{s}_block{b}_{part}/op" for s in (2, 3) for b in range(1, 10)
              for part in ("conv", "bn", "relu")] + ["net/other"]
    tree = tree_of(layers)
    net = tree.find("net")
    groups = {tree.label[k]: k for k in tree.children[net] if tree.kind[k] == scopes.GROUP}
    assert sorted(groups) == ["conv2_*", "conv3_*"]
    assert [tree.label[k] for k in tree.children[groups["conv2_*"]]] == [
        f"conv2_block{b}_*" for b in range(1, 10)]  # 27 layers: crowded, split further
    series = tree_of([f"net/block{i}_conv/op" for i in range(30)] + ["net/other"])
    net = series.find("net")
    assert [series.label[k] for k in series.children[net]] == ["block*_conv", "other"]
    assert series.size[series.children[net][0]] == 30


def test_depth_and_scope_open_a_part():
    ir = allreduce("cnn_bn_momentum")
    top = scopes.collapsed(ir, depth=1)
    assert all(box.path.count("/") <= 1 for box in top.boxes)
    part = scopes.collapsed(ir, scope="replica_1/bn0")  # a replica's name finds the fold
    assert part.boxes and all(box.path.startswith("replica_*/bn0/") for box in part.boxes)


def test_parallel_edges_are_bundled_with_a_count(run_cli, tmp_path):
    out = tmp_path / "g.dot"
    code, _, err = run_cli("viz", fixture_path("mlp_sgd"), "-o", out, "--depth", "1")
    assert code == 0, err
    text = out.read_text()
    edges = re.findall(r"^  (b\d+) -> (b\d+)", text, re.M)
    assert len(edges) == len(set(edges))
    assert re.search(r'label="\d+"', text)


@pytest.mark.parametrize("color", ["device", "replica", "pass"])
def test_viz_color_by(run_cli, tmp_path, color):
    model = tmp_path / "m.meta"
    metagraph.save(allreduce("mlp_sgd"), str(model))
    out = tmp_path / "g.dot"
    code, _, err = run_cli("viz", model, "-o", out, "--color-by", color)
    assert code == 0, err
    text = out.read_text()
    expected = {"device": "/device:CPU:*", "replica": "every replica", "pass": "replicate"}
    assert f"colour: {color}" in text and expected[color] in text
    assert "x 2" in text  # folded replicas are badged
    code, _, err = run_cli("viz", model, "-o", out, "--color", "pass")  # the old name
    assert code == 0, err


def test_viz_needs_an_output(run_cli):
    code, _, err = run_cli("viz", fixture_path("mlp_sgd"))
    assert code == 2 and "-o OUT" in err


def test_viz_html_option(run_cli, tmp_path):
    out = tmp_path / "page.html"
    code, _, err = run_cli("viz", fixture_path("cnn_momentum"), "-o", out)
    assert code == 0, err
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>") and 'id="graph-data"' in text
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")  # nothing fetched


def test_tensorboard_event_files(run_cli, tmp_path):
    import tensorflow as tf
    from tensorflow.core.framework import graph_pb2
    dumps = tmp_path / "dumps"
    code, _, err = run_cli("apply", fixture_path("mlp_sgd"), "--replicas", 2, "-o",
                           tmp_path / "out.meta", "--dump-dir", dumps)
    assert code == 0, err
    code, out, err = run_cli("viz", dumps, "--tensorboard", tmp_path / "tb")
    assert code == 0, err
    runs = sorted(os.listdir(tmp_path / "tb"))
    assert runs[0] == "00_input" and len(runs) == len(list(dumps.glob("*.pbtxt")))
    last = tmp_path / "tb" / runs[-1]
    (events,) = os.listdir(last)
    graphs = [e.graph_def for e in tf.compat.v1.train.summary_iterator(str(last / events))
              if e.graph_def]
    assert len(graphs) == 1
    assert len(graph_pb2.GraphDef.FromString(graphs[0]).node) == len(
        metagraph.load(str(tmp_path / "out.meta")))


def test_dump_dir_pictures_are_collapsed(run_cli, tmp_path):
    dumps = tmp_path / "dumps"
    code, _, err = run_cli("apply", fixture_path("cnn_bn_momentum"), "--replicas", 2, "-o",
                           tmp_path / "out.meta", "--dump-dir", dumps)
    assert code == 0, err
    last = sorted(dumps.glob("*.dot"))[-1].read_text()
    assert "x 2" in last and len(re.findall(r"^  b\d+ \[", last, re.M)) <= 150


def test_pipeline_draws_with_the_function_it_is_handed(tmp_path):
    from graphxform.pipeline import Pipeline
    drawn = []
    Pipeline([], dump_dir=str(tmp_path), draw=lambda ir, stem: drawn.append(stem)).run(
        metagraph.load(fixture_path("mlp_sgd")))
    assert drawn == [str(tmp_path / "00_input")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00_input.pbtxt"]


@pytest.mark.slow
@needs_dot
def test_resnet50_x8_renders_to_svg_in_seconds(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import models
    model = models.resnet50()
    transformed = tmp_path / "resnet50.x8.meta"
    ir = metagraph.load(model)
    strategies.transform(ir, "allreduce", devices=[f"/device:CPU:{i}" for i in range(8)])
    metagraph.save(ir, str(transformed))
    from graphxform import cli
    out = tmp_path / "resnet50.svg"
    start = time.monotonic()
    with pytest.raises(SystemExit) as done:
        cli.main(["viz", str(transformed), "-o", str(out)])
    took = time.monotonic() - start
    assert done.value.code in (0, None)
    assert took < 30, f"viz took {took:.1f} s"
    text = out.read_text()
    boxes = len(re.findall(r"<title>b\d+</title>", text))
    assert 20 <= boxes <= 160
    assert "x 8" in text
