"""The ``slotinfer`` command line: info, demo, generate, classify, bench."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="slotinfer", description="Continuous-batching LLM inference on MLX.")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("info", help="mlx version, device, BLAS in use, compute dtype")

    p = sub.add_parser("demo", help="generate and classify on a small built-in model (built once, cached)")
    p.add_argument("--model", help="use this model folder instead of the built-in one")

    p = sub.add_parser("generate", help="generate for prompts (arguments, or one per stdin line)")
    p.add_argument("--model", required=True, help="a Hugging Face-layout model folder")
    p.add_argument("prompts", nargs="*", help="prompts; read from stdin, one per line, when none")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")

    try:
        from . import classify_cli
        classify_cli.add_parser(sub)
    except ImportError:
        classify_cli = None

    p = sub.add_parser("bench", help="decode throughput of the slot engine (tokens/s at several slot counts)")
    from .bench import add_arguments
    add_arguments(p)

    args = parser.parse_args(argv)
    try:
        return _dispatch(args, classify_cli)
    except Exception as e:  # a typed, readable error instead of a traceback
        from .errors import SlotinferError
        if isinstance(e, SlotinferError):
            print(f"slotinfer: error: {e}", file=sys.stderr)
            return 2
        raise


def _dispatch(args, classify_cli) -> int:
    import slotinfer

    if args.command == "info":
        from . import device
        for key, value in device.describe().items():
            print(f"{key:>16}: {value}")
        return 0
    if args.command == "demo":
        from .demo import run
        return run(args.model)
    if args.command == "generate":
        model = slotinfer.load(args.model)
        prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
        if args.chat:
            prompts = [model.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        results = model.batch_generate(prompts, max_tokens=args.max_tokens, temperature=args.temperature,
                                       top_p=args.top_p, top_k=args.top_k, seed=args.seed, slots=args.slots)
        for prompt, r in zip(prompts, results):
            rec = {"prompt": prompt, "text": r.text, "finish_reason": r.finish_reason}
            if r.error is not None:
                rec["error"] = str(r.error)
            print(json.dumps(rec, ensure_ascii=False))
        return 0
    if args.command == "classify":
        return classify_cli.run(args)
    if args.command == "bench":
        from .bench import run
        return run(args)
    raise AssertionError(args.command)
