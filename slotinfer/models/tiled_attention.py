"""A prefill's attention in tiles of queries, over keys in fixed blocks: bounded scores, exact rows.

Computed whole, a prefill's attention holds ``rows x heads x L x S`` scores and passes over
them several times (mask, max, exp, the value product, the sums): 1.2 GB a layer for eight
2,048-token rows in one call, and on CPU each pass over arrays that large costs many times
what it costs over one that stays in cache.  Here the queries go in tiles sized so that a
tile's scores stay about :data:`TILE_SCORES` elements, each tile reads the keys up to the last
one any of its queries sees (the causal triangle above it is never computed), and the work is
the same products and exps as the whole form.

**Exactness.**  A query's output must not depend on which other queries share its tile, on how
far the tile's keys reach, nor on the rows beside it (a row alone is bit for bit the row in any
batch, however its prompt is cut into chunks).  The scores are products over ``head_dim`` only,
and the max and exp act per element or order-free.  The weighted sum of values is where the
association could follow the tile: one product over all the tile's keys would associate the sum
as the BLAS splits that length.  So keys are taken in fixed blocks of :data:`KEY_BLOCK`
positions counted from position 0: each block gives its partial sums (values and, through a
softmax's denominator, as a sum of fixed length) in one product short enough to be one panel,
and the blocks are summed in block order.  (A product over ``head_dim + 1`` columns, the sums
beside the values, is not the same for a query whatever the tile's height on OpenBLAS; over
``head_dim`` columns it is.  So are the scores' products, with the keys laid out as [D, S]:
tests/models/test_tiled_attention.py.  That holds where the library's products sum as the BLAS
shim's own loops do, which take the small ones: OpenBLAS's AVX-512 kernels.  Its Haswell kernels,
on an AVX2 CPU, sum in another order, so there a query's output can move in its last bits with the
tile's height or the keys' reach; this path serves only where the native prefill attention does
not.)  Keys a query does not see weigh exact zeros,
and a block of them adds exact zeros at the end of the chain; so a query's output is a function
of its own scores alone.
"""

from __future__ import annotations

import threading

import mlx.core as mx

from ..cpu.ops import Ops

KEY_BLOCK = 128  # keys per partial product: fixed, counted from position 0
TILE_SCORES = 1 << 22  # scores per tile (rows x heads x queries x keys), about 16 MiB of float32
MIN_TILE, MAX_TILE = 16, 512  # queries per tile

_last = threading.local()  # the reach of the last mask seen (one mask serves every layer of a call)


def tiled_attend(q, k, v, scale: float, mask, softcap: float | None, ops: Ops):
    """Softmax attention of ``q`` [B, H, L, D] over ``k``, ``v`` [B, kv_heads, S, D] (grouped-query
    heads), with ``mask`` as ``attend`` takes it: None, ``"causal"`` (bottom-right aligned) or a bool
    array broadcastable to [B, 1, L, S].  ``ops.shifted_exp`` gives the weights.  Returns [B, H, L, D]."""
    B, H, L, D = q.shape
    kvh, S = k.shape[1], k.shape[2]
    rep = H // kvh
    reach = _reach(mask, L, S)  # [L]: keys each query index needs, counting from 0
    nb_all = -(-S // KEY_BLOCK)
    pad = nb_all * KEY_BLOCK - S
    if pad:
        k = mx.pad(k, [(0, 0), (0, 0), (0, pad), (0, 0)])
        v = mx.pad(v, [(0, 0), (0, 0), (0, pad), (0, 0)])
    vb = v.reshape(B, kvh, nb_all, KEY_BLOCK, D)
    # keys laid out as [D, S] once: a product with the transposed keys takes another form below
    # 8 query rows (a different result), where one with these does not
    kt = mx.contiguous(k.swapaxes(-1, -2))
    q = (q * scale).reshape(B, kvh, rep, L, D)
    tile = _tile(B * H * S)
    outs = []
    for a in range(0, L, tile):
        b = min(L, a + tile)
        t = b - a
        nb = max(1, -(-max(reach[a:b]) // KEY_BLOCK))
        ext = nb * KEY_BLOCK
        qt = q[:, :, :, a:b].reshape(B, kvh, rep * t, D)
        s = (qt @ kt[..., :ext]).reshape(B, kvh, rep, t, ext)
        if softcap is not None:
            s = mx.tanh(s / softcap) * softcap
        s = mx.where(_tile_mask(mask, a, b, ext, L, S), s, -mx.inf)
        e = ops.shifted_exp(s).reshape(B, kvh, rep * t, nb, KEY_BLOCK).swapaxes(2, 3)  # [B, kvh, nb, rep*t, KB]
        o = (e @ vb[:, :, :nb]).sum(axis=2)  # block partials [B, kvh, nb, rep*t, D], summed in block order
        den = e.sum(axis=-1).sum(axis=2)  # [B, kvh, rep*t]: each block's weights, then the blocks
        outs.append((o / den[..., None]).reshape(B, kvh, rep, t, D))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    return out.reshape(B, H, L, D)


def _tile(scores_per_query: int) -> int:
    t = MAX_TILE
    while t > MIN_TILE and t * scores_per_query > TILE_SCORES:
        t //= 2
    return t


def _reach(mask, L: int, S: int) -> list[int]:
    """For each query index, one past the last key any row lets it see (host ints)."""
    if mask is None:
        return [S] * L
    if isinstance(mask, str):  # causal, bottom-right aligned
        return [i + S - L + 1 for i in range(L)]
    last = getattr(_last, "value", None)
    if last is not None and last[0] is mask:
        return last[1]
    cols = mx.where(mask, mx.arange(S, dtype=mx.int32), -1).max(axis=-1)  # [..., L]
    cols = cols.reshape(-1, cols.shape[-1]).max(axis=0)
    reach = [int(c) + 1 for c in mx.broadcast_to(cols, (L,)).tolist()]
    _last.value = (mask, reach)
    return reach


def _tile_mask(mask, a: int, b: int, ext: int, L: int, S: int):
    """The mask of queries ``a:b`` over keys ``0:ext`` (keys from ``S`` on: padding, never seen),
    shaped to broadcast against scores [B, kv_heads, rep, b - a, ext]."""
    if mask is None or isinstance(mask, str):
        keys = mx.arange(ext)[None]
        limit = S if mask is None else mx.arange(a, b)[:, None] + (S - L + 1)
        return keys < limit  # [b - a, ext]: broadcasts
    m = mask[..., a:b, :min(ext, S)]
    if ext > S:
        m = mx.pad(m, [(0, 0)] * (m.ndim - 1) + [(0, ext - S)], constant_values=False)
    return mx.expand_dims(m, 2) if m.ndim == 4 else m
