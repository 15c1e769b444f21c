"""``slotinfer serve MODEL --ray``: the same routes on Ray Serve, over replicas of the engine.

    slotinfer serve MODEL --ray --replicas 2
    slotinfer serve MODEL --ray --ray-address HOST:6379 --autoscale 1:4

Without ``--ray-address`` a local cluster is started (and stopped at exit); with it, the
application is deployed on that cluster and deleted from it at exit.  See docs/scale-out.md.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import sys
import threading


def add_flags(p):
    from .common import positive_int

    g = p.add_argument_group("scale-out on Ray Serve (the 'ray' extra: pip install -e '.[ray]' in the checkout)")
    g.add_argument("--ray", action="store_true", help="serve through Ray Serve replicas, routed by prompt prefix")
    g.add_argument("--ray-address", metavar="ADDR", help="a running cluster's address (default: start a local one)")
    g.add_argument("--replicas", type=positive_int, default=None, help="engines, one per replica (default 1)")
    g.add_argument("--autoscale", metavar="MIN:MAX", default=None,
                   help="replicas between MIN and MAX, added while each has more requests than --slots")
    g.add_argument("--routing", choices=["prefix", "pow2", "round_robin"], default="prefix",
                   help="prefix: prompts that start alike go to the replica caching that start; pow2: Ray Serve's "
                        "default (the shorter queue of two); round_robin: each replica in turn")
    g.add_argument("--replica-cpus", type=float, default=1.0, metavar="N", help="CPUs each replica asks Ray for")
    g.add_argument("--replica-gpus", type=float, default=0.0, metavar="N", help="GPUs each replica asks Ray for")
    g.add_argument("--stream-hold-ms", type=float, default=None, metavar="MS",
                   help="a replica holds a streamed choice's tokens MS after the first to send those that come "
                        "meanwhile together: less CPU per token in Ray's processes (default 50; 0: each at once)")
    g.add_argument("--stream-interval", type=positive_int, default=1, metavar="N",
                   help="a replica also holds them until it has N (at most 0.5 s; the first goes at once): "
                        "less CPU per token, burstier streams (default 1)")


def check(parser, args):
    """Usage errors of the --ray flags, before anything starts."""
    given = [f for f in ("ray_address", "replicas", "autoscale", "stream_hold_ms") if getattr(args, f) is not None]
    if not args.ray:
        if given:
            parser.error(f"--{given[0].replace('_', '-')} goes with --ray")
        return
    if args.replicas is not None and args.autoscale is not None:
        parser.error("give --replicas N or --autoscale MIN:MAX, not both")
    if args.autoscale is not None:
        lo, sep, hi = args.autoscale.partition(":")
        if not (sep and lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi)):
            parser.error(f"--autoscale takes MIN:MAX with 1 <= MIN <= MAX (e.g. 1:4), got {args.autoscale!r}")
        args.autoscale = (int(lo), int(hi))
    elif args.replicas is None:
        args.replicas = 1
    if args.stream_hold_ms is not None and not 0 <= args.stream_hold_ms <= 10_000:
        parser.error(f"--stream-hold-ms takes milliseconds from 0 to 10000, got {args.stream_hold_ms:g}")


def run(args) -> int:
    try:
        import ray
        from ray import serve

        import slotinfer.ray as sr
    except ImportError as e:
        print(f"slotinfer serve --ray needs the 'ray' extra ({e}); in the slotinfer checkout: pip install -e '.[ray]'",
              file=sys.stderr)
        return 2
    from ..serve.app import default_name
    from ..serve.ray_app import hub_path

    name = args.served_model_name or default_name(hub_path(args.model))
    engine = {"prefill_tokens": args.prefill_tokens, "kv_dtype": args.kv_dtype, "kv_cache_bytes": args.kv_cache_bytes,
              "prefix_cache_bytes": 0 if args.no_prefix_cache else args.prefix_cache_bytes,
              "speculative": args.speculative, "draft_tokens": args.draft_tokens}
    app = sr.serve_app({name: args.model}, replicas=args.replicas, autoscale=args.autoscale, routing=args.routing,
                       slots=args.slots, max_queue=args.max_queue, max_len=args.max_len, engine=engine,
                       num_cpus=args.replica_cpus, num_gpus=args.replica_gpus, stream_interval=args.stream_interval,
                       api_key=args.api_key, **({} if args.stream_hold_ms is None else {"stream_hold_ms": args.stream_hold_ms}),
                       max_body_bytes=args.max_body_bytes, read_timeout=args.read_timeout)
    if args.ray_address and not _reachable(args.ray_address):  # ray.init would wait minutes on it
        print(f"slotinfer: error: no Ray cluster answers at {args.ray_address!r}; start one there with "
              f"'ray start --head' (or leave out --ray-address to start a local one)", file=sys.stderr)
        return 2
    try:
        # a local cluster declares room for every replica: Ray's CPU count only schedules, the threads share the cores
        most = args.replicas or args.autoscale[1]
        local = {} if args.ray_address else {"num_cpus": max(os.cpu_count() or 1, math.ceil(most * args.replica_cpus + 1))}
        ray.init(address=args.ray_address, **local, include_dashboard=False, log_to_driver=args.log_level == "debug",
                 configure_logging=False)
    except (ConnectionError, ValueError, RuntimeError) as e:
        from .common import ray_connect_error

        print(f"slotinfer: error: {ray_connect_error(args.ray_address, e)}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run_many([serve.RunTarget(app, name="slotinfer", route_prefix="/")], wait_for_applications_running=False)
        failed = _wait_running(serve, "slotinfer", stop)
        if failed:  # a replica's constructor failed: the model or an engine option is bad
            print(f"slotinfer: error: the application could not start: {failed}", file=sys.stderr)
            return 2
        if stop.is_set():  # stopped while it started (it could not be placed, say)
            return 0
        how = f"{args.replicas} replicas" if args.replicas else "{}..{} replicas (autoscaled)".format(*args.autoscale)
        print(f"slotinfer serve: {name} running on http://{args.host}:{args.port} on Ray Serve ({how} of "
              f"{args.slots} slots, routing: {args.routing}, API key "
              f"{'required' if args.api_key else 'not required'})", file=sys.stderr, flush=True)
        stop.wait()
    finally:
        if args.ray_address:
            serve.delete("slotinfer")
        else:
            serve.shutdown()
        ray.shutdown()
    return 0


def _wait_running(serve, name: str, stop: threading.Event) -> str | None:
    """Wait until the application runs (None), fails to start (the reason), or ``stop`` is set (None).
    Meanwhile, say why a deployment waits, each new reason once: a replica that no node has room for
    (Serve's message names the resources it asked for) waits until one has, or Ctrl-C."""
    said = set()
    while not stop.wait(0.5):
        app = serve.status().applications.get(name)
        if app is None:
            continue
        if app.status == "RUNNING":
            return None
        if app.status == "DEPLOY_FAILED":  # the failed deployment's message ends with its replica's exception
            reasons = [str(d.message).strip().splitlines()[-1] for d in app.deployments.values()
                       if d.status in ("UNHEALTHY", "DEPLOY_FAILED") and str(d.message or "").strip()]
            return "; ".join(reasons) or str(app.message).strip() or "unknown reason"
        for deployment in app.deployments.values():
            message = str(deployment.message or "").strip()
            if message and message not in said:
                said.add(message)
                print(f"slotinfer serve: waiting: {message} (Ctrl-C stops)", file=sys.stderr, flush=True)
    return None


def _reachable(address: str, timeout: float = 3.0) -> bool:
    """Whether something listens at ``address`` (HOST:PORT, or ray://HOST:PORT); "auto" is Ray's to find."""
    if address in ("auto", "local"):
        return True
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return True  # not HOST:PORT: Ray says what is wrong with it
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError:
        return False
    return True
