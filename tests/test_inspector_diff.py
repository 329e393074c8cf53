"""`graphxform diff A B`: a fixture against its allreduce output lists exactly the nodes the
passes made (checked against provenance), a graph against itself nothing."""

import json

import pytest
from conftest import ALL_FIXTURES, fixture_path

from graphxform import metagraph, strategies
from graphxform.inspector import diff


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Each fixture's allreduce output on 2 replicas, saved and loaded back (provenance comes
    from the file's _graphxform_pass attrs)."""
    where = tmp_path_factory.mktemp("diff")
    paths = {}
    for name in ALL_FIXTURES:
        ir = metagraph.load(fixture_path(name))
        strategies.transform(ir, "allreduce", devices=["/device:CPU:0", "/device:CPU:1"])
        paths[name] = str(where / f"{name}.allreduce.meta")
        metagraph.save(ir, paths[name])
    return paths


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_diff_lists_exactly_the_nodes_the_passes_made(name, outputs):
    a, b = metagraph.load(fixture_path(name)), metagraph.load(outputs[name])
    found = diff.compare(a, b)
    made = {n: data["created_by"] for n, data in b.node_items() if data["created_by"]}
    assert found.made_by_passes() == set(made)
    for change in found.changes:
        if change.status in (diff.ADDED, diff.REPLACED):
            assert change.made_by == made[change.name]
    assert found.provenance
    assert {c.name for c in found.of(diff.REMOVED)} == set(a.nodes()) - set(b.nodes())


@pytest.mark.parametrize("name", ["mlp_sgd", "embedding_adam"])
def test_diff_with_itself_is_empty(name, outputs, run_cli):
    for path in (fixture_path(name), outputs[name]):
        code, out, err = run_cli("diff", path, path, "--json")
        assert code == 0, err
        doc = json.loads(out)
        assert doc["changes"] == [] and set(doc["counts"].values()) == {0}
        code, out, _ = run_cli("diff", path, path)
        assert "no differences" in out


def test_diff_text_groups_by_pass_and_scope(outputs, run_cli):
    code, out, err = run_cli("diff", fixture_path("mlp_sgd"), outputs["mlp_sgd"])
    assert code == 0, err
    assert "by pass:" in out and "by scope:" in out
    assert "replica_*/" in out and "added by replicate" in out
    assert "allreduce/" in out and "added by all-reduce" in out
    assert "GradientDescent/Const: -^GradientDescent/update, +^replica_0/" in out  # rewired


def test_diff_without_provenance_matches_names(outputs, tmp_path):
    meta, _ = metagraph.read_metagraph(outputs["mlp_sgd"])
    for node in meta.graph_def.node:
        node.attr.pop(metagraph.PROVENANCE_ATTR, None)
    bare = tmp_path / "bare.meta"
    bare.write_bytes(meta.SerializeToString())
    found = diff.compare(metagraph.load(fixture_path("mlp_sgd")), metagraph.load(str(bare)))
    assert not found.provenance
    added = found.of(diff.ADDED)
    assert added and all(c.made_by is None for c in added)
    assert diff.UNKNOWN_PASS in found.by_pass() and "passes unknown" in found.text()


@pytest.mark.parametrize("fmt", ["dot", "html"])
def test_diff_picture_colours_the_changes(outputs, run_cli, tmp_path, fmt):
    out = tmp_path / f"d.{fmt}"
    code, _, err = run_cli("diff", fixture_path("cnn_bn_momentum"), outputs["cnn_bn_momentum"],
                           "--format", fmt, "-o", out)
    assert code == 0, err
    text = out.read_text()
    if fmt == "dot":
        assert diff.DIFF_COLOURS[diff.ADDED] in text and "added" in text
    else:
        assert '"diff":' in text and '"colorBy":"diff"' in text


def test_removed_nodes_are_drawn_where_they_were(tmp_path):
    a = metagraph.load(fixture_path("mlp_sgd"))
    b = metagraph.load(fixture_path("mlp_sgd"))
    b.remove_node("GradientDescent/update", safe=False)
    found = diff.compare(a, b)
    assert [c.name for c in found.of(diff.REMOVED)] == ["GradientDescent/update"]
    from graphxform.inspector import scopes
    folded = scopes.FoldedGraph(b, ghosts=a)
    statuses = diff.leaf_status(found, folded)
    assert statuses[folded.leaf_of["GradientDescent/update"]] == diff.REMOVED
