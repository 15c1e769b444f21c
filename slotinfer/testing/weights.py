"""The tiny models' weights: drawn tensor by tensor from a seeded generator and written as
safetensors (dense or MLX-quantized, in one file or shards) through reused buffers."""

from __future__ import annotations

import functools
import json
import math
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..models.config import ModelConfig, expected_shapes

# Initial scales (see _draw; values are uniform with these standard deviations):
# linear weights std gain / sqrt(fan_in) with gain LINEAR_GAIN, QK_GAIN (q/k) or OUT_GAIN
# (o_proj, down_proj); embeddings std EMBED_STD (Gemma: EMBED_STD / sqrt(hidden), as
# Gemma multiplies them by sqrt(hidden)); norm weights mean 1 (q/k norms QK_NORM_SCALE)
# with std NORM_STD -- Gemma stores w for a scale of 1 + w, so its means are 0 (q/k
# norms QK_NORM_SCALE - 1); biases std BIAS_STD.  Greedy decoding of these random
# models wanders over many tokens instead of repeating one.
LINEAR_GAIN = 1.0
QK_GAIN = 2.0  # q_proj and k_proj: peaky attention, so outputs depend on the context
QK_NORM_SCALE = 2.0  # effective scale of q_norm/k_norm (same reason)
OUT_GAIN = 4.0  # o_proj and down_proj: layers must outweigh the (tied) embedding
EMBED_STD = 0.3
NORM_STD = 0.1
BIAS_STD = 0.1


class _Tensor:
    """One tensor to write: HF name, shape, and how to draw it."""

    __slots__ = ("name", "shape", "kind", "fan_in", "gain", "seed_name")

    def __init__(self, name, shape, kind, *, fan_in=None, gain=LINEAR_GAIN, seed_name=None):
        self.name = name
        self.shape = tuple(int(s) for s in shape)
        self.kind = kind  # embed | linear | bias | norm | gemma_norm | vision
        self.fan_in = fan_in if fan_in is not None else self.shape[-1]
        self.gain = gain
        self.seed_name = seed_name or name


def _tensor_plan(model: ModelConfig, cfg: dict) -> list[_Tensor]:
    """The tensors of a checkpoint of ``cfg`` (parsed as ``model``): the loader's own list of what the
    config asks for, drawn by the kind and gain their names give; a wrapper's decoder tensors sit under
    ``language_model.``, after them its vision tensors (their values are never read)."""
    wrapped = "text_config" in cfg
    prefix = "language_model." if wrapped else ""
    norm = "gemma_norm" if model.norm_offset else "norm"
    plan = []
    for name, shape in expected_shapes(model).items():
        kind, gain = _kind(name, norm)
        plan.append(_Tensor(prefix + name, shape, kind, gain=gain, seed_name=name))
    if wrapped:
        vc = cfg["vision_config"]
        vh, ps = int(vc["hidden_size"]), int(vc["patch_size"])
        plan.append(_Tensor("vision_tower.vision_model.embeddings.patch_embedding.weight",
                            (vh, 3, ps, ps), "vision", fan_in=3 * ps * ps))
        plan.append(_Tensor("multi_modal_projector.mm_input_projection_weight",
                            (vh, model.hidden_size), "vision", fan_in=vh))
    return plan


def _kind(name: str, norm: str) -> tuple[str, float]:
    """How a tensor is drawn, by its name: (kind, gain)."""
    if name == "model.embed_tokens.weight":
        return "embed", LINEAR_GAIN
    if name.endswith(".bias"):
        return "bias", LINEAR_GAIN
    if name.endswith("norm.weight"):
        return norm, QK_NORM_SCALE if name.endswith(("q_norm.weight", "k_norm.weight")) else LINEAR_GAIN
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return "linear", QK_GAIN
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return "linear", OUT_GAIN
    return "linear", LINEAR_GAIN


class _Scratch:
    """Reused flat buffers: fresh multi-hundred-MB arrays cost more in page faults
    than drawing the numbers, so every tensor is drawn into the same memory."""

    def __init__(self):
        self._bufs: dict[str, np.ndarray] = {}

    def get(self, key: str, shape, dtype) -> np.ndarray:
        n = int(np.prod(shape, dtype=np.int64))
        buf = self._bufs.get(key)
        if buf is None or buf.dtype != dtype or buf.size < n:
            buf = np.empty(max(n, 1), dtype=dtype)
            self._bufs[key] = buf
        return buf[:n].reshape(shape)


def _draw(t: _Tensor, seed: int, gemma_embed: bool, scratch: _Scratch | None = None) -> np.ndarray:
    """The float32 values of one tensor (deterministic in seed and name).

    Uniform draws (five times faster than normal ones) scaled to the wanted std."""
    rng = np.random.default_rng((int(seed), zlib.crc32(t.seed_name.encode("utf-8"))))
    x = (scratch or _Scratch()).get("f32", t.shape, np.float32)
    rng.random(dtype=np.float32, out=x)
    if t.kind == "embed":
        # Gemma multiplies embeddings by sqrt(hidden_size): store them that much smaller.
        std, mean = (EMBED_STD / math.sqrt(t.shape[1]) if gemma_embed else EMBED_STD), 0.0
    elif t.kind in ("linear", "vision"):
        std, mean = t.gain / math.sqrt(t.fan_in), 0.0
    elif t.kind == "bias":
        std, mean = BIAS_STD, 0.0
    elif t.kind == "norm":
        std, mean = NORM_STD, t.gain
    elif t.kind == "gemma_norm":
        std, mean = NORM_STD, t.gain - 1.0
    else:
        raise AssertionError(t.kind)
    half_width = std * math.sqrt(3.0)  # U(-a, a) has std a / sqrt(3)
    x *= np.float32(2.0 * half_width)
    x += np.float32(mean - half_width)
    return x


def _to_bf16_bits(x: np.ndarray, scratch: _Scratch | None = None) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even."""
    scratch = scratch or _Scratch()
    u = x.view(np.uint32)
    b = scratch.get("u32", x.shape, np.uint32)
    np.right_shift(u, np.uint32(16), out=b)
    b &= np.uint32(1)
    b += np.uint32(0x7FFF)
    b += u
    b >>= np.uint32(16)
    out = scratch.get("u16", x.shape, np.uint16)
    np.copyto(out, b, casting="unsafe")
    return out


def _mx_to_numpy(a, tag: str) -> np.ndarray:
    import mlx.core as mx

    if tag == "BF16":
        return np.array(a.view(mx.uint16))
    return np.array(a)


class _Group:
    """Tensors that are produced together (a quantized weight and its scales/biases).

    ``produce(scratch)`` runs numpy only (on a helper thread); ``finish(arrays)``, when
    set, runs on the calling thread (MLX work: MLX streams belong to their thread)."""

    def __init__(self, entries: list[tuple[str, str, tuple[int, ...]]], produce: Callable[["_Scratch"], dict],
                 finish: Callable[[dict], dict] | None = None):
        self.entries = entries
        self.produce = produce
        self.finish = finish

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(tag, shape) for _, tag, shape in self.entries)


_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4}


def _nbytes(tag: str, shape) -> int:
    return _ITEMSIZE[tag] * int(np.prod(shape, dtype=np.int64))


def _groups(plan: list[_Tensor], seed: int, tag: str, gemma: bool,
            quant: dict | None) -> tuple[list[_Group], dict]:
    """Write groups, and the quantization entries for config.json."""
    groups: list[_Group] = []
    per_layer: dict[str, dict] = {}

    def store(x: np.ndarray, scratch: _Scratch) -> np.ndarray:
        if tag == "F32":
            return x
        if tag == "F16":
            out = scratch.get("f16", x.shape, np.float16)
            np.copyto(out, x, casting="same_kind")
            return out
        return _to_bf16_bits(x, scratch)

    for t in plan:
        quantized = False
        if quant is not None and t.kind in ("embed", "linear"):
            module = t.name[: -len(".weight")]
            q = quant["overrides"].get(module, {})
            bits = int(q.get("bits", quant["bits"]))
            gsize = int(q.get("group_size", quant["group_size"]))
            if t.shape[-1] % gsize == 0 and (t.shape[-1] * bits) % 32 == 0:
                quantized = True
                if module in quant["overrides"]:
                    per_layer[module] = {"group_size": gsize, "bits": bits}
        if not quantized:
            groups.append(_Group([(t.name, tag, t.shape)],
                                 functools.partial(lambda t, scratch: {t.name: store(_draw(t, seed, gemma, scratch), scratch)}, t)))
            continue
        out, inp = t.shape
        base = t.name[: -len(".weight")]
        entries = [
            (base + ".weight", "U32", (out, inp * bits // 32)),
            (base + ".scales", tag, (out, inp // gsize)),
            (base + ".biases", tag, (out, inp // gsize)),
        ]

        def produce(scratch, t=t):
            return {"w": _draw(t, seed, gemma, scratch)}

        def finish(arrays, bits=bits, gsize=gsize, base=base):
            import mlx.core as mx

            w = mx.array(arrays["w"])
            if tag != "F32":
                w = w.astype(mx.float16 if tag == "F16" else mx.bfloat16)
            wq, scales, biases = mx.quantize(w, group_size=gsize, bits=bits)
            mx.eval(wq, scales, biases)
            return {base + ".weight": np.array(wq),
                    base + ".scales": _mx_to_numpy(scales, tag),
                    base + ".biases": _mx_to_numpy(biases, tag)}

        groups.append(_Group(entries, produce, finish))
    if quant is not None:
        modules = {t.name[: -len(".weight")] for t in plan if t.kind in ("embed", "linear")}
        unknown = set(quant["overrides"]) - modules
        if unknown:
            raise ValueError(f"quantize overrides name no quantizable module: {sorted(unknown)} "
                             f"(module paths look like {sorted(modules)[0]!r})")
    return groups, per_layer


def _write_safetensors(path: Path, groups: list[_Group]) -> int:
    """Write one safetensors file, one group at a time; returns the data size."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for g in groups:
        for name, tag, shape in g.entries:
            n = _nbytes(tag, shape)
            header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    # Draw the next group on a helper thread while this one is written (numpy and file
    # writes release the GIL); two scratch sets alternate between them.
    scratches = (_Scratch(), _Scratch())
    with open(path, "wb") as f, ThreadPoolExecutor(max_workers=1) as pool:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        pending = pool.submit(groups[0].produce, scratches[0]) if groups else None
        for k, g in enumerate(groups):
            arrays = pending.result()
            if g.finish is not None:
                arrays = g.finish(arrays)
            if k + 1 < len(groups):
                pending = pool.submit(groups[k + 1].produce, scratches[(k + 1) % 2])
            for name, tag, shape in g.entries:
                a = np.ascontiguousarray(arrays[name])
                if a.nbytes != _nbytes(tag, shape):
                    raise AssertionError(f"{name}: produced {a.shape} {a.dtype}, planned {shape} {tag}")
                f.write(memoryview(a).cast("B"))
            del arrays
    return offset


def _split_shards(groups: list[_Group], shards: int) -> list[list[_Group]]:
    total = sum(g.nbytes for g in groups)
    target = total / shards
    out: list[list[_Group]] = [[]]
    acc = 0
    for i, g in enumerate(groups):
        left_groups = len(groups) - i
        left_shards = shards - len(out)
        if out[-1] and left_shards > 0 and (acc >= target * len(out) or left_groups <= left_shards):
            out.append([])
        out[-1].append(g)
        acc += g.nbytes
    return out


