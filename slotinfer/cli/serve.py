"""``slotinfer serve MODEL``: load, start the Inferencer, serve until SIGINT/SIGTERM, exit 0."""

from __future__ import annotations

import signal
import socket
import sys


DEFAULT_MAX_LEN = 2048


_MODEL_HELP = "a model folder, a GGUF file, or a hub id (org/name, org/name:file.gguf)"
_ABOUT = """An OpenAI-compatible HTTP server over one slot engine (docs/serve.md).

Sampling: a request that leaves out temperature is sampled at 1.0, as OpenAI's API does; send
temperature 0 for greedy output. (slotinfer generate is greedy unless given --temperature.)"""


def add_parser(sub):
    from .. import settings
    from .common import DefaultsShown, add_speculative_flags, byte_size, positive_int

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the 'serve' extra)", description=_ABOUT,
                       formatter_class=DefaultsShown)
    p.add_argument("model", nargs="?", help=_MODEL_HELP + "; or give it as --model")
    p.add_argument("--model", dest="model_flag", metavar="MODEL", help="the same as MODEL: " + _MODEL_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to bind; 127.0.0.1 answers this machine only")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0 picks a free one, printed at start)")
    p.add_argument("--slots", type=positive_int, default=32, help="sequences decoded together")
    p.add_argument("--max-len", type=positive_int, default=None,
                   help="tokens one request may hold, prompt and output (default 2048, or the model's context if "
                        "shorter; at most the model's context)")
    p.add_argument("--prefill-tokens", type=positive_int, default=512, metavar="N",
                   help="padded prompt tokens one prefill chunk (or classify unit) holds; smaller chunks keep "
                        "running streams flowing beside long prompts and classifications")
    p.add_argument("--kv-cache-bytes", type=byte_size, default=None, metavar="SIZE",
                   help="the K/V pool every slot draws its blocks from, e.g. 2GiB (default: what slots x max-len "
                        "tokens take, at most a quarter of the memory); a request waits until its prompt and "
                        "max_tokens fit")
    p.add_argument("--prefix-cache-bytes", type=byte_size, default=None, metavar="SIZE",
                   help="the most K/V the prefix cache keeps in the pool while no request holds it, e.g. 1GiB "
                        "(default: an eighth of the memory, at most 4 GiB; docs/prefix-cache.md)")
    p.add_argument("--no-prefix-cache", action="store_true", help="keep no K/V across requests")
    p.add_argument("--kv-dtype", choices=["float32", "float16", "bfloat16", "q8_0"], default=None,
                   help="the dtype K/V are kept in (default: the model's compute dtype); float16 halves their memory, "
                        "q8_0 (8-bit blocks) takes 0.27x float32's")
    add_speculative_flags(p)
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a slot; past it a request gets 429 (0: unbounded)")
    p.add_argument("--api-key", default=settings.api_key(),
                   help="require 'Authorization: Bearer KEY' (default: $SLOTINFER_API_KEY; none: open)")
    p.add_argument("--served-model-name", help="the model's name in the API (default: the folder's name, the GGUF file's name "
                        "without .gguf and its quantization suffix, or the hub id)")
    p.add_argument("--max-body-bytes", type=positive_int, default=8 << 20,
                   help="larger request bodies get 413 (default: 8388608, 8 MiB)")
    p.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a request's body may take to arrive; a slower one gets 408")
    p.add_argument("--grace-period", type=float, default=10.0,
                   help="seconds in-flight requests may take to finish on SIGINT/SIGTERM before they are cancelled")
    from . import ray_serve

    ray_serve.add_flags(p)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log")
    return p


def check(parser, args):
    """MODEL, given as the argument or as --model (once): a usage error otherwise."""
    given = {m for m in (args.model, args.model_flag) if m is not None}
    if not given:
        parser.error("a model is required: slotinfer serve MODEL (or --model MODEL)")
    if len(given) > 1:
        parser.error(f"the model is given twice, as {args.model!r} and as --model {args.model_flag!r}; give it once")
    args.model = given.pop()
    from . import ray_serve

    ray_serve.check(parser, args)


def run(args) -> int:
    if args.ray:
        from . import ray_serve

        return ray_serve.run(args)
    try:
        import uvicorn

        from ..serve.app import build_app
        from ..serve.backend import warm_up
        from ..serve.shutdown import GracefulServer
    except ImportError as e:
        print(f"slotinfer serve needs the 'serve' extra ({e.name} is missing); in the slotinfer checkout: "
              f"pip install -e '.[serve]'", file=sys.stderr)
        return 2
    if args.max_queue < 0:
        print("slotinfer: error: --max-queue must be >= 0", file=sys.stderr)
        return 2
    if args.kv_cache_bytes == 0:
        print("slotinfer: error: --kv-cache-bytes must be above 0 (leave it out for the default)", file=sys.stderr)
        return 2
    import slotinfer

    model = slotinfer.load(args.model)
    if args.max_len is None:
        args.max_len = min(DEFAULT_MAX_LEN, model.context_length)
    if args.max_len > model.context_length:
        print(f"slotinfer: error: --max-len {args.max_len} is beyond the model's context of {model.context_length} "
              f"tokens; give at most {model.context_length}", file=sys.stderr)
        return 2
    inf = slotinfer.Inferencer(model, slots=args.slots, max_len=args.max_len, max_queue=args.max_queue,
                               prefill_tokens=args.prefill_tokens,
                               prefix_cache_bytes=0 if args.no_prefix_cache else args.prefix_cache_bytes,
                               kv_dtype=args.kv_dtype, kv_cache_bytes=args.kv_cache_bytes,
                               speculative=args.speculative, draft_tokens=args.draft_tokens)
    try:
        took = warm_up(inf)
        print(f"slotinfer serve: prefill and decode steps compiled in {took:.1f} s", file=sys.stderr, flush=True)
        app = build_app(inf, served_model_name=args.served_model_name, api_key=args.api_key,
                        max_body_bytes=args.max_body_bytes, read_timeout=args.read_timeout)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="off")
        # past the grace period every request still running is ended (cancelled rows: a stream's error
        # event and [DONE], a whole request's 503) before uvicorn would cancel its handler
        server = GracefulServer(config, grace=args.grace_period, end_requests=app.state.slotinfer.end_requests)
        try:
            sock = _bind(args.host, args.port)  # bound here so that port 0's pick can be announced at any log level
        except OSError as e:
            print(f"slotinfer: error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
            return 2
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"slotinfer serve: {app.state.slotinfer.name} running on http://{host}:{sock.getsockname()[1]} "
              f"({args.slots} slots of up to {args.max_len} tokens, K/V pool "
              f"{inf.engine.memory()['kv_cache_bytes'] / 2**30:.2f} GiB, max queue {args.max_queue or 'unbounded'}, "
              f"API key {'required' if args.api_key else 'not required'})", file=sys.stderr, flush=True)
        # uvicorn re-raises the signal that stopped it once it has shut down; a handler that
        # ignores it lets a requested shutdown end as a success (exit 0) instead of a kill.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        server.run(sockets=[sock])
    finally:
        inf.close(drain=False, timeout=args.grace_period)  # whatever is left ends as cancelled
    return 0


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # connections wait in the backlog until uvicorn accepts: none refused after the announcement
    sock.set_inheritable(True)
    return sock
