"""The training loop a user of a corpus recipe runs, for tests to run on any graph.

The drop-in contract is checked the way a user's own script would use a graph
(original or transformed): ``import_meta_graph`` into a fresh graph, initialize
(and optionally restore a checkpoint through the graph's own saver), feed the
original placeholder names, run the original train op name(s) in order (each
step runs every train op once, fetching its loss with it), then read the
variables.  Equivalence tests run this on the original and on the output and
compare.

This module imports no builder code (no tf_slim), so importing it has no side
effects beyond TensorFlow itself.

    from recipe_loop import load_manifest, load_feeds, recipe_meta, run_user_loop
    entry = load_manifest()["gan_mlp"]
    result = run_user_loop(recipe_meta("gan_mlp"), entry, load_feeds("gan_mlp"))
    result.losses          # [[d_loss, g_loss] per step]
"""

import dataclasses
import json
import pathlib

import numpy as np

RECIPES_DIR = pathlib.Path(__file__).parent / "fixtures" / "recipes"
POOL_ROWS = 64  # rows per placeholder in each recipe's .npz


def load_manifest(directory=RECIPES_DIR):
    """Recipe name -> manifest entry (see tests/fixtures/README.md)."""
    return json.loads((pathlib.Path(directory) / "manifest.json").read_text())


def recipe_meta(name, directory=RECIPES_DIR):
    return str(pathlib.Path(directory) / f"{name}.meta")


def load_feeds(name, directory=RECIPES_DIR):
    """Placeholder node name -> the recipe's pool of 64 rows."""
    with np.load(pathlib.Path(directory) / f"{name}.npz") as data:
        return {key: data[key] for key in data.files}


SPARSE_PARTS = ("indices", "values", "shape")  # a sparse_placeholder's three feeds


def sparse_names(feeds):
    """The SparseTensors a pool holds as ``N/indices``, ``N/values`` and ``N/shape`` (one
    SparseTensor whose axis 0 counts the pool's rows), as a sparse_placeholder named N is fed."""
    heads = {key.rpartition("/")[0] for key in feeds if key.rpartition("/")[2] in SPARSE_PARTS}
    return sorted(h for h in heads if h and all(f"{h}/{p}" in feeds for p in SPARSE_PARTS))


def pool_rows(feeds, key):
    """How many examples the pool of feed ``key`` holds."""
    head, _, part = key.rpartition("/")
    if part in SPARSE_PARTS and head in sparse_names(feeds):
        return int(feeds[f"{head}/shape"][0])
    return len(feeds[key])


def batch(feeds, step, batch_size):
    """The feed_dict of one step: rows [step*B, (step+1)*B) of each pool, wrapping; of a
    SparseTensor's pool, the entries of those rows, renumbered from 0."""
    sparse = sparse_names(feeds)
    members = {f"{h}/{p}" for h in sparse for p in SPARSE_PARTS}
    feed_dict = {}
    for name, pool in feeds.items():
        if name not in members:
            rows = (step * batch_size + np.arange(batch_size)) % len(pool)
            feed_dict[name + ":0"] = pool[rows]
    for head in sparse:
        indices, values, shape = (feeds[f"{head}/{p}"] for p in SPARSE_PARTS)
        rows = (step * batch_size + np.arange(batch_size)) % int(shape[0])
        picked = [np.flatnonzero(indices[:, 0] == row) for row in rows]
        new_indices = np.concatenate([indices[p] for p in picked])
        new_indices[:, 0] = np.concatenate([np.full(len(p), j) for j, p in enumerate(picked)])
        feed_dict[f"{head}/indices:0"] = new_indices
        feed_dict[f"{head}/values:0"] = values[np.concatenate(picked)]
        feed_dict[f"{head}/shape:0"] = np.concatenate([[batch_size], shape[1:]]).astype(
            shape.dtype)
    return feed_dict


@dataclasses.dataclass
class LoopResult:
    losses: list          # per step: the loss fetched with each train op, in order
    global_steps: list    # global_step after each step ([] when the graph has none)
    extras: list          # per step: values of entry["extra_fetches"] (last train op's run)
    variables: dict       # variable op name -> value after the loop (global variables)


def run_user_loop(meta, entry, feeds, steps=3, *, batch_size=None, restore=None,
                  save_initial=None, variables=None, config=None, check_graph=None):
    """Run ``steps`` steps of the user's loop on ``meta`` (path or MetaGraphDef).

    entry: a manifest entry (train_ops, losses, extra_fetches, global_step,
    batch_size).  feeds: placeholder name -> row pool (feed fewer names to leave
    optional placeholders unfed).  restore: checkpoint prefix to restore after
    initializing, through the graph's saver (or a new Saver when it has none).
    save_initial: checkpoint prefix to write right after initialization.
    variables: names of variables to read at the end (default: every global
    variable).  check_graph(graph): called after the import, before running.
    """
    import tensorflow as tf
    v1 = tf.compat.v1
    batch_size = batch_size or entry["batch_size"]
    graph = tf.Graph()
    with graph.as_default():
        saver = v1.train.import_meta_graph(meta)
        if check_graph is not None:
            check_graph(graph)
        train_ops = [_fetchable(graph, name) for name in entry["train_ops"]]
        losses = [graph.get_tensor_by_name(name) for name in entry["losses"]]
        extras = [graph.get_tensor_by_name(name) for name in entry.get("extra_fetches", [])]
        by_name = {v.op.name: v for v in v1.global_variables()}
        step_var = by_name[entry["global_step"]] if entry.get("global_step") else None
        init = [v1.global_variables_initializer(), v1.local_variables_initializer(),
                v1.tables_initializer()]
        if (restore or save_initial) and saver is None:
            saver = v1.train.Saver()
        with v1.Session(graph=graph, config=config) as sess:
            sess.run(init)
            if restore:
                saver.restore(sess, restore)
            if save_initial:
                saver.save(sess, save_initial, write_meta_graph=False)
            result = LoopResult([], [], [], {})
            for step in range(steps):
                feed_dict = batch(feeds, step, batch_size)
                step_losses = []
                for i, (train_op, loss) in enumerate(zip(train_ops, losses)):
                    last = i == len(train_ops) - 1
                    _, loss_value, extra_values = sess.run(
                        [train_op, loss, extras if last else []], feed_dict)
                    step_losses.append(float(loss_value))
                result.losses.append(step_losses)
                result.extras.append(extra_values)
                if step_var is not None:
                    result.global_steps.append(int(sess.run(step_var)))
            names = list(by_name) if variables is None else list(variables)
            result.variables = dict(zip(names, sess.run([by_name[n] for n in names])))
    return result


def _fetchable(graph, name):
    """A train op given as an op name (``d_train``) or a tensor (``train_op/x:0``)."""
    return graph.get_tensor_by_name(name) if ":" in name else graph.get_operation_by_name(name)


def before_and_after(name, transform, replicas, tmp_path, steps=3):
    """The user's loop on recipe ``name`` and on ``transform(GraphIR)``'s output, from one
    checkpoint: (single-device LoopResult, transformed LoopResult). ``transform`` transforms
    the loaded IR in place; the output runs with ``replicas`` CPU devices."""
    import tensorflow as tf

    from graphxform import metagraph
    entry, feeds = load_manifest()[name], load_feeds(name)
    start = str(pathlib.Path(tmp_path) / "start")
    before = run_user_loop(recipe_meta(name), entry, feeds, steps, save_initial=start)
    ir = metagraph.load(recipe_meta(name))
    transform(ir)
    config = tf.compat.v1.ConfigProto(device_count={"CPU": replicas})
    after = run_user_loop(metagraph.to_metagraph(ir), entry, feeds, steps, restore=start,
                          config=config)
    return before, after
