"""Load -> emit is lossless for every fixture and every file format; bad files are one-line
errors that leave nothing behind."""

import os

import pytest
from conftest import ALL_FIXTURES, fixture_path
from tensorflow.core.protobuf import meta_graph_pb2

from graphxform import metagraph
from graphxform.errors import GraphxformError


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_binary_roundtrip_is_exact(name):
    path = fixture_path(name)
    with open(path, "rb") as f:
        original = meta_graph_pb2.MetaGraphDef.FromString(f.read())
    emitted = metagraph.to_metagraph(metagraph.load(path))
    assert emitted == original


@pytest.mark.parametrize("name", ["mlp_saver", "rnn_while"])
def test_text_and_graphdef_roundtrips(name, tmp_path):
    ir = metagraph.load(fixture_path(name))
    expected = metagraph.to_metagraph(ir)
    text = str(tmp_path / "m.pbtxt")
    metagraph.save(ir, text)
    assert metagraph.to_metagraph(metagraph.load(text)) == expected
    pb = str(tmp_path / "g.pb")
    metagraph.save(ir, pb)
    bare = metagraph.load(pb)
    assert bare.kind == "graph"
    assert metagraph.to_graphdef(bare) == expected.graph_def
    graph_text = str(tmp_path / "g.pbtxt")
    metagraph.save(bare, graph_text)
    assert metagraph.load(graph_text).kind == "graph"


def test_save_refuses_to_overwrite_input(tmp_path):
    path = tmp_path / "m.meta"
    path.write_bytes(open(fixture_path("mlp_sgd"), "rb").read())
    ir = metagraph.load(str(path))
    with pytest.raises(GraphxformError, match="overwrite the input"):
        metagraph.save(ir, str(path))


def _bad_files(tmp_path):
    good = open(fixture_path("mlp_sgd"), "rb").read()
    graph_def = meta_graph_pb2.MetaGraphDef.FromString(good).graph_def.SerializeToString()
    opless = meta_graph_pb2.MetaGraphDef.FromString(good)
    for i in range(20):
        opless.graph_def.node.add(name=f"pad{i}", op="NoOp")
    opless.graph_def.node[-5].op = ""  # past the nodes the kind check samples
    files = {
        "missing.meta": None,
        "opless.meta": opless.SerializeToString(),
        "empty.meta": b"",
        "random.meta": os.urandom(4096),
        "truncated.meta": good[: len(good) // 2],
        "graphdef.meta": graph_def,
        "metagraph.pb": good,
    }
    for name, data in files.items():
        if data is not None:
            (tmp_path / name).write_bytes(data)
    return [str(tmp_path / name) for name in files]


def test_bad_input_gives_one_line_errors(tmp_path, run_cli):
    for path in _bad_files(tmp_path):
        code, out, err = run_cli("inspect", path)
        assert code != 0, path
        assert err.count("\n") == 1 and err.startswith("graphxform: error: "), (path, err)
        assert os.path.basename(path) in err
        assert "Traceback" not in err


def test_bad_output_paths(tmp_path, run_cli):
    model = tmp_path / "m.meta"
    model.write_bytes(open(fixture_path("mlp_sgd"), "rb").read())
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    for out in (model, blocker / "out.svg", tmp_path / "missing" / "out.svg"):
        code, _, err = run_cli("viz", model, "-o", out)
        assert code != 0 and err.count("\n") == 1 and "Traceback" not in err, err
    assert model.read_bytes() == open(fixture_path("mlp_sgd"), "rb").read()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "m.meta"]


def test_debug_shows_traceback(tmp_path, run_cli):
    code, _, err = run_cli("inspect", str(tmp_path / "missing.meta"), "--debug")
    assert code != 0 and "Traceback" in err
