"""`graphxform inspect` and `graphxform viz` on every fixture."""

import json
import os
import shutil

import pytest
from conftest import ALL_FIXTURES, fixture_path


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_inspect_json_and_text(name, run_cli):
    code, out, err = run_cli("inspect", fixture_path(name), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["train_op"] and doc["loss"] == "loss:0"
    names = {v["name"] for v in doc["variables"]}
    assert "global_step" in names
    assert all(v["gradient"] for v in doc["variables"] if v["role"] == "trainable")
    code, out, _ = run_cli("inspect", fixture_path(name))
    assert code == 0 and "variable" in out and "totals:" in out


def test_inspect_json_names_embedding_updates(run_cli):
    _, out, _ = run_cli("inspect", fixture_path("embedding_adam"), "--json")
    by_name = {v["name"]: v for v in json.loads(out)["variables"]}
    emb = by_name["embedding/weights"]
    assert emb["gradient"]["kind"] == "sparse"
    assert emb["slots"] == {"Adam": "embedding/weights/Adam", "Adam_1": "embedding/weights/Adam_1"}
    assert [u["type"] for u in emb["updates"]] == ["AssignSubVariableOp"]


def test_inspect_train_op_option(run_cli):
    code, out, _ = run_cli("inspect", fixture_path("mlp_sgd"), "--json", "--train-op",
                           "GradientDescent/update")
    assert code == 0 and json.loads(out)["train_op"] == "GradientDescent/update"
    code, _, err = run_cli("inspect", fixture_path("mlp_sgd"), "--train-op", "nope")
    assert code != 0 and "nope" in err and err.count("\n") == 1


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_viz_dot(name, run_cli, tmp_path):
    out = tmp_path / "g.dot"
    code, _, err = run_cli("viz", fixture_path(name), "-o", out, "--depth", "1")
    assert code == 0, err
    text = out.read_text()
    assert text.startswith("digraph") and "->" in text


@pytest.mark.skipif(shutil.which("dot") is None and not os.environ.get("CI"),
                    reason="needs Graphviz's dot (CI installs it and never skips this)")
def test_viz_renders_svg(run_cli, tmp_path):
    out = tmp_path / "g.svg"
    code, _, err = run_cli("viz", fixture_path("cnn_bn_momentum"), "-o", out, "--scope", "bn0")
    assert code == 0, err
    assert "<svg" in out.read_text()


def test_viz_unknown_scope(run_cli, tmp_path):
    code, _, err = run_cli("viz", fixture_path("mlp_sgd"), "-o", tmp_path / "g.dot", "--scope",
                           "nothing_here")
    assert code != 0 and "nothing_here" in err
    assert list(tmp_path.iterdir()) == []
