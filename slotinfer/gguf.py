"""``load("model.gguf")``: llama.cpp's single-file format -> :class:`~slotinfer.model.Model`.

The header is scanned here first (tensor types, shapes, the file's extent) so that a
file slotinfer cannot represent is refused with a typed error before anything is read;
then ``mx.load`` reads weights and metadata.  F32/F16/BF16 tensors stay dense; Q4_0,
Q4_1 and Q8_0 arrive as MLX affine triples (``weight``/``scales``/``biases``, groups of
32) and go through the same device policy as MLX-quantized safetensors.  The config
comes from :mod:`slotinfer.models.gguf_config`, the tokenizer from
:mod:`slotinfer.gguf_tokenizer`.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ._files import open_regular
from .errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError, WeightError
from .models import expected_shapes, parse_config
from .models.gguf_config import architecture, config_dict, gguf_module, module_name

# GGML tensor types: id -> (name, elements per block, bytes per block); None: not readable here
_SUPPORTED = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2),
              2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34)}
_QUANT_BITS = {2: 4, 3: 4, 8: 8}
_OTHER = {6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
          15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
          22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
          34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6
_SHORT_ARRAY = 4096  # arrays up to this length are read into the scanned metadata (one entry per layer)
_MAGIC = b"GGUF"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: int
    shape: tuple  # row-major, as numpy and MLX index it (GGUF lists dims innermost first)
    offset: int  # absolute offset of the data in the file

    @property
    def type_name(self) -> str:
        return (_SUPPORTED.get(self.type) or (_OTHER.get(self.type, f"type {self.type}"),))[0]


def find(path: Path) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the only ``*.gguf`` of a folder without config.json."""
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" or _starts_with_magic(path) else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    files = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(files) > 1:
        raise ModelNotFoundError(
            f"{str(path)!r} holds {len(files)} GGUF files ({', '.join(p.name for p in files)}); "
            "pass the path of the one to load")
    return files[0] if files else None


def _starts_with_magic(path: Path) -> bool:
    with open_regular(path, error=WeightError) as f:
        return f.read(4) == _MAGIC


def scan(path: Path) -> tuple[list[TensorInfo], dict]:
    """The tensor table of a GGUF file, checked (magic, version, supported types, data inside the file),
    and its metadata's scalars, strings and short arrays: what the config is checked with before any
    tensor data is read."""
    with open_regular(path, error=WeightError) as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise WeightError(f"{path.name} is truncated ({size} bytes); re-download it")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            tensors, meta = _scan(buf, size, path.name)
    for t in tensors:
        _check_type(t, path)
        _, per_block, block_bytes = _SUPPORTED[t.type]
        count = int(np.prod(t.shape, dtype=np.int64))
        end = t.offset + count // per_block * block_bytes
        if count % per_block or end > size:
            raise WeightError(f"{path.name} is truncated or damaged: tensor {t.name} ({t.type_name}, "
                              f"shape {t.shape}) needs bytes up to {end}, the file has {size}; re-download it")
    return tensors, meta


def _scan(buf, size: int, name: str) -> tuple[list[TensorInfo], dict]:
    if buf[:4] != _MAGIC:
        raise WeightError(f"{name} is not a GGUF file (it does not start with GGUF's magic bytes); "
                          "the download is damaged or is something else, re-download it")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise WeightError(f"{name}: GGUF version {version} is not supported (2 and 3 are); "
                          "re-convert it with a current llama.cpp")
    reader = _Reader(buf, 24, name)
    meta = {}
    for _ in range(n_kv):
        key = reader.string()
        meta[key] = reader.value(reader.u32())
    alignment = meta.get("general.alignment")
    if not (isinstance(alignment, int) and not isinstance(alignment, bool) and alignment > 0):
        alignment = 32
    infos = []
    for _ in range(n_tensors):
        tensor = reader.string()
        dims = [reader.unpack("<Q") for _ in range(reader.u32())]
        infos.append((tensor, reader.u32(), tuple(reversed(dims)), reader.unpack("<Q")))
    data = -(-reader.pos // alignment) * alignment
    return [TensorInfo(n, t, s, data + o) for n, t, s, o in infos], meta


def _check_type(t: TensorInfo, path: Path) -> None:
    if t.type not in _SUPPORTED:
        raise WeightError(
            f"{path.name}: tensor {t.name} is {t.type_name}, which slotinfer cannot read; supported GGUF types: "
            f"{', '.join(v[0] for v in _SUPPORTED.values())}. Re-quantize the model to Q8_0 or Q4_0 with "
            "llama.cpp (llama-quantize --allow-requantize model.gguf out.gguf Q8_0), or load its "
            "safetensors release instead")


class _Reader:
    """Sequential reads from the header, each one checked against the end of the file."""

    def __init__(self, buf, pos: int, name: str):
        self.buf, self.pos, self.name = buf, pos, name

    def unpack(self, fmt: str):
        n = struct.calcsize(fmt)
        if self.pos + n > len(self.buf):
            raise WeightError(f"{self.name} is truncated inside its header; re-download it")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def u32(self) -> int:
        return self.unpack("<I")

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise WeightError(f"{self.name} is truncated inside its header; re-download it")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == _FLOAT32:  # the decimal the converter wrote (1e-05, not 9.999999747378752e-06)
            return float(str(np.float32(self.unpack("<f"))))
        if kind in _SCALAR:
            return self.unpack(_SCALAR[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.u32(), self.unpack("<Q")
            if item in _SCALAR and count <= _SHORT_ARRAY:  # per-layer settings
                return [self.unpack(_SCALAR[item]) for _ in range(count)]
            if item in _SCALAR:  # skipped, not parsed: token types and scores run to 10^5 entries
                self.pos += count * struct.calcsize(_SCALAR[item])
                return None
            for _ in range(count):
                self.value(item)
            return None
        raise WeightError(f"{self.name}: metadata value of unknown type {kind}; the file is damaged or from a "
                          "newer GGUF version, re-convert it")


def read(path: Path):
    """(ModelConfig, {checkpoint name: array}, {module: quantization}, metadata) of a GGUF file.

    The config is built from the scanned header and checked against the tensor table before any
    tensor data is read."""
    tensors, scanned = scan(path)
    source = path.name
    name, fam = architecture(scanned, source)
    # Llama 3.1+ rope scaling: the converter stores per-frequency factors instead of its parameters
    rope = next((t for t in tensors if t.name == "rope_freqs.weight" and t.type == 0), None)
    tensors = [t for t in tensors if t is not rope]
    by_module = {t.name.rsplit(".", 1)[0]: t for t in tensors if t.name.endswith(".weight")}
    hf_names = {}
    for t in tensors:
        module, _, kind = t.name.rpartition(".")
        own = module_name(fam, module)
        if own is None or kind not in ("weight", "bias"):
            raise UnsupportedModelError(f"{source}: tensor {t.name} has no counterpart in slotinfer's {name} "
                                        "model; load the model's safetensors release instead")
        hf_names[t.name] = f"{own}.{kind}"
    if "token_embd" not in by_module:
        raise WeightError(f"{source}: tensor token_embd.weight is missing; the file is incomplete, re-convert it")
    cfg_raw = config_dict(scanned, name, fam, vocab_rows=by_module["token_embd"].shape[0],
                          tied="output" not in by_module, source=source,
                          rope_factors=None if rope is None else _f32(path, rope))
    try:
        cfg = parse_config(cfg_raw)
    except ModelLoadError as e:
        raise type(e)(f"{source}: its metadata gives a config slotinfer cannot run: {e}") from None
    _check_shapes(cfg, fam, tensors, hf_names, source)
    try:
        weights, meta = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise WeightError(f"cannot read {source}: {e}; the file is damaged, re-download it") from None

    out, quant = {}, {}
    for t in tensors:
        hf = hf_names[t.name]
        base = t.name.rsplit(".", 1)[0]
        if t.type in _QUANT_BITS:
            module = hf.rsplit(".", 1)[0]
            quant[module] = {"group_size": 32, "bits": _QUANT_BITS[t.type]}
            parts = {k: weights[f"{base}.{k}"] for k in ("weight", "scales", "biases")}
        elif t.type == 30:  # MLX reads BF16 as float16, which loses small and large values: read the bits
            parts = {t.name.rsplit(".", 1)[1]: _bf16(path, t)}
        else:
            parts = {t.name.rsplit(".", 1)[1]: weights[t.name]}
        module = hf.rsplit(".", 1)[0]
        for kind, w in parts.items():
            if fam.permuted_qk and module.endswith(("q_proj", "k_proj")):
                heads = cfg.num_heads if module.endswith("q_proj") else cfg.num_kv_heads
                w = _unpermute(w, heads)
            if fam.norm_offset and module.endswith("norm") and kind == "weight":
                w = w.astype(mx.float32) - fam.norm_offset  # the loader adds the family's offset back
            out[f"{module}.{kind}"] = w
    return cfg, out, quant, meta


def _f32(path: Path, t: TensorInfo) -> np.ndarray:
    return np.fromfile(path, dtype="<f4", count=int(np.prod(t.shape, dtype=np.int64)), offset=t.offset)


def _bf16(path: Path, t: TensorInfo) -> mx.array:
    bits = np.fromfile(path, dtype="<u2", count=int(np.prod(t.shape, dtype=np.int64)), offset=t.offset)
    return mx.array(bits.reshape(t.shape)).view(mx.bfloat16)


def _unpermute(w: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's q/k row order (each head's two rotary halves interleaved) so the rows are the
    checkpoint's again; rows of a quantized weight, its scales and its biases move alike."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_shapes(cfg, fam, tensors: list[TensorInfo], hf_names: dict, source: str) -> None:
    expected = expected_shapes(cfg)
    have = {hf_names[t.name]: t for t in tensors}
    dims = (f"hidden {cfg.hidden_size}, {cfg.num_heads} heads of {cfg.head_dim}, {cfg.num_kv_heads} kv heads, "
            f"feed-forward {cfg.intermediate_size}, {cfg.num_layers} layers")
    for hf, shape in expected.items():
        t = have.get(hf)
        if t is None:
            module, kind = hf.rsplit(".", 1)
            raise WeightError(f"{source}: tensor {gguf_module(fam, module)}.{kind} is missing; the metadata "
                              f"({dims}) asks for it, the file is incomplete: re-convert it")
        if tuple(t.shape) != tuple(shape):
            raise WeightError(f"{source}: tensor {t.name} has shape {t.shape}, but the metadata ({dims}) gives "
                              f"{tuple(shape)}; the file is inconsistent, re-convert it")
    extra = sorted(set(have) - set(expected) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    if extra:
        raise WeightError(f"{source}: unexpected tensors {', '.join(have[e].name for e in extra[:5])} for "
                          f"{cfg.model_type} ({dims}); the file does not match its metadata, re-convert it")
