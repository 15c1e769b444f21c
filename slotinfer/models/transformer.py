"""The one decoder every supported family runs through.

Families differ by the switches of :class:`ModelConfig`, never by copies of this
code.  The model reads like single-sequence code: all batching knowledge (where
K/V go, which positions each query may see, each row's rope offset) lives in the
attention *context* passed to ``__call__``, which is either the reference
path's ``kv.PagedSequenceCache`` or one of the slot table's views.

Attention context protocol::

    ctx.offset                         # rope position of the first new token: int or [B] array
    ctx.update(layer, keys, values)    # store new K/V [B, kv_heads, L, head_dim]; return what to attend over:
                                       # (k, v), or (paged, None) where paged.attend(q, scale, mask, softcap,
                                       # ops, split) attends over K/V kept in blocks
    ctx.mask(layer, L, window)         # None, "causal", or a bool mask broadcastable to [B, 1, L, S]
    ctx.rope_tables                    # optional: a dict the layers of one decode step share (see RoPE)
    ctx.fused_rope_tables(layer)       # optional: that dict where a block may run as native nodes, else None
                                       # (slotinfer.cpu.fused, through Ops.fused_block)

Projections are fused at load time (q|k|v into ``qkv_proj``, gate|up into
``gate_up_proj``): fewer, larger matmuls keep the BLAS busy on CPU.  So are Qwen 3's and
Gemma 3's q and k norms, into one per-head ``qk_norm``: fewer MLX ops per layer.

Which kernels the elementwise steps and attention run on is not decided here: the model
takes one :class:`~slotinfer.cpu.ops.Ops` (MLX's own by default; the CPU policy's from
:func:`slotinfer.device.model_ops`).

Why one module: it is the one decoder of every family; split, a layer's math would be read
across files.
"""

from __future__ import annotations

import math
import threading

import mlx.core as mx
import mlx.nn as nn

from ..cpu.ops import MLX_OPS, Ops
from .config import ModelConfig, Rope
from .tiled_attention import tiled_attend


class RMSNorm(nn.Module):
    """RMSNorm; Gemma's (1 + w) offset is folded into ``weight`` by the loader."""

    def __init__(self, dims: int, eps: float, ops: Ops = MLX_OPS):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps
        self._rms_norm = ops.rms_norm

    def __call__(self, x):
        return self._rms_norm(x, self.weight, self.eps)


class HeadNorm(nn.Module):
    """RMSNorm over each head of ``[..., heads, dims]`` with a weight per head: queries and keys
    (Qwen 3, Gemma 3) normed as one tensor.  The loader lays the checkpoint's ``q_norm`` weight
    on the query heads and ``k_norm``'s on the key heads."""

    def __init__(self, heads: int, dims: int, eps: float, ops: Ops = MLX_OPS):
        super().__init__()
        self.weight = mx.ones((heads, dims))
        self.eps = eps
        self._rms_norm = ops.rms_norm

    def __call__(self, x):
        return self._rms_norm(x, None, self.eps) * self.weight


class RoPE(nn.Module):
    def __init__(self, rope: Rope, dims: int, apply=None):
        super().__init__()
        self._apply = apply  # Ops.rope_apply: the tables applied in one op, when the ops have it
        self.dims = dims
        self.base = rope.theta
        self.scale = 1.0 / rope.factor if rope.type == "linear" else 1.0
        self._freqs = _llama3_freqs(rope, dims) if rope.type == "llama3" else None
        if self._freqs is not None:
            # Evaluated now: a lazy array belongs to this thread's stream, and the first step
            # may run on another thread (the Inferencer's worker), where that stream does not exist.
            mx.eval(self._freqs)

    def __call__(self, x, offset, tables: dict | None = None):
        """``x`` [B, heads, L, D] rotated at positions ``offset`` + 0..L-1.

        ``tables``: a dict the layers of one decode step share (the CPU policy's decode views:
        ``ctx.rope_tables``).  Off the GPU, ``mx.fast.rope`` is a composition of MLX ops whose
        cosines and sines, the same in every layer, would be made again by each; here they are
        made once per step, by ``mx.fast.rope`` itself (of a probe whose first half is ones and
        second half zeros: ``1 * cos - 0 * sin``, ``1 * sin + 0 * cos``), and each layer applies
        them with the expressions ``mx.fast.rope`` uses, the same values bit for bit
        (tests/cpu/test_fastmath.py).
        """
        if tables is None or x.shape[2] != 1:
            return self._rope(x, offset)
        half = self.dims // 2
        cos, sin = self.step_tables(offset, tables, x.dtype)
        if self._apply is not None and x.dtype == mx.float32:
            return self._apply(x, cos, sin)
        x1, x2 = x[..., :half], x[..., half:self.dims]
        outs = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
        if self.dims < x.shape[-1]:
            outs.append(x[..., self.dims:])
        return mx.concatenate(outs, axis=-1)

    def step_tables(self, offset, tables: dict, dtype=mx.float32):
        """Cosines and sines [rows, 1, 1, dims / 2] of positions ``offset`` (int or [rows]), made
        by ``mx.fast.rope`` once per ``tables`` (a decode step's ``ctx.rope_tables``) for every
        layer that rotates alike."""
        half = self.dims // 2
        key = (self.dims, self.base, self.scale, id(self._freqs))
        if key not in tables:
            rows = offset.size if isinstance(offset, mx.array) else 1
            probe = mx.broadcast_to(mx.concatenate([mx.ones((half,)), mx.zeros((self.dims - half,))]),
                                    (rows, 1, 1, self.dims)).astype(dtype)
            r = self._rope(probe, offset)
            tables[key] = (r[..., :half], r[..., half:])
        return tables[key]

    def _rope(self, x, offset):
        if self._freqs is not None:
            return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._freqs)
        return mx.fast.rope(x, self.dims, traditional=False, base=self.base, scale=self.scale, offset=offset)


def _llama3_freqs(rope: Rope, dims: int) -> mx.array:
    """Llama 3 scaling: long wavelengths slowed by ``factor``, short kept, a smooth blend between.

    Returned as periods (position / period = angle), the form ``mx.fast.rope`` takes.
    """
    inv = rope.theta ** (-mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    wavelen = 2 * math.pi / inv
    orig = rope.original_max_position_embeddings
    low_wl, high_wl = orig / rope.low_freq_factor, orig / rope.high_freq_factor
    smooth = (orig / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * inv / rope.factor + smooth * inv
    inv = mx.where(wavelen > low_wl, inv / rope.factor, mx.where(wavelen < high_wl, inv, blended))
    return 1.0 / inv


_local = threading.local()


def cpu_streams(n: int) -> tuple:
    """``n`` CPU streams of the calling thread (MLX streams belong to the thread that made them)."""
    got = getattr(_local, "streams", ())
    if len(got) < n:
        got = _local.streams = got + tuple(mx.new_stream(mx.cpu) for _ in range(n - len(got)))
    return got[:n]


def attend_split(q, k, v, scale: float, mask, softcap: float | None, ops: Ops, split: int):
    """:func:`attend` with the batch split into ``split`` parts on concurrent CPU streams
    (plain :func:`attend` when ``split`` or the batch is below 2).

    The CPU policy for decode steps: MLX runs one stream's ops on one thread, and a
    step's attention reads every slot's K/V from memory, which one core cannot do at
    the memory's speed.  Rows are independent, so each part is exactly what the whole
    computes for those rows.
    """
    B = q.shape[0]
    n = min(split, B)
    if n < 2:
        return attend(q, k, v, scale, mask, softcap, ops)
    cuts = [B * i // n for i in range(n + 1)]
    per_row = isinstance(mask, mx.array) and mask.ndim == 4 and mask.shape[0] == B
    outs = []
    for s, lo, hi in zip(cpu_streams(n), cuts, cuts[1:]):
        with mx.stream(s):
            outs.append(attend(q[lo:hi], k[lo:hi], v[lo:hi], scale, mask[lo:hi] if per_row else mask, softcap,
                               ops))
    return mx.concatenate(outs, axis=0)


def attend(q, k, v, scale: float, mask, softcap: float | None, ops: Ops = MLX_OPS):
    """Softmax attention with grouped-query heads.

    Soft-capped scores (Gemma 2) and ops without ``fused_attention`` (the CPU policy's
    softmax) take the explicit path; otherwise MLX's fused kernel.
    """
    if softcap is None and ops.fused_attention:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    B, H, L, D = q.shape
    kvh, S = k.shape[1], k.shape[2]
    if L > 1 and ops.prefill_attention is not None:
        # A prefill by the native primitive where the ops have it, whatever its span (tiles of
        # queries over fixed key blocks counted from position 0, a running softmax:
        # qkernel/prefill_attention.h): a query's sums do not depend on the batch's padded width,
        # where a matrix product's blocking does (a short prompt alone and beside a longer one)
        out = ops.prefill_attention(q, k, v, scale, mask, softcap)
        if out is not None:
            return out
    if ops.shifted_exp is not None and L > 1 and S >= _SUM_BY_PRODUCT:
        # A long prefill's scores are L x S per head: in tiles of queries, each over the keys it
        # sees, so they stay in cache, with the value products in fixed key blocks
        # (tiled_attention.py)
        return tiled_attend(q, k, v, scale, mask, softcap, ops)
    q = q.reshape(B, kvh, H // kvh, L, D)
    scores = (q * scale) @ mx.expand_dims(k, 2).swapaxes(-1, -2)  # [B, kvh, rep, L, S]
    if softcap is not None:
        scores = mx.tanh(scores / softcap) * softcap
    if isinstance(mask, str):
        mask = mx.arange(S)[None] <= (mx.arange(L) + S - L)[:, None]
    if mask is not None:
        mask = mask if mask.ndim < 4 else mx.expand_dims(mask, 2)
        scores = mx.where(mask, scores, -mx.inf)
    v = mx.expand_dims(v, 2)
    probs = ops.softmax(scores)
    return (probs @ v).reshape(B, H, L, D)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ops: Ops = MLX_OPS):
        super().__init__()
        self.layer = layer
        self.ops = ops
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.attn_bias)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=cfg.o_bias)
        heads = cfg.num_heads + cfg.num_kv_heads
        self.qk_norm = HeadNorm(heads, cfg.head_dim, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        self.rope = RoPE(cfg.rope_for(layer), cfg.head_dim, ops.rope_apply)
        self.scale = cfg.scale
        self.softcap = cfg.attn_softcap
        self.window = cfg.sliding_window if cfg.is_sliding(layer) else None

    def __call__(self, x, ctx):
        B, L, _ = x.shape
        # Queries and keys sit side by side in the fused projection: normed and rotated as one
        # tensor of n_heads + n_kv heads (two MLX ops per layer instead of four; RMSNorm and RoPE
        # act on each head alone, so this is the same function).
        heads = self.n_heads + self.n_kv
        qk, v = mx.split(self.qkv_proj(x), [heads * self.head_dim], axis=-1)
        qk = qk.reshape(B, L, heads, self.head_dim)
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        tables = getattr(ctx, "rope_tables", None) if self.ops.shared_rope else None
        qk = self.rope(qk.transpose(0, 2, 1, 3), ctx.offset, tables)
        q, k = qk[:, : self.n_heads], qk[:, self.n_heads:]
        v = v.reshape(B, L, self.n_kv, self.head_dim).transpose(0, 2, 1, 3)
        k, v = ctx.update(self.layer, k, v)
        split = self.ops.attention_streams if L == 1 else 1  # a decode step reads every slot's K/V
        mask = ctx.mask(self.layer, L, self.window)
        if hasattr(k, "attend"):  # K/V kept in pool blocks (slotinfer.kv.PagedKV): read through its block tables
            out = k.attend(q, self.scale, mask, self.softcap, self.ops, split)
        else:
            out = attend_split(q, k, v, self.scale, mask, self.softcap, self.ops, split)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


_SUM_BY_PRODUCT = 128  # key span from which a prefill attends in tiles (tiled_attention.py)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops = MLX_OPS):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gelu = cfg.activation == "gelu_tanh"
        self.act = ops.gelu_tanh_mul if self.gelu else ops.silu_mul

    def __call__(self, x):
        g, u = mx.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(self.act(g, u))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ops: Ops = MLX_OPS):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = Attention(cfg, layer, ops)
        self.mlp = MLP(cfg, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, ops)
        self.sandwich = cfg.sandwich_norms
        self._fused = ops.fused_block  # the whole block as native nodes where it applies (CPU decode)
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, ops)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, ops)

    def __call__(self, x, ctx):
        if self._fused is not None:
            out = self._fused(self, x, ctx)
            if out is not None:
                return out
        if self.sandwich:  # Gemma: norm around both sub-blocks
            h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), ctx))
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        h = x + self.self_attn(self.input_layernorm(x), ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class LayerStack(nn.Module):
    """Embedding, blocks and final norm, under the checkpoints' own ``model.`` names."""

    def __init__(self, cfg: ModelConfig, ops: Ops = MLX_OPS):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [Block(cfg, i, ops) for i in range(cfg.num_layers)]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)


def layer_by_layer(kv, tokens: int, threshold: int):
    """An ``after_layer`` for :meth:`Transformer.__call__` when a forward of ``tokens`` tokens
    reaches ``threshold`` (> 0), else None: it evaluates each layer's output and its K/V writes
    before the next layer is queued.  ``kv`` holds the ``keys`` and ``values`` lists written to
    (the slot table, a :class:`~slotinfer.kv.views.SequenceCache`), read at each call.  MLX
    allocates an op's output when the op is queued, ahead of the thread that computes it, so an
    eager forward issued whole holds several layers' activations at once (see
    :func:`slotinfer.device.prefill_by_layer`)."""
    if not 0 < threshold <= tokens:
        return None
    return lambda i, h: mx.eval(h, kv.keys[i], kv.values[i])


class Transformer(nn.Module):
    """Token ids -> final hidden states; :meth:`head` turns hidden states into logits.

    ``ops``: the kernels of its elementwise steps and attention (:class:`~slotinfer.cpu.ops.Ops`;
    :func:`slotinfer.device.model_ops` gives the device policy's).
    """

    def __init__(self, cfg: ModelConfig, ops: Ops = MLX_OPS):
        super().__init__()
        self.config = cfg
        self.model = LayerStack(cfg, ops)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def embed(self, tokens):
        h = self.model.embed_tokens(tokens)
        if self.config.embed_scale is not None:
            # Gemma rounds the scale to the activation dtype before multiplying.
            h = h * mx.array(self.config.embed_scale, dtype=h.dtype)
        return h

    def __call__(self, tokens, ctx, after_layer=None):
        """Final hidden states of ``tokens`` [B, L]; ``after_layer(i, h)``, when given, runs after
        layer ``i`` (an eager forward evaluates as it goes through it: :func:`layer_by_layer`)."""
        h = self.embed(tokens)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, ctx)
            if after_layer is not None:
                after_layer(i, h)
        return self.model.norm(h)

    def head(self, h):
        """Logits over the whole vocabulary for hidden states ``h`` [..., hidden]."""
        if self.config.tie_word_embeddings:
            logits = self.model.embed_tokens.as_linear(h)
        else:
            logits = self.lm_head(h)
        return self._cap(logits)

    def head_rows(self, h, ids):
        """Logits of only the vocabulary rows ``ids`` (e.g. a label set): a fraction of the head's cost."""
        w = self._head_weight(ids)
        return self._cap(h @ w.T)

    def _head_weight(self, ids):
        layer = self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        if hasattr(layer, "weight_rows"):  # GGUF blocks on CPU (slotinfer.cpu.qlayers)
            return layer.weight_rows(ids)
        if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            return mx.dequantize(layer.weight[ids], layer.scales[ids], layer.biases[ids],
                                 group_size=layer.group_size, bits=layer.bits)
        return layer.weight[ids]

    def _cap(self, logits):
        cap = self.config.final_softcap
        return logits if cap is None else mx.tanh(logits / cap) * cap
