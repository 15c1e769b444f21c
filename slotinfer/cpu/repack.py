"""GGUF blocks the CPU's kernels do not read, repacked at load into blocks they do.

The kernels (:mod:`.qkernel`) compute on Q8_0, Q4_0 and Q4_1 blocks of 32 values.  A file's other
quantized matrices are repacked one tensor at a time, so they stay compact instead of becoming
float32:

- **Q4_K -> Q4_1, value for value.**  A Q4_K super-block of 256 values is eight sub-blocks of 32,
  each value ``d * sc * q - dmin * m`` with a 4-bit ``q``, 6-bit ``sc`` and ``m`` per sub-block and
  float16 ``d`` and ``dmin`` per super-block.  A Q4_1 block is ``D * q + M`` over 32 values with
  float16 ``D`` and ``M``: each sub-block becomes one Q4_1 block with the same ``q``,
  ``D = d * sc`` and ``M = -dmin * m``, rounded to float16 (a relative 2**-11 of the sub-block's
  scale and minimum, far below its 4-bit steps).  5 bits a weight against Q4_K's 4.5.
- **Every other type -> Q8_0**, from ``gguf``'s float32 reading, by ``gguf``'s quantizer:
  ``d = max|x| / 127`` per 32 values, ``q = round(x / d)``.  Its error, at most ``d / 2``, is below
  the steps of the 6-bit and smaller types it holds.  8.5 bits a weight.
"""

from __future__ import annotations

import numpy as np

Q4_K = 12  # GGML type id
Q4_K_BYTES = 144  # d, dmin (float16), 12 bytes of packed 6-bit scales and mins, 128 bytes of 4-bit values


def q4_k_to_q4_1(raw: np.ndarray) -> np.ndarray:
    """Q4_K blocks ``raw`` (``uint8 [rows, k / 256 * 144]``) as Q4_1 blocks ``uint8 [rows, k / 32 * 20]``."""
    rows = raw.shape[0]
    b = raw.reshape(-1, Q4_K_BYTES)
    d = b[:, 0:2].copy().view("<f2").astype(np.float32)  # [n, 1]
    dmin = b[:, 2:4].copy().view("<f2").astype(np.float32)
    s = b[:, 4:16]
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], axis=1)  # [n, 8]
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    scale = (d * sc).astype(np.float16)
    low = (-(dmin * mn)).astype(np.float16)
    qs = b[:, 16:].reshape(-1, 4, 32)  # each 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high
    q = np.stack([qs & 0xF, qs >> 4], axis=2).reshape(-1, 8, 32)  # [n, 8 sub-blocks, 32 values]
    packed = q[:, :, :16] | (q[:, :, 16:] << 4)  # Q4_1: value i in the low nibble, i + 16 in the high
    out = np.concatenate([scale.view(np.uint8).reshape(-1, 8, 2), low.view(np.uint8).reshape(-1, 8, 2), packed],
                         axis=2)
    return out.reshape(rows, -1)


def to_q8_0(w: np.ndarray) -> np.ndarray:
    """float32 ``w`` (``[rows, k]``, ``k`` a multiple of 32) as Q8_0 blocks ``uint8 [rows, k / 32 * 34]``,
    by the ``gguf`` package's quantizer (bit for bit llama.cpp's reference)."""
    import gguf

    return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
