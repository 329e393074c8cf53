"""The threads that fill a graph's TF1 input queues (its QueueRunners: `tf.compat.v1.train.batch`
and the like), started and stopped as a TF1 training loop does, for the local runner and for
each task of a cluster. Without them a step's dequeue waits for ever."""

from __future__ import annotations


class InputThreads:
    """Start with ``start()`` once the variables are ready; ``stop()`` before the session
    closes (also when nothing was started)."""

    def __init__(self, graph, session):
        self.graph, self.session = graph, session
        self._coordinator, self._threads = None, []

    def start(self) -> None:
        import tensorflow as tf
        tf1 = tf.compat.v1
        if self._coordinator is not None:
            return
        self._coordinator = tf1.train.Coordinator()
        with self.graph.as_default():
            for runner in self.graph.get_collection(tf1.GraphKeys.QUEUE_RUNNERS):
                self._threads += runner.create_threads(self.session, coord=self._coordinator,
                                                       daemon=True, start=True)

    def stop(self) -> None:
        """request_stop closes the queues, which wakes an enqueue waiting on a full one; the
        threads are daemons, so one stuck in TF cannot hold the exit."""
        if not self._threads:
            return
        self._coordinator.request_stop()
        try:
            self._coordinator.join(self._threads, stop_grace_period_secs=5,
                                   ignore_live_threads=True)
        except Exception:  # noqa: BLE001 - a thread's own failure; the step reported it
            pass
        self._threads = []
