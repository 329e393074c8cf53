"""Pass, PassResult and Pipeline: run passes in order, verify after each, time and dump them."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, ClassVar

from graphxform.errors import ContractError, GraphxformError, PassError
from graphxform.ir import GraphIR, paused_gc


@dataclasses.dataclass
class PassResult:
    modified: bool
    summary: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class PassContext:
    """What passes share: the analysis of the input graph and what earlier passes recorded."""
    training: object = None  # graphxform.training.TrainingGraph of the input graph
    devices: list = dataclasses.field(default_factory=list)  # one per replica
    state: dict = dataclasses.field(default_factory=dict)  # pass name -> what it left for later
    cluster: object = None  # graphxform.cluster.Cluster for strategies that run on one
    strategy: str = ""

    @property
    def replicas(self) -> int:
        return len(self.devices)


class Pass:
    """A graph pass. Subclasses are dataclasses whose fields are their options."""
    name: ClassVar[str] = ""

    def run(self, ir: GraphIR, ctx: PassContext) -> PassResult:
        raise NotImplementedError

    def __str__(self) -> str:
        options = ",".join(f"{f.name}={getattr(self, f.name)}"
                           for f in dataclasses.fields(self)) if dataclasses.is_dataclass(self) else ""
        return f"{self.name}{{{options}}}" if options else self.name


@dataclasses.dataclass
class PassTiming:
    name: str
    seconds: float  # the pass and the structural check after it
    modified: bool
    summary: dict
    verify_seconds: float = 0.0  # the structural check alone


def refuse_oversized_output(model: str, replicas: int) -> None:
    """Refuse, before any work, an output that would pass the 2 GiB protobuf can hold
    (TensorFlow could not read it back): estimated as the model file's size times
    ``replicas``, since every replica copies the training step."""
    from graphxform.metagraph import PROTOBUF_LIMIT
    try:
        size = os.path.getsize(model)
    except OSError:  # loading it says what is wrong
        return
    estimate = size * max(replicas, 1)
    if estimate > PROTOBUF_LIMIT:
        raise GraphxformError(f"{model}: the output would be about {_size(estimate)} "
                              f"({replicas} replicas of {_size(size)}), more than the "
                              f"{_size(PROTOBUF_LIMIT + 1)} protobuf can hold; use fewer "
                              "replicas")


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} bytes"


class Pipeline:
    """Runs passes in order. Verifies the IR after each (``verify=False`` skips it; only the
    nodes a pass added or rewired are checked, and cycles through them), records
    per-pass time, and with ``dump_dir`` writes ``NN_<pass>.pbtxt`` after each and has
    ``draw(ir, stem)`` picture it beside (the inspector's; by default its collapsed DOT)."""

    def __init__(self, passes, verify: bool = True, dump_dir: str | None = None,
                 draw: Callable[[GraphIR, str], None] | None = None):
        self.passes = list(passes)
        self.verify = verify
        self.dump_dir = dump_dir
        self.draw = draw
        self.timings: list[PassTiming] = []

    def run(self, ir: GraphIR, ctx: PassContext | None = None) -> GraphIR:
        from graphxform import verify as verify_mod
        ctx = ctx or PassContext()
        if ir.source and os.path.isfile(ir.source):
            refuse_oversized_output(ir.source, ctx.replicas)
        self.timings = []
        if self.dump_dir:
            os.makedirs(self.dump_dir, exist_ok=True)
            self._dump(ir, 0, "input")
        for index, p in enumerate(self.passes, start=1):
            start = checked = time.perf_counter()
            try:
                with paused_gc():  # passes add and copy nodes by the ten thousand
                    result = p.run(ir, ctx)
                    checked = time.perf_counter()
                    if self.verify:
                        verify_mod.check_structure(ir, changed_only=True)
            except ContractError:
                raise  # a refusal of the graph, in the user's words, not a pass failing
            except GraphxformError as e:
                raise PassError(self._where(index) + str(e)) from e
            except Exception as e:  # a bug in a pass: still name it
                raise PassError(self._where(index) + f"{type(e).__name__}: {e}") from e
            end = time.perf_counter()
            self.timings.append(PassTiming(p.name, end - start, result.modified,
                                           result.summary, end - checked))
            if self.dump_dir:
                self._dump(ir, index, p.name)
        return ir

    def _where(self, index: int) -> str:
        before = [p.name for p in self.passes[: index - 1]]
        after = f" (after {', '.join(before)})" if before else ""
        return f"pass {self.passes[index - 1].name}{after}: "

    def _dump(self, ir: GraphIR, index: int, name: str) -> None:
        from graphxform import metagraph
        stem = os.path.join(self.dump_dir, f"{index:02d}_{name}")
        metagraph.write_atomic(stem + ".pbtxt", metagraph.serialize(ir, stem + ".pbtxt"))
        (self.draw or _default_draw())(ir, stem)

    def __str__(self) -> str:
        return ",".join(str(p) for p in self.passes)


def _default_draw() -> Callable[[GraphIR, str], None]:
    """The picture of a stage when nobody handed one: the inspector's `viz` default, looked up
    only when a stage is dumped (the pipeline does not depend on the inspector otherwise)."""
    import importlib
    return importlib.import_module("graphxform.inspector.viz").dump
