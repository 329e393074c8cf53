"""The drop-in contract on the corpus of public recipes, strategy allreduce, checked the way a
user's own loop uses the output: import_meta_graph, restore the original's checkpoint through the
output's saver, feed the original placeholder names, run the original train op name(s)
alternately, fetch the original loss names (tests/recipe_loop.py)."""

import numpy as np
import pytest
from recipe_loop import before_and_after, load_manifest, recipe_meta

from graphxform import equivalence, metagraph, strategies, training

MANIFEST = load_manifest()
EXACT = sorted(name for name, entry in MANIFEST.items() if entry["exact"])
INEXACT = sorted(name for name, entry in MANIFEST.items() if not entry["exact"])
RTOL = 1e-5


def user_loops(name, replicas, tmp_path):
    """(single-device result, allreduce result) of the user's loop from one checkpoint."""
    devices = [f"/device:CPU:{i}" for i in range(replicas)]
    return before_and_after(name, lambda ir: strategies.transform(ir, "allreduce",
                                                                  devices=devices),
                            replicas, tmp_path)


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("name", EXACT)
def test_exact_recipe_matches_single_device(name, replicas, tmp_path):
    before, after = user_loops(name, replicas, tmp_path)
    np.testing.assert_allclose(after.losses, before.losses, rtol=RTOL, atol=1e-7)
    assert after.global_steps == before.global_steps
    floor = equivalence.scale_floor(before.variables, before.variables)
    for diff in equivalence.compare_variables(before.variables, after.variables, {}, floor):
        assert diff.scaled <= RTOL, f"{name}: {diff.name} differs by {diff.scaled:.2e} (scaled)"
        assert diff.replica_spread <= RTOL, f"{name}: replicas of {diff.name} differ"


@pytest.mark.parametrize("name", INEXACT)
def test_inexact_recipe_trains_and_verify_names_the_reason(name, tmp_path):
    before, after = user_loops(name, 2, tmp_path)
    assert np.all(np.isfinite(after.losses))
    assert after.global_steps == before.global_steps
    original = metagraph.load(recipe_meta(name))
    reasons = " ".join(equivalence.mismatch_reasons(original, training.analyze(original)))
    for why in MANIFEST[name]["inexact_because"]:
        keyword = {"dropout": "random", "sampled softmax": "random"}.get(why, why)
        assert keyword.split()[0] in reasons, f"{name}: verify does not name {why}: {reasons}"


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_inspect_shows_steps_losses_and_where_gradients_are_reduced(name, run_cli):
    code, out, _ = run_cli("inspect", recipe_meta(name))
    assert code == 0
    entry = MANIFEST[name]
    for step, loss in zip(entry["train_ops"], entry["losses"]):
        assert f"step: {step}   loss: {loss}" in out
    section = out.split("where each gradient is born (and reduced across replicas):")[1]
    tg = training.analyze(metagraph.load(recipe_meta(name)))
    for var in tg.trainable:
        line = next(l for l in section.splitlines() if l.startswith(var.name + " "))
        assert var.gradient.tensors[0] in line
