"""Attention over K/V kept in pool blocks, read through block tables without copying them.

A layer's pool is ``[num_blocks, kv_heads, block_size, head_dim]``: head-major inside a block,
so each (block, head) is one contiguous ``[block_size, head_dim]`` matrix, and the pool viewed
as ``[num_blocks * kv_heads, block_size, head_dim]`` (a free reshape) is what ``mx.gather_mm``
indexes.  Row ``i`` of a step reads the blocks ``tables[i]`` in order: its logical position
``j`` lies in block ``tables[i, j // bs]`` at offset ``j % bs``.

:func:`paged_attend` computes what :func:`slotinfer.models.transformer.attend` computes over
the same positions laid out contiguously (grouped-query heads, a per-row mask, Gemma 2's
softcap, the ops' softmax), in three steps:

1. scores per (row, K/V head, block): ``gather_mm`` of the head's ``rep`` query rows against
   the block's keys, laid out as ``[rows, kv_heads, rep, L, blocks * bs]``, the contiguous
   layout, so the mask and the ops' softmax run over one row of scores as in ``attend``;
2. P·V per (row, head, block): ``gather_mm`` of each block's weights against its values;
3. the blocks' partial products summed as an explicit chain in block order,
   ``((o_0 + o_1) + o_2) + ...``, fixed by the code rather than by a reduction kernel.

**Exactness.**  On CPU, while a K/V head has fewer than 8 query heads (``rep``; SmolLM2 3,
Qwen3-0.6B 2), the scores are those of the contiguous form, and so are the softmax's weights
(the products sum over ``head_dim`` in an order that depends neither on the number of columns
nor on up to 7 rows; from 8 rows they take another form, docs/blas.md).  P·V is not: contiguously it is one multiply-add chain over every position, here one
chain per block and then the sum of step 3, another association (errors ~1e-7 relative).
What *is* exact is the paged form against itself: a row's output depends only on its query,
its blocks' contents and its mask, never on the other rows, on padding blocks past its length
(``ZERO`` blocks under zero weights add exact zeros to the chain) or on where its blocks lie in
the pool.  So the reference a batched engine is held to must read through this function too,
with the same block size (tests/kv/test_paged_attention.py holds both statements).

Writes go through :func:`write_index` and :func:`slotinfer.kv.views.scatter`: one flat
``put_along_axis`` per layer, as the slot table writes today.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .quant import dequantize, is_q8, quantize
from .views import SequenceCache, scatter, window_mask
from ..cpu.ops import MLX_OPS, Ops
from ..errors import InvalidRequestError
from ..models.transformer import cpu_streams


def write_index(blocks, offsets, *, kv_heads: int, block_size: int, head_dim: int, num_blocks: int):
    """Offsets of every element that writing token (``blocks[i, l]``, ``offsets[i, l]``) stores in
    a pool flattened to 1-D.

    ``blocks`` and ``offsets`` are [n, L] (from :meth:`~slotinfer.kv.BlockPool.locate`; padding
    tokens go to ``TRASH``); the result is [n * kv_heads * L * head_dim], in the order of a
    ``[n, kv_heads, L, head_dim]`` update, as :meth:`slotinfer.kv.slot_table.SlotTable.flat_index` gives
    for the slot table (int64 only when a layer's pool holds 2**31 elements or more).
    """
    h, bs, d = kv_heads, block_size, head_dim
    dt = mx.int32 if num_blocks * h * bs * d < 2**31 else mx.int64
    heads = mx.arange(h, dtype=dt)[None, :, None]
    cols = (blocks.astype(dt)[:, None, :] * h + heads) * bs + offsets.astype(dt)[:, None, :]  # [n, heads, L]
    return (cols[..., None] * d + mx.arange(d, dtype=dt)).reshape(-1)


def block_index(tables, kv_heads: int):
    """``(lhs, rhs, each)`` of :func:`paged_attend`'s two products for ``tables`` [B, nblk]: the
    query rows and the pool matrix each (row, head, block) multiplies, the pool viewed as
    ``[blocks * kv_heads, bs, D]``, and the weight rows of the second (one each).  The same for
    every layer of a step, so a view makes them once (:class:`PagedDecodeView`)."""
    rhs = tables.astype(mx.uint32)[:, None, :] * kv_heads + mx.arange(kv_heads, dtype=mx.uint32)[None, :, None]
    lhs = mx.broadcast_to(mx.arange(tables.shape[0] * kv_heads, dtype=mx.uint32).reshape(-1, kv_heads, 1),
                          rhs.shape)
    return lhs, rhs, mx.arange(rhs.size, dtype=mx.uint32)


def paged_attend(q, pool_keys, pool_values, tables, scale: float, mask, softcap: float | None,
                 ops: Ops = MLX_OPS, split: int = 1, index=None):
    """Softmax attention of ``q`` [B, H, L, D] over the blocks ``tables`` [B, nblk] (int32) of a
    layer's pools ``[num_blocks, kv_heads, bs, D]``: keys at logical positions ``0 .. nblk*bs-1``.

    ``mask``: None or a bool array broadcastable to ``[B, 1, L, nblk * bs]`` over logical
    positions, as a decode view gives ``attend`` (a row's length and window); without one, every
    position of every block is attended.  ``split`` > 1 divides the rows over that many
    concurrent CPU streams, as ``attend_split`` does (each part is exactly what the whole
    computes for those rows).  ``index``: :func:`block_index` of ``tables``, where the caller
    has it (used when the rows are not split).  Returns [B, H, L, D] in ``q``'s dtype.

        >>> out = paged_attend(q, pool_k, pool_v, tables, D ** -0.5, mask, None, device.model_ops())
    """
    B = q.shape[0]
    n = min(split, B)
    if n < 2:
        return _attend(q, pool_keys, pool_values, tables, scale, mask, softcap, ops, index)
    cuts = [B * i // n for i in range(n + 1)]
    per_row = isinstance(mask, mx.array) and mask.ndim == 4 and mask.shape[0] == B
    outs = []
    for s, lo, hi in zip(cpu_streams(n), cuts, cuts[1:]):
        with mx.stream(s):
            outs.append(_attend(q[lo:hi], pool_keys, pool_values, tables[lo:hi], scale,
                                mask[lo:hi] if per_row else mask, softcap, ops))
    return mx.concatenate(outs, axis=0)


def _attend(q, pool_keys, pool_values, tables, scale, mask, softcap, ops, index=None):
    B, H, L, D = q.shape
    _, kvh, bs, _ = pool_keys.shape
    rep, nblk = H // kvh, tables.shape[1]  # (q8_0 pools: their rows are bytes, D is q's)
    out_dtype = q.dtype
    if q.dtype != mx.float32 and mx.default_device() == mx.cpu:
        q = q.astype(mx.float32)  # MLX's CPU gather_mm takes float32 only: a half-precision model attends in it
    q8 = is_q8(pool_keys)
    if q8 and ops.paged_decode is not None and L == 1 and q.dtype == mx.float32:  # read as stored, natively
        return ops.paged_decode(q, pool_keys, pool_values, tables, mask, scale, softcap).astype(out_dtype)
    if pool_keys.dtype != q.dtype:
        # K/V stored in another dtype (float16 on CPU, q8_0 blocks) are read in q's: the rows' blocks
        # only, taken and converted (what the slot table's views convert too), never the whole pool
        convert = (lambda a: dequantize(a, q.dtype)) if q8 else (lambda a: a.astype(q.dtype))
        pool_keys = convert(mx.take(pool_keys, tables.reshape(-1), axis=0))
        pool_values = convert(mx.take(pool_values, tables.reshape(-1), axis=0))
        tables = mx.arange(B * nblk, dtype=mx.uint32).reshape(B, nblk)
        index = None  # the rows' blocks, renumbered
    if ops.paged_decode is not None and L == 1 and q.dtype == pool_keys.dtype == mx.float32:
        return ops.paged_decode(q, pool_keys, pool_values, tables, mask, scale, softcap).astype(out_dtype)
    kf, vf = pool_keys.reshape(-1, bs, D), pool_values.reshape(-1, bs, D)
    lhs, rhs, each = index if index is not None else block_index(tables, kvh)
    s = mx.gather_mm((q * scale).reshape(B * kvh, rep * L, D), kf.swapaxes(-1, -2), lhs, rhs)  # [B, kvh, nblk, rep*L, bs]
    s = s.reshape(B, kvh, nblk, rep, L, bs).transpose(0, 1, 3, 4, 2, 5).reshape(B, kvh, rep, L, nblk * bs)
    if softcap is not None:
        s = mx.tanh(s / softcap) * softcap
    if mask is not None:
        s = mx.where(mask if mask.ndim < 4 else mx.expand_dims(mask, 2), s, -mx.inf)
    p = ops.softmax(s)
    p = p.reshape(B, kvh, rep, L, nblk, bs).transpose(0, 1, 4, 2, 3, 5).reshape(B * kvh * nblk, rep * L, bs)
    o = mx.gather_mm(p, vf, each, rhs.reshape(-1)).reshape(B, kvh, nblk, rep * L, D)
    out = o[:, :, 0]
    for j in range(1, nblk):  # a fixed chain in block order: trailing ZERO blocks add exact zeros
        out = out + o[:, :, j]
    return out.reshape(B, H, L, D).astype(out_dtype)


@dataclass(frozen=True)
class PagedKV:
    """What a paged view's ``update`` gives the model for one layer in place of contiguous K/V:
    the layer's pools and the step's block tables; :meth:`attend` is :func:`paged_attend` over them.

    The model's attention needs one branch to use it (``transformer.Attention``: when the K/V it
    gets back has ``attend``, call that instead of ``attend_split``); contiguous views are unchanged.
    """

    keys: mx.array  # [num_blocks, kv_heads, bs, head_dim]
    values: mx.array
    tables: mx.array  # [B, nblk] int32
    index: tuple | None = None  # block_index(tables, kv_heads), made once for every layer

    def attend(self, q, scale: float, mask, softcap: float | None, ops: Ops = MLX_OPS, split: int = 1):
        return paged_attend(q, self.keys, self.values, self.tables, scale, mask, softcap, ops, split,
                            self.index)


class PagedDecodeView:
    """Attention context of a step over pool blocks: ``L`` new tokens for each of B rows.

    ``index``: the flat write offsets of the new tokens (:func:`write_index`; padding to TRASH);
    ``offset`` [B]: each row's first new position, for rope; ``tables`` [B, nblk]: the rows'
    block tables (ZERO past what a row holds); ``mask_pos`` [B]: the position whose view each
    row's first query has (a row's own position; for a padding row ``nblk * bs - 1``, so that it
    sees ZERO blocks and stays finite).  The pools (lists, one per layer) are rebound by each
    write, as the slot table's views do.
    """

    def __init__(self, pool_keys, pool_values, index, offset, tables, mask_pos):
        self.keys, self.values = list(pool_keys), list(pool_values)
        self.index, self.offset, self.tables, self.mask_pos = index, offset, tables, mask_pos
        self.span = tables.shape[1] * pool_keys[0].shape[2]
        self._masks = {}
        self.rope_tables = {}  # the step's rope cosines and sines, made once for every layer
        self._blocks = None  # block_index of the tables, made once for every layer

    def update(self, layer, k, v):
        if is_q8(self.keys[layer]) and not is_q8(k):  # q8_0 pools: each token's head vectors quantized as written
            k, v = quantize(k), quantize(v)
        self.keys[layer] = scatter(self.keys[layer], self.index, k)
        self.values[layer] = scatter(self.values[layer], self.index, v)
        if self._blocks is None:
            self._blocks = block_index(self.tables, k.shape[1])
        return PagedKV(self.keys[layer], self.values[layer], self.tables, self._blocks), None

    def write_qkv(self, layer, qkv, heads: int, module):
        """The step's K and V, taken from the fused block's q|k|v [B, 1, (heads + 2 kv_heads) D], written
        into float32 pools by the extension's ``kv_write``, a node a pool (in place, as :meth:`update`'s
        scatters); None where the pools hold another dtype (the caller then slices and calls
        :meth:`update`)."""
        if self.keys[layer].dtype != mx.float32:
            return None
        self.keys[layer] = module.kv_write(self.keys[layer], qkv, self.index, heads, 0)
        self.values[layer] = module.kv_write(self.values[layer], qkv, self.index, heads, 1)
        if self._blocks is None:
            self._blocks = block_index(self.tables, self.keys[layer].shape[1])
        return PagedKV(self.keys[layer], self.values[layer], self.tables, self._blocks)

    def quantizer(self, layer):
        """What turns K/V into this layer's stored form before :meth:`update` (q8_0 pools:
        :func:`~slotinfer.kv.quant.quantize`, which ``update`` then skips), or None: as they are."""
        return quantize if is_q8(self.keys[layer]) else None

    def fused_rope_tables(self, layer):
        """The step's rope tables, where a block may run as native nodes (:mod:`slotinfer.cpu.fused`:
        one token a row, float32 or q8_0 pools); else None."""
        return self.rope_tables if self.keys[layer].dtype in (mx.float32, mx.uint8) else None

    def mask(self, layer, L, window):
        if (L, window) not in self._masks:
            q_pos = self.mask_pos[:, None] + mx.arange(L)[None]  # [B, L]
            self._masks[L, window] = window_mask(q_pos, mx.arange(self.span), window)[:, None]  # [B, 1, L, span]
        return self._masks[L, window]


class PagedSequenceCache(SequenceCache):
    """The single-sequence reference context with decode reading pool blocks, as a paged engine's
    decode step reads them: what ``Model.generate`` runs through for "alone" to equal "batched"
    bit for bit once decode is paged.

    K/V live in a private pool per layer, ``[blocks, kv_heads, block_size, head_dim]``, grown a
    block at a time (new blocks are zeros, like ``ZERO``), the table being ``0 .. blocks-1``.  A
    fresh prompt (``L`` > 1 at offset 0) attends to its own K/V, as ``SequenceCache`` and the
    Encoder's fresh rows do; a single new token attends through :func:`paged_attend` over
    ``blocks * block_size`` positions under a length (and window) mask.  ``block_size`` must be
    the engine's.
    """

    def __init__(self, num_layers: int, block_size: int):
        super().__init__(num_layers)
        self.block_size = block_size

    def update(self, layer, k, v):
        B, kvh, L, D = k.shape
        bs, start = self.block_size, self.offset
        if B != 1 or (L > 1 and start > 0):
            raise InvalidRequestError("a PagedSequenceCache takes one sequence: its whole prompt, then one token "
                                      "at a time")
        need = -(-(start + L) // bs)
        have = 0 if self.keys[layer] is None else self.keys[layer].shape[0]
        if need > have:
            more = mx.zeros((need - have, kvh, bs, D), dtype=k.dtype)
            self.keys[layer] = more if have == 0 else mx.concatenate([self.keys[layer], more])
            self.values[layer] = mx.zeros_like(more) if have == 0 else mx.concatenate([self.values[layer], more])
        pos = mx.arange(start, start + L)[None]
        index = write_index(pos // bs, pos % bs, kv_heads=kvh, block_size=bs, head_dim=D, num_blocks=need)
        self.keys[layer] = scatter(self.keys[layer], index, k)
        self.values[layer] = scatter(self.values[layer], index, v)
        if L > 1:
            return k, v
        return PagedKV(self.keys[layer], self.values[layer], mx.arange(need, dtype=mx.int32)[None]), None

    def fused_rope_tables(self, layer):
        """Rope tables for a block run as native nodes on the decode of one token (what the
        engine's :class:`PagedDecodeView` offers, so that this reference reads through the same
        loops); None before the prompt or for pools in another dtype than float32."""
        keys = self.keys[layer]
        return {} if keys is not None and keys.dtype == mx.float32 else None

    def mask(self, layer, L, window):
        if L > 1:
            return super().mask(layer, L, window)
        span = self.keys[layer].shape[0] * self.block_size
        return window_mask(mx.array([[self.offset]]), mx.arange(span), window)[:, None]  # [1, 1, 1, span]
