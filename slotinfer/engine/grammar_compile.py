"""Compiling a constraint safely: first in a child process that may crash or be killed, then here.

llguidance's compiler recurses on the shape of what it compiles (about 5 KB of native stack per
link of a chain of Lark rules or JSON-schema ``$ref``s), and a compile may run for minutes.  Neither
a native stack overflow nor a running native call can be stopped inside this process.  So every
constraint is first compiled, and its first mask computed, in a child process
(``_grammar_worker.py``) on a thread with a ``STACK_BYTES`` stack:

- one that crashes the child (a stack overflow) is refused as too deeply nested;
- one past ``SLOTINFER_GRAMMAR_SECONDS`` is refused, and its child killed at once: its work stops;
- one the compiler or its first mask rejects is refused with llguidance's reason.

Only what the child compiled in time is compiled again here, on a thread with the same stack
(:func:`on_big_stack`), where it takes the time it took there.  At most ``RUNNING`` children
compile at once; ``WAITING`` more may wait for one, and past that a compile is refused with
:class:`~slotinfer.errors.GrammarBusy` (retryable).  The time bound runs from the start of a
compile, not from its wait, so slow constraints never make another request's small one fail.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import _grammar_worker  # a plain script module: it imports nothing of slotinfer
from ..errors import GrammarBusy, GrammarError

WORKER = Path(__file__).with_name("_grammar_worker.py")
STACK_BYTES = _grammar_worker.STACK_BYTES  # each compile thread's, here and in the children
RUNNING, WAITING, IDLE = 8, 32, 2  # children compiling at once, compiles waiting for one, warm children kept
_SETUP_SECONDS = 120.0  # a fresh child's start and tokenizer build (not the constraint's fault)


class _Child:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-u", str(WORKER), str(STACK_BYTES)],
                                     stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.tokenizers: set = set()

    def send(self, obj):
        data = pickle.dumps(obj)
        self.proc.stdin.write(struct.pack("<I", len(data)) + data)
        self.proc.stdin.flush()

    def receive(self, seconds: float):
        """The child's answer; None if it died; TimeoutError past ``seconds``."""
        out = self.proc.stdout
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([out], [], [], min(left, 0.25))
            if ready:
                break
        head = out.read(4)
        if len(head) < 4:
            return None
        (n,) = struct.unpack("<I", head)
        return pickle.loads(out.read(n))

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class Compiler:
    """The children that vet constraints (one per process, shared by every model)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._idle: list[_Child] = []
        self._running = self._waiting = self._starting = 0

    def vet(self, key, source, kind: str, value, json_options, limits: dict, seconds: float) -> str:
        """The llguidance grammar text of a constraint that compiles, with its first mask, within
        ``seconds`` in a child; raises GrammarError (or GrammarBusy when too many wait)."""
        child = self._take(key)
        threading.Thread(target=self._spare, args=(key, source), daemon=True).start()
        try:
            _prepare(child, key, source)
            child.send(("compile", key, kind, value, json_options, limits))
            answer = child.receive(seconds)
            if answer is None:  # it died: a native stack overflow
                child.kill()
                child = None
        except TimeoutError:
            child.kill()
            child = None
            raise _error(kind, f"the {kind} took longer than {seconds:g} s to compile (its compile was stopped); "
                               "simplify it, or raise SLOTINFER_GRAMMAR_SECONDS") from None
        except BaseException:
            if child is not None:
                child.kill()
                child = None
            raise
        finally:
            self._give_back(child)
        if answer is None:
            raise _error(kind, f"the {kind} is nested too deeply for the grammar compiler (it ran out of stack: a "
                               "long chain of rules or $refs, or deep nesting); flatten it")
        status, text = answer
        if status != "ok":
            raise _error(kind, f"the {kind} is not valid: {first_lines(text)}")
        return text

    def _spare(self, key, source):
        """Keep a warm child (tokenizer built) ready, so that a compile never waits for a start."""
        with self._cv:
            if sum(key in c.tokenizers for c in self._idle) + self._starting >= 1:
                return
            self._starting += 1
        child = None
        try:
            child = _Child()
            _prepare(child, key, source)
        except BaseException:
            if child is not None:
                child.kill()
            child = None
        finally:
            with self._cv:
                self._starting -= 1
                if child is not None and len(self._idle) < IDLE:
                    self._idle.append(child)
                    child = None
            if child is not None:
                child.kill()

    def _take(self, key) -> _Child:
        with self._cv:
            if self._running >= RUNNING:
                if self._waiting >= WAITING:
                    raise GrammarBusy(f"{self._running} constraints are compiling and {self._waiting} more wait; "
                                      "retry in a few seconds")
                self._waiting += 1
                try:
                    self._cv.wait_for(lambda: self._running < RUNNING)
                finally:
                    self._waiting -= 1
            self._running += 1
            ready = [c for c in self._idle if key in c.tokenizers]
            child = ready[-1] if ready else self._idle[-1] if self._idle else None
            if child is not None:
                self._idle.remove(child)
        if child is None or child.proc.poll() is not None:
            try:
                child = _Child()
            except BaseException:
                with self._cv:
                    self._running -= 1
                    self._cv.notify()
                raise
        return child

    def _give_back(self, child: _Child | None):
        with self._cv:
            self._running -= 1
            if child is not None and child.proc.poll() is None and len(self._idle) < IDLE:
                self._idle.append(child)
                child = None
            self._cv.notify()
        if child is not None:
            child.kill()

    def close(self):
        with self._cv:
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()


def _prepare(child: _Child, key, source):
    if key not in child.tokenizers:
        child.send(("tokenizer", key, source()))
        if child.receive(_SETUP_SECONDS) != ("ready",):
            raise RuntimeError("the grammar compiler's child process failed to start")
        child.tokenizers.add(key)


def on_big_stack(fn, *args):
    """``fn(*args)`` on a fresh thread with a ``STACK_BYTES`` stack (the one the child vetted it on)."""
    result, error = [], []

    def run():
        try:
            result.append(fn(*args))
        except BaseException as e:
            error.append(e)

    with _stack_lock:
        old = threading.stack_size(STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="slotinfer-grammar", daemon=True)
            thread.start()
        finally:
            threading.stack_size(old)
    thread.join()
    if error:
        raise error[0]
    return result[0]


_stack_lock = threading.Lock()
COMPILER = Compiler()


def first_lines(text: str, limit: int = 600) -> str:
    """llguidance's message without the parser state or backtrace it may append."""
    text = (text or "").split("\n<state>", 1)[0].split("\n<backtrace>", 1)[0].strip()
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _error(kind: str, message: str) -> GrammarError:
    e = GrammarError(message)
    e.param = kind
    return e


os.register_at_fork(after_in_child=lambda: COMPILER.__init__())  # a forked process starts its own children
