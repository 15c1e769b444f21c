"""Linear and embedding layers whose weight stays in GGUF blocks on CPU (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K,
Q6_K: :data:`.qkernel.FORMATS`).

The weight is the file's bytes, ``uint8 [rows, qkernel.row_bytes(fmt, k)]``; products go through
:mod:`.qkernel` (float32 activations and sums), embedding lookups decode the rows they take.
:func:`swap` puts them in a model in place of its ``nn.Linear`` / ``nn.Embedding`` where the
loader kept blocks (the CPU policy :func:`slotinfer.device.cpu_block_kernels` decides).
"""

from __future__ import annotations

import contextlib
import threading

import mlx.core as mx
import mlx.nn as nn

from . import qkernel

_host = threading.local()


@contextlib.contextmanager
def all_cores():
    """Products built (traced) in this block on this thread take every core at any row count: for a
    step the host waits for, where no next step is being built beside it (:func:`.qkernel.qlinear`'s
    ``spare``).  The values are the same either way."""
    before = getattr(_host, "all_cores", False)
    _host.all_cores = True
    try:
        yield
    finally:
        _host.all_cores = before


def _spare() -> bool:
    return not getattr(_host, "all_cores", False)


def _half(lo, hi):
    """float16 values from their two little-endian bytes, as float32."""
    return (lo.astype(mx.uint16) | (hi.astype(mx.uint16) << 8)).view(mx.float16).astype(mx.float32)


def _nibbles(q, shift: int):
    return (q >> shift) & 15 if shift else q & 15


def _q4_k(blk):
    """Q4_K super-blocks ``[..., 144]`` as float32 ``[..., 256]``: (d * sc) * q - dmin * m per 32, as gguf."""
    d, dmin = _half(blk[..., 0], blk[..., 1])[..., None], _half(blk[..., 2], blk[..., 3])[..., None]
    s = blk[..., 4:16]
    sc = mx.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    m = mx.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    scale, low = d * sc.astype(mx.float32), dmin * m.astype(mx.float32)  # [..., 8]
    qs = blk[..., 16:].reshape(*blk.shape[:-1], 4, 1, 32)
    q = mx.concatenate([_nibbles(qs, 0), _nibbles(qs, 4)], axis=-2).reshape(*blk.shape[:-1], 8, 32)
    return (scale[..., None] * q.astype(mx.float32) - low[..., None]).reshape(*blk.shape[:-1], 256)


def _q6_k(blk):
    """Q6_K super-blocks ``[..., 210]`` as float32 ``[..., 256]``: (d * sc) * (q - 32) per 16, as gguf."""
    lead = blk.shape[:-1]
    sc = blk[..., 192:208].astype(mx.int16)
    scale = _half(blk[..., 208], blk[..., 209])[..., None] * mx.where(sc > 127, sc - 256, sc).astype(mx.float32)
    ql = blk[..., :128].reshape(*lead, 2, 1, 64)
    ql = mx.concatenate([_nibbles(ql, 0), _nibbles(ql, 4)], axis=-2).reshape(*lead, 2, 4, 32)
    qh = blk[..., 128:192].reshape(*lead, 2, 1, 32)
    qh = mx.concatenate([(qh >> (2 * j)) & 3 for j in range(4)], axis=-2)
    q = (ql | (qh << 4)).astype(mx.float32) - 32
    return (scale.reshape(*lead, 16, 1) * q.reshape(*lead, 16, 16)).reshape(*lead, 256)


def dequantize(w: mx.array, fmt: str) -> mx.array:
    """float32 weights of blocks ``w`` ``[..., row bytes]`` in ``fmt`` (:data:`.qkernel.FORMATS`), each the
    value gguf's reference gives."""
    bb = qkernel.BLOCK_BYTES[fmt]
    blk = w.reshape(*w.shape[:-1], w.shape[-1] // bb, bb)
    if fmt in ("q4_k", "q6_k"):
        return (_q4_k if fmt == "q4_k" else _q6_k)(blk).reshape(*w.shape[:-1], -1)
    d = _half(blk[..., 0], blk[..., 1])[..., None]
    if fmt == "q5_0":
        qh = blk[..., 2:6].astype(mx.uint32)
        bits = qh[..., 0:1] | (qh[..., 1:2] << 8) | (qh[..., 2:3] << 16) | (qh[..., 3:4] << 24)
        high = (bits >> mx.arange(32, dtype=mx.uint32)) & 1
        q = blk[..., 6:]
        vals = mx.concatenate([q & 15, q >> 4], axis=-1).astype(mx.uint32) | (high << 4)
        out = d * (vals.astype(mx.float32) - 16)
    elif fmt == "q8_0":
        q = blk[..., 2:].astype(mx.int16)
        vals = mx.where(q > 127, q - 256, q).astype(mx.float32)
        out = d * vals
    else:
        q = blk[..., 4:] if fmt == "q4_1" else blk[..., 2:]
        vals = mx.concatenate([q & 15, q >> 4], axis=-1).astype(mx.float32)
        out = d * (vals - 8) if fmt == "q4_0" else d * vals + _half(blk[..., 2], blk[..., 3])[..., None]
    return out.reshape(*w.shape[:-1], -1)


class BlockLinear(nn.Module):
    """``x @ W.T (+ bias)`` with ``W`` in GGUF blocks."""

    def __init__(self, input_dims: int, output_dims: int, fmt: str, bias: bool = False):
        super().__init__()
        self.fmt = fmt
        self.weight = mx.zeros((output_dims, qkernel.row_bytes(fmt, input_dims)), dtype=mx.uint8)
        if bias:
            self.bias = mx.zeros((output_dims,))

    def __call__(self, x):
        y = qkernel.qlinear(x, self.weight, self.fmt, spare=_spare())
        return y + self.bias if "bias" in self else y

    def weight_rows(self, ids):
        """float32 rows ``ids`` of W (a few output rows, as a label set's logits take)."""
        return dequantize(self.weight[ids], self.fmt)


class BlockEmbedding(nn.Module):
    """An embedding table in GGUF blocks; ``as_linear`` is the tied head's product."""

    def __init__(self, num_embeddings: int, dims: int, fmt: str):
        super().__init__()
        self.fmt = fmt
        self.weight = mx.zeros((num_embeddings, qkernel.row_bytes(fmt, dims)), dtype=mx.uint8)

    def __call__(self, ids):
        return dequantize(self.weight[ids], self.fmt)

    def as_linear(self, x):
        return qkernel.qlinear(x, self.weight, self.fmt, spare=_spare())

    def weight_rows(self, ids):
        return dequantize(self.weight[ids], self.fmt)


def swap(net: nn.Module, formats: dict) -> None:
    """Replace the modules named in ``formats`` (``{module path: fmt}``) by their block versions."""
    found = dict(net.named_modules())
    for path, fmt in formats.items():
        old = found[path]
        if isinstance(old, nn.Embedding):
            new = BlockEmbedding(old.weight.shape[0], old.weight.shape[1], fmt)
        elif isinstance(old, nn.Linear):
            new = BlockLinear(old.weight.shape[1], old.weight.shape[0], fmt, bias="bias" in old)
        else:
            raise TypeError(f"{path} is a {type(old).__name__}; only Linear and Embedding layers keep GGUF blocks")
        parent_path, _, name = path.rpartition(".")
        setattr(found[parent_path] if parent_path else net, name, new)
