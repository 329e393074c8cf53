"""Initializable and reinitializable tf.data iterators (`make_initializable_iterator`,
`Iterator.from_structure` + `make_initializer`): `run`, `verify` and `launch` run the
iterator's initializer (a MakeIterator) once before the first step, as the user's loop does
(`sess.run(it.initializer, feed_dict=...)`), feeding the placeholders it reads from --feeds."""

import re

import numpy as np

from graphxform import metagraph
from graphxform.input_pipeline import iterator_initializers
from graphxform import training
from test_input_pipelines import _examples, _export, _model_and_step, _passes


def _dataset(tf, source):
    return tf.data.Dataset.from_tensor_slices(source).shuffle(64, seed=3).batch(16).repeat()


def initializable_graph(path, from_placeholders=False):
    """The TF guide's initializable iterator, over arrays or over placeholders (fed once)."""
    def build(tf, tf1):
        source = _examples()
        if from_placeholders:
            source = (tf1.placeholder(tf.float32, [None, 8], name="features"),
                      tf1.placeholder(tf.int64, [None], name="labels"))
        x, y = tf1.data.make_initializable_iterator(_dataset(tf, source)).get_next()
        _model_and_step(tf1, x, y)
    return _export(build, path)


def reinitializable_graph(path, validation=False):
    def build(tf, tf1):
        dataset = _dataset(tf, _examples())
        it = tf1.data.Iterator.from_structure(tf1.data.get_output_types(dataset),
                                              tf1.data.get_output_shapes(dataset))
        it.make_initializer(dataset, name="train_init")
        if validation:
            it.make_initializer(_dataset(tf, _examples(64, seed=1)), name="val_init")
        x, y = it.get_next()
        _model_and_step(tf1, x, y)
    return _export(build, path)


def _feeds(tmp_path):
    xs, ys = _examples()
    np.savez(tmp_path / "feeds.npz", features=xs, labels=ys)
    return tmp_path / "feeds.npz"


def test_an_initializable_iterator_is_initialized_by_run_and_verify(run_cli, tmp_path):
    model = initializable_graph(tmp_path / "m.meta")
    code, out, err = run_cli("run", model, "--steps", 2)
    assert code == 0, err
    assert "step 2  loss" in out
    _passes(run_cli, "--replicas", 2, model)


def test_a_reinitializable_iterator_with_its_one_initializer(run_cli, tmp_path):
    model = reinitializable_graph(tmp_path / "m.meta")
    ir = metagraph.load(model)
    inits = iterator_initializers(ir, training.analyze(ir).pipeline)
    assert [(i.op, i.iterator, i.placeholders) for i in inits] == [
        ("train_init", "IteratorV2", [])]
    _passes(run_cli, "--strategy", "replicated", "--replicas", 2, model)


def test_an_iterator_with_several_initializers_is_refused_by_run(run_cli, tmp_path):
    code, _, err = run_cli("run", reinitializable_graph(tmp_path / "m.meta", validation=True),
                           "--steps", 1)
    assert code == 1
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "iterator 'IteratorV2' has 2 initializers ('train_init', 'val_init')" in err


def test_placeholders_the_initializer_reads_come_from_feeds(run_cli, tmp_path):
    model = initializable_graph(tmp_path / "m.meta", from_placeholders=True)
    for command in (["run", model, "--steps", 1], ["verify", "--replicas", 2, model]):
        code, _, err = run_cli(*command)
        assert code == 1, err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert ("iterator initializer 'MakeIterator' reads placeholder 'features': pass its "
                "array in --feeds") in err
    _passes(run_cli, "--replicas", 2, model, "--feeds", _feeds(tmp_path))


def test_ps_verify_and_launched_workers_initialize_their_iterator(run_cli, tmp_path):
    """verify's one client and launch's worker processes (each initializing the iterator its
    own step reads, fed from --feeds) both train like one device."""
    from processes import assert_launched_tasks_gone
    from graphxform.runtime.local import Feeds, Runner
    model = initializable_graph(tmp_path / "m.meta", from_placeholders=True)
    feeds = _feeds(tmp_path)
    cluster = tmp_path / "cluster.json"
    cluster.write_text('{"ps": ["127.0.0.1:28910"], "worker": ["127.0.0.1:28911", '
                       '"127.0.0.1:28912"]}')
    _passes(run_cli, "--strategy", "ps", "--cluster", cluster, "--steps", 3, model,
            "--feeds", feeds)
    with Runner(metagraph.load(model)) as run:
        source = Feeds(run.inputs, str(feeds))
        run.initialize(source)
        start = run.save(str(tmp_path / "start"))
        losses = [run.step(source.batch(k)).loss for k in range(3)]
    out_path = tmp_path / "out.meta"
    assert run_cli("apply", "--strategy", "ps", "--cluster", cluster, model,
                   "-o", out_path)[0] == 0
    code, out, err = run_cli("launch", out_path, "--steps", 3, "--restore", start,
                             "--feeds", feeds, "--timeout", 60)
    assert code == 0, out + err
    got = [float(x) for x in re.findall(r"^step \d+  loss (\S+)$", out, re.M)]
    np.testing.assert_allclose(got, losses, rtol=1e-5)
    assert_launched_tasks_gone(out)
