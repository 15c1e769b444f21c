"""K/V kept in q8_0 blocks (slotinfer/kv/quant.py): the format, row-local quantization, and a pool
that counts its real bytes.

Each block of 32 values keeps its largest magnitude's scale (``d = max|x| / 127`` in float16) and
reads back within half a step of ``d`` of what was written; a token's bytes depend on its own
values alone (so a row alone is quantized as in any batch); the bytes a token takes are 34 / 128
of float32's, and the pool's budget, block size and stats count them.
"""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import slotinfer
from slotinfer import device
from slotinfer.kv import block_bytes
from slotinfer.kv.quant import dequantize, quantize, row_bytes
from slotinfer.kv.slot_table import SlotTable


@given(rows=st.integers(1, 6), blocks=st.integers(1, 5), scale=st.sampled_from([1e-6, 1e-3, 1.0, 1e3, 1e6]),
       zeros=st.booleans(), seed=st.integers(0, 2**16))
def test_a_block_reads_back_within_half_its_step(rows, blocks, scale, zeros, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, blocks * 32)) * scale).astype(np.float32)
    if zeros:
        x[0, :32] = 0.0  # a block of zeros: scale 0, values 0
    p = quantize(mx.array(x))
    assert p.dtype == mx.uint8 and p.shape == (rows, row_bytes(blocks * 32)) == (rows, blocks * 34)
    got = np.array(dequantize(p)).reshape(rows, blocks, 32)
    g = x.reshape(rows, blocks, 32).astype(np.float64)
    d = np.array(p).reshape(rows, blocks, 34)[..., :2].copy().view(np.float16).astype(np.float64)  # [rows, blocks, 1]
    amax = np.abs(g).max(-1, keepdims=True)
    # the float16 nearest max|x| / 127 from above, or that one and not below it by more than float32 rounding
    assert np.all(d * 127 >= amax * (1 - 2**-22))
    below = np.nextafter(d.astype(np.float16), np.float16(0)).astype(np.float64)
    assert np.all((below * 127 < amax * (1 + 2**-22)) | (amax == 0))
    assert np.all(np.abs(got - g) <= d * (0.5 + 2**-20))  # half a step
    assert np.all(got[amax[..., 0] == 0] == 0)


@given(rows=st.integers(2, 8), seed=st.integers(0, 2**16))
def test_a_row_is_quantized_alone_as_in_any_batch(rows, seed):
    x = mx.array(np.random.default_rng(seed).standard_normal((rows, 3, 2, 64)).astype(np.float32))
    batched = quantize(x)
    for i in range(rows):
        assert mx.array_equal(quantize(x[i:i + 1]), batched[i:i + 1]).item()
    assert mx.array_equal(quantize(x.transpose(2, 1, 0, 3)), batched.transpose(2, 1, 0, 3)).item()


def test_the_pool_counts_q8_bytes(models):
    """Bytes per token 34 / 128 of float32's: in the budget's blocks, the arrays and the stats."""
    cfg = models["qwen3"].config  # head_dim 32
    kw = dict(slots=2, max_len=512, kv_cache_bytes=1 << 20)
    f32 = SlotTable(cfg, dtype=mx.float32, **kw)
    q8 = SlotTable(cfg, dtype=device.kv_dtype(mx.float32, "q8_0"), **kw)
    assert q8.block_nbytes * 128 == f32.block_nbytes * 34
    assert q8.block_nbytes == block_bytes(num_layers=cfg.num_layers, kv_heads=cfg.num_kv_heads,
                                          head_dim=cfg.head_dim, dtype="q8_0", block_size=q8.block_size)
    assert q8.stats()["token_bytes"] / f32.stats()["token_bytes"] <= 0.27
    assert q8.num_blocks == (1 << 20) // q8.block_nbytes > f32.num_blocks * 3
    assert q8.allocated_bytes == q8.keys[0].shape[0] * q8.block_nbytes and q8.keys[0].dtype == mx.uint8


def test_q8_needs_a_head_size_that_32_divides(models):
    with pytest.raises(slotinfer.InvalidRequestError, match="head_dim is 16"):
        slotinfer.Inferencer(models["llama"], slots=1, max_len=64, kv_dtype="q8_0", start=False)
