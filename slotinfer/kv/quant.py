"""K/V kept in 8 bits: ``kv_dtype="q8_0"``.

Each token's head vector of ``head_dim`` values is stored as ``head_dim / 32`` blocks of 34 bytes:
a float16 scale ``d`` and 32 int8 values ``q``, the value read back being ``d * q`` (GGUF's Q8_0
block layout; the scale is float16 because a float32 one, 36 bytes a block, would put K/V at
0.28x float32 bytes, over the 0.27x this format is for).  A layer's pool is then a uint8 array
``[num_blocks, kv_heads, block_size, head_dim / 32 * 34]``: one row of bytes per token and head,
addressed and written like a float pool's rows (uint8 pools hold q8_0 and nothing else).

Quantizing is row-local: each block of 32 values is scaled by its own largest magnitude
(``d = max|x| / 127`` rounded to float16, up where nearest would fall below it, ``q = round(x / d)``),
so a token's bytes depend on its own K/V alone, whatever else is written in the same step, and each
value reads back within half a step of ``d`` (magnitudes past float16's 65504 * 127 saturate).
Reading dequantizes a block at a time: the CPU's native attention (decode and prefill,
``slotinfer/cpu/qkernel``) inside its loops, elsewhere MLX's ops over the blocks a step reads
(:func:`dequantize`, the same values bit for bit: ``float32(d) * float32(q)`` is one rounding
either way).  The float16 scale costs nothing in accuracy that the int8 steps do not already: a
value is quantized against the rounded scale itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

Q8 = "q8_0"
BLOCK = 32  # values a block
BLOCK_BYTES = 34  # a float16 scale and 32 int8 values
_F16_MAX = 65504.0


def row_bytes(head_dim: int) -> int:
    """Bytes of one token's head vector in q8_0."""
    return head_dim // BLOCK * BLOCK_BYTES


def check_head_dim(head_dim: int) -> None:
    from ..errors import InvalidRequestError

    if head_dim % BLOCK:
        raise InvalidRequestError(f"kv_dtype='q8_0' stores K/V in blocks of {BLOCK} values along the head dimension, "
                                  f"and this model's head_dim is {head_dim}: use kv_dtype float16 or float32")


def is_q8(pool) -> bool:
    """Whether a pool (or packed K/V) holds q8_0 blocks: uint8 arrays hold nothing else."""
    return pool.dtype == mx.uint8


def quantize(x):
    """``x`` [..., D] (any float dtype; D a multiple of 32) as q8_0 bytes [..., D / 32 * 34]."""
    *lead, D = x.shape
    g = x.astype(mx.float32).reshape(*lead, D // BLOCK, BLOCK)
    amax = mx.max(mx.abs(g), axis=-1, keepdims=True)
    d = mx.minimum(amax * (1.0 / 127.0), _F16_MAX).astype(mx.float16)
    # a scale rounded below max|x| / 127 (or to 0, below float16's range) goes up to the next float16,
    # so the largest value still fits in 127 steps and every value reads back within half a step
    low = (d.astype(mx.float32) * 127.0 < amax) & (d < _F16_MAX)
    d = mx.where(low, mx.view(mx.view(d, mx.uint16) + mx.array(1, mx.uint16), mx.float16), d)
    df = d.astype(mx.float32)
    q = mx.where(df > 0, mx.round(g / mx.where(df > 0, df, 1.0)), 0.0)
    q = mx.clip(q, -127.0, 127.0).astype(mx.int8)
    packed = mx.concatenate([mx.view(d, mx.uint8), mx.view(q, mx.uint8)], axis=-1)  # [..., D / 32, 34]
    return packed.reshape(*lead, D // BLOCK * BLOCK_BYTES)


def dequantize(p, dtype=mx.float32):
    """q8_0 bytes ``p`` [..., R] as values [..., R / 34 * 32] in ``dtype``: ``float32(d) * float32(q)``."""
    *lead, R = p.shape
    nb = R // BLOCK_BYTES
    b = p.reshape(*lead, nb, BLOCK_BYTES)
    bits = b[..., 0:1].astype(mx.uint16) | (b[..., 1:2].astype(mx.uint16) << 8)
    d = mx.view(bits, mx.float16).astype(mx.float32)
    q = mx.view(b[..., 2:], mx.int8).astype(mx.float32)
    return (d * q).reshape(*lead, nb * BLOCK).astype(dtype)


@dataclass(frozen=True)
class QuantizedKV:
    """What a prefill view's ``update`` gives the model for one layer of q8_0 K/V: the keys and
    values a chunk attends over, still packed (``[n, kv_heads, S, D / 32 * 34]`` uint8).
    :meth:`attend` reads them through the ops' native prefill attention where it takes q8_0
    (dequantizing a block of keys at a time inside its loops), else dequantizes them with MLX's ops
    and attends as over float K/V."""

    keys: mx.array
    values: mx.array

    def attend(self, q, scale: float, mask, softcap: float | None, ops, split: int = 1):
        from ..models.transformer import attend_split

        if ops.prefill_attention is not None and q.shape[2] > 1:
            out = ops.prefill_attention(q, self.keys, self.values, scale, mask, softcap)
            if out is not None:
                return out
        k, v = dequantize(self.keys, q.dtype), dequantize(self.values, q.dtype)
        return attend_split(q, k, v, scale, mask, softcap, ops, split)
