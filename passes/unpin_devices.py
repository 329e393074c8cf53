"""unpin-devices: on a cluster, drop the device pins of the single-device input.

A graph built for one machine names that machine's devices: a model or its variables built under
``with tf.device("/cpu:0")`` or ``"/device:GPU:0"``, or ``/job:localhost/replica:0/task:0/...``,
kept by ``export_meta_graph(clear_devices=False)``. On a cluster the strategy places what it
places (each replica on its worker, each variable on its ps task); a node it leaves shared (a
variable's reads, hyper-parameters, an assert's constants, the placeholders) would keep the pin,
and a cluster session, which has no ``localhost`` job and no soft placement, refuses to place
it. So every pin is dropped first, and what no pass places runs in the client (the chief), as in
an input exported without devices. Colocation (``_class``) is kept."""

from __future__ import annotations

import dataclasses

from graphxform.pipeline import Pass, PassResult


@dataclasses.dataclass
class UnpinDevices(Pass):
    name = "unpin-devices"

    def run(self, ir, ctx):
        pinned = [n for n in ir.nodes() if ir.node(n)["device"]]
        for name in pinned:
            ir.node(name)["device"] = ""
        return PassResult(modified=bool(pinned), summary={"unpinned": len(pinned)})
