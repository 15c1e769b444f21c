"""The schedules' cost models of benchmarks/schedules.py (used by bench_mixed_bound.py)."""

import os
import sys

from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
from schedules import diluted_ratio, schedule_spans, schedule_steps  # noqa: E402

gens_st = st.lists(st.integers(1, 600), min_size=1, max_size=80)
reqs_st = st.lists(st.tuples(st.integers(1, 600), st.integers(1, 300)), min_size=1, max_size=60)


@given(gens_st, st.integers(1, 32))
def test_schedule_bounds(gens, slots):
    got = schedule_steps(gens, slots)
    # neither schedule beats the work spread evenly over the slots, nor the longest item
    floor = max(max(gens), -(-sum(gens) // slots))
    assert floor <= got["continuous"] <= got["static"] <= sum(gens)
    # static: batch after batch, each as long as its longest output
    assert got["static"] == sum(max(gens[i:i + slots]) for i in range(0, len(gens), slots))


@given(gens_st)
def test_one_slot_is_sequential(gens):
    assert schedule_steps(gens, 1) == {"static": sum(gens), "continuous": sum(gens)}


@given(gens_st, st.integers(1, 32))
def test_continuous_matches_step_by_step_admission(gens, slots):
    """An independent replay: step by step, each free slot takes the next item in order."""
    queue, live, steps = list(gens), [], 0
    while queue or live:
        while queue and len(live) < slots:
            live.append(queue.pop(0))
        live = [g - 1 for g in live if g > 1]
        steps += 1
    assert schedule_steps(gens, slots)["continuous"] == steps


@given(st.floats(1.0, 3.0), st.floats(0.1, 1000.0), st.floats(0.0, 1000.0))
def test_diluted_ratio_is_the_ratio_of_wall_times(decode_ratio, decode_s, prefill_s):
    """Static decodes ``decode_ratio`` times as long as continuous; both prefill the same prompts."""
    continuous, static = decode_s + prefill_s, decode_ratio * decode_s + prefill_s
    got = diluted_ratio(decode_ratio, prefill_s / continuous)
    assert abs(got - static / continuous) <= 1e-9 * static / continuous
    assert 1.0 - 1e-12 <= got <= decode_ratio + 1e-12


@given(reqs_st, st.integers(1, 32))
def test_schedule_spans_replay_the_schedules(reqs, slots):
    spans = schedule_spans(reqs, slots)
    steps = schedule_steps([g for _, g in reqs], slots)
    assert {m: len(s) for m, s in spans.items()} == steps
    # a span covers the new token of a live row, never more than the longest request
    top = max(p + g for p, g in reqs)
    assert all(min(p + 1 for p, _ in reqs) <= s <= top for sp in spans.values() for s in sp)


@given(reqs_st)
def test_one_slot_spans_walk_each_request(reqs):
    want = [p + k for p, g in reqs for k in range(1, g + 1)]
    assert schedule_spans(reqs, 1) == {"continuous": want, "static": want}


@given(reqs_st)
def test_one_batch_spans_are_the_longest_live_row(reqs):
    """All requests fit at once: both schedules are one batch, and step k's span is the longest
    prompt + k + 1 among the requests that still need a token."""
    want = [max(p + k + 1 for p, g in reqs if g > k) for k in range(max(g for _, g in reqs))]
    assert schedule_spans(reqs, len(reqs)) == {"continuous": want, "static": want}
