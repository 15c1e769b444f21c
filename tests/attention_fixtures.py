"""The float64 reference the CPU attention paths (tiled in MLX's ops, and the native prefill
primitive) are held to."""

import numpy as np


def reference(q, k, v, mask, scale, softcap=None):
    """Softmax attention in float64: q [B, H, L, D], k and v [B, kvh, S, D], grouped-query heads,
    ``mask`` True where a query sees a key, [B, L, S] or [B, 1, L, S]."""
    q, k, v, m = (np.array(x).astype(np.float64) for x in (q, k, v, mask))
    B, H, L, D = q.shape
    kvh = k.shape[1]
    s = np.einsum("bgrld,bgsd->bgrls", q.reshape(B, kvh, H // kvh, L, D) * scale, k)
    if softcap is not None:
        s = np.tanh(s / softcap) * softcap
    s = np.where(m.reshape(m.shape[0], 1, 1, *m.shape[-2:]), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bgrls,bgsd->bgrld", p, v).reshape(B, H, L, D)


def paged_reference(q, keys, values, tables, mask, scale, softcap=None):
    """:func:`reference` for one query a row over pool blocks: q [B, H, 1, D], pools [blocks, kvh, bs, D],
    ``tables`` [B, nblk], ``mask`` [B, nblk * bs] True where the row sees a position."""
    q, keys, values, tables, mask = (np.array(a) for a in (q, keys, values, tables, mask))
    b, d, kvh = q.shape[0], q.shape[-1], keys.shape[1]
    k = keys[tables].transpose(0, 2, 1, 3, 4).reshape(b, kvh, -1, d)  # [b, kvh, span, d]
    v = values[tables].transpose(0, 2, 1, 3, 4).reshape(b, kvh, -1, d)
    return reference(q, k, v, mask[:, None], scale, softcap or None)
