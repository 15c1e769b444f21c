"""Linear and embedding layers whose weight stays in GGUF Q8_0 / Q4_0 / Q4_1 blocks on CPU.

The weight is the file's bytes, ``uint8 [rows, k / 32 * block bytes]``; products go through
:mod:`.qkernel` (float32 activations and sums), embedding lookups decode the rows they take.
:func:`swap` puts them in a model in place of its ``nn.Linear`` / ``nn.Embedding`` where the
loader kept blocks (the CPU policy :func:`slotinfer.device.cpu_block_kernels` decides).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import qkernel

BLOCK = 32


def _half(lo, hi):
    """float16 values from their two little-endian bytes, as float32."""
    return (lo.astype(mx.uint16) | (hi.astype(mx.uint16) << 8)).view(mx.float16).astype(mx.float32)


def dequantize(w: mx.array, fmt: str) -> mx.array:
    """float32 weights of blocks ``w`` ``[..., k / 32 * bytes]`` in ``fmt`` (q8_0, q4_0, q4_1)."""
    bb = qkernel.BLOCK_BYTES[fmt]
    blk = w.reshape(*w.shape[:-1], w.shape[-1] // bb, bb)
    d = _half(blk[..., 0], blk[..., 1])[..., None]
    if fmt == "q8_0":
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
        self.weight = mx.zeros((output_dims, input_dims // BLOCK * qkernel.BLOCK_BYTES[fmt]), dtype=mx.uint8)
        if bias:
            self.bias = mx.zeros((output_dims,))

    def __call__(self, x):
        y = qkernel.qlinear(x, self.weight, self.fmt)
        return y + self.bias if "bias" in self else y

    def weight_rows(self, ids):
        """float32 rows ``ids`` of W (a few output rows, as a label set's logits take)."""
        return dequantize(self.weight[ids], self.fmt)


class BlockEmbedding(nn.Module):
    """An embedding table in GGUF blocks; ``as_linear`` is the tied head's product."""

    def __init__(self, num_embeddings: int, dims: int, fmt: str):
        super().__init__()
        self.fmt = fmt
        self.weight = mx.zeros((num_embeddings, dims // BLOCK * qkernel.BLOCK_BYTES[fmt]), dtype=mx.uint8)

    def __call__(self, ids):
        return dequantize(self.weight[ids], self.fmt)

    def as_linear(self, x):
        return qkernel.qlinear(x, self.weight, self.fmt)

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
