"""``load("model.gguf")``: llama.cpp's single-file format -> :class:`~slotinfer.model.Model`.

The header is scanned here first (tensor types, shapes, the file's extent, the metadata)
so that a file slotinfer cannot represent is refused with a typed error before any tensor
data is read.  Then the weights are read one of two ways:

- a file holding only F32, F16, BF16, Q8_0, Q4_0 and Q4_1 goes through ``mx.load``, MLX's own
  reader (faster than the alternative, docs/gguf.md): F32/F16 stay dense, BF16 is read here
  bit for bit, and the quantized types arrive as MLX affine triples
  (``weight``/``scales``/``biases``, groups of 32) that follow the same device policy as
  MLX-quantized safetensors;
- any other file (K-quants, I-quants, Q5_0/Q5_1, and the mixed files llama.cpp writes) is read
  tensor by tensor: each quantized tensor is dequantized by the ``gguf`` package's numpy
  reference (``gguf.quants.dequantize``, the llama.cpp project's own), then kept dense in the
  compute dtype or requantized to MLX's affine layout, as :mod:`slotinfer.device` decides.
  One tensor at a time: the load never holds more than the weights plus one tensor in float32.

The config comes from :mod:`slotinfer.models.gguf_config`, the tokenizer from
:mod:`slotinfer.text.gguf_tokenizer`.
"""

from __future__ import annotations

import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import device, settings
from .._files import open_regular
from ..errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError, WeightError
from ..models import expected_shapes, parse_config
from ..models.gguf_config import architecture, config_dict, gguf_module, module_name

# GGML tensor types (ids) slotinfer reads.  MLX's reader: F32, F16, Q4_0, Q4_1, Q8_0 (and BF16, read here)
_F32, _F16, _BF16 = 0, 1, 30
_MLX_TYPES = (_F32, _F16, _BF16, 8, 2, 3)
_QUANT_BITS = {2: 4, 3: 4, 8: 8}  # Q4_0, Q4_1, Q8_0 as MLX affine triples
# kept as stored for the CPU's own kernels: Q4_0, Q4_1, Q8_0, Q5_0, Q4_K, Q6_K
_BLOCK_FORMATS = {2: "q4_0", 3: "q4_1", 8: "q8_0", 6: "q5_0", 12: "q4_k", 14: "q6_k"}
_BLOCK_HALVES = {3: (0, 2), 12: (0, 2), 14: (208,)}  # a block's float16 fields (its d, and m or dmin); others: (0,)
# dequantized by gguf.quants: Q5_0, Q5_1, the K-quants Q2_K..Q6_K, the I-quants (IQ1_S ... IQ4_XS)
_GGUF_TYPES = (6, 7, 10, 11, 12, 13, 14, 16, 17, 18, 19, 20, 21, 22, 23, 29)
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6
_SHORT_ARRAY = 4096  # numeric arrays up to this length are read as lists (one entry per layer)
_MAGIC = b"GGUF"
_DEQUANTIZE_VALUES = 2**20  # values dequantized in one call (4 MiB of float32 output)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: int
    shape: tuple  # row-major, as numpy and MLX index it (GGUF lists dims innermost first)
    offset: int  # absolute offset of the data in the file

    @property
    def type_name(self) -> str:
        return _type_name(self.type)

    @property
    def block(self) -> tuple[int, int]:
        """(values per block, bytes per block) of the tensor's type."""
        return _ggml().GGML_QUANT_SIZES[_ggml().GGMLQuantizationType(self.type)]


def _ggml():
    import gguf  # the llama.cpp project's own reader of its block formats, imported on first use

    return gguf


def _type_name(kind: int) -> str:
    try:
        return _ggml().GGMLQuantizationType(kind).name
    except ValueError:
        return f"type {kind}"


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
    """The tensor table of a GGUF file, checked (magic, version, supported types, whole blocks per row,
    data inside the file), and its metadata: what the config is checked with before any tensor data is
    read, and what the tokenizer is built from."""
    with open_regular(path, error=WeightError) as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise WeightError(f"{path.name} is truncated ({size} bytes); re-download it")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            tensors, meta = _scan(buf, size, path.name)
    for t in tensors:
        _check_type(t, path)
        per_block, block_bytes = t.block
        row = t.shape[-1] if t.shape else 1
        if row % per_block:
            raise WeightError(f"{path.name}: tensor {t.name} is {t.type_name} with rows of {row} values, which is "
                              f"not a whole number of {t.type_name}'s {per_block}-value blocks; the file is damaged, "
                              "re-download it")
        end = t.offset + int(np.prod(t.shape, dtype=np.int64)) // per_block * block_bytes
        if end > size:
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
    if t.type not in _MLX_TYPES + _GGUF_TYPES:
        raise WeightError(
            f"{path.name}: tensor {t.name} is {t.type_name}, which slotinfer cannot read; supported GGUF types: "
            f"{', '.join(_type_name(k) for k in _MLX_TYPES + _GGUF_TYPES)}. Get the model as one of these "
            "(Q4_K_M, Q6_K and Q8_0 files are the common ones), re-quantize it with llama.cpp "
            "(llama-quantize --allow-requantize model.gguf out.gguf Q8_0), or load its safetensors release "
            "instead (docs/gguf.md)")


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
            if item in _SCALAR:  # token types and scores: 10^5 entries, read as one numpy array
                n = count * struct.calcsize(_SCALAR[item])
                if self.pos + n > len(self.buf):
                    raise WeightError(f"{self.name} is truncated inside its header; re-download it")
                values = np.frombuffer(self.buf[self.pos:self.pos + n], dtype=_SCALAR[item])
                self.pos += n
                return values
            if item == _STRING:  # the vocabulary and the merges
                return [self.string() for _ in range(count)]
            for _ in range(count):  # arrays of arrays: nothing slotinfer reads
                self.value(item)
            return None
        raise WeightError(f"{self.name}: metadata value of unknown type {kind}; the file is damaged or from a "
                          "newer GGUF version, re-convert it")


def header(path: Path):
    """(ModelConfig, family, tensor table, {GGUF name: checkpoint name}, metadata) of a GGUF file, from its
    header alone (no tensor data but Llama 3.1's small rope factors), the config checked against the table."""
    tensors, meta = scan(path)
    source = path.name
    name, fam = architecture(meta, source)
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
    cfg_raw = config_dict(meta, name, fam, vocab_rows=by_module["token_embd"].shape[0],
                          tied="output" not in by_module, source=source,
                          rope_factors=None if rope is None else _f32(path, rope))
    try:
        cfg = parse_config(cfg_raw)
    except ModelLoadError as e:
        raise type(e)(f"{source}: its metadata gives a config slotinfer cannot run: {e}") from None
    _check_shapes(cfg, fam, tensors, hf_names, source)
    return cfg, fam, tensors, hf_names, meta


def read(path: Path, *, keep_quantized: bool = False, dtype=mx.float32, blocks: bool = False):
    """(ModelConfig, {checkpoint name: array}, {module: quantization}, metadata, checked) of a GGUF file;
    ``checked``: every tensor was found free of NaN and Inf here (``SLOTINFER_CHECK_FINITE``).

    The config is built from the scanned header and checked against the tensor table before any
    tensor data is read.  Tensors that gguf's reference dequantizes become ``dtype`` arrays, or MLX
    affine triples in :func:`slotinfer.device.requantized_layout` where ``keep_quantized``.
    ``blocks``: Q8_0/Q4_0/Q4_1/Q5_0/Q4_K/Q6_K matrices stay the file's bytes (``uint8``, quantization
    ``{"format": "q4_k"}``), for the CPU's own kernels (:mod:`slotinfer.cpu.qlayers`), and the
    other quantized types' matrices are requantized to Q8_0 (:mod:`slotinfer.cpu.repack`)."""
    cfg, fam, tensors, hf_names, meta = header(path)

    def place(module: str, kind: str, w: mx.array) -> mx.array:
        if fam.permuted_qk and module.endswith(("q_proj", "k_proj")):
            heads = cfg.num_heads if module.endswith("q_proj") else cfg.num_kv_heads
            w = _unpermute(w, heads)
        if fam.norm_offset and module.endswith("norm") and kind == "weight":
            w = w.astype(mx.float32) - fam.norm_offset  # the loader adds the family's offset back
        return w

    out, quant = {}, {}
    if not blocks and all(t.type in _MLX_TYPES for t in tensors):
        parts = _mlx_parts(path, tensors, quant, hf_names)
        for t in tensors:
            module = hf_names[t.name].rsplit(".", 1)[0]
            for kind, w in parts(t).items():
                out[f"{module}.{kind}"] = place(module, kind, w)
        return cfg, out, quant, meta, False
    for t in tensors:  # one tensor at a time, each evaluated before the next is read
        module = hf_names[t.name].rsplit(".", 1)[0]
        for kind, w in _tensor(path, t, keep_quantized, dtype, quant, module, blocks).items():
            w = place(module, kind, w)
            mx.eval(w)
            out[f"{module}.{kind}"] = w
    return cfg, out, quant, meta, settings.check_finite()


def _mlx_parts(path: Path, tensors: list[TensorInfo], quant: dict, hf_names: dict):
    """MLX's own reader, for files of the types it reads: measured faster than gguf's numpy
    reference (docs/gguf.md), and its Q4_0/Q4_1/Q8_0 triples need no requantizing on a GPU."""
    try:
        weights = mx.load(str(path))
    except (RuntimeError, ValueError) as e:
        raise WeightError(f"cannot read {path.name}: {e}; the file is damaged, re-download it") from None

    def parts(t: TensorInfo) -> dict:
        base, kind = t.name.rsplit(".", 1)
        if t.type in _QUANT_BITS:
            quant[hf_names[t.name].rsplit(".", 1)[0]] = {"group_size": 32, "bits": _QUANT_BITS[t.type]}
            return {k: weights[f"{base}.{k}"] for k in ("weight", "scales", "biases")}
        if t.type == _BF16:  # MLX reads BF16 as float16, which loses small and large values: read the bits
            return {kind: _bf16(path, t)}
        return {kind: weights[t.name]}

    return parts


def _tensor(path: Path, t: TensorInfo, keep_quantized: bool, dtype, quant: dict, module: str,
            blocks: bool = False) -> dict:
    """One tensor of the file: {kind: array}, the parts of a quantized one included."""
    kind = t.name.rsplit(".", 1)[1]
    count = int(np.prod(t.shape, dtype=np.int64))
    if blocks and t.type in _BLOCK_FORMATS and kind == "weight" and len(t.shape) == 2:
        raw = _raw_blocks(path, t)
        _check_finite(path, t, _block_scales(raw, t.block[1], _BLOCK_HALVES.get(t.type, (0,))))
        quant[module] = {"format": _BLOCK_FORMATS[t.type]}
        return {kind: mx.array(raw)}
    if t.type == _BF16:
        w = _bf16(path, t)
        _check_finite(path, t, np.array(w.astype(mx.float32)))
        return {kind: w}
    if t.type in (_F32, _F16):
        stored = np.fromfile(path, dtype="<f4" if t.type == _F32 else "<f2", count=count, offset=t.offset)
        _check_finite(path, t, stored)
        return {kind: mx.array(stored.reshape(t.shape))}
    if blocks and kind == "weight" and len(t.shape) == 2 and t.shape[1] % 32 == 0:
        return {kind: _repacked(path, t, quant, module)}
    w = _dequantize(path, t)
    _check_finite(path, t, w)
    if not (keep_quantized and kind == "weight" and len(t.shape) == 2):
        return {kind: mx.array(w, dtype=dtype)}
    per_block, block_bytes = t.block
    layout = device.requantized_layout(8 * block_bytes / per_block)
    quant[module] = layout
    # half precision in, as MLX's own triples are: the scales and biases come out float16
    q, scales, biases = mx.quantize(mx.array(w, dtype=mx.float16), **layout)
    return {"weight": q, "scales": scales, "biases": biases}


def _repacked(path: Path, t: TensorInfo, quant: dict, module: str) -> mx.array:
    """A matrix of a type the CPU's kernels do not read (Q5_1, Q2_K, Q3_K, Q5_K, the I-quants) requantized
    to Q8_0 from gguf's reading (:mod:`slotinfer.cpu.repack`)."""
    from ..cpu import repack

    w = _dequantize(path, t)
    _check_finite(path, t, w)
    quant[module] = {"format": "q8_0"}
    return mx.array(repack.to_q8_0(w))


def _raw_blocks(path: Path, t: TensorInfo) -> np.ndarray:
    """The file's bytes of a 2-D quantized tensor, ``uint8 [rows, k / values per block * block bytes]``."""
    per_block, block_bytes = t.block
    rows, k = t.shape
    return np.fromfile(path, dtype=np.uint8, count=rows * (k // per_block) * block_bytes,
                       offset=t.offset).reshape(rows, -1)


def _block_scales(raw: np.ndarray, block_bytes: int, at: tuple) -> np.ndarray:
    """The float16 fields at byte offsets ``at`` of each raw block (its scale, and a minimum where it has
    one): finite there, finite weights."""
    blk = raw.reshape(-1, block_bytes)
    return np.concatenate([blk[:, i:i + 2] for i in at], axis=1).copy().view("<f2")


def _check_finite(path: Path, t: TensorInfo, w: np.ndarray) -> None:
    """NaN or Inf refused by the GGUF tensor's name and type (numpy's check is several times MLX's CPU speed)."""
    if settings.check_finite() and not np.isfinite(w).all():
        how = "" if t.type in (_F32, _F16, _BF16) else " once dequantized (its blocks' scales are damaged)"
        raise WeightError(f"{path.name}: tensor {t.name} ({t.type_name}) holds NaN or Inf values{how}; re-download "
                          "the file. SLOTINFER_CHECK_FINITE=0 skips this check")


def _dequantize(path: Path, t: TensorInfo) -> np.ndarray:
    """gguf's float32 reading of a quantized tensor, slices of rows at a time on
    :func:`slotinfer.device.load_threads` threads: its numpy dequantizers hold several temporaries
    the size of their output, which for a whole embedding would be gigabytes."""
    gguf = _ggml()
    kind = gguf.GGMLQuantizationType(t.type)
    per_block, block_bytes = t.block
    row = t.shape[-1] // per_block * block_bytes
    rows = int(np.prod(t.shape[:-1], dtype=np.int64))
    out = np.empty((rows, t.shape[-1]), dtype=np.float32)
    step = max(1, _DEQUANTIZE_VALUES // t.shape[-1])

    def rows_from(start: int) -> None:
        n = min(step, rows - start)
        # blocks are independent: n rows go as one long row, one call (gguf loops in Python per 16 rows)
        raw = np.fromfile(path, dtype=np.uint8, count=n * row, offset=t.offset + start * row).reshape(1, n * row)
        out[start:start + n] = gguf.quants.dequantize(raw, kind).reshape(n, t.shape[-1])

    starts = range(0, rows, step)
    threads = min(len(starts), device.load_threads())
    if threads == 1:
        for start in starts:
            rows_from(start)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(rows_from, starts))
    return out.reshape(t.shape)


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
