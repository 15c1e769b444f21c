"""The one ops object a model computes its elementwise math and attention with.

The model (:mod:`slotinfer.models.transformer`) takes an :class:`Ops` and never asks which
device it runs on; :func:`slotinfer.device.model_ops` picks one per device:

* :data:`MLX_OPS` -- MLX's own kernels (fused RMSNorm, fused attention, ``mx.exp``): the
  GPU policy, where they are fast.
* :func:`cpu_ops` -- :mod:`.fastmath`'s exp-based activations, softmax and RMSNorm, written
  as fused MLX arithmetic because MLX's x86 CPU ``exp`` runs element by element through
  libm; a decode step's attention split over concurrent CPU streams, because one core
  cannot read every slot's K/V at the memory's speed; and rope's cosines and sines made
  once per decode step instead of once per layer.  Where slotinfer's native extension is
  built (:mod:`.qkernel`), RMSNorm, rope from a step's tables and a decode step's attention
  over pool blocks are its primitives, one MLX node each where the ops above take five to
  thirty-five: at one row a decode step's cost is MLX's cost per node.  So is a long
  prefill's attention: tiles of queries over fixed key blocks with a running softmax, where
  MLX's ops pass over each tile's scores several times.

Both compute the same functions (``tests/cpu/test_fastmath.py`` holds them to float32
tolerance); they differ in speed only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from .._compile import ThreadCompiled
from . import fastmath, fused, qkernel


@dataclass(frozen=True)
class Ops:
    """Kernels for the model's elementwise steps.

    ``rms_norm(x, weight | None, eps)``; ``silu_mul(g, u)`` and ``gelu_tanh_mul(g, u)``:
    the gated MLP activations; ``softmax(scores)`` over the last axis; ``shifted_exp``:
    ``exp(x - max(x))``, when set, lets a long prefill's attention normalize after its
    value product (see ``attend``); ``fused_attention``: MLX's fused kernel serves
    attention without soft-capping; ``attention_streams``: concurrent streams a decode
    step's attention is split over (1: none); ``shared_rope``: a decode step's layers share
    their rope cosines and sines (where ``mx.fast.rope`` is a composition of ops that makes
    them anew in each layer; see ``transformer.RoPE``); ``rope_apply(x, cos, sin)``: those
    tables applied to ``x`` [B, heads, 1, D], when set; ``paged_decode(q, keys, values,
    tables, mask, scale, softcap)``: when set, the attention of one new token per row over pool
    blocks (see :func:`slotinfer.kv.paged_attend`), float32; ``fused_block(block, x, ctx)``: when
    set, a decoder block's output as native nodes, or None where it does not apply
    (:mod:`.fused`); ``prefill_attention(q, k, v, scale, mask, softcap)``: when set, a long
    prefill's attention as ``attend`` takes it, or None where it does not apply (then the
    tiled path serves: :mod:`slotinfer.models.tiled_attention`).
    """

    name: str
    rms_norm: Callable
    silu_mul: Callable
    gelu_tanh_mul: Callable
    softmax: Callable
    shifted_exp: Callable | None = None
    fused_attention: bool = True
    attention_streams: int = 1
    shared_rope: bool = False
    rope_apply: Callable | None = None
    paged_decode: Callable | None = None
    fused_block: Callable | None = None
    prefill_attention: Callable | None = None


def _gelu_arg(g):  # gelu_tanh(g) = 0.5 g (1 + tanh(a))
    return math.sqrt(2.0 / math.pi) * (g + 0.044715 * g * g * g)


@ThreadCompiled
def _silu_mul(g, u):
    return nn.silu(g) * u


@ThreadCompiled
def _gelu_tanh_mul(g, u):
    return 0.5 * g * (1.0 + mx.tanh(_gelu_arg(g))) * u


@ThreadCompiled
def _own_silu_mul(g, u):
    return fastmath.silu(g) * u


@ThreadCompiled
def _own_gelu_tanh_mul(g, u):  # 0.5 (1 + tanh(a)) = sigmoid(2a)
    return fastmath.sigmoid(2.0 * _gelu_arg(g)) * g * u


def _precise_softmax(scores):
    return mx.softmax(scores, axis=-1, precise=True)


MLX_OPS = Ops("mlx", rms_norm=mx.fast.rms_norm, silu_mul=_silu_mul, gelu_tanh_mul=_gelu_tanh_mul,
              softmax=_precise_softmax)

_own_softmax = ThreadCompiled(fastmath.softmax)
_own_shifted_exp = ThreadCompiled(fastmath.shifted_exp)


def cpu_ops(attention_streams: int = 1, native: bool = True) -> Ops:
    """The CPU's own kernels (see the module docstring); ``native``: the extension's primitives
    where it is built (else the fused MLX arithmetic serves alone)."""
    module = qkernel.load() if native else None
    ops = Ops("cpu", rms_norm=fastmath.rms_norm, silu_mul=_own_silu_mul, gelu_tanh_mul=_own_gelu_tanh_mul,
              softmax=_own_softmax, shifted_exp=_own_shifted_exp, fused_attention=False,
              attention_streams=attention_streams, shared_rope=True)
    if module is None:
        return ops

    def rms_norm(x, weight, eps):
        if x.dtype != mx.float32 or (weight is not None and weight.dtype != mx.float32):
            return fastmath.rms_norm(x, weight, eps)
        return module.rms_norm(x, weight, eps)

    def paged_decode(q, keys, values, tables, mask, scale, softcap):
        return module.paged_decode_attention(q, keys, values, tables.astype(mx.int32), mask, scale, softcap or 0.0)

    return dataclasses.replace(ops, rms_norm=rms_norm, rope_apply=module.rope_apply,
                               paged_decode=paged_decode, fused_block=functools.partial(fused.block, module),
                               prefill_attention=functools.partial(_prefill_attention, module))


def _prefill_attention(module, q, k, v, scale, mask, softcap):
    """A prefill's attention by the extension's primitive (one node, K/V read a block at a time
    for a tile of queries: qkernel/prefill_attention.h), or None where it does not apply: other
    dtypes than float32 (or K/V in q8_0 blocks, uint8: dequantized a block of keys at a time inside the
    loops), masks of other shapes than ``attend``'s."""
    B, L, S = q.shape[0], q.shape[2], k.shape[2]
    if q.dtype != mx.float32 or k.dtype != v.dtype or k.dtype not in (mx.float32, mx.uint8):
        return None
    causal = isinstance(mask, str)
    if causal:
        if mask != "causal":
            return None
        mask = None
    elif mask is not None:  # broadcastable to [B, 1, L, S]: taken as [B or 1, L, S]
        if mask.dtype != mx.bool_ or mask.ndim > 4:
            return None
        mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
        if mask.shape[0] not in (1, B) or mask.shape[1] != 1:
            return None
        mask = mx.broadcast_to(mask[:, 0], (mask.shape[0], L, S))
    return module.prefill_attention(q, k, v, mask, scale, softcap or 0.0, causal=causal)
