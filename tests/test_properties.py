"""The invariants of DESIGN.md as properties, on tiny models of every family.

1. Token-exact: greedy output of every item equals ``Model.generate`` of it alone,
   whatever the arrival schedule, slot count, chunking and neighbours.
2. Seeded sampling draws the same tokens in any batch.
3. Conservation: every item ends exactly once under cancellations and failures;
   slots never leak; the engine keeps serving.
4. Memory: under a K/V budget of a few blocks requests wait for blocks, each still served as
   alone, and every block goes back to the pool.
"""

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from slotinfer.engine.engine import Engine
from slotinfer.errors import PromptTooLongError
from slotinfer.kv import KV_BLOCK_SIZE, block_bytes
from slotinfer.testing import FAMILIES

MAX_LEN = 64


@st.composite
def requests(draw, sampled=False):
    n = draw(st.integers(1, 6))
    out = []
    for _ in range(n):
        # Up to 40 prompt tokens: longer than Gemma's 16-token window, and chunked when the budget is small.
        ids = draw(st.lists(st.integers(3, 500), min_size=1, max_size=40))
        params = dict(max_tokens=draw(st.integers(1, 12)), ignore_eos=draw(st.booleans()))
        if draw(st.booleans()):
            params["stop_token_ids"] = draw(st.lists(st.integers(3, 500), max_size=3))
        if sampled:
            params.update(
                temperature=draw(st.sampled_from([0.0, 0.7, 1.3])),
                top_k=draw(st.sampled_from([0, 1, 5])),
                top_p=draw(st.sampled_from([1.0, 0.9, 0.5])),
                min_p=draw(st.sampled_from([0.0, 0.05])),
                repetition_penalty=draw(st.sampled_from([1.0, 1.3])),
                seed=draw(st.integers(0, 2**32 - 1)),
            )
        out.append((draw(st.integers(0, 8)), ids, params))  # (arrival step, prompt, params)
    return out


# Speculation on: the n-gram drafter with its gate opening at the first right shadow draft, at any row count.
SPECULATIVE = dict(speculative="ngram", draft_tokens=4, position_cost=0.01, bandwidth_rows=64)


def run_schedule(model, reqs, slots, prefill_tokens, *, on_step=None, spec=False):
    """Feed requests to an engine at their arrival steps; return it and their handles in request order."""
    engine = Engine(model, slots=slots, max_len=MAX_LEN, prefill_tokens=prefill_tokens,
                    **(SPECULATIVE if spec else {}))
    return engine, feed(engine, reqs, on_step=on_step)


def feed(engine, reqs, *, on_step=None):
    """Run ``reqs`` (arrival step, prompt, params) on ``engine`` until all end; their handles in order."""
    handles, step = [None] * len(reqs), 0
    while engine.busy or any(h is None for h in handles):
        for i, (arrival, ids, params) in enumerate(reqs):
            if arrival == step:
                item = engine.make_item(ids, **params)
                engine.add(item)
                handles[i] = item.handle
        if on_step:
            on_step(step, handles)
        engine.step()
        step += 1
    return handles


def slot_counts():
    return st.one_of(st.integers(1, 8), st.just(64))


@pytest.mark.parametrize("family", FAMILIES)
@given(reqs=requests(), slots=slot_counts(), prefill=st.sampled_from([4, 16, 512]), spec=st.booleans())
def test_greedy_output_is_token_exact(models, family, reqs, slots, prefill, spec):
    m = models[family]
    engine, handles = run_schedule(m, reqs, slots, prefill, spec=spec)
    for (_, ids, params), h in zip(reqs, handles):
        got, want = h.result(0), m.generate(ids, **params)
        assert got.tokens == want.tokens
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
    assert engine.items.free == list(range(slots))


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3"])
@given(reqs=requests(sampled=True), slots=slot_counts(), prefill=st.sampled_from([4, 512]), spec=st.booleans())
def test_seeded_sampling_is_batch_independent(models, family, reqs, slots, prefill, spec):
    m = models[family]
    _, handles = run_schedule(m, reqs, slots, prefill, spec=spec)
    for (_, ids, params), h in zip(reqs, handles):
        assert h.result(0).tokens == m.generate(ids, **params).tokens


@given(
    reqs=requests(),
    slots=st.integers(1, 4),
    cancels=st.dictionaries(st.integers(0, 5), st.integers(0, 12), max_size=4),
    raisers=st.sets(st.integers(0, 5), max_size=2),
)
def test_every_item_ends_exactly_once(models, reqs, slots, cancels, raisers):
    m = models["qwen2"]
    ends = {}

    def boom(ev):
        raise RuntimeError("consumer bug")

    reqs = [(a, ids, {**p, "on_token": boom} if i in raisers else p) for i, (a, ids, p) in enumerate(reqs)]

    def on_step(step, handles):
        for i, at in cancels.items():
            if at == step and i < len(handles) and handles[i] is not None:
                handles[i].cancel()

    engine, handles = run_schedule(m, reqs, slots, 8, on_step=on_step)
    for i, h in enumerate(handles):
        assert h.done()
        events = list(h)  # the stream ends exactly once
        if h._future.exception() is not None:
            assert i in raisers and "on_token" in str(h._future.exception())
            ends[i] = "error"
            continue
        c = h.result(0)
        ends[i] = c.finish_reason
        assert [e.token for e in events] == c.tokens[: len(events)]
        if c.finish_reason == "cancelled":
            assert i in cancels
        else:  # raising consumers fail at their first token; only a cancel beats them to it
            assert i not in raisers
            assert c.tokens == m.generate(reqs[i][1], **reqs[i][2]).tokens
    assert engine.items.finished == len(reqs) == len(ends)
    assert engine.items.free == list(range(slots)) and not any(engine.items.by_slot)
    # ...and the engine keeps serving afterwards
    item = engine.make_item([5, 6, 7], max_tokens=4)
    engine.add(item)
    engine.run_until_done()
    assert item.handle.result(0).tokens == m.generate([5, 6, 7], max_tokens=4).tokens


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@given(data=st.data(), slots=st.integers(1, 4), blocks=st.integers(1, 4), prefill=st.sampled_from([64, 512]),
       spec=st.booleans())
def test_a_tiny_kv_budget_makes_requests_wait_and_serves_each_as_alone(models, family, data, slots, blocks, prefill,
                                                                      spec):
    """A K/V pool of a few blocks holds fewer requests than the slots: the others wait in the FIFO
    for blocks, and running ones that cross into a block none is free for preempt the newest, which
    resumes later by recompute.  One that cannot fit even alone is refused at submit, naming
    max_tokens; every other ends exactly once (cancelled, or with its solo tokens, greedy or seeded),
    its stream carries each token once, a slot holds the blocks of its tokens and at most those of
    its prompt and max_tokens, and every block is back in the pool at the end."""
    m = models[family]
    cfg = m.config
    each = block_bytes(num_layers=cfg.num_layers, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                       dtype=mx.float32, block_size=KV_BLOCK_SIZE)
    engine = Engine(m, slots=slots, max_len=600, prefill_tokens=prefill, kv_cache_bytes=(blocks + 2) * each,
                    prefix_cache_bytes=0, **(SPECULATIVE if spec else {}))
    reqs = data.draw(st.lists(st.tuples(st.integers(0, 6), st.lists(st.integers(3, 500), min_size=1, max_size=300),
                                        st.integers(1, 48), st.sampled_from([{}, dict(temperature=0.9, seed=3)])),
                              min_size=1, max_size=6))
    cancels = data.draw(st.dictionaries(st.integers(0, 5), st.integers(0, 12), max_size=2))
    handles, refused, step = {}, set(), 0
    pool = engine.table.pool
    while engine.busy or len(handles) + len(refused) < len(reqs):
        for i, (arrival, ids, n, sampling) in enumerate(reqs):
            if arrival == step:
                need = -(-(len(ids) + n - 1) // KV_BLOCK_SIZE)
                if need > blocks:
                    with pytest.raises(PromptTooLongError, match="kv_cache_bytes") as e:
                        engine.make_item(ids, max_tokens=n, ignore_eos=True)
                    room = blocks * KV_BLOCK_SIZE  # the prompt alone fits when one token more does
                    err = e.value
                    assert (err.prompt_tokens, err.max_tokens, err.limit, err.setting) == (len(ids), n, room,
                                                                                          "kv_cache_bytes")
                    assert (err.param, err.most) == (("max_tokens", room + 1 - len(ids)) if len(ids) <= room else
                                                     ("prompt", None))
                    assert "at most 0" not in str(err) and "at most -" not in str(err)
                    refused.add(i)
                    continue
                item = engine.make_item(ids, max_tokens=n, ignore_eos=True, **sampling)
                engine.add(item)
                handles[i] = item.handle
        for i, at in cancels.items():
            if at == step and i in handles:
                handles[i].cancel()
        engine.step()
        held = [it for it in engine.items.by_slot if it is not None]
        for it in held:
            assert -(-int(engine.table.lengths[it.slot]) // KV_BLOCK_SIZE) <= pool.held[it.slot]
            assert pool.held[it.slot] <= -(-it.reserved // KV_BLOCK_SIZE)
        assert pool.num_used == sum(pool.held[it.slot] for it in held) <= blocks
        step += 1
    assert engine.items.finished == len(handles)
    for i, h in handles.items():
        c = h.result(0)
        streamed = [e.token for e in h]
        assert streamed == c.tokens[: len(streamed)]  # each token once, in order, and the stream ended once
        if c.finish_reason != "cancelled":
            assert c.tokens == m.generate(reqs[i][1], max_tokens=reqs[i][2], ignore_eos=True, **reqs[i][3]).tokens
    assert pool.num_free == blocks and pool.num_used == 0 and not pool.tables.any()
    assert engine.items.free == list(range(slots))
