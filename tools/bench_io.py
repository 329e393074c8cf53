"""Time graphxform's load, analyse and emit on a large graph against the protobuf floor.

The floor is what any tool must pay to read and write the file: parse the .meta bytes into a
MetaGraphDef and serialize it again. Measured against it, in the same run:

  load     graphxform.metagraph.load(path)                       (read + parse + build the IR)
  analyse  graphxform.training.analyze(ir)
  emit     graphxform.metagraph.to_bytes(ir)

It also times a lower bound for any IR that keeps its edges in networkx's adjacency dicts, as
DESIGN.md's IR does: parse, read every input string out of the NodeDefs, and fill one
successor and one predecessor dict entry per (source, destination) pair; no port parsing, no
node data, no analysis, no emit. Where that alone passes the budget, no such IR meets it.

Each figure is the best (minimum) of --repeats runs after one warm-up run. The budget is
(load + analyse + emit) <= 3.0 x floor; the script exits 0 either way and says which. It also
checks once that the emitted MetaGraphDef equals the parsed one (lossless round trip).

The model is built on first use by tools/models.py and cached in --cache-dir.

Usage: python tools/bench_io.py [--model resnet50|transformer] [--repeats 5]
                                [--cache-dir ~/.cache/graphxform-bench] [--profile [N]]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import models  # noqa: E402  (tools/models.py)

BUDGET = 3.0
DEFAULT_CACHE = os.path.join("~", ".cache", "graphxform-bench")


def _best(fn, repeats: int):
    """(min seconds over ``repeats`` calls after one warm-up, last result)."""
    result = fn()  # warm-up: imports, caches, first-touch allocations
    best = float("inf")
    for _ in range(repeats):
        result = None
        gc.collect()
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def networkx_lower_bound(data: bytes, meta_cls):
    """Parse + read every input + fill succ/pred dicts: what a networkx-adjacency IR cannot
    skip when it loads a graph."""
    nodes = meta_cls.FromString(data).graph_def.node
    names = [nd.name for nd in nodes]
    inputs = [list(nd.input) for nd in nodes]
    succ = {name: {} for name in names}
    pred = {name: {} for name in names}
    keys = {}
    for dst, texts in zip(names, inputs):
        dst_pred = pred[dst]
        for text in texts:
            src = text[1:] if text[0] == "^" else text.partition(":")[0]
            succ[src][dst] = dst_pred[src] = keys
    return succ


def _profile(label: str, fn, top: int) -> None:
    fn()  # warm-up, as for the timings
    gc.collect()
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).strip_dirs().sort_stats("tottime")
    stats.print_stats(top)
    print(f"\n=== cProfile: {label} (top {top} by own time) ===")
    lines = out.getvalue().splitlines()
    start = next((i for i, ln in enumerate(lines) if "ncalls" in ln), 0)
    print("\n".join(ln for ln in lines[start:] if ln.strip()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(models.MODELS), default="resnet50")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure (best kept)")
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE,
                        help="where tools/models.py caches the built .meta (default %(default)s)")
    parser.add_argument("--profile", type=int, nargs="?", const=25, default=0, metavar="N",
                        help="also print the top N functions (own time) of load, analyse, emit")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    cache_dir = os.path.expanduser(args.cache_dir)
    t0 = time.perf_counter()
    path = models.MODELS[args.model](cache_dir)
    got_model = time.perf_counter() - t0

    from tensorflow.core.protobuf import meta_graph_pb2

    from graphxform import metagraph, training

    with open(path, "rb") as f:
        data = f.read()
    parsed = meta_graph_pb2.MetaGraphDef.FromString(data)
    print(f"model     {args.model}: {path}")
    print(f"          {len(parsed.graph_def.node)} nodes, {len(data) / 2**20:.2f} MiB "
          f"(ready in {got_model:.1f} s)")
    print(f"repeats   best of {args.repeats} after 1 warm-up")

    def floor():
        return meta_graph_pb2.MetaGraphDef.FromString(data).SerializeToString()

    t_floor, _ = _best(floor, args.repeats)
    t_load, ir = _best(lambda: metagraph.load(path), args.repeats)
    t_analyse, _ = _best(lambda: training.analyze(ir), args.repeats)
    t_emit, _ = _best(lambda: metagraph.to_bytes(ir), args.repeats)

    emitted = metagraph.to_metagraph(ir)
    lossless = emitted == parsed
    # Plain serialization orders map entries (attr) arbitrarily; TF writes them sorted.
    same_bytes = emitted.SerializeToString(deterministic=True) == data

    t_bound, _ = _best(lambda: networkx_lower_bound(data, meta_graph_pb2.MetaGraphDef),
                       args.repeats)
    total = t_load + t_analyse + t_emit
    print()
    print(f"{'phase':<24}{'seconds':>10}{'x floor':>10}")
    print(f"{'floor (parse+serialize)':<24}{t_floor:>10.4f}{1.0:>10.2f}")
    for label, t in (("load", t_load), ("analyse", t_analyse), ("emit (bytes)", t_emit)):
        print(f"{label:<24}{t:>10.4f}{t / t_floor:>10.2f}")
    print(f"{'total':<24}{total:>10.4f}{total / t_floor:>10.2f}")
    print(f"{'networkx lower bound':<24}{t_bound:>10.4f}{t_bound / t_floor:>10.2f}"
          "   (parse + read inputs + adjacency dicts only)")
    print()
    ratio = total / t_floor
    verdict = "within budget" if ratio <= BUDGET else "OVER budget"
    print(f"(load + analyse + emit) / floor = {ratio:.2f}x against {BUDGET:.1f}x: {verdict}")
    print(f"round trip: emitted MetaGraphDef {'==' if lossless else '!='} parsed one "
          f"({'lossless' if lossless else 'NOT LOSSLESS'}); "
          f"deterministic bytes {'identical to' if same_bytes else 'differ from'} the file")

    if args.profile:
        _profile("load", lambda: metagraph.load(path), args.profile)
        _profile("analyse", lambda: training.analyze(ir), args.profile)
        _profile("emit", lambda: metagraph.to_bytes(ir), args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
