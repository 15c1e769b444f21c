"""GGUF blocks repacked at load for the CPU's kernels (:mod:`.qkernel`).

The kernels read Q8_0, Q4_0, Q4_1, Q5_0, Q4_K and Q6_K blocks as the file stores them.  Two cases are
repacked, one tensor at a time, so they stay compact instead of becoming float32:

- **Every other type -> Q8_0** (Q5_1, Q2_K, Q3_K, Q5_K, the I-quants), from ``gguf``'s float32 reading,
  by ``gguf``'s quantizer: ``d = max|x| / 127`` per 32 values, ``q = round(x / d)``.  Its error, at
  most ``d / 2``, is below the steps of the 6-bit and smaller types it holds.  8.5 bits a weight.
- **Q4_0 and Q5_0 -> Q8_0, value for value** (:func:`widen`), where one of them shares a fused
  projection with Q8_0 blocks (llama.cpp's Q4_K_M puts Q8_0 value projections beside Q5_0 queries and
  keys in models whose rows are not whole K-quant super-blocks): ``d * (q - 8)`` and ``d * (q - 16)``
  are Q8_0's ``d * q'`` with the same float16 ``d`` and ``q' = q - 8`` or ``q - 16``.
"""

from __future__ import annotations

import numpy as np

# the formats whose every weight a Q8_0 block holds exactly, and the offset of their q
WIDENS = {"q4_0": 8, "q5_0": 16, "q8_0": 0}


def widen(raw: np.ndarray, fmt: str) -> np.ndarray:
    """Blocks ``raw`` (``uint8 [rows, k / 32 * bytes]``) in ``fmt`` (a key of :data:`WIDENS`) as Q8_0
    blocks ``uint8 [rows, k / 32 * 34]`` of the same values."""
    if fmt == "q8_0":
        return raw
    rows = raw.shape[0]
    b = raw.reshape(-1, 18 if fmt == "q4_0" else 22)
    qs = b[:, -16:]
    q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int16)
    if fmt == "q5_0":
        bits = b[:, 2:6].copy().view("<u4")  # [n, 1]
        q |= (((bits >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int16)
    q8 = (q - WIDENS[fmt]).astype(np.int8).view(np.uint8)
    return np.concatenate([b[:, 0:2], q8], axis=1).reshape(rows, -1)


def to_q8_0(w: np.ndarray) -> np.ndarray:
    """float32 ``w`` (``[rows, k]``, ``k`` a multiple of 32) as Q8_0 blocks ``uint8 [rows, k / 32 * 34]``,
    by the ``gguf`` package's quantizer (bit for bit llama.cpp's reference)."""
    import gguf

    return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
