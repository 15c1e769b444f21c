"""The extension's decode-step primitives (slotinfer/cpu/qkernel/decode_ops.h): RMSNorm, rope from
a step's tables and attention of one new token per row over pool blocks.

Each against a float64 numpy reference (rope: bit for bit against the MLX expression it replaces),
each row's result the same alone as in any batch, strided inputs read as their values, and bad
input refused.  Every loop set this CPU runs (AVX-512, AVX2, the baseline) is held to them.
Skipped where the extension was not built (the MLX ops then serve, tests/cpu/test_fastmath.py).
"""

import numpy as np
import pytest
from attention_fixtures import paged_reference
from hypothesis import given
from hypothesis import strategies as st

import slotinfer  # noqa: F401 - first: the BLAS before mlx.core
import mlx.core as mx
from slotinfer.cpu import qkernel
from slotinfer.cpu.ops import cpu_ops
from slotinfer.kv.quant import quantize

module = qkernel.load()
pytestmark = pytest.mark.skipif(module is None, reason=f"the qkernel extension is {qkernel.status()}")


def normal(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# -- RMSNorm ------------------------------------------------------------------------------------

@given(rows=st.integers(1, 9), n=st.sampled_from([1, 7, 16, 64, 576, 1000]), weighted=st.booleans(),
       scale=st.sampled_from([1e-3, 1.0, 1e3]), seed=st.integers(0, 2**16))
def test_rms_norm_matches_float64(kernels, rows, n, weighted, scale, seed):
    rng = np.random.default_rng(seed)
    x, w = normal(rng, rows, n, scale=scale), normal(rng, n)
    got = np.array(module.rms_norm(mx.array(x), mx.array(w) if weighted else None, 1e-5))
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-5) * (w if weighted else 1.0)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


@given(rows=st.integers(2, 12), seed=st.integers(0, 2**16))
def test_rms_norm_row_alone_equals_batched(kernels, rows, seed):
    rng = np.random.default_rng(seed)
    x, w = mx.array(normal(rng, rows, 3, 96)), mx.array(normal(rng, 96))
    batched = module.rms_norm(x, w, 1e-6)
    for i in range(rows):
        assert mx.array_equal(module.rms_norm(x[i:i + 1], w, 1e-6), batched[i:i + 1]).item()
    assert mx.array_equal(module.rms_norm(x.transpose(1, 0, 2), w, 1e-6), batched.transpose(1, 0, 2)).item()


# -- rope from tables -------------------------------------------------------------------------------

@given(b=st.integers(1, 5), heads=st.integers(1, 12), d=st.sampled_from([8, 64, 80, 128]),
       partial=st.booleans(), shared=st.booleans(), seed=st.integers(0, 2**16))
def test_rope_apply_is_the_mlx_expression_bit_for_bit(kernels, b, heads, d, partial, shared, seed):
    """``x1 * cos - x2 * sin``, ``x1 * sin + x2 * cos`` and the features past the rotated ones
    copied, each product rounded as MLX's separate ops round it; one table row for all rows or one
    each; ``x`` a transposed view, as the model gives it."""
    rng = np.random.default_rng(seed)
    dims = d // 2 if partial else d
    half = dims // 2
    x = mx.array(normal(rng, b, 1, heads, d)).transpose(0, 2, 1, 3)
    r = mx.array(normal(rng, 1 if shared else b, 1, 1, 2 * half))
    cos, sin = r[..., :half], r[..., half:]
    x1, x2 = x[..., :half], x[..., half:dims]
    want = mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x[..., dims:]], axis=-1)
    assert mx.array_equal(module.rope_apply(x, cos, sin), want).item()


# -- attention of one new token per row over pool blocks -------------------------------------------

@st.composite
def attention_cases(draw):
    kvh, rep = draw(st.sampled_from([(1, 1), (1, 4), (3, 3), (2, 8), (4, 2)]))
    return dict(kvh=kvh, heads=kvh * rep, d=draw(st.sampled_from([8, 20, 64, 128])),
                bs=draw(st.sampled_from([1, 4, 16, 128])), b=draw(st.integers(1, 5)),
                window=draw(st.sampled_from([None, None, 3])), softcap=draw(st.sampled_from([0.0, 0.0, 30.0])),
                seed=draw(st.integers(0, 2**16)))


def pools(c):
    rng = np.random.default_rng(c["seed"])
    bs, b = c["bs"], c["b"]
    lengths = rng.integers(1, 3 * bs + 2, size=b)
    width = int(-(-lengths.max() // bs)) + int(rng.integers(0, 2))
    blocks = 2 + b * width
    keys, values = normal(rng, blocks, c["kvh"], bs, c["d"]), normal(rng, blocks, c["kvh"], bs, c["d"])
    tables = rng.permutation(np.arange(2, blocks))[: b * width].reshape(b, width).astype(np.int32)
    for i, n in enumerate(lengths):
        tables[i, -(-n // bs):] = 0  # past a row's blocks: a block of zeros
    keys[0] = values[0] = 0
    pos = np.arange(width * bs)[None]
    mask = pos < lengths[:, None]
    if c["window"]:
        mask &= pos > lengths[:, None] - 1 - c["window"]
    q = normal(rng, b, c["heads"], 1, c["d"])
    return q, keys, values, tables, mask, lengths


@given(attention_cases())
def test_paged_decode_attention_matches_float64(kernels, c):
    q, keys, values, tables, mask, _ = pools(c)
    scale = c["d"] ** -0.5
    got = module.paged_decode_attention(mx.array(q), mx.array(keys), mx.array(values), mx.array(tables),
                                        mx.array(mask)[:, None, None], scale, c["softcap"])
    np.testing.assert_allclose(np.array(got), paged_reference(q, keys, values, tables, mask, scale, c["softcap"]),
                               rtol=2e-5, atol=2e-6)


@given(attention_cases())
def test_paged_decode_attention_row_alone_equals_batched(kernels, c):
    """Bit for bit: the other rows, blocks of zeros past a row's length under a false mask and a
    mask shared by all rows change nothing."""
    q, keys, values, tables, mask, lengths = pools(c)
    args = [mx.array(a) for a in (keys, values)]
    batched = module.paged_decode_attention(mx.array(q), *args, mx.array(tables), mx.array(mask), 1.0 / 8, c["softcap"])
    bs = c["bs"]
    for i, n in enumerate(lengths):
        nblk = -(-int(n) // bs)
        alone = module.paged_decode_attention(mx.array(q[i:i + 1]), *args, mx.array(tables[i:i + 1, :nblk]),
                                              mx.array(mask[i, : nblk * bs]), 1.0 / 8, c["softcap"])
        assert mx.array_equal(alone, batched[i:i + 1]).item(), f"row {i}"


@pytest.fixture
def threads():
    """Set the extension's thread count for a test; the default back after it."""
    default = module.threads()
    yield module.set_threads
    module.set_threads(default)


@given(c=attention_cases(), many=st.sampled_from([2, 3, 4]))
def test_paged_decode_attention_is_the_same_on_any_thread_count(kernels, threads, c, many):
    """Bit for bit: the rows, K/V heads and parts of their query heads that go to the pool's threads
    (as many as the step has, or as few as one row's heads) give one thread's result, each row alone
    as in the batch."""
    q, keys, values, tables, mask, lengths = pools(c)
    args = [mx.array(a) for a in (keys, values)]

    def attend(t, rows, nblk):
        threads(t)
        out = module.paged_decode_attention(mx.array(q[rows]), *args, mx.array(tables[rows, :nblk]),
                                            mx.array(mask[rows, : nblk * c["bs"]]), 1.0 / 8, c["softcap"])
        mx.eval(out)
        return out

    everything = slice(None), tables.shape[1]
    assert mx.array_equal(attend(many, *everything), attend(1, *everything)).item()
    i = int(np.argmax(lengths))
    nblk = -(-int(lengths[i]) // c["bs"])
    assert mx.array_equal(attend(many, slice(i, i + 1), nblk), attend(1, slice(i, i + 1), nblk)).item()


@given(c=attention_cases(), d=st.sampled_from([16, 64, 80, 128, 256]), bs=st.sampled_from([5, 16, 23, 128]),
       q8=st.booleans(), scale=st.sampled_from([0.125, 8.0]))
def test_paged_decode_attention_is_the_same_bits_in_every_loop_set(c, d, bs, q8, scale):
    """The vector loops (scores of 16 or 8 keys at once, their lane trees transposed; values of a few
    heads at once; q8_0 rows dequantized in registers) add what the plain loop adds, in its order:
    the same bits in every loop set, over float32 and q8_0 pools, with blocks whose last keys fall
    short of a group and weights that underflow to 0 (scale 8)."""
    c = dict(c, d=d, bs=bs)
    q, keys, values, tables, mask, _ = pools(c)
    pools_ = [mx.array(keys), mx.array(values)]
    if q8 and d % 32 == 0:
        pools_ = [quantize(p) for p in pools_]
    args = (mx.array(q), *pools_, mx.array(tables), mx.array(mask)[:, None, None], scale, c["softcap"])
    names = ["portable", "avx2", "avx512"]
    got = {}
    try:
        for name in names[:names.index(module.best_kernels()) + 1]:
            module.set_kernels(name)
            got[name] = np.array(module.paged_decode_attention(*args))
    finally:
        module.set_kernels(module.best_kernels())
    for name, out in got.items():
        assert out.tobytes() == got["portable"].tobytes(), name


def test_paged_decode_attention_reads_strided_queries():
    """Queries as the model gives them (a slice of a transposed projection) are read as their values."""
    c = dict(kvh=2, heads=6, d=64, bs=16, b=3, window=None, softcap=0.0, seed=5)
    q, keys, values, tables, mask, _ = pools(c)
    qk = mx.array(np.concatenate([q, normal(np.random.default_rng(1), 3, 2, 1, 64)], axis=1))
    view = qk.transpose(0, 2, 1, 3).transpose(0, 2, 1, 3)[:, :6]
    args = [mx.array(a) for a in (keys, values, tables, mask)]
    assert mx.array_equal(module.paged_decode_attention(view, *args[:3], args[3], 0.125),
                          module.paged_decode_attention(mx.array(q), *args[:3], args[3], 0.125)).item()


def test_the_cpu_ops_use_them():
    ops = cpu_ops()
    assert ops.rope_apply is module.rope_apply and ops.paged_decode is not None
    assert cpu_ops(native=False).paged_decode is None


def test_bad_input_is_refused_with_what_was_wrong():
    x = mx.zeros((2, 64))
    with pytest.raises(ValueError, match="float32"):
        module.rms_norm(x.astype(mx.float16), None, 1e-5)
    with pytest.raises(ValueError, match="weight"):
        module.rms_norm(x, mx.ones((32,)), 1e-5)
    with pytest.raises(ValueError, match="1, D"):
        module.rope_apply(mx.zeros((1, 2, 3, 8)), mx.zeros((1, 1, 1, 4)), mx.zeros((1, 1, 1, 4)))
    with pytest.raises(ValueError, match="half"):
        module.rope_apply(mx.zeros((1, 2, 1, 8)), mx.zeros((1, 1, 1, 5)), mx.zeros((1, 1, 1, 5)))
    q, pool, tables = mx.zeros((2, 4, 1, 8)), mx.zeros((3, 2, 4, 8)), mx.zeros((2, 1), dtype=mx.int32)
    with pytest.raises(ValueError, match="int32"):
        module.paged_decode_attention(q, pool, pool, tables.astype(mx.int64), None, 1.0)
    with pytest.raises(ValueError, match="kv_heads"):
        module.paged_decode_attention(mx.zeros((2, 3, 1, 8)), pool, pool, tables, None, 1.0)
    with pytest.raises(ValueError, match="mask"):
        module.paged_decode_attention(q, pool, pool, tables, mx.ones((2, 5), dtype=mx.bool_), 1.0)


# -- a whole block as a few nodes (slotinfer/cpu/fused.py) ---------------------------------------------

def quantized(rng, rows, k, qtype):
    import gguf

    w = normal(rng, rows, k, scale=0.2)
    return mx.array(gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype]))


@given(b=st.integers(1, 4), kv=st.sampled_from([(1, 3), (2, 2), (2, 1)]), d=st.sampled_from([32, 64]),
       bs=st.sampled_from([4, 16]), shared_rope=st.booleans(), bias=st.booleans(), qk_norm=st.booleans(),
       seed=st.integers(0, 2**16))
def test_attention_half_is_its_separate_nodes_bit_for_bit(kernels, b, kv, d, bs, shared_rope, bias, qk_norm, seed):
    """``qkv_rope`` (RMSNorm, q|k|v and its bias, the per-head q/k norms, rope from tables) and
    ``attend_out`` (paged attention, o and the residual add) give what the separate primitives
    give, bit for bit."""
    rng = np.random.default_rng(seed)
    kvh, rep = kv
    heads, hid = kvh * rep, 64
    nblk, blocks = 3, 2 + 3 * b
    x, wn = mx.array(normal(rng, b, 1, hid)), mx.array(normal(rng, hid))
    wqkv, wo = quantized(rng, (heads + 2 * kvh) * d, hid, "Q4_1"), quantized(rng, hid, heads * d, "Q8_0")
    keys, values = mx.array(normal(rng, blocks, kvh, bs, d)), mx.array(normal(rng, blocks, kvh, bs, d))
    tables = mx.array(rng.permutation(np.arange(2, blocks))[: b * nblk].reshape(b, nblk).astype(np.int32))
    pos = rng.integers(0, nblk * bs, size=b)
    mask = mx.array(np.arange(nblk * bs)[None] <= pos[:, None])
    r = normal(rng, 1 if shared_rope else b, 1, 1, d)
    cos, sin = mx.array(r)[..., : d // 2], mx.array(r)[..., d // 2:]
    extra = dict(qkv_bias=mx.array(normal(rng, (heads + 2 * kvh) * d)) if bias else None,
                 qk_norm=mx.array(normal(rng, heads + kvh, d)) if qk_norm else None)
    got_qkv = module.qkv_rope(x, wn, 1e-5, wqkv, "q4_1", cos, sin, heads, kvh, **extra)
    got_h = module.attend_out(got_qkv, keys, values, tables, mask, wo, "q8_0", x, heads, d ** -0.5)
    # the separate nodes, as the model runs them
    qkv = module.qlinear(module.rms_norm(x, wn, 1e-5), wqkv, "q4_1")
    if bias:
        qkv = qkv + extra["qkv_bias"]
    qkv = qkv.reshape(b, 1, heads + 2 * kvh, d)
    qk = qkv[:, :, : heads + kvh]
    if qk_norm:
        qk = module.rms_norm(qk, None, 1e-5) * extra["qk_norm"]
    qk = module.rope_apply(qk.transpose(0, 2, 1, 3), cos, sin)
    want_qkv = mx.concatenate([qk.transpose(0, 2, 1, 3), qkv[:, :, heads + kvh:]], axis=2).reshape(b, 1, -1)
    assert mx.array_equal(got_qkv, want_qkv).item()
    att = module.paged_decode_attention(qk[:, :heads], keys, values, tables, mask, d ** -0.5)
    want_h = x + module.qlinear(att.reshape(b, 1, heads * d), wo, "q8_0")
    assert mx.array_equal(got_h, want_h).item()


@given(b=st.integers(1, 3), kv=st.sampled_from([(1, 3), (3, 3), (2, 4)]), many=st.sampled_from([2, 3]),
       seed=st.integers(0, 2**16))
def test_attend_out_is_the_same_on_any_thread_count(kernels, threads, b, kv, many, seed):
    """``attend_out`` (attention on the pool's threads, then o) at 2 or 3 threads is its one-thread
    result bit for bit, on spans long enough to be split."""
    rng = np.random.default_rng(seed)
    kvh, rep = kv
    heads, hid, d, bs, nblk = kvh * rep, 64, 64, 16, 8
    blocks = 2 + nblk * b
    x = mx.array(normal(rng, b, 1, hid))
    qkv = mx.array(normal(rng, b, 1, (heads + 2 * kvh) * d))
    wo = quantized(rng, hid, heads * d, "Q4_1")
    keys, values = mx.array(normal(rng, blocks, kvh, bs, d)), mx.array(normal(rng, blocks, kvh, bs, d))
    tables = mx.array(rng.permutation(np.arange(2, blocks))[: b * nblk].reshape(b, nblk).astype(np.int32))
    mask = mx.array(np.arange(nblk * bs)[None] <= rng.integers(0, nblk * bs, size=b)[:, None])
    got = []
    for t in (1, many):
        threads(t)
        got.append(module.attend_out(qkv, keys, values, tables, mask, wo, "q4_1", x, heads, d ** -0.5))
        mx.eval(got[-1])
    assert mx.array_equal(*got).item()


@given(b=st.integers(52, 64), many=st.sampled_from([2, 3]), bias=st.booleans(), qk_norm=st.booleans(),
       act=st.sampled_from(["silu", "gelu_tanh"]), seed=st.integers(0, 2**16))
def test_row_local_work_is_the_same_on_any_thread_count(kernels, threads, b, many, bias, qk_norm, act, seed):
    """Enough rows that the norms, rope, activations and residual adds go to the pool's threads in
    pieces of rows (past ~16k floats): every node's result at 2 or 3 threads is its one-thread
    result bit for bit (the rows of a piece start where they should, whatever the split)."""
    rng = np.random.default_rng(seed)
    kvh, rep, d, hid, n, bs, nblk = 1, 3, 64, 576, 384, 16, 2
    heads = kvh * rep
    x, wn = mx.array(normal(rng, b, 1, hid)), mx.array(normal(rng, hid))
    wqkv, wo = quantized(rng, (heads + 2 * kvh) * d, hid, "Q4_1"), quantized(rng, hid, heads * d, "Q8_0")
    wgu, wd = quantized(rng, 2 * n, hid, "Q4_0"), quantized(rng, hid, n, "Q8_0")
    blocks = 2 + nblk * b
    keys, values = mx.array(normal(rng, blocks, kvh, bs, d)), mx.array(normal(rng, blocks, kvh, bs, d))
    tables = mx.array(rng.permutation(np.arange(2, blocks)).reshape(b, nblk).astype(np.int32))
    mask = mx.array(np.arange(nblk * bs)[None] <= rng.integers(0, nblk * bs, size=b)[:, None])
    r = normal(rng, b, 1, 1, d)
    cos, sin = mx.array(r)[..., : d // 2], mx.array(r)[..., d // 2:]
    extra = dict(qkv_bias=mx.array(normal(rng, (heads + 2 * kvh) * d)) if bias else None,
                 qk_norm=mx.array(normal(rng, heads + kvh, d)) if qk_norm else None)
    q = mx.array(normal(rng, b, heads + kvh, 1, d))

    def nodes():
        qkv = module.qkv_rope(x, wn, 1e-5, wqkv, "q4_1", cos, sin, heads, kvh, **extra)
        return [qkv, module.attend_out(qkv, keys, values, tables, mask, wo, "q8_0", x, heads, d ** -0.5),
                module.mlp_block(x, wn, 1e-6, wgu, "q4_0", wd, "q8_0", act),
                module.rms_norm(x, wn, 1e-5), module.rope_apply(q, cos, sin)]

    threads(1)
    alone = nodes()
    mx.eval(alone)
    threads(many)
    shared = nodes()
    mx.eval(shared)
    for name, one, split in zip(("qkv_rope", "attend_out", "mlp_block", "rms_norm", "rope_apply"), alone, shared):
        assert mx.array_equal(one, split).item(), name


@given(rows=st.integers(1, 6), act=st.sampled_from(["silu", "gelu_tanh"]), seed=st.integers(0, 2**16))
def test_mlp_block_is_its_separate_nodes(kernels, rows, act, seed):
    """RMSNorm, gate|up, the activation of the CPU ops, down and the residual add as one node: the
    ops' values to float32 rounding (their activation is MLX's compiled arithmetic), and each row
    the same alone as in any batch, bit for bit."""
    rng = np.random.default_rng(seed)
    hid, n = 64, 96
    wgu, wd = quantized(rng, 2 * n, hid, "Q4_0"), quantized(rng, hid, n, "Q8_0")
    h, wn = mx.array(normal(rng, rows, 1, hid)), mx.array(normal(rng, hid))
    got = module.mlp_block(h, wn, 1e-6, wgu, "q4_0", wd, "q8_0", act)
    ops = cpu_ops()
    g, u = mx.split(module.qlinear(module.rms_norm(h, wn, 1e-6), wgu, "q4_0"), 2, axis=-1)
    want = h + module.qlinear(ops.silu_mul(g, u) if act == "silu" else ops.gelu_tanh_mul(g, u), wd, "q8_0")
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    for i in range(rows):
        alone = module.mlp_block(h[i:i + 1], wn, 1e-6, wgu, "q4_0", wd, "q8_0", act)
        assert mx.array_equal(alone, got[i:i + 1]).item()


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def llama_q41(request, tmp_path_factory):
    """A tiny model in a Q4_1 GGUF (its norms float32): every block takes the fused path (Qwen 2
    with its q|k|v bias, Qwen 3 with its q/k norms)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: gguf_fixtures
    from gguf_fixtures import twin, write_gguf

    root = tmp_path_factory.mktemp("fused")
    family = request.param
    return slotinfer.load(write_gguf(twin(family, root / family), root / f"{family}-q4_1.gguf", "Q4_1"))


def test_a_model_decodes_through_the_fused_blocks(llama_q41, monkeypatch):
    """The engine's decode steps and the single-sequence reference go through the fused blocks; the
    greedy tokens equal the separate nodes' and are the same alone and batched."""
    from slotinfer.cpu import fused

    prompts = ["hello world", "the cat sat on", "1 2 3 4 5 6 7 8 9 10 11 12"]
    calls = []
    real = fused.block

    def counted(module_, blk, x, ctx):
        out = real(module_, blk, x, ctx)
        if x.shape[1] == 1:  # a decode step (a prefill runs the separate nodes)
            calls.append(out is not None)
        return out

    blocks = llama_q41.net.model.layers
    for blk in blocks:
        monkeypatch.setattr(blk, "_fused", lambda b, x, ctx: counted(module, b, x, ctx))
    batched = [r.tokens for r in llama_q41.batch_generate(prompts, max_tokens=24, ignore_eos=True)]
    assert calls and all(calls), "a block did not take the fused path"
    alone = [llama_q41.generate(p, max_tokens=24, ignore_eos=True).tokens for p in prompts]
    for blk in blocks:
        monkeypatch.setattr(blk, "_fused", None)
    separate = [r.tokens for r in llama_q41.batch_generate(prompts, max_tokens=24, ignore_eos=True)]
    assert batched == alone == separate


def test_fused_blocks_refuse_bad_input():
    rng = np.random.default_rng(0)
    w = quantized(rng, 64, 64, "Q8_0")
    gate_up = quantized(rng, 128, 64, "Q8_0")
    with pytest.raises(ValueError, match="activation"):
        module.mlp_block(mx.zeros((1, 1, 64)), mx.ones((64,)), 1e-5, gate_up, "q8_0", w, "q8_0", "relu")
    with pytest.raises(ValueError, match="w_down"):
        module.mlp_block(mx.zeros((1, 1, 64)), mx.ones((64,)), 1e-5, gate_up, "q8_0", quantized(rng, 64, 32, "Q8_0"),
                         "q8_0")
    wqkv, wo, pool = quantized(rng, 96, 64, "Q8_0"), quantized(rng, 64, 32, "Q8_0"), mx.zeros((4, 1, 4, 32))
    x, tables, half = mx.zeros((1, 1, 64)), mx.zeros((1, 1), dtype=mx.int32), mx.zeros((1, 16))
    qkv = module.qkv_rope(x, mx.ones((64,)), 1e-5, wqkv, "q8_0", half, half, 1, 1)
    mx.eval(module.attend_out(qkv, pool, pool, tables, mx.ones((1, 4), dtype=mx.bool_), wo, "q8_0", x, 1, 0.25))
    with pytest.raises(ValueError, match=r"\[B, 1, hidden\]"):
        module.qkv_rope(mx.zeros((1, 2, 64)), mx.ones((64,)), 1e-5, wqkv, "q8_0", half, half, 1, 1)
    with pytest.raises(ValueError, match="kv_heads"):
        module.qkv_rope(x, mx.ones((64,)), 1e-5, wqkv, "q8_0", half, half, 2, 3)
    with pytest.raises(ValueError, match="mask"):
        module.attend_out(qkv, pool, pool, tables, mx.ones((1, 5), dtype=mx.bool_), wo, "q8_0", x, 1, 0.25)
    with pytest.raises(ValueError, match="qkv"):
        module.attend_out(qkv[..., :64], pool, pool, tables, mx.ones((1, 4), dtype=mx.bool_), wo, "q8_0", x, 1, 0.25)


# -- the K/V write of a fused block ------------------------------------------------------------

@given(b=st.integers(1, 5), kv=st.sampled_from([(1, 3), (2, 2), (3, 9)]), d=st.sampled_from([8, 64]),
       bs=st.sampled_from([1, 4, 16]), wide=st.booleans(), seed=st.integers(0, 2**16))
def test_kv_write_writes_what_the_scatters_write(b, kv, d, bs, wide, seed):
    """``kv_write`` puts each row's K and V from q|k|v where :func:`write_index` says, as the MLX
    scatters of ``PagedDecodeView.update`` do, and leaves a pool that is still held elsewhere as it was."""
    from slotinfer.kv.paged_attention import write_index

    kvh, heads = kv
    rng = np.random.default_rng(seed)
    blocks = 2 * b + 1
    keys0, values0 = normal(rng, blocks, kvh, bs, d), normal(rng, blocks, kvh, bs, d)
    qkv = normal(rng, b, 1, (heads + 2 * kvh) * d)
    cells = rng.choice(blocks * bs, size=b, replace=False)  # each row its own (block, offset)
    where = (mx.array(cells[:, None] // bs, dtype=mx.int32), mx.array(cells[:, None] % bs, dtype=mx.int32))
    index = write_index(*where, kv_heads=kvh, block_size=bs, head_dim=d, num_blocks=blocks)
    index = index.astype(mx.int64) if wide else index
    held_k, held_v = mx.array(keys0), mx.array(values0)
    keys, values = (module.kv_write(p, mx.array(qkv), index, heads, part) for part, p in enumerate((held_k, held_v)))
    want_k, want_v = keys0.copy(), values0.copy()
    for r, c in enumerate(cells):
        k = qkv[r, 0, heads * d:(heads + kvh) * d].reshape(kvh, d)
        v = qkv[r, 0, (heads + kvh) * d:].reshape(kvh, d)
        want_k[c // bs, :, c % bs], want_v[c // bs, :, c % bs] = k, v
    assert np.array_equal(np.array(keys), want_k) and np.array_equal(np.array(values), want_v)
    assert np.array_equal(np.array(held_k), keys0) and np.array_equal(np.array(held_v), values0)


def test_kv_write_refuses_bad_input():
    pool, qkv, index = mx.zeros((4, 1, 4, 32)), mx.zeros((1, 1, 96)), mx.zeros((32,), dtype=mx.int32)
    mx.eval(module.kv_write(pool, qkv, index, 1, 1))
    with pytest.raises(ValueError, match="qkv"):
        module.kv_write(pool, qkv[..., :64], index, 1, 0)
    with pytest.raises(ValueError, match="index"):
        module.kv_write(pool, qkv, index[:16], 1, 0)
    with pytest.raises(ValueError, match="index"):
        module.kv_write(pool, qkv, index.astype(mx.float32), 1, 0)
    with pytest.raises(ValueError, match="float32"):
        module.kv_write(pool.astype(mx.float16), qkv, index, 1, 0)
    with pytest.raises(ValueError, match="part"):
        module.kv_write(pool, qkv, index, 1, 2)


def test_kv_write_writes_a_pool_nothing_else_holds_in_place():
    """Step after step, the pool goes from node to node without a copy (a copy of every pool every
    step would cost more than the step); a pool still held is copied and left as it was."""
    from slotinfer.kv.paged_attention import write_index

    pool, qkv = mx.zeros((256, 2, 128, 64)), mx.ones((1, 1, 8 * 64))  # 16 MiB
    index = write_index(mx.array([[3]]), mx.array([[5]]), kv_heads=2, block_size=128, head_dim=64, num_blocks=256)
    mx.eval(pool, qkv, index)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    for part in (0, 1, 0):
        pool = module.kv_write(pool, qkv, index, 4, part)
        mx.eval(pool)
    assert mx.get_peak_memory() < before + pool.nbytes // 2
    held = pool
    mx.reset_peak_memory()
    written = module.kv_write(held, qkv * 2, index, 4, 0)
    mx.eval(written)
    assert mx.get_peak_memory() >= before + pool.nbytes
    assert float(held[3, 0, 5, 0]) == 1.0 and float(written[3, 0, 5, 0]) == 2.0
