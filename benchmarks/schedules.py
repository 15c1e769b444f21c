"""Cost models of the mixed workload's two schedules (``slotinfer bench --mixed``).

Lab tools for ``bench_mixed_bound.py``, kept out of the shipped package: the step counts
each schedule needs, each step's attention span, and how a prefill both modes share
dilutes their ratio.  ``tests/engine/test_schedules.py`` checks them against independent replays.
"""

from __future__ import annotations

import heapq


def diluted_ratio(decode_ratio: float, prefill_share: float) -> float:
    """Throughput ratio of two modes whose decode times differ by ``decode_ratio`` (static /
    continuous) and which share the same prefill, ``prefill_share`` of the continuous mode's
    wall time ``p``: ``r (1 - p) + p``.  On a CPU, where a prompt token costs ~40% of a
    16-row decode token, this is what keeps a mixed workload's ratio under the schedule's."""
    return decode_ratio * (1.0 - prefill_share) + prefill_share


def schedule_steps(gens: list[int], slots: int) -> dict:
    """Decode steps each schedule needs when a step costs the same whatever it holds:
    static batches take their longest output's steps; continuous admission (FIFO into the
    first free slot, no gap) ends when the last slot does."""
    static = sum(max(gens[i:i + slots]) for i in range(0, len(gens), slots))
    free = [0] * slots
    for g in gens:
        heapq.heapreplace(free, free[0] + g)
    return {"static": static, "continuous": max(free)}


def schedule_spans(reqs: list[tuple[int, int]], slots: int) -> dict[str, list[int]]:
    """Replay both schedules of :func:`schedule_steps` step by step and give each decode step's
    attention span: the longest live row's length (prompt, tokens decoded so far and the new
    one), which sets what the Decoder's step computes for every slot.

    ``reqs`` are (prompt tokens, output tokens) pairs; an item holds its slot for as many
    steps as it has output tokens.  A step's cost in the engine is close to a constant plus
    a term in this span (idle rows compute too), so these lists turn step times measured at
    a few spans into each schedule's decode time: ``benchmarks/bench_mixed_bound.py``.
    """
    out = {}
    for mode in ("continuous", "static"):
        queue, live, spans = list(reqs), [], []  # live: [prompt, remaining, decoded]
        while queue or live:
            if mode == "continuous" or not live:
                while queue and len(live) < slots:
                    p, g = queue.pop(0)
                    live.append([p, g, 0])
            spans.append(max(p + d + 1 for p, _, d in live))
            live = [[p, g - 1, d + 1] for p, g, d in live if g > 1]
        out[mode] = spans
    return out
