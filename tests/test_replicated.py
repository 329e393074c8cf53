"""Strategies `replicated` (tf_cnn_benchmarks' all-reduce specs) and `independent`."""

import pytest
from conftest import fixture_path
from recipe_loop import before_and_after, load_manifest

from graphxform import allreduce_spec, equivalence, metagraph, strategies
from graphxform.errors import GraphxformError

MANIFEST = load_manifest()
EXACT = sorted(name for name, entry in MANIFEST.items() if entry["exact"])
CPU_SPECS = ["collective", "pscpu", "xring", "pscpu#3", "xring#2", "pscpu:1k:xring#2",
             "collective/pscpu"]


@pytest.mark.parametrize("text, parts, limits", [
    ("pscpu", [("pscpu", None, 1)], []),
    ("xring#4", [("xring", None, 4)], []),
    ("nccl/xring", [("nccl", "xring", 1)], []),
    ("psgpu/pscpu#2", [("psgpu", "pscpu", 2)], []),
    ("pscpu:32k:xring", [("pscpu", None, 1), ("xring", None, 1)], [32 * 1024]),
    ("collective:1k:pscpu#2:4m:xring", [("collective", None, 1), ("pscpu", None, 2),
                                        ("xring", None, 1)], [1024, 4 << 20]),
    (" collective ", [("collective", None, 1)], []),
])
def test_spec_forms(text, parts, limits):
    spec = allreduce_spec.parse(text)
    assert [(p.algorithm, p.across, p.shards) for p in spec.parts] == parts
    assert list(spec.limits) == limits


def test_spec_chooses_by_size():
    spec = allreduce_spec.parse("pscpu:1k:xring:1m:collective")
    assert [spec.part_for(n).algorithm for n in (0, 1023, 1024, (1 << 20) - 1, 1 << 20)] == [
        "pscpu", "pscpu", "xring", "xring", "collective"]


@pytest.mark.parametrize("text, message", [
    ("", "empty"),
    ("ring", "unknown algorithm 'ring'"),
    ("pscpu:32k", "expected part"),
    ("pscpu:32q:xring", "'32q' is not a size"),
    ("pscpu#two", "shard count 'two'"),
    ("pscpu#0", "at least one shard"),
    ("pscpu/xring/nccl", "more than two levels"),
    ("pscpu:1m:xring:1k:nccl", "sizes must ascend"),
])
def test_malformed_specs_are_one_line_errors(text, message):
    with pytest.raises(GraphxformError, match=message):
        allreduce_spec.parse(text)


@pytest.mark.parametrize("text", ["nccl", "psgpu", "pscpu:1k:nccl", "pscpu/psgpu"])
def test_gpu_only_specs_refused_on_cpus_naming_the_part(text):
    with pytest.raises(GraphxformError, match="needs GPU replicas"):
        strategies.transform(metagraph.load(fixture_path("mlp_sgd")), "replicated",
                             devices=["/device:CPU:0", "/device:CPU:1"], all_reduce_spec=text)


@pytest.mark.slow
@pytest.mark.parametrize("spec", CPU_SPECS)
@pytest.mark.parametrize("name", EXACT)
def test_every_cpu_spec_matches_one_device_on_the_corpus(name, spec, tmp_path):
    options = {"gradient_repacking": 3} if "#" in spec else {}
    before, after = before_and_after(name, lambda ir: strategies.transform(
        ir, "replicated", devices=["/device:CPU:0", "/device:CPU:1"], all_reduce_spec=spec,
        **options), 2, tmp_path)
    for got, expected in zip(after.losses, before.losses):
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-7)
    floor = equivalence.scale_floor(before.variables, before.variables)
    for diff in equivalence.compare_variables(before.variables, after.variables, {}, floor):
        assert diff.scaled <= 1e-5 and diff.replica_spread == 0.0, diff


@pytest.mark.parametrize("options", [{"gradient_repacking": 2},
                                     {"agg_small_grads_max_bytes": 100,
                                      "agg_small_grads_max_group": 2}])
@pytest.mark.parametrize("spec", ["xring", "pscpu"])
def test_repacking_and_aggregation_verify_at_three_replicas(spec, options):
    ir = metagraph.load(fixture_path("cnn_momentum"))
    strategies.transform(ir, "replicated", devices=[f"/device:CPU:{i}" for i in range(3)],
                         all_reduce_spec=spec, **options)
    report = equivalence.compare(metagraph.load(fixture_path("cnn_momentum")), ir,
                                 fixture_path("cnn_momentum", ".npz"), steps=3, batch_size=12)
    assert report.ok, equivalence.format_report(report)


def test_options_of_replicated_are_refused_elsewhere(run_cli, tmp_path):
    code, _, err = run_cli("apply", fixture_path("mlp_sgd"), "--replicas", 2,
                           "--gradient-repacking", 2, "-o", tmp_path / "out.meta")
    assert code != 0 and "--gradient-repacking is an option of --strategy replicated" in err


def test_independent_trains_apart_and_verify_says_why(run_cli):
    code, out, _ = run_cli("verify", fixture_path("mlp_sgd"), "--strategy", "independent",
                           "--replicas", 2, "--feeds", fixture_path("mlp_sgd", ".npz"),
                           "--steps", 3)
    assert code == 1
    assert "never exchange gradients (--strategy independent)" in out


def test_independent_replicas_start_equal_and_drift():
    ir = metagraph.load(fixture_path("mlp_sgd"))
    strategies.transform(ir, "independent", devices=["/device:CPU:0", "/device:CPU:1"])
    assert not ir.has_scope("allreduce/")
    report = equivalence.compare(metagraph.load(fixture_path("mlp_sgd")), ir,
                                 fixture_path("mlp_sgd", ".npz"), steps=2, batch_size=16)
    assert max(d.replica_spread for d in report.variables) > 1e-3
