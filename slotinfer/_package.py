"""Whether ``import slotinfer`` found this package, or a folder of that name ahead of it on sys.path.

Run from the folder above a checkout, ``import slotinfer`` finds the checkout's root (a folder named
slotinfer without ``__init__.py``) first, as a namespace package; an editable install's finder still
serves the submodules, so ``slotinfer.ray`` loads and then fails far away ("module 'slotinfer' has no
attribute 'load'", in a Ray actor).  This says so in one line, where it first matters.
"""

from __future__ import annotations

import sys


def shadowed() -> str | None:
    """Why the ``slotinfer`` imported is not the package (None when it is)."""
    found = sys.modules.get("slotinfer")
    if found is None or getattr(found, "__file__", None) is not None:
        return None
    where = " and ".join(repr(str(p)) for p in getattr(found, "__path__", [])) or "a folder named slotinfer"
    return (f"'import slotinfer' found the folder {where} (no __init__.py: a checkout's root, seen from the folder "
            "above it) instead of the slotinfer package; run from another folder, such as the checkout itself")


def check():
    """ImportError with :func:`shadowed`'s line, if it has one."""
    why = shadowed()
    if why is not None:
        raise ImportError(why)
