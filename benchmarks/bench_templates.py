"""What the template sandbox's limits cost a real chat template's render: bounded against plain.

Each bundled family template (and SmolLM2's GGUF template where the model is installed) renders a
100-turn chat of 200-word messages through slotinfer's bounded sandbox (``compile_template`` +
``render``: the size and time checks) and through Jinja's own sandbox with no limits, interleaved;
it prints each template's time ratio, best of ``--rounds`` rounds of ``--renders`` renders.

    python benchmarks/bench_templates.py
    python benchmarks/bench_templates.py --rounds 15 --turns 200
"""

from __future__ import annotations

import argparse
import time

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from slotinfer import default_model
from slotinfer.templates import _raise_from_template, compile_template, render
from slotinfer.testing.tokenizers import _template
from slotinfer.tokenizer import _jinja_env


def real_templates() -> dict[str, str]:
    found = {name: _template(name) for name in ("llama3", "qwen2", "qwen3", "gemma")}
    gguf = default_model.path()
    if gguf is not None:
        import mlx.core as mx

        found["smollm2-gguf"] = mx.load(str(gguf), return_metadata=True)[1]["tokenizer.chat_template"]
    return found


def best_times(fns, rounds: int, renders: int) -> list[float]:
    """Best-of-rounds seconds per batch of renders, the functions interleaved in every round."""
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(renders):
                fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--renders", type=int, default=5)
    ap.add_argument("--turns", type=int, default=100)
    args = ap.parse_args()

    msgs = [{"role": ("user", "assistant")[i % 2], "content": "word " * 200} for i in range(args.turns)]
    ctx = {"messages": msgs, "add_generation_prompt": True, "bos_token": "<s>"}
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = _raise_from_template

    print(f"{'template':<14} {'bounded ms':>11} {'plain ms':>9} {'ratio':>6}")
    for name, src in real_templates().items():
        plain, bounded = env.from_string(src), compile_template(_jinja_env(), src)
        tb, tp = best_times([lambda: render(bounded, ctx), lambda: plain.render(**ctx)], args.rounds, args.renders)
        print(f"{name:<14} {1e3 * tb / args.renders:>11.2f} {1e3 * tp / args.renders:>9.2f} {tb / tp:>5.2f}x")


if __name__ == "__main__":
    main()
