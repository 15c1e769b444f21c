"""The process-wide worker threads that run Inferencers' engine loops (:data:`WORKERS`)."""

from __future__ import annotations

import queue
import sys
import threading

import mlx.core as mx


class Workers:
    """The threads that run Inferencers' engine loops, each kept for the next Inferencer.

    MLX gives every thread that runs ops streams of its own (the worker's, and the CPU
    policy's attention streams), each served by a thread that lives as long as the process.
    A new thread per Inferencer would leave those behind at every close; reusing the
    workers keeps them to one set per Inferencer open at a time.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []

    def run(self, fn) -> threading.Event:
        """Run ``fn()`` on an idle worker (or a new one); the event is set once it returned."""
        done = threading.Event()
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name="slotinfer-worker", daemon=True).start()
        inbox.put((fn, done))
        return done

    def _serve(self, inbox):
        stream = mx.new_stream(mx.default_device())
        while True:
            fn, done = inbox.get()
            try:
                with mx.stream(stream):
                    fn()
            except BaseException:  # a bug in the loop: reported, and the worker serves on
                sys.excepthook(*sys.exc_info())
            finally:
                mx.synchronize(stream)  # no device work of one Inferencer outlives its run
                # Waiting idle, hold nothing of the last run: its job may refer to an Inferencer,
                # whose slot table must be freed once its user lets go of it.
                fn = None
                with self._lock:
                    self._idle.append(inbox)
                done.set()
                done = None


WORKERS = Workers()
