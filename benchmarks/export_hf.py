"""Write a GGUF Llama-family model as a Hugging Face-layout folder of float32 safetensors.

Peers that read only that layout (mlx-lm) can then run the very weights slotinfer runs from the
GGUF: quantized tensors are dequantized exactly as slotinfer's CPU policy does, Q/K rows are in the
Hugging Face order, and the tokenizer is the one slotinfer builds from the GGUF metadata.

    python benchmarks/export_hf.py                       # the default model -> ~/.cache/slotinfer/bench/smollm2-hf
    python benchmarks/export_hf.py model.gguf out_dir
"""

import argparse
import json
from pathlib import Path

import slotinfer  # first: installs the BLAS before mlx.core loads
import mlx.core as mx
from slotinfer import default_model
from slotinfer.loading import gguf
from slotinfer.cli.bench import CACHE
from slotinfer.text.tokenizer import Tokenizer


def export(src: Path, out: Path) -> Path:
    cfg, weights, quant, meta, _ = gguf.read(src)
    if cfg.model_type != "llama":
        raise SystemExit(f"{src.name}: only Llama-family files are exported (this one is {cfg.model_type})")
    if cfg.rope.type != "default":
        raise SystemExit(f"{src.name}: {cfg.rope.type} rope scaling is not exported")
    dense = {}
    for name, w in weights.items():
        module, kind = name.rsplit(".", 1)
        if kind in ("scales", "biases"):
            continue
        if module in quant:
            q = quant[module]
            w = mx.dequantize(w, weights[f"{module}.scales"], weights[f"{module}.biases"],
                              group_size=q["group_size"], bits=q["bits"])
        dense[name] = w.astype(mx.float32)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dense, metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope.theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tok = Tokenizer.from_gguf(meta, src.name)
    tok._tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token, "eos_token": tok.eos_token,
        "unk_token": tok.unk_token, "pad_token": tok.pad_token, "chat_template": tok.chat_template}, indent=1))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", nargs="?", help="the GGUF file (default: SmolLM2-135M-Instruct's)")
    ap.add_argument("out", nargs="?", help="the folder to write (default: ~/.cache/slotinfer/bench/smollm2-hf)")
    args = ap.parse_args()
    src = Path(args.gguf) if args.gguf else default_model.path()
    if src is None:
        raise SystemExit(f"no GGUF given and the default model is not installed: {default_model.INSTALL}")
    print(export(src, Path(args.out) if args.out else CACHE / "bench" / "smollm2-hf"))


if __name__ == "__main__":
    main()
