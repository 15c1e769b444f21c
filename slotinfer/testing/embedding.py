"""A tiny decoder embedding model in Qwen3-Embedding's published layout.

Qwen3-Embedding's folders hold a Qwen 3 decoder without its head (``Qwen3Model``'s tensor names:
``embed_tokens.weight``, ``layers.N.*``, ``norm.weight``, no ``model.`` prefix), a ``tokenizer.json``
whose post-processor appends ``<|endoftext|>`` to every text, and sentence-transformers' files:
``modules.json`` (Transformer, Pooling, Normalize), ``1_Pooling/config.json`` with last-token
pooling, and ``config_sentence_transformers.json``.

    >>> from slotinfer.testing.embedding import make_tiny_embedding_model
    >>> folder = make_tiny_embedding_model(tmp / "emb")           # pooling="lasttoken"
    >>> slotinfer.load(folder).embed(["a cat sat"]).shape         # (1, 64)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from . import make_tiny_model

__all__ = ["make_tiny_embedding_model"]

_EOT = "<|endoftext|>"


def make_tiny_embedding_model(path: str | os.PathLike, *, pooling: str = "lasttoken", seed: int = 0,
                              overrides=None) -> Path:
    """Write a random Qwen 3 embedding model (``pooling``: "lasttoken" or "mean") to ``path``; return it."""
    if pooling not in ("lasttoken", "mean"):
        raise ValueError(f"pooling must be 'lasttoken' or 'mean', got {pooling!r}")
    import mlx.core as mx

    folder = make_tiny_model("qwen3", path, seed=seed, overrides=overrides)
    weights = mx.load(str(folder / "model.safetensors"))
    bare = {name[len("model."):]: w for name, w in weights.items() if name.startswith("model.")}
    mx.save_safetensors(str(folder / "model.safetensors"), bare, metadata={"format": "pt"})

    tok_path = folder / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    eot = next(t["id"] for t in tok["added_tokens"] if t["content"] == _EOT)
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": _EOT, "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": _EOT, "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}, {"SpecialToken": {"id": _EOT, "type_id": 1}}],
        "special_tokens": {_EOT: {"id": _EOT, "ids": [eot], "tokens": [_EOT]}},
    }
    tok_path.write_text(json.dumps(tok, ensure_ascii=False))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["padding_side"] = "left"  # as published: last-token pooling reads the last column
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))

    hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ], indent=2))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": pooling == "lasttoken", "include_prompt": True}, indent=2))
    (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": {"query": "Instruct: Given a query, retrieve passages that answer it\nQuery:", "document": ""},
        "default_prompt_name": None, "similarity_fn_name": "cosine"}, indent=2))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    return folder
