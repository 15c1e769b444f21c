"""glibc's allocator, told to keep freed memory in the process (the CPU policy), and told to give
it back after a rare request that took far more than a step does.

A step allocates and frees the same large activations (a 32-slot LM head writes 19 MB of
logits; a 1024-token prefill 25 MB per MLP) over and over.  By default glibc returns the
freed top of the heap to the system, and the next step faults the pages back in, zeroed by
the kernel, a cost paid on every step.  Allocations up to 32 MiB are kept on the heap, and up to 1 GiB of
free heap is retained.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

_MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")
_tuned: bool | None = None


def retain_freed_memory() -> bool:
    """Apply the setting once per process, unless the process tunes glibc's malloc itself
    (``MALLOC_*_`` or ``GLIBC_TUNABLES``) or does not run on glibc.  Returns whether it is in force."""
    global _tuned
    if _tuned is None:
        _tuned = False
        if (sys.platform == "linux" and platform.libc_ver()[0] == "glibc"
                and not any(os.environ.get(v) for v in _MALLOC_ENV)):
            libc = ctypes.CDLL(None)
            M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
            _tuned = bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    return _tuned


def in_force() -> bool:
    """Whether :func:`retain_freed_memory` has applied the setting (without applying it)."""
    return bool(_tuned)


def release_free_memory() -> bool:
    """Return the free memory of every malloc arena to the system (glibc's ``malloc_trim``); False
    where there is no glibc.

    For after a rare, outsized request: tokenizing megabytes of text allocates hundreds of MB
    (each token's string, offsets and masks) on the tokenizer's threads' arenas, which glibc keeps
    once freed; without this an 8 MB prompt leaves the process 1.2 GB larger for good.  The heap a
    step reuses is faulted back in once, at the next step.
    """
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    ctypes.CDLL(None).malloc_trim(0)
    return True
