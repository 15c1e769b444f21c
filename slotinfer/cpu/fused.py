"""A decoder block of a CPU decode step as a few native nodes.

At one row a decode step's cost is MLX's cost per node (docs/quantized-cpu.md): a pre-norm block
whose linear layers keep GGUF blocks (:mod:`.qlayers`) is about 35 nodes even with the native
RMSNorm, rope and attention.  :func:`block` computes it as the extension's ``qkv_rope``
(RMSNorm, q|k|v and its bias, the q/k norms, rope from the step's tables), the K/V writes (the
extension's ``kv_write`` into the engine's float32 pools, a node a pool where MLX's slices, reshapes
and scatters took six; MLX scatters elsewhere; both write the pools in place), ``attend_out`` (paged
attention, o and the residual) and ``mlp_block`` (RMSNorm, gate|up, the activation, down and the
residual).  They compose the loops the separate nodes run, in their order, so they give their
values bit for bit (the activation is the CPU ops' arithmetic, :mod:`.ops`).

It applies where the context offers it (``ctx.fused_rope_tables``: the engine's paged decode view, and
the single-sequence reference's decode of one token, so that "alone" still equals "batched") and
the block has what the primitives compute: no sandwich norms, no biases but q|k|v's, float32
activations and K/V, every linear layer in blocks (Llama, SmolLM, Qwen 2 and 3 checkpoints in GGUF
Q8_0/Q4_0/Q4_1/Q5_0/Q4_K/Q6_K, or other types requantized to Q8_0).  Elsewhere :func:`block` returns None and the block runs
as MLX ops.
"""

from __future__ import annotations

import mlx.core as mx

from .qlayers import BlockLinear


def _plain(layer) -> bool:
    return isinstance(layer, BlockLinear) and "bias" not in layer


def block(module, blk, x, ctx):
    """``blk``'s output for ``x`` [B, 1, hidden] in ``ctx`` as native nodes, or None where they do
    not apply (see the module docstring)."""
    rope_tables = getattr(ctx, "fused_rope_tables", lambda layer: None)(blk.self_attn.layer)
    if rope_tables is None or x.ndim != 3 or x.shape[1] != 1 or blk.sandwich:
        return None
    attn, mlp = blk.self_attn, blk.mlp
    if not isinstance(attn.qkv_proj, BlockLinear) or not all(map(_plain, (attn.o_proj, mlp.gate_up_proj,
                                                                          mlp.down_proj))):
        return None
    if x.dtype != mx.float32 or blk.input_layernorm.weight.dtype != mx.float32:
        return None
    B, H, kvh, D = x.shape[0], attn.n_heads, attn.n_kv, attn.head_dim
    cos, sin = attn.rope.step_tables(ctx.offset, rope_tables, x.dtype)
    norm = blk.input_layernorm
    qkv = module.qkv_rope(x, norm.weight, norm.eps, attn.qkv_proj.weight, attn.qkv_proj.fmt, cos, sin, H, kvh,
                          qkv_bias=attn.qkv_proj.bias if "bias" in attn.qkv_proj else None,
                          qk_norm=attn.qk_norm.weight if attn.qk_norm is not None else None)
    write = getattr(ctx, "write_qkv", None)
    paged = write(attn.layer, qkv, H, module) if write is not None else None  # float32 pools: native nodes
    if paged is None:
        quantize = getattr(ctx, "quantizer", lambda layer: None)(attn.layer)
        if quantize is not None:  # q8_0 pools: K and V quantized together, half the nodes of one each
            kv = quantize(qkv[:, :, H * D:].reshape(B, 2 * kvh, 1, D))
            k, v = kv[:, :kvh], kv[:, kvh:]
        else:
            k = qkv[:, :, H * D:(H + kvh) * D].reshape(B, kvh, 1, D)  # a slice and a reshape: no squeeze node
            v = qkv[:, :, (H + kvh) * D:].reshape(B, kvh, 1, D)
        paged, _ = ctx.update(attn.layer, k, v)  # the K/V writes: MLX scatters, in place
    mask = ctx.mask(attn.layer, 1, attn.window)
    h = module.attend_out(qkv, paged.keys, paged.values, paged.tables.astype(mx.int32), mask, attn.o_proj.weight,
                          attn.o_proj.fmt, x, H, attn.scale, attn.softcap or 0.0)
    norm = blk.post_attention_layernorm
    act = "gelu_tanh" if mlp.gelu else "silu"
    return module.mlp_block(h, norm.weight, norm.eps, mlp.gate_up_proj.weight, mlp.gate_up_proj.fmt,
                            mlp.down_proj.weight, mlp.down_proj.fmt, act)
