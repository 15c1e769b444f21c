"""``load(path)``: a Hugging Face-layout folder -> :class:`Model`.

Reads ``config.json``, every ``*.safetensors`` shard (dense f32/f16/bf16 or the
MLX-quantized layout: packed uint32 ``.weight`` + ``.scales`` + ``.biases``),
the tokenizer files and ``generation_config.json``.  Weight names stay the
checkpoint's own; the only rewrites are the ones the decoder needs (fused
projections, Gemma's norm offset folded in) and they happen here, once.
A ``.gguf`` file (or a folder holding one and no config.json) is read by
:mod:`slotinfer.loading.gguf` and joins the same :func:`assemble` tail.

Why one module: the checks on a model's files must run in one order, before anything is
allocated.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path, PurePosixPath
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import device, settings
from . import gguf
from . import hub
from .._files import check_regular, open_regular, read_json, where_missing
from ..errors import ConfigError, InvalidRequestError, ModelNotFoundError, TokenizerError, WeightError
from ..model import Model
from ..models import ModelConfig, Transformer, expected_shapes, parse_config
from ..text.tokenizer import Tokenizer

_DROP_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("language_model.", ""),
                  # a bare decoder without its head, as embedding models (Qwen3-Embedding) publish it
                  ("embed_tokens.", "model.embed_tokens."), ("layers.", "model.layers."), ("norm.", "model.norm."))
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_QUANT_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize / mx.dequantize support
_QUANT_GROUPS = (32, 64, 128)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "chat_template.json")
_MAX_HEADER = 100_000_000  # the safetensors format's own limit on the JSON header
_FINITE_BATCH = 64 * 2**20  # bytes of small float tensors checked for NaN/Inf in one reduction


def load(path, *, dtype=None, revision=None, weights: bool = True) -> Model:
    """Load a decoder checkpoint folder (Hugging Face or MLX-quantized layout), a GGUF file, or a
    Hugging Face repo id (``"org/name"``, at ``revision``) through huggingface_hub's cache.

    ``dtype`` overrides the device policy's compute dtype (float32 on CPU, the
    stored dtype on a GPU), e.g. ``load(path, dtype="bfloat16")``.

        >>> model = slotinfer.load("models/Qwen3-0.6B")
        >>> model = slotinfer.load("SmolLM2-135M-Instruct.Q4_1.gguf")  # docs/gguf.md
        >>> model = slotinfer.load("HuggingFaceTB/SmolLM2-135M-Instruct")
        >>> model.generate("The capital of France is", max_tokens=8).text

    ``weights=False`` reads the config, tokenizer and chat template only, not the weights (``model.net``
    is None): enough to render, encode and decode prompts that run elsewhere (the Ray Serve ingress).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidRequestError(f"load() takes the path of a model folder (a str or Path), got {path!r}")
    path = hub.local_path(path, revision)  # a repo id becomes its snapshot folder (or file) in the cache
    folder = Path(path).expanduser()
    gguf_file = gguf.find(folder)
    if gguf_file is not None:
        return _load_gguf(gguf_file, dtype) if weights else _gguf_text(gguf_file)
    if folder.is_file():
        raise ModelNotFoundError(
            f"{str(folder)!r} is a file, not a folder; pass the folder holding config.json "
            f"(here probably {str(folder.parent)!r})"
        )
    if os.path.lexists(folder) and not folder.is_dir():
        check_regular(folder, error=ModelNotFoundError)  # a pipe, a device or a symlink loop: says which
    if not folder.is_dir() and folder.suffix.lower() == ".gguf":
        raise ModelNotFoundError(f"the GGUF file {str(path)!r} does not exist ({where_missing(folder)}); check "
                                 "its path")
    if not folder.is_dir():
        raise ModelNotFoundError(f"model folder {str(path)!r} does not exist ({where_missing(folder)}); pass the "
                                 "folder holding config.json, a .gguf file, or a Hugging Face repo id (org/name)")
    raw = read_json(folder / "config.json", error=ConfigError, required=True)
    cfg = parse_config(raw)

    def tokenizer():
        tok = Tokenizer.from_folder(folder)
        if tok.vocab_size > cfg.vocab_size:
            raise TokenizerError(
                f"tokenizer.json has {tok.vocab_size} tokens but the model's vocab_size is {cfg.vocab_size}: "
                "the tokenizer belongs to another model; copy the tokenizer files of this checkpoint"
            )
        return tok, frozenset(tok.eos_ids)  # the tokenizer read the folder's declared EOS ids

    if not weights:
        for name in _TOKENIZER_FILES:
            check_regular(folder / name, error=TokenizerError)
        tok, eos_ids = tokenizer()
        return Model(None, cfg, tok, eos_ids=eos_ids, dtype=None, path=folder)
    files = shard_files(folder)
    specs = _text_weights({k: v for f in files for k, v in read_header(f).items()})
    check_weights(cfg, specs, _quant_params(raw, specs))  # the config against the headers, before any data
    for name in _TOKENIZER_FILES:  # what the tokenizer reads, refused before the weights are read when it cannot be
        check_regular(folder / name, error=TokenizerError)
    check_regular(folder / "generation_config.json", error=ConfigError)
    weights = _text_weights(_read_data(files))
    quant = _quant_params(raw, weights)
    return assemble(cfg, weights, quant, dtype=dtype, path=folder, tokenizer=tokenizer)


def assemble(cfg: ModelConfig, weights: dict, quant: dict, *, dtype, path: Path, tokenizer,
             checked: bool = False) -> Model:
    """The tail every checkpoint format shares: device policy, checks, dequantize or keep quantized,
    build the Transformer, load its weights; ``tokenizer()`` gives (Tokenizer, EOS ids).  ``weights``
    is consumed (emptied); ``checked``: the reader has already refused NaN and Inf."""
    stored = _stored_dtype(weights)
    compute = device.compute_dtype(stored, override=dtype)
    device.retain_freed_memory()
    keep_q = device.keep_quantized() and dtype is None
    check_weights(cfg, weights, quant)
    if settings.check_finite() and not checked:
        check_finite(weights, path.name)
    weights = _prepare(cfg, weights, quant, compute, keep_q)

    net = Transformer(cfg, device.model_ops())
    kept = {name.rsplit(".", 1)[0]: quant[name.rsplit(".", 1)[0]] for name in weights if name.endswith(".scales")}
    if kept:
        nn.quantize(net, class_predicate=lambda p, m: kept.get(p, False))
    blocks = {m: q["format"] for m, q in quant.items() if "format" in q}
    if blocks:  # GGUF blocks kept for the CPU's own kernels
        from ..cpu import qlayers

        qlayers.swap(net, blocks)
    net.load_weights(list(weights.items()), strict=True)
    mx.eval(net.parameters())
    tok, eos_ids = tokenizer()
    device.release_free_memory()
    return Model(net, cfg, tok, eos_ids=eos_ids, dtype=compute, path=path)


def _load_gguf(file: Path, dtype) -> Model:
    cfg, weights, quant, meta, checked = gguf.read(file, keep_quantized=device.keep_quantized() and dtype is None,
                                                   dtype=device.compute_dtype(mx.float32, override=dtype),
                                                   blocks=device.cpu_block_kernels() and dtype is None)
    tok = _gguf_tokenizer(file, cfg, meta)
    return assemble(cfg, weights, quant, dtype=dtype, path=file, tokenizer=lambda: (tok, tok.eos_ids),
                    checked=checked)


def _gguf_text(file: Path) -> Model:
    cfg, _, _, _, meta = gguf.header(file)
    tok = _gguf_tokenizer(file, cfg, meta)
    return Model(None, cfg, tok, eos_ids=tok.eos_ids, dtype=None, path=file)


def _gguf_tokenizer(file: Path, cfg: ModelConfig, meta: dict) -> Tokenizer:
    tok = Tokenizer.from_gguf(meta, file.name)
    if tok.vocab_size > cfg.vocab_size:
        raise TokenizerError(
            f"{file.name}: the vocabulary (tokenizer.ggml.tokens) has {tok.vocab_size} tokens but token_embd has "
            f"{cfg.vocab_size} rows; the file is inconsistent, re-convert it")
    return tok


class TensorSpec(NamedTuple):
    """A tensor as its file's header describes it: enough to check a config against, no data."""

    dtype: mx.Dtype
    shape: tuple


_ST_DTYPES = {"F64": mx.float64, "F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16, "U32": mx.uint32,
              "I32": mx.int32, "U16": mx.uint16, "I16": mx.int16, "U8": mx.uint8, "I8": mx.int8,
              "U64": mx.uint64, "I64": mx.int64, "BOOL": mx.bool_}


def _read_data(files: list[Path]) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # mlx raises plain RuntimeError/ValueError on bad files
            raise WeightError(f"cannot read {f.name}: {e}; the file is damaged, re-download it") from None
    return weights


def shard_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: those its index names, else every ``*.safetensors``; each one
    inside the folder (see :func:`_inside`)."""
    index = folder / "model.safetensors.index.json"
    if os.path.lexists(index):
        data = read_json(index, error=WeightError)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise WeightError(
                f"{index} has no 'weight_map' object; restore the file from the checkpoint "
                "(or delete it to read every *.safetensors file of the folder)"
            )
        bad = [f for f in weight_map.values() if not isinstance(f, str) or not f]
        if bad:
            raise WeightError(
                f"{index.name}: 'weight_map' must map tensor names to shard file names, got {bad[0]!r}; "
                "restore the file from the checkpoint"
            )
        names = sorted(set(weight_map.values()))
        for name in names:
            _plain_name(name, index)
        files = [folder / name for name in names]
        missing = [f.name for f in files if not os.path.lexists(f)]
        if missing:
            raise ModelNotFoundError(f"shards listed in {index.name} are missing: {', '.join(missing)}")
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ModelNotFoundError(f"no *.safetensors weights in {str(folder)!r}")
    for f in files:
        _inside(f, folder)
    return files


def _plain_name(name: str, index: Path) -> None:
    """A shard name of an index is a relative path below the folder: no absolute path, no '..'."""
    parts = PurePosixPath(name).parts
    if name.startswith(("/", "\\")) or "\\" in name or "\0" in name or ".." in parts or not parts:
        raise WeightError(
            f"{index.name} names the shard {name!r}, which is not a file inside the model folder; shard names "
            "are file names relative to the folder (like model-00001-of-00002.safetensors): restore the index "
            "from the checkpoint"
        )


def _inside(file: Path, folder: Path) -> None:
    """A weights file must resolve into the model folder, or, in a Hugging Face hub cache snapshot,
    into the blobs folder of the same repo (where the hub keeps the files a snapshot links to)."""
    root = Path(os.path.realpath(folder))
    target = Path(os.path.realpath(file))
    allowed = [root] + [up.parent / "blobs" for up in root.parents
                        if up.name == "snapshots" and up.parent.name.startswith("models--")][:1]
    if not any(target.is_relative_to(a) for a in allowed):
        raise WeightError(
            f"{file.name} in {folder} leads outside the model folder (a symlink to a file elsewhere); slotinfer "
            "reads weights only from inside the folder: copy the file into the folder instead of linking it"
        )


def read_header(f: Path) -> dict[str, TensorSpec]:
    """The tensors a safetensors file declares, checked against the file before any data is read:
    truncated downloads, files that are not safetensors at all, and headers that lie about sizes."""
    with open_regular(f, error=WeightError) as fh:
        size = os.fstat(fh.fileno()).st_size
        start = fh.read(64)
        if start.startswith(b"version https://git-lfs"):
            raise WeightError(
                f"{f.name} is a git-lfs pointer file, not the weights: fetch the real file "
                "(`git lfs pull` in the clone, or re-download it)"
            )
        if len(start) < 8:
            raise WeightError(f"{f.name} is truncated ({size} bytes); re-download it")
        n = struct.unpack("<Q", start[:8])[0]
        if n > _MAX_HEADER or start[8:9] not in (b"{", b""):  # a safetensors header is a JSON object
            raise WeightError(
                f"{f.name} is not a safetensors file (its first bytes are no safetensors header); "
                "the download is damaged or is something else (an error page?), re-download it"
            )
        if 8 + n > size:
            raise WeightError(f"{f.name} is truncated: its header needs {8 + n} bytes, the file has {size}; re-download it")
        fh.seek(8)
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise WeightError(f"{f.name} has a damaged header; it is not a complete safetensors file, re-download it") from None
    if not isinstance(header, dict):
        raise WeightError(f"{f.name} has a damaged header; it is not a complete safetensors file, re-download it")
    specs, end = {}, 0
    for k, v in header.items():
        if k == "__metadata__":
            continue
        specs[k] = spec = _tensor_spec(f, k, v)
        o = v["data_offsets"]
        if o[1] - o[0] != math.prod(spec.shape) * spec.dtype.size:
            raise WeightError(
                f"{f.name}: tensor {k!r} ({v['dtype']}, shape {spec.shape}) spans {o[1] - o[0]} bytes, "
                f"its shape needs {math.prod(spec.shape) * spec.dtype.size}; the file is damaged, re-download it"
            )
        end = max(end, o[1])
    if 8 + n + end > size:
        raise WeightError(f"{f.name} is truncated: its header needs {8 + n + end} bytes, the file has {size}; re-download it")
    return specs


def _tensor_spec(f: Path, k: str, v) -> TensorSpec:
    o = v.get("data_offsets") if isinstance(v, dict) else None
    if not (isinstance(o, list) and len(o) == 2 and all(isinstance(x, int) for x in o) and 0 <= o[0] <= o[1]):
        raise WeightError(
            f"{f.name} is not a valid safetensors file (tensor {k!r} has no valid 'data_offsets'); "
            "the file is damaged, re-download it"
        )
    shape = v.get("shape")
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise WeightError(f"{f.name} is not a valid safetensors file (tensor {k!r} has no valid 'shape'); "
                          "the file is damaged, re-download it")
    dtype = _ST_DTYPES.get(v.get("dtype"))
    if dtype is None:
        raise WeightError(f"{f.name}: tensor {k!r} has dtype {v.get('dtype')!r}, which slotinfer cannot read "
                          f"(it reads {', '.join(_ST_DTYPES)}); convert the checkpoint to float16, bfloat16 or float32")
    return TensorSpec(dtype, tuple(shape))


def _text_weights(weights: dict) -> dict:
    """Keep the decoder's tensors under the names a plain causal LM uses."""
    out = {}
    for name, w in weights.items():
        if name.startswith(_DROP_PREFIXES) or name.endswith("rotary_emb.inv_freq"):
            continue
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        out[name] = w
    return out


def check_finite(weights: dict, source: str) -> None:
    """Refuse NaN or Inf in any float tensor (a damaged file, or one saved after training diverged).

    Small tensors are checked a batch at a time (norms and quantization scales run to hundreds of
    tensors, where one reduction each would cost more in dispatch than in reading), each batch
    one reduction; only a batch that fails is searched tensor by tensor."""
    names = [n for n, w in weights.items() if mx.issubdtype(w.dtype, mx.floating)]
    batches, batch, size = [], [], 0
    for n in names:
        batch.append(n)
        size += weights[n].nbytes
        if size >= _FINITE_BATCH:
            batches.append(batch)
            batch, size = [], 0
    batches += [batch] if batch else []

    def finite(group):
        flat = [weights[n].reshape(-1) for n in group]
        return mx.isfinite(flat[0] if len(flat) == 1 else mx.concatenate(flat)).all()

    if not batches or all(mx.stack([finite(b) for b in batches]).tolist()):
        return
    bad = [n for n in names if not mx.isfinite(weights[n]).all().item()]
    more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
    raise WeightError(
        f"{source}: tensor {', '.join(bad[:3])}{more} holds NaN or Inf values; the weights are damaged "
        "(or were saved after training diverged): re-download or re-convert them. "
        "SLOTINFER_CHECK_FINITE=0 skips this check"
    )


def _quant_params(raw: dict, weights: dict) -> dict[str, dict]:
    """{module path: {"group_size", "bits"}} for every quantized module in the checkpoint."""
    q = raw.get("quantization") or raw.get("quantization_config") or {}
    if not isinstance(q, dict):
        raise ConfigError(f"config.json: 'quantization' must be an object like {{\"group_size\": 64, \"bits\": 4}}, "
                          f"got {q!r} (the value of 'quantization', or else of 'quantization_config')")
    overrides = {}
    for key, val in q.items():
        if isinstance(val, (dict, bool)):
            overrides[next(iter(_text_weights({key: 0})), key)] = val
    params = {}
    for name in weights:
        if not name.endswith(".scales"):
            continue
        module = name[: -len(".scales")]
        spec = overrides.get(module, q)
        if not isinstance(spec, dict) or "bits" not in spec or "group_size" not in spec:
            raise ConfigError(
                f"{module} is quantized (has .scales) but config.json gives no 'quantization' "
                "{group_size, bits} for it; the folder is not a complete MLX-quantized checkpoint"
            )
        if f"{module}.biases" not in weights:
            raise WeightError(f"{module}.biases is missing: affine-quantized weights need scales and biases")
        params[module] = {"group_size": _quant_int(spec, "group_size", module, _QUANT_GROUPS),
                          "bits": _quant_int(spec, "bits", module, _QUANT_BITS)}
    return params


def _quant_int(spec: dict, key: str, module: str, allowed: tuple) -> int:
    val = spec[key]
    try:
        n = int(val)
    except (TypeError, ValueError):
        n = None
    if n not in allowed or isinstance(val, bool):
        raise ConfigError(
            f"config.json: quantization {key} {val!r} (for {module}) is not valid; MLX supports "
            f"{', '.join(map(str, allowed))}: set the {key} the checkpoint was quantized with"
        )
    return n


def _stored_dtype(weights: dict):
    floats = [w.dtype for n, w in weights.items() if mx.issubdtype(w.dtype, mx.floating)]
    return max(set(floats), key=floats.count) if floats else mx.float32


def check_layer_count(cfg: ModelConfig, names, source: str = "config.json's num_hidden_layers") -> None:
    """The config's layer count against the layers the tensors hold, before anything is sized by it."""
    layers = {n.split(".")[2] for n in names if n.startswith("model.layers.")}
    if len(layers) != cfg.num_layers or any(not i.isdigit() or int(i) >= cfg.num_layers for i in layers):
        raise WeightError(
            f"{source} gives {cfg.num_layers} layers, but the tensors hold {len(layers)} (model.layers.*); "
            "the config does not belong to these weights: restore it from the checkpoint"
        )


def check_weights(cfg: ModelConfig, weights: dict, quant: dict):
    """Every tensor the config asks for, with its shape and a dtype the decoder can use; ``weights``
    holds arrays or :class:`TensorSpec` (headers), so this runs before any data is read too."""
    check_layer_count(cfg, weights)
    expected = expected_shapes(cfg)
    if cfg.tie_word_embeddings:  # some tied checkpoints still carry a copy of the head
        for suffix in ("weight", "scales", "biases"):
            weights.pop(f"lm_head.{suffix}", None)
    missing = sorted(set(expected) - set(weights))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightError(
            f"tensors missing from the checkpoint: {', '.join(missing[:5])}{more}; "
            f"the weights do not match config.json ({_deciding_keys(cfg, missing[0])})"
        )
    aux = {f"{m}.{s}" for m in quant for s in ("scales", "biases")}
    unexpected = sorted(set(weights) - set(expected) - aux)
    if unexpected:
        raise WeightError(
            f"unexpected tensors in the checkpoint: {', '.join(unexpected[:5])}; "
            f"is config.json's model_type ({cfg.model_type!r}) right for these weights?"
        )
    for name, shape in expected.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module in quant and "format" in quant[module]:
            _check_blocks(module, tuple(shape), weights[name], quant[module]["format"])
        elif name.endswith(".weight") and module in quant:
            _check_quantized(module, tuple(shape), weights, quant[module])
        elif tuple(weights[name].shape) != tuple(shape):
            raise WeightError(f"tensor {name} has shape {tuple(weights[name].shape)}, expected {tuple(shape)} from "
                              f"config.json ({_deciding_keys(cfg, name)}); the config does not belong to these weights")
        elif not mx.issubdtype(weights[name].dtype, mx.floating):
            kind = str(weights[name].dtype).rsplit(".", 1)[-1]
            raise WeightError(f"tensor {name} is {kind}, but the decoder needs floating-point weights here; "
                              "the checkpoint is damaged or mislabelled, re-download or re-convert it")


def _deciding_keys(cfg: ModelConfig, name: str) -> str:
    """The config.json keys that decide whether the checkpoint holds ``name``, and its shape."""
    if name.startswith("lm_head."):
        return f"tie_word_embeddings {cfg.tie_word_embeddings}, vocab_size {cfg.vocab_size}"
    if name.endswith("_proj.bias"):
        return f"model_type {cfg.model_type!r}, attention_bias, mlp_bias"
    return (f"model_type {cfg.model_type!r}, hidden_size {cfg.hidden_size}, intermediate_size "
            f"{cfg.intermediate_size}, num_attention_heads {cfg.num_heads}, num_key_value_heads {cfg.num_kv_heads}, "
            f"head_dim {cfg.head_dim}, vocab_size {cfg.vocab_size}")


def _check_blocks(module: str, shape: tuple, w, fmt: str):
    """GGUF blocks kept as stored: uint8 rows of in / 32 blocks (the GGUF reader made them)."""
    from ..cpu.qkernel import BLOCK_VALUES, row_bytes

    fits = len(shape) == 2 and shape[1] % BLOCK_VALUES[fmt] == 0
    want = (shape[0], row_bytes(fmt, shape[1])) if fits else None
    if want is None or w.dtype != mx.uint8 or tuple(w.shape) != want:
        raise WeightError(f"{module}.weight in {fmt} blocks is {w.dtype} {tuple(w.shape)}, expected uint8 {want} "
                          f"for its {'x'.join(map(str, shape))} weight; the file is damaged, re-download it")


def _check_quantized(module: str, shape: tuple, weights: dict, q: dict):
    """MLX's affine layout of a dense (out, in) weight: a packed uint32 .weight of (out, in * bits / 32)
    and float .scales and .biases of (out, in / group_size)."""
    bits, group_size = q["bits"], q["group_size"]
    setting = f"bits={bits}, group_size={group_size} (config.json's quantization)"
    if len(shape) != 2 or shape[1] % group_size or shape[1] * bits % 32:
        raise ConfigError(
            f"{module}: a {'x'.join(map(str, shape))} weight cannot be quantized with {setting}; "
            "the quantization settings do not belong to this model"
        )
    w = weights[f"{module}.weight"]
    if w.dtype != mx.uint32:
        raise WeightError(
            f"{module}.weight is {w.dtype}, but a quantized weight (the module has .scales) is packed uint32; "
            "the checkpoint is damaged or not in MLX's quantized layout, re-download or re-convert it"
        )
    out, inp = shape
    want = {"weight": (out, inp * bits // 32), "scales": (out, inp // group_size), "biases": (out, inp // group_size)}
    for kind, expected in want.items():
        t = weights[f"{module}.{kind}"]
        if tuple(t.shape) != expected:
            raise WeightError(
                f"tensor {module}.{kind} has shape {tuple(t.shape)}, expected {expected} for the {out}x{inp} "
                f"weight quantized with {setting}; the tensors and config.json's quantization do not match "
                "(wrong bits or group_size, or a damaged checkpoint)"
            )
        if kind != "weight" and not mx.issubdtype(t.dtype, mx.floating):
            raise WeightError(f"{module}.{kind} is {t.dtype}; quantization scales and biases must be floats, re-download it")


def _prepare(cfg, weights, quant, compute, keep_q) -> dict:
    """Dequantize (CPU policy), fold Gemma's norm offset, fuse projections and q/k norms, cast.

    ``weights`` is emptied, so that no caller keeps a tensor alive once what replaces it is made.
    GGUF blocks kept for the CPU's own kernels (quantization ``{"format": ...}``) stay as they are."""
    source, out = dict(weights), {}
    weights.clear()
    blocks = {m for m, q in quant.items() if "format" in q}
    for name, w in source.items():
        module, kind = name.rsplit(".", 1)
        if module in blocks and kind == "weight":
            out[name] = w
            continue
        if module in quant and not keep_q:
            if kind in ("scales", "biases"):  # consumed by dequantize; a Linear's own "bias" stays
                continue
        if module in quant and not keep_q and kind == "weight":
            q = quant[module]
            # in the compute dtype: half-precision scales would round every weight to half precision
            w = mx.dequantize(w, source[f"{module}.scales"].astype(compute), source[f"{module}.biases"].astype(compute),
                              group_size=q["group_size"], bits=q["bits"])
        if cfg.norm_offset and name.endswith("norm.weight"):
            w = w.astype(mx.float32) + cfg.norm_offset
        if mx.issubdtype(w.dtype, mx.floating) and not (keep_q and module in quant and kind in ("scales", "biases")):
            w = w.astype(compute)
        out[name] = w
    if not keep_q:
        for module in set(quant) - blocks:
            del quant[module]
    del source
    return _fuse(cfg, out, quant, compute)


def _widened(weights: dict, quant: dict, modules: list, specs: list) -> list:
    """A fused group's GGUF blocks all as Q8_0 where each part's format widens to it value for value
    (:func:`slotinfer.cpu.repack.widen`: Q4_0, Q5_0), so the group stays in blocks; else ``specs``."""
    from ..cpu import repack

    if not all(s and s.get("format") in repack.WIDENS for s in specs):
        return specs
    for m, s in zip(modules, specs):
        w = weights[f"{m}.weight"]
        weights[f"{m}.weight"] = mx.array(repack.widen(np.asarray(w), s["format"]))
        quant[m] = {"format": "q8_0"}
    return [quant[m] for m in modules]


def _fuse(cfg, weights: dict, quant: dict, compute) -> dict:
    for i in {n.split(".")[2] for n in weights if n.startswith("model.layers.")}:
        attn = f"model.layers.{i}.self_attn"
        if f"{attn}.q_norm.weight" in weights:  # one per-head weight for queries and keys (HeadNorm)
            q, k = weights.pop(f"{attn}.q_norm.weight"), weights.pop(f"{attn}.k_norm.weight")
            weights[f"{attn}.qk_norm.weight"] = mx.concatenate(
                [mx.broadcast_to(q, (cfg.num_heads, q.shape[-1])), mx.broadcast_to(k, (cfg.num_kv_heads, k.shape[-1]))])
        for fused, parts in _FUSED.items():
            parent = f"model.layers.{i}.{'self_attn' if fused == 'qkv_proj' else 'mlp'}"
            modules = [f"{parent}.{p}" for p in parts]
            specs = [quant.get(m) for m in modules]
            if any(s != specs[0] for s in specs):
                specs = _widened(weights, quant, modules, specs)
            if any(s != specs[0] for s in specs):  # mixed precision in one group: fuse dense
                for m, s in zip(modules, specs):
                    if s and "format" in s:  # GGUF blocks beside another type
                        from ..cpu.qlayers import dequantize

                        weights[f"{m}.weight"] = dequantize(weights[f"{m}.weight"], s["format"]).astype(compute)
                        quant.pop(m)
                    elif s:
                        w = weights[f"{m}.weight"]
                        weights[f"{m}.weight"] = mx.dequantize(
                            w, weights.pop(f"{m}.scales").astype(compute), weights.pop(f"{m}.biases").astype(compute),
                            **s)
                        quant.pop(m)
                specs = [None] * len(parts)
            for kind in ("weight", "bias", "scales", "biases"):
                names = [f"{m}.{kind}" for m in modules]
                if names[0] in weights:
                    joined = mx.concatenate([weights.pop(n) for n in names], axis=0)
                    mx.eval(joined)  # made now: its parts are freed before the next fused tensor exists
                    weights[f"{parent}.{fused}.{kind}"] = joined
            if specs[0]:
                for m in modules:
                    quant.pop(m)
                quant[f"{parent}.{fused}"] = specs[0]
        mx.eval([w for n, w in weights.items() if n.startswith(f"model.layers.{i}.")])  # the rest, layer by layer
    return weights
