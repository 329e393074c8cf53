"""Benchmark `graphxform apply` as users type it, against the protobuf floor, in one run.

For each graph (ResNet-50 and a 24-layer transformer encoder, both from tools/models.py) at
``--replicas`` (8), every round runs each of these once, in turn:

- cli: ``graphxform apply --strategy allreduce --replicas 8 MODEL -o OUT`` in a subprocess,
  exactly as typed, default checks on (the structural check after every pass and the proof that
  TensorFlow accepts the output); wall time.
- startup: ``python -c "import tensorflow"`` in a subprocess, the bare start-up the issue
  names; the headline is cli less startup.
- own startup: what the cli pays before any work, its modules and TensorFlow's core alone (it
  no longer imports TF's Python API: graphxform/tf_import.py); cli less own startup is the
  stricter figure, printed beside the headline.
- floor: the protobuf floor, in this process. Parse the bytes into a MetaGraphDef, copy every
  NodeDef once per replica into a new graph (``replica_i/`` prefix on name and inputs, the
  replica's device), copy the rest of the MetaGraphDef once, serialize.
- import_graph_def: parse, ``tf.compat.v1.import_graph_def(graph_def, name="replica_i")`` once
  per replica into one tf.Graph under ``tf.device``, ``graph.as_graph_def()``, serialize.
- pipeline: what the cli does, in this process, phase by phase (the breakdown): ``metagraph.load``,
  ``strategies.transform(verify=True)`` (passes and the structural check after each),
  ``verify.check_imports`` (TensorFlow accepts the output), ``metagraph.to_bytes``.

Every method starts from the .meta file on disk (page-cached) and ends with the output bytes
(the cli writes them to a file). Each figure is the best of ``--repeats`` rounds after one
warm-up round; interleaved, a slow stretch of a shared machine hits every method alike.
Budgets: cli less startup <= 3.0x the floor; the pipeline with verification on (load, transform
with verify=True, emit) <= 2.0x the floor, also shown with the TensorFlow check.
Then the cli alone at 1, 2, 4, 8, 16, 32 replicas of ResNet-50 (less startup) with a
least-squares line, to show growth stays linear.

``--memory``: peak RSS of the cli on DenseNet-121 x 32 replicas (tools/models.py builds it; about
1 GB of output) less that of a bare ``import tensorflow``, against the output's size; budget 4x.
``--profile`` adds a cProfile of one in-process pipeline run per graph.

Usage: python tools/bench_transform.py [--repeats 3] [--quick] [--profile] [--memory]
Always exits 0 (a budget miss or a failing method is reported, not raised).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # tools/models.py

CLI_BUDGET = 3.0       # (cli - startup) / floor, at most
PIPELINE_BUDGET = 2.0  # in-process pipeline with verification on / floor, at most
MEMORY_BUDGET = 4.0    # (peak RSS of the cli - that of a bare TF import) / output bytes, at most
SCALING_REPLICAS = (1, 2, 4, 8, 16, 32)
QUICK_REPLICAS = (1, 2, 4, 8)


# ------------------------------------------------------------------ the methods

@dataclasses.dataclass
class Sample:
    seconds: float  # wall time
    nodes: int = 0
    out_bytes: int = 0
    phases: dict = dataclasses.field(default_factory=dict)  # seconds per phase; peak_rss
    passes: list = dataclasses.field(default_factory=list)  # [(pass, seconds, verify seconds)]
    cpu: float | None = None  # CPU time (a child's own, from its rusage; this process's)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def run_pipeline(path: str, devices: list[str], strategy: str, check: bool = True) -> Sample:
    """What ``apply`` does, in this process: load, transform (verify=True), check_imports,
    emit; each phase and each pass timed."""
    from graphxform import metagraph, strategies, verify
    clock = time.perf_counter
    c0, t0 = time.process_time(), clock()
    ir = metagraph.load(path)
    t1 = clock()
    pipeline = strategies.transform(ir, strategy, devices=devices, verify=True)
    c2, t2 = time.process_time(), clock()
    if check:
        verify.check_imports(ir)
    c3, t3 = time.process_time(), clock()
    data = metagraph.to_bytes(ir)
    c4, t4 = time.process_time(), clock()
    return Sample(t4 - t0, len(ir), len(data),
                  {"load": t1 - t0, "transform": t2 - t1, "check_imports": t3 - t2,
                   "emit": t4 - t3, "cpu_unchecked": (c2 - c0) + (c4 - c3),
                   "cpu_check_imports": c3 - c2},
                  [(t.name, t.seconds, t.verify_seconds) for t in pipeline.timings])


def cli_command(path: str, replicas: int, strategy: str, out: str) -> list[str]:
    """``graphxform apply`` exactly as a user types it (the installed console script)."""
    exe = shutil.which("graphxform") or os.path.join(os.path.dirname(sys.executable), "graphxform")
    return [exe, "apply", "--strategy", strategy, "--replicas", str(replicas), path, "-o", out]


def run_cli(path: str, replicas: int, strategy: str, out_dir: str) -> Sample:
    out = os.path.join(out_dir, f"out-{replicas}.meta")
    try:
        sample = measure_child(cli_command(path, replicas, strategy, out))
        sample.out_bytes = os.path.getsize(out)
        return sample
    finally:
        if os.path.exists(out):
            os.unlink(out)


def run_startup() -> Sample:
    return measure_child([sys.executable, "-c", "import tensorflow"])


def run_own_startup() -> Sample:
    """What the cli itself pays before any work: its modules and TensorFlow's core, without
    the TF Python API it no longer imports (graphxform/tf_import.py). cli less this is the
    stricter figure: cli less a bare `import tensorflow` credits the cli with 2 s it skips."""
    return measure_child([sys.executable, "-c", "import graphxform.cli; "
                          "from graphxform import tf_import; tf_import.core()"])


def measure_child(args: list[str]) -> Sample:
    """Run ``args``; its wall time, and its peak RSS in bytes (``phases["peak_rss"]``) read
    from the child's own rusage (os.wait4), so other children do not count. Raise on failure."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with proc.stdout, proc.stderr:
        out_reader = _Drain(proc.stdout)
        err_reader = _Drain(proc.stderr)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        out_reader.join()
        err_reader.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        text = (err_reader.data or out_reader.data).decode(errors="replace").strip()
        raise RuntimeError(f"exit {proc.returncode}: {(text.splitlines() or [''])[-1][:300]}")
    return Sample(seconds, phases={"peak_rss": usage.ru_maxrss * 1024},
                  cpu=usage.ru_utime + usage.ru_stime)


class _Drain(threading.Thread):
    """Read a child's pipe to its end in the background (so the child never blocks on it)."""

    def __init__(self, stream):
        super().__init__(daemon=True)
        self.stream, self.data = stream, b""
        self.start()

    def run(self):
        self.data = self.stream.read()


def run_floor(path: str, devices: list[str]) -> Sample:
    """Parse, one CopyFrom per node per replica with name/device/inputs rewritten, serialize."""
    from tensorflow.core.protobuf import meta_graph_pb2
    t0 = time.perf_counter()
    meta = meta_graph_pb2.MetaGraphDef.FromString(_read(path))
    out = meta_graph_pb2.MetaGraphDef()
    for field, value in meta.ListFields():  # everything but the nodes, once
        if field.name == "graph_def":
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            getattr(out, field.name).MergeFrom(value)
        else:
            getattr(out, field.name).CopyFrom(value)
    src = meta.graph_def
    dst = out.graph_def
    dst.versions.CopyFrom(src.versions)
    if src.HasField("library"):
        dst.library.CopyFrom(src.library)
    nodes = dst.node
    for i, device in enumerate(devices):
        prefix = f"replica_{i}/"
        caret = "^" + prefix
        for nd in src.node:
            new = nodes.add()
            new.CopyFrom(nd)
            new.name = prefix + nd.name
            new.device = device
            if nd.input:
                new.input[:] = [caret + s[1:] if s[0] == "^" else prefix + s for s in nd.input]
    data = out.SerializeToString()
    return Sample(time.perf_counter() - t0, len(nodes), len(data))


def run_import_graph_def(path: str, devices: list[str]) -> Sample:
    import tensorflow as tf
    from tensorflow.core.protobuf import meta_graph_pb2
    t0 = time.perf_counter()
    meta = meta_graph_pb2.MetaGraphDef.FromString(_read(path))
    graph = tf.Graph()
    with graph.as_default():
        for i, device in enumerate(devices):
            with tf.device(device):
                tf.compat.v1.import_graph_def(meta.graph_def, name=f"replica_{i}")
    graph_def = graph.as_graph_def()
    data = graph_def.SerializeToString()
    return Sample(time.perf_counter() - t0, len(graph_def.node), len(data))


def interleaved(methods: dict, repeats: int) -> dict:
    """Best (least total time) per method of ``repeats`` rounds, each round running every
    method once in turn, after an untimed warm-up round. Interleaved, a stretch of the shared
    machine running slow hits every method alike instead of one method's runs, so the ratios
    hold up; a method that fails is reported and left out of later rounds (its figure None).
    Each sample's ``cpu`` is the least CPU time of any round: other processes on a shared
    machine stretch wall time far more than CPU time."""
    best = {label: None for label in methods}
    least_cpu = {}
    failed = set()
    for round_ in range(repeats + 1):
        for label, fn in methods.items():
            if label in failed:
                continue
            gc.collect()
            start = time.process_time()
            sample = attempt(label, fn)
            if sample is None:
                failed.add(label)
                continue
            if sample.cpu is None:
                sample.cpu = time.process_time() - start
            if round_:
                least_cpu[label] = min(least_cpu.get(label, sample.cpu), sample.cpu)
                if best[label] is None or sample.seconds < best[label].seconds:
                    best[label] = sample
            del sample
    gc.collect()
    for label, sample in best.items():  # the least CPU time of any round, as wall time
        if sample is not None:
            sample.cpu = least_cpu[label]
    return best


def attempt(label: str, fn):
    """Run ``fn``; on failure print why and return None (the benchmark goes on)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported, not raised: the tool always exits 0
        print(f"  {label}: FAILED: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}")
        if os.environ.get("BENCH_DEBUG"):
            traceback.print_exc()
        return None


# ------------------------------------------------------------------ analysis and printing

def linear_fit(xs, ys):
    """Least squares y = slope * x + intercept; returns (slope, intercept, r2)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx if sxx else 0.0
    intercept = my - slope * mx
    ss_res = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    r2 = 1.0 - ss_res / ss_tot if ss_tot else 1.0
    return slope, intercept, r2


def _fmt(x, spec=".3f", missing="-"):
    return missing if x is None else format(x, spec)


def print_table(rows) -> None:
    head = ("graph", "nodes out", "floor s", "startup s", "cli s", "cli-startup x floor",
            "(CPU time)", "own startup s", "cli-own x floor", "pipeline s", "x floor", "(CPU time)", "+check s", "x floor",
            "import_graph_def s", "x floor")
    table = [head]
    for r in rows:
        table.append((
            r["graph"], str(r["nodes_out"] or "-"), _fmt(r["floor_s"]), _fmt(r["startup_s"]),
            _fmt(r["cli_s"]), _lenient_ratio(r["cli_ratio"]),
            _lenient_ratio(r["cli_cpu_ratio"]), _fmt(r["own_startup_s"]),
            _ratio(r["cli_own_ratio"], CLI_BUDGET), _fmt(r["pipeline_s"]),
            _ratio(r["pipeline_ratio"], PIPELINE_BUDGET),
            _ratio(r["pipeline_cpu_ratio"], PIPELINE_BUDGET), _fmt(r["pipeline_checked_s"]),
            _ratio(r["pipeline_checked_ratio"]), _fmt(r["import_graph_def_s"]),
            _ratio(r["import_ratio"])))
    widths = [max(len(row[c]) for row in table) for c in range(len(head))]
    for k, row in enumerate(table):
        print("  ".join(cell.ljust(w) if c == 0 else cell.rjust(w)
                        for c, (cell, w) in enumerate(zip(row, widths))))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def _lenient_ratio(x) -> str:
    """cli less a bare `import tensorflow`, which the cli no longer pays in full: below zero
    when the whole command takes less than that import (the stricter column follows)."""
    if x is not None and x < 0:
        return f"{x:.2f}x (cli < bare import)"
    return _ratio(x, CLI_BUDGET)


def _ratio(x, budget=None) -> str:
    if x is None:
        return "-"
    verdict = "" if budget is None else (" (within)" if x <= budget else " (OVER)")
    return f"{x:.2f}x{verdict}"


def _least_on_this_ir(sample: Sample) -> float:
    """Load, replicate (less its structural check) and emit: the pipeline's part that copies
    and writes every replica, which no faster pass or check can remove."""
    copying = sum(seconds - checked for name, seconds, checked in sample.passes
                  if name == "replicate")
    return sample.phases["load"] + copying + sample.phases["emit"]


def print_breakdown(name: str, sample: Sample) -> None:
    phases = "  ".join(f"{k} {v:.3f}" for k, v in sample.phases.items()
                       if not k.startswith("cpu"))
    print(f"  {name}: total {sample.seconds:.3f} s = {phases}")
    print(f"      {'pass':18s} {'seconds':>8s} {'of which verify':>16s}")
    for pass_name, seconds, verify_seconds in sample.passes:
        print(f"      {pass_name:18s} {seconds:8.3f} {verify_seconds:16.3f}")


def profile_hot_spots(path: str, devices: list[str], strategy: str, top: int) -> None:
    """cProfile one graphxform run; hot spots by own time, and the graphxform/passes functions
    by cumulative time (where a pass spends its time, including what it calls)."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    gc.collect()
    prof.enable()
    run_pipeline(path, devices, strategy)
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, func): (cc, nc, tt, ct, callers)}
    total = sum(tt for (_, _, tt, _, _) in stats.values())

    def where(key):
        file, line, func = key
        if file.startswith(REPO + os.sep):
            file = os.path.relpath(file, REPO)
        elif "site-packages" in file:
            file = file.split("site-packages" + os.sep, 1)[1]
        return f"{file}:{line}({func})"

    def ours(key):
        return key[0].startswith((os.path.join(REPO, "graphxform"), os.path.join(REPO, "passes")))

    def entered_from(key, depth=6):
        """The graphxform/passes functions through which the run reached ``key``, roughly most
        time first (each direct caller's share goes to the first of ours above it)."""
        found = {}
        for caller, edge in stats.get(key, (0, 0, 0, 0, {}))[4].items():
            stack, seen = [(caller, 0)], set()
            while stack:
                k, d = stack.pop()
                if k in seen:
                    continue
                seen.add(k)
                if ours(k):
                    found[k] = found.get(k, 0.0) + edge[3]
                elif d < depth:
                    stack.extend((c, d + 1) for c in stats.get(k, (0, 0, 0, 0, {}))[4])
        return [where(k) for k, _ in sorted(found.items(), key=lambda kv: -kv[1])]

    print(f"  cProfile of one run ({total:.2f} s of own time under the profiler)")
    print(f"  by own time (top {top}; '<-' = reached from):")
    for key, (_, nc, tt, ct, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]:
        via = "" if ours(key) else "  <- " + ", ".join(entered_from(key)[:2])
        print(f"    {tt:7.3f} s own {ct:7.3f} s cum {nc:9d} calls  {where(key)}{via}")
    print(f"  graphxform/ and passes/ by cumulative time (top {top}):")
    for key, (_, nc, tt, ct, _) in sorted(((k, v) for k, v in stats.items() if ours(k)),
                                          key=lambda kv: -kv[1][3])[:top]:
        print(f"    {ct:7.3f} s cum {tt:7.3f} s own {nc:9d} calls  {where(key)}")


# ------------------------------------------------------------------------ main

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="allreduce")
    parser.add_argument("--replicas", type=int, default=8, help="replicas for the comparison")
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/graphxform-bench"),
                        help="where tools/models.py builds (or finds) the .meta files")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per figure (best)")
    parser.add_argument("--models", default="resnet50,transformer",
                        help="comma-separated: resnet50, transformer, densenet121")
    parser.add_argument("--scaling-repeats", type=int, default=1,
                        help="timed rounds per replica count in the scaling sweep (best)")
    parser.add_argument("--quick", action="store_true",
                        help="scaling sweep at replicas 1,2,4,8 only")
    parser.add_argument("--no-scaling", action="store_true", help="skip the scaling sweep")
    parser.add_argument("--no-import-graph-def", action="store_true",
                        help="leave out the import_graph_def baseline (the slowest method)")
    parser.add_argument("--memory", action="store_true",
                        help="only the peak-memory figure: the cli on DenseNet-121 x 32")
    parser.add_argument("--memory-replicas", type=int, default=32)
    parser.add_argument("--profile", action="store_true",
                        help="cProfile one in-process pipeline run per graph")
    parser.add_argument("--top", type=int, default=15, help="rows per profile listing")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)

    import models
    import numpy
    import tensorflow as tf
    import google.protobuf

    try:
        from google.protobuf.internal import api_implementation
        pb_impl = api_implementation.Type()
    except Exception:  # noqa: BLE001
        pb_impl = "?"
    start = time.perf_counter()
    print(f"bench_transform: strategy {args.strategy}, best of {args.repeats} interleaved "
          f"rounds after 1 warm-up; python {platform.python_version()}, tensorflow "
          f"{tf.__version__}, protobuf {google.protobuf.__version__} ({pb_impl}), numpy "
          f"{numpy.__version__}, {os.cpu_count()} CPUs, load average "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    builders = {"resnet50": lambda: models.resnet50(args.cache_dir),
                "transformer": lambda: models.transformer(args.cache_dir, layers=24),
                "densenet121": lambda: models.densenet121(args.cache_dir)}
    out_dir = tempfile.mkdtemp(prefix="bench-transform-")
    report = {}
    try:
        if args.memory:
            report["memory"] = memory_figure(builders["densenet121"], args, out_dir)
        else:
            report.update(timing_figures(builders, args, out_dir))
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    elapsed = time.perf_counter() - start
    print(f"\ntotal benchmark time {elapsed:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report, "elapsed_s": elapsed}, f, indent=1, default=str)
    return 0


def timing_figures(builders: dict, args, out_dir: str) -> dict:
    """The interleaved comparison per graph, then the scaling sweep."""
    from tensorflow.core.protobuf import meta_graph_pb2
    devices = [f"/device:CPU:{i}" for i in range(args.replicas)]
    rows, details, paths = [], {}, {}
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        if name not in builders:
            print(f"{name}: unknown model (known: {', '.join(builders)})")
            continue
        t0 = time.perf_counter()
        path = attempt(f"{name} build", builders[name])
        if path is None:
            continue
        paths[name] = path
        nodes = len(meta_graph_pb2.MetaGraphDef.FromString(_read(path)).graph_def.node)
        print(f"\n{name}: {nodes} nodes, {os.path.getsize(path) / 2**20:.2f} MiB, {path} "
              f"(ready in {time.perf_counter() - t0:.1f} s)")
        methods = {
            "cli": lambda: run_cli(path, args.replicas, args.strategy, out_dir),
            "startup": run_startup,
            "own_startup": run_own_startup,
            "floor": lambda: run_floor(path, devices),
            "pipeline": lambda: run_pipeline(path, devices, args.strategy),
            "import_graph_def": lambda: run_import_graph_def(path, devices)}
        if args.no_import_graph_def:
            del methods["import_graph_def"]
        found = interleaved(methods, args.repeats)
        cli, startup, floor, pipe = (found[k] for k in ("cli", "startup", "floor", "pipeline"))
        imp, own = found.get("import_graph_def"), found.get("own_startup")
        for label, sample in found.items():
            if sample:
                print(f"  {label}: {sample.seconds:.3f} s (CPU time {sample.cpu:.3f} s)")
        if pipe:
            print_breakdown("pipeline (verify=True, check_imports)", pipe)
            print(f"      -> {pipe.nodes} nodes, {pipe.out_bytes / 2**20:.1f} MiB")
        least = pipe and _least_on_this_ir(pipe)
        if least and floor:
            print(f"      load + replicate + emit alone: {least:.3f} s = "
                  f"{least / floor.seconds:.2f}x the floor (what any pipeline on this IR pays: "
                  "every replica's nodes in networkx, and the output written)")
        checked = pipe and pipe.seconds
        unchecked = pipe and pipe.seconds - pipe.phases["check_imports"]
        rows.append({
            "graph": name, "nodes_in": nodes, "nodes_out": pipe and pipe.nodes,
            "replicas": args.replicas, "floor_s": floor and floor.seconds,
            "startup_s": startup and startup.seconds, "cli_s": cli and cli.seconds,
            "cli_ratio": (cli.seconds - startup.seconds) / floor.seconds
            if cli and startup and floor else None,
            "cli_cpu_ratio": (cli.cpu - startup.cpu) / floor.cpu
            if cli and startup and floor else None,
            "own_startup_s": own and own.seconds,
            "cli_own_ratio": (cli.seconds - own.seconds) / floor.seconds
            if cli and own and floor else None,
            "pipeline_cpu_ratio": pipe.phases["cpu_unchecked"] / floor.cpu
            if pipe and floor else None,
            "pipeline_s": unchecked, "pipeline_checked_s": checked,
            "pipeline_ratio": unchecked / floor.seconds if pipe and floor else None,
            "pipeline_checked_ratio": checked / floor.seconds if pipe and floor else None,
            "load_replicate_emit_ratio": least / floor.seconds if least and floor else None,
            "import_graph_def_s": imp and imp.seconds,
            "import_ratio": imp.seconds / floor.seconds if imp and floor else None})
        details[name] = {k: dataclasses.asdict(v) for k, v in found.items() if v}

    print(f"\n{args.strategy}, {args.replicas} replicas (budgets: cli - startup <= {CLI_BUDGET}x "
          f"floor, pipeline with verification on <= {PIPELINE_BUDGET}x floor; '+check' adds "
          "the TensorFlow check to the pipeline):")
    print_table(rows)
    scaling, fit = [], None
    if not args.no_scaling and "resnet50" in paths:
        scaling, fit = scaling_sweep(paths["resnet50"], args, out_dir)
    if args.profile:
        for name, path in paths.items():
            print(f"\nprofile: pipeline on {name}, {args.replicas} replicas")
            attempt("profile", lambda: profile_hot_spots(path, devices, args.strategy, args.top))
    return {"rows": rows, "details": details, "scaling": scaling, "scaling_fit": fit}


def scaling_sweep(path: str, args, out_dir: str) -> tuple[list, dict | None]:
    """The cli on ResNet-50 by replica count, less the cli's own start-up (its modules and
    TF's core: the bare `import tensorflow` is more than the cli pays now), interleaved."""
    counts = QUICK_REPLICAS if args.quick else SCALING_REPLICAS
    methods = {"startup": run_own_startup}
    for n in counts:
        methods[n] = lambda n=n: run_cli(path, n, args.strategy, out_dir)
    print(f"\ncli on resnet50 by replica count, less its own start-up, best of "
          f"{args.scaling_repeats} "
          "interleaved rounds after 1 warm-up:")
    found = interleaved(methods, args.scaling_repeats)
    startup = found.pop("startup")
    points = []
    print(f"  {'replicas':>8}  {'cli s':>7}  {'less startup':>12}  {'CPU s':>7}  "
          f"{'less startup':>12}  {'MiB out':>8}")
    for n, sample in found.items():
        if sample is None or startup is None:
            continue
        work, work_cpu = sample.seconds - startup.seconds, sample.cpu - startup.cpu
        points.append({"replicas": n, "cli_s": sample.seconds, "work_s": work,
                       "cli_cpu_s": sample.cpu, "work_cpu_s": work_cpu,
                       "out_bytes": sample.out_bytes})
        print(f"  {n:8d}  {sample.seconds:7.3f}  {work:12.3f}  {sample.cpu:7.3f}  "
              f"{work_cpu:12.3f}  {sample.out_bytes / 2**20:8.1f}")
    if len(points) < 2:
        return points, None
    fits = {}
    for key, label in (("work_s", "wall"), ("work_cpu_s", "CPU time")):
        slope, intercept, r2 = linear_fit([p["replicas"] for p in points],
                                          [p[key] for p in points])
        fits[key] = {"slope": slope, "intercept": intercept, "r2": r2}
        print(f"  linear fit ({label}): seconds = {slope:.4f} * replicas + {intercept:.4f}, "
              f"R^2 = {r2:.4f}")
    return points, fits


def memory_figure(build, args, out_dir: str) -> dict | None:
    """Peak RSS of the cli on DenseNet-121 x ``--memory-replicas``, less a bare TF import's,
    against the output's size."""
    t0 = time.perf_counter()
    path = attempt("densenet121 build", build)
    if path is None:
        return None
    print(f"\ndensenet121: {os.path.getsize(path) / 2**20:.2f} MiB, {path} "
          f"(ready in {time.perf_counter() - t0:.1f} s)")
    startup = attempt("startup", run_startup)
    own = attempt("own startup", run_own_startup)
    cli = attempt("cli", lambda: run_cli(path, args.memory_replicas, args.strategy, out_dir))
    if startup is None or cli is None or own is None:
        return None
    base, peak = startup.phases["peak_rss"], cli.phases["peak_rss"]
    own_base = own.phases["peak_rss"]
    ratio = (peak - base) / cli.out_bytes
    own_ratio = (peak - own_base) / cli.out_bytes
    verdict = "within" if ratio <= MEMORY_BUDGET else "OVER"
    print(f"  bare import tensorflow: peak RSS {base / 2**30:.2f} GiB, {startup.seconds:.1f} s")
    print(f"  apply x{args.memory_replicas}: peak RSS {peak / 2**30:.2f} GiB, "
          f"{cli.seconds:.1f} s, output {cli.out_bytes / 2**30:.2f} GiB")
    print(f"  peak RSS less the bare import: {(peak - base) / 2**30:.2f} GiB = {ratio:.2f}x the "
          f"output ({verdict} the {MEMORY_BUDGET}x budget)")
    print(f"  the cli's own start-up (TF's core alone): peak RSS {own_base / 2**30:.2f} GiB; "
          f"peak less that: {(peak - own_base) / 2**30:.2f} GiB = {own_ratio:.2f}x the output "
          "(the stricter figure)")
    return {"replicas": args.memory_replicas, "startup_rss": base, "own_startup_rss": own_base,
            "cli_rss": peak, "out_bytes": cli.out_bytes, "cli_s": cli.seconds, "ratio": ratio,
            "own_ratio": own_ratio}


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001 - the tool always exits 0 (usage errors keep their code)
        traceback.print_exc()
    sys.exit(0)
