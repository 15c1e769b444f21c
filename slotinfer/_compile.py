"""``mx.compile`` with one compiled function per thread.

MLX keeps compiled traces in thread-local storage and frees a thread's traces in a C++
thread-exit destructor, which touches Python objects.  A worker thread whose traces are still
alive when it ends can reach that destructor after the interpreter has begun finalizing, and
the process aborts at exit ("terminate called without an active exception").  Holding the
compiled function in a ``threading.local`` frees its trace while the thread still holds the
GIL (CPython clears a thread's locals before ``Thread.join`` returns), so nothing is left for
the C++ destructor.
"""

from __future__ import annotations

import functools
import threading

import mlx.core as mx


class ThreadCompiled:
    """``fn`` compiled once per calling thread (or run eagerly when ``enabled`` is false).

    Usable as a decorator: ``@ThreadCompiled``.
    """

    def __init__(self, fn, enabled: bool = True):
        self.fn, self.enabled = fn, enabled
        self._local = threading.local()
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        if not self.enabled:
            return self.fn(*args)
        compiled = getattr(self._local, "compiled", None)
        if compiled is None:
            compiled = self._local.compiled = mx.compile(self.fn)
        return compiled(*args)
