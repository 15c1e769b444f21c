"""The 8-bit activations option of the quantized kernels (kernels_i8.h): each row of x quantized to int8
per block of 32, multiplied with the weights' integers exactly.

Held to an exact reference written here in numpy (the weights' integers read from the blocks, the
activations quantized as the contract says, the integer sums in int64, the float steps in float32 in the
contract's order): the kernels' result bit for bit, on every loop set this CPU runs; the VNNI, AVX2 and
portable loops give the same result; and a row alone is the row in any batch.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_qkernel import FORMATS, K_QUANTS, blocks, built, k_of, module, qlinear

import slotinfer  # noqa: F401 - first: the BLAS before mlx.core
from slotinfer import settings
from slotinfer.cpu import qkernel

F32 = np.float32


@pytest.fixture
def int8():
    module.set_int8_activations(True)
    yield
    module.set_int8_activations(False)


def _half(b, at):
    return b[..., at:at + 2].copy().view(np.float16)[..., 0].astype(F32)


def weight_integers(qtype, b, k):
    """The kernels' reading of the blocks: unsigned integers u [n, k] with the offset o (the weight's
    integer is u - o), and per lane of 4 weights the factor dw and the term mv [n, k / 4]."""
    n = b.shape[0]
    if qtype in K_QUANTS:
        s = b.reshape(n, k // 256, -1)
        u = np.zeros((n, k // 256, 8, 32), np.int64)
        dw = np.zeros((n, k // 256, 8, 8), F32)
        mv = np.zeros_like(dw)
        if qtype == "Q4_K":
            d, dmin, sc = _half(s, 0), _half(s, 2), s[..., 4:16].astype(np.int64)
            for j in range(8):
                q = s[..., 16 + 32 * (j // 2):48 + 32 * (j // 2)].astype(np.int64)
                u[:, :, j] = (q >> (4 * (j % 2))) & 15
                if j < 4:
                    scale, mn = sc[..., j] & 63, sc[..., j + 4] & 63
                else:
                    scale = (sc[..., j + 4] & 15) | ((sc[..., j - 4] >> 6) << 4)
                    mn = (sc[..., j + 4] >> 4) | ((sc[..., j] >> 6) << 4)
                dw[:, :, j] = (d * scale.astype(F32))[..., None]
                mv[:, :, j] = (-(dmin * mn.astype(F32)))[..., None]
            return u.reshape(n, k), 0, dw.reshape(n, -1), mv.reshape(n, -1)
        d, sc = _half(s, 208), s[..., 192:208].view(np.int8).astype(F32)
        for J in range(8):
            half, j = J >> 2, J & 3
            lo = (s[..., 64 * half + 32 * (j & 1):64 * half + 32 * (j & 1) + 32].astype(np.int64) >> (4 if j & 2 else 0)) & 15
            hi = (s[..., 128 + 32 * half:160 + 32 * half].astype(np.int64) >> (2 * j)) & 3
            u[:, :, J] = lo | (hi << 4)
            dw[:, :, J, :4] = (d * sc[..., 2 * J])[..., None]
            dw[:, :, J, 4:] = (d * sc[..., 2 * J + 1])[..., None]
        return u.reshape(n, k), 32, dw.reshape(n, -1), mv.reshape(n, -1)
    s = b.reshape(n, k // 32, -1)
    d = _half(s, 0)
    m = np.zeros_like(d)
    if qtype == "Q8_0":
        u, off = s[..., 2:34].view(np.int8).astype(np.int64) + 128, 128
    else:
        qs = s[..., {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6}[qtype]:].astype(np.int64)
        u = np.concatenate([qs & 15, qs >> 4], axis=-1)
        off = {"Q4_0": 8, "Q4_1": 0, "Q5_0": 16}[qtype]
        if qtype == "Q5_0":
            qh = s[..., 2:6].copy().view(np.uint32)[..., 0].astype(np.int64)
            u = u | (((qh[..., None] >> np.arange(32)) & 1) << 4)
        if qtype == "Q4_1":
            m = _half(s, 2)
    return u.reshape(n, k), off, np.repeat(d, 8, axis=-1), np.repeat(m, 8, axis=-1)


def reference(qtype, x, b):
    """out [m, n] as the contract computes it, exactly."""
    m_rows, k = x.shape
    u, off, dw, mv = weight_integers(qtype, b, k)
    xb = x.reshape(m_rows, k // 32, 32)
    dx = np.abs(xb).max(axis=-1) / F32(127)
    inv = np.where(dx != 0, F32(1) / np.where(dx != 0, dx, F32(1)), F32(0)).astype(F32)
    q = np.rint(xb * inv[..., None]).astype(np.int64).reshape(m_rows, k)
    y = q.reshape(m_rows, -1, 4).sum(-1)
    dxl = np.repeat(dx, 8, axis=-1)
    sx = dxl * y.astype(F32)
    lanes = k // 4
    i = -off * y[:, None, :] + (u[None].reshape(1, u.shape[0], lanes, 4) * q.reshape(m_rows, 1, lanes, 4)).sum(-1)
    pad = -lanes % 16  # an odd count of blocks: the last pair's second block is zeros
    i, dxl, sx = (np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)]) for a in (i, dxl, sx))
    dw, mv = (np.pad(a, [(0, 0), (0, pad)]) for a in (dw, mv))
    acc = np.zeros((m_rows, u.shape[0], 16), F32)
    for p in range((lanes + pad) // 16):
        at = slice(16 * p, 16 * p + 16)
        acc = acc + i[..., at].astype(F32) * (dw[None, :, at] * dxl[:, None, at])
        if qtype in ("Q4_1", "Q4_K"):
            acc = acc + mv[None, :, at] * sx[:, None, at]
    h = acc[..., :8] + acc[..., 8:]
    return (h[..., 0] + h[..., 4] + (h[..., 2] + h[..., 6])) + (h[..., 1] + h[..., 5] + (h[..., 3] + h[..., 7]))


@built
@given(qtype=st.sampled_from(FORMATS), n=st.integers(1, 40), k_blocks=st.integers(1, 12),
       m=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_equals_the_integer_reference(kernels, int8, qtype, n, k_blocks, m, seed):
    """Bit for bit the contract's result: the integers exact, the float steps in their order."""
    k = k_of(qtype, k_blocks)
    b, _ = blocks(qtype, n, k, seed)
    x = np.random.default_rng(seed + 1).standard_normal((m, k)).astype(F32)
    x[0, :32] = 0.0  # a block of zeros: dx 0
    assert np.array_equal(qlinear(x, b, qtype), reference(qtype, x, b))


@built
@given(qtype=st.sampled_from(FORMATS), m=st.sampled_from([1, 2, 3, 5, 33]), seed=st.integers(0, 2**16))
def test_every_loop_set_equals_portable(kernels, int8, qtype, m, seed):
    """The int8 loops of the loop set in use (AVX512-VNNI's, AVX2's) and the portable ones give the same
    values, bit for bit, on weights and activations that reach the integer sums' extremes."""
    loops = module.int8_kernels()
    k = k_of(qtype, 7)
    b, _ = blocks(qtype, 45, k, seed)
    if qtype == "Q8_0":  # a block of the extreme weights, -128 and 127
        b = b.copy()
        b[0, 36:68] = np.where(np.arange(32) % 2, 0x7F, 0x80).astype(np.uint8)
    x = np.random.default_rng(seed + 1).standard_normal((m, k)).astype(F32) * 3
    x[:, 32:64] = np.where(np.arange(32) % 3, 1.0, -1.0).astype(F32)  # a block of q = +-127
    try:
        fast = qlinear(x, b, qtype)
        module.set_kernels("portable")
        assert module.int8_kernels() == "portable"
        portable = qlinear(x, b, qtype)
    finally:
        module.set_kernels(kernels)
    assert np.array_equal(fast, portable), loops


@built
@given(qtype=st.sampled_from(FORMATS), m=st.integers(2, 80), seed=st.integers(0, 2**16),
       threads=st.sampled_from([1, 2, 3]))
def test_batch_invariant(kernels, int8, qtype, m, seed, threads):
    """With the option on, a row's result is bit-identical whatever the rows beside it and the threads."""
    k = 512 if qtype in K_QUANTS else 320
    b, _ = blocks(qtype, 37, k, seed)
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((m, k)).astype(F32)
    default = module.threads()
    module.set_threads(threads)
    try:
        together = qlinear(x, b, qtype)
        module.set_threads(1)
        alone = np.concatenate([qlinear(x[i:i + 1], b, qtype) for i in range(m)])
        others = rng.standard_normal((m, k)).astype(F32) * 1e3
        others[m // 2] = x[m // 2]
        beside = qlinear(others, b, qtype)[m // 2]
    finally:
        module.set_threads(default)
    assert np.array_equal(together, alone)
    assert np.array_equal(beside, alone[m // 2])


@built
def test_close_to_the_float_product(int8):
    """The option changes values by about the activations' rounding to 8 bits (a step of max|x| / 127)."""
    for qtype in FORMATS:
        k = k_of(qtype, 9)
        b, wd = blocks(qtype, 64, k, 7)
        x = np.random.default_rng(8).standard_normal((4, k)).astype(F32)
        ref = x.astype(np.float64) @ wd.T
        assert np.abs(qlinear(x, b, qtype) - ref).max() <= 0.02 * np.abs(ref).max(), qtype


def test_the_setting(monkeypatch):
    monkeypatch.delenv("SLOTINFER_INT8_ACTIVATIONS", raising=False)
    assert settings.int8_activations() is False
    monkeypatch.setenv("SLOTINFER_INT8_ACTIVATIONS", "1")
    assert settings.int8_activations() is True
    monkeypatch.setenv("SLOTINFER_INT8_ACTIVATIONS", "yes")
    with pytest.raises(ValueError, match="SLOTINFER_INT8_ACTIVATIONS"):
        settings.int8_activations()


@built
def test_a_model_alone_equals_batched(smollm2, int8):
    """The real model's greedy tokens with the option on: each prompt's alone and beside others of other
    lengths (padded in one prefill, which attends bit for bit as alone: its rows meet the products and
    their activation rounding with the same values)."""
    prompts = ["The capital of France is", "1, 2, 3, 4, 5,", "def fibonacci(n):"]
    assert len({len(smollm2.tokenizer.encode(p)) for p in prompts}) == len(prompts)
    batched = [r.tokens for r in smollm2.batch_generate(prompts, max_tokens=24)]
    for prompt, tokens in zip(prompts, batched):
        assert smollm2.generate(prompt, max_tokens=24).tokens == tokens, prompt
