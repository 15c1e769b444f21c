"""Prototype: a quantized linear layer on CPU as an MLX primitive (``x @ dequant(W).T``, W in GGUF
Q8_0 / Q4_0 / Q4_1 blocks, float32 activations and accumulation).  See ``qkernels.h`` for the
loops and the order of their sums, and ``docs/benchmarks.md`` ("Quantized linear layers on CPU")
for what they measure.  Not part of the install and not used by the model yet: build it with
``sh slotinfer/cpu/qkernel/build.sh .venv/bin/python``.  Import after ``mlx.core``.

``qlinear`` is None (and ``error`` says why) when the extension is not built.
"""

from __future__ import annotations

import importlib

qlinear = None
module = None
error: str | None = None
try:
    import mlx.core  # noqa: F401  (the extension binds mlx.core's types)

    module = importlib.import_module(__name__ + "._qkernel")
    qlinear = module.qlinear
except ImportError as e:  # not built, or built against another mlx
    error = str(e)

# GGUF type names -> the extension's format names
FORMATS = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}
