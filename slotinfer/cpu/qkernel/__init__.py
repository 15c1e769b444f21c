"""slotinfer's native CPU extension.  Quantized linear layers: ``x @ dequant(W).T`` as an MLX
primitive, W in GGUF Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q4_K / Q6_K blocks as the file stores them, float32 activations and
accumulation.  And a decode step's RMSNorm, rope from tables and attention over pool blocks, one
MLX node each (``decode_ops.h``), and a prefill's attention (``prefill_attention.h``); the CPU ops
use them: :func:`slotinfer.cpu.ops.cpu_ops`.

The extension (``module.cpp``, ``primitives.cpp``, ``prefill_attention.cpp``, loops in ``kernels.h``
and ``prefill_loops.h``) is compiled when
slotinfer is installed (``setup.py``), against the mlx wheel of the build environment; :func:`load`
imports it on first use, and only under that same mlx version.  Where it is missing or unusable,
:func:`load` returns None and :func:`status` says why: the CPU policy then computes these layers in
float32 (:func:`slotinfer.device.cpu_block_kernels`, docs/quantized-cpu.md).
"""

from __future__ import annotations

import importlib

from ... import settings

# GGUF type names -> the extension's format names
FORMATS = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0", "Q4_K": "q4_k", "Q6_K": "q6_k"}
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q4_k": 144, "q6_k": 210}  # a block, as stored
BLOCK_VALUES = {"q8_0": 32, "q4_0": 32, "q4_1": 32, "q5_0": 32, "q4_k": 256, "q6_k": 256}  # its weights


def row_bytes(fmt: str, k: int) -> int:
    """The bytes of a weight row of ``k`` values in ``fmt`` blocks."""
    return k // BLOCK_VALUES[fmt] * BLOCK_BYTES[fmt]

_module = None
_error: str | None = None
_tried = False


def load():
    """The built extension, ready (its thread count set), or None (see :func:`status`)."""
    global _module, _error, _tried
    if not _tried:
        int8 = settings.int8_activations()  # a bad value raises here, naming the variable
        _tried = True
        try:
            _module = _import()
        except Exception as e:  # noqa: BLE001 - a broken build must leave the float32 path working
            _module, _error = None, f"it failed to load ({e!r})"
        if _module is not None:
            _module.set_int8_activations(int8)
    return _module


def _import():
    global _error
    import mlx.core as mx  # first: the extension binds mlx.core's types

    try:
        module = importlib.import_module(__name__ + "._qkernel")
    except ImportError as e:
        _error = (f"it was not built when slotinfer was installed ({e}); reinstall slotinfer with a C++20 "
                  "compiler at hand (pip install -e . in a checkout)")
        return None
    if module.mlx_version != mx.__version__:
        _error = (f"it was built against mlx {module.mlx_version} but mlx {mx.__version__} is installed; "
                  "reinstall slotinfer to rebuild it")
        return None
    # one Q8_0 block (d = 1.0, q = 0..31) against x = 1: an mx.array that does not pass (another
    # nanobind ABI than mlx.core's) or a wrong sum shows here, not inside a model
    block = mx.array([0, 60] + list(range(32)), dtype=mx.uint8).reshape(1, 34)
    try:
        got = module.qlinear(mx.ones((1, 32)), block, "q8_0").item()
    except (TypeError, RuntimeError, ValueError) as e:
        got = e
    if got != sum(range(32)):
        _error = f"its self-check failed ({got!r} where {sum(range(32))} was due); reinstall slotinfer"
        return None
    from .. import blas

    module.set_threads(blas.ensure_blas().threads or blas.usable_cores())
    return module


def status() -> str:
    """One line for ``slotinfer info``: the loops in use and their threads, or why there are none."""
    module = load()
    if module is None:
        return f"unavailable: {_error}"
    int8 = f", 8-bit activations ({module.int8_kernels()} loops)" if module.int8_activations() else ""
    return f"{module.kernels()} loops, {module.threads()} threads{int8}"


def qlinear(x, w, fmt: str, *, spare: bool = True):
    """``x @ dequant(w).T``: ``x`` float32 [..., k], ``w`` uint8 [n, :func:`row_bytes`] in ``fmt``
    (a name in :data:`FORMATS`).  ``spare``: at a few rows the product leaves a core to the thread
    that builds the next step meanwhile (False: every core, for a step the host waits for; the same
    values either way).  Raises RuntimeError where the extension is unavailable."""
    module = load()
    if module is None:
        raise RuntimeError(f"slotinfer's quantized CPU kernels are unavailable: {_error}")
    return module.qlinear(x, w, fmt, spare=spare)
