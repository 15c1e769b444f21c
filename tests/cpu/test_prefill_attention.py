"""The extension's prefill attention (slotinfer/cpu/qkernel/prefill_attention.h): close to the
float64 softmax, and a query's output the same bit for bit whatever shares its tile, its call or
its batch, however its prompt was cut into chunks and however many threads ran it.  Every loop set
this CPU runs is held to it; ``attend`` takes this path on CPU.  Skipped where the extension was
not built (the tiled path then serves, tests/models/test_tiled_attention.py)."""

import numpy as np
import pytest
from attention_fixtures import reference
from hypothesis import given
from hypothesis import strategies as st

import slotinfer  # noqa: F401 - first: the BLAS before mlx.core
import mlx.core as mx
from slotinfer import device
from slotinfer.cpu import qkernel
from slotinfer.models import transformer
from slotinfer.models.transformer import attend

module = qkernel.load()
pytestmark = pytest.mark.skipif(module is None, reason=f"the qkernel extension is {qkernel.status()}")


def case(seed, B, L, S, kvh=2, rep=3, D=32, window=None, holes=False):
    """Queries of B rows, each a chunk of L positions from a start of its own, over S keys; with
    ``holes``, some earlier keys of each row hidden too (padding columns between segments)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, kvh * rep, L, D)).astype(np.float32)
    k = rng.standard_normal((B, kvh, S, D)).astype(np.float32)
    v = rng.standard_normal((B, kvh, S, D)).astype(np.float32)
    starts = rng.integers(0, S - L + 1, B)
    q_pos = starts[:, None] + np.arange(L)[None]  # [B, L]
    keys = np.arange(S)[None, None]
    mask = keys <= q_pos[:, :, None]
    if window is not None:
        mask &= keys > q_pos[:, :, None] - window
    if holes:
        mask &= (rng.random((B, 1, S)) > 0.3) | (keys == q_pos[:, :, None])
    return mx.array(q), mx.array(k), mx.array(v), mx.array(mask)  # mask [B, L, S]


def native(q, k, v, mask, softcap=None, causal=False):
    return np.array(module.prefill_attention(q, k, v, mask, 0.2, softcap or 0.0, causal=causal))


@given(seed=st.integers(0, 2**16), B=st.integers(1, 3), L=st.integers(2, 90), extra=st.integers(0, 300),
       heads=st.sampled_from([(2, 3), (1, 1), (4, 2), (1, 8)]), D=st.sampled_from([16, 24, 64]),
       softcap=st.sampled_from([None, 30.0]), window=st.sampled_from([None, 1, 40, 100]), holes=st.booleans())
def test_matches_the_float64_softmax(kernels, seed, B, L, extra, heads, D, softcap, window, holes):
    q, k, v, mask = case(seed, B, L, L + extra, *heads, D=D, window=window, holes=holes)
    got = native(q, k, v, mask, softcap)
    np.testing.assert_allclose(got, reference(q, k, v, mask, 0.2, softcap), rtol=2e-5, atol=2e-5)


@given(seed=st.integers(0, 2**16), B=st.integers(2, 3), L=st.integers(2, 200), extra=st.integers(0, 300),
       cut=st.integers(1, 199), more=st.integers(1, 200), window=st.sampled_from([None, 50]),
       softcap=st.sampled_from([None, 30.0]), holes=st.booleans())
def test_a_query_is_the_same_in_any_tile_call_or_batch(kernels, seed, B, L, extra, cut, more, window, softcap,
                                                       holes):
    """Row 0 alone; its later queries alone (they share their tiles with other queries); with masked
    keys appended (a longer span); on one thread: the same bits as in the batch."""
    q, k, v, mask = case(seed, B, L, L + extra, window=window, holes=holes)
    whole = native(q, k, v, mask, softcap)
    np.testing.assert_array_equal(native(q[:1], k[:1], v[:1], mask[:1], softcap), whole[:1])
    cut = min(cut, L - 1)
    np.testing.assert_array_equal(native(q[:1, :, cut:], k[:1], v[:1], mask[:1, cut:], softcap), whole[:1, :, cut:])
    pad = mx.random.normal((1, k.shape[1], more, k.shape[3]))
    pad_m = mx.concatenate([mask[:1], mx.zeros((1, L, more), dtype=mx.bool_)], axis=-1)
    np.testing.assert_array_equal(native(q[:1], mx.concatenate([k[:1], pad], axis=2),
                                         mx.concatenate([v[:1], pad * 3], axis=2), pad_m, softcap), whole[:1])
    threads = module.threads()
    module.set_threads(1)
    try:
        np.testing.assert_array_equal(native(q, k, v, mask, softcap), whole)
    finally:
        module.set_threads(threads)


@given(seed=st.integers(0, 2**16), L=st.integers(2, 300), pieces=st.lists(st.integers(1, 300), min_size=1,
                                                                            max_size=4))
def test_a_prompt_cut_into_chunks_gives_the_bits_of_the_whole(kernels, seed, L, pieces):
    """Causal attention of a whole prompt against the same prompt in chunks, each over the keys up to
    its end (what a chunked prefill or a prefix-cache hit computes)."""
    q, k, v, _ = case(seed, 1, L, L)
    whole = native(q, k, v, None, causal=True)
    at = 0
    for n in pieces + [L]:
        end = min(L, at + n)
        got = native(q[:, :, at:end], k[:, :, :end], v[:, :, :end], None, causal=True)
        np.testing.assert_array_equal(got, whole[:, :, at:end])
        at = end
        if at == L:
            break


def test_causal_is_the_bool_mask_and_a_query_that_sees_nothing_gets_zeros():
    q, k, v, _ = case(3, 2, 200, 260)
    causal = mx.array(np.arange(260)[None] <= np.arange(200)[:, None] + 60)[None]
    want = native(q, k, v, causal)
    np.testing.assert_array_equal(native(q, k, v, None, causal=True), want)
    np.testing.assert_allclose(want, reference(q, k, v, mx.broadcast_to(causal, (2, 200, 260)), 0.2),
                               rtol=2e-5, atol=2e-5)
    blind = mx.concatenate([mx.zeros((1, 1, 260), dtype=mx.bool_), causal[:, 1:]], axis=1)
    got = native(q, k, v, blind)
    assert (got[:, :, 0] == 0).all()
    np.testing.assert_array_equal(got[:, :, 1:], want[:, :, 1:])


def test_strided_inputs_are_read_as_their_values():
    q, k, v, mask = case(5, 2, 150, 200)
    qs = mx.swapaxes(mx.swapaxes(q, 1, 2) * 1, 1, 2)  # [B, H, L, D] with L's stride outermost
    np.testing.assert_array_equal(native(qs, k[:, :, :, :], v, mask[:, None][:, 0]), native(q, k, v, mask))


def test_attend_takes_the_native_path_on_cpu(monkeypatch):
    ops = device.model_ops()
    if ops.prefill_attention is None:
        pytest.skip("these ops have no native prefill attention")
    q, k, v, mask = case(7, 2, 150, 200)

    def tiled(*a, **kw):
        raise AssertionError("the tiled path ran")

    monkeypatch.setattr(transformer, "tiled_attend", tiled)
    got = np.array(attend(q, k, v, 0.2, mask[:, None], None, ops))
    np.testing.assert_array_equal(got, native(q, k, v, mask))
    np.testing.assert_array_equal(np.array(attend(q[:, :, :, :], k, v, 0.2, "causal", 30.0, ops)),
                                  native(q, k, v, None, 30.0, causal=True))


def test_bad_input_is_refused():
    q, k, v, mask = case(1, 2, 10, 20)
    with pytest.raises(ValueError, match="float32"):
        module.prefill_attention(q.astype(mx.float16), k, v, mask, 0.2)
    with pytest.raises(ValueError, match="mask"):
        module.prefill_attention(q, k, v, mask[:, :, :5], 0.2)
    with pytest.raises(ValueError, match="kv_heads"):
        module.prefill_attention(q, k[:, :, :, :16], v[:, :, :, :16], mask, 0.2)
    with pytest.raises(ValueError, match="not both"):
        module.prefill_attention(q, k, v, mask, 0.2, causal=True)
