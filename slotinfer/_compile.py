"""``mx.compile`` with one compiled function per thread, and a bounded number of traces.

MLX keeps compiled traces in thread-local storage and frees a thread's traces in a C++
thread-exit destructor, which touches Python objects.  A worker thread whose traces are still
alive when it ends can reach that destructor after the interpreter has begun finalizing, and
the process aborts at exit ("terminate called without an active exception").  Holding the
compiled function in a ``threading.local`` frees its trace while the thread still holds the
GIL (CPython clears a thread's locals before ``Thread.join`` returns), so nothing is left for
the C++ destructor.

MLX also traces a compiled function anew for every new set of input shapes and keeps every
trace for as long as the function lives: an op called on a prefill's activations
(``[rows, width, ...]``, a shape per prompt length) gathers a trace per shape the traffic
ever brought.  So each shape gets a compiled function of its own, and a thread keeps the
:data:`MAX_VARIANTS` most recently used; dropping one frees its trace.  The same trace runs
whether it was kept or made again, so results do not change, only the time to trace (about a
millisecond) when an evicted shape comes back.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict

import mlx.core as mx

MAX_VARIANTS = 32  # traces a compiled function keeps per thread (shapes in use at once are far fewer)


class _Variants(OrderedDict):
    """One thread's compiled variants of a function, least recently used first (held weakly by
    :class:`ThreadCompiled`, so one of its own, not equal to another table of the same contents)."""

    __hash__ = object.__hash__
    __eq__ = object.__eq__


class ThreadCompiled:
    """``fn`` compiled once per calling thread and input signature (or run eagerly when ``enabled``
    is false), keeping at most ``most`` signatures per thread.

    Usable as a decorator: ``@ThreadCompiled``.
    """

    def __init__(self, fn, enabled: bool = True, *, most: int = MAX_VARIANTS):
        self.fn, self.enabled, self.most = fn, enabled, most
        self.traced = 0  # variants ever compiled, in every thread (a retrace after an eviction counts again)
        self._local = threading.local()
        self._tables: weakref.WeakSet[_Variants] = weakref.WeakSet()
        functools.update_wrapper(self, fn)

    @property
    def variants(self) -> int:
        """Compiled variants alive now, in every thread: at most ``most`` per thread, whatever shapes came."""
        return sum(len(t) for t in list(self._tables))

    def __call__(self, *args):
        if not self.enabled:
            return self.fn(*args)
        table = getattr(self._local, "variants", None)
        if table is None:
            table = self._local.variants = _Variants()
            self._tables.add(table)
        key = _signature(args)
        compiled = table.get(key)
        if compiled is None:
            # a callable object of its own: MLX keys its traces by the Python function's identity, and
            # frees them all when that compiled function is dropped
            compiled = table[key] = mx.compile(functools.partial(self.fn))
            self.traced += 1
            while len(table) > self.most:
                table.popitem(last=False)
        else:
            table.move_to_end(key)
        return compiled(*args)


def _signature(tree):
    """What MLX keys a trace by: each array's shape and dtype (in lists, tuples, dicts), other values as they are."""
    if isinstance(tree, mx.array):
        return tree.shape, tree.dtype
    if isinstance(tree, (list, tuple)):
        return type(tree), tuple(_signature(a) for a in tree)
    if isinstance(tree, dict):
        return dict, tuple((k, _signature(v)) for k, v in tree.items())
    return tree
