"""Every ``SLOTINFER_*`` environment variable, read in this one module.

The table in ``docs/configuration.md`` lists them for users.  Nothing here imports MLX:
:mod:`slotinfer.cpu.blas` reads its variables before ``mlx.core`` is first imported.
Each function reads the environment when called, so a test or a benchmark that sets a
variable in a fresh process (or with ``monkeypatch``) sees it.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import SettingError


def _flag(name: str) -> bool:
    """An on-by-default switch: ``0`` turns it off, anything else (or unset) leaves it on."""
    return os.environ.get(name, "1").strip() != "0"


def blas() -> str:
    """``SLOTINFER_BLAS``: which BLAS MLX's f32 matmul goes through ('' = the fastest found)."""
    return os.environ.get("SLOTINFER_BLAS", "").strip()


def blas_threads() -> int | None:
    """``SLOTINFER_BLAS_THREADS``: the BLAS's thread count; None when unset (or not a whole
    number > 0), leaving the default of :func:`slotinfer.cpu.blas.usable_cores`."""
    value = os.environ.get("SLOTINFER_BLAS_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def own_gemm() -> bool:
    """``SLOTINFER_OWN_GEMM=0``: every product goes to the library, none to the shim's own loops."""
    return _flag("SLOTINFER_OWN_GEMM")


def quant_kernels() -> bool:
    """``SLOTINFER_QUANT_KERNELS=0``: on CPU, GGUF quantized weights are dequantized to float32
    at load instead of staying in their blocks for slotinfer's own kernels."""
    return _flag("SLOTINFER_QUANT_KERNELS")


def int8_activations() -> bool:
    """``SLOTINFER_INT8_ACTIVATIONS=1``: on CPU, the quantized kernels' products quantize each row of
    activations to 8 bits per block of 32 and multiply in integers (off by default: it changes the
    values).  Raises SettingError (a ValueError) on anything but 0 or 1."""
    value = os.environ.get("SLOTINFER_INT8_ACTIVATIONS", "").strip()
    if value not in ("", "0", "1"):
        raise SettingError(f"SLOTINFER_INT8_ACTIVATIONS={value!r}: expected 0 or 1 (1: the CPU's quantized "
                         "kernels take activations in 8 bits); unset it for the default, 0")
    return value == "1"


def own_math() -> bool:
    """``SLOTINFER_OWN_MATH=0``: MLX's own exp, softmax and RMSNorm on CPU too."""
    return _flag("SLOTINFER_OWN_MATH")


def native_ops() -> bool:
    """``SLOTINFER_NATIVE_OPS=0``: on CPU, RMSNorm, rope and decode attention stay MLX arithmetic
    instead of the native extension's primitives (one node each)."""
    return _flag("SLOTINFER_NATIVE_OPS")


def attention_streams() -> int | None:
    """``SLOTINFER_ATTENTION_STREAMS``: CPU streams a decode step's attention is split over;
    None when unset.  Raises SettingError (a ValueError) on anything but a whole number >= 1."""
    value = os.environ.get("SLOTINFER_ATTENTION_STREAMS", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise SettingError(f"SLOTINFER_ATTENTION_STREAMS={value!r}: expected a whole number >= 1 "
                         "(the CPU streams a decode step's attention is split over); unset it for the default")
    return int(value)


def compile_steps() -> bool:
    """``SLOTINFER_COMPILE=0``: the decode step runs eagerly (for debugging, and for comparing)."""
    return _flag("SLOTINFER_COMPILE")


def check_finite() -> bool:
    """``SLOTINFER_CHECK_FINITE=0``: ``load`` does not scan the weights for NaN and Inf."""
    return _flag("SLOTINFER_CHECK_FINITE")


def cache_dir() -> Path:
    """``SLOTINFER_CACHE``: where ``slotinfer bench`` and ``slotinfer demo`` keep the models
    they build; default ``~/.cache/slotinfer``.  The library itself writes nothing there."""
    value = os.environ.get("SLOTINFER_CACHE", "").strip()
    return Path(value) if value else Path.home() / ".cache" / "slotinfer"


def api_key() -> str | None:
    """``SLOTINFER_API_KEY``: the key ``slotinfer serve`` requires when ``--api-key`` is not given
    (kept out of the process list); None when unset or empty."""
    return os.environ.get("SLOTINFER_API_KEY") or None


def template_max_chars() -> int:
    """``SLOTINFER_TEMPLATE_MAX_CHARS``: the most characters (or list items) a chat or prompt
    template may build or render; default 8,000,000.  Raises SettingError (a ValueError) on anything but a whole number >= 1."""
    return _whole("SLOTINFER_TEMPLATE_MAX_CHARS", 8_000_000, "the most characters a template may render")


def template_seconds() -> float:
    """``SLOTINFER_TEMPLATE_SECONDS``: the longest one template render may take; default 2."""
    return _seconds("SLOTINFER_TEMPLATE_SECONDS", 2.0, "the longest one template render may take")


def grammar_seconds() -> float:
    """``SLOTINFER_GRAMMAR_SECONDS``: the longest a request's JSON schema, regex, choice list or
    grammar may take to compile before it is refused; default 5."""
    return _seconds("SLOTINFER_GRAMMAR_SECONDS", 5.0, "the longest a grammar may take to compile")


def _seconds(name: str, default: float, meaning: str) -> float:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise SettingError(f"{name}={value!r}: expected a number of seconds > 0 ({meaning}); unset it for the "
                         f"default of {default:g}")
    return seconds


def _whole(name: str, default: int, meaning: str) -> int:
    value = os.environ.get(name, "").strip().replace("_", "")
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise SettingError(f"{name}={value!r}: expected a whole number >= 1 ({meaning}); "
                         f"unset it for the default of {default:,}")
    return int(value)
