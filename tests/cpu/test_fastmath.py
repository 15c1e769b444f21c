"""The CPU policy's elementwise math (slotinfer.cpu.fastmath) against float64 references.

The model's outputs are checked against transformers in test_parity_transformers; here each
function is held to its stated accuracy over its whole input range, including the edges a
softmax meets (masked -inf scores, underflow) and NaN.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from slotinfer import device
from slotinfer.cpu import blas as _blas
from slotinfer.cpu import fastmath
from slotinfer.cpu.ops import MLX_OPS, Ops, cpu_ops
from slotinfer.models.config import Rope
from slotinfer.models.transformer import RoPE, attend, attend_split

# Both forms of the polynomial: Estrin's (the softmax's) and Horner's (the activations').
EXPS = [mx.compile(fastmath.exp), mx.compile(lambda x: fastmath.exp(x, estrin=False))]
FORMS = pytest.mark.parametrize("form", [0, 1], ids=["estrin", "horner"])
F32 = dict(width=32, allow_nan=False, allow_infinity=False)


@FORMS
@given(arrays(np.float32, st.integers(1, 300), elements=st.floats(-86.875, 88.0, **F32)))
def test_exp_relative_error_below_2e_7(form, x):
    got = np.asarray(EXPS[form](mx.array(x))).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    assert np.all(np.abs(got - want) <= 2e-7 * want)


@FORMS
@given(arrays(np.float32, st.integers(1, 50), elements=st.floats(-2.0**100, -87.0, **F32)))
def test_exp_is_exactly_zero_below_the_cut(form, x):
    assert np.all(np.asarray(EXPS[form](mx.array(x))) == 0.0)


@FORMS
def test_exp_edges(form):
    got = np.asarray(EXPS[form](mx.array([-np.inf, np.nan, np.inf, 0.0], dtype=mx.float32)))
    assert got[0] == 0.0 and math.isnan(got[1]) and np.isfinite(got[2]) and got[2] > 1e38 and got[3] == 1.0


@given(arrays(np.float32, st.integers(1, 300), elements=st.floats(-200.0, 200.0, **F32)))
def test_silu_matches_float64(x):
    got = np.asarray(mx.compile(fastmath.silu)(mx.array(x))).astype(np.float64)
    x64 = x.astype(np.float64)
    want = x64 / (1.0 + np.exp(-x64))
    assert np.all(np.abs(got - want) <= 4e-7 * np.abs(want) + 1e-30)


@given(arrays(np.float32, st.tuples(st.integers(1, 6), st.integers(1, 40)), elements=st.floats(-60.0, 60.0, **F32)),
       st.data())
def test_softmax_matches_float64_and_masked_entries_are_exactly_zero(x, data):
    keep = data.draw(arrays(np.bool_, x.shape))
    keep[:, 0] = True  # every row sees at least one column (its own token)
    scores = np.where(keep, x, -np.inf).astype(np.float32)
    got = np.asarray(fastmath.softmax(mx.array(scores))).astype(np.float64)
    s64 = scores.astype(np.float64)
    e = np.exp(s64 - s64.max(axis=-1, keepdims=True))
    want = e / e.sum(axis=-1, keepdims=True)
    assert np.all(got[~keep] == 0.0)
    # A float32 sum of n terms is within n * 2^-24 of the exact one: 2.4e-6 for 40 columns.
    assert np.allclose(got, want, rtol=1e-6 + x.shape[1] * 2.0**-24, atol=1e-7)


@given(st.integers(1, 3), st.sampled_from([(2, 1), (4, 2), (4, 4)]), st.integers(1, 5), st.integers(1, 9))
def test_attention_with_own_softmax_matches_mlx_kernel(b, heads, L, extra):
    h, kvh = heads
    S = L + extra
    rng = np.random.default_rng(b * 100 + L * 10 + extra)
    q = mx.array(rng.standard_normal((b, h, L, 16), dtype=np.float32))
    k = mx.array(rng.standard_normal((b, kvh, S, 16), dtype=np.float32))
    v = mx.array(rng.standard_normal((b, kvh, S, 16), dtype=np.float32))
    mask = mx.array(rng.random((b, 1, L, S)) < 0.7) | (mx.arange(S) == 0)
    for m in (None, "causal", mask):
        ours = attend(q, k, v, 0.25, m, None, cpu_ops())
        ref = attend(q, k, v, 0.25, m, None, MLX_OPS)
        assert np.allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-5)


@given(st.integers(1, 9), st.integers(2, 4), st.sampled_from([(2, 1), (4, 2)]), st.integers(1, 40),
       st.sampled_from([None, 30.0]), st.booleans(), st.integers(0, 2**16))
def test_attention_split_over_streams_is_exact(b, split, heads, S, softcap, own_math, seed):
    """A decode step's attention split by slots over concurrent CPU streams gives each row
    bit for bit what the whole batch gives it: per-row masks and shared ones alike."""
    h, kvh = heads
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((b, h, 1, 16), dtype=np.float32))
    k = mx.array(rng.standard_normal((b, kvh, S, 16), dtype=np.float32))
    v = mx.array(rng.standard_normal((b, kvh, S, 16), dtype=np.float32))
    per_row = mx.array(rng.random((b, 1, 1, S)) < 0.7) | (mx.arange(S) == 0)
    for m in (None, per_row, per_row[:1]):
        ops = cpu_ops() if own_math else MLX_OPS
        whole = attend(q, k, v, 0.25, m, softcap, ops)
        parts = attend_split(q, k, v, 0.25, m, softcap, ops, split)
        assert np.array_equal(np.asarray(parts), np.asarray(whole))


def test_attention_split_is_a_cpu_policy(monkeypatch):
    monkeypatch.delenv("SLOTINFER_ATTENTION_STREAMS", raising=False)
    assert device.attention_split("gpu") == 1
    assert device.attention_split("cpu") == min(_blas.usable_cores(), 8)
    monkeypatch.setenv("SLOTINFER_ATTENTION_STREAMS", "1")
    assert device.attention_split("cpu") == 1
    for bad in ("0", "two", "-3"):
        monkeypatch.setenv("SLOTINFER_ATTENTION_STREAMS", bad)
        with pytest.raises(ValueError, match="SLOTINFER_ATTENTION_STREAMS"):
            device.attention_split("cpu")


@pytest.mark.parametrize("cores, streams", [(1, 1), (2, 2), (3, 3), (8, 8), (64, 8)])
def test_attention_split_follows_the_cores_the_process_may_use(monkeypatch, cores, streams):
    """A container's quota or an affinity mask, not the host's CPU count, sets the streams."""
    monkeypatch.delenv("SLOTINFER_ATTENTION_STREAMS", raising=False)
    monkeypatch.setattr(_blas, "usable_cores", lambda: cores)
    assert device.attention_split("cpu") == streams


def test_policy_uses_own_math_on_cpu_only():
    assert device.own_elementwise("cpu") is True
    assert device.own_elementwise("gpu") is False


def test_model_ops_follow_the_device_policy(monkeypatch):
    """The model gets one ops object: the CPU's own kernels and split attention on CPU,
    MLX's kernels on GPU; SLOTINFER_OWN_MATH=0 keeps MLX's kernels on CPU but not the split."""
    monkeypatch.setenv("SLOTINFER_ATTENTION_STREAMS", "3")
    monkeypatch.delenv("SLOTINFER_OWN_MATH", raising=False)
    cpu, gpu = device.model_ops("cpu"), device.model_ops("gpu")
    assert isinstance(cpu, Ops) and cpu.name == "cpu" and not cpu.fused_attention and cpu.attention_streams == 3
    assert gpu is MLX_OPS and gpu.fused_attention and gpu.attention_streams == 1
    monkeypatch.setenv("SLOTINFER_OWN_MATH", "0")
    plain = device.model_ops("cpu")
    assert plain.rms_norm is MLX_OPS.rms_norm and plain.fused_attention and plain.attention_streams == 3


@given(arrays(np.float32, st.integers(1, 200), elements=st.floats(-30.0, 30.0, **F32)))
def test_gelu_tanh_as_sigmoid_matches_float64(g):
    one = mx.ones(g.shape)
    g64 = g.astype(np.float64)
    want = 0.5 * g64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (g64 + 0.044715 * g64**3)))
    for f in (cpu_ops().gelu_tanh_mul, MLX_OPS.gelu_tanh_mul):
        got = np.asarray(f(mx.array(g), one)).astype(np.float64)
        assert np.allclose(got, want, rtol=2e-6, atol=1e-6)


def test_silu_mul_close_to_mlx():
    g = mx.random.normal((64, 96), key=mx.random.key(1)) * 8
    assert np.allclose(np.asarray(fastmath.silu(g)), np.asarray(nn.silu(g)), rtol=1e-5, atol=1e-6)


@given(st.integers(2, 40), st.integers(0, 100), st.sampled_from([(2, 1), (4, 2)]))
def test_prefill_attention_whose_sums_come_from_a_product_matches_mlx_kernel(L, extra, heads):
    # From a key span of 128 on, a prefill's softmax sums come from a product with ones.
    h, kvh = heads
    S = 128 + extra
    rng = np.random.default_rng(L * 1000 + extra)
    q = mx.array(rng.standard_normal((1, h, L, 16), dtype=np.float32))
    k = mx.array(rng.standard_normal((1, kvh, S, 16), dtype=np.float32))
    v = mx.array(rng.standard_normal((1, kvh, S, 16), dtype=np.float32))
    causal = mx.arange(S)[None] <= (mx.arange(L) + S - L)[:, None]
    for m in (causal[None, None], "causal"):
        ours = attend(q, k, v, 0.25, m, None, cpu_ops())
        ref = attend(q, k, v, 0.25, m, None, MLX_OPS)
        assert np.allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-5)


@given(arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 200)),
              elements=st.floats(-1e4, 1e4, **F32)),
       st.booleans(), st.sampled_from([1e-6, 1e-5]), st.integers(0, 2**31 - 1))
def test_rms_norm_is_mlx_rms_norm_bit_for_bit_eager_and_compiled(x, weighted, eps, seed):
    # The CPU policy's norm only moves a kernel boundary; its arithmetic is MLX's fallback's.
    x = mx.array(x)
    w = mx.random.normal((x.shape[-1],), key=mx.random.key(seed)) if weighted else None
    want = np.asarray(mx.fast.rms_norm(x, w, eps))
    for fn in (fastmath.rms_norm, mx.compile(fastmath.rms_norm)):
        assert np.array_equal(np.asarray(fn(x, w, eps)), want)


def test_rms_norm_of_other_dtypes_is_mlx_rms_norm():
    x = mx.random.normal((3, 64), key=mx.random.key(1)).astype(mx.bfloat16)
    w = mx.random.normal((64,), key=mx.random.key(2)).astype(mx.bfloat16)
    got, want = fastmath.rms_norm(x, w, 1e-6), mx.fast.rms_norm(x, w, 1e-6)
    assert got.dtype == mx.bfloat16 and np.array_equal(np.asarray(got.astype(mx.float32)),
                                                      np.asarray(want.astype(mx.float32)))


ROPES = [Rope(theta=10000.0), Rope(theta=1e6), Rope(theta=10000.0, type="linear", factor=4.0),
         Rope(theta=500000.0, type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8192)]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("rope", ROPES, ids=["default", "base_1e6", "linear", "llama3"])
@given(b=st.integers(1, 4), heads=st.integers(1, 6), partial=st.booleans(), seed=st.integers(0, 2**16))
def test_rope_with_shared_tables_is_mlx_rope_bit_for_bit(compiled, rope, b, heads, partial, seed):
    """A decode step's layers share their cosines and sines (the CPU policy's ``shared_rope``):
    every layer's rotation is still ``mx.fast.rope``'s, bit for bit, at any position."""
    D = 64
    layer = RoPE(rope, 32 if partial else D)
    rng = np.random.default_rng(seed)
    xs = [mx.array(rng.standard_normal((b, heads, 1, D)).astype(np.float32)) for _ in range(3)]
    offset = mx.array(rng.integers(0, 200_000, size=b).astype(np.int32))

    def both(offset, *xs):
        tables = {}  # one step: three layers share it
        return [layer(x, offset, tables) for x in xs] + [layer(x, offset) for x in xs]

    out = (mx.compile(both) if compiled else both)(offset, *xs)
    for shared, own in zip(out[:3], out[3:]):
        assert np.array_equal(np.array(shared), np.array(own))
