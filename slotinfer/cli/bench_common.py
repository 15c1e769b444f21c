"""What ``slotinfer bench`` and ``slotinfer bench --serve`` share: the benchmark model's cache,
the random Qwen3-0.6B shape, and the alternating run order that keeps drift out of ratios."""

from __future__ import annotations

from pathlib import Path

from .. import settings

QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=151936)
CACHE = settings.cache_dir()


def bench_model_path() -> Path:
    path = CACHE / "bench" / "qwen3-0.6b-shape"
    if not (path / "config.json").exists():
        from ..testing import make_tiny_model
        print(f"building a random Qwen3-0.6B-shaped checkpoint (bf16, as published) in {path} ...", flush=True)
        make_tiny_model("qwen3", path, overrides=QWEN3_06B, dtype="bfloat16")
    return path


def alternating_order(rounds: int) -> list[str]:
    """The modes' run order: continuous, static, then static, continuous, and so on.  Over an
    even number of rounds both modes sit at the same mean position, so a machine that speeds
    up or slows down steadily during the runs moves both means alike (a mode run last alone
    read 1.37x and 1.71x on the same 512 requests, one order then the other)."""
    pair = ("continuous", "static")
    return [m for r in range(rounds) for m in (pair if r % 2 == 0 else pair[::-1])]
