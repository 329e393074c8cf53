"""CPU seconds of the in-process pipeline for whichever graphxform is on PYTHONPATH, to compare
two versions of the code in one period of the (shared, noisy) machine: run it for the old tree
and the new one in turn, twice.

    PYTHONPATH=/path/to/old python tools/bench_ab.py MODEL.meta [REPEATS]
    PYTHONPATH=/path/to/new python tools/bench_ab.py MODEL.meta [REPEATS]

Prints, best of REPEATS after one warm-up: load + transform (allreduce, 8 replicas,
verification on), emit (`metagraph.to_bytes`), their sum (the pipeline), and the TF check
`apply` ends with (`verify.check_imports`). CPU time, not wall time: other processes on the
machine stretch wall time far more than a process's own CPU time."""

import gc
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main(argv):
    from graphxform import metagraph, strategies, verify
    path, repeats = os.path.expanduser(argv[0]), int(argv[1]) if len(argv) > 1 else 3
    devices = [f"/device:CPU:{i}" for i in range(8)]
    best = None
    for round_ in range(repeats + 1):
        start = time.process_time()
        ir = metagraph.load(path)
        strategies.transform(ir, "allreduce", devices=devices, verify=True)
        transformed = time.process_time()
        metagraph.to_bytes(ir)
        emitted = time.process_time()
        verify.check_imports(ir)
        checked = time.process_time()
        times = (transformed - start, emitted - transformed, emitted - start, checked - emitted)
        if round_:  # the first round warms caches and imports
            best = times if best is None else tuple(map(min, best, times))
        del ir
        gc.collect()
    print("load+transform {:.3f}  emit {:.3f}  pipeline {:.3f}  check_imports {:.3f}"
          .format(*best))


if __name__ == "__main__":
    main(sys.argv[1:])
