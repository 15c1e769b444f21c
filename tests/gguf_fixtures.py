"""GGUF files written from slotinfer's tiny safetensors models, the way llama.cpp's converter writes them.

:func:`write_gguf` reads a folder of :func:`slotinfer.testing.make_tiny_model` (its
config.json, safetensors and tokenizer files) and writes the same model with the ``gguf``
package from PyPI: llama.cpp's tensor names, Llama's q/k rows interleaved per head,
Gemma's norms stored as ``1 + w``, 2-D weights in the requested type, the vocabulary padded
to the embedding with ``[PADn]`` tokens, and the tokenizer as metadata.  Everything here is
written independently of slotinfer's reader (only numpy, json and ``gguf``).

Weights go in any GGUF type: the types ``gguf`` can quantize (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)
are quantized from the model's weights; for the others (K-quants, I-quants) ``gguf`` has
only dequantizers, so :func:`random_blocks` writes valid random blocks whose values have the
weights' spread.  Either way the reference for what a reader must get back is ``gguf``'s own
dequantization of the file (:func:`dequantized_twin`).

:func:`twin` writes the safetensors folder the GGUF is compared with; its tokenizer.json
splits text with the real pre-tokenizer of the family (Llama 3's or Qwen 2's regex), so the
two files describe the same tokenizer.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import tokenizers
from gguf import GGMLQuantizationType as T

from slotinfer.testing import make_tiny_model

ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3"}
PRE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GEMMA_LAYER = {"pre_feedforward_layernorm": "ffn_norm", "post_attention_layernorm": "post_attention_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_CONTROL, _USER_DEFINED, _UNUSED, _BYTE, _UNKNOWN = 3, 4, 5, 6, 2


def twin(family: str, path: Path, dims: dict | None = None, **kw) -> Path:
    """The safetensors model a GGUF of ``family`` is written from, in settings a GGUF can express:
    Gemma's attention scaled by the head size (what llama.cpp assumes), and for Llama a rope base
    that puts two of head size 16's frequencies in Llama 3's blended band (its rope scaling is
    stored as one factor per frequency).  ``dims`` overrides the sizes (e.g. :data:`K_QUANT_DIMS`)."""
    overrides = {"rope_theta": 10000.0} if family == "llama" else {}
    overrides.update(dims or {})
    if family.startswith("gemma"):
        overrides["query_pre_attn_scalar"] = overrides.get("head_dim", 32)
    folder = make_tiny_model(family, path, overrides=overrides, **kw)
    split = {"llama": LLAMA3_REGEX, "qwen2": QWEN2_REGEX, "qwen3": QWEN2_REGEX}.get(family)
    if split is not None:
        tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
            tokenizers.pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
            tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.save(str(folder / "tokenizer.json"))
    return folder


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py order of q/k rows: each head's two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_factors(cfg: dict) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` tensor for Llama 3 rope scaling (convert_hf_to_gguf.py's formula)."""
    rs = cfg["rope_scaling"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (cfg["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high, orig = (rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"],
                               rs["original_max_position_embeddings"])
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def text_config(folder: Path) -> dict:
    cfg = json.loads((folder / "config.json").read_text())
    return cfg.get("text_config", cfg)


def hf_tensors(folder: Path) -> dict[str, np.ndarray]:
    """The decoder's tensors as float32, under plain causal-LM names."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        for name, w in mx.load(str(f)).items():
            if name.startswith(("vision_tower.", "multi_modal_projector.")):
                continue
            out[name.removeprefix("language_model.")] = np.array(w.astype(mx.float32))
    return out


def gguf_name(hf: str, gemma: bool) -> str:
    module, kind = hf.rsplit(".", 1)
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if module in top:
        return f"{top[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)
    name = (_GEMMA_LAYER.get(rest) if gemma else None) or _LAYER[rest]
    return f"blk.{layer}.{name}.{kind}"


def tensors(folder: Path) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 data) in llama.cpp's layout."""
    cfg = text_config(folder)
    mt = cfg["model_type"]
    gemma = mt.startswith("gemma")
    out = []
    for hf, w in hf_tensors(folder).items():
        if mt == "llama" and ".q_proj." in hf:
            w = permute(w, cfg["num_attention_heads"])
        elif mt == "llama" and ".k_proj." in hf:
            w = permute(w, cfg["num_key_value_heads"])
        if gemma and hf.endswith("norm.weight"):
            w = w + np.float32(1.0)
        out.append((gguf_name(hf, gemma), w))
    if (cfg.get("rope_scaling") or {}).get("rope_type") == "llama3":
        out.append(("rope_freqs.weight", rope_factors(cfg)))
    return out


def metadata(folder: Path) -> dict:
    """The metadata llama.cpp writes for this model: {key: value}; ints are uint32, floats float32."""
    cfg = text_config(folder)
    mt = cfg["model_type"]
    a = ARCH[mt]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    meta = {
        "general.name": f"tiny-{mt}",
        f"{a}.block_count": cfg["num_hidden_layers"], f"{a}.context_length": cfg["max_position_embeddings"],
        f"{a}.embedding_length": cfg["hidden_size"], f"{a}.feed_forward_length": cfg["intermediate_size"],
        f"{a}.attention.head_count": cfg["num_attention_heads"],
        f"{a}.attention.head_count_kv": cfg["num_key_value_heads"],
        f"{a}.attention.key_length": hd, f"{a}.attention.value_length": hd, f"{a}.rope.dimension_count": hd,
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
        f"{a}.rope.freq_base": float(cfg["rope_theta"]),
    }
    if mt.startswith("gemma"):
        meta[f"{a}.attention.sliding_window"] = cfg["sliding_window"]
    if mt == "gemma2":
        meta[f"{a}.attn_logit_softcapping"] = float(cfg["attn_logit_softcapping"])
        meta[f"{a}.final_logit_softcapping"] = float(cfg["final_logit_softcapping"])
    if mt == "gemma3_text":
        meta[f"{a}.rope.scaling.type"] = cfg["rope_scaling"]["rope_type"]
        meta[f"{a}.rope.scaling.factor"] = float(cfg["rope_scaling"]["factor"])
        period = cfg["sliding_window_pattern"]
        meta[f"{a}.attention.sliding_window_pattern"] = [(i + 1) % period != 0 for i in range(cfg["num_hidden_layers"])]
    meta.update(tokenizer_metadata(folder, cfg["vocab_size"], gemma=mt.startswith("gemma")))
    return meta


def tokenizer_metadata(folder: Path, vocab_size: int, *, gemma: bool) -> dict:
    tj = json.loads((folder / "tokenizer.json").read_text())
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    tokens: list = [None] * vocab_size
    types = [1] * vocab_size
    for t, i in tj["model"]["vocab"].items():
        tokens[i] = t
    for added in tj["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = _CONTROL if added["special"] else _USER_DEFINED
    for i, t in enumerate(tokens):
        if t is None:
            tokens[i], types[i] = f"[PAD{i}]", _UNUSED
        elif gemma and t.startswith("<0x") and len(t) == 6:
            types[i] = _BYTE
    ids = {t: i for i, t in enumerate(tokens)}
    meta = {"tokenizer.ggml.model": "llama" if gemma else "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.chat_template": tcfg["chat_template"]}
    if gemma:
        types[ids["<unk>"]] = _UNKNOWN
        # SentencePiece scores: a piece made by an earlier merge scores higher
        meta["tokenizer.ggml.scores"] = [float(-i) if ty == 1 else 0.0 for i, ty in enumerate(types)]
        meta["tokenizer.ggml.add_space_prefix"] = False
        meta["tokenizer.ggml.pre"] = "default"
    else:
        meta["tokenizer.ggml.merges"] = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
        meta["tokenizer.ggml.pre"] = PRE[text_config(folder)["model_type"]]
    for key, name in (("bos_token_id", "bos_token"), ("eos_token_id", "eos_token"),
                      ("padding_token_id", "pad_token"), ("unknown_token_id", "unk_token")):
        if tcfg.get(name):
            meta[f"tokenizer.ggml.{key}"] = ids[tcfg[name]]
    meta["tokenizer.ggml.add_bos_token"] = bool(tcfg.get("add_bos_token", gemma or "<|begin_of_text|>" in ids))
    meta["tokenizer.ggml.add_eos_token"] = False
    return meta


# K-QUANT_DIMS: sizes whose rows are whole 256-value super-blocks (hidden, heads x head size, feed-forward)
K_QUANT_DIMS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64, num_hidden_layers=2)
# types gguf can only dequantize: the offsets of each block's float16 scale fields (ggml's block structs:
# Q2_K ends in d, dmin; Q3_K and Q6_K end in d; the others start with d, and Q4_K/Q5_K with d, dmin)
SCALE_FIELDS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
                T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,),
                T.IQ3_XXS: (0,), T.IQ3_S: (0,), T.IQ1_S: (0,), T.IQ1_M: "IQ1_M"}


def _set_f16(blocks: np.ndarray, field, values: np.ndarray) -> None:
    bits = values.astype(np.float16).view(np.uint16)
    if field == "IQ1_M":  # d is split into the top 4 bits of the block's four uint16 scales (bytes 48..55)
        scales = blocks[:, 48:56].copy().view(np.uint16)
        for i in range(4):
            scales[:, i] = (scales[:, i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
        blocks[:, 48:56] = scales.view(np.uint8)
    else:
        blocks[:, field:field + 2] = bits.view(np.uint8).reshape(-1, 2)


# the float16 fields random blocks get their spread from: SCALE_FIELDS, and the scale d (and the min m of
# Q4_1 and Q5_1) of the types gguf also quantizes
BLOCK_FIELDS = {**SCALE_FIELDS, T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2)}


def _calibration(blocks: np.ndarray, qtype: T) -> tuple[float, float]:
    """(ratio, unit) of random ``blocks``: with every block's scale at 1 and its min (where the type has
    one) at ``ratio``, gguf's dequantization has mean zero and standard deviation ``unit``."""
    fields = BLOCK_FIELDS[qtype]
    fields = (fields,) if isinstance(fields, str) else fields

    def read(*scales):  # gguf's values with every block's scale fields set to ``scales``
        b = blocks.copy()
        for field, value in zip(fields, scales):
            _set_f16(b, field, np.full(len(b), value))
        return gguf.quants.dequantize(b, qtype)

    ratio = read(1.0, 0.0).mean() / -read(0.0, 1.0).mean() if len(fields) == 2 else 0.0
    return ratio, read(1.0, ratio).std()


def _spread(blocks: np.ndarray, qtype: T, factor: np.ndarray, ratio: float) -> None:
    fields = BLOCK_FIELDS[qtype]
    for field, value in zip((fields,) if isinstance(fields, str) else fields, (1.0, ratio)):
        _set_f16(blocks, field, factor * value)


def random_blocks(w: np.ndarray, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """Valid random ``qtype`` blocks for a tensor of ``w``'s shape: random bytes, with each block's
    float16 scales set (a random factor in [0.5, 1.5] per block) so that gguf's dequantization has
    ``w``'s standard deviation and, where the type has a min, mean zero."""
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(w.size // per, size), dtype=np.uint8)
    ratio, unit = _calibration(blocks, qtype)
    _spread(blocks, qtype, rng.uniform(0.5, 1.5, len(blocks)) * float(w.std()) / unit, ratio)
    return blocks.reshape(w.shape[0], -1)


@functools.lru_cache(maxsize=None)
def _type_calibration(qtype: T) -> tuple[float, float]:
    """:func:`_calibration` of 4096 random blocks: what any tensor of random ``qtype`` blocks has."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    return _calibration(np.random.default_rng(0).integers(0, 256, size=(4096, size), dtype=np.uint8), qtype)


def random_tensor_blocks(shape: tuple, qtype: T, std: float, rng: np.random.Generator) -> np.ndarray:
    """:func:`random_blocks` of a ``shape`` tensor with standard deviation ``std``, at any size: no
    float32 values are made, and the scales come from the type's calibration on a sample.  Where the
    type has no min, half the blocks' scales are negative: random codes of Q4_0 or Q8_0 average half a
    step below zero, a bias every row would share."""
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(int(np.prod(shape, dtype=np.int64)) // per, size), dtype=np.uint8)
    ratio, unit = _type_calibration(qtype)
    factor = rng.uniform(0.5, 1.5, len(blocks)) * std / unit
    if ratio == 0.0:
        factor *= rng.choice(np.array([-1.0, 1.0]), len(blocks))
    _spread(blocks, qtype, factor, ratio)
    return blocks.reshape(shape[0], -1)


def q4_k(w: np.ndarray) -> np.ndarray:
    """``w`` (rows of whole 256-value super-blocks) as Q4_K blocks, by min/max per 32-value sub-block: each
    value is d * sc * q - dmin * m, with 6-bit sc and m per sub-block and 4-bit q (a plain encoder, not
    llama.cpp's search for the best scales: what matters here is a valid file close to ``w``)."""
    x = w.astype(np.float32).reshape(-1, 8, 32)
    low = np.minimum(x.min(axis=2), 0)
    scale = (x.max(axis=2) - low) / 15
    d = (scale.max(axis=1) / 63).astype(np.float16)
    dmin = ((-low).max(axis=1) / 63).astype(np.float16)
    fd, fdmin = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, fd, out=np.zeros_like(scale), where=fd > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(np.divide(-low, fdmin, out=np.zeros_like(low), where=fdmin > 0)), 0, 63).astype(np.uint8)
    step = (fd * sc)[:, :, None]
    q = np.round(np.divide(x + (fdmin * m)[:, :, None], step, out=np.zeros_like(x), where=step > 0))
    q = np.clip(q, 0, 15).astype(np.uint8)
    packed = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 0xF) | (m[:, 4:] & 0xF) << 4], axis=1)
    qs = (q[:, 0::2] | q[:, 1::2] << 4).reshape(-1, 128)  # 32 bytes per pair of sub-blocks
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, qs], axis=1)
    return blocks.reshape(w.shape[0], -1)


def q6_k(w: np.ndarray) -> np.ndarray:
    """``w`` as Q6_K blocks: each value d * sc * (q - 32), an 8-bit sc per 16 values and a 6-bit q, by the
    largest magnitude per 16 values (a plain encoder, as :func:`q4_k`)."""
    x = w.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(x).max(axis=2) / 31
    d = (scale.max(axis=1) / 127).astype(np.float16)
    fd = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, fd, out=np.zeros_like(scale), where=fd > 0)), 0, 127).astype(np.int8)
    step = (fd * sc)[:, :, None]
    q = np.round(np.divide(x, step, out=np.zeros_like(x), where=step > 0))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128 values
    ql = (q[:, :, :64] & 0xF) | (q[:, :, 64:] & 0xF) << 4
    hi = (q >> 4).reshape(-1, 2, 4, 32)
    qh = hi[:, :, 0] | hi[:, :, 1] << 2 | hi[:, :, 2] << 4 | hi[:, :, 3] << 6
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8),
                             d.view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(w.shape[0], -1)


ENCODERS = {T.Q4_K: q4_k, T.Q6_K: q6_k}


def requantize(src: Path, out: Path, qtype) -> Path:
    """The GGUF ``src`` again with its 2-D weights in ``qtype`` (a name, or a function as
    :func:`llama_cpp_q4_k_m`): each tensor as gguf reads it, encoded by :data:`ENCODERS` (Q4_K, Q6_K) or
    gguf's quantizers, the metadata copied as it is."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment"):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    choose = qtype if callable(qtype) else (lambda n, w: T[qtype] if w.ndim == 2 else T.F32)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32)
        typ = choose(t.name, w)
        if typ == T.F32:
            writer.add_tensor(t.name, w)
            continue
        q = ENCODERS[typ](w) if typ in ENCODERS else gguf.quants.quantize(w, typ)
        writer.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=typ)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def encode(w: np.ndarray, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """``w`` as ``qtype`` blocks (uint8 rows): random blocks for the types gguf only dequantizes, else
    gguf's quantizer."""
    return random_blocks(w, qtype, rng) if qtype in SCALE_FIELDS else gguf.quants.quantize(w, qtype)


def llama_cpp_q4_k_m(name: str, w: np.ndarray, tied: bool = False) -> T:
    """The type llama.cpp's Q4_K_M recipe gives a tensor: Q6_K for the output (the embedding where it is
    ``tied`` to the output), the value projections and every other layer's down projection, Q4_K
    elsewhere; rows that are not whole 256-value super-blocks fall back to Q8_0 (for Q6_K) and Q5_0
    (for Q4_K); norms and biases stay F32."""
    if w.ndim != 2:
        return T.F32
    layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
    big = name.startswith("output.") or (tied and name.startswith("token_embd.")) or ".attn_v." in name or \
        (".ffn_down." in name and layer % 2 == 0)
    if w.shape[1] % 256:
        return T.Q8_0 if big else T.Q5_0
    return T.Q6_K if big else T.Q4_K


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of :func:`permute`: Hugging Face's q/k row order again."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantized_twin(folder: Path, path: Path, out: Path) -> Path:
    """A copy of the safetensors ``folder`` whose weights are gguf's own reading of the GGUF ``path``
    (``gguf.GGUFReader`` and ``gguf.quants.dequantize``) in Hugging Face's layout: what loading the
    GGUF must give, weight for weight."""
    from safetensors.numpy import save_file

    cfg = text_config(folder)
    mt = cfg["model_type"]
    gemma = mt.startswith("gemma")
    hf = {gguf_name(n, gemma): n for n in hf_tensors(folder)}
    weights = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.name == "rope_freqs.weight":
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32)
        name = hf[t.name]
        if mt == "llama" and ".q_proj." in name:
            w = unpermute(w, cfg["num_attention_heads"])
        elif mt == "llama" and ".k_proj." in name:
            w = unpermute(w, cfg["num_key_value_heads"])
        if gemma and name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        weights[name] = np.ascontiguousarray(w)
    shutil.copytree(folder, out)
    for f in out.glob("*.safetensors*"):
        f.unlink()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def quantized(w: np.ndarray, qtype: T) -> np.ndarray:
    """What a reader gets back from ``w`` stored as ``qtype`` (gguf's own numpy reference)."""
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)


def add_metadata(writer: gguf.GGUFWriter, meta: dict) -> None:
    """Each value as llama.cpp's converter types it: ints uint32, floats float32."""
    for key, value in meta.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)


def write_gguf(folder: Path, out: Path, qtype="F32", *, meta_edits: dict | None = None,
               tensor_edits=None, arch: str | None = None, seed: int = 0) -> Path:
    """Write the model of ``folder`` as a GGUF: 2-D weights as ``qtype``, norms and biases F32.

    ``qtype`` is a type name or a function (GGUF name, data) -> type, as :func:`llama_cpp_q4_k_m`;
    ``meta_edits`` replaces keys (None deletes one); ``tensor_edits(list)`` returns the
    (name, data, type) list to write, to build broken files; ``seed`` draws the random blocks.
    """
    meta = metadata(folder)
    for key, value in (meta_edits or {}).items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    choose = qtype if callable(qtype) else (lambda n, w: T[qtype] if w.ndim == 2 else T.F32)
    plan = [(n, w, choose(n, w)) for n, w in tensors(folder)]
    if tensor_edits is not None:
        plan = tensor_edits(plan)
    writer = gguf.GGUFWriter(str(out), arch or ARCH[text_config(folder)["model_type"]])
    add_metadata(writer, meta)
    rng = np.random.default_rng(seed)
    for name, w, typ in plan:
        if typ == T.F32:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
        elif typ == T.F16:
            writer.add_tensor(name, w.astype(np.float16))
        elif isinstance(w, np.ndarray) and w.dtype == np.uint8:  # raw blocks, written as given
            writer.add_tensor(name, w, raw_shape=w.shape, raw_dtype=typ)
        else:
            q = encode(w, typ, rng)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=typ)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# A Llama 2 7B's sizes, for write_random_gguf: 6.7e9 weights, 3.5 GiB in Q4_0
LLAMA2_7B = dict(hidden=4096, ffn=11008, layers=32, heads=32, kv_heads=32, vocab=32000, tied=False)


def write_random_gguf(path: Path, *, hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, vocab: int,
                      tied: bool, qtype="Q4_0", rope_base: float = 10000.0, context: int = 2048,
                      seed: int = 0) -> Path:
    """A Llama-architecture GGUF of these sizes with random weights, written tensor by tensor: each
    matrix is drawn straight as ``qtype`` blocks (:func:`random_tensor_blocks`, with the spreads
    of slotinfer's tiny models), so a 7B-shaped file takes the memory of its largest tensor, never
    of its float32 weights.  Norms are F32 ones; the tokenizer is the tiny Llama model's, padded to
    ``vocab`` with ``[PADn]`` tokens.  ``qtype``: a type name or a function (GGUF name, data) -> type
    as for :func:`write_gguf` (its data: zeros of the tensor's shape); ``tied``: no output matrix."""
    from slotinfer.testing.weights import EMBED_STD, LINEAR_GAIN, OUT_GAIN, QK_GAIN

    hd = hidden // heads
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not tied:
        shapes["output.weight"] = (vocab, hidden)
    for i in range(layers):
        for name, s in (("attn_norm", (hidden,)), ("attn_q", (hidden, hidden)), ("attn_k", (kv_heads * hd, hidden)),
                        ("attn_v", (kv_heads * hd, hidden)), ("attn_output", (hidden, hidden)),
                        ("ffn_norm", (hidden,)), ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                        ("ffn_down", (hidden, ffn))):
            shapes[f"blk.{i}.{name}.weight"] = s
    choose = qtype if callable(qtype) else (lambda n, w: T[qtype] if w.ndim == 2 else T.F32)
    types = {name: choose(name, np.broadcast_to(np.float32(0), s)) for name, s in shapes.items()}

    def std(name: str) -> float:
        if name == "token_embd.weight":
            return EMBED_STD
        gain = QK_GAIN if ".attn_q." in name or ".attn_k." in name else \
            OUT_GAIN if ".attn_output." in name or ".ffn_down." in name else LINEAR_GAIN
        return gain / shapes[name][1] ** 0.5

    meta = {"block_count": layers, "context_length": context, "embedding_length": hidden,
            "feed_forward_length": ffn, "attention.head_count": heads, "attention.head_count_kv": kv_heads,
            "attention.key_length": hd, "attention.value_length": hd, "rope.dimension_count": hd,
            "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": float(rope_base)}
    with tempfile.TemporaryDirectory() as tmp:  # the tiny model's folder, for its tokenizer
        tok = make_tiny_model("llama", Path(tmp))
        meta = {"general.name": "random-llama", **{f"llama.{k}": v for k, v in meta.items()},
                **tokenizer_metadata(tok, vocab, gemma=False)}
    writer = gguf.GGUFWriter(str(path), "llama")
    add_metadata(writer, meta)
    for name, s in shapes.items():  # the tensor table first; the data follows in the same order
        if types[name] == T.F32:
            writer.add_tensor_info(name, s, np.dtype(np.float32), 4 * int(np.prod(s)))
        else:
            per, size = gguf.GGML_QUANT_SIZES[types[name]]
            writer.add_tensor_info(name, (s[0], s[1] // per * size), np.dtype(np.uint8), s[0] * s[1] // per * size,
                                   raw_dtype=types[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, s in shapes.items():
        if types[name] == T.F32:
            writer.write_tensor_data(np.ones(s, dtype=np.float32))
        else:
            writer.write_tensor_data(random_tensor_blocks(s, types[name], std(name), rng))
    writer.close()
    return path
