"""Attention over K/V kept in q8_0 blocks (slotinfer/kv/quant.py), read by the extension's decode
and prefill attention, which dequantize a row of keys or values at a time inside their loops.

Each is, bit for bit, the float32 kernel over the dequantized K/V (so everything held of the float
loops holds: a row alone equals the row in any batch, a query the same in any tile, call or chunk),
and within float32 rounding of the float64 softmax over the dequantized K/V.  The MLX fallback (no
native ops: other devices, ``SLOTINFER_NATIVE_OPS=0``) is held to the same reference.  Every loop
set this CPU runs is held to them.  Skipped where the extension was not built.
"""

import numpy as np
import pytest
from attention_fixtures import paged_reference
from attention_fixtures import reference as prefill_reference
from hypothesis import given
from hypothesis import strategies as st

import slotinfer  # noqa: F401 - first: the BLAS before mlx.core
import mlx.core as mx
from slotinfer.cpu import qkernel
from slotinfer.cpu.ops import MLX_OPS, cpu_ops
from slotinfer.kv import paged_attend
from slotinfer.kv.quant import QuantizedKV, dequantize, quantize

module = qkernel.load()
pytestmark = pytest.mark.skipif(module is None, reason=f"the qkernel extension is {qkernel.status()}")


def normal(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@st.composite
def decode_cases(draw):
    kvh, rep = draw(st.sampled_from([(1, 1), (1, 4), (3, 3), (2, 8), (4, 2)]))
    return dict(kvh=kvh, heads=kvh * rep, d=draw(st.sampled_from([32, 64, 128])),
                bs=draw(st.sampled_from([1, 4, 16, 128])), b=draw(st.integers(1, 5)),
                window=draw(st.sampled_from([None, None, 3])), softcap=draw(st.sampled_from([0.0, 0.0, 30.0])),
                seed=draw(st.integers(0, 2**16)))


def q8_pools(c):
    """Queries, q8_0 pools (block 0 all zeros, as ZERO is), tables, mask and lengths of a decode step."""
    rng = np.random.default_rng(c["seed"])
    bs, b = c["bs"], c["b"]
    lengths = rng.integers(1, 3 * bs + 2, size=b)
    width = int(-(-lengths.max() // bs)) + int(rng.integers(0, 2))
    blocks = 2 + b * width
    keys, values = normal(rng, blocks, c["kvh"], bs, c["d"]), normal(rng, blocks, c["kvh"], bs, c["d"], scale=3.0)
    keys[0] = values[0] = 0
    tables = rng.permutation(np.arange(2, blocks))[: b * width].reshape(b, width).astype(np.int32)
    for i, n in enumerate(lengths):
        tables[i, -(-n // bs):] = 0
    pos = np.arange(width * bs)[None]
    mask = pos < lengths[:, None]
    if c["window"]:
        mask &= pos > lengths[:, None] - 1 - c["window"]
    q = normal(rng, b, c["heads"], 1, c["d"])
    k8, v8 = quantize(mx.array(keys)), quantize(mx.array(values))
    return mx.array(q), k8, v8, mx.array(tables), mx.array(mask), lengths


@given(decode_cases())
def test_decode_reads_q8_blocks_as_the_float_loops_read_them_dequantized(kernels, c):
    q, k8, v8, tables, mask, _ = q8_pools(c)
    scale = c["d"] ** -0.5
    got = module.paged_decode_attention(q, k8, v8, tables, mask[:, None, None], scale, c["softcap"])
    kf, vf = dequantize(k8), dequantize(v8)
    assert mx.array_equal(got, module.paged_decode_attention(q, kf, vf, tables, mask[:, None, None], scale,
                                                            c["softcap"])).item()
    want = paged_reference(q, kf, vf, tables, mask, scale, c["softcap"])
    np.testing.assert_allclose(np.array(got), want, rtol=2e-5, atol=2e-5)
    # the MLX fallback (no native ops) over the same blocks
    mlx = paged_attend(q, k8, v8, tables, scale, mask[:, None, None], c["softcap"] or None, MLX_OPS)
    np.testing.assert_allclose(np.array(mlx), want, rtol=1e-4, atol=1e-4)


@given(decode_cases())
def test_decode_over_q8_blocks_row_alone_equals_batched(kernels, c):
    q, k8, v8, tables, mask, lengths = q8_pools(c)
    batched = module.paged_decode_attention(q, k8, v8, tables, mask, 0.125, c["softcap"])
    bs = c["bs"]
    for i, n in enumerate(lengths):
        nblk = -(-int(n) // bs)
        alone = module.paged_decode_attention(q[i:i + 1], k8, v8, tables[i:i + 1, :nblk], mask[i, : nblk * bs],
                                              0.125, c["softcap"])
        assert mx.array_equal(alone, batched[i:i + 1]).item(), f"row {i}"


def q8_weights(rng, rows, k):
    """A Q8_0 weight matrix [rows, k / 32 * 34] (GGUF's blocks)."""
    d = (rng.random((rows, k // 32, 1)) * 0.02 + 0.001).astype(np.float16).view(np.uint8)
    q = rng.integers(-127, 128, (rows, k // 32, 32)).astype(np.int8).view(np.uint8)
    return mx.array(np.concatenate([d, q], axis=-1).reshape(rows, -1))


@given(b=st.integers(1, 4), kv=st.sampled_from([(1, 3), (2, 2), (3, 3)]), d=st.sampled_from([32, 64]),
       seed=st.integers(0, 2**16))
def test_attend_out_over_q8_blocks_is_its_float_form_over_the_dequantized_blocks(kernels, b, kv, d, seed):
    """The fused block's attention half (attention, o and the residual) reads q8_0 pools as the float
    one reads their dequantized values, bit for bit."""
    kvh, rep = kv
    heads, hid = kvh * rep, 96
    c = dict(kvh=kvh, heads=heads, d=d, bs=16, b=b, window=None, softcap=0.0, seed=seed)
    _, k8, v8, tables, mask, _ = q8_pools(c)
    rng = np.random.default_rng(seed + 1)
    qkv, x = mx.array(normal(rng, b, 1, (heads + 2 * kvh) * d)), mx.array(normal(rng, b, 1, hid))
    w_o = q8_weights(rng, hid, heads * d)
    got = module.attend_out(qkv, k8, v8, tables, mask, w_o, "q8_0", x, heads, d ** -0.5)
    want = module.attend_out(qkv, dequantize(k8), dequantize(v8), tables, mask, w_o, "q8_0", x, heads, d ** -0.5)
    assert mx.array_equal(got, want).item()


@given(seed=st.integers(0, 2**16), B=st.integers(1, 3), L=st.integers(2, 90), extra=st.integers(0, 200),
       heads=st.sampled_from([(2, 3), (1, 1), (1, 8)]), D=st.sampled_from([32, 64]),
       softcap=st.sampled_from([None, 30.0]), window=st.sampled_from([None, 40]))
def test_prefill_reads_q8_blocks_as_the_float_loops_read_them_dequantized(kernels, seed, B, L, extra, heads, D,
                                                                          softcap, window):
    rng = np.random.default_rng(seed)
    kvh, rep = heads
    S = L + extra
    q = mx.array(normal(rng, B, kvh * rep, L, D))
    k8, v8 = quantize(mx.array(normal(rng, B, kvh, S, D))), quantize(mx.array(normal(rng, B, kvh, S, D, scale=2.0)))
    keys = np.arange(S)[None, None]
    q_pos = (S - L + np.arange(L))[None, :, None]
    m = keys <= q_pos
    if window is not None:
        m = m & (keys > q_pos - window)
    mask = mx.array(np.broadcast_to(m, (B, L, S)))
    got = module.prefill_attention(q, k8, v8, mask, 0.2, softcap or 0.0)
    kf, vf = dequantize(k8), dequantize(v8)
    assert mx.array_equal(got, module.prefill_attention(q, kf, vf, mask, 0.2, softcap or 0.0)).item()
    want = prefill_reference(q, kf, vf, mask, 0.2, softcap)
    np.testing.assert_allclose(np.array(got), want, rtol=2e-5, atol=2e-5)
    # what the model's attention does with a prefill view's q8_0 K/V: native on CPU, MLX's ops without
    for ops in (cpu_ops(), cpu_ops(native=False)):
        out = QuantizedKV(k8, v8).attend(q, 0.2, mask[:, None], softcap, ops)
        np.testing.assert_allclose(np.array(out), want, rtol=1e-4, atol=1e-4)


def test_q8_pools_of_a_bad_shape_are_refused():
    q = mx.zeros((1, 2, 1, 64))
    k8 = quantize(mx.zeros((3, 1, 4, 64)))
    tables = mx.array([[1]], dtype=mx.int32)
    with pytest.raises(ValueError, match="q8_0"):
        module.paged_decode_attention(q, k8, mx.zeros((3, 1, 4, 64)), tables, None, 1.0)
    with pytest.raises(ValueError, match="q8_0"):
        module.paged_decode_attention(q, k8[..., :34], k8[..., :34], tables, None, 1.0)
    with pytest.raises(ValueError, match="q8_0"):
        module.prefill_attention(mx.zeros((1, 2, 3, 64)), k8[:1, :, :3], mx.zeros((1, 1, 3, 64)), None, 1.0)
