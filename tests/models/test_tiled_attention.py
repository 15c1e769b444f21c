"""A prefill's tiled attention (models/tiled_attention.py): close to the float64 softmax, and a
query's output the same bit for bit whatever shares its tile or its call."""

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from attention_fixtures import reference
from hypothesis import given
from hypothesis import strategies as st

from slotinfer import device
from slotinfer.models import tiled_attention as TA
from slotinfer.models.transformer import attend

OPS = dataclasses.replace(device.model_ops(), prefill_attention=None)  # the tiled path, native one aside
pytestmark = pytest.mark.skipif(OPS.shifted_exp is None, reason="the tiled path serves the CPU policy's ops")


def case(seed, B, L, S, kvh=2, rep=3, D=32):
    k = mx.random.key(seed)
    ks = mx.random.split(k, 4)
    q = mx.random.normal((B, kvh * rep, L, D), key=ks[0])
    keys = mx.random.normal((B, kvh, S, D), key=ks[1])
    vals = mx.random.normal((B, kvh, S, D), key=ks[2])
    starts = mx.random.randint(0, S - L + 1, (B,), key=ks[3])
    mask = (mx.arange(S)[None, None] <= (starts[:, None] + mx.arange(L)[None])[:, :, None])[:, None]
    return q, keys, vals, mask


@given(seed=st.integers(0, 2**16), B=st.integers(1, 3), L=st.integers(2, 90), extra=st.integers(0, 300),
       softcap=st.sampled_from([None, 30.0]))
def test_matches_the_float64_softmax(seed, B, L, extra, softcap):
    q, k, v, mask = case(seed, B, L, L + extra)
    got = np.array(TA.tiled_attend(q, k, v, 0.2, mask, softcap, OPS))
    np.testing.assert_allclose(got, reference(q, k, v, mask, 0.2, softcap), rtol=2e-5, atol=2e-5)


def _blas_keeps_a_row_whatever_the_shape() -> bool:
    """Whether this machine's products over head_dim give a row the same bits whatever the call's rows
    and columns, as the tiled path's premise has it (tiled_attention.py).  The shim's own loops do
    (docs/blas.md); a product past their size goes to the library, and OpenBLAS's Haswell kernels (an
    AVX2 CPU without AVX-512) sum it in another order than the loops, where its AVX-512 kernels agree."""
    key = mx.random.key(7)
    q = mx.random.normal((1, 3, 96, 32), key=key)
    kt = mx.random.normal((1, 3, 32, 512), key=mx.random.split(key)[1])
    small = np.array(q[:, :, :8] @ kt[..., :128])
    return all(np.array_equal(np.array(q @ kt[..., :n])[:, :, :8, :128], small) for n in (128, 256, 512))


@pytest.mark.skipif(not _blas_keeps_a_row_whatever_the_shape(),
                    reason="this CPU's BLAS sums a product past the shim's own loops in another order than they do "
                           "(OpenBLAS's Haswell kernels): the tiled path, which serves only where the native "
                           "prefill attention does not, is exact to float32 rounding here, not bit for bit")
@given(seed=st.integers(0, 2**16), B=st.integers(2, 3), L=st.integers(2, 90), extra=st.integers(0, 300),
       cut=st.integers(1, 89), more=st.integers(1, 200), tile=st.sampled_from([1 << 10, 1 << 14, 1 << 20]))
def test_a_query_is_the_same_in_any_tile_call_or_batch(seed, B, L, extra, cut, more, tile, monkeypatch):
    """Row 0 alone; its later queries alone; with masked keys appended; with other tile sizes: the
    same bits as in the batch (how an engine call cuts and pads a row must not change it)."""
    q, k, v, mask = case(seed, B, L, L + extra)
    whole = np.array(TA.tiled_attend(q, k, v, 0.2, mask, None, OPS))
    monkeypatch.setattr(TA, "TILE_SCORES", tile)
    alone = np.array(TA.tiled_attend(q[:1], k[:1], v[:1], 0.2, mask[:1], None, OPS))
    np.testing.assert_array_equal(alone, whole[:1])
    cut = min(cut, L - 1)
    later = TA.tiled_attend(q[:1, :, cut:], k[:1], v[:1], 0.2, mask[:1, :, cut:], None, OPS)
    np.testing.assert_array_equal(np.array(later), whole[:1, :, cut:])
    pad_k = mx.concatenate([k[:1], mx.random.normal((1, k.shape[1], more, k.shape[3]))], axis=2)
    pad_v = mx.concatenate([v[:1], mx.random.normal((1, v.shape[1], more, v.shape[3]))], axis=2)
    pad_m = mx.concatenate([mask[:1], mx.zeros((1, 1, L, more), dtype=mx.bool_)], axis=-1)
    np.testing.assert_array_equal(np.array(TA.tiled_attend(q[:1], pad_k, pad_v, 0.2, pad_m, None, OPS)), whole[:1])


def test_causal_is_the_bool_mask_and_attend_takes_this_path():
    q, k, v, _ = case(3, 1, 200, 200)
    causal = (mx.arange(200)[None] <= mx.arange(200)[:, None])[None, None]
    want = np.array(TA.tiled_attend(q, k, v, 0.2, causal, None, OPS))
    np.testing.assert_array_equal(np.array(TA.tiled_attend(q, k, v, 0.2, "causal", None, OPS)), want)
    np.testing.assert_array_equal(np.array(attend(q, k, v, 0.2, "causal", None, OPS)), want)
