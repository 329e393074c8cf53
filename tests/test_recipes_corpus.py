"""The corpus of public recipes (tests/fixtures/recipes, issue 12) runs as its users run it.

This is the single-device baseline the equivalence tests build on: every
fixture exists, every name the manifest gives is in the graph, and the
user's loop (tests/recipe_loop.py) trains 3 steps with finite losses.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from recipe_loop import (POOL_ROWS, RECIPES_DIR, load_feeds, load_manifest, pool_rows,
                         recipe_meta, run_user_loop)

MANIFEST = load_manifest()
REPO = RECIPES_DIR.parents[2]


def test_corpus_covers_issue_12():
    tags = set().union(*(entry["has"] for entry in MANIFEST.values()))
    wanted = {"tf_slim", "bn", "dropout", "fixed_batch", "clip", "lr_schedule",
              "two_train_ops", "tf_keras", "rnn", "regularization", "total_loss",
              "summaries", "check_numerics", "loss_scaling", "feature_columns",
              "two_optimizers", "sparse", "ema", "ref_vars", "unnamed_mean_loss",
              "placeholder_with_default", "unread_placeholder"}
    assert len(MANIFEST) >= 13
    assert wanted <= tags, sorted(wanted - tags)
    assert any(entry["exact"] for entry in MANIFEST.values())
    assert any(loss == "Mean_1:0" for entry in MANIFEST.values() for loss in entry["losses"])


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_recipe_trains_as_its_user_runs_it(name):
    entry = MANIFEST[name]
    assert os.path.exists(recipe_meta(name))
    assert os.path.getsize(recipe_meta(name)) < 1 << 20
    feeds = load_feeds(name)
    assert sorted(feeds) == entry["feeds"]
    assert all(pool_rows(feeds, key) == POOL_ROWS for key in feeds)
    assert len(entry["train_ops"]) == len(entry["losses"]) >= 1
    assert entry["exact"] == (not entry["inexact_because"])
    assert set(entry["feeds_optional"]) | set(entry["feeds"]) == set(entry["placeholders"])

    def names_exist(graph):
        for train_op in entry["train_ops"]:
            if ":" in train_op:
                graph.get_tensor_by_name(train_op)
            else:
                graph.get_operation_by_name(train_op)
        for loss in entry["losses"]:
            assert graph.get_tensor_by_name(loss).shape.rank == 0, loss
        for tensor in entry["extra_fetches"]:
            graph.get_tensor_by_name(tensor)
        for placeholder, spec in entry["placeholders"].items():
            assert graph.get_operation_by_name(placeholder).type == spec["op"]

    # Only the required feeds: optional placeholders stay unfed.
    result = run_user_loop(recipe_meta(name), entry, feeds, steps=3, check_graph=names_exist)
    losses = np.asarray(result.losses)
    assert losses.shape == (3, len(entry["losses"]))
    assert np.all(np.isfinite(losses)), losses
    if entry["global_step"]:
        assert result.global_steps == [1, 2, 3]
    assert result.variables and all(np.all(np.isfinite(v)) for v in result.variables.values()
                                    if np.asarray(v).dtype.kind == "f")


def test_user_loop_restores_a_checkpoint(tmp_path):
    """A checkpoint written after init restores: the same 3 steps give the same losses."""
    name = "gan_mlp"
    entry, feeds = MANIFEST[name], load_feeds(name)
    prefix = str(tmp_path / "initial")
    first = run_user_loop(recipe_meta(name), entry, feeds, save_initial=prefix)
    again = run_user_loop(recipe_meta(name), entry, feeds, restore=prefix)
    np.testing.assert_allclose(again.losses, first.losses, rtol=1e-6)


@pytest.mark.slow
def test_fixtures_match_a_fresh_build():
    """tools/recipes.py --check: files equal a fresh build, manifest claims hold."""
    pytest.importorskip("tf_slim")
    run = subprocess.run([sys.executable, "tools/recipes.py", "--check"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
