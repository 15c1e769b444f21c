"""The ``slotinfer`` command line: info, demo, generate, classify, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys


def positive_int(text: str) -> int:
    """argparse ``type`` of a count: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def stdout_closed() -> int:
    """stdout's reader went away (``| head``): stop writing and exit 1 without a traceback.

    stdout is pointed at devnull so that the interpreter's final flush does not fail again.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="slotinfer", description="Continuous-batching LLM inference on MLX.")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("info", help="mlx version, device, BLAS in use, compute dtype")

    p = sub.add_parser("demo", help="generate and classify on a small built-in model (built once, cached)")
    p.add_argument("--model", help="use this model folder instead of the built-in one")

    p = gen = sub.add_parser("generate", help="generate for prompts (arguments, or one per stdin line)")
    p.add_argument("--model", required=True, help="a Hugging Face-layout model folder")
    p.add_argument("prompts", nargs="*", help="prompts; read from stdin, one per line, when none")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--slots", type=positive_int, default=32)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    from .ray_cli import add_flags
    add_flags(p, generate=True)

    try:
        from . import classify_cli
        classify_cli.add_parser(sub)
    except ImportError:
        classify_cli = None

    p = sub.add_parser("bench", help="decode throughput of the slot engine (tokens/s at several slot counts)")
    from .bench import add_arguments
    add_arguments(p)

    args = parser.parse_args(argv)
    if args.command == "generate":
        _check_generate(gen, args)
    try:
        return _dispatch(args, classify_cli)
    except BrokenPipeError:
        return stdout_closed()
    except Exception as e:  # a typed, readable error instead of a traceback
        from .errors import SlotinferError
        if isinstance(e, SlotinferError):
            print(f"slotinfer: error: {e}", file=sys.stderr)
            return 2
        raise


def _check_generate(parser, args):
    """The run-wide values, checked before the model loads: a usage error (exit 2), not one error per prompt."""
    from .errors import InvalidRequestError
    from .model import check_max_tokens
    from .sampling import SamplingParams

    checks = [("--max-tokens", lambda: check_max_tokens(args.max_tokens)),
              ("--temperature", lambda: SamplingParams(temperature=args.temperature)),
              ("--top-p", lambda: SamplingParams(top_p=args.top_p)),
              ("--top-k", lambda: SamplingParams(top_k=args.top_k)),
              ("--seed", lambda: SamplingParams(seed=args.seed))]
    for flag, check in checks:
        try:
            check()
        except InvalidRequestError as e:
            parser.error(f"argument {flag}: {e}")


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
    if args.command == "generate" and args.ray:
        from . import ray_cli
        return ray_cli.run("generate", args)
    if args.command == "generate":
        model = slotinfer.load(args.model)
        prompts = args.prompts or [line.rstrip("\r\n") for line in sys.stdin if line.strip()]
        if args.chat:
            prompts = [model.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        results = model.batch_generate(prompts, max_tokens=args.max_tokens, temperature=args.temperature,
                                       top_p=args.top_p, top_k=args.top_k, seed=args.seed, slots=args.slots)
        for prompt, r in zip(prompts, results):
            rec = {"prompt": prompt, "text": r.text, "finish_reason": r.finish_reason}
            if r.error is not None:
                rec["error"] = str(r.error)
            print(json.dumps(rec, ensure_ascii=False))
        sys.stdout.flush()  # a closed pipe fails here, inside main, rather than at exit
        return 0
    if args.command == "classify":
        return classify_cli.run(args)
    if args.command == "bench":
        from .bench import run
        return run(args)
    raise AssertionError(args.command)
