"""tf_cnn_benchmarks' all-reduce specs: which algorithm reduces a gradient of a given size.

Grammar (sizes in bytes, with an optional k, m or g suffix; ranges ascending):

    spec      := part (":" size ":" part)*        e.g. "pscpu:32k:xring#2"
    part      := algorithm ("/" algorithm)? ("#" shards)?
    algorithm := "pscpu" | "psgpu" | "xring" | "nccl" | "collective"

A tensor smaller than the first size uses the first part, one smaller than the second size the
second, and so on. ``a/b`` is hierarchical: ``a`` inside a worker, ``b`` across workers (with
the replicas of one process, one worker, ``b`` has nothing to do). ``#k`` splits each tensor
into k shards reduced independently. This module only parses and chooses; the pass
``replicated-all-reduce`` builds the ops.
"""

from __future__ import annotations

import dataclasses
import re

from graphxform.errors import GraphxformError

ALGORITHMS = ("pscpu", "psgpu", "xring", "nccl", "collective")
GPU_ONLY = ("psgpu", "nccl")
_SIZE = re.compile(r"^(\d+)([kmg]?)$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


@dataclasses.dataclass(frozen=True)
class Part:
    algorithm: str  # within a worker
    across: str | None = None  # across workers (hierarchical), if given
    shards: int = 1
    text: str = ""


@dataclasses.dataclass(frozen=True)
class Spec:
    parts: tuple  # Part per size range
    limits: tuple  # ascending byte sizes between the parts (len(parts) - 1)
    text: str = ""

    def part_for(self, nbytes: int) -> Part:
        for limit, part in zip(self.limits, self.parts):
            if nbytes < limit:
                return part
        return self.parts[-1]

    def require_devices(self, devices) -> None:
        """A GPU-only algorithm on CPU replicas is a one-line error naming the part."""
        on_gpu = all("GPU" in d.upper() for d in devices)
        for part in self.parts:
            for algorithm in (part.algorithm, part.across):
                if algorithm in GPU_ONLY and not on_gpu:
                    raise GraphxformError(
                        f"--all-reduce-spec {self.text}: '{part.text}' uses {algorithm}, which "
                        "needs GPU replicas (these replicas are on CPU devices)")


def parse(text: str) -> Spec:
    """Parse an all-reduce spec; a malformed one is a one-line error naming the bad piece."""
    if not text or not text.strip():
        raise GraphxformError("--all-reduce-spec is empty")
    pieces = text.strip().split(":")
    if len(pieces) % 2 == 0:
        raise GraphxformError(f"--all-reduce-spec {text}: expected part(:size:part)*, got "
                              f"{len(pieces)} ':'-separated pieces")
    parts = tuple(_part(text, piece) for piece in pieces[0::2])
    limits = tuple(_size(text, piece) for piece in pieces[1::2])
    if any(b <= a for a, b in zip(limits, limits[1:])):
        raise GraphxformError(f"--all-reduce-spec {text}: sizes must ascend")
    return Spec(parts, limits, text.strip())


def _part(spec: str, piece: str) -> Part:
    body, _, shards = piece.partition("#")
    if _ and not shards.isdigit():
        raise GraphxformError(f"--all-reduce-spec {spec}: shard count '{shards}' in '{piece}' "
                              "is not a whole number")
    count = int(shards) if shards else 1
    if count < 1:
        raise GraphxformError(f"--all-reduce-spec {spec}: '{piece}' needs at least one shard")
    names = body.split("/")
    if len(names) > 2:
        raise GraphxformError(f"--all-reduce-spec {spec}: '{piece}' has more than two levels")
    for name in names:
        if name not in ALGORITHMS:
            raise GraphxformError(f"--all-reduce-spec {spec}: unknown algorithm '{name}' "
                                  f"(known: {', '.join(ALGORITHMS)})")
    return Part(names[0], names[1] if len(names) == 2 else None, count, piece)


def _size(spec: str, piece: str) -> int:
    match = _SIZE.match(piece)
    if not match:
        raise GraphxformError(f"--all-reduce-spec {spec}: '{piece}' is not a size in bytes "
                              "(e.g. 4096, 32k, 1m)")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]
